"""CUDA kernels of the moe family (csrc/moe.cu, csrc/moe.cpp) against the reference (ops/moe.py).

Gate (router logits, fp32 or bf16 weight, x cast to fp32 inside the kernel for up to 8 tokens; above that one bf16
GEMM with fp32 output for bf16 x and weight, else the reference's cuBLAS call): against float64, within GATE_TOL of
sum |x| |w| per logit; bit-identical to the cuBLAS call it makes above 8 tokens.

Routers (Flash 256 and Pro 384 experts, top-6, T in {1, 64, 4096}): the same expert sets as the reference run on the
same device (the kernel computes the fp32 scores with torch's formulas, so the scores are identical) and weights
within ROUTE_RTOL; a near-tie is the only accepted difference against the CPU reference.
Experts: compared with the reference run on the same device in the same dtype (matmuls with fp32 accumulation);
max |got - ref| <= EXPERTS_TOL * max |ref| and ||got - ref|| / ||ref|| <= NORM_TOL. The caching allocator is
filled with NaN before each kernel call, so any output row or workspace entry the kernels leave unwritten shows.
Flash dims (D 4096, I 2048, 256 routed experts, top-6, the shared expert as three separate tensors as the model
holds them) at T = 1, 8 and 64 (plan, expert GEMV and combine kernels; the shared expert one more slot; up to 8 tokens
also the opt-in tiny path: two kernels that plan and combine inside themselves) and 4096 (grouped GEMMs; the shared
expert plain GEMMs; the grouped GEMM kernel against at::_grouped_mm too, and at 600 tokens and with 384 experts),
with: random routing (most experts chosen by no token), one expert chosen by every token, hash
routing (repeated ids included), padded rows (garbage x, one expert repeated k times), skewed routing (Zipf-like:
thousands of rows on a few experts, a few rows on many); with and without the shared expert. Small dims: every path
around its thresholds (tiny: T <= 8 and T * k <= 64; grouped: more than 3072 rows, the shared expert's T rows counted),
float16 and float32, ids outside [0, E) (no weight, as in the reference), determinism with and without programmatic
launches and the tiny path's L2 prefetch, CUDA-graph capture and replay.
Tests taking the `small_path` fixture run on the default paths, then (batches of up to 8 tokens) on the tiny path,
then (one-token calls) through the plan kernel; pairs that would repeat the default run are not collected
(`same_as_default`, tests/ops/conftest.py).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dsv4rt.ops.moe import (clamped_swiglu, moe_experts, moe_experts_ref, moe_gate, moe_gate_ref, moe_hash_route,
                            moe_hash_route_ref, moe_route, moe_route_ref, sqrt_softplus)
from factories import moe_experts_inputs, ref_result, to_device

pytestmark = pytest.mark.cuda

ROUTE_RTOL = 1e-5
# bf16/fp16: the kernels round the projections and the activation to the dtype as the reference does, but sum in
# another order, so a rounding can land one step apart (2^-8 relative in bf16) and the output is rounded once
# (the reference also rounds each expert's output); fp32: accumulation order only.
EXPERTS_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}
NORM_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}

FLASH_D, FLASH_I, FLASH_E, TOPK = 4096, 2048, 256, 6
SCALE, LIMIT = 1.5, 10.0
GROUPED_MIN_PAIRS = 3072  # csrc/moe.cpp: T * k (+ T with a shared expert) above this runs the grouped GEMMs (bf16;
# at the factory dims, which the grouped kernel does not take: above 768 rows where it does)
TINY_TOKENS = 8  # csrc/moe.h: T <= 8 and T * k <= 64 can run the tiny path (bf16/fp16; DSV4RT_MOE_TINY picks)


@pytest.fixture(params=["default", "tiny", "plan"])
def small_path(request, monkeypatch):
    """Runs a test on the default paths, again with every batch of up to 8 tokens on the tiny path, and again with
    one-token calls through the plan kernel (DSV4RT_MOE_DIRECT=0; the default reads their ids directly)."""
    if request.param == "tiny":
        monkeypatch.setenv("DSV4RT_MOE_TINY", str(TINY_TOKENS))
    if request.param == "plan":
        monkeypatch.setenv("DSV4RT_MOE_DIRECT", "0")
    return request.param


def same_as_default(path: str, n_tokens: int) -> str | None:
    """Why a (small_path, n_tokens) pair would repeat the default run, or None. tests/ops/conftest.py leaves such
    pairs out at collection (they would skip on every machine)."""
    if path == "tiny" and n_tokens > TINY_TOKENS:
        return "the tiny path serves at most 8 tokens: the same run as the default"
    if path == "plan" and n_tokens != 1:
        return "only one-token calls skip the plan kernel: the same run as the default"
    return None


def skip_if_same(path: str, n_tokens: int) -> None:
    why = same_as_default(path, n_tokens)
    if why is not None:
        pytest.skip(why)


def poison_allocator(nbytes: int) -> None:
    """Leave NaN bytes (0xFF) in the caching allocator's free blocks: the op's outputs and scratch come from them."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    buf.fill_(0xFF)
    del buf


