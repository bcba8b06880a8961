"""Compile a step function, capture one CUDA graph per bucket, replay. Knows nothing of DSV4.

The step function takes one argument (any pytree of tensors, e.g. a NamedTuple of views of static
buffers) and returns a tensor. `args_for(key)` must return views with the same data pointers every
time it is called for a key: the graph reads whatever those addresses hold at replay.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, Hashable, Iterable, Optional

import torch
import torch.utils._pytree as pytree

from .backend import resolve


def _ptrs(args: Any) -> list[int]:
    return [t.data_ptr() for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]


class GraphRunner:
    """One compiled function, one CUDA graph per bucket key, one shared memory pool and capture stream."""

    def __init__(self, fn: Callable[[Any], torch.Tensor], args_for: Callable[[Hashable], Any],
                 log: Optional[Callable[[str], None]] = None, backend: str | Callable = "inductor") -> None:
        # backend: "inductor" (fused kernels) or "aot_eager" (same trace, no codegen: fast to capture; mutations of
        # custom ops done in place, backend.py), or any torch.compile backend
        self.fn = torch.compile(fn, fullgraph=True, dynamic=False, backend=resolve(backend))
        self.args_for = args_for
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[Hashable, torch.Tensor] = {}
        self.addresses: dict[Hashable, list[int]] = {}
        self.capture_seconds = 0.0
        self.replays = 0
        self._pool = None
        self._stream: Optional[torch.cuda.Stream] = None

    def capture(self, keys: Iterable[Hashable], order: Callable[[Hashable], Any] = lambda k: k) -> float:
        """Capture every key not captured yet, largest first (smaller graphs then reuse its pool). Returns seconds."""
        todo = sorted((k for k in keys if k not in self.graphs), key=order, reverse=True)
        t0 = time.perf_counter()
        for i, key in enumerate(todo):
            t1 = time.perf_counter()
            self._capture_one(key)
            self.log(f"captured bucket {key} ({i + 1}/{len(todo)}) in {time.perf_counter() - t1:.1f}s, "
                     f"{time.perf_counter() - t0:.1f}s elapsed")
        dt = time.perf_counter() - t0
        self.capture_seconds += dt
        return dt

    @torch.inference_mode()
    def _capture_one(self, key: Hashable) -> None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream()
        args = self.args_for(key)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile, autotune, create library handles outside the capture
                self.fn(args)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            out = self.fn(args)
        torch.cuda.current_stream().wait_stream(stream)
        self.graphs[key], self.outputs[key], self.addresses[key] = graph, out, _ptrs(args)

    def has(self, key: Hashable) -> bool:
        return key in self.graphs

    def replay(self, key: Hashable) -> torch.Tensor:
        """Replay the bucket's graph on whatever its input buffers hold. The output lives in the graph pool:
        use or copy it before the next replay."""
        if __debug__:  # the commonest capture bug: inputs rebuilt at new addresses
            assert _ptrs(self.args_for(key)) == self.addresses[key], f"bucket {key}: input addresses moved"
        self.graphs[key].replay()
        self.replays += 1
        return self.outputs[key]
