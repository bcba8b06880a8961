// MoE family (ops/moe.py): top-k router, hash router, routed experts with the clamped SwiGLU.
//
// Routers: one warp per token, one launch. Scores s = sqrt(softplus(z)) in fp32 (torch's formula: z > 20 ? z :
// log1p(exp(z))); top-k over s + bias by k rounds of a warp arg-max (ties: the lower expert id); weights
// s / sum(s) * scale in the order chosen. A router lets its successor start before it waits for the logits: the
// successor may then run ahead only on data complete before the router's predecessor started (moe_experts with
// x_ready: x, written before moe_gate, which waits for it before it lets the router start).
//
// Experts. A plan kernel (one CTA) turns ids [T, k] into the per-expert pair lists on the device: counts, offsets,
// the distinct chosen experts ("slots", ascending) and the pairs (token, choice) grouped by expert. Ids outside
// [0, E) are dropped, as the reference gives them no weight. A one-token call (direct) needs no plan: slot s is choice
// s, its expert read from ids by the GEMV kernels, the combine takes pair j from row j of y (an id outside [0, E):
// the slot exits, the combine skips it), and the routing chain ends at the router. Then, for small batches:
//   * up: grid (I/8 tiles, S slots); a CTA takes 8 gate rows and the matching 8 up rows of its slot's expert, its
//     4 warps split D. Tensor cores (mma m16n8k16, fp32 accumulation) multiply those 16 rows by up to 8 of the
//     expert's tokens at a time: rows are the A operand loaded straight from global memory in 16-byte vectors
//     (a dot product may take its k in any order, so each lane's 8 contiguous columns serve as the fragment's k
//     indices, and the token operand is loaded with the same mapping); each thread ends up with the gate and up
//     value of one channel for two tokens and writes act = clamped SwiGLU, rounded as the reference rounds.
//     A slot's weights are read once for every 8 * NG of its tokens; a CTA whose slot is unused exits at once.
//   * down: the same over w2 (16 output rows a CTA, I split over the warps), writing y [P, D] fp32;
//   * one-token calls (D and I multiples of 256) run the ROW instances of both kernels instead: the same grids,
//     each warp owning whole rows (up: 2 channels' gate and up rows, down: 4 rows) in fp32 FMAs, so that a warp
//     load is 512 contiguous bytes of one row (see warp_rows_dot); DSV4RT_MOE_ROWS=0 keeps the mma instances;
//   * combine: out[t] = sum_j weights[t, j] * y[pos(t, j)] in fp32, j in order: deterministic.
// x_ready (the caller's promise that x was complete before the kernel preceding this call's first one started): the
// plan kernel lets the up kernel start at once, and the up kernel's shared-expert CTAs (x and the shared weights, no
// plan) do their work before they wait; on the tiny path the shared slot's items run before the wait. The shared
// expert then overlaps the router and the plan.
// Large batches run the two projections as grouped GEMMs (moe_gmm_kernel, or at::_grouped_mm in the binding) around the
// plan (and, with at::_grouped_mm, the activation) and the combine.
// With programmatic dependent launches each kernel's CTAs get resident while its predecessor drains; every CTA
// waits (griddepcontrol.wait) before it reads what its predecessor wrote and before it exits, so each kernel
// completes only after the one before it. The down kernel prefetches its weight tile into L2 before that wait.
#include <cfloat>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <utility>

#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "launch.cuh"
#include "async_copy.cuh"
#include "wgmma.cuh"  // wgmma fences and waits, setmaxnreg (sm_90a)
#include "kv_quant.cuh"  // Num<T>, round_to<T>
#include "moe.h"

namespace dsv4rt {
namespace {

using dsv4rt::cp_async16;  // async_copy.cuh; the L2-hinted variant below overloads it

constexpr int kRouteWarps = 4;     // tokens per router CTA
constexpr int kPlanThreads = 1024;
constexpr int kGemvWarps = 4;      // warps of an up/down CTA, splitting the reduction dimension
constexpr int kGemvThreads = kGemvWarps * 32;
constexpr int kChunk = 32;         // columns a warp covers per 16-byte load of each row (4 lanes x 8 elements)
constexpr int kCombineThreads = 128;
constexpr int kCombineBatch = 8;   // choices (and the shared expert) whose rows a combine thread loads at once

// ------------------------------------------------------------------------------------------ device helpers

__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// The shared expert's down rows: prefetched into L2 as last to be evicted while the routing runs (see keep_shared in
// GemvArgs), then back to normal priority once the down kernel has read them (128-byte lines).
__device__ __forceinline__ void prefetch_l2_keep(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(p), "r"(bytes), "l"(pol)
               : "memory");
#endif
}

__device__ __forceinline__ void l2_normal_priority(const void* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("applypriority.global.L2::evict_normal [%0], 128;" ::"l"(p) : "memory");
#endif
}

// Weights: read once, not kept in L1.
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// Data the predecessor kernel writes while this one may already run (programmatic launch): a coherent load,
// ordered after griddepcontrol.wait.
__device__ __forceinline__ uint4 ld_coherent(const void* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}


// silu(min(g, L)) * clamp(u, -L, L) with the reference's roundings to T: the projections (the matmul output),
// the clamps, silu; the caller rounds the product when it stores it.
template <typename T>
__device__ __forceinline__ float clamped_swiglu(float gate, float up, float limit) {
  const float g = round_to<T>(fminf(round_to<T>(gate), limit));
  const float silu = round_to<T>(g / (1.0f + expf(-g)));
  const float u = round_to<T>(fminf(fmaxf(round_to<T>(up), -limit), limit));
  return silu * u;
}

__device__ __forceinline__ float sqrt_softplus(float z) {
  return sqrtf(z > 20.0f ? z : log1pf(expf(z)));  // F.softplus (beta 1, threshold 20), then sqrt, in fp32
}

// d += A (16 x 16, row) * B (16 x 8, col), fp32 accumulators.
template <typename T>
struct Mma;

template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

template <>
struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

// One 16-byte column chunk (8 elements) of two A rows (ra: row g, rb: row g + 8) and of the token operand (xv:
// token g) gives two k16 steps: elements 0-3 of each, then 4-7. Fragment k indices {2c, 2c+1, 2c+8, 2c+9} of lane
// (g, c) map to its elements {0, 1, 2, 3} (then {4..7}) in A and B alike, so the products pair up exactly.
template <typename T>
__device__ __forceinline__ void mma_chunk(float (&d)[4], const uint4& ra, const uint4& rb, const uint4& xv) {
  Mma<T>::run(d, ra.x, rb.x, ra.y, rb.y, xv.x, xv.y);
  Mma<T>::run(d, ra.z, rb.z, ra.w, rb.w, xv.z, xv.w);
}

// A launch without clusters, with programmatic stream serialization when `pdl` (launch.cuh).
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
                   Args&&... args) {
  return launch_ex(kernel, grid, block, smem, stream, 1, pdl, std::forward<Args>(args)...);
}

// ------------------------------------------------------------------------------------------ gate
constexpr int kGateThreads = 256;
constexpr int kGateU = 8;  // 16-byte weight loads in flight a thread
// Threads a weight row, so that a 4,096-wide row is one round of kGateU loads a thread: fp32 weights 128 (2 rows a
// CTA), bf16 64 (4 rows a CTA: at one token a CSA layer's 2,624 projection rows then fit one wave of resident CTAs,
// where 128 threads a row took two waves, each a DRAM round trip).
__host__ __device__ constexpr int gate_row_threads(int weight_bytes) { return 32 * weight_bytes; }

template <typename T>
__device__ __forceinline__ float4 load4(const T* p);

template <>
__device__ __forceinline__ float4 load4<float>(const float* p) {
  const uint4 v = ld_coherent(p);
  return make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z), __uint_as_float(v.w));
}

template <typename T>
__device__ __forceinline__ float4 load4_half(const T* p) {
  uint2 v;
  asm volatile("ld.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p) : "memory");
  const T* h = reinterpret_cast<const T*>(&v);
  return make_float4(Num<T>::load(h[0]), Num<T>::load(h[1]), Num<T>::load(h[2]), Num<T>::load(h[3]));
}

template <>
__device__ __forceinline__ float4 load4<__nv_bfloat16>(const __nv_bfloat16* p) {
  return load4_half(p);
}

template <>
__device__ __forceinline__ float4 load4<__half>(const __half* p) {
  return load4_half(p);
}

// A 16-byte load of gate weights as fp32: 4 floats, or 8 bf16 (a shift each) or fp16 values widened exactly.
template <typename W>
__device__ __forceinline__ void unpack_w(const uint4& v, float (&f)[16 / sizeof(W)]);

template <>
__device__ __forceinline__ void unpack_w<float>(const uint4& v, float (&f)[4]) {
  f[0] = __uint_as_float(v.x);
  f[1] = __uint_as_float(v.y);
  f[2] = __uint_as_float(v.z);
  f[3] = __uint_as_float(v.w);
}

template <>
__device__ __forceinline__ void unpack_w<__nv_bfloat16>(const uint4& v, float (&f)[8]) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(u[i] << 16);
    f[2 * i + 1] = __uint_as_float(u[i] & 0xFFFF0000u);
  }
}

template <>
__device__ __forceinline__ void unpack_w<__half>(const uint4& v, float (&f)[8]) {
  const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __half22float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

// Grid row e of a GemvWeights: its weight and output, the weight's first grid row, its row count (the output's row
// stride) and x's column offset. The selection runs over constant indices (no dynamic indexing of the parameter arrays);
// rows past the end fall in the last weight.
struct GemvRow {
  const void* w;
  void* out;
  int64_t start, rows, xoff;
};

__device__ __forceinline__ GemvRow gemv_row(const GemvWeights& ws, int64_t e, int64_t dim) {
  GemvRow r{ws.w[0], ws.out[0], 0, ws.end[0], 0};
#pragma unroll
  for (int i = 1; i < moe_gemv_max_weights; ++i) {
    if (i < ws.n && e >= ws.end[i - 1]) {
      r = GemvRow{ws.w[i], ws.out[i], ws.end[i - 1], ws.end[i] - ws.end[i - 1], 0};
    }
  }
  if (ws.group_rows > 0) r.xoff = (e - r.start) / ws.group_rows * dim;  // grouped: row block g reads x's block g
  return r;
}

template <typename O>
__device__ __forceinline__ O out_cast(float v);
template <>
__device__ __forceinline__ float out_cast<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 out_cast<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half out_cast<__half>(float v) { return __float2half_rn(v); }

// out_i[t, r] = sum_d float(x[t, xoff + d]) * float(w_i[r, d]) for each weight i of `ws` (moe_gate: one weight, the
// router's logits): fp32 FMAs, each thread over its columns, then the threads of a row in a fixed order:
// deterministic; the sum rounded once to O (fp32 for moe_gate and linear_fp32, x's type for linear). W: the weights'
// element type, float or bf16 (the checkpoint's: converted exactly, half the bytes of an fp32 copy's read), or
// fp16 / bf16 as x (linear). NT: tokens a thread sums (a power of two >= n_tokens). RT: threads a weight row.
// (At least 2 CTAs an SM for 16-bit x: ptxas otherwise spilled a few bytes at 80 registers in the 8-token instance.)
template <typename T, typename W, typename O, int NT, int RT>
__global__ void __launch_bounds__(kGateThreads, sizeof(T) == 2 ? 2 : 1)
    moe_gate_kernel(const T* x, const GemvWeights ws, int n_tokens, int64_t dim, int64_t ldx, int64_t total_rows) {
  constexpr int kE = 16 / sizeof(W);   // weights a 16-byte load
  constexpr int kSeg = RT < 32 ? RT : 32;  // lanes of a row within a warp
  constexpr int kRows = kGateThreads / RT;  // rows a CTA
  __shared__ float part[kGateThreads / kSeg][moe_gate_max_tokens];
  const int tr = threadIdx.x % RT;
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kRows + threadIdx.x / RT;
  const bool live = e < total_rows;
  const GemvRow row = gemv_row(ws, e, dim);
  const W* wr = static_cast<const W*>(row.w) + (live ? e - row.start : 0) * dim;
  const T* xr = x + (live ? row.xoff : 0);
  const int nq = static_cast<int>(dim / kE);  // dim < 2^31 (checked by the launcher)
  uint4 wv[kGateU];
  auto load_w = [&](int q0) {
#pragma unroll
    for (int u = 0; u < kGateU; ++u) {
      const int q = q0 + u * RT;
      wv[u] = (live && q < nq) ? ld_stream(wr + kE * q) : make_uint4(0, 0, 0, 0);
    }
  };
  load_w(tr);  // the weights are no predecessor's output: in flight before the wait
  pdl_wait();
  pdl_launch_dependents();
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
  for (int q0 = tr;;) {
#pragma unroll
    for (int u = 0; u < kGateU; ++u) {
      const int q = q0 + u * RT;
      if (q >= nq) break;
      float wf[kE];
      unpack_w<W>(wv[u], wf);
      // no `t < n_tokens` test around the loads (each load waited for the previous token's): tokens past n_tokens
      // (up to NT) re-read the last token's row into sums that are never stored
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const int64_t tt = t < n_tokens ? t : n_tokens - 1;
#pragma unroll
        for (int h = 0; h < kE / 4; ++h) {
          const float4 xv = load4<T>(xr + tt * ldx + kE * q + 4 * h);
          acc[t] = fmaf(wf[4 * h], xv.x, acc[t]);
          acc[t] = fmaf(wf[4 * h + 1], xv.y, acc[t]);
          acc[t] = fmaf(wf[4 * h + 2], xv.z, acc[t]);
          acc[t] = fmaf(wf[4 * h + 3], xv.w, acc[t]);
        }
      }
    }
    q0 += kGateU * RT;
    if (q0 >= nq) break;
    load_w(q0);
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    float v = acc[t];
#pragma unroll
    for (int o = kSeg / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x % kSeg == 0) part[threadIdx.x / kSeg][t] = v;
  }
  __syncthreads();
  constexpr int kPartsPerRow = RT / kSeg;
  static_assert(kRows * moe_gate_max_tokens <= kGateThreads, "one thread an output of the CTA");
  const int rl = threadIdx.x / moe_gate_max_tokens, t = threadIdx.x % moe_gate_max_tokens;
  const int64_t er = static_cast<int64_t>(blockIdx.x) * kRows + rl;
  if (rl < kRows && t < n_tokens && er < total_rows) {
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kPartsPerRow; ++k) sum += part[rl * kPartsPerRow + k][t];
    const GemvRow o = gemv_row(ws, er, dim);
    static_cast<O*>(o.out)[t * o.rows + (er - o.start)] = out_cast<O>(sum);
  }
}

