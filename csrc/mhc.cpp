// Torch binding of the mHC family: checks, output allocation, then csrc/mhc.cu on the current stream.
#include <cstdint>
#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "binding.h"
#include "mhc.h"

namespace {

constexpr int64_t kMaxN = 8;

int dtype_code(const char* op, at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    default: TORCH_CHECK(false, op, ": x must be float32 or bfloat16, got ", c10::toString(t));
  }
}

// x [T, n, D]: contiguous, 1 <= n <= 8, D a multiple of 4, aligned for 4-element vector loads.
void check_streams(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor");
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous(), op, ": x must be a contiguous [T, n, D] tensor");
  TORCH_CHECK(x.size(1) >= 1 && x.size(1) <= kMaxN, op, ": n = x.size(1) must be in [1, 8], got ",
              dsv4rt::num(x.size(1)));
  TORCH_CHECK(x.size(2) % 4 == 0 && x.size(2) > 0, op, ": D = x.size(2) must be a positive multiple of 4, got ",
              dsv4rt::num(x.size(2)));
  TORCH_CHECK(x.size(1) * x.size(2) <= INT32_MAX, op, ": n * D too large");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % (4 * x.element_size()) == 0, op,
              ": x must be aligned to 4 elements");
}

void check_f32(const char* op, const at::Tensor& t, const char* name, const at::Device& dev, int64_t numel) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device() == dev, op, ": ", name,
              " must be a contiguous float32 tensor on ", dsv4rt::dev_str(dev));
  TORCH_CHECK(t.numel() == numel, op, ": ", name, " must have ", dsv4rt::num(numel), " elements, got ",
              dsv4rt::num(t.numel()));
}

void check_mix_params(const char* op, const at::Tensor& x, const at::Tensor& fn, const at::Tensor& base,
                      const at::Tensor& scale, int64_t rows, int64_t n_scale) {
  const at::Device dev = x.device();
  const int64_t k_dim = x.size(1) * x.size(2);
  check_f32(op, fn, "fn", dev, rows * k_dim);
  TORCH_CHECK(fn.dim() == 2 && fn.size(0) == rows && fn.size(1) == k_dim, op, ": fn must be [",
              dsv4rt::num(rows), ", n*D = ", dsv4rt::num(k_dim), "]");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(fn.data_ptr()) % 16 == 0, op, ": fn must be 16-byte aligned");
  check_f32(op, base, "base", dev, rows);
  check_f32(op, scale, "scale", dev, n_scale);
}

void launch_check(const char* op, cudaError_t err) {
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear it: the error is reported here
    TORCH_CHECK(false, op, ": launch failed: ", cudaGetErrorString(err));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

dsv4rt::HcMixArgs mix_args(const at::Tensor& x, const at::Tensor& fn, const at::Tensor& base,
                           const at::Tensor& scale, at::Tensor& out, bool head, double eps, double norm_eps,
                           const char* op) {
  dsv4rt::HcMixArgs a{};
  a.x = x.data_ptr();
  a.fn = fn.data_ptr<float>();
  a.base = base.data_ptr<float>();
  a.scale = scale.data_ptr<float>();
  a.out = out.data_ptr();
  a.n_tokens = x.size(0);
  a.n = static_cast<int>(x.size(1));
  a.d = static_cast<int>(x.size(2));
  a.dtype = dtype_code(op, x.scalar_type());
  a.head = head;
  a.eps = static_cast<float>(eps);
  a.norm_eps = static_cast<float>(norm_eps);
  return a;
}

// The optional output norm's weight: [D] fp32 on x's device, 16-byte aligned (float4 loads).
void check_out_norm(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& norm_weight) {
  if (!norm_weight.has_value()) return;
  const at::Tensor& w = *norm_weight;
  check_f32(op, w, "norm_weight", x.device(), x.size(2));
  TORCH_CHECK(w.dim() == 1, op, ": norm_weight must be [D = ", dsv4rt::num(x.size(2)), "]");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0, op, ": norm_weight must be 16-byte aligned");
}

