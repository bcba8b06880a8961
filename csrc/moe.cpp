// Torch binding of the MoE family: checks, then csrc/moe.cu on the current stream. moe_gate runs its kernel for up to
// 8 tokens (x cast inside it) and a cuBLAS GEMM above that (bf16 x and weight: fp32 output of the bf16 inputs; else
// the reference's own call). moe_experts picks its path from shapes only:
// large batches (bf16, more than DSV4RT_MOE_GROUPED_MIN_PAIRS rows: by default 768 where the grouped kernel runs,
// 3072 elsewhere; the shared expert's T rows counted with the T * k pairs) run the projections as grouped GEMMs
// between the plan and combine kernels: on sm_90 the grouped kernel of csrc/moe.cu (moe_gmm_kernel: TMA, wgmma, the
// activation in its epilogue; DSV4RT_MOE_GMM=0 turns it off), else at::_grouped_mm and the activation kernel
// (offsets computed on the device); the shared expert as plain GEMMs on its separate weights; the rest
// run the plan, expert GEMV and combine kernels, the shared expert one more slot of the GEMVs; tiny batches (opt-in,
// see kTinyTokens: T <= 8 tokens, T * k <= 64 pairs; bf16/fp16, D and I multiples of 32) can run two expert kernels
// that plan and combine inside themselves instead. Knobs, read at each call (so at capture time for a CUDA graph):
// DSV4RT_MOE_PDL=0 turns off the programmatic dependent launches, DSV4RT_MOE_TINY=n sends batches of at most n
// tokens (n <= 8; 0: none) to the tiny path, DSV4RT_MOE_TINY_PREFETCH=0 turns off its L2 prefetch of the down
// projection's first expert, DSV4RT_MOE_EARLY=0 ignores x_ready (the shared expert then waits for the routing too),
// DSV4RT_MOE_DIRECT=0 runs the plan kernel for one-token calls too (moe.h, MoeExpertsArgs::direct), DSV4RT_MOE_KEEP=0
// turns off the L2 prefetch of the shared expert's down rows during the routing (MoeExpertsArgs::keep_shared),
// DSV4RT_MOE_ROWS=0 runs one-token calls on the mma instances of the GEMV kernels (csrc/moe.cu reads it).
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/_grouped_mm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "moe.h"
#include "binding.h"

namespace {

// Batches up to this many tokens take the tiny path (at most moe_tiny_max_tokens). 0: opt-in (DSV4RT_MOE_TINY=8)
// until its kernels are measured faster than the GEMV path.
constexpr int64_t kTinyTokens = 0;
constexpr int64_t kGroupedMinPairs = 3072;  // measured crossover with at::_grouped_mm (H200): ~3.6K pairs (512 tokens)
// with the grouped kernel (moe_gmm_kernel; H200, Flash dims, us a call): 128 tokens (896 rows) 2,580 against 2,828 on
// the GEMV path, 256 tokens 2,877 / 3,143 against 3,330 / 3,335; 64 tokens (448 rows) stay on the GEMV path
constexpr int64_t kGmmMinPairs = 768;
constexpr int64_t kMaxExperts = 4096;       // the plan keeps two ints per expert in shared memory
constexpr int64_t kMaxGroupedExperts = 1023;  // at::_grouped_mm takes fewer than 1024 groups
constexpr int64_t kMaxRouteExperts = 1024;  // 32 per lane of a router warp
constexpr int64_t kKeepMaxTokens = 8;       // MoeExpertsArgs::keep_shared up to this many tokens

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? std::atoll(v) : fallback;
}

bool use_pdl() { return env_int("DSV4RT_MOE_PDL", 1) != 0; }

void check_launch(cudaError_t err, const char* op) {
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear it: the error is reported here
    TORCH_CHECK(false, op, ": launch failed: ", cudaGetErrorString(err));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return dsv4rt::kMoeF32;
    case at::kBFloat16: return dsv4rt::kMoeBF16;
    case at::kHalf: return dsv4rt::kMoeF16;
    default: TORCH_CHECK(false, "moe_experts: x must be float32, bfloat16 or float16, got ", t);
  }
}

