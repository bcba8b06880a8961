// Row-norm and rotation family (ops/norm.py): the RMSNorms and RoPE rotations between the step's other ops, one
// launch each, where plain torch takes eight launches for an RMSNorm and about ten for a rotation.
//
// rms_norm_kernel: one CTA a row (grid-stride over rows), its threads over 16-byte groups of the row when the row
// is a whole number of aligned groups, else over elements. The sum of squares (each square rounded to fp32, as
// x.pow(2)) in a fixed order: each thread's groups in turn, a warp butterfly, then the warps in index order, so a
// result is deterministic; mean = sum * (1 / d), as torch's mean scales its sum. Then the reference's products in its
// order, w * (x * r), each rounded to fp32 (no fused multiply-add), and the result rounded to x's dtype.
// rope_rows_kernel: one warp a (token, head) row, eight rows a CTA. With `NORM`, the row is first scaled by its
// RMS factor rounded to x's dtype, the product rounded to x's dtype too (the model's q * rsqrt(...).to(q.dtype)).
// The channels before the rotated tail are copied; each pair (a, b) of the tail becomes (a cos - b sin,
// b cos + a sin), inverse (a cos + b sin, b cos - a sin), every product and sum rounded to fp32 as the reference's
// separate torch ops round them, so a rotation equals the reference bit for bit.
// No scratch, no atomics; grids depend on shapes only (capture-safe); plain launches (stream order).
#include <cstdint>
#include <type_traits>

#include "kv_quant.cuh"
#include "launch.cuh"
#include "norm.h"

namespace dsv4rt {
namespace {

constexpr int kNormThreads = 256;
constexpr int kRowWarps = 8;  // rope_rows_kernel: rows (warps) a CTA

// V consecutive elements at p as floats, and back; V > 1: one 16-byte access (p aligned)
template <typename T, int V>
__device__ __forceinline__ void load_v(const T* p, float (&f)[V]) {
  if constexpr (V == 1) {
    f[0] = Num<T>::load(*p);
  } else if constexpr (std::is_same_v<T, float>) {
    const float4 q = *reinterpret_cast<const float4*>(p);
    f[0] = q.x, f[1] = q.y, f[2] = q.z, f[3] = q.w;
  } else {
    static_assert(V * sizeof(T) == 16, "a group is 16 bytes");
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int i = 0; i < V; ++i) f[i] = Num<T>::load(e[i]);
  }
}

template <typename T, int V>
__device__ __forceinline__ void store_v(T* p, const float (&f)[V]) {
  if constexpr (V == 1) {
    *p = Num<T>::store(f[0]);
  } else if constexpr (std::is_same_v<T, float>) {
    *reinterpret_cast<float4*>(p) = make_float4(f[0], f[1], f[2], f[3]);
  } else {
    uint4 u;
    T* e = reinterpret_cast<T*>(&u);
#pragma unroll
    for (int i = 0; i < V; ++i) e[i] = Num<T>::store(f[i]);
    *reinterpret_cast<uint4*>(p) = u;
  }
}

// V fp32 weights at p (V a multiple of 4: float4 accesses, p 16-byte aligned)
template <int V>
__device__ __forceinline__ void load_w(const float* p, float (&f)[V]) {
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int k = 0; k < V / 4; ++k) {
      const float4 q = reinterpret_cast<const float4*>(p)[k];
      f[4 * k] = q.x, f[4 * k + 1] = q.y, f[4 * k + 2] = q.z, f[4 * k + 3] = q.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) f[i] = p[i];
  }
}

// rsqrt(mean(x^2) + eps) of row xr (d = groups * V channels) in a fixed sum order: each thread's groups in turn, a
// warp butterfly, then the warps in index order. Every thread of the CTA (kNormThreads) calls it; s_part holds
// kNormThreads / 32 floats.
template <typename T, int V>
__device__ __forceinline__ float row_rms_factor(const T* xr, int64_t groups, float inv_d, float eps, float* s_part) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float acc = 0.0f;
#pragma unroll 2
  for (int64_t g = threadIdx.x; g < groups; g += kNormThreads) {
    float f[V];
    load_v<T, V>(xr + g * V, f);
#pragma unroll
    for (int i = 0; i < V; ++i) acc = __fadd_rn(acc, __fmul_rn(f[i], f[i]));
  }
  acc = warp_sum(acc);
  if (lane == 0) s_part[warp] = acc;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int i = 0; i < kNormThreads / 32; ++i) total += s_part[i];
  const float rr = rsqrtf(__fadd_rn(__fmul_rn(total, inv_d), eps));
  __syncthreads();  // s_part is the next row's
  return rr;
}

