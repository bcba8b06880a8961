// Sliding-window ring family (ops/swa.py): write a step's kv rows into each request's ring of W rows.
//
// Grid-stride over tokens, one CTA per token at a time. Token t goes to ring row (req_slot[t], positions[t] mod W)
// when it is a live token (req_slot >= 0) among the last W positions of its request in this step
// (p >= end_pos - W); every other token is skipped. The reference sends those to the spare slot (the last)
// instead; nothing reads that slot's rows. Within one step the kept positions of a request are distinct mod W, so
// no two CTAs write the same row.
#include "kv_quant.cuh"
#include "launch.cuh"
#include "swa.h"

namespace dsv4rt {
namespace {

__device__ __forceinline__ int64_t ring_row(const int32_t* req_slot, const int32_t* positions, const int32_t* end_pos,
                                            int64_t t, int64_t n_slots, int64_t window) {
  const int64_t slot = req_slot[t], p = positions[t], e = end_pos[t];
  if (slot < 0 || slot >= n_slots || p < e - window) return -1;
  return slot * window + ((p % window) + window) % window;
}

// Plain rows: the cache has the kv dtype. `vec` when a row is a whole number of aligned 16-byte words.
template <typename T>
__global__ void swa_cache_write_kernel(const T* __restrict__ kv, T* __restrict__ cache,
                                       const int32_t* __restrict__ req_slot, const int32_t* __restrict__ positions,
                                       const int32_t* __restrict__ end_pos, int64_t n_tokens, int64_t width,
                                       int64_t n_slots, int64_t window, bool vec) {
  for (int64_t t = blockIdx.x; t < n_tokens; t += gridDim.x) {
    const int64_t row = ring_row(req_slot, positions, end_pos, t, n_slots, window);
    if (row < 0) continue;
    const T* src = kv + t * width;
    T* dst = cache + row * width;
    if (vec) {
      const int64_t n = width * static_cast<int64_t>(sizeof(T)) / 16;
      const uint4* s4 = reinterpret_cast<const uint4*>(src);
      uint4* d4 = reinterpret_cast<uint4*>(dst);
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) d4[i] = s4[i];
    } else {
      for (int64_t i = threadIdx.x; i < width; i += blockDim.x) dst[i] = src[i];
    }
  }
}

// FP8 rows: one warp per 64-block of the nope dims (2 values a lane), then the rope dims as bf16, then the
// exponent bytes (written by each block's lane 0) and the zero pad.
template <typename T>
__global__ void swa_cache_write_fp8_kernel(const T* __restrict__ kv, uint8_t* __restrict__ cache,
                                           const int32_t* __restrict__ req_slot,
                                           const int32_t* __restrict__ positions,
                                           const int32_t* __restrict__ end_pos, int64_t n_tokens, int width,
                                           int rope_dim, int row_bytes, int64_t n_slots, int64_t window) {
  const int nope = width - rope_dim, n_blocks = nope / kFp8Block;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  for (int64_t t = blockIdx.x; t < n_tokens; t += gridDim.x) {
    const int64_t row = ring_row(req_slot, positions, end_pos, t, n_slots, window);
    if (row < 0) continue;
    const T* x = kv + t * width;
    uint8_t* out = cache + row * row_bytes;
    uint8_t* exps = out + nope + 2 * rope_dim;
    for (int b = warp; b < n_blocks; b += n_warps) {
      const int i = b * kFp8Block + 2 * lane;
      const float v0 = Num<T>::load(x[i]), v1 = Num<T>::load(x[i + 1]);
      const int k = pow2_scale_exp(warp_max(fmaxf(fabsf(v0), fabsf(v1))), kFp8AmaxFloor, kFp8InvMax);
      const float scale = exp2_int(k);
      const uint16_t pair = static_cast<uint16_t>(fp8_encode(v0, scale)) |
                            static_cast<uint16_t>(static_cast<uint16_t>(fp8_encode(v1, scale)) << 8);
      *reinterpret_cast<uint16_t*>(out + i) = pair;
      if (lane == 0) exps[b] = static_cast<uint8_t>(k + 127);
    }
    __nv_bfloat16* rope = reinterpret_cast<__nv_bfloat16*>(out + nope);
    for (int i = threadIdx.x; i < rope_dim; i += blockDim.x) rope[i] = __float2bfloat16_rn(Num<T>::load(x[nope + i]));
    for (int i = n_blocks + threadIdx.x; i < row_bytes - nope - 2 * rope_dim; i += blockDim.x) exps[i] = 0;
  }
}

template <typename T>
void launch(const void* kv, void* cache, bool fp8, const int32_t* req_slot, const int32_t* positions,
            const int32_t* end_pos, int64_t n_tokens, int64_t width, int64_t rope_dim, int64_t n_slots,
            int64_t window, int64_t row, cudaStream_t stream) {
  const T* x = static_cast<const T*>(kv);
  // grid-stride: a prefill chunk's skipped tokens cost a few loads each, not a CTA each
  const int64_t max_grid = static_cast<int64_t>(num_sms()) * 8;
  const unsigned grid = static_cast<unsigned>(n_tokens < max_grid ? n_tokens : max_grid);
  if (fp8) {
    const int n_blocks = static_cast<int>((width - rope_dim) / kFp8Block);
    const int threads = 32 * (n_blocks < 2 ? 2 : (n_blocks > 8 ? 8 : n_blocks));
    swa_cache_write_fp8_kernel<T><<<grid, threads, 0, stream>>>(
        x, static_cast<uint8_t*>(cache), req_slot, positions, end_pos, n_tokens, static_cast<int>(width),
        static_cast<int>(rope_dim), static_cast<int>(row), n_slots, window);
  } else {
    const bool vec = (width * static_cast<int64_t>(sizeof(T))) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(kv) % 16 == 0 && reinterpret_cast<uintptr_t>(cache) % 16 == 0;
    swa_cache_write_kernel<T><<<grid, 128, 0, stream>>>(x, static_cast<T*>(cache), req_slot, positions, end_pos,
                                                        n_tokens, width, n_slots, window, vec);
  }
}

}  // namespace

void swa_cache_write_launch(const void* kv, int kv_dtype, void* swa_cache, bool fp8, const int32_t* req_slot,
                            const int32_t* positions, const int32_t* end_pos, int64_t n_tokens, int64_t width,
                            int64_t rope_dim, int64_t n_slots, int64_t window, int64_t row, cudaStream_t stream) {
  if (n_tokens == 0) return;
  switch (static_cast<DType>(kv_dtype)) {
    case DType::kFloat32:
      launch<float>(kv, swa_cache, fp8, req_slot, positions, end_pos, n_tokens, width, rope_dim, n_slots, window,
                    row, stream);
      break;
    case DType::kBFloat16:
      launch<__nv_bfloat16>(kv, swa_cache, fp8, req_slot, positions, end_pos, n_tokens, width, rope_dim, n_slots,
                            window, row, stream);
      break;
    case DType::kFloat16:
      launch<__half>(kv, swa_cache, fp8, req_slot, positions, end_pos, n_tokens, width, rope_dim, n_slots, window,
                     row, stream);
      break;
  }
}

}  // namespace dsv4rt
