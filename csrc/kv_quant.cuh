// Device helpers shared by the cache-writing kernels: activation dtypes, warp/block reductions, and the FP8/FP4
// block quantisers of ops/kv_quant.py. No torch headers: every .cu compiles with nvcc alone (csrc/check_compile.sh).
//
// Rounding matches the references as torch runs them on CUDA, step for step:
//   amax / qmax     torch divides by a CPU scalar as a multiply by its float reciprocal
//                   (aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu), so we multiply too
//   scale           exp2(ceil(log2(.))) with the IEEE log2f/ceilf (no --use_fast_math: it swaps in approximations)
//   x / scale       a true division (the divisor is a tensor there)
//   FP8             e4m3, saturating round-to-nearest-even (values are clamped to +-448 first, as the reference does)
//   FP4             the reference's e2m1 thresholds, ties to the even code
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace dsv4rt {

// Activation dtype of a float tensor, as the bindings pass it.
enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Storage formats of compressed entries (ops/kv_quant.py QUANT_*).
enum Quant : int { kQuantNone = 0, kQuantFp8 = 1, kQuantFp4 = 2, kQuantFp8Sim = 3, kQuantFp4Sim = 4 };

constexpr int kFp8Block = 64;
constexpr int kFp4Block = 32;
constexpr float kFp8Max = 448.0f;
constexpr float kFp4Max = 6.0f;
constexpr float kFp8InvMax = static_cast<float>(1.0 / 448.0);
constexpr float kFp4InvMax = static_cast<float>(1.0 / 6.0);
constexpr float kFp8AmaxFloor = 1e-4f;
constexpr float kFp4AmaxFloor = 0x1.8p-124f;  // 6 * 2^-126

template <typename T>
struct Num;
template <>
struct Num<float> {
  static __device__ __forceinline__ float load(float x) { return x; }
  static __device__ __forceinline__ float store(float x) { return x; }
};
template <>
struct Num<__nv_bfloat16> {
  static __device__ __forceinline__ float load(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
};
template <>
struct Num<__half> {
  static __device__ __forceinline__ float load(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half store(float x) { return __float2half_rn(x); }
};

// x rounded to T and back (what `.to(dtype)` followed by `.float()` does).
template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return Num<T>::load(Num<T>::store(x));
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// 2^x by ex2.approx.ftz (within 2 ulp; 2^-inf = +0, results below 2^-126 flush to zero): the softmax exponentials
// of the attention and compressor kernels, one MUFU instruction where exp2f takes several.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block in a fixed order (deterministic). `scratch` holds >= 32 floats; every thread must call.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int i = 0; i < n_warps; ++i) total = __fadd_rn(total, scratch[i]);
  return total;
}

// Exponent k of the power-of-two scale 2^k = 2^ceil(log2(max(amax, floor) / qmax)).
__device__ __forceinline__ int pow2_scale_exp(float amax, float floor_, float inv_qmax) {
  const float k = ceilf(log2f(__fmul_rn(fmaxf(amax, floor_), inv_qmax)));
  return static_cast<int>(fminf(fmaxf(k, -126.0f), 127.0f));
}

__device__ __forceinline__ float exp2_int(int k) { return __int_as_float((k + 127) << 23); }

__device__ __forceinline__ uint8_t fp8_encode(float x, float scale) {
  const float y = fminf(fmaxf(__fdiv_rn(x, scale), -kFp8Max), kFp8Max);
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float fp8_decode(uint8_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return __half2float(__half(h));
}

// e2m1 code of y (already divided by its scale): magnitude by the reference's thresholds, sign in bit 3.
__device__ __forceinline__ uint8_t e2m1_encode(float y) {
  const float a = fabsf(y);
  const int mag = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return static_cast<uint8_t>(mag | ((y < 0.0f) ? 8 : 0));
}

__device__ __forceinline__ float e2m1_magnitude(int mag) {
  // 0, 0.5, 1, 1.5, 2, 3, 4, 6
  return mag < 4 ? 0.5f * mag : (mag < 6 ? static_cast<float>(mag - 2) : (mag == 6 ? 4.0f : 6.0f));
}

}  // namespace dsv4rt
