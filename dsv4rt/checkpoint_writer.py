"""Writers of checkpoint folders in the official DeepSeek-V4 layout, for tests and tools.

`save_official` quantises a model into the released format (spec §11.2, §11.6): official names, FP8 e4m3 with
128x128 ue8m0 block scales for the FP8-listed weights, routed experts as packed FP4 e2m1 with one ue8m0 scale per
32, bf16 / fp32 / int64 for the rest, sharded into N files with `model.safetensors.index.json` and an official
inference `config.json`.
"""
from __future__ import annotations

import bisect
import itertools
import json
import os
from typing import Literal, Optional

import torch
from torch import Tensor

from . import dequant
from .checkpoint import CONFIG_FILE, FP8_WEIGHTS, FP32_TENSORS, INDEX_FILE, local_name, official_name
from .config import CSA, HASH_MOE, HCA, SLIDING, ModelConfig

WO_A_FORMATS = ("fp8", "bf16")
EXPERT_FORMATS = ("fp4", "fp8")


def official_config(cfg: ModelConfig) -> dict:
    """`cfg` as an official inference config.json (`dim`, `n_layers`, `compress_ratios`, ...).

    `compress_ratios` holds each layer's own rate, which the official code reads as 0 = sliding, 4 = CSA,
    other = HCA; so a reduced HCA rate round-trips through `ModelConfig.from_hf`. A CSA rate other than 4 is
    recorded in HF's `compress_rates` as well.
    """
    if cfg.csa_ratio == cfg.hca_ratio:
        raise ValueError(f"CSA and HCA rates are both {cfg.csa_ratio}: compress_ratios could not tell them apart")
    n_hash = cfg.mlp_types.count(HASH_MOE)
    if cfg.mlp_types[:n_hash] != (HASH_MOE,) * n_hash:
        raise ValueError(f"hash-routed layers must come first (n_hash_layers), got {cfg.mlp_types}")
    rate = {SLIDING: 0, CSA: cfg.csa_ratio, HCA: cfg.hca_ratio}
    d = dict(
        vocab_size=cfg.vocab_size, dim=cfg.hidden_size, moe_inter_dim=cfg.moe_inter, n_layers=cfg.num_layers,
        n_hash_layers=n_hash, n_mtp_layers=0, n_heads=cfg.num_heads, n_routed_experts=cfg.n_experts,
        n_shared_experts=cfg.n_shared, n_activated_experts=cfg.n_active, score_func="sqrtsoftplus",
        route_scale=cfg.routed_scale, swiglu_limit=cfg.swiglu_limit, q_lora_rank=cfg.q_lora_rank,
        head_dim=cfg.head_dim, rope_head_dim=cfg.rope_dim, o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank,
        window_size=cfg.sliding_window, compress_ratios=[rate[t] for t in cfg.layer_types],
        compress_rope_theta=cfg.compress_rope_theta, rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps,
        index_n_heads=cfg.index_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_iters, hc_eps=cfg.hc_eps, bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id, max_position_embeddings=cfg.max_position, dtype="fp8", scale_fmt="ue8m0",
        expert_dtype="fp4",
    )
    if cfg.csa_ratio != 4:
        d["compress_rates"] = {"compressed_sparse_attention": cfg.csa_ratio,
                               "heavily_compressed_attention": cfg.hca_ratio}
    if cfg.yarn is not None:
        y = cfg.yarn
        d.update(rope_factor=y.factor, original_seq_len=y.original_max_position, beta_fast=y.beta_fast,
                 beta_slow=y.beta_slow)
    return d


def _local_state(source, cfg: Optional[ModelConfig]) -> tuple[ModelConfig, dict[str, Tensor]]:
    """(config, dsv4rt-named tensors) of an HF DeepseekV4ForCausalLM, a dsv4rt Model or an HF-named dict."""
    from .model import Model

    if isinstance(source, Model):
        cfg, sd = cfg or source.cfg, source.state_dict()
    elif isinstance(source, dict):
        if cfg is None:
            raise ValueError("a state dict needs its ModelConfig (cfg=...)")
        sd = source
    else:  # an HF model
        cfg, sd = cfg or ModelConfig.from_hf(source.config), source.state_dict()
    local = {}
    for k, v in sd.items():
        name = local_name(k)
        if name is not None:
            local[name] = v
    with torch.device("meta"):
        expected = Model(cfg, torch.bfloat16).state_dict()
    missing, extra = sorted(set(expected) - set(local)), sorted(set(local) - set(expected))
    if missing or extra:
        raise ValueError(f"state dict does not match the config: missing {missing[:8]}, unexpected {extra[:8]}")
    return cfg, {k: local[k] for k in expected}


