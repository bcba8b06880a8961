// Torch binding of the sliding-window ring write: checks, then csrc/swa.cu on the current stream.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "swa.h"

namespace {

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: TORCH_CHECK(false, "swa_cache_write: kv must be float32, bfloat16 or float16, got ", t);
  }
}

void swa_cache_write_cuda(const at::Tensor& kv, at::Tensor& swa_cache, const at::Tensor& req_slot,
                          const at::Tensor& positions, const at::Tensor& end_pos, int64_t rope_dim) {
  TORCH_CHECK(kv.dim() == 2 && swa_cache.dim() == 3, "swa_cache_write: kv [T, D] and swa_cache [S+1, W, R]");
  TORCH_CHECK(kv.is_contiguous() && swa_cache.is_contiguous(), "swa_cache_write: contiguous tensors required");
  for (const at::Tensor* idx : {&req_slot, &positions, &end_pos}) {
    TORCH_CHECK(idx->scalar_type() == at::kInt && idx->is_contiguous() && idx->numel() == kv.size(0),
                "swa_cache_write: req_slot, positions, end_pos must be contiguous int32 [T]");
    TORCH_CHECK(idx->device() == kv.device(), "swa_cache_write: tensors on different devices");
  }
  TORCH_CHECK(swa_cache.device() == kv.device(), "swa_cache_write: tensors on different devices");
  const int64_t width = kv.size(1);
  const bool fp8 = swa_cache.scalar_type() == at::kByte;
  if (fp8) {
    const int64_t nope = width - rope_dim;
    TORCH_CHECK(rope_dim >= 0 && nope > 0 && nope % 64 == 0, "swa_cache_write: fp8 rows need width - rope_dim a "
                "positive multiple of 64");
    TORCH_CHECK(swa_cache.size(2) == nope + 2 * rope_dim + (nope / 64 + 7) / 8 * 8,
                "swa_cache_write: fp8 row width mismatch");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(swa_cache.data_ptr()) % 2 == 0, "swa_cache_write: misaligned cache");
  } else {
    TORCH_CHECK(swa_cache.scalar_type() == kv.scalar_type() && swa_cache.size(2) == width,
                "swa_cache_write: cache rows must have kv's dtype and width");
  }
  if (kv.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(kv.device());
  dsv4rt::swa_cache_write_launch(kv.data_ptr(), dtype_code(kv.scalar_type()), swa_cache.data_ptr(), fp8,
                               req_slot.data_ptr<int32_t>(), positions.data_ptr<int32_t>(),
                               end_pos.data_ptr<int32_t>(), kv.size(0), width, rope_dim, swa_cache.size(0),
                               swa_cache.size(1), swa_cache.size(2), c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4rt, CUDA, m) { m.impl("swa_cache_write", &swa_cache_write_cuda); }
