"""MoE block (router + routed experts + shared expert), CUDA-graph replayed, Flash dims: hidden 4096, moe_inter 2048,
256 routed experts, top-6, one shared expert, bf16 weights.

Weights as the model holds them: w13 [256, 2I, D], w2 [256, D, I], the shared expert's gate [I, D], up [I, D] and
down [D, I] as three separate tensors, read in place by moe_experts. Variants:
  * fused: what dsv4rt/model.py MoE.forward does: moe_gate (fp32 logits) + moe_route + moe_experts with the shared
    projections and x_ready=True (router + experts; the shared expert starts while the router runs);
  * experts: moe_experts alone (routed + shared, x_ready=True: x is an input of the graph) on precomputed routing
    (the fused call minus the router);
  * router: the fused call's routing alone (moe_gate, moe_route); router_linear: the same with the former
    F.linear(x.float(), gate) logits (a cast and a cuBLAS GEMV over the fp32 weight).
The router weight is bf16, as a bf16 model holds it (the checkpoint's dtype; moe_gate casts it to fp32 exactly).
Each benchmark captures REPEATS calls in one CUDA graph, cycling through several input sets so that successive calls
choose other experts (no L2 reuse from one call to the next), and divides the replay time by REPEATS. The MoE
kernels are launched with programmatic dependent launch, so back to back a call's first kernels overlap the end of
the call before; in the model torch ops run between two MoE calls. test_bench_moe therefore also times each call
after a one-element torch kernel (graphtime.isolated_seconds: no overlap with the call before) and judges the
targets on that time.
Targets (issue 6), against ceilings measured in the same run:
  * batch 1: within 1.25x of reading those 7 experts' weights (6 routed + shared) at the copy bandwidth (1 GiB copy);
  * batch 64: within 1.5x of reading the distinct experts the batch selects (the shared one included);
  * a 4,096-token chunk: >= 60% of the bf16 matmul rate (8192^3 torch.mm), at 2 * T * 7 * 3 * D * I FLOPs. Such a
    chunk also reads every expert's weights (24,576 routed pairs over 256 experts): that read at the copy bandwidth
    is printed as the chunk's other floor.
The knobs benchmark compares the expert op (and the fused call) at small batches with its default settings, with
x_ready ignored (DSV4RT_MOE_EARLY=0), without programmatic launches, and on the other small-batch path (the tiny path,
DSV4RT_MOE_TINY=8, or the GEMV path, DSV4RT_MOE_TINY=0) with and without x_ready and the tiny L2 prefetch; and with a
one-token call through the plan kernel (DSV4RT_MOE_DIRECT=0) and without the L2 prefetch of the shared expert's down
rows during the routing (DSV4RT_MOE_KEEP=0). The profile benchmark
prints the kernels of one fused call (CUDA-graph replay under torch.profiler, programmatic launches off); the timeline
benchmark when each kernel of a batch-1 call starts and ends with them on. The crossover benchmark times both
expert paths (GEMV kernels, grouped GEMMs) at sizes around the threshold.
Run: python -m pytest tests/bench/test_bench_moe.py --benchmark-only -s
"""
from __future__ import annotations

import statistics

import pytest
import torch
import torch.nn.functional as F

from dsv4rt.ops.moe import moe_experts, moe_gate, moe_route
from graphtime import capture, isolated_seconds, median_seconds, replay_kernels, timeline_lines

D, I, E, K = 4096, 2048, 256, 6
SCALE, LIMIT = 1.5, 10.0
EXPERT_BYTES = 3 * D * I * 2                       # gate, up and down rows of one expert, bf16
TARGETS = {1: ("bandwidth", 1.25), 64: ("bandwidth", 1.5), 4096: ("matmul", 0.60)}
INPUT_SETS = {1: 16, 2: 16, 4: 8, 8: 8, 64: 4, 128: 2, 256: 2, 512: 2, 1024: 2, 4096: 2}
# calls per graph: replay launch cost hidden
REPEATS = {1: 48, 2: 32, 4: 16, 8: 16, 64: 8, 128: 4, 256: 4, 512: 4, 1024: 2, 4096: 4}
ROUNDS = 15
RESULTS: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _summary():
    yield
    if RESULTS:
        import dsv4rt.ops
        cov = {k: v for k, v in dsv4rt.ops.kernel_coverage().items() if k.startswith("moe")}
        print(f"\n== MoE benchmarks on {torch.cuda.get_device_name()}; kernel coverage {cov}")
        for line in RESULTS:
            print(line)


