"""compressor family: compressor_update stores a step's rows and emits the entries of the windows it closes."""
import math

import pytest
import torch

from dsv4rt.ops.compressor import compressor_update, compressor_update_ref
from dsv4rt.ops.kv_quant import (QUANT_FP4, QUANT_FP4_SIM, QUANT_FP8, QUANT_FP8_SIM, QUANT_NONE, hadamard,
                                 idx_fp4_dequantize, idx_fp4_fake_quant, idx_fp4_quantize, kv_fp8_dequantize,
                                 kv_fp8_fake_quant, kv_fp8_quantize)
from dsv4rt.ops.swa import PAD_SLOT
from factories import (CASE_NAMES, COMPRESSORS, ROPE_DIM, Seg, compressor_update_inputs, ref_result, step_meta,
                       to_device)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
KINDS = list(COMPRESSORS)  # csa (overlap, m=4), hca (no overlap, m=16), indexer (overlap, m=4)
# (kind, storage format) pairs the model uses: main entries FP8, indexer entries FP4, and their simulations
FORMATS = [("csa", QUANT_FP8), ("hca", QUANT_FP8), ("indexer", QUANT_FP4), ("csa", QUANT_FP8_SIM),
           ("indexer", QUANT_FP4_SIM)]

# Tolerances for entries computed on CUDA vs the CPU reference (state rows are data movement: exact).
# fp32: pooling within 1e-6 relative (issue 2's table; atol relative to the entry scale for cancellations
# in RoPE). bf16: a 1e-6 difference may flip the bf16 rounding of the pooled row before the norm and of the
# result after it: two bf16 ulps (2^-7). Quantised formats are compared after dequantisation within one
# step of the format at the row's scale (a rounding flip): e4m3 2^-3 of the row amax, e2m1 2/3 of it.
ENTRY_RTOL = {torch.float32: 1e-6, torch.bfloat16: 2**-7}
QUANT_STEP = {QUANT_FP8: 2**-3, QUANT_FP8_SIM: 2**-3, QUANT_FP4: 2 / 3, QUANT_FP4_SIM: 2 / 3}


def _unpack(args):
    (kv, score, ape, norm_weight, inv_freq, kv_state, score_state, entry_cache, req_slot, positions, start_pos,
     end_pos, block_table, ratio, overlap, quant, eps, dtype) = args
    return dict(kv=kv, score=score, ape=ape, norm_weight=norm_weight, inv_freq=inv_freq, kv_state=kv_state,
                score_state=score_state, entry_cache=entry_cache, req_slot=req_slot, positions=positions,
                start_pos=start_pos, end_pos=end_pos, block_table=block_table, ratio=ratio, overlap=overlap,
                quant=quant, eps=eps, dtype=dtype)


# ------------------------------------------------------------------------------------------ loop model
def rope_loop(x, pos, inv_freq):
    """Rotate the pairs (c0 + 2i, c0 + 2i + 1) of the tail by pos * f_i (fp32 angle), one pair at a time."""
    x = x.float()
    out = x.clone()
    c0 = x.shape[0] - 2 * inv_freq.shape[0]
    for i in range(inv_freq.shape[0]):
        theta = torch.tensor(float(pos), dtype=torch.float32) * inv_freq[i]
        cos, sin = math.cos(float(theta)), math.sin(float(theta))
        a, b = float(x[c0 + 2 * i]), float(x[c0 + 2 * i + 1])
        out[c0 + 2 * i] = a * cos - b * sin
        out[c0 + 2 * i + 1] = a * sin + b * cos
    return out


