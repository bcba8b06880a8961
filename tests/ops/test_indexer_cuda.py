"""CUDA kernel of `dsv4rt::indexer_topk` (csrc/indexer.cu) against the reference.

Two scoring paths: tensor cores (bf16 q, bf16 or FP4 keys, <= 64 heads, head dim 64/128, sm_90a) and the general
one (any dtype, fp32 arithmetic; forced with DSV4RT_INDEXER_GENERAL=1). With FP4 keys of head dim 128 in blocks of
>= 16 entries, calls whose scoring CTAs take many tiles each run an instance that takes e4m3 operands when q converts
exactly (the model's FP4-quantised q does), else bf16 ones; the `path` fixture forces that instance ("tensor",
DSV4RT_INDEXER_F8=1) or the bf16 one ("tensor-bf16", DSV4RT_INDEXER_F8=0), since the tests' calls are short. Every
check:
  * each query holds min(topk, visible) distinct indices in [0, visible), then -1 (the output memory is poisoned
    before the call, so an unwritten slot shows);
  * the index set equals the reference's for every query whose k-th and (k+1)-th float64 scores differ by more
    than SCORE_TOL (relative to the query's score scale); at closer scores it is a valid top k within SCORE_TOL;
  * the output is sorted ascending and repeat calls are bit identical (ties at equal scores go to the smaller index).
Two selection kernels: one CTA a query with its keys in shared memory (queries of at most 32,768 entries in calls of
few queries) and the grid one; tests marked with the `select` fixture run with the one-CTA selection on and off
(DSV4RT_INDEXER_SELECT).
Inputs: FP4 rows are real quantised rows of Hadamard-rotated keys and q is rotated and fake-quantised, as the model
does; block tables hand each request shuffled blocks of a pool whose last block is the trash block.
"""
from __future__ import annotations

import math

import pytest
import torch

from dsv4rt.ops.indexer import indexer_topk, indexer_topk_ref
from dsv4rt.ops.kv_quant import hadamard, idx_fp4_dequantize_ref, idx_fp4_fake_quant, idx_fp4_quantize_ref
from dsv4rt.ops.swa import PAD_SLOT
from factories import CASE_NAMES, indexer_topk_inputs, to_device

pytestmark = pytest.mark.cuda

SCORE_TOL = 1e-5   # |score error| / (sum_h |w_h| |q_h . k|): fp32 accumulation of exact products, any order
RATIO = 4
FLASH = dict(n_heads=64, head_dim=128, topk=512, per_block=32)   # Flash dims, 128-token blocks at ratio 4
TINY = dict(n_heads=16, head_dim=64, topk=4, per_block=32)       # the tiny config's indexer
PATHS = ["tensor", "tensor-bf16", "general"]


