"""dsv4rt custom ops (namespace `dsv4rt`). Import this package as `dsv4rt.ops` only.

Each module is one op family: schema string, fake (meta) implementation, capture-safe reference
registered for every backend (CompositeExplicitAutograd), and the wrapper the model calls. Native
CUDA kernels live in `csrc/<family>.cu` and register for the CUDA key of the same ops when
`load_cuda_kernels()` builds the extension; `kernel_coverage()` says which ops have one.
"""
from __future__ import annotations

import functools
import pathlib

if __name__ != "dsv4rt.ops":  # a second import name would register every schema twice
    raise ImportError(f"import the op package as `dsv4rt.ops`, not `{__name__}`")

import torch

from . import attention, compressor, indexer, kv_quant, mhc, moe, rope, swa  # noqa: F401  (registers the ops)

OPS = (
    "swa_cache_write", "compressor_update", "indexer_topk", "sparse_attn",
    "kv_fp8_quantize", "kv_fp8_dequantize", "idx_fp4_quantize", "idx_fp4_dequantize",
    "moe_route", "moe_hash_route", "moe_experts", "hc_pre", "hc_post", "hc_head",
)

CSRC = pathlib.Path(__file__).resolve().parent.parent / "csrc"


@functools.cache
def load_cuda_kernels(verbose: bool = False) -> list[str]:
    """Build (ninja, cached) and load csrc/*.cu (kernels, no torch headers) and csrc/*.cpp (their torch bindings,
    which register the CUDA kernels). Returns the sources loaded."""
    sources = sorted(str(p) for p in (*CSRC.glob("*.cu"), *CSRC.glob("*.cpp")))
    if not sources:
        return []
    if not torch.cuda.is_available():
        raise RuntimeError("load_cuda_kernels: no CUDA device")
    from torch.utils import cpp_extension

    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}" + ("a" if major >= 9 else "")  # sm_90a, sm_100a: as csrc/check_compile.sh
    build_dir = CSRC.parent / ".build" / "dsv4rt_cuda"
    build_dir.mkdir(parents=True, exist_ok=True)
    # No --use_fast_math: the kernels must round exactly as the references (IEEE division, log2f/exp2f/cosf/sinf,
    # no flush of denormals); csrc/check_compile.sh builds with the same flags.
    cpp_extension.load(name="dsv4rt_cuda", sources=sources, build_directory=str(build_dir), is_python_module=False,
                       extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}"],
                       extra_cflags=["-O3"], verbose=verbose)
    return sources


def kernel_coverage() -> dict[str, str]:
    """Per op: "native" when a CUDA kernel is registered for it, else "reference"."""
    return {
        op: "native" if torch._C._dispatch_has_kernel_for_dispatch_key(f"dsv4rt::{op}", "CUDA") else "reference"
        for op in OPS
    }
