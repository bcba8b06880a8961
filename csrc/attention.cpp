// Torch binding of the sparse MQA attention: checks, then csrc/attention.cu on the current stream.
#include <optional>
#include <string>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "attention.h"
#include "binding.h"

namespace {

using dsv4rt::num;  // numbers in check messages: see binding.h

int value_fmt(at::ScalarType t, const char* name) {
  switch (t) {
    case at::kFloat: return dsv4rt::kAttnF32;
    case at::kBFloat16: return dsv4rt::kAttnBf16;
    case at::kHalf: return dsv4rt::kAttnF16;
    default:
      TORCH_CHECK(false, "sparse_attn: ", name, " must be float32, bfloat16 or float16, got ", c10::toString(t));
  }
}

int64_t fp8_row_bytes(int64_t dim, int64_t rope_dim) {
  const int64_t nope = dim - rope_dim;
  return nope + 2 * rope_dim + (nope / 64 + 7) / 8 * 8;
}

// A cache of rows: [lead, lead2, D] values of any float dtype, or [.., fp8_row_bytes] uint8 FP8 rows.
int cache_fmt(const at::Tensor& c, const char* name, int64_t dim, int64_t rope_dim, const at::Device& dev) {
  TORCH_CHECK(c.dim() == 3 && c.is_contiguous() && c.device() == dev, "sparse_attn: ", name,
              " must be a contiguous 3-d tensor on ", dev.str());
  if (c.scalar_type() == at::kByte) {
    const int64_t nope = dim - rope_dim;
    TORCH_CHECK(rope_dim >= 0 && nope > 0 && nope % 64 == 0, "sparse_attn: FP8 ", name,
                " needs D - rope_dim a positive multiple of 64 (D ", num(dim), ", rope_dim ", num(rope_dim), ")");
    TORCH_CHECK(c.size(2) == fp8_row_bytes(dim, rope_dim), "sparse_attn: FP8 ", name, " rows must be ",
                num(fp8_row_bytes(dim, rope_dim)), " bytes, got ", num(c.size(2)));
    return dsv4rt::kAttnFp8;
  }
  TORCH_CHECK(c.size(2) == dim, "sparse_attn: ", name, " rows must hold D = ", num(dim), " values, got ",
              num(c.size(2)));
  return value_fmt(c.scalar_type(), name);
}

void check_meta(const at::Tensor& x, const char* name, int64_t n, const at::Device& dev) {
  TORCH_CHECK(x.scalar_type() == at::kInt && x.dim() == 1 && x.is_contiguous() && x.numel() == n &&
                  x.device() == dev,
              "sparse_attn: ", name, " must be a contiguous int32 [T] tensor on ", dev.str());
}

at::Tensor sparse_attn_cuda(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& swa_cache,
                            const std::optional<at::Tensor>& entry_cache, const std::optional<at::Tensor>& entry_idx,
                            const at::Tensor& sinks, const at::Tensor& req_slot, const at::Tensor& positions,
                            const at::Tensor& start_pos, const at::Tensor& block_table, int64_t ratio,
                            int64_t rope_dim, double scale) {
  const at::Device dev = q.device();
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "sparse_attn: q must be [T, H, D] with unit stride along D");
  TORCH_CHECK(kv.dim() == 2 && kv.stride(1) == 1 && kv.device() == dev,
              "sparse_attn: kv must be [T, D] with unit stride along D, on q's device");
  const int64_t n_tok = q.size(0), heads = q.size(1), dim = q.size(2);
  TORCH_CHECK(kv.size(0) == n_tok && kv.size(1) == dim, "sparse_attn: kv must be [T, D] for q [T, H, D]");
  TORCH_CHECK(kv.scalar_type() == q.scalar_type(), "sparse_attn: kv must have q's dtype");
  const int dtype = value_fmt(q.scalar_type(), "q");
  TORCH_CHECK(dim % 32 == 0 && dim <= 1024, "sparse_attn: D must be a multiple of 32, at most 1024, got ",
              num(dim));
  TORCH_CHECK(heads >= 1, "sparse_attn: q needs at least one head");
  TORCH_CHECK(ratio >= 1, "sparse_attn: ratio must be positive, got ", num(ratio));
  TORCH_CHECK(rope_dim >= 0 && rope_dim <= dim, "sparse_attn: rope_dim must be in [0, D]");
  TORCH_CHECK(sinks.scalar_type() == at::kFloat && sinks.is_contiguous() && sinks.numel() == heads &&
                  sinks.device() == dev,
              "sparse_attn: sinks must be a contiguous float32 [H] tensor on q's device");
  check_meta(req_slot, "req_slot", n_tok, dev);
  check_meta(positions, "positions", n_tok, dev);
  check_meta(start_pos, "start_pos", n_tok, dev);
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.stride(1) == 1 &&
                  block_table.device() == dev,
              "sparse_attn: block_table must be int32 [S+1, MB] with unit column stride");
  const int swa_fmt = cache_fmt(swa_cache, "swa_cache", dim, rope_dim, dev);
  TORCH_CHECK(swa_cache.size(1) >= 1, "sparse_attn: swa_cache needs a window of at least one row");
  TORCH_CHECK(swa_cache.size(1) < (int64_t{1} << 30), "sparse_attn: window too large");
  int ent_fmt = 0;
  if (entry_cache.has_value()) {
    ent_fmt = cache_fmt(*entry_cache, "entry_cache", dim, rope_dim, dev);
    TORCH_CHECK(entry_cache->size(0) >= 1 && entry_cache->size(1) >= 1, "sparse_attn: empty entry_cache");
    TORCH_CHECK(block_table.size(1) >= 1, "sparse_attn: block_table has no columns");
  }
  if (entry_idx.has_value()) {
    TORCH_CHECK(entry_cache.has_value(), "sparse_attn: entry_idx needs entry_cache");
    const at::Tensor& idx = *entry_idx;
    TORCH_CHECK(idx.scalar_type() == at::kInt && idx.dim() == 2 && idx.size(0) == n_tok && idx.stride(1) == 1 &&
                    idx.device() == dev,
                "sparse_attn: entry_idx must be int32 [T, K] with unit column stride");
  }

  at::Tensor out = at::empty({n_tok, heads, dim}, q.options());
  if (n_tok == 0) return out;
  const c10::cuda::CUDAGuard guard(dev);

  dsv4rt::SparseAttnArgs a{};
  a.q = q.data_ptr();
  a.q_stride_t = q.stride(0);
  a.q_stride_h = q.stride(1);
  a.kv = kv.data_ptr();
  a.kv_stride = kv.stride(0);
  a.swa_cache = swa_cache.data_ptr();
  a.swa_fmt = swa_fmt;
  a.swa_row_bytes = swa_cache.size(2) * swa_cache.element_size();
  if (entry_cache.has_value()) {
    a.entry_cache = entry_cache->data_ptr();
    a.ent_fmt = ent_fmt;
    a.ent_row_bytes = entry_cache->size(2) * entry_cache->element_size();
    a.n_blocks = entry_cache->size(0);
    a.per_block = static_cast<int>(entry_cache->size(1));
  }
  if (entry_idx.has_value()) {
    a.entry_idx = entry_idx->data_ptr<int32_t>();
    a.idx_stride = entry_idx->stride(0);
    a.topk = static_cast<int>(entry_idx->size(1));
  }
  a.sinks = sinks.data_ptr<float>();
  a.req_slot = req_slot.data_ptr<int32_t>();
  a.positions = positions.data_ptr<int32_t>();
  a.start_pos = start_pos.data_ptr<int32_t>();
  a.block_table = block_table.data_ptr<int32_t>();
  a.bt_stride = block_table.stride(0);
  a.bt_cols = block_table.size(1);
  a.bt_rows = block_table.size(0);
  a.out = out.data_ptr();
  a.n_tokens = n_tok;
  a.heads = static_cast<int>(heads);
  a.dim = static_cast<int>(dim);
  a.rope_dim = static_cast<int>(rope_dim);
  a.dtype = dtype;
  a.n_slots = swa_cache.size(0);
  a.window = static_cast<int>(swa_cache.size(1));
  a.ratio = static_cast<int>(ratio);
  a.scale = static_cast<float>(scale);
  a.n_splits = dsv4rt::sparse_attn_splits(a);
  // key-split partials: a size fixed by the shapes, from the caching allocator (the graph's pool under capture)
  at::Tensor workspace;
  if (a.n_splits > 1) {
    workspace = at::empty({dsv4rt::sparse_attn_workspace_floats(a, a.n_splits)}, q.options().dtype(at::kFloat));
    a.workspace = workspace.data_ptr<float>();
  }
  const cudaError_t err = dsv4rt::sparse_attn_launch(a, c10::cuda::getCurrentCUDAStream());
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear it: the error is reported here
    TORCH_CHECK(false, "sparse_attn: launch failed: ", cudaGetErrorString(err));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4rt, CUDA, m) { m.impl("sparse_attn", &sparse_attn_cuda); }