def _check_formats(wo_a, experts) -> None:
    """Any other value would be written silently as the default format."""
    for arg, value, allowed in (("wo_a", wo_a, WO_A_FORMATS), ("experts", experts, EXPERT_FORMATS)):
        if not isinstance(value, str) or value not in allowed:
            raise ValueError(f"{arg} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def official_tensors(cfg: ModelConfig, state: dict[str, Tensor], wo_a: Literal["fp8", "bf16"] = "fp8",
                     experts: Literal["fp4", "fp8"] = "fp4") -> dict[str, Tensor]:
    """dsv4rt-named float tensors -> official names and formats, in checkpoint order (scale after its weight).

    `wo_a="bf16"` stores `attn.wo_a` dequantised (as the reference's converter does); `experts="fp8"` stores
    routed experts as FP8 with 128x128 scales (convert.py's lossless re-expression for hardware without FP4).
    """
    _check_formats(wo_a, experts)
    out: dict[str, Tensor] = {}

    def put(name: str, t: Tensor) -> None:
        leaf = name.split(".", 2)[-1] if name.startswith("layers.") else name
        if (leaf in FP8_WEIGHTS and not (leaf == "attn.wo_a.weight" and wo_a == "bf16")) or \
                (".ffn.experts." in name and experts == "fp8"):
            out[name], out[name[: -len(".weight")] + ".scale"] = dequant.quant_fp8_block(t)
        elif ".ffn.experts." in name:
            out[name], out[name[: -len(".weight")] + ".scale"] = dequant.quant_fp4(t)
        elif not t.is_floating_point():
            out[name] = t.to(torch.int64).contiguous()
        elif leaf in FP32_TENSORS or name.startswith("hc_head_"):
            out[name] = t.to(torch.float32).contiguous()
        else:
            out[name] = t.to(torch.bfloat16).contiguous()

    inter = cfg.moe_inter
    for local, t in state.items():
        t = t.detach().cpu()
        if local.endswith(".experts.gate_up_proj") or local.endswith(".experts.down_proj"):
            if local.endswith(".down_proj"):
                continue  # written with gate_up_proj, expert by expert
            layer = local.split(".")[1]
            down = state[local.replace("gate_up_proj", "down_proj")].detach().cpu()
            for e in range(cfg.n_experts):
                base = f"layers.{layer}.ffn.experts.{e}"
                put(f"{base}.w1.weight", t[e, :inter])
                put(f"{base}.w2.weight", down[e])
                put(f"{base}.w3.weight", t[e, inter:])
            continue
        put(official_name(local), t)
    return out


def write_shards(path: str | os.PathLike, tensors: dict[str, Tensor], shards: int,
                 metadata: Optional[dict] = None) -> list[str]:
    """Write `tensors` into `shards` safetensors files of about equal size plus `model.safetensors.index.json`.

    A block scale (`X.scale`) stays in the file of its weight `X.weight`. Returns the file names.
    """
    from safetensors.torch import save_file

    folder = os.fspath(path)
    groups: list[list[str]] = []
    for name in tensors:
        if name.endswith(".scale") and groups and groups[-1][0] == name[: -len(".scale")] + ".weight":
            groups[-1].append(name)
        else:
            groups.append([name])
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= len(groups):
        raise ValueError(f"shards must be an int in 1..{len(groups)}, got {shards!r}")
    os.makedirs(folder, exist_ok=True)
    sizes = [sum(tensors[n].numel() * tensors[n].element_size() for n in g) for g in groups]
    cum, total = list(itertools.accumulate(sizes)), sum(sizes)
    bounds = [0]
    for i in range(1, shards):
        # the first group past i/shards of the bytes, leaving at least one group for each later shard
        j = bisect.bisect_left(cum, total * i / shards) + 1
        bounds.append(min(max(j, bounds[-1] + 1), len(groups) - (shards - i)))
    bounds.append(len(groups))
    files, weight_map = [], {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        names = [n for g in groups[bounds[i]:bounds[i + 1]] for n in g]
        save_file({n: tensors[n] for n in names}, os.path.join(folder, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
        files.append(fname)
    index = {"metadata": {"total_size": total, **(metadata or {})}, "weight_map": weight_map}
    with open(os.path.join(folder, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)
    return files


def save_official(path: str | os.PathLike, source, cfg: Optional[ModelConfig] = None, shards: int = 3,
                  wo_a: Literal["fp8", "bf16"] = "fp8", experts: Literal["fp4", "fp8"] = "fp4") -> list[str]:
    """Quantise `source` into an official DeepSeek-V4 checkpoint folder at `path`; returns the shard names.

    `source`: an HF DeepseekV4ForCausalLM, a dsv4rt Model, or an HF-named state dict (then `cfg` is required).
    Everything is checked and encoded before the first file is written, so a refusal leaves a checkpoint already
    in `path` as it was.
    """
    _check_formats(wo_a, experts)
    cfg, state = _local_state(source, cfg)
    config = json.dumps(official_config(cfg), indent=2)
    files = write_shards(path, official_tensors(cfg, state, wo_a=wo_a, experts=experts), shards)
    with open(os.path.join(os.fspath(path), CONFIG_FILE), "w") as f:
        f.write(config)
    return files
