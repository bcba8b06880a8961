"""Checkpoint folders: official DeepSeek-V4 safetensors (FP8/FP4 weights, spec §11.2, §11.6) and HF-format ones.

A folder holds `config.json` (official inference keys or HF keys) and either `model.safetensors.index.json` with
its shards or a single `model.safetensors`. Every safetensors header is read and checked against the config
(names, shapes, dtypes, block scales, file sizes) before any weight is touched; the weights then stream one
tensor at a time from memory-mapped shards to the device, where they are decoded (dsv4rt/dequant.py) into the
model's dtype. Peak host memory stays near the largest tensor. The loaded values are checked (finite in the
model's dtype, no ue8m0 NaN scale, hash tables naming real experts) with one device read at the end.

Names: a checkpoint name is stripped of `model.` and renamed by the rules of transformers'
`conversion_mapping["deepseek_v4"]` (official -> HF), which leave HF names unchanged; so official checkpoints,
HF checkpoints and the half-renamed names HF's `save_pretrained` writes (`attn.norm`, `head.weight`, per-expert
`w1/w2/w3`) all land on the same parameters. Routed experts may come per expert (`experts.E.w1/w2/w3`, stacked
into `gate_up_proj = [w1; w3]` and `down_proj = w2`) or fused.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import struct
import sys
import time
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from . import dequant
from .config import CSA, HCA, SLIDING, ModelConfig
from .weights import finite_flags

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

_MAX_HEADER = 256 << 20  # a larger header length means a corrupt file, not a big model
_FLOAT = ("F32", "BF16", "F16")
_INT = ("I64", "I32")
_SCALE = ("F8_E8M0", "F32")  # ue8m0 scales; float32 powers of two decode the same way
_FP8 = "F8_E4M3"
_FP4_PACKED = ("I8", "U8")
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "U64": 8, "U32": 4, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}

# Entries that carry no weights of ours: the MTP block (out of scope) and HF's rotary frequency buffers.
_IGNORED = re.compile(r"^(mtp\.|.*\brotary_emb\.)")

# transformers `conversion_mapping["deepseek_v4"]`, in order, each applied once (official -> HF).
_RENAMES = [(re.compile(p), r) for p, r in [
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"),
    (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"),
    (r"^hc_head_base", "hc_head.hc_base"),
    (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"),
    (r"\.hc_attn_base", ".attn_hc.base"),
    (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"),
    (r"\.hc_ffn_base", ".ffn_hc.base"),
    (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]]
_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
_LAYER = re.compile(r"^layers\.(\d+)\.")

# local (HF, no `model.`) name -> official name, per block (after `layers.N.`) and at the top level
_OFFICIAL_TOP = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight", "norm.weight": "norm.weight",
                 "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
_OFFICIAL_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn", "attn_hc.base": "hc_attn_base", "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn", "ffn_hc.base": "hc_ffn_base", "ffn_hc.scale": "hc_ffn_scale",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
}
# Official FP8 (128x128 block) weights, spec §11.2; `wo_a` is FP8 in the released checkpoint as well.
FP8_WEIGHTS = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
               "attn.indexer.wq_b.weight", "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight",
               "ffn.shared_experts.w3.weight")
# Official float32 tensors (mHC, sinks, compressor position biases, router bias); other floats are bf16.
FP32_TENSORS = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
                "attn.attn_sink", "attn.compressor.ape", "attn.indexer.compressor.ape", "ffn.gate.bias")


class CheckpointError(ValueError):
    """A checkpoint folder that does not hold a loadable model; the message names the file and the tensor."""


# ---------------------------------------------------------------------------------------------------- names
def local_name(name: str) -> Optional[str]:
    """Checkpoint tensor name (official, HF or HF-saved) -> dsv4rt parameter name; None for ignored entries.

    Per-expert names keep their `experts.E.wK.weight` tail (see `expert_slot`).
    """
    if name.startswith("model."):
        name = name[len("model."):]
    if _IGNORED.match(name):
        return None
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name, count=1)
    return name


def official_name(local: str) -> str:
    """dsv4rt parameter name, or a routed expert's `layers.N.mlp.experts.E.wK.weight`, -> official name."""
    if local in _OFFICIAL_TOP:
        return _OFFICIAL_TOP[local]
    m = _LAYER.match(local)
    if m:
        rest = local[m.end():]
        if rest in _OFFICIAL_BLOCK:
            return m.group(0) + _OFFICIAL_BLOCK[rest]
        e = re.match(r"^mlp\.experts\.(\d+)\.(w[123])\.weight$", rest)
        if e:
            return f"{m.group(0)}ffn.experts.{e.group(1)}.{e.group(2)}.weight"
    raise KeyError(f"no official name for {local!r}")


