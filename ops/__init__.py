"""dsv4rt custom ops (namespace `dsv4rt`). Import this package as `dsv4rt.ops` only.

Each module is one op family: schema string, fake (meta) implementation, capture-safe reference
registered for every backend (CompositeExplicitAutograd), and the wrapper the model calls. Native
CUDA kernels live in `csrc/<family>.cu` (+ `csrc/<family>.cpp`, the binding) and register for the CUDA key of
the same ops when `load_cuda_kernels()` builds that family's extension; `kernel_coverage()` says which ops have one.
"""
from __future__ import annotations

import functools
import os
import pathlib

if __name__ != "dsv4rt.ops":  # a second import name would register every schema twice
    raise ImportError(f"import the op package as `dsv4rt.ops`, not `{__name__}`")

import torch

from . import attention, compressor, indexer, kv_quant, mhc, moe, norm, rope, swa  # noqa: F401  (registers the ops)

# The ops the model's forward calls (what a "native" step needs) ...
STEP_OPS = (
    "swa_cache_write", "compressor_update", "compressor_update_pair", "indexer_topk", "sparse_attn",
    "moe_gate", "linear_fp32", "linear", "moe_route", "moe_hash_route", "moe_experts", "hc_pre", "hc_post",
    "hc_post_pre", "hc_head", "rms_norm", "rope_rotate", "head_norm_rope", "kv_norm_rope_quant",
    "idx_fp4_hadamard_fake_quant",
)
# ... and every op of the namespace: the standalone FP8/FP4 row codecs serve tests and tools (the cache-write
# kernels quantise inside their own launch).
OPS = STEP_OPS + ("kv_fp8_fake_quant", "kv_fp8_quantize", "kv_fp8_dequantize", "idx_fp4_quantize",
                  "idx_fp4_dequantize")

CSRC = pathlib.Path(__file__).resolve().parent.parent / "csrc"


def kernel_families() -> list[str]:
    """Op families with a native kernel: stems with both csrc/<stem>.cu (kernels) and csrc/<stem>.cpp (binding)."""
    return sorted(p.stem for p in CSRC.glob("*.cu") if p.with_suffix(".cpp").exists())


@functools.cache
def _load_family(stem: str, arch: str, verbose: bool) -> None:
    from torch.utils import cpp_extension

    build_dir = CSRC.parent / ".build" / f"dsv4rt_{stem}"
    build_dir.mkdir(parents=True, exist_ok=True)
    # No --use_fast_math: the kernels must round exactly as the references (IEEE division, log2f/exp2f/cosf/sinf,
    # no flush of denormals) wherever a result is compared bit for bit; an approximation is written out where it is
    # used and its tolerance is tested (the compressors' softmax pooling: exp_sub, __fdividef; csrc/compressor.cu).
    # csrc/check_compile.sh builds with the same flags. DSV4RT_NVCC_FLAGS adds flags (e.g.
    # -lineinfo, for Nsight Compute's source view). torch keys the build on its flags: a process that loads a family
    # without the flags an earlier one built it with rebuilds it without them.
    extra = os.environ.get("DSV4RT_NVCC_FLAGS", "").split()
    cpp_extension.load(name=f"dsv4rt_{stem}", sources=[str(CSRC / f"{stem}.cu"), str(CSRC / f"{stem}.cpp")],
                       build_directory=str(build_dir), is_python_module=False,
                       extra_cuda_cflags=["-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", *extra],
                       extra_cflags=["-O3"], verbose=verbose)


def load_cuda_kernels(verbose: bool = False, families: list[str] | None = None) -> list[str]:
    """Build (ninja, cached under .build/dsv4rt_<family>) and load one extension per op family: csrc/<family>.cu
    (kernels, no torch headers) plus csrc/<family>.cpp (its torch binding, which registers the CUDA kernels).

    `families` (default: the comma list in DSV4RT_KERNEL_FAMILIES, else every family) picks which to load, so a
    family can be benchmarked against its reference. Returns the families loaded. A family that fails to build
    raises; the families loaded before it stay registered."""
    if not CSRC.is_dir():  # a non-editable install copies the packages but not csrc/
        raise FileNotFoundError(f"load_cuda_kernels: no kernel sources at {CSRC}; install the package editable "
                                "(pip install -e .) from a checkout that has csrc/")
    if families is None:
        env = os.environ.get("DSV4RT_KERNEL_FAMILIES", "").strip()
        families = [f.strip() for f in env.split(",") if f.strip()] if env else kernel_families()
    unknown = sorted(set(families) - set(kernel_families()))
    if unknown:
        raise ValueError(f"load_cuda_kernels: no native kernel family {unknown}; have {kernel_families()}")
    if not families:
        return []
    if not torch.cuda.is_available():
        raise RuntimeError("load_cuda_kernels: no CUDA device")
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}" + ("a" if major >= 9 else "")  # sm_90a, sm_100a: as csrc/check_compile.sh
    for stem in families:
        _load_family(stem, arch, verbose)
    return list(families)


def kernel_coverage() -> dict[str, str]:
    """Per op: "native" when a CUDA kernel is registered for it, else "reference"."""
    return {
        op: "native" if torch._C._dispatch_has_kernel_for_dispatch_key(f"dsv4rt::{op}", "CUDA") else "reference"
        for op in OPS
    }
