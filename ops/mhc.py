"""Manifold-constrained hyper-connection family: hc_pre (mix, Sinkhorn, collapse), hc_post, hyper head. All fp32.

hc_pre and hc_head take an optional `norm_weight`: the collapsed row then goes through rms_norm(., norm_weight,
out_eps) in the same launch (the block's input / post-attention norm, the model's final norm). hc_post_pre is an
hc_post followed by the next hc_pre on its output (the boundary between two sublayers): on CUDA at decode the post
runs inside the pre's partial grid, one grid fewer."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .norm import rms_norm_ref

torch.library.define(
    "dsv4rt::hc_pre",
    "(Tensor x, Tensor fn, Tensor base, Tensor scale, int iters, float eps, float norm_eps, Tensor? norm_weight=None, "
    "float out_eps=0.0) -> (Tensor, Tensor, Tensor)",
)
torch.library.define("dsv4rt::hc_post", "(Tensor x, Tensor y, Tensor post, Tensor comb) -> Tensor")
torch.library.define(
    "dsv4rt::hc_post_pre",
    "(Tensor x, Tensor y, Tensor post, Tensor comb, Tensor fn, Tensor base, Tensor scale, int iters, float eps, "
    "float norm_eps, Tensor? norm_weight=None, float out_eps=0.0) -> (Tensor, Tensor, Tensor, Tensor)",
)
torch.library.define(
    "dsv4rt::hc_head",
    "(Tensor x, Tensor fn, Tensor base, Tensor scale, float eps, float norm_eps, Tensor? norm_weight=None, "
    "float out_eps=0.0) -> Tensor",
)


@torch.library.register_fake("dsv4rt::hc_pre")
def _hc_pre_fake(x, fn, base, scale, iters, eps, norm_eps, norm_weight=None, out_eps=0.0):
    torch._check(x.dim() == 3)
    _check_norm_weight("hc_pre", x, norm_weight)
    t, n, d = x.shape
    torch._check(fn.shape[0] == (2 + n) * n and fn.shape[1] == n * d)
    return (x.new_empty((t, d)), x.new_empty((t, n), dtype=torch.float32),
            x.new_empty((t, n, n), dtype=torch.float32))


@torch.library.register_fake("dsv4rt::hc_post")
def _hc_post_fake(x, y, post, comb):
    torch._check(x.dim() == 3 and y.shape == (x.shape[0], x.shape[2]))
    return torch.empty_like(x)


@torch.library.register_fake("dsv4rt::hc_post_pre")
def _hc_post_pre_fake(x, y, post, comb, fn, base, scale, iters, eps, norm_eps, norm_weight=None, out_eps=0.0):
    streams = _hc_post_fake(x, y, post, comb)
    return (streams, *_hc_pre_fake(streams, fn, base, scale, iters, eps, norm_eps, norm_weight, out_eps))


@torch.library.register_fake("dsv4rt::hc_head")
def _hc_head_fake(x, fn, base, scale, eps, norm_eps, norm_weight=None, out_eps=0.0):
    torch._check(x.dim() == 3 and fn.shape[0] == x.shape[1])
    _check_norm_weight("hc_head", x, norm_weight)
    return x.new_empty((x.shape[0], x.shape[2]))


def _check_norm_weight(op: str, x: Tensor, w: Optional[Tensor]) -> None:
    if w is not None:
        torch._check(w.dtype == torch.float32 and w.dim() == 1 and w.shape[0] == x.shape[-1],
                     lambda: f"{op}: norm_weight must be float32 [{x.shape[-1]}], got {w.dtype} {tuple(w.shape)}")


def _out_norm(op: str, out: Tensor, w: Optional[Tensor], eps: float) -> Tensor:
    if w is None:
        return out
    _check_norm_weight(op, out, w)
    return rms_norm_ref(out, w, eps)


def _mix(x: Tensor, fn: Tensor, norm_eps: float) -> Tensor:
    flat = x.reshape(x.shape[0], -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return flat @ fn.float().t()


def hc_pre_ref(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, iters: int, eps: float, norm_eps: float,
               norm_weight: Optional[Tensor] = None, out_eps: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    n = x.shape[1]
    mix = _mix(x, fn, norm_eps)
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(pre_w * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + base[n : 2 * n])
    comb = torch.softmax(comb_w.reshape(-1, n, n) * scale[2] + base[2 * n :].reshape(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)
    return _out_norm("hc_pre", collapsed, norm_weight, out_eps), post, comb


def hc_post_ref(x: Tensor, y: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    # X'[k] = post[k] * y + sum_j comb[j, k] * X[j]  (j source stream, k destination)
    out = post.unsqueeze(-1) * y.float().unsqueeze(1) + torch.einsum("tjk,tjd->tkd", comb, x.float())
    return out.to(x.dtype)


def hc_post_pre_ref(x: Tensor, y: Tensor, post: Tensor, comb: Tensor, fn: Tensor, base: Tensor, scale: Tensor,
                    iters: int, eps: float, norm_eps: float, norm_weight: Optional[Tensor] = None,
                    out_eps: float = 0.0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    streams = hc_post_ref(x, y, post, comb)
    return (streams, *hc_pre_ref(streams, fn, base, scale, iters, eps, norm_eps, norm_weight, out_eps))


def hc_head_ref(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, eps: float, norm_eps: float,
                norm_weight: Optional[Tensor] = None, out_eps: float = 0.0) -> Tensor:
    mix = _mix(x, fn, norm_eps)
    pre = torch.sigmoid(mix * scale.float() + base.float()) + eps
    return _out_norm("hc_head", (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype), norm_weight, out_eps)


torch.library.impl("dsv4rt::hc_pre", "CompositeExplicitAutograd", hc_pre_ref)
torch.library.impl("dsv4rt::hc_post", "CompositeExplicitAutograd", hc_post_ref)
torch.library.impl("dsv4rt::hc_head", "CompositeExplicitAutograd", hc_head_ref)
torch.library.impl("dsv4rt::hc_post_pre", "CompositeExplicitAutograd", hc_post_pre_ref)


def hc_pre(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, iters: int, eps: float, norm_eps: float,
           norm_weight: Optional[Tensor] = None, out_eps: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """Shapes: x [T, n, D]; fn [(2+n)n, nD]; base [(2+n)n]; scale [3] -> x [T, D], post [T, n], comb [T, n, n] fp32.
    With norm_weight ([D] fp32) the returned x is rms_norm(x, norm_weight, out_eps)."""
    return torch.ops.dsv4rt.hc_pre.default(x, fn, base, scale, iters, eps, norm_eps, norm_weight, out_eps)


def hc_post(x: Tensor, y: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """Shapes: x [T, n, D]; y [T, D]; post [T, n]; comb [T, n, n] -> [T, n, D] (fp32 math, one cast)."""
    return torch.ops.dsv4rt.hc_post.default(x, y, post, comb)


def hc_post_pre(x: Tensor, y: Tensor, post: Tensor, comb: Tensor, fn: Tensor, base: Tensor, scale: Tensor,
                iters: int, eps: float, norm_eps: float, norm_weight: Optional[Tensor] = None,
                out_eps: float = 0.0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """hc_post(x, y, post, comb) -> streams [T, n, D], then hc_pre(streams, fn, ...): returns (streams, x [T, D],
    post [T, n], comb [T, n, n])."""
    return torch.ops.dsv4rt.hc_post_pre.default(x, y, post, comb, fn, base, scale, iters, eps, norm_eps, norm_weight,
                                                out_eps)


def hc_head(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, eps: float, norm_eps: float,
            norm_weight: Optional[Tensor] = None, out_eps: float = 0.0) -> Tensor:
    """Shapes: x [T, n, D]; fn [n, nD]; base [n]; scale [1] -> [T, D]; with norm_weight, rms_norm'd as hc_pre."""
    return torch.ops.dsv4rt.hc_head.default(x, fn, base, scale, eps, norm_eps, norm_weight, out_eps)