@pytest.fixture(scope="module")
def moe_weights():
    """(w13, w2, (shared gate, up, down), router gate fp32, bias)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * I, D, generator=g, device="cuda", dtype=torch.bfloat16).mul_(6.0 * D**-0.5)
    w2 = torch.randn(E, D, I, generator=g, device="cuda", dtype=torch.bfloat16).mul_(I**-0.5)
    sg, su = (torch.randn(I, D, generator=g, device="cuda", dtype=torch.bfloat16).mul_(6.0 * D**-0.5)
              for _ in range(2))
    sd = torch.randn(D, I, generator=g, device="cuda", dtype=torch.bfloat16).mul_(I**-0.5)
    gate = torch.randn(E, D, generator=g, device="cuda").mul_(D**-0.5).bfloat16()  # as a bf16 model holds it
    bias = torch.randn(E, generator=g, device="cuda").mul_(0.1)
    yield w13, w2, (sg, su, sd), gate, bias
    del w13, w2, sg, su, sd
    torch.cuda.empty_cache()


def _route(x, gate, bias):
    return moe_route(moe_gate(x, gate), bias, K, SCALE)


def _variant(name: str, wt):
    w13, w2, shared, gate, bias = wt
    if name == "fused":
        def fn(x, routing):
            return moe_experts(x, w13, w2, *_route(x, gate, bias), LIMIT, *shared, x_ready=True)
    elif name == "experts":
        def fn(x, routing):
            return moe_experts(x, w13, w2, *routing, LIMIT, *shared, x_ready=True)
    elif name == "router":
        def fn(x, routing):
            return _route(x, gate, bias)
    elif name == "router_linear":
        gate32 = gate.float()  # the former fp32 weight, converted outside the graph
        def fn(x, routing):
            return moe_route(F.linear(x.float(), gate32), bias, K, SCALE)
    else:
        raise ValueError(name)
    return fn


def _inputs(tokens: int, wt):
    """Input sets: (x [T, D] bf16, routing (weights [T, 6], ids [T, 6])), and the mean distinct experts read (the
    routed ones the set chooses, plus the shared expert)."""
    _, _, _, gate, bias = wt
    sets, distinct = [], []
    for seed in range(INPUT_SETS[tokens]):
        g = torch.Generator(device="cuda").manual_seed(1000 + seed)
        x = torch.randn(tokens, D, generator=g, device="cuda").to(torch.bfloat16)
        routing = _route(x, gate, bias)
        sets.append((x, routing))
        distinct.append(int(torch.unique(routing[1]).numel()) + 1)
    return sets, statistics.mean(distinct)


def _capture(fn, sets, repeats: int) -> torch.cuda.CUDAGraph:
    return capture(lambda r: fn(*sets[r % len(sets)]), repeats, warmup=len(sets))


def _time_call(fn, sets, repeats: int) -> tuple[torch.cuda.CUDAGraph, float]:
    graph = _capture(fn, sets, repeats)
    graph.replay()
    return graph, median_seconds(graph.replay, ROUNDS) / repeats


@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["fused", "experts", "router", "router_linear"])
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_bench_moe(benchmark, moe_weights, copy_bandwidth, matmul_rate, tokens, variant):
    sets, distinct = _inputs(tokens, moe_weights)
    fn = _variant(variant, moe_weights)
    graph, back_to_back = _time_call(fn, sets, REPEATS[tokens])
    per_call = isolated_seconds(lambda r: fn(*sets[r % len(sets)]), REPEATS[tokens], len(sets), ROUNDS)
    floor = distinct * EXPERT_BYTES / copy_bandwidth
    flops = 2 * tokens * (K + 1) * 3 * D * I
    kind, target = TARGETS[tokens]
    if variant.startswith("router"):
        ratio, met, vs = per_call / floor, None, f"({per_call / floor:.2f}x the expert read floor)"
    elif kind == "bandwidth":
        ratio, met = per_call / floor, per_call / floor <= target
        vs = f"{ratio:.2f}x the {distinct:.1f}-expert read floor {floor * 1e6:.1f} us (target <= {target}x)"
    else:
        ratio = flops / per_call / matmul_rate
        met = ratio >= target
        vs = (f"{flops / per_call / 1e12:.0f} TFLOP/s = {ratio:.0%} of mm {matmul_rate / 1e12:.0f} TFLOP/s "
              f"(target >= {target:.0%}); weight-read floor {floor * 1e6:.0f} us = at most "
              f"{flops / floor / matmul_rate:.0%} of mm")
    verdict = "" if met is None else ("met; " if met else "NOT met; ")
    line = (f"T={tokens:5d} {variant:13s} {per_call * 1e6:9.1f} us/call ({back_to_back * 1e6:.1f} back to back)  {vs}  "
            f"[{verdict}copy {copy_bandwidth / 1e12:.2f} TB/s]")
    RESULTS.append(line)
    print("\n" + line)
    benchmark.extra_info.update(device=torch.cuda.get_device_name(), tokens=tokens, variant=variant,
                                us_per_call=per_call * 1e6, us_per_call_back_to_back=back_to_back * 1e6,
                                distinct_experts=distinct, ratio=ratio, target=target,
                                met=met, copy_TBps=copy_bandwidth / 1e12, mm_TFLOPs=matmul_rate / 1e12)
    benchmark.pedantic(lambda: (graph.replay(), torch.cuda.synchronize()), rounds=5, warmup_rounds=1)


KNOBS = {  # name -> environment of csrc/moe.cpp at capture time
    "default": {},
    "no_early": {"DSV4RT_MOE_EARLY": "0"},
    "no_pdl": {"DSV4RT_MOE_PDL": "0"},
    "gemv": {"DSV4RT_MOE_TINY": "0"},
    "gemv_no_early": {"DSV4RT_MOE_TINY": "0", "DSV4RT_MOE_EARLY": "0"},
    "tiny": {"DSV4RT_MOE_TINY": "8"},
    "tiny_no_early": {"DSV4RT_MOE_TINY": "8", "DSV4RT_MOE_EARLY": "0"},
    "tiny_no_prefetch": {"DSV4RT_MOE_TINY": "8", "DSV4RT_MOE_TINY_PREFETCH": "0"},
    "plan": {"DSV4RT_MOE_DIRECT": "0"},
    "no_keep": {"DSV4RT_MOE_KEEP": "0"},
    "plan_no_keep": {"DSV4RT_MOE_DIRECT": "0", "DSV4RT_MOE_KEEP": "0"},
}


# the tiny path serves at most 8 tokens: its knobs are not collected at 64
KNOB_CASES = [(t, v, k) for t in (1, 8, 64) for v in ("experts", "fused") for k in KNOBS
              if not (t > 8 and k.startswith("tiny"))]


@pytest.mark.cuda
@pytest.mark.parametrize("tokens,variant,knob", KNOB_CASES)
def test_bench_moe_knobs(benchmark, moe_weights, copy_bandwidth, tokens, variant, knob, monkeypatch):
    """The expert op (or the fused call) with its default settings, with x_ready ignored, without programmatic
    launches, and forced onto either small-batch path (the knobs are read when the graph is captured)."""
    for k, v in KNOBS[knob].items():
        monkeypatch.setenv(k, v)
    sets, distinct = _inputs(tokens, moe_weights)
    graph, per_call = _time_call(_variant(variant, moe_weights), sets, REPEATS[tokens])
    floor = distinct * EXPERT_BYTES / copy_bandwidth
    line = (f"T={tokens:5d} {variant:8s} {knob:16s} {per_call * 1e6:9.1f} us/call  {per_call / floor:.2f}x the "
            f"{distinct:.1f}-expert read floor {floor * 1e6:.1f} us")
    RESULTS.append(line)
    print("\n" + line)
    benchmark.extra_info.update(device=torch.cuda.get_device_name(), tokens=tokens, variant=variant, knob=knob,
                                us_per_call=per_call * 1e6, ratio=per_call / floor)
    benchmark.pedantic(lambda: (graph.replay(), torch.cuda.synchronize()), rounds=5, warmup_rounds=1)


@pytest.mark.cuda
@pytest.mark.parametrize("path", ["gemv", "grouped"])
@pytest.mark.parametrize("tokens", [128, 256, 512, 1024])
def test_bench_moe_crossover(benchmark, moe_weights, copy_bandwidth, matmul_rate, tokens, path, monkeypatch):
    """Both expert paths at one size (the path is forced through the threshold knob at capture time)."""
    monkeypatch.setenv("DSV4RT_MOE_GROUPED_MIN_PAIRS", str(1 << 40) if path == "gemv" else "0")
    sets, distinct = _inputs(tokens, moe_weights)
    graph, per_call = _time_call(_variant("experts", moe_weights), sets, REPEATS[tokens])
    floor = distinct * EXPERT_BYTES / copy_bandwidth
    flops = 2 * tokens * (K + 1) * 3 * D * I
    line = (f"T={tokens:5d} experts  {path:7s} {per_call * 1e6:9.1f} us/call  {per_call / floor:.2f}x the read floor, "
            f"{flops / per_call / matmul_rate:.0%} of mm")
    RESULTS.append(line)
    print("\n" + line)
    benchmark.extra_info.update(device=torch.cuda.get_device_name(), tokens=tokens, path=path,
                                us_per_call=per_call * 1e6)
    benchmark.pedantic(lambda: (graph.replay(), torch.cuda.synchronize()), rounds=3, warmup_rounds=1)


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_bench_moe_profile(benchmark, moe_weights, tokens, monkeypatch):
    """Kernel times of the fused call (one input set, graph-replayed under torch.profiler), per call. Without
    programmatic launches: with them a kernel's time also covers its wait for the one before."""
    from torch.profiler import ProfilerActivity, profile
    monkeypatch.setenv("DSV4RT_MOE_PDL", "0")
    sets, _ = _inputs(tokens, moe_weights)
    repeats = REPEATS[tokens]
    graph = _capture(_variant("fused", moe_weights), sets[:1], repeats)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    rows = sorted(((e.key, e.device_time_total / (3 * repeats), e.count // (3 * repeats))
                   for e in prof.key_averages() if e.device_time_total > 0), key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    lines = [f"T={tokens:5d} fused kernels, PDL off (us/call, launches/call), sum {total:.1f} us:"]
    lines += [f"    {us:9.1f} {n:3d}  {name[:110]}" for name, us, n in rows[:12]]
    RESULTS.extend(lines)
    print("\n" + "\n".join(lines))
    benchmark.pedantic(lambda: (graph.replay(), torch.cuda.synchronize()), rounds=2, warmup_rounds=1)


@pytest.mark.cuda
@pytest.mark.parametrize("knob", ["default", "plan_no_keep"])
@pytest.mark.parametrize("variant", ["fused", "experts"])
def test_bench_moe_timeline(benchmark, moe_weights, copy_bandwidth, variant, knob, monkeypatch):
    """Batch 1 with programmatic launches on (as the model runs): when each kernel of a call starts and ends,
    relative to the call's first kernel, averaged over the middle calls of a graph of 16 (input sets cycled), from
    torch.profiler's trace. Shows how long the routing chain (gate -> route -> plan) holds back the routed experts."""
    for k, v in KNOBS[knob].items():
        monkeypatch.setenv(k, v)
    sets, distinct = _inputs(1, moe_weights)
    repeats = 16
    graph, per_call = _time_call(_variant(variant, moe_weights), sets, repeats)
    floor = distinct * EXPERT_BYTES / copy_bandwidth
    events = replay_kernels(graph)
    # the call's first kernel: the gate, else the plan, or the up kernel of a one-token call without one
    plan = any("moe_plan" in e["name"] for e in events)
    first = "moe_gate" if variant == "fused" else ("moe_plan" if plan else "moe_up")
    calls: list[list[dict]] = []
    for e in events:
        if first in e["name"]:
            calls.append([])
        if calls:
            calls[-1].append(e)
    assert len(calls) == repeats, f"expected {repeats} calls in the trace, found {len(calls)}"
    middle = calls[4:-2]
    lines = [f"T=    1 {variant:8s} {knob} timeline: {per_call * 1e6:.1f} us/call = {per_call / floor:.3f}x the "
             f"{distinct:.1f}-expert read (start / end us after the call's first kernel, mean of {len(middle)} calls)"]
    lines += timeline_lines(middle)
    RESULTS.extend(lines)
    print("\n" + "\n".join(lines))
    benchmark.extra_info.update(device=torch.cuda.get_device_name(), variant=variant, us_per_call=per_call * 1e6)
    benchmark.pedantic(lambda: (graph.replay(), torch.cuda.synchronize()), rounds=2, warmup_rounds=1)
