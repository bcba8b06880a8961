"""Cache-write kernels (compressor_update, swa_cache_write), CUDA-graph replayed, Flash dims.

Each benchmark captures REPEATS steps in one CUDA graph; the time per step is the replay time / REPEATS. The
compressor kernels are launched with programmatic dependent launch, so back to back a step's first grid overlaps
the end of the step before, and the pair op's grids overlap HCA's. In the model the CSA pair and HCA's compressor run
in different layers, each after torch ops, so test_bench_compressor_update also times the step with each of the two
calls after a one-element torch kernel (graphtime.isolated_seconds: no overlap with what ran before) and judges the
targets on that time.
  * prefill: one 8,192-token chunk (one request, starting mid-window) through the three compressors of a
    CSA + HCA layer pair; achieved bandwidth = the bytes the step must move (kv/score rows read as fp32; state
    read and written: CSA the buffered rows, HCA its online softmax state (M, Z, A: 3 d fp32) once a request;
    entries written) / time, against a device-to-device copy measured in the same run;
  * decode: batch 64 (64 requests at seeded random positions) through the same three compressors (target:
    <= 10 us for the three together); decode_close: the worst case, every request closes a CSA and an HCA window.
    The three run as the model calls them: the CSA layer's main and indexer compressors in one compressor_update_pair
    call (one launch at decode), then HCA's compressor_update; also printed: the three as three compressor_update
    calls, and the pair op as two launches (DSV4RT_COMPRESSOR_PAIR=0);
  * swa: the sliding-ring write of the same two steps.
Run: python -m pytest tests/bench/test_bench_cache_write.py --benchmark-only -s
Each mode also prints the per-compressor breakdown (each alone). The prefill timeline benchmark prints when each
kernel of the three starts and ends within a step (graph replay under torch.profiler, programmatic launches on, as
the model runs): where a prefill step's time goes.
With DSV4RT_BENCH_SWEEP=1, test_bench_compressor_sweep also times each compressor alone under a list of forced
launch configurations (csrc/compressor.cu pick_config, pick_online and pick_bulk, through its DSV4RT_COMPRESSOR_*
environment variables) at prefill (cycling input sets, so that rows come from memory, not L2) and decode, and the
three together under a few per-compressor combinations; one table: the numbers that pick the defaults
(DSV4RT_BENCH_SWEEP_MODES=prefill,decode limits the modes, DSV4RT_BENCH_SWEEP_COMBOS_ONLY=1 to the combinations).
"""
from __future__ import annotations

import os

import pytest
import torch

from dsv4rt.ops.compressor import compressor_update, compressor_update_pair, pair_args
from dsv4rt.ops.kv_quant import QUANT_FP4, QUANT_FP8, QUANT_NONE, fp4_row_bytes, fp8_row_bytes
from dsv4rt.ops.swa import swa_cache_write
from graphtime import capture, isolated_seconds, median_seconds, replay_kernels, timeline_lines

HEAD_DIM, INDEX_DIM, ROPE_DIM = 512, 128, 64   # Flash
CSA_RATIO, HCA_RATIO, WINDOW = 4, 128, 128
BLOCK_TOKENS = 128
PREFILL_TOKENS, PREFILL_START = 8192, 8293     # start: mid-window for both ratios (CSA s%4 = 1, HCA s%128 = 101)
DECODE_BATCH = 64
MAX_CONTEXT = 65536
REPEATS = {"prefill": 20, "decode": 200, "decode_close": 200}  # steps per graph: enough to hide the replay's launch
ROUNDS = 20
# name: (d, ratio, overlap, quant for kv_dtype "fp8")
COMPRESSORS = {"csa_main": (HEAD_DIM, CSA_RATIO, True, QUANT_FP8),
               "csa_indexer": (INDEX_DIM, CSA_RATIO, True, QUANT_FP4),
               "hca": (HEAD_DIM, HCA_RATIO, False, QUANT_FP8)}


