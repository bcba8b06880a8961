// Torch binding of the KV compressor update (one compressor, or the two of a CSA layer at once): checks, then
// csrc/compressor.cu on the current stream.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "compressor.h"
#include "binding.h"

namespace {

constexpr int64_t kQuantNone = 0, kQuantFp8 = 1, kQuantFp4 = 2, kQuantFp8Sim = 3, kQuantFp4Sim = 4;

int dtype_code(at::ScalarType t, const char* op) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: TORCH_CHECK(false, op, ": dtype must be float32, bfloat16 or float16, got ", t);
  }
}

void check_f32(const char* op, const at::Tensor& x, const char* name, const at::Device& dev) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.device() == dev, op, ": ", name,
              " must be a contiguous float32 tensor on ", dsv4rt::dev_str(dev));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, op, ": ", name, " must be 16-byte aligned");
}

// The checks of one call (errors name the op and the argument), then its launcher arguments.
dsv4rt::CompressorArgs checked_args(const char* op, const at::Tensor& kv, const at::Tensor& score,
                                    const at::Tensor& ape, const at::Tensor& norm_weight, const at::Tensor& inv_freq,
                                    at::Tensor& kv_state, at::Tensor& score_state, at::Tensor& entry_cache,
                                    const at::Tensor& req_slot, const at::Tensor& positions,
                                    const at::Tensor& start_pos, const at::Tensor& end_pos,
                                    const at::Tensor& block_table, int64_t ratio, bool overlap, int64_t quant,
                                    double eps, at::ScalarType dtype) {
  const at::Device dev = kv.device();
  const int64_t c = overlap ? 2 : 1, d = norm_weight.size(0), rope_dim = 2 * inv_freq.size(0);
  const int64_t n_tok = kv.size(0);
  TORCH_CHECK(ratio > 0, op, ": ratio must be positive");
  TORCH_CHECK(kv.dim() == 2 && kv.sizes() == score.sizes() && kv.size(1) == c * d,
              op, ": kv, score must be [T, c*d]");
  TORCH_CHECK(d % 4 == 0 && d <= 1024 && rope_dim <= d, op, ": d must be a multiple of 4, at most "
              "1024, and at least rope_dim");
  check_f32(op, kv, "kv", dev);
  check_f32(op, score, "score", dev);
  check_f32(op, ape, "ape", dev);
  check_f32(op, kv_state, "kv_state", dev);
  check_f32(op, score_state, "score_state", dev);
  TORCH_CHECK(norm_weight.scalar_type() == at::kFloat && norm_weight.is_contiguous() && norm_weight.device() == dev,
              op, ": norm_weight must be contiguous float32");
  TORCH_CHECK(inv_freq.scalar_type() == at::kFloat && inv_freq.is_contiguous() && inv_freq.device() == dev,
              op, ": inv_freq must be contiguous float32");
  TORCH_CHECK(ape.dim() == 2 && ape.size(0) == ratio && ape.size(1) == c * d,
              op, ": ape must be [m, c*d]");
  if (overlap) {
    TORCH_CHECK(kv_state.dim() == 3 && kv_state.size(1) == c * ratio && kv_state.size(2) == c * d &&
                    kv_state.sizes() == score_state.sizes(),
                op, ": with overlap, kv_state and score_state must be [S+1, 2*m, 2*d]");
  } else {  // the online softmax state: A [S+1, 1, d], (M, Z) [S+1, 2, d]
    TORCH_CHECK(kv_state.dim() == 3 && kv_state.size(1) == 1 && kv_state.size(2) == d && score_state.dim() == 3 &&
                    score_state.size(0) == kv_state.size(0) && score_state.size(1) == 2 && score_state.size(2) == d,
                op, ": without overlap, the state is the online softmax (A; M, Z): kv_state must be "
                "[S+1, 1, d] and score_state [S+1, 2, d]");
  }
  for (const at::Tensor* idx : {&req_slot, &positions, &start_pos, &end_pos}) {
    TORCH_CHECK(idx->scalar_type() == at::kInt && idx->is_contiguous() && idx->numel() == n_tok &&
                    idx->device() == dev,
                op, ": req_slot, positions, start_pos, end_pos must be contiguous int32 [T]");
  }
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.stride(1) == 1 &&
                  block_table.size(0) >= kv_state.size(0) && block_table.device() == dev,
              op, ": block_table must be int32 [S+1, MB] with unit column stride");
  TORCH_CHECK(entry_cache.dim() == 3 && entry_cache.is_contiguous() && entry_cache.device() == dev,
              op, ": entry_cache must be contiguous [NB+1, E, row]");
  const int64_t row = entry_cache.size(2);
  if (quant == kQuantFp8) {
    const int64_t nope = d - rope_dim;
    TORCH_CHECK(entry_cache.scalar_type() == at::kByte && nope > 0 && nope % 64 == 0 &&
                    row == nope + 2 * rope_dim + (nope / 64 + 7) / 8 * 8,
                op, ": FP8 entries need uint8 rows of fp8_row_bytes(d, rope_dim)");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(entry_cache.data_ptr()) % 4 == 0,
                op, ": FP8 entries must be 4-byte aligned");
  } else if (quant == kQuantFp4) {
    TORCH_CHECK(entry_cache.scalar_type() == at::kByte && d % 32 == 0 && (d & (d - 1)) == 0 && row == d / 2 + d / 32,
                op, ": FP4 entries need a power-of-two d and uint8 rows of fp4_row_bytes(d)");
  } else {
    TORCH_CHECK(quant == kQuantNone || quant == kQuantFp8Sim || quant == kQuantFp4Sim,
                op, ": unknown quant ", dsv4rt::num(quant));
    TORCH_CHECK(entry_cache.scalar_type() == dtype && row == d,
                op, ": value entries must be `dtype` [.., d]");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(entry_cache.data_ptr()) % 16 == 0,
                op, ": value entries must be 16-byte aligned");
    if (quant == kQuantFp8Sim) {
      TORCH_CHECK(d - rope_dim > 0 && (d - rope_dim) % 64 == 0, op, ": FP8 needs d - rope_dim % 64 == 0");
    }
    if (quant == kQuantFp4Sim) {
      TORCH_CHECK(d % 32 == 0 && (d & (d - 1)) == 0, op, ": FP4 needs a power-of-two d");
    }
  }
  dsv4rt::CompressorArgs a{};
  a.kv = kv.data_ptr<float>();
  a.score = score.data_ptr<float>();
  a.ape = ape.data_ptr<float>();
  a.norm_weight = norm_weight.data_ptr<float>();
  a.inv_freq = inv_freq.data_ptr<float>();
  a.kv_state = kv_state.data_ptr<float>();
  a.score_state = score_state.data_ptr<float>();
  a.entry_cache = entry_cache.data_ptr();
  a.req_slot = req_slot.data_ptr<int32_t>();
  a.positions = positions.data_ptr<int32_t>();
  a.start_pos = start_pos.data_ptr<int32_t>();
  a.end_pos = end_pos.data_ptr<int32_t>();
  a.block_table = block_table.data_ptr<int32_t>();
  a.bt_stride = block_table.stride(0);
  a.bt_cols = block_table.size(1);
  a.n_tokens = n_tok;
  a.n_slots = kv_state.size(0);
  a.n_blocks = entry_cache.size(0);
  a.per_block = entry_cache.size(1);
  a.row = row;
  a.ratio = static_cast<int>(ratio);
  a.c = static_cast<int>(c);
  a.d = static_cast<int>(d);
  a.rope_dim = static_cast<int>(rope_dim);
  a.quant = static_cast<int>(quant);
  a.dtype = dtype_code(dtype, op);
  a.eps = static_cast<float>(eps);
  return a;
}