def compress_tokens(rows, ratio, overlap, norm_weight, inv_freq, eps, dtype, open_rows=(), prev=None):
    """Spec §6.4 for one request: rows = [(position, kv [c*d], score incl. ape [c*d])] in position order.

    open_rows: (kv, score) of the open window before the first row; prev: (kv [m, c*d], score) of the last
    closed window (overlap only) or None. Returns ({w: entry [d] in dtype}, open_rows, prev) after the rows.
    """
    m, c = ratio, 2 if overlap else 1
    d = rows[0][1].shape[0] // c if rows else 0
    open_rows, entries = list(open_rows), {}
    for p, a, s in rows:
        open_rows.append((a, s))
        if (p + 1) % m:
            continue
        w = (p + 1) // m - 1
        K = torch.stack([a for a, _ in open_rows])
        S = torch.stack([s for _, s in open_rows])
        assert K.shape[0] == m
        if overlap:
            slots_k, slots_s = K[:, d:], S[:, d:]       # B halves of window w
            if prev is not None:                        # A halves of window w - 1
                slots_k = torch.cat((prev[0][:, :d], slots_k))
                slots_s = torch.cat((prev[1][:, :d], slots_s))
            prev = (K, S)
        else:
            slots_k, slots_s = K, S
        pooled = (torch.softmax(slots_s, dim=0) * slots_k).sum(0).to(dtype)  # softmax per channel, over slots
        x = pooled.float()
        normed = (norm_weight * (x / torch.sqrt((x * x).mean() + eps))).to(dtype)
        entries[w] = rope_loop(normed, w * m, inv_freq).to(dtype)
        open_rows = []
    return entries, open_rows, prev