def _step_meta(mode: str, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(req_slot, positions, start_pos, end_pos) int32 [T]."""
    if mode == "prefill":
        pos = torch.arange(PREFILL_START, PREFILL_START + PREFILL_TOKENS, dtype=torch.int32)
        slot = torch.zeros_like(pos)
        start = torch.full_like(pos, PREFILL_START)
        end = torch.full_like(pos, PREFILL_START + PREFILL_TOKENS)
    else:
        pos = torch.randint(0, MAX_CONTEXT - 1, (DECODE_BATCH,), generator=g, dtype=torch.int32)
        if mode == "decode_close":
            pos = (pos // HCA_RATIO + 1) * HCA_RATIO - 1
        slot = torch.arange(DECODE_BATCH, dtype=torch.int32)
        start, end = pos.clone(), pos + 1
    return slot, pos, start, end


def _compressor_args(name: str, meta: tuple[torch.Tensor, ...], fmt: str, g: torch.Generator) -> tuple[tuple, dict]:
    d, m, overlap, q8 = COMPRESSORS[name]
    quant = q8 if fmt == "fp8" else QUANT_NONE
    c = 2 if overlap else 1
    cw = c * d
    slot, pos, start, end = meta
    n_tok, n_slots = pos.shape[0], int(slot.max()) + 1
    per_block = BLOCK_TOKENS // m
    # a distinct block for every (request, block column) that a closing window writes; the rest: the trash block
    closing = [(int(r), (int(p) + 1) // m - 1) for r, p in zip(slot, pos) if (int(p) + 1) % m == 0]
    needed = sorted({(r, w // per_block) for r, w in closing})
    n_blocks = len(needed)
    max_blocks = MAX_CONTEXT // BLOCK_TOKENS
    block_table = torch.full((n_slots + 1, max_blocks), n_blocks, dtype=torch.int32)
    for (r, col), b in zip(needed, torch.randperm(n_blocks, generator=g).tolist()):
        block_table[r, col] = b
    quant_rows = {QUANT_FP8: fp8_row_bytes(d, ROPE_DIM), QUANT_FP4: fp4_row_bytes(d)}
    row = quant_rows.get(quant, d)
    entry_dtype = torch.uint8 if quant in quant_rows else torch.bfloat16
    entry_bytes = row * (1 if quant in quant_rows else 2)
    dev = "cuda"
    args = (torch.randn(n_tok, cw, generator=g).to(dev), torch.randn(n_tok, cw, generator=g).to(dev),
            torch.randn(m, cw, generator=g).to(dev), (1 + 0.1 * torch.randn(d, generator=g)).to(dev),
            (1.0 / 160000.0 ** (torch.arange(0, ROPE_DIM, 2, dtype=torch.float32) / ROPE_DIM)).to(dev),
            *(_state(n_slots, m, overlap, cw, g)),
            torch.zeros(n_blocks + 1, per_block, row, dtype=entry_dtype, device=dev), slot.to(dev), pos.to(dev),
            start.to(dev), end.to(dev), block_table.to(dev), m, overlap, quant, 1e-6, torch.bfloat16)

    # bytes the step must move: kv + score rows (fp32), state read and written, closed entries. Overlap: rows of
    # kv + score state (2 cw fp32 each) read (open rows before s, overlap rows) and written (open rows after the
    # step, overlap rows). HCA: the online state (M, Z, A: 3 d fp32) read once when the request's window began
    # before s, written once (the open window's state, or zeros after a close)
    closes = state_read = state_written = 0
    for _, s, e in {(int(r), int(a), int(b)) for r, a, b in zip(slot, start, end)}:  # one per request
        open_start, open_end = s // m * m, e // m * m
        n_close = (open_end - open_start) // m
        closes += n_close
        if not overlap:
            state_read += 3 * d * 4 if s > open_start else 0
            state_written += 3 * d * 4
        elif n_close:
            state_read += 2 * 4 * cw * ((s - open_start) + m)
            state_written += 2 * 4 * cw * ((e - open_end) + m)
        else:
            state_written += 2 * 4 * cw * (e - s)
    nbytes = 2 * 4 * n_tok * cw + state_read + state_written + closes * entry_bytes
    return args, {"closes": closes, "bytes": nbytes}


def _state(n_slots: int, m: int, overlap: bool, cw: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_state, score_state) on the device: overlap random rows [S+1, 2m, cw] each; HCA a valid online softmax
    state, kv_state [S+1, 1, d] (A ~ N(0, 1)) and score_state [S+1, 2, d] (M ~ N(0, 1), Z in [1, 2))."""
    if overlap:
        return (torch.randn(n_slots + 1, 2 * m, cw, generator=g).to("cuda"),
                torch.randn(n_slots + 1, 2 * m, cw, generator=g).to("cuda"))
    mx, z = torch.randn(n_slots + 1, cw, generator=g), 1 + torch.rand(n_slots + 1, cw, generator=g)
    return (torch.randn(n_slots + 1, 1, cw, generator=g).to("cuda"), torch.stack((mx, z), dim=1).to("cuda"))


def _swa_args(mode: str, fmt: str, g: torch.Generator) -> tuple[tuple, dict]:
    slot, pos, _, end = _step_meta(mode, g)
    n_tok, n_slots = pos.shape[0], int(slot.max()) + 1
    dev = "cuda"
    if fmt == "fp8":
        row = fp8_row_bytes(HEAD_DIM, ROPE_DIM)
        cache = torch.zeros(n_slots + 1, WINDOW, row, dtype=torch.uint8, device=dev)
    else:
        row = 2 * HEAD_DIM
        cache = torch.zeros(n_slots + 1, WINDOW, HEAD_DIM, dtype=torch.bfloat16, device=dev)
    kv = torch.randn(n_tok, HEAD_DIM, generator=g).to(torch.bfloat16).to(dev)
    kept = n_tok if mode == "decode" else WINDOW  # rows among the last W positions of their request
    nbytes = kept * (2 * HEAD_DIM + row)           # read as bf16, written as cache rows; the rest are skipped
    return (kv, cache, slot.to(dev), pos.to(dev), end.to(dev), ROPE_DIM), {"bytes": nbytes}


def _capture(calls, repeats: int) -> torch.cuda.CUDAGraph:
    """`repeats` steps of the (fn, args) calls in one graph."""
    return capture(lambda i: [fn(*args) for fn, args in calls], repeats)


def _report(benchmark, graph, repeats: int, nbytes: int, copy_bw: float, info: dict,
            isolated: float | None = None) -> None:
    """Per-step time of `graph`, or `isolated` (seconds, graphtime.isolated_seconds) when given: the time judged,
    the back-to-back time beside it."""
    import dsv4rt.ops
    back_to_back = median_seconds(graph.replay, ROUNDS) / repeats
    per_step = isolated if isolated is not None else back_to_back
    bw = nbytes / per_step
    benchmark.extra_info.update(device=torch.cuda.get_device_name(), repeats=repeats, us_per_step=per_step * 1e6,
                                us_per_step_back_to_back=back_to_back * 1e6, bytes=nbytes, achieved_GBps=bw / 1e9,
                                copy_GBps=copy_bw / 1e9, fraction_of_copy=bw / copy_bw, **info)
    ops = ("compressor_update", "compressor_update_pair", "swa_cache_write")
    cov = {k: v for k, v in dsv4rt.ops.kernel_coverage().items() if k in ops}
    b2b = f" ({back_to_back * 1e6:.2f} back to back)" if isolated is not None else ""
    print(f"\n{benchmark.name}: {per_step * 1e6:.2f} us/step{b2b}, {nbytes / 1e6:.2f} MB, {bw / 1e9:.0f} GB/s "
          f"({bw / copy_bw:.0%} of copy {copy_bw / 1e9:.0f} GB/s) on {torch.cuda.get_device_name()}; {info}; {cov}")
    benchmark.pedantic(lambda: (graph.replay(), torch.cuda.synchronize()), rounds=ROUNDS, warmup_rounds=2)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["fp8", "auto"])
