"""Interleaved partial RoPE on the trailing `rope_dim` channels (plain torch; used by references and the model)."""
from __future__ import annotations

import torch
from torch import Tensor


def rope_rotate(x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool = False) -> Tensor:
    """Rotate adjacent channel pairs of the last 2*len(inv_freq) channels by positions * inv_freq (fp32).

    Shapes: x [T, ..., D]; positions [T] (int or float); inv_freq [rd/2] fp32. Returns x's shape and dtype.
    """
    rd = 2 * inv_freq.shape[0]
    ang = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, rd/2]
    cos, sin = torch.cos(ang), torch.sin(ang)
    if inverse:
        sin = -sin
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    nope, rope = x[..., :-rd], x[..., -rd:].float()
    a, b = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    return torch.cat((nope, rotated.to(x.dtype)), dim=-1)