// ------------------------------------------------------------------------------------------ GEMV, 2-8 tokens
// The same products for 2 to 8 tokens when x and the weights share one 16-bit type, on the tensor cores: a CTA takes a
// tile of 16 rows of one weight and its 8 warps split the reduction; lane (g, c) loads 16 bytes of rows g and g + 8
// and of token g's x at the same 8 columns (mma_chunk: a chunk of 32 columns is two m16n8k16 steps, the tokens the n
// dimension; tokens past n_tokens re-read the last one and are never stored). moe_gate_kernel reads x once a token
// for every 16-byte weight chunk (from L1); at 8 tokens it took 2.2-2.6x cuBLAS's time on large weights (H200). Here a
// lane reads one x chunk for two weight chunks. The 8 warps' partial sums add in shared memory in a fixed order:
// deterministic. Tiles do not cross weights (a weight's last tile is partial); grouped weights need group_rows % 16
// == 0 (one x block a tile).
constexpr int kMmaWarps = 8;
constexpr int kMmaRows = 16;  // rows a tile (the mma M)
constexpr int kMmaU = 4;      // 32-column chunks a lane loads in one round

struct MmaTile {
  const void* w;
  void* out;
  int64_t rows, row0, xoff;
};

__device__ __forceinline__ MmaTile mma_tile(const GemvWeights& ws, int64_t tile, int64_t dim) {
  MmaTile r{ws.w[0], ws.out[0], ws.end[0], 0, 0};
  int64_t t0 = 0, start = 0;
  bool found = false;
#pragma unroll
  for (int i = 0; i < moe_gemv_max_weights; ++i) {
    if (i < ws.n) {
      const int64_t rows = ws.end[i] - start, tiles = (rows + kMmaRows - 1) / kMmaRows;
      if (!found && tile < t0 + tiles) {
        r = MmaTile{ws.w[i], ws.out[i], rows, (tile - t0) * kMmaRows, 0};
        found = true;
      }
      t0 += tiles;
      start = ws.end[i];
    }
  }
  if (ws.group_rows > 0) r.xoff = r.row0 / ws.group_rows * dim;
  return r;
}

template <typename T, typename O, bool kTwo>
__global__ void __launch_bounds__(kMmaWarps * 32)
    gemv_mma_kernel(const T* x, const GemvWeights ws, int n_tokens, int64_t dim, int64_t ldx) {
  __shared__ float red[kMmaWarps][kMmaRows][8];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const MmaTile tile = mma_tile(ws, blockIdx.x, dim);
  const bool a_ok = tile.row0 + g < tile.rows, b_ok = tile.row0 + g + 8 < tile.rows;
  const T* wa = static_cast<const T*>(tile.w) + (a_ok ? tile.row0 + g : 0) * dim + c * 8;
  const T* wb = static_cast<const T*>(tile.w) + (b_ok ? tile.row0 + g + 8 : 0) * dim + c * 8;
  const T* xt = x + tile.xoff + static_cast<int64_t>(g < n_tokens ? g : n_tokens - 1) * ldx + c * 8;
  const int nchunks = static_cast<int>(dim / 32);
  const int per = (nchunks + kMmaWarps - 1) / kMmaWarps;
  const int j_begin = warp * per, j_end = min(nchunks, j_begin + per);
  uint4 va[kMmaU], vb[kMmaU];
  auto load_w = [&](int j0, uint4 (&a)[kMmaU], uint4 (&b)[kMmaU]) {
#pragma unroll
    for (int u = 0; u < kMmaU; ++u) {
      const bool ok = j0 + u < j_end;
      a[u] = ok && a_ok ? ld_stream(wa + (j0 + u) * 32) : make_uint4(0, 0, 0, 0);
      b[u] = ok && b_ok ? ld_stream(wb + (j0 + u) * 32) : make_uint4(0, 0, 0, 0);
    }
  };
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  auto round = [&](int j0, const uint4 (&a)[kMmaU], const uint4 (&b)[kMmaU]) {  // x's chunks, then the products
    uint4 vx[kMmaU];
#pragma unroll
    for (int u = 0; u < kMmaU; ++u) {
      vx[u] = j0 + u < j_end ? ld_coherent(xt + (j0 + u) * 32) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kMmaU; ++u) mma_chunk<T>(d, a[u], b[u], vx[u]);
  };
  load_w(j_begin, va, vb);  // the weights are no predecessor's output: in flight before the wait
  pdl_wait();               // every thread: x is the predecessor's output, and the outputs may be memory it still reads
  pdl_launch_dependents();
  if constexpr (kTwo) {
    // two rounds of weight loads in flight: round j0 + kMmaU's are issued before round j0's products wait for theirs
    // (chunks past j_end load zeros and add nothing; the chunks' order, and so the sums, are the one-round loop's)
    uint4 wa2[kMmaU], wb2[kMmaU];
    for (int j0 = j_begin; j0 < j_end; j0 += 2 * kMmaU) {
      load_w(j0 + kMmaU, wa2, wb2);
      round(j0, va, vb);
      load_w(j0 + 2 * kMmaU, va, vb);
      round(j0 + kMmaU, wa2, wb2);
    }
  } else {
    for (int j0 = j_begin; j0 < j_end; j0 += kMmaU) {
      round(j0, va, vb);
      if (j0 + kMmaU < j_end) load_w(j0 + kMmaU, va, vb);
    }
  }
  // d: rows g (d[0], d[1]) and g + 8 (d[2], d[3]), tokens 2c and 2c + 1
  red[warp][g][2 * c] = d[0];
  red[warp][g][2 * c + 1] = d[1];
  red[warp][g + 8][2 * c] = d[2];
  red[warp][g + 8][2 * c + 1] = d[3];
  __syncthreads();
  const int r = threadIdx.x % kMmaRows, t = threadIdx.x / kMmaRows;  // consecutive threads, consecutive rows
  if (t < n_tokens && t < 8 && tile.row0 + r < tile.rows) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kMmaWarps; ++w) sum += red[w][r][t];
    static_cast<O*>(tile.out)[t * tile.rows + tile.row0 + r] = out_cast<O>(sum);
  }
}

// ------------------------------------------------------------------------------------------ routers
// J = ceil(E / 32) experts per lane, kept in registers.
template <int J>
__global__ void __launch_bounds__(kRouteWarps * 32) moe_route_kernel(const float* __restrict__ logits,
                                                                     const void* __restrict__ bias, bool bias_bf16,
                                                                     int64_t n_tokens, int n_experts, int topk,
                                                                     float scale, float* __restrict__ weights,
                                                                     int32_t* __restrict__ ids) {
  pdl_launch_dependents();  // see "Routers" above: the successor may start while this waits for the logits
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRouteWarps + (threadIdx.x >> 5);
  // The bias is a weight, no predecessor's output: its loads are in flight before the wait (at decode the memory
  // system is busy with the shared expert's weights, so a load after the wait would lengthen the routing chain).
  float bv[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int e = j * 32 + lane;
    bv[j] = 0.0f;
    if (e < n_experts) {
      bv[j] = bias_bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(bias)[e])
                        : static_cast<const float*>(bias)[e];
    }
  }
  pdl_wait();
  if (t >= n_tokens) return;
  const float* row = logits + t * n_experts;
  // every logit load issued before any is used (a load under `e < n_experts`, used at once, waited for the memory
  // before the next was issued: J round trips); lanes past n_experts re-read the last logit and discard it
  float z[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int e = j * 32 + lane;
    z[j] = row[e < n_experts ? e : n_experts - 1];
  }
  float sel[J], sc[J];
  uint32_t taken = 0;  // bit j: expert j * 32 + lane chosen (or absent)
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int e = j * 32 + lane;
    sc[j] = 0.0f;
    sel[j] = 0.0f;
    if (e < n_experts) {
      sc[j] = sqrt_softplus(z[j]);
      sel[j] = sc[j] + bv[j];
    } else {
      taken |= 1u << j;
    }
  }
  float my_w = 0.0f, total = 0.0f;
  int my_id = 0;
  for (int r = 0; r < topk; ++r) {
    float best = 0.0f, best_s = 0.0f;
    int best_e = INT_MAX;  // none
#pragma unroll
    for (int j = 0; j < J; ++j) {  // ascending e: a tie keeps the lower id
      if (!((taken >> j) & 1u) && (best_e == INT_MAX || sel[j] > best)) {
        best = sel[j];
        best_s = sc[j];
        best_e = j * 32 + lane;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {  // (value desc, id asc) is a total order: every lane ends with the max
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const float os = __shfl_xor_sync(0xffffffffu, best_s, o);
      const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
      if (oe != INT_MAX && (best_e == INT_MAX || ob > best || (ob == best && oe < best_e))) {
        best = ob;
        best_s = os;
        best_e = oe;
      }
    }
    if ((best_e & 31) == lane) taken |= 1u << (best_e >> 5);
    if (lane == r) {
      my_id = best_e;
      my_w = best_s;
    }
    total += best_s;
  }
  if (lane < topk) {
    weights[t * topk + lane] = my_w / total * scale;
    ids[t * topk + lane] = my_id;
  }
}

__global__ void __launch_bounds__(kRouteWarps * 32) moe_hash_route_kernel(
    const float* __restrict__ logits, const void* __restrict__ tid2eid, bool tid2eid_i64,
    const void* __restrict__ token_ids, bool token_ids_i64, int64_t vocab, int64_t n_tokens, int n_experts, int topk,
    float scale, float* __restrict__ weights, int32_t* __restrict__ ids) {
  pdl_launch_dependents();
  pdl_wait();
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRouteWarps + (threadIdx.x >> 5);
  if (t >= n_tokens) return;
  int64_t tok = token_ids_i64 ? static_cast<const int64_t*>(token_ids)[t] : static_cast<const int32_t*>(token_ids)[t];
  tok = tok < 0 ? 0 : (tok >= vocab ? vocab - 1 : tok);  // never read outside the table
  int e = 0;
  float s = 0.0f;
  if (lane < topk) {
    const int64_t at = tok * topk + lane;
    e = static_cast<int>(tid2eid_i64 ? static_cast<const int64_t*>(tid2eid)[at]
                                     : static_cast<const int32_t*>(tid2eid)[at]);
    const int ec = e < 0 ? 0 : (e >= n_experts ? n_experts - 1 : e);
    s = sqrt_softplus(logits[t * n_experts + ec]);
  }
  float total = 0.0f;
  for (int r = 0; r < topk; ++r) total += __shfl_sync(0xffffffffu, s, r);  // in the table's order
  if (lane < topk) {
    weights[t * topk + lane] = s / total * scale;
    ids[t * topk + lane] = e;
  }
}

// ------------------------------------------------------------------------------------------ plan
__global__ void __launch_bounds__(kPlanThreads) moe_plan_kernel(const int32_t* __restrict__ ids, int n_pairs,
                                                                int topk, int n_experts, int n_slots, MoePlan plan,
                                                                bool early) {
  extern __shared__ int plan_smem[];
  int* count = plan_smem;               // [E]
  int* cursor = plan_smem + n_experts;  // [E]
  __shared__ int warp_pairs[32], warp_active[32], totals[2];
  if (early) pdl_launch_dependents();  // x_ready: the up kernel's shared-expert CTAs start at once (they read x, no plan)
  pdl_wait();
  if (!early) pdl_launch_dependents();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int e = tid; e < n_experts; e += kPlanThreads) count[e] = 0;
  __syncthreads();
  for (int i = tid; i < n_pairs; i += kPlanThreads) {
    const int e = ids[i];
    if (static_cast<unsigned>(e) < static_cast<unsigned>(n_experts)) atomicAdd(&count[e], 1);
  }
  __syncthreads();
  // exclusive scan of (pairs, chosen experts) over contiguous ranges of experts, one range per thread
  const int per = (n_experts + kPlanThreads - 1) / kPlanThreads;
  const int e0 = min(tid * per, n_experts), e1 = min(e0 + per, n_experts);
  int pairs = 0, active = 0;
  for (int e = e0; e < e1; ++e) {
    pairs += count[e];
    active += count[e] > 0;
  }
  int inc_p = pairs, inc_a = active;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int vp = __shfl_up_sync(0xffffffffu, inc_p, o), va = __shfl_up_sync(0xffffffffu, inc_a, o);
    if (lane >= o) {
      inc_p += vp;
      inc_a += va;
    }
  }
  if (lane == 31) {
    warp_pairs[warp] = inc_p;
    warp_active[warp] = inc_a;
  }
  __syncthreads();
  if (warp == 0) {
    const int wp = warp_pairs[lane], wa = warp_active[lane];
    int sp = wp, sa = wa;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int vp = __shfl_up_sync(0xffffffffu, sp, o), va = __shfl_up_sync(0xffffffffu, sa, o);
      if (lane >= o) {
        sp += vp;
        sa += va;
      }
    }
    warp_pairs[lane] = sp - wp;
    warp_active[lane] = sa - wa;
    if (lane == 31) {
      totals[0] = sp;
      totals[1] = sa;
    }
  }
  __syncthreads();
  int off = warp_pairs[warp] + inc_p - pairs, slot = warp_active[warp] + inc_a - active;
  for (int e = e0; e < e1; ++e) {
    const int c = count[e];
    cursor[e] = off;
    plan.expert_end[e] = off + c;
    if (c > 0) {
      plan.slot_expert[slot] = e;
      plan.slot_off[slot] = off;
      ++slot;
    }
    off += c;
  }
  const int total = totals[0], n_active = totals[1];
  for (int s = n_active + tid; s < n_slots; s += kPlanThreads) {
    plan.slot_expert[s] = -1;
    plan.slot_off[s] = total;
  }
  if (tid == 0) plan.slot_off[n_slots] = total;
  __syncthreads();
  // A pair's place inside its expert's list is arbitrary: every output row is computed the same way wherever it
  // sits, and the combine gathers by (token, choice), so the result does not depend on it.
  for (int i = tid; i < n_pairs; i += kPlanThreads) {
    const int e = ids[i];
    int p = -1;
    if (static_cast<unsigned>(e) < static_cast<unsigned>(n_experts)) {
      p = atomicAdd(&cursor[e], 1);
      plan.pair_tok[p] = i / topk;
    }
    plan.pos_of[i] = p;
  }
  for (int p = total + tid; p < n_pairs; p += kPlanThreads) plan.pair_tok[p] = 0;
}

