"""The fp32-result projections of a layer's compressors and indexer scorer (`linear_fp32`, ops/moe.py), CUDA-graph
replayed, Flash dims (hidden 4,096; CSA: main kv and gate 1,024 rows each, indexer kv and gate 256 each, scorer 64;
HCA: main kv and gate 512 each), bf16 x: one `linear_fp32` call over the layer's bf16 weights, against one
`moe_gate` call a weight (bf16) and against the fp32 GEMMs over fp32 weights that the model ran before its
projections kept the checkpoint's bf16. Same card, same run.

Each graph holds REPEATS calls on fixed inputs; time per call = median replay time / REPEATS.
Run: python -m pytest tests/bench/test_bench_linear.py --benchmark-only -s
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsv4rt.ops.moe import linear_fp32, moe_gate
from graphtime import capture, median_seconds

REPEATS = 50
ROUNDS = 20
HIDDEN = 4096
LAYERS = {"CSA": (1024, 1024, 256, 256, 64), "HCA": (512, 512)}


@pytest.mark.cuda
@pytest.mark.parametrize("n_tok", [1, 8, 64])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_bench_linear_fp32(benchmark, layer, n_tok):
    import dsv4rt.ops
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n_tok, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    ws = [(torch.randn(n, HIDDEN, device="cuda", generator=g) * HIDDEN**-0.5).to(torch.bfloat16)
          for n in LAYERS[layer]]
    ws32 = [w.float() for w in ws]
    calls = {
        "linear_fp32 (one call)": lambda i: linear_fp32(x, *ws),
        "moe_gate a weight": lambda i: [moe_gate(x, w) for w in ws],
        "fp32 GEMMs (before)": lambda i: [F.linear(x.float(), w) for w in ws32],
    }
    us = {k: median_seconds(capture(c, REPEATS).replay, ROUNDS) / REPEATS * 1e6 for k, c in calls.items()}
    cov = dsv4rt.ops.kernel_coverage()["linear_fp32"]
    benchmark.extra_info.update(device=torch.cuda.get_device_name(), layer=layer, tokens=n_tok, coverage=cov,
                                **{f"us {k}": v for k, v in us.items()})
    print(f"\n{layer} projections T={n_tok} ({cov}): " + ", ".join(f"{k} {v:.2f} us" for k, v in us.items())
          + f" on {torch.cuda.get_device_name()}")
    graph = capture(calls["linear_fp32 (one call)"], REPEATS)
    benchmark.pedantic(lambda: (graph.replay(), torch.cuda.synchronize()), rounds=ROUNDS, warmup_rounds=2)
