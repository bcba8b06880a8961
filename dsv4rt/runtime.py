"""The serving loop's public face: admit / step / release / generate over a fixed set of request slots."""
from __future__ import annotations

import math
import numbers
import os
import sys
from dataclasses import dataclass, field
from typing import AbstractSet as Set, Callable, Iterable, Mapping, Optional, Sequence

import torch
from torch import nn

from dsv4rt import ops
from dsv4rt.graphs import GraphRunner
from dsv4rt.graphs.backend import resolve as resolve_backend
from dsv4rt.ops.kv_quant import store_rows
from dsv4rt.ops.swa import PAD_SLOT

from .cache import BlockAllocator, KVCache
from .config import BLOCK_TOKENS, CSA, HCA, SLIDING, as_int, seed_value
from .config import int_arg as _int_arg
from .model import Model, StepTensors
from .prepare import Segment, StepInputs, bucket_for, buckets_up_to, fill, logit_rows_for, split_segments


class RequestError(ValueError):
    """A request's input cannot be served (bad token id, context overflow, empty input)."""


class UnknownRequest(LookupError):
    """The handle was never admitted, or was already released."""


class CapacityError(RuntimeError):
    """No room: every request slot is taken, or the block allocator cannot hold the step's entries."""


class Step(nn.Module):
    """The function that gets compiled (and captured): one forward over the static step inputs."""

    def __init__(self, model: Model, cache: KVCache) -> None:
        super().__init__()
        self.model, self.cache = model, cache

    def forward(self, st: StepTensors) -> torch.Tensor:
        return self.model(st, self.cache)


@dataclass
class _Request:
    slot: int
    pos: int = 0
    blocks: list[int] = field(default_factory=list)
    broken: Optional[str] = None  # why its caches may be incomplete (a forward call of it failed): refused from then on