def official_expert_names(layer: int, expert: int) -> tuple[str, str, str]:
    """Official names of one routed expert's w1 (gate), w2 (down), w3 (up)."""
    return tuple(f"layers.{layer}.ffn.experts.{expert}.{w}.weight" for w in ("w1", "w2", "w3"))


def expert_slot(local: str, cfg: ModelConfig) -> Optional[tuple[str, tuple]]:
    """`layers.N.mlp.experts.E.wK.weight` -> (stacked parameter, index into it); None for other names.

    w1 and w3 are the gate and up halves of `gate_up_proj [E, 2I, D]` (rows 0..I-1 and I..2I-1); w2 is
    `down_proj [E, D, I]`.
    """
    m = _EXPERT.match(local)
    if not m:
        return None
    prefix, e, w = m.group(1), int(m.group(2)), m.group(3)
    inter = cfg.moe_inter
    if w == "w2":
        return f"{prefix}.down_proj", (e,)
    return f"{prefix}.gate_up_proj", (e, slice(0, inter) if w == "w1" else slice(inter, 2 * inter))


# ---------------------------------------------------------------------------------------------------- headers
@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header describes it."""
    name: str
    file: str                # path of the file holding it
    dtype: str               # safetensors dtype string, e.g. "BF16", "F8_E4M3"
    shape: tuple[int, ...]
    offset: int              # start in the file's data section
    nbytes: int


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _entry(path: str, name: str, h, data_size: int) -> TensorInfo:
    """One header entry, checked on its own: a malformed one would crash the reader or read the wrong bytes."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: tensor {name}: malformed header entry, {why}: {h!r:.200}")

    if not isinstance(h, dict):
        raise bad("not an object")
    dtype, shape, offsets = h.get("dtype"), h.get("shape"), h.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad("dtype is not a string")
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        raise bad("shape is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(o) for o in offsets):
        raise bad("data_offsets is not a pair of non-negative integers")
    (start, end), shape = offsets, tuple(shape)
    if start > end:
        raise bad("data_offsets ends before it starts")
    if end > data_size:
        raise CheckpointError(f"{path}: tensor {name} needs bytes {start}..{end} of the data section, the file "
                              f"holds {data_size} (truncated file)")
    if dtype in _ITEMSIZE and end - start != math.prod(shape) * _ITEMSIZE[dtype]:
        raise CheckpointError(f"{path}: tensor {name} ({dtype} {list(shape)}) spans {end - start} bytes, "
                              f"expected {math.prod(shape) * _ITEMSIZE[dtype]}")
    return TensorInfo(name, path, dtype, shape, start, end - start)


def read_header(path: str) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, from its header only; checks every entry, and that the tensors' bytes
    are present and tile the data section as safetensors requires (no overlap, no gap, nothing after them)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            n = struct.unpack("<Q", head)[0]
            if n > min(size - 8, _MAX_HEADER):
                raise CheckpointError(f"{path}: truncated or corrupt safetensors file (header of {n} bytes, "
                                      f"file of {size})")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    out = {name: _entry(path, name, h, data_size) for name, h in header.items()}
    infos = sorted(out.values(), key=lambda i: (i.offset, i.nbytes, i.name))
    for prev, info in zip(infos, infos[1:]):  # sorted by start: an overlap shows between neighbours
        if info.offset < prev.offset + prev.nbytes:
            raise CheckpointError(f"{path}: tensor {info.name} (bytes {info.offset}..{info.offset + info.nbytes} of "
                                  f"the data section) overlaps tensor {prev.name} (bytes {prev.offset}.."
                                  f"{prev.offset + prev.nbytes})")
    pos, prev = 0, None
    for info in infos:
        if info.offset != pos:
            raise CheckpointError(f"{path}: tensor {info.name} starts at byte {info.offset} of the data section, "
                                  f"leaving bytes {pos}..{info.offset} unused (corrupt file: safetensors data is "
                                  f"contiguous)")
        pos, prev = info.offset + info.nbytes, info
    if pos != data_size:
        raise CheckpointError(f"{path}: {data_size - pos} bytes of the data section follow the last tensor"
                              + (f" {prev.name}" if prev else "") + " (corrupt file)")
    return out


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder's config and tensor directory (headers only)."""
    folder: str
    config: dict
    files: tuple[str, ...]           # tensor files, in index order
    listing: str                     # the file that lists the tensors (index, or the single file)
    tensors: dict[str, TensorInfo]   # every tensor, by checkpoint name

    @property
    def official(self) -> bool:
        return "embed.weight" in self.tensors

    def display_name(self, local: str) -> str:
        """How this checkpoint would name a parameter (for messages about missing tensors)."""
        if self.official:
            with contextlib.suppress(KeyError):
                return official_name(local)
        return local if local == "lm_head.weight" else "model." + local


def _read_json(path: str, what: str):
    """A JSON file of the folder; a missing, unreadable, non-UTF-8 or malformed one is a CheckpointError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: unreadable {what}, not UTF-8 text (byte {e.start}: {e.reason})") from None
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: unreadable {what} ({e})") from None


def _folder(path: str | os.PathLike) -> str:
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder}: not a checkpoint folder")
    return folder


def _read_config(folder: str) -> dict:
    """The folder's config.json, which must hold a JSON object (`ModelConfig.from_hf` reads a string as a path)."""
    path = os.path.join(folder, CONFIG_FILE)
    config = _read_json(path, "config")
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(config).__name__}, not an object of config keys")
    return config


