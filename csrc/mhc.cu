// mHC family (ops/mhc.py): hc_pre and hc_head in at most two launches, hc_post in one. All math in fp32.
//
// hc_pre / hc_head (mix rows M = (2+n)n / n over the flattened streams f = x[t] of K = n*D channels):
//   * partial kernel (only when K > kFusedMaxK): grid (splits, token tiles); CTA (s, i) takes the channel slice
//     [s*kc, (s+1)*kc) of the tiles' tokens, a warp a token at a time (lanes over float4 columns, the M dot products
//     and the sum of squares in registers, then a warp butterfly). Its M + 1 partial sums go to the front of the
//     token's own output row (the collapsed x, D elements: the launcher takes at most as many splits as fit there);
//   * finish kernel: one CTA per token sums the partials (or, without the partial kernel, computes the whole mix
//     itself), then mix = dot * rsqrt(mean(f^2) + norm_eps), pre = sigmoid(mix * scale[0] + base) + eps. Only then
//     (after a barrier) is the output row overwritten: warps 1.. collapse x = sum_j pre[j] x[t, j], while warp 0
//     computes post and the Sinkhorn matrix (hc_pre): for n <= 4 the whole matrix in each lane's registers
//     (sinkhorn_regs), else one matrix element per lane (two when n*n > 32) in shared memory; row and column sums
//     in index order; the reference's order of normalisations and eps placement (softmax + eps, column, then
//     iters - 1 times row and column). With a norm weight (the block's input / post-attention norm, the final
//     norm after hc_head) the collapsing warps then RMS-normalise the collapsed row as rms_norm_kernel does (the sum
//     of squares of the rounded outputs, reduced among those warps at a named barrier, then each thread rescales
//     the groups it stored): one launch of rms_norm less a sublayer.
// hc_post: one thread per (token, 4 channels): the n source streams and y in registers, n destination streams out.
// Every grid is launched with programmatic dependent launch (DSV4RT_MHC_PDL=0: plain launches): hc_post lets the
// next grid start at once, the partial grid brings its weight slice into L2 before it waits, the finish grid loads
// its first stream values before it waits. Every reduction has a fixed order (no atomics), so results are
// deterministic. Grids depend on shapes only.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include <cuda_bf16.h>

#include "launch.cuh"
#include "mhc.h"

namespace dsv4rt {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kPostThreads = 128;
constexpr int kMaxN = 8;
constexpr int64_t kFusedMaxK = 2048;  // up to this many channels per token, the finish kernel computes the mix alone
constexpr int64_t kSplitAlign = 128;  // channels per split: a multiple of 32 lanes x float4

__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }

__device__ __forceinline__ float4 load4(const __nv_bfloat16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}

__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

__device__ __forceinline__ void store4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }

__device__ __forceinline__ void store4(__nv_bfloat16* p, float4 v) {
  __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w);
  uint2 u;
  u.x = *reinterpret_cast<const uint32_t*>(&a);
  u.y = *reinterpret_cast<const uint32_t*>(&b);
  *reinterpret_cast<uint2*>(p) = u;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;  // the butterfly leaves the same bits in every lane
}

__device__ __forceinline__ float sigmoidf(float v) { return 1.0f / (1.0f + expf(-v)); }

// v rounded to T and back (what a store to T then a load reads)
template <typename T>
__device__ __forceinline__ float round_t(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return __bfloat162float(__float2bfloat16_rn(v));
  }
}

// v rounded to T, componentwise (the value a load of the stored v gives)
template <typename T>
__device__ __forceinline__ float4 round4(float4 v) {
  return make_float4(round_t<T>(v.x), round_t<T>(v.y), round_t<T>(v.z), round_t<T>(v.w));
}

// hc_post's value of destination stream k at 4 channels: post[k] * y + sum_j comb[j, k] * xv[j] (j < n, in index
// order). hc_post_kernel and the fused partial grid of hc_post_pre both compute it here: the same bits.
template <int NX>
__device__ __forceinline__ float4 post_mix(const float4 (&xv)[NX], float4 yv, const float* comb, const float* post,
                                           int n, int k) {
  float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
  for (int j = 0; j < NX; ++j) {
    if (j < n) {
      const float c = __ldg(comb + j * n + k);
      s.x += c * xv[j].x;
      s.y += c * xv[j].y;
      s.z += c * xv[j].z;
      s.w += c * xv[j].w;
    }
  }
  const float p = __ldg(post + k);
  return make_float4(p * yv.x + s.x, p * yv.y + s.y, p * yv.z + s.z, p * yv.w + s.w);
}

