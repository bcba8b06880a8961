"""Seeded, small inputs for the op tests and the CUDA kernel tests: one factory per op, args in schema order.

Every factory draws its values on the CPU from its own seeded generator and then moves them to `device`,
so `f("cuda", ...)` and `f("cpu", ...)` hold the same values (kernel vs reference compares rely on it).

Step metadata is laid out as `dsv4rt/prepare.py` fills it: the tokens of a request are contiguous and in
position order, positions run start .. end-1, padded tokens (PAD_SLOT) come last with position, start and
end 0. Block tables are valid: each request holds the blocks its closed entries need (drawn shuffled from
the pool, the pool's last block handed out), every other entry is the trash block (the pool's last + 1);
row N_SLOTS is the padding row. Caches hold random history in their storage format (FP8/FP4 rows are real
quantised rows, never random bytes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from dsv4rt.ops.kv_quant import (QUANT_FP4, QUANT_FP8, QUANT_NONE, hadamard, idx_fp4_fake_quant,
                                 idx_fp4_quantize_ref, kv_fp8_quantize_ref, store_rows)
from dsv4rt.ops.swa import PAD_SLOT

N_SLOTS = 4                      # request slots; per-slot tensors have one more, the spare slot
WINDOW = 16                      # sliding-window rows (the tiny config's)
HEAD_DIM, ROPE_DIM = 128, 64     # nope 64: one FP8 block, 200-byte FP8 rows
IDX_DIM = 128                    # indexer head dim: 68-byte FP4 rows
CSA_RATIO, HCA_RATIO = 4, 16     # HCA reduced from 128 (as in the tiny config) to keep windows short
BLOCK_TOKENS = 32                # source tokens per entry block (runtime: 128): small requests span blocks
MAX_BLOCKS = 4                   # block-table width: 128 tokens of context
N_HEADS, IDX_HEADS, TOPK = 4, 16, 5
EPS = 1e-6


@dataclass(frozen=True)
class Seg:
    """One request's tokens in a step: request slot, first position, token count."""
    slot: int
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


# name -> (segments, padded tokens). Positions are chosen against WINDOW = 16, m = 4 and m' = 16:
#   decode1  T = 1, the last slot, closes a CSA and an HCA window, ring wrapped (p >= W)
#   decode   one token per request: closes both / neither / CSA only / neither; two PAD tokens
#   prefill  a 37-token chunk from 0 (longer than W, closes 9 CSA and 2 HCA windows), a chunk starting
#            mid-window (its first closing windows begin in the state), a 2-token chunk closing nothing
#   mixed    decode and prefill together, a chunk shorter than m from 0, a 20-token chunk ending on a close
CASES: dict[str, tuple[tuple[Seg, ...], int]] = {
    "decode1": ((Seg(N_SLOTS - 1, 47, 1),), 0),
    "decode": ((Seg(0, 47, 1), Seg(2, 21, 1), Seg(3, 35, 1), Seg(1, 2, 1)), 2),
    "prefill": ((Seg(1, 0, 37), Seg(3, 13, 22), Seg(0, 5, 2)), 3),
    "mixed": ((Seg(2, 40, 1), Seg(0, 0, 3), Seg(3, 60, 20), Seg(1, 95, 1)), 1),
}
CASE_NAMES = tuple(CASES)

COMPRESSORS = {  # kind -> (ratio, overlap, width)
    "csa": (CSA_RATIO, True, HEAD_DIM),
    "hca": (HCA_RATIO, False, HEAD_DIM),
    "indexer": (CSA_RATIO, True, IDX_DIM),
}


# ------------------------------------------------------------------------------------------ helpers
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _to(device, *args: Any) -> tuple:
    return tuple(a.to(device) if isinstance(a, Tensor) else a for a in args)


def to_device(args: tuple, device) -> tuple:
    """Copies of the tensor args on `device` (other args as they are)."""
    return tuple(a.detach().clone().to(device) if isinstance(a, Tensor) else a for a in args)


