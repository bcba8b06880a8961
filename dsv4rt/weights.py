"""Weights: HF state dicts into a `Model` (validated), and random initialisation for demos and benchmarks."""
from __future__ import annotations

import re

import torch

from .config import ModelConfig, seed_value

# HF state-dict entries that carry no weights of ours: rotary frequency buffers (recomputed from the
# config) and the MTP block (out of scope).
_IGNORED = re.compile(r"(^|\.)(rotary_emb\.|mtp\.)")


def hf_to_local(name: str) -> str:
    """HF parameter name -> dsv4rt parameter name (the trees match; only the `model.` prefix goes)."""
    return name[len("model."):] if name.startswith("model.") else name


def check_dtype(dtype: torch.dtype) -> None:
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")


def _build(cls, cfg: ModelConfig, dtype: torch.dtype, device) -> "torch.nn.Module":
    check_dtype(dtype)
    with torch.device("meta"):
        model = cls(cfg, dtype)
    return model.to_empty(device=device).requires_grad_(False)


def _refresh_buffers(model) -> None:
    cfg = model.cfg
    model.inv_freq_main.copy_(cfg.inv_freq("sliding"))
    model.inv_freq_compress.copy_(cfg.inv_freq("csa"))


def check_loaded(model) -> None:
    """Refuse loaded values the step would fail on halfway (after it has written other requests' caches): a hash
    layer's expert table (`tid2eid`) must name experts in [0, n_experts)."""
    n = model.cfg.n_experts
    for name, buf in model.named_buffers():
        if not name.endswith("tid2eid"):
            continue
        bad = buf[(buf < 0) | (buf >= n)]
        if bad.numel():
            raise ValueError(f"{name}: expert id {bad[0].item()} outside [0, n_experts={n})")


def load_hf_state_dict(cls, cfg: ModelConfig, state_dict: dict, dtype: torch.dtype, device) -> "torch.nn.Module":
    model = _build(cls, cfg, dtype, device)
    expected = model.state_dict()
    given = {hf_to_local(k): v for k, v in state_dict.items() if not _IGNORED.search(k)}
    missing = sorted(set(expected) - set(given))
    extra = sorted(set(given) - set(expected))
    bad_shape = sorted(f"{k}: expected {tuple(expected[k].shape)}, got {tuple(given[k].shape)}"
                       for k in set(expected) & set(given) if tuple(expected[k].shape) != tuple(given[k].shape))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
    if extra:
        problems.append(f"{len(extra)} unexpected tensor(s): {', '.join(extra[:8])}" + (" ..." if len(extra) > 8 else ""))
    if bad_shape:
        problems.append(f"{len(bad_shape)} mis-shaped tensor(s): {'; '.join(bad_shape[:8])}")
    if problems:
        raise ValueError("state dict does not match the config: " + " | ".join(problems))
    with torch.no_grad():
        for k, dst in expected.items():
            src = given[k]
            if src.is_floating_point() != dst.is_floating_point():
                raise ValueError(f"state dict tensor {k} has dtype {src.dtype}, expected a {dst.dtype}-compatible dtype")
            dst.copy_(src.to(device=dst.device, dtype=dst.dtype))
        _refresh_buffers(model)
    check_loaded(model)
    return model.eval()


def init_random(cls, cfg: ModelConfig, seed: int, dtype: torch.dtype, device) -> "torch.nn.Module":
    """Random weights with sane scales (fan-in scaled projections, unit norms, randomised sinks/biases/hash table)."""
    seed = seed_value(seed)  # before the build: a bad seed costs nothing
    model = _build(cls, cfg, dtype, device)
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def normal(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_((torch.randn(t.shape, generator=gen) * std + mean).to(t.dtype))

    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name:
                normal(p, 0.1, 1.0)
            elif leaf in ("sinks",):
                normal(p, 0.5)
            elif leaf in ("position_bias", "e_score_correction_bias", "base", "hc_base"):
                normal(p, 0.1)
            elif leaf in ("scale", "hc_scale"):
                normal(p, 0.1, 1.0)
            elif leaf in ("fn", "hc_fn"):
                normal(p, 0.02)
            elif name == "embed_tokens.weight":
                normal(p, 1.0)
            else:
                normal(p, p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                # distinct experts per token id: a random permutation prefix per row
                b.copy_(torch.rand(cfg.vocab_size, cfg.n_experts, generator=gen).argsort(-1)[:, : cfg.n_active])
        _refresh_buffers(model)
    return model.eval()