// Barrier `id` among the first-arriving `threads` threads (a multiple of 32) of the CTA.
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// acc[m] += fn[m, 4g..4g+3] . f[4g..4g+3] for m < m_rows, acc[CAP] += |f[4g..4g+3]|^2, over float4 groups
// g = g0, g0 + step, ... < g1. The loads of a group's rows carry no condition (rows past m_rows read row m_rows - 1
// again, into sums nobody reads), so up to kMixChunk of them are in flight together. Under a runtime `m < m_rows`
// test each load waited for the memory before the next was issued (H200, Flash dims, one token: hc_pre 22.6 ->
// 17.8 us a call, graph-replayed).
constexpr int kMixChunk = 24;

// load_f(g): the float4 group g of f (a load; hc_post_pre's partial grid computes and stores it first).
template <int CAP, typename LoadF>
__device__ __forceinline__ void mix_accumulate_f(float (&acc)[CAP + 1], const float* __restrict__ fn, LoadF load_f,
                                                 int64_t k_dim, int m_rows, int64_t g0, int64_t g1, int64_t step) {
  for (int64_t g = g0; g < g1; g += step) {
    const float4 xv = load_f(g);
    acc[CAP] += xv.x * xv.x + xv.y * xv.y + xv.z * xv.z + xv.w * xv.w;
    if constexpr (CAP <= kMixChunk) {  // n <= 4 (hc_pre) / n <= 24 (hc_head)
      float4 w[CAP];
#pragma unroll
      for (int m = 0; m < CAP; ++m) {
        const int r = m < m_rows ? m : m_rows - 1;
        w[m] = __ldg(reinterpret_cast<const float4*>(fn + r * k_dim + 4 * g));
      }
#pragma unroll
      for (int m = 0; m < CAP; ++m) acc[m] += w[m].x * xv.x + w[m].y * xv.y + w[m].z * xv.z + w[m].w * xv.w;
    } else {  // more rows than registers for both the sums and the rows in flight: a row at a time
#pragma unroll
      for (int m = 0; m < CAP; ++m) {
        if (m < m_rows) {
          const float4 w = __ldg(reinterpret_cast<const float4*>(fn + m * k_dim + 4 * g));
          acc[m] += w.x * xv.x + w.y * xv.y + w.z * xv.z + w.w * xv.w;
        }
      }
    }
  }
}

template <int CAP, typename T>
__device__ __forceinline__ void mix_accumulate(float (&acc)[CAP + 1], const float* __restrict__ fn,
                                               const T* __restrict__ f, int64_t k_dim, int m_rows, int64_t g0,
                                               int64_t g1, int64_t step) {
  mix_accumulate_f<CAP>(acc, fn, [f](int64_t g) { return load4(f + 4 * g); }, k_dim, m_rows, g0, g1, step);
}

