"""The serving loop's public face: admit / step / release / generate over a fixed set of request slots."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch
from torch import nn

from .cache import KVCache
from .config import BLOCK_TOKENS
from .model import Model, StepTensors
from .prepare import Segment, StepInputs, fill, split_segments


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


class Runtime:
    """Runs a `Model` over paged caches for up to `max_requests` concurrent requests.

    kv_dtype: "auto" (activation dtype), "fp8" (FP8 rows + FP4 indexer keys, stored for real) or
    "fp8_sim" (the same numerics, fake-quantised values kept in the activation dtype).
    compile: run the step through torch.compile(fullgraph=True).
    max_tokens_per_step: tokens per forward call; longer steps are split into several calls.
    num_blocks: size of the block pool (default: enough for every slot at max_context).
    """

    def __init__(self, model: Model, max_requests: int = 8, max_context: int = 4096, kv_dtype: str = "auto",
                 compile: bool = False, max_tokens_per_step: int | None = None, num_blocks: int | None = None) -> None:
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        if max_context < 1:
            raise ValueError(f"max_context must be >= 1, got {max_context}")
        if max_context > model.cfg.max_position:
            raise ValueError(f"max_context {max_context} exceeds the model's max_position {model.cfg.max_position}")
        self.model, self.cfg = model, model.cfg
        self.device = model.device
        self.max_requests, self.max_context = max_requests, max_context
        self.max_tokens = max_tokens_per_step or min(max(BLOCK_TOKENS, max_requests), 1 << (max_context - 1).bit_length())
        if self.max_tokens < max_requests:
            raise ValueError(f"max_tokens_per_step ({self.max_tokens}) must be >= max_requests ({max_requests})")
        self.cache = KVCache(self.cfg, max_requests, max_context, kv_dtype, model.dtype, self.device, num_blocks)
        self.kv_dtype = kv_dtype
        from .cache import BlockAllocator
        self.allocator = BlockAllocator(self.cache.num_blocks)
        trash = self.cache.num_blocks
        self.inputs = StepInputs.allocate(self.max_tokens, max_requests, self.cache.max_blocks, trash, self.device)
        self.host = StepInputs.allocate(self.max_tokens, max_requests, self.cache.max_blocks, trash, "cpu",
                                        pin=self.device.type == "cuda")
        self._step = Step(model, self.cache)
        self.compiled = compile
        if compile:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self._fn = torch.compile(self._step, fullgraph=True, dynamic=False)
        else:
            self._fn = self._step
        self._requests: dict[int, _Request] = {}
        self._free_slots = list(range(max_requests - 1, -1, -1))
        self._next_handle = 0

    # ------------------------------------------------------------------ lifecycle
    def admit(self) -> int:
        """Take a free request slot (its ring and compressor state reset). Returns the request handle."""
        if not self._free_slots:
            raise CapacityError(f"all {self.max_requests} request slots are in use (max_requests={self.max_requests})")
        slot = self._free_slots.pop()
        self.cache.reset_slot(slot)
        handle = self._next_handle
        self._next_handle += 1
        self._requests[handle] = _Request(slot)
        return handle

    def release(self, handle: int) -> None:
        """Free the request's slot and blocks."""
        req = self._get(handle)
        self.allocator.free(req.blocks)
        self.host.block_table[req.slot].fill_(self.cache.num_blocks)
        self._free_slots.append(req.slot)
        del self._requests[handle]

    def position(self, handle: int) -> int:
        """Tokens the request has processed so far."""
        return self._get(handle).pos

    @property
    def live(self) -> list[int]:
        return list(self._requests)

    def _get(self, handle: int) -> _Request:
        try:
            return self._requests[handle]
        except (KeyError, TypeError):
            raise UnknownRequest(f"unknown request handle {handle!r} (never admitted or already released)") from None

    # ------------------------------------------------------------------ prepare
    def _validate(self, batch: Mapping[int, Sequence[int]]) -> list[Segment]:
        if not isinstance(batch, Mapping) or not batch:
            raise RequestError("step() takes a non-empty dict {handle: [token ids]}")
        segments, need_blocks = [], 0
        for handle, tokens in batch.items():
            req = self._get(handle)
            try:
                toks = [int(t) for t in tokens]
            except (TypeError, ValueError):
                raise RequestError(f"request {handle}: token ids must be a sequence of ints") from None
            if not toks:
                raise RequestError(f"request {handle}: no new tokens")
            bad = [t for t in toks if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise RequestError(f"request {handle}: token id {bad[0]} outside the vocabulary [0, {self.cfg.vocab_size})")
            if req.pos + len(toks) > self.max_context:
                raise RequestError(f"request {handle}: {req.pos} + {len(toks)} tokens exceeds max_context={self.max_context}")
            need_blocks += max(0, self.cache.blocks_needed(req.pos + len(toks)) - len(req.blocks))
            segments.append(Segment(handle, req.slot, req.pos, toks))
        if need_blocks > self.allocator.num_free:
            raise CapacityError(f"block allocator exhausted: the step needs {need_blocks} new blocks, "
                                f"{self.allocator.num_free} free of {self.allocator.num_blocks}")
        return segments

    def _allocate(self, segments: list[Segment]) -> None:
        for seg in segments:
            req = self._requests[seg.handle]
            n_new = self.cache.blocks_needed(seg.start + len(seg.tokens)) - len(req.blocks)
            if n_new > 0:
                first = len(req.blocks)
                req.blocks.extend(self.allocator.allocate(n_new))
                self.host.block_table[req.slot, first:len(req.blocks)] = torch.tensor(req.blocks[first:],
                                                                                       dtype=torch.int32)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, batch: Mapping[int, Sequence[int]], all_logits: bool = False) -> dict[int, torch.Tensor]:
        """Process new tokens for some live requests. Returns {handle: fp32 logits [n, vocab]} on the CPU,
        n = the request's new tokens (all_logits=True) or 1 (its last position)."""
        segments = self._validate(batch)  # refusals happen here, before anything is written
        self._allocate(segments)
        pieces: dict[int, list[torch.Tensor]] = {s.handle: [] for s in segments}
        for call in split_segments(segments, self.max_tokens):
            bucket, n_rows, owners = fill(self.host, call, all_logits, self.max_tokens)
            self.inputs.copy_from(self.host)
            logits = self._fn(self.inputs.args(bucket, n_rows)).float().cpu()
            r = 0
            for handle, k in owners:
                pieces[handle].append(logits[r:r + k])
                r += k
            for seg in call:
                self._requests[seg.handle].pos += len(seg.tokens)
        if all_logits:
            return {h: torch.cat(p) for h, p in pieces.items()}
        return {h: p[-1] for h, p in pieces.items()}

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Iterable[Sequence[int]], max_new_tokens: int = 16, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop_at_eos: bool = False
                 ) -> list[list[int]]:
        """Generate for each prompt (greedy when temperature == 0). Returns the new tokens of each prompt."""
        prompts = [list(p) for p in prompts]
        if max_new_tokens < 0:
            raise RequestError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
            raise RequestError("sampling needs temperature >= 0, 0 < top_p <= 1 and top_k >= 0")
        gen = torch.Generator().manual_seed(seed if seed is not None else 0)
        outs: list[list[int]] = [[] for _ in prompts]
        for i0 in range(0, len(prompts), self.max_requests):
            group = list(range(i0, min(i0 + self.max_requests, len(prompts))))
            handles = []
            try:
                for _ in group:
                    handles.append(self.admit())
                live = dict(zip(handles, group))
                feed = {h: prompts[i] for h, i in live.items()}
                for _ in range(max_new_tokens):
                    if not feed:
                        break
                    logits = self.step(feed)
                    feed = {}
                    for h, lg in logits.items():
                        tok = _sample(lg[-1], temperature, top_k, top_p, gen)
                        outs[live[h]].append(tok)
                        done = stop_at_eos and tok == self.cfg.eos_token_id
                        if not done and len(outs[live[h]]) < max_new_tokens:
                            feed[h] = [tok]
            finally:
                for h in handles:
                    self.release(h)
        return outs


def _sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    z = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(z, min(top_k, z.numel())).values[-1]
        z = torch.where(z < kth, float("-inf"), z)
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, descending=True)
        probs = torch.softmax(sorted_z, -1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        z[order[drop]] = float("-inf")
    return int(torch.multinomial(torch.softmax(z, -1), 1, generator=gen))