// ------------------------------------------------------------------------------------------ small batches
struct GemvArgs {
  const void* x;    // [T, D]
  const void* w13;  // [E, 2I, D]
  const void* w2;   // [E, D, I]
  const void* sg;   // [I, D] the shared expert's gate rows (null: no shared expert)
  const void* su;   // [I, D] its up rows
  const void* sd;   // [D, I] its down rows
  void* act;        // [P + Ts, I]
  float* y;         // [P + Ts, D]
  MoePlan plan;
  const int32_t* ids;  // [T, k] (direct: slot s is choice s of the one token)
  int64_t dim, inter;
  int n_tokens, n_pairs;
  int n_slots;      // routed slots; slot n_slots (when sg is set) is the shared expert: every token, rows P + t
  int n_experts;
  float limit;
  bool x_ready;     // MoeExpertsArgs::x_ready: the shared slot's up CTAs run before the wait for the plan
  bool direct;      // MoeExpertsArgs::direct: no plan; slot s = choice s, pair s, token 0
  // With x_ready (the routing runs while the shared slot's up CTAs stream their rows, and no routed weight can be
  // read before it ends): those CTAs also prefetch the shared expert's down rows into L2 as last to be evicted, so
  // that the down kernel reads them from L2 while the routed rows stream; its shared CTAs put the lines back to
  // normal priority after use. MoeExpertsArgs::keep_shared.
  bool keep_shared;
};

// Slots in reverse: the shared expert (the last slot, with every token: the longest CTAs) and the highest chosen
// experts start first, the unused slots (past the last chosen expert) exit at once.
__device__ __forceinline__ int slot_of_block() { return static_cast<int>(gridDim.y - 1 - blockIdx.y); }

// A CTA's slot: its expert's gate/up rows ([I, D] each) and down rows ([D, I]), and its pairs [off, off + n).
template <typename T>
struct Slot {
  const T* gate;
  const T* up;
  const T* down;
  int off, n;
  bool shared;
  bool direct;  // GemvArgs::direct: the one token, q = 0
  __device__ __forceinline__ int token(const MoePlan& p, int q) const {
    return (shared || direct) ? q : p.pair_tok[off + q];
  }
};

// The expert of routed slot s (-1: unused), from the plan or, direct, from ids (an id outside [0, E): unused);
// any value for the shared slot. l2: an L2 load (the down kernel reads it before its wait, see there).
__device__ __forceinline__ int slot_expert(const GemvArgs& a, int s, bool l2) {
  if (s >= a.n_slots) return 0;
  if (a.direct) {
    const int e = l2 ? __ldcg(a.ids + s) : a.ids[s];
    return static_cast<unsigned>(e) < static_cast<unsigned>(a.n_experts) ? e : -1;
  }
  return l2 ? __ldcg(a.plan.slot_expert + s) : a.plan.slot_expert[s];
}

// e: the slot's expert (any value for the shared slot); false when the slot is unused.
template <typename T>
__device__ __forceinline__ bool slot_rows(const GemvArgs& a, int s, int e, Slot<T>& sl) {
  const int64_t D = a.dim, I = a.inter;
  sl.shared = s == a.n_slots;
  sl.direct = a.direct;
  if (sl.shared) {
    sl.gate = static_cast<const T*>(a.sg);
    sl.up = static_cast<const T*>(a.su);
    sl.down = static_cast<const T*>(a.sd);
    return true;
  }
  if (e < 0) return false;
  sl.gate = static_cast<const T*>(a.w13) + static_cast<int64_t>(e) * 2 * I * D;
  sl.up = sl.gate + I * D;
  sl.down = static_cast<const T*>(a.w2) + static_cast<int64_t>(e) * D * I;
  return true;
}

// The slot's pairs (read after the plan kernel completed).
template <typename T>
__device__ __forceinline__ void slot_pairs(const GemvArgs& a, int s, Slot<T>& sl) {
  if (sl.shared) {
    sl.off = a.n_pairs;
    sl.n = a.n_tokens;
  } else if (sl.direct) {
    sl.off = s;
    sl.n = 1;
  } else {
    sl.off = a.plan.slot_off[s];
    sl.n = a.plan.slot_off[s + 1] - sl.off;
  }
}

// ------------------------------------------------------------------------------------------ one-token rows
// One-token calls (ROW instances of the GEMV kernels): each warp owns whole weight rows and a lane loads 16 bytes
// of one row, so each warp load is 512 contiguous bytes of a row. The mma fragment layout (lane (g, c) loads row g)
// makes each warp load eight 64-byte pieces of eight rows, and that pattern streams about a fifth slower (H200,
// 7 experts' gate and up rows read alone, tests/bench/test_bench_read_patterns.py: 3.45 against 4.27 TB/s, one
// contiguous range a CTA 4.43, the copy 4.20). Products in fp32 FMAs over a lane's columns,
// then a fixed shuffle tree: deterministic; exact products and fp32 sums, as the mma path.
constexpr int kRowChunk = 256;  // columns of one warp load of a row (32 lanes x 8 elements)
constexpr int kRowU = 4;        // chunks of each row (and of the operand) a lane loads in one round

// 8 elements of T (16 bytes) as floats
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  const T* p = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int j = 0; j < 8; ++j) f[j] = Num<T>::load(p[j]);
}

// acc[r] = sum_k rows[r][k] * b[k] over k < K (K % kRowChunk == 0), this lane's columns, then summed over the warp
// (every lane holds the sums). COHERENT: b is the predecessor grid's output (ld_coherent), else x (__ldg).
template <typename T, bool COHERENT>
__device__ __forceinline__ void warp_rows_dot(const T* const (&rows)[4], const T* b, int64_t K, int lane,
                                              float (&acc)[4]) {
#pragma unroll
  for (int r = 0; r < 4; ++r) acc[r] = 0.0f;
  const int nk = static_cast<int>(K / kRowChunk);
  for (int j0 = 0; j0 < nk; j0 += kRowU) {
    uint4 w[4][kRowU], bv[kRowU];
#pragma unroll
    for (int u = 0; u < kRowU; ++u) {
      const bool ok = j0 + u < nk;
      const int64_t o = static_cast<int64_t>(j0 + u) * kRowChunk + lane * 8;
#pragma unroll
      for (int r = 0; r < 4; ++r) w[r][u] = ok ? ld_stream(rows[r] + o) : make_uint4(0, 0, 0, 0);
      bv[u] = !ok ? make_uint4(0, 0, 0, 0)
                  : (COHERENT ? ld_coherent(b + o) : __ldg(reinterpret_cast<const uint4*>(b + o)));
    }
#pragma unroll
    for (int u = 0; u < kRowU; ++u) {
      float bf[8];
      unpack8<T>(bv[u], bf);
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        float wf[8];
        unpack8<T>(w[r][u], wf);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[r] = fmaf(wf[e], bf[e], acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
  }
}

// up: act[p, i0 + g] for the CTA's 8 channels and every pair p of its slot.
template <typename T, int NG, int U, bool ROW = false>
__global__ void __launch_bounds__(kGemvThreads, 4) moe_up_mma_kernel(const GemvArgs a) {
  __shared__ float4 red[kGemvWarps][NG][32];
  const int s = slot_of_block();
  // The shared slot needs x only (complete when x_ready), not the plan: it waits after its work.
  const bool early = a.x_ready && s == a.n_slots && a.sg != nullptr;
  if (!early) {
    pdl_wait();
    pdl_launch_dependents();
  } else if (a.keep_shared && threadIdx.x == 0) {  // this CTA's share of the shared down rows, 16-byte pieces
    const int64_t total = a.dim * a.inter * static_cast<int64_t>(sizeof(T)) / 16;
    const int64_t per = (total + gridDim.x - 1) / gridDim.x, q0 = per * blockIdx.x;
    const int64_t n = (q0 < total ? (total - q0 < per ? total - q0 : per) : 0) * 16;
    const char* base = static_cast<const char*>(a.sd) + q0 * 16;
    for (int64_t o = 0; o < n; o += 65536) prefetch_l2_keep(base + o, static_cast<uint32_t>(n - o < 65536 ? n - o : 65536));
  }
  Slot<T> sl;
  if (!slot_rows<T>(a, s, slot_expert(a, s, false), sl)) return;
  slot_pairs<T>(a, s, sl);
  const int off = sl.off, n = sl.n;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int64_t D = a.dim, I = a.inter;
  if constexpr (ROW) {  // warp w: channels i0 + 2w and i0 + 2w + 1, their gate and up rows (see warp_rows_dot)
    const int64_t ic = static_cast<int64_t>(blockIdx.x) * 8 + 2 * warp;
    const T* const rows[4] = {sl.gate + ic * D, sl.gate + (ic + 1) * D, sl.up + ic * D, sl.up + (ic + 1) * D};
    T* act = static_cast<T*>(a.act);
    for (int q = 0; q < n; ++q) {
      float h[4];
      warp_rows_dot<T, false>(rows, static_cast<const T*>(a.x) + static_cast<int64_t>(sl.token(a.plan, q)) * D, D,
                              lane, h);
      if (early) pdl_wait();  // no store before the wait (see below)
      if (lane < 2) {  // lane 0: channel ic, lane 1: ic + 1
        act[(off + q) * I + ic + lane] =
            Num<T>::store(clamped_swiglu<T>(lane == 0 ? h[0] : h[1], lane == 0 ? h[2] : h[3], a.limit));
      }
    }
    if (early) {
      pdl_wait();
      pdl_launch_dependents();
    }
    return;
  }
  const int64_t i = static_cast<int64_t>(blockIdx.x) * 8 + g;
  const T* row_g = sl.gate + i * D + c * 8;
  const T* row_u = sl.up + i * D + c * 8;
  const int nk = static_cast<int>(D / kChunk);
  T* act = static_cast<T*>(a.act);
  for (int base = 0; base < n; base += 8 * NG) {
    const int ng = min(NG, (n - base + 7) / 8);
    const T* xrow[NG];
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) {
      const int q = base + gi * 8 + g;
      xrow[gi] = (gi < ng && q < n)
                     ? static_cast<const T*>(a.x) + static_cast<int64_t>(sl.token(a.plan, q)) * D + c * 8
                     : nullptr;
    }
    float acc[NG][4];
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) acc[gi][0] = acc[gi][1] = acc[gi][2] = acc[gi][3] = 0.0f;
    for (int kb = warp * U; kb < nk; kb += kGemvWarps * U) {
      uint4 wg[U], wu[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        wg[u] = wu[u] = make_uint4(0, 0, 0, 0);
        if (kb + u < nk) {
          wg[u] = ld_stream(row_g + (kb + u) * kChunk);
          wu[u] = ld_stream(row_u + (kb + u) * kChunk);
        }
      }
#pragma unroll
      for (int gi = 0; gi < NG; ++gi) {
        if (gi < ng) {
          uint4 xv[U];
#pragma unroll
          for (int u = 0; u < U; ++u) {
            xv[u] = make_uint4(0, 0, 0, 0);
            if (xrow[gi] != nullptr && kb + u < nk) xv[u] = __ldg(reinterpret_cast<const uint4*>(xrow[gi] + (kb + u) * kChunk));
          }
#pragma unroll
          for (int u = 0; u < U; ++u) mma_chunk<T>(acc[gi], wg[u], wu[u], xv[u]);
        }
      }
    }
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) {
      if (gi < ng) red[warp][gi][lane] = make_float4(acc[gi][0], acc[gi][1], acc[gi][2], acc[gi][3]);
    }
    __syncthreads();
    // An early CTA writes nothing before its wait: act may sit in memory that a grid still running before it (the
    // router, say) reads through a tensor the allocator has since freed and handed to this call. Only reads go
    // before a wait (launch.cuh); the weights' streaming, the costly part, is done by now.
    if (early) pdl_wait();
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) {
      if (gi < ng && gi % kGemvWarps == warp) {
        float h[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int w = 0; w < kGemvWarps; ++w) {  // fixed order: deterministic
          const float4 v = red[w][gi][lane];
          h[0] += v.x;
          h[1] += v.y;
          h[2] += v.z;
          h[3] += v.w;
        }
        // lane (g, c): gate (h0, h1) and up (h2, h3) of channel i for tokens q0 = 2c and q0 + 1 of the group
        const int q0 = base + gi * 8 + 2 * c;
        if (q0 < n) act[(off + q0) * I + i] = Num<T>::store(clamped_swiglu<T>(h[0], h[2], a.limit));
        if (q0 + 1 < n) act[(off + q0 + 1) * I + i] = Num<T>::store(clamped_swiglu<T>(h[1], h[3], a.limit));
      }
    }
    __syncthreads();  // red is reused by the next group of tokens
  }
  if (early) {  // before the dependents may start: the down kernel reads the plan before its own wait
    pdl_wait();
    pdl_launch_dependents();
  }
}

