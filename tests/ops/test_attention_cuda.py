"""CUDA kernel of `dsv4rt::sparse_attn` (csrc/attention.cu) against the reference, at the model dims.

Dims: Flash (64 heads, D 512, rope 64, W 128, CSA m 4 top-k 512, HCA m' 128), Pro (128 heads, top-k 1024) and the
tiny model (4 heads, D 128, W 16, top-k 4, HCA m' 16). Entry pools are paged as the runtime pages them (128
source tokens a block, shuffled blocks, unused table columns on the trash block). Queries cover sliding lengths
1, W-1, W and W+1 (ring wrapped), chunks that start mid-context (keys from kv and from the ring), index lists
padded with -1, contexts of many blocks, padded tokens, several requests of different lengths in one call.
The reference (`sparse_attn_ref`, fp32) runs on the same device tensors. Tolerance: ATTN_TOL x max |reference|
(2e-3 relative to the output scale; bf16 outputs add one bf16 rounding, 2^-8). The output's memory is poisoned
(NaN) through the caching allocator before each call, so an unwritten element fails.
The tensor-core paths run for bf16 q (for 64-head groups of D = 512 on sm_90a a wgmma kernel: the producer-consumer
one where CTAs take many tiles, else the split-D one; mma.sync otherwise; each forced at the Flash dims under
DSV4RT_ATTN_MMA=sync|split|pc), the generic fp32 path for float32 / float16 q;
key splits (partials + combine) run where the shapes ask for them and, forced by DSV4RT_ATTN_SPLITS, on cases that
would not split.
"""
from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dsv4rt.ops.attention import sparse_attn, sparse_attn_ref
from dsv4rt.ops.kv_quant import kv_fp8_quantize_ref
from dsv4rt.ops.swa import PAD_SLOT

pytestmark = pytest.mark.cuda

ROPE_DIM = 64
BLOCK_TOKENS = 128
ATTN_TOL = {torch.float32: 2e-3, torch.float16: 2e-3 + 2**-11, torch.bfloat16: 2e-3 + 2**-8}


@dataclass(frozen=True)
class Dims:
    heads: int
    dim: int
    window: int
    csa_ratio: int
    topk: int
    hca_ratio: int


FLASH = Dims(64, 512, 128, 4, 512, 128)
PRO = Dims(128, 512, 128, 4, 1024, 128)
TINY = Dims(4, 128, 16, 4, 4, 16)
DIMS = {"flash": FLASH, "pro": PRO, "tiny": TINY}