# ------------------------------------------------------------------------------------------ inputs
def make_inputs(tokens: list[tuple[int, int]], fmt: str, n_heads: int, head_dim: int, topk: int, per_block: int,
                q_dtype: torch.dtype = torch.bfloat16, seed: int = 0, key_scale: float = 1.0,
                key_fn=None, positive_weights: bool = False, spare_blocks: int = 2, q_quant: bool = True) -> tuple:
    """Op args for queries (slot or PAD_SLOT, position). fmt: "fp4" (uint8 rows), "bf16" or "fp32" value keys.

    key_fn(gen, n_rows, head_dim) -> float32 rows overrides the random normal keys (before rotation/quantisation).
    q_quant=False keeps FP4-format calls' q rotated but not quantised (a q the e4m3 operands cannot hold).
    """
    gen = torch.Generator().manual_seed(seed)
    slots = sorted({s for s, _ in tokens if s != PAD_SLOT})
    n_slots = (max(slots) + 1) if slots else 1
    need = {s: max(math.ceil(((p + 1) // RATIO) / per_block) for s2, p in tokens if s2 == s) for s in slots}
    width = max(list(need.values()) + [1])
    n_blocks = sum(need.values()) + spare_blocks
    order = torch.randperm(n_blocks, generator=gen).tolist()
    table = torch.full((n_slots + 1, width), n_blocks, dtype=torch.int32)  # unallocated: the trash block
    for s in slots:
        table[s, : need[s]] = torch.tensor([order.pop() for _ in range(need[s])], dtype=torch.int32)
    n_rows = (n_blocks + 1) * per_block
    x = key_fn(gen, n_rows, head_dim) if key_fn else torch.randn(n_rows, head_dim, generator=gen) * key_scale
    q = torch.randn(len(tokens), n_heads, head_dim, generator=gen)
    if fmt == "fp4":
        cache = idx_fp4_quantize_ref(hadamard(x)).reshape(n_blocks + 1, per_block, -1)
        q = idx_fp4_fake_quant(hadamard(q)) if q_quant else hadamard(q)
    else:
        cache = x.to(torch.bfloat16 if fmt == "bf16" else torch.float32).reshape(n_blocks + 1, per_block, head_dim)
    weights = torch.randn(len(tokens), n_heads, generator=gen) * (n_heads**-0.5 * head_dim**-0.5)
    if positive_weights:
        weights = weights.abs()
    req_slot = torch.tensor([s for s, _ in tokens], dtype=torch.int32)
    positions = torch.tensor([p if s != PAD_SLOT else 0 for s, p in tokens], dtype=torch.int32)
    return (q.to(q_dtype).cuda(), weights.cuda(), cache.contiguous().cuda(), req_slot.cuda(), positions.cuda(),
            table.cuda(), RATIO, topk)


def visible(args) -> list[int]:
    _, _, cache, req_slot, positions, table, ratio, _ = args
    n_cap = table.shape[1] * cache.shape[1]
    return [0 if r == PAD_SLOT else min((p + 1) // ratio, n_cap) for r, p in zip(req_slot.tolist(), positions.tolist())]


def scores64(args) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 scores [T, n_cap] of every entry slot (-inf where not visible) and each query's |score| scale."""
    q, w, cache, req_slot, positions, table, ratio, _ = to_device(args, "cpu")
    head_dim = q.shape[2]
    keys = (idx_fp4_dequantize_ref(cache, head_dim, torch.float32) if cache.dtype == torch.uint8 else cache).double()
    slot = torch.where(req_slot >= 0, req_slot.long(), table.shape[0] - 1)
    n_cap = table.shape[1] * cache.shape[1]
    j = torch.arange(n_cap)
    rows = keys[table[slot][:, j // cache.shape[1]].long(), j % cache.shape[1]]  # [T, n_cap, d]
    dots = torch.einsum("thd,tnd->thn", q.double(), rows)
    w64 = w.double()[..., None]
    score = (w64 * dots.relu()).sum(1)
    scale = (w64.abs() * dots.abs()).sum(1).amax(1).clamp_min(1e-300)
    vis = torch.tensor(visible(args))[:, None] > j[None, :]
    return torch.where(vis, score, float("-inf")), scale


def run_poisoned(args) -> torch.Tensor:
    """The op's output, its memory first filled with garbage through the caching allocator."""
    n = args[0].shape[0] * args[7]
    junk = torch.full((max(n, 1) * 4,), 0x7F7F7F7F, dtype=torch.int32, device="cuda")
    del junk
    out = indexer_topk(*args)
    torch.cuda.synchronize()
    return out


def check(got: torch.Tensor, args, ref_sets: bool = True) -> None:
    topk = args[7]
    assert got.dtype == torch.int32 and got.shape == (args[0].shape[0], topk)
    got = got.cpu()
    score, scale = scores64(args)
    expected = indexer_topk_ref(*to_device(args, "cpu")) if ref_sets else None
    for t, nv in enumerate(visible(args)):
        row = got[t].tolist()
        k = min(topk, nv)
        assert row[k:] == [-1] * (topk - k), f"query {t}: -1 padding"
        real = row[:k]
        assert real == sorted(set(real)) and all(0 <= i < nv for i in real), f"query {t}: {real[:16]}..."
        if k == 0 or k == nv:
            continue
        s = score[t]
        tol = SCORE_TOL * float(scale[t])
        chosen = torch.zeros(s.shape[0], dtype=torch.bool)
        chosen[real] = True
        worst_in = float(s[chosen].min())
        best_out = float(s[~chosen & (s > float("-inf"))].max())
        assert worst_in >= best_out - tol, f"query {t}: not a top {topk} ({worst_in} < {best_out})"
        kth, next_ = s.topk(k + 1).values[-2:].tolist()
        if ref_sets and kth - next_ > tol:  # no near-tie at the boundary: identical sets
            want = sorted(i for i in expected[t].tolist() if i >= 0)
            assert real == want, f"query {t}: index set differs from the reference"


@pytest.fixture(params=["small", "grid"])
def select(request, monkeypatch):
    monkeypatch.setenv("DSV4RT_INDEXER_SELECT", request.param)
    return request.param


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    if request.param == "general":
        monkeypatch.setenv("DSV4RT_INDEXER_GENERAL", "1")
    else:
        monkeypatch.delenv("DSV4RT_INDEXER_GENERAL", raising=False)
    if request.param == "general":
        monkeypatch.delenv("DSV4RT_INDEXER_F8", raising=False)
    else:
        monkeypatch.setenv("DSV4RT_INDEXER_F8", "0" if request.param == "tensor-bf16" else "1")
    return request.param


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp4", [False, True])
@pytest.mark.parametrize("case", CASE_NAMES)
def test_factory_cases(case, fp4, dtype, path):
    args = indexer_topk_inputs("cuda", case, fp4, dtype)
    check(run_poisoned(args), args)


def _lengths_tokens(lengths: list[int], n_pad: int) -> list[tuple[int, int]]:
    """One query per request with `n` visible entries (any of the positions ratio*n - 1 .. ratio*n + ratio - 2),
    requests in reversed slots, a PAD token after each of the first n_pad."""
    toks = []
    for i, n in enumerate(lengths):
        toks.append((len(lengths) - 1 - i, max(RATIO * n + (i % RATIO) - 1, 0)))
        if i < n_pad:
            toks.append((PAD_SLOT, 0))
    return toks


@pytest.mark.parametrize("fmt", ["fp4", "bf16"])
def test_flash_lengths(fmt, path, select):
    # visible counts around the selection width, the 128-entry tile and the 32-entry block; one of many blocks
    k = FLASH["topk"]
    lengths = [0, 1, k - 1, k, k + 1, 127, 128, 129, 1000, 3001, 2 * k + 7]
    args = make_inputs(_lengths_tokens(lengths, 3), fmt, **FLASH)
    check(run_poisoned(args), args)


@pytest.mark.parametrize("fmt", ["fp4", "bf16"])
def test_flash_prefill_chunk(fmt, path, select):
    # a prefill chunk of 40 tokens (visible 1000..1009) plus decodes of two other requests, 2 PAD tokens
    toks = [(0, 4000 + i) for i in range(40)] + [(1, 6001), (PAD_SLOT, 0), (2, 700), (PAD_SLOT, 0)]
    args = make_inputs(toks, fmt, **FLASH, seed=1)
    check(run_poisoned(args), args)


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["fp4", "bf16", "fp32"])
def test_tiny_dims(fmt, q_dtype, path):
    lengths = [0, 1, 3, 4, 5, 31, 32, 33, 300]
    args = make_inputs(_lengths_tokens(lengths, 2), fmt, **TINY, q_dtype=q_dtype, seed=2)
    check(run_poisoned(args), args)


@pytest.mark.parametrize("fmt", ["fp4", "bf16"])
def test_pro_topk(fmt, select):
    dims = dict(FLASH, topk=1024)
    args = make_inputs(_lengths_tokens([1023, 1024, 1025, 5000], 1), fmt, **dims, seed=3)
    check(run_poisoned(args), args)


@pytest.mark.parametrize("fmt", ["fp4", "bf16"])
def test_long_context(fmt, select):
    # 40,000 visible entries: many CTAs per query in both kernels; with the one-CTA selection on, the query of 20,000
    # entries takes it and the other the grid selection, in the same call
    args = make_inputs([(0, RATIO * 40000 - 1), (1, RATIO * 20000 + 2)], fmt, **FLASH, seed=4)
    check(run_poisoned(args), args)


@pytest.mark.parametrize("fmt", ["fp4", "bf16"])
def test_short_queries_wide_table(fmt, select):
    # a block table wide enough for 40,000 entries (a runtime's max_context), every query far shorter: with the
    # one-CTA selection on, the grid selection runs and leaves every query to it
    args = list(make_inputs([(0, RATIO * 40000 - 1), (1, RATIO * 3000 + 2)], fmt, **FLASH, seed=14))
    args[4] = torch.tensor([RATIO * 1500 + 1, RATIO * 3000 + 2], dtype=torch.int32, device="cuda")
    check(run_poisoned(tuple(args)), tuple(args))


@pytest.mark.parametrize("fmt", ["fp4", "bf16"])
def test_unaligned_key_rows(fmt, select):
    # 2-entry blocks and an odd table width (351 blocks, 702 entry slots a query): the second query's scores start
    # 8 bytes past a 16-byte boundary, so the one-CTA selection loads them one word at a time
    dims = dict(FLASH, per_block=2)
    args = make_inputs([(0, RATIO * 701 - 1), (1, RATIO * 650 + 1)], fmt, **dims, seed=15)
    assert args[5].shape[1] == 351
    check(run_poisoned(args), args)


def near_equal_keys(gen, n, d):
    """One shared key plus noise of about one bf16 step: distinct, tightly clustered scores."""
    return torch.randn(1, d, generator=gen) + 1e-2 * torch.randn(n, d, generator=gen)


def test_concentrated_scores():
    # nearly every score in the 12-bit histogram bin of the k-th: more candidates than the list holds (8192),
    # so the last CTA rescans the keys
    args = make_inputs([(0, RATIO * 40000 - 1)], "bf16", **FLASH, seed=5, key_fn=near_equal_keys,
                       positive_weights=True)
    score, _ = scores64(args)
    s32 = score[0].float()
    bins = (s32.view(torch.int32).long() & 0xFFFFFFFF) >> 20  # positive scores: the key's top bits, less the sign
    kth = s32.topk(FLASH["topk"]).values[-1]
    assert int((bins == ((kth.view(torch.int32).long() & 0xFFFFFFFF) >> 20)).sum()) > 8192
    check(run_poisoned(args), args)


@pytest.mark.parametrize("fmt", ["fp4", "bf16"])
def test_equal_scores_take_smallest_indices(fmt, path, select):
    # every key equal: every score ties, the k smallest indices are chosen
    args = make_inputs([(0, RATIO * 3000 - 1), (1, RATIO * 600 + 1)], fmt, **FLASH, seed=6,
                       key_fn=lambda gen, n, d: torch.randn(1, d, generator=gen).expand(n, d).clone())
    got = run_poisoned(args).cpu()
    k = FLASH["topk"]
    assert got[0].tolist() == list(range(k)) and got[1].tolist() == list(range(k))


@pytest.mark.parametrize("scale", [2.0**12, 2.0**-30])
def test_fp4_scale_extremes(scale, path):
    # block scales far above 2^1 (the decode's second multiply) and far below 1
    args = make_inputs(_lengths_tokens([700, 2000], 0), "fp4", **FLASH, seed=7, key_scale=scale)
    check(run_poisoned(args), args)


def test_fp4_mixed_scales(path):
    # within every warp's rows some block scales are above 2^1 and some below: the second multiply is taken for the
    # warp and must leave the other rows' values unchanged (their factor is 1)
    def keys(gen, n, d):
        x = torch.randn(n, d, generator=gen)
        return x * (2.0 ** (12 * (torch.arange(n) % 3 == 0).float())).unsqueeze(1)
    args = make_inputs(_lengths_tokens([700, 3000], 0), "fp4", **FLASH, seed=12, key_fn=keys)
    check(run_poisoned(args), args)


def _set_block_scale(cache: torch.Tensor, rows: slice, block: int, drop: int) -> None:
    """Rows `rows` of every cache block: FP4 block `block`'s scale byte `drop` binades below the row's other blocks'
    largest (so `drop` is the row's spread)."""
    others = [64 + b for b in range(4) if b != block]
    top = cache[:, rows][..., others].to(torch.int32).amax(-1)
    assert int(top.min()) > drop
    cache[:, rows, 64 + block] = (top - drop).to(torch.uint8)


def test_fp4_block_scale_spread(path):
    # rows whose blocks' scales lie 11 (one shift still holds them) and 12 or 20 binades apart (the e4m3 operands
    # cannot: those CTAs score their range again with bf16 operands), and rows with a block of zero codes at the
    # floor scale (byte 1: it reads 0 whatever the shift, but the check counts its spread too); every kind of row in
    # most tiles
    args = list(make_inputs(_lengths_tokens([700, 3000], 0), "fp4", **FLASH, seed=16))
    cache = args[2]
    _set_block_scale(cache, slice(0, None, 7), 1, 11)
    _set_block_scale(cache, slice(3, None, 29), 2, 12)
    _set_block_scale(cache, slice(5, None, 31), 3, 20)
    zero = slice(2, None, 5)
    cache[:, zero, 32:48] = 0  # block 2's codes (elements 64 .. 95)
    cache[:, zero, 66] = 1
    check(run_poisoned(tuple(args)), tuple(args))


def test_fp4_spread_everywhere(path):
    # every row's block 3 twelve binades below its largest: every CTA takes the second (bf16) pass
    args = list(make_inputs(_lengths_tokens([513, 2000], 1), "fp4", **FLASH, seed=17))
    _set_block_scale(args[2], slice(None), 3, 12)
    check(run_poisoned(tuple(args)), tuple(args))


@pytest.mark.parametrize("q_kind", ["bf16", "head_range", "zero_head", "tiny_weight"])
def test_fp4_q_operands(q_kind, path):
    # q that the e4m3 operands cannot hold takes bf16 operands (the CTA's choice, from q alone): q not quantised,
    # or one head's values spanning more binades than e4m3's normal range, or a weight that the head's scale would
    # push below the normal floats; a head of zeros keeps the e4m3 operands
    args = list(make_inputs(_lengths_tokens([700, 3000], 1), "fp4", **FLASH, seed=18, q_quant=q_kind != "bf16"))
    q, w = args[0].clone(), args[1].clone()
    if q_kind == "head_range":
        q[:, 3, :32] *= 2.0**-20
    elif q_kind == "zero_head":
        q[:, 5] = 0
    elif q_kind == "tiny_weight":
        q[:, 7] *= 2.0**-100
        w[:, 7] = 2.0**-30
    args[0], args[1] = q, w
    check(run_poisoned(tuple(args)), tuple(args))


@pytest.mark.parametrize("head_dim", [128, 64])
def test_fp4_copy_paths_agree(head_dim, monkeypatch):
    # FP4 rows in blocks of >= 16 entries reach shared memory by one bulk copy a warp's run; DSV4RT_INDEXER_CP_ASYNC=1
    # takes per-lane 16-byte copies instead. Both give the reference's sets and the same output bit for bit. Lengths
    # end a warp's run part way and leave some warps of the last tile with no visible row; 20,000 entries give a CTA
    # many tiles (each stage's mbarrier goes through many phases).
    toks = _lengths_tokens([513, 1000, 3001, 20000], 1)
    args = make_inputs(toks, "fp4", **dict(FLASH, head_dim=head_dim), seed=13)
    monkeypatch.delenv("DSV4RT_INDEXER_CP_ASYNC", raising=False)
    bulk = run_poisoned(args)
    check(bulk, args)
    monkeypatch.setenv("DSV4RT_INDEXER_CP_ASYNC", "1")
    assert torch.equal(run_poisoned(args), bulk)


def test_deterministic(select):
    args = make_inputs(_lengths_tokens([600, 5000, 20000], 1), "fp4", **FLASH, seed=8)
    a, b = run_poisoned(args), run_poisoned(args)
    assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", ["fp4", "bf16"])
def test_graph_replay_new_inputs(fmt, capture_graph, select):
    # capture once, then change positions, slots, block table, keys, q and weights in place: the replay equals
    # the reference on the new inputs (no host-side planning is baked into the graph)
    toks = [(0, RATIO * 3000 - 1), (1, RATIO * 3000 - 5), (PAD_SLOT, 0)]
    first = make_inputs(toks, fmt, **FLASH, seed=9)
    other = make_inputs(toks, fmt, **FLASH, seed=10)
    table = first[5].clone()
    table[[0, 1]] = table[[1, 0]]
    second = (other[0], other[1], other[2], torch.tensor([1, 0, 0], dtype=torch.int32, device="cuda"),
              torch.tensor([RATIO * 2500 + 3, RATIO * 900, RATIO * 10], dtype=torch.int32, device="cuda"), table,
              RATIO, FLASH["topk"])
    args = [a.clone() if isinstance(a, torch.Tensor) else a for a in first]
    graph, out = capture_graph(lambda: indexer_topk(*args))
    for new in (second, first):
        for dst, src in zip(args[:6], new[:6]):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        check(out.clone(), new)


def test_opcheck_flash():
    args = make_inputs(_lengths_tokens([600, 1500], 1), "fp4", **FLASH, seed=11)
    torch.library.opcheck(torch.ops.dsv4rt.indexer_topk.default, args)


@pytest.mark.parametrize("per_block", [32, 8])
def test_many_tiles_per_cta(per_block, select):
    # 60 queries of ~20,000 visible entries: 8 scoring CTAs a query, each with ~39 tiles of 64 entries (the raw-row
    # ring wraps many times); per_block 8: a warp's 16 rows span two blocks
    dims = dict(n_heads=64, head_dim=64, topk=64, per_block=per_block)
    toks = [(0, RATIO * 20000 - 1 - 37 * i) for i in range(60)]
    args = make_inputs(toks, "fp4", **dims, seed=6)
    check(run_poisoned(args), args)
