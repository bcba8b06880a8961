// MoE family (ops/moe.py): top-k router, hash router, routed experts with the clamped SwiGLU.
//
// Routers: one warp per token, one launch. Scores s = sqrt(softplus(z)) in fp32 (torch's formula: z > 20 ? z :
// log1p(exp(z))); top-k over s + bias by k rounds of a warp arg-max (ties: the lower expert id); weights
// s / sum(s) * scale in the order chosen.
//
// Experts. A plan kernel (one CTA) turns ids [T, k] into the per-expert pair lists on the device: counts, offsets,
// the distinct chosen experts ("slots", ascending) and the pairs (token, choice) grouped by expert. Ids outside
// [0, E) are dropped, as the reference gives them no weight. Then, for small batches:
//   * up: grid (I/8 tiles, S slots); a CTA takes 8 gate rows and the matching 8 up rows of its slot's expert, its
//     4 warps split D. Tensor cores (mma m16n8k16, fp32 accumulation) multiply those 16 rows by up to 8 of the
//     expert's tokens at a time: rows are the A operand loaded straight from global memory in 16-byte vectors
//     (a dot product may take its k in any order, so each lane's 8 contiguous columns serve as the fragment's k
//     indices, and the token operand is loaded with the same mapping); each thread ends up with the gate and up
//     value of one channel for two tokens and writes act = clamped SwiGLU, rounded as the reference rounds.
//     A slot's weights are read once for every 8 * NG of its tokens; a CTA whose slot is unused exits at once.
//   * down: the same over w2 (16 output rows a CTA, I split over the warps), writing y [P, D] fp32;
//   * combine: out[t] = sum_j weights[t, j] * y[pos(t, j)] in fp32, j in order: deterministic.
// Large batches run the two projections as grouped GEMMs (the binding) around the plan, activation and combine.
// With programmatic dependent launches each kernel's CTAs get resident while its predecessor drains; every CTA
// waits (griddepcontrol.wait) before it reads what its predecessor wrote and before it exits, so each kernel
// completes only after the one before it. The down kernel prefetches its weight tile into L2 before that wait.
#include <cfloat>
#include <climits>
#include <cstdint>
#include <utility>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "launch.cuh"
#include "moe.h"

