"""The projections the reference runs in fp32 (compressors, indexer scorer, router): their weight dtypes, and
`linear_fp32` against a float64 product."""
import pytest
import torch
import torch.nn.functional as F

import dsv4rt
from dsv4rt.model import linear_fp32

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
@pytest.mark.parametrize("tokens", [1, 8, 9, 64, 513])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_linear_fp32(device, tokens, wdtype):
    """fp32 output; bf16 operands give every product exactly, so only the fp32 summation order differs from a
    float64 product. On CUDA up to 8 tokens take moe_gate's GEMV kernel, more a cuBLAS GEMM."""
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 1024, generator=g).to(device=device, dtype=torch.bfloat16)
    w = (torch.randn(300, 1024, generator=g) * 0.02).to(device=device, dtype=wdtype)
    got = linear_fp32(x, w)
    want = F.linear(x.double(), w.double())
    assert got.dtype == torch.float32 and got.shape == (tokens, 300)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() <= 1e-5