template <typename T, int V>
__global__ void __launch_bounds__(kNormThreads) rms_norm_kernel(const T* __restrict__ x, const float* __restrict__ w,
                                                                T* __restrict__ out, int64_t rows, int64_t d,
                                                                float inv_d, float eps) {
  __shared__ float s_part[kNormThreads / 32];
  const int64_t groups = d / V;
#pragma unroll 1
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * d;
    const float rr = row_rms_factor<T, V>(xr, groups, inv_d, eps, s_part);
    T* orow = out + r * d;
#pragma unroll 2
    for (int64_t g = threadIdx.x; g < groups; g += kNormThreads) {
      float f[V], wv[V];
      load_v<T, V>(xr + g * V, f);
      load_w<V>(w + g * V, wv);
#pragma unroll
      for (int i = 0; i < V; ++i) f[i] = __fmul_rn(wv[i], __fmul_rn(f[i], rr));
      store_v<T, V>(orow + g * V, f);
    }
  }
}

template <typename T, int V, bool NORM>
__global__ void __launch_bounds__(kRowWarps * 32) rope_rows_kernel(const T* __restrict__ x,
                                                                   const float* __restrict__ cs,
                                                                   const float* __restrict__ sn, T* __restrict__ out,
                                                                   int64_t tokens, int64_t heads, int64_t d,
                                                                   int64_t half, bool inverse, float inv_d,
                                                                   float eps) {
  const int lane = threadIdx.x % 32;
  const int64_t rows = tokens * heads, tail = d - 2 * half;
#pragma unroll 1
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / 32; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kRowWarps) {
    const int64_t t = row / heads;
    const T* xr = x + row * d;
    T* orow = out + row * d;
    float scale = 1.0f;
    if constexpr (NORM) {
      float acc = 0.0f;
#pragma unroll 2
      for (int64_t g = lane; g < d / V; g += 32) {
        float f[V];
        load_v<T, V>(xr + g * V, f);
#pragma unroll
        for (int i = 0; i < V; ++i) acc = __fadd_rn(acc, __fmul_rn(f[i], f[i]));
      }
      scale = round_to<T>(rsqrtf(__fadd_rn(__fmul_rn(warp_sum(acc), inv_d), eps)));
    }
#pragma unroll 2
    for (int64_t g = lane; g < tail / V; g += 32) {
      float f[V];
      load_v<T, V>(xr + g * V, f);
      if constexpr (NORM) {
#pragma unroll
        for (int i = 0; i < V; ++i) f[i] = __fmul_rn(f[i], scale);
      }
      store_v<T, V>(orow + g * V, f);
    }
    const float* cr = cs + t * half;
    const float* sr = sn + t * half;
    for (int64_t j = lane; j < half; j += 32) {
      float a = Num<T>::load(xr[tail + 2 * j]), b = Num<T>::load(xr[tail + 2 * j + 1]);
      if constexpr (NORM) a = round_to<T>(__fmul_rn(a, scale)), b = round_to<T>(__fmul_rn(b, scale));
      const float c = cr[j], s = sr[j];
      const float ac = __fmul_rn(a, c), bs = __fmul_rn(b, s), bc = __fmul_rn(b, c), as = __fmul_rn(a, s);
      orow[tail + 2 * j] = Num<T>::store(inverse ? __fadd_rn(ac, bs) : __fsub_rn(ac, bs));
      orow[tail + 2 * j + 1] = Num<T>::store(inverse ? __fsub_rn(bc, as) : __fadd_rn(bc, as));
    }
  }
}