namespace dsv4rt {
namespace {

constexpr int kRouteWarps = 4;     // tokens per router CTA
constexpr int kPlanThreads = 1024;
constexpr int kGemvWarps = 4;      // warps of an up/down CTA, splitting the reduction dimension
constexpr int kGemvThreads = kGemvWarps * 32;
constexpr int kChunk = 32;         // columns a warp covers per 16-byte load of each row (4 lanes x 8 elements)
constexpr int kCombineThreads = 128;

// ------------------------------------------------------------------------------------------ device helpers
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
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

template <typename T>
struct Num;

template <>
struct Num<float> {
  static __device__ __forceinline__ float to_float(float v) { return v; }
  static __device__ __forceinline__ float from_float(float v) { return v; }
};

template <>
struct Num<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};

template <>
struct Num<__half> {
  static __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
};

template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return Num<T>::to_float(Num<T>::from_float(v));
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

template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
                   Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

// ------------------------------------------------------------------------------------------ routers
// J = ceil(E / 32) experts per lane, kept in registers.
template <int J>
__global__ void __launch_bounds__(kRouteWarps * 32) moe_route_kernel(const float* __restrict__ logits,
                                                                     const void* __restrict__ bias, bool bias_bf16,
                                                                     int64_t n_tokens, int n_experts, int topk,
                                                                     float scale, float* __restrict__ weights,
                                                                     int32_t* __restrict__ ids) {
  pdl_wait();
  pdl_trigger();
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRouteWarps + (threadIdx.x >> 5);
  if (t >= n_tokens) return;
  const float* row = logits + t * n_experts;
  float sel[J], sc[J];
  uint32_t taken = 0;  // bit j: expert j * 32 + lane chosen (or absent)
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int e = j * 32 + lane;
    sc[j] = 0.0f;
    sel[j] = 0.0f;
    if (e < n_experts) {
      const float b = bias_bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(bias)[e])
                                : static_cast<const float*>(bias)[e];
      sc[j] = sqrt_softplus(row[e]);
      sel[j] = sc[j] + b;
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
  pdl_wait();
  pdl_trigger();
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
                                                                int topk, int n_experts, int n_slots, MoePlan plan) {
  extern __shared__ int plan_smem[];
  int* count = plan_smem;               // [E]
  int* cursor = plan_smem + n_experts;  // [E]
  __shared__ int warp_pairs[32], warp_active[32], totals[2];
  pdl_wait();
  pdl_trigger();
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
  void* act;        // [P, I]
  float* y;         // [P, D]
  MoePlan plan;
  int64_t dim, inter;
  float limit;
};


// Slots in reverse: the unused ones (past the last chosen expert) exit first, and the highest expert id, where a
// fused shared expert sits with every token (the longest CTAs), starts first.
__device__ __forceinline__ int slot_of_block() { return static_cast<int>(gridDim.y - 1 - blockIdx.y); }

// up: act[p, i0 + g] for the CTA's 8 channels and every pair p of its slot.
template <typename T, int NG, int U>
__global__ void __launch_bounds__(kGemvThreads, 4) moe_up_mma_kernel(const GemvArgs a) {
  __shared__ float4 red[kGemvWarps][NG][32];
  pdl_wait();
  pdl_trigger();
  const int s = slot_of_block();
  const int e = a.plan.slot_expert[s];
  if (e < 0) return;
  const int off = a.plan.slot_off[s], n = a.plan.slot_off[s + 1] - off;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int64_t D = a.dim, I = a.inter;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * 8 + g;
  const T* row_g = static_cast<const T*>(a.w13) + (static_cast<int64_t>(e) * 2 * I + i) * D + c * 8;
  const T* row_u = row_g + I * D;
  const int nk = static_cast<int>(D / kChunk);
  T* act = static_cast<T*>(a.act);
  for (int base = 0; base < n; base += 8 * NG) {
    const int ng = min(NG, (n - base + 7) / 8);
    const T* xrow[NG];
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) {
      const int q = base + gi * 8 + g;
      xrow[gi] = (gi < ng && q < n)
                     ? static_cast<const T*>(a.x) + static_cast<int64_t>(a.plan.pair_tok[off + q]) * D + c * 8
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
        if (q0 < n) act[(off + q0) * I + i] = Num<T>::from_float(clamped_swiglu<T>(h[0], h[2], a.limit));
        if (q0 + 1 < n) act[(off + q0 + 1) * I + i] = Num<T>::from_float(clamped_swiglu<T>(h[1], h[3], a.limit));
      }
    }
    __syncthreads();  // red is reused by the next group of tokens
  }
}

// down: y[p, r0 .. r0 + 16) for every pair p of the CTA's slot.
template <typename T, int NG, int U>
__global__ void __launch_bounds__(kGemvThreads, 4) moe_down_mma_kernel(const GemvArgs a) {
  __shared__ float4 red[kGemvWarps][NG][32];
  const int s = slot_of_block();
  const int64_t D = a.dim, I = a.inter;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * 16;
  // The plan was written two launches back; the up kernel waited for it before any of its CTAs let this grid start.
  const int e = __ldcg(a.plan.slot_expert + s);
  if (e >= 0 && threadIdx.x < 16) {  // the CTA's weight tile into L2 while the up kernel drains
    prefetch_l2(static_cast<const T*>(a.w2) + (static_cast<int64_t>(e) * D + r0 + threadIdx.x) * I,
                static_cast<uint32_t>(I * sizeof(T)));
  }
  pdl_wait();
  pdl_trigger();
  if (e < 0) return;
  const int off = a.plan.slot_off[s], n = a.plan.slot_off[s + 1] - off;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const T* row_a = static_cast<const T*>(a.w2) + (static_cast<int64_t>(e) * D + r0 + g) * I + c * 8;
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

// Plain fp32-FMA versions (float32 weights, or shapes the mma path does not take): a warp per output row, lanes
// over the reduction dimension, one token at a time.
template <typename T>
__global__ void __launch_bounds__(kGemvThreads) moe_up_simple_kernel(const GemvArgs a) {
  const int s = slot_of_block();
  const int e = a.plan.slot_expert[s];
  const int64_t D = a.dim, I = a.inter;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kGemvWarps + (threadIdx.x >> 5);
  if (e < 0 || i >= I) return;
  const int lane = threadIdx.x & 31;
  const int off = a.plan.slot_off[s], n = a.plan.slot_off[s + 1] - off;
  const T* wg = static_cast<const T*>(a.w13) + (static_cast<int64_t>(e) * 2 * I + i) * D;
  const T* wu = wg + I * D;
  for (int q = 0; q < n; ++q) {
    const T* xr = static_cast<const T*>(a.x) + static_cast<int64_t>(a.plan.pair_tok[off + q]) * D;
    float hg = 0.0f, hu = 0.0f;
    for (int64_t k = lane; k < D; k += 32) {
      const float xv = Num<T>::to_float(xr[k]);
      hg = fmaf(Num<T>::to_float(wg[k]), xv, hg);
      hu = fmaf(Num<T>::to_float(wu[k]), xv, hu);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      hg += __shfl_xor_sync(0xffffffffu, hg, o);
      hu += __shfl_xor_sync(0xffffffffu, hu, o);
    }
    if (lane == 0) static_cast<T*>(a.act)[(off + q) * I + i] = Num<T>::from_float(clamped_swiglu<T>(hg, hu, a.limit));
  }
}

template <typename T>
__global__ void __launch_bounds__(kGemvThreads) moe_down_simple_kernel(const GemvArgs a) {
  const int s = slot_of_block();
  const int e = a.plan.slot_expert[s];
  const int64_t D = a.dim, I = a.inter;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kGemvWarps + (threadIdx.x >> 5);
  if (e < 0 || r >= D) return;
  const int lane = threadIdx.x & 31;
  const int off = a.plan.slot_off[s], n = a.plan.slot_off[s + 1] - off;
  const T* w = static_cast<const T*>(a.w2) + (static_cast<int64_t>(e) * D + r) * I;
  for (int q = 0; q < n; ++q) {
    const T* ar = static_cast<const T*>(a.act) + (off + q) * I;
    float acc = 0.0f;
    for (int64_t k = lane; k < I; k += 32) acc = fmaf(Num<T>::to_float(w[k]), Num<T>::to_float(ar[k]), acc);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) a.y[(off + q) * D + r] = acc;
  }
}

