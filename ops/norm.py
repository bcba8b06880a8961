"""Row-norm and rotation family: the RMSNorms and RoPE rotations between the step's other ops.

Plain torch runs an RMSNorm as eight launches (cast, square, mean, add, rsqrt, two products, cast back) and a
rotation as about ten (slices, casts, four products, two sums, stack, cat); at decode each is a few microseconds of
launch-bound work, and a layer has nine of them. These ops do each in one launch (csrc/norm.cu) with the same
numerics: the rotations bit for bit, the norms up to the order of their fp32 sum of squares.

* `rms_norm(x, weight, eps)`: weight * (x * rsqrt(mean(x^2) + eps)) in fp32, returned in x's dtype.
* `rope_rotate(x, cos, sin, inverse)`: `ops.rope.rope_rotate` with the step's table (cos, sin).
* `head_norm_rope(x, cos, sin, eps)`: the attention query's per-head RMSNorm without weight (its factor rounded to
  x's dtype, as the model computes it), then the rotation.
* `kv_fp8_fake_quant(x, rope_dim)`: the kv row as the FP8 cache holds it (`ops.kv_quant.kv_fp8_fake_quant`).
* `idx_fp4_hadamard_fake_quant(x)`: the indexer query's Hadamard transform and FP4 rounding.
* `kv_norm_rope_quant(x, weight, cos, sin, eps, fp8)`: an attention layer's kv path, `rms_norm`, then `rope_rotate`,
  then (fp8) `kv_fp8_fake_quant`, in one launch and bit for bit with the three.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .kv_quant import hadamard
from .kv_quant import idx_fp4_fake_quant as _idx_fp4_fake_quant_plain
from .kv_quant import kv_fp8_fake_quant as _kv_fp8_fake_quant_plain
from .rope import rope_rotate as _rope_rotate_plain

torch.library.define("dsv4rt::rms_norm", "(Tensor x, Tensor weight, float eps) -> Tensor")
torch.library.define("dsv4rt::rope_rotate", "(Tensor x, Tensor cos, Tensor sin, bool inverse) -> Tensor")
torch.library.define("dsv4rt::head_norm_rope", "(Tensor x, Tensor cos, Tensor sin, float eps) -> Tensor")
torch.library.define("dsv4rt::kv_fp8_fake_quant", "(Tensor x, int rope_dim) -> Tensor")
torch.library.define("dsv4rt::idx_fp4_hadamard_fake_quant", "(Tensor x) -> Tensor")
torch.library.define("dsv4rt::kv_norm_rope_quant",
                     "(Tensor x, Tensor weight, Tensor cos, Tensor sin, float eps, bool fp8) -> Tensor")

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_x(op: str, x: Tensor, min_dim: int) -> None:
    torch._check(x.dtype in _DTYPES, lambda: f"{op}: x must be float32, bfloat16 or float16, got {x.dtype}")
    torch._check(x.dim() >= min_dim, lambda: f"{op}: x must have at least {min_dim} dims, got {tuple(x.shape)}")


def _check_table(op: str, x: Tensor, cos: Tensor, sin: Tensor) -> None:
    _check_x(op, x, 2)
    torch._check(cos.dtype == torch.float32 and sin.dtype == torch.float32,
                 lambda: f"{op}: cos and sin must be float32, got {cos.dtype} and {sin.dtype}")
    torch._check(cos.dim() == 2 and cos.shape == sin.shape and cos.shape[0] == x.shape[0],
                 lambda: f"{op}: cos and sin must be [T, rope_dim / 2] with T = {x.shape[0]}, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    torch._check(2 * cos.shape[1] <= x.shape[-1],
                 lambda: f"{op}: rope_dim {2 * cos.shape[1]} exceeds the row width {x.shape[-1]}")


def _check_weight(x: Tensor, weight: Tensor) -> None:
    _check_x("rms_norm", x, 1)
    torch._check(weight.dtype == torch.float32 and weight.dim() == 1 and weight.shape[0] == x.shape[-1],
                 lambda: f"rms_norm: weight must be float32 [{x.shape[-1]}], got {weight.dtype} {tuple(weight.shape)}")


def _check_heads(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    torch._check(x.dim() == 3, lambda: f"head_norm_rope: x must be [T, H, D], got {tuple(x.shape)}")
    _check_table("head_norm_rope", x, cos, sin)


def _check_fp8_row(x: Tensor, rope_dim: int) -> None:
    _check_x("kv_fp8_fake_quant", x, 1)
    nope = x.shape[-1] - rope_dim
    torch._check(rope_dim >= 0 and nope > 0 and nope % 64 == 0,
                 lambda: f"kv_fp8_fake_quant: width - rope_dim must be a positive multiple of 64, got width "
                         f"{x.shape[-1]} and rope_dim {rope_dim}")


def _check_fp4_row(x: Tensor) -> None:
    _check_x("idx_fp4_hadamard_fake_quant", x, 1)
    torch._check(x.shape[-1] in (32, 64, 128, 256),
                 lambda: f"idx_fp4_hadamard_fake_quant: the row width must be 32, 64, 128 or 256, got {x.shape[-1]}")


def _check_kv_path(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, fp8: bool) -> None:
    torch._check(x.dim() == 2, lambda: f"kv_norm_rope_quant: x must be [T, D], got {tuple(x.shape)}")
    _check_table("kv_norm_rope_quant", x, cos, sin)
    torch._check(weight.dtype == torch.float32 and weight.dim() == 1 and weight.shape[0] == x.shape[-1],
                 lambda: f"kv_norm_rope_quant: weight must be float32 [{x.shape[-1]}], got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    nope = x.shape[-1] - 2 * cos.shape[1]
    torch._check(not fp8 or (nope > 0 and nope % 64 == 0),
                 lambda: f"kv_norm_rope_quant: with fp8, width - rope_dim must be a positive multiple of 64, got "
                         f"width {x.shape[-1]} and rope_dim {2 * cos.shape[1]}")


@torch.library.register_fake("dsv4rt::kv_norm_rope_quant")
def _kv_norm_rope_quant_fake(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float, fp8: bool) -> Tensor:
    _check_kv_path(x, weight, cos, sin, fp8)
    return torch.empty_like(x)


@torch.library.register_fake("dsv4rt::kv_fp8_fake_quant")
def _kv_fp8_fake_quant_fake(x: Tensor, rope_dim: int) -> Tensor:
    _check_fp8_row(x, rope_dim)
    return torch.empty_like(x)


@torch.library.register_fake("dsv4rt::idx_fp4_hadamard_fake_quant")
def _idx_fp4_hadamard_fake_quant_fake(x: Tensor) -> Tensor:
    _check_fp4_row(x)
    return torch.empty_like(x)


@torch.library.register_fake("dsv4rt::rms_norm")
def _rms_norm_fake(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    _check_weight(x, weight)
    return torch.empty_like(x)


@torch.library.register_fake("dsv4rt::rope_rotate")
def _rope_rotate_fake(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    _check_table("rope_rotate", x, cos, sin)
    return torch.empty_like(x)


@torch.library.register_fake("dsv4rt::head_norm_rope")
def _head_norm_rope_fake(x: Tensor, cos: Tensor, sin: Tensor, eps: float) -> Tensor:
    _check_heads(x, cos, sin)
    return torch.empty_like(x)


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Reference: (weight * (x32 * rsqrt(mean(x32^2) + eps))).to(x.dtype), x32 = x in fp32, over the last dim."""
    _check_weight(x, weight)
    x32 = x.float()
    return (weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def rope_rotate_ref(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    """Reference: `ops.rope.rope_rotate(x, ..., inverse, table=(cos, sin))` (plain torch)."""
    _check_table("rope_rotate", x, cos, sin)
    return _rope_rotate_plain(x, None, None, inverse=inverse, table=(cos, sin))


def head_norm_rope_ref(x: Tensor, cos: Tensor, sin: Tensor, eps: float) -> Tensor:
    """Reference: x * rsqrt(mean(x32^2) + eps).to(x.dtype) per [t, h] row, then the rotation."""
    _check_heads(x, cos, sin)
    y = x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    return _rope_rotate_plain(y, None, None, table=(cos, sin))


def kv_fp8_fake_quant_ref(x: Tensor, rope_dim: int) -> Tensor:
    """Reference: `ops.kv_quant.kv_fp8_fake_quant` (what a row reads back from the FP8 cache layout)."""
    _check_fp8_row(x, rope_dim)
    return _kv_fp8_fake_quant_plain(x, rope_dim)


def idx_fp4_hadamard_fake_quant_ref(x: Tensor) -> Tensor:
    """Reference: `idx_fp4_fake_quant(hadamard(x)).to(x.dtype)` (the indexer query as the official model rounds it)."""
    _check_fp4_row(x)
    return _idx_fp4_fake_quant_plain(hadamard(x)).to(x.dtype)


def kv_norm_rope_quant_ref(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float, fp8: bool) -> Tensor:
    """Reference: rms_norm_ref, then rope_rotate_ref, then (fp8) kv_fp8_fake_quant_ref with rope_dim = 2 * half."""
    _check_kv_path(x, weight, cos, sin, fp8)
    y = rope_rotate_ref(rms_norm_ref(x, weight, eps), cos, sin, False)
    return kv_fp8_fake_quant_ref(y, 2 * cos.shape[1]) if fp8 else y


torch.library.impl("dsv4rt::kv_fp8_fake_quant", "CompositeExplicitAutograd", kv_fp8_fake_quant_ref)
torch.library.impl("dsv4rt::kv_norm_rope_quant", "CompositeExplicitAutograd", kv_norm_rope_quant_ref)
torch.library.impl("dsv4rt::idx_fp4_hadamard_fake_quant", "CompositeExplicitAutograd", idx_fp4_hadamard_fake_quant_ref)
torch.library.impl("dsv4rt::rms_norm", "CompositeExplicitAutograd", rms_norm_ref)
torch.library.impl("dsv4rt::rope_rotate", "CompositeExplicitAutograd", rope_rotate_ref)
torch.library.impl("dsv4rt::head_norm_rope", "CompositeExplicitAutograd", head_norm_rope_ref)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim with an fp32 weight.

    Shapes: x [..., D] float32/bfloat16/float16; weight [D] float32. Returns x's shape and dtype. Capture-safe.
    """
    return torch.ops.dsv4rt.rms_norm.default(x.contiguous(), weight, eps)


def rope_rotate(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """Rotate adjacent channel pairs of the last rope_dim = 2 * cos.shape[1] channels by the step's table.

    Shapes: x [T, ..., D]; cos, sin [T, rope_dim / 2] float32 (`ops.rope.rope_table`). Returns x's shape and dtype;
    `inverse` rotates by the negated angles. Capture-safe.
    """
    return torch.ops.dsv4rt.rope_rotate.default(x.contiguous(), cos, sin, inverse)


def head_norm_rope(x: Tensor, cos: Tensor, sin: Tensor, eps: float) -> Tensor:
    """Per-head RMSNorm without weight (the factor in x's dtype), then the rotation of the last rope_dim channels.

    Shapes: x [T, H, D]; cos, sin [T, rope_dim / 2] float32. Returns x's shape and dtype. Capture-safe.
    """
    return torch.ops.dsv4rt.head_norm_rope.default(x.contiguous(), cos, sin, eps)


def kv_fp8_fake_quant(x: Tensor, rope_dim: int) -> Tensor:
    """The FP8 row format's quantise-dequantise: the first width - rope_dim channels in blocks of 64 through e4m3
    with a power-of-two scale, the last rope_dim rounded to bf16.

    Shapes: x [..., width]. Returns x's shape and dtype. Capture-safe.
    """
    return torch.ops.dsv4rt.kv_fp8_fake_quant.default(x.contiguous(), rope_dim)


def idx_fp4_hadamard_fake_quant(x: Tensor) -> Tensor:
    """The normalised Hadamard transform of each row, then FP4 e2m1 quantise-dequantise in blocks of 32.

    Shapes: x [..., D], D in {32, 64, 128, 256}. Returns x's shape and dtype. Capture-safe.
    """
    return torch.ops.dsv4rt.idx_fp4_hadamard_fake_quant.default(x.contiguous())


def kv_norm_rope_quant(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float, fp8: bool) -> Tensor:
    """An attention layer's kv path: RMSNorm with an fp32 weight, the rotation of the last rope_dim = 2 * cos.shape[1]
    channels, then with `fp8` the FP8 row format's quantise-dequantise; one launch on CUDA.

    Shapes: x [T, D]; weight [D] float32; cos, sin [T, rope_dim / 2] float32. Returns x's shape and dtype.
    Capture-safe.
    """
    return torch.ops.dsv4rt.kv_norm_rope_quant.default(x.contiguous(), weight, cos, sin, eps, fp8)