void set_out_norm(dsv4rt::HcMixArgs& a, const std::optional<at::Tensor>& norm_weight, double out_eps) {
  if (!norm_weight.has_value()) return;
  a.norm_w = norm_weight->data_ptr<float>();
  a.out_eps = static_cast<float>(out_eps);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_pre_cuda(const at::Tensor& x, const at::Tensor& fn,
                                                            const at::Tensor& base, const at::Tensor& scale,
                                                            int64_t iters, double eps, double norm_eps,
                                                            const std::optional<at::Tensor>& norm_weight,
                                                            double out_eps) {
  constexpr const char* op = "hc_pre";
  check_streams(op, x);
  const int64_t n_tok = x.size(0), n = x.size(1), d = x.size(2);
  check_mix_params(op, x, fn, base, scale, (2 + n) * n, 3);
  TORCH_CHECK(iters <= INT32_MAX, op, ": iters too large");
  dtype_code(op, x.scalar_type());
  check_out_norm(op, x, norm_weight);
  at::Tensor out = at::empty({n_tok, d}, x.options());
  at::Tensor post = at::empty({n_tok, n}, x.options().dtype(at::kFloat));
  at::Tensor comb = at::empty({n_tok, n, n}, x.options().dtype(at::kFloat));
  if (n_tok == 0) return {out, post, comb};
  const c10::cuda::CUDAGuard guard(x.device());
  dsv4rt::HcMixArgs a = mix_args(x, fn, base, scale, out, false, eps, norm_eps, op);
  a.post = post.data_ptr<float>();
  a.comb = comb.data_ptr<float>();
  a.iters = static_cast<int>(iters);
  set_out_norm(a, norm_weight, out_eps);
  launch_check(op, dsv4rt::hc_mix_launch(a, c10::cuda::getCurrentCUDAStream()));
  return {out, post, comb};
}

at::Tensor hc_head_cuda(const at::Tensor& x, const at::Tensor& fn, const at::Tensor& base, const at::Tensor& scale,
                        double eps, double norm_eps, const std::optional<at::Tensor>& norm_weight, double out_eps) {
  constexpr const char* op = "hc_head";
  check_streams(op, x);
  const int64_t n_tok = x.size(0), d = x.size(2);
  check_mix_params(op, x, fn, base, scale, x.size(1), 1);
  dtype_code(op, x.scalar_type());
  check_out_norm(op, x, norm_weight);
  at::Tensor out = at::empty({n_tok, d}, x.options());
  if (n_tok == 0) return out;
  const c10::cuda::CUDAGuard guard(x.device());
  dsv4rt::HcMixArgs a = mix_args(x, fn, base, scale, out, true, eps, norm_eps, op);
  set_out_norm(a, norm_weight, out_eps);
  launch_check(op, dsv4rt::hc_mix_launch(a, c10::cuda::getCurrentCUDAStream()));
  return out;
}

// hc_post's inputs: x [T, n, D] (check_streams), y [T, D] of x's dtype, post [T, n] and comb [T, n, n] fp32.
void check_post_inputs(const char* op, const at::Tensor& x, const at::Tensor& y, const at::Tensor& post,
                       const at::Tensor& comb) {
  check_streams(op, x);
  const int64_t n_tok = x.size(0), n = x.size(1), d = x.size(2);
  const at::Device dev = x.device();
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && y.device() == dev && y.is_contiguous() && y.dim() == 2 &&
                  y.size(0) == n_tok && y.size(1) == d,
              op, ": y must be a contiguous [T, D] tensor of x's dtype and device");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(y.data_ptr()) % (4 * y.element_size()) == 0, op,
              ": y must be aligned to 4 elements");
  check_f32(op, post, "post", dev, n_tok * n);
  check_f32(op, comb, "comb", dev, n_tok * n * n);
  TORCH_CHECK(post.dim() == 2 && comb.dim() == 3, op, ": post must be [T, n], comb [T, n, n]");
  dtype_code(op, x.scalar_type());
}

at::Tensor hc_post_cuda(const at::Tensor& x, const at::Tensor& y, const at::Tensor& post, const at::Tensor& comb) {
  constexpr const char* op = "hc_post";
  check_post_inputs(op, x, y, post, comb);
  const int64_t n_tok = x.size(0), n = x.size(1), d = x.size(2);
  const at::Device dev = x.device();
  const int code = dtype_code(op, x.scalar_type());
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (n_tok == 0) return out;
  const c10::cuda::CUDAGuard guard(dev);
  dsv4rt::HcPostArgs a{};
  a.x = x.data_ptr();
  a.y = y.data_ptr();
  a.post = post.data_ptr<float>();
  a.comb = comb.data_ptr<float>();
  a.out = out.data_ptr();
  a.n_tokens = n_tok;
  a.n = static_cast<int>(n);
  a.d = static_cast<int>(d);
  a.dtype = code;
  launch_check(op, dsv4rt::hc_post_launch(a, c10::cuda::getCurrentCUDAStream()));
  return out;
}

// hc_post, then hc_pre on its output, in one launch sequence (csrc/mhc.cu: hc_post_pre_launch).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hc_post_pre_cuda(
    const at::Tensor& x, const at::Tensor& y, const at::Tensor& post, const at::Tensor& comb, const at::Tensor& fn,
    const at::Tensor& base, const at::Tensor& scale, int64_t iters, double eps, double norm_eps,
    const std::optional<at::Tensor>& norm_weight, double out_eps) {
  constexpr const char* op = "hc_post_pre";
  check_post_inputs(op, x, y, post, comb);
  const int64_t n_tok = x.size(0), n = x.size(1), d = x.size(2);
  check_mix_params(op, x, fn, base, scale, (2 + n) * n, 3);
  TORCH_CHECK(iters <= INT32_MAX, op, ": iters too large");
  check_out_norm(op, x, norm_weight);
  at::Tensor streams = at::empty(x.sizes(), x.options());  // never x itself: the launch reads x while it writes
  at::Tensor out = at::empty({n_tok, d}, x.options());
  at::Tensor post_out = at::empty({n_tok, n}, x.options().dtype(at::kFloat));
  at::Tensor comb_out = at::empty({n_tok, n, n}, x.options().dtype(at::kFloat));
  if (n_tok == 0) return {streams, out, post_out, comb_out};
  const c10::cuda::CUDAGuard guard(x.device());
  dsv4rt::HcMixArgs a = mix_args(streams, fn, base, scale, out, false, eps, norm_eps, op);
  a.post = post_out.data_ptr<float>();
  a.comb = comb_out.data_ptr<float>();
  a.iters = static_cast<int>(iters);
  a.post_x = x.data_ptr();
  a.post_y = y.data_ptr();
  a.post_post = post.data_ptr<float>();
  a.post_comb = comb.data_ptr<float>();
  set_out_norm(a, norm_weight, out_eps);
  launch_check(op, dsv4rt::hc_post_pre_launch(a, c10::cuda::getCurrentCUDAStream()));
  return {streams, out, post_out, comb_out};
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4rt, CUDA, m) {
  m.impl("hc_pre", &hc_pre_cuda);
  m.impl("hc_post", &hc_post_cuda);
  m.impl("hc_head", &hc_head_cuda);
  m.impl("hc_post_pre", &hc_post_pre_cuda);
}