// ------------------------------------------------------------------------------------------ activation, combine
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  const T* p = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int j = 0; j < 8; ++j) f[j] = Num<T>::to_float(p[j]);
}

// act[p, :] = clamped SwiGLU(h[p, :I], h[p, I:]) for p < n_pairs; 8 channels a thread (I % 8 == 0, 16-byte rows).
template <typename T>
__global__ void __launch_bounds__(256) moe_act_kernel(const T* h, int64_t h_stride, T* __restrict__ act,
                                                      int64_t n_pairs, int64_t inter, float limit) {
  pdl_wait();
  pdl_trigger();
  const int64_t per_row = inter / 8, total = n_pairs * per_row;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < total;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t p = v / per_row, i = (v - p * per_row) * 8;
    float gf[8], uf[8];
    unpack8<T>(ld_coherent(h + p * h_stride + i), gf);
    unpack8<T>(ld_coherent(h + p * h_stride + inter + i), uf);
    uint4 o;
    T* op = reinterpret_cast<T*>(&o);
#pragma unroll
    for (int j = 0; j < 8; ++j) op[j] = Num<T>::from_float(clamped_swiglu<T>(gf[j], uf[j], limit));
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

// out[t, d] = sum_j weights[t, j] * y[pos_of[t, j], d] (fp32, j ascending); grid (T, ceil(D / 1024)).
template <typename T, typename Y>
__global__ void __launch_bounds__(kCombineThreads) moe_combine_kernel(const Y* y, int64_t y_stride,
                                                                      const float* __restrict__ weights,
                                                                      const int32_t* pos_of, T* __restrict__ out,
                                                                      int64_t dim, int topk, bool vec) {
  pdl_wait();
  pdl_trigger();
  const int64_t t = blockIdx.x;
  const int64_t d = (static_cast<int64_t>(blockIdx.y) * kCombineThreads + threadIdx.x) * 8;
  if (d >= dim) return;
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  for (int j = 0; j < topk; ++j) {
    const int p = pos_of[t * topk + j];
    if (p < 0) continue;  // id outside [0, E): no contribution, as in the reference
    const float w = weights[t * topk + j];
    const Y* row = y + p * y_stride + d;
    if (vec) {
      float v[8];
      load8<Y>(row, v);
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[k] = fmaf(w, v[k], acc[k]);
    } else {
      for (int k = 0; k < 8 && d + k < dim; ++k) acc[k] = fmaf(w, Num<Y>::to_float(row[k]), acc[k]);
    }
  }
  if (vec) {
    uint4 o[sizeof(T) == 4 ? 2 : 1];
    T* op = reinterpret_cast<T*>(o);
#pragma unroll
    for (int k = 0; k < 8; ++k) op[k] = Num<T>::from_float(acc[k]);
    uint4* dst = reinterpret_cast<uint4*>(out + t * dim + d);
#pragma unroll
    for (int k = 0; k < static_cast<int>(sizeof(o) / sizeof(uint4)); ++k) dst[k] = o[k];
  } else {
    for (int k = 0; k < 8 && d + k < dim; ++k) out[t * dim + d + k] = Num<T>::from_float(acc[k]);
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

GemvArgs gemv_args(const MoeExpertsArgs& a, void* act, float* y) {
  GemvArgs g{};
  g.x = a.x;
  g.w13 = a.w13;
  g.w2 = a.w2;
  g.act = act;
  g.y = y;
  g.plan = a.plan;
  g.dim = a.dim;
  g.inter = a.inter;
  g.limit = a.limit;
  return g;
}

int64_t n_slots(const MoeExpertsArgs& a) {
  const int64_t pairs = a.n_tokens * a.topk;
  return pairs < a.n_experts ? pairs : a.n_experts;
}

template <typename T, int NG, int U>
cudaError_t launch_mma_pair(const GemvArgs& g, int64_t slots, cudaStream_t stream, bool pdl) {
  const dim3 block(kGemvThreads);
  const unsigned s = static_cast<unsigned>(slots);
  cudaError_t err = launch(moe_up_mma_kernel<T, NG, U>, dim3(static_cast<unsigned>(g.inter / 8), s), block, 0, stream,
                           pdl, g);
  if (err != cudaSuccess) return err;
  return launch(moe_down_mma_kernel<T, NG, U>, dim3(static_cast<unsigned>(g.dim / 16), s), block, 0, stream, pdl, g);
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
                n_pairs, a.topk, a.n_experts, static_cast<int>(n_slots(a)), a.plan);
}

cudaError_t moe_act_launch(const MoeExpertsArgs& a, const void* h, int64_t h_stride, void* act, int64_t n_pairs,
                           cudaStream_t stream) {
  const int64_t vecs = n_pairs * (a.inter / 8);
  int64_t blocks = (vecs + 255) / 256;
  const int64_t cap = static_cast<int64_t>(num_sms()) * 8;
  blocks = blocks < cap ? blocks : cap;
  if (blocks == 0) return cudaSuccess;
  return with_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    return launch(moe_act_kernel<T>, dim3(static_cast<unsigned>(blocks)), dim3(256), 0, stream, a.pdl,
                  static_cast<const T*>(h), h_stride, static_cast<T*>(act), n_pairs, a.inter, a.limit);
  });
}