// down: y[p, r0 .. r0 + 16) for every pair p of the CTA's slot.
template <typename T, int NG, int U, bool ROW = false>
__global__ void __launch_bounds__(kGemvThreads, 4) moe_down_mma_kernel(const GemvArgs a) {
  __shared__ float4 red[kGemvWarps][NG][32];
  const int s = slot_of_block();
  const int64_t D = a.dim, I = a.inter;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * 16;
  // The plan (direct: the router's ids) was written two launches back (direct: by the grid before the up kernel); the
  // up kernel waited for it before any of its CTAs let this grid start.
  Slot<T> sl;
  const bool used = slot_rows<T>(a, s, slot_expert(a, s, true), sl);
  const bool kept = a.keep_shared && a.x_ready && sl.shared;  // its tile is in L2 already (see keep_shared)
  if (used && !kept && threadIdx.x < 16) {  // the CTA's weight tile into L2 while the up kernel drains
    prefetch_l2(sl.down + (r0 + threadIdx.x) * I, static_cast<uint32_t>(I * sizeof(T)));
  }
  pdl_wait();
  pdl_launch_dependents();
  if (!used) return;
  slot_pairs<T>(a, s, sl);
  const int off = sl.off, n = sl.n;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  if constexpr (ROW) {  // warp w: output rows r0 + 4w .. r0 + 4w + 3 (see warp_rows_dot)
    const int64_t rw = r0 + 4 * warp;
    const T* const rows[4] = {sl.down + rw * I, sl.down + (rw + 1) * I, sl.down + (rw + 2) * I, sl.down + (rw + 3) * I};
    for (int q = 0; q < n; ++q) {
      float h[4];
      warp_rows_dot<T, true>(rows, static_cast<const T*>(a.act) + (off + q) * I, I, lane, h);
      if (lane < 4) a.y[(off + q) * D + rw + lane] = lane == 0 ? h[0] : (lane == 1 ? h[1] : (lane == 2 ? h[2] : h[3]));
    }
  } else {
  const T* row_a = sl.down + (r0 + g) * I + c * 8;
  const T* row_b = row_a + 8 * I;
  const T* act = static_cast<const T*>(a.act);
  const int nk = static_cast<int>(I / kChunk);
  for (int base = 0; base < n; base += 8 * NG) {
    const int ng = min(NG, (n - base + 7) / 8);
    const T* brow[NG];
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) {
      const int q = base + gi * 8 + g;
      brow[gi] = (gi < ng && q < n) ? act + (off + q) * I + c * 8 : nullptr;
    }
    float acc[NG][4];
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) acc[gi][0] = acc[gi][1] = acc[gi][2] = acc[gi][3] = 0.0f;
    for (int kb = warp * U; kb < nk; kb += kGemvWarps * U) {
      uint4 wa[U], wb[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        wa[u] = wb[u] = make_uint4(0, 0, 0, 0);
        if (kb + u < nk) {
          wa[u] = ld_stream(row_a + (kb + u) * kChunk);
          wb[u] = ld_stream(row_b + (kb + u) * kChunk);
        }
      }
#pragma unroll
      for (int gi = 0; gi < NG; ++gi) {
        if (gi < ng) {
          uint4 bv[U];
#pragma unroll
          for (int u = 0; u < U; ++u) {
            bv[u] = make_uint4(0, 0, 0, 0);
            if (brow[gi] != nullptr && kb + u < nk) bv[u] = ld_coherent(brow[gi] + (kb + u) * kChunk);
          }
#pragma unroll
          for (int u = 0; u < U; ++u) mma_chunk<T>(acc[gi], wa[u], wb[u], bv[u]);
        }
      }
    }
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) {
      if (gi < ng) red[warp][gi][lane] = make_float4(acc[gi][0], acc[gi][1], acc[gi][2], acc[gi][3]);
    }
    __syncthreads();
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) {
      if (gi < ng && gi % kGemvWarps == warp) {
        float h[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int w = 0; w < kGemvWarps; ++w) {
          const float4 v = red[w][gi][lane];
          h[0] += v.x;
          h[1] += v.y;
          h[2] += v.z;
          h[3] += v.w;
        }
        // lane (g, c): rows r0 + g (h0, h1) and r0 + 8 + g (h2, h3) for tokens q0 = 2c and q0 + 1 of the group
        const int q0 = base + gi * 8 + 2 * c;
        float* y0 = a.y + (off + q0) * D + r0 + g;
        if (q0 < n) {
          y0[0] = h[0];
          y0[8] = h[2];
        }
        if (q0 + 1 < n) {
          y0[D] = h[1];
          y0[D + 8] = h[3];
        }
      }
    }
    __syncthreads();
  }
  }
  if (kept) {  // the tile's lines back to normal priority (see keep_shared)
    const uintptr_t t0 = reinterpret_cast<uintptr_t>(sl.down + r0 * I) & ~uintptr_t{127};
    const uintptr_t t1 = reinterpret_cast<uintptr_t>(sl.down + (r0 + 16) * I);
    for (uintptr_t p = t0 + threadIdx.x * 128; p < t1; p += blockDim.x * 128) {
      l2_normal_priority(reinterpret_cast<const void*>(p));
    }
  }
}

// Plain fp32-FMA versions (float32 weights, or shapes the mma path does not take): a warp per output row, lanes
// over the reduction dimension, one token at a time.
template <typename T>
__global__ void __launch_bounds__(kGemvThreads) moe_up_simple_kernel(const GemvArgs a) {
  const int s = slot_of_block();
  const int64_t D = a.dim, I = a.inter;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kGemvWarps + (threadIdx.x >> 5);
  Slot<T> sl;
  if (!slot_rows<T>(a, s, slot_expert(a, s, false), sl) || i >= I) return;
  slot_pairs<T>(a, s, sl);
  const int lane = threadIdx.x & 31;
  const T* wg = sl.gate + i * D;
  const T* wu = sl.up + i * D;
  for (int q = 0; q < sl.n; ++q) {
    const T* xr = static_cast<const T*>(a.x) + static_cast<int64_t>(sl.token(a.plan, q)) * D;
    float hg = 0.0f, hu = 0.0f;
    for (int64_t k = lane; k < D; k += 32) {
      const float xv = Num<T>::load(xr[k]);
      hg = fmaf(Num<T>::load(wg[k]), xv, hg);
      hu = fmaf(Num<T>::load(wu[k]), xv, hu);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      hg += __shfl_xor_sync(0xffffffffu, hg, o);
      hu += __shfl_xor_sync(0xffffffffu, hu, o);
    }
    if (lane == 0) {
      static_cast<T*>(a.act)[(sl.off + q) * I + i] = Num<T>::store(clamped_swiglu<T>(hg, hu, a.limit));
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kGemvThreads) moe_down_simple_kernel(const GemvArgs a) {
  const int s = slot_of_block();
  const int64_t D = a.dim, I = a.inter;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kGemvWarps + (threadIdx.x >> 5);
  Slot<T> sl;
  if (!slot_rows<T>(a, s, slot_expert(a, s, false), sl) || r >= D) return;
  slot_pairs<T>(a, s, sl);
  const int lane = threadIdx.x & 31;
  const T* w = sl.down + r * I;
  for (int q = 0; q < sl.n; ++q) {
    const T* ar = static_cast<const T*>(a.act) + (sl.off + q) * I;
    float acc = 0.0f;
    for (int64_t k = lane; k < I; k += 32) acc = fmaf(Num<T>::load(w[k]), Num<T>::load(ar[k]), acc);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) a.y[(sl.off + q) * D + r] = acc;
  }
}

// ------------------------------------------------------------------------------------------ tiny batches
// T <= 8 tokens (one 8-token mma group) and T * k <= 64 pairs. Every CTA derives the plan from ids in a few hundred
// cycles, so there is no plan kernel; the chosen experts become slots (the shared expert slot 0, then the routed
// experts in order of first appearance), each with a token mask and per-token weights. Up: one CTA per 8 channels
// loops over all slots; down: one CTA per 16 output rows loops over all slots and keeps the weighted sum over them
// in registers, so it writes out itself (no combine kernel). Both grids are a single wave of 2 CTAs per SM on
// Flash dims. Each thread streams its two weight rows and its token operand (x, or act) through a cp.async ring:
// kTinyStages - 1 items in flight, each thread reading back only what it copied (no barrier guards the ring), so
// no load latency is exposed but the ring's; weights L2 evict-first (read once).
// The 8 warps split the reduction dimension: item r of a slot covers chunks (r * 8 + warp) * kTinyU + [0, kTinyU),
// so at any time the CTA reads 8 * kTinyU contiguous 32-column chunks of each of its 16 rows.
constexpr int kTinyWarps = 8;
constexpr int kTinyThreads = kTinyWarps * 32;
constexpr int kTinyU = 2;       // 32-column chunks of each of its two rows (and of its operand) a lane copies per item
constexpr int kTinyStages = 4;  // ring depth
constexpr int kTinyWords = 3 * kTinyU;  // 16-byte words of a thread in one stage: row a, row b, operand
constexpr size_t kTinySmem = static_cast<size_t>(kTinyStages) * kTinyWords * kTinyThreads * sizeof(uint4);  // 96 KiB
constexpr int kTinyMaxSlots = moe_tiny_max_pairs + 1;

struct TinyArgs {
  const void* x;    // [T, D]
  const void* w13;  // [E, 2I, D]
  const void* w2;   // [E, D, I]
  const void* sg;   // [I, D] shared expert (null: none)
  const void* su;   // [I, D]
  const void* sd;   // [D, I]
  const float* weights;  // [T, k]
  const int32_t* ids;    // [T, k]
  void* act;        // [slots * T, I]: row s * T + t = token t through slot s's expert (written where taken)
  void* out;        // [T, D]
  int64_t dim, inter;
  int n_tokens, topk, n_experts;
  float limit;
  bool prefetch_down;  // the up kernel's CTAs prefetch the down kernel's first slot into L2 as they finish
  bool x_ready;        // MoeExpertsArgs::x_ready: the up kernel computes most of the shared slot before its wait
};

struct TinyPlan {
  int n_slots;
  int expert[kTinyMaxSlots];                         // -1: the shared expert (slot 0 when given)
  uint32_t mask[kTinyMaxSlots];                      // bit t: token t takes the slot's expert
  float w[kTinyMaxSlots][moe_tiny_max_tokens];       // token t's routing weight of it (repeats summed), else 0
};

__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}

// 16 bytes global -> shared, zero-filled when !valid (src is then not read).
__device__ __forceinline__ void cp_async16(uint4* dst, const void* src, bool valid, uint64_t policy) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;" ::"r"(d), "l"(src),
               "r"(valid ? 16 : 0), "l"(policy)
               : "memory");
}


// Run by one warp. Slots in a fixed order (the shared expert, then routed experts by first appearance in ids), so
// every CTA of both kernels derives the same plan; the weighted sums run in that order: deterministic.
__device__ __forceinline__ void tiny_plan(const TinyArgs& a, TinyPlan& p, int* pair_expert, int lane) {
  const int T = a.n_tokens, k = a.topk, P = T * k;
  const bool shared = a.sg != nullptr;
  int e[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = lane + 32 * h;
    e[h] = -1;
    if (i < P) {
      const int v = __ldcg(a.ids + i);
      e[h] = static_cast<unsigned>(v) < static_cast<unsigned>(a.n_experts) ? v : -1;  // else no weight
      pair_expert[i] = e[h];
    }
  }
  __syncwarp();
  bool first[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = lane + 32 * h;
    first[h] = e[h] >= 0;
    for (int j = 0; j < i && first[h]; ++j) first[h] = pair_expert[j] != e[h];
  }
  const uint32_t m0 = __ballot_sync(0xffffffffu, first[0]), m1 = __ballot_sync(0xffffffffu, first[1]);
  const uint32_t below = (1u << lane) - 1u;
  const int base = shared ? 1 : 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (!first[h]) continue;
    const int s = base + (h == 0 ? __popc(m0 & below) : __popc(m0) + __popc(m1 & below));
    uint32_t mask = 0;
    p.expert[s] = e[h];
    for (int t = 0; t < moe_tiny_max_tokens; ++t) {
      float w = 0.0f;
      if (t < T) {
        for (int j = 0; j < k; ++j) {
          if (pair_expert[t * k + j] == e[h]) {
            w += __ldcg(a.weights + t * k + j);
            mask |= 1u << t;
          }
        }
      }
      p.w[s][t] = w;
    }
    p.mask[s] = mask;
  }
  if (lane == 0) {
    p.n_slots = base + __popc(m0) + __popc(m1);
    if (shared) {
      p.expert[0] = -1;
      p.mask[0] = (1u << T) - 1u;
      for (int t = 0; t < moe_tiny_max_tokens; ++t) p.w[0][t] = t < T ? 1.0f : 0.0f;
    }
  }
}

