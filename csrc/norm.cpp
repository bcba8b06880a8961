// Torch binding of the row-norm and rotation family: checks, then csrc/norm.cu on the current stream.
#include <cmath>
#include <string>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "binding.h"
#include "norm.h"

namespace {

using dsv4rt::num;

// "[a, b, ...]" (check messages stream no integers: csrc/binding.h)
std::string shape_str(at::IntArrayRef s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + num(s[i]);
  return r + "]";
}

int dtype_code(const char* op, at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: TORCH_CHECK(false, op, ": x must be float32, bfloat16 or float16, got ", c10::toString(t));
  }
}

void check_table(const char* op, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() >= 2 && x.is_contiguous(), op, ": x must be contiguous [T, ..., D]");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->is_contiguous(), op,
                ": cos and sin must be contiguous float32 [T, rope_dim / 2]");
    TORCH_CHECK(t->device() == x.device(), op, ": tensors on different devices");
  }
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == x.size(0), op, ": cos and sin must be [T, rope_dim / 2] "
              "with T = x.size(0) = ", num(x.size(0)), ", got ", shape_str(cos.sizes()), " and ",
              shape_str(sin.sizes()));
  TORCH_CHECK(2 * cos.size(1) <= x.size(-1), op, ": rope_dim ", num(2 * cos.size(1)), " exceeds the row width ",
              num(x.size(-1)));
}

void check_norm_weight(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.is_contiguous() &&
                  weight.size(0) == x.size(-1),
              op, ": weight must be contiguous float32 [D] with D = x.size(-1) = ", num(x.size(-1)), ", got ",
              c10::toString(weight.scalar_type()), " ", shape_str(weight.sizes()));
  TORCH_CHECK(weight.device() == x.device(), op, ": tensors on different devices");
}

at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int code = dtype_code("rms_norm", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), "rms_norm: x must be contiguous");
  check_norm_weight("rms_norm", x, weight);
  at::Tensor out = at::empty_like(x);
  const int64_t d = x.size(-1);
  if (x.numel() == 0) return out;
  const c10::cuda::CUDAGuard guard(x.device());
  dsv4rt::rms_norm_launch(x.data_ptr(), weight.data_ptr<float>(), out.data_ptr(), code, x.numel() / d, d,
                          static_cast<float>(eps), c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor rope_rows(const char* op, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool norm,
                     bool inverse, double eps) {
  const int code = dtype_code(op, x.scalar_type());
  check_table(op, x, cos, sin);
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return out;
  const int64_t tokens = x.size(0), d = x.size(-1);
  const c10::cuda::CUDAGuard guard(x.device());
  dsv4rt::rope_rows_launch(x.data_ptr(), cos.data_ptr<float>(), sin.data_ptr<float>(), out.data_ptr(), code, tokens,
                           x.numel() / (tokens * d), d, cos.size(1), norm, inverse, static_cast<float>(eps),
                           c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor rope_rotate_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool inverse) {
  return rope_rows("rope_rotate", x, cos, sin, false, inverse, 0.0);
}

at::Tensor head_norm_rope_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, double eps) {
  TORCH_CHECK(x.dim() == 3, "head_norm_rope: x must be [T, H, D], got ", shape_str(x.sizes()));
  return rope_rows("head_norm_rope", x, cos, sin, true, false, eps);
}

at::Tensor kv_norm_rope_quant_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos,
                                   const at::Tensor& sin, double eps, bool fp8) {
  const char* op = "kv_norm_rope_quant";
  const int code = dtype_code(op, x.scalar_type());
  TORCH_CHECK(x.dim() == 2, op, ": x must be [T, D], got ", shape_str(x.sizes()));
  check_table(op, x, cos, sin);
  check_norm_weight(op, x, weight);
  const int64_t tokens = x.size(0), d = x.size(1), half = cos.size(1), nope = d - 2 * half;
  TORCH_CHECK(!fp8 || (nope > 0 && nope % 64 == 0), op, ": with fp8, width - rope_dim must be a positive multiple "
              "of 64, got width ", num(d), " and rope_dim ", num(2 * half));
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return out;
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const float e = static_cast<float>(eps);
  const float* w = weight.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  if (dsv4rt::kv_norm_rope_quant_launch(x.data_ptr(), w, cs, sn, out.data_ptr(), code, tokens, d, half, fp8, e,
                                        stream)) {
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
  }
  // a shape the one-launch kernel does not take: the three ops' launches
  at::Tensor normed = at::empty_like(x);
  dsv4rt::rms_norm_launch(x.data_ptr(), w, normed.data_ptr(), code, tokens, d, e, stream);
  dsv4rt::rope_rows_launch(normed.data_ptr(), cs, sn, out.data_ptr(), code, tokens, 1, d, half, false, false, 0.0f,
                           stream);
  if (fp8) {
    dsv4rt::kv_fp8_fake_quant_launch(out.data_ptr(), normed.data_ptr(), code, tokens, d, 2 * half, stream);
    out = normed;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor kv_fp8_fake_quant_cuda(const at::Tensor& x, int64_t rope_dim) {
  const int code = dtype_code("kv_fp8_fake_quant", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), "kv_fp8_fake_quant: x must be contiguous");
  const int64_t d = x.size(-1), nope = d - rope_dim;
  TORCH_CHECK(rope_dim >= 0 && nope > 0 && nope % 64 == 0, "kv_fp8_fake_quant: width - rope_dim must be a positive "
              "multiple of 64, got width ", num(d), " and rope_dim ", num(rope_dim));
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return out;
  const c10::cuda::CUDAGuard guard(x.device());
  dsv4rt::kv_fp8_fake_quant_launch(x.data_ptr(), out.data_ptr(), code, x.numel() / d, d, rope_dim,
                                   c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor idx_fp4_hadamard_fake_quant_cuda(const at::Tensor& x) {
  const int code = dtype_code("idx_fp4_hadamard_fake_quant", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), "idx_fp4_hadamard_fake_quant: x must be contiguous");
  const int64_t d = x.size(-1);
  TORCH_CHECK(d == 32 || d == 64 || d == 128 || d == 256, "idx_fp4_hadamard_fake_quant: the row width must be 32, "
              "64, 128 or 256, got ", num(d));
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return out;
  const c10::cuda::CUDAGuard guard(x.device());
  dsv4rt::idx_fp4_hadamard_fake_quant_launch(x.data_ptr(), out.data_ptr(), code, x.numel() / d, d,
                                             static_cast<float>(std::pow(static_cast<double>(d), -0.5)),
                                             c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4rt, CUDA, m) {
  m.impl("rms_norm", &rms_norm_cuda);
  m.impl("rope_rotate", &rope_rotate_cuda);
  m.impl("head_norm_rope", &head_norm_rope_cuda);
  m.impl("kv_fp8_fake_quant", &kv_fp8_fake_quant_cuda);
  m.impl("kv_norm_rope_quant", &kv_norm_rope_quant_cuda);
  m.impl("idx_fp4_hadamard_fake_quant", &idx_fp4_hadamard_fake_quant_cuda);
}