void check_launch(cudaError_t err, const char* op) {
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear it: the error is reported here
    TORCH_CHECK(false, op, ": launch failed: ", cudaGetErrorString(err));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void compressor_update_cuda(const at::Tensor& kv, const at::Tensor& score, const at::Tensor& ape,
                            const at::Tensor& norm_weight, const at::Tensor& inv_freq, at::Tensor& kv_state,
                            at::Tensor& score_state, at::Tensor& entry_cache, const at::Tensor& req_slot,
                            const at::Tensor& positions, const at::Tensor& start_pos, const at::Tensor& end_pos,
                            const at::Tensor& block_table, int64_t ratio, bool overlap, int64_t quant, double eps,
                            at::ScalarType dtype) {
  const char* op = "compressor_update";
  const dsv4rt::CompressorArgs a = checked_args(op, kv, score, ape, norm_weight, inv_freq, kv_state, score_state,
                                                entry_cache, req_slot, positions, start_pos, end_pos, block_table,
                                                ratio, overlap, quant, eps, dtype);
  if (a.n_tokens == 0) return;
  const c10::cuda::CUDAGuard guard(kv.device());
  check_launch(dsv4rt::compressor_update_launch(a, c10::cuda::getCurrentCUDAStream()), op);
}

// Two compressors of one layer on the same tokens (dsv4rt::compressor_update_pair): the same checks for each, the
// shared metadata, ratio and overlap once; one launch when csrc/compressor.cu can pair them.
void compressor_update_pair_cuda(const at::Tensor& kv, const at::Tensor& score, const at::Tensor& ape,
                                 const at::Tensor& norm_weight, at::Tensor& kv_state, at::Tensor& score_state,
                                 at::Tensor& entry_cache, int64_t quant, const at::Tensor& kv2,
                                 const at::Tensor& score2, const at::Tensor& ape2, const at::Tensor& norm_weight2,
                                 at::Tensor& kv_state2, at::Tensor& score_state2, at::Tensor& entry_cache2,
                                 int64_t quant2, const at::Tensor& inv_freq, const at::Tensor& req_slot,
                                 const at::Tensor& positions, const at::Tensor& start_pos, const at::Tensor& end_pos,
                                 const at::Tensor& block_table, int64_t ratio, bool overlap, double eps,
                                 at::ScalarType dtype) {
  const char* op = "compressor_update_pair";
  TORCH_CHECK(kv2.device() == kv.device(), op, ": the two compressors' tensors on different devices");
  const dsv4rt::CompressorArgs a = checked_args(op, kv, score, ape, norm_weight, inv_freq, kv_state, score_state,
                                                entry_cache, req_slot, positions, start_pos, end_pos, block_table,
                                                ratio, overlap, quant, eps, dtype);
  const dsv4rt::CompressorArgs b = checked_args(op, kv2, score2, ape2, norm_weight2, inv_freq, kv_state2,
                                                score_state2, entry_cache2, req_slot, positions, start_pos, end_pos,
                                                block_table, ratio, overlap, quant2, eps, dtype);
  if (a.n_tokens == 0) return;
  const c10::cuda::CUDAGuard guard(kv.device());
  check_launch(dsv4rt::compressor_update_pair_launch(a, b, c10::cuda::getCurrentCUDAStream()), op);
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4rt, CUDA, m) {
  m.impl("compressor_update", &compressor_update_cuda);
  m.impl("compressor_update_pair", &compressor_update_pair_cuda);
}