class Runtime:
    """Runs a `Model` over paged caches for up to `max_requests` concurrent requests.

    kv_dtype: "auto" (activation dtype), "fp8" (FP8 rows + FP4 indexer keys, stored for real) or
    "fp8_sim" (the same numerics, fake-quantised values kept in the activation dtype).
    compile: run the step through torch.compile(fullgraph=True).
    graphs: capture the compiled step as one CUDA graph per token bucket and replay it (default: on for
        CUDA models). Buckets are the powers of two up to max_tokens_per_step (decode batches and prefill
        chunks alike); graphs that return every position's logits are captured on first use.
    max_tokens_per_step: tokens per forward call; longer steps are split into several calls.
    num_blocks: size of the block pool (default: enough for every slot at max_context).
    backend: torch.compile backend: "inductor" or "aot_eager" (the same fullgraph trace without code
        generation; the caches are written in place, as Inductor's reinplacing does: `dsv4rt.graphs.backend`),
        or any backend torch.compile takes; refused (ValueError) when the step runs eagerly. Default: "inductor"
        for compile=True, "aot_eager" for graphs: on an H200, Inductor's first start in a fresh environment took
        350 s for 3 buckets of the tiny model (a second start, which reuses the compile cache, 9.2 s); aot_eager
        captured 7 buckets of a 4-layer Flash slice in 18.7 s. Before the norm family's ops (ops/norm.py) took the
        RMSNorms and rotations, Inductor's replayed decode step was shorter (the same slice on an H200: 1.48
        against 2.19 ms at batch 1, 2.75 against 3.71 ms at batch 64) after 123 s of compile and capture against
        23 s; with them the two backends have not been compared again (docs/benchmarks.md).
    kernels: on CUDA, "auto" builds/loads the csrc/ kernels and falls back to the reference ops (with a
        message) when that fails; "native" refuses to start unless every op the step calls
        (`dsv4rt.ops.STEP_OPS`) has a native kernel;
        "reference" does not load the extension (kernels loaded earlier in the process stay registered).
        The environment variable DSV4RT_KERNELS overrides the default.
    log: where progress lines go (default: stderr).
    """

    def __init__(self, model: Model, max_requests: int = 8, max_context: int = 4096, kv_dtype: str = "auto",
                 compile: bool = False, max_tokens_per_step: int | None = None, num_blocks: int | None = None,
                 graphs: Optional[bool] = None, backend: Optional[str | Callable] = None, kernels: Optional[str] = None,
                 log: Optional[Callable[[str], None]] = None) -> None:
        if not isinstance(compile, bool):
            raise TypeError(f"compile must be a bool, got {compile!r}")
        if graphs is not None and not isinstance(graphs, bool):
            raise TypeError(f"graphs must be a bool or None, got {graphs!r}")
        if log is not None and not callable(log):
            raise TypeError(f"log must be a callable taking one str, got {type(log).__name__}")
        max_requests = _int_arg("max_requests", max_requests, 1)
        max_context = _int_arg("max_context", max_context, 1)
        if max_tokens_per_step is not None:
            max_tokens_per_step = _int_arg("max_tokens_per_step", max_tokens_per_step, 1)
        if num_blocks is not None:
            num_blocks = _int_arg("num_blocks", num_blocks, 0)
        if backend is not None and not (isinstance(backend, str) or callable(backend)):
            raise TypeError(f"backend must be a torch.compile backend name or callable, got {_type_name(backend)}")
        if backend is not None and not (compile or (model.device.type == "cuda" if graphs is None else graphs)):
            raise ValueError(f"backend={getattr(backend, '__name__', backend)!r} is used only with compile=True or "
                             "graphs=True; this runtime runs the step eagerly (graphs default to off on the CPU)")
        if max_context > model.cfg.max_position:
            raise ValueError(f"max_context {max_context} exceeds the model's max_position {model.cfg.max_position}")
        self.model, self.cfg = model, model.cfg
        self.device = model.device
        self.max_requests, self.max_context = max_requests, max_context
        # default: a block's worth of tokens (or one a request), no more than the bucket a request's context fills
        default = max(max_requests, min(BLOCK_TOKENS, 1 << (max_context - 1).bit_length()))
        self.max_tokens = max_tokens_per_step or default
        if self.max_tokens < max_requests:
            raise ValueError(f"max_tokens_per_step ({self.max_tokens}) must be >= max_requests ({max_requests})")
        if self.max_tokens > max(default, max_requests * max_context):
            raise ValueError(f"max_tokens_per_step ({self.max_tokens}) must be <= max_requests * max_context "
                             f"({max_requests * max_context}): a step holds no more tokens")
        self.cache = KVCache(self.cfg, max_requests, max_context, kv_dtype, model.dtype, self.device, num_blocks)
        self.kv_dtype = kv_dtype
        self.allocator = BlockAllocator(self.cache.num_blocks)
        trash = self.cache.num_blocks
        self.rows_cap = bucket_for(max_requests, self.max_tokens)
        self.inputs = StepInputs.allocate(self.max_tokens, max_requests, self.cache.max_blocks, trash, self.device)
        # host side: the block table master copy and two pinned staging buffers, each guarded by the event of
        # the copy that last read it (rewriting staging under an in-flight non_blocking copy is a silent race)
        self.block_table = torch.full((max_requests + 1, self.cache.max_blocks), trash, dtype=torch.int32)
        # rows of the host table changed since the static inputs' table was last written: only those are staged and
        # copied (a full table is max_requests + 1 rows of max_context / 128 blocks, 2 MB at 64 x 1M tokens)
        self._bt_dirty: set[int] = set()
        on_gpu = self.device.type == "cuda"
        self._stages = [StepInputs.allocate(self.max_tokens, max_requests, self.cache.max_blocks, trash, "cpu",
                                            pin=on_gpu) for _ in range(2 if on_gpu else 1)]
        self._stage_events: list[Optional[torch.cuda.Event]] = [None] * len(self._stages)
        self._stage_written = [(0, 0)] * len(self._stages)  # what each staging buffer's last fill wrote (prepare.fill)
        self._stage_i = 0
        self._step = Step(model, self.cache)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.kernels = _load_kernels(os.environ.get("DSV4RT_KERNELS", "auto") if kernels is None else kernels, on_gpu,
                                     self.log)
        self.graphs = on_gpu if graphs is None else graphs
        if self.graphs and not on_gpu:
            raise ValueError("graphs=True needs a model on a CUDA device")
        self.compiled = compile or self.graphs
        backend = backend or ("aot_eager" if self.graphs else "inductor")
        self.backend = backend
        if self.compiled:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.runner: Optional[GraphRunner] = None
        self.startup_seconds = 0.0
        if self.graphs:
            self.runner = GraphRunner(self._step, self._bucket_args, log=self.log, backend=backend)
            keys = [(b, False) for b in buckets_up_to(self.max_tokens)]
            self.log(f"compiling and capturing {len(keys)} buckets (tokens {keys[0][0]}..{keys[-1][0]}) ...")
            hits = torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"]
            self.startup_seconds = self.runner.capture(keys, order=lambda k: k[0])
            reused = torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"] - hits
            cache = f", {reused} compiled graphs reused from the compile cache" if backend == "inductor" else ""
            name = getattr(backend, "__name__", backend)
            self.log(f"compile + capture: {self.startup_seconds:.1f}s for {len(keys)} graphs ({name} backend{cache})")
            self._fn = None
        elif compile:
            self._fn = torch.compile(self._step, fullgraph=True, dynamic=False, backend=resolve_backend(backend))
        else:
            self._fn = self._step
        self._requests: dict[int, _Request] = {}
        self._landed = False
        # decode(): ids clamped into the vocabulary, counted by slot on the device until the host next waits for it
        self._bad_ids = torch.zeros(max_requests, dtype=torch.int32, device=self.device)
        self._ids_unchecked = False
        self._free_slots = list(range(max_requests - 1, -1, -1))
        self._next_handle = 0

    def _bucket_args(self, key: tuple[int, bool]) -> StepTensors:
        bucket, all_logits = key
        return self.inputs.args(bucket, logit_rows_for(bucket, all_logits, self.rows_cap))

    # ------------------------------------------------------------------ lifecycle
    def admit(self) -> int:
        """Take a free request slot (its ring and compressor state reset). Returns the request handle."""
        if not self._free_slots:
            raise CapacityError(f"all {self.max_requests} request slots are in use (max_requests={self.max_requests})")
        slot = self._free_slots.pop()
        self.cache.reset_slot(slot)
        if self._ids_unchecked:
            self._bad_ids[slot] = 0  # an unread count of the slot's last request (stream-ordered, no wait)
        handle = self._next_handle
        self._next_handle += 1
        self._requests[handle] = _Request(slot)
        return handle

    def release(self, handle: int) -> None:
        """Free the request's slot and blocks."""
        req = self._get(handle)
        del self._requests[as_int(handle)]  # the key is an int whatever integer type the handle came as
        self.allocator.free(req.blocks)
        self.block_table[req.slot].fill_(self.cache.num_blocks)
        self._bt_dirty.add(req.slot)
        self._free_slots.append(req.slot)

    def position(self, handle: int) -> int:
        """Tokens the request has processed so far."""
        return self._get(handle).pos

    @property
    def live(self) -> list[int]:
        return list(self._requests)

    def _get(self, handle: int) -> _Request:
        try:
            req = self._requests.get(as_int(handle))  # any integer scalar type (numpy's too)
        except TypeError:
            req = None
        if req is None:
            raise UnknownRequest(f"unknown request handle {handle!r} (never admitted or already released)")
        return req

    # ------------------------------------------------------------------ prepare
    def _validate(self, batch: Mapping[int, Sequence[int]]) -> tuple[list[Segment], list[int]]:
        """The step's segments and the blocks each segment's request must be given, every refusal raised before
        anything is written."""
        if not isinstance(batch, Mapping) or not batch:
            raise RequestError("step() takes a non-empty dict {handle: [token ids]}")
        return self._segments(batch.items())

    def _segments(self, items: Iterable[tuple[int, Sequence[int]]]) -> tuple[list[Segment], list[int]]:
        """_validate's checks over (handle, token ids) pairs (a handle that comes twice is refused)."""
        segments, new_blocks, need_blocks, seen = [], [], 0, set()
        vocab, blocks_needed = self.cfg.vocab_size, self.cache.blocks_needed
        for handle, tokens in items:
            req = self._get(handle)
            handle = as_int(handle)  # an int from here on (the handle may come as another integer type)
            if req.broken is not None:
                raise RequestError(f"request {handle}: {req.broken}; release it")
            if handle in seen:
                raise RequestError(f"request {handle} appears twice in the step")
            seen.add(handle)
            toks = _token_list("request", tokens, handle)
            if not toks:
                raise RequestError(f"request {handle}: no new tokens")
            if min(toks) < 0 or max(toks) >= vocab:
                bad = next(t for t in toks if not 0 <= t < vocab)
                raise RequestError(f"request {handle}: token id {bad} outside the vocabulary [0, {vocab})")
            end = req.pos + len(toks)
            if end > self.max_context:
                raise RequestError(f"request {handle}: {req.pos} + {len(toks)} tokens exceeds max_context={self.max_context}")
            n_new = blocks_needed(end) - len(req.blocks)
            new_blocks.append(n_new)
            if n_new > 0:
                need_blocks += n_new
            segments.append(Segment(handle, req.slot, req.pos, toks))
        if need_blocks > self.allocator.num_free:
            raise CapacityError(f"block allocator exhausted: the step needs {need_blocks} new blocks, "
                                f"{self.allocator.num_free} free of {self.allocator.num_blocks}")
        return segments, new_blocks

    def _allocate(self, segments: list[Segment], new_blocks: list[int]) -> None:
        """Gives each segment's request the new blocks _validate found it needs."""
        for seg, n_new in zip(segments, new_blocks):
            if n_new > 0:
                req = self._requests[seg.handle]
                first = len(req.blocks)
                req.blocks.extend(self.allocator.allocate(n_new))
                self.block_table[req.slot, first:len(req.blocks)] = torch.tensor(req.blocks[first:],
                                                                                  dtype=torch.int32)
                self._bt_dirty.add(req.slot)

    # ------------------------------------------------------------------ step
    def _stage(self) -> StepInputs:
        """Next host staging buffer, once the copy that last read it has finished."""
        self._stage_i = (self._stage_i + 1) % len(self._stages)
        event = self._stage_events[self._stage_i]
        if event is not None:
            event.synchronize()  # only waits when the host runs two steps ahead of the device
        return self._stages[self._stage_i]

    def _launch(self, call: list[Segment], all_logits: bool,
                ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, list]:
        """Prepare one forward call and launch it; returns the device logits (no host sync) and row owners. `ids`: the
        call's token ids on the device, one a segment (decode()); the segments then hold placeholders."""
        stage = self._stage()
        bucket, n_rows, owners, written = fill(stage, call, all_logits, self.max_tokens, self.rows_cap,
                                               self._stage_written[self._stage_i])
        self._stage_written[self._stage_i] = written
        rows = sorted(self._bt_dirty)
        if 4 * len(rows) > self.block_table.shape[0]:
            rows = None  # many rows: one copy of the whole table
            stage.block_table.copy_(self.block_table)
        else:
            for r in rows:
                stage.block_table[r].copy_(self.block_table[r])
        key = (bucket, all_logits)
        if self.runner is not None and not self.runner.has(key):
            # Warm-up and capture run the step: do it on padding, before the real inputs land, so that no
            # cache or compressor state is written twice (the step is not idempotent).
            self.log(f"capturing bucket {key} on first use ...")
            self.inputs.req_slot.fill_(PAD_SLOT)
            self.runner.capture([key])
        self.inputs.copy_from(stage, block_rows=rows)
        self._bt_dirty.clear()
        if ids is not None:
            self._device_ids(ids)
        self._landed = True  # from here on the call may write its requests' caches
        if self.device.type == "cuda":
            event = self._stage_events[self._stage_i] or torch.cuda.Event()
            event.record()
            self._stage_events[self._stage_i] = event
        if self.runner is not None:
            logits = self.runner.replay(key)
        else:
            logits = self._fn(self.inputs.args(bucket, n_rows))
        return logits, owners

    def _to_host(self, logits: torch.Tensor, n: int) -> torch.Tensor:
        """The first n logit rows on the host: the step's only host-device synchronisation. Only the returned rows
        travel (a bucket's padding rows do not; a Flash row is 517 KB of fp32), in one asynchronous copy into pinned
        memory (torch's caching host allocator keeps the buffers), then a wait for the stream."""
        rows = logits[:n]
        if rows.device.type != "cuda":
            return rows  # a fresh output of the uncaptured forward
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        torch.cuda.current_stream(rows.device).synchronize()
        return host

    def _run(self, segments: list[Segment], new_blocks: list[int], all_logits: bool, on_device: bool,
             ids: Optional[torch.Tensor] = None) -> tuple[dict[int, list[torch.Tensor]], list[torch.Tensor]]:
        """Run validated segments as forward calls of at most max_tokens_per_step tokens; returns each handle's
        logit pieces in call order, and each call's logit rows (the rows of its segments, in order)."""
        self._allocate(segments, new_blocks)
        pieces: dict[int, list[torch.Tensor]] = {s.handle: [] for s in segments}
        outs: list[torch.Tensor] = []
        advanced: set[int] = set()  # requests whose tokens an earlier, completed call of this step processed
        done = 0  # segments of earlier calls (decode(): one token and one id each)
        for call in split_segments(segments, self.max_tokens):
            self._landed = False
            try:
                logits, owners = self._launch(call, all_logits, None if ids is None else ids[done:done + len(call)])
                done += len(call)
                n = sum(k for _, k in owners)
                if not on_device:
                    logits = self._to_host(logits, n)
                elif self.runner is not None:
                    logits = logits[:n].clone()  # the replayed output is the graph pool's: the next replay reuses it
                else:
                    logits = logits[:n]  # a fresh output of the uncaptured forward
            except BaseException as e:
                # once its inputs have landed the call may have written part of its requests' caches (no rollback):
                # refuse those requests from now on rather than let them continue on incomplete state. A step split
                # into several calls has also advanced the requests of its earlier calls, whose logits the caller
                # never gets: a retry of the step would feed their tokens twice, so they are refused too. Other
                # requests are untouched (a failure before the inputs land, such as a capture on first use, wrote
                # nothing of this call's).
                why = type(e).__name__
                if self._landed:
                    for seg in call:
                        self._requests[seg.handle].broken = (f"a forward call failed ({why}) after it may have "
                                                             f"written part of this request's caches")
                for h in advanced:
                    req = self._requests[h]
                    if req.broken is None:
                        req.broken = (f"its step failed ({why}) after an earlier forward call had processed some of "
                                      f"its tokens (position now {req.pos}; their logits were not returned)")
                raise
            outs.append(logits)
            sizes = [k for _, k in owners]
            for (handle, _), part in zip(owners, logits.split(sizes)):
                pieces[handle].append(part)
            for seg in call:
                self._requests[seg.handle].pos += len(seg.tokens)
                advanced.add(seg.handle)
        return pieces, outs

    @torch.no_grad()
    def step(self, batch: Mapping[int, Sequence[int]], all_logits: bool = False,
             on_device: bool = False) -> dict[int, torch.Tensor]:
        """Process new tokens for some live requests. Returns {handle: fp32 logits [n, vocab]} on the CPU,
        n = the request's new tokens (all_logits=True) or 1 (its last position).

        on_device=True returns them on the model's device instead, without waiting for the step: a stream-ordered
        copy of the returned rows that the caller keeps (later steps do not overwrite it). For a caller that
        samples on the device: at 64 requests of a Flash model the host copy is 33 MB a step."""
        for name, flag in (("all_logits", all_logits), ("on_device", on_device)):
            if not isinstance(flag, bool):
                raise RequestError(f"{name} must be a bool, got {_type_name(flag)}")
        segments, new_blocks = self._validate(batch)  # refusals happen here, before anything is written
        if self._ids_unchecked and not on_device:
            self.synchronize()  # this call waits for the device anyway: a bad decode() id refuses its request now
            for seg in segments:
                req = self._requests[seg.handle]
                if req.broken is not None:
                    raise RequestError(f"request {seg.handle}: {req.broken}; release it")
        pieces, _ = self._run(segments, new_blocks, all_logits, on_device)
        if all_logits:
            return {h: torch.cat(p) for h, p in pieces.items()}
        return {h: p[-1] for h, p in pieces.items()}

    @torch.no_grad()
    def decode(self, handles: Sequence[int], ids: torch.Tensor) -> torch.Tensor:
        """One new token for each request of `handles`, its id taken from the 1-D integer tensor `ids` (the same
        length) where it lies, normally the model's device: the argmax or a sample of the previous logits. The ids
        are not read on the host, so a decode loop of `decode` calls never waits for the device. Returns the logits
        [len(handles), vocab] fp32 on the model's device, row i for handles[i], a copy the caller keeps (as
        `step(on_device=True)`).

        Positions, context limits and blocks are checked as step() checks them, before anything is written. An id
        outside the vocabulary cannot be refused up front (it is not read): the step runs on a clamped id, so no
        cache is touched out of bounds, and the request is refused (RequestError naming the id's problem) from the
        first call that waits for the device on: step() returning host logits, or synchronize()."""
        if isinstance(handles, (str, bytes, Set, Mapping)) or not isinstance(handles, Sequence):
            raise RequestError(f"decode() takes a sequence of handles, got {type(handles).__name__}")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype.is_floating_point \
                or ids.dtype.is_complex or ids.dtype == torch.bool:
            what = f"{ids.dtype} tensor of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else \
                type(ids).__name__
            raise RequestError(f"decode() takes the ids as a 1-D integer tensor, got {what}")
        if ids.shape[0] != len(handles) or not handles:
            raise RequestError(f"decode() takes one id a handle: {len(handles)} handles, {ids.shape[0]} ids")
        segments, new_blocks = self._segments((h, _ONE_TOKEN) for h in handles)
        ids = ids.to(self.device, torch.int64, non_blocking=True)
        _, outs = self._run(segments, new_blocks, False, True, ids)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _device_ids(self, ids: torch.Tensor) -> None:
        """decode()'s ids into the step inputs, clamped into the vocabulary on the device; a clamped id is counted
        against its request's slot, for _check_ids to find once the host waits for the device."""
        n = ids.shape[0]
        dst = self.inputs.token_ids[:n]
        torch.clamp(ids, 0, self.cfg.vocab_size - 1, out=dst)
        self._bad_ids.index_add_(0, self.inputs.req_slot[:n], dst.ne(ids).to(torch.int32))
        self._ids_unchecked = True

    def _check_ids(self) -> None:
        """Refuse the requests decode() fed an id outside the vocabulary (reads the device: the caller has waited
        for it or is about to)."""
        bad = self._bad_ids.nonzero().flatten().tolist()
        self._ids_unchecked = False
        if bad:
            self._bad_ids.zero_()
            by_slot = {r.slot: r for r in self._requests.values()}
            for slot in bad:
                if slot in by_slot:  # a request released since has taken its count away with it
                    by_slot[slot].broken = (f"decode() was given a token id outside the vocabulary [0, "
                                            f"{self.cfg.vocab_size}); it ran on a clamped id")

    def synchronize(self) -> None:
        """Wait for the device to finish every launched step; after decode() calls, a request given an id outside
        the vocabulary is refused from here on."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        if self._ids_unchecked:
            self._check_ids()

    # ------------------------------------------------------------------ synthetic fast-forward
    @torch.no_grad()
    def admit_synthetic(self, context: int, seed: int = 0) -> int:
        """Admit a request whose caches hold random valid content for `context` processed tokens (sliding
        ring, compressed entries, indexer keys, compressor state), so long-context steps can be timed
        without running the prefill. Its outputs are meaningless; its cost per step is real."""
        try:
            context = _int_arg("context", context, 0)
        except (TypeError, ValueError) as e:
            raise RequestError(f"synthetic {e}") from None
        seed = _seed_arg(seed)
        if not 0 <= context < self.max_context:
            raise RequestError(f"synthetic context {context} must be in [0, max_context={self.max_context})")
        need = self.cache.blocks_needed(context)
        if need > self.allocator.num_free:
            raise CapacityError(f"block allocator exhausted: {need} blocks needed, {self.allocator.num_free} free")
        handle = self.admit()
        try:
            self._fill_synthetic(self._requests[handle], context, need, seed)
        except BaseException:
            self.release(handle)  # no half-admitted request is left behind (its slot and blocks go back)
            raise
        return handle

    def _fill_synthetic(self, req: _Request, context: int, need: int, seed: int) -> None:
        req.blocks = self.allocator.allocate(need)
        self.block_table[req.slot, :need] = torch.tensor(req.blocks, dtype=torch.int32)
        self._bt_dirty.add(req.slot)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        cfg = self.cfg
        blocks = torch.tensor(req.blocks, dtype=torch.long, device=self.device)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, device=self.device)

        for lc in self.cache.layers:
            lc.swa[req.slot] = store_rows(rand(cfg.sliding_window, cfg.head_dim), cfg.rope_dim, lc.main_quant,
                                          lc.swa.dtype)
            if lc.layer_type == SLIDING:
                continue
            lc.kv_state[req.slot] = rand(*lc.kv_state.shape[1:])
            lc.score_state[req.slot] = rand(*lc.score_state.shape[1:])
            if lc.layer_type == HCA:  # online softmax state (M, Z, A): Z > 0, a window of a few rows
                lc.score_state[req.slot, 1] = lc.score_state[req.slot, 1].abs() + 1.0
            if need:
                per_block = lc.entries.shape[1]
                lc.entries[blocks] = store_rows(rand(need, per_block, cfg.head_dim), cfg.rope_dim, lc.main_quant,
                                                lc.entries.dtype)
            if lc.layer_type == CSA:
                lc.idx_kv_state[req.slot] = rand(*lc.idx_kv_state.shape[1:])
                lc.idx_score_state[req.slot] = rand(*lc.idx_score_state.shape[1:])
                if need:
                    lc.idx_entries[blocks] = store_rows(rand(need, lc.idx_entries.shape[1], cfg.index_head_dim), 0,
                                                        lc.idx_quant, lc.idx_entries.dtype)
        req.pos = context

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Iterable[Sequence[int]], max_new_tokens: int = 16, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop_at_eos: bool = False
                 ) -> list[list[int]]:
        """Generate for each prompt (greedy when temperature == 0). Returns the new tokens of each prompt.

        Everything is checked before the first step (prompts, lengths against max_context and the cache blocks each
        prompt needs, sampling arguments); the prompts run in groups that the free request slots and blocks hold,
        each group's slots released at the end. A prompt's tokens depend on the seed and its index only (sampling
        draws from a generator a prompt), not on the prompts or requests beside it."""
        if isinstance(prompts, (str, bytes, Set, Mapping)) or not isinstance(prompts, Iterable):  # sets: no order
            raise RequestError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
        prompts = [_token_list("prompt", p, i) for i, p in enumerate(prompts)]
        try:
            max_new_tokens = _int_arg("max_new_tokens", max_new_tokens, 0)
            top_k = _int_arg("top_k", top_k, 0)
        except (TypeError, ValueError) as e:
            raise RequestError(str(e)) from None
        seed = _seed_arg(0 if seed is None else seed)
        if not isinstance(stop_at_eos, bool):
            raise RequestError(f"stop_at_eos must be a bool, got {_type_name(stop_at_eos)}")
        temperature, top_p = _real_arg("temperature", temperature), _real_arg("top_p", top_p)
        if temperature < 0 or not 0 < top_p <= 1:
            raise RequestError(f"sampling needs a temperature >= 0 and 0 < top_p <= 1, got temperature="
                               f"{temperature!r}, top_p={top_p!r}")
        needs = []  # cache blocks each prompt holds at its last step
        for i, p in enumerate(prompts):
            if not p:
                raise RequestError(f"prompt {i} is empty")
            bad = [t for t in p if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise RequestError(f"prompt {i}: token id {bad[0]} outside the vocabulary [0, {self.cfg.vocab_size})")
            if len(p) + max_new_tokens - 1 > self.max_context:
                raise RequestError(f"prompt {i}: {len(p)} tokens + {max_new_tokens} new exceed max_context="
                                   f"{self.max_context} (at most {self.max_context - len(p) + 1} new tokens)")
            needs.append(self.cache.blocks_needed(len(p) + max_new_tokens - 1))
        if max_new_tokens == 0 or not prompts:
            return [[] for _ in prompts]
        if not self._free_slots:
            raise CapacityError(f"generate needs a free request slot: all {self.max_requests} are in use")
        free = self.allocator.num_free  # each group gives its blocks back: every group starts with these
        if max(needs) > free:
            i = needs.index(max(needs))
            raise CapacityError(f"prompt {i} needs {needs[i]} cache blocks by its last token; {free} of the "
                                f"{self.allocator.num_blocks} are free")
        # sampling: a generator a prompt, so a prompt's tokens do not depend on the prompts or requests beside it
        gens = [torch.Generator().manual_seed((seed + i * 0x9E3779B97F4A7C15) % (1 << 64)) for i in range(len(prompts))
                ] if temperature > 0 else []
        outs: list[list[int]] = [[] for _ in prompts]
        i0 = 0
        while i0 < len(prompts):
            group, held = [], 0  # as many prompts as the free slots and blocks hold
            while i0 + len(group) < len(prompts) and len(group) < len(self._free_slots) \
                    and held + needs[i0 + len(group)] <= free:
                held += needs[i0 + len(group)]
                group.append(i0 + len(group))
            i0 += len(group)
            self._generate_group(prompts, group, outs, max_new_tokens, temperature, top_k, top_p, gens, stop_at_eos)
        return outs

    def _generate_group(self, prompts: list[list[int]], group: list[int], outs: list[list[int]], max_new_tokens: int,
                        temperature: float, top_k: int, top_p: float, gens: list[torch.Generator],
                        stop_at_eos: bool) -> None:
        """generate() for the prompts of `group`, run together; their new tokens go to `outs`."""
        handles = []
        try:
            for _ in group:
                handles.append(self.admit())
            live = dict(zip(handles, group))
            feed = {h: prompts[i] for h, i in live.items()}
            greedy = temperature == 0
            if greedy and not stop_at_eos:
                # every request runs to max_new_tokens: the ids stay on the device, read once at the end
                ids = [_last_rows_argmax(self.step(feed, on_device=True))]
                for _ in range(max_new_tokens - 1):
                    ids.append(self.decode(handles, ids[-1]).argmax(-1))
                for h, toks in zip(handles, torch.stack(ids, 1).tolist()):
                    outs[live[h]] = toks
                return
            for _ in range(max_new_tokens):
                if not feed:
                    break
                logits = self.step(feed, on_device=greedy)
                if greedy:
                    picked = greedy_tokens(logits)
                else:
                    picked = [_sample(lg[-1], temperature, top_k, top_p, gens[live[h]]) for h, lg in logits.items()]
                feed = {}
                for h, tok in zip(logits, picked):
                    outs[live[h]].append(tok)
                    done = stop_at_eos and tok == self.cfg.eos_token_id
                    if not done and len(outs[live[h]]) < max_new_tokens:
                        feed[h] = [tok]
        finally:
            for h in handles:
                self.release(h)


def _load_kernels(mode: str, on_gpu: bool, log: Callable[[str], None]) -> dict[str, str]:
    """Load the CUDA kernels as `mode` asks; returns kernel_coverage()."""
    if mode not in ("auto", "native", "reference"):
        raise ValueError(f"kernels must be 'auto', 'native' or 'reference', got {mode!r}")
    if on_gpu and mode != "reference":
        try:
            ops.load_cuda_kernels()
        except Exception as e:  # a failed build: the references still serve every op
            if mode == "native":
                raise RuntimeError(f"kernels='native': the CUDA extension failed to build or load: {e}") from e
            log(f"CUDA kernels unavailable ({type(e).__name__}: {e}); running the reference ops")
    coverage = ops.kernel_coverage()
    missing = [op for op in ops.STEP_OPS if coverage[op] != "native"]
    if on_gpu and mode == "native" and missing:
        raise RuntimeError(f"kernels='native' but these ops have no CUDA kernel: {', '.join(missing)}")
    return coverage


_ONE_TOKEN = [0]  # decode()'s placeholder: the id comes from the device


def _seed_arg(seed) -> int:
    """A random seed (config.seed_value), else a RequestError naming it."""
    try:
        return seed_value(seed)
    except (TypeError, ValueError) as e:
        raise RequestError(str(e)) from None


def _real_arg(name: str, x) -> float:
    """A finite real argument (an int or float of any real type, numpy's too; not a bool) as a float, else a
    RequestError naming it."""
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        try:
            v = float(x)
        except OverflowError:  # an int past float's range
            v = math.inf
        if math.isfinite(v):
            return v
        shown = repr(x) if len(repr(x)) <= 40 else repr(x)[:37] + "..."
        raise RequestError(f"{name} must be finite, got {shown}")
    raise RequestError(f"{name} must be a real number, got {_type_name(x)} {x!r}")


def _type_name(x) -> str:
    """x's type, qualified by its module unless builtin (numpy's bool is also called `bool`)."""
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _token_list(kind: str, tokens, index: int) -> list[int]:
    """Token ids as a list of ints; strings, floats and bools are refused rather than converted. Errors name
    f"{kind} {index}" (the message is built only then)."""
    if type(tokens) is list and all(type(t) is int for t in tokens):  # the common case, without per-item checks
        return list(tokens)
    who = f"{kind} {index}"
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise RequestError(f"{who}: token ids must be a 1-D integer tensor or a sequence of ints")
        return tokens.tolist()
    if isinstance(tokens, (str, bytes, Set, Mapping)) or not isinstance(tokens, Iterable):  # sets: no order
        raise RequestError(f"{who}: token ids must be a sequence of ints, got {type(tokens).__name__}")
    out = []
    for t in tokens:
        try:
            out.append(as_int(t))
        except TypeError:
            raise RequestError(f"{who}: token id {t!r} is not an int") from None
    return out


def greedy_tokens(logits: Mapping[int, torch.Tensor]) -> list[int]:
    """The argmax of each request's last logits row, in the mapping's order, taken where the logits are: with
    `step(on_device=True)` one device op picks every row and only the token ids travel to the host. An empty
    mapping picks none."""
    if not isinstance(logits, Mapping):
        raise TypeError(f"greedy_tokens takes step()'s {{handle: logits}} dict, got {type(logits).__name__}")
    if not logits:
        return []
    return _last_rows_argmax(logits).tolist()


def _last_rows_argmax(logits: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """greedy_tokens' pick as a 1-D tensor where the logits are (decode()'s ids)."""
    last = torch.cat([lg[-1:] for lg in logits.values()])
    if last.dim() != 2 or last.shape[0] != len(logits):  # one check for all: 1-D or empty rows
        raise TypeError(f"greedy_tokens takes step()'s [rows >= 1, vocab] logits for each request, got shapes "
                        f"{[tuple(lg.shape) for lg in logits.values()][:4]}")
    return last.argmax(-1)


def _sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator) -> int:
    """One token from one row of host logits, temperature > 0 (greedy decoding takes the argmax on the device)."""
    z = logits.double()  # float64: a temperature below float32's smallest subnormal must not round to 0 (0 / 0)
    z = (z - z.max()) / temperature  # the largest at 0: no overflow to inf (and NaN) for small temperatures
    if top_k > 0:
        kth = torch.topk(z, min(top_k, z.numel())).values[-1]
        z = torch.where(z < kth, float("-inf"), z)
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, descending=True)
        probs = torch.softmax(sorted_z, -1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        z[order[drop]] = float("-inf")
    return int(torch.multinomial(torch.softmax(z, -1), 1, generator=gen))
