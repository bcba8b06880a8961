"""Command line: `python -m dsv4rt generate` (tiny random model by default) and `python -m dsv4rt info`."""
from __future__ import annotations

import argparse
import sys
import time

import torch

from .cache import cache_bytes_per_token
from .config import CSA, HCA, SLIDING, ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _config(args) -> ModelConfig:
    cfg = {"tiny": ModelConfig.tiny, "flash": ModelConfig.flash, "pro": ModelConfig.pro}[args.preset]()
    if getattr(args, "experts", None):
        cfg = cfg.replace(n_experts=args.experts, n_active=min(cfg.n_active, args.experts))
    if getattr(args, "layers", None):
        cfg = cfg.truncated(args.layers)
    return cfg


def _parse_tokens(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise SystemExit(f"--prompt-ids takes integers separated by commas or spaces, got {text!r}") from None


def cmd_generate(args) -> int:
    import dsv4rt

    cfg = _config(args)
    dtype = DTYPES[args.dtype]
    device = torch.device(args.device)
    t0 = time.perf_counter()
    print(f"building a random {args.preset} model ({cfg.num_layers} layers, {cfg.n_experts} experts, {args.dtype}) "
          f"on {device} ...", file=sys.stderr, flush=True)
    model = dsv4rt.Model.random(cfg, seed=args.seed, dtype=dtype, device=device)
    prompt = _parse_tokens(args.prompt_ids)
    rt = dsv4rt.Runtime(model, max_requests=1, max_context=max(len(prompt) + args.max_new_tokens, 1),
                        kv_dtype=args.kv_dtype, compile=args.compile)
    print(f"ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    t1 = time.perf_counter()
    out = rt.generate([prompt], max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                      top_p=args.top_p, seed=args.seed)[0]
    dt = time.perf_counter() - t1
    print(f"prompt: {prompt}")
    print(f"new tokens: {out}")
    print(f"{len(out)} tokens in {dt:.2f}s ({len(out) / dt:.1f} tokens/s, prefill included)")
    return 0


def cmd_info(args) -> int:
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv4rt", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    def model_opts(sp):
        sp.add_argument("--preset", choices=["tiny", "flash", "pro"], default="tiny")
        sp.add_argument("--layers", type=int, help="keep only the first N blocks")
        sp.add_argument("--experts", type=int, help="routed experts per layer (random-weight models only)")

    g = sub.add_parser("generate", help="generate tokens with a random-weight model")
    model_opts(g)
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    g.add_argument("--kv-dtype", choices=["auto", "fp8", "fp8_sim"], default="auto")
    g.add_argument("--prompt-ids", default="0 17 42 7 99", help="prompt token ids")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--compile", action="store_true", help="run the step through torch.compile(fullgraph=True)")
    g.set_defaults(fn=cmd_generate)

    i = sub.add_parser("info", help="parameter counts and cache bytes of a preset")
    model_opts(i)
    i.set_defaults(fn=cmd_info)

    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
