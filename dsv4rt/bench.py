"""Decode-step latency against the HBM floor and HF eager, and prefill-call time (`python -m dsv4rt bench`,
tests/bench/).

Numbers come from the device the command runs on, in one process: the copy bandwidth used for the
floor is measured in the same run, and the HF baseline runs the same weights on the same card.
"""
from __future__ import annotations

import functools
import math
import re
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch

from dsv4rt import ops
from dsv4rt.ops import kernel_coverage, moe

from .config import BLOCK_TOKENS, CSA, HCA, SLIDING, ModelConfig
from .model import Model
from .runtime import Runtime, greedy_tokens


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        b.copy_(a)
    end.record()
    end.synchronize()
    return 2 * nbytes * iters / (start.elapsed_time(end) / 1e3)


def _param_bytes(model: Model, include) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if include(n))


def step_bytes(model: Model, rt: Runtime, batch: int, context: int, distinct_experts: list[int]) -> int:
    """Bytes one decode step must touch: weights it reads (embedding rows, every dense weight, the shared
    experts, the routed experts the batch chose) and the cache rows its attention and indexer read."""
    cfg = model.cfg
    dense = _param_bytes(model, lambda n: ".experts." not in n and not n.startswith("embed_tokens"))
    emb = batch * cfg.hidden_size * model.embed_tokens.weight.element_size()
    per_expert = sum(p[0].numel() * p.element_size() for n, p in model.named_parameters()
                     if n.startswith("layers.0.mlp.experts."))
    routed = per_expert * sum(distinct_experts)
    cache = 0
    for lc in rt.cache.layers:
        row = lc.swa.shape[-1] * lc.swa.element_size()
        n_rows = min(context + 1, cfg.sliding_window)
        cache += batch * n_rows * row
        if lc.layer_type == CSA:
            n = (context + 1) // cfg.csa_ratio
            cache += batch * (min(cfg.index_topk, n) * row + n * lc.idx_entries.shape[-1] * lc.idx_entries.element_size())
        elif lc.layer_type == HCA:
            cache += batch * ((context + 1) // cfg.hca_ratio) * row
    return dense + emb + routed + cache


def _distinct_experts(rt: Runtime, bucket: int) -> list[int]:
    """Distinct routed experts per layer for the batch now in the step inputs (one eager forward)."""
    seen: list[int] = []
    real = moe.moe_experts
    n_live = int((rt.inputs.req_slot[:bucket] >= 0).sum())

    def spy(x, w13, w2, weights, ids, limit, *shared, **options):
        seen.append(int(ids[:n_live].unique().numel()))
        return real(x, w13, w2, weights, ids, limit, *shared, **options)

    moe.moe_experts = spy
    try:
        with torch.no_grad():
            rt._step(rt.inputs.args(bucket, min(bucket, rt.rows_cap)))
    finally:
        moe.moe_experts = real
    return seen


@dataclass
class Row:
    model: str
    batch: int
    context: int
    ms_step: float
    ms_layer: float
    floor_ms: float
    hf_ms: Optional[float]
    host_ms: float
    api_ms: Optional[float] = None
    greedy_ms: Optional[float] = None

    def markdown(self) -> str:
        hf = f"{self.hf_ms:.2f}" if self.hf_ms else "-"
        speed = f"{self.hf_ms / self.ms_step:.1f}x" if self.hf_ms else "-"
        api = f"{self.api_ms:.3f}" if self.api_ms else "-"
        greedy = f"{self.greedy_ms:.3f}" if self.greedy_ms else "-"
        return (f"| {self.model} | {self.batch} | {self.context} | {self.ms_step:.3f} | {self.ms_layer:.3f} | "
                f"{self.floor_ms:.3f} | {self.floor_ms / self.ms_step:.2f} | {hf} | {speed} | {self.host_ms:.3f} | "
                f"{api} | {greedy} |")


HEADER = ("| model | batch | context | ms/step | ms/layer | HBM floor ms | floor/measured | HF eager ms | "
          "speedup | host ms/step | step() ms | greedy step ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def time_decode(rt: Runtime, handles: list[int], iters: int = 20) -> tuple[float, float, int]:
    """(device ms per replayed decode step, host ms per step for prepare + copies + launch, bucket)."""
    batch = {h: [1] for h in handles}
    segs, new_blocks = rt._validate(batch)
    rt._allocate(segs, new_blocks)
    logits, _ = rt._launch(segs, all_logits=False)  # fills the inputs; positions stay fixed while timing
    torch.cuda.synchronize()
    host = 0.0
    for _ in range(iters):
        t0 = time.perf_counter()
        rt._launch(segs, all_logits=False)
        host += time.perf_counter() - t0
        torch.cuda.synchronize()
    key = min(k for k in rt.runner.graphs if k[0] >= len(handles) and not k[1])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        rt.runner.graphs[key].replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters, host * 1e3 / iters, key[0]


def time_step_api(rt: Runtime, handles: list[int], iters: int = 20, greedy: bool = False) -> float:
    """Wall ms of one `Runtime.step()` decode call as a caller makes it: validation, prepare, the replay and the
    logits' copy to the host; greedy=True: `step(on_device=True)` and the argmax of each request's row on the device,
    the token ids copied to the host (what `generate()` does at temperature 0). Each call advances the requests by one
    token (leave `iters` + 1 positions of room)."""
    batch = {h: [1] for h in handles}

    def call() -> None:
        out = rt.step(batch, on_device=greedy)
        if greedy:
            greedy_tokens(out)

    call()  # warm-up: the pinned host buffers of this size
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - t0) * 1e3 / iters


@functools.cache
def csrc_kernels() -> dict[str, str]:
    """Kernel name -> op family, from the `*_kernel` names in csrc/<family>.cu (empty without the sources)."""
    names: dict[str, str] = {}
    for path in sorted(ops.CSRC.glob("*.cu")):
        for name in re.findall(r"\b(\w+_kernel)\b", path.read_text()):
            names.setdefault(name, path.stem)
    return names


def kernel_group(name: str) -> str:
    """The group a profiled kernel belongs to: "dsv4rt <family>" for a csrc/ kernel, "GEMM (cuBLAS/CUTLASS)",
    "copy / memset", or "torch (plain ops)" for the elementwise, reduction and indexing kernels between the ops."""
    m = re.search(r"dsv4rt::(?:\(anonymous namespace\)::)?(\w+)", name)
    if m:
        return f"dsv4rt {csrc_kernels().get(m.group(1), 'other')}"
    low = name.lower()
    if any(s in low for s in ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas")):
        return "GEMM (cuBLAS/CUTLASS)"
    if "memcpy" in low or "memset" in low:
        return "copy / memset"
    return "torch (plain ops)"


def profile_replay(rt: Runtime, bucket: int, top: int = 20, iters: int = 3, out=sys.stderr) -> None:
    """Print the `top` kernels of one replayed decode step of `bucket` tokens by device time (torch.profiler over
    `iters` replays), with the number of kernels per step, then the step's kernel time by group (`kernel_group`)."""
    from torch.profiler import ProfilerActivity, profile

    graph = rt.runner.graphs[min(k for k in rt.runner.graphs if k[0] >= bucket and not k[1])]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            graph.replay()
        torch.cuda.synchronize()
    stats = prof.key_averages()
    kernels = sum(e.count for e in stats if e.device_time_total > 0) / iters
    print(f"profile of one replayed step (bucket {bucket}): {kernels:.0f} kernels", file=out)
    print(stats.table(sort_by="device_time_total", row_limit=top), file=out)
    groups: dict[str, list[float]] = {}
    for e in stats:
        if e.device_time_total > 0:
            g = groups.setdefault(kernel_group(e.key), [0.0, 0.0])
            g[0] += e.count / iters
            g[1] += e.device_time_total / iters
    print("kernel time a step by group (us, kernels; kernels that overlap under programmatic launches each count "
          "their whole span):", file=out)
    for name, (n, us) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name:<24} {us:9.1f} us {n:6.0f}", file=out)


def hf_decode_ms(model: Model, batch: int, context: int, iters: int = 5) -> Optional[float]:
    """HF transformers eager, same weights, same card: ms per decode step after a `context`-token prefill. None when
    transformers is missing or the HF model runs out of device memory (its eager prefill materialises the attention
    matrix: batch 8 at 4K needs more than an 80 GB card has left next to the runtime); the table then shows "-"."""
    try:
        from transformers import DynamicCache
    except ImportError:
        return None
    from .hf import hf_model_for

    cfg = model.cfg
    hf = past = None
    try:
        hf = hf_model_for(model)
        ids = torch.randint(0, cfg.vocab_size, (batch, context), device=model.device)
        with torch.no_grad():
            past = DynamicCache(config=hf.config)
            hf(input_ids=ids, past_key_values=past, use_cache=True)
            tok = ids[:, -1:]
            hf(input_ids=tok, past_key_values=past, use_cache=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                hf(input_ids=tok, past_key_values=past, use_cache=True)
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3 / iters
    except torch.OutOfMemoryError as e:
        print(f"HF eager baseline skipped at batch {batch}, context {context}: out of device memory "
              f"({str(e).splitlines()[0]})", file=sys.stderr, flush=True)
        return None
    finally:
        del hf, past
        torch.cuda.empty_cache()


def preset_config(preset: str, layers: Optional[int] = None, experts: Optional[int] = None) -> ModelConfig:
    """A preset's config, `experts` routed experts a layer and only the first `layers` blocks when given."""
    presets = {"tiny": ModelConfig.tiny, "flash": ModelConfig.flash, "pro": ModelConfig.pro}
    if preset not in presets:
        raise ValueError(f"preset must be one of {', '.join(presets)}, got {preset!r}")
    cfg = presets[preset]()
    if experts is not None:  # 0 is refused by the config, not read as "all"
        cfg = cfg.replace(n_experts=experts, n_active=min(cfg.n_active, experts))
    return cfg.truncated(layers) if layers is not None else cfg


def active_weight_params(model: Model) -> int:
    """Weights every token of a prefill multiplies: each parameter outside the routed experts, the embedding and the
    LM head (which runs on the logit rows only), plus n_active routed experts a layer (the shared expert is among
    the former)."""
    dense = sum(p.numel() for n, p in model.named_parameters()
                if ".experts." not in n and not n.startswith(("embed_tokens", "lm_head")))
    per_expert = sum(p[0].numel() for n, p in model.named_parameters() if n.startswith("layers.0.mlp.experts."))
    return dense + model.cfg.num_layers * model.cfg.n_active * per_expert


def time_prefill(rt: Runtime, tokens: int, iters: int = 3, seed: int = 0) -> float:
    """Milliseconds of one `rt.step` that prefills `tokens` prompt tokens into a fresh request, as its caller sees
    it (prepare, copies, the forward calls, the last position's logits back on the host): the median of `iters`
    calls after one untimed call. Each call admits a request and releases it afterwards."""
    if iters < 1:
        raise ValueError(f"time_prefill: iters must be at least 1, got {iters}")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, rt.cfg.vocab_size, (tokens,), generator=g).tolist()
    times = []
    for _ in range(iters + 1):
        handle = rt.admit()
        try:
            if rt.device.type == "cuda":
                torch.cuda.synchronize(rt.device)
            t0 = time.perf_counter()
            rt.step({handle: ids})  # returns host tensors: the step's own sync ends it
            times.append(time.perf_counter() - t0)
        finally:
            rt.release(handle)
    return statistics.median(times[1:]) * 1e3


PREFILL_HEADER = "| model | prefill tokens | ms/call | tokens/s | weight TFLOP/s |\n|---|---|---|---|---|"


def prefill_flops(model: Model, tokens: int) -> int:
    """The weights' matmul work of one prefill call: 2 x active_weight_params a token, and the LM head once (the
    last position's logits). Attention's scores are not counted."""
    return 2 * (active_weight_params(model) * tokens + model.lm_head.weight.numel())


def prefill_row(name: str, chunk: int, ms: float, flops: int) -> str:
    return f"| {name} | {chunk} | {ms:.2f} | {chunk / ms * 1e3:.0f} | {flops / ms / 1e9:.1f} |"


def run_prefill(preset: str = "tiny", layers: Optional[int] = None, experts: Optional[int] = None,
                chunks=(2048, 8192), kv_dtype: str = "fp8", dtype: torch.dtype = torch.bfloat16,
                backend: str = "aot_eager", iters: int = 3, device: str = "cuda",
                out=None) -> list[tuple[int, float]]:
    """Prefill table: for each chunk size, one request's prompt of that many tokens in one step (a runtime with
    max_tokens_per_step = the chunk, graph-replayed on CUDA). weight TFLOP/s = `prefill_flops` / time: the matmul
    work of the weights alone (attention's scores not counted). Returns [(chunk, ms)]."""
    cfg = preset_config(preset, layers, experts)
    out = out or sys.stdout
    model = Model.random(cfg, seed=0, dtype=dtype, device=device)
    name = f"{preset} L{cfg.num_layers} E{cfg.n_experts}"
    card = torch.cuda.get_device_name(device) if model.device.type == "cuda" else str(model.device)
    print(f"device {card}, torch {torch.__version__}, {dtype} weights, kv_dtype={kv_dtype}, "
          f"compile backend {backend}, prefill calls", file=out)
    rows: list[tuple[int, float]] = []
    for chunk in chunks:
        rt = Runtime(model, max_requests=1, max_context=chunk + 64, kv_dtype=kv_dtype, max_tokens_per_step=chunk,
                     backend=backend if model.device.type == "cuda" else None,  # the CPU runs the step eagerly
                     log=lambda m: print(m, file=sys.stderr, flush=True))
        ms = time_prefill(rt, chunk, iters=iters)
        rows.append((chunk, ms))
        print(prefill_row(name, chunk, ms, prefill_flops(model, chunk)), file=sys.stderr, flush=True)
        del rt
        if model.device.type == "cuda":
            torch.cuda.empty_cache()
    print(PREFILL_HEADER, file=out)
    for chunk, ms in rows:
        print(prefill_row(name, chunk, ms, prefill_flops(model, chunk)), file=out)
    return rows


def run(preset: str = "tiny", layers: Optional[int] = None, experts: Optional[int] = None,
        batches=(1, 8, 32), contexts=(4096,), long_contexts=(65536, 1048576), kv_dtype: str = "fp8",
        dtype: torch.dtype = torch.bfloat16, hf: bool = True, hf_max_batch: int = 8, backend: str = "aot_eager",
        profile: int = 0, max_context: int = 0, out=sys.stdout) -> list[Row]:
    """Decode latency table for one model. Long contexts run at batch 1 (fast-forwarded caches). `profile` > 0
    prints that many top kernels of each timed step (to stderr). `max_context` > 0 sizes every runtime's block table
    for that many tokens (as a server configured for long requests does) while its block pool holds only the
    requests' blocks; 0 sizes the table to each context."""
    cfg = preset_config(preset, layers, experts)
    device = torch.device("cuda")
    model = Model.random(cfg, seed=0, dtype=dtype, device=device)
    bw = copy_bandwidth(device)
    name = f"{preset} L{cfg.num_layers} E{cfg.n_experts}"
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s, "
          f"{dtype} weights, kv_dtype={kv_dtype}, compile backend {backend}"
          + (f", block tables for max_context={max_context}" if max_context else ""), file=out)
    cover = kernel_coverage()
    print("native kernels: " + (", ".join(k for k, v in cover.items() if v == "native") or "none") +
          "; reference ops: " + ", ".join(k for k, v in cover.items() if v == "reference"), file=out)
    rows: list[Row] = []
    plan = [(b, c) for c in contexts for b in batches] + [(1, c) for c in long_contexts]
    for context in sorted(set(c for _, c in plan)):
        bs = sorted(b for b, c in plan if c == context)
        context = min(context, cfg.max_position - 64)  # room for the timed decode steps
        if max_context and max_context < context + 64:
            raise ValueError(f"max_context {max_context} is below context {context} + 64 decode steps")
        wide = max_context or context + 64
        rt = Runtime(model, max_requests=max(bs), max_context=wide, kv_dtype=kv_dtype,
                     max_tokens_per_step=max(bs), backend=backend,
                     num_blocks=max(bs) * math.ceil((context + 64) / BLOCK_TOKENS) if max_context else None,
                     log=lambda m: print(m, file=sys.stderr, flush=True))
        cache_gib = sum(t.numel() * t.element_size() for t in rt.cache.buffers()) / 2**30
        alloc, reserved = torch.cuda.memory_allocated() / 2**30, torch.cuda.memory_reserved() / 2**30
        print(f"context {context}: caches {cache_gib:.2f} GiB, device memory after capture: allocated "
              f"{alloc:.2f} GiB, reserved {reserved:.2f} GiB", file=sys.stderr, flush=True)
        for b in bs:
            handles = [rt.admit_synthetic(context, seed=i) for i in range(b)]
            ms, host_ms, bucket = time_decode(rt, handles)
            api_ms = time_step_api(rt, handles)
            greedy_ms = time_step_api(rt, handles, greedy=True)
            distinct = _distinct_experts(rt, bucket)
            floor = step_bytes(model, rt, b, context, distinct) / bw * 1e3
            hf_ms = hf_decode_ms(model, b, context) if hf and b <= hf_max_batch and context <= 8192 else None
            row = Row(name, b, context, ms, ms / cfg.num_layers, floor, hf_ms, host_ms, api_ms, greedy_ms)
            rows.append(row)
            print(row.markdown(), file=sys.stderr, flush=True)
            if profile:
                profile_replay(rt, bucket, top=profile)
            for h in handles:
                rt.release(h)
        del rt
        torch.cuda.empty_cache()
    print(HEADER, file=out)
    for r in rows:
        print(r.markdown(), file=out)
    return rows
