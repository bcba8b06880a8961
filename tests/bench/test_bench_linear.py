"""`linear_fp32` and `linear` (ops/moe.py), CUDA-graph replayed. The fp32-result projections of a layer's
compressors and indexer scorer (`linear_fp32`), Flash dims (hidden 4,096; CSA: main kv and gate 1,024 rows each,
indexer kv and gate 256 each, scorer 64; HCA: main kv and gate 512 each), bf16 x: one `linear_fp32` call over the
layer's bf16 weights, against one `moe_gate` call a weight (bf16) and against the fp32 GEMMs over fp32 weights that
the model ran before its projections kept the checkpoint's bf16. And the bf16 projections of a Flash layer at
decode and the LM head (`linear`: one GEMV launch for the projections of one input) against cuBLAS, each with the
time to read its weights at the copy bandwidth measured in the same run. Same card, same run.

Each graph holds REPEATS calls, cycling through copies of the weights larger than L2 (successive calls read HBM);
time per call = median replay time / REPEATS.
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
L2_CLEAR = 160 << 20  # bytes of weight copies a benchmark cycles through: more than an H200's 50 MB L2


@pytest.mark.cuda
@pytest.mark.parametrize("n_tok", [1, 8, 64])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_bench_linear_fp32(benchmark, layer, n_tok):
    import dsv4rt.ops
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n_tok, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    sets = max(1, -(-L2_CLEAR // (sum(LAYERS[layer]) * HIDDEN * 2)))  # successive calls read HBM, not L2
    ws = [[(torch.randn(n, HIDDEN, device="cuda", generator=g) * HIDDEN**-0.5).to(torch.bfloat16)
           for n in LAYERS[layer]] for _ in range(sets)]
    ws32 = [[w.float() for w in s] for s in ws]
    calls = {
        "linear_fp32 (one call)": lambda i: linear_fp32(x, *ws[i % sets]),
        "moe_gate a weight": lambda i: [moe_gate(x, w) for w in ws[i % sets]],
        "fp32 GEMMs (before)": lambda i: [F.linear(x.float(), w) for w in ws32[i % sets]],
    }
    us = {k: median_seconds(capture(c, REPEATS).replay, ROUNDS) / REPEATS * 1e6 for k, c in calls.items()}
    cov = dsv4rt.ops.kernel_coverage()["linear_fp32"]
    benchmark.extra_info.update(device=torch.cuda.get_device_name(), layer=layer, tokens=n_tok, coverage=cov,
                                **{f"us {k}": v for k, v in us.items()})
    print(f"\n{layer} projections T={n_tok} ({cov}): " + ", ".join(f"{k} {v:.2f} us" for k, v in us.items())
          + f" on {torch.cuda.get_device_name()}")
    graph = capture(calls["linear_fp32 (one call)"], REPEATS)
    benchmark.pedantic(lambda: (graph.replay(), torch.cuda.synchronize()), rounds=ROUNDS, warmup_rounds=2)


# `linear` (bf16 x, weights and outputs) at the Flash layer's decode projections: (x width, groups, weight rows...).
PROJECTIONS = {
    "q_a + kv": (HIDDEN, 1, (1024, 512)),
    "q_b + indexer q_b": (1024, 1, (32768, 8192)),
    "o_a (8 groups)": (32768, 8, (8192,)),
    "o_b": (8192, 1, (HIDDEN,)),
    "lm_head": (HIDDEN, 1, (129280,)),
}


@pytest.mark.cuda
@pytest.mark.parametrize("n_tok", [1, 8])
@pytest.mark.parametrize("proj", list(PROJECTIONS))
def test_bench_linear(benchmark, copy_bandwidth, proj, n_tok):
    import dsv4rt.ops
    from dsv4rt.ops.moe import linear, linear_ref
    width, groups, rows = PROJECTIONS[proj]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n_tok, width, device="cuda", generator=g).to(torch.bfloat16)
    k = width // groups
    nbytes = sum(rows) * k * 2
    sets = max(1, -(-L2_CLEAR // nbytes))
    ws = [[(torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(torch.bfloat16) for n in rows]
          for _ in range(sets)]
    calls = {
        "linear (one call)": lambda i: linear(x, *ws[i % sets], groups=groups),
        "cuBLAS (F.linear / einsum, before)": lambda i: linear_ref(x, ws[i % sets], groups),
    }
    us = {n: median_seconds(capture(c, REPEATS).replay, ROUNDS) / REPEATS * 1e6 for n, c in calls.items()}
    floor = nbytes / copy_bandwidth * 1e6  # the copy's bytes read + written a second: the rate of reading alone
    cov = dsv4rt.ops.kernel_coverage()["linear"]
    benchmark.extra_info.update(device=torch.cuda.get_device_name(), proj=proj, tokens=n_tok, coverage=cov,
                                weight_read_us=floor, **{f"us {n}": v for n, v in us.items()})
    print(f"\nlinear {proj} T={n_tok} ({cov}; {nbytes / 1e6:.1f} MB, read at copy bandwidth {floor:.2f} us): "
          + ", ".join(f"{n} {v:.2f} us ({v / floor:.2f}x)" for n, v in us.items())
          + f" on {torch.cuda.get_device_name()}")
    graph = capture(calls["linear (one call)"], REPEATS)
    benchmark.pedantic(lambda: (graph.replay(), torch.cuda.synchronize()), rounds=ROUNDS, warmup_rounds=2)
