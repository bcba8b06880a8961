"""Weights: HF state dicts into a `Model` (validated), and random initialisation for demos and benchmarks."""
from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from .config import ModelConfig, seed_value

# HF state-dict entries that carry no weights of ours: rotary frequency buffers (recomputed from the
# config) and the MTP block (out of scope).
_IGNORED = re.compile(r"(^|\.)(rotary_emb\.|mtp\.)")


def hf_to_local(name: str) -> str:
    """HF parameter name -> dsv4rt parameter name (the trees match; only the `model.` prefix goes)."""
    return name[len("model."):] if name.startswith("model.") else name


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SOURCE_FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)  # what a state dict may hold


def check_dtype(dtype: torch.dtype) -> None:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (torch.float32, torch.bfloat16 or torch.float16), got "
                        f"{type(dtype).__name__} {dtype!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}")


def check_device(device) -> torch.device:
    """The device the weights go to, refused by name when it cannot hold them (None, meta, a CUDA device this
    process does not have) before anything is built or read."""
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError):
        raise ValueError(f"device must be a torch.device or a name such as 'cpu' or 'cuda:0', got {device!r}") from None
    if dev.type == "meta":
        raise ValueError("device 'meta' holds no weights: give the device the model is to run on")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(dev)!r}: no CUDA device is available to this torch ({torch.__version__})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(dev)!r}: this process has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def finite_flags(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each float tensor holds only finite values, for all of them with one host read: one aminmax a tensor
    (it propagates NaN and inf, and allocates nothing the size of the tensor); float32 holds every extreme exactly."""
    ends = [x.float() for t in tensors if t.numel() for x in torch.aminmax(t)]
    ok = iter(torch.stack(ends).isfinite().view(-1, 2).all(1).tolist() if ends else [])
    return [next(ok) if t.numel() else True for t in tensors]


def _build(cls, cfg: ModelConfig, dtype: torch.dtype, device) -> "torch.nn.Module":
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a dsv4rt.ModelConfig, got {type(cfg).__name__} (ModelConfig.from_hf reads an "
                        "HF config, a config.json path or a dict)")
    check_dtype(dtype)
    device = check_device(device)
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
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
    model = _build(cls, cfg, dtype, device)
    expected = model.state_dict()
    given, source = {}, {}
    for k, v in state_dict.items():
        if _IGNORED.search(k):
            continue
        local = hf_to_local(k)
        if local in source:  # "model.norm.weight" and "norm.weight": one would silently win
            raise ValueError(f"state dict tensors {source[local]} and {k} both fill {local}")
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"state dict entry {k} is a {type(v).__name__}, not a torch.Tensor")
        if v.is_meta:
            raise ValueError(f"state dict tensor {k} is on the meta device: it holds no values")
        given[local], source[local] = v, k
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
    for k, dst in expected.items():
        src = given[k]
        if dst.is_floating_point() and src.dtype not in _SOURCE_FLOATS:
            hint = (": an FP8/FP4 weight needs its block scale (Model.from_pretrained decodes an official checkpoint "
                    "folder)") if src.dtype.itemsize == 1 or not src.is_floating_point() else ""
            raise ValueError(f"state dict tensor {source[k]} has dtype {src.dtype}, expected float32, bfloat16, float16 "
                             f"or float64{hint}")
        if not dst.is_floating_point() and (src.is_floating_point() or src.is_complex() or src.dtype == torch.bool):
            raise ValueError(f"state dict tensor {source[k]} has dtype {src.dtype}, expected an integer dtype")
    with torch.no_grad():
        for k, dst in expected.items():
            dst.copy_(given[k].to(device=dst.device, dtype=dst.dtype))
        floats = [k for k, dst in expected.items() if dst.is_floating_point()]
        bad = [source[k] for k, good in zip(floats, finite_flags([expected[k] for k in floats])) if not good]
        if bad:  # a NaN, or a value past the target dtype's range
            raise ValueError(f"state dict tensor {bad[0]} holds non-finite values in {dtype} (NaN, or past the "
                             f"dtype's range)" + (f"; so do {len(bad) - 1} more" if len(bad) > 1 else ""))
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
