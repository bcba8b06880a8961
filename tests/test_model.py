"""The projections the reference runs in fp32 (compressors, indexer scorer, router): their weight dtypes, and
`linear_fp32` (ops/moe.py) against a float64 product."""
import pytest
import torch
import torch.nn.functional as F

import dsv4rt
from dsv4rt.ops import moe
from dsv4rt.ops.moe import linear_fp32

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
    """Every fp32-result projection a bf16 model's prefill and decode steps run (the compressors' and indexer's through
    `linear_fp32`, the router's through `moe_gate`), recorded with its inputs: bf16 weights, fp32 outputs, and each
    output within 1e-5 of the float64 product of the same inputs (bf16 products are exact, the order of the fp32 sum is
    all that differs)."""
    calls = []

    def record(fn):
        def wrapped(x, *ws):
            out = fn(x, *ws)
            calls.append((fn.__name__, x, ws, out if isinstance(out, (list, tuple)) else [out]))
            return out
        return wrapped

    monkeypatch.setattr(moe, "linear_fp32", record(moe.linear_fp32))
    monkeypatch.setattr(moe, "moe_gate", record(moe.moe_gate))
    model = dsv4rt.Model.random(dsv4rt.ModelConfig.tiny(), seed=3, dtype=torch.bfloat16, device=device)
    rt = dsv4rt.Runtime(model, max_requests=1, max_context=128, kv_dtype="fp8", graphs=False)
    r = rt.admit()
    rt.step({r: list(range(1, 41))})
    rt.step({r: [5]})
    kinds = {(name, len(ws), x.shape[0]) for name, x, ws, _ in calls}
    layer_types = set(model.cfg.layer_types)
    for n in ("linear_fp32", "moe_gate"):  # the prefill's rows (padded to a bucket) and the decode's one row
        assert {t > 8 for m, _, t in kinds if m == n} == {True, False}, kinds
    assert len(layer_types) >= 3 and any(n == "linear_fp32" and k == 5 for n, k, _ in kinds), (layer_types, kinds)
    for name, x, ws, outs in calls:
        assert x.dtype == torch.bfloat16 and len(outs) == len(ws)
        for w, out in zip(ws, outs):
            assert w.dtype == torch.bfloat16 and out.dtype == torch.float32 and out.device.type == device
            want = F.linear(x.double(), w.double())
            assert ((out.double() - want).abs().max() / want.abs().max()).item() <= 1e-5, name