@pytest.mark.parametrize("mode", ["prefill", "decode", "decode_close"])
def test_bench_compressor_update(benchmark, copy_bandwidth, mode, fmt, monkeypatch):
    g = torch.Generator().manual_seed(0)
    calls, nbytes, info = [], 0, {"mode": mode, "kv_dtype": fmt}
    step = _step_meta(mode, g)  # one step: the three compressors see the same tokens
    for name in COMPRESSORS:
        args, meta = _compressor_args(name, step, fmt, g)
        calls.append((compressor_update, args))
        nbytes += meta["bytes"]
        info[f"{name}_closes"] = meta["closes"]
    for name, call in zip(COMPRESSORS, calls):  # each alone, for the breakdown
        info[f"{name}_us"] = median_seconds(_capture([call], REPEATS[mode]).replay, ROUNDS) / REPEATS[mode] * 1e6
    # as the model calls them: the CSA layer's two compressors in one op (one launch at decode), then HCA's
    # (the indexer takes the main call's metadata and block table, as in the model)
    pair = [(compressor_update_pair, pair_args(calls[0][1], calls[1][1])), calls[2]]
    info["three_calls_us"] = median_seconds(_capture(calls, REPEATS[mode]).replay, ROUNDS) / REPEATS[mode] * 1e6
    monkeypatch.setenv("DSV4RT_COMPRESSOR_PAIR", "0")
    info["pair_as_two_launches_us"] = (median_seconds(_capture(pair, REPEATS[mode]).replay, ROUNDS) / REPEATS[mode]
                                       * 1e6)
    monkeypatch.delenv("DSV4RT_COMPRESSOR_PAIR")
    graph = _capture(pair, REPEATS[mode])
    isolated = isolated_seconds([lambda i, fn=fn, args=args: fn(*args) for fn, args in pair], REPEATS[mode])
    _report(benchmark, graph, REPEATS[mode], nbytes, copy_bandwidth, info, isolated)
    parts = ", ".join(f"{k} {v:.2f}" for k, v in info.items() if k.endswith("_us"))
    target = ""
    if mode == "decode":
        target = f" (target <= 10 us: {'met' if isolated * 1e6 <= 10.0 else 'NOT met'})"
    print(f"{benchmark.name}: {benchmark.extra_info['us_per_step']:.2f} us for the three (CSA pair + HCA, each after "
          f"a torch kernel){target}, {benchmark.extra_info['us_per_step_back_to_back']:.2f} back to back; {parts}")


