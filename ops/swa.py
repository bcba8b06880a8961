"""Sliding-window ring family: append a step's kv rows to each request's ring of W rows.

The ring of request slot r holds the kv row of position p at ring row p mod W. Slot index S (the
last) is the spare slot: padded tokens (req_slot == PAD_SLOT) and rows that a longer chunk of the
same request would overwrite are sent there, so the op never branches on data.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .kv_quant import fp8_row_bytes, kv_fp8_quantize_ref

PAD_SLOT = -1

torch.library.define(
    "dsv4rt::swa_cache_write",
    "(Tensor kv, Tensor(a!) swa_cache, Tensor req_slot, Tensor positions, Tensor end_pos, int rope_dim) -> ()",
)


@torch.library.register_fake("dsv4rt::swa_cache_write")
def _swa_cache_write_fake(kv: Tensor, swa_cache: Tensor, req_slot: Tensor, positions: Tensor, end_pos: Tensor,
                          rope_dim: int) -> None:
    torch._check(kv.dim() == 2 and swa_cache.dim() == 3)
    torch._check(kv.shape[0] == req_slot.shape[0] == positions.shape[0] == end_pos.shape[0])
    if swa_cache.dtype == torch.uint8:
        torch._check(swa_cache.shape[2] == fp8_row_bytes(kv.shape[1], rope_dim))
    else:
        torch._check(swa_cache.shape[2] == kv.shape[1])
        torch._check(swa_cache.dtype == kv.dtype)
    torch._check(req_slot.dtype == torch.int32 and positions.dtype == torch.int32 and end_pos.dtype == torch.int32)


def swa_cache_write_ref(kv: Tensor, swa_cache: Tensor, req_slot: Tensor, positions: Tensor, end_pos: Tensor,
                        rope_dim: int) -> None:
    """Reference: ring[slot, p mod W] = kv[t] for the last W positions of each request; others to the spare slot."""
    n_slots, window, row = swa_cache.shape
    spare = n_slots - 1
    p = positions.long()
    keep = (req_slot >= 0) & (p >= end_pos.long() - window)
    slot = torch.where(keep, req_slot.long(), spare)
    rows = kv_fp8_quantize_ref(kv, rope_dim) if swa_cache.dtype == torch.uint8 else kv.to(swa_cache.dtype)
    swa_cache.view(n_slots * window, row).index_copy_(0, slot * window + p % window, rows)


torch.library.impl("dsv4rt::swa_cache_write", "CompositeExplicitAutograd", swa_cache_write_ref)


def swa_cache_write(kv: Tensor, swa_cache: Tensor, req_slot: Tensor, positions: Tensor, end_pos: Tensor,
                    rope_dim: int) -> None:
    """Append a step's kv rows to the sliding rings (FP8 row layout when the cache is uint8).

    Shapes: kv [T, D]; swa_cache [S+1, W, D or fp8_row_bytes]; req_slot, positions, end_pos [T] int32.
    Mutates: swa_cache rows (slot, p mod W) for positions p >= end_pos - W; padded tokens go to slot S.
    Capture-safe.
    """
    torch.ops.dsv4rt.swa_cache_write.default(kv, swa_cache, req_slot, positions, end_pos, rope_dim)
