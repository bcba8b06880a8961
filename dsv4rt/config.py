"""Model configuration: presets of the published models, a tiny test model, and conversion from HF configs."""
from __future__ import annotations

import dataclasses
import json
import math
import operator
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

SLIDING, CSA, HCA = "sliding", "csa", "hca"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE, MOE = "hash", "moe"
MLP_TYPES = (HASH_MOE, MOE)
BLOCK_TOKENS = 128  # source tokens per cache block; every compression rate divides it
MAX_INDEX_TOPK = 32768  # the widest top-k the indexer kernel selects (csrc/indexer.cpp)

_HF_LAYER = {"sliding_attention": SLIDING, "compressed_sparse_attention": CSA, "heavily_compressed_attention": HCA}
_HF_MLP = {"hash_moe": HASH_MOE, "moe": MOE}


@dataclass(frozen=True, slots=True)
class Yarn:
    factor: float = 16.0
    original_max_position: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    csa_ratio: int
    hca_ratio: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    n_experts: int
    n_active: int
    n_shared: int
    moe_inter: int
    mlp_types: tuple[str, ...]
    routed_scale: float
    swiglu_limit: float
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: Optional[Yarn] = Yarn()
    hc_mult: int = 4
    hc_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    bos_token_id: int = 0
    eos_token_id: int = 1
    max_position: int = 1048576

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_types", tuple(self.mlp_types))
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "rope_dim", "q_lora_rank",
                     "o_groups", "o_lora_rank", "sliding_window", "csa_ratio", "hca_ratio", "index_heads",
                     "index_head_dim", "index_topk", "n_experts", "n_active", "moe_inter", "hc_mult", "hc_iters"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 < v < 1 << 31:
                raise ValueError(f"ModelConfig.{name} must be a positive int below 2**31, got {v!r}")
        for name in ("routed_scale", "swiglu_limit", "rope_theta", "compress_rope_theta", "hc_eps", "norm_eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive finite number, got {v!r}")
        for name in ("bos_token_id", "eos_token_id"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < self.vocab_size:
                raise ValueError(f"ModelConfig.{name} must be a token id in [0, vocab_size={self.vocab_size}), got {v!r}")
        if not isinstance(self.max_position, int) or isinstance(self.max_position, bool) \
                or not 0 < self.max_position < 1 << 31:
            raise ValueError(f"ModelConfig.max_position must be a positive int below 2**31, got {self.max_position!r}")
        if self.index_topk > MAX_INDEX_TOPK:
            raise ValueError(f"ModelConfig.index_topk must be <= {MAX_INDEX_TOPK} (the indexer kernel's output width), "
                             f"got {self.index_topk}")
        y = self.yarn
        if y is not None:
            if not isinstance(y, Yarn):
                raise ValueError(f"ModelConfig.yarn must be a Yarn or None, got {type(y).__name__}")
            if not (math.isfinite(y.factor) and y.factor > 0 and isinstance(y.original_max_position, int)
                    and y.original_max_position > 0 and math.isfinite(y.beta_fast) and math.isfinite(y.beta_slow)):
                raise ValueError(f"ModelConfig.yarn: factor and original_max_position must be positive, the betas "
                                 f"finite, got {y}")
        if self.rope_dim > self.head_dim or self.rope_dim % 2:
            raise ValueError(f"ModelConfig.rope_dim ({self.rope_dim}) must be even and <= head_dim ({self.head_dim})")
        if self.rope_dim > self.index_head_dim:
            raise ValueError(f"ModelConfig.rope_dim ({self.rope_dim}) must be <= index_head_dim ({self.index_head_dim})")
        if self.num_heads % self.o_groups:
            raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be divisible by o_groups ({self.o_groups})")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"ModelConfig.layer_types has {len(self.layer_types)} entries, num_layers is {self.num_layers}")
        if len(self.mlp_types) != self.num_layers:
            raise ValueError(f"ModelConfig.mlp_types has {len(self.mlp_types)} entries, num_layers is {self.num_layers}")
        for t in self.layer_types:
            if t not in LAYER_TYPES:
                raise ValueError(f"ModelConfig.layer_types: unknown layer type {t!r} (expected one of {LAYER_TYPES})")
        for t in self.mlp_types:
            if t not in MLP_TYPES:
                raise ValueError(f"ModelConfig.mlp_types: unknown mlp type {t!r} (expected one of {MLP_TYPES})")
        for name in ("csa_ratio", "hca_ratio"):
            if BLOCK_TOKENS % getattr(self, name):
                raise ValueError(f"ModelConfig.{name} ({getattr(self, name)}) must divide the block size {BLOCK_TOKENS}")
        if self.n_active > self.n_experts:
            raise ValueError(f"ModelConfig.n_active ({self.n_active}) must be <= n_experts ({self.n_experts})")
        if self.n_shared != 1:
            raise ValueError(f"ModelConfig.n_shared must be 1 (DSV4 has one shared expert), got {self.n_shared}")
        if self.index_head_dim & (self.index_head_dim - 1):
            raise ValueError(f"ModelConfig.index_head_dim ({self.index_head_dim}) must be a power of two (Hadamard)")

    # ------------------------------------------------------------------ presets
    @classmethod
    def flash(cls, **overrides: Any) -> "ModelConfig":
        n = 43
        types = [SLIDING, SLIDING] + [CSA if i % 2 == 0 else HCA for i in range(2, n)]
        base = dict(vocab_size=129280, hidden_size=4096, num_layers=n, num_heads=64, head_dim=512, rope_dim=64,
                    q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128, layer_types=tuple(types),
                    csa_ratio=4, hca_ratio=128, index_heads=64, index_head_dim=128, index_topk=512, n_experts=256,
                    n_active=6, n_shared=1, moe_inter=2048, mlp_types=tuple([HASH_MOE] * 3 + [MOE] * (n - 3)),
                    routed_scale=1.5, swiglu_limit=10.0)
        return _with_overrides(cls(**base), overrides)

    @classmethod
    def pro(cls, **overrides: Any) -> "ModelConfig":
        n = 61
        types = [HCA, HCA] + [CSA if i % 2 == 0 else HCA for i in range(2, n)]
        base = dict(vocab_size=129280, hidden_size=7168, num_layers=n, num_heads=128, head_dim=512, rope_dim=64,
                    q_lora_rank=1536, o_groups=16, o_lora_rank=1024, sliding_window=128, layer_types=tuple(types),
                    csa_ratio=4, hca_ratio=128, index_heads=64, index_head_dim=128, index_topk=1024, n_experts=384,
                    n_active=6, n_shared=1, moe_inter=3072, mlp_types=tuple([HASH_MOE] * 3 + [MOE] * (n - 3)),
                    routed_scale=2.5, swiglu_limit=10.0)
        return _with_overrides(cls(**base), overrides)

    @classmethod
    def tiny(cls, **overrides: Any) -> "ModelConfig":
        """Every layer type, a reduced HCA rate (16), >= 16 indexer heads; fp8-compatible dims (nope = 64)."""
        base = dict(vocab_size=512, hidden_size=128, num_layers=5, num_heads=4, head_dim=128, rope_dim=64,
                    q_lora_rank=64, o_groups=2, o_lora_rank=32, sliding_window=16,
                    layer_types=(SLIDING, CSA, HCA, CSA, HCA), csa_ratio=4, hca_ratio=16, index_heads=16,
                    index_head_dim=64, index_topk=4, n_experts=8, n_active=2, n_shared=1, moe_inter=64,
                    mlp_types=(HASH_MOE, HASH_MOE, MOE, MOE, MOE), routed_scale=1.5, swiglu_limit=10.0)
        return _with_overrides(cls(**base), overrides)

    def replace(self, **overrides: Any) -> "ModelConfig":
        return _with_overrides(self, overrides)

    def truncated(self, layers: int) -> "ModelConfig":
        """The first `layers` blocks of this model (for benchmarking a slice on one device)."""
        if not 0 < layers <= self.num_layers:
            raise ValueError(f"layers must be in 1..{self.num_layers}, got {layers}")
        return self.replace(num_layers=layers, layer_types=self.layer_types[:layers], mlp_types=self.mlp_types[:layers])

    # ------------------------------------------------------------------ HF / official configs
    @classmethod
    def from_hf(cls, x: Any) -> "ModelConfig":
        """From a transformers DeepseekV4Config, a dict (HF or official keys, or `ModelConfig.to_dict()`'s), or the
        path of an HF or official config.json."""
        if isinstance(x, (str, os.PathLike)):
            path = os.fspath(x)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                d = json.load(f)
        elif isinstance(x, dict):
            d = dict(x)
        elif hasattr(x, "to_dict") or hasattr(x, "__dict__"):
            d = x.to_dict() if hasattr(x, "to_dict") else dict(vars(x))
        else:
            raise TypeError(f"ModelConfig.from_hf takes a config object, a dict or a path, got {type(x).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        if "num_layers" in d and set(d) <= fields:  # ModelConfig.to_dict()
            if isinstance(d.get("yarn"), dict):
                d["yarn"] = Yarn(**d["yarn"])
            return cls(**d)
        try:
            return _from_dict(d)
        except (KeyError, TypeError, IndexError, AttributeError) as e:  # a field missing, or of the wrong shape
            what = f"field {e.args[0]!r} is missing" if isinstance(e, KeyError) else f"a field is missing or invalid ({e})"
            raise ValueError(f"ModelConfig.from_hf: {what}") from None

    # ------------------------------------------------------------------ derived
    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    def ratio(self, layer_type: str) -> int:
        return {CSA: self.csa_ratio, HCA: self.hca_ratio}[layer_type]

    def inv_freq(self, layer_type: str) -> torch.Tensor:
        """fp32 [rope_dim/2] RoPE frequencies: plain theta for sliding layers, YaRN'd compress theta otherwise."""
        rd = self.rope_dim
        if layer_type == SLIDING:
            return 1.0 / (self.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float) / rd))
        base = self.compress_rope_theta
        pos_freqs = base ** (torch.arange(0, rd, 2, dtype=torch.float) / rd)
        if self.yarn is None:
            return 1.0 / pos_freqs
        y = self.yarn

        def corr(n_rot: float) -> float:
            return rd * math.log(y.original_max_position / (n_rot * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = max(math.floor(corr(y.beta_fast)), 0), min(math.ceil(corr(y.beta_slow)), rd - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(rd // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        extra = 1 - ramp
        return (1.0 / (y.factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _with_overrides(cfg: ModelConfig, overrides: dict) -> ModelConfig:
    if not overrides:
        return cfg
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = set(overrides) - fields
    if unknown:
        raise ValueError(f"ModelConfig: unknown field(s) {sorted(unknown)}")
    return dataclasses.replace(cfg, **overrides)


_REQUIRED = (("vocab_size",), ("hidden_size", "dim"), ("num_hidden_layers", "n_layers"),
             ("num_attention_heads", "n_heads"), ("q_lora_rank",), ("o_groups",), ("o_lora_rank",),
             ("n_routed_experts",), ("num_experts_per_tok", "n_activated_experts"),
             ("moe_intermediate_size", "moe_inter_dim"))


def _from_dict(d: dict) -> ModelConfig:
    missing = [" or ".join(repr(k) for k in keys) for keys in _REQUIRED if all(d.get(k) is None for k in keys)]
    if missing:
        raise ValueError(f"ModelConfig.from_hf: missing field(s) {', '.join(missing)}")
    for key, kind in (("compress_rates", dict), ("rope_parameters", dict), ("rope_scaling", dict), ("layer_types", list),
                      ("mlp_layer_types", list), ("compress_ratios", list)):
        if d.get(key) is not None and not isinstance(d[key], kind):
            what = "an object" if kind is dict else "a list"
            raise ValueError(f"config: {key} must be {what}, got {type(d[key]).__name__} {d[key]!r}")
    official = "dim" in d and "n_layers" in d
    g = (lambda hf, off, default=None: d.get(off, d.get(hf, default))) if official else (
        lambda hf, off, default=None: d.get(hf, d.get(off, default)))

    def gi(hf: str, off: str, default=None) -> int:  # an integer field by its HF or official name
        return _whole(g(hf, off, default), hf)

    def gf(hf: str, off: str, default: float) -> float:  # a real field by its HF or official name
        return _real(g(hf, off, default), hf)

    for hf, off, want in (("scoring_func", "score_func", "sqrtsoftplus"), ("hidden_act", "hidden_act", "silu")):
        got = g(hf, off, want)
        if got != want:  # a model the forward does not implement: refused rather than run as DSV4's
            raise ValueError(f"ModelConfig.from_hf: {hf} {got!r} is not supported (DeepSeek-V4 uses {want!r})")

    n = gi("num_hidden_layers", "n_layers")
    csa_ratio, hca_ratio = 4, 128
    rates = d.get("compress_rates") or {}
    if rates:
        csa_ratio = _whole(rates.get("compressed_sparse_attention", 4), "compressed_sparse_attention")
        hca_ratio = _whole(rates.get("heavily_compressed_attention", 128), "heavily_compressed_attention")
    if d.get("layer_types"):
        try:
            types = [_HF_LAYER[t] for t in d["layer_types"][:n]]
        except KeyError as e:
            raise ValueError(f"ModelConfig.layer_types: unknown layer type {e.args[0]!r}") from None
    elif d.get("compress_ratios") is not None:
        ratios = [_whole(r, "compress_ratios") for r in d["compress_ratios"][:n]]
        types, hca_ratio = _types_from_ratios(ratios, csa_ratio, hca_ratio, "heavily_compressed_attention" in rates)
    else:  # transformers' default when a config names no schedule: HHH CHCH..., V4-Pro's shifted by one layer
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    if d.get("mlp_layer_types"):
        try:
            mlp = [_HF_MLP[t] for t in d["mlp_layer_types"][:n]]
        except KeyError as e:
            raise ValueError(f"ModelConfig.mlp_types: unknown mlp type {e.args[0]!r}") from None
    else:
        n_hash = gi("num_hash_layers", "n_hash_layers", 3)
        if n_hash < 0:
            raise ValueError(f"config: num_hash_layers must be >= 0, got {n_hash}")
        mlp = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)
    head_dim = gi("head_dim", "head_dim", 512)
    if "qk_rope_head_dim" in d:
        rope_dim = _whole(d["qk_rope_head_dim"], "qk_rope_head_dim")
    elif "rope_head_dim" in d:
        rope_dim = _whole(d["rope_head_dim"], "rope_head_dim")
    elif d.get("partial_rotary_factor"):
        rope_dim = _whole(head_dim * d["partial_rotary_factor"], "head_dim * partial_rotary_factor")
    else:
        rope_dim = _whole(head_dim / 8, "head_dim / 8 (the rope dims when none are given, as HF's default 0.125)")
    yarn = _yarn_from(d)
    rope_theta = _real(d.get("rope_theta", 10000.0), "rope_theta")
    rp = d.get("rope_parameters") or {}
    if isinstance(rp.get("main"), dict):
        if rp["main"].get("rope_type", "default") != "default":
            raise ValueError(f"ModelConfig.from_hf: rope_parameters.main rope_type {rp['main']['rope_type']!r} is not "
                             "supported (the sliding layers' RoPE is plain)")
        rope_theta = _real(rp["main"].get("rope_theta", rope_theta), "rope_parameters.main.rope_theta")
    compress_theta = _real(d.get("compress_rope_theta", 160000.0), "compress_rope_theta")
    if isinstance(rp.get("compress"), dict):
        compress_theta = _real(rp["compress"].get("rope_theta", compress_theta), "rope_parameters.compress.rope_theta")
    eos = d.get("eos_token_id", 1)
    return ModelConfig(
        vocab_size=gi("vocab_size", "vocab_size"), hidden_size=gi("hidden_size", "dim"), num_layers=n,
        num_heads=gi("num_attention_heads", "n_heads"), head_dim=head_dim, rope_dim=rope_dim,
        q_lora_rank=gi("q_lora_rank", "q_lora_rank"), o_groups=gi("o_groups", "o_groups"),
        o_lora_rank=gi("o_lora_rank", "o_lora_rank"),
        sliding_window=gi("sliding_window", "window_size", 128), layer_types=tuple(types),
        csa_ratio=csa_ratio, hca_ratio=hca_ratio, index_heads=gi("index_n_heads", "index_n_heads", 64),
        index_head_dim=gi("index_head_dim", "index_head_dim", 128), index_topk=gi("index_topk", "index_topk", 512),
        n_experts=gi("n_routed_experts", "n_routed_experts"),
        n_active=gi("num_experts_per_tok", "n_activated_experts"),
        n_shared=gi("n_shared_experts", "n_shared_experts", 1),
        moe_inter=gi("moe_intermediate_size", "moe_inter_dim"), mlp_types=tuple(mlp),
        routed_scale=gf("routed_scaling_factor", "route_scale", 1.5),  # HF's default (V4-Flash's)
        swiglu_limit=gf("swiglu_limit", "swiglu_limit", 10.0), rope_theta=rope_theta,
        compress_rope_theta=compress_theta, yarn=yarn, hc_mult=gi("hc_mult", "hc_mult", 4),
        hc_iters=gi("hc_sinkhorn_iters", "hc_sinkhorn_iters", 20), hc_eps=gf("hc_eps", "hc_eps", 1e-6),
        norm_eps=gf("rms_norm_eps", "norm_eps", 1e-6),
        bos_token_id=_whole(d.get("bos_token_id") or 0, "bos_token_id"),
        eos_token_id=_whole(eos[0] if isinstance(eos, list) else (1 if eos is None else eos), "eos_token_id"),
        max_position=gi("max_position_embeddings", "max_position_embeddings", 1048576),
    )


def _types_from_ratios(ratios: list[int], csa_ratio: int, hca_ratio: int, hca_given: bool) -> tuple[list[str], int]:
    """Layer types and HCA rate from per-layer `compress_ratios`, read as the official code does.

    0 is sliding window only, the CSA rate (4) is CSA (overlapping windows and an indexer), and any other
    positive rate is HCA at that rate; so reduced-rate test models need no extra key. All HCA layers share one
    rate, which must agree with `compress_rates` when both are given.
    """
    hca_rates = sorted({r for r in ratios if r not in (0, csa_ratio)})
    if any(r < 0 for r in hca_rates):
        raise ValueError(f"ModelConfig.layer_types: negative compress ratio {hca_rates[0]}")
    if len(hca_rates) > 1:
        raise ValueError(f"ModelConfig.hca_ratio: compress_ratios mixes HCA rates {hca_rates}; one rate is supported")
    if hca_rates:
        if hca_given and hca_rates[0] != hca_ratio:
            raise ValueError(f"ModelConfig.hca_ratio: compress_ratios says {hca_rates[0]}, compress_rates says "
                             f"{hca_ratio}")
        hca_ratio = hca_rates[0]
    types = [SLIDING if r == 0 else CSA if r == csa_ratio else HCA for r in ratios]
    return types, hca_ratio


def _yarn_from(d: dict) -> Optional[Yarn]:
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if isinstance(rp.get("compress"), dict):
        rp = rp["compress"]
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind == "yarn":
        return Yarn(_real(rp.get("factor", 16.0), "rope factor"),
                    _whole(rp.get("original_max_position_embeddings", 65536), "original_max_position_embeddings"),
                    _real(rp.get("beta_fast", 32), "beta_fast"), _real(rp.get("beta_slow", 1), "beta_slow"))
    if kind != "default":  # linear, dynamic, llama3, ...: a RoPE the forward does not compute
        raise ValueError(f"ModelConfig.from_hf: rope_type {kind!r} is not supported (DeepSeek-V4's compressed layers "
                         "use yarn, or plain RoPE)")
    if "rope_factor" in d and "original_seq_len" in d:  # official inference config
        return Yarn(_real(d["rope_factor"], "rope_factor"), _whole(d["original_seq_len"], "original_seq_len"),
                    _real(d.get("beta_fast", 32), "beta_fast"), _real(d.get("beta_slow", 1), "beta_slow"))
    return None


def _real(v, key: str) -> float:
    """A real-valued field of a config dict (an int or float, or a string holding one), else a ValueError naming
    the field; None is not a default (a key given as null)."""
    if not isinstance(v, bool):
        try:
            return float(v)
        except (TypeError, ValueError):
            pass
    raise ValueError(f"config: {key} must be a number, got {v!r}")


def _whole(v, key: str = "an integer field") -> int:
    """An integer field of a config dict: an int, or a float or string holding a whole number (4096.0, "4096"), else
    a ValueError naming the field (int() would truncate 512.9 to 512)."""
    if isinstance(v, bool):
        raise ValueError(f"config: {key} must be an integer, got {v!r}")
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            pass
    raise ValueError(f"config: {key} must be an integer, got {v!r}")


def as_int(value) -> int:
    """`value` as an int if it is one integer scalar: a Python or numpy integer or a 0-d integer tensor. A bool, and
    a tensor or array that holds one element in one or more dimensions (torch's __index__ takes `tensor([3])`),
    raise TypeError as any non-integer does."""
    if isinstance(value, bool) or getattr(value, "ndim", 0) != 0 or getattr(value, "dtype", None) == torch.bool:
        raise TypeError(f"not an integer scalar: {type(value).__name__}")
    return operator.index(value)


def int_arg(name: str, value, minimum: int) -> int:
    """An integer argument (as_int) of at least `minimum`, else a TypeError or ValueError that names it."""
    try:
        v = as_int(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def seed_value(seed) -> int:
    """A random seed a torch.Generator takes: any integer type (not bool) in [-2**63, 2**64), else a TypeError or
    ValueError that names it."""
    v = int_arg("seed", seed, -(1 << 63))
    if v >= 1 << 64:
        raise ValueError(f"seed must be in [-2**63, 2**64), got {v}")
    return v
