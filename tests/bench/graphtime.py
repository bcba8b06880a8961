"""Timing helpers shared by the kernel benchmarks: capture calls in one CUDA graph, median device time."""
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
