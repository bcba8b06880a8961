"""Sparse MQA attention with sinks over the sliding rows plus compressed entries.

Keys of the query at position p of request slot r (values = keys, one shared head):
  * sliding rows of positions max(0, p-W+1) .. p: rows of this step's chunk (positions >= the
    request's chunk start) come from `kv`, older ones from the ring `swa_cache[r, q mod W]`;
  * compressed entries (CSA/HCA layers), addressed through the request's block table:
    by `entry_idx` (CSA: the indexer's top-k, -1 = no key), or, without `entry_idx`, every
    visible entry j < (p+1) // ratio (HCA).
Softmax in fp32 with the per-head sink in the denominator only.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .kv_quant import load_rows

torch.library.define(
    "dsv4rt::sparse_attn",
    "(Tensor q, Tensor kv, Tensor swa_cache, Tensor? entry_cache, Tensor? entry_idx, Tensor sinks, "
    "Tensor req_slot, Tensor positions, Tensor start_pos, Tensor block_table, int ratio, int rope_dim, "
    "float scale) -> Tensor",
)


@torch.library.register_fake("dsv4rt::sparse_attn")
def _sparse_attn_fake(q, kv, swa_cache, entry_cache, entry_idx, sinks, req_slot, positions, start_pos, block_table,
                      ratio, rope_dim, scale) -> Tensor:
    torch._check(q.dim() == 3 and kv.dim() == 2)
    torch._check(q.shape[0] == kv.shape[0] and q.shape[2] == kv.shape[1])
    torch._check(sinks.shape[0] == q.shape[1])
    if entry_idx is not None:
        torch._check(entry_cache is not None)
        torch._check(entry_idx.shape[0] == q.shape[0] and entry_idx.dtype == torch.int32)
    return torch.empty_like(q)


def _gather_sliding(kv: Tensor, swa_cache: Tensor, slot: Tensor, p: Tensor, s: Tensor, valid: Tensor,
                    rope_dim: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    n_tok, width = kv.shape
    window = swa_cache.shape[1]
    i = torch.arange(window, device=kv.device)
    qpos = p[:, None] - i  # [T, W] key positions, newest first
    vis = valid[:, None] & (qpos >= 0)
    in_chunk = qpos >= s[:, None]
    tok = torch.arange(n_tok, device=kv.device)[:, None] - i
    new_rows = kv[tok.clamp(0, n_tok - 1)].to(dtype)
    ring = swa_cache[slot[:, None], qpos.remainder(window)]
    ring = load_rows(ring, width, rope_dim, 1 if swa_cache.dtype == torch.uint8 else 0, dtype)
    keys = torch.where(in_chunk[..., None], new_rows, ring)
    return torch.where(vis[..., None], keys, 0), vis


def gather_entries(entry_cache: Tensor, block_table: Tensor, slot: Tensor, j: Tensor, vis: Tensor, width: int,
                   rope_dim: int, quant: int, dtype: torch.dtype) -> Tensor:
    """Rows j [T, N] of each token's request through the block table; invisible ones zeroed."""
    per_block = entry_cache.shape[1]
    jc = j.clamp(0, block_table.shape[1] * per_block - 1)
    blk = block_table[slot[:, None], jc // per_block].long()
    rows = load_rows(entry_cache[blk, jc % per_block], width, rope_dim, quant, dtype)
    return torch.where(vis[..., None], rows, 0)


def sparse_attn_ref(q: Tensor, kv: Tensor, swa_cache: Tensor, entry_cache: Optional[Tensor],
                    entry_idx: Optional[Tensor], sinks: Tensor, req_slot: Tensor, positions: Tensor,
                    start_pos: Tensor, block_table: Tensor, ratio: int, rope_dim: int, scale: float) -> Tensor:
    width = kv.shape[1]
    spare = swa_cache.shape[0] - 1
    valid = req_slot >= 0
    slot = torch.where(valid, req_slot.long(), spare)
    p, s = positions.long(), start_pos.long()
    keys, vis = _gather_sliding(kv, swa_cache, slot, p, s, valid, rope_dim, torch.float32)
    if entry_cache is not None:
        quant = 1 if entry_cache.dtype == torch.uint8 else 0
        n_visible = (p + 1) // ratio
        if entry_idx is None:
            j = torch.arange(block_table.shape[1] * entry_cache.shape[1], device=q.device)[None, :].expand(q.shape[0], -1)
        else:
            j = entry_idx.long()
        cvis = valid[:, None] & (j >= 0) & (j < n_visible[:, None])
        ckeys = gather_entries(entry_cache, block_table, slot, j, cvis, width, rope_dim, quant, torch.float32)
        keys = torch.cat((keys, ckeys), dim=1)
        vis = torch.cat((vis, cvis), dim=1)
    logits = torch.einsum("thd,tnd->thn", q.float(), keys) * scale
    logits = torch.where(vis[:, None, :], logits, float("-inf"))
    sink = sinks.float()[None, :, None]
    m = torch.maximum(logits.amax(-1, keepdim=True), sink)
    e = torch.exp(logits - m)
    probs = e / (e.sum(-1, keepdim=True) + torch.exp(sink - m))
    return torch.einsum("thn,tnd->thd", probs, keys).to(q.dtype)


torch.library.impl("dsv4rt::sparse_attn", "CompositeExplicitAutograd", sparse_attn_ref)


def sparse_attn(q: Tensor, kv: Tensor, swa_cache: Tensor, entry_cache: Optional[Tensor], entry_idx: Optional[Tensor],
                sinks: Tensor, req_slot: Tensor, positions: Tensor, start_pos: Tensor, block_table: Tensor,
                ratio: int, rope_dim: int, scale: float) -> Tensor:
    """Attention of each query over its sliding rows and compressed entries, with sinks.

    Shapes: q [T, H, D]; kv [T, D] (this step's rows); swa_cache [S+1, W, D or fp8 bytes];
    entry_cache [NB+1, E, D or fp8 bytes] or None (sliding layers); entry_idx [T, K] int32 or None
    (prefix mode); sinks [H] fp32; req_slot/positions/start_pos [T] int32; block_table [S+1, MB] int32.
    Returns [T, H, D] in q's dtype. Mutates: nothing. Capture-safe.
    """
    return torch.ops.dsv4rt.sparse_attn.default(q, kv, swa_cache, entry_cache, entry_idx, sinks, req_slot, positions,
                                                start_pos, block_table, ratio, rope_dim, scale)