def scan(path: str | os.PathLike) -> Checkpoint:
    """Read the config, the index and every shard header of a checkpoint folder; no weights are read."""
    folder = _folder(path)
    return _scan_tensors(folder, _read_config(folder))


def _scan_tensors(folder: str, config: dict) -> Checkpoint:
    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.exists(index_path):
        return _scan_index(folder, config, index_path)
    single = os.path.join(folder, SINGLE_FILE)
    if not os.path.exists(single):
        raise CheckpointError(f"{folder}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
    return Checkpoint(folder, config, (single,), single, read_header(single))


def _plain_file_name(name) -> bool:
    """A shard named by the index must be a file of the folder itself, not a path leading out of it."""
    return (isinstance(name, str) and name not in ("", ".", "..") and os.path.basename(name) == name
            and not (os.altsep and os.altsep in name))


def _scan_index(folder: str, config: dict, index_path: str) -> Checkpoint:
    index = _read_json(index_path, "index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path}: unreadable index (needs a 'weight_map' object)")
    by_file: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        if not _plain_file_name(fname):
            raise CheckpointError(f"{index_path}: tensor {name} is mapped to {fname!r}, not the name of a file in "
                                  f"the checkpoint folder")
        by_file.setdefault(fname, []).append(name)
    files, tensors = [], {}
    for fname in sorted(by_file):
        path = os.path.join(folder, fname)
        listed = by_file[fname]
        if not os.path.exists(path):
            raise CheckpointError(f"{path}: shard missing ({INDEX_FILE} lists {len(listed)} tensor(s) in it, "
                                  f"e.g. {listed[0]})")
        header = read_header(path)
        absent = [n for n in listed if n not in header]
        if absent:
            raise CheckpointError(f"{path}: tensor {absent[0]} is listed in {INDEX_FILE} but not in the file"
                                  + (f" ({len(absent) - 1} more)" if len(absent) > 1 else ""))
        unlisted = sorted(set(header) - set(listed))
        if unlisted:
            raise CheckpointError(f"{path}: tensor {unlisted[0]} is in the file but {INDEX_FILE} does not list it "
                                  f"there")
        files.append(path)
        tensors.update(header)
    return Checkpoint(folder, config, tuple(files), index_path, tensors)


# ---------------------------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class _Source:
    """One checkpoint tensor (and its block scale) and where it goes."""
    info: TensorInfo
    scale: Optional[TensorInfo]
    target: str            # dsv4rt parameter / buffer name
    index: tuple           # index into the target (a routed expert's slice), () for the whole tensor
    layer: Optional[int]   # block index, None for embed / head / norms


def _expected(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    from .model import Model

    with torch.device("meta"):
        return Model(cfg, torch.bfloat16).state_dict()


def _check_format(src: _Source, want: tuple[int, ...], is_float: bool) -> Optional[str]:
    """None if the tensor's dtype, shape and scale fit a target of shape `want`; else what is wrong."""
    info, scale = src.info, src.scale
    got = f"{info.dtype} {list(info.shape)}"
    if not is_float:
        if info.dtype not in _INT or scale is not None:
            return f"is {got}, expected an integer tensor (I64 or I32) {list(want)}"
        return None if info.shape == want else f"has shape {list(info.shape)}, expected {list(want)} from config.json"
    if info.dtype in _FLOAT:
        if scale is not None:
            return f"is {got} but has a block scale {scale.name}; only FP8/FP4 weights carry scales"
        return None if info.shape == want else f"has shape {list(info.shape)}, expected {list(want)} from config.json"
    if info.dtype != _FP8 and info.dtype not in _FP4_PACKED:
        return f"is {got}, expected a float tensor (BF16, F32, F16) or an FP8/FP4 weight {list(want)}"
    if len(want) != 2:
        return f"is {got}: quantised weights must be 2-D, this parameter is {list(want)}"
    if scale is None:
        return f"is {got} without its block scale {info.name.rsplit('.', 1)[0]}.scale"
    out_f, in_f = want
    if info.dtype == _FP8:
        want_w, want_s = (out_f, in_f), (-(-out_f // dequant.FP8_BLOCK), -(-in_f // dequant.FP8_BLOCK))
    else:
        if in_f % dequant.FP4_BLOCK:
            return f"is packed FP4 but the input dim {in_f} is not a multiple of {dequant.FP4_BLOCK}"
        want_w, want_s = (out_f, in_f // 2), (out_f, in_f // dequant.FP4_BLOCK)
    if info.shape != want_w:
        return f"has shape {list(info.shape)}, expected {list(want_w)} ({info.dtype}) from config.json"
    if scale.dtype not in _SCALE:
        return f"has a scale {scale.name} of dtype {scale.dtype}, expected F8_E8M0"
    if scale.shape != want_s:
        return f"has a scale {scale.name} of shape {list(scale.shape)}, expected {list(want_s)}"
    return None


def plan(ckpt: Checkpoint, cfg: ModelConfig) -> list[_Source]:
    """Map every checkpoint tensor onto the parameters of `cfg`; raise CheckpointError on any mismatch."""
    expected = _expected(cfg)
    names = ckpt.tensors
    # a block scale is `X.scale` next to a quantised `X.weight` (mHC `attn_hc.scale` has no such sibling)
    scales = {n[: -len(".scale")] + ".weight": n for n in names
              if n.endswith(".scale") and n[: -len(".scale")] + ".weight" in names}
    scale_names = set(scales.values())
    sources, problems = [], []
    covered: dict[tuple, str] = {}
    n_experts = cfg.n_experts

    def problem(info: TensorInfo, what: str) -> None:
        problems.append(f"{info.file}: tensor {info.name} {what}")

    for name, info in names.items():
        if name in scale_names:
            continue
        local = local_name(name)
        if local is None:
            continue
        scale = names[scales[name]] if name in scales else None
        slot = expert_slot(local, cfg)
        target, index = slot if slot else (local, ())
        if target not in expected:
            problem(info, f"is not a parameter of this model (read as {local}; config.json has "
                          f"{cfg.num_layers} layers)")
            continue
        if slot and slot[1][0] >= n_experts:
            problem(info, f"is an expert outside the {n_experts} routed experts of config.json")
            continue
        tgt = expected[target]
        want = tuple(tgt[index].shape) if index else tuple(tgt.shape)
        layer = _LAYER.match(local)
        src = _Source(info, scale, target, index, int(layer.group(1)) if layer else None)
        duplicate = next((covered[u] for u in _units(target, index, cfg) if u in covered), None)
        if duplicate:
            problem(info, f"fills the same part of {target} as {duplicate}")
            continue
        covered.update((u, name) for u in _units(target, index, cfg))  # present, even if malformed
        bad = _check_format(src, want, tgt.is_floating_point())
        if bad:
            problem(info, bad)
            continue
        sources.append(src)
    for target in expected:
        for unit in _units(target, (), cfg):
            if unit not in covered:
                problems.append(f"{ckpt.listing}: tensor {_unit_name(ckpt, unit)} is missing (config.json expects "
                                f"it)")
    if problems:
        msg = problems[0]
        if len(problems) > 1:
            shown = "; ".join(problems[1:6]) + (" ..." if len(problems) > 6 else "")
            msg += f" (and {len(problems) - 1} more problem(s): {shown})"
        raise CheckpointError(msg)
    return sources


def _units(target: str, index: tuple, cfg: ModelConfig) -> Iterable[tuple]:
    """The pieces of a target that a checkpoint must fill exactly once (per-expert halves for stacked experts)."""
    if target.endswith(".experts.gate_up_proj"):
        experts = [index[0]] if index else range(cfg.n_experts)
        halves = ["w1" if index[1].start == 0 else "w3"] if index else ["w1", "w3"]
        return [(target, e, h) for e in experts for h in halves]
    if target.endswith(".experts.down_proj"):
        experts = [index[0]] if index else range(cfg.n_experts)
        return [(target, e, "w2") for e in experts]
    return [(target,)]


def _unit_name(ckpt: Checkpoint, unit: tuple) -> str:
    if len(unit) == 1:
        return ckpt.display_name(unit[0])
    target, e, w = unit
    layer = int(_LAYER.match(target).group(1))
    if ckpt.official:
        return official_expert_names(layer, e)[int(w[1]) - 1]
    return f"model.{target} (expert {e}, {w})"


# ---------------------------------------------------------------------------------------------------- config
def checkpoint_config(ckpt: Checkpoint) -> ModelConfig:
    """ModelConfig of a scanned checkpoint; config errors name config.json."""
    return _model_config(ckpt.folder, ckpt.config)


def _model_config(folder: str, config: dict) -> ModelConfig:
    path = os.path.join(folder, CONFIG_FILE)
    try:
        return ModelConfig.from_hf(config)
    except KeyError as e:
        raise CheckpointError(f"{path}: missing key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from None


def _layer_count(layers, n: int) -> int:
    if layers is None:
        return n
    if isinstance(layers, range):
        if layers.start != 0 or layers.step != 1 or len(layers) == 0:
            raise ValueError(f"layers must be range(k) (the first k blocks), got {layers}")
        layers = len(layers)
    if isinstance(layers, bool) or not isinstance(layers, int) or not 0 < layers <= n:  # True is not 1 block
        raise ValueError(f"layers must be an int or range in 1..{n} (the checkpoint has {n} blocks), got {layers!r}")
    return layers


def _scan_for(path: str | os.PathLike, layers) -> tuple[Checkpoint, ModelConfig, int]:
    """(checkpoint, its config, blocks to keep): config.json and `layers` are checked before any header is read."""
    folder = _folder(path)
    config = _read_config(folder)
    full = _model_config(folder, config)
    k = _layer_count(layers, full.num_layers)
    return _scan_tensors(folder, config), full, k


# ---------------------------------------------------------------------------------------------------- load
def load(cls, path: str | os.PathLike, layers=None, dtype: torch.dtype = torch.bfloat16,
         device: torch.device | str = "cpu", progress: bool = True):
    """Build `cls` (dsv4rt.Model) from a checkpoint folder; see `Model.from_pretrained`."""
    from safetensors import safe_open

    from .weights import _build, _refresh_buffers, check_dtype, check_loaded

    check_dtype(dtype)
    t0 = time.perf_counter()
    ckpt, full, k = _scan_for(path, layers)
    sources = plan(ckpt, full)
    cfg = full.truncated(k) if k < full.num_layers else full
    sources = [s for s in sources if s.layer is None or s.layer < k]
    model = _build(cls, cfg, dtype, device)
    params = model.state_dict()
    by_file: dict[str, list[_Source]] = {}
    for s in sources:
        by_file.setdefault(s.info.file, []).append(s)
    files = [f for f in ckpt.files if f in by_file]
    with contextlib.ExitStack() as stack, torch.no_grad():
        handles: dict[str, object] = {}

        def handle(file: str):
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
            return handles[file]

        def read(info: TensorInfo) -> torch.Tensor:
            try:
                return handle(info.file).get_tensor(info.name)
            except Exception as e:  # safetensors raises its own error types; report the file and tensor
                raise CheckpointError(f"{info.file}: tensor {info.name}: cannot read ({e})") from None

        def decode(s: _Source, device, dtype: torch.dtype) -> torch.Tensor:
            """The tensor as stored, or an FP8/FP4 weight decoded into `dtype`."""
            value = read(s.info).to(device)
            if s.scale is None:
                return value
            scale = read(s.scale).to(device)
            if value.dtype == torch.float8_e4m3fn:
                return dequant.dequant_fp8_block(value, scale, dtype)
            return dequant.dequant_fp4(value, scale, dtype)

        loaded = []  # sources in load order
        for i, file in enumerate(files):
            group = by_file[file]
            if progress:
                mb = sum(s.info.nbytes + (s.scale.nbytes if s.scale else 0) for s in group) / 2**20
                print(f"[{i + 1}/{len(files)}] {os.path.basename(file)}: {len(group)} tensors, {mb:.1f} MiB",
                      file=sys.stderr, flush=True)
            for s in sorted(group, key=lambda s: s.info.offset):  # sequential reads through the mapping
                dst = params[s.target]
                if s.index:
                    dst = dst[s.index]
                dst.copy_(decode(s, dst.device, dst.dtype))
                loaded.append(s)
        _check_values(params, loaded, cfg.n_experts, read, lambda s: decode(s, "cpu", torch.float32))
        _refresh_buffers(model)
    check_loaded(model)
    if progress:
        print(f"loaded {len(sources)} tensors ({cfg.num_layers} of {full.num_layers} blocks) in "
              f"{time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    return model.eval()


def _fine(t: torch.Tensor, n_experts: int) -> bool:
    """`t` holds only finite values (a float), or only expert ids in [0, n_experts) (a hash table)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(lo.isfinite() & hi.isfinite()) if t.is_floating_point() else bool((lo >= 0) & (hi < n_experts))


def _check_values(params: dict[str, torch.Tensor], loaded: list[_Source], n_experts: int, read, decode32) -> None:
    """Refuse loaded values the model cannot run on: NaN or inf (also from a ue8m0 NaN scale, byte 255, or a value
    past the range of the model's dtype), a hash table naming an expert that does not exist.

    Cheap on any device: the floats are read back at once (weights.finite_flags), the few hash tables one by one,
    so the load never waits on the device tensor by tensor; only a failure looks for the first bad checkpoint
    tensor."""
    floats = [p for p in params.values() if p.is_floating_point()]
    tables = [p for n, p in params.items() if n.endswith(".tid2eid")]
    if all(finite_flags(floats)) and all(_fine(p, n_experts) for p in tables):
        return
    bad = []
    for s in loaded:
        dst = params[s.target][s.index] if s.index else params[s.target]
        if dst.is_floating_point() or s.target.endswith(".tid2eid"):
            if not _fine(dst, n_experts):
                bad.append((s, dst))
    if not bad:  # every state-dict entry comes from the checkpoint, so one of them is bad; should that change:
        raise CheckpointError("the loaded model holds NaN, infinite or out-of-range values")
    s, dst = bad[0]
    info = s.info
    if not dst.is_floating_point():
        ids = dst[(dst < 0) | (dst >= n_experts)]
        msg = (f"{info.file}: tensor {info.name} names expert {ids[0].item()}, outside the {n_experts} routed "
               f"experts of config.json")
    elif s.scale is not None and s.scale.dtype == "F8_E8M0" and (read(s.scale).view(torch.uint8) == 255).any():
        msg = (f"{s.scale.file}: tensor {s.scale.name} holds the ue8m0 byte 255, which is NaN (block scale of "
               f"{info.name})")
    elif _fine(decode32(s).float(), n_experts):
        msg = (f"{info.file}: tensor {info.name} holds values past the range of {dst.dtype} (largest "
               f"{torch.finfo(dst.dtype).max:g}); load it in a wider dtype")
    else:
        msg = (f"{info.file}: tensor {info.name} holds NaN or infinite values"
               + (f" once decoded with its block scale {s.scale.name}" if s.scale else ""))
    raise CheckpointError(msg + (f" (and {len(bad) - 1} more tensor(s) with bad values)" if len(bad) > 1 else ""))


# ---------------------------------------------------------------------------------------------------- info
def describe(path: str | os.PathLike, layers=None) -> tuple[str, Optional[CheckpointError]]:
    """A report of a checkpoint folder from its config and headers only (config, schedule, tensor count, bytes by
    dtype), and the error that loading it would raise (None if it would load). `layers` is checked as
    `from_pretrained` checks it (ValueError); the report covers the whole folder."""
    ckpt, cfg, _ = _scan_for(path, layers)
    mtp = [n for n in ckpt.tensors if local_name(n) is None]
    by_dtype: dict[str, list[int]] = {}
    for info in ckpt.tensors.values():
        c = by_dtype.setdefault(info.dtype, [0, 0])
        c[0] += 1
        c[1] += info.nbytes
    sched = "".join({SLIDING: "S", CSA: "C", HCA: "H"}[t] for t in cfg.layer_types)
    quant = sorted({i.dtype for i in ckpt.tensors.values()} & {_FP8, *_FP4_PACKED})
    lines = [
        f"checkpoint {ckpt.folder}: {len(ckpt.files)} file(s), {'official' if ckpt.official else 'HF'} names"
        + (f", quantised weights ({', '.join(quant)})" if quant else ""),
        "config: " + ", ".join(f"{k}={v}" for k, v in cfg.to_dict().items() if k not in ("layer_types", "mlp_types")),
        f"schedule {sched} (S {sched.count('S')}, C {sched.count('C')}, H {sched.count('H')}); "
        f"hash MoE layers {cfg.mlp_types.count('hash')}",
        f"tensors: {len(ckpt.tensors)} ({len(mtp)} ignored: MTP / rotary buffers)",
        "bytes by dtype:",
    ]
    for dt, (count, nbytes) in sorted(by_dtype.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"  {dt:8s} {count:8d} tensors {nbytes:16,d} B")
    total = sum(c[1] for c in by_dtype.values())
    lines.append(f"  {'total':8s} {len(ckpt.tensors):8d} tensors {total:16,d} B ({total / 2**30:.2f} GiB)")
    error = None
    try:
        plan(ckpt, cfg)
        lines.append("check: every tensor matches config.json")
    except CheckpointError as e:
        error = e
        lines.append(f"check: FAILED: {e}")
    return "\n".join(lines), error
