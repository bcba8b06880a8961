// Launcher of the KV compressor update (csrc/compressor.cu), called by the torch binding (csrc/compressor.cpp).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace dsv4rt {

// Raw views of the op's tensors (all contiguous; fp32 unless said). c = 2 with overlap, else 1; cw = c * d.
struct CompressorArgs {
  const float* kv;           // [T, cw] projections
  const float* score;        // [T, cw] gate projections (ape is added here)
  const float* ape;          // [m, cw]
  const float* norm_weight;  // [d]
  const float* inv_freq;     // [rope_dim / 2]
  float* kv_state;           // [n_slots, c*m, cw]
  float* score_state;        // [n_slots, c*m, cw]
  void* entry_cache;         // [n_blocks, per_block, row]: `dtype` values or uint8 FP8/FP4 rows
  const int32_t* req_slot;   // [T]
  const int32_t* positions;  // [T]
  const int32_t* start_pos;  // [T]
  const int32_t* end_pos;    // [T]
  const int32_t* block_table;  // [n_slots, bt_cols], row stride bt_stride
  int64_t bt_stride;
  int64_t bt_cols;
  int64_t n_tokens;
  int64_t n_slots;
  int64_t n_blocks;
  int64_t per_block;
  int64_t row;  // entry row: elements (value formats) or bytes (FP8/FP4)
  int ratio;
  int c;
  int d;
  int rope_dim;
  int quant;  // Quant
  int dtype;  // DType of the entries (the activation dtype)
  float eps;
  // set by the launcher from the shapes (DSV4RT_COMPRESSOR_* environment variables override them):
  int cluster;  // CTAs that share one chunk of tokens, each a slice of d / cluster channels
  int groups;   // slot groups: threads that pool disjoint slots of the same 4 channels
  int chunk;    // tokens per chunk (one chunk per cluster)
  int pipe;     // closing tokens' slots staged in shared memory ahead of their turn
  int bulk;  // (no overlap) a second grid takes the windows that read no state; this one skips them
  int chain;  // windows path of a pair: 1 the first call's windows (state) grid, 2 the second's, launched behind it
};

cudaError_t compressor_update_launch(const CompressorArgs& args, cudaStream_t stream);

// Two overlap calls on the same tokens (the CSA main and indexer compressors of a layer), bf16 entries and FP8 / FP4
// or unquantised rows: one grid when both are decode-sized (a token a CTA); when both take the windows path (prefill
// chunks), the two windows grids back to back, the second streaming without waiting for the first, then the two state
// grids; else the two launches above (DSV4RT_COMPRESSOR_PAIR=0: always two launches).
cudaError_t compressor_update_pair_launch(const CompressorArgs& first, const CompressorArgs& second,
                                          cudaStream_t stream);

}  // namespace dsv4rt
