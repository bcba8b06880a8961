"""KV compressor family: store a step's (kv, score + ape) rows and close the windows that end in it.

One op serves the three compressors of the spec (CSA main: overlap, d=512; CSA indexer: overlap,
d=128; HCA: no overlap, d=512) for decode and prefill chunks alike.

State of request slot r (fp32), c = 2 with overlap else 1, m = ratio:
    overlap (CSA): kv_state / score_state [S+1, 2m, 2d], buffered rows
        rows [0, m)   = full rows of the last closed window (their A halves feed the next entry)
        rows [m, 2m)  = the open window, position q at row m + q mod m
    no overlap (HCA): per-channel online softmax of the open window's rows (no rows are buffered)
        score_state [S+1, 2, d]: row 0 = running max M, row 1 = Z = sum of exp(score + ape - M)
        kv_state    [S+1, 1, d]: row 0 = A = sum of exp(score + ape - M) * kv
        a channel with Z == 0 is empty (a fresh request's zeros); the entry of a closing window is A / Z.
Entry w of a request (window [w*m, (w+1)*m)) is pooled (per-channel softmax over slots: A halves of
window w-1 and B halves of window w with overlap; the m rows of window w without), RMS-normed,
RoPE'd at position w*m, quantised and written to entry_cache[block_table[r, w // E], w % E]
(E = entries per block). Tokens that close no window write zeros to the trash block (the last).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .kv_quant import QUANT_FP4, QUANT_FP8, fp4_row_bytes, fp8_row_bytes, store_rows
from .rope import rope_rotate

torch.library.define(
    "dsv4rt::compressor_update",
    "(Tensor kv, Tensor score, Tensor ape, Tensor norm_weight, Tensor inv_freq, Tensor(a!) kv_state, "
    "Tensor(b!) score_state, Tensor(c!) entry_cache, Tensor req_slot, Tensor positions, Tensor start_pos, "
    "Tensor end_pos, Tensor block_table, int ratio, bool overlap, int quant, float eps, ScalarType dtype) -> ()",
)
# The two compressors of a CSA layer (main, indexer) on the same tokens: compressor_update on each, in one launch
# when the kernel can pair them (decode). Per compressor: kv, score, ape, norm_weight, kv_state, score_state,
# entry_cache, quant; shared: inv_freq, the step metadata, ratio, overlap, eps, dtype.
torch.library.define(
    "dsv4rt::compressor_update_pair",
    "(Tensor kv, Tensor score, Tensor ape, Tensor norm_weight, Tensor(a!) kv_state, Tensor(b!) score_state, "
    "Tensor(c!) entry_cache, int quant, Tensor kv2, Tensor score2, Tensor ape2, Tensor norm_weight2, "
    "Tensor(d!) kv_state2, Tensor(e!) score_state2, Tensor(f!) entry_cache2, int quant2, Tensor inv_freq, "
    "Tensor req_slot, Tensor positions, Tensor start_pos, Tensor end_pos, Tensor block_table, int ratio, "
    "bool overlap, float eps, ScalarType dtype) -> ()",
)


def _check_args(kv, score, ape, norm_weight, inv_freq, kv_state, score_state, entry_cache, block_table, ratio,
                overlap, quant, dtype, op: str = "compressor_update") -> None:
    """Shapes and dtypes of a call, with errors that name the op and the argument (the fake and the reference both
    run it; the CUDA binding checks the same)."""
    c = 2 if overlap else 1
    d = norm_weight.shape[0]

    def check(ok, msg):
        torch._check(ok, lambda: f"{op}: {msg}")

    check(kv.dim() == 2 and kv.shape == score.shape and kv.shape[1] == c * d,
          f"kv and score must be [T, {c * d}] (c*d), got {tuple(kv.shape)} and {tuple(score.shape)}")
    check(kv.dtype == torch.float32 and score.dtype == torch.float32, "kv and score must be float32")
    check(ape.dim() == 2 and ape.shape[0] == ratio and ape.shape[1] == c * d,
          f"ape must be [{ratio}, {c * d}] (m, c*d), got {tuple(ape.shape)}")
    if overlap:
        check(kv_state.dim() == 3 and kv_state.shape[1] == 2 * ratio and kv_state.shape[2] == 2 * d
              and kv_state.shape == score_state.shape,
              f"with overlap, kv_state and score_state must be [S+1, {2 * ratio}, {2 * d}] (buffered rows), got "
              f"{tuple(kv_state.shape)} and {tuple(score_state.shape)}")
    else:
        check(kv_state.dim() == 3 and kv_state.shape[1] == 1 and kv_state.shape[2] == d and score_state.dim() == 3
              and score_state.shape[0] == kv_state.shape[0] and score_state.shape[1] == 2 and score_state.shape[2] == d,
              f"without overlap, the state is the online softmax (A; M, Z): kv_state [S+1, 1, {d}] and score_state "
              f"[S+1, 2, {d}], got {tuple(kv_state.shape)} and {tuple(score_state.shape)}")
    check(kv_state.dtype == torch.float32 and score_state.dtype == torch.float32, "states must be float32")
    check(block_table.dtype == torch.int32, "block_table must be int32")
    if quant == QUANT_FP8:
        want = fp8_row_bytes(d, 2 * inv_freq.shape[0])
        check(entry_cache.dtype == torch.uint8 and entry_cache.shape[2] == want,
              f"FP8 entry_cache rows must be uint8 of {want} bytes")
    elif quant == QUANT_FP4:
        check(entry_cache.dtype == torch.uint8 and entry_cache.shape[2] == fp4_row_bytes(d),
              f"FP4 entry_cache rows must be uint8 of {fp4_row_bytes(d)} bytes")
    else:  # stored as values (QUANT_NONE or a simulated format)
        check(entry_cache.dtype == dtype and entry_cache.shape[2] == d, f"entry_cache rows must be {d} {dtype}")


@torch.library.register_fake("dsv4rt::compressor_update")
def _compressor_update_fake(kv, score, ape, norm_weight, inv_freq, kv_state, score_state, entry_cache, req_slot,
                            positions, start_pos, end_pos, block_table, ratio, overlap, quant, eps, dtype) -> None:
    _check_args(kv, score, ape, norm_weight, inv_freq, kv_state, score_state, entry_cache, block_table, ratio, overlap,
                quant, dtype)


def _online_pool(kv: Tensor, sc: Tensor, kv_state: Tensor, score_state: Tensor, valid: Tensor, slot: Tensor,
                 p: Tensor, s: Tensor, m: int) -> tuple[Tensor, Tensor, Tensor]:
    """No overlap: (M, Z, A) [T, d] of each token's window over its rows up to the last row of the window in this
    call, merged with the request's state when the window opened before the call (position s)."""
    n_tok, d = kv.shape
    tok = torch.arange(n_tok, device=kv.device)
    ws = torch.div(p, m, rounding_mode="floor") * m                 # the window's first position
    first = tok - (p - torch.maximum(s, ws))                         # the window's first token in this call
    first = torch.where(valid, first, tok).clamp(0, n_tok - 1)
    sc = torch.where(valid[:, None], sc, float("-inf"))
    idx = first[:, None].expand(n_tok, d)
    mx = torch.full_like(sc, float("-inf")).scatter_reduce(0, idx, sc, "amax", include_self=True)[first]
    st_m, st_z, st_a = score_state[slot, 0], score_state[slot, 1], kv_state[slot, 0]
    has = (valid & (ws < s))[:, None] & (st_z > 0)                   # the state holds rows [ws, s)
    mx = torch.where(has, torch.maximum(mx, st_m), mx)
    e = torch.where(valid[:, None], torch.exp(sc - mx), 0.0)
    z = torch.zeros_like(sc).index_add_(0, first, e)[first]
    acc = torch.zeros_like(sc).index_add_(0, first, e * kv)[first]
    f = torch.where(has, torch.exp(st_m - mx), 0.0)
    return mx, z + f * torch.where(has, st_z, 0.0), acc + f * torch.where(has, st_a, 0.0)


