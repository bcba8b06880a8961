// Launcher of the sparse MQA attention with sinks (csrc/attention.cu), called by the torch binding
// (csrc/attention.cpp).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace dsv4rt {

// Storage format of a row source: activation dtypes as DType (kv_quant.cuh), or the FP8 row layout.
enum AttnFmt : int { kAttnF32 = 0, kAttnBf16 = 1, kAttnF16 = 2, kAttnFp8 = 3 };

// Raw views of the op's tensors. Strides in elements unless said; rows of the caches in bytes.
struct SparseAttnArgs {
  const void* q;  // [T, H, D] `dtype`, unit stride along D
  int64_t q_stride_t, q_stride_h;
  const void* kv;  // [T, D] `dtype`, unit stride along D
  int64_t kv_stride;
  const void* swa_cache;  // [n_slots, window, row]
  int swa_fmt;            // AttnFmt
  int64_t swa_row_bytes;
  const void* entry_cache;  // [n_blocks, per_block, row] or null (sliding layers)
  int ent_fmt;              // AttnFmt
  int64_t ent_row_bytes;
  const int32_t* entry_idx;  // [T, topk] (CSA) or null (HCA: every visible entry)
  int64_t idx_stride;
  int topk;
  const float* sinks;  // [H]
  const int32_t* req_slot;   // [T]
  const int32_t* positions;  // [T]
  const int32_t* start_pos;  // [T]
  const int32_t* block_table;  // [bt_rows, bt_cols], row stride bt_stride
  int64_t bt_stride, bt_cols, bt_rows;
  void* out;  // [T, H, D] `dtype`, contiguous
  float* workspace;  // key-split partials (n_splits > 1): acc [T, n_splits, H, D] then (max, sum) [T, n_splits, H, 2]
  int64_t n_tokens;
  int heads, dim, rope_dim;
  int dtype;  // DType of q, kv and out
  int64_t n_slots;  // rows of the ring (request slots + the spare one)
  int window;
  int64_t n_blocks;  // entry pool blocks (the trash block included)
  int per_block;
  int ratio;
  float scale;
  int n_splits;  // set from sparse_attn_splits()
};

// Key splits per (token, head group): a function of the shapes only (1: no workspace).
int sparse_attn_splits(const SparseAttnArgs& a);

// fp32 elements of the workspace for `n_splits` splits (0 when n_splits == 1).
int64_t sparse_attn_workspace_floats(const SparseAttnArgs& a, int n_splits);

cudaError_t sparse_attn_launch(const SparseAttnArgs& a, cudaStream_t stream);

}  // namespace dsv4rt