def assert_experts_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.float(), want.float()
    assert torch.isfinite(g).all(), "non-finite outputs (an unwritten row?)"
    scale = w.abs().max().item()
    if scale == 0.0:  # nothing chosen: exact zeros
        assert torch.equal(g, w)
        return
    err = (g - w).abs().max().item()
    rel = ((g - w).norm() / w.norm()).item()
    assert err <= EXPERTS_TOL[got.dtype] * scale, f"max |diff| {err:.3e} vs max |ref| {scale:.3e}"
    assert rel <= NORM_TOL[got.dtype], f"relative norm error {rel:.3e}"


def run_kernel(args: tuple, poison: int = 1 << 28, op=moe_experts) -> torch.Tensor:
    """The op (default moe_experts on (x, w13, w2, weights, ids, limit[, shared_gate, shared_up, shared_down])) on a
    poisoned allocator."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the op's blocks then come from the poisoned segment, not from the reference's
    poison_allocator(poison)
    out = op(*args)
    torch.cuda.synchronize()
    return out


def run_both(args: tuple, monkeypatch, name: str, first: str, second: str) -> list[torch.Tensor]:
    """moe_experts on `args` with the environment variable `name` at `first`, then at `second` (two kernel paths):
    each close to the reference, and the two close to each other."""
    want = moe_experts_ref(*args)
    outs = []
    for value in (first, second):
        monkeypatch.setenv(name, value)
        outs.append(run_kernel(args))
        assert_experts_close(outs[-1], want)
    assert_experts_close(outs[0], outs[1])
    return outs


# ------------------------------------------------------------------------------------------ routers
def route_inputs(n_tokens: int, n_experts: int, seed: int = 0, bias_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_tokens, n_experts, generator=g) * 2.0
    logits[:, :4] *= 15.0  # beyond softplus's threshold (|z| > 20) on some entries
    bias = (torch.randn(n_experts, generator=g) * 0.5).to(bias_dtype)
    return logits.cuda(), bias.cuda()


def assert_routing_equal(got, want, rtol=ROUTE_RTOL):
    gw, gi = got
    ww, wi = want
    assert gi.dtype == torch.int32 and gw.dtype == torch.float32 and gi.shape == wi.shape
    gi_s, order_g = gi.long().sort(dim=1)
    wi_s, order_w = wi.long().sort(dim=1)
    assert torch.equal(gi_s, wi_s), f"{(gi_s != wi_s).any(1).sum().item()} tokens chose other experts"
    torch.testing.assert_close(gw.gather(1, order_g), ww.gather(1, order_w), rtol=rtol, atol=0)


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_experts", [FLASH_E, 384])
@pytest.mark.parametrize("n_tokens", [1, 64, 4096])
def test_route_matches_reference(n_tokens, n_experts, bias_dtype):
    logits, bias = route_inputs(n_tokens, n_experts, bias_dtype=bias_dtype)
    want = moe_route_ref(logits, bias, TOPK, SCALE)
    got = moe_route(logits, bias, TOPK, SCALE)
    assert_routing_equal(got, want)
    # selection follows s + bias, in descending order
    s = sqrt_softplus(logits) + bias.float()
    sel = s.gather(1, got[1].long())
    assert (sel[:, :-1] >= sel[:, 1:]).all()


def test_route_matches_cpu_reference_but_for_near_ties():
    logits, bias = route_inputs(256, FLASH_E, seed=1)
    gw, gi = moe_route(logits, bias, TOPK, SCALE)
    ww, wi = moe_route_ref(logits.cpu(), bias.cpu(), TOPK, SCALE)
    s = sqrt_softplus(logits.cpu()) + bias.cpu()
    for t in range(logits.shape[0]):
        a, b = set(gi[t].tolist()), set(wi[t].tolist())
        if a != b:  # only where the k-th and (k+1)-th selection scores are within fp32 rounding
            top = s[t].sort(descending=True).values
            assert (top[TOPK - 1] - top[TOPK]).abs() <= 1e-6 * top[TOPK - 1].abs()
        else:
            got = dict(zip(gi[t].tolist(), gw[t].tolist()))
            for e, w in zip(wi[t].tolist(), ww[t].tolist()):
                assert math.isclose(got[e], w, rel_tol=ROUTE_RTOL)


def hash_inputs(n_tokens: int, n_experts: int, index_dtype, seed: int = 0, vocab: int = 1000):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_tokens, n_experts, generator=g) * 2.0
    tid2eid = torch.stack([torch.randperm(n_experts, generator=g)[:TOPK] for _ in range(vocab)])
    tid2eid[:7] = 0  # HF's initial table: every such token -> expert 0, k times
    token_ids = torch.randint(0, vocab, (n_tokens,), generator=g)
    token_ids[: min(n_tokens, 3)] = 0
    return logits.cuda(), tid2eid.to(index_dtype).cuda(), token_ids.to(index_dtype).cuda()


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("n_experts", [FLASH_E, 384])
@pytest.mark.parametrize("n_tokens", [1, 64, 4096])
def test_hash_route_matches_reference(n_tokens, n_experts, index_dtype):
    logits, tid2eid, token_ids = hash_inputs(n_tokens, n_experts, index_dtype)
    ww, wi = moe_hash_route_ref(logits, tid2eid, token_ids, SCALE)
    gw, gi = moe_hash_route(logits, tid2eid, token_ids, SCALE)
    assert gi.dtype == torch.int32 and torch.equal(gi, wi)  # the table's order, repeated ids kept
    torch.testing.assert_close(gw, ww, rtol=ROUTE_RTOL, atol=0)


def test_route_native():
    import dsv4rt.ops
    cov = dsv4rt.ops.kernel_coverage()
    assert cov["moe_route"] == cov["moe_hash_route"] == cov["moe_experts"] == "native"
    assert torch._C._dispatch_has_kernel_for_dispatch_key("dsv4rt::moe_gate", "CUDA")


GATE_TOL = 1e-5  # fp32 sums of D = 4096 products in another order: ~sqrt(D) * 2^-24 of sum |x| |w| (bf16 GEMM 6.5e-7)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n_experts", [FLASH_E, 384])
@pytest.mark.parametrize("n_tokens", [1, 2, 3, 5, 8, 9, 64, 4096])  # 1, 2, 3, 5: each token-count instance
def test_gate_matches_reference(n_tokens, n_experts, dtype, wdtype):
    g = torch.Generator().manual_seed(n_tokens)
    x = (torch.randn(n_tokens, FLASH_D, generator=g) * 2.0).to(dtype).cuda()
    w = (torch.randn(n_experts, FLASH_D, generator=g) * FLASH_D**-0.5).to(wdtype).cuda()
    run_kernel((x, w), op=moe_gate)
    got = run_kernel((x, w), op=moe_gate)
    assert got.dtype == torch.float32 and got.shape == (n_tokens, n_experts) and torch.isfinite(got).all()
    exact = (x.double() @ w.double().t())
    bound = GATE_TOL * (x.double().abs() @ w.double().abs().t())
    assert ((got.double() - exact).abs() <= bound).all()
    if n_tokens > 8:  # cuBLAS: bf16 x and weight as one bf16 GEMM with fp32 output, else the reference's own call
        both_bf16 = dtype == torch.bfloat16 and wdtype == torch.bfloat16
        want = torch.mm(x, w.t(), out_dtype=torch.float32) if both_bf16 else moe_gate_ref(x, w)
        assert torch.equal(got, want)
    assert torch.equal(got, moe_gate(x, w))  # deterministic
    # routing from these logits: the reference's expert sets but for near-ties
    gw, gi = moe_route(got, torch.zeros(n_experts, device="cuda"), TOPK, SCALE)
    ww, wi = moe_route_ref(moe_gate_ref(x, w), torch.zeros(n_experts, device="cuda"), TOPK, SCALE)
    s = sqrt_softplus(exact.float()).sort(dim=1, descending=True).values
    tie = (s[:, TOPK - 1] - s[:, TOPK]).abs() <= 1e-5 * s[:, TOPK - 1]
    same = (gi.long().sort(1).values == wi.long().sort(1).values).all(1)
    assert (same | tie).all()


# ------------------------------------------------------------------------------------------ experts, Flash dims
@pytest.fixture(scope="module")
def flash_weights():
    """w13 [E, 2I, D], w2 [E, D, I] bf16 and the shared expert's gate [I, D], up [I, D], down [D, I] (separate
    tensors); std 6/sqrt(D) so that the projections have std ~6 and both clamps of the SwiGLU engage."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(FLASH_E, 2 * FLASH_I, FLASH_D, generator=g, device="cuda", dtype=torch.bfloat16)
    w13.mul_(6.0 * FLASH_D**-0.5)
    w2 = torch.randn(FLASH_E, FLASH_D, FLASH_I, generator=g, device="cuda", dtype=torch.bfloat16)
    w2.mul_(FLASH_I**-0.5)
    sg, su = (torch.randn(FLASH_I, FLASH_D, generator=g, device="cuda", dtype=torch.bfloat16).mul_(6.0 * FLASH_D**-0.5)
              for _ in range(2))
    sd = torch.randn(FLASH_D, FLASH_I, generator=g, device="cuda", dtype=torch.bfloat16).mul_(FLASH_I**-0.5)
    yield w13, w2, (sg, su, sd)
    del w13, w2, sg, su, sd
    torch.cuda.empty_cache()


