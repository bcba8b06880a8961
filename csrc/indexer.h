// Launcher of the lightning-indexer top-k (csrc/indexer.cu), called by the torch binding (csrc/indexer.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace dsv4rt {

// Storage of the indexer keys: values of an activation dtype, or the 68-byte FP4 rows (ops/kv_quant.py).
enum class IdxFormat : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kFp4 = 3 };

// Raw views of the op's tensors (all contiguous unless said).
struct IndexerArgs {
  const void* q;              // [T, n_heads, head_dim], dtype q_dtype (0 fp32, 1 bf16, 2 fp16)
  const float* weights;       // [T, n_heads]
  const void* idx_cache;      // [n_blocks, per_block, row]: values (row = head_dim) or FP4 rows (bytes)
  const int32_t* req_slot;    // [T]
  const int32_t* positions;   // [T]
  const int32_t* block_table;  // [n_slots, bt_cols], row stride bt_stride
  int32_t* out;               // [T, topk]
  void* workspace;            // indexer_workspace_bytes(args) bytes, 256-byte aligned
  int64_t bt_stride;
  int64_t bt_cols;
  int64_t n_slots;
  int64_t n_blocks;
  int64_t per_block;
  int64_t row_bytes;          // bytes of one cache row
  int64_t n_tokens;
  int n_heads;
  int head_dim;
  int q_dtype;
  int format;                 // IdxFormat
  int ratio;
  int topk;
};

// Scratch the launch needs (scores of a group of tokens, candidate lists, histograms); depends on shapes only.
size_t indexer_workspace_bytes(const IndexerArgs& args);

// Whether the shapes are supported at all (the tensor-core path or the general one); `why` says what is not.
bool indexer_supported(const IndexerArgs& args, const char** why);

cudaError_t indexer_topk_launch(const IndexerArgs& args, cudaStream_t stream);

}  // namespace dsv4rt
