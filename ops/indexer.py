"""Lightning-indexer family: scores of every visible indexer entry and a fixed-width top-k.

score[j] = sum_h w[h] * relu(q[h] . k_j) over the request's indexer entries j < (p+1) // ratio
(the causal validity rule); the top-k indices are returned with -1 for "no entry", so every
query gets min(topk, visible) real indices at a fixed width.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .attention import gather_entries

torch.library.define(
    "dsv4rt::indexer_topk",
    "(Tensor q, Tensor weights, Tensor idx_cache, Tensor req_slot, Tensor positions, Tensor block_table, "
    "int ratio, int topk) -> Tensor",
)


@torch.library.register_fake("dsv4rt::indexer_topk")
def _indexer_topk_fake(q, weights, idx_cache, req_slot, positions, block_table, ratio, topk) -> Tensor:
    torch._check(q.dim() == 3 and weights.shape == q.shape[:2])
    torch._check(weights.dtype == torch.float32)
    torch._check(block_table.dtype == torch.int32)
    return q.new_empty((q.shape[0], topk), dtype=torch.int32)


def indexer_scores_ref(q: Tensor, weights: Tensor, idx_cache: Tensor, req_slot: Tensor, positions: Tensor,
                       block_table: Tensor, ratio: int) -> Tensor:
    """[T, n_cap] fp32 scores of every entry slot of the token's request, -inf where not visible."""
    n_tok, _, width = q.shape
    spare = block_table.shape[0] - 1
    valid = req_slot >= 0
    slot = torch.where(valid, req_slot.long(), spare)
    n_cap = block_table.shape[1] * idx_cache.shape[1]
    j = torch.arange(n_cap, device=q.device)[None, :].expand(n_tok, -1)
    vis = valid[:, None] & (j < ((positions.long() + 1) // ratio)[:, None])
    quant = 2 if idx_cache.dtype == torch.uint8 else 0
    keys = gather_entries(idx_cache, block_table, slot, j, vis, width, 0, quant, torch.float32)  # [T, N, d]
    per_head = torch.einsum("thd,tnd->thn", q.float(), keys).relu()
    score = (per_head * weights.float()[..., None]).sum(dim=1)
    return torch.where(vis, score, float("-inf"))


def indexer_topk_ref(q: Tensor, weights: Tensor, idx_cache: Tensor, req_slot: Tensor, positions: Tensor,
                     block_table: Tensor, ratio: int, topk: int) -> Tensor:
    score = indexer_scores_ref(q, weights, idx_cache, req_slot, positions, block_table, ratio)
    k = min(topk, score.shape[1])
    top = score.topk(k, dim=-1)
    idx = torch.where(top.values > float("-inf"), top.indices, -1).to(torch.int32)
    if k < topk:
        idx = torch.cat((idx, idx.new_full((idx.shape[0], topk - k), -1)), dim=1)
    return idx


torch.library.impl("dsv4rt::indexer_topk", "CompositeExplicitAutograd", indexer_topk_ref)


def indexer_topk(q: Tensor, weights: Tensor, idx_cache: Tensor, req_slot: Tensor, positions: Tensor,
                 block_table: Tensor, ratio: int, topk: int) -> Tensor:
    """Top-k visible indexer entries per query, -1 padded.

    Shapes: q [T, nI, dI] (RoPE'd; Hadamard-rotated when idx_cache is FP4); weights [T, nI] fp32 (all
    scales folded in); idx_cache [NB+1, E, dI or fp4 bytes]; req_slot/positions [T] int32;
    block_table [S+1, MB] int32. Returns [T, topk] int32. Mutates: nothing. Capture-safe.
    The order of the indices is unspecified (the reference: by descending score; the CUDA kernel: ascending index,
    ties at equal scores to the smaller index); consumers treat the list as a set.
    """
    return torch.ops.dsv4rt.indexer_topk.default(q, weights, idx_cache, req_slot, positions, block_table, ratio, topk)
