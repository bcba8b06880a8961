"""CUDA kernel of `dsv4rt::swa_cache_write` (csrc/swa.cu) against the reference, bit for bit.

The cache is poisoned first (NaN rows, 0xFF bytes): rows the reference leaves alone must stay poisoned, rows it
writes must match exactly. The kernel skips padded tokens and positions p < end_pos - W, which the reference
sends to the spare slot (the last): only the other slots are compared.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from dsv4rt.ops.kv_quant import fp8_row_bytes
from dsv4rt.ops.swa import PAD_SLOT, swa_cache_write_ref

WINDOW = 128                 # Flash sliding window
N_SLOTS = 8                  # request slots; the cache has one more, the spare slot
DIMS = [(512, 64), (128, 64)]  # (width, rope_dim): Flash (7 FP8 blocks), tiny config (1 block)


@dataclass(frozen=True)
class Seg:
    """One request's tokens in the step: request slot, first position, token count."""
    slot: int
    start: int
    length: int


# decode: one token per request, unwrapped / wrapped ring; prefill: a chunk crossing the ring's end, a chunk
# longer than W (its first positions go nowhere), a chunk of exactly W; mixed: both, PAD tokens in between.
# Slots 5 and 6 are never written: their rows must stay poisoned.
SCENARIOS: dict[str, tuple[tuple[Seg, ...], tuple[int, ...]]] = {
    "decode": ((Seg(0, 5, 1), Seg(1, 300, 1), Seg(7, 127, 1), Seg(2, 128, 1)), (2, 4)),
    "prefill": ((Seg(2, 100, 60), Seg(3, 0, 300), Seg(4, 1000, WINDOW)), (3,)),
    "mixed": ((Seg(0, 6, 1), Seg(3, 250, 200), Seg(1, 301, 1), Seg(4, 17, 3)), (1, 3, 5)),
}


def swa_inputs(device: str, scenario: str, width: int, rope_dim: int, dtype: torch.dtype, fp8: bool,
               seed: int = 0) -> tuple:
    """(kv, swa_cache, req_slot, positions, end_pos, rope_dim); PAD tokens inserted before the given token indices."""
    segs, pads = SCENARIOS[scenario]
    slot, pos, end = [], [], []
    for s in segs:
        slot += [s.slot] * s.length
        pos += list(range(s.start, s.start + s.length))
        end += [s.start + s.length] * s.length
    for i, at in enumerate(sorted(pads, reverse=True)):  # PAD tokens look live otherwise: p = 3 is in every ring
        slot.insert(at, PAD_SLOT)
        pos.insert(at, 3 + i)
        end.insert(at, 4 + i)
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(len(slot), width, generator=g) * 2).to(dtype)
    if fp8:
        cache = torch.full((N_SLOTS + 1, WINDOW, fp8_row_bytes(width, rope_dim)), 0xFF, dtype=torch.uint8)
    else:
        cache = torch.full((N_SLOTS + 1, WINDOW, width), float("nan"), dtype=dtype)
    i32 = dict(dtype=torch.int32)
    args = (kv, cache, torch.tensor(slot, **i32), torch.tensor(pos, **i32), torch.tensor(end, **i32))
    return tuple(a.to(device) for a in args) + (rope_dim,)


def check_swa(args: tuple, run_op: Callable) -> None:
    """run_op(*args) on the inputs vs the reference on a clone of the cache: every slot but the spare, exactly."""
    before = args[1].clone()
    expected = args[1].clone()
    swa_cache_write_ref(args[0], expected, *args[2:])
    run_op(*args)
    got = args[1]
    as_bytes = (lambda t: t) if got.dtype == torch.uint8 else (lambda t: t.view(torch.uint8))
    assert not torch.equal(as_bytes(expected[:-1]), as_bytes(before[:-1]))  # the case writes something
    assert torch.equal(as_bytes(got[:-1]), as_bytes(expected[:-1]))


@pytest.mark.cuda
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("fmt", ["auto", "fp8"])
@pytest.mark.parametrize("width,rope_dim", DIMS)
def test_swa_cache_write_cuda_matches_reference(scenario, dtype, fmt, width, rope_dim):
    args = swa_inputs("cuda", scenario, width, rope_dim, dtype, fmt == "fp8")
    check_swa(args, torch.ops.dsv4rt.swa_cache_write.default)


@pytest.mark.cuda
def test_swa_cache_write_cuda_is_native():
    import dsv4rt.ops
    assert dsv4rt.ops.kernel_coverage()["swa_cache_write"] == "native"


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["auto", "fp8"])
def test_swa_cache_write_cuda_opcheck(fmt):
    args = swa_inputs("cuda", "mixed", 512, 64, torch.bfloat16, fmt == "fp8")
    args[1].zero_()  # opcheck compares repeated runs: no NaN
    torch.library.opcheck(torch.ops.dsv4rt.swa_cache_write.default, args)
