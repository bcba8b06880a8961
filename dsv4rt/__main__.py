"""Command line: `python -m dsv4rt generate` (tiny random model by default, or `--checkpoint PATH`) and
`python -m dsv4rt info` (a preset, or `--checkpoint PATH` read from its headers only)."""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from .cache import cache_bytes_per_token
from .config import CSA, HCA, SLIDING, ModelConfig, seed_value

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _check_counts(args) -> None:
    """--layers / --experts, when given, are at least 1 (0 used to be taken as "not given")."""
    for opt in ("layers", "experts"):
        value = getattr(args, opt, None)
        if value is not None and value < 1:
            raise SystemExit(f"--{opt} must be at least 1, got {value}")


def _config(args) -> ModelConfig:
    cfg = {"tiny": ModelConfig.tiny, "flash": ModelConfig.flash, "pro": ModelConfig.pro}[args.preset]()
    if getattr(args, "experts", None) is not None:
        cfg = cfg.replace(n_experts=args.experts, n_active=min(cfg.n_active, args.experts))
    if getattr(args, "layers", None) is not None:
        try:
            cfg = cfg.truncated(args.layers)
        except ValueError as e:
            raise SystemExit(f"--layers: {e}") from None
    return cfg


def _parse_tokens(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise SystemExit(f"--prompt-ids takes integers separated by commas or spaces, got {text!r}") from None


def _tokenizer(checkpoint: str):
    """The folder's tokenizer.json through the `tokenizers` library (an optional dependency)."""
    path = os.path.join(checkpoint, "tokenizer.json")
    if not os.path.exists(path):
        raise SystemExit(f"--prompt needs {path}; pass token ids with --prompt-ids instead")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise SystemExit("--prompt needs the `tokenizers` package (pip install 'dsv4rt[tokenizer]')") from None
    return Tokenizer.from_file(path)


def cmd_generate(args) -> int:
    import dsv4rt

    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        raise SystemExit(f"--device: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device here")
    _check_counts(args)
    try:
        seed_value(args.seed)
    except ValueError as e:
        raise SystemExit(f"--seed: {e}") from None
    t0 = time.perf_counter()
    tok = None
    if args.checkpoint:
        dtype_name = args.dtype or "bfloat16"
        if args.prompt is not None:
            tok = _tokenizer(args.checkpoint)
        print(f"loading {args.checkpoint} ({args.layers or 'all'} layers, {dtype_name}) on {device} ...",
              file=sys.stderr, flush=True)
        try:
            model = dsv4rt.Model.from_pretrained(args.checkpoint, layers=args.layers, dtype=DTYPES[dtype_name],
                                                 device=device)
        except ValueError as e:  # a dsv4rt.CheckpointError, or an option the load refuses (--layers, --device)
            raise SystemExit(f"cannot load the checkpoint: {e}") from None
        cfg = model.cfg
    else:
        if args.prompt is not None:
            raise SystemExit("--prompt needs --checkpoint (a folder with tokenizer.json); use --prompt-ids")
        cfg, dtype_name = _config(args), args.dtype or "float32"
        print(f"building a random {args.preset} model ({cfg.num_layers} layers, {cfg.n_experts} experts, "
              f"{dtype_name}) on {device} ...", file=sys.stderr, flush=True)
        model = dsv4rt.Model.random(cfg, seed=args.seed, dtype=DTYPES[dtype_name], device=device)
    if tok is not None:
        prompt = tok.encode(args.prompt).ids
        if not prompt or prompt[0] != cfg.bos_token_id:  # DeepSeek prompts start with BOS
            prompt = [cfg.bos_token_id] + prompt
    else:
        prompt = _parse_tokens(args.prompt_ids)
    if args.max_new_tokens < 0:
        raise SystemExit(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if len(prompt) + args.max_new_tokens > cfg.max_position:
        raise SystemExit(f"--max-new-tokens {args.max_new_tokens}: the prompt's {len(prompt)} tokens plus the new "
                         f"ones exceed the model's max_position {cfg.max_position}")
    rt = dsv4rt.Runtime(model, max_requests=1, max_context=max(len(prompt) + args.max_new_tokens, 1),
                        kv_dtype=args.kv_dtype, compile=args.compile)
    print(f"ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    t1 = time.perf_counter()
    try:
        out = rt.generate([prompt], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed)[0]
    except dsv4rt.RequestError as e:  # a bad prompt or sampling argument, refused before the first step
        raise SystemExit(f"generate: {e}") from None
    dt = time.perf_counter() - t1
    if tok is not None:
        print(f"prompt: {args.prompt}")
        print(f"completion: {tok.decode(out)}")
    else:
        print(f"prompt: {prompt}")
    print(f"new tokens: {out}")
    print(f"{len(out)} tokens in {dt:.2f}s ({len(out) / dt:.1f} tokens/s, prefill included)")
    return 0


def cmd_info(args) -> int:
    _check_counts(args)
    if args.checkpoint:
        from .checkpoint import CheckpointError, describe

        try:
            report, error = describe(args.checkpoint, layers=args.layers)
        except CheckpointError as e:  # no config or unreadable headers: nothing to describe
            print(f"cannot read the checkpoint: {e}", file=sys.stderr)
            return 1
        except ValueError as e:  # --layers past the checkpoint's blocks, refused before a header is read
            raise SystemExit(f"--layers: {e}") from None
        print(report)
        return 1 if error else 0
    cfg = _config(args)
    import dsv4rt

    with torch.device("meta"):
        model = dsv4rt.Model(cfg, torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    per_token_active = total - experts + experts * cfg.n_active // cfg.n_experts
    sched = "".join({SLIDING: "S", CSA: "C", HCA: "H"}[t] for t in cfg.layer_types)
    print(f"preset {args.preset}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads x "
          f"{cfg.head_dim}, vocab {cfg.vocab_size}")
    print(f"schedule {sched} (S {sched.count('S')}, C {sched.count('C')}, H {sched.count('H')}); "
          f"hash MoE layers {cfg.mlp_types.count('hash')}")
    print(f"parameters: {total / 1e9:.2f} B total, {experts / 1e9:.2f} B in routed experts, "
          f"{per_token_active / 1e9:.2f} B active per token")
    for kv in ("fp8", "auto"):
        b = cache_bytes_per_token(cfg, kv)
        print(f"cache bytes, kv_dtype={kv} (bf16 activations):")
        print("  | layer type | per token per layer | constant per request per layer |")
        for t, name in ((SLIDING, "sliding"), (CSA, "CSA"), (HCA, "HCA")):
            print(f"  | {name:10s} | {b[t]['per_token']:19.2f} | {b[t]['per_request']:30d} |")
    return 0


def cmd_bench(args) -> int:
    from . import bench

    _check_counts(args)
    batches, long_contexts = _int_list(args.batches, "--batches"), _int_list(args.long_contexts, "--long-contexts")
    contexts, prefill = _int_list(args.contexts, "--contexts"), _int_list(args.prefill, "--prefill")
    if not (batches or long_contexts or prefill):
        raise SystemExit("bench: nothing to run (--batches, --long-contexts and --prefill are all empty)")
    if not torch.cuda.is_available():
        raise SystemExit("bench needs a CUDA device")
    import os

    import dsv4rt.ops
    if os.environ.get("DSV4RT_KERNELS", "native") != "reference":
        dsv4rt.ops.load_cuda_kernels()
    if batches or long_contexts:
        bench.run(args.preset, layers=args.layers, experts=args.experts, batches=batches,
                  contexts=contexts if batches else (), long_contexts=long_contexts,
                  kv_dtype=args.kv_dtype, dtype=DTYPES[args.dtype], hf=not args.no_hf, backend=args.backend,
                  profile=args.profile, max_context=args.max_context)
    if prefill:
        bench.run_prefill(args.preset, layers=args.layers, experts=args.experts, chunks=prefill,
                          kv_dtype=args.kv_dtype, dtype=DTYPES[args.dtype], backend=args.backend)
    return 0


def _int_list(text: str, option: str) -> tuple[int, ...]:
    """"1,8,32" -> (1, 8, 32); "" -> (); a bad or non-positive entry is refused by name."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = int(part)
        except ValueError:
            raise SystemExit(f"{option}: {part!r} is not an integer") from None
        if value < 1:
            raise SystemExit(f"{option}: {value} must be at least 1")
        out.append(value)
    return tuple(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv4rt", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    def model_opts(sp):
        sp.add_argument("--preset", choices=["tiny", "flash", "pro"], default="tiny")
        sp.add_argument("--layers", type=int, help="keep only the first N blocks")
        sp.add_argument("--experts", type=int, help="routed experts per layer (random-weight models only)")

    def checkpoint_opt(sp, what):
        sp.add_argument("--checkpoint", metavar="PATH", help=f"{what} a checkpoint folder (official DeepSeek-V4 "
                        "or HF format) instead of a preset")

    g = sub.add_parser("generate", help="generate tokens with a random-weight model or a checkpoint")
    model_opts(g)
    checkpoint_opt(g, "load")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", choices=sorted(DTYPES), help="float32 for random models, bfloat16 for checkpoints")
    g.add_argument("--kv-dtype", choices=["auto", "fp8", "fp8_sim"], default="auto")
    g.add_argument("--prompt-ids", default="0 17 42 7 99", help="prompt token ids")
    g.add_argument("--prompt", help="prompt text (needs --checkpoint with a tokenizer.json)")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--compile", action="store_true", help="run the step through torch.compile(fullgraph=True)")
    g.set_defaults(fn=cmd_generate)

    i = sub.add_parser("info", help="parameter counts and cache bytes of a preset, or a checkpoint's contents")
    model_opts(i)
    checkpoint_opt(i, "describe (headers only)")
    i.set_defaults(fn=cmd_info)

    b = sub.add_parser("bench", help="decode latency table (CUDA): ms/step vs the HBM floor and HF eager; with "
                                     "--prefill, prefill-call times")
    model_opts(b)
    b.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    b.add_argument("--kv-dtype", choices=["auto", "fp8", "fp8_sim"], default="fp8")
    b.add_argument("--batches", default="1,8,32")
    b.add_argument("--contexts", default="4096", help="contexts run at every batch size")
    b.add_argument("--long-contexts", default="65536,1048576", help="contexts run at batch 1 (fast-forwarded)")
    b.add_argument("--no-hf", action="store_true", help="skip the HF transformers eager baseline")
    b.add_argument("--backend", choices=["inductor", "aot_eager", "aot_eager_functional"], default="aot_eager",
                   help="torch.compile backend (aot_eager_functional: without writing the caches in place, for "
                        "comparison)")
    b.add_argument("--profile", type=int, default=0, metavar="N",
                   help="print the N kernels taking the most device time in each timed step, then the step's "
                        "kernel time by group (each dsv4rt op family, GEMMs, plain torch ops, copies)")
    b.add_argument("--prefill", default="", metavar="N,M",
                   help="also time one request's prefill of N prompt tokens in one step, for each size given "
                        "(ms a call, tokens/s, weight TFLOP/s); empty --batches and --long-contexts run only this")
    b.add_argument("--max-context", type=int, default=0, metavar="N",
                   help="the runtime's max_context (block-table width) for every context run; default: the context "
                        "+ 64. The block pool still holds only what the requests use")
    b.set_defaults(fn=cmd_bench)

    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