// MINB 1: the grid fits on the SMs at once, so a thread may take every register (all of a group's rows in flight, see
// mix_accumulate). MINB 2: no minimum in the launch bounds, the compiler's choice (128 registers at CAP 24; an
// explicit minimum of 2 CTAs an SM gave the same count but issued the row loads one or two at a time between the
// multiplies: H200, hc_pre at 64 tokens, partial grid 8.8 -> 15.5 us).
// POST (hc_post_pre, n <= 4): each group of the slice is first made from the streams before (post_mix, as
// hc_post_kernel makes it), stored into x, and its stored (rounded) value summed: the same partial sums, in the same
// order, as this grid computes over hc_post's output.
template <int CAP, typename T, int MINB, bool POST = false>
__global__ void __launch_bounds__(kThreads, MINB == 1 ? 1 : 0)
    hc_mix_partial_kernel(HcMixArgs a, int m_rows, int64_t kc, int tokens_per_warp) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t k_dim = static_cast<int64_t>(a.n) * a.d;
  const int split = blockIdx.x;
  const int64_t g0 = split * kc / 4, g1 = (k_dim < (split + 1) * kc ? k_dim : (split + 1) * kc) / 4;
  // the weights are no grid's output: the CTA's slice of them is brought into L2 while the grid before still runs
  // (one-wave grids, first token tile only; at most kThreads * 4 lines)
  if (MINB == 1 && blockIdx.y == 0) {
    const int64_t lines_a_row = (g1 - g0) * 16 / 128, lines = m_rows * lines_a_row;
    for (int64_t i = threadIdx.x; i < lines && i < 4 * kThreads; i += kThreads) {
      const int64_t m = i / lines_a_row, l = i - m * lines_a_row;
      prefetch_l2(a.fn + m * k_dim + 4 * g0 + 32 * l);
    }
  }
  pdl_wait();               // x is the grid before's output
  pdl_launch_dependents();  // after the wait: the finish grid may read x before its own wait
  const int64_t t0 = (static_cast<int64_t>(blockIdx.y) * kWarps + warp) * tokens_per_warp;
  const T* x = static_cast<const T*>(a.x);
  for (int i = 0; i < tokens_per_warp; ++i) {
    const int64_t t = t0 + i;
    if (t >= a.n_tokens) break;
    float acc[CAP + 1] = {};
    if constexpr (POST) {
      const int n = a.n, d = a.d;
      const T* px = static_cast<const T*>(a.post_x) + t * k_dim;
      const T* py = static_cast<const T*>(a.post_y) + t * d;
      const float* pc = a.post_comb + t * n * n;
      const float* pp = a.post_post + t * n;
      T* nx = const_cast<T*>(x) + t * k_dim;  // the launch's own output (a.x)
      auto make = [&](int64_t g) {
        const int f = static_cast<int>(4 * g), k = f / d, c = f - k * d;  // n * D < 2^31 (the binding checks)
        float4 xv[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) xv[j] = load4(px + (j < n ? j : n - 1) * d + c);
        const float4 v = post_mix<4>(xv, load4(py + c), pc, pp, n, k);
        store4(nx + f, v);
        return round4<T>(v);
      };
      mix_accumulate_f<CAP>(acc, a.fn, make, k_dim, m_rows, g0 + lane, g1, 32);
    } else {
      mix_accumulate<CAP>(acc, a.fn, x + t * k_dim, k_dim, m_rows, g0 + lane, g1, 32);
    }
    // partial sums of split s: floats [s*(M+1), (s+1)*(M+1)) of the token's output row; the sum of squares last
    float* part = reinterpret_cast<float*>(static_cast<T*>(a.out) + t * a.d) + split * (m_rows + 1);
#pragma unroll
    for (int m = 0; m <= CAP; ++m) {
      if (m < m_rows || m == CAP) {
        const float v = warp_sum(acc[m]);
        if (lane == 0) part[m == CAP ? m_rows : m] = v;
      }
    }
  }
}

// 1/s correctly rounded, without a branch. For |s| in [2^-126, 2^126) it is __frcp_rn's own fast path (the
// approximate reciprocal and one Newton step), so the same bits; __frcp_rn tests that range and calls a slow path
// otherwise, and that test and call (a convergence region each) serialised a normalisation's four reciprocals: about
// 0.4 us a Sinkhorn iteration on an H200 (sm_90a SASS: 8 BSSY / BSYNC regions an iteration). Outside the range
// (never a Sinkhorn sum: entries <= 1 + eps, sums >= eps) s is scaled by 2^64 or 2^-64 first, exactly, and the
// reciprocal scaled back. Measured (H200, Flash dims, one token, finish grid alone, programmatic launches off):
// 20 iterations 5.9 us against 11.9 with __frcp_rn; 1 iteration 3.55 against 3.73 us.
__device__ __forceinline__ float rcp_rn(float s) {
  const float a = fabsf(s);
  const float k = a < 0x1p-126f ? 0x1p64f : (a >= 0x1p126f ? 0x1p-64f : 1.0f);
  const float sk = s * k;
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(sk));
  return fmaf(r, fmaf(-sk, r, 1.0f), r) * k;
}