cudaError_t moe_combine_launch(const MoeExpertsArgs& a, const void* y, bool y_f32, int64_t y_stride,
                               cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(a.n_tokens),
                  static_cast<unsigned>((a.dim + 8 * kCombineThreads - 1) / (8 * kCombineThreads)));
  const bool vec = a.dim % 8 == 0 && y_stride % 8 == 0;
  return with_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (y_f32) {
      return launch(moe_combine_kernel<T, float>, grid, dim3(kCombineThreads), 0, stream, a.pdl,
                    static_cast<const float*>(y), y_stride, a.weights, static_cast<const int32_t*>(a.plan.pos_of),
                    static_cast<T*>(a.out), a.dim, a.topk, vec);
    }
    return launch(moe_combine_kernel<T, T>, grid, dim3(kCombineThreads), 0, stream, a.pdl, static_cast<const T*>(y),
                  y_stride, a.weights, static_cast<const int32_t*>(a.plan.pos_of), static_cast<T*>(a.out), a.dim,
                  a.topk, vec);
  });
}

cudaError_t moe_experts_small_launch(const MoeExpertsArgs& a, void* act, float* y, bool tensor_cores,
                                     cudaStream_t stream) {
  const GemvArgs g = gemv_args(a, act, y);
  const unsigned slots = static_cast<unsigned>(n_slots(a));
  cudaError_t err = moe_plan_launch(a, stream);
  if (err != cudaSuccess) return err;
  if (tensor_cores && a.dtype != kMoeF32) {
    // Token groups per pass from the shape only: a slot holds at most T tokens (more only with repeated ids).
    err = with_dtype(a.dtype, [&](auto tag) {
      using T = decltype(tag);
      if constexpr (sizeof(T) == 2) {
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
  return moe_combine_launch(a, y, true, a.dim, stream);
}

}  // namespace dsv4rt