def random_choice(n_tokens: int, n_experts: int, k: int, g: torch.Generator) -> torch.Tensor:
    """[T, k] distinct experts per token."""
    return torch.rand(n_tokens, n_experts, generator=g).argsort(dim=1)[:, :k].int()


def flash_case(n_tokens: int, scenario: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [T, D] bf16, weights [T, k] fp32, ids [T, k] int32): the k routed choices."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tokens, FLASH_D, generator=g)
    w = torch.rand(n_tokens, TOPK, generator=g) + 0.1
    w = w / w.sum(-1, keepdim=True) * SCALE
    if scenario == "random":
        ids = random_choice(n_tokens, FLASH_E, TOPK, g)
    elif scenario == "every_token":  # expert 17 chosen by every token
        ids = random_choice(n_tokens, FLASH_E - 1, TOPK, g)
        ids = torch.where(ids >= 17, ids + 1, ids)
        ids[:, 2] = 17
    elif scenario == "hash":  # ids from the hash router, some tokens on HF's all-zero table rows
        logits, tid2eid, token_ids = hash_inputs(n_tokens, FLASH_E, torch.int64, seed=seed)
        w, ids = (t.cpu() for t in moe_hash_route(logits, tid2eid, token_ids, SCALE))
    elif scenario == "padded":  # the last half (at least one) rows are padding: garbage x, one expert k times
        ids = random_choice(n_tokens, FLASH_E, TOPK, g)
        n_pad = max(1, n_tokens // 2)
        x[-n_pad:] = torch.randn(n_pad, FLASH_D, generator=g) * 3.0
        ids[-n_pad:] = 0
        w[-n_pad:] = SCALE / TOPK
    elif scenario == "skewed":  # Zipf-like popularity: some experts with thousands of rows, many with a few
        p = (torch.arange(FLASH_E, dtype=torch.float64) + 1.0) ** -1.1
        ids = torch.multinomial(p.expand(n_tokens, FLASH_E), TOPK, replacement=False, generator=g).int()
    else:
        raise ValueError(scenario)
    return x.to(torch.bfloat16).cuda(), w.float().contiguous().cuda(), ids.int().contiguous().cuda()


@pytest.mark.parametrize("scenario", ["random", "every_token", "hash", "padded", "skewed"])
@pytest.mark.parametrize("n_tokens", [1, 8, 64, 4096])
def test_experts_flash_matches_reference(flash_weights, n_tokens, scenario, small_path):
    skip_if_same(small_path, n_tokens)
    w13, w2, shared = flash_weights
    x, w, ids = flash_case(n_tokens, scenario)
    args = (x, w13, w2, w, ids, LIMIT, *shared)
    want = moe_experts_ref(*args)
    got = run_kernel(args, poison=3 << 29)
    assert_experts_close(got, want)


@pytest.mark.parametrize("scenario", ["random", "every_token", "padded", "skewed"])
@pytest.mark.parametrize("n_tokens", [600, 4096])
def test_experts_flash_grouped_kernel(flash_weights, n_tokens, scenario, monkeypatch):
    """The large-batch path's grouped GEMM kernel (moe_gmm_kernel: items of 128 rows, TMA, wgmma m64n256) and
    at::_grouped_mm (DSV4RT_MOE_GMM=0), each against the reference and against each other: 600 tokens (4,200 rows
    with the shared expert, above both paths' thresholds: items of a few rows) and 4,096 (one expert with every token:
    32 items)."""
    w13, w2, shared = flash_weights
    x, w, ids = flash_case(n_tokens, scenario, seed=7)
    run_both((x, w13, w2, w, ids, LIMIT, *shared), monkeypatch, "DSV4RT_MOE_GMM", "1", "0")


def test_experts_grouped_kernel_pro_experts(monkeypatch):
    """384 experts (V4-Pro's count; every CTA scans one expert a thread) at small dims that the grouped kernel takes
    (D 512, I 256), 1,024 tokens, some experts with more than 128 rows, against the reference and at::_grouped_mm."""
    g = torch.Generator(device="cuda").manual_seed(11)
    n_exp, d, inter, n_tok = 384, 512, 256, 1024
    w13 = torch.randn(n_exp, 2 * inter, d, generator=g, device="cuda", dtype=torch.bfloat16).mul_(6.0 * d**-0.5)
    w2 = torch.randn(n_exp, d, inter, generator=g, device="cuda", dtype=torch.bfloat16).mul_(inter**-0.5)
    x = torch.randn(n_tok, d, generator=g, device="cuda").to(torch.bfloat16)
    gc = torch.Generator().manual_seed(11)
    ids = random_choice(n_tok, n_exp - 1, TOPK, gc)
    ids = torch.where(ids >= 5, ids + 1, ids)
    ids[:300, 0] = 5  # expert 5: 300 rows (three items); every other expert a few
    w = torch.rand(n_tok, TOPK, generator=gc) + 0.1
    w = (w / w.sum(-1, keepdim=True) * SCALE).float().cuda()
    run_both((x, w13, w2, w, ids.int().contiguous().cuda(), LIMIT), monkeypatch, "DSV4RT_MOE_GMM", "1", "0")


@pytest.mark.parametrize("n_tokens", [1, 8, 9])
def test_experts_flash_hash_small_batches(flash_weights, n_tokens):
    w13, w2, shared = flash_weights
    x, w, ids = flash_case(n_tokens, "hash", seed=6)
    args = (x, w13, w2, w, ids, LIMIT, *shared)
    assert_experts_close(run_kernel(args), moe_experts_ref(*args))


@pytest.mark.parametrize("n_tokens", [1, 8, 64, 4096])
def test_experts_shared_equals_model_path(flash_weights, n_tokens):
    """Shared expert inside the op == the op on the routed experts + the shared expert through F.linear (the model's
    former path), both on the device."""
    w13, w2, (sg, su, sd) = flash_weights
    x, w, ids = flash_case(n_tokens, "random", seed=3)
    routed = run_kernel((x, w13, w2, w, ids, LIMIT))
    shared = F.linear(clamped_swiglu(F.linear(x, sg), F.linear(x, su), LIMIT), sd)
    got = run_kernel((x, w13, w2, w, ids, LIMIT, sg, su, sd))
    assert_experts_close(got, routed + shared)


@pytest.mark.parametrize("n_tokens", [1, 8, 64])
def test_experts_routed_only(flash_weights, n_tokens):
    """No shared expert: 256 experts, top-6."""
    w13, w2, _ = flash_weights
    x, w, ids = flash_case(n_tokens, "random", seed=4)
    args = (x, w13, w2, w, ids, LIMIT)
    assert_experts_close(run_kernel(args), moe_experts_ref(*args))


@pytest.mark.parametrize("n_tokens", [1, 2, 8])
def test_experts_tiny_path_equals_gemv_path(flash_weights, n_tokens, monkeypatch):
    """The tiny path against the GEMV path (DSV4RT_MOE_TINY=0) on the same inputs: both close to the reference."""
    w13, w2, shared = flash_weights
    x, w, ids = flash_case(n_tokens, "every_token", seed=5)
    run_both((x, w13, w2, w, ids, LIMIT, *shared), monkeypatch, "DSV4RT_MOE_TINY", str(TINY_TOKENS), "0")


@pytest.mark.parametrize("scenario", ["random", "every_token", "hash", "repeated", "out_of_range"])
def test_experts_one_token_direct_equals_plan(flash_weights, scenario, monkeypatch):
    """A one-token call reads its ids directly (no plan kernel): the same bits as through the plan, whatever the ids
    (repeated ids, ids outside [0, E): no contribution)."""
    w13, w2, shared = flash_weights
    x, w, ids = flash_case(1, "hash" if scenario == "hash" else "random", seed=11)
    if scenario == "every_token":
        ids[0, 2] = 17
    elif scenario == "repeated":
        ids[0, 1:4] = ids[0, 0]
    elif scenario == "out_of_range":
        ids[0, 1], ids[0, 4] = -3, FLASH_E + 5
    args = (x, w13, w2, w, ids, LIMIT, *shared)
    direct = run_kernel(args)
    monkeypatch.setenv("DSV4RT_MOE_DIRECT", "0")
    plan = run_kernel(args)
    assert torch.equal(direct, plan)
    assert_experts_close(direct, moe_experts_ref(*args))


@pytest.mark.parametrize("scenario", ["random", "repeated", "out_of_range", "routed_only"])
def test_experts_one_token_rows_equal_mma(flash_weights, scenario, monkeypatch):
    """One-token calls at Flash dims run the row instances of the GEMV kernels (a warp per whole weight row); against
    the mma instances (DSV4RT_MOE_ROWS=0) on the same inputs, through the direct path and the plan: all close to the
    reference (the fp32 sums run in another order, so a bf16 rounding may land one step apart)."""
    w13, w2, shared = flash_weights
    x, w, ids = flash_case(1, "random", seed=13)
    if scenario == "repeated":
        ids[0, 1:4] = ids[0, 0]
    elif scenario == "out_of_range":
        ids[0, 1], ids[0, 4] = -3, FLASH_E + 5
    args = (x, w13, w2, w, ids, LIMIT, *(() if scenario == "routed_only" else shared))
    want = moe_experts_ref(*args)
    outs = {}
    for rows in ("1", "0"):
        for direct in ("1", "0"):
            monkeypatch.setenv("DSV4RT_MOE_ROWS", rows)
            monkeypatch.setenv("DSV4RT_MOE_DIRECT", direct)
            outs[rows, direct] = run_kernel(args)
            assert_experts_close(outs[rows, direct], want)
    assert torch.equal(outs["1", "1"], outs["1", "0"])  # the row kernels give the same bits with or without the plan
    assert_experts_close(outs["1", "1"], outs["0", "1"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim,inter", [(256, 256), (512, 768), (1280, 512)])
def test_experts_one_token_rows_dims(dim, inter, dtype, monkeypatch):
    """The row instances at D and I multiples of 256 other than Flash's: one chunk of 256 columns (the rest of a
    load round empty), three (a partial round), five; bf16 and fp16; with the shared expert and without."""
    g = torch.Generator().manual_seed(dim + inter)
    n_exp, k = 8, 3
    x = torch.randn(1, dim, generator=g)
    w13 = torch.randn(n_exp, 2 * inter, dim, generator=g) * (6.0 * dim**-0.5)
    w2 = torch.randn(n_exp, dim, inter, generator=g) * inter**-0.5
    shared = (torch.randn(inter, dim, generator=g) * (6.0 * dim**-0.5),
              torch.randn(inter, dim, generator=g) * (6.0 * dim**-0.5), torch.randn(dim, inter, generator=g) * inter**-0.5)
    ids = torch.randperm(n_exp, generator=g)[:k].reshape(1, k).int()
    w = torch.rand(1, k, generator=g) + 0.1
    for sh in (shared, ()):
        args = tuple(t.to(dtype).cuda() for t in (x, w13, w2)) + ((w / w.sum()).cuda(), ids.cuda(), LIMIT) + tuple(
            t.to(dtype).cuda() for t in sh)
        run_both(args, monkeypatch, "DSV4RT_MOE_ROWS", "1", "0")


# ------------------------------------------------------------------------------------------ experts, small dims
SHARED = [False, True]


@pytest.mark.parametrize("shared", SHARED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n_tokens", [1, 7, 8, 9, 64, 300, GROUPED_MIN_PAIRS // 4, GROUPED_MIN_PAIRS // 4 + 1,
                                      GROUPED_MIN_PAIRS // 3, GROUPED_MIN_PAIRS // 3 + 1, 4096])
def test_experts_small_dims_all_paths(n_tokens, dtype, shared, small_path):
    """Factory dims (8 experts, top-3): each expert holds hundreds of tokens at the larger sizes (many token groups
    per CTA). Tiny path (when on) up to 8 tokens (bf16/fp16); rows = T * 3 (+ T with the shared expert): 768 tokens with the
    shared expert and 1024 without are 3072 rows (GEMV path), 769 and 1025 just above (grouped GEMMs for bf16)."""
    skip_if_same(small_path, n_tokens)
    args = moe_experts_inputs("cuda", dtype, n_tokens, seed=n_tokens, shared=shared)
    want = ref_result(moe_experts_ref, *args)
    assert_experts_close(run_kernel(args), want)


def custom_inputs(n_tokens: int, ids: torch.Tensor, dtype=torch.bfloat16, seed: int = 0, shared: bool = True):
    """Factory-sized weights (8 experts, D 64, I 32; the shared expert's when `shared`) with given ids [T, k]."""
    x, w13, w2, _, _, limit, *sh = moe_experts_inputs("cuda", dtype, n_tokens, seed=seed, shared=shared)
    g = torch.Generator().manual_seed(seed + 1)
    w = torch.rand(ids.shape, generator=g) + 0.1
    return (x, w13, w2, (w / w.sum(-1, keepdim=True) * SCALE).cuda(), ids.int().contiguous().cuda(), limit, *sh)


@pytest.mark.parametrize("shared", SHARED)
@pytest.mark.parametrize("n_tokens,k", [(8, 4), (8, 5), (9, 3), (17, 2), (4, 8), (8, 8), (8, 9), (2, 32)])
def test_experts_token_group_sizes(n_tokens, k, shared, small_path):
    """Batches of up to 8 tokens (tiny path, when on, while T * k <= 64: (8, 8) is 64 pairs, (8, 9) 72 the GEMV path),
    9 and 17 tokens (2 and 4 token groups); 4 x 8 and 8 x 8: every expert chosen by every token; (2, 32): repeats."""
    skip_if_same(small_path, n_tokens)
    g = torch.Generator().manual_seed(n_tokens * 10 + k)
    ids = random_choice(n_tokens, 8, k, g) if k <= 8 else torch.randint(0, 8, (n_tokens, k), generator=g)
    args = custom_inputs(n_tokens, ids, seed=k, shared=shared)
    assert_experts_close(run_kernel(args), moe_experts_ref(*args))


@pytest.mark.parametrize("shared", SHARED)
@pytest.mark.parametrize("n_tokens", [1, 3, 20])
def test_experts_repeated_ids(n_tokens, shared, small_path):
    """One token choosing the same expert several times (HF's initial hash table)."""
    skip_if_same(small_path, n_tokens)
    ids = torch.tensor([[2, 2, 5, 2], [0, 0, 0, 0], [7, 1, 7, 3]]).repeat(7, 1)[:n_tokens]
    args = custom_inputs(n_tokens, ids, seed=3, shared=shared)
    assert_experts_close(run_kernel(args), moe_experts_ref(*args))


@pytest.mark.parametrize("shared", SHARED)
@pytest.mark.parametrize("n_tokens", [1, 5, 4096])
def test_experts_ids_out_of_range_have_no_weight(n_tokens, shared, small_path):
    skip_if_same(small_path, n_tokens)
    x, w13, w2, w, ids, limit, *sh = moe_experts_inputs("cuda", torch.bfloat16, n_tokens, seed=1, shared=shared)
    ids = ids.clone()
    ids[0, 0] = -1
    ids[-1, 1] = w13.shape[0]
    ids[n_tokens // 2, 2] = 1 << 20
    args = (x, w13, w2, w, ids, limit, *sh)
    assert_experts_close(run_kernel(args), moe_experts_ref(*args))


@pytest.mark.parametrize("n_tokens", [1, 20])
def test_experts_only_shared(n_tokens, small_path):
    """Every id out of range, and no routed choice at all (k = 0): the output is the shared expert alone."""
    skip_if_same(small_path, n_tokens)
    x, w13, w2, w, ids, limit, *sh = moe_experts_inputs("cuda", torch.bfloat16, n_tokens, seed=8, shared=True)
    for w_, ids_ in ((w, torch.full_like(ids, -1)), (w[:, :0].contiguous(), ids[:, :0].contiguous())):
        args = (x, w13, w2, w_, ids_, limit, *sh)
        assert_experts_close(run_kernel(args), moe_experts_ref(*args))


@pytest.mark.parametrize("shared", SHARED)
@pytest.mark.parametrize("n_tokens", [1, 8, 64, 4096])
def test_experts_cpu_reference(n_tokens, shared, small_path):
    """Also against the reference on the CPU (small dims), to rule out a shared error in the device reference."""
    skip_if_same(small_path, n_tokens)
    args = moe_experts_inputs("cuda", torch.bfloat16, n_tokens, seed=2, shared=shared)
    want = ref_result(moe_experts_ref, *to_device(args, "cpu"))
    assert_experts_close(run_kernel(args).cpu(), want)


@pytest.mark.parametrize("n_tokens", [1, 8, 64, 4096])
def test_experts_deterministic_and_knob_independent(n_tokens, monkeypatch, small_path):
    """Bit-identical across calls, without programmatic launches, and without the tiny path's L2 prefetch."""
    skip_if_same(small_path, n_tokens)
    args = moe_experts_inputs("cuda", torch.bfloat16, n_tokens, seed=5, shared=True)
    first = run_kernel(args)
    assert torch.equal(first, run_kernel(args))
    monkeypatch.setenv("DSV4RT_MOE_TINY_PREFETCH", "0")
    assert torch.equal(first, run_kernel(args))
    monkeypatch.setenv("DSV4RT_MOE_PDL", "0")
    assert torch.equal(first, run_kernel(args))


@pytest.mark.parametrize("n_tokens", [1, 8, 64])
def test_experts_x_ready_bit_identical(flash_weights, n_tokens, monkeypatch, small_path):
    """x_ready (the shared expert's gate/up work before the wait for the routing) changes no bit, with and without
    programmatic launches and with the promise ignored (DSV4RT_MOE_EARLY=0)."""
    skip_if_same(small_path, n_tokens)
    w13, w2, shared = flash_weights
    x, w, ids = flash_case(n_tokens, "every_token", seed=11)
    args = (x, w13, w2, w, ids, LIMIT, *shared)
    first = run_kernel(args)
    assert torch.equal(first, run_kernel((*args, True)))
    monkeypatch.setenv("DSV4RT_MOE_EARLY", "0")
    assert torch.equal(first, run_kernel((*args, True)))
    monkeypatch.setenv("DSV4RT_MOE_EARLY", "1")
    monkeypatch.setenv("DSV4RT_MOE_PDL", "0")
    assert torch.equal(first, run_kernel((*args, True)))
    assert_experts_close(first, moe_experts_ref(*args))


def test_experts_empty_batch():
    x, w13, w2, w, ids, limit, *sh = moe_experts_inputs("cuda", torch.bfloat16, 1, shared=True)
    for extra in ((), tuple(sh)):
        out = moe_experts(x[:0], w13, w2, w[:0], ids[:0], limit, *extra)
        assert out.shape == (0, x.shape[1])


def test_experts_rejects_bad_layouts():
    x, w13, w2, w, ids, limit, sg, su, sd = moe_experts_inputs("cuda", torch.bfloat16, 4, shared=True)
    with pytest.raises(RuntimeError, match="moe_experts: ids must be a contiguous int32"):
        moe_experts(x, w13, w2, w, ids.long(), limit)
    with pytest.raises(RuntimeError, match="moe_experts: x, w13 and w2 must share one dtype"):
        moe_experts(x, w13.float(), w2, w, ids, limit)
    with pytest.raises(RuntimeError, match="moe_experts: x, w13 and w2 must be contiguous"):
        moe_experts(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, w, ids, limit)
    with pytest.raises(RuntimeError, match="all three shared-expert projections"):
        torch.ops.dsv4rt.moe_experts.default(x, w13, w2, w, ids, limit, sg, su, None)
    with pytest.raises(RuntimeError, match="moe_experts: shared_up must be contiguous"):
        moe_experts(x, w13, w2, w, ids, limit, sg, su.t().contiguous().t(), sd)
    with pytest.raises(RuntimeError, match="moe_experts: shared_down must have x's dtype"):
        moe_experts(x, w13, w2, w, ids, limit, sg, su, sd.float())
    with pytest.raises(RuntimeError, match=r"moe_experts: shared_gate must be \[32, 64\]"):
        moe_experts(x, w13, w2, w, ids, limit, sd, su, sd)


# ------------------------------------------------------------------------------------------ capture
@pytest.mark.parametrize("n_tokens", [1, 8, 64])
def test_model_chain_replay(flash_weights, n_tokens, small_path, capture_graph):
    """MoE.forward's chain at Flash dims in one CUDA graph, replayed many times back to back on inputs rewritten in
    place: a kernel writes x, then moe_gate, moe_route and moe_experts with x_ready=True (the shared expert starts
    while the router runs). Every replay equals the eager chain without x_ready, bit for bit."""
    skip_if_same(small_path, n_tokens)
    w13, w2, shared = flash_weights
    g = torch.Generator(device="cuda").manual_seed(21)
    gate = torch.randn(FLASH_E, FLASH_D, generator=g, device="cuda") * FLASH_D**-0.5
    bias = torch.randn(FLASH_E, generator=g, device="cuda") * 0.1

    def chain(src, x_ready):
        x = (src * 2.0).to(torch.bfloat16)  # x written by the kernel right before the router
        weights, ids = moe_route(moe_gate(x, gate), bias, TOPK, SCALE)
        return moe_experts(x, w13, w2, weights, ids, LIMIT, *shared, x_ready=x_ready)

    static_src = torch.randn(n_tokens, FLASH_D, device="cuda")
    reps = 8
    graph, outs = capture_graph(lambda: [chain(static_src, True) for _ in range(reps)])
    for seed in (22, 23, 24):
        new_src = torch.randn(n_tokens, FLASH_D, generator=torch.Generator(device="cuda").manual_seed(seed),
                              device="cuda")
        static_src.copy_(new_src)
        graph.replay()
        torch.cuda.synchronize()
        want = chain(new_src, False)
        for out in outs:
            assert torch.equal(out, want)
        x = (new_src * 2.0).to(torch.bfloat16)
        weights, ids = moe_route(moe_gate(x, gate), bias, TOPK, SCALE)
        assert_experts_close(want, moe_experts_ref(x, w13, w2, weights, ids, LIMIT, *shared))



@pytest.mark.parametrize("n_tokens", [1, 8, 64, 4096])
def test_route_and_experts_replay(n_tokens, small_path, capture_graph):
    """Router + experts (with the shared expert) captured in one CUDA graph, replayed on new inputs written in
    place: equal to eager calls."""
    skip_if_same(small_path, n_tokens)
    n_exp = 8
    x, w13, w2, _, _, limit, *sh = moe_experts_inputs("cuda", torch.bfloat16, n_tokens, seed=7, shared=True)
    bias = torch.randn(n_exp, device="cuda") * 0.1

    def step(xin, logits):
        weights, ids = moe_route(logits, bias, 3, SCALE)
        return moe_experts(xin, w13, w2, weights, ids, limit, *sh)

    static_x, static_logits = x.clone(), torch.randn(n_tokens, n_exp, device="cuda")
    graph, static_out = capture_graph(lambda: step(static_x, static_logits))
    for seed in (8, 9):
        new_x = moe_experts_inputs("cuda", torch.bfloat16, n_tokens, seed=seed)[0]
        new_logits = torch.randn(n_tokens, n_exp, device="cuda") * 2.0
        static_x.copy_(new_x)
        static_logits.copy_(new_logits)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, step(new_x, new_logits))
        weights, ids = moe_route_ref(new_logits, bias, 3, SCALE)
        assert_experts_close(static_out, moe_experts_ref(new_x, w13, w2, weights, ids, limit, *sh))
