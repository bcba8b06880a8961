"""The model's projections: those the reference runs in fp32 (compressors, indexer scorer, router), their weight
dtypes and `linear_fp32` (ops/moe.py) against a float64 product; the bf16 ones through `linear` (ops/moe.py) against
a float64 product rounded once; and every projection call a bf16 model's steps make."""
import pytest
import torch
import torch.nn.functional as F

import dsv4rt
from dsv4rt.ops import moe
from dsv4rt.ops.moe import linear, linear_fp32, linear_ref

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
FP32_PROJ = ("compressor.kv_proj.weight", "compressor.gate_proj.weight", "indexer.kv_proj.weight",
             "indexer.gate_proj.weight", "scorer.weights_proj.weight", "mlp.gate.weight")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp32_projection_weight_dtypes(dtype):
    """A bf16 model keeps these weights in the checkpoint's bf16; fp16 and fp32 models hold them in fp32."""
    model = dsv4rt.Model.random(dsv4rt.ModelConfig.tiny(), dtype=dtype)
    want = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    got = {n: p.dtype for n, p in model.named_parameters() if n.endswith(FP32_PROJ)}
    assert all(any(n.endswith(k) for n in got) for k in FP32_PROJ)
    assert got == dict.fromkeys(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [1, 2, 3, 8, 9, 64, 513])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [(300,), (64, 1, 300, 2, 130), (8, 8, 8, 8, 8, 8, 8)])
def test_linear_fp32(device, tokens, wdtype, rows):
    """fp32 outputs, one a weight; bf16 operands give every product exactly, so only the fp32 summation order differs
    from a float64 product. On CUDA up to 8 tokens and 6 weights take one GEMV launch (odd row counts put two
    weights' rows in one CTA), more a GEMM a weight."""
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 1024, generator=g).to(device=device, dtype=torch.bfloat16)
    ws = [(torch.randn(n, 1024, generator=g) * 0.02).to(device=device, dtype=wdtype) for n in rows]
    got = linear_fp32(x, *ws)
    assert len(got) == len(ws)
    for w, out in zip(ws, got):
        want = F.linear(x.double(), w.double())
        assert out.dtype == torch.float32 and out.shape == (tokens, w.shape[0]) and out.is_contiguous()
        assert ((out.double() - want).abs().max() / want.abs().max()).item() <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_linear_fp32_errors(device):
    x = torch.zeros(2, 64, device=device)
    with pytest.raises(Exception, match="weight 1 must be \\[N, K\\] with K = 64"):
        linear_fp32(x, torch.zeros(3, 64, device=device), torch.zeros(3, 32, device=device))
    with pytest.raises(Exception, match="weight 0 must be float32 or bfloat16"):
        linear_fp32(x, torch.zeros(3, 64, device=device, dtype=torch.float16))
    with pytest.raises(Exception, match="no weights"):
        linear_fp32(x)
    with pytest.raises(Exception, match="x must be \\[T, K\\]"):
        linear_fp32(x[0], torch.zeros(3, 64, device=device))


# (x width, groups, weight rows): two weights of a 2,048-wide x (64 threads a row), of a 1,024-wide x (16 threads a
# row, as q_b), odd row counts that share CTAs, and grouped projections as o_a (groups of 512 and of 2,048 columns)
LINEAR_CASES = {"wide": (2048, 1, (300, 64, 2)), "narrow": (1024, 1, (520, 130, 7)), "grouped": (2048, 4, (4 * 96,)),
                "grouped_wide": (4096, 2, (2 * 72,)), "ragged": (2080, 1, (40, 24)),
                "wider": (8224, 1, (70, 3))}  # ragged: 65 chunks of 32, 9 a warp (the tensor-core GEMV's two-round
# loop runs past its warp's last chunk); wide: 8 a warp; wider: one token's rows above 4,096 (128 threads a row,
# o_b's 8,192; a partial last round)
ROUNDING = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # one rounding of the fp32 sum: half an ulp, doubled