// One warp a unit, a row being nope / 64 FP8 units and one rope unit: FP8 block b's channels 64b + lane and
// 64b + 32 + lane, the block's amax by a warp butterfly; the rope unit rounds the rope channels to bf16. A row's
// units run in parallel, so one token costs one load round, not one a block.
template <typename T>
__global__ void __launch_bounds__(kRowWarps * 32) kv_fp8_fake_quant_kernel(const T* __restrict__ x,
                                                                           T* __restrict__ out, int64_t rows,
                                                                           int64_t d, int64_t rope_dim) {
  const int lane = threadIdx.x % 32;
  const int64_t nope = d - rope_dim, per_row = nope / kFp8Block + 1;
#pragma unroll 1
  for (int64_t unit = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / 32; unit < rows * per_row;
       unit += static_cast<int64_t>(gridDim.x) * kRowWarps) {
    const int64_t row = unit / per_row, b0 = (unit % per_row) * kFp8Block;
    const T* xr = x + row * d;
    T* orow = out + row * d;
    if (b0 < nope) {
      const float v0 = Num<T>::load(xr[b0 + lane]), v1 = Num<T>::load(xr[b0 + 32 + lane]);
      const float scale = exp2_int(pow2_scale_exp(warp_max(fmaxf(fabsf(v0), fabsf(v1))), kFp8AmaxFloor, kFp8InvMax));
      orow[b0 + lane] = Num<T>::store(__fmul_rn(fp8_decode(fp8_encode(v0, scale)), scale));
      orow[b0 + 32 + lane] = Num<T>::store(__fmul_rn(fp8_decode(fp8_encode(v1, scale)), scale));
    } else {
      for (int64_t i = nope + lane; i < d; i += 32) orow[i] = Num<T>::store(round_to<__nv_bfloat16>(Num<T>::load(xr[i])));
    }
  }
}

// The kv path of an attention layer in one launch: rms_norm (weight w), the rotation of the last 2 * half channels
// and, with FP8, the FP8 row format's quantise-dequantise, each value rounded where rms_norm_kernel,
// rope_rows_kernel<NORM = false> and kv_fp8_fake_quant_kernel round it (to T after the norm and after the rotation;
// the nope channels through e4m3 in blocks of 64; the rope channels to bf16), so it equals those three launches bit
// for bit. One CTA a row; thread g holds the row's group g of V channels (d / V <= kNormThreads; d - 2 * half a
// multiple of V, and of 64 with FP8). An FP8 block's 64 / V threads are consecutive lanes of one warp.
template <typename T, int V, bool FP8>
__global__ void __launch_bounds__(kNormThreads) kv_norm_rope_quant_kernel(const T* __restrict__ x,
                                                                          const float* __restrict__ w,
                                                                          const float* __restrict__ cs,
                                                                          const float* __restrict__ sn,
                                                                          T* __restrict__ out, int64_t rows,
                                                                          int64_t d, int64_t half, float inv_d,
                                                                          float eps) {
  static_assert(V >= 2 && 64 % V == 0, "an FP8 block is whole groups within one warp");
  __shared__ float s_part[kNormThreads / 32];
  const int64_t groups = d / V, tail = d - 2 * half, g = threadIdx.x;
  const bool mine = g < groups, rope = g * V >= tail;
#pragma unroll 1
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * d;
    const float rr = row_rms_factor<T, V>(xr, groups, inv_d, eps, s_part);
    float f[V];
    float amax = 0.0f;
    if (mine) {
      float wv[V];
      load_v<T, V>(xr + g * V, f);
      load_w<V>(w + g * V, wv);
#pragma unroll
      for (int i = 0; i < V; ++i) f[i] = round_to<T>(__fmul_rn(wv[i], __fmul_rn(f[i], rr)));
      if (rope) {  // pairs (tail + 2j, tail + 2j + 1), j = j0 .. j0 + V / 2 - 1
        const int64_t j0 = (g * V - tail) / 2;
        const float* cr = cs + r * half + j0;
        const float* sr = sn + r * half + j0;
#pragma unroll
        for (int p = 0; p < V / 2; ++p) {
          const float a = f[2 * p], b = f[2 * p + 1], c = cr[p], sv = sr[p];
          const float ac = __fmul_rn(a, c), bs = __fmul_rn(b, sv), bc = __fmul_rn(b, c), as = __fmul_rn(a, sv);
          f[2 * p] = round_to<T>(__fsub_rn(ac, bs));
          f[2 * p + 1] = round_to<T>(__fadd_rn(bc, as));
        }
        if constexpr (FP8) {
#pragma unroll
          for (int i = 0; i < V; ++i) f[i] = round_to<T>(round_to<__nv_bfloat16>(f[i]));
        }
      } else if constexpr (FP8) {
#pragma unroll
        for (int i = 0; i < V; ++i) amax = fmaxf(amax, fabsf(f[i]));
      }
    }
    if constexpr (FP8) {
      // the block's amax over its 64 / V lanes; every lane takes part (rope lanes' blocks are theirs alone: tail is
      // a multiple of 64)
#pragma unroll
      for (int o = 1; o < 64 / V; o *= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      if (mine && !rope) {
        const float scale = exp2_int(pow2_scale_exp(amax, kFp8AmaxFloor, kFp8InvMax));
#pragma unroll
        for (int i = 0; i < V; ++i) f[i] = __fmul_rn(fp8_decode(fp8_encode(f[i], scale)), scale);
      }
    }
    if (mine) store_v<T, V>(out + r * d + g * V, f);
  }
}

