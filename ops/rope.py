"""Interleaved partial RoPE on the trailing `rope_dim` channels (plain torch; used by references and the model)."""
from __future__ import annotations

import torch
from torch import Tensor


def rope_table(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin of positions * inv_freq, fp32 [T, rd/2]: what `rope_rotate` rotates by. A step computes each
    table once and hands it to every rotation of its layers (four a layer), instead of five ops each."""
    ang = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, rd/2]
    return torch.cos(ang), torch.sin(ang)


def rope_rotate(x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool = False,
                table: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Rotate adjacent channel pairs of the last 2*len(inv_freq) channels by positions * inv_freq (fp32).

    Shapes: x [T, ..., D]; positions [T] (int or float); inv_freq [rd/2] fp32. Returns x's shape and dtype.
    `table`: `rope_table(positions, inv_freq)`, when the caller has it (the same values). `inverse` rotates by the
    negated angles (a*cos + b*sin, b*cos - a*sin: bit for bit the rotation by -sin).
    """
    cos, sin = table if table is not None else rope_table(positions, inv_freq)
    rd = 2 * cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    nope, rope = x[..., :-rd], x[..., -rd:].float()
    a, b = rope[..., 0::2], rope[..., 1::2]
    if inverse:
        rotated = torch.stack((a * cos + b * sin, b * cos - a * sin), dim=-1).flatten(-2)
    else:
        rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    return torch.cat((nope, rotated.to(x.dtype)), dim=-1)
