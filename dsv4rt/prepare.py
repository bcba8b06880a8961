"""Host-side prepare step: a batch {request: new token ids} -> the static step-input buffers.

Everything data-dependent happens here, on the host: validation, positions, block allocation for the
entries that close in the step, bucket choice, padding. The forward then reads only these buffers.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from dsv4rt.ops.swa import PAD_SLOT

from .model import StepTensors


def bucket_for(n: int, limit: int) -> int:
    """Smallest power of two >= n, capped at `limit`."""
    b = 1
    while b < n:
        b *= 2
    return min(b, limit)


@dataclass(frozen=True)
class StepInputs:
    """Fixed-address buffers read by the step. Allocated once, rewritten in place every step."""
    token_ids: Tensor    # [max_tokens] int64
    positions: Tensor    # [max_tokens] int32
    req_slot: Tensor     # [max_tokens] int32, PAD_SLOT past the live tokens
    start_pos: Tensor    # [max_tokens] int32
    end_pos: Tensor      # [max_tokens] int32
    block_table: Tensor  # [max_requests + 1, max_blocks] int32; row max_requests is the padding row
    logit_rows: Tensor   # [max_tokens] int64

    @classmethod
    def allocate(cls, max_tokens: int, n_slots: int, max_blocks: int, trash_block: int, device,
                 pin: bool = False) -> "StepInputs":
        def z(*shape, dtype, fill=0):
            t = torch.full(shape, fill, dtype=dtype, device=device)
            return t.pin_memory() if pin else t
        return cls(token_ids=z(max_tokens, dtype=torch.int64), positions=z(max_tokens, dtype=torch.int32),
                   req_slot=z(max_tokens, dtype=torch.int32, fill=PAD_SLOT),
                   start_pos=z(max_tokens, dtype=torch.int32), end_pos=z(max_tokens, dtype=torch.int32),
                   block_table=z(n_slots + 1, max_blocks, dtype=torch.int32, fill=trash_block),
                   logit_rows=z(max_tokens, dtype=torch.int64))

    def args(self, n_tokens: int, n_rows: int) -> StepTensors:
        """Fixed-address views for a bucket of n_tokens tokens returning n_rows logit rows."""
        return StepTensors(self.token_ids[:n_tokens], self.positions[:n_tokens], self.req_slot[:n_tokens],
                           self.start_pos[:n_tokens], self.end_pos[:n_tokens], self.block_table,
                           self.logit_rows[:n_rows])

    def copy_from(self, host: "StepInputs", block_rows: "list[int] | None" = None) -> None:
        """Asynchronous when `host` is pinned and self is on a GPU. `block_rows`: copy only these rows of the block
        table (the others are current already); None copies all of it."""
        for f in fields(self):  # not dataclasses.astuple, which deep-copies tensors
            if f.name == "block_table" and block_rows is not None:
                for r in block_rows:
                    self.block_table[r].copy_(host.block_table[r], non_blocking=True)
            else:
                getattr(self, f.name).copy_(getattr(host, f.name), non_blocking=True)


def buckets_up_to(max_tokens: int) -> list[int]:
    """Token buckets: powers of two up to max_tokens, and max_tokens itself."""
    out, b = [], 1
    while b < max_tokens:
        out.append(b)
        b *= 2
    return out + [max_tokens]


@dataclass
class Segment:
    """One request's tokens within one forward call."""
    handle: int
    slot: int
    start: int          # position of the first token
    tokens: list[int]


def logit_rows_for(bucket: int, all_logits: bool, rows_cap: int) -> int:
    """Logit rows a bucket returns: every token, or one per request (at most rows_cap requests per call)."""
    return bucket if all_logits else min(bucket, rows_cap)


def fill(host: StepInputs, segments: list[Segment], all_logits: bool, max_tokens: int, rows_cap: int,
         written: "tuple[int, int] | None" = None) -> tuple[int, int, list, tuple[int, int]]:
    """Write one forward call's segments (not the block table) into the host buffers, padding after them.
    `written`: the (token, logit row) counts the previous fill of these buffers wrote (everything after them is
    padding already); None pads to the end. Returns (bucket, logit rows, [(handle, rows of that handle)] in row
    order, the counts written now)."""
    # decode of 8 or more requests: a token a segment, each field in one pass (on the development CPU, Python 3.11,
    # 64 segments 122 -> 92 us; below about 8 the passes' fixed cost is more than they save)
    if len(segments) >= 8 and all(len(s.tokens) == 1 for s in segments):
        ids = [s.tokens[0] for s in segments]
        pos = start = [s.start for s in segments]
        slot = [s.slot for s in segments]
        end = [p + 1 for p in pos]
        rows = list(range(len(segments)))
        owners = [(s.handle, 1) for s in segments]
    else:
        ids, pos, slot, start, end, rows = [], [], [], [], [], []
        owners = []  # (handle, number of rows) in row order
        for s in segments:
            k, t = len(s.tokens), len(ids)
            ids += s.tokens
            pos += range(s.start, s.start + k)
            slot += [s.slot] * k
            start += [s.start] * k
            end += [s.start + k] * k
            if all_logits:
                rows += range(t, t + k)
                owners.append((s.handle, k))
            else:
                rows.append(t + k - 1)
                owners.append((s.handle, 1))
    n, n_rows = len(ids), len(rows)
    bucket = bucket_for(n, max_tokens)
    # one host tensor for every field, a copy per field; padding only where the previous fill wrote values
    vals = torch.tensor(ids + pos + slot + start + end + rows, dtype=torch.int64).split([n] * 5 + [n_rows])
    stale_n, stale_rows = written if written is not None else (max_tokens, max_tokens)
    for buf, v, stale, pad in zip((host.token_ids, host.positions, host.req_slot, host.start_pos, host.end_pos,
                                   host.logit_rows), vals, (stale_n,) * 5 + (stale_rows,), (0, 0, PAD_SLOT, 0, 0, 0)):
        k = v.shape[0]
        buf[:k].copy_(v)
        if stale > k:
            buf[k:stale] = pad
    return bucket, logit_rows_for(bucket, all_logits, rows_cap), owners, (n, n_rows)


def split_segments(batch: list[Segment], max_tokens: int) -> list[list[Segment]]:
    """Pack the step's segments into forward calls of at most max_tokens tokens, splitting long prompts."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if sum(len(seg.tokens) for seg in batch) <= max_tokens:  # one call (every decode step up to max_tokens)
        return [batch] if batch else []
    calls: list[list[Segment]] = [[]]
    room = max_tokens
    for seg in batch:
        start, toks = seg.start, seg.tokens
        while toks:
            if room == 0:
                calls.append([])
                room = max_tokens
            take = toks[:room]
            calls[-1].append(Segment(seg.handle, seg.slot, start, take))
            start += len(take)
            toks = toks[len(take):]
            room -= len(take)
    return [c for c in calls if c]
