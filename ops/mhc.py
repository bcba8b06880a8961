"""Manifold-constrained hyper-connection family: hc_pre (mix, Sinkhorn, collapse), hc_post, hyper head. All fp32."""
from __future__ import annotations

import torch
from torch import Tensor

torch.library.define(
    "dsv4rt::hc_pre",
    "(Tensor x, Tensor fn, Tensor base, Tensor scale, int iters, float eps, float norm_eps) -> (Tensor, Tensor, Tensor)",
)
torch.library.define("dsv4rt::hc_post", "(Tensor x, Tensor y, Tensor post, Tensor comb) -> Tensor")
torch.library.define(
    "dsv4rt::hc_head", "(Tensor x, Tensor fn, Tensor base, Tensor scale, float eps, float norm_eps) -> Tensor"
)


@torch.library.register_fake("dsv4rt::hc_pre")
def _hc_pre_fake(x, fn, base, scale, iters, eps, norm_eps):
    torch._check(x.dim() == 3)
    t, n, d = x.shape
    torch._check(fn.shape[0] == (2 + n) * n and fn.shape[1] == n * d)
    return (x.new_empty((t, d)), x.new_empty((t, n), dtype=torch.float32),
            x.new_empty((t, n, n), dtype=torch.float32))


@torch.library.register_fake("dsv4rt::hc_post")
def _hc_post_fake(x, y, post, comb):
    torch._check(x.dim() == 3 and y.shape == (x.shape[0], x.shape[2]))
    return torch.empty_like(x)


@torch.library.register_fake("dsv4rt::hc_head")
def _hc_head_fake(x, fn, base, scale, eps, norm_eps):
    torch._check(x.dim() == 3 and fn.shape[0] == x.shape[1])
    return x.new_empty((x.shape[0], x.shape[2]))


def _mix(x: Tensor, fn: Tensor, norm_eps: float) -> Tensor:
    flat = x.reshape(x.shape[0], -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return flat @ fn.float().t()


def hc_pre_ref(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, iters: int, eps: float,
               norm_eps: float) -> tuple[Tensor, Tensor, Tensor]:
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
    return collapsed, post, comb


def hc_post_ref(x: Tensor, y: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    # X'[k] = post[k] * y + sum_j comb[j, k] * X[j]  (j source stream, k destination)
    out = post.unsqueeze(-1) * y.float().unsqueeze(1) + torch.einsum("tjk,tjd->tkd", comb, x.float())
    return out.to(x.dtype)


def hc_head_ref(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, eps: float, norm_eps: float) -> Tensor:
    mix = _mix(x, fn, norm_eps)
    pre = torch.sigmoid(mix * scale.float() + base.float()) + eps
    return (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)


torch.library.impl("dsv4rt::hc_pre", "CompositeExplicitAutograd", hc_pre_ref)
torch.library.impl("dsv4rt::hc_post", "CompositeExplicitAutograd", hc_post_ref)
torch.library.impl("dsv4rt::hc_head", "CompositeExplicitAutograd", hc_head_ref)


def hc_pre(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, iters: int, eps: float,
           norm_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Shapes: x [T, n, D]; fn [(2+n)n, nD]; base [(2+n)n]; scale [3] -> x [T, D], post [T, n], comb [T, n, n] fp32."""
    return torch.ops.dsv4rt.hc_pre.default(x, fn, base, scale, iters, eps, norm_eps)


def hc_post(x: Tensor, y: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """Shapes: x [T, n, D]; y [T, D]; post [T, n]; comb [T, n, n] -> [T, n, D] (fp32 math, one cast)."""
    return torch.ops.dsv4rt.hc_post.default(x, y, post, comb)


def hc_head(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, eps: float, norm_eps: float) -> Tensor:
    """Shapes: x [T, n, D]; fn [n, nD]; base [n]; scale [1] -> [T, D]."""
    return torch.ops.dsv4rt.hc_head.default(x, fn, base, scale, eps, norm_eps)
