"""moe family: top-k router (bias for selection only), hash router, routed experts with the clamped SwiGLU, and the
shared expert (separate weights, weight 1) inside moe_experts."""
import functools
import math

import pytest
import torch
import torch.nn.functional as F

from dsv4rt.ops.moe import (clamped_swiglu, linear, linear_fp32, linear_fp32_ref, linear_ref, moe_experts,
                            moe_experts_ref, moe_gate, moe_gate_ref, moe_hash_route, moe_hash_route_ref, moe_route,
                            moe_route_ref)
from factories import (assert_trace_matches_reference, moe_experts_inputs, moe_hash_route_inputs, moe_route_inputs,
                       ref_result, to_device)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]

# CUDA vs CPU reference. Routing: identical expert sets, fp32 weights within 1e-5 relative (sqrt-softplus
# and a renormalisation in fp32). Experts: max |diff| <= TOL * max |reference| (fp32: accumulation order of
# two matmuls; bf16: the intermediate activation is rounded to bf16, 2^-8 relative, and both outputs once).
ROUTE_RTOL = 1e-5
EXPERTS_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}

def moe_gate_inputs(device, n_tokens: int = 7, dtype=torch.bfloat16, seed: int = 0) -> tuple:
    """(x [T, D] dtype, weight [E, D] fp32) at the factory's MoE dims."""
    x, *_ = moe_experts_inputs("cpu", dtype, n_tokens, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    return to_device((x, torch.randn(8, x.shape[1], generator=g) * x.shape[1] ** -0.5), device)


def linear_fp32_inputs(device, n_tokens: int = 7, seed: int = 0) -> tuple:
    """(x [T, D] bf16, [the gate weight [8, D], a second fp32 weight [3, D]])."""
    x, w = moe_gate_inputs(device, n_tokens, seed=seed)
    w2 = torch.randn(3, x.shape[1], generator=torch.Generator().manual_seed(seed + 2)) * x.shape[1] ** -0.5
    return x, [w, w2.to(device)]


def linear_inputs(device, n_tokens: int = 3, groups: int = 1, seed: int = 0) -> tuple:
    """(x [T, groups * 64] bf16, [bf16 weights: [40, 64] and [24, 64], or one [groups * 24, 64]], groups)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tokens, groups * 64, generator=g).to(torch.bfloat16)
    rows = (40, 24) if groups == 1 else (groups * 24,)
    ws = [(torch.randn(n, 64, generator=g) * 0.125).to(torch.bfloat16) for n in rows]
    return x.to(device), [w.to(device) for w in ws], groups


OPS = {  # case -> (op name, factory, reference, wrapper)
    "moe_gate": ("moe_gate", moe_gate_inputs, moe_gate_ref, moe_gate),
    "linear_fp32": ("linear_fp32", linear_fp32_inputs, linear_fp32_ref, lambda x, ws: linear_fp32(x, *ws)),
    "linear": ("linear", linear_inputs, linear_ref, lambda x, ws, groups: linear(x, *ws, groups=groups)),
    "linear_grouped": ("linear", functools.partial(linear_inputs, groups=4), linear_ref,
                       lambda x, ws, groups: linear(x, *ws, groups=groups)),
    "moe_route": ("moe_route", moe_route_inputs, moe_route_ref, moe_route),
    "moe_hash_route": ("moe_hash_route", moe_hash_route_inputs, moe_hash_route_ref, moe_hash_route),
    "moe_experts": ("moe_experts", moe_experts_inputs, moe_experts_ref, moe_experts),
    "moe_experts_shared": ("moe_experts", functools.partial(moe_experts_inputs, shared=True), moe_experts_ref,
                           moe_experts),
    "moe_experts_x_ready": ("moe_experts", lambda device: (*moe_experts_inputs(device, shared=True), True),
                            moe_experts_ref, moe_experts),
}


def by_expert(weights, ids):
    """Per token {expert id: weight}: the routing as a set (the order of the k choices is irrelevant)."""
    return [dict(zip(i, w)) for i, w in zip(ids.tolist(), weights.tolist())]


def assert_routing_equal(got, expected, rtol):
    g, e = by_expert(*got), by_expert(*expected)
    assert [sorted(x) for x in g] == [sorted(x) for x in e]
    for gt, et in zip(g, e):
        for k in et:
            assert math.isclose(gt[k], et[k], rel_tol=rtol, abs_tol=0)


def sqrt_softplus(z):
    return math.sqrt(math.log1p(math.exp(z)))


def route_loop(logits, bias, topk, scale):
    weights, ids = [], []
    for row in logits.tolist():
        s = [sqrt_softplus(z) for z in row]
        chosen = sorted(range(len(s)), key=lambda e: s[e] + float(bias[e]), reverse=True)[:topk]
        total = sum(s[e] for e in chosen)
        ids.append(chosen)
        weights.append([s[e] / total * scale for e in chosen])
    return torch.tensor(weights), torch.tensor(ids, dtype=torch.int32)


def hash_route_loop(logits, tid2eid, token_ids, scale):
    weights, ids = [], []
    for row, tok in zip(logits.tolist(), token_ids.tolist()):
        s = [sqrt_softplus(z) for z in row]
        chosen = tid2eid[tok].tolist()
        total = sum(s[e] for e in chosen)
        ids.append(chosen)
        weights.append([s[e] / total * scale for e in chosen])
    return torch.tensor(weights), torch.tensor(ids, dtype=torch.int32)


def silu(v):
    return v / (1.0 + math.exp(-v))


def experts_loop(x, w13, w2, weights, ids, limit, shared_gate=None, shared_up=None, shared_down=None):
    """y = sum_i w_i W2_e [silu(min(g, L)) * clamp(u, -L, L)], (g; u) = W13_e x, per token and channel; plus the
    shared expert with weight 1 when given."""
    inter = w2.shape[2]
    experts = [(w13[e], w2[e]) for e in range(w13.shape[0])]
    if shared_gate is not None:
        experts.append((torch.cat([shared_gate, shared_up]), shared_down))
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        chosen = list(zip(ids[t].tolist(), weights[t].tolist()))
        if shared_gate is not None:
            chosen.append((len(experts) - 1, 1.0))
        for e, w in chosen:
            h = (experts[e][0].float() @ x[t].float()).tolist()
            act = [silu(min(g, limit)) * min(max(u, -limit), limit) for g, u in zip(h[:inter], h[inter:])]
            out[t] += w * (experts[e][1].float() @ torch.tensor(act))
    return out.to(x.dtype)


# ------------------------------------------------------------------------------------------ generic
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(OPS))
def test_opcheck(case, device):
    name, factory, _, _ = OPS[case]
    torch.library.opcheck(getattr(torch.ops.dsv4rt, name).default, factory(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(OPS))
def test_trace(case, device):
    _, factory, ref, wrapper = OPS[case]
    assert_trace_matches_reference(wrapper, ref, factory(device))


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["moe_route", "moe_hash_route"])
def test_cuda_route_matches_reference(name):
    _, factory, ref, wrapper = OPS[name]
    args = factory("cuda", n_tokens=64)
    expected = ref_result(ref, *to_device(args, "cpu"))
    weights, ids = wrapper(*args)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert_routing_equal((weights.cpu(), ids.cpu()), expected, ROUTE_RTOL)


@pytest.mark.cuda
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_tokens", [1, 7, 64])
def test_cuda_experts_matches_reference(n_tokens, dtype, shared):
    args = moe_experts_inputs("cuda", dtype, n_tokens, shared=shared)
    expected = ref_result(moe_experts_ref, *to_device(args, "cpu"))
    got = moe_experts(*args)
    assert got.dtype == dtype
    atol = EXPERTS_TOL[dtype] * expected.float().abs().max().item()
    torch.testing.assert_close(got.cpu().float(), expected.float(), rtol=0, atol=atol)


# ------------------------------------------------------------------------------------------ semantics
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_is_fp32_linear(dtype, wdtype):
    """The model's former logits: F.linear(x.float(), weight.float()), bit for bit on the CPU; a bf16 weight (a bf16
    model keeps the checkpoint's) is cast exactly."""
    x, weight = moe_gate_inputs("cpu", dtype=dtype)
    weight = weight.to(wdtype)
    got = moe_gate(x, weight)
    assert got.dtype == torch.float32 and torch.equal(got, F.linear(x.float(), weight.float()))


def test_gate_weight_dtypes():
    """Weights other than fp32 and bf16 are refused by name, traced (fake) and eager (the reference) alike."""
    x, weight = moe_gate_inputs("cpu")
    with pytest.raises(Exception, match="float32 or bfloat16"):
        torch.library.opcheck(torch.ops.dsv4rt.moe_gate.default, (x, weight.half()))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        moe_gate(x, weight.half())


def test_route_matches_loop():
    args = moe_route_inputs("cpu", n_tokens=32)
    assert_routing_equal(moe_route(*args), route_loop(*args), 1e-5)


def test_route_bias_only_selects():
    # bias makes expert 3 win though its score is the lowest; its weight still comes from its own score
    logits = torch.tensor([[3.0, 2.0, 1.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    weights, ids = moe_route(logits, bias, 2, 1.5)
    s = [sqrt_softplus(z) for z in (3.0, -1.0)]
    assert sorted(ids[0].tolist()) == [0, 3]
    got = dict(zip(ids[0].tolist(), weights[0].tolist()))
    assert math.isclose(got[0], s[0] / sum(s) * 1.5, rel_tol=1e-6)
    assert math.isclose(got[3], s[1] / sum(s) * 1.5, rel_tol=1e-6)
    # without the bias the top two are 0 and 1
    assert sorted(moe_route(logits, torch.zeros(4), 2, 1.5)[1][0].tolist()) == [0, 1]


def test_route_weights_sum_to_scale():
    weights, _ = moe_route(*moe_route_inputs("cpu", n_tokens=16))
    torch.testing.assert_close(weights.sum(-1), torch.full((16,), 1.5), rtol=1e-6, atol=1e-6)


def test_hash_route_matches_loop():
    args = moe_hash_route_inputs("cpu", n_tokens=32)
    weights, ids = moe_hash_route(*args)
    logits, tid2eid, token_ids, _ = args
    assert torch.equal(ids.long(), tid2eid[token_ids])  # the table's order, unchanged
    assert_routing_equal((weights, ids), hash_route_loop(*args), 1e-5)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_match_loop(dtype, shared):
    args = moe_experts_inputs("cpu", dtype, shared=shared)
    x, w13, w2, _, _, limit = args[:6]
    h = torch.einsum("td,eod->teo", x.float(), w13.float())
    assert (h[..., : w2.shape[2]] > limit).any() and (h[..., w2.shape[2] :] < -limit).any()  # clamps engage
    want = experts_loop(*args).float()
    # bf16: the reference rounds the projections and the activation to bf16 (the loop keeps fp32)
    atol = (1e-5 if dtype == torch.float32 else 1e-2) * want.abs().max().item()
    torch.testing.assert_close(moe_experts(*args).float(), want, rtol=0, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_shared_is_the_models_former_path(dtype):
    """With the shared projections given, the reference equals (bit for bit) what the model computed before they
    moved into the op: routed experts, plus three F.linear through the clamped SwiGLU, added in x's dtype."""
    x, w13, w2, weights, ids, limit, sg, su, sd = moe_experts_inputs("cpu", dtype, shared=True)
    shared = F.linear(clamped_swiglu(F.linear(x, sg), F.linear(x, su), limit), sd)
    assert torch.equal(moe_experts(x, w13, w2, weights, ids, limit, sg, su, sd),
                       moe_experts(x, w13, w2, weights, ids, limit) + shared)
    # the shared expert alone: every id out of range (no routed weight)
    none = torch.full_like(ids, w13.shape[0])
    assert torch.equal(moe_experts(x, w13, w2, weights, none, limit, sg, su, sd), shared)


def test_experts_shared_needs_all_three():
    x, w13, w2, weights, ids, limit, sg, su, _ = moe_experts_inputs("cpu", torch.float32, shared=True)
    with pytest.raises(Exception, match="all three shared-expert projections"):
        torch.compile(moe_experts, fullgraph=True, backend="aot_eager")(x, w13, w2, weights, ids, limit, sg, su)


@pytest.mark.parametrize("up_sign", [1.0, -1.0])
def test_clamped_swiglu(up_sign):
    # one expert, identity projections: g = x, u = up_sign * x, y = silu(min(g, 10)) * clamp(u, -10, 10)
    x = torch.tensor([[-20.0, -12.0, -5.0, 0.0, 5.0, 9.5, 12.0, 20.0]])
    eye = torch.eye(8)
    w13 = torch.cat((eye, up_sign * eye))[None]
    got = moe_experts(x, w13, eye[None], torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32), 10.0)[0]
    want = [silu(min(v, 10.0)) * min(max(up_sign * v, -10.0), 10.0) for v in x[0].tolist()]
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-5, atol=0)
    # the gate is clamped from above only: at x = -20, silu(-20) (not silu(-10)) times the clamped up value
    two_sided = silu(-10.0) * min(max(up_sign * -20.0, -10.0), 10.0)  # what a gate clamped at -10 too would give
    assert abs(float(got[0])) < 1e-6 and abs(float(got[0]) - two_sided) > 4e-3