// The Sinkhorn matrix of hc_pre for n <= NX <= 4: every lane of warp 0 holds the whole matrix in registers (the
// same values in every lane), so a row or column sum is register adds and a normalisation multiplies by one
// correctly rounded reciprocal (rcp_rn) a line: no shared memory, shuffles, barriers or branches in the chain of
// 2 * iters - 1 normalisations, so a normalisation's lines overlap. The reference's order (softmax over the row +
// eps, columns, then iters - 1 times rows and columns) and its sums' index order are kept; x * (1 / s) may differ
// from x / s in the last bit. Lane 0 stores.
template <int NX>
__device__ __forceinline__ void sinkhorn_regs(const HcMixArgs& a, int64_t t, const float* s_mix, float rms) {
  const int n = a.n;
  const float s2 = a.scale[2], eps = a.eps;
  float c[NX][NX];
#pragma unroll
  for (int j = 0; j < NX; ++j) {
#pragma unroll
    for (int k = 0; k < NX; ++k) {
      c[j][k] = j < n && k < n ? s_mix[2 * n + j * n + k] * rms * s2 + a.base[2 * n + j * n + k] : 0.0f;
    }
  }
#pragma unroll
  for (int j = 0; j < NX; ++j) {  // softmax over k, + eps
    float m = c[j][0];
#pragma unroll
    for (int k = 1; k < NX; ++k) {
      if (k < n) m = fmaxf(m, c[j][k]);
    }
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < NX; ++k) {
      c[j][k] = k < n ? expf(c[j][k] - m) : 0.0f;
      sum += c[j][k];
    }
    const float r = rcp_rn(sum);
#pragma unroll
    for (int k = 0; k < NX; ++k) c[j][k] = __fadd_rn(__fmul_rn(c[j][k], r), eps);
  }
  // normalise(std::true_type{}): row j divided by sum_k c[j][k] + eps, for every j; std::false_type{}: the columns
  auto normalise = [&](auto by_rows) {
    constexpr bool kRows = decltype(by_rows)::value;
#pragma unroll
    for (int l = 0; l < NX; ++l) {
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < NX; ++i) {
        if (i < n) sum += kRows ? c[l][i] : c[i][l];
      }
      const float r = rcp_rn(sum + eps);
#pragma unroll
      for (int i = 0; i < NX; ++i) (kRows ? c[l][i] : c[i][l]) *= r;
    }
  };
  normalise(std::false_type{});
  for (int it = 1; it < a.iters; ++it) {
    normalise(std::true_type{});
    normalise(std::false_type{});
  }
  if (threadIdx.x == 0) {
#pragma unroll
    for (int j = 0; j < NX; ++j) {
#pragma unroll
      for (int k = 0; k < NX; ++k) {
        if (j < n && k < n) a.comb[t * n * n + j * n + k] = c[j][k];
      }
    }
  }
}

// x[t, j] at float4 group g for j < NX, NX >= n (rows past n re-read row n - 1: no condition, so all are in flight
// together)
template <int NX, typename T>
__device__ __forceinline__ void load_streams(float4 (&v)[NX], const T* x_row, int n, int d, int64_t g) {
#pragma unroll
  for (int j = 0; j < NX; ++j) v[j] = load4(x_row + static_cast<int64_t>(j < n ? j : n - 1) * d + 4 * g);
}

// First float4 group a thread collapses in mix_finish (negative for warp 0 of hc_pre, which runs the Sinkhorn), and
// the step between its groups.
__device__ __forceinline__ int64_t collapse_first(bool sinkhorn) { return threadIdx.x - (sinkhorn ? 32 : 0); }
__device__ __forceinline__ int collapse_step(bool sinkhorn) { return kThreads - (sinkhorn ? 32 : 0); }

