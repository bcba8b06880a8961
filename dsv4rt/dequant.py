"""Weight formats of the official DeepSeek-V4 checkpoint (spec §11.2): decode at load, encode for test writers.

FP8: e4m3 values [out, in] with one ue8m0 (power-of-two) scale per 128x128 block, `scale [ceil(out/128),
ceil(in/128)]`. FP4: e2m1 codes packed two per byte, `int8 [out, in/2]`, the low nibble holding the even column
(element 2k) and the high nibble element 2k+1, with one ue8m0 scale per 32 elements along K, `scale [out, in/32]`.
A ue8m0 byte b means 2^(b-127).

Weights are decoded into the runtime's compute dtype at load. Both decodings are exact in bfloat16 and float32
(a 3- or 1-bit mantissa times a power of two, barring scales near 2^-127), so dequantised weights equal the
quantised values; quantised execution can later replace these functions without changing the checkpoint reader.
"""
from __future__ import annotations

import torch
from torch import Tensor

FP8_BLOCK = 128  # FP8 weight scale block, both dims
FP4_BLOCK = 32   # FP4 weight scale block, along K
FP8_MAX = 448.0  # largest finite e4m3 value
FP4_MAX = 6.0    # largest e2m1 value
E8M0_BIAS = 127

# e2m1 code -> value; codes 8..15 are the negatives of 0..7 (8 is -0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_E2M1_MIDPOINTS = tuple((lo + hi) / 2 for lo, hi in zip(E2M1_VALUES[:7], E2M1_VALUES[1:8]))


def e8m0_to_float(scale: Tensor) -> Tensor:
    """ue8m0 scales (float8_e8m0fnu, or their uint8 bytes) as float32 powers of two."""
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e8m0fnu)
    return scale.float()


def dequant_fp8_block(weight: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """FP8 e4m3 weight with 128x128 block scales -> `dtype`.

    Shapes: weight [out, in] float8_e4m3fn, scale [ceil(out/128), ceil(in/128)] float8_e8m0fnu -> [out, in].
    """
    out_f, in_f = weight.shape
    s = e8m0_to_float(scale)
    s = s.repeat_interleave(FP8_BLOCK, 0)[:out_f].repeat_interleave(FP8_BLOCK, 1)[:, :in_f]
    return (weight.float() * s).to(dtype)


def dequant_fp4(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Packed FP4 e2m1 weight with per-32 scales -> `dtype`.

    Shapes: packed [out, in/2] int8 (or uint8), scale [out, in/32] float8_e8m0fnu -> [out, in].
    """
    out_f = packed.shape[0]
    b = packed.view(torch.uint8)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(-1)  # low nibble = even column
    w = table.index_select(0, codes.long()).view(out_f, -1)
    s = e8m0_to_float(scale).repeat_interleave(FP4_BLOCK, 1)
    return (w * s).to(dtype)


# ---------------------------------------------------------------------------- encoders (checkpoint writers)
def _ceil_log2(x: Tensor) -> Tensor:
    """Exact ceil(log2(x)) for positive float32 x (frexp: x = m * 2^e, m in [0.5, 1))."""
    m, e = torch.frexp(x)
    return e - (m == 0.5).to(e.dtype)


def _e8m0(exponent: Tensor) -> Tensor:
    return (exponent.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)


def quant_fp8_block(weight: Tensor) -> tuple[Tensor, Tensor]:
    """`weight` [out, in] -> (float8_e4m3fn [out, in], float8_e8m0fnu [ceil(out/128), ceil(in/128)]).

    Scale per block: 2^ceil(log2(amax / 448)), the official power-of-two rule, so no value saturates.
    """
    w = weight.float()
    out_f, in_f = w.shape
    rb, cb = -(-out_f // FP8_BLOCK), -(-in_f // FP8_BLOCK)
    padded = w.new_zeros(rb * FP8_BLOCK, cb * FP8_BLOCK)
    padded[:out_f, :in_f] = w
    amax = padded.abs().view(rb, FP8_BLOCK, cb, FP8_BLOCK).amax(dim=(1, 3))
    exponent = _ceil_log2(amax.clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX)
    scale = _e8m0(exponent)
    s = e8m0_to_float(scale).repeat_interleave(FP8_BLOCK, 0)[:out_f].repeat_interleave(FP8_BLOCK, 1)[:, :in_f]
    q = (w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quant_fp4(weight: Tensor) -> tuple[Tensor, Tensor]:
    """`weight` [out, in] (in divisible by 32) -> (packed int8 [out, in/2], float8_e8m0fnu [out, in/32]).

    Scale per 32: 2^ceil(log2(amax / 6)); each value rounds to the nearest e2m1 magnitude.
    """
    w = weight.float()
    out_f, in_f = w.shape
    if in_f % FP4_BLOCK:
        raise ValueError(f"FP4 needs the input dim to be a multiple of {FP4_BLOCK}, got {in_f}")
    blocks = w.view(out_f, in_f // FP4_BLOCK, FP4_BLOCK)
    amax = blocks.abs().amax(-1)
    scale = _e8m0(_ceil_log2(amax.clamp(min=torch.finfo(torch.float32).tiny) / FP4_MAX))
    v = (blocks / e8m0_to_float(scale).unsqueeze(-1)).reshape(out_f, in_f)
    a = v.abs()
    code = torch.zeros_like(a, dtype=torch.uint8)
    for mid in _E2M1_MIDPOINTS:  # codes 0..7 are the magnitudes in increasing order; ties round down
        code += (a > mid).to(torch.uint8)
    code = code | ((v < 0).to(torch.uint8) << 3)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.view(torch.int8), scale