void check_index(const at::Tensor& t, const char* op, const char* name, const at::Device& dev) {
  TORCH_CHECK((t.scalar_type() == at::kLong || t.scalar_type() == at::kInt) && t.is_contiguous() && t.device() == dev,
              op, ": ", name, " must be a contiguous int64 or int32 tensor on ", dsv4rt::dev_str(dev));
}

// x . weight^T in fp32 where no GEMV launch takes it: bf16 x and weight (a bf16 model): cuBLAS's bf16 GEMM with fp32
// output (exact products, fp32 sums), no copy of the weight. Otherwise the reference's own arithmetic, the weight cast
// to fp32 (bf16 only: off the model's path).
at::Tensor linear_fp32_gemm(const at::Tensor& x, const at::Tensor& weight) {
  if (x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16) return at::mm(x, weight.t(), at::kFloat);
  return at::linear(x.to(at::kFloat), weight.to(at::kFloat));
}

bool gemv_x_ok(const at::Tensor& x) {
  return x.size(0) >= 1 && x.size(0) <= dsv4rt::moe_gate_max_tokens && x.size(1) % 8 == 0 && x.is_contiguous() &&
         aligned16(x) &&
         (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf);
}

// One output a weight ([T, N_i] of out_dtype, x's rows) and the GemvWeights that points the launch at them.
dsv4rt::GemvWeights gemv_weights(const at::Tensor& x, at::TensorList weights, at::ScalarType out_dtype,
                                 std::vector<at::Tensor>& outs) {
  dsv4rt::GemvWeights ws{};
  int64_t end = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    outs.push_back(at::empty({x.size(0), weights[i].size(0)}, x.options().dtype(out_dtype)));
    end += weights[i].size(0);
    ws.w[i] = weights[i].data_ptr();
    ws.out[i] = outs.back().data_ptr();
    ws.end[i] = end;
  }
  ws.n = static_cast<int>(weights.size());
  return ws;
}

// linear_fp32: one GEMV launch for every weight when x has at most moe_gate_max_tokens rows and the weights share one
// type (and at most moe_gemv_max_weights of them); else one GEMM each (linear_fp32_gemm).
std::vector<at::Tensor> linear_fp32_cuda(const at::Tensor& x, at::TensorList weights) {
  TORCH_CHECK(x.dim() == 2, "linear_fp32: x must be [T, K], got ", dsv4rt::num(x.dim()), " dims");
  TORCH_CHECK(!weights.empty(), "linear_fp32: no weights");
  bool native = gemv_x_ok(x) && static_cast<int64_t>(weights.size()) <= dsv4rt::moe_gemv_max_weights;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1), "linear_fp32: weight ", dsv4rt::num(static_cast<int64_t>(i)),
                " must be [N, K] with K = ", dsv4rt::num(x.size(1)), " (x's width)");
    TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, "linear_fp32: weight ",
                dsv4rt::num(static_cast<int64_t>(i)), " must be float32 or bfloat16, got ", w.scalar_type());
    TORCH_CHECK(w.device() == x.device(), "linear_fp32: weight ", dsv4rt::num(static_cast<int64_t>(i)), " is on ",
                dsv4rt::dev_str(w.device()), ", x on ", dsv4rt::dev_str(x.device()));
    native = native && w.scalar_type() == weights[0].scalar_type() && w.is_contiguous() && aligned16(w);
  }
  const c10::cuda::CUDAGuard guard(x.device());
  std::vector<at::Tensor> outs;
  outs.reserve(weights.size());
  if (!native) {
    for (const at::Tensor& w : weights) outs.push_back(linear_fp32_gemm(x, w));
    return outs;
  }
  const dsv4rt::GemvWeights ws = gemv_weights(x, weights, at::kFloat, outs);
  check_launch(dsv4rt::moe_gemv_launch(x.data_ptr(), dtype_code(x.scalar_type()), ws,
                                       dtype_code(weights[0].scalar_type()), true, x.size(0), x.size(1), x.size(1),
                                       c10::cuda::getCurrentCUDAStream(), use_pdl()),
               "linear_fp32");
  return outs;
}

