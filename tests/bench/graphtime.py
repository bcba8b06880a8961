"""Timing helpers shared by the kernel benchmarks: capture calls in one CUDA graph, median device time, the kernels
of a replay as a timeline."""
from __future__ import annotations

import statistics
from typing import Callable

import torch


def capture(call: Callable[[int], object], repeats: int, warmup: int = 1) -> torch.cuda.CUDAGraph:
    """One CUDA graph of call(0), ..., call(repeats - 1); call(0..warmup-1) run first, outside the capture, on
    the capture stream (lazy initialisation, workspaces). Cycling input sets inside `call` keeps successive calls
    from reusing L2."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(warmup):
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(repeats):
            call(i)
    torch.cuda.synchronize()
    return graph


def median_seconds(fn: Callable[[], object], rounds: int = 20) -> float:
    """Median device seconds of fn() (CUDA events), after one untimed call."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    times = []
    for _ in range(rounds):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e-3)
    return statistics.median(times)


def isolated_seconds(calls: "Callable[[int], object] | list[Callable[[int], object]]", repeats: int,
                     warmup: int = 1, rounds: int = 20) -> float:
    """Device seconds of one step of `calls` (a callable, or a list of them run in order) in which no call can overlap
    the kernels before it: each call follows a one-element torch kernel, launched without programmatic stream
    serialization, so that kernel starts only when the call before has completed and the call's grids only when it
    has exited. The graph of those kernels alone is timed too and subtracted. Kernels launched with programmatic
    dependent launch overlap their predecessor's end, so back to back (capture above) a call hides part of its start
    behind the call before; in a decode step other kernels (torch ops) run between two calls of an op, as here."""
    steps = calls if isinstance(calls, list) else [calls]
    sep = torch.zeros(1, device="cuda")

    def both(i: int) -> None:
        for call in steps:
            sep.add_(1.0)
            call(i)

    def alone(i: int) -> None:
        for _ in steps:
            sep.add_(1.0)

    t_both = median_seconds(capture(both, repeats, warmup).replay, rounds)
    t_alone = median_seconds(capture(alone, repeats, 1).replay, rounds)
    return (t_both - t_alone) / repeats


def measure_copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB, bytes read + written per second: the best of three medians of 10 copies. A
    single median now and then came out 4% low on an H200 that otherwise measured 4.18-4.22 TB/s, and a low
    bandwidth makes every floor easier to reach; the best of three is the stricter and steadier reference."""
    n = 1 << 30
    src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    t = min(median_seconds(lambda: dst.copy_(src), 10) for _ in range(3))
    return 2 * n / t


def measure_matmul_rate() -> float:
    """bf16 8192^3 matmul, FLOP per second (random data)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = median_seconds(lambda: a @ b, 10)
    return 2 * n**3 / t


def replay_kernels(graph: torch.cuda.CUDAGraph) -> list[dict]:
    """The kernels of one replay of `graph` under torch.profiler, by start time: chrome-trace events with `name`,
    `ts` (start, us) and `dur` (us)."""
    import json
    import tempfile
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/trace.json"
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])


def timeline_lines(steps: list[list[dict]]) -> list[str]:
    """One line a kernel of a step, `start end name` in us after the step's first kernel started, the mean over
    `steps` (lists of the same kernels in the same order). The name is the kernel's function name (`*_kernel`) and
    its template arguments, when it has them."""
    import re
    lines = []
    for i, e in enumerate(steps[0]):
        start = statistics.mean(c[i]["ts"] - c[0]["ts"] for c in steps)
        end = statistics.mean(c[i]["ts"] + c[i]["dur"] - c[0]["ts"] for c in steps)
        kernel = re.search(r"(\w+_kernel(<[^()]*>)?)", e["name"])
        lines.append(f"    {start:7.1f} {end:7.1f}  {kernel.group(1) if kernel else e['name'][:60]}")
    return lines