// One warp a row of 32 * E channels, lane l holding channels E l .. E l + E - 1. Hadamard stages h < E inside the
// lane, the others across lanes (partner lane ^ h / E); each pair (a, b), a the lower channel, becomes (a + b, a - b)
// as in the reference. Then FP4 blocks of 32 channels: 32 / E lanes each, amax by a butterfly over them.
template <typename T, int E>
__global__ void __launch_bounds__(kRowWarps * 32) idx_fp4_hadamard_fake_quant_kernel(const T* __restrict__ x,
                                                                                     T* __restrict__ out,
                                                                                     int64_t rows, float inv_sqrt_d) {
  constexpr int kD = 32 * E;
  const int lane = threadIdx.x % 32;
#pragma unroll 1
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / 32; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kRowWarps) {
    const T* xr = x + row * kD + E * lane;
    float v[E];
#pragma unroll
    for (int k = 0; k < E; ++k) v[k] = Num<T>::load(xr[k]);
#pragma unroll
    for (int h = 1; h < E; h *= 2) {
#pragma unroll
      for (int k = 0; k < E; ++k) {
        if ((k & h) == 0) {
          const float a = v[k], b = v[k + h];
          v[k] = __fadd_rn(a, b), v[k + h] = __fsub_rn(a, b);
        }
      }
    }
#pragma unroll
    for (int h = 1; h < 32; h *= 2) {  // channel stride h * E
      const bool upper = (lane & h) != 0;
#pragma unroll
      for (int k = 0; k < E; ++k) {
        const float other = __shfl_xor_sync(0xffffffffu, v[k], h);
        v[k] = upper ? __fsub_rn(other, v[k]) : __fadd_rn(v[k], other);
      }
    }
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < E; ++k) {
      v[k] = __fmul_rn(v[k], inv_sqrt_d);
      amax = fmaxf(amax, fabsf(v[k]));
    }
#pragma unroll
    for (int o = 1; o < 32 / E; o *= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float scale = exp2_int(pow2_scale_exp(amax, kFp4AmaxFloor, kFp4InvMax));
    T* orow = out + row * kD + E * lane;
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const float y = __fdiv_rn(v[k], scale);
      const float mag = e2m1_magnitude(e2m1_encode(y) & 7);
      orow[k] = Num<T>::store(__fmul_rn(copysignf(mag, y), scale));
    }
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T>
void rms_norm_typed(const void* x, const float* w, void* out, int64_t rows, int64_t d, float eps,
                    cudaStream_t stream) {
  constexpr int kV = 16 / sizeof(T);
  const bool vec = d % kV == 0 && aligned16(x) && aligned16(w) && aligned16(out);
  const int grid = static_cast<int>(rows < 8LL * num_sms() ? rows : 8LL * num_sms());
  const float inv_d = 1.0f / static_cast<float>(d);
  const T* xt = static_cast<const T*>(x);
  T* ot = static_cast<T*>(out);
  if (vec) {
    rms_norm_kernel<T, kV><<<grid, kNormThreads, 0, stream>>>(xt, w, ot, rows, d, inv_d, eps);
  } else {
    rms_norm_kernel<T, 1><<<grid, kNormThreads, 0, stream>>>(xt, w, ot, rows, d, inv_d, eps);
  }
}

