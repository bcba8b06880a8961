"""MoE family: router logits (fp32 gate), top-k router (sqrt-softplus, bias for selection only), hash router,
routed + shared experts; `linear_fp32`, the router logits' product for several weights at once (the model's
compressor and indexer-scorer projections: one launch a layer at decode); and `linear`, the same GEMV kernel for the
model's bf16 projections at decode (x @ w.T in x's dtype, several weights of one x, or a grouped projection).

Routing weights come from the unbiased scores, renormalised over the chosen experts and multiplied
by the routed scaling factor. Experts use the clamped SwiGLU: silu(min(g, L)) * clamp(u, -L, L).
The shared expert (optional, its three projections as separate tensors) is added with weight 1 for every token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

torch.library.define("dsv4rt::moe_gate", "(Tensor x, Tensor weight) -> Tensor")
torch.library.define("dsv4rt::linear_fp32", "(Tensor x, Tensor[] weights) -> Tensor[]")
torch.library.define("dsv4rt::linear", "(Tensor x, Tensor[] weights, int groups=1) -> Tensor[]")
torch.library.define("dsv4rt::moe_route", "(Tensor logits, Tensor bias, int topk, float scale) -> (Tensor, Tensor)")
torch.library.define(
    "dsv4rt::moe_hash_route", "(Tensor logits, Tensor tid2eid, Tensor token_ids, float scale) -> (Tensor, Tensor)"
)
torch.library.define(
    "dsv4rt::moe_experts",
    "(Tensor x, Tensor w13, Tensor w2, Tensor weights, Tensor ids, float limit, Tensor? shared_gate=None, "
    "Tensor? shared_up=None, Tensor? shared_down=None, bool x_ready=False) -> Tensor",
)


@torch.library.register_fake("dsv4rt::moe_gate")
def _moe_gate_fake(x, weight):
    torch._check(x.dim() == 2 and weight.dim() == 2 and weight.shape[1] == x.shape[1])
    torch._check(weight.dtype in (torch.float32, torch.bfloat16),
                 lambda: "moe_gate: weight must be float32 or bfloat16")
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


def _check_linear_fp32(x: Tensor, weights: list[Tensor]) -> None:
    torch._check(x.dim() == 2, lambda: f"linear_fp32: x must be [T, K], got {tuple(x.shape)}")
    torch._check(len(weights) > 0, lambda: "linear_fp32: no weights")
    for i, w in enumerate(weights):
        torch._check(w.dim() == 2 and w.shape[1] == x.shape[1],
                     lambda: f"linear_fp32: weight {i} must be [N, K] with K = {x.shape[1]} (x's width), got "
                             f"{tuple(w.shape)}")
        torch._check(w.dtype in (torch.float32, torch.bfloat16),
                     lambda: f"linear_fp32: weight {i} must be float32 or bfloat16, got {w.dtype}")


@torch.library.register_fake("dsv4rt::linear_fp32")
def _linear_fp32_fake(x, weights):
    _check_linear_fp32(x, weights)
    return [x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32) for w in weights]


def _check_linear(x: Tensor, weights: list[Tensor], groups: int) -> int:
    """The checks of `linear` (its fake, reference and CUDA binding say the same); returns K, x's width a group."""
    torch._check(x.dim() == 2, lambda: f"linear: x must be [T, K], got {tuple(x.shape)}")
    torch._check(len(weights) > 0, lambda: "linear: no weights")
    torch._check(groups >= 1, lambda: f"linear: groups must be >= 1, got {groups}")
    torch._check(groups == 1 or len(weights) == 1, lambda: f"linear: groups > 1 takes one weight, got {len(weights)}")
    torch._check(x.shape[1] % groups == 0,
                 lambda: f"linear: x's width {x.shape[1]} is not a multiple of groups {groups}")
    k = x.shape[1] // groups
    for i, w in enumerate(weights):
        torch._check(w.dim() == 2 and w.shape[1] == k and w.shape[0] % groups == 0,
                     lambda: f"linear: weight {i} must be [N, K] with K = {k}"
                             + (" (x's width / groups) and N a multiple of groups" if groups > 1 else " (x's width)")
                             + f", got {tuple(w.shape)}")
        torch._check(w.dtype == x.dtype, lambda: f"linear: weight {i} is {w.dtype}, x {x.dtype} (one dtype)")
    return k


