"""KV quantisation family: the official FP8 row layout and the FP4 indexer-key layout.

FP8 row (sliding rows, CSA/HCA main entries), width = nope + rope:
    bytes [0, nope)              nope dims as FP8 e4m3, blocks of 64, each scaled by its own power of two
    bytes [nope, nope + 2*rope)  rope dims as bf16
    bytes [.., + n_blocks)       one ue8m0 exponent byte per block (scale = 2^(byte - 127)), padded to 8
For width 512 / rope 64 that is 448 + 128 + 8 = 584 bytes.

FP4 row (indexer keys after the Hadamard rotation), width d:
    bytes [0, d/2)               e2m1 codes, two per byte, low nibble = even element
    bytes [d/2, d/2 + d/32)      one ue8m0 exponent byte per block of 32
For d = 128 that is 64 + 4 = 68 bytes.

Rounding matches the official fake-quant: amax floored (1e-4 for FP8, 6 * 2^-126 for FP4),
scale = 2^ceil(log2(amax / qmax)), round to nearest even.
"""
from __future__ import annotations

import torch
from torch import Tensor

FP8_BLOCK = 64
FP4_BLOCK = 32
FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_AMAX_FLOOR = 1e-4
FP4_AMAX_FLOOR = 6.0 * 2.0**-126



def fp8_row_bytes(width: int, rope_dim: int) -> int:
    nope = width - rope_dim
    if nope <= 0 or nope % FP8_BLOCK:
        raise ValueError(f"fp8 KV layout needs width - rope_dim to be a positive multiple of {FP8_BLOCK}, got {nope}")
    n_blocks = nope // FP8_BLOCK
    return nope + 2 * rope_dim + (n_blocks + 7) // 8 * 8


def fp4_row_bytes(width: int) -> int:
    if width % FP4_BLOCK or width & (width - 1):
        raise ValueError(f"fp4 indexer layout needs a power-of-two width divisible by {FP4_BLOCK}, got {width}")
    return width // 2 + width // FP4_BLOCK


def _pow2_scale(amax: Tensor, qmax: float) -> Tensor:
    return torch.exp2(torch.ceil(torch.log2(amax / qmax)))


