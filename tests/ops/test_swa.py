"""swa family: swa_cache_write appends a step's kv rows to each request's ring of W rows."""
import pytest
import torch

from dsv4rt.ops import swa
from dsv4rt.ops.kv_quant import kv_fp8_quantize_ref
from dsv4rt.ops.swa import PAD_SLOT, swa_cache_write, swa_cache_write_ref
from factories import CASE_NAMES, WINDOW, Seg, ref_result, step_meta, swa_cache_write_inputs, to_device

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
FORMATS = [False, True]  # ring of values / ring of FP8 rows


def live(cache):
    """Every slot but the spare one: padded tokens and overwritten rows land in the spare slot in any order."""
    return cache[:-1]


def swa_loop(kv, swa_cache, req_slot, positions, end_pos, rope_dim):
    """Token by token: ring[slot, p mod W] = row for the last W positions of the request's chunk."""
    out = swa_cache.clone()
    window = swa_cache.shape[1]
    for t in range(kv.shape[0]):
        r, p, e = int(req_slot[t]), int(positions[t]), int(end_pos[t])
        if r == PAD_SLOT or p < e - window:
            continue
        row = kv[t : t + 1]
        out[r, p % window] = kv_fp8_quantize_ref(row, rope_dim)[0] if out.dtype == torch.uint8 else row[0]
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", FORMATS)
def test_opcheck(device, fp8):
    torch.library.opcheck(torch.ops.dsv4rt.swa_cache_write.default, swa_cache_write_inputs(device, "mixed", fp8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", FORMATS)
def test_trace(device, fp8):
    args = swa_cache_write_inputs(device, "prefill", fp8)
    expected = ref_result(swa_cache_write_ref, *args)
    torch._dynamo.reset()
    torch.compile(swa_cache_write, fullgraph=True, backend="aot_eager")(*args)
    torch.testing.assert_close(live(args[1]), live(expected), rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_cuda_matches_reference(case, fp8, dtype):
    args = swa_cache_write_inputs("cuda", case, fp8, dtype)
    expected = ref_result(swa_cache_write_ref, *to_device(args, "cpu"))
    swa_cache_write(*args)
    torch.testing.assert_close(live(args[1]).cpu(), live(expected), rtol=0, atol=0)  # data movement: exact


@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_matches_loop(case, fp8):
    args = swa_cache_write_inputs("cpu", case, fp8, torch.float32)
    expected = swa_loop(*args)
    swa_cache_write(*args)
    torch.testing.assert_close(live(args[1]), live(expected), rtol=0, atol=0)


def test_long_chunk_keeps_last_window():
    # prefill: slot 1 writes positions 0..36 (37 > W = 16); its ring must hold exactly positions 21..36
    kv, cache, req_slot, positions, end_pos, rd = swa_cache_write_inputs("cpu", "prefill", dtype=torch.float32)
    before = cache.clone()
    swa_cache_write(kv, cache, req_slot, positions, end_pos, rd)
    tok = {(int(r), int(p)): t for t, (r, p) in enumerate(zip(req_slot, positions))}
    for p in range(37 - WINDOW, 37):
        assert torch.equal(cache[1, p % WINDOW], kv[tok[(1, p)]])
    # slot 0 wrote positions 5, 6 only; every other row of its ring is untouched
    for i in range(WINDOW):
        want = kv[tok[(0, i)]] if i in (5, 6) else before[0, i]
        assert torch.equal(cache[0, i], want)
    # slot 2 has no token in the step
    assert torch.equal(cache[2], before[2])


def test_pad_tokens_write_nothing():
    # a step of PAD tokens only (their positions would address ring rows 0 and 3 of any slot)
    req_slot, positions, _, end_pos = step_meta((), 2)
    positions[1] = 3
    kv = torch.randn(2, 128)
    cache = torch.randn(5, WINDOW, 128)
    before = cache.clone()
    swa_cache_write(kv, cache, req_slot, positions, end_pos, 64)
    assert torch.equal(live(cache), live(before))


def test_ring_wrap_decode():
    # one request decoding positions 14..20 one token per step: the ring wraps at 16
    cache = torch.zeros(5, WINDOW, 128)
    rows = {}
    for p in range(14, 21):
        req_slot, positions, _, end_pos = step_meta((Seg(3, p, 1),), 1)
        kv = torch.randn(2, 128)
        rows[p] = kv[0]
        swa.swa_cache_write(kv, cache, req_slot, positions, end_pos, 64)
    for p, row in rows.items():
        assert torch.equal(cache[3, p % WINDOW], row)
    assert cache[3, 5:14].eq(0).all() and cache[:3].eq(0).all()