// Position of an item: slot s, item r of the slot, ring stage (items advance in that order; no divisions).
struct TinyCursor {
  int s = 0, r = 0, stage = 0;
  __device__ __forceinline__ void next(int per_slot) {
    if (++r == per_slot) {
      r = 0;
      ++s;
    }
    if (++stage == kTinyStages) stage = 0;
  }
};

__device__ __forceinline__ uint4* tiny_stage(uint4* ring, int stage) {
  return ring + stage * kTinyWords * kTinyThreads + threadIdx.x;
}

__device__ __forceinline__ int tiny_chunk(int r, int warp) { return (r * kTinyWarps + warp) * kTinyU; }

// This warp's item at cursor q: chunks [kb, kb + kTinyU) of rows ra and rb (lane offsets applied) into its stage.
template <typename T>
__device__ __forceinline__ void tiny_issue_rows(uint4* ring, const TinyCursor& q, int warp, int nk, const T* ra,
                                                const T* rb, uint64_t policy) {
  uint4* st = tiny_stage(ring, q.stage);
  const int kb = tiny_chunk(q.r, warp);
#pragma unroll
  for (int u = 0; u < kTinyU; ++u) {
    const bool ok = kb + u < nk;
    cp_async16(st + u * kTinyThreads, ok ? ra + (kb + u) * kChunk : ra, ok, policy);
    cp_async16(st + (kTinyU + u) * kTinyThreads, ok ? rb + (kb + u) * kChunk : rb, ok, policy);
  }
}

// The same chunks of the lane's token operand row (null: the lane's column is not taken; the reader uses zeros).
template <typename T>
__device__ __forceinline__ void tiny_issue_operand(uint4* ring, const TinyCursor& q, int warp, int nk, const T* rowb) {
  if (rowb == nullptr) return;
  uint4* st = tiny_stage(ring, q.stage) + 2 * kTinyU * kTinyThreads;
  const int kb = tiny_chunk(q.r, warp);
#pragma unroll
  for (int u = 0; u < kTinyU; ++u) {
    if (kb + u < nk) cp_async16(st + u * kTinyThreads, rowb + (kb + u) * kChunk);
  }
}

// Item at cursor q from the ring: rows a and b, and the operand (zeros where not taken or past the last chunk).
__device__ __forceinline__ void tiny_read(uint4* ring, const TinyCursor& q, int warp, int nk, bool taken,
                                          uint4 (&wa)[kTinyU], uint4 (&wb)[kTinyU], uint4 (&bv)[kTinyU]) {
  const uint4* st = tiny_stage(ring, q.stage);
  const int kb = tiny_chunk(q.r, warp);
#pragma unroll
  for (int u = 0; u < kTinyU; ++u) {
    wa[u] = st[u * kTinyThreads];
    wb[u] = st[(kTinyU + u) * kTinyThreads];
    bv[u] = (taken && kb + u < nk) ? st[(2 * kTinyU + u) * kTinyThreads] : make_uint4(0, 0, 0, 0);
  }
}

// Gate row (ra) and up row (rb) of channel i of expert e (-1: the shared expert), at lane column offset c * 8.
template <typename T>
__device__ __forceinline__ void tiny_up_rows(const TinyArgs& a, int e, int64_t i, int c, const T*& ra,
                                             const T*& rb) {
  const int64_t D = a.dim, I = a.inter;
  if (e < 0) {
    ra = static_cast<const T*>(a.sg) + i * D;
    rb = static_cast<const T*>(a.su) + i * D;
  } else {
    ra = static_cast<const T*>(a.w13) + (static_cast<int64_t>(e) * 2 * I + i) * D;
    rb = ra + I * D;
  }
  ra += c * 8;
  rb += c * 8;
}

template <typename T>
__device__ __forceinline__ const T* tiny_down_base(const TinyArgs& a, int e) {
  return e < 0 ? static_cast<const T*>(a.sd) : static_cast<const T*>(a.w2) + static_cast<int64_t>(e) * a.dim * a.inter;
}

