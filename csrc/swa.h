// Launcher of the sliding-window ring write (csrc/swa.cu), called by the torch binding (csrc/swa.cpp).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace dsv4rt {

// kv [T, width] (kv_dtype, see DType); swa_cache [n_slots, window, row] of kv_dtype (fp8 == false, row == width)
// or uint8 FP8 rows (fp8 == true, row == fp8_row_bytes(width, rope_dim)); req_slot/positions/end_pos [T] int32.
void swa_cache_write_launch(const void* kv, int kv_dtype, void* swa_cache, bool fp8, const int32_t* req_slot,
                            const int32_t* positions, const int32_t* end_pos, int64_t n_tokens, int64_t width,
                            int64_t rope_dim, int64_t n_slots, int64_t window, int64_t row, cudaStream_t stream);

}  // namespace dsv4rt