@pytest.mark.cuda
def test_bench_compressor_prefill_timeline(benchmark, copy_bandwidth):
    """The prefill step (fp8) as the model calls it: start and end of each kernel, in us after the step's first kernel
    started, the mean over the middle steps of a graph of REPEATS["prefill"] steps, from torch.profiler's trace."""
    g = torch.Generator().manual_seed(0)
    step, nbytes, calls = _step_meta("prefill", g), 0, []
    for name in COMPRESSORS:
        args, meta = _compressor_args(name, step, "fp8", g)
        calls.append((compressor_update, args))
        nbytes += meta["bytes"]
    pair = [(compressor_update_pair, pair_args(calls[0][1], calls[1][1])), calls[2]]
    repeats = REPEATS["prefill"]
    graph = _capture(pair, repeats)
    per_step = median_seconds(graph.replay, ROUNDS) / repeats
    events = replay_kernels(graph)
    per = len(events) // repeats
    assert per > 0 and len(events) == per * repeats, f"{len(events)} kernels in the trace for {repeats} steps"
    steps = [events[i * per:(i + 1) * per] for i in range(repeats)]
    names = [[e["name"] for e in st] for st in steps]
    middle = [st for st, nm in zip(steps[4:-2], names[4:-2]) if nm == names[4]]  # the same kernels in the same order
    lines = [f"prefill timeline on {torch.cuda.get_device_name()}: {per_step * 1e6:.2f} us/step, "
             f"{nbytes / per_step / copy_bandwidth:.0%} of copy ({per} kernels a step; start / end us after the step's "
             f"first kernel, mean of {len(middle)} steps)"]
    lines += timeline_lines(middle)
    print("\n" + "\n".join(lines))
    benchmark.extra_info.update(device=torch.cuda.get_device_name(), us_per_step=per_step * 1e6, timeline=lines)
    benchmark.pedantic(lambda: (graph.replay(), torch.cuda.synchronize()), rounds=2, warmup_rounds=1)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["fp8", "auto"])
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_bench_swa_cache_write(benchmark, copy_bandwidth, mode, fmt):
    g = torch.Generator().manual_seed(0)
    args, meta = _swa_args(mode, fmt, g)
    graph = _capture([(swa_cache_write, args)], REPEATS[mode])
    _report(benchmark, graph, REPEATS[mode], meta["bytes"], copy_bandwidth, {"mode": mode, "kv_dtype": fmt})