// Ring protocol of both kernels: the weight copies of the first kTinyStages - 1 items may go out before the wait
// for the predecessor kernel (one group each), their operand copies after it (one more group); the first iteration
// waits for every group, later ones for all but the kTinyStages - 2 newest (item it + 1 .. it + kTinyStages - 2).
template <typename T>
__global__ void __launch_bounds__(kTinyThreads, 2) moe_up_tiny_kernel(const TinyArgs a) {
  extern __shared__ uint4 ring[];
  __shared__ TinyPlan plan;
  __shared__ int pair_expert[moe_tiny_max_pairs];
  __shared__ float4 red[2][kTinyWarps][32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int64_t D = a.dim, I = a.inter;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * 8 + g;
  const int nk = static_cast<int>(D / kChunk);
  const int per_slot = (nk + kTinyWarps * kTinyU - 1) / (kTinyWarps * kTinyU);
  const uint64_t policy = evict_first_policy();
  // operand: lane (g, c) holds token g's columns of x (the same for every slot); lanes past the last token none
  const bool has_tok = g < a.n_tokens;
  const T* xg = has_tok ? static_cast<const T*>(a.x) + static_cast<int64_t>(g) * D + c * 8 : nullptr;
  const T* ra = nullptr;
  const T* rb = nullptr;
  int rows_slot = -1, issued = 0;  // issued: items copied (or being copied) so far
  TinyCursor iss;  // the next item to copy
  // x_ready: x is complete already, so slot 0 (the shared expert) takes its operands with its rows and its items run
  // before the wait for the routing, as long as the item kTinyStages - 1 ahead is still in slot 0.
  const bool early = a.x_ready && a.sg != nullptr;
  if (a.sg != nullptr) {  // slot 0 needs no plan: its first rows stream in while the previous kernel drains
    tiny_up_rows<T>(a, -1, i, c, ra, rb);
    rows_slot = 0;
    for (; issued < kTinyStages - 1 && iss.s == 0; ++issued, iss.next(per_slot)) {
      tiny_issue_rows<T>(ring, iss, warp, nk, ra, rb, policy);
      if (early) tiny_issue_operand<T>(ring, iss, warp, nk, xg);
      cp_async_commit();
    }
  }
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  TinyCursor cur;
  int it0 = 0;  // items consumed before the wait
  if (early) {
    // kTinyStages - 1 items of slot 0 in flight (one group each); consume one, copy the next while it is in slot 0
    for (; iss.s == 0; ++it0, ++issued, iss.next(per_slot), cur.next(per_slot)) {
      cp_async_wait<kTinyStages - 2>();
      uint4 wa[kTinyU], wb[kTinyU], bv[kTinyU];
      tiny_read(ring, cur, warp, nk, has_tok, wa, wb, bv);
      tiny_issue_rows<T>(ring, iss, warp, nk, ra, rb, policy);
      tiny_issue_operand<T>(ring, iss, warp, nk, xg);
      cp_async_commit();
#pragma unroll
      for (int u = 0; u < kTinyU; ++u) mma_chunk<T>(acc, wa[u], wb[u], bv[u]);
    }
  }
  pdl_wait();
  pdl_launch_dependents();
  if (!early) {  // x is the predecessor's output: the operands of the items already copied go now
    TinyCursor q;
    for (int p = 0; p < issued; ++p, q.next(per_slot)) tiny_issue_operand<T>(ring, q, warp, nk, xg);
    cp_async_commit();
  }
  if (warp == 0) tiny_plan(a, plan, pair_expert, lane);
  __syncthreads();
  const int n_slots = plan.n_slots, n_items = n_slots * per_slot;
  auto issue = [&]() {
    if (iss.s < n_slots) {
      if (iss.s != rows_slot) {
        tiny_up_rows<T>(a, plan.expert[iss.s], i, c, ra, rb);
        rows_slot = iss.s;
      }
      tiny_issue_rows<T>(ring, iss, warp, nk, ra, rb, policy);
      tiny_issue_operand<T>(ring, iss, warp, nk, xg);
    }
    cp_async_commit();  // an empty group past the end keeps the wait count uniform
    iss.next(per_slot);
  };
  for (; issued - it0 < kTinyStages - 1; ++issued) issue();
  for (int it = it0; it < n_items; ++it) {
    const int s = cur.s;
    if (a.prefetch_down && cur.r == 0 && s == n_slots - 1 && threadIdx.x < 16) {
      // the down kernel's first slot, its rows of the tiles b = blockIdx.x (mod gridDim.x), into L2
      const T* base = tiny_down_base<T>(a, plan.expert[0]);
      for (int64_t b = blockIdx.x; b < D / 16; b += gridDim.x) {
        prefetch_l2(base + (b * 16 + threadIdx.x) * I, static_cast<uint32_t>(I * sizeof(T)));
      }
    }
    if (it == 0 && !early) {
      cp_async_wait<0>();  // the operand group of the items copied before the wait came last
    } else {
      cp_async_wait<kTinyStages - 2>();  // this thread's copies of item it have landed
    }
    uint4 wa[kTinyU], wb[kTinyU], bv[kTinyU];
    tiny_read(ring, cur, warp, nk, has_tok, wa, wb, bv);
    issue();  // into the stage item it - 1 used
#pragma unroll
    for (int u = 0; u < kTinyU; ++u) mma_chunk<T>(acc, wa[u], wb[u], bv[u]);
    if (cur.r == per_slot - 1) {  // slot s done: reduce over the warps (two buffers: one barrier per slot)
      red[s & 1][warp][lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
      __syncthreads();
      if (warp == s % kTinyWarps) {
        float h[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int w = 0; w < kTinyWarps; ++w) {  // fixed order: deterministic
          const float4 v = red[s & 1][w][lane];
          h[0] += v.x;
          h[1] += v.y;
          h[2] += v.z;
          h[3] += v.w;
        }
        // lane (g, c): gate (h0, h1) and up (h2, h3) of channel i for tokens 2c and 2c + 1
        const uint32_t m = plan.mask[s];
        const int t0 = 2 * c;
        T* act = static_cast<T*>(a.act) + static_cast<int64_t>(s) * a.n_tokens * I + i;
        if ((m >> t0) & 1u) act[t0 * I] = Num<T>::store(clamped_swiglu<T>(h[0], h[2], a.limit));
        if ((m >> (t0 + 1)) & 1u) act[(t0 + 1) * I] = Num<T>::store(clamped_swiglu<T>(h[1], h[3], a.limit));
      }
    }
    cur.next(per_slot);
  }
  cp_async_wait<0>();
}

template <typename T>
__global__ void __launch_bounds__(kTinyThreads, 2) moe_down_tiny_kernel(const TinyArgs a) {
  extern __shared__ uint4 ring[];
  __shared__ TinyPlan plan;
  __shared__ int pair_expert[moe_tiny_max_pairs];
  __shared__ float4 red[kTinyWarps][32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int64_t D = a.dim, I = a.inter;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * 16;
  const int nk = static_cast<int>(I / kChunk);
  const int per_slot = (nk + kTinyWarps * kTinyU - 1) / (kTinyWarps * kTinyU);
  const uint64_t policy = evict_first_policy();
  // ids and weights were complete before the up kernel let this grid start (each of its CTAs waited for them
  // before its launch_dependents), so the plan and the first weight copies go ahead of the wait for act.
  if (warp == 0) tiny_plan(a, plan, pair_expert, lane);
  __syncthreads();
  const int n_slots = plan.n_slots, n_items = n_slots * per_slot;
  // operand: lane (g, c) holds token g's activation through the item's slot, where token g takes that slot
  const T* act = static_cast<const T*>(a.act) + static_cast<int64_t>(g) * I + c * 8;
  auto taken = [&](const TinyCursor& q) { return q.s < n_slots && ((plan.mask[q.s] >> g) & 1u) != 0; };
  auto operand = [&](const TinyCursor& q) -> const T* {
    return taken(q) ? act + static_cast<int64_t>(q.s) * a.n_tokens * I : nullptr;
  };
  const T* ra = nullptr;
  const T* rb = nullptr;
  int rows_slot = -1;
  TinyCursor iss;
  auto issue_rows = [&]() {
    if (iss.s < n_slots) {
      if (iss.s != rows_slot) {
        ra = tiny_down_base<T>(a, plan.expert[iss.s]) + (r0 + g) * I + c * 8;
        rb = ra + 8 * I;
        rows_slot = iss.s;
      }
      tiny_issue_rows<T>(ring, iss, warp, nk, ra, rb, policy);
    }
  };
  for (int p = 0; p < kTinyStages - 1; ++p, iss.next(per_slot)) {
    issue_rows();
    cp_async_commit();
  }
  pdl_wait();
  pdl_launch_dependents();
  {  // act is the up kernel's output: the operands of the items already copied go now
    TinyCursor q;
    for (int p = 0; p < kTinyStages - 1; ++p, q.next(per_slot)) tiny_issue_operand<T>(ring, q, warp, nk, operand(q));
    cp_async_commit();
  }
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  TinyCursor cur;
  for (int it = 0; it < n_items; ++it) {
    if (it == 0) {
      cp_async_wait<0>();
    } else {
      cp_async_wait<kTinyStages - 2>();
    }
    uint4 wa[kTinyU], wb[kTinyU], bv[kTinyU];
    tiny_read(ring, cur, warp, nk, taken(cur), wa, wb, bv);
    issue_rows();
    tiny_issue_operand<T>(ring, iss, warp, nk, operand(iss));
    cp_async_commit();
    iss.next(per_slot);
#pragma unroll
    for (int u = 0; u < kTinyU; ++u) mma_chunk<T>(acc, wa[u], wb[u], bv[u]);
    if (cur.r == per_slot - 1) {  // slot done: add its weighted rows (lane (g, c): rows g, g + 8; tokens 2c, 2c + 1)
      const float w0 = plan.w[cur.s][2 * c], w1 = plan.w[cur.s][2 * c + 1];
      o[0] = fmaf(w0, acc[0], o[0]);
      o[1] = fmaf(w1, acc[1], o[1]);
      o[2] = fmaf(w0, acc[2], o[2]);
      o[3] = fmaf(w1, acc[3], o[3]);
      acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
    }
    cur.next(per_slot);
  }
  cp_async_wait<0>();
  red[warp][lane] = make_float4(o[0], o[1], o[2], o[3]);
  __syncthreads();
  if (warp == 0) {
    float h[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int w = 0; w < kTinyWarps; ++w) {
      const float4 v = red[w][lane];
      h[0] += v.x;
      h[1] += v.y;
      h[2] += v.z;
      h[3] += v.w;
    }
    T* out = static_cast<T*>(a.out) + r0 + g;
    const int t0 = 2 * c;
    if (t0 < a.n_tokens) {
      out[t0 * D] = Num<T>::store(h[0]);
      out[t0 * D + 8] = Num<T>::store(h[2]);
    }
    if (t0 + 1 < a.n_tokens) {
      out[(t0 + 1) * D] = Num<T>::store(h[1]);
      out[(t0 + 1) * D + 8] = Num<T>::store(h[3]);
    }
  }
}

// ------------------------------------------------------------------------------------------ activation, combine
// act[p, :] = clamped SwiGLU(gate[p, :], up[p, :]) for p < n_rows; 8 channels a thread (I % 8 == 0, 16-byte rows).
template <typename T>
__global__ void __launch_bounds__(256) moe_act_kernel(const T* gate, const T* up, int64_t h_stride,
                                                      T* __restrict__ act, int64_t n_rows, int64_t inter,
                                                      float limit) {
  pdl_wait();
  pdl_launch_dependents();
  const int64_t per_row = inter / 8, total = n_rows * per_row;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < total;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t p = v / per_row, i = (v - p * per_row) * 8;
    float gf[8], uf[8];
    unpack8<T>(ld_coherent(gate + p * h_stride + i), gf);
    unpack8<T>(ld_coherent(up + p * h_stride + i), uf);
    uint4 o;
    T* op = reinterpret_cast<T*>(&o);
#pragma unroll
    for (int j = 0; j < 8; ++j) op[j] = Num<T>::store(clamped_swiglu<T>(gf[j], uf[j], limit));
    *reinterpret_cast<uint4*>(act + p * inter + i) = o;
  }
}

template <typename Y>
__device__ __forceinline__ void load8(const Y* p, float (&f)[8]);

template <>
__device__ __forceinline__ void load8<float>(const float* p, float (&f)[8]) {
  const uint4 a = ld_coherent(p), b = ld_coherent(p + 4);
  f[0] = __uint_as_float(a.x);
  f[1] = __uint_as_float(a.y);
  f[2] = __uint_as_float(a.z);
  f[3] = __uint_as_float(a.w);
  f[4] = __uint_as_float(b.x);
  f[5] = __uint_as_float(b.y);
  f[6] = __uint_as_float(b.z);
  f[7] = __uint_as_float(b.w);
}

template <>
__device__ __forceinline__ void load8<__nv_bfloat16>(const __nv_bfloat16* p, float (&f)[8]) {
  unpack8<__nv_bfloat16>(ld_coherent(p), f);
}

template <>
__device__ __forceinline__ void load8<__half>(const __half* p, float (&f)[8]) {
  unpack8<__half>(ld_coherent(p), f);
}

// out[t, d] = sum_j weights[t, j] * y[pos_of[t, j], d] (+ shared_y[t, d]) (fp32, j ascending, the shared expert
// last); grid (T, ceil(D / 1024)). direct_ids (the small path's direct mode): no plan, pair t * k + j is row t * k + j
// of y, absent when its id is outside [0, E).
template <typename T, typename Y>
__global__ void __launch_bounds__(kCombineThreads) moe_combine_kernel(const Y* y, int64_t y_stride,
                                                                      const Y* shared_y, int64_t shared_stride,
                                                                      const float* __restrict__ weights,
                                                                      const int32_t* pos_of,
                                                                      const int32_t* direct_ids, int n_experts,
                                                                      T* __restrict__ out, int64_t dim, int topk,
                                                                      bool vec) {
  pdl_wait();
  pdl_launch_dependents();
  const int64_t t = blockIdx.x;
  const int64_t d = (static_cast<int64_t>(blockIdx.y) * kCombineThreads + threadIdx.x) * 8;
  if (d >= dim) return;
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  // choices j = 0 .. topk - 1, then the shared expert (j = topk), summed in that order; kCombineBatch of them a
  // round: their positions and weights are loaded together, then their rows, then the sums (a position, a row, a
  // sum, one choice after another, was two memory latencies a choice at the end of every call)
  const int n_terms = topk + (shared_y != nullptr ? 1 : 0);
  for (int j0 = 0; j0 < n_terms; j0 += kCombineBatch) {
    int p[kCombineBatch];
    float w[kCombineBatch];
#pragma unroll
    for (int u = 0; u < kCombineBatch; ++u) {
      const int j = j0 + u;
      p[u] = -1;
      w[u] = 1.0f;  // the shared expert's weight
      if (j < topk) {
        const int64_t q = t * topk + j;
        if (direct_ids != nullptr) {
          p[u] = static_cast<unsigned>(direct_ids[q]) < static_cast<unsigned>(n_experts) ? static_cast<int>(q) : -1;
        } else {
          p[u] = pos_of[q];  // < 0: an id outside [0, E), no contribution, as in the reference
        }
        w[u] = weights[q];
      } else if (j < n_terms) {
        p[u] = 0;
      }
    }
    const Y* row[kCombineBatch];
#pragma unroll
    for (int u = 0; u < kCombineBatch; ++u) {
      const int j = j0 + u;
      row[u] = p[u] < 0 ? nullptr : (j < topk ? y + p[u] * y_stride + d : shared_y + t * shared_stride + d);
    }
    if (vec) {
      float v[kCombineBatch][8];
#pragma unroll
      for (int u = 0; u < kCombineBatch; ++u) {
        if (row[u] != nullptr) load8<Y>(row[u], v[u]);
      }
#pragma unroll
      for (int u = 0; u < kCombineBatch; ++u) {
        if (row[u] != nullptr) {
#pragma unroll
          for (int k = 0; k < 8; ++k) acc[k] = fmaf(w[u], v[u][k], acc[k]);
        }
      }
    } else {
      for (int u = 0; u < kCombineBatch; ++u) {
        if (row[u] == nullptr) continue;
        for (int k = 0; k < 8 && d + k < dim; ++k) acc[k] = fmaf(w[u], Num<Y>::load(row[u][k]), acc[k]);
      }
    }
  }
  if (vec) {
    uint4 o[sizeof(T) == 4 ? 2 : 1];
    T* op = reinterpret_cast<T*>(o);
#pragma unroll
    for (int k = 0; k < 8; ++k) op[k] = Num<T>::store(acc[k]);
    uint4* dst = reinterpret_cast<uint4*>(out + t * dim + d);
#pragma unroll
    for (int k = 0; k < static_cast<int>(sizeof(o) / sizeof(uint4)); ++k) dst[k] = o[k];
  } else {
    for (int k = 0; k < 8 && d + k < dim; ++k) out[t * dim + d + k] = Num<T>::store(acc[k]);
  }
}

// ------------------------------------------------------------------------------------------ launch plumbing
template <typename F>
cudaError_t with_dtype(int dtype, F&& f) {
  switch (dtype) {
    case kMoeF32: return f(float{});
    case kMoeBF16: return f(__nv_bfloat16{});
    case kMoeF16: return f(__half{});
    default: return cudaErrorInvalidValue;
  }
}

// DSV4RT_GEMV_MMA (comparisons only): 0 runs 2-8 token GEMVs of 16-bit x and weights on moe_gate_kernel instead of
// gemv_mma_kernel, 1 on its one-round instance only, 2 on its two-round instance only; unset: the launcher's choice.
int gemv_mma_mode() {
  const char* v = std::getenv("DSV4RT_GEMV_MMA");
  return v == nullptr || *v == '\0' ? -1 : std::atoi(v);
}

bool rows_on() {
  const char* v = std::getenv("DSV4RT_MOE_ROWS");
  return v == nullptr || *v == '\0' || std::atoi(v) != 0;
}

int64_t n_slots(const MoeExpertsArgs& a) {
  const int64_t pairs = a.n_tokens * a.topk;
  return pairs < a.n_experts ? pairs : a.n_experts;
}

GemvArgs gemv_args(const MoeExpertsArgs& a, void* act, float* y) {
  GemvArgs g{};
  g.x = a.x;
  g.w13 = a.w13;
  g.w2 = a.w2;
  g.sg = a.shared_gate;
  g.su = a.shared_up;
  g.sd = a.shared_down;
  g.act = act;
  g.y = y;
  g.plan = a.plan;
  g.ids = a.ids;
  g.direct = a.direct;
  g.keep_shared = a.keep_shared;
  g.n_experts = a.n_experts;
  g.dim = a.dim;
  g.inter = a.inter;
  g.n_tokens = static_cast<int>(a.n_tokens);
  g.n_pairs = static_cast<int>(a.n_tokens * a.topk);
  g.n_slots = static_cast<int>(n_slots(a));
  g.limit = a.limit;
  g.x_ready = a.x_ready;
  return g;
}

template <typename T, int NG, int U, bool ROW = false>
cudaError_t launch_mma_pair(const GemvArgs& g, int64_t slots, cudaStream_t stream, bool pdl) {
  const dim3 block(kGemvThreads);
  const unsigned s = static_cast<unsigned>(slots);
  cudaError_t err = launch(moe_up_mma_kernel<T, NG, U, ROW>, dim3(static_cast<unsigned>(g.inter / 8), s), block, 0,
                           stream, pdl, g);
  if (err != cudaSuccess) return err;
  return launch(moe_down_mma_kernel<T, NG, U, ROW>, dim3(static_cast<unsigned>(g.dim / 16), s), block, 0, stream, pdl,
                g);
}

// ------------------------------------------------------------------------------------------ large batches (sm_90a)
// Grouped GEMMs of the routed experts for large batches (prefill chunks), bf16. Work items: each expert's token rows
// in items of at most 128 rows (the plan's expert_end, scanned by every CTA); CTA (x, y) multiplies item y by weight
// tile x (256 weight rows), so an expert of at most 128 rows (most, in a prefill chunk) reads each weight byte once,
// and the items of a larger expert, adjacent in launch order, read a tile at about the same time (so that the later
// reads can come from L2). Warp specialised, 3 warpgroups: one thread of warpgroup 0 issues the tensor copies (TMA: a box of
// 128 token rows and two of 128 weight rows a k-chunk of 64, 128-byte swizzle, into a ring of 4 stages of 48 KB);
// warpgroups 1 and 2 each multiply 64 of the item's rows (warpgroup 2 idles on items of at most 64 rows) by the tile
// with wgmma m64n256k16 (fp32 accumulators, 128 a thread).
//   * up (kUp): the tile is 128 gate rows [i0, i0 + 128) and the matching 128 up rows [I + i0, ...) of w13[e]: the
//     epilogue writes act = clamped SwiGLU of the pair (rounded as the reference rounds h) for those 128 channels;
//   * down: the tile is 256 rows of w2[e] (output dims); the epilogue writes y [P, D] in bf16 (the reference's
//     F.linear rounding).
// Rows [off_e, end_e) of A (xs or act, [P, K] row-major) are expert e's. Token rows past an item's are read (other
// experts' rows, or zeros past P) and never stored.
// Why this shape (H200, 4,096 tokens, the benchmark's skewed routing, us for up / down): at::_grouped_mm's CUTLASS
// kernels take 4,843 for both; a first kernel of this kind (tiles of 128 weight rows, cp.async copies by a warpgroup,
// m64n128k16, an expert's rows in passes) 3,260 / 1,667, and without any copy still 2,616 / 1,114 (without the
// multiplies 2,739 / 1,343): each half slow. Tiles of 256 rows with TMA copies: 2,809 / 1,440, then copy-bound
// (without the multiplies 2,795); items instead of passes (large experts' weights no longer read again later):
// 2,482 / 1,247. Token rows skipped (timing only) 2,396 / 1,214, so their reads from L2 cost little; two k-chunks
// copied at once (256 contiguous bytes a weight row) 2,674 / 1,339, slower.
constexpr int kGmmBN = 256, kGmmBM = 128, kGmmBK = 64, kGmmStages = 4, kGmmThreads = 384;
constexpr int kGmmABytes = kGmmBM * 128, kGmmBBytes = kGmmBN * 128, kGmmStageBytes = kGmmABytes + kGmmBBytes;
// the ring, its mbarriers (full[4], empty[4]), the item (e, first row, end) and the scan's 12 warp sums
constexpr size_t kGmmSmem = static_cast<size_t>(kGmmStages) * kGmmStageBytes + 2 * kGmmStages * 8 + 16 * 4 + 1024;
constexpr int kGmmMathRegs = 232, kGmmCopyRegs = 40;  // 128 x (40 + 2 x 232) = 64,512 registers

// K-major bf16 operand in 128-byte swizzled atoms (8 rows of 128 bytes, 1 KB aligned): leading offset unused, 1 KB
// between 8-row groups; a k16 step is +32 bytes of the start address.
__device__ __forceinline__ uint64_t gmm_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

// box (c0 = k, c1 = row) of a 2D tensor map -> shared dst (1 KB aligned), completing on bar
__device__ __forceinline__ void gmm_tma_load(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  DSV4RT_WGMMA(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// d (+)= A B^T, m64n256k16, bf16: A (64 rows) and B (256 rows) K-major in shared memory, 128-byte swizzle
__device__ __forceinline__ void gmm_wgmma(float (&d)[128], uint64_t da, uint64_t db, int accumulate) {
  DSV4RT_WGMMA(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(da), "l"(db), "r"(accumulate));
}

// The k-loop of a multiplying warpgroup over its 64 rows (at byte a_off of a stage's token rows). A chunk's wgmmas
// stay in flight while the next chunk's are issued; its stage is released once they have completed. !LIVE (no row
// of this warpgroup in the item): the stages are released as they fill.
template <bool LIVE>
__device__ __forceinline__ void gmm_kloop(float (&acc)[128], uint32_t ring, uint32_t full, uint32_t empty, int nk,
                                          int a_off) {
  int prev = -1;
  for (int kc = 0; kc < nk; ++kc) {
    const int s = kc % kGmmStages;
    mbar_wait(full + 8 * s, (kc / kGmmStages) & 1);
    if constexpr (LIVE) {
      const uint32_t sa = ring + s * kGmmStageBytes + a_off, sb = ring + s * kGmmStageBytes + kGmmABytes;
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kGmmBK / 16; ++ks)
        gmm_wgmma(acc, gmm_desc(sa + 32 * ks), gmm_desc(sb + 32 * ks), (kc > 0 || ks > 0) ? 1 : 0);
      wgmma_commit();
      if (prev >= 0) {
        wgmma_wait<1>();  // the previous chunk's wgmmas are done: its stage may be refilled
        mbar_arrive(empty + 8 * prev);
      }
      prev = s;
    } else {
      mbar_arrive(empty + 8 * s);
    }
  }
  if constexpr (LIVE) {
    wgmma_wait<0>();
    if (prev >= 0) mbar_arrive(empty + 8 * prev);
  }
}

template <bool kUp>
__global__ void __launch_bounds__(kGmmThreads, 1)
    moe_gmm_kernel(const __grid_constant__ MoeGmmArgs g, const __grid_constant__ CUtensorMap tma,
                   const __grid_constant__ CUtensorMap tmb) {
  const int tile = blockIdx.x;
  extern __shared__ uint8_t gmm_smem_raw[];
  uint8_t* base = gmm_smem_raw + ((1024 - (smem_u32(gmm_smem_raw) & 1023)) & 1023);  // swizzle atoms: 1 KB aligned
  const uint32_t ring = smem_u32(base);
  const uint32_t full = ring + kGmmStages * kGmmStageBytes, empty = full + 8 * kGmmStages;
  int* item = reinterpret_cast<int*>(base + kGmmStages * kGmmStageBytes + 2 * kGmmStages * 8);  // [3]: e, off, end
  // the CTA's item (blockIdx.y): each expert's rows in items of at most 128, in expert order (a scan of the items
  // per expert, one thread an expert); CTAs past the last item exit
  {
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    int beg = 0, end = 0, n = 0;
    if (t < g.n_experts) {
      end = g.expert_end[t];
      beg = t > 0 ? g.expert_end[t - 1] : 0;
      n = (end - beg + kGmmBM - 1) / kGmmBM;
    }
    int incl = n;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    int* wsum = item + 4;  // [12] the warps' totals
    if (t == 0) item[0] = -1;
    if (lane == 31) wsum[warp] = incl;
    __syncthreads();
    int before = 0;
    for (int w = 0; w < warp; ++w) before += wsum[w];
    incl += before;
    const int y = static_cast<int>(blockIdx.y);
    if (n > 0 && y >= incl - n && y < incl) {
      item[0] = t;
      item[1] = beg + (y - (incl - n)) * kGmmBM;
      item[2] = end;
    }
    if (threadIdx.x == 0) {
      for (int s = 0; s < kGmmStages; ++s) {
        mbar_init(full + 8 * s, 1);      // the copying thread's arrival (with the stage's bytes)
        mbar_init(empty + 8 * s, 256);   // the two multiplying warpgroups' arrivals
      }
      mbar_init_fence();
    }
    __syncthreads();
  }
  const int e = item[0];
  if (e < 0) return;
  const int off = item[1], rows = min(item[2] - off, kGmmBM);  // this item: rows [off, off + rows)
  const int nk = static_cast<int>(g.k / kGmmBK);
  const int wg = threadIdx.x >> 7;
  if (wg == 0) {
    reg_dealloc<kGmmCopyRegs>();
    if (threadIdx.x != 0) return;
    // weight rows of the tile's two boxes: up, 128 gate rows and the matching up rows; down, 256 consecutive rows
    const int brow0 = static_cast<int>(e * g.b_rows + (kUp ? tile * 128 : tile * kGmmBN));
    const int brow1 = kUp ? static_cast<int>(brow0 + g.inter) : brow0 + 128;
    for (int kc = 0; kc < nk; ++kc) {
      const int s = kc % kGmmStages;
      if (kc >= kGmmStages) mbar_wait(empty + 8 * s, ((kc / kGmmStages) - 1) & 1);
      const uint32_t sa = ring + s * kGmmStageBytes, bar = full + 8 * s;
      mbar_arrive_expect_tx(bar, kGmmStageBytes);
      gmm_tma_load(sa, &tma, kc * kGmmBK, off, bar);
      gmm_tma_load(sa + kGmmABytes, &tmb, kc * kGmmBK, brow0, bar);
      gmm_tma_load(sa + kGmmABytes + 128 * 128, &tmb, kc * kGmmBK, brow1, bar);
    }
    return;
  }
  reg_alloc<kGmmMathRegs>();
  // multiplying warpgroups: cw 0 / 1 takes the item's rows [64 cw, 64 cw + 64)
  const int cw = wg - 1, tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31;
  float acc[128];
  // the k-loop as a template on liveness, so that no wgmma sits in a branch (ptxas serialises wgmmas in a path it
  // cannot prove uniform)
  if (rows <= 64 * cw) {
    gmm_kloop<false>(acc, ring, full, empty, nk, 0);
    return;
  }
  gmm_kloop<true>(acc, ring, full, empty, nk, 64 * cw * 128);
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(acc[i])::"memory");
  // accumulator (m64nNk16): register 4j + 2h + c is row 16 warp + lane / 4 + 8h, column 8j + 2 (lane % 4) + c
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 64 * cw + 16 * warp + (lane >> 2) + 8 * h;
    if (r >= rows) continue;
    const int64_t row = static_cast<int64_t>(off) + r;
    if constexpr (kUp) {
      __nv_bfloat16* out = static_cast<__nv_bfloat16*>(g.out) + row * g.ldo + tile * 128 + 2 * (lane & 3);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float a0 = clamped_swiglu<__nv_bfloat16>(acc[4 * j + 2 * h], acc[4 * (j + 16) + 2 * h], g.limit);
        const float a1 = clamped_swiglu<__nv_bfloat16>(acc[4 * j + 2 * h + 1], acc[4 * (j + 16) + 2 * h + 1], g.limit);
        *reinterpret_cast<__nv_bfloat162*>(out + 8 * j) = __floats2bfloat162_rn(a0, a1);
      }
    } else {
      __nv_bfloat16* out = static_cast<__nv_bfloat16*>(g.out) + row * g.ldo + tile * kGmmBN + 2 * (lane & 3);
#pragma unroll
      for (int j = 0; j < 32; ++j)
        *reinterpret_cast<__nv_bfloat162*>(out + 8 * j) = __floats2bfloat162_rn(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    }
  }
}

// cuTensorMapEncodeTiled from the driver (through the runtime: no link against libcuda), or null
PFN_cuTensorMapEncodeTiled_v12000 moe_tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// A map over a row-major bf16 matrix [rows, k] for boxes of 64 k x 128 rows, 128-byte swizzle (zeros past the end).
// No L2 promotion: a box reads 128 bytes a row, and promoting each to 256 bytes (the row's next k-chunk, which the
// next stage reads) was slower (H200, 4,096 tokens, up / down us: 2,462-2,472 / 1,235-1,242 with 256-byte promotion,
// 2,388-2,405 / 1,192-1,201 with none, 2,382-2,390 / 1,190-1,193 with 128-byte; evict-first hints on the weight
// copies 2,649 / 1,290).
cudaError_t encode_rows_map(CUtensorMap* map, const void* base, int64_t rows, int64_t k) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = moe_tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(k) * 2};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kGmmBK), 128};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box, elem,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}
}  // namespace