def cpu_repeat(params: dict) -> bool:
    """Parametrisations that only repeat another on the CPU (tests/conftest.py leaves them out): DSV4RT_GEMV_MMA
    picks among CUDA kernels, so on the CPU (the reference) every value runs the same."""
    return params.get("device") == "cpu" and params.get("mma", "") != ""


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 8, 9, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(LINEAR_CASES))
@pytest.mark.parametrize("mma", ["", "1", "2", "0"])  # CUDA, 2-8 tokens: gemv_mma_kernel (auto, one round, two), or not
def test_linear(device, tokens, dtype, case, mma, monkeypatch):
    """Outputs in x's dtype. On CUDA up to 8 tokens take a GEMV kernel (one launch for all weights; 2-8 tokens on the
    tensor cores unless DSV4RT_GEMV_MMA=0): each output within one rounding (plus the fp32 sum's order) of the
    float64 product, deterministic; more tokens take cuBLAS, the reference's own call (grouped: a batched GEMM, held
    to the same bound). On the CPU the reference, which also meets the bound."""
    monkeypatch.setenv("DSV4RT_GEMV_MMA", mma)
    width, groups, rows = LINEAR_CASES[case]
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, width, generator=g).to(device=device, dtype=dtype)
    k = width // groups
    ws = [(torch.randn(n, k, generator=g) * k**-0.5).to(device=device, dtype=dtype) for n in rows]
    got = linear(x, *ws, groups=groups)
    assert len(got) == len(ws)
    if device != "cpu" and tokens > 8 and groups == 1:  # the reference's own call (cuBLAS, whose fp16/bf16 GEMMs
        # may reduce in reduced precision, so the float64 bound below does not hold for them)
        assert all(torch.equal(a, b) for a, b in zip(got, linear_ref(x, ws, groups)))
        return
    xg = x.double().view(tokens, groups, k)
    for w, out in zip(ws, got):
        n = w.shape[0] // groups
        want = torch.einsum("tgi,goi->tgo", xg, w.double().view(groups, n, k)).reshape(tokens, groups * n)
        bound = ROUNDING[dtype] * want.abs() + 1e-5 * torch.einsum(
            "tgi,goi->tgo", xg.abs(), w.double().abs().view(groups, n, k)).reshape(tokens, groups * n)
        assert out.dtype == dtype and out.shape == (tokens, w.shape[0]) and out.is_contiguous()
        assert ((out.double() - want).abs() <= bound).all(), ((out.double() - want).abs() / bound).max().item()
    again = linear(x, *ws, groups=groups)
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    if mma in ("1", "2") and 2 <= tokens <= 8:  # both instances sum the chunks in one order: equal bit for bit
        monkeypatch.setenv("DSV4RT_GEMV_MMA", "2" if mma == "1" else "1")
        assert all(torch.equal(a, b) for a, b in zip(got, linear(x, *ws, groups=groups)))


@pytest.mark.parametrize("device", DEVICES)
def test_linear_errors(device):
    x = torch.zeros(2, 64, device=device, dtype=torch.bfloat16)
    w = torch.zeros(8, 64, device=device, dtype=torch.bfloat16)
    with pytest.raises(Exception, match="weight 1 must be \\[N, K\\] with K = 64"):
        linear(x, w, w[:, :32])
    with pytest.raises(Exception, match="weight 0 is (torch.float32|Float), x (torch.bfloat16|BFloat16)"):
        linear(x, w.float())
    with pytest.raises(Exception, match="groups > 1 takes one weight"):
        linear(x, w[:, :32], w[:, :32], groups=2)
    with pytest.raises(Exception, match="not a multiple of groups 3"):
        linear(x, w, groups=3)
    with pytest.raises(Exception, match="N a multiple of groups"):
        linear(x, w[:7, :32], groups=2)
    with pytest.raises(Exception, match="no weights"):
        linear(x)


def _run(model, prompt, decodes=6):
    rt = dsv4rt.Runtime(model, max_requests=1, max_context=128)
    r = rt.admit()
    logits = [rt.step({r: prompt}, all_logits=True)[r]]
    for t in range(decodes):
        logits.append(rt.step({r: [(7 * t + 3) % model.cfg.vocab_size]}, all_logits=True)[r])
    return torch.cat(logits)