@torch.library.register_fake("dsv4rt::linear")
def _linear_fake(x, weights, groups=1):
    _check_linear(x, weights, groups)
    return [x.new_empty((x.shape[0], w.shape[0])) for w in weights]


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
def _moe_experts_fake(x, w13, w2, weights, ids, limit, shared_gate=None, shared_up=None, shared_down=None,
                      x_ready=False):
    torch._check(x.dim() == 2 and w13.dim() == 3 and w2.dim() == 3)
    torch._check(w13.shape[2] == x.shape[1] and w2.shape[1] == x.shape[1] and w13.shape[1] == 2 * w2.shape[2])
    torch._check(weights.shape == ids.shape and ids.shape[0] == x.shape[0])
    shared = (shared_gate, shared_up, shared_down)
    torch._check(all(t is None for t in shared) or all(t is not None for t in shared),
                 lambda: "moe_experts: give all three shared-expert projections or none")
    if shared_gate is not None:
        d, i = x.shape[1], w2.shape[2]
        torch._check(shared_gate.shape == (i, d) and shared_up.shape == (i, d) and shared_down.shape == (d, i))
    return torch.empty_like(x)


def sqrt_softplus(z: Tensor) -> Tensor:
    return torch.sqrt(F.softplus(z.float()))


def _renorm(scores: Tensor, ids: Tensor, scale: float) -> Tensor:
    w = scores.gather(1, ids)
    return w / w.sum(-1, keepdim=True) * scale


def moe_gate_ref(x: Tensor, weight: Tensor) -> Tensor:
    """Router logits in fp32: x cast to fp32, times the gate weight cast to fp32 (fp32, or the checkpoint's bf16:
    exact)."""
    torch._check(weight.dtype in (torch.float32, torch.bfloat16),
                 lambda: f"moe_gate: weight must be float32 or bfloat16, got {weight.dtype}")
    return F.linear(x.float(), weight.float())


def linear_fp32_ref(x: Tensor, weights: list[Tensor]) -> list[Tensor]:
    """Reference: [F.linear(x.float(), w.float()) for w in weights] (each weight as moe_gate takes it)."""
    _check_linear_fp32(x, weights)
    x32 = x.float()
    return [F.linear(x32, w.float()) for w in weights]


def linear_ref(x: Tensor, weights: list[Tensor], groups: int = 1) -> list[Tensor]:
    """Reference: [F.linear(x, w) for w in weights]; groups > 1: x [T, G*K] and one weight [G*N, K] give [T, G*N],
    block g of the output from block g of x and rows [g*N, (g+1)*N) of the weight (the model's grouped output
    projection)."""
    k = _check_linear(x, weights, groups)
    if groups == 1:
        return [F.linear(x, w) for w in weights]
    w = weights[0]
    n = w.shape[0] // groups
    y = torch.einsum("tgi,goi->tgo", x.reshape(x.shape[0], groups, k), w.view(groups, n, k))
    return [y.reshape(x.shape[0], groups * n)]


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


def moe_experts_ref(x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor, ids: Tensor, limit: float,
                    shared_gate: Tensor | None = None, shared_up: Tensor | None = None,
                    shared_down: Tensor | None = None, x_ready: bool = False) -> Tensor:
    """Every routed expert on every token, weighted by its routing weight (0 where not chosen), fp32 accumulation,
    rounded to x's dtype; then the shared expert added in x's dtype (three F.linear, as the model computed it).
    x_ready is a scheduling promise for the CUDA kernels (see moe_experts); it does not change the result."""
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
    routed = out.to(x.dtype)
    if shared_gate is None:
        return routed
    h = clamped_swiglu(F.linear(x, shared_gate), F.linear(x, shared_up), limit)
    return routed + F.linear(h, shared_down)


torch.library.impl("dsv4rt::moe_gate", "CompositeExplicitAutograd", moe_gate_ref)
torch.library.impl("dsv4rt::linear_fp32", "CompositeExplicitAutograd", linear_fp32_ref)
torch.library.impl("dsv4rt::linear", "CompositeExplicitAutograd", linear_ref)
torch.library.impl("dsv4rt::moe_route", "CompositeExplicitAutograd", moe_route_ref)
torch.library.impl("dsv4rt::moe_hash_route", "CompositeExplicitAutograd", moe_hash_route_ref)
torch.library.impl("dsv4rt::moe_experts", "CompositeExplicitAutograd", moe_experts_ref)