MoePlan moe_plan_views(int32_t* workspace, int64_t n_experts, int64_t n_pairs) {
  const int64_t slots = n_experts < n_pairs ? n_experts : n_pairs;
  MoePlan p{};
  p.expert_end = workspace;
  p.slot_expert = p.expert_end + n_experts;
  p.slot_off = p.slot_expert + slots;
  p.pair_tok = p.slot_off + slots + 1;
  p.pos_of = p.pair_tok + n_pairs;
  return p;
}

cudaError_t moe_gemv_launch(const void* x, int dtype, const GemvWeights& ws, int weight_dtype, bool out_fp32,
                            int64_t n_tokens, int64_t dim, int64_t ldx, cudaStream_t stream, bool pdl) {
  const bool same = weight_dtype == dtype && dtype != kMoeF32;  // linear: x, weights and output of one 16-bit type
  if (n_tokens < 1 || n_tokens > moe_gate_max_tokens || dim % 8 != 0 || dim >= (int64_t{1} << 31) || ldx % 8 != 0 ||
      ldx < dim || ws.n < 1 ||
      ws.n > moe_gemv_max_weights || (out_fp32 ? weight_dtype == kMoeF16 : !same)) {
    return cudaErrorInvalidValue;
  }
  const int64_t total = ws.end[ws.n - 1];
  if (total <= 0) return cudaSuccess;
  if (n_tokens >= 2 && weight_dtype == dtype && dtype != kMoeF32 && dim % 32 == 0 &&
      (ws.group_rows == 0 || ws.group_rows % kMmaRows == 0) && gemv_mma_mode() != 0) {  // the tensor cores (above)
    int64_t tiles = 0, start = 0;
    for (int i = 0; i < ws.n; ++i) {
      tiles += (ws.end[i] - start + kMmaRows - 1) / kMmaRows;
      start = ws.end[i];
    }
    return with_dtype(dtype, [&](auto tag) {
      using T = decltype(tag);
      if constexpr (std::is_same_v<T, float>) {
        return cudaErrorInvalidValue;  // excluded above
      } else {
        // two rounds in flight when a warp's share of the row takes more than one (H200, 8 tokens: 4,096-wide q_a
        // with kv 8.7 -> 6.6 us, 8,192-wide o_b 29.1 -> 21.2; 1,024-wide q_b, one round, 23.4 -> 27.5 with two)
        const int mode = gemv_mma_mode();
        const bool two = mode == 2 || (mode != 1 && dim > 32 * kMmaWarps * kMmaU);
        auto kernel = out_fp32 ? (two ? gemv_mma_kernel<T, float, true> : gemv_mma_kernel<T, float, false>)
                               : (two ? gemv_mma_kernel<T, T, true> : gemv_mma_kernel<T, T, false>);
        return launch(kernel, dim3(static_cast<unsigned>(tiles)), dim3(kMmaWarps * 32), 0, stream, pdl,
                      static_cast<const T*>(x), ws, static_cast<int>(n_tokens), dim, ldx);
      }
    });
  }
  // threads a row: kGateU 16-byte loads a thread cover a 4,096-wide row (a 1,024-wide 16-bit row: 16 threads, so
  // that q_b's 32,768 rows of 2 KB keep every load live; a one-token row wider than 4,096 16-bit weights, o_b's
  // 8,192: 128 threads, one round of loads where 64 threads took two in series)
  const int wbytes = weight_dtype == kMoeF32 ? 4 : 2;
  const bool narrow = !out_fp32 && dim <= 1024;
  const bool wide = !out_fp32 && n_tokens == 1 && dim > int64_t{kGateU} * 8 * gate_row_threads(2);
  const int rt = narrow ? 16 : wide ? 2 * gate_row_threads(2) : gate_row_threads(wbytes);
  const dim3 grid(static_cast<unsigned>((total + kGateThreads / rt - 1) / (kGateThreads / rt)));
  // the token loop's trip count a template argument: one token's call keeps one sum a thread and reads x once, not
  // moe_gate_max_tokens times
  auto go = [&](auto tag, auto w_tag, auto o_tag, auto nt, auto rt_c) {
    using T = decltype(tag);
    using W = decltype(w_tag);
    using O = decltype(o_tag);
    return launch(moe_gate_kernel<T, W, O, decltype(nt)::value, decltype(rt_c)::value>, grid, dim3(kGateThreads), 0,
                  stream, pdl, static_cast<const T*>(x), ws, static_cast<int>(n_tokens), dim, ldx, total);
  };
  auto by_tokens = [&](auto tag, auto w_tag, auto o_tag, auto rt_c) {
    if (n_tokens == 1) return go(tag, w_tag, o_tag, std::integral_constant<int, 1>{}, rt_c);
    if (n_tokens == 2) return go(tag, w_tag, o_tag, std::integral_constant<int, 2>{}, rt_c);
    if (n_tokens <= 4) return go(tag, w_tag, o_tag, std::integral_constant<int, 4>{}, rt_c);
    return go(tag, w_tag, o_tag, std::integral_constant<int, moe_gate_max_tokens>{}, rt_c);
  };
  return with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (out_fp32) {  // moe_gate, linear_fp32: fp32 or bf16 weights, fp32 output
      if (weight_dtype == kMoeBF16) {
        return by_tokens(tag, __nv_bfloat16{}, float{}, std::integral_constant<int, gate_row_threads(2)>{});
      }
      return by_tokens(tag, float{}, float{}, std::integral_constant<int, gate_row_threads(4)>{});
    }
    if constexpr (std::is_same_v<T, float>) {
      return cudaErrorInvalidValue;  // excluded above (`same`)
    } else {  // linear: weights and output in x's type
      if (narrow) return by_tokens(tag, T{}, T{}, std::integral_constant<int, 16>{});
      if (wide) {
        return go(tag, T{}, T{}, std::integral_constant<int, 1>{},
                  std::integral_constant<int, 2 * gate_row_threads(2)>{});
      }
      return by_tokens(tag, T{}, T{}, std::integral_constant<int, gate_row_threads(2)>{});
    }
  });
}