def cache_rows(gen: torch.Generator, lead: tuple[int, ...], width: int, rope_dim: int, quant: int,
               dtype: torch.dtype) -> Tensor:
    """Random rows in a cache's storage format (byte layouts are quantised random values)."""
    return store_rows(_randn(gen, *lead, width), rope_dim, quant, dtype).contiguous()


def inv_freq_table(rope_dim: int = ROPE_DIM, base: float = 160000.0) -> Tensor:
    return 1.0 / base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)


def step_meta(segs: tuple[Seg, ...], n_pad: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """req_slot, positions, start_pos, end_pos [T] int32, as prepare.fill writes them."""
    slot, pos, start, end = [], [], [], []
    for s in segs:
        for i in range(s.length):
            slot.append(s.slot), pos.append(s.start + i), start.append(s.start), end.append(s.end)
    for _ in range(n_pad):
        slot.append(PAD_SLOT), pos.append(0), start.append(0), end.append(0)
    return tuple(torch.tensor(v, dtype=torch.int32) for v in (slot, pos, start, end))


def make_block_table(segs: tuple[Seg, ...], ratio: int, gen: torch.Generator) -> tuple[Tensor, int]:
    """[N_SLOTS + 1, MAX_BLOCKS] int32 table and the pool size NB (trash block = NB).

    Each request holds ceil((end // ratio) / entries_per_block) blocks, as the runtime allocates them; blocks
    come shuffled from a pool with two spare blocks. The pool's last block (NB - 1) is the last block of the
    first segment holding any, so the entries that segment's step closes last land in it.
    """
    per_block = BLOCK_TOKENS // ratio
    need = {s.slot: math.ceil((s.end // ratio) / per_block) for s in segs}
    assert max(need.values(), default=0) <= MAX_BLOCKS
    n_blocks = sum(need.values()) + 2
    order = [b for b in torch.randperm(n_blocks, generator=gen).tolist() if b != n_blocks - 1]
    table = torch.full((N_SLOTS + 1, MAX_BLOCKS), n_blocks, dtype=torch.int32)
    last_given = False
    for s in segs:
        k = need[s.slot]
        if k == 0:
            continue
        blocks = [order.pop() for _ in range(k - 1)] + [order.pop() if last_given else n_blocks - 1]
        last_given = True
        table[s.slot, :k] = torch.tensor(blocks, dtype=torch.int32)
    return table, n_blocks


# ------------------------------------------------------------------------------------------ kv_quant
def _quant_rows(gen: torch.Generator, n_rows: int, width: int) -> Tensor:
    """Rows whose scales span many octaves, with an all-zero row (amax floor) and an outlier row."""
    x = _randn(gen, n_rows, width) * torch.exp2(torch.randint(-12, 8, (n_rows, 1), generator=gen).float())
    x[0] = 0.0
    x[1, 3] = 1000.0
    return x


def kv_fp8_quantize_inputs(device, dtype: torch.dtype = torch.bfloat16, n_rows: int = 6, width: int = 256,
                           rope_dim: int = ROPE_DIM, seed: int = 0) -> tuple:
    """(x [n_rows, width], rope_dim). Width 256 / rope 64: three FP8 blocks, five pad bytes (328-byte rows)."""
    return _to(device, _quant_rows(_gen(seed), n_rows, width).to(dtype), rope_dim)


def kv_fp8_dequantize_inputs(device, dtype: torch.dtype = torch.bfloat16, n_rows: int = 6, width: int = 256,
                             rope_dim: int = ROPE_DIM, seed: int = 0) -> tuple:
    """(q [n_rows, row_bytes] uint8, width, rope_dim, dtype): real FP8 rows."""
    x, _ = kv_fp8_quantize_inputs("cpu", dtype, n_rows, width, rope_dim, seed)
    return _to(device, kv_fp8_quantize_ref(x, rope_dim), width, rope_dim, dtype)


def idx_fp4_quantize_inputs(device, dtype: torch.dtype = torch.bfloat16, n_rows: int = 6, width: int = IDX_DIM,
                            seed: int = 0) -> tuple:
    """(x [n_rows, width],): Hadamard-rotated rows, as the indexer stores them."""
    x = hadamard(_quant_rows(_gen(seed), n_rows, width))
    return _to(device, x.to(dtype))


def idx_fp4_dequantize_inputs(device, dtype: torch.dtype = torch.bfloat16, n_rows: int = 6, width: int = IDX_DIM,
                              seed: int = 0) -> tuple:
    """(q [n_rows, width/2 + width/32] uint8, width, dtype): real FP4 rows."""
    (x,) = idx_fp4_quantize_inputs("cpu", dtype, n_rows, width, seed)
    return _to(device, idx_fp4_quantize_ref(x), width, dtype)


# ------------------------------------------------------------------------------------------ swa
def swa_cache_write_inputs(device, case: str = "prefill", fp8: bool = False, dtype: torch.dtype = torch.bfloat16,
                           seed: int = 0) -> tuple:
    """(kv [T, D], swa_cache [N_SLOTS+1, W, D or FP8 bytes], req_slot, positions, end_pos, rope_dim)."""
    gen = _gen(seed)
    segs, n_pad = CASES[case]
    req_slot, positions, _, end_pos = step_meta(segs, n_pad)
    kv = _randn(gen, len(req_slot), HEAD_DIM, dtype=dtype)
    swa_cache = cache_rows(gen, (N_SLOTS + 1, WINDOW), HEAD_DIM, ROPE_DIM, QUANT_FP8 if fp8 else QUANT_NONE, dtype)
    return _to(device, kv, swa_cache, req_slot, positions, end_pos, ROPE_DIM)


# ------------------------------------------------------------------------------------------ compressor
EMPTY_STATE_SLOT = 0             # HCA: this slot's online state is all zeros (empty)
EMPTY_CHANNELS = 0.125           # HCA: about this fraction of every other slot's channels is empty


def online_state(gen: torch.Generator, n_slots: int, d: int) -> tuple[Tensor, Tensor]:
    """(kv_state [n_slots, 1, d], score_state [n_slots, 2, d]): a valid per-channel online softmax state.

    M ~ N(0, 1), Z = 0.5 + 2 |N(0, 1)| (> 0), A = Z * N(0, 1) (so A / Z is O(1)); slot EMPTY_STATE_SLOT and a random
    EMPTY_CHANNELS of the other slots' channels are empty (M = Z = A = 0).
    """
    mx = _randn(gen, n_slots, d)
    z = 0.5 + _randn(gen, n_slots, d).abs() * 2
    acc = z * _randn(gen, n_slots, d)
    empty = torch.rand(n_slots, d, generator=gen) < EMPTY_CHANNELS
    empty[EMPTY_STATE_SLOT] = True
    mx, z, acc = (torch.where(empty, 0.0, x) for x in (mx, z, acc))
    return acc[:, None].contiguous(), torch.stack((mx, z), dim=1).contiguous()


def compressor_update_inputs(device, case: str = "prefill", kind: str = "csa", quant: int = QUANT_NONE,
                             dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                             segs: Optional[tuple[Seg, ...]] = None, n_pad: int = 0) -> tuple:
    """All 18 args of compressor_update for one of COMPRESSORS ("csa", "hca", "indexer").

    kv/score are fp32 projections [T, c*d]; the state holds random fp32 history: with overlap open-window rows
    and the last closed window's rows, without a valid online softmax state (`online_state`); the entry pool
    holds random entries in the storage format of `quant`. `segs`/`n_pad` override the named case.
    """
    gen = _gen(seed)
    ratio, overlap, d = COMPRESSORS[kind]
    c = 2 if overlap else 1
    if segs is None:
        segs, n_pad = CASES[case]
    req_slot, positions, start_pos, end_pos = step_meta(segs, n_pad)
    block_table, n_blocks = make_block_table(segs, ratio, gen)
    n_tok = len(req_slot)
    kv = _randn(gen, n_tok, c * d)
    score = _randn(gen, n_tok, c * d)
    ape = _randn(gen, ratio, c * d, scale=0.5)
    norm_weight = 1.0 + _randn(gen, d, scale=0.1)
    inv_freq = inv_freq_table()
    if overlap:
        kv_state = _randn(gen, N_SLOTS + 1, c * ratio, c * d)
        score_state = _randn(gen, N_SLOTS + 1, c * ratio, c * d)
    else:
        kv_state, score_state = online_state(gen, N_SLOTS + 1, d)
    entry_cache = cache_rows(gen, (n_blocks + 1, BLOCK_TOKENS // ratio), d, ROPE_DIM, quant, dtype)
    return _to(device, kv, score, ape, norm_weight, inv_freq, kv_state, score_state, entry_cache, req_slot,
               positions, start_pos, end_pos, block_table, ratio, overlap, quant, EPS, dtype)


# ------------------------------------------------------------------------------------------ indexer
def indexer_topk_inputs(device, case: str = "prefill", fp4: bool = False, dtype: torch.dtype = torch.bfloat16,
                        topk: int = TOPK, seed: int = 0) -> tuple:
    """(q [T, nI, dI], weights [T, nI] fp32, idx_cache, req_slot, positions, block_table, ratio, topk).

    topk = 5 is below the visible count of some queries (a real selection) and above it for others (-1 pad).
    With fp4 the cache holds FP4 rows of rotated keys and q is rotated and fake-quantised, as the model does.
    """
    gen = _gen(seed)
    segs, n_pad = CASES[case]
    req_slot, positions, _, _ = step_meta(segs, n_pad)
    block_table, n_blocks = make_block_table(segs, CSA_RATIO, gen)
    n_tok = len(req_slot)
    q = _randn(gen, n_tok, IDX_HEADS, IDX_DIM)
    if fp4:
        q = idx_fp4_fake_quant(hadamard(q))
    weights = _randn(gen, n_tok, IDX_HEADS, scale=IDX_HEADS**-0.5 * IDX_DIM**-0.5)
    quant = QUANT_FP4 if fp4 else QUANT_NONE
    idx_cache = cache_rows(gen, (n_blocks + 1, BLOCK_TOKENS // CSA_RATIO), IDX_DIM, 0, quant, dtype)
    return _to(device, q.to(dtype), weights, idx_cache, req_slot, positions, block_table, CSA_RATIO, topk)


# ------------------------------------------------------------------------------------------ attention
def entry_index_lists(req_slot: Tensor, positions: Tensor, ratio: int, topk: int, gen: torch.Generator) -> Tensor:
    """[T, topk] int32: min(topk, visible) distinct visible entries per query, -1 elsewhere, in shuffled order."""
    rows = []
    for r, p in zip(req_slot.tolist(), positions.tolist()):
        n_vis = 0 if r == PAD_SLOT else (p + 1) // ratio
        k = min(topk, n_vis)
        row = torch.randperm(n_vis, generator=gen)[:k].tolist() + [-1] * (topk - k)
        rows.append([row[i] for i in torch.randperm(topk, generator=gen).tolist()])
    return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), topk)


ATTN_MODES = ("sliding", "hca", "csa")


def sparse_attn_inputs(device, case: str = "prefill", mode: str = "csa", fp8: bool = False,
                       dtype: torch.dtype = torch.bfloat16, topk: int = TOPK, seed: int = 0) -> tuple:
    """All 13 args of sparse_attn: mode "sliding" (no entries), "hca" (every visible entry), "csa" (index lists).

    The ring and the entry pool hold random rows (FP8 rows when fp8); kv holds this step's rows.
    """
    gen = _gen(seed)
    segs, n_pad = CASES[case]
    req_slot, positions, start_pos, _ = step_meta(segs, n_pad)
    ratio = {"sliding": 1, "hca": HCA_RATIO, "csa": CSA_RATIO}[mode]
    block_table, n_blocks = make_block_table(segs, CSA_RATIO if mode == "sliding" else ratio, gen)
    n_tok = len(req_slot)
    quant = QUANT_FP8 if fp8 else QUANT_NONE
    q = _randn(gen, n_tok, N_HEADS, HEAD_DIM, dtype=dtype)
    kv = _randn(gen, n_tok, HEAD_DIM, dtype=dtype)
    swa_cache = cache_rows(gen, (N_SLOTS + 1, WINDOW), HEAD_DIM, ROPE_DIM, quant, dtype)
    entry_cache = entry_idx = None
    if mode != "sliding":
        entry_cache = cache_rows(gen, (n_blocks + 1, BLOCK_TOKENS // ratio), HEAD_DIM, ROPE_DIM, quant, dtype)
    if mode == "csa":
        entry_idx = entry_index_lists(req_slot, positions, ratio, topk, gen)
    sinks = _randn(gen, N_HEADS)
    return _to(device, q, kv, swa_cache, entry_cache, entry_idx, sinks, req_slot, positions, start_pos, block_table,
               ratio, ROPE_DIM, HEAD_DIM**-0.5)


# ------------------------------------------------------------------------------------------ moe
N_EXPERTS, N_ACTIVE, MOE_DIM, MOE_INTER, VOCAB = 8, 3, 64, 32, 50
ROUTED_SCALE, SWIGLU_LIMIT = 1.5, 10.0


def moe_route_inputs(device, n_tokens: int = 7, seed: int = 0) -> tuple:
    """(logits [T, E] fp32, bias [E] fp32, topk, scale); the bias is large enough to change selections."""
    gen = _gen(seed)
    return _to(device, _randn(gen, n_tokens, N_EXPERTS, scale=2.0), _randn(gen, N_EXPERTS), N_ACTIVE, ROUTED_SCALE)


def moe_hash_route_inputs(device, n_tokens: int = 7, seed: int = 0) -> tuple:
    """(logits [T, E] fp32, tid2eid [V, k] int64 (distinct experts per row), token_ids [T] int64, scale)."""
    gen = _gen(seed)
    logits = _randn(gen, n_tokens, N_EXPERTS, scale=2.0)
    tid2eid = torch.stack([torch.randperm(N_EXPERTS, generator=gen)[:N_ACTIVE] for _ in range(VOCAB)])
    token_ids = torch.randint(0, VOCAB, (n_tokens,), generator=gen)
    return _to(device, logits, tid2eid, token_ids, ROUTED_SCALE)


def moe_experts_inputs(device, dtype: torch.dtype = torch.bfloat16, n_tokens: int = 7, seed: int = 0,
                       shared: bool = False) -> tuple:
    """(x [T, D], w13 [E, 2I, D], w2 [E, D, I], weights [T, k] fp32, ids [T, k] int32, limit), and with `shared`
    the shared expert's (gate [I, D], up [I, D], down [D, I]) appended (separate tensors, as the model holds them).

    Projections have std ~6, so both clamps of the SwiGLU (|h| > 10) engage on a fair share of channels.
    """
    gen = _gen(seed)
    x = _randn(gen, n_tokens, MOE_DIM, dtype=dtype)
    w13 = _randn(gen, N_EXPERTS, 2 * MOE_INTER, MOE_DIM, scale=6.0 * MOE_DIM**-0.5, dtype=dtype)
    w2 = _randn(gen, N_EXPERTS, MOE_DIM, MOE_INTER, scale=MOE_INTER**-0.5, dtype=dtype)
    ids = torch.stack([torch.randperm(N_EXPERTS, generator=gen)[:N_ACTIVE] for _ in range(n_tokens)]).int()
    w = torch.rand(n_tokens, N_ACTIVE, generator=gen) + 0.1
    weights = w / w.sum(-1, keepdim=True) * ROUTED_SCALE
    args = (x, w13, w2, weights, ids, SWIGLU_LIMIT)
    if shared:
        gen_s = _gen(seed + 10_000)  # the routed inputs stay those of the same seed without `shared`
        args += (_randn(gen_s, MOE_INTER, MOE_DIM, scale=6.0 * MOE_DIM**-0.5, dtype=dtype),
                 _randn(gen_s, MOE_INTER, MOE_DIM, scale=6.0 * MOE_DIM**-0.5, dtype=dtype),
                 _randn(gen_s, MOE_DIM, MOE_INTER, scale=MOE_INTER**-0.5, dtype=dtype))
    return _to(device, *args)


# ------------------------------------------------------------------------------------------ mhc
HC_N, HC_DIM, HC_ITERS, HC_EPS = 4, 32, 20, 1e-6


def hc_pre_inputs(device, dtype: torch.dtype = torch.bfloat16, n_tokens: int = 5, seed: int = 0) -> tuple:
    """(x [T, n, D], fn [(2+n)n, nD], base [(2+n)n], scale [3], iters, eps, norm_eps)."""
    gen = _gen(seed)
    n = HC_N
    return _to(device, _randn(gen, n_tokens, n, HC_DIM, dtype=dtype), _randn(gen, (2 + n) * n, n * HC_DIM, scale=0.2),
               _randn(gen, (2 + n) * n, scale=0.5), torch.tensor([0.7, 1.3, 2.0]), HC_ITERS, HC_EPS, EPS)


def hc_post_inputs(device, dtype: torch.dtype = torch.bfloat16, n_tokens: int = 5, seed: int = 0) -> tuple:
    """(x [T, n, D], y [T, D], post [T, n] fp32, comb [T, n, n] fp32), comb not symmetric."""
    gen = _gen(seed)
    n = HC_N
    post = 2 * torch.sigmoid(_randn(gen, n_tokens, n))
    comb = torch.softmax(_randn(gen, n_tokens, n, n, scale=2.0), dim=-1)
    return _to(device, _randn(gen, n_tokens, n, HC_DIM, dtype=dtype), _randn(gen, n_tokens, HC_DIM, dtype=dtype),
               post, comb)


def hc_head_inputs(device, dtype: torch.dtype = torch.bfloat16, n_tokens: int = 5, seed: int = 0) -> tuple:
    """(x [T, n, D], fn [n, nD], base [n], scale [1], eps, norm_eps)."""
    gen = _gen(seed)
    n = HC_N
    return _to(device, _randn(gen, n_tokens, n, HC_DIM, dtype=dtype), _randn(gen, n, n * HC_DIM, scale=0.2),
               _randn(gen, n, scale=0.5), torch.tensor([1.5]), HC_EPS, EPS)


# ------------------------------------------------------------------------------------------ results
def written_args(op_name: str, args: tuple) -> tuple[Tensor, ...]:
    """The args the schema of dsv4rt::<op_name> marks as written (Tensor(a!)), in schema order."""
    schema = getattr(torch.ops.dsv4rt, op_name).default._schema
    return tuple(args[i] for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write)


def ref_result(ref: Callable, *args: Any):
    """Run a reference (`<op>_ref`) on clones of the tensor args; return what the op produces.

    For ops that write (schema `Tensor(a!)`): the written clones (one tensor, or a tuple in schema order).
    For functional ops: the reference's return value. The caller's tensors are never touched.
    """
    op_name = ref.__name__.removesuffix("_ref")
    cloned = tuple(a.clone() if isinstance(a, Tensor) else a for a in args)
    out = ref(*cloned)
    written = written_args(op_name, cloned)
    if written:
        return written[0] if len(written) == 1 else written
    return out


def assert_trace_matches_reference(wrapper: Callable, ref: Callable, args: tuple) -> None:
    """torch.compile(wrapper, fullgraph=True, backend="aot_eager") on a functional op equals the eager op exactly.

    Where the op runs its reference (CPU, or CUDA without a native kernel) the expected value is the reference's
    (the trace runs the same arithmetic); where a native CUDA kernel serves the op it is the eager kernel's: the
    trace must run the kernel unchanged (the kernel itself is compared with the reference in test_*_cuda.py)."""
    import torch._dynamo

    from dsv4rt.ops import kernel_coverage

    op_name = ref.__name__.removesuffix("_ref")
    native = any(isinstance(a, Tensor) and a.is_cuda for a in args) and kernel_coverage()[op_name] == "native"
    expected = wrapper(*args) if native else ref_result(ref, *args)
    torch._dynamo.reset()
    got = torch.compile(wrapper, fullgraph=True, backend="aot_eager")(*args)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