// linear: out_i = x . w_i^T in x's type (groups > 1: one weight [G * N, K], x [T, G * K], out[:, g*N:(g+1)*N] =
// x[:, g*K:(g+1)*K] . w[g*N:(g+1)*N]^T). One GEMV launch for every weight when x has at most moe_gate_max_tokens
// rows and x and the weights are bf16 (or fp16), contiguous and 16-byte aligned; else cuBLAS through at::linear /
// at::bmm a weight, as the reference.
std::vector<at::Tensor> linear_cuda(const at::Tensor& x, at::TensorList weights, int64_t groups) {
  TORCH_CHECK(x.dim() == 2, "linear: x must be [T, K], got ", dsv4rt::num(x.dim()), " dims");
  TORCH_CHECK(!weights.empty(), "linear: no weights");
  TORCH_CHECK(groups >= 1, "linear: groups must be >= 1, got ", dsv4rt::num(groups));
  TORCH_CHECK(groups == 1 || weights.size() == 1, "linear: groups > 1 takes one weight, got ",
              dsv4rt::num(static_cast<int64_t>(weights.size())));
  TORCH_CHECK(x.size(1) % groups == 0, "linear: x's width ", dsv4rt::num(x.size(1)), " is not a multiple of groups ",
              dsv4rt::num(groups));
  const int64_t k = x.size(1) / groups;
  bool native = x.size(0) >= 1 && x.size(0) <= dsv4rt::moe_gate_max_tokens && k % 8 == 0 && x.is_contiguous() &&
                aligned16(x) && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf) &&
                static_cast<int64_t>(weights.size()) <= dsv4rt::moe_gemv_max_weights;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    TORCH_CHECK(w.dim() == 2 && w.size(1) == k && w.size(0) % groups == 0, "linear: weight ",
                dsv4rt::num(static_cast<int64_t>(i)), " must be [N, K] with K = ", dsv4rt::num(k),
                groups > 1 ? " (x's width / groups) and N a multiple of groups" : " (x's width)");
    TORCH_CHECK(w.scalar_type() == x.scalar_type(), "linear: weight ", dsv4rt::num(static_cast<int64_t>(i)), " is ",
                w.scalar_type(), ", x ", x.scalar_type(), " (one dtype)");
    TORCH_CHECK(w.device() == x.device(), "linear: weight ", dsv4rt::num(static_cast<int64_t>(i)), " is on ",
                dsv4rt::dev_str(w.device()), ", x on ", dsv4rt::dev_str(x.device()));
    native = native && w.is_contiguous() && aligned16(w);
  }
  const c10::cuda::CUDAGuard guard(x.device());
  std::vector<at::Tensor> outs;
  outs.reserve(weights.size());
  if (!native) {
    if (groups == 1) {
      for (const at::Tensor& w : weights) outs.push_back(at::linear(x, w));
    } else {  // [G, T, K] x [G, K, N] -> [G, T, N] -> [T, G * N]
      const int64_t n = weights[0].size(0) / groups;
      const at::Tensor y =
          at::bmm(x.view({x.size(0), groups, k}).transpose(0, 1), weights[0].view({groups, n, k}).transpose(1, 2));
      outs.push_back(y.transpose(0, 1).reshape({x.size(0), groups * n}));
    }
    return outs;
  }
  dsv4rt::GemvWeights ws = gemv_weights(x, weights, x.scalar_type(), outs);
  ws.group_rows = groups > 1 ? weights[0].size(0) / groups : 0;
  if (ws.end[ws.n - 1] > 0) {
    check_launch(dsv4rt::moe_gemv_launch(x.data_ptr(), dtype_code(x.scalar_type()), ws, dtype_code(x.scalar_type()),
                                         false, x.size(0), k, x.size(1), c10::cuda::getCurrentCUDAStream(), use_pdl()),
                 "linear");
  }
  return outs;
}