def test_bf16_projections_match_their_fp32_copies():
    """A bf16 model against a copy whose fp32-result projection weights are fp32 copies of the same values. On the CPU
    both run the reference's upcast product, so every logit is equal bit for bit. (The same comparison on CUDA cannot
    hold to a tolerance: the bf16 and fp32 weights take different kernels whose sums differ in order, and the step
    amplifies that: on the CPU, 1e-6 relative noise on these projections moves the logits by 0.16 of the largest with
    FP8 caches, through quantisation and top-k choices; `test_bf16_projection_calls_in_the_model` checks CUDA.)"""
    import copy

    model = dsv4rt.Model.random(dsv4rt.ModelConfig.tiny(), seed=3, dtype=torch.bfloat16)
    twin = copy.deepcopy(model)
    for name, module in twin.named_modules():
        if isinstance(getattr(module, "weight", None), torch.nn.Parameter) and f"{name}.weight".endswith(FP32_PROJ):
            module.weight = torch.nn.Parameter(module.weight.float(), requires_grad=False)
    assert sum(p.dtype == torch.float32 and n.endswith(FP32_PROJ) for n, p in twin.named_parameters()) >= 4
    prompt = torch.randint(0, model.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    got, want = _run(model, prompt), _run(twin, prompt)
    assert torch.equal(got, want), ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_projection_calls_in_the_model(device, monkeypatch):
    """Every projection a bf16 model's prefill and decode steps run through the GEMV ops, recorded with its inputs:
    the compressors' and indexer scorer's (`linear_fp32`) and the router's (`moe_gate`) with fp32 outputs within 1e-5
    of the float64 product of the same inputs (bf16 products are exact, the fp32 sum's order is all that differs);
    the attention's and the LM head's at one token (`linear`) in bf16, within one rounding of that product."""
    calls = []

    def record(fn):
        def wrapped(x, *ws, groups=1):
            out = fn(x, *ws, groups=groups) if groups > 1 else fn(x, *ws)
            calls.append((fn.__name__, x, ws, groups, out if isinstance(out, (list, tuple)) else [out]))
            return out
        return wrapped

    for name in ("linear_fp32", "moe_gate", "linear"):
        monkeypatch.setattr(moe, name, record(getattr(moe, name)))
    model = dsv4rt.Model.random(dsv4rt.ModelConfig.tiny(), seed=3, dtype=torch.bfloat16, device=device)
    rt = dsv4rt.Runtime(model, max_requests=1, max_context=128, kv_dtype="fp8", graphs=False)
    r = rt.admit()
    rt.step({r: list(range(1, 41))})
    rt.step({r: [5]})
    kinds = {(name, len(ws), groups, x.shape[0]) for name, x, ws, groups, _ in calls}
    assert len(set(model.cfg.layer_types)) >= 3
    for n in ("linear_fp32", "moe_gate"):  # the prefill's rows (padded to a bucket) and the decode's one row
        assert {t > 8 for m, _, _, t in kinds if m == n} == {True, False}, kinds
    assert any(n == "linear_fp32" and k == 5 for n, k, _, _ in kinds), kinds  # a CSA layer's five, one call
    # `linear` up to 8 tokens (model.project): the decode step's q_a with kv, q_b (with the indexer's on CSA layers)
    # and o_b a layer, and the LM head of each step (the prefill's one logit row too)
    assert {(k, t) for n, k, _, t in kinds if n == "linear"} == {(1, 1), (2, 1)}, kinds
    assert sum(n == "linear" for n, *_ in calls) == 3 * model.cfg.num_layers + 2
    for name, x, ws, groups, outs in calls:
        assert x.dtype == torch.bfloat16 and len(outs) == len(ws)
        for w, out in zip(ws, outs):
            assert w.dtype == torch.bfloat16 and out.device.type == device
            want = linear_ref(x.double(), [w.double()], groups)[0]
            if name == "linear":
                assert out.dtype == torch.bfloat16
                assert ((out.double() - want).abs() <= ROUNDING[torch.bfloat16] * want.abs() + 1e-5
                        * linear_ref(x.double().abs(), [w.double().abs()], groups)[0]).all(), name
            else:
                assert out.dtype == torch.float32
                assert ((out.double() - want).abs().max() / want.abs().max()).item() <= 1e-5, name
