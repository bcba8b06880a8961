"""KV caches: the only place cache shapes are decided.

Per layer (buffers of a `LayerCache`):
  swa         [S+1, W, R]          sliding ring of each request slot (row p mod W); slot S is the spare
                                   slot that padded tokens write to
  entries     [NB+1, 128/m, R]     CSA/HCA compressed entries, paged: block b of a request covers its
                                   source tokens [128b, 128b+128); block NB is the trash block
  kv_state,   CSA: [S+1, 2m, 2d] fp32 each, the open window's rows + the overlap rows, per request slot;
  score_state HCA: the open window as a per-channel online softmax, kv_state [S+1, 1, d] (A) and
              score_state [S+1, 2, d] (M, Z) (ops/compressor.py); zeros = an empty window
  idx_*       the same three for the CSA indexer compressor (d = index_head_dim)
R is the row width: head_dim values in the activation dtype ("auto", "fp8_sim") or the FP8 row
layout's bytes ("fp8"; FP4 rows for indexer entries). One block table per request addresses the
pools of every layer: block ids come from one `BlockAllocator`.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from dsv4rt.ops import kv_quant
from dsv4rt.ops.kv_quant import QUANT_FP4, QUANT_FP4_SIM, QUANT_FP8, QUANT_FP8_SIM, QUANT_NONE

from .config import BLOCK_TOKENS, CSA, HCA, SLIDING, ModelConfig, as_int, int_arg

KV_DTYPES = ("auto", "fp8", "fp8_sim")


class BlockAllocator:
    """Fixed-size block allocator (host only). Blocks are ints in [0, num_blocks). A block is handed out once until
    it is freed: freeing a block that is not allocated (out of range, already free, or twice in one call) is
    refused before anything changes, since two requests sharing a block would overwrite each other's entries."""

    def __init__(self, num_blocks: int) -> None:
        num_blocks = _count("num_blocks must be an int >= 0", num_blocks)
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._taken = bytearray(num_blocks)  # 1: allocated

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        n = _count("allocate takes a block count >= 0", n)
        if n > len(self._free):
            raise RuntimeError(f"block allocator exhausted: {n} blocks requested, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._taken[b] = 1
        return out

    def free(self, blocks: list[int]) -> None:
        blocks = [_block(b, self.num_blocks) for b in blocks]
        seen = set()
        for b in blocks:
            if not self._taken[b] or b in seen:
                raise ValueError(f"free: block {b} is not allocated (already free, or listed twice)")
            seen.add(b)
        for b in blocks:
            self._taken[b] = 0
        self._free.extend(reversed(blocks))


def _count(what: str, n) -> int:
    """A non-negative integer (any integer scalar type, config.as_int), else a ValueError starting with `what`."""
    try:
        v = as_int(n)
    except TypeError:
        v = -1
    if v < 0:
        raise ValueError(f"{what}, got {n!r}")
    return v


def _block(b, num_blocks: int) -> int:
    try:
        v = as_int(b)
    except TypeError:
        v = -1
    if not 0 <= v < num_blocks:
        raise ValueError(f"free: {b!r} is not a block of this allocator [0, {num_blocks})")
    return v


class LayerCache(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, n_slots: int, num_blocks: int, kv_dtype: str,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.layer_type = layer_type
        hd, rd = cfg.head_dim, cfg.rope_dim
        main_quant = {"auto": QUANT_NONE, "fp8": QUANT_FP8, "fp8_sim": QUANT_FP8_SIM}[kv_dtype]
        idx_quant = {"auto": QUANT_NONE, "fp8": QUANT_FP4, "fp8_sim": QUANT_FP4_SIM}[kv_dtype]
        self.main_quant, self.idx_quant = main_quant, idx_quant

        def rows(n_lead: tuple[int, ...], width: int, quant: int) -> torch.Tensor:
            if quant == QUANT_FP8:
                return torch.zeros(*n_lead, kv_quant.fp8_row_bytes(width, rd), dtype=torch.uint8, device=device)
            if quant == QUANT_FP4:
                return torch.zeros(*n_lead, kv_quant.fp4_row_bytes(width), dtype=torch.uint8, device=device)
            return torch.zeros(*n_lead, width, dtype=dtype, device=device)

        self.register_buffer("swa", rows((n_slots + 1, cfg.sliding_window), hd, main_quant), persistent=False)
        if layer_type in (CSA, HCA):
            m = cfg.ratio(layer_type)
            kv_rows, sc_rows, width = (2 * m, 2 * m, 2 * hd) if layer_type == CSA else (1, 2, hd)
            self.register_buffer("entries", rows((num_blocks + 1, BLOCK_TOKENS // m), hd, main_quant), persistent=False)
            self.register_buffer("kv_state", torch.zeros(n_slots + 1, kv_rows, width, device=device), persistent=False)
            self.register_buffer("score_state", torch.zeros(n_slots + 1, sc_rows, width, device=device),
                                 persistent=False)
        if layer_type == CSA:
            m, di = cfg.csa_ratio, cfg.index_head_dim
            self.register_buffer("idx_entries", rows((num_blocks + 1, BLOCK_TOKENS // m), di, idx_quant),
                                 persistent=False)
            self.register_buffer("idx_kv_state", torch.zeros(n_slots + 1, 2 * m, 2 * di, device=device),
                                 persistent=False)
            self.register_buffer("idx_score_state", torch.zeros(n_slots + 1, 2 * m, 2 * di, device=device),
                                 persistent=False)

    def per_slot(self) -> list[torch.Tensor]:
        return [b for name, b in self.named_buffers() if name in ("swa", "kv_state", "score_state", "idx_kv_state",
                                                                     "idx_score_state")]


class KVCache(nn.Module):
    """All caches of one runtime. Allocated once; the captured step only writes into them."""

    def __init__(self, cfg: ModelConfig, max_requests: int, max_context: int, kv_dtype: str = "auto",
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 num_blocks: int | None = None) -> None:
        super().__init__()
        max_requests, max_context = int_arg("max_requests", max_requests, 1), int_arg("max_context", max_context, 1)
        if num_blocks is not None:
            num_blocks = int_arg("num_blocks", num_blocks, 0)
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
        if kv_dtype != "auto":
            kv_quant.fp8_row_bytes(cfg.head_dim, cfg.rope_dim)  # raises if the dims have no FP8 layout
            kv_quant.fp4_row_bytes(cfg.index_head_dim)
        self.cfg, self.kv_dtype = cfg, kv_dtype
        self.max_requests, self.max_context = max_requests, max_context
        self.max_blocks = math.ceil(max_context / BLOCK_TOKENS)
        # compression rates of the layers that keep entries (blocks_needed runs for every request of every step).
        # When the smallest divides the others (rates divide the power-of-two BLOCK_TOKENS, so they always do), its
        # entries are the first to fill a block: blocks_needed is one division by it.
        self._rates = tuple(sorted({cfg.ratio(t) for t in cfg.layer_types if t != SLIDING}))
        self._first_rate = self._rates[0] if self._rates and all(r % self._rates[0] == 0 for r in self._rates) else 0
        self.num_blocks = max_requests * self.max_blocks if num_blocks is None else num_blocks
        self.layers = nn.ModuleList(
            LayerCache(cfg, t, max_requests, self.num_blocks, kv_dtype, dtype, torch.device(device))
            for t in cfg.layer_types
        )

    def reset_slot(self, slot: int) -> None:
        """Zero a request slot's ring and compressor state (entries are addressed by blocks, not reset). `slot` is
        in [0, max_requests]: the last is the spare slot padding writes to (a negative index would zero another)."""
        slot = int_arg("slot", slot, 0)
        if slot > self.max_requests:
            raise ValueError(f"slot must be <= max_requests ({self.max_requests}), got {slot}")
        for layer in self.layers:
            for buf in layer.per_slot():
                buf[slot].zero_()

    def blocks_needed(self, n_tokens: int) -> int:
        """Blocks a request holding n_tokens processed tokens needs for its closed compressed entries."""
        m = self._first_rate
        if m:
            return -(-(n_tokens // m) // (BLOCK_TOKENS // m))
        need = 0
        for m in self._rates:  # closed entries n // m, BLOCK_TOKENS // m of them a block
            b = -(-(n_tokens // m) // (BLOCK_TOKENS // m))
            if b > need:
                need = b
        return need

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


def cache_bytes_per_token(cfg: ModelConfig, kv_dtype: str = "fp8", dtype: torch.dtype = torch.bfloat16) -> dict:
    """Bytes of growing cache per token per layer type, and the constant per-request state per layer type."""
    el = torch.tensor([], dtype=dtype).element_size()
    main = kv_quant.fp8_row_bytes(cfg.head_dim, cfg.rope_dim) if kv_dtype == "fp8" else cfg.head_dim * el
    idx = kv_quant.fp4_row_bytes(cfg.index_head_dim) if kv_dtype == "fp8" else cfg.index_head_dim * el
    ring = cfg.sliding_window * main
    # compressor state per request, fp32: CSA kv_state + score_state [2m, 2d] each; HCA (M, Z, A) [3, d]
    csa_state = 2 * 4 * (2 * cfg.csa_ratio * 2 * cfg.head_dim + 2 * cfg.csa_ratio * 2 * cfg.index_head_dim)
    hca_state = 3 * 4 * cfg.head_dim
    return {
        SLIDING: {"per_token": 0.0, "per_request": ring},
        CSA: {"per_token": (main + idx) / cfg.csa_ratio, "per_request": ring + csa_state},
        HCA: {"per_token": main / cfg.hca_ratio, "per_request": ring + hca_state},
    }

