"""CUDA kernel of `dsv4rt::compressor_update` (csrc/compressor.cu) against the reference.

Flash dims: CSA main (d 512, m 4, overlap), CSA indexer (d 128, m 4, overlap, FP4), HCA (d 512, m 128).
Outputs are poisoned first: overlap state rows the reference does not read are NaN (rows of window -1 that it
reads with weight 0 are zeros, as in a fresh request); the HCA online state (M, Z, A) is a valid state of random
rows for requests whose open window began before the step (some channels empty, one request's state all
empty), zeros for requests whose window begins at the step's start, NaN for slots the step does not touch;
entry rows are NaN or 0xFF bytes. Checked:
  * overlap kv_state / score_state: bit for bit (pure data movement; the score + ape add is one fp32 add);
  * HCA kv_state / score_state: M, Z and A each within STATE_RTOL relative (atol: STATE_RTOL times the
    largest magnitude of the reference's values): the online softmax sums and merges in another order;
    untouched slots still NaN;
  * entry rows the step does not close: still poisoned;
  * closed entries: close to the reference (the pooling sums in another order, its exponentials on the MUFU
    (ex2.approx, 2 ulp) and its final division within 2 ulp: fp32 within FP32_ROW_RTOL of
    the row norm with overlap, HCA_FP32_ROW_RTOL for HCA, 16-bit dtypes within a rounding step), and their
    quantisation exact: the kernel's FP8/FP4/SIM rows equal the reference quantiser (`store_rows`) applied to
    the kernel's own unquantised entries.
The kernel skips padded tokens and tokens that close no window, which the reference sends to the spare state
slot and the trash block (the last ones): those are not compared.
The launch configuration (tokens a CTA, slot groups, cluster size, programmatic dependent launch, the bulk grid) is
picked from the shapes; FORCED_CONFIGS overrides it through the launcher's environment variables, so that every code
path of the kernels runs at these small shapes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch import Tensor

from dsv4rt.ops.compressor import compressor_update_ref
from dsv4rt.ops.kv_quant import (QUANT_FP4, QUANT_FP4_SIM, QUANT_FP8, QUANT_FP8_SIM, QUANT_NONE, fp4_row_bytes,
                                 fp8_row_bytes, idx_fp4_dequantize_ref, kv_fp8_dequantize_ref, store_rows)
from dsv4rt.ops.swa import PAD_SLOT
from factories import Seg

ROPE_DIM = 64
ROPE_THETA = 160000.0        # compress theta (YaRN left out: any frequencies do)
EPS = 1e-6
N_SLOTS = 8                  # request slots; per-slot tensors have one more, the spare slot
BLOCK_TOKENS = 128           # source tokens per entry block, as the runtime
FP32_ROW_RTOL = 1e-6         # |got - want| / |want| per entry row, fp32 activations (overlap compressors)
HCA_FP32_ROW_RTOL = 1e-5     # the same for HCA (online softmax: sums and merges in another order)
STATE_RTOL = 1e-5            # HCA online state (M, Z, A) vs the reference
HCA_EMPTY_CHANNELS = 0.125   # fraction of a continuing HCA state's channels left empty (Z == 0)
VALUE_TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}  # one rounding step, O(1) values
QUANT_MATCH = 0.99           # quantised entries: fraction of values equal to the reference's (a rounding
                             # difference before the quantiser can move a value by one step)


@dataclass(frozen=True)
class Compressor:
    d: int
    ratio: int
    overlap: bool
    quant: dict  # kv_dtype format -> QUANT_*


COMPRESSORS = {
    "csa_main": Compressor(512, 4, True, {"auto": QUANT_NONE, "fp8": QUANT_FP8, "fp8_sim": QUANT_FP8_SIM}),
    "csa_indexer": Compressor(128, 4, True, {"auto": QUANT_NONE, "fp8": QUANT_FP4, "fp8_sim": QUANT_FP4_SIM}),
    "hca": Compressor(512, 128, False, {"auto": QUANT_NONE, "fp8": QUANT_FP8, "fp8_sim": QUANT_FP8_SIM}),
}


def _decode(m: int) -> tuple[Seg, ...]:
    # closes window 0 (overlap: no window -1) / closes with overlap rows / open / fresh / closes deep in the block
    # table (the last slot) / open, last open row but one
    return (Seg(0, m - 1, 1), Seg(1, 5 * m - 1, 1), Seg(2, 5 * m + 1, 1), Seg(3, 0, 1), Seg(N_SLOTS - 1, 40 * m - 1, 1),
            Seg(4, 8 * m - 2, 1))


def _prefill(m: int) -> tuple[Seg, ...]:
    # from 0 closing 3 windows / mid-window start closing 3 (the first two read the state; new open rows over
    # rows the first reads) / no close / closes 2 from one row before a close / one aligned window / 2 tokens
    return (Seg(0, 0, 3 * m + 2), Seg(1, 2 * m + 2, 3 * m), Seg(2, m + 1, m - 2), Seg(3, 7 * m - 1, m + 2),
            Seg(4, 3 * m, m), Seg(5, 10 * m + 3, 2))


def _mixed(m: int) -> tuple[Seg, ...]:
    # decode closing / a chunk closing 2 after a mid-window start / decode open / a chunk shorter than m from 0 /
    # an aligned chunk of two windows
    return (Seg(0, 9 * m - 1, 1), Seg(1, 4 * m + 1, 2 * m), Seg(2, 3 * m + 2, 1), Seg(6, 0, m - 1),
            Seg(7, 2 * m, 2 * m))


def _long(m: int) -> tuple[Seg, ...]:
    # long chunks (many interior windows: the windows path's entries whose slots are all rows of the call): from 0 / a
    # mid-window start after a PAD token (closing tokens inside the windows path's spans, not at their ends) / an
    # aligned start. Fewer windows for large m (HCA).
    n = 24 if m <= 8 else 3
    return (Seg(0, 0, n * m + 1), Seg(1, 3 * m + 2, (n - 1) * m + 3), Seg(2, 5 * m, (n // 3) * m + 2))


def _anchors(m: int) -> tuple[Seg, ...]:
    # requests that close a window and leave open rows, several ending within m tokens of each other (several owners
    # and new open windows in one chunk of a kernel, or one span of HCA's bulk grid): closes w0 at its first token, 2
    # open rows / closes w1 from mid-window, 2 open rows / from 0 past one window, 5 open rows / a decode token (it
    # closes a window for m = 4, none for m = 128)
    return (Seg(0, m - 1, 3), Seg(1, 2 * m - 2, 4), Seg(2, 0, m + 5), Seg(3, 3 * m + 7, 1))


# name -> (segments for ratio m, indices of the segments before which a PAD token goes; len(segs): at the end)
SCENARIOS: dict[str, tuple[Callable[[int], tuple[Seg, ...]], tuple[int, ...]]] = {
    "decode": (_decode, (2, 6)),
    "prefill": (_prefill, (6, 6)),
    "mixed": (_mixed, (1, 3, 5)),
    "long": (_long, (1,)),
    "anchors": (_anchors, (1, 4)),
}


@dataclass
class Case:
    args: tuple        # the op's arguments, schema order
    written: Tensor    # [NB+1, E] bool: entry rows that the step closes
    quant: int
    dtype: torch.dtype


def _closing_windows(seg: Seg, m: int) -> list[int]:
    return [(p + 1) // m - 1 for p in range(seg.start, seg.end) if (p + 1) % m == 0]


def _overlap_state(segs: tuple[Seg, ...], m: int, cw: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """[S+1, 2m, cw] each: NaN except the rows the reference reads (positions q < s of the windows closing in the
    step: the open window's rows before s and the rows of the window before it)."""
    kv_state = torch.full((N_SLOTS + 1, 2 * m, cw), float("nan"))
    score_state = torch.full((N_SLOTS + 1, 2 * m, cw), float("nan"))
    for s in segs:
        open_start = s.start // m * m
        for w in _closing_windows(s, m):
            for q in range((w - 1) * m, min((w + 1) * m, s.start)):
                row = m + q % m if q >= open_start else q % m
                if q < 0:  # window -1: read with weight 0 (fresh request: zeros)
                    kv_state[s.slot, row] = 0.0
                    score_state[s.slot, row] = 0.0
                else:
                    kv_state[s.slot, row] = torch.randn(cw, generator=g)
                    score_state[s.slot, row] = torch.randn(cw, generator=g) * 2
    return kv_state, score_state


def _online_state(segs: tuple[Seg, ...], m: int, d: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """kv_state [S+1, 1, d] (A), score_state [S+1, 2, d] (M, Z): NaN for slots the step does not touch, zeros for
    a request whose window begins at its start, else (M, Z, A) of random rows [s // m * m, s) (scores as the
    step's) with HCA_EMPTY_CHANNELS of the channels empty; the first such request's state is all empty."""
    kv_state = torch.full((N_SLOTS + 1, 1, d), float("nan"))
    score_state = torch.full((N_SLOTS + 1, 2, d), float("nan"))
    first = True
    for s in segs:
        kv_state[s.slot], score_state[s.slot] = 0.0, 0.0
        n_rows = s.start % m
        if not n_rows:
            continue
        kv = torch.randn(n_rows, d, generator=g)
        sc = torch.randn(n_rows, d, generator=g) * 2
        mx = sc.max(0).values
        e = torch.exp(sc - mx)
        empty = (torch.rand(d, generator=g) < HCA_EMPTY_CHANNELS) | first
        first = False
        score_state[s.slot, 0] = torch.where(empty, 0.0, mx)
        score_state[s.slot, 1] = torch.where(empty, 0.0, e.sum(0))
        kv_state[s.slot, 0] = torch.where(empty, 0.0, (e * kv).sum(0))
    return kv_state, score_state


def compressor_inputs(device: str, comp: str, scenario: str, fmt: str, dtype: torch.dtype, seed: int = 0) -> Case:
    cfg = COMPRESSORS[comp]
    d, m, c = cfg.d, cfg.ratio, (2 if cfg.overlap else 1)
    cw, quant = c * d, cfg.quant[fmt]
    make_segs, pads = SCENARIOS[scenario]
    segs = make_segs(m)
    g = torch.Generator().manual_seed(seed)

    slot, pos, start, end = [], [], [], []
    for i in range(len(segs) + 1):
        for _ in range(pads.count(i)):  # PAD tokens that would close a window if they were live
            slot, pos, start, end = slot + [PAD_SLOT], pos + [m - 1], start + [0], end + [m]
        if i < len(segs):
            s = segs[i]
            slot += [s.slot] * s.length
            pos += list(range(s.start, s.end))
            start += [s.start] * s.length
            end += [s.end] * s.length
    n_tok = len(slot)

    kv = torch.randn(n_tok, cw, generator=g)
    score = torch.randn(n_tok, cw, generator=g) * 2
    ape = torch.randn(m, cw, generator=g) * 0.5
    norm_weight = 1 + 0.1 * torch.randn(d, generator=g)
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, ROPE_DIM, 2, dtype=torch.float32) / ROPE_DIM)

    if cfg.overlap:
        kv_state, score_state = _overlap_state(segs, m, cw, g)
    else:
        kv_state, score_state = _online_state(segs, m, d, g)

    # block table: a shuffled block for every (request, block column) a closing window needs; the pool's last
    # block among them; unused columns point at the trash block
    per_block = BLOCK_TOKENS // m
    needed = sorted({(s.slot, w // per_block) for s in segs for w in _closing_windows(s, m)})
    n_blocks = len(needed) + 3
    perm = torch.randperm(n_blocks - 1, generator=g).tolist()
    blocks = [n_blocks - 1] + perm[: len(needed) - 1]
    max_cols = max(col for _, col in needed) + 2
    block_table = torch.full((N_SLOTS + 1, max_cols), n_blocks, dtype=torch.int32)
    for (sl, col), b in zip(needed, blocks):
        block_table[sl, col] = b
    written = torch.zeros(n_blocks + 1, per_block, dtype=torch.bool)
    for s in segs:
        for w in _closing_windows(s, m):
            written[block_table[s.slot, w // per_block], w % per_block] = True

    if quant == QUANT_FP8:
        entries = torch.full((n_blocks + 1, per_block, fp8_row_bytes(d, ROPE_DIM)), 0xFF, dtype=torch.uint8)
    elif quant == QUANT_FP4:
        entries = torch.full((n_blocks + 1, per_block, fp4_row_bytes(d)), 0xFF, dtype=torch.uint8)
    else:
        entries = torch.full((n_blocks + 1, per_block, d), float("nan"), dtype=dtype)

    i32 = dict(dtype=torch.int32)
    tensors = (kv, score, ape, norm_weight, inv_freq, kv_state, score_state, entries, torch.tensor(slot, **i32),
               torch.tensor(pos, **i32), torch.tensor(start, **i32), torch.tensor(end, **i32), block_table)
    args = tuple(t.to(device) for t in tensors) + (m, cfg.overlap, quant, EPS, dtype)
    return Case(args, written.to(device), quant, dtype)


def _bytes(t: Tensor) -> Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _byte_regions(quant: int, d: int) -> dict[str, slice]:
    if quant == QUANT_FP8:
        nope = d - ROPE_DIM
        return {"fp8 codes": slice(0, nope), "rope bf16": slice(nope, nope + 2 * ROPE_DIM),
                "exponents+pad": slice(nope + 2 * ROPE_DIM, None)}
    if quant == QUANT_FP4:
        return {"fp4 codes": slice(0, d // 2), "exponents": slice(d // 2, None)}
    return {"values": slice(0, None)}


def _differing_bytes(got: Tensor, want: Tensor, quant: int, d: int) -> dict[str, int]:
    """Per region of the row layout: how many bytes differ (for the failure messages)."""
    g, w = _bytes(got), _bytes(want)
    if quant not in (QUANT_FP8, QUANT_FP4):
        g, w = got.view(got.shape[0], -1), want.view(want.shape[0], -1)
    return {name: int((g[:, sl] != w[:, sl]).sum()) for name, sl in _byte_regions(quant, d).items()}


def _assert_entries_close(got: Tensor, want: Tensor, quant: int, dtype: torch.dtype, d: int,
                          fp32_row_rtol: float = FP32_ROW_RTOL) -> None:
    regions = _differing_bytes(got, want, quant, d)
    if quant == QUANT_FP8:
        got, want = kv_fp8_dequantize_ref(got, d, ROPE_DIM, torch.float32), kv_fp8_dequantize_ref(want, d, ROPE_DIM,
                                                                                                   torch.float32)
    elif quant == QUANT_FP4:
        got, want = idx_fp4_dequantize_ref(got, d, torch.float32), idx_fp4_dequantize_ref(want, d, torch.float32)
    got, want = got.float(), want.float()
    assert torch.isfinite(got).all()
    if quant == QUANT_NONE:
        if dtype == torch.float32:
            rel = (got - want).norm(dim=-1) / want.norm(dim=-1)
            assert rel.max() <= fp32_row_rtol, f"fp32 entry rows differ by {rel.max():.3g} relative"
        tol = VALUE_TOL[dtype]
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    else:  # quantised: a rounding difference before the quantiser may move a value by one quantisation step
        same = (got == want).float().mean()
        assert same >= QUANT_MATCH, (f"only {same:.4f} of the quantised entry values equal the reference's; "
                                     f"differing bytes by region {regions}")


def check_compressor(case: Case, run_op: Callable) -> None:
    """run_op(*case.args) vs the reference on clones of the written tensors (see the module docstring)."""
    args = case.args
    kv_state, score_state, entries = args[5], args[6], args[7]
    d, dtype, quant = args[3].shape[0], case.dtype, case.quant
    pre_state = (kv_state.clone(), score_state.clone())
    want_kv, want_sc, want_entries = kv_state.clone(), score_state.clone(), entries.clone()
    compressor_update_ref(*args[:5], want_kv, want_sc, want_entries, *args[8:])
    run_op(*args)

    overlap = args[14]
    if overlap:  # buffered rows: data movement, bit for bit
        for got, want in ((kv_state, want_kv), (score_state, want_sc)):
            assert torch.equal(got[:-1].view(torch.int32), want[:-1].view(torch.int32)), "state differs"
    else:        # online state: M, Z, A each within STATE_RTOL of its largest value; untouched slots still NaN
        for name, got, want in (("M", score_state[:-1, 0], want_sc[:-1, 0]),
                                ("Z", score_state[:-1, 1], want_sc[:-1, 1]), ("A", kv_state[:-1, 0], want_kv[:-1, 0])):
            scale = float(want.nan_to_num().abs().max())
            torch.testing.assert_close(got, want, rtol=STATE_RTOL, atol=STATE_RTOL * scale, equal_nan=True,
                                       msg=lambda m, name=name: f"HCA state {name}: {m}")
    untouched = ~case.written
    untouched[-1] = False  # the trash block
    assert torch.equal(_bytes(entries)[untouched], _bytes(want_entries)[untouched]), "rows written that close nothing"
    written = case.written.clone()
    written[-1] = False
    assert written.any()
    got_rows, want_rows = entries[written], want_entries[written]

    if quant != QUANT_NONE:  # the quantiser exactly: the reference's applied to the kernel's own values
        raw = torch.full((*entries.shape[:2], d), float("nan"), dtype=dtype, device=entries.device)
        run_op(*args[:5], pre_state[0].clone(), pre_state[1].clone(), raw, *args[8:15], QUANT_NONE, *args[16:])
        expected = store_rows(raw[written], ROPE_DIM, quant, entries.dtype)
        assert torch.equal(_bytes(got_rows), _bytes(expected)), (
            f"quantised rows differ from store_rows(kernel values): {_differing_bytes(got_rows, expected, quant, d)}")
    _assert_entries_close(got_rows, want_rows, quant, dtype, d, FP32_ROW_RTOL if overlap else HCA_FP32_ROW_RTOL)


@pytest.mark.cuda
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("fmt", ["auto", "fp8", "fp8_sim"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("comp", list(COMPRESSORS))
def test_compressor_update_cuda_matches_reference(comp, dtype, fmt, scenario):
    case = compressor_inputs("cuda", comp, scenario, fmt, dtype)
    check_compressor(case, torch.ops.dsv4rt.compressor_update.default)


@pytest.mark.cuda
@pytest.mark.parametrize("comp", list(COMPRESSORS))
def test_compressor_update_cuda_float16(comp):
    check_compressor(compressor_inputs("cuda", comp, "mixed", "fp8", torch.float16),
                     torch.ops.dsv4rt.compressor_update.default)


# Forced launch configurations (csrc/compressor.cu, pick_config, pick_online and pick_bulk).
# General kernel: several tokens a CTA (closing tokens in turn, their slots staged in shared memory ahead
# of their turn unless PIPE=0; row-writing tokens batched; the owner and other closers of a request in one CTA), slot
# groups that divide m (G == m: the owner copies its overlap rows inside the pooling) or not (1 and 3: several
# batches of slots a thread; 32: groups without slots for the small windows), channel slices in clusters (also for
# the small windows, where the default is one CTA), and plain stream serialization instead of programmatic
# dependent launch.
# Online kernel (no-overlap compressors: HCA): CLUSTER and CHUNK as above, and GROUPS slot groups a CTA (at most
# 256 threads; by default two when a bulk grid runs behind it, else one), merged in shared memory.
# Bulk grid (BULK=1; by default only in calls of 512 tokens or more; no-overlap compressors only): HCA's interior
# windows, which read no state, in a second grid behind the online kernel: clusters of K CTAs (channel slices) over a
# span of m tokens, G slot groups, started without waiting for the online kernel.
# Windows path (WINDOWS=1; by default only in calls of 1,024 tokens or more; overlap compressors only): a grid that
# pools every entry of the call at once, then a grid that writes the state.
FORCED_CONFIGS = {
    "chunk256_g32": {"CHUNK": "256", "GROUPS": "32"},
    "chunk16_g2_nopipe": {"CHUNK": "16", "GROUPS": "2", "PIPE": "0"},
    "chunk64_g1": {"CHUNK": "64", "GROUPS": "1"},
    "chunk8_g2": {"CHUNK": "8", "GROUPS": "2"},
    "chunk3_g3": {"CHUNK": "3", "GROUPS": "3"},
    "chunk1_g4": {"CHUNK": "1", "GROUPS": "4"},
    "chunk5_g4": {"CHUNK": "5", "GROUPS": "4"},
    "cluster2_chunk16_g8": {"CLUSTER": "2", "CHUNK": "16", "GROUPS": "8"},
    "cluster4_chunk2_g16": {"CLUSTER": "4", "CHUNK": "2", "GROUPS": "16"},
    # a token a CTA in a cluster: the one-token path of the general instance (without a cluster, chunk1_g4 runs the
    # compact kOne instance)
    "cluster2_chunk1_g4": {"CLUSTER": "2", "CHUNK": "1", "GROUPS": "4"},
    "no_pdl": {"PDL": "0"},
    # the bulk grid behind the online kernel (HCA's interior windows: the prefill and mixed scenarios; the overlap
    # compressors have none, so these run their defaults)
    "bulk": {"BULK": "1"},
    "bulk_k2_g3": {"BULK": "1", "BULK_K": "2", "BULK_G": "3"},
    "bulk_g1": {"BULK": "1", "BULK_G": "1"},
    "bulk_online_cluster8": {"BULK": "1", "CLUSTER": "8"},
    "bulk_no_pdl": {"BULK": "1", "PDL": "0"},
    "bulk_k8_chunk4": {"BULK": "1", "BULK_K": "8", "CHUNK": "4"},
    # the windows path (by default only in calls of 1,024 tokens or more; overlap compressors only): every entry
    # pooled at once by a windows grid, then the state written by a state grid behind it (HCA runs its defaults)
    "windows": {"WINDOWS": "1"},
    "windows_no_pdl": {"WINDOWS": "1", "PDL": "0"},
}


# settings a compressor's calls never read (csrc/compressor.cu: the bulk grid is HCA's, pick_bulk; the windows path
# the overlap compressors', windows_ok), by `overlap`
IGNORED_SETTINGS = {True: {"BULK", "BULK_K", "BULK_G"}, False: {"WINDOWS"}}


def _forced_cases() -> list[tuple[str, str]]:
    """(compressor, config) pairs whose settings change something for that compressor. A config all of whose
    settings the compressor ignores would run its defaults (test_compressor_update_cuda_matches_reference covers
    them); one that reduces to an earlier config's settings would repeat it (bulk_no_pdl for the overlap
    compressors is no_pdl)."""
    cases = []
    for comp, c in COMPRESSORS.items():
        seen = set()
        for name, env in FORCED_CONFIGS.items():
            effective = frozenset((k, v) for k, v in env.items() if k not in IGNORED_SETTINGS[c.overlap])
            if effective and effective not in seen:
                seen.add(effective)
                cases.append((comp, name))
    return cases


@pytest.mark.cuda
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("dtype,fmt", [(torch.float32, "auto"), (torch.bfloat16, "fp8")])
@pytest.mark.parametrize("comp,config", _forced_cases())
def test_compressor_update_cuda_forced_config(comp, dtype, fmt, scenario, config, monkeypatch):
    for key, value in FORCED_CONFIGS[config].items():
        monkeypatch.setenv(f"DSV4RT_COMPRESSOR_{key}", value)
    case = compressor_inputs("cuda", comp, scenario, fmt, dtype, seed=1)
    check_compressor(case, torch.ops.dsv4rt.compressor_update.default)


@pytest.mark.cuda
def test_compressor_update_cuda_is_native():
    import dsv4rt.ops
    assert dsv4rt.ops.kernel_coverage()["compressor_update"] == "native"


@pytest.mark.cuda
@pytest.mark.parametrize("comp", list(COMPRESSORS))
def test_compressor_update_cuda_opcheck(comp):
    case = compressor_inputs("cuda", comp, "mixed", "fp8", torch.bfloat16)
    for t in case.args[5:8]:  # opcheck compares repeated runs: no NaN
        t.zero_()
    torch.library.opcheck(torch.ops.dsv4rt.compressor_update.default, case.args)


@pytest.mark.cuda
@pytest.mark.parametrize("comp,windows", [("hca", "0"), ("csa_main", "0"), ("csa_main", "1"), ("csa_indexer", "1")])
def test_compressor_update_cuda_graph_replay(comp, windows, monkeypatch, capture_graph):
    """Captured once (HCA with its bulk grid forced on, CSA main with and without the windows path, the indexer with
    it: two grids ordered by programmatic dependent launch inside the graph; the windows path on the long scenario);
    replays on new rows, states and block tables write exactly what the eager op writes on the same inputs, byte for
    byte (the kernels are deterministic)."""
    monkeypatch.setenv("DSV4RT_COMPRESSOR_BULK", "1")
    monkeypatch.setenv("DSV4RT_COMPRESSOR_WINDOWS", windows)
    op = torch.ops.dsv4rt.compressor_update.default
    scenario = "long" if windows == "1" else "prefill"
    static = list(compressor_inputs("cuda", comp, scenario, "fp8", torch.bfloat16, seed=0).args)
    graph, _ = capture_graph(lambda: op(*static))
    for seed in (1, 2):
        new = compressor_inputs("cuda", comp, scenario, "fp8", torch.bfloat16, seed=seed).args
        eager = [t.clone() if isinstance(t, Tensor) else t for t in new]
        for dst, src in zip(static, new):
            if isinstance(dst, Tensor):
                dst.copy_(src)
        graph.replay()
        op(*eager)
        torch.cuda.synchronize()
        for name, i in (("kv_state", 5), ("score_state", 6), ("entries", 7)):
            assert torch.equal(_bytes(static[i]), _bytes(eager[i])), f"{name} differs between replay and eager"
