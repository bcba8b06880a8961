"""mHC ops (hc_pre, hc_post, hc_head), CUDA-graph replayed, Flash dims (n = 4, D = 4096, 20 Sinkhorn iterations,
bf16 streams), decode T = 1, 8 and 64 and a 512-token prefill chunk: the native kernels against the references (ops/mhc.py, plain torch) on the
same card in the same run.

Each graph holds REPEATS calls of one op on fixed inputs; time per call = median replay time / REPEATS.
Run: python -m pytest tests/bench/test_bench_mhc.py --benchmark-only -s
"""
from __future__ import annotations

import pytest
import torch

from dsv4rt.ops.mhc import hc_head, hc_head_ref, hc_post, hc_post_ref, hc_pre, hc_pre_ref
from graphtime import capture, median_seconds

N, D, ITERS, EPS = 4, 4096, 20, 1e-6
REPEATS = 50
ROUNDS = 20
RESULTS: dict[tuple[str, int], tuple[float, float]] = {}


def _args(op: str, n_tok: int) -> tuple:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_tok, N, D, generator=g).to(torch.bfloat16)
    if op == "hc_pre":
        m = (2 + N) * N
        args = (x, torch.randn(m, N * D, generator=g) * 2 * (N * D) ** -0.5, torch.randn(m, generator=g) * 0.5,
                torch.tensor([0.7, 1.3, 2.0]), ITERS, EPS, EPS)
    elif op == "hc_head":
        args = (x, torch.randn(N, N * D, generator=g) * 2 * (N * D) ** -0.5, torch.randn(N, generator=g) * 0.5,
                torch.tensor([1.5]), EPS, EPS)
    else:
        args = (x, torch.randn(n_tok, D, generator=g).to(torch.bfloat16), 2 * torch.sigmoid(torch.randn(n_tok, N)),
                torch.softmax(torch.randn(n_tok, N, N, generator=g), -1))
    return tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


OPS = {"hc_pre": (hc_pre, hc_pre_ref), "hc_post": (hc_post, hc_post_ref), "hc_head": (hc_head, hc_head_ref)}


@pytest.mark.cuda
@pytest.mark.parametrize("n_tok", [1, 8, 64, 512])
@pytest.mark.parametrize("op", list(OPS))
def test_bench_mhc(benchmark, op, n_tok):
    import dsv4rt.ops
    wrapper, ref = OPS[op]
    args = _args(op, n_tok)
    graph = capture(lambda i: wrapper(*args), REPEATS)
    us = median_seconds(graph.replay, ROUNDS) / REPEATS * 1e6
    ref_us = median_seconds(capture(lambda i: ref(*args), REPEATS).replay, ROUNDS) / REPEATS * 1e6
    RESULTS[(op, n_tok)] = (us, ref_us)
    cov = dsv4rt.ops.kernel_coverage()[op]
    benchmark.extra_info.update(device=torch.cuda.get_device_name(), op=op, tokens=n_tok, repeats=REPEATS,
                                us_per_call=us, reference_us_per_call=ref_us, speedup=ref_us / us, coverage=cov)
    print(f"\n{op} T={n_tok}: {us:.2f} us/call ({cov}) vs reference {ref_us:.2f} us/call: {ref_us / us:.1f}x "
          f"on {torch.cuda.get_device_name()}")
    benchmark.pedantic(lambda: (graph.replay(), torch.cuda.synchronize()), rounds=ROUNDS, warmup_rounds=2)


@pytest.mark.cuda
def test_bench_mhc_summary(benchmark):
    """The table of the runs above (run the file as a whole)."""
    print(f"\nmHC ops, Flash dims (n={N}, D={D}, bf16, iters={ITERS}), graph-replayed, on {torch.cuda.get_device_name()}")
    print(f"{'op':<8} {'T':>4} {'native us':>10} {'reference us':>13} {'speedup':>8}")
    for (op, n_tok), (us, ref_us) in sorted(RESULTS.items()):
        print(f"{op:<8} {n_tok:>4} {us:10.2f} {ref_us:13.2f} {ref_us / us:7.1f}x")
    benchmark.extra_info.update(results={f"{k[0]}_T{k[1]}": v for k, v in RESULTS.items()})
    benchmark.pedantic(lambda: torch.cuda.synchronize(), rounds=1)