def compressor_update_ref(kv: Tensor, score: Tensor, ape: Tensor, norm_weight: Tensor, inv_freq: Tensor,
                          kv_state: Tensor, score_state: Tensor, entry_cache: Tensor, req_slot: Tensor,
                          positions: Tensor, start_pos: Tensor, end_pos: Tensor, block_table: Tensor, ratio: int,
                          overlap: bool, quant: int, eps: float, dtype: torch.dtype) -> None:
    _check_args(kv, score, ape, norm_weight, inv_freq, kv_state, score_state, entry_cache, block_table, ratio, overlap,
                quant, dtype)
    n_tok, cw = kv.shape
    m, c = ratio, (2 if overlap else 1)
    d = cw // c
    n_slots = kv_state.shape[0]
    dev = kv.device
    valid = req_slot >= 0
    slot = torch.where(valid, req_slot.long(), n_slots - 1)
    p, s, e = positions.long(), start_pos.long(), end_pos.long()
    sc = score + ape[p.remainder(m)]
    tok = torch.arange(n_tok, device=dev)
    closes = valid & ((p + 1).remainder(m) == 0)
    w = torch.div(p + 1, m, rounding_mode="floor") - 1

    if overlap:
        # --- gather the rows of window w-1 and window w for the window each token would close
        r = torch.arange(c * m, device=dev)
        q = (w[:, None] - (c - 1)) * m + r[None, :]  # [T, c*m] source positions
        in_chunk = q >= s[:, None]
        chunk_row = (tok[:, None] - (p[:, None] - q)).clamp(0, n_tok - 1)
        open_start = torch.div(s, m, rounding_mode="floor") * m
        state_row = torch.where(q >= open_start[:, None], (c - 1) * m + q.remainder(m), q.remainder(m))
        src_kv = torch.where(in_chunk[..., None], kv[chunk_row], kv_state[slot[:, None], state_row])
        src_sc = torch.where(in_chunk[..., None], sc[chunk_row], score_state[slot[:, None], state_row])
        src_sc = torch.where((q >= 0)[..., None], src_sc, float("-inf"))
        slot_kv = torch.cat((src_kv[:, :m, :d], src_kv[:, m:, d:]), dim=1)  # A halves of w-1, B halves of w
        slot_sc = torch.cat((src_sc[:, :m, :d], src_sc[:, m:, d:]), dim=1)
        weights = torch.softmax(torch.where(closes[:, None, None], slot_sc, 0.0), dim=1)
        pooled = (weights * torch.where(closes[:, None, None], slot_kv, 0.0)).sum(dim=1).to(dtype)  # [T, d]
    else:
        mx, z, acc = _online_pool(kv, sc, kv_state, score_state, valid, slot, p, s, m)
        pooled = torch.where(closes[:, None], acc / torch.where(closes[:, None], z, 1.0), 0.0).to(dtype)

    # --- norm, RoPE at the window's first position, quantise, write through the block table
    x32 = pooled.float()
    normed = (norm_weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(dtype)
    entry = rope_rotate(normed, w.clamp_min(0) * m, inv_freq)
    entry = torch.where(closes[:, None], entry, 0)
    rows = store_rows(entry, 2 * inv_freq.shape[0], quant, entry_cache.dtype)
    n_blocks, per_block, row_bytes = entry_cache.shape
    wc = w.clamp(0, block_table.shape[1] * per_block - 1)
    blk = torch.where(closes, block_table[slot, wc // per_block].long(), n_blocks - 1)
    dst = torch.where(closes, blk * per_block + wc.remainder(per_block), (n_blocks - 1) * per_block)
    entry_cache.view(n_blocks * per_block, row_bytes).index_copy_(0, dst, rows)

    if not overlap:
        # --- state: the request's last token leaves its window's (M, Z, A), or an empty state when it closes
        last = valid & (p == e - 1)
        keep = (last & ~closes)[:, None]
        zero = torch.zeros_like(mx)
        st_slot = torch.where(last, slot, n_slots - 1)
        score_state.view(n_slots * 2, d).index_copy_(0, torch.cat((2 * st_slot, 2 * st_slot + 1)),
                                                     torch.cat((torch.where(keep, mx, zero), torch.where(keep, z, zero))))
        kv_state.view(n_slots, d).index_copy_(0, st_slot, torch.where(keep, acc, zero))
        return

    # --- state: the open window after the step, and (overlap) the last closed window's rows
    rows_per_slot = c * m
    in_open = valid & (p >= torch.div(e, m, rounding_mode="floor") * m)
    open_dst = torch.where(in_open, slot * rows_per_slot + (c - 1) * m + p.remainder(m),
                           (n_slots - 1) * rows_per_slot + (c - 1) * m + p.remainder(m))
    kv_flat = kv_state.view(n_slots * rows_per_slot, cw)
    sc_flat = score_state.view(n_slots * rows_per_slot, cw)
    last_close = closes & (p + m >= e)
    ov_slot = torch.where(last_close, slot, n_slots - 1)
    ov_dst = (ov_slot[:, None] * rows_per_slot + torch.arange(m, device=dev)[None, :]).reshape(-1)
    kv_flat.index_copy_(0, ov_dst, src_kv[:, m:].reshape(-1, cw))
    sc_flat.index_copy_(0, ov_dst, src_sc[:, m:].reshape(-1, cw))
    kv_flat.index_copy_(0, open_dst, kv)
    sc_flat.index_copy_(0, open_dst, sc)


torch.library.impl("dsv4rt::compressor_update", "CompositeExplicitAutograd", compressor_update_ref)


def _pair_calls(kv, score, ape, norm_weight, kv_state, score_state, entry_cache, quant, kv2, score2, ape2,
                norm_weight2, kv_state2, score_state2, entry_cache2, quant2, inv_freq, req_slot, positions, start_pos,
                end_pos, block_table, ratio, overlap, eps, dtype):
    """The pair's two compressor_update argument lists."""
    meta = (req_slot, positions, start_pos, end_pos, block_table, ratio, overlap)
    return ((kv, score, ape, norm_weight, inv_freq, kv_state, score_state, entry_cache, *meta, quant, eps, dtype),
            (kv2, score2, ape2, norm_weight2, inv_freq, kv_state2, score_state2, entry_cache2, *meta, quant2, eps,
             dtype))


def pair_args(first: tuple, second: tuple) -> tuple:
    """compressor_update_pair's args from two compressor_update argument lists (the inverse of _pair_calls); the
    shared ones (inv_freq, metadata, block table, ratio, overlap, eps, dtype) are taken from `first`."""
    per = lambda a: (*a[:4], *a[5:8], a[15])  # noqa: E731  (kv, score, ape, norm_weight, states, entries, quant)
    return (*per(first), *per(second), first[4], *first[8:15], first[16], first[17])


def _check_pair(first, second) -> None:
    for a in (first, second):
        _check_args(*a[:8], a[12], a[13], a[14], a[15], a[17], op="compressor_update_pair")
    torch._check(first[0].shape[0] == second[0].shape[0],
                 lambda: f"compressor_update_pair: the two compressors must take the same tokens, got "
                         f"{first[0].shape[0]} and {second[0].shape[0]} rows")


@torch.library.register_fake("dsv4rt::compressor_update_pair")
def _compressor_update_pair_fake(*args) -> None:
    _check_pair(*_pair_calls(*args))


def compressor_update_pair_ref(*args) -> None:
    """compressor_update on each of the two compressors (they share no mutated tensor, so the order is free)."""
    first, second = _pair_calls(*args)
    _check_pair(first, second)
    compressor_update_ref(*first)
    compressor_update_ref(*second)


torch.library.impl("dsv4rt::compressor_update_pair", "CompositeExplicitAutograd", compressor_update_pair_ref)


def compressor_update(kv: Tensor, score: Tensor, ape: Tensor, norm_weight: Tensor, inv_freq: Tensor, kv_state: Tensor,
                      score_state: Tensor, entry_cache: Tensor, req_slot: Tensor, positions: Tensor,
                      start_pos: Tensor, end_pos: Tensor, block_table: Tensor, ratio: int, overlap: bool, quant: int,
                      eps: float, dtype: torch.dtype) -> None:
    """Store a step's compressor rows and emit the entries of every window that closes in the step.

    Shapes: kv, score [T, c*d] fp32 (projections; ape [m, c*d] is added here); norm_weight [d];
    inv_freq [rd/2]; kv_state, score_state fp32: [S+1, 2m, 2d] each with overlap, else [S+1, 1, d] and
    [S+1, 2, d] (online softmax state, see the module docstring); entry_cache [NB+1, E, d or bytes];
    req_slot/positions/start_pos/end_pos [T] int32; block_table [S+1, MB] int32.
    Mutates: kv_state, score_state (open window, overlap rows), entry_cache (closed entries). Capture-safe.
    """
    torch.ops.dsv4rt.compressor_update.default(kv, score, ape, norm_weight, inv_freq, kv_state, score_state,
                                               entry_cache, req_slot, positions, start_pos, end_pos, block_table,
                                               ratio, overlap, quant, eps, dtype)


def compressor_update_pair(kv: Tensor, score: Tensor, ape: Tensor, norm_weight: Tensor, kv_state: Tensor,
                           score_state: Tensor, entry_cache: Tensor, quant: int, kv2: Tensor, score2: Tensor,
                           ape2: Tensor, norm_weight2: Tensor, kv_state2: Tensor, score_state2: Tensor,
                           entry_cache2: Tensor, quant2: int, inv_freq: Tensor, req_slot: Tensor, positions: Tensor,
                           start_pos: Tensor, end_pos: Tensor, block_table: Tensor, ratio: int, overlap: bool,
                           eps: float, dtype: torch.dtype) -> None:
    """compressor_update for the two compressors of a CSA layer (main, then indexer) on the same tokens: per
    compressor its rows, parameters, state, entry cache and quant, then what they share (inv_freq, the step
    metadata, ratio, overlap, eps, dtype). The CUDA kernel runs both in one launch at decode (a token a CTA, bf16,
    FP8 + FP4 or unquantised entries) and as two launches otherwise. Mutates both states and entry caches."""
    torch.ops.dsv4rt.compressor_update_pair.default(kv, score, ape, norm_weight, kv_state, score_state, entry_cache,
                                                    quant, kv2, score2, ape2, norm_weight2, kv_state2, score_state2,
                                                    entry_cache2, quant2, inv_freq, req_slot, positions, start_pos,
                                                    end_pos, block_table, ratio, overlap, eps, dtype)