at::Tensor moe_gate_cuda(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.size(1) == x.size(1),
              "moe_gate: x must be [T, D] and weight [E, D]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "moe_gate: weight must be float32 or bfloat16, got ", weight.scalar_type());
  TORCH_CHECK(weight.device() == x.device(), "moe_gate: x and weight on different devices");
  const int64_t n_tok = x.size(0), dim = x.size(1), n_exp = weight.size(0);
  const c10::cuda::CUDAGuard guard(x.device());
  if (!(gemv_x_ok(x) && weight.is_contiguous() && aligned16(weight))) return linear_fp32_gemm(x, weight);
  at::Tensor logits = at::empty({n_tok, n_exp}, x.options().dtype(at::kFloat));
  if (n_exp == 0) return logits;
  check_launch(dsv4rt::moe_gate_launch(x.data_ptr(), dtype_code(x.scalar_type()), weight.data_ptr(),
                                       weight.scalar_type() == at::kBFloat16, n_tok, dim, n_exp,
                                       logits.data_ptr<float>(), c10::cuda::getCurrentCUDAStream(), use_pdl()),
               "moe_gate");
  return logits;
}

std::tuple<at::Tensor, at::Tensor> moe_route_cuda(const at::Tensor& logits, const at::Tensor& bias, int64_t topk,
                                                  double scale) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "moe_route: logits must be a contiguous float32 [T, E] tensor");
  const int64_t n_tok = logits.size(0), n_exp = logits.size(1);
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == n_exp && bias.is_contiguous() &&
                  (bias.scalar_type() == at::kFloat || bias.scalar_type() == at::kBFloat16),
              "moe_route: bias must be a contiguous float32 or bfloat16 [E] tensor");
  TORCH_CHECK(bias.device() == logits.device(), "moe_route: logits and bias on different devices");
  TORCH_CHECK(n_exp >= 1 && n_exp <= kMaxRouteExperts, "moe_route: 1 to ", dsv4rt::num(kMaxRouteExperts), " experts, got ",
              dsv4rt::num(n_exp));
  TORCH_CHECK(topk >= 1 && topk <= 32 && topk <= n_exp, "moe_route: topk must be in [1, min(32, E)], got ",
              dsv4rt::num(topk));
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor weights = at::empty({n_tok, topk}, logits.options());
  at::Tensor ids = at::empty({n_tok, topk}, logits.options().dtype(at::kInt));
  if (n_tok == 0) return {weights, ids};
  check_launch(dsv4rt::moe_route_launch(logits.data_ptr<float>(), bias.data_ptr(),
                                        bias.scalar_type() == at::kBFloat16, n_tok, static_cast<int>(n_exp),
                                        static_cast<int>(topk), static_cast<float>(scale),
                                        weights.data_ptr<float>(), ids.data_ptr<int32_t>(),
                                        c10::cuda::getCurrentCUDAStream(), use_pdl()),
               "moe_route");
  return {weights, ids};
}

std::tuple<at::Tensor, at::Tensor> moe_hash_route_cuda(const at::Tensor& logits, const at::Tensor& tid2eid,
                                                       const at::Tensor& token_ids, double scale) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "moe_hash_route: logits must be a contiguous float32 [T, E] tensor");
  const at::Device dev = logits.device();
  check_index(tid2eid, "moe_hash_route", "tid2eid", dev);
  check_index(token_ids, "moe_hash_route", "token_ids", dev);
  TORCH_CHECK(tid2eid.dim() == 2 && tid2eid.size(0) >= 1, "moe_hash_route: tid2eid must be [V, k] with V >= 1");
  TORCH_CHECK(token_ids.dim() == 1 && token_ids.size(0) == logits.size(0), "moe_hash_route: token_ids must be [T]");
  const int64_t n_tok = logits.size(0), n_exp = logits.size(1), topk = tid2eid.size(1);
  TORCH_CHECK(n_exp >= 1, "moe_hash_route: no experts");
  TORCH_CHECK(topk >= 1 && topk <= 32, "moe_hash_route: k (tid2eid.size(1)) must be in [1, 32], got ",
              dsv4rt::num(topk));
  const c10::cuda::CUDAGuard guard(dev);
  at::Tensor weights = at::empty({n_tok, topk}, logits.options());
  at::Tensor ids = at::empty({n_tok, topk}, logits.options().dtype(at::kInt));
  if (n_tok == 0) return {weights, ids};
  check_launch(dsv4rt::moe_hash_route_launch(logits.data_ptr<float>(), tid2eid.data_ptr(),
                                             tid2eid.scalar_type() == at::kLong, token_ids.data_ptr(),
                                             token_ids.scalar_type() == at::kLong, tid2eid.size(0), n_tok,
                                             static_cast<int>(n_exp), static_cast<int>(topk),
                                             static_cast<float>(scale), weights.data_ptr<float>(),
                                             ids.data_ptr<int32_t>(), c10::cuda::getCurrentCUDAStream(), use_pdl()),
               "moe_hash_route");
  return {weights, ids};
}