cudaError_t moe_gate_launch(const void* x, int dtype, const void* weight, bool weight_bf16, int64_t n_tokens,
                            int64_t dim, int64_t n_experts, float* logits, cudaStream_t stream, bool pdl) {
  GemvWeights ws{};
  ws.w[0] = weight;
  ws.out[0] = logits;
  ws.end[0] = n_experts;
  ws.n = 1;
  return moe_gemv_launch(x, dtype, ws, weight_bf16 ? kMoeBF16 : kMoeF32, true, n_tokens, dim, dim, stream, pdl);
}

cudaError_t moe_route_launch(const float* logits, const void* bias, bool bias_bf16, int64_t n_tokens, int n_experts,
                             int topk, float scale, float* weights, int32_t* ids, cudaStream_t stream, bool pdl) {
  const dim3 grid(static_cast<unsigned>((n_tokens + kRouteWarps - 1) / kRouteWarps)), block(kRouteWarps * 32);
  const int j = (n_experts + 31) / 32;
#define DSV4RT_ROUTE(J)                                                                                          \
  if (j <= J) {                                                                                                  \
    return launch(moe_route_kernel<J>, grid, block, 0, stream, pdl, logits, bias, bias_bf16, n_tokens, n_experts, \
                  topk, scale, weights, ids);                                                                    \
  }
  DSV4RT_ROUTE(1)
  DSV4RT_ROUTE(2)
  DSV4RT_ROUTE(4)
  DSV4RT_ROUTE(8)
  DSV4RT_ROUTE(12)
  DSV4RT_ROUTE(16)
  DSV4RT_ROUTE(32)
#undef DSV4RT_ROUTE
  return cudaErrorInvalidValue;
}

cudaError_t moe_hash_route_launch(const float* logits, const void* tid2eid, bool tid2eid_i64, const void* token_ids,
                                  bool token_ids_i64, int64_t vocab, int64_t n_tokens, int n_experts, int topk,
                                  float scale, float* weights, int32_t* ids, cudaStream_t stream, bool pdl) {
  const dim3 grid(static_cast<unsigned>((n_tokens + kRouteWarps - 1) / kRouteWarps)), block(kRouteWarps * 32);
  return launch(moe_hash_route_kernel, grid, block, 0, stream, pdl, logits, tid2eid, tid2eid_i64, token_ids,
                token_ids_i64, vocab, n_tokens, n_experts, topk, scale, weights, ids);
}

cudaError_t moe_plan_launch(const MoeExpertsArgs& a, cudaStream_t stream) {
  const int n_pairs = static_cast<int>(a.n_tokens * a.topk);
  return launch(moe_plan_kernel, dim3(1), dim3(kPlanThreads), 2 * a.n_experts * sizeof(int), stream, a.pdl, a.ids,
                n_pairs, a.topk, a.n_experts, static_cast<int>(n_slots(a)), a.plan, a.x_ready);
}

bool moe_gmm_supported(int64_t dim, int64_t inter, int64_t n_experts) {
  int dev = 0, major = 0, minor = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  return major == 9 && minor == 0 && n_experts <= kGmmThreads && dim % kGmmBN == 0 && inter % 128 == 0 && dim % kGmmBK == 0 &&
         inter % kGmmBK == 0 && moe_tensor_map_encoder() != nullptr;
}

cudaError_t moe_gmm_launch(const MoeGmmArgs& g, bool up, cudaStream_t stream) {
  // the tensor maps (host-side encodes, no stream work: safe while capturing): A [P, K], B [E * b_rows, K], boxes of
  // 64 k x 128 rows in the 128-byte swizzle
  CUtensorMap tma, tmb;
  cudaError_t err = encode_rows_map(&tma, g.a, g.a_rows, g.k);
  if (err == cudaSuccess) err = encode_rows_map(&tmb, g.b, g.n_experts * g.b_rows, g.k);
  if (err != cudaSuccess) return err;
  auto kernel = up ? moe_gmm_kernel<true> : moe_gmm_kernel<false>;
  // every call (a host-side attribute, no stream work: safe while capturing; per device, whichever is current)
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kGmmSmem));
  if (err != cudaSuccess) return err;
  const int64_t n_tiles = up ? g.inter / 128 : g.b_rows / kGmmBN;
  // items: at most one partial pass an expert beyond the rows' full passes
  const int64_t n_items = g.n_experts + (g.a_rows + kGmmBM - 1) / kGmmBM;
  return launch(kernel, dim3(static_cast<unsigned>(n_tiles), static_cast<unsigned>(n_items)), dim3(kGmmThreads),
                kGmmSmem, stream, false, g, tma, tmb);
}

cudaError_t moe_act_launch(const MoeExpertsArgs& a, const void* gate, const void* up, int64_t h_stride, void* act,
                           int64_t n_rows, cudaStream_t stream) {
  const int64_t vecs = n_rows * (a.inter / 8);
  int64_t blocks = (vecs + 255) / 256;
  const int64_t cap = static_cast<int64_t>(num_sms()) * 8;
  blocks = blocks < cap ? blocks : cap;
  if (blocks == 0) return cudaSuccess;
  return with_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    return launch(moe_act_kernel<T>, dim3(static_cast<unsigned>(blocks)), dim3(256), 0, stream, a.pdl,
                  static_cast<const T*>(gate), static_cast<const T*>(up), h_stride, static_cast<T*>(act), n_rows,
                  a.inter, a.limit);
  });
}

cudaError_t moe_combine_launch(const MoeExpertsArgs& a, const void* y, bool y_f32, int64_t y_stride,
                               const void* shared_y, int64_t shared_stride, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(a.n_tokens),
                  static_cast<unsigned>((a.dim + 8 * kCombineThreads - 1) / (8 * kCombineThreads)));
  const bool vec = a.dim % 8 == 0 && y_stride % 8 == 0 && (shared_y == nullptr || shared_stride % 8 == 0);
  const int32_t* direct_ids = a.direct ? a.ids : nullptr;
  return with_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (y_f32) {
      return launch(moe_combine_kernel<T, float>, grid, dim3(kCombineThreads), 0, stream, a.pdl,
                    static_cast<const float*>(y), y_stride, static_cast<const float*>(shared_y), shared_stride,
                    a.weights, static_cast<const int32_t*>(a.plan.pos_of), direct_ids, a.n_experts,
                    static_cast<T*>(a.out), a.dim, a.topk, vec);
    }
    return launch(moe_combine_kernel<T, T>, grid, dim3(kCombineThreads), 0, stream, a.pdl, static_cast<const T*>(y),
                  y_stride, static_cast<const T*>(shared_y), shared_stride, a.weights,
                  static_cast<const int32_t*>(a.plan.pos_of), direct_ids, a.n_experts, static_cast<T*>(a.out), a.dim,
                  a.topk, vec);
  });
}

cudaError_t moe_experts_tiny_launch(const MoeExpertsArgs& a, void* act, cudaStream_t stream) {
  TinyArgs t{};
  t.x = a.x;
  t.w13 = a.w13;
  t.w2 = a.w2;
  t.sg = a.shared_gate;
  t.su = a.shared_up;
  t.sd = a.shared_down;
  t.weights = a.weights;
  t.ids = a.ids;
  t.act = act;
  t.out = a.out;
  t.dim = a.dim;
  t.inter = a.inter;
  t.n_tokens = static_cast<int>(a.n_tokens);
  t.topk = a.topk;
  t.n_experts = a.n_experts;
  t.limit = a.limit;
  t.prefetch_down = a.tiny_prefetch;
  t.x_ready = a.x_ready;
  if (a.n_tokens > moe_tiny_max_tokens || a.n_tokens * a.topk > moe_tiny_max_pairs) return cudaErrorInvalidValue;
  return with_dtype(a.dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    if constexpr (sizeof(T) == 2) {
      const dim3 block(kTinyThreads);
      // 2 CTAs of ~107 KiB shared memory a multiprocessor: the whole carveout for shared memory
      for (const void* k : {reinterpret_cast<const void*>(moe_up_tiny_kernel<T>),
                            reinterpret_cast<const void*>(moe_down_tiny_kernel<T>)}) {
        cudaError_t err = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(kTinySmem));
        if (err == cudaSuccess) {
          err = cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     static_cast<int>(cudaSharedmemCarveoutMaxShared));
        }
        if (err != cudaSuccess) return err;
      }
      cudaError_t err;
      err = launch(moe_up_tiny_kernel<T>, dim3(static_cast<unsigned>(a.inter / 8)), block, kTinySmem, stream, a.pdl, t);
      if (err != cudaSuccess) return err;
      return launch(moe_down_tiny_kernel<T>, dim3(static_cast<unsigned>(a.dim / 16)), block, kTinySmem, stream, a.pdl,
                    t);
    }
    return cudaErrorInvalidValue;
  });
}

cudaError_t moe_experts_small_launch(const MoeExpertsArgs& args, void* act, float* y, bool tensor_cores,
                                     cudaStream_t stream) {
  MoeExpertsArgs a = args;
  a.direct = args.direct && a.n_tokens == 1 && a.topk <= a.n_experts;  // then slots = choices: no plan
  const GemvArgs g = gemv_args(a, act, y);
  const bool shared = a.shared_gate != nullptr;
  const unsigned slots = static_cast<unsigned>(n_slots(a) + (shared ? 1 : 0));
  cudaError_t err = a.direct ? cudaSuccess : moe_plan_launch(a, stream);
  if (err != cudaSuccess) return err;
  if (tensor_cores && a.dtype != kMoeF32) {
    // Token groups per pass from the shape only: a slot holds at most T tokens (more only with repeated ids).
    err = with_dtype(a.dtype, [&](auto tag) {
      using T = decltype(tag);
      if constexpr (sizeof(T) == 2) {
        // one token: the row instances (whole rows a warp); DSV4RT_MOE_ROWS=0 keeps the mma ones
        if (a.n_tokens == 1 && a.dim % kRowChunk == 0 && a.inter % kRowChunk == 0 && rows_on())
          return launch_mma_pair<T, 1, 8, true>(g, slots, stream, a.pdl);
        if (a.n_tokens <= 8) return launch_mma_pair<T, 1, 8>(g, slots, stream, a.pdl);
        if (a.n_tokens <= 16) return launch_mma_pair<T, 2, 8>(g, slots, stream, a.pdl);
        return launch_mma_pair<T, 4, 4>(g, slots, stream, a.pdl);
      }
      return cudaErrorInvalidValue;
    });
  } else {
    // Plain launches: these kernels read their predecessor's output with ordinary loads from the start.
    err = with_dtype(a.dtype, [&](auto tag) {
      using T = decltype(tag);
      const dim3 block(kGemvThreads);
      cudaError_t e = launch(moe_up_simple_kernel<T>,
                             dim3(static_cast<unsigned>((a.inter + kGemvWarps - 1) / kGemvWarps), slots), block, 0,
                             stream, false, g);
      if (e != cudaSuccess) return e;
      return launch(moe_down_simple_kernel<T>, dim3(static_cast<unsigned>((a.dim + kGemvWarps - 1) / kGemvWarps), slots),
                    block, 0, stream, false, g);
    });
  }
  if (err != cudaSuccess) return err;
  const float* shared_y = shared ? y + a.n_tokens * a.topk * a.dim : nullptr;
  return moe_combine_launch(a, y, true, a.dim, shared_y, a.dim, stream);
}

}  // namespace dsv4rt