@pytest.mark.cuda
@pytest.mark.parametrize("iters", [1, 2, 20])
def test_bench_mhc_kernels(benchmark, monkeypatch, iters):
    """Device time of each mHC grid of hc_pre and hc_head at one token (torch.profiler on eager calls, programmatic
    launches off, so a grid's time is its own), hc_pre at 1, 2 and 20 Sinkhorn iterations: the difference is the
    Sinkhorn chain's cost."""
    from torch.profiler import ProfilerActivity, profile
    monkeypatch.setenv("DSV4RT_MHC_PDL", "0")
    pre, head = _args("hc_pre", 1), _args("hc_head", 1)
    pre = pre[:4] + (iters,) + pre[5:]
    for _ in range(5):
        hc_pre(*pre), hc_head(*head)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            hc_pre(*pre)
            hc_head(*head)
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA" and "hc_mix" in e.name:
            key = ("partial" if "partial" in e.name else "finish") + (" (hc_pre)" if "<24" in e.name else " (hc_head)")
            times.setdefault(key, []).append(e.device_time_total)
    line = ", ".join(f"{k} {sum(v) / len(v):.2f} us" for k, v in sorted(times.items()))
    print(f"\nT=1, {iters} Sinkhorn iterations: {line} on {torch.cuda.get_device_name()}")
    assert len(times) == 4, f"expected the partial and finish grids of both ops, got {sorted(times)}"
    benchmark.extra_info.update(device=torch.cuda.get_device_name(), iters=iters,
                                us={k: sum(v) / len(v) for k, v in times.items()})
    benchmark.pedantic(lambda: (hc_pre(*pre), torch.cuda.synchronize()), rounds=5, warmup_rounds=1)


@pytest.mark.cuda
@pytest.mark.parametrize("n_tok", [1, 8, 64])
def test_bench_mhc_boundary(benchmark, monkeypatch, n_tok):
    """A sublayer boundary of the decode step, graph-replayed: hc_post, hc_pre and rms_norm as three native calls
    (the step before hc_post_pre and the norm weight), against hc_post_pre with the norm weight, fused (the post
    inside the pre's partial grid) and with DSV4RT_MHC_POST_FUSE=0 (hc_post's grid first)."""
    import dsv4rt.ops
    from dsv4rt.ops.mhc import hc_post_pre
    from dsv4rt.ops.norm import rms_norm
    x, y, post, comb = _args("hc_post", n_tok)
    _, fn, base, scale, iters, eps, norm_eps = _args("hc_pre", n_tok)
    w = torch.rand(D, device="cuda") + 0.5

    def three(i):
        streams = hc_post(x, y, post, comb)
        xo, po, co = hc_pre(streams, fn, base, scale, iters, eps, norm_eps)
        return rms_norm(xo, w, norm_eps)

    calls = {"hc_post + hc_pre + rms_norm": three,
             "hc_post_pre (norm weight)": lambda i: hc_post_pre(x, y, post, comb, fn, base, scale, iters, eps,
                                                                norm_eps, w, norm_eps)}
    us = {name: median_seconds(capture(c, REPEATS).replay, ROUNDS) / REPEATS * 1e6 for name, c in calls.items()}
    monkeypatch.setenv("DSV4RT_MHC_POST_FUSE", "0")  # read at launch, so at capture: a graph of the unfused form
    us["hc_post_pre, POST_FUSE=0"] = median_seconds(capture(calls["hc_post_pre (norm weight)"], REPEATS).replay,
                                                    ROUNDS) / REPEATS * 1e6
    benchmark.extra_info.update(device=torch.cuda.get_device_name(), tokens=n_tok,
                                coverage=dsv4rt.ops.kernel_coverage()["hc_post_pre"],
                                **{f"us {k}": v for k, v in us.items()})
    print(f"\nmHC boundary T={n_tok}: " + ", ".join(f"{k} {v:.2f} us" for k, v in us.items())
          + f" on {torch.cuda.get_device_name()}")
    graph = capture(calls["hc_post_pre (norm weight)"], REPEATS)
    benchmark.pedantic(lambda: (graph.replay(), torch.cuda.synchronize()), rounds=ROUNDS, warmup_rounds=2)
