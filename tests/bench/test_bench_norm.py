"""Row-norm and rotation ops (rms_norm, rope_rotate, head_norm_rope, the fake quants, kv_norm_rope_quant),
CUDA-graph replayed, Flash dims (hidden 4096, q_lora 1024, 64 heads of 512 with rope 64, indexer 64 heads of 128),
decode T = 1 and 64 and a 2,048-token chunk:
the native kernels against the references (plain torch, ops/norm.py) on the same card in the same run.

Each graph holds REPEATS calls of one op on fixed inputs; time per call = median replay time / REPEATS.
Run: python -m pytest tests/bench/test_bench_norm.py --benchmark-only -s
"""
from __future__ import annotations

import pytest
import torch

from dsv4rt.ops import norm
from dsv4rt.ops.norm import (head_norm_rope_ref, idx_fp4_hadamard_fake_quant_ref, kv_fp8_fake_quant_ref,
                             kv_norm_rope_quant_ref, rms_norm_ref, rope_rotate_ref)
from dsv4rt.ops.rope import rope_table
from graphtime import capture, median_seconds

REPEATS = 50
ROUNDS = 20
EPS = 1e-6

# case -> (op, reference, shape of x, rope_dim or width of the weight)
CASES = {
    "rms_norm hidden": (norm.rms_norm, rms_norm_ref, (4096,), None),
    "rms_norm q_lora": (norm.rms_norm, rms_norm_ref, (1024,), None),
    "head_norm_rope q": (norm.head_norm_rope, head_norm_rope_ref, (64, 512), 64),
    "rope_rotate kv": (norm.rope_rotate, rope_rotate_ref, (512,), 64),
    "rope_rotate o (inverse)": (norm.rope_rotate, rope_rotate_ref, (64, 512), 64),
    "kv_fp8_fake_quant kv": (norm.kv_fp8_fake_quant, kv_fp8_fake_quant_ref, (512,), 64),
    "idx_fp4_hadamard_fake_quant qi": (norm.idx_fp4_hadamard_fake_quant, idx_fp4_hadamard_fake_quant_ref, (64, 128),
                                       None),
    "kv_norm_rope_quant kv": (norm.kv_norm_rope_quant, kv_norm_rope_quant_ref, (512,), 64),
}


def _args(case: str, n_tok: int) -> tuple:
    _, _, shape, rope_dim = CASES[case]
    x = torch.randn((n_tok,) + shape, device="cuda").to(torch.bfloat16)
    if case.startswith("kv_fp8"):
        return x, rope_dim
    if case.startswith("idx_fp4"):
        return (x,)
    if rope_dim is None:
        return x, torch.rand(shape[-1], device="cuda") + 0.5, EPS
    pos = torch.arange(n_tok, device="cuda", dtype=torch.int32) + 4096
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rope_dim, 2, device="cuda", dtype=torch.float32) / rope_dim))
    cos, sin = rope_table(pos, inv_freq)
    if case.startswith("head_norm"):
        return x, cos, sin, EPS
    if case.startswith("kv_norm"):  # the kv path with FP8 caches; its reference is the three ops' plain torch
        return x, torch.rand(shape[-1], device="cuda") + 0.5, cos, sin, EPS, True
    return x, cos, sin, "inverse" in case


@pytest.mark.cuda
@pytest.mark.parametrize("n_tok", [1, 64, 2048])
@pytest.mark.parametrize("case", list(CASES))
def test_bench_norm(benchmark, case, n_tok):
    import dsv4rt.ops
    op, ref, _, _ = CASES[case]
    args = _args(case, n_tok)
    us = median_seconds(capture(lambda i: op(*args), REPEATS).replay, ROUNDS) / REPEATS * 1e6
    ref_us = median_seconds(capture(lambda i: ref(*args), REPEATS).replay, ROUNDS) / REPEATS * 1e6
    name = case.split()[0]
    cov = dsv4rt.ops.kernel_coverage()[name]
    benchmark.extra_info.update(device=torch.cuda.get_device_name(), case=case, tokens=n_tok,
                                us_per_call=us, reference_us_per_call=ref_us, coverage=cov)
    print(f"\n{case} T={n_tok}: {us:.2f} us/call ({cov}) vs reference {ref_us:.2f} us/call: {ref_us / us:.1f}x "
          f"on {torch.cuda.get_device_name()}")
    graph = capture(lambda i: op(*args), REPEATS)
    benchmark.pedantic(lambda: (graph.replay(), torch.cuda.synchronize()), rounds=ROUNDS, warmup_rounds=2)