# (mode, compressor) -> forced configurations "K,G,chunk,pipe" or named knobs "BULK_K=8 BULK_G=8" (empty: the
# launcher's default: the CSA compressors run the general kernel, or at prefill the windows path, which takes no
# knob; WINDOWS=0 turns it off, and a forced K, G, chunk or pipe does too; HCA runs the online-state kernel, which
# takes K (cluster), G (slot groups) and chunk, and in long calls the bulk grid behind it: BULK_K its channel
# slices, BULK_G its slot groups, BULK=0 none).
SWEEP = {
    ("prefill", "csa_main"): [",,,", "WINDOWS=0", ",1,,", ",4,,", ",,4,", ",,8,", ",,32,", ",,16,0", ",1,4,", ",1,8,",
                              "2,,4,", "4,,4,", "2,1,8,"],
    ("prefill", "csa_indexer"): [",,,", "WINDOWS=0", ",1,,", ",4,,", ",,8,", ",,16,", ",,32,", ",1,8,", ",1,16,",
                                 ",,8,0"],
    ("prefill", "hca"): [",,,", "BULK=0", "BULK_K=8", "BULK_G=16", "BULK_G=4", "BULK_K=2", "BULK_K=8 BULK_G=8",
                         "BULK_K=2 BULK_G=4", "8,,,", "2,,,", "1,,,", "8,1,,", "2,1,,", "2,,128,", ",1,,"],
    ("decode", "csa_main"): [",,,", ",2,1,", "2,,1,", "4,,1,"],
    ("decode", "csa_indexer"): [",,,", ",2,1,", ",1,1,"],
    ("decode", "hca"): [",,,", ",,2,", ",,4,", "2,,1,"],
    ("decode_close", "csa_main"): [",,,"],
    ("decode_close", "hca"): [",,,", "2,,1,"],
}
# the three together under per-compressor configurations (csa_main, csa_indexer, hca), as above
COMBOS = {
    "prefill": [(",,,", ",,,", ",,,"), (",,,", ",,,", "BULK=0"), (",,,", ",,,", "8,,,"), (",,,", ",,,", "2,,,"),
                (",,,", ",,,", "BULK_K=8 BULK_G=8")],
    "decode": [(",,,", ",,,", ",,,"), ("4,,1,", ",,,", ",,,"), (",,,,100", ",,,,100", ",,,,100")],
}
# a fifth field: DSV4RT_COMPRESSOR_CARVEOUT (set once, it stays on the kernel for the process: those combos last)
_KNOBS = ("CLUSTER", "GROUPS", "CHUNK", "PIPE", "CARVEOUT")


def _with_env(env: dict, fn):
    saved = {k: os.environ.get(k) for k in env}
    try:
        for k, v in env.items():
            if v:
                os.environ[k] = v
            else:
                os.environ.pop(k, None)
        return fn()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _env_of(cfg: str) -> dict:
    """Positional "K,G,chunk,pipe[,carveout]" or named "KNOB=v KNOB=v" (DSV4RT_COMPRESSOR_KNOB)."""
    if "=" in cfg:
        return {f"DSV4RT_COMPRESSOR_{k}": v for k, v in (kv.split("=") for kv in cfg.split())}
    env = {f"DSV4RT_COMPRESSOR_{k}": v for k, v in zip(_KNOBS, cfg.split(","))}
    if any(cfg.split(",")[:4]):  # a forced general-kernel configuration: not the windows path
        env["DSV4RT_COMPRESSOR_WINDOWS"] = "0"
    return env


