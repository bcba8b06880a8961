// Torch binding of the lightning-indexer top-k: checks, output and scratch, then csrc/indexer.cu on the current stream.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <string>

#include "indexer.h"

namespace {

int q_dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: TORCH_CHECK(false, "indexer_topk: q and value keys must be float32, bfloat16 or float16");
  }
}

at::Tensor indexer_topk_cuda(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& idx_cache,
                             const at::Tensor& req_slot, const at::Tensor& positions, const at::Tensor& block_table,
                             int64_t ratio, int64_t topk) {
  // messages carry numbers and devices as strings: streaming them into a check message crashed the process on the
  // GPU image instead of raising
  const at::Device dev = q.device();
  const std::string on = " on " + dev.str();
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "indexer_topk: q must be a contiguous [T, n_heads, head_dim] tensor");
  const int64_t n_tok = q.size(0), n_heads = q.size(1), head_dim = q.size(2);
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.dim() == 2 &&
                  weights.size(0) == n_tok && weights.size(1) == n_heads && weights.device() == dev,
              "indexer_topk: weights must be contiguous float32 [T, n_heads]" + on);
  TORCH_CHECK(ratio > 0, "indexer_topk: ratio must be positive");
  TORCH_CHECK(topk > 0 && topk <= 32768, "indexer_topk: topk must be in [1, 32768], got " + std::to_string(topk));
  TORCH_CHECK(n_heads > 0 && head_dim > 0, "indexer_topk: empty heads");
  for (const at::Tensor* idx : {&req_slot, &positions}) {
    TORCH_CHECK(idx->scalar_type() == at::kInt && idx->is_contiguous() && idx->numel() == n_tok &&
                    idx->device() == dev,
                "indexer_topk: req_slot, positions must be contiguous int32 [T]" + on);
  }
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.stride(1) == 1 &&
                  block_table.size(0) >= 1 && block_table.device() == dev,
              "indexer_topk: block_table must be int32 [S+1, MB] with unit column stride" + on);
  TORCH_CHECK(idx_cache.dim() == 3 && idx_cache.is_contiguous() && idx_cache.device() == dev,
              "indexer_topk: idx_cache must be a contiguous [NB+1, E, row] tensor" + on);
  TORCH_CHECK(idx_cache.size(0) >= 1 && idx_cache.size(1) >= 1, "indexer_topk: idx_cache has no rows");
  dsv4rt::IdxFormat format;
  int64_t row_bytes;
  switch (idx_cache.scalar_type()) {
    case at::kByte:
      format = dsv4rt::IdxFormat::kFp4;
      TORCH_CHECK(head_dim % 32 == 0 && idx_cache.size(2) == head_dim / 2 + head_dim / 32,
                  "indexer_topk: FP4 keys need head_dim % 32 == 0 and rows of head_dim/2 + head_dim/32 bytes, got "
                  "head_dim " + std::to_string(head_dim) + " and rows of " + std::to_string(idx_cache.size(2)));
      row_bytes = idx_cache.size(2);
      break;
    case at::kFloat:
    case at::kBFloat16:
    case at::kHalf:
      format = static_cast<dsv4rt::IdxFormat>(q_dtype_code(idx_cache.scalar_type()));
      TORCH_CHECK(idx_cache.size(2) == head_dim, "indexer_topk: value keys must be [.., head_dim]");
      row_bytes = idx_cache.size(2) * idx_cache.element_size();
      break;
    default:
      TORCH_CHECK(false, "indexer_topk: idx_cache must be uint8 (FP4 rows) or float32/bfloat16/float16");
  }

  at::Tensor out = at::empty({n_tok, topk}, q.options().dtype(at::kInt));
  dsv4rt::IndexerArgs a{};
  a.q = q.data_ptr();
  a.weights = weights.data_ptr<float>();
  a.idx_cache = idx_cache.data_ptr();
  a.req_slot = req_slot.data_ptr<int32_t>();
  a.positions = positions.data_ptr<int32_t>();
  a.block_table = block_table.data_ptr<int32_t>();
  a.out = out.data_ptr<int32_t>();
  a.bt_stride = block_table.stride(0);
  a.bt_cols = block_table.size(1);
  a.n_slots = block_table.size(0);
  a.n_blocks = idx_cache.size(0);
  a.per_block = idx_cache.size(1);
  a.row_bytes = row_bytes;
  a.n_tokens = n_tok;
  a.n_heads = static_cast<int>(n_heads);
  a.head_dim = static_cast<int>(head_dim);
  a.q_dtype = q_dtype_code(q.scalar_type());
  a.format = static_cast<int>(format);
  a.ratio = static_cast<int>(ratio);
  a.topk = static_cast<int>(topk);
  if (n_tok == 0) return out;

  const c10::cuda::CUDAGuard guard(dev);
  const char* why = "";
  TORCH_CHECK(dsv4rt::indexer_supported(a, &why), std::string("indexer_topk: ") + why);
  // scratch from the caching allocator: inside a captured graph it lives in the graph's pool
  at::Tensor workspace = at::empty({static_cast<int64_t>(dsv4rt::indexer_workspace_bytes(a))},
                                   q.options().dtype(at::kByte));
  a.workspace = workspace.data_ptr();
  const cudaError_t err = dsv4rt::indexer_topk_launch(a, c10::cuda::getCurrentCUDAStream());
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear it: the error is reported here
    TORCH_CHECK(false, std::string("indexer_topk: launch failed: ") + cudaGetErrorString(err));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4rt, CUDA, m) { m.impl("indexer_topk", &indexer_topk_cuda); }
