"""How fast a warp's load pattern streams expert weights (read only, no arithmetic worth the name), graph-replayed.

The small-batch MoE kernels read the gate and up rows ([2I, D] bf16 of an expert, D = 4096, I = 2048) of the chosen
experts once. Three read-only kernels over the same bytes of 7 experts (the batch-1 MoE), cycling through 9 sets of
experts so that nothing comes from L2:
  * mma: the mma path's layout (csrc/moe.cu, moe_up_mma_kernel): a CTA takes 8 gate and 8 up rows, its 4 warps
    split D, lane (g, c) loads row g at columns c * 8 + 32 k: each warp load is eight 64-byte pieces of eight rows;
  * rows: the same CTAs, each warp owning two gate and two up rows (the ROW instances, warp_rows_dot): each warp
    load is 512 contiguous bytes of one row;
  * flat: each CTA one contiguous 128 KB range (each warp load 512 contiguous bytes, 4 warps side by side).
Prints TB/s for each, with the copy bandwidth measured in the same run. The gap between the first two is why
one-token MoE calls run the row instances (docs/benchmarks.md).
Run: python -m pytest tests/bench/test_bench_read_patterns.py --benchmark-only -s
"""
from __future__ import annotations

import pytest
import torch

from graphtime import capture, median_seconds

D, I, EXPERTS, CHOSEN, SETS, REPEATS = 4096, 2048, 64, 7, 9, 10

_SRC = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cstdint>

__device__ __forceinline__ uint4 ld_nc(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// grid (I / 8, experts): CTA = 8 gate rows + the matching 8 up rows of one expert (rows of D bf16 elements)
__global__ void __launch_bounds__(128, 4) read_kernel(const int64_t* bases, int D, int I, int mode, float* out) {
  const uint16_t* gate = reinterpret_cast<const uint16_t*>(bases[blockIdx.y]) + int64_t(blockIdx.x) * 8 * D;
  const uint16_t* up = gate + int64_t(I) * D;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint32_t acc = 0;
  if (mode == 0) {  // mma layout
    const int g = lane >> 2, c = lane & 3, nk = D / 32;
    const uint16_t* rg = gate + int64_t(g) * D + c * 8;
    const uint16_t* ru = up + int64_t(g) * D + c * 8;
    for (int kb = warp * 8; kb < nk; kb += 32) {
      uint4 a[8], b[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        a[u] = ld_nc(rg + (kb + u) * 32);
        b[u] = ld_nc(ru + (kb + u) * 32);
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) acc ^= a[u].x ^ b[u].y ^ a[u].z ^ b[u].w;
    }
  } else if (mode == 1) {  // whole rows a warp
    for (int rr = 0; rr < 2; ++rr) {
      const uint16_t* rg = gate + int64_t(2 * warp + rr) * D + lane * 8;
      const uint16_t* ru = up + int64_t(2 * warp + rr) * D + lane * 8;
      for (int j0 = 0; j0 < D / 256; j0 += 8) {
        uint4 a[8], b[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          a[u] = ld_nc(rg + (j0 + u) * 256);
          b[u] = ld_nc(ru + (j0 + u) * 256);
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) acc ^= a[u].x ^ b[u].y ^ a[u].z ^ b[u].w;
      }
    }
  } else {  // flat: CTA x reads rows [16 x, 16 x + 16) of the expert's 2I gate and up rows as one 128 KB range
    const uint4* q = reinterpret_cast<const uint4*>(reinterpret_cast<const uint16_t*>(bases[blockIdx.y]) +
                                                    int64_t(blockIdx.x) * 16 * D);
    const int64_t n = int64_t(16) * D / 8;  // 16-byte words
    for (int64_t i = threadIdx.x; i < n; i += 128 * 8) {
      uint4 v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) v[u] = ld_nc(q + i + u * 128);
#pragma unroll
      for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
  }
  if (acc == 0x9e3779b9u) out[0] = 1.0f;  // keeps the loads; practically never true
}

void read_rows(torch::Tensor bases, int64_t D, int64_t I, int64_t mode, torch::Tensor out) {
  const dim3 grid(static_cast<unsigned>(I / 8), static_cast<unsigned>(bases.numel()));
  read_kernel<<<grid, 128, 0, at::cuda::getCurrentCUDAStream()>>>(bases.data_ptr<int64_t>(), int(D), int(I),
                                                                  int(mode), out.data_ptr<float>());
}
"""


@pytest.fixture(scope="module")
def probe():
    from torch.utils.cpp_extension import load_inline
    return load_inline("dsv4rt_read_patterns", "void read_rows(torch::Tensor, int64_t, int64_t, int64_t, torch::Tensor);",
                       cuda_sources=_SRC, functions=["read_rows"], extra_cuda_cflags=["-O3"], verbose=False)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["mma", "rows", "flat"])
def test_bench_read_pattern(benchmark, probe, copy_bandwidth, mode):
    w = torch.empty(EXPERTS, 3 * I * D, dtype=torch.bfloat16, device="cuda").normal_()  # gate, up, down an expert
    sets = [torch.tensor([w[(CHOSEN * k + j) % EXPERTS].data_ptr() for j in range(CHOSEN)], dtype=torch.int64,
                         device="cuda") for k in range(SETS)]
    out = torch.zeros(1, device="cuda")
    m = {"mma": 0, "rows": 1, "flat": 2}[mode]
    graph = capture(lambda r: probe.read_rows(sets[r % SETS], D, I, m, out), REPEATS, warmup=1)
    per_call = median_seconds(graph.replay, 10) / REPEATS
    nbytes = CHOSEN * 2 * I * D * 2
    print(f"\nread pattern {mode:5s}: {nbytes / per_call / 1e12:.2f} TB/s ({per_call * 1e6:.1f} us for {nbytes / 1e6:.0f} "
          f"MB) on {torch.cuda.get_device_name()}; copy {copy_bandwidth / 1e12:.2f} TB/s")
    benchmark.extra_info.update(device=torch.cuda.get_device_name(), mode=mode, TBps=nbytes / per_call / 1e12,
                                copy_TBps=copy_bandwidth / 1e12)
    benchmark.pedantic(lambda: (graph.replay(), torch.cuda.synchronize()), rounds=3, warmup_rounds=1)