void check_shared(const at::Tensor& t, const char* name, int64_t rows, int64_t cols, const at::Tensor& x) {
  TORCH_CHECK(t.dim() == 2, "moe_experts: ", name, " must be 2-D [", dsv4rt::num(rows), ", ",
              dsv4rt::num(cols), "], got ", dsv4rt::num(t.dim()), " dims");
  TORCH_CHECK(t.size(0) == rows && t.size(1) == cols, "moe_experts: ", name, " must be [", dsv4rt::num(rows), ", ",
              dsv4rt::num(cols), "], got [", dsv4rt::num(t.size(0)), ", ", dsv4rt::num(t.size(1)), "]");
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), "moe_experts: ", name, " must have x's dtype ", x.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "moe_experts: ", name, " must be contiguous");
  TORCH_CHECK(t.device() == x.device(), "moe_experts: ", name, " on another device than x");
}

at::Tensor moe_experts_cuda(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                            const at::Tensor& weights, const at::Tensor& ids, double limit,
                            const std::optional<at::Tensor>& shared_gate, const std::optional<at::Tensor>& shared_up,
                            const std::optional<at::Tensor>& shared_down, bool x_ready) {
  const at::Device dev = x.device();
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3,
              "moe_experts: x must be [T, D], w13 [E, 2I, D], w2 [E, D, I]");
  const int64_t n_tok = x.size(0), dim = x.size(1), n_exp = w13.size(0), inter = w2.size(2);
  TORCH_CHECK(w13.size(1) == 2 * inter && w13.size(2) == dim && w2.size(0) == n_exp && w2.size(1) == dim,
              "moe_experts: w13 must be [E, 2I, D] and w2 [E, D, I] for x [T, D]");
  const int dtype = dtype_code(x.scalar_type());
  TORCH_CHECK(w13.scalar_type() == x.scalar_type() && w2.scalar_type() == x.scalar_type(),
              "moe_experts: x, w13 and w2 must share one dtype");
  TORCH_CHECK(x.is_contiguous() && w13.is_contiguous() && w2.is_contiguous(),
              "moe_experts: x, w13 and w2 must be contiguous");
  TORCH_CHECK(weights.dim() == 2 && weights.size(0) == n_tok && weights.scalar_type() == at::kFloat &&
                  weights.is_contiguous(),
              "moe_experts: weights must be a contiguous float32 [T, k] tensor");
  TORCH_CHECK(ids.sizes() == weights.sizes() && ids.scalar_type() == at::kInt && ids.is_contiguous(),
              "moe_experts: ids must be a contiguous int32 [T, k] tensor");
  for (const at::Tensor* t : {&w13, &w2, &weights, &ids}) {
    TORCH_CHECK(t->device() == dev, "moe_experts: tensors on different devices");
  }
  const bool shared = shared_gate.has_value();
  TORCH_CHECK(shared_up.has_value() == shared && shared_down.has_value() == shared,
              "moe_experts: give all three shared-expert projections (shared_gate, shared_up, shared_down) or none");
  if (shared) {
    check_shared(*shared_gate, "shared_gate", inter, dim, x);
    check_shared(*shared_up, "shared_up", inter, dim, x);
    check_shared(*shared_down, "shared_down", dim, inter, x);
  }
  const int64_t topk = ids.size(1), n_pairs = n_tok * topk;
  TORCH_CHECK(n_exp >= 1 && n_exp <= kMaxExperts, "moe_experts: 1 to ", dsv4rt::num(kMaxExperts), " experts, got ",
              dsv4rt::num(n_exp));
  TORCH_CHECK(dim >= 1 && inter >= 1, "moe_experts: empty hidden or intermediate size");
  TORCH_CHECK(n_pairs + n_tok < (int64_t{1} << 31) && (n_pairs + n_tok) * std::max(dim, inter) < (int64_t{1} << 62),
              "moe_experts: too many (token, choice) pairs");
  const c10::cuda::CUDAGuard guard(dev);
  at::Tensor out = at::empty({n_tok, dim}, x.options());
  if (n_tok == 0) return out;
  if (topk == 0 && !shared) return out.zero_();
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t n_slots = std::min(n_exp, n_pairs);

  dsv4rt::MoeExpertsArgs a{};
  a.x = x.data_ptr();
  a.w13 = w13.data_ptr();
  a.w2 = w2.data_ptr();
  a.shared_gate = shared ? shared_gate->data_ptr() : nullptr;
  a.shared_up = shared ? shared_up->data_ptr() : nullptr;
  a.shared_down = shared ? shared_down->data_ptr() : nullptr;
  a.weights = weights.data_ptr<float>();
  a.ids = ids.data_ptr<int32_t>();
  a.out = out.data_ptr();
  a.n_tokens = n_tok;
  a.dim = dim;
  a.inter = inter;
  a.n_experts = static_cast<int>(n_exp);
  a.topk = static_cast<int>(topk);
  a.limit = static_cast<float>(limit);
  a.dtype = dtype;
  a.pdl = use_pdl();
  a.tiny_prefetch = env_int("DSV4RT_MOE_TINY_PREFETCH", 1) != 0;
  a.x_ready = x_ready && a.pdl && env_int("DSV4RT_MOE_EARLY", 1) != 0;

  const bool tensor_cores = dtype != dsv4rt::kMoeF32 && dim % 32 == 0 && inter % 32 == 0 && aligned16(x) &&
                            aligned16(w13) && aligned16(w2) &&
                            (!shared || (aligned16(*shared_gate) && aligned16(*shared_up) && aligned16(*shared_down)));
  const int64_t tiny_tokens = std::min<int64_t>(env_int("DSV4RT_MOE_TINY", kTinyTokens), dsv4rt::moe_tiny_max_tokens);
  if (tensor_cores && n_tok <= tiny_tokens && n_pairs <= dsv4rt::moe_tiny_max_pairs) {
    at::Tensor act = at::empty({dsv4rt::moe_tiny_act_rows(n_exp, n_tok, topk, shared), inter}, x.options());
    check_launch(dsv4rt::moe_experts_tiny_launch(a, act.data_ptr(), stream), "moe_experts");
    return out;
  }
  at::Tensor workspace = at::empty({dsv4rt::moe_plan_words(n_exp, n_pairs)}, x.options().dtype(at::kInt));
  a.plan = dsv4rt::moe_plan_views(workspace.data_ptr<int32_t>(), n_exp, n_pairs);
  // The threshold counts the shared expert's rows as pairs: both paths compute them.
  const int64_t rows = n_pairs + (shared ? n_tok : 0);
  // the grouped kernel (csrc/moe.cu) where it runs, else at::_grouped_mm: each with its own crossover
  const bool gmm = dtype == dsv4rt::kMoeBF16 && tensor_cores && env_int("DSV4RT_MOE_GMM", 1) != 0 &&
                   w13.is_contiguous() && w2.is_contiguous() && dsv4rt::moe_gmm_supported(dim, inter, n_exp);
  const bool grouped = dtype == dsv4rt::kMoeBF16 && tensor_cores && n_exp <= kMaxGroupedExperts && n_pairs > 0 &&
                       rows > env_int("DSV4RT_MOE_GROUPED_MIN_PAIRS", gmm ? kGmmMinPairs : kGroupedMinPairs);
  if (!grouped) {
    at::Tensor act = at::empty({rows, inter}, x.options());
    at::Tensor y = at::empty({rows, dim}, x.options().dtype(at::kFloat));
    a.direct = env_int("DSV4RT_MOE_DIRECT", 1) != 0;  // the launcher takes it for one-token calls only
    // only small calls: their routing chain is a visible share of the call (H100, batch 64: 2,902 -> 2,912 us with it)
    a.keep_shared = n_tok <= kKeepMaxTokens && env_int("DSV4RT_MOE_KEEP", 1) != 0;
    check_launch(dsv4rt::moe_experts_small_launch(a, act.data_ptr(), y.data_ptr<float>(), tensor_cores, stream),
                 "moe_experts");
    return out;
  }
  at::Tensor shared_y;
  if (shared) {  // plain GEMMs on the separate weights (transposed views: no copy), the same activation kernel
    const at::Tensor hg = at::mm(x, shared_gate->t()), hu = at::mm(x, shared_up->t());  // [T, I]
    TORCH_CHECK(hg.is_contiguous() && hu.is_contiguous() && aligned16(hg) && aligned16(hu),
                "moe_experts: unexpected GEMM layout");
    at::Tensor act_s = at::empty({n_tok, inter}, x.options());
    check_launch(dsv4rt::moe_act_launch(a, hg.data_ptr(), hu.data_ptr(), inter, act_s.data_ptr(), n_tok, stream),
                 "moe_experts");
    shared_y = at::mm(act_s, shared_down->t());  // [T, D], rounded to the dtype as the reference's F.linear
    TORCH_CHECK(shared_y.is_contiguous() && aligned16(shared_y), "moe_experts: unexpected GEMM layout");
  }
  check_launch(dsv4rt::moe_plan_launch(a, stream), "moe_experts");
  const at::Tensor offs = workspace.narrow(0, 0, n_exp);  // expert_end: the grouped GEMMs' offsets
  const at::Tensor pair_tok = workspace.narrow(0, n_exp + 2 * n_slots + 1, n_pairs);
  const at::Tensor xs = at::index_select(x, 0, pair_tok);  // [P, D], tokens in expert order
  if (gmm && xs.is_contiguous() && aligned16(xs)) {
    // a CTA an (item of at most 128 of an expert's rows, tile of 256 weight rows): each weight read once (csrc/moe.cu)
    at::Tensor act = at::empty({n_pairs, inter}, x.options());
    dsv4rt::MoeGmmArgs g{xs.data_ptr(), w13.data_ptr(), a.plan.expert_end, act.data_ptr(), dim, 2 * inter, inter,
                         inter, a.limit, n_pairs, static_cast<int>(a.n_experts)};
    check_launch(dsv4rt::moe_gmm_launch(g, true, stream), "moe_experts");
    at::Tensor y = at::empty({n_pairs, dim}, x.options());
    dsv4rt::MoeGmmArgs g2{act.data_ptr(), w2.data_ptr(), a.plan.expert_end, y.data_ptr(), inter, dim, dim, inter,
                          a.limit, n_pairs, static_cast<int>(a.n_experts)};
    check_launch(dsv4rt::moe_gmm_launch(g2, false, stream), "moe_experts");
    check_launch(dsv4rt::moe_combine_launch(a, y.data_ptr(), false, dim, shared ? shared_y.data_ptr() : nullptr,
                                            dim, stream),
                 "moe_experts");
    return out;
  }
  const at::Tensor h = at::_grouped_mm(xs, w13.transpose(1, 2), offs);  // [P, 2I]
  TORCH_CHECK(h.stride(1) == 1 && h.stride(0) % 8 == 0 && aligned16(h), "moe_experts: unexpected grouped GEMM layout");
  at::Tensor act = at::empty({n_pairs, inter}, x.options());
  const char* h_up = static_cast<const char*>(h.data_ptr()) + inter * h.element_size();
  check_launch(dsv4rt::moe_act_launch(a, h.data_ptr(), h_up, h.stride(0), act.data_ptr(), n_pairs, stream),
               "moe_experts");
  const at::Tensor y = at::_grouped_mm(act, w2.transpose(1, 2), offs);  // [P, D]
  TORCH_CHECK(y.stride(1) == 1 && y.stride(0) % 8 == 0 && aligned16(y), "moe_experts: unexpected grouped GEMM layout");
  check_launch(dsv4rt::moe_combine_launch(a, y.data_ptr(), false, y.stride(0), shared ? shared_y.data_ptr() : nullptr,
                                          dim, stream),
               "moe_experts");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4rt, CUDA, m) {
  m.impl("moe_gate", &moe_gate_cuda);
  m.impl("linear_fp32", &linear_fp32_cuda);
  m.impl("linear", &linear_cuda);
  m.impl("moe_route", &moe_route_cuda);
  m.impl("moe_hash_route", &moe_hash_route_cuda);
  m.impl("moe_experts", &moe_experts_cuda);
}