def compressor_loop(kv, score, ape, norm_weight, inv_freq, kv_state, score_state, entry_cache, req_slot, positions,
                    start_pos, end_pos, block_table, ratio, overlap, quant, eps, dtype):
    """Per request: read its state (documented layout), run spec §6.4, return entries and the state after."""
    m, c = ratio, 2 if overlap else 1
    out = {}
    for r in sorted({int(x) for x in req_slot} - {PAD_SLOT}):
        toks = [t for t in range(kv.shape[0]) if int(req_slot[t]) == r]
        s = int(start_pos[toks[0]])
        open_rows = [(kv_state[r, (c - 1) * m + q % m], score_state[r, (c - 1) * m + q % m])
                     for q in range(s // m * m, s)]
        prev = (kv_state[r, :m], score_state[r, :m]) if overlap and s >= m else None
        rows = [(int(positions[t]), kv[t], score[t] + ape[int(positions[t]) % m]) for t in toks]
        out[r] = compress_tokens(rows, m, overlap, norm_weight, inv_freq, eps, dtype, open_rows, prev)
    return out


def entry_location(block_table, per_block, r, w):
    return int(block_table[r, w // per_block]), w % per_block


# ------------------------------------------------------------------------------------------ generic
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,quant", [("csa", QUANT_NONE), ("hca", QUANT_FP8), ("indexer", QUANT_FP4)])
def test_opcheck(device, kind, quant):
    args = compressor_update_inputs(device, "mixed", kind, quant)
    torch.library.opcheck(torch.ops.dsv4rt.compressor_update.default, args)


def assert_written_equal(got, expected):
    """kv_state, score_state (spare slot excluded) and entry_cache (trash block excluded): exact."""
    for g, e in zip(got, expected):
        torch.testing.assert_close(g[:-1], e[:-1], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,quant", [("csa", QUANT_NONE), ("hca", QUANT_NONE), ("indexer", QUANT_FP4),
                                        ("csa", QUANT_FP8)])
def test_trace(device, kind, quant):
    args = compressor_update_inputs(device, "prefill", kind, quant)
    expected = ref_result(compressor_update_ref, *args)
    torch._dynamo.reset()
    torch.compile(compressor_update, fullgraph=True, backend="aot_eager")(*args)
    assert_written_equal((args[5], args[6], args[7]), expected)


def dequantize_entries(rows, quant, width):
    if quant == QUANT_FP8:
        return kv_fp8_dequantize(rows, width, ROPE_DIM, torch.float32)
    if quant == QUANT_FP4:
        return idx_fp4_dequantize(rows, width, torch.float32)
    return rows.float()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,quant", [(k, QUANT_NONE) for k in KINDS] + FORMATS)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_cuda_matches_reference(case, kind, quant, dtype):
    args = compressor_update_inputs("cuda", case, kind, quant, dtype)
    kv_state, score_state, entries = ref_result(compressor_update_ref, *to_device(args, "cpu"))
    compressor_update(*args)
    torch.testing.assert_close(args[5][:-1].cpu(), kv_state[:-1], rtol=0, atol=0)
    torch.testing.assert_close(args[6][:-1].cpu(), score_state[:-1], rtol=0, atol=0)
    width = COMPRESSORS[kind][2]
    got = dequantize_entries(args[7][:-1].cpu(), quant, width)
    want = dequantize_entries(entries[:-1], quant, width)
    row_scale = want.abs().amax(-1, keepdim=True)
    if quant == QUANT_NONE:
        rtol = ENTRY_RTOL[dtype]
        torch.testing.assert_close(got, want, rtol=rtol, atol=(rtol * row_scale).expand_as(want).max().item())
    else:
        assert ((got - want).abs() <= QUANT_STEP[quant] * row_scale + ENTRY_RTOL[dtype] * want.abs()).all()


# ------------------------------------------------------------------------------------------ semantics
SEM_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2**-7, atol=2**-7)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_matches_loop(case, kind, dtype):
    args = compressor_update_inputs("cpu", case, kind, QUANT_NONE, dtype)
    a = _unpack(args)
    before = {k: a[k].clone() for k in ("kv_state", "score_state", "entry_cache")}
    expected = compressor_loop(*args)
    compressor_update(*args)
    m, c = a["ratio"], (2 if a["overlap"] else 1)
    per_block = a["entry_cache"].shape[1]
    n_blocks = a["entry_cache"].shape[0] - 1  # the last block is the trash block

    # entries: written at (block_table[r, w // E], w % E), nothing else outside the trash block
    written = torch.zeros(a["entry_cache"].shape[:2], dtype=torch.bool)
    n_closed = 0
    for r, (entries, _, _) in expected.items():
        for w, entry in entries.items():
            blk, off = entry_location(a["block_table"], per_block, r, w)
            assert blk < n_blocks, "an entry of a live request must never address the trash block"
            torch.testing.assert_close(a["entry_cache"][blk, off], entry, **SEM_TOL[dtype])
            written[blk, off] = True
            n_closed += 1
    assert n_closed > 0  # every case closes a window of every compressor
    keep = ~written[:n_blocks]
    assert torch.equal(a["entry_cache"][:n_blocks][keep], before["entry_cache"][:n_blocks][keep])

    # state: the open window after the step, the last closed window's rows (overlap), other slots untouched
    for r, (_, open_rows, prev) in expected.items():
        e = int(a["end_pos"][a["req_slot"] == r][0])
        qs = list(range(e // m * m, e))
        assert len(open_rows) == len(qs)
        for q, (kv_row, sc_row) in zip(qs, open_rows):
            assert torch.equal(a["kv_state"][r, (c - 1) * m + q % m], kv_row)
            assert torch.equal(a["score_state"][r, (c - 1) * m + q % m], sc_row)
        if a["overlap"] and prev is not None:
            assert torch.equal(a["kv_state"][r, :m], prev[0])
            assert torch.equal(a["score_state"][r, :m], prev[1])
    idle = [r for r in range(a["kv_state"].shape[0] - 1) if r not in expected]
    for name in ("kv_state", "score_state"):
        assert torch.equal(a[name][idle], before[name][idle])


def test_nothing_written_without_a_close():
    # decode tokens at positions 21 and 5 (slots 2, 0) close no CSA window; one PAD token
    segs = (Seg(2, 21, 1), Seg(0, 5, 1))
    args = compressor_update_inputs("cpu", kind="csa", segs=segs, n_pad=1, dtype=torch.float32)
    entry_cache = args[7]
    before = entry_cache.clone()
    compressor_update(*args)
    assert torch.equal(entry_cache[:-1], before[:-1])


@pytest.mark.parametrize("kind,quant", FORMATS)
def test_storage_formats(kind, quant):
    """Entries in a storage format equal the value entries stored in that format (bytes or fake-quant)."""
    plain = compressor_update_inputs("cpu", "mixed", kind, QUANT_NONE, torch.bfloat16)
    stored = compressor_update_inputs("cpu", "mixed", kind, quant, torch.bfloat16)
    for x, y in zip(plain[:7], stored[:7]):  # same inputs and state; only the entry pool's format differs
        assert torch.equal(x, y)
    compressor_update(*plain)
    compressor_update(*stored)
    a = _unpack(plain)
    per_block = a["entry_cache"].shape[1]
    closes = ((a["positions"] + 1) % a["ratio"] == 0) & (a["req_slot"] >= 0)
    assert closes.any()
    for t in closes.nonzero().flatten().tolist():
        r, w = int(a["req_slot"][t]), (int(a["positions"][t]) + 1) // a["ratio"] - 1
        blk, off = entry_location(a["block_table"], per_block, r, w)
        value = a["entry_cache"][blk, off][None]
        row = stored[7][blk, off][None]
        if quant == QUANT_FP8:
            want = kv_fp8_quantize(value, ROPE_DIM)
        elif quant == QUANT_FP4:
            want = idx_fp4_quantize(hadamard(value))
        elif quant == QUANT_FP8_SIM:
            want = kv_fp8_fake_quant(value, ROPE_DIM)
        else:
            want = idx_fp4_fake_quant(hadamard(value)).to(value.dtype)
        torch.testing.assert_close(row, want, rtol=0, atol=0)


# chunkings of one 37-token request: whole, token by token, ragged (closes mid-chunk), aligned to m'
CHUNKINGS = [[37], [1] * 37, [3, 13, 1, 1, 19], [16, 16, 5]]


@pytest.mark.parametrize("kind", ["csa", "hca"])
@pytest.mark.parametrize("chunks", CHUNKINGS, ids=lambda c: "-".join(map(str, c[:5])))
def test_chunked_steps_match_one_pass(kind, chunks):
    """Steps of any chunking (state handed over between them) emit the entries of spec §6.4 from scratch."""
    ratio, overlap, d = COMPRESSORS[kind]
    c = 2 if overlap else 1
    n = sum(chunks)
    slot = 2
    gen = torch.Generator().manual_seed(7)
    kv_all = torch.randn(n, c * d, generator=gen)
    sc_all = torch.randn(n, c * d, generator=gen)
    a = _unpack(compressor_update_inputs("cpu", kind=kind, segs=(Seg(slot, 0, n),), dtype=torch.float32))
    ape, norm_weight, inv_freq, block_table = a["ape"], a["norm_weight"], a["inv_freq"], a["block_table"]
    kv_state, score_state, entry_cache = a["kv_state"], a["score_state"], a["entry_cache"]
    kv_state[slot].zero_()  # a freshly admitted request (reset_slot)
    score_state[slot].zero_()
    start = 0
    for k in chunks:
        req_slot, positions, start_pos, end_pos = step_meta((Seg(slot, start, k),), 1)
        pad = torch.zeros(1, c * d)
        compressor_update(torch.cat((kv_all[start : start + k], pad)), torch.cat((sc_all[start : start + k], pad)),
                          ape, norm_weight, inv_freq, kv_state, score_state, entry_cache, req_slot, positions,
                          start_pos, end_pos, block_table, ratio, overlap, QUANT_NONE, 1e-6, torch.float32)
        start += k
    rows = [(p, kv_all[p], sc_all[p] + ape[p % ratio]) for p in range(n)]
    entries, _, _ = compress_tokens(rows, ratio, overlap, norm_weight, inv_freq, 1e-6, torch.float32)
    assert sorted(entries) == list(range(n // ratio))
    per_block = entry_cache.shape[1]
    for w, entry in entries.items():
        blk, off = entry_location(block_table, per_block, slot, w)
        torch.testing.assert_close(entry_cache[blk, off], entry, rtol=1e-5, atol=1e-5)


def test_first_csa_entry_has_no_previous_window():
    """Entry 0 pools only the B halves of window 0 (window -1 has weight 0), whatever the state holds."""
    ratio, _, d = COMPRESSORS["csa"]
    args = compressor_update_inputs("cpu", kind="csa", segs=(Seg(1, 0, ratio),), dtype=torch.float32)
    a = _unpack(args)
    a["kv_state"][1].fill_(1e3)  # stale garbage must not leak into a new request's first entry
    a["score_state"][1].fill_(1e3)
    compressor_update(*args)
    sc = a["score"][:, d:] + a["ape"][:, d:]
    pooled = (torch.softmax(sc, dim=0) * a["kv"][:, d:]).sum(0)
    normed = a["norm_weight"] * pooled * torch.rsqrt(pooled.square().mean() + 1e-6)
    blk, off = entry_location(a["block_table"], a["entry_cache"].shape[1], 1, 0)
    torch.testing.assert_close(a["entry_cache"][blk, off], rope_loop(normed, 0, a["inv_freq"]), rtol=1e-5, atol=1e-5)