def hadamard(x: Tensor) -> Tensor:
    """Normalised Walsh-Hadamard transform (Sylvester order) over the last dim, in fp32."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    y = x.float()
    h = 1
    while h < n:
        y = y.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return y.reshape(*lead, n) * (n**-0.5)


# ---------------------------------------------------------------- FP8 rows
def kv_fp8_quantize_ref(x: Tensor, rope_dim: int) -> Tensor:
    width = x.shape[-1]
    row = fp8_row_bytes(width, rope_dim)
    nope = width - rope_dim
    nb = nope // FP8_BLOCK
    lead = x.shape[:-1]
    xb = x[..., :nope].float().reshape(*lead, nb, FP8_BLOCK)
    scale = _pow2_scale(xb.abs().amax(-1).clamp_min(FP8_AMAX_FLOOR), FP8_MAX)  # [..., nb]
    q = (xb / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q_bytes = q.view(torch.uint8).reshape(*lead, nope)
    rope_bytes = x[..., nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    exp_bytes = (torch.log2(scale) + 127).to(torch.uint8)
    pad = torch.zeros(*lead, row - nope - 2 * rope_dim - nb, dtype=torch.uint8, device=x.device)
    return torch.cat((q_bytes, rope_bytes, exp_bytes, pad), dim=-1)


def kv_fp8_dequantize_ref(q: Tensor, width: int, rope_dim: int, dtype: torch.dtype) -> Tensor:
    nope = width - rope_dim
    nb = nope // FP8_BLOCK
    lead = q.shape[:-1]
    vals = q[..., :nope].contiguous().view(torch.float8_e4m3fn).float().reshape(*lead, nb, FP8_BLOCK)
    scale = torch.exp2(q[..., nope + 2 * rope_dim : nope + 2 * rope_dim + nb].float() - 127)
    nope_vals = (vals * scale.unsqueeze(-1)).reshape(*lead, nope)
    rope_vals = q[..., nope : nope + 2 * rope_dim].contiguous().view(torch.bfloat16).float()
    return torch.cat((nope_vals, rope_vals), dim=-1).to(dtype)


def bf16_round(x: Tensor) -> Tensor:
    """fp32 values rounded to bf16 (nearest even), kept in fp32. Integer arithmetic on purpose: Inductor
    keeps `x.to(bfloat16).float()` in fp32 inside fused kernels (emulate_precision_casts is off)."""
    bits = x.float().view(torch.int32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).view(torch.float32)


def kv_fp8_fake_quant(x: Tensor, rope_dim: int) -> Tensor:
    """Pure-torch quantise-dequantise of the FP8 row layout, written independently of the byte layout."""
    width = x.shape[-1]
    nope = width - rope_dim
    lead = x.shape[:-1]
    xb = x[..., :nope].float().reshape(*lead, nope // FP8_BLOCK, FP8_BLOCK)
    scale = _pow2_scale(xb.abs().amax(-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR), FP8_MAX)
    deq = (xb / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale
    rope = bf16_round(x[..., nope:])
    return torch.cat((deq.reshape(*lead, nope), rope), dim=-1).to(x.dtype)


# ---------------------------------------------------------------- FP4 rows
def _e2m1_encode(y: Tensor) -> Tensor:
    """Round-to-nearest-even onto the e2m1 grid; y already scaled into [-6, 6]. Returns uint8 codes."""
    a = y.abs()
    mag = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0))
    return mag.to(torch.uint8) | ((y < 0).to(torch.uint8) << 3)


def _e2m1_magnitude(code: Tensor) -> Tensor:
    """Value of e2m1 magnitude codes 0..7 (0, 0.5, 1, 1.5, 2, 3, 4, 6), computed, not looked up: a table
    built from Python data inside a captured step would be a host-to-device copy."""
    exp, man = (code >> 1).float(), (code & 1).float()
    return torch.where(exp == 0, 0.5 * man, torch.exp2(exp - 1) * (1 + 0.5 * man))


def _e2m1_decode(codes: Tensor) -> Tensor:
    mag = _e2m1_magnitude(codes & 7)
    return torch.where((codes & 8) != 0, -mag, mag)


def idx_fp4_quantize_ref(x: Tensor) -> Tensor:
    width = x.shape[-1]
    fp4_row_bytes(width)
    nb = width // FP4_BLOCK
    lead = x.shape[:-1]
    xb = x.float().reshape(*lead, nb, FP4_BLOCK)
    scale = _pow2_scale(xb.abs().amax(-1).clamp_min(FP4_AMAX_FLOOR), FP4_MAX)
    codes = _e2m1_encode(xb / scale.unsqueeze(-1)).reshape(*lead, width)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    exp_bytes = (torch.log2(scale) + 127).to(torch.uint8)
    return torch.cat((packed, exp_bytes), dim=-1)


def idx_fp4_dequantize_ref(q: Tensor, width: int, dtype: torch.dtype) -> Tensor:
    nb = width // FP4_BLOCK
    lead = q.shape[:-1]
    packed = q[..., : width // 2]
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*lead, nb, FP4_BLOCK)
    scale = torch.exp2(q[..., width // 2 : width // 2 + nb].float() - 127)
    return (_e2m1_decode(codes) * scale.unsqueeze(-1)).reshape(*lead, width).to(dtype)


def idx_fp4_fake_quant(x: Tensor) -> Tensor:
    """Pure-torch FP4 quantise-dequantise (no Hadamard), written independently of the byte layout.

    The nearest e2m1 magnitude with ties to the even code, in arithmetic: the magnitudes lie 0.5 apart below 2, 1
    apart in [2, 4] and 2 apart in [4, 6], and in each span the even codes are the even multiples of the step, so
    round-half-even of |y| / step picks the code. Elementwise on x's shape (a nearest-of-8 search would build 8
    copies of it: at a 2,048-token prefill chunk, an int64 tensor of 1 GB for the indexer's q)."""
    width = x.shape[-1]
    lead = x.shape[:-1]
    xb = x.float().reshape(*lead, width // FP4_BLOCK, FP4_BLOCK)
    scale = _pow2_scale(xb.abs().amax(-1, keepdim=True).clamp_min(FP4_AMAX_FLOOR), FP4_MAX)
    y = xb / scale  # |y| <= 6
    a = y.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    mag = (torch.round(a / step) * step).clamp_max(FP4_MAX)
    return (torch.copysign(mag, y) * scale).reshape(*lead, width).to(x.dtype)


# ---------------------------------------------------------------- ops
torch.library.define("dsv4rt::kv_fp8_quantize", "(Tensor x, int rope_dim) -> Tensor")
torch.library.define("dsv4rt::kv_fp8_dequantize", "(Tensor q, int width, int rope_dim, ScalarType dtype) -> Tensor")
torch.library.define("dsv4rt::idx_fp4_quantize", "(Tensor x) -> Tensor")
torch.library.define("dsv4rt::idx_fp4_dequantize", "(Tensor q, int width, ScalarType dtype) -> Tensor")


@torch.library.register_fake("dsv4rt::kv_fp8_quantize")
def _kv_fp8_quantize_fake(x: Tensor, rope_dim: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], fp8_row_bytes(x.shape[-1], rope_dim)), dtype=torch.uint8)


