"""attention family: sparse_attn over the sliding rows (ring + this step's chunk) and compressed entries, with sinks."""
import math

import pytest
import torch

from dsv4rt.ops.attention import sparse_attn, sparse_attn_ref
from dsv4rt.ops.kv_quant import kv_fp8_dequantize
from dsv4rt.ops.swa import PAD_SLOT
from factories import (ATTN_MODES, CASE_NAMES, ROPE_DIM, WINDOW, assert_trace_matches_reference, ref_result,
                       sparse_attn_inputs, to_device)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
FORMATS = [False, True]  # ring and entries as values / as FP8 rows

# CUDA vs CPU reference, max |diff| <= TOL * max |reference output| (issue 2's table: 2e-3 relative to the
# output scale). bf16 outputs add one bf16 ulp at that scale (2^-8): both sides round their fp32 result.
ATTN_TOL = {torch.float32: 2e-3, torch.bfloat16: 2e-3 + 2**-8}


def _load(rows, width):
    return kv_fp8_dequantize(rows, width, ROPE_DIM, torch.float32) if rows.dtype == torch.uint8 else rows.float()


def attention_loop(q, kv, swa_cache, entry_cache, entry_idx, sinks, req_slot, positions, start_pos, block_table,
                   ratio, rope_dim, scale):
    """Per query and head: keys = sliding rows (chunk rows from kv, older ones from the ring) + entries;
    P_i = exp(l_i) / (sum_j exp(l_j) + exp(sink)), o = sum_i P_i key_i. Padded queries give 0."""
    n_tok, n_heads, width = q.shape
    ring = _load(swa_cache, width)
    entries = None if entry_cache is None else _load(entry_cache, width)
    token_of = {(int(r), int(p)): t for t, (r, p) in enumerate(zip(req_slot, positions)) if int(r) != PAD_SLOT}
    out = torch.zeros(n_tok, n_heads, width)
    for t in range(n_tok):
        r, p, s = int(req_slot[t]), int(positions[t]), int(start_pos[t])
        if r == PAD_SLOT:
            continue
        keys = [kv[token_of[(r, x)]].float() if x >= s else ring[r, x % WINDOW] for x in range(max(0, p - WINDOW + 1),
                                                                                           p + 1)]
        if entries is not None:
            n_vis = (p + 1) // ratio
            js = range(n_vis) if entry_idx is None else [j for j in entry_idx[t].tolist() if j >= 0]
            per_block = entries.shape[1]
            keys += [entries[int(block_table[r, j // per_block]), j % per_block] for j in js]
        for h in range(n_heads):
            logits = [float(q[t, h].float() @ k) * scale for k in keys]
            sink = float(sinks[h])
            m = max(max(logits), sink)
            den = sum(math.exp(x - m) for x in logits) + math.exp(sink - m)
            out[t, h] = sum(math.exp(x - m) / den * k for x, k in zip(logits, keys))
    return out.to(q.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode,fp8", [("sliding", False), ("hca", True), ("csa", False), ("csa", True)])
def test_opcheck(device, mode, fp8):
    torch.library.opcheck(torch.ops.dsv4rt.sparse_attn.default, sparse_attn_inputs(device, "mixed", mode, fp8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode,fp8", [("sliding", False), ("hca", False), ("csa", True)])
def test_trace(device, mode, fp8):
    assert_trace_matches_reference(sparse_attn, sparse_attn_ref, sparse_attn_inputs(device, "prefill", mode, fp8))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("mode", ATTN_MODES)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_cuda_matches_reference(case, mode, fp8, dtype):
    args = sparse_attn_inputs("cuda", case, mode, fp8, dtype)
    expected = ref_result(sparse_attn_ref, *to_device(args, "cpu"))
    got = sparse_attn(*args)
    assert got.dtype == dtype and got.shape == expected.shape
    atol = ATTN_TOL[dtype] * expected.float().abs().max().item()
    torch.testing.assert_close(got.cpu().float(), expected.float(), rtol=0, atol=atol)


@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("mode", ATTN_MODES)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_matches_loop(case, mode, fp8):
    args = sparse_attn_inputs("cpu", case, mode, fp8, torch.float32)
    torch.testing.assert_close(sparse_attn(*args), attention_loop(*args), rtol=1e-5, atol=1e-5)


def test_matches_loop_bf16():
    args = sparse_attn_inputs("cpu", "mixed", "csa", False, torch.bfloat16)
    torch.testing.assert_close(sparse_attn(*args).float(), attention_loop(*args).float(), rtol=2**-7, atol=2**-7)


def _args(case, mode, **kw):
    return list(sparse_attn_inputs("cpu", case, mode, dtype=torch.float32, **kw))


def test_sinks_only_enlarge_the_denominator():
    args = _args("mixed", "hca")
    args[5] = torch.full_like(args[5], -1e4)  # exp(sink - max) underflows to 0: a plain softmax
    plain = sparse_attn(*args)
    torch.testing.assert_close(plain, attention_loop(*args), rtol=1e-5, atol=1e-5)
    args[5] = torch.full_like(args[5], 2.0)
    with_sink = sparse_attn(*args)
    # same direction per head, scaled by sum(e) / (sum(e) + e^sink) < 1: the sink has no value vector
    live = args[6] >= 0
    ratio = (with_sink[live] * plain[live]).sum(-1) / plain[live].square().sum(-1)
    assert ((ratio > 0) & (ratio < 1)).all()
    torch.testing.assert_close(with_sink[live], plain[live] * ratio[..., None], rtol=1e-4, atol=1e-5)


def test_ring_row_being_replaced_is_not_read():
    # prefill: slot 3's chunk starts at s = 13. Ring row s mod W holds position s - W, outside every window
    # of the chunk's queries; rows of positions >= s come from kv, older ones from the ring
    args = _args("prefill", "sliding")
    before = sparse_attn(*args)
    s = 13
    args[2][3, s % WINDOW] = 1e4
    torch.testing.assert_close(sparse_attn(*args), before, rtol=0, atol=0)
    args[2][3, (s - 1) % WINDOW] = 1e4  # position s - 1: read by the chunk's queries p <= s - 1 + W - 1
    after = sparse_attn(*args)
    changed = (after - before).abs().amax((1, 2)) > 0
    assert changed.tolist() == ((args[6] == 3) & (args[7] <= s + WINDOW - 2)).tolist()


def test_causal_within_the_chunk():
    args = _args("prefill", "csa")
    before = sparse_attn(*args)
    t = 50  # slot 3's chunk spans tokens 37..58
    args[1][t] += 5.0
    after = sparse_attn(*args)
    changed = ((after - before).abs().amax((1, 2)) > 0).nonzero().flatten().tolist()
    assert changed == [x for x in range(37, 59) if x >= t and x - t < WINDOW]


def test_hca_prefix_reads_only_visible_entries():
    # decode1: the query at p = 47 sees HCA entries 0, 1, 2 ((p+1) // 16 = 3)
    args = _args("decode1", "hca")
    before = sparse_attn(*args)
    entry_cache, block_table, r = args[3], args[9], int(args[6][0])
    per_block = entry_cache.shape[1]
    for j in range(3, block_table.shape[1] * per_block):
        entry_cache[int(block_table[r, j // per_block]), j % per_block] = 1e4
    torch.testing.assert_close(sparse_attn(*args), before, rtol=0, atol=0)
    entry_cache[int(block_table[r, 2 // per_block]), 2 % per_block] = 1e4
    assert not torch.equal(sparse_attn(*args), before)


def test_csa_index_lists():
    args = _args("mixed", "csa")
    before = sparse_attn(*args)
    entry_idx, entry_cache, block_table = args[4], args[3], args[9]
    # the order within a list is irrelevant
    args[4] = entry_idx.flip(-1).contiguous()
    torch.testing.assert_close(sparse_attn(*args), before, rtol=1e-6, atol=1e-6)
    # -1 reads nothing: a query listing -1 entries and not entry 0 ignores entry 0
    t = next(t for t, row in enumerate(entry_idx.tolist()) if -1 in row and 0 not in row and int(args[6][t]) >= 0)
    r = int(args[6][t])
    entry_cache[int(block_table[r, 0]), 0] = 1e4
    torch.testing.assert_close(sparse_attn(*args)[t], before[t], rtol=1e-6, atol=1e-6)
    # an all -1 list leaves the sliding rows only
    args[4] = torch.full_like(entry_idx, -1)
    sliding = list(args)
    sliding[3] = sliding[4] = None
    torch.testing.assert_close(sparse_attn(*args), sparse_attn(*sliding), rtol=1e-6, atol=1e-6)