// The rest of hc_pre / hc_head once s_mix holds the token's M dot products and (at index m_rows) its sum of squares:
// pre = sigmoid(mix * rms * scale[0] + base) + eps; then, after a barrier, warp 0 computes post and the Sinkhorn
// matrix (when `sinkhorn`: hc_pre) while the other threads collapse x = sum_j pre[j] x[t, j] into the output row,
// group collapse_first(), then every collapse_step() after it. `cur` holds the thread's first group of x[t]
// (load_streams; loaded by the caller, so that it can be in flight early); each group's successor is loaded before
// the group is summed. Every thread of the CTA calls it.
template <int NX, typename T>
__device__ __forceinline__ void mix_finish(const HcMixArgs& a, int64_t t, const float* s_mix, float* s_pre,
                                           float* s_c, float* s_sq, int m_rows, bool sinkhorn, float4 (&cur)[NX]) {
  const int lane = threadIdx.x % 32, n = a.n, d = a.d;
  const int64_t k_dim = static_cast<int64_t>(n) * d;
  const float rms = 1.0f / sqrtf(s_mix[m_rows] / static_cast<float>(k_dim) + a.norm_eps);
  if (threadIdx.x < n) s_pre[threadIdx.x] = sigmoidf(s_mix[threadIdx.x] * rms * a.scale[0] + a.base[threadIdx.x]) + a.eps;
  __syncthreads();

  if (NX <= 4 && sinkhorn && threadIdx.x < 32 && !a.sinkhorn_smem) {
    if (lane < n) a.post[t * n + lane] = 2.0f * sigmoidf(s_mix[n + lane] * rms * a.scale[1] + a.base[n + lane]);
    sinkhorn_regs<NX <= 4 ? NX : 4>(a, t, s_mix, rms);
  } else if (sinkhorn && threadIdx.x < 32) {  // larger n, or forced: an element a lane, the matrix in shared memory
    if (lane < n) a.post[t * n + lane] = 2.0f * sigmoidf(s_mix[n + lane] * rms * a.scale[1] + a.base[n + lane]);
    const int nn = n * n;
    const float s2 = a.scale[2];
    float c[2] = {0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int idx = lane + 32 * r;
      if (idx < nn) {
        c[r] = s_mix[2 * n + idx] * rms * s2 + a.base[2 * n + idx];
        s_c[idx] = c[r];
      }
    }
    __syncwarp();
    // softmax over k (the row), + eps
    float mx[2] = {0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int idx = lane + 32 * r;
      if (idx < nn) {
        const int j = idx / n;
        float m = s_c[j * n];
#pragma unroll
        for (int k = 1; k < kMaxN; ++k) {
          if (k < n) m = fmaxf(m, s_c[j * n + k]);
        }
        mx[r] = expf(c[r] - m);
      }
    }
    __syncwarp();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int idx = lane + 32 * r;
      if (idx < nn) s_c[idx] = mx[r];
    }
    __syncwarp();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int idx = lane + 32 * r;
      if (idx < nn) {
        const int j = idx / n;
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < kMaxN; ++k) {
          if (k < n) s += s_c[j * n + k];
        }
        c[r] = mx[r] / s + a.eps;
      }
    }
    // rows: divide by sum_k C[j][k] + eps; columns: by sum_j C[j][k] + eps (sums in index order; the loads of a
    // sum unrolled, so they are in flight together)
    auto normalise = [&](bool rows) {
      __syncwarp();
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int idx = lane + 32 * r;
        if (idx < nn) s_c[idx] = c[r];
      }
      __syncwarp();
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int idx = lane + 32 * r;
        if (idx < nn) {
          const int j = idx / n, k = idx - j * n;
          const int first = rows ? j * n : k, stride = rows ? 1 : n;
          float s = 0.0f;
#pragma unroll
          for (int i = 0; i < kMaxN; ++i) {
            if (i < n) s += s_c[first + i * stride];
          }
          c[r] = c[r] / (s + a.eps);
        }
      }
    };
    normalise(false);
    for (int it = 1; it < a.iters; ++it) {
      normalise(true);
      normalise(false);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int idx = lane + 32 * r;
      if (idx < nn) a.comb[t * nn + idx] = c[r];
    }
  } else {
    // collapse: x[t] = sum_j pre[j] x[t, j] (warp 0 is busy with Sinkhorn when `sinkhorn`)
    const T* x_row = static_cast<const T*>(a.x) + t * k_dim;
    T* out_row = static_cast<T*>(a.out) + t * d;
    const int64_t groups = d / 4;
    const int step = collapse_step(sinkhorn);
    float sq = 0.0f;  // with norm_w: the sum of squares of the thread's rounded outputs
    for (int64_t g = collapse_first(sinkhorn); g < groups; g += step) {
      float4 next[NX];
      if (g + step < groups) load_streams<NX>(next, x_row, n, d, g + step);
      float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (int j = 0; j < NX; ++j) {
        if (j < n) {
          const float p = s_pre[j];
          acc.x += p * cur[j].x;
          acc.y += p * cur[j].y;
          acc.z += p * cur[j].z;
          acc.w += p * cur[j].w;
        }
      }
      store4(out_row + 4 * g, acc);
      if (a.norm_w != nullptr) {
        const float r[4] = {round_t<T>(acc.x), round_t<T>(acc.y), round_t<T>(acc.z), round_t<T>(acc.w)};
#pragma unroll
        for (int i = 0; i < 4; ++i) sq = __fadd_rn(sq, __fmul_rn(r[i], r[i]));
      }
#pragma unroll
      for (int j = 0; j < NX; ++j) cur[j] = next[j];
    }
    if (a.norm_w != nullptr) {
      // rms_norm of the collapsed row (rms_norm_kernel's arithmetic: mean = sum * (1 / d), w * (x * r) each
      // rounded to fp32), among the collapsing warps only (named barrier 1), so the Sinkhorn warp is not waited
      // for. Each thread rescales the groups it stored (its own writes: visible to it).
      const int cw = step / 32, w0 = sinkhorn ? 1 : 0;
      sq = warp_sum(sq);
      if (lane == 0) s_sq[threadIdx.x / 32 - w0] = sq;
      named_bar_sync(1, step);
      float total = 0.0f;
      for (int w = 0; w < cw; ++w) total = __fadd_rn(total, s_sq[w]);
      const float rr = rsqrtf(__fadd_rn(__fmul_rn(total, 1.0f / static_cast<float>(d)), a.out_eps));
      for (int64_t g = collapse_first(sinkhorn); g < groups; g += step) {
        const float4 v = load4(out_row + 4 * g);
        const float4 nw = *reinterpret_cast<const float4*>(a.norm_w + 4 * g);
        store4(out_row + 4 * g, make_float4(__fmul_rn(nw.x, __fmul_rn(v.x, rr)), __fmul_rn(nw.y, __fmul_rn(v.y, rr)),
                                            __fmul_rn(nw.z, __fmul_rn(v.z, rr)), __fmul_rn(nw.w, __fmul_rn(v.w, rr))));
      }
    }
  }
}