def moe_gate(x: Tensor, weight: Tensor) -> Tensor:
    """Router logits. Shapes: x [T, D] (any float dtype), weight [E, D] fp32 or bf16 -> [T, E] fp32 (both cast to
    fp32 first)."""
    return torch.ops.dsv4rt.moe_gate.default(x, weight)


def linear_fp32(x: Tensor, *weights: Tensor) -> list[Tensor]:
    """x @ w.T in fp32 for each weight, as `moe_gate` computes it: with bf16 operands every product is exact in fp32
    and the sums are fp32, so only the summation order differs from the reference's upcast GEMM.

    Shapes: x [T, K] (any float dtype), each weight [N_i, K] fp32 or bf16 -> [T, N_i] fp32 each. On CUDA, up to 8
    tokens and 6 weights of one dtype take one GEMV launch (moe_gate's kernel over all their rows); otherwise one
    GEMM a weight (bf16: cuBLAS with an fp32 output). Capture-safe.
    """
    return list(torch.ops.dsv4rt.linear_fp32.default(x.contiguous(), list(weights)))


def linear(x: Tensor, *weights: Tensor, groups: int = 1) -> list[Tensor]:
    """x @ w.T in x's dtype for each weight (fp32 sums, each output rounded once, as cuBLAS's GEMM); groups > 1: one
    grouped weight (see `linear_ref`).

    Shapes: x [T, G*K], each weight [N_i, K] of x's dtype -> [T, N_i] each. On CUDA, bf16 or fp16 x with up to 8
    tokens and 6 weights takes one GEMV launch over all their rows (the weights read once; one token: `moe_gate`'s
    kernel; 2-8 tokens: a tensor-core GEMV, K a multiple of 32). On an H200 q_b with the indexer's q_b (84 MB) took
    22.4 / 23.4 us at 1 / 8 tokens against cuBLAS's 25.4 / 25.9; the LM head (1 GB) 235 / 273 against 247 / 248, so
    the model takes cuBLAS for it above one token (`model.project`). Otherwise cuBLAS a weight (a batched GEMM for
    groups). Capture-safe.
    """
    return list(torch.ops.dsv4rt.linear.default(x.contiguous(), list(weights), groups))


def moe_route(logits: Tensor, bias: Tensor, topk: int, scale: float) -> tuple[Tensor, Tensor]:
    """Top-k routing. Shapes: logits [T, E] fp32, bias [E] -> weights [T, k] fp32, ids [T, k] int32."""
    return torch.ops.dsv4rt.moe_route.default(logits, bias, topk, scale)


def moe_hash_route(logits: Tensor, tid2eid: Tensor, token_ids: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Hash routing. Shapes: logits [T, E] fp32, tid2eid [V, k], token_ids [T] -> weights [T, k], ids [T, k] int32."""
    return torch.ops.dsv4rt.moe_hash_route.default(logits, tid2eid, token_ids, scale)


def moe_experts(x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor, ids: Tensor, limit: float,
                shared_gate: Tensor | None = None, shared_up: Tensor | None = None,
                shared_down: Tensor | None = None, x_ready: bool = False) -> Tensor:
    """Routed experts, plus the shared expert (weight 1, every token) when its projections are given.

    Shapes: x [T, D]; w13 [E, 2I, D] (gate rows then up rows); w2 [E, D, I]; weights [T, k] fp32; ids [T, k] int32
    (ids outside [0, E) contribute nothing); shared_gate, shared_up [I, D] and shared_down [D, I] (the model's
    separate weights, read in place: all three or none). Returns [T, D] in x's dtype. Mutates: nothing.

    x_ready=True promises that x was complete before the kernel preceding this call's first kernel started, as when
    the router ops (moe_gate, then moe_route or moe_hash_route) run between the kernel that wrote x and this call
    (MoE.forward). With programmatic dependent launches the CUDA kernels then run the shared expert's gate/up work,
    which needs x but no routing, while the router finishes. The result is bit-identical either way; leave it False
    when x may come from the kernel just before this call."""
    return torch.ops.dsv4rt.moe_experts.default(x, w13, w2, weights, ids, limit, shared_gate, shared_up, shared_down,
                                                x_ready)
