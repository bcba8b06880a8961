"""MoE family: top-k router (sqrt-softplus, bias for selection only), hash router, routed experts.

Routing weights come from the unbiased scores, renormalised over the chosen experts and multiplied
by the routed scaling factor. Experts use the clamped SwiGLU: silu(min(g, L)) * clamp(u, -L, L).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

torch.library.define("dsv4rt::moe_route", "(Tensor logits, Tensor bias, int topk, float scale) -> (Tensor, Tensor)")
torch.library.define(
    "dsv4rt::moe_hash_route", "(Tensor logits, Tensor tid2eid, Tensor token_ids, float scale) -> (Tensor, Tensor)"
)
torch.library.define(
    "dsv4rt::moe_experts", "(Tensor x, Tensor w13, Tensor w2, Tensor weights, Tensor ids, float limit) -> Tensor"
)


@torch.library.register_fake("dsv4rt::moe_route")
def _moe_route_fake(logits, bias, topk, scale):
    torch._check(logits.dim() == 2 and bias.shape[0] == logits.shape[1])
    t = logits.shape[0]
    return logits.new_empty((t, topk), dtype=torch.float32), logits.new_empty((t, topk), dtype=torch.int32)


@torch.library.register_fake("dsv4rt::moe_hash_route")
def _moe_hash_route_fake(logits, tid2eid, token_ids, scale):
    torch._check(logits.dim() == 2 and token_ids.shape[0] == logits.shape[0])
    t, k = logits.shape[0], tid2eid.shape[1]
    return logits.new_empty((t, k), dtype=torch.float32), logits.new_empty((t, k), dtype=torch.int32)


@torch.library.register_fake("dsv4rt::moe_experts")
def _moe_experts_fake(x, w13, w2, weights, ids, limit):
    torch._check(x.dim() == 2 and w13.dim() == 3 and w2.dim() == 3)
    torch._check(w13.shape[2] == x.shape[1] and w2.shape[1] == x.shape[1] and w13.shape[1] == 2 * w2.shape[2])
    torch._check(weights.shape == ids.shape and ids.shape[0] == x.shape[0])
    return torch.empty_like(x)


def sqrt_softplus(z: Tensor) -> Tensor:
    return torch.sqrt(F.softplus(z.float()))


def _renorm(scores: Tensor, ids: Tensor, scale: float) -> Tensor:
    w = scores.gather(1, ids)
    return w / w.sum(-1, keepdim=True) * scale


def moe_route_ref(logits: Tensor, bias: Tensor, topk: int, scale: float) -> tuple[Tensor, Tensor]:
    scores = sqrt_softplus(logits)
    ids = torch.topk(scores + bias.float(), topk, dim=-1).indices
    return _renorm(scores, ids, scale), ids.to(torch.int32)


def moe_hash_route_ref(logits: Tensor, tid2eid: Tensor, token_ids: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    scores = sqrt_softplus(logits)
    ids = tid2eid[token_ids.long()].long()
    return _renorm(scores, ids, scale), ids.to(torch.int32)


def clamped_swiglu(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


EXPERT_GROUP = 16  # experts per batched matmul in the reference: bounds its temporaries, keeps the trace short


def moe_experts_ref(x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor, ids: Tensor, limit: float) -> Tensor:
    """Every expert on every token, weighted by its routing weight (0 where not chosen); fp32 accumulation."""
    n_exp, two_i, _ = w13.shape
    inter = two_i // 2
    expert = torch.arange(n_exp, device=x.device)
    dense = ((ids.long()[:, :, None] == expert).float() * weights.float()[:, :, None]).sum(1)  # [T, E]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for g0 in range(0, n_exp, EXPERT_GROUP):
        g1 = min(g0 + EXPERT_GROUP, n_exp)
        h = torch.einsum("td,eod->eto", x, w13[g0:g1])  # [G, T, 2I]
        act = clamped_swiglu(h[..., :inter], h[..., inter:], limit)
        y = torch.einsum("eti,edi->etd", act, w2[g0:g1]).float()  # [G, T, D]
        out = out + (y * dense[:, g0:g1].t()[..., None]).sum(0)
    return out.to(x.dtype)


torch.library.impl("dsv4rt::moe_route", "CompositeExplicitAutograd", moe_route_ref)
torch.library.impl("dsv4rt::moe_hash_route", "CompositeExplicitAutograd", moe_hash_route_ref)
torch.library.impl("dsv4rt::moe_experts", "CompositeExplicitAutograd", moe_experts_ref)


def moe_route(logits: Tensor, bias: Tensor, topk: int, scale: float) -> tuple[Tensor, Tensor]:
    """Top-k routing. Shapes: logits [T, E] fp32, bias [E] -> weights [T, k] fp32, ids [T, k] int32."""
    return torch.ops.dsv4rt.moe_route.default(logits, bias, topk, scale)


def moe_hash_route(logits: Tensor, tid2eid: Tensor, token_ids: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Hash routing. Shapes: logits [T, E] fp32, tid2eid [V, k], token_ids [T] -> weights [T, k], ids [T, k] int32."""
    return torch.ops.dsv4rt.moe_hash_route.default(logits, tid2eid, token_ids, scale)


def moe_experts(x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor, ids: Tensor, limit: float) -> Tensor:
    """Routed experts. Shapes: x [T, D]; w13 [E, 2I, D] (gate rows then up rows); w2 [E, D, I];
    weights [T, k] fp32; ids [T, k] int32. Returns [T, D] in x's dtype. Mutates: nothing."""
    return torch.ops.dsv4rt.moe_experts.default(x, w13, w2, weights, ids, limit)