def _label(cfg: str) -> str:
    if "=" in cfg:
        return cfg
    return " ".join(f"{k}={v or '-'}" for k, v in zip(("K", "G", "chunk", "pipe"), cfg.split(",")))


def _sweep_sets(mode: str, fmt: str = "fp8"):
    """Input sets of the three compressors for one step; prefill: enough sets that cycling through them reads
    from memory, not L2 (about 100 MB a compressor)."""
    g = torch.Generator().manual_seed(0)
    step = _step_meta(mode, g)
    sets, nbytes = {}, 0
    for name in COMPRESSORS:
        args, meta = _compressor_args(name, step, fmt, g)
        n = max(1, -(-100_000_000 // meta["bytes"])) if mode == "prefill" else 1
        sets[name] = [args] + [_compressor_args(name, step, fmt, g)[0] for _ in range(n - 1)]
        nbytes += meta["bytes"]
    return sets, nbytes


def _time_env(calls, repeats: int) -> float:
    """us a step of calls [(args_sets, env)], each call under its env (the launcher reads it at capture), cycling
    through the input sets."""
    def step(i):
        for sets, env in calls:
            _with_env(env, lambda: compressor_update(*sets[i % len(sets)]))
    graph = capture(step, repeats)
    return median_seconds(graph.replay, ROUNDS) / repeats * 1e6


@pytest.mark.cuda
@pytest.mark.skipif(not os.environ.get("DSV4RT_BENCH_SWEEP"), reason="set DSV4RT_BENCH_SWEEP=1")
def test_bench_compressor_sweep(benchmark, copy_bandwidth):
    rows, later = [], []
    only = os.environ.get("DSV4RT_BENCH_SWEEP_MODES", "prefill,decode,decode_close").split(",")
    for mode in only:
        sets, nbytes = _sweep_sets(mode)
        for name in COMPRESSORS:
            if os.environ.get("DSV4RT_BENCH_SWEEP_COMBOS_ONLY"):  # only the three together
                break
            for cfg in SWEEP.get((mode, name), []):
                us = _time_env([(sets[name], _env_of(cfg))], REPEATS[mode])
                label = _label(cfg)
                rows.append((mode, name, label, us, None))
        for combo in COMBOS.get(mode, []):
            if any("=" not in c and len(c.split(",")) >= 5 for c in combo):  # a carveout stays set: after all else
                later.append((mode, sets, nbytes, combo))
                continue
            us = _time_env([(sets[n], _env_of(c)) for n, c in zip(COMPRESSORS, combo)], REPEATS[mode])
            rows.append((mode, "all three", " | ".join(combo), us, nbytes / (us * 1e-6)))
    for mode, sets, nbytes, combo in later:
        us = _time_env([(sets[n], _env_of(c)) for n, c in zip(COMPRESSORS, combo)], REPEATS[mode])
        rows.append((mode, "all three", " | ".join(combo), us, nbytes / (us * 1e-6)))
    print(f"\ncompressor sweep on {torch.cuda.get_device_name()}, kv_dtype fp8, copy {copy_bandwidth / 1e9:.0f} GB/s")
    print(f"{'mode':<13} {'compressor':<12} {'config':<36} {'us':>8} {'of copy':>7}")
    for mode, name, cfg, us, bw in rows:
        frac = f"{bw / copy_bandwidth:7.0%}" if bw else ""
        print(f"{mode:<13} {name:<12} {cfg:<36} {us:8.2f} {frac}")
    benchmark.extra_info.update(device=torch.cuda.get_device_name(),
                                sweep=[dict(mode=r[0], compressor=r[1], config=r[2], us=r[3]) for r in rows])
    benchmark.pedantic(lambda: torch.cuda.synchronize(), rounds=1)