def _scenarios(d: Dims) -> dict[str, list[tuple[int, int, int]]]:
    """name -> segments (request slot, first position, tokens); positions are chosen against W and the ratios."""
    w = d.window
    return {
        # sliding lengths 1, W-1, W, W+1 (ring wrapped), a long context (CSA lists full; HCA many blocks), a CSA
        # list padded with -1 (fewer visible entries than top-k)
        "decode": [(0, 0, 1), (1, w - 2, 1), (2, w - 1, 1), (3, w, 1), (4, 300 * d.hca_ratio + 5, 1),
                   (5, d.topk * d.csa_ratio // 3, 1)],
        # a chunk from 0 longer than W, a chunk starting mid-context (kv rows + ring rows), decodes, short chunks
        "prefill": [(0, 0, w + 9), (1, 3 * w + 7, w // 2 + 3), (2, 5000, 1), (3, 40 * d.hca_ratio - 2, 3)],
    }


def _rows(n: int, d: Dims, fp8: bool, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, d.dim, generator=g, device="cuda")
    return kv_fp8_quantize_ref(x, ROPE_DIM) if fp8 else x.to(dtype)


def make_case(d: Dims, mode: str, segs, fp8: bool, dtype: torch.dtype, seed: int = 0, n_pad: int = 1,
              n_slots: int = 8, table_cols: int | None = None, pool_blocks: int | None = None) -> tuple:
    """All 13 args of sparse_attn (cuda tensors). mode: sliding / csa (index lists) / hca (visible prefix)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    gc = torch.Generator().manual_seed(seed)
    slot, pos, start = [], [], []
    for r, s, n in segs:
        slot += [r] * n
        pos += list(range(s, s + n))
        start += [s] * n
    slot += [PAD_SLOT] * n_pad
    pos += [0] * n_pad
    start += [0] * n_pad
    n_tok = len(slot)
    ratio = {"sliding": 1, "csa": d.csa_ratio, "hca": d.hca_ratio}[mode]
    per_block = BLOCK_TOKENS // ratio

    # block table: each request holds the blocks of its visible entries, shuffled; the rest is the trash block
    need = {r: math.ceil(((s + n) // ratio) / per_block) for r, s, n in segs} if mode != "sliding" else {}
    cols = table_cols or max([k for k in need.values()] + [1]) + 1
    n_blocks = pool_blocks or sum(need.values()) + 2
    perm = torch.randperm(n_blocks, generator=gc).tolist()
    block_table = torch.full((n_slots + 1, cols), n_blocks, dtype=torch.int32)
    for r, k in need.items():
        block_table[r, :k] = torch.tensor([perm.pop() for _ in range(k)], dtype=torch.int32)

    q = torch.randn(n_tok, d.heads, d.dim, generator=g, device="cuda").to(dtype)
    kv = torch.randn(n_tok, d.dim, generator=g, device="cuda").to(dtype)
    swa = _rows((n_slots + 1) * d.window, d, fp8, dtype, g).view(n_slots + 1, d.window, -1)
    entries = entry_idx = None
    if mode != "sliding":
        entries = _rows((n_blocks + 1) * per_block, d, fp8, dtype, g).view(n_blocks + 1, per_block, -1)
    if mode == "csa":
        lists = []
        for r, p in zip(slot, pos):
            n_vis = 0 if r == PAD_SLOT else (p + 1) // ratio
            k = min(d.topk, n_vis)
            row = torch.randperm(n_vis, generator=gc)[:k].tolist() + [-1] * (d.topk - k)
            lists.append([row[i] for i in torch.randperm(d.topk, generator=gc).tolist()])
        entry_idx = torch.tensor(lists, dtype=torch.int32, device="cuda")
    sinks = torch.randn(d.heads, generator=g, device="cuda")
    i32 = dict(dtype=torch.int32, device="cuda")
    return (q, kv, swa, entries, entry_idx, sinks, torch.tensor(slot, **i32), torch.tensor(pos, **i32),
            torch.tensor(start, **i32), block_table.cuda(), ratio, ROPE_DIM, d.dim**-0.5)


def poisoned_call(args) -> torch.Tensor:
    """The op's output lands where a NaN tensor of its size was just freed: unwritten elements stay NaN."""
    q = args[0]
    poison = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    del poison
    return sparse_attn(*args)


def check(args) -> None:
    q = args[0]
    expected = sparse_attn_ref(*args)
    got = poisoned_call(args)
    torch.cuda.synchronize()
    assert got.dtype == q.dtype and got.shape == q.shape
    assert not got.isnan().any(), f"{int(got.isnan().sum())} output elements unwritten or NaN"
    atol = ATTN_TOL[q.dtype] * expected.float().abs().max().item()
    err = (got.float() - expected.float()).abs()
    assert err.max().item() <= atol, (f"max |got - ref| = {err.max().item():.3g} > {atol:.3g} at "
                                      f"{tuple(int(i) for i in torch.nonzero(err == err.max())[0])}")


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16rows", "fp8rows"])
@pytest.mark.parametrize("mode", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("scenario", ["decode", "prefill"])
@pytest.mark.parametrize("dims", ["flash", "tiny"])
def test_matches_reference_bf16(dims, scenario, mode, fp8):
    d = DIMS[dims]
    check(make_case(d, mode, _scenarios(d)[scenario], fp8, torch.bfloat16))


@pytest.mark.parametrize("splits", ["0", "3"])
@pytest.mark.parametrize("mode,fp8", [("csa", True), ("hca", False), ("sliding", True)])
@pytest.mark.parametrize("kernel", ["sync", "split", "pc"])
def test_each_tensor_core_kernel_at_flash_dims(monkeypatch, kernel, mode, fp8, splits):
    # each kernel the Flash dims can take, forced: mma.sync; the split-D wgmma kernel (CTAs of few tiles, D = 512
    # with another rope width); the producer-consumer one (CTAs of many tiles)
    monkeypatch.setenv("DSV4RT_ATTN_MMA", kernel)
    if splits != "0":
        monkeypatch.setenv("DSV4RT_ATTN_SPLITS", splits)
    check(make_case(FLASH, mode, _scenarios(FLASH)["prefill"], fp8, torch.bfloat16, seed=5))


@pytest.mark.parametrize("fp8_ring", [True, False], ids=["fp8ring-bf16entries", "bf16ring-fp8entries"])
def test_pc_kernel_mixed_row_formats(monkeypatch, fp8_ring):
    # the producer-consumer kernel's instance follows the ring's format (FP8: a tile's loads all in flight, bf16 rows
    # mostly loaded late); rows of the other format take their other path
    monkeypatch.setenv("DSV4RT_ATTN_MMA", "pc")
    fp8_args = make_case(FLASH, "csa", _scenarios(FLASH)["prefill"], True, torch.bfloat16, seed=7)
    bf16_args = make_case(FLASH, "csa", _scenarios(FLASH)["prefill"], False, torch.bfloat16, seed=7)
    args = list(fp8_args)
    if fp8_ring:
        args[3] = bf16_args[3]  # the entries in bf16
    else:
        args[2] = bf16_args[2]  # the sliding ring in bf16
    assert (args[2].dtype == torch.uint8) == fp8_ring and (args[3].dtype == torch.uint8) != fp8_ring
    check(tuple(args))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16rows", "fp8rows"])
@pytest.mark.parametrize("kernel", ["pc", "split"])
def test_late_keys_dominate(monkeypatch, kernel, fp8):
    # the HCA entries (the tiles after the sliding rows) score about 6x the sliding rows, so a row's max jumps by far
    # more than 2^8 (log2 units) after its first tiles: the producer-consumer kernel's lazy softmax, which keeps a
    # row's reference max through smaller rises, must rescale there
    monkeypatch.setenv("DSV4RT_ATTN_MMA", kernel)
    args = list(make_case(FLASH, "hca", _scenarios(FLASH)["prefill"], fp8, torch.bfloat16, seed=11))
    shape = args[3].shape
    g = torch.Generator(device="cuda").manual_seed(12)
    x = 6.0 * torch.randn(shape[0] * shape[1], FLASH.dim, generator=g, device="cuda")
    args[3] = (kv_fp8_quantize_ref(x, ROPE_DIM) if fp8 else x.to(torch.bfloat16)).view(shape)
    check(tuple(args))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16rows", "fp8rows"])
@pytest.mark.parametrize("mode", ["csa", "hca"])
def test_pro_heads(mode, fp8):
    d = PRO
    check(make_case(d, mode, _scenarios(d)["decode"], fp8, torch.bfloat16))


@pytest.mark.parametrize("splits", ["1", "3", "64"])
@pytest.mark.parametrize("mode", ["csa", "hca"])
@pytest.mark.parametrize("dims", ["flash", "tiny"])
def test_forced_splits(monkeypatch, dims, mode, splits):
    # the same inputs, whole or split over the keys (split counts past the tile count are capped)
    monkeypatch.setenv("DSV4RT_ATTN_SPLITS", splits)
    d = DIMS[dims]
    check(make_case(d, mode, _scenarios(d)["prefill"], True, torch.bfloat16, seed=3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", ["csa", "hca"])
@pytest.mark.parametrize("dims", ["flash", "tiny"])
def test_generic_path(dims, mode, dtype):
    d = DIMS[dims]
    check(make_case(d, mode, _scenarios(d)["decode"], mode == "csa", dtype, seed=1))


def test_long_hca_context_many_splits():
    # a 1M-context HCA decode at batch 2 (8,192 visible entries + 128 sliding rows): the shape-chosen split count
    d = FLASH
    segs = [(0, (1 << 20) - 1, 1), (1, 70000, 1)]
    check(make_case(d, "hca", segs, True, torch.bfloat16, seed=4, n_pad=0))


def _off_by_8(rows: torch.Tensor) -> torch.Tensor:
    """The same FP8 rows in storage that starts 8 bytes past a 16-byte boundary."""
    flat = torch.zeros(rows.numel() + 8, dtype=torch.uint8, device=rows.device)
    out = flat[8:].view(rows.shape)
    out.copy_(rows)
    assert out.data_ptr() % 16 == 8
    return out


@pytest.mark.parametrize("mode", ["csa", "hca"])
def test_fp8_caches_off_16_byte_alignment(mode):
    # the tensor-core kernel copies FP8 rows in 16-byte pieces from 16-byte boundaries, which it may do only from a
    # 16-byte aligned cache; other caches take the generic path, with the same result
    args = list(make_case(FLASH, mode, _scenarios(FLASH)["decode"], True, torch.bfloat16, seed=6))
    args[2] = _off_by_8(args[2])
    args[3] = _off_by_8(args[3])
    check(tuple(args))


def test_fp8_row_at_the_end_of_its_cache():
    # the gather copies an FP8 row from its 16-byte aligned start in whole 16-byte pieces, which for the last row of
    # a cache can read past its end (a pool of an odd number of rows: HCA at the Flash dims keeps one entry a
    # block); that row is copied up to its end and its tail loaded by the thread
    d = FLASH
    args = list(make_case(d, "hca", [(0, 5 * d.hca_ratio + 3, 1)], True, torch.bfloat16, seed=7, n_pad=0,
                          pool_blocks=8))
    entries, table = args[3], args[9].clone()
    n_rows, row_bytes = entries.shape[0] * entries.shape[1], entries.shape[2]
    assert n_rows % 2 == 1 and (n_rows - 1) * row_bytes % 16 == 0 and row_bytes % 16 != 0
    table[0, 2] = entries.shape[0] - 1  # the request's entry 2 is the pool's last row
    args[9] = table
    check(tuple(args))


def test_no_visible_key_gives_zero():
    # padded tokens only: the sink-only softmax gives 0, as the reference
    args = make_case(FLASH, "csa", [(0, 10, 1)], True, torch.bfloat16, n_pad=3)
    out = poisoned_call(args)
    assert torch.equal(out[1:].float(), torch.zeros_like(out[1:].float()))


@pytest.mark.parametrize("kernel", ["default", "pc"])
@pytest.mark.parametrize("mode,fp8", [("csa", True), ("hca", False)])
def test_graph_replay_with_new_inputs(monkeypatch, mode, fp8, kernel, capture_graph):
    """Captured once; replays with new positions, lists, caches and queries equal the reference: nothing about
    the inputs' values is planned on the host."""
    if kernel != "default":
        monkeypatch.setenv("DSV4RT_ATTN_MMA", kernel)
    d = FLASH
    shape_kw = dict(table_cols=80, pool_blocks=700, n_pad=1)
    seg_sets = [[(0, 9000, 1), (3, 40, 1), (5, 127, 1), (6, 2000, 1)],
                [(1, 300, 1), (2, 9999, 1), (4, 0, 1), (7, 5555, 1)],
                [(0, 130, 1), (3, 4100, 1), (5, 8000, 1), (6, 1, 1)]]
    static = list(make_case(d, mode, seg_sets[0], fp8, torch.bfloat16, seed=0, **shape_kw))
    graph, out = capture_graph(lambda: sparse_attn(*static))
    for i, segs in enumerate(seg_sets):
        new = make_case(d, mode, segs, fp8, torch.bfloat16, seed=10 + i, **shape_kw)
        for dst, src in zip(static, new):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        expected = sparse_attn_ref(*static)
        atol = ATTN_TOL[torch.bfloat16] * expected.float().abs().max().item()
        torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=atol)


@pytest.mark.parametrize("kernel", ["default", "pc", "split"])
@pytest.mark.parametrize("mode,fp8", [("csa", True), ("hca", False)])
def test_chained_calls_in_one_graph(monkeypatch, mode, fp8, kernel, capture_graph):
    """Three calls in one graph, each call's q the output of the call before. The grids are launched with
    programmatic stream serialization, so a grid may start while the one before still runs: it must read q, the
    rows and the split partials only after its wait. Replays with new queries equal the same calls run one at a
    time with a device sync between them (deterministic kernels: bit for bit)."""
    if kernel != "default":
        monkeypatch.setenv("DSV4RT_ATTN_MMA", kernel)
    if kernel == "split":
        monkeypatch.setenv("DSV4RT_ATTN_SPLITS", "3")
    segs = [(0, 9000, 1), (3, 40, 1), (5, 127, 1), (6, 2000, 1)]
    static = list(make_case(FLASH, mode, segs, fp8, torch.bfloat16, seed=0, table_cols=80, pool_blocks=700))
    q = static[0]

    def chain(sync: bool = False) -> torch.Tensor:
        o = q
        for _ in range(3):
            o = sparse_attn(o, *static[1:])
            if sync:
                torch.cuda.synchronize()
        return o

    graph, out = capture_graph(chain)
    g = torch.Generator(device="cuda")
    for seed in (1, 2):
        q.copy_(torch.randn(q.shape, generator=g.manual_seed(seed), device="cuda").to(q.dtype))
        graph.replay()
        torch.cuda.synchronize()
        expected = chain(sync=True)
        assert not expected.isnan().any()
        assert torch.equal(out, expected), f"{int((out != expected).sum())} elements differ"


def test_is_native():
    import dsv4rt.ops
    assert dsv4rt.ops.kernel_coverage()["sparse_attn"] == "native"


def test_rejects_bad_fp8_rows():
    # in a child process: a failed check must raise a RuntimeError naming the op, not take the process down (on the
    # H200 image, streaming an integer into the check message once killed the process: see csrc/binding.h)
    code = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, "tests/ops")
        import dsv4rt.ops
        dsv4rt.ops.load_cuda_kernels()
        from test_attention_cuda import TINY, make_case
        from dsv4rt.ops.attention import sparse_attn
        args = list(make_case(TINY, "sliding", [(0, 3, 1)], True, torch.bfloat16))
        args[2] = args[2][..., :-8].contiguous()
        try:
            sparse_attn(*args)
        except RuntimeError as e:
            print("RAISED", str(e).splitlines()[0])
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=str(Path(__file__).resolve().parents[2]))
    assert res.returncode == 0, f"child exited {res.returncode}: {res.stderr[-2000:]}"
    assert "RAISED sparse_attn: FP8 swa_cache rows must be 200 bytes, got 192" in res.stdout, res.stdout