template <typename T, int V>
void rope_rows_norm(bool norm, const T* x, const float* cs, const float* sn, T* out, int64_t tokens, int64_t heads,
                    int64_t d, int64_t half, bool inverse, float eps, int grid, cudaStream_t stream) {
  const float inv_d = 1.0f / static_cast<float>(d);
  if (norm) {
    rope_rows_kernel<T, V, true><<<grid, kRowWarps * 32, 0, stream>>>(x, cs, sn, out, tokens, heads, d, half,
                                                                      inverse, inv_d, eps);
  } else {
    rope_rows_kernel<T, V, false><<<grid, kRowWarps * 32, 0, stream>>>(x, cs, sn, out, tokens, heads, d, half,
                                                                       inverse, inv_d, eps);
  }
}

template <typename T>
void rope_rows_typed(const void* x, const float* cs, const float* sn, void* out, int64_t tokens, int64_t heads,
                     int64_t d, int64_t half, bool norm, bool inverse, float eps, cudaStream_t stream) {
  constexpr int kV = 16 / sizeof(T);
  const int64_t rows = tokens * heads, blocks = (rows + kRowWarps - 1) / kRowWarps;
  const int grid = static_cast<int>(blocks < 16LL * num_sms() ? blocks : 16LL * num_sms());
  const bool vec = d % kV == 0 && (d - 2 * half) % kV == 0 && aligned16(x) && aligned16(out);
  const T* xt = static_cast<const T*>(x);
  T* ot = static_cast<T*>(out);
  if (vec) {
    rope_rows_norm<T, kV>(norm, xt, cs, sn, ot, tokens, heads, d, half, inverse, eps, grid, stream);
  } else {
    rope_rows_norm<T, 1>(norm, xt, cs, sn, ot, tokens, heads, d, half, inverse, eps, grid, stream);
  }
}

}  // namespace

void rms_norm_launch(const void* x, const float* w, void* out, int dtype, int64_t rows, int64_t d, float eps,
                     cudaStream_t stream) {
  if (rows <= 0 || d <= 0) return;
  switch (dtype) {
    case 0: rms_norm_typed<float>(x, w, out, rows, d, eps, stream); break;
    case 1: rms_norm_typed<__nv_bfloat16>(x, w, out, rows, d, eps, stream); break;
    default: rms_norm_typed<__half>(x, w, out, rows, d, eps, stream); break;
  }
}

void rope_rows_launch(const void* x, const float* cos, const float* sin, void* out, int dtype, int64_t tokens,
                      int64_t heads, int64_t d, int64_t half, bool norm, bool inverse, float eps,
                      cudaStream_t stream) {
  if (tokens <= 0 || heads <= 0 || d <= 0) return;
  switch (dtype) {
    case 0: rope_rows_typed<float>(x, cos, sin, out, tokens, heads, d, half, norm, inverse, eps, stream); break;
    case 1:
      rope_rows_typed<__nv_bfloat16>(x, cos, sin, out, tokens, heads, d, half, norm, inverse, eps, stream);
      break;
    default: rope_rows_typed<__half>(x, cos, sin, out, tokens, heads, d, half, norm, inverse, eps, stream); break;
  }
}

void kv_fp8_fake_quant_launch(const void* x, void* out, int dtype, int64_t rows, int64_t d, int64_t rope_dim,
                              cudaStream_t stream) {
  if (rows <= 0 || d <= 0) return;
  const int64_t blocks = (rows * ((d - rope_dim) / kFp8Block + 1) + kRowWarps - 1) / kRowWarps;
  const int grid = static_cast<int>(blocks < 16LL * num_sms() ? blocks : 16LL * num_sms());
  switch (dtype) {
    case 0:
      kv_fp8_fake_quant_kernel<float><<<grid, kRowWarps * 32, 0, stream>>>(static_cast<const float*>(x),
                                                                          static_cast<float*>(out), rows, d, rope_dim);
      break;
    case 1:
      kv_fp8_fake_quant_kernel<__nv_bfloat16><<<grid, kRowWarps * 32, 0, stream>>>(
          static_cast<const __nv_bfloat16*>(x), static_cast<__nv_bfloat16*>(out), rows, d, rope_dim);
      break;
    default:
      kv_fp8_fake_quant_kernel<__half><<<grid, kRowWarps * 32, 0, stream>>>(static_cast<const __half*>(x),
                                                                           static_cast<__half*>(out), rows, d, rope_dim);
      break;
  }
}