@torch.library.register_fake("dsv4rt::kv_fp8_dequantize")
def _kv_fp8_dequantize_fake(q: Tensor, width: int, rope_dim: int, dtype: torch.dtype) -> Tensor:
    torch._check(q.dtype == torch.uint8)
    torch._check(q.shape[-1] == fp8_row_bytes(width, rope_dim))
    return q.new_empty((*q.shape[:-1], width), dtype=dtype)


@torch.library.register_fake("dsv4rt::idx_fp4_quantize")
def _idx_fp4_quantize_fake(x: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], fp4_row_bytes(x.shape[-1])), dtype=torch.uint8)


@torch.library.register_fake("dsv4rt::idx_fp4_dequantize")
def _idx_fp4_dequantize_fake(q: Tensor, width: int, dtype: torch.dtype) -> Tensor:
    torch._check(q.dtype == torch.uint8)
    torch._check(q.shape[-1] == fp4_row_bytes(width))
    return q.new_empty((*q.shape[:-1], width), dtype=dtype)


torch.library.impl("dsv4rt::kv_fp8_quantize", "CompositeExplicitAutograd", kv_fp8_quantize_ref)
torch.library.impl("dsv4rt::kv_fp8_dequantize", "CompositeExplicitAutograd", kv_fp8_dequantize_ref)
torch.library.impl("dsv4rt::idx_fp4_quantize", "CompositeExplicitAutograd", idx_fp4_quantize_ref)
torch.library.impl("dsv4rt::idx_fp4_dequantize", "CompositeExplicitAutograd", idx_fp4_dequantize_ref)


def kv_fp8_quantize(x: Tensor, rope_dim: int) -> Tensor:
    """Quantise rows to the FP8 row layout.

    Shapes: x [..., W] float -> [..., fp8_row_bytes(W, rope_dim)] uint8. Mutates: nothing.
    """
    return torch.ops.dsv4rt.kv_fp8_quantize.default(x, rope_dim)


def kv_fp8_dequantize(q: Tensor, width: int, rope_dim: int, dtype: torch.dtype) -> Tensor:
    """Dequantise FP8 rows. Shapes: q [..., row_bytes] uint8 -> [..., width] dtype. Mutates: nothing."""
    return torch.ops.dsv4rt.kv_fp8_dequantize.default(q, width, rope_dim, dtype)


def idx_fp4_quantize(x: Tensor) -> Tensor:
    """Quantise (already Hadamard-rotated) indexer keys to FP4 rows. Shapes: [..., d] -> [..., d/2 + d/32] uint8."""
    return torch.ops.dsv4rt.idx_fp4_quantize.default(x)


def idx_fp4_dequantize(q: Tensor, width: int, dtype: torch.dtype) -> Tensor:
    """Dequantise FP4 rows. Shapes: q [..., d/2 + d/32] uint8 -> [..., d] dtype. Mutates: nothing."""
    return torch.ops.dsv4rt.idx_fp4_dequantize.default(q, width, dtype)


# How a cache stores rows: as computed, the real byte layouts, or simulated (fake-quantised values in the
# activation dtype, computed by the pure-torch fake-quant above; the oracle for the byte layouts).
QUANT_NONE, QUANT_FP8, QUANT_FP4, QUANT_FP8_SIM, QUANT_FP4_SIM = 0, 1, 2, 3, 4


def load_rows(cache_rows: Tensor, width: int, rope_dim: int, quant: int, dtype: torch.dtype) -> Tensor:
    """Rows read from a cache, as `dtype`: byte layouts (1, 2) are dequantised, other formats read as stored."""
    if quant == QUANT_FP8:
        return kv_fp8_dequantize_ref(cache_rows, width, rope_dim, dtype)
    if quant == QUANT_FP4:
        return idx_fp4_dequantize_ref(cache_rows, width, dtype)
    return cache_rows.to(dtype)


def store_rows(rows: Tensor, rope_dim: int, quant: int, cache_dtype: torch.dtype) -> Tensor:
    """Rows in the cache's format (FP4 formats rotate by the Hadamard transform first)."""
    if quant == QUANT_FP8:
        return kv_fp8_quantize_ref(rows, rope_dim)
    if quant == QUANT_FP4:
        return idx_fp4_quantize_ref(hadamard(rows))
    if quant == QUANT_FP8_SIM:
        return kv_fp8_fake_quant(rows, rope_dim).to(cache_dtype)
    if quant == QUANT_FP4_SIM:
        return idx_fp4_fake_quant(hadamard(rows)).to(cache_dtype)
    return rows.to(cache_dtype)