// The M + 1 sums of acc over the CTA's warps, in warp order, into dst[0..m_rows] (the sum of squares at m_rows).
// Every thread calls; dst is written by threads 0..m_rows after a barrier and visible after the next one.
template <int CAP>
__device__ __forceinline__ void block_mix_sums(float (&acc)[CAP + 1], float (*s_red)[CAP + 1], float* dst,
                                               int m_rows) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int m = 0; m <= CAP; ++m) {
    if (m < m_rows || m == CAP) {
      const float v = warp_sum(acc[m]);
      if (lane == 0) s_red[warp][m == CAP ? m_rows : m] = v;
    }
  }
  __syncthreads();
  if (threadIdx.x <= m_rows) {
    float v = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) v += s_red[w][threadIdx.x];
    dst[threadIdx.x] = v;
  }
}

// Launched with programmatic dependent launch. After the partial grid (n_splits > 0), which waits for the grid
// before it and only then lets this grid start, x is complete: the collapse's first loads go out before the wait.
// NX >= n: streams a thread holds for the collapse (4 for n <= 4, so no load is repeated at the DSV4 value n = 4).
template <int CAP, int NX, typename T, int MINB>
__global__ void __launch_bounds__(kThreads, MINB) hc_mix_finish_kernel(HcMixArgs a, int m_rows, int n_splits) {
  __shared__ float s_mix[CAP + 1];
  __shared__ float s_red[kWarps][CAP + 1];
  __shared__ float s_pre[kMaxN];
  __shared__ float s_c[kMaxN * kMaxN];
  __shared__ float s_sq[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = blockIdx.x;
  const int64_t k_dim = static_cast<int64_t>(a.n) * a.d;
  const T* x_row = static_cast<const T*>(a.x) + t * k_dim;
  const bool sinkhorn = !a.head;
  const int64_t g = collapse_first(sinkhorn);
  float4 cur[NX];
  // (hc_post_pre's fused partial grid writes x: loaded after the wait)
  if (n_splits > 0 && !a.post_fused && g >= 0 && g < a.d / 4) load_streams<NX>(cur, x_row, a.n, a.d, g);
  pdl_wait();
  if (n_splits > 0) {
    // value i = warp + q * kWarps of the M + 1, summed over the splits s = lane, lane + 32, ... in that order, then
    // across the lanes; every load of a pass issued before any is added
    constexpr int kPer = (CAP + 1 + kWarps - 1) / kWarps;
    const float* part = reinterpret_cast<const float*>(static_cast<T*>(a.out) + t * a.d);
    float v[kPer] = {};
#pragma unroll 4
    for (int s0 = 0; s0 < n_splits; s0 += 32) {
      const int s = s0 + lane;
      float p[kPer];
#pragma unroll
      for (int q = 0; q < kPer; ++q) {
        const int i = warp + q * kWarps;
        p[q] = s < n_splits && i <= m_rows ? part[s * (m_rows + 1) + i] : 0.0f;
      }
#pragma unroll
      for (int q = 0; q < kPer; ++q) v[q] += p[q];
    }
#pragma unroll
    for (int q = 0; q < kPer; ++q) {
      const int i = warp + q * kWarps;
      const float sum = warp_sum(v[q]);
      if (lane == 0 && i <= m_rows) s_mix[i] = sum;
    }
  } else {
    float acc[CAP + 1] = {};
    mix_accumulate<CAP>(acc, a.fn, x_row, k_dim, m_rows, threadIdx.x, k_dim / 4, kThreads);
    block_mix_sums<CAP>(acc, s_red, s_mix, m_rows);
  }
  __syncthreads();  // the partials in the output row are all read: the row may be overwritten after the next barrier
  if ((n_splits == 0 || a.post_fused) && g >= 0 && g < a.d / 4) load_streams<NX>(cur, x_row, a.n, a.d, g);
  pdl_launch_dependents();
  mix_finish<NX, T>(a, t, s_mix, s_pre, s_c, s_sq, m_rows, sinkhorn, cur);
}

template <typename T>
__global__ void __launch_bounds__(kPostThreads) hc_post_kernel(HcPostArgs a) {
  const int n = a.n, d = a.d;
  const int64_t groups = d / 4;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kPostThreads + threadIdx.x;
  pdl_launch_dependents();  // the next grid (hc_pre's partial grid: its weights into L2) may be scheduled
  pdl_wait();               // every input may be an output of the grid before
  if (i >= a.n_tokens * groups) return;
  const int64_t t = i / groups, g = i - t * groups;
  const T* x = static_cast<const T*>(a.x) + t * n * d + 4 * g;
  T* out = static_cast<T*>(a.out) + t * n * d + 4 * g;
  float4 xv[kMaxN];
#pragma unroll
  for (int j = 0; j < kMaxN; ++j) {
    if (j < n) xv[j] = load4(x + static_cast<int64_t>(j) * d);
  }
  const float4 yv = load4(static_cast<const T*>(a.y) + t * d + 4 * g);
  const float* comb = a.comb + t * n * n;
  const float* post = a.post + t * n;
#pragma unroll
  for (int k = 0; k < kMaxN; ++k) {
    if (k < n) store4(out + static_cast<int64_t>(k) * d, post_mix<kMaxN>(xv, yv, comb, post, n, k));
  }
}

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Whether environment variable `name` is "0" (a switch turned off).
bool env_is_zero(const char* name) {
  const char* env = std::getenv(name);
  return env != nullptr && env[0] == '0' && env[1] == '\0';
}

// Programmatic dependent launch for every mHC grid (a grid may be scheduled while the one before it runs, and waits
// for it with pdl_wait); DSV4RT_MHC_PDL=0 turns it off (plain launches).
bool use_pdl() { return !env_is_zero("DSV4RT_MHC_PDL"); }

template <typename T>
cudaError_t launch_post(const HcPostArgs& a, cudaStream_t stream) {
  const int64_t blocks = cdiv(a.n_tokens * (a.d / 4), kPostThreads);
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  return launch_ex(hc_post_kernel<T>, dim3(static_cast<unsigned>(blocks)), dim3(kPostThreads), 0, stream, 1,
                   use_pdl(), a);
}

// post (hc_post_pre): a.post_* hold hc_post's inputs and a.x its output. Where the mix is split over CTAs, n <= 4
// (CAP 24) and the partial grid fits on the SMs at once (one CTA an SM: decode up to about 16 tokens), the partial
// grid makes x as it goes (POST); otherwise hc_post's grid runs first. (H100, one boundary with the norm weight,
// graph-replayed: fused 10.57 / 11.77 us at 1 / 8 tokens against 11.43 / 12.35 with hc_post's grid first; at 64
// tokens, where the partial grid takes two CTAs an SM, fused 20.46 against 17.53 us.)
template <int CAP, int NX, typename T>
cudaError_t launch_mix(HcMixArgs a, int m_rows, cudaStream_t stream, bool post) {
  const bool pdl = use_pdl();
  const int64_t k_dim = static_cast<int64_t>(a.n) * a.d;
  // splits whose partials (M + 1 floats each) fit in the token's output row
  const int64_t max_fit = static_cast<int64_t>(a.d) * static_cast<int64_t>(sizeof(T)) / 4 / (m_rows + 1);
  int64_t splits = 0, tiles = 0, kc = 0;
  int tokens_per_warp = 1;
  // DSV4RT_MHC_SPLIT=0: the finish kernel computes the mix (tests)
  if (!(k_dim <= kFusedMaxK || max_fit < 2 || env_is_zero("DSV4RT_MHC_SPLIT"))) {
    tokens_per_warp = a.n_tokens <= 64 ? 1 : a.n_tokens <= 256 ? 2 : 4;
    tiles = cdiv(a.n_tokens, static_cast<int64_t>(kWarps) * tokens_per_warp);
    int64_t want = cdiv(2 * static_cast<int64_t>(num_sms()), tiles);
    want = want < max_fit ? want : max_fit;
    kc = cdiv(cdiv(k_dim, want), kSplitAlign) * kSplitAlign;
    splits = cdiv(k_dim, kc);
    if (splits >= 2 && tiles > 65535) return cudaErrorInvalidConfiguration;
  }
  const bool fit = splits * tiles <= num_sms();
  bool fuse = false;
  if constexpr (CAP == 24 && NX == 4) fuse = post && splits >= 2 && fit && !env_is_zero("DSV4RT_MHC_POST_FUSE");
  if (post && !fuse) {
    HcPostArgs pa{};
    pa.x = a.post_x;
    pa.y = a.post_y;
    pa.post = a.post_post;
    pa.comb = a.post_comb;
    pa.out = const_cast<void*>(a.x);
    pa.n_tokens = a.n_tokens;
    pa.n = a.n;
    pa.d = a.d;
    pa.dtype = a.dtype;
    const cudaError_t err = launch_post<T>(pa, stream);
    if (err != cudaSuccess) return err;
  }
  a.post_fused = fuse;
  int n_splits = 0;
  if (splits >= 2) {
    n_splits = static_cast<int>(splits);
    const dim3 grid(n_splits, static_cast<unsigned>(tiles));
    auto go = [&](auto kernel) {
      return launch_ex(kernel, grid, dim3(kThreads), 0, stream, 1, pdl, a, m_rows, kc, tokens_per_warp);
    };
    cudaError_t err = cudaSuccess;
    if constexpr (CAP == 24 && NX == 4) {  // the only instance that fuses (fuse stays false elsewhere)
      if (fuse) err = go(hc_mix_partial_kernel<CAP, T, 1, true>);
    }
    if (!fuse) err = fit ? go(hc_mix_partial_kernel<CAP, T, 1>) : go(hc_mix_partial_kernel<CAP, T, 2>);
    if (err != cudaSuccess) return err;
  }
  if (a.n_tokens > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(a.n_tokens));
  return a.n_tokens <= num_sms()
             ? launch_ex(hc_mix_finish_kernel<CAP, NX, T, 1>, grid, dim3(kThreads), 0, stream, 1, pdl, a, m_rows,
                         n_splits)
             : launch_ex(hc_mix_finish_kernel<CAP, NX, T, 2>, grid, dim3(kThreads), 0, stream, 1, pdl, a, m_rows,
                         n_splits);
}

template <typename T>
cudaError_t dispatch_mix(const HcMixArgs& a, cudaStream_t stream, bool post) {
  const int m_rows = a.head ? a.n : (2 + a.n) * a.n;
  // (2+n)n <= 24 only for n <= 4; hc_head's n rows reach 8
  if (m_rows <= 8) {
    return a.n <= 4 ? launch_mix<8, 4, T>(a, m_rows, stream, post) : launch_mix<8, kMaxN, T>(a, m_rows, stream, post);
  }
  if (m_rows <= 24) return launch_mix<24, 4, T>(a, m_rows, stream, post);
  if (m_rows <= 48) return launch_mix<48, kMaxN, T>(a, m_rows, stream, post);
  if (m_rows <= 80) return launch_mix<80, kMaxN, T>(a, m_rows, stream, post);
  return cudaErrorInvalidValue;
}

cudaError_t mix_entry(const HcMixArgs& args, cudaStream_t stream, bool post) {
  if (args.n_tokens == 0) return cudaSuccess;
  if (args.n < 1 || args.n > kMaxN || args.d % 4 != 0) return cudaErrorInvalidValue;
  if (post && (args.head || args.post_x == nullptr || args.post_y == nullptr || args.post_post == nullptr ||
               args.post_comb == nullptr)) {
    return cudaErrorInvalidValue;
  }
  HcMixArgs a = args;
  const char* env = std::getenv("DSV4RT_MHC_SINKHORN");  // "smem": the shared-memory form at every n (tests)
  a.sinkhorn_smem = env != nullptr && env[0] == 's';
  a.post_fused = false;
  switch (a.dtype) {
    case 0: return dispatch_mix<float>(a, stream, post);
    case 1: return dispatch_mix<__nv_bfloat16>(a, stream, post);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t hc_mix_launch(const HcMixArgs& args, cudaStream_t stream) { return mix_entry(args, stream, false); }

cudaError_t hc_post_pre_launch(const HcMixArgs& args, cudaStream_t stream) { return mix_entry(args, stream, true); }

cudaError_t hc_post_launch(const HcPostArgs& a, cudaStream_t stream) {
  if (a.n_tokens == 0) return cudaSuccess;
  if (a.n < 1 || a.n > kMaxN || a.d % 4 != 0) return cudaErrorInvalidValue;
  switch (a.dtype) {
    case 0: return launch_post<float>(a, stream);
    case 1: return launch_post<__nv_bfloat16>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace dsv4rt