template <typename T>
bool kv_norm_rope_quant_typed(const void* x, const float* w, const float* cs, const float* sn, void* out,
                              int64_t rows, int64_t d, int64_t half, bool fp8, float eps, cudaStream_t stream) {
  constexpr int kV = 16 / sizeof(T);
  const int64_t tail = d - 2 * half;
  if (d % kV != 0 || tail % kV != 0 || tail < 0 || d / kV > kNormThreads || (fp8 && (tail <= 0 || tail % 64 != 0)) ||
      !aligned16(x) || !aligned16(w) || !aligned16(out)) {
    return false;
  }
  const int grid = static_cast<int>(rows < 8LL * num_sms() ? rows : 8LL * num_sms());
  const float inv_d = 1.0f / static_cast<float>(d);
  const T* xt = static_cast<const T*>(x);
  T* ot = static_cast<T*>(out);
  if (fp8) {
    kv_norm_rope_quant_kernel<T, kV, true><<<grid, kNormThreads, 0, stream>>>(xt, w, cs, sn, ot, rows, d, half, inv_d,
                                                                               eps);
  } else {
    kv_norm_rope_quant_kernel<T, kV, false><<<grid, kNormThreads, 0, stream>>>(xt, w, cs, sn, ot, rows, d, half,
                                                                                inv_d, eps);
  }
  return true;
}

template <typename T>
void idx_fp4_typed(const void* x, void* out, int64_t rows, int64_t d, float inv_sqrt_d, int grid,
                   cudaStream_t stream) {
  const T* xt = static_cast<const T*>(x);
  T* ot = static_cast<T*>(out);
  switch (d) {
    case 32: idx_fp4_hadamard_fake_quant_kernel<T, 1><<<grid, kRowWarps * 32, 0, stream>>>(xt, ot, rows, inv_sqrt_d); break;
    case 64: idx_fp4_hadamard_fake_quant_kernel<T, 2><<<grid, kRowWarps * 32, 0, stream>>>(xt, ot, rows, inv_sqrt_d); break;
    case 128: idx_fp4_hadamard_fake_quant_kernel<T, 4><<<grid, kRowWarps * 32, 0, stream>>>(xt, ot, rows, inv_sqrt_d); break;
    default: idx_fp4_hadamard_fake_quant_kernel<T, 8><<<grid, kRowWarps * 32, 0, stream>>>(xt, ot, rows, inv_sqrt_d); break;
  }
}

void idx_fp4_hadamard_fake_quant_launch(const void* x, void* out, int dtype, int64_t rows, int64_t d, float inv_sqrt_d,
                                        cudaStream_t stream) {
  if (rows <= 0) return;
  const int64_t blocks = (rows + kRowWarps - 1) / kRowWarps;
  const int grid = static_cast<int>(blocks < 16LL * num_sms() ? blocks : 16LL * num_sms());
  switch (dtype) {
    case 0: idx_fp4_typed<float>(x, out, rows, d, inv_sqrt_d, grid, stream); break;
    case 1: idx_fp4_typed<__nv_bfloat16>(x, out, rows, d, inv_sqrt_d, grid, stream); break;
    default: idx_fp4_typed<__half>(x, out, rows, d, inv_sqrt_d, grid, stream); break;
  }
}

bool kv_norm_rope_quant_launch(const void* x, const float* w, const float* cos, const float* sin, void* out, int dtype,
                               int64_t rows, int64_t d, int64_t half, bool fp8, float eps, cudaStream_t stream) {
  if (rows <= 0 || d <= 0) return true;
  switch (dtype) {
    case 0: return kv_norm_rope_quant_typed<float>(x, w, cos, sin, out, rows, d, half, fp8, eps, stream);
    case 1: return kv_norm_rope_quant_typed<__nv_bfloat16>(x, w, cos, sin, out, rows, d, half, fp8, eps, stream);
    default: return kv_norm_rope_quant_typed<__half>(x, w, cos, sin, out, rows, d, half, fp8, eps, stream);
  }
}

}  // namespace dsv4rt
