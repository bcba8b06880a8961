// Sparse MQA attention family (ops/attention.py): every head of a query attends, with its sink in the softmax
// denominator, over one shared K = V head: the query's sliding rows and its compressed entries.
//
// Keys of token t (position p, request slot r, chunk start s) are numbered by a "slot" in [0, W + E):
//   slot i < W        sliding row of position x = p - i (i < min(p + 1, W)): this step's kv row t - i when
//                     x >= s, else ring row (r, x mod W);
//   slot W + e        CSA: entry_idx[t, e] (-1 or not yet visible: no key); HCA: entry e while e < (p+1) / ratio;
//                     entry j is row (block_table[r, j / E], j mod E) of the pool.
// Rows are read straight from the caches in their storage format (FP8 rows dequantised here).
//
// Tensor-core path (q bf16, caches bf16 or FP8 rows, D in {128, 512}): one CTA per (token, group of 16 or 64 heads, key
// split); the heads are the M dimension (MQA: all heads share the keys). 64-head groups of D = 512 with a 64-dim rope
// on sm_90a (Flash, Pro) whose CTAs take many tiles run the producer-consumer kernel (sparse_attn_pc_kernel, below: a
// producer warpgroup converts each tile while two math warpgroups compute the one before; use_pc). The other calls:
// gather threads of their own (a warpgroup beside the two math warpgroups of a 64-head CTA, one warp beside the 16-head
// CTA's two) stage each tile of 64 key slots: a bulk copy (the copy engine) a raw row into the staging slots, tracked
// by an mbarrier, issued as soon as the math warps have converted the previous tile, so that it runs while they
// compute. Each row is prefetched into L2 two tiles earlier, and the gathers' indices are loaded three (block ids) and
// four (list entries) tiles ahead. The math warps dequantise the staged rows into a swizzled fp16 tile, a thread per
// key and 64-dim atom. Warp (m, h) owns 16 heads and one half of D (for 64 heads: warpgroup h): S = Q K^T over its
// half, the pair's halves summed through shared memory (both warps then hold the same S), fp32 online softmax in
// registers, P times V = K for its half of the output columns. 64-head groups of D = 512 use wgmma on sm_90a, the rest
// mma.sync m16n8k16.
// Operands are fp16: bf16 and FP8 values convert exactly (in fp16's range, |x| <= 65504, which RMS-normed q and kv rows
// hold), so S is exact up to fp32 summation order, and P rounds to 11 bits, not bf16's 8.
// Splits (a function of the shapes only) write partial (max, sum, acc) rows to a workspace; a second kernel combines
// them with the sink.
// Any other dtype or shape runs the generic path: one CTA per (token, head), fp32 dot products, four warps each
// with its own online softmax, combined at the end.
#include <cstdlib>
#include <cstring>

#include "attention.h"
#include "async_copy.cuh"
#include "kv_quant.cuh"
#include "launch.cuh"
#include "wgmma.cuh"

namespace dsv4rt {
namespace {

constexpr int kNT = 64;  // key slots per tile
constexpr int kMaxSplits = 256;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -__builtin_huge_valf();

// Kind of a resolved key row: 0 = no key, else AttnFmt + 1.
constexpr int kKindNone = 0, kKindF32 = kAttnF32 + 1, kKindBf16 = kAttnBf16 + 1, kKindF16 = kAttnF16 + 1,
              kKindFp8 = kAttnFp8 + 1;

__host__ __device__ __forceinline__ int elem_bytes(int dtype) { return dtype == kAttnF32 ? 4 : 2; }

// ------------------------------------------------------------------------------------------ key resolution
struct TokenCtx {
  int64_t t;
  int r;         // request slot, -1: no keys (padding)
  int p, s0;     // position, first position of the request in this step
  int n_swa;     // sliding keys: slots [0, n_swa)
  int n_vis;     // visible entries: j < n_vis
  int end_slot;  // slots >= end_slot hold no key
};

__device__ __forceinline__ TokenCtx token_ctx(const SparseAttnArgs& a, int64_t t) {
  TokenCtx c;
  c.t = t;
  c.r = a.req_slot[t];
  c.p = a.positions[t];
  c.s0 = a.start_pos[t];
  c.n_swa = c.n_vis = c.end_slot = 0;
  if (c.r < 0 || c.r >= a.n_slots || c.p < 0) {  // PAD_SLOT: the reference's keys are all invisible (output 0)
    c.r = -1;
    return c;
  }
  c.n_swa = c.p + 1 < a.window ? c.p + 1 : a.window;
  c.end_slot = c.n_swa;
  if (a.entry_cache != nullptr && c.r < a.bt_rows) {
    c.n_vis = (c.p + 1) / a.ratio;
    const int64_t cap = a.bt_cols * a.per_block;
    int64_t n_ent = a.entry_idx != nullptr ? (c.n_vis > 0 ? a.topk : 0) : (c.n_vis < cap ? c.n_vis : cap);
    if (n_ent > 0) c.end_slot = a.window + static_cast<int>(n_ent);
  }
  return c;
}

// A read-only int load that stays where it is written (volatile asm): the kernel issues the gathers' index loads a
// tile or two before their use, and a plain __ldg may be sunk by the compiler next to its first use, where the
// warp then waits a whole memory latency (Nsight Compute showed it: the top long-scoreboard stalls of the kernel).
__device__ __forceinline__ int ld_index(const int32_t* p) {
  int v;
  asm volatile("ld.global.nc.b32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// Entry number of an entry slot (CSA: the index list's value), -1 for no key. Not loaded when !live.
__device__ __forceinline__ int load_j(const SparseAttnArgs& a, const TokenCtx& c, int slot, bool live) {
  if (!live || slot < a.window || slot >= c.end_slot) return -1;
  const int e = slot - a.window;
  if (a.entry_idx == nullptr) return e;
  return ld_index(a.entry_idx + c.t * a.idx_stride + e);
}

// Whether entry slot `slot` with list value j is a key: visible, and inside the pool.
__device__ __forceinline__ bool entry_live(const TokenCtx& c, int window, int slot, int j) {
  return slot >= window && j >= 0 && j < c.n_vis;
}

// Entry j >= 0 clamped into the block table (as the reference's clamp), for 32-bit unsigned arithmetic: the
// producer-consumer kernel's index pipeline is on its critical path, where 64-bit divisions cost a microsecond a tile.
__device__ __forceinline__ unsigned clamp_entry(const SparseAttnArgs& a, int j) {
  const int64_t cap = a.bt_cols * a.per_block;
  return static_cast<unsigned>(j < cap ? j : cap - 1);
}

// Raw block-table value of entry j (0 when the slot holds no entry key; resolve() clamps it). The clamp is left to
// the use, a tile later: applied here, it would stand right behind the load and wait for it.
__device__ __forceinline__ int load_blk(const SparseAttnArgs& a, const TokenCtx& c, int slot, int j) {
  if (!entry_live(c, a.window, slot, j)) return 0;
  return ld_index(a.block_table + c.r * a.bt_stride + clamp_entry(a, j) / static_cast<unsigned>(a.per_block));
}

struct Src {
  const uint8_t* ptr;
  int kind;
  const uint8_t* end;  // the end of the cache (or rows) holding it
};

__device__ __forceinline__ Src resolve(const SparseAttnArgs& a, const TokenCtx& c, int slot, int j, int blk) {
  Src s{nullptr, kKindNone, nullptr};
  if (slot < a.window) {
    if (slot >= c.n_swa) return s;
    const int x = c.p - slot;
    if (x >= c.s0) {  // this step's row
      const int64_t tt = c.t - slot;
      if (tt < 0) return s;
      s.ptr = static_cast<const uint8_t*>(a.kv) + tt * a.kv_stride * elem_bytes(a.dtype);
      s.kind = a.dtype + 1;
      s.end = s.ptr + a.dim * elem_bytes(a.dtype);
    } else {
      s.ptr = static_cast<const uint8_t*>(a.swa_cache) +
              (static_cast<int64_t>(c.r) * a.window + static_cast<unsigned>(x) % a.window) * a.swa_row_bytes;
      s.kind = a.swa_fmt + 1;
      s.end = static_cast<const uint8_t*>(a.swa_cache) + a.n_slots * a.window * a.swa_row_bytes;
    }
    return s;
  }
  if (!entry_live(c, a.window, slot, j)) return s;
  blk = blk < 0 ? 0 : (blk >= a.n_blocks ? static_cast<int>(a.n_blocks - 1) : blk);  // clamped into the pool
  const unsigned within = clamp_entry(a, j) % static_cast<unsigned>(a.per_block);
  s.ptr = static_cast<const uint8_t*>(a.entry_cache) +
          (static_cast<int64_t>(blk) * a.per_block + within) * a.ent_row_bytes;
  s.kind = a.ent_fmt + 1;
  s.end = static_cast<const uint8_t*>(a.entry_cache) + a.n_blocks * a.per_block * a.ent_row_bytes;
  return s;
}

// First tile >= x (below te) that may hold a key: it meets [0, n_swa) or [W, end_slot).
__device__ __forceinline__ int next_tile(const SparseAttnArgs& a, const TokenCtx& c, int x, int te) {
  for (; x < te; ++x) {
    const int lo = x * kNT;
    if (lo < c.n_swa) return x;
    if (lo >= c.end_slot) return te;
    if (lo + kNT > a.window) return x;
  }
  return te;
}

// 2^(byte - 127), the FP8 block scale (byte 0: the denormal 2^-127, as torch.exp2 gives).
__device__ __forceinline__ float scale_from_byte(uint32_t b) {
  return b ? __uint_as_float(b << 23) : __uint_as_float(0x00400000u);
}

// ------------------------------------------------------------------------------------------ PTX helpers
__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += a * b, m16n8k16, fp16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_half(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// 8 bf16 as 8 fp16 (exact in fp16's normal range: 8 significant bits fit in 11).
__device__ __forceinline__ uint4 bf16x8_to_half8(uint4 v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = pack_half(__uint_as_float(w[i] << 16), __uint_as_float(w[i] & 0xFFFF0000u));
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// 8 FP8 e4m3 codes times a power-of-two scale (given as fp16 2^k), as 8 fp16: exact while the products stay in fp16's
// normal range (4 significant bits; scales of real rows are >= 2^-22, the 1e-4 amax floor over 448).
__device__ __forceinline__ uint4 fp8x8_to_half8(uint2 raw, __half2 sc) {
  uint32_t o[4];
  const uint32_t w[2] = {raw.x, raw.y};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_fp8x2_storage_t pair = static_cast<__nv_fp8x2_storage_t>((w[i >> 1] >> (16 * (i & 1))) & 0xFFFFu);
    const __half2 v = __hmul2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)), sc);
    o[i] = *reinterpret_cast<const uint32_t*>(&v);
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// ---- wgmma (sm_90a): shared-memory matrix descriptors, 128-byte swizzle; tiles are 1024-byte aligned atoms
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32) | (1ull << 62);
}

// The wgmma kernels run on sm_90a only (the host picks them for compute capability 9.0): wgmma.cuh.
// Orders uses of an accumulator after the wait (the registers are written asynchronously).
__device__ __forceinline__ void fence_reg(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// d (+)= A B^T, m64n64k16: A (64 rows) and B (64 rows) K-major in shared memory, 128-byte swizzle; each descriptor
// as its 32-bit halves (lo holds the address field).
__device__ __forceinline__ void wgmma_ss_m64n64(float (&d)[8][4], uint32_t alo, uint32_t ahi, uint32_t blo,
                                                uint32_t bhi, int accumulate) {
  DSV4RT_WGMMA(
      "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %36, 0;\nmov.b64 da, {%32, %33};\nmov.b64 db, {%34, %35};\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, da, db, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(alo), "r"(ahi), "r"(blo), "r"(bhi), "r"(accumulate));
}

// S = Q K^T over NA 64-dim atoms (4 k16 steps each) of the Q tile at q_s (atoms kAtomQ bytes apart) and the K tile at
// k_s (kAtomK apart), m64n64, 128-byte swizzle, complete on return. A descriptor's address field is
// (addr mod 2^18) >> 4 in its low 14 bits, and shared addresses stay below 2^18: each step's descriptors are the two
// bases plus constants (one add each, where building them took a dozen uniform instructions a step).
template <int NA, int kAtomQ, int kAtomK>
__device__ __forceinline__ void qk_wgmma(float (&s)[8][4], uint32_t q_s, uint32_t k_s) {
#pragma unroll
  for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
  wgmma_fence();
  const uint64_t dq = smem_desc(q_s, 16, 1024), dk = smem_desc(k_s, 16, 1024);
  const uint32_t qlo = static_cast<uint32_t>(dq), qhi = static_cast<uint32_t>(dq >> 32);
  const uint32_t klo = static_cast<uint32_t>(dk), khi = static_cast<uint32_t>(dk >> 32);
#pragma unroll
  for (int ks = 0; ks < 4 * NA; ++ks) {
    const uint32_t kin = (ks & 3) * 32;
    wgmma_ss_m64n64(s, qlo + (((ks >> 2) * kAtomQ + kin) >> 4), qhi, klo + (((ks >> 2) * kAtomK + kin) >> 4), khi,
                    ks > 0);
  }
  wgmma_commit();
  wgmma_wait_all();
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) fence_reg(s[j][e]);
}

// The 128 accumulators of an m64n256 wgmma as asm operands %0 .. %127.
#define DSV4RT_D256(d) \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), \
  "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
  "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
  "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
  "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), \
  "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
  "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
  "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), \
  "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), \
  "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), \
  "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), \
  "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
  "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), \
  "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
  "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), \
  "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]), \
  "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), \
  "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), \
  "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), \
  "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]), \
  "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), \
  "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]), \
  "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]), \
  "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]), \
  "+f"(d[24][0]), "+f"(d[24][1]), "+f"(d[24][2]), "+f"(d[24][3]), \
  "+f"(d[25][0]), "+f"(d[25][1]), "+f"(d[25][2]), "+f"(d[25][3]), \
  "+f"(d[26][0]), "+f"(d[26][1]), "+f"(d[26][2]), "+f"(d[26][3]), \
  "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]), "+f"(d[27][3]), \
  "+f"(d[28][0]), "+f"(d[28][1]), "+f"(d[28][2]), "+f"(d[28][3]), \
  "+f"(d[29][0]), "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]), \
  "+f"(d[30][0]), "+f"(d[30][1]), "+f"(d[30][2]), "+f"(d[30][3]), \
  "+f"(d[31][0]), "+f"(d[31][1]), "+f"(d[31][2]), "+f"(d[31][3])

// d += A B, m64n256k16: A in registers (the mma.sync A fragment per warp), B N-major in shared memory.
__device__ __forceinline__ void wgmma_rs_m64n256_tb(float (&d)[32][4], const uint32_t (&a)[4], uint64_t db) {
  DSV4RT_WGMMA(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
      : DSV4RT_D256(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

// d += A B, m64n256k16: A (64 rows) K-major in shared memory (128-byte swizzle), B N-major in shared memory.
__device__ __forceinline__ void wgmma_ss_m64n256_tb(float (&d)[32][4], uint64_t da, uint64_t db) {
  DSV4RT_WGMMA(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 1;\n}\n"
      : DSV4RT_D256(d)
      : "l"(da), "l"(db), "r"(1));
}

// ------------------------------------------------------------------------------------------ tensor-core path
template <int D, int MT>
struct MmaCfg {
  static constexpr int kWarps = 2 * MT;          // MT head tiles x 2 halves of D (MT = 4: two warpgroups)
  static constexpr int kThreads = 32 * kWarps;    // math threads (warps 0 .. kWarps - 1)
  // gather warps (warps kWarps ..): a warpgroup of them when the math warps are two warpgroups, whose registers
  // then move to the math warps (setmaxnreg)
  static constexpr int kGatherWarps = MT == 4 ? 4 : 1;
  static constexpr int kCtaThreads = kThreads + 32 * kGatherWarps;
  // of which the first kIssueThreads issue the copies, kKeysPerThread rows each; the others exit at once
  static constexpr int kIssueThreads = MT == 4 ? 64 : 32;
  static constexpr int kKeysPerThread = kNT / kIssueThreads;
  static constexpr int kRows = 16 * MT;          // heads per CTA
  static constexpr int kDh = D / 2;              // output columns (and S partial dims) per warp
  static constexpr int kNTiles = kDh / 8;        // output n8 tiles per warp
  static constexpr int kRowBytes = 2 * D;        // an fp16 row
  // a staging slot (a bf16 or FP8 row fits), 16 bytes more than a row: the converter's lanes take consecutive keys,
  // whose slots then start 4 banks apart (conflict-free 16-byte reads)
  static constexpr int kStageRowBytes = kRowBytes + 16;
  static constexpr int kChunks = D / 8;          // 16-byte chunks per fp16 row
  static constexpr int kQOff = 0;                // Q [D/64][kRows][128 B] fp16, swizzled
  static constexpr int kKOff = kQOff + kRows * kRowBytes;     // K tile [D/64][kNT][128 B] fp16, swizzled
  static constexpr int kStageOff = kKOff + kNT * kRowBytes;   // raw rows of the next tile
  static constexpr int kXsOff = kStageOff + kNT * kStageRowBytes;  // S halves exchanged by warp pairs
  static constexpr int kKindOff = kXsOff + kWarps * 32 * 32 * 4;
  static constexpr int kBarOff = kKindOff + 2 * kNT;          // the staging tile's mbarrier (8 bytes)
  static constexpr int kSmem = kBarOff + 8 + 1024;            // + alignment of the base to 1024 bytes
  static_assert(kThreads % kNT == 0 && D % 64 == 0, "tile shape");
};

// Byte offset of 16-byte chunk c (dims 8c..8c+7) of row `row` in a tile of ROWS rows: atoms of 64 dims, each
// [ROWS][128 B] with the chunks of a row xor-ed by row mod 8 (the wgmma 128-byte swizzle; conflict-free ldmatrix).
template <int ROWS>
__device__ __forceinline__ uint32_t swz(int row, int c) {
  return static_cast<uint32_t>((c >> 3) * (ROWS * 128) + row * 128 + (((c & 7) ^ (row & 7)) << 4));
}

// Flag in a key's kinds byte: its FP8 row starts 8 bytes into its staging slot (see issue_key).
constexpr int kShift8 = 0x40;

// ---- a tile's rows land in the staging slots by the copy engine (bulk_copy, mbarriers: async_copy.cuh)
// The bytes of a key row's copy: from its 16-byte aligned base (an FP8 row, 8-byte aligned in a cache with a
// 16-byte aligned base (cache_fast), starts 8 bytes after it when odd: kShift8), `whole` of them by the copy engine
// (a multiple of 16), and a tail of `tail` bytes (< 16, 8-byte words) that only a row at the very end of its cache
// has (its copy then stops at the end of the row; other rows' copies read up to 15 bytes of the next row).
struct RowCopy {
  const uint8_t* base;
  int whole, tail, shift;
};

template <int D>
__device__ __forceinline__ RowCopy row_copy(const Src& src, int fp8_bytes) {
  if (src.kind == kKindBf16) return RowCopy{src.ptr, 2 * D, 0, 0};
  const int shift = static_cast<int>(reinterpret_cast<uintptr_t>(src.ptr) & 8);
  const uint8_t* base = src.ptr - shift;
  const int bytes = fp8_bytes + shift, up = (bytes + 15) & ~15;
  if (base + up <= src.end) return RowCopy{base, up, 0, shift};
  return RowCopy{base, bytes & ~15, bytes - (bytes & ~15), shift};
}

// The rows of a later tile into L2 (the copy that stages them then reads L2, not DRAM): a prefetch instruction a
// 128-byte line (the load path; bulk prefetches would queue in the copy engine behind the copies, whose issue rate
// they then halve).
template <int D>
__device__ __forceinline__ void prefetch_key(const Src& src, int fp8_bytes) {
  if (src.kind != kKindBf16 && src.kind != kKindFp8) return;
  const RowCopy rc = row_copy<D>(src, fp8_bytes);
  const uintptr_t b = reinterpret_cast<uintptr_t>(rc.base);
  for (uintptr_t l = b & ~uintptr_t(127); l < b + rc.whole; l += 128)
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(l));
}

// Programmatic dependent launch (launch.cuh): the attention grids may be scheduled while the grid before them still
// runs. Before pdl_wait() a CTA reads step metadata only (its token's context, block-table entries) and prefetches
// into L2 the rows of its first N tiles that the metadata alone locates: sliding rows, and entries when no index
// list picks them (the list is the grid before's output). A prefetch into L2 binds no value: every row is read after
// the wait, so a row the grid before writes is read as written. N: one tile, except two for the producer-consumer
// kernel over bf16 rows (H200, each call behind a torch kernel, alternated three times: one tile against two, decode
// b128 FP8 37.70-37.93 against 38.36-38.64 us, HCA 1M bf16 20.57-20.65 against 21.58-21.65 us, decode b128 bf16
// 44.59-44.92 against 43.07-43.32 us).
template <int D, int N>
__device__ __forceinline__ void prefetch_first_rows(const SparseAttnArgs& a, const TokenCtx& ctx, int tb, int te,
                                                    int key, int fp8_bytes) {
  int n = next_tile(a, ctx, tb, te);
#pragma unroll 1
  for (int i = 0; i < N && n < te; ++i, n = next_tile(a, ctx, n + 1, te)) {
    const int slot = n * kNT + key;
    int j = -1, blk = 0;
    if (slot >= a.window) {
      if (a.entry_idx != nullptr) continue;
      j = load_j(a, ctx, slot, true);
      blk = load_blk(a, ctx, slot, j);
    }
    prefetch_key<D>(resolve(a, ctx, slot, j, blk), fp8_bytes);
  }
}

// One key row, raw (bf16 values or the FP8 layout), to its staging slot, by one thread: a bulk copy tracked by the
// tile's mbarrier (the thread's expected bytes are added first), and the kinds byte. An FP8 row lands 8 bytes into
// its slot when odd (kShift8); a tail (row_copy) is loaded here and stored before the thread arrives.
template <int D, int MT>
__device__ __forceinline__ void issue_key(const Src& src, uint32_t stage, uint8_t* stage_ptr, uint8_t* kinds, int key,
                                          int fp8_bytes, uint32_t bar) {
  using C = MmaCfg<D, MT>;
  if (src.kind != kKindBf16 && src.kind != kKindFp8) {
    kinds[key] = static_cast<uint8_t>(src.kind);
    return;
  }
  const RowCopy rc = row_copy<D>(src, fp8_bytes);
  kinds[key] = static_cast<uint8_t>(src.kind | (rc.shift ? kShift8 : 0));
  mbar_expect_tx(bar, rc.whole);
  bulk_copy(stage + key * C::kStageRowBytes, rc.base, rc.whole, bar);
  uint8_t* tail = stage_ptr + key * C::kStageRowBytes + rc.whole;
  for (int o = 0; o < rc.tail; o += 8)
    *reinterpret_cast<uint2*>(tail + o) = __ldg(reinterpret_cast<const uint2*>(rc.base + rc.whole + o));
}

// Per key slot, a pipeline over the coming tiles (n[0] the current one, n[1..4] the next ones that may hold keys):
// s0 is the current tile's row, s1 the next one's; each next() resolves the row two tiles ahead and prefetches it
// into L2 (its copy or load then reads L2), loads the block id three tiles ahead and the list entry four tiles
// ahead, so each dependent load has a tile's time to arrive. A thread runs KK key slots g, g + stride, ..; `pf`:
// whether it issues the prefetches.
template <int KK>
struct KeyPipe {
  int n[5];
  Src s0[KK], s1[KK];
  int j2[KK], b2[KK], j3[KK];

  template <int D>
  __device__ __forceinline__ void start(const SparseAttnArgs& a, const TokenCtx& ctx, int tb, int te, int g,
                                        int stride, int fp8_bytes, bool pf) {
    n[0] = next_tile(a, ctx, tb, te);
#pragma unroll
    for (int i = 1; i < 5; ++i) n[i] = next_tile(a, ctx, n[i - 1] + 1, te);
#pragma unroll
    for (int h = 0; h < KK; ++h) {
      const int key = g + h * stride;
      int j[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) j[i] = load_j(a, ctx, n[i] * kNT + key, n[i] < te);
      int b[3];
#pragma unroll
      for (int i = 0; i < 3; ++i) b[i] = load_blk(a, ctx, n[i] * kNT + key, j[i]);
      s0[h] = resolve(a, ctx, n[0] * kNT + key, j[0], b[0]);
      s1[h] = n[1] < te ? resolve(a, ctx, n[1] * kNT + key, j[1], b[1]) : Src{nullptr, kKindNone, nullptr};
      if (pf) prefetch_key<D>(s1[h], fp8_bytes);
      j2[h] = j[2];
      b2[h] = b[2];
      j3[h] = j[3];
    }
  }

  // to the next tile: s0 <- s1, and the loads of the later tiles issued
  template <int D>
  __device__ __forceinline__ void next(const SparseAttnArgs& a, const TokenCtx& ctx, int te, int g, int stride,
                                       int fp8_bytes, bool pf) {
    const int n5 = next_tile(a, ctx, n[4] + 1, te);
#pragma unroll
    for (int h = 0; h < KK; ++h) {
      const int key = g + h * stride;
      const Src s2 = n[2] < te ? resolve(a, ctx, n[2] * kNT + key, j2[h], b2[h]) : Src{nullptr, kKindNone, nullptr};
      if (pf) prefetch_key<D>(s2, fp8_bytes);
      const int b3 = load_blk(a, ctx, n[3] * kNT + key, j3[h]);
      const int j4 = load_j(a, ctx, n[4] * kNT + key, n[4] < te);
      s0[h] = s1[h];
      s1[h] = s2;
      j2[h] = j3[h];
      b2[h] = b3;
      j3[h] = j4;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) n[i] = n[i + 1];
    n[4] = n5;
  }
};

// Staging tile (raw rows) -> swizzled fp16 K tile; absent keys become zero rows. A thread takes one key and every
// (kThreads / kNT)-th 64-dim atom of it (the lanes of a warp: 32 consecutive keys, one atom): an FP8 atom is one
// scale block (its scale read once), the rope atom of an FP8 row and the atoms of a bf16 row are 128 contiguous
// bytes; all loads of an atom are issued before its first conversion.
template <int D, int MT>
__device__ __forceinline__ void convert_tile(const uint8_t* stage, uint8_t* kdst, const uint8_t* kinds, int nope,
                                             int exp_off, int tid) {
  using C = MmaCfg<D, MT>;
  const int key = tid % kNT;
  const int kind = kinds[key] & ~kShift8;
  const uint8_t* row = stage + key * C::kStageRowBytes + (kinds[key] & kShift8 ? 8 : 0);
  constexpr int kStep = C::kThreads / kNT, kItems = (D / 64 + kStep - 1) / kStep;
#pragma unroll 2
  for (int i = 0; i < kItems; ++i) {
    const int atom = tid / kNT + i * kStep;
    if (atom >= D / 64) break;
    uint4 v[8];
    if (kind == kKindFp8 && atom * 64 < nope) {  // FP8 rows: 8-byte aligned in their slot
      const uint2* src = reinterpret_cast<const uint2*>(row + atom * 64);
      uint2 raw[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) raw[j] = src[j];
      const __half sc = __float2half_rn(scale_from_byte(row[exp_off + atom]));
      const __half2 sc2 = __half2(sc, sc);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = fp8x8_to_half8(raw[j], sc2);
    } else if (kind == kKindFp8) {  // the rope dims of an FP8 row: bf16
      const uint2* src = reinterpret_cast<const uint2*>(row + nope + 2 * (atom * 64 - nope));
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint2 lo = src[2 * j], hi = src[2 * j + 1];
        v[j] = make_uint4(lo.x, lo.y, hi.x, hi.y);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = bf16x8_to_half8(v[j]);
    } else if (kind == kKindBf16) {
      const uint4* src = reinterpret_cast<const uint4*>(row + atom * 128);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = src[j];
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = bf16x8_to_half8(v[j]);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) *reinterpret_cast<uint4*>(kdst + swz<kNT>(key, atom * 8 + j)) = v[j];
  }
}

// Online softmax over rows g and g + 8 of a warp's 16 heads, S complete: absent keys masked, scaled to log2 units;
// returns P in s, rescales acc and gives the rows' rescale factors (al0, al1). LAZY: a row's reference max moves
// only when the tile's max exceeds it by more than kLazyMax (log2 units), so p <= 2^kLazyMax (fp16 holds it) and
// most tiles leave the factors at exactly 1 and skip the rescale; acc and l stay relative to the same reference,
// and the end (or the split combine) divides by l at that reference, so the result is the same softmax.
constexpr float kLazyMax = 8.0f;

// acc rows r0 (elements 0, 1) and r0 + 8 (2, 3) times their rescale factors.
template <int NTILES>
__device__ __forceinline__ void rescale_rows(float (&acc)[NTILES][4], float al0, float al1) {
#pragma unroll
  for (int n = 0; n < NTILES; ++n) {
    acc[n][0] *= al0;
    acc[n][1] *= al0;
    acc[n][2] *= al1;
    acc[n][3] *= al1;
  }
}

template <int NTILES, bool LAZY = false>
__device__ __forceinline__ void softmax_rows(float (&s)[8][4], float (&acc)[NTILES][4], const uint8_t* kinds,
                                             float& m0, float& m1, float& l0, float& l1, float& al0, float& al1,
                                             float sc2, int lane) {
  const int tig = lane & 3;
  const uint32_t vlo = __ballot_sync(0xffffffffu, kinds[lane] != 0);
  const uint32_t vhi = __ballot_sync(0xffffffffu, kinds[lane + 32] != 0);
  float mx0 = kNegInf, mx1 = kNegInf;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t vm = j < 4 ? vlo : vhi;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const bool ok = (vm >> (((8 * j) & 31) + 2 * tig + e)) & 1u;
      s[j][e] = ok ? s[j][e] * sc2 : kNegInf;
      s[j][2 + e] = ok ? s[j][2 + e] * sc2 : kNegInf;
      mx0 = fmaxf(mx0, s[j][e]);
      mx1 = fmaxf(mx1, s[j][2 + e]);
    }
  }
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
  if constexpr (LAZY) {  // (-inf) - (-inf) is NaN: no key yet keeps -inf
    if (mn0 - m0 <= kLazyMax) mn0 = m0;
    if (mn1 - m1 <= kLazyMax) mn1 = m1;
  }
  const float mu0 = mn0 == kNegInf ? 0.0f : mn0, mu1 = mn1 == kNegInf ? 0.0f : mn1;  // no key yet: all p = 0
  al0 = LAZY && mn0 == m0 ? 1.0f : fast_exp2(m0 - mu0);
  al1 = LAZY && mn1 == m1 ? 1.0f : fast_exp2(m1 - mu1);
  m0 = mn0;
  m1 = mn1;
  float rs0 = 0.0f, rs1 = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      s[j][e] = fast_exp2(s[j][e] - mu0);
      s[j][2 + e] = fast_exp2(s[j][2 + e] - mu1);
      rs0 += s[j][e];
      rs1 += s[j][2 + e];
    }
  }
  l0 = l0 * al0 + rs0;
  l1 = l1 * al1 + rs1;
  if (!LAZY || al0 != 1.0f || al1 != 1.0f) rescale_rows(acc, al0, al1);
}

// The warp pair's halves of S summed (both warps form the same sum: fp32 addition commutes), then softmax_rows.
template <int NTILES>
__device__ __forceinline__ void softmax_tile(float (&s)[8][4], float (&acc)[NTILES][4], float* xs, const uint8_t* kinds,
                                             float& m0, float& m1, float& l0, float& l1, float sc2, int warp,
                                             int partner, int bar_id, int lane) {
  float* mine = xs + warp * 1024;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) mine[(j * 4 + e) * 32 + lane] = s[j][e];
  bar_sync(bar_id, 64);
  const float* other = xs + partner * 1024;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] += other[(j * 4 + e) * 32 + lane];
  float al0, al1;
  softmax_rows<NTILES>(s, acc, kinds, m0, m1, l0, l1, al0, al1, sc2, lane);
}

// P (rows g, g + 8; keys 16 kk ..) as the A fragment of a k16 step.
__device__ __forceinline__ void p_fragment(const float (&s)[8][4], int kk, uint32_t (&pa)[4]) {
  pa[0] = pack_half(s[2 * kk][0], s[2 * kk][1]);
  pa[1] = pack_half(s[2 * kk][2], s[2 * kk][3]);
  pa[2] = pack_half(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  pa[3] = pack_half(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// One tile, mma.sync: S = Q K^T over this warp's half of D, softmax, acc += P V over its half of the columns.
template <int D, int MT>
__device__ __forceinline__ void compute_tile(uint32_t q_s, uint32_t k_s, const uint8_t* kinds, float* xs,
                                             float (&acc)[MmaCfg<D, MT>::kNTiles][4], float& m0, float& m1,
                                             float& l0, float& l1, float sc2, int warp, int lane) {
  using C = MmaCfg<D, MT>;
  const int mt = warp % MT, dh = warp / MT;
  float s[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < C::kDh / 16; ++ks) {
    const int kc = (dh * C::kDh + ks * 16) >> 3;
    uint32_t qa[4];
    ldsm_x4(qa, q_s + swz<C::kRows>(mt * 16 + (lane & 7) + (lane & 8), kc + (lane >> 4)));
#pragma unroll
    for (int jp = 0; jp < 4; ++jp) {
      uint32_t kb[4];
      ldsm_x4(kb, k_s + swz<kNT>(jp * 16 + (lane & 7) + ((lane >> 4) << 3), kc + ((lane >> 3) & 1)));
      mma_f16(s[2 * jp], qa, kb[0], kb[1]);
      mma_f16(s[2 * jp + 1], qa, kb[2], kb[3]);
    }
  }
  softmax_tile<C::kNTiles>(s, acc, xs, kinds, m0, m1, l0, l1, sc2, warp, dh ? warp - MT : warp + MT, 1 + mt, lane);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    uint32_t pa[4];
    p_fragment(s, kk, pa);
    const int key = kk * 16 + (lane & 7) + (lane & 8);
#pragma unroll
    for (int np = 0; np < C::kNTiles / 2; ++np) {
      uint32_t vb[4];
      ldsm_x4_trans(vb, k_s + swz<kNT>(key, ((dh * C::kDh + np * 16) >> 3) + (lane >> 4)));
      mma_f16(acc[2 * np], pa, vb[0], vb[1]);
      mma_f16(acc[2 * np + 1], pa, vb[2], vb[3]);
    }
  }
}

// One tile, wgmma (D = 512, 64 heads): warpgroup h computes S over its 256 dims (16 x m64n64k16, both operands
// K-major in shared memory: leading offset unused, 1024 bytes between 8-row groups, +32 bytes a k16 step), the
// halves are summed as above, then acc += P V over its 256 columns (4 x m64n256k16, P from registers, V = the K tile
// read N-major: 8 KiB between the 64-dim atoms, 1024 bytes between groups of 8 keys).
__device__ __forceinline__ void compute_tile_wg(uint32_t q_s, uint32_t k_s, const uint8_t* kinds, float* xs,
                                                float (&acc)[32][4], float& m0, float& m1, float& l0, float& l1,
                                                float sc2, int warp, int lane) {
  constexpr int kAtomQ = 64 * 128, kAtomK = kNT * 128;  // bytes of one 64-dim atom of Q / of the K tile
  const int mt = warp & 3, dh = warp >> 2;
  float s[8][4];
  qk_wgmma<4, kAtomQ, kAtomK>(s, q_s + dh * 4 * kAtomQ, k_s + dh * 4 * kAtomK);
  softmax_tile<32>(s, acc, xs, kinds, m0, m1, l0, l1, sc2, warp, warp ^ 4, 1 + mt, lane);
  uint32_t pa[4][4];
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) p_fragment(s, kk, pa[kk]);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    wgmma_rs_m64n256_tb(acc, pa[kk], smem_desc(k_s + dh * 4 * kAtomK + kk * 16 * 128, kAtomK, 1024));
  wgmma_commit();
  wgmma_wait_all();
#pragma unroll
  for (int n = 0; n < 32; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) fence_reg(acc[n][e]);
}

// Q rows of head group hg of token t as fp16 (rows past H: zeros) into the swizzled Q tile, by the math threads.
// 16-byte chunks a thread, in rounds of loads issued before their first use: all 16 at once in the wgmma kernels
// (registers are free here), 8 in the mma.sync kernels (16 spill in their 16-head variant).
template <int D, int MT, bool WG>
__device__ __forceinline__ void stage_q(const SparseAttnArgs& a, int64_t t, int hg, uint8_t* qd, int tid) {
  using C = MmaCfg<D, MT>;
  const __nv_bfloat16* qb = static_cast<const __nv_bfloat16*>(a.q);
  constexpr int kPer = C::kRows * C::kChunks / C::kThreads, kMaxRound = WG ? 16 : 8;
  constexpr int kRound = kPer < kMaxRound ? kPer : kMaxRound;
  static_assert(C::kRows * C::kChunks % C::kThreads == 0 && kPer % kRound == 0, "Q chunks");
#pragma unroll 1
  for (int i0 = 0; i0 < kPer; i0 += kRound) {
    uint4 v[kRound];
#pragma unroll
    for (int i = 0; i < kRound; ++i) {
      const int idx = tid + (i0 + i) * C::kThreads, row = idx / C::kChunks, c = idx % C::kChunks;
      const int h = hg * C::kRows + row;
      v[i] = h < a.heads ? *reinterpret_cast<const uint4*>(qb + t * a.q_stride_t +
                                                            static_cast<int64_t>(h) * a.q_stride_h + c * 8)
                         : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < kRound; ++i) {
      const int idx = tid + (i0 + i) * C::kThreads, row = idx / C::kChunks, c = idx % C::kChunks;
      *reinterpret_cast<uint4*>(qd + swz<C::kRows>(row, c)) = bf16x8_to_half8(v[i]);
    }
  }
}

// Named barriers of the tensor-core kernel (1 .. 4: the softmax's warp pairs, see compute_tile): the math warps
// arrive at kBarFree when they have converted a tile (the staging slots are free again) and the gather threads wait
// there; kBarMath orders the math warps alone. A staged tile is signalled by the staging mbarrier.
constexpr int kBarFree = 6, kBarMath = 7;
// Registers a thread of the 64-head kernels (384 threads): two math warpgroups take most of the registers the
// launch allocates (168 x 384 = 64512 = 2 x 128 x 224 + 128 x 56; setmaxnreg only moves registers within that
// allocation, and an increase the decreases do not cover waits forever).
constexpr int kMathRegs = 224, kGatherRegs = 56;

template <int D, int MT, bool WG>
__global__ void __launch_bounds__(MmaCfg<D, MT>::kCtaThreads, 1)
    sparse_attn_mma_kernel(const SparseAttnArgs a, int max_tiles) {
  using C = MmaCfg<D, MT>;
  static_assert(!WG || (D == 512 && MT == 4), "the wgmma path is for 64 heads of D = 512");
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int n_hg = (a.heads + C::kRows - 1) / C::kRows;
  const int64_t t = blockIdx.x / n_hg;
  const int hg = static_cast<int>(blockIdx.x % n_hg);
  const int split = blockIdx.y, n_splits = gridDim.y;
  const TokenCtx ctx = token_ctx(a, t);
  const int tps = (max_tiles + n_splits - 1) / n_splits;
  const int tb = split * tps;
  const int n_tiles = (ctx.end_slot + kNT - 1) / kNT;
  const int te = tb + tps < n_tiles ? tb + tps : n_tiles;
  const int nope = D - a.rope_dim, exp_off = nope + 2 * a.rope_dim;
  uint8_t* kinds = smem + C::kKindOff;

  const uint32_t staged_bar = smem_u32(smem + C::kBarOff);
  if (tid == 0) {
    mbar_init(staged_bar, C::kIssueThreads);
    mbar_init_fence();
  }
  __syncthreads();
  pdl_launch_dependents();  // the combine (or the next grid) may be scheduled: it waits for this grid's completion

  if (warp >= C::kWarps) {
    // The gather threads: tile after tile, one bulk copy a row into the staging slots, as soon as the math warps
    // have converted the previous tile; the tile's mbarrier completes when every row has landed. Thread g copies
    // keys g, g + kIssueThreads, ..; the other threads of the gather warpgroup have nothing to do.
    if constexpr (MT == 4) reg_dealloc<kGatherRegs>();
    const int g = tid - C::kThreads;
    if (g >= C::kIssueThreads) return;
    constexpr int kK = C::kKeysPerThread;
    const int fp8_bytes = exp_off + nope / kFp8Block;  // an FP8 row: values, rope, scales
    const uint32_t stage = smem_u32(smem + C::kStageOff);
    // Per key, KeyPipe: this tile's row is copied; the copies of a tile go out (and the thread arrives) before the
    // pipeline's waits for the later tiles' indices.
#pragma unroll
    for (int h = 0; h < kK; ++h) prefetch_first_rows<D, 1>(a, ctx, tb, te, g + h * C::kIssueThreads, fp8_bytes);
    pdl_wait();  // the grid before has completed: q, this step's rows, the caches and the index list are written
    KeyPipe<kK> kp;
    kp.template start<D>(a, ctx, tb, te, g, C::kIssueThreads, fp8_bytes, true);
    for (int it = 0; kp.n[0] < te; ++it) {
      if (it > 0) bar_sync(kBarFree, C::kThreads + C::kIssueThreads);
#pragma unroll
      for (int h = 0; h < kK; ++h)
        issue_key<D, MT>(kp.s0[h], stage, smem + C::kStageOff, kinds + (it & 1) * kNT, g + h * C::kIssueThreads,
                         fp8_bytes, staged_bar);
      mbar_arrive(staged_bar);
      kp.template next<D>(a, ctx, te, g, C::kIssueThreads, fp8_bytes, true);
    }
    return;
  }
  if constexpr (MT == 4) reg_alloc<kMathRegs>();
  pdl_wait();

  float* xs = reinterpret_cast<float*>(smem + C::kXsOff);
  const uint32_t q_s = smem_u32(smem + C::kQOff), k_s = smem_u32(smem + C::kKOff);
  float acc[C::kNTiles][4];
#pragma unroll
  for (int n = 0; n < C::kNTiles; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  float m0 = kNegInf, m1 = kNegInf, l0 = 0.0f, l1 = 0.0f;
  const float sc2 = a.scale * kLog2e;

  int cur = next_tile(a, ctx, tb, te);
  if (cur < te) {
    // Q rows of the head group as fp16, while the gather threads stage the first tile
    stage_q<D, MT, WG>(a, t, hg, smem + C::kQOff, tid);
    int n1 = next_tile(a, ctx, cur + 1, te);
    for (int it = 0; cur < te; ++it) {
      const int par = it & 1;
      mbar_wait(staged_bar, par);  // tile `cur` is staged
      // every math warp is done with the previous tile (and has stored its Q rows)
      bar_sync(kBarMath, C::kThreads);
      convert_tile<D, MT>(smem + C::kStageOff, smem + C::kKOff, kinds + par * kNT, nope, exp_off, tid);
      if (WG) fence_proxy_async_shared();  // the tensor cores read Q and K through the async proxy
      bar_sync(kBarMath, C::kThreads);  // the K tile is complete
      if (n1 < te) bar_arrive(kBarFree, C::kThreads + C::kIssueThreads);  // the staging slots are free
      if constexpr (WG) {
        compute_tile_wg(q_s, k_s, kinds + par * kNT, xs, acc, m0, m1, l0, l1, sc2, warp, lane);
      } else {
        compute_tile<D, MT>(q_s, k_s, kinds + par * kNT, xs, acc, m0, m1, l0, l1, sc2, warp, lane);
      }
      cur = n1;
      n1 = next_tile(a, ctx, n1 + 1, te);
    }
  }

  // row sums over the quad; finish with the sink, or write the split's partial rows
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  const int mt = warp % MT, dh = warp / MT, g = lane >> 2, tig = lane & 3;
  // Whole rows: the output goes through shared memory (the K tile's space, [kRows][D] bf16 with 16-byte chunks
  // xor-ed by row), then out in 16-byte stores, whole rows a warp.
  uint8_t* ost = smem + C::kKOff;
  static_assert(C::kRows * D * 2 <= kNT * C::kRowBytes, "the output tile fits in the K tile");
  float sink[2] = {0.0f, 0.0f};
  if (n_splits == 1) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int h = hg * C::kRows + mt * 16 + g + 8 * r;
      if (h < a.heads) sink[r] = a.sinks[h];
    }
    bar_sync(kBarMath, C::kThreads);  // every math warp is done with the K tile
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = mt * 16 + g + 8 * r, h = hg * C::kRows + row;
    if (h >= a.heads) continue;
    const float m = r ? m1 : m0, l = r ? l1 : l0;
    const int col = dh * C::kDh + 2 * tig;
    if (n_splits == 1) {
      const float sink2 = sink[r] * kLog2e;
      const float mm = fmaxf(m, sink2);
      const float f = exp2f(m - mm);
      const float inv = f / (l * f + exp2f(sink2 - mm));
#pragma unroll
      for (int n = 0; n < C::kNTiles; ++n) {
        const int cc = col + n * 8;  // column pair (cc, cc + 1) in chunk cc / 8
        *reinterpret_cast<__nv_bfloat162*>(ost + row * D * 2 + (((cc >> 3) ^ (row & 7)) << 4) + 2 * (cc & 7)) =
            __floats2bfloat162_rn(acc[n][2 * r] * inv, acc[n][2 * r + 1] * inv);
      }
    } else {
      const int64_t prow = (t * n_splits + split) * a.heads + h;
      float* ml = a.workspace + a.n_tokens * n_splits * a.heads * D;
      if (dh == 0 && tig == 0) {
        ml[2 * prow] = m;
        ml[2 * prow + 1] = l;
      }
      if (m != kNegInf) {  // a split without keys leaves its acc row unwritten: the combine skips it
        float* w = a.workspace + prow * D + col;
#pragma unroll
        for (int n = 0; n < C::kNTiles; ++n)
          *reinterpret_cast<float2*>(w + n * 8) = make_float2(acc[n][2 * r], acc[n][2 * r + 1]);
      }
    }
  }
  if (n_splits == 1) {
    bar_sync(kBarMath, C::kThreads);
    const int rows = a.heads - hg * C::kRows < C::kRows ? a.heads - hg * C::kRows : C::kRows;
    __nv_bfloat16* o = static_cast<__nv_bfloat16*>(a.out) + (t * a.heads + hg * C::kRows) * D;
    for (int idx = tid; idx < rows * (D / 8); idx += C::kThreads) {
      const int row = idx / (D / 8), c = idx % (D / 8);
      *reinterpret_cast<uint4*>(o + row * D + c * 8) =
          *reinterpret_cast<const uint4*>(ost + row * D * 2 + ((c ^ (row & 7)) << 4));
    }
  }
}

// ---- the producer-consumer kernel (64 heads of D = 512, sm_90a): three warpgroups, two fp16 K tiles.
// Warpgroup 0: S = Q K^T over all of D (32 x m64n64k16, no exchange), the online softmax, P to shared memory with
// the rows' rescale factors, then acc += P V over output columns 0 .. 255 (P from registers).
// Warpgroup 1: rescales its acc by those factors, acc += P V over columns 256 .. 511 (P from shared memory); its
// product of tile i runs while warpgroup 0 computes S of tile i + 1.
// Warpgroup 2 (the producer): two threads a key resolve the tile's rows (KeyPipe: rows prefetched into L2 two tiles
// ahead); eight lanes a key load them raw (a tile's loads in flight during the index pipeline's step), convert them
// into the free K tile and mark it full. So the math warps never convert, and a tile's conversion runs while the one
// before is computed.
// mbarriers: full[b] (the producer's 128 threads), empty[b] (the 256 math threads, once their products have read K
// tile b), pfull[b] (warpgroup 0), pempty[b] (warpgroup 1) for the two P tiles; tile it uses K and P tile it & 1.
// Three warpgroups, not four: at 512 threads a thread may hold 128 registers, and ptxas needs at least 158 for the 128
// accumulators of wgmma m64n256, so a second producer warpgroup does not fit. Warpgroup 1 running the index pipeline
// (the tiles' row pointers through a ring in shared memory) was slower (docs/benchmarks.md, branch
// wip/attn-index-wg1).
struct PcCfg {
  static constexpr int kThreads = 384;
  static constexpr int kKBytes = kNT * 1024;               // an fp16 K tile [8 atoms][64][128 B]
  static constexpr int kQOff = 0;                          // Q [8 atoms][64 heads][128 B]
  static constexpr int kKOff = kQOff + 64 * 1024;          // 2 K tiles
  static constexpr int kPOff = kKOff + 2 * kKBytes;        // 2 P tiles [64 heads][128 B]
  static constexpr int kAlphaOff = kPOff + 2 * 64 * 128;   // 2 x 64 row factors
  static constexpr int kMlOff = kAlphaOff + 2 * 64 * 4;    // 64 x (max, sum): warpgroup 0 -> 1 at the end
  static constexpr int kKindOff = kMlOff + 64 * 8;         // 2 x 64 key kinds
  static constexpr int kBarOff = kKindOff + 2 * kNT;       // full[2], empty[2], pfull[2], pempty[2]
  static constexpr int kSmem = kBarOff + 8 * 8 + 1024;     // + alignment of the base to 1024 bytes
  // registers a thread: 168 x 384 = 64512 = 128 x (192 + 160 + 152). Warpgroup 0 spills one word with the lazy
  // softmax; 200 / 160 / 144 spills nothing but was slower on an H200 (36.6-36.9 against 35.8-35.9 us at decode b128,
  // the producer at 144), and 208 for warpgroup 0's S of the next tile behind its P V leaves the producer 136 (it
  // spills: 44.6-44.8 us).
  static constexpr int kRegsS = 192, kRegsPV = 160, kRegsProd = 152;
};

// The producer's rows: 8 lanes a key (u = lane & 7), so that a warp's load touches the lines of 4 rows, not of 32 (the
// load pipeline handles a warp's lines one at a time: with a key a thread pair, the producer's loads took a microsecond
// a tile). Lane u of a key takes the fp16 chunks u + 8m of its row, m = 0 .. 7: FP8 rows, the 8-byte pieces u + 8m of
// the 7 scaled atoms, the two pieces of rope chunk u, and the scales; bf16 rows, the 16-byte chunks u + 8m. So each
// store of a warp fills 4 whole 128-byte rows of an atom (no bank conflict). pc_load_pass issues the loads of one key a
// key group (a pass), pc_store_pass converts and stores them; absent keys become zeros. The pc kernel runs D = 512
// with a 64-dim rope only (use_pc): FP8 rows are 448 scaled dims, 64 bf16 rope dims at 448, 7 scale bytes at 576.
constexpr int kPcNope = 448, kPcExpOff = 576;

// Pass registers: N 16-byte words. FP8 rows take 5 (the pieces u + 8m, m < 7, the rope chunk's two pieces, the
// scales); bf16 rows the chunks u + 8m, m < N, loaded ahead, the others (N < 8) loaded by pc_store_pass.
template <int N>
__device__ __forceinline__ void pc_load_pass(int kind, const uint8_t* row, int u, uint4 (&v)[N]) {
  if (kind == kKindFp8) {
    uint2 x[10];
#pragma unroll
    for (int m = 0; m < 7; ++m) x[m] = __ldg(reinterpret_cast<const uint2*>(row + 8 * (u + 8 * m)));
    x[7] = __ldg(reinterpret_cast<const uint2*>(row + kPcNope + 16 * u));
    x[8] = __ldg(reinterpret_cast<const uint2*>(row + kPcNope + 16 * u + 8));
    x[9] = __ldg(reinterpret_cast<const uint2*>(row + kPcExpOff));
#pragma unroll
    for (int i = 0; i < 5; ++i) v[i] = make_uint4(x[2 * i].x, x[2 * i].y, x[2 * i + 1].x, x[2 * i + 1].y);
  } else if (kind == kKindBf16) {
#pragma unroll
    for (int m = 0; m < N; ++m) v[m] = __ldg(reinterpret_cast<const uint4*>(row) + u + 8 * m);
  }
}

// Called by all lanes of the warp together (the atoms' scales pass between the lanes of a key group).
template <int N>
__device__ __forceinline__ void pc_store_pass(int kind, const uint8_t* row, const uint4 (&v)[N], uint8_t* kd, int key,
                                              int lane) {
  const int u = lane & 7;
  // lane u's scale is atom u's (as fp16 pairs), atom m's comes from lane m of the group
  const uint32_t byte = ((u < 4 ? v[4].z : v[4].w) >> (8 * (u & 3))) & 0xFFu;
  const __half h = __float2half_rn(scale_from_byte(byte));
  const __half2 h2 = __half2(h, h);
  const uint32_t own = *reinterpret_cast<const uint32_t*>(&h2);
  uint32_t sc[7];
#pragma unroll
  for (int m = 0; m < 7; ++m) sc[m] = __shfl_sync(0xffffffffu, own, (lane & ~7) | m);
  if (kind == kKindFp8) {
#pragma unroll
    for (int m = 0; m < 7; ++m) {
      const uint4 w = v[m >> 1];
      const uint2 piece = m & 1 ? make_uint2(w.z, w.w) : make_uint2(w.x, w.y);
      *reinterpret_cast<uint4*>(kd + swz<kNT>(key, u + 8 * m)) =
          fp8x8_to_half8(piece, *reinterpret_cast<const __half2*>(&sc[m]));
    }
    *reinterpret_cast<uint4*>(kd + swz<kNT>(key, 56 + u)) = bf16x8_to_half8(make_uint4(v[3].z, v[3].w, v[4].x, v[4].y));
  } else if (kind == kKindBf16) {
    uint4 w[N < 8 ? 8 - N : 1];
#pragma unroll
    for (int m = N; m < 8; ++m) w[m - N] = __ldg(reinterpret_cast<const uint4*>(row) + u + 8 * m);
#pragma unroll
    for (int m = 0; m < 8; ++m)
      *reinterpret_cast<uint4*>(kd + swz<kNT>(key, u + 8 * m)) = bf16x8_to_half8(m < N ? v[m] : w[m - N]);
  } else {
#pragma unroll
    for (int m = 0; m < 8; ++m) *reinterpret_cast<uint4*>(kd + swz<kNT>(key, u + 8 * m)) = make_uint4(0, 0, 0, 0);
  }
}

// What the three warpgroups of a CTA of the producer-consumer kernel share.
struct PcCta {
  TokenCtx ctx;
  int64_t t;
  int hg, split, n_splits, tb, te, nope, exp_off;
  uint8_t* smem;
  uint32_t bars;  // full[2], empty[2], pfull[2], pempty[2]
  __device__ __forceinline__ uint32_t full(int b) const { return bars + 8 * b; }
  __device__ __forceinline__ uint32_t empty(int b) const { return bars + 16 + 8 * b; }
  __device__ __forceinline__ uint32_t pfull(int b) const { return bars + 32 + 8 * b; }
  __device__ __forceinline__ uint32_t pempty(int b) const { return bars + 48 + 8 * b; }
};

// F8 (calls whose caches hold FP8 rows): the 4 passes' loads all in flight (5 words each) during the index pipeline's
// step and the wait for the K tile; bf16 rows among them (this step's rows) load most of theirs when stored. Else two
// passes in flight (8 words each), each pass's conversion with the pass after next loading.
template <bool F8>
__device__ __forceinline__ void pc_produce(const SparseAttnArgs& a, const PcCta& c, int g) {
  // the index pipeline: two threads a key (key g >> 1, the prefetches by the first); the rows: a warp's 16 keys in 4
  // passes of 4 key groups, pass q's key of group grp being 4q + grp, whose pipeline is at lanes 8q + 2grp (+ 1)
  const int key = g >> 1, half = g & 1, lane = g & 31, grp = lane >> 3, kw = (g >> 5) * 16;
  const int fp8_bytes = c.exp_off + c.nope / kFp8Block;
  uint8_t* kinds = c.smem + PcCfg::kKindOff;
  if (half == 0) prefetch_first_rows<512, F8 ? 1 : 2>(a, c.ctx, c.tb, c.te, key, fp8_bytes);
  pdl_wait();
  KeyPipe<1> kp;
  kp.start<512>(a, c.ctx, c.tb, c.te, key, 0, fp8_bytes, half == 0);
  for (int it = 0; kp.n[0] < c.te; ++it) {
    const int b = it & 1;
    const int kind = kp.s0[0].kind;
    int kq[4];
    const uint8_t* pq[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      kq[q] = __shfl_sync(0xffffffffu, kind, 8 * q + 2 * grp);
      pq[q] = reinterpret_cast<const uint8_t*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(kp.s0[0].ptr), 8 * q + 2 * grp));
    }
    uint8_t* kd = c.smem + PcCfg::kKOff + b * PcCfg::kKBytes;
    if constexpr (F8) {
      uint4 r[4][5];
#pragma unroll
      for (int q = 0; q < 4; ++q) pc_load_pass<5>(kq[q], pq[q], lane & 7, r[q]);
      kp.next<512>(a, c.ctx, c.te, key, 0, fp8_bytes, half == 0);
      if (it >= 2) mbar_wait(c.empty(b), ((it >> 1) + 1) & 1);  // tile it - 2's products are done with K tile b
#pragma unroll
      for (int q = 0; q < 4; ++q) pc_store_pass<5>(kq[q], pq[q], r[q], kd, kw + 4 * q + grp, lane);
    } else {
      uint4 r0[8], r1[8];
      pc_load_pass<8>(kq[0], pq[0], lane & 7, r0);
      pc_load_pass<8>(kq[1], pq[1], lane & 7, r1);
      kp.next<512>(a, c.ctx, c.te, key, 0, fp8_bytes, half == 0);
      if (it >= 2) mbar_wait(c.empty(b), ((it >> 1) + 1) & 1);
      pc_store_pass<8>(kq[0], pq[0], r0, kd, kw + grp, lane);
      pc_load_pass<8>(kq[2], pq[2], lane & 7, r0);
      pc_store_pass<8>(kq[1], pq[1], r1, kd, kw + 4 + grp, lane);
      pc_load_pass<8>(kq[3], pq[3], lane & 7, r1);
      pc_store_pass<8>(kq[2], pq[2], r0, kd, kw + 8 + grp, lane);
      pc_store_pass<8>(kq[3], pq[3], r1, kd, kw + 12 + grp, lane);
    }
    if (half == 0) kinds[b * kNT + key] = static_cast<uint8_t>(kind);
    fence_proxy_async_shared();  // the tensor cores read the tile through the async proxy
    mbar_arrive(c.full(b));
  }
}

// Math warpgroup W (0: S, softmax and the left half of P V; 1: the right half), from Q staging to the output. Each
// warpgroup runs its own inlined copy (no code shared after setmaxnreg: each keeps its own register budget).
template <int W>
__device__ __forceinline__ void pc_math(const SparseAttnArgs& a, const PcCta& c, int tid) {
  using P = PcCfg;
  constexpr int kAtom = 64 * 128;  // bytes of one 64-dim atom of Q, of a K tile
  uint8_t* smem = c.smem;
  const int lane = tid & 31, warp = tid >> 5;
  pdl_wait();
  stage_q<512, 4, true>(a, c.t, c.hg, smem + P::kQOff, tid);
  fence_proxy_async_shared();
  bar_sync(kBarMath, 256);  // Q complete

  const uint8_t* kinds = smem + P::kKindOff;
  const uint32_t q_s = smem_u32(smem + P::kQOff), k_s = smem_u32(smem + P::kKOff), p_s = smem_u32(smem + P::kPOff);
  float* alpha = reinterpret_cast<float*>(smem + P::kAlphaOff);
  float* ml_s = reinterpret_cast<float*>(smem + P::kMlOff);
  const int mt = warp & 3, g = lane >> 2, tig = lane & 3;
  const int r0 = mt * 16 + g;  // the thread's accumulator rows: r0 and r0 + 8
  float acc[32][4];
#pragma unroll
  for (int n = 0; n < 32; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  float m0 = kNegInf, m1 = kNegInf, l0 = 0.0f, l1 = 0.0f;
  const float sc2 = a.scale * kLog2e;

  int it = 0;
  for (int cur = next_tile(a, c.ctx, c.tb, c.te); cur < c.te; cur = next_tile(a, c.ctx, cur + 1, c.te), ++it) {
    const int b = it & 1;
    const uint32_t par = (it >> 1) & 1;
    const uint32_t kb = k_s + b * P::kKBytes, pb = p_s + b * 64 * 128;
    mbar_wait(c.full(b), par);
    if constexpr (W == 0) {
      float s[8][4];
      qk_wgmma<8, kAtom, kAtom>(s, q_s, kb);
      float al0, al1;
      softmax_rows<32, true>(s, acc, kinds + b * kNT, m0, m1, l0, l1, al0, al1, sc2, lane);
      uint32_t pa[4][4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) p_fragment(s, kk, pa[kk]);
      if (it >= 2) mbar_wait(c.pempty(b), ((it >> 1) + 1) & 1);  // warpgroup 1 is done with P tile b
      uint8_t* pd = smem + P::kPOff + b * 64 * 128;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {  // keys 16 kk + 2 tig (+ 1; + 8, + 9) of rows r0, r0 + 8
        *reinterpret_cast<uint32_t*>(pd + swz<64>(r0, 2 * kk) + 4 * tig) = pa[kk][0];
        *reinterpret_cast<uint32_t*>(pd + swz<64>(r0 + 8, 2 * kk) + 4 * tig) = pa[kk][1];
        *reinterpret_cast<uint32_t*>(pd + swz<64>(r0, 2 * kk + 1) + 4 * tig) = pa[kk][2];
        *reinterpret_cast<uint32_t*>(pd + swz<64>(r0 + 8, 2 * kk + 1) + 4 * tig) = pa[kk][3];
      }
      if (tig == 0) {
        alpha[b * 64 + r0] = al0;
        alpha[b * 64 + r0 + 8] = al1;
      }
      fence_proxy_async_shared();  // warpgroup 1 reads P through the async proxy
      mbar_arrive(c.pfull(b));
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_rs_m64n256_tb(acc, pa[kk], smem_desc(kb + kk * 16 * 128, kAtom, 1024));
      wgmma_commit();
      wgmma_wait_all();
    } else {
      mbar_wait(c.pfull(b), par);
      const float al0 = alpha[b * 64 + r0], al1 = alpha[b * 64 + r0 + 8];
      if (al0 != 1.0f || al1 != 1.0f) rescale_rows(acc, al0, al1);  // the lazy softmax leaves most factors at 1
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_ss_m64n256_tb(acc, smem_desc(pb + kk * 32, 16, 1024),
                            smem_desc(kb + 4 * kAtom + kk * 16 * 128, kAtom, 1024));
      wgmma_commit();
      wgmma_wait_all();
      mbar_arrive(c.pempty(b));
    }
#pragma unroll
    for (int n = 0; n < 32; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) fence_reg(acc[n][e]);
    mbar_arrive(c.empty(b));
  }

  // (max, sum) of the rows from warpgroup 0 to 1; finish with the sink, or write the split's partial rows
  if constexpr (W == 0) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    if (tig == 0) {
      ml_s[2 * r0] = m0;
      ml_s[2 * r0 + 1] = l0;
      ml_s[2 * (r0 + 8)] = m1;
      ml_s[2 * (r0 + 8) + 1] = l1;
    }
  }
  bar_sync(kBarMath, 256);  // (max, sum) published; every product is done with the K tiles
  uint8_t* ost = smem + P::kKOff;  // the output tile [64][512] bf16, 16-byte chunks xor-ed by row
  const int col = W * 256 + 2 * tig;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r0 + 8 * r, h = c.hg * 64 + row;
    if (h >= a.heads) continue;
    const float m = ml_s[2 * row], l = ml_s[2 * row + 1];
    if (c.n_splits == 1) {
      const float sink2 = a.sinks[h] * kLog2e;
      const float mm = fmaxf(m, sink2);
      const float f = exp2f(m - mm);
      const float inv = f / (l * f + exp2f(sink2 - mm));
#pragma unroll
      for (int n = 0; n < 32; ++n) {
        const int cc = col + n * 8;
        *reinterpret_cast<__nv_bfloat162*>(ost + row * 1024 + (((cc >> 3) ^ (row & 7)) << 4) + 2 * (cc & 7)) =
            __floats2bfloat162_rn(acc[n][2 * r] * inv, acc[n][2 * r + 1] * inv);
      }
    } else {
      const int64_t prow = (c.t * c.n_splits + c.split) * a.heads + h;
      float* mlw = a.workspace + a.n_tokens * c.n_splits * a.heads * 512;
      if (W == 0 && tig == 0) {
        mlw[2 * prow] = m;
        mlw[2 * prow + 1] = l;
      }
      if (m != kNegInf) {  // a split without keys leaves its acc row unwritten: the combine skips it
        float* w = a.workspace + prow * 512 + col;
#pragma unroll
        for (int n = 0; n < 32; ++n)
          *reinterpret_cast<float2*>(w + n * 8) = make_float2(acc[n][2 * r], acc[n][2 * r + 1]);
      }
    }
  }
  if (c.n_splits == 1) {
    bar_sync(kBarMath, 256);
    const int rows = a.heads - c.hg * 64 < 64 ? a.heads - c.hg * 64 : 64;
    __nv_bfloat16* o = static_cast<__nv_bfloat16*>(a.out) + (c.t * a.heads + c.hg * 64) * 512;
    for (int idx = tid; idx < rows * 64; idx += 256) {
      const int row = idx >> 6, cc = idx & 63;
      *reinterpret_cast<uint4*>(o + row * 512 + cc * 8) =
          *reinterpret_cast<const uint4*>(ost + row * 1024 + ((cc ^ (row & 7)) << 4));
    }
  }
}

template <bool F8>
__global__ void __launch_bounds__(PcCfg::kThreads, 1) sparse_attn_pc_kernel(const SparseAttnArgs a, int max_tiles) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const int tid = threadIdx.x, wg = tid >> 7;
  PcCta c;
  c.smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  const int n_hg = (a.heads + 63) / 64;
  c.t = blockIdx.x / n_hg;
  c.hg = static_cast<int>(blockIdx.x % n_hg);
  c.split = blockIdx.y;
  c.n_splits = gridDim.y;
  c.ctx = token_ctx(a, c.t);
  const int tps = (max_tiles + c.n_splits - 1) / c.n_splits;
  c.tb = c.split * tps;
  const int n_tiles = (c.ctx.end_slot + kNT - 1) / kNT;
  c.te = c.tb + tps < n_tiles ? c.tb + tps : n_tiles;
  c.nope = 512 - a.rope_dim;
  c.exp_off = c.nope + 2 * a.rope_dim;
  c.bars = smem_u32(c.smem + PcCfg::kBarOff);
  if (tid == 0) {
    for (int b = 0; b < 2; ++b) {
      mbar_init(c.full(b), 128);
      mbar_init(c.empty(b), 256);
      mbar_init(c.pfull(b), 128);
      mbar_init(c.pempty(b), 128);
    }
    mbar_init_fence();
  }
  __syncthreads();
  pdl_launch_dependents();
  if (wg == 0) {
    reg_alloc<PcCfg::kRegsS>();
    pc_math<0>(a, c, tid);
  } else if (wg == 1) {
    reg_dealloc<PcCfg::kRegsPV>();
    pc_math<1>(a, c, tid);
  } else {
    reg_dealloc<PcCfg::kRegsProd>();
    pc_produce<F8>(a, c, tid - 256);
  }
}

// A float4 load issued where it stands (volatile): the combine's loads of a round go out before their sums.
__device__ __forceinline__ float4 ld_f4_pinned(const float* p) {
  float4 v;
  asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}

// Split partials -> output: o = sum_s 2^(m_s - M) acc_s / (sum_s 2^(m_s - M) l_s + 2^(sink - M)). Block (row, chunk
// of 128 columns): every warp lists the splits with keys and their weights (the same list, in its own shared
// memory: no block barrier); each of the 4 warps sums a quarter of them (a float4 a lane, 24 loads in flight), and
// the quarters are added in a fixed order (deterministic).
constexpr int kCombineWarps = 4;
template <typename T>
__global__ void __launch_bounds__(32 * kCombineWarps) sparse_attn_combine_kernel(const SparseAttnArgs a) {
  constexpr int kPer = kMaxSplits / 32;  // splits a lane reads the (max, sum) of
  __shared__ float w_s[kCombineWarps][kMaxSplits];
  __shared__ int live_s[kCombineWarps][kMaxSplits];
  __shared__ float4 part_s[kCombineWarps][32];
  const int64_t t = blockIdx.x / a.heads;
  const int h = static_cast<int>(blockIdx.x % a.heads);
  const int ns = a.n_splits, dim = a.dim, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* ml = a.workspace + a.n_tokens * ns * a.heads * dim;
  const int64_t row0 = t * ns * a.heads + h;  // split s: row0 + s * heads
  // Every warp lists the splits with keys and their weights itself (its own copy: no block barrier before the sums),
  // from the splits' (max, sum) pairs loaded in one round (loaded split after split, they were the kernel's chain)
  pdl_launch_dependents();
  const float sink2 = a.sinks[h] * kLog2e;  // a weight: before the wait
  pdl_wait();  // the partials are written
  float mv[kPer], lv[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int s = 32 * k + lane;
    mv[k] = kNegInf;
    lv[k] = 0.0f;
    if (s < ns) {
      mv[k] = ml[2 * (row0 + s * a.heads)];
      lv[k] = ml[2 * (row0 + s * a.heads) + 1];
    }
  }
  float mm = sink2;
#pragma unroll
  for (int k = 0; k < kPer; ++k) mm = fmaxf(mm, mv[k]);
  mm = warp_max(mm);
  float den = 0.0f;
  int n_live = 0;
  float* w_w = w_s[warp];
  int* live_w = live_s[warp];
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    if (32 * k >= ns) break;
    const int s = 32 * k + lane;
    float w = 0.0f, l = 0.0f;
    if (s < ns) {
      w = exp2f(mv[k] - mm);  // a split without keys: 2^-inf = 0
      l = lv[k];
    }
    den += w * l;
    const unsigned live = __ballot_sync(0xffffffffu, w != 0.0f);
    if (w != 0.0f) {
      const int at = n_live + __popc(live & ((1u << lane) - 1u));
      w_w[at] = w;
      live_w[at] = s;
    }
    n_live += __popc(live);
  }
  den = warp_sum(den) + exp2f(sink2 - mm);
  __syncwarp();
  const int d = blockIdx.y * 128 + lane * 4;
  const bool in = d < dim;
  float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  // the warp's batches of kU splits (batch i: splits [i, i + kU), i = warp * kU + k * kCombineWarps * kU), kB
  // batches' rows in flight at once (one round for up to 96 live splits), summed batch after batch
  constexpr int kU = 8, kB = 3, kStride = kCombineWarps * kU;
  for (int i0 = warp * kU; i0 < n_live; i0 += kB * kStride) {
    float4 v[kB][kU];
#pragma unroll
    for (int b = 0; b < kB; ++b) {
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int i = i0 + b * kStride + u, ic = i < n_live ? i : 0;  // a load always (then zeroed): in flight together
        v[b][u] = ld_f4_pinned(a.workspace + (row0 + live_w[ic] * a.heads) * dim + (in ? d : 0));
        if (!in || i >= n_live) v[b][u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    }
#pragma unroll
    for (int b = 0; b < kB; ++b) {
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int i = i0 + b * kStride + u;
        const float w = i < n_live ? w_w[i] : 0.0f;
        o.x = fmaf(w, v[b][u].x, o.x);
        o.y = fmaf(w, v[b][u].y, o.y);
        o.z = fmaf(w, v[b][u].z, o.z);
        o.w = fmaf(w, v[b][u].w, o.w);
      }
    }
  }
  part_s[warp][lane] = o;
  __syncthreads();
  if (warp != 0 || !in) return;
  for (int w = 1; w < kCombineWarps; ++w) {
    const float4 p = part_s[w][lane];
    o.x += p.x;
    o.y += p.y;
    o.z += p.z;
    o.w += p.w;
  }
  const float inv_den = 1.0f / den;
  T* out = static_cast<T*>(a.out) + (t * a.heads + h) * dim + d;
  out[0] = Num<T>::store(o.x * inv_den);
  out[1] = Num<T>::store(o.y * inv_den);
  out[2] = Num<T>::store(o.z * inv_den);
  out[3] = Num<T>::store(o.w * inv_den);
}

// ------------------------------------------------------------------------------------------ generic path
constexpr int kGenWarps = 4;
constexpr int kGenPer = 32;  // D / 32 values a lane: D <= 1024

__device__ __forceinline__ float key_elem(const uint8_t* row, int kind, int d, int nope, int exp_off) {
  switch (kind) {
    case kKindF32: return reinterpret_cast<const float*>(row)[d];
    case kKindBf16: return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row)[d]);
    case kKindF16: return __half2float(reinterpret_cast<const __half*>(row)[d]);
    default:
      if (d < nope) return fp8_decode(row[d]) * scale_from_byte(row[exp_off + d / kFp8Block]);
      return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row + nope)[d - nope]);
  }
}

template <typename T>
__global__ void __launch_bounds__(32 * kGenWarps) sparse_attn_generic_kernel(const SparseAttnArgs a) {
  extern __shared__ float gsm[];  // acc [warps][D], max [warps], sum [warps]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t t = blockIdx.x / a.heads;
  const int h = static_cast<int>(blockIdx.x % a.heads);
  const int dim = a.dim, per = dim / 32;
  const int nope = dim - a.rope_dim, exp_off = nope + 2 * a.rope_dim;
  const TokenCtx c = token_ctx(a, t);
  const T* qrow = static_cast<const T*>(a.q) + t * a.q_stride_t + static_cast<int64_t>(h) * a.q_stride_h;
  float qv[kGenPer], acc[kGenPer];
#pragma unroll
  for (int i = 0; i < kGenPer; ++i) {
    qv[i] = i < per ? Num<T>::load(qrow[lane + 32 * i]) : 0.0f;
    acc[i] = 0.0f;
  }
  float m = kNegInf, l = 0.0f;
  const int n_keys = c.n_swa + (c.end_slot > a.window ? c.end_slot - a.window : 0);
  for (int i = warp; i < n_keys; i += kGenWarps) {
    const int slot = i < c.n_swa ? i : a.window + (i - c.n_swa);
    const int j = load_j(a, c, slot, true);
    const Src src = resolve(a, c, slot, j, load_blk(a, c, slot, j));
    if (src.kind == kKindNone) continue;
    float kv[kGenPer];
    float dot = 0.0f;
#pragma unroll
    for (int ii = 0; ii < kGenPer; ++ii) {
      kv[ii] = ii < per ? key_elem(src.ptr, src.kind, lane + 32 * ii, nope, exp_off) : 0.0f;
      dot = fmaf(qv[ii], kv[ii], dot);
    }
    const float x = warp_sum(dot) * a.scale;
    const float mn = fmaxf(m, x);
    const float alpha = expf(m - mn), p = expf(x - mn);
    l = l * alpha + p;
#pragma unroll
    for (int ii = 0; ii < kGenPer; ++ii) acc[ii] = fmaf(p, kv[ii], acc[ii] * alpha);
    m = mn;
  }
  float* accs = gsm;
  float* ms = gsm + kGenWarps * dim;
  float* ls = ms + kGenWarps;
#pragma unroll
  for (int ii = 0; ii < kGenPer; ++ii)
    if (ii < per) accs[warp * dim + lane + 32 * ii] = acc[ii];
  if (lane == 0) {
    ms[warp] = m;
    ls[warp] = l;
  }
  __syncthreads();
  const float sink = a.sinks[h];
  float mm = sink;
  for (int w = 0; w < kGenWarps; ++w) mm = fmaxf(mm, ms[w]);
  float f[kGenWarps];
  float den = expf(sink - mm);
#pragma unroll
  for (int w = 0; w < kGenWarps; ++w) {
    f[w] = expf(ms[w] - mm);
    den += ls[w] * f[w];
  }
  T* out = static_cast<T*>(a.out) + (t * a.heads + h) * dim;
  for (int d = threadIdx.x; d < dim; d += blockDim.x) {
    float o = 0.0f;
#pragma unroll
    for (int w = 0; w < kGenWarps; ++w) o = fmaf(accs[w * dim + d], f[w], o);
    out[d] = Num<T>::store(o / den);
  }
}

// ------------------------------------------------------------------------------------------ host side
bool aligned(const void* p, int n) { return reinterpret_cast<uintptr_t>(p) % n == 0; }

bool cache_fast(const void* p, int fmt, int64_t row_bytes, int dim) {
  if (fmt == kAttnBf16) return aligned(p, 16) && row_bytes == 2 * dim;
  // FP8: a 16-byte aligned base, so that only rows past the first start 8 bytes off (issue_key)
  if (fmt == kAttnFp8) return aligned(p, 16) && row_bytes % 8 == 0 && row_bytes <= 2 * dim;
  return false;
}

// Tensor-core path: q bf16, D in {128, 512}, caches bf16 / FP8 rows, 16-byte aligned bf16 rows.
bool use_mma(const SparseAttnArgs& a) {
  if (a.dtype != static_cast<int>(DType::kBFloat16) || (a.dim != 128 && a.dim != 512)) return false;
  if (!aligned(a.q, 16) || (a.q_stride_t * 2) % 16 || (a.q_stride_h * 2) % 16) return false;
  if (!aligned(a.kv, 16) || (a.kv_stride * 2) % 16) return false;
  const int nope = a.dim - a.rope_dim;
  const bool fp8 = a.swa_fmt == kAttnFp8 || (a.entry_cache != nullptr && a.ent_fmt == kAttnFp8);
  if (fp8 && (nope <= 0 || nope % kFp8Block)) return false;
  if (!cache_fast(a.swa_cache, a.swa_fmt, a.swa_row_bytes, a.dim)) return false;
  if (a.entry_cache != nullptr && !cache_fast(a.entry_cache, a.ent_fmt, a.ent_row_bytes, a.dim)) return false;
  return a.heads >= 1;
}

int mt_for(const SparseAttnArgs& a) { return a.heads <= 16 ? 1 : 4; }

int max_tiles(const SparseAttnArgs& a) {
  int64_t e = 0;
  if (a.entry_cache != nullptr) e = a.entry_idx != nullptr ? a.topk : a.bt_cols * a.per_block;
  const int64_t n = (a.window + e + kNT - 1) / kNT;
  return static_cast<int>(n < 1 ? 1 : n);
}

// wgmma for 64-head groups of D = 512 (sm_90a): kPc where the producer-consumer kernel may run (a 64-dim rope),
// else kSplit (the split-D kernel). DSV4RT_ATTN_MMA (tests, comparisons): `pc` or `split` forces that kernel,
// `sync` the mma.sync one.
enum class Wg { kNone, kSplit, kPc };
Wg wg_kind(const SparseAttnArgs& a) {
  if (a.dim != 512 || mt_for(a) != 4) return Wg::kNone;
  const char* env = std::getenv("DSV4RT_ATTN_MMA");
  if (env != nullptr && std::strcmp(env, "sync") == 0) return Wg::kNone;
  int dev = 0, major = 0, minor = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (major != 9 || minor != 0) return Wg::kNone;
  if (a.rope_dim != 64 || (env != nullptr && std::strcmp(env, "split") == 0)) return Wg::kSplit;
  return Wg::kPc;
}
bool use_wgmma(const SparseAttnArgs& a) { return wg_kind(a) != Wg::kNone; }  // either wgmma kernel: 1 CTA an SM

// Tiles a CTA must take for the producer-consumer kernel to run: its producer loads and converts a CTA's first tile
// before the math can start (the split-D kernel's copies are asynchronous), which costs more than its overlap saves
// when a CTA takes few tiles. H200, the split-D kernel against it: batch 128 (10 tiles a CTA) 43.9-44.6 against
// 37.4-38.1 us; the decode step at batch 1, 64 and 1M (1 to 5 tiles a CTA) 27, 14 and 22 us longer with it.
constexpr int kPcMinTiles = 8;
bool use_pc(const SparseAttnArgs& a) {
  if (wg_kind(a) != Wg::kPc) return false;
  const char* env = std::getenv("DSV4RT_ATTN_MMA");
  if (env != nullptr && std::strcmp(env, "pc") == 0) return true;
  const int ns = a.n_splits > 0 ? a.n_splits : 1;
  return (max_tiles(a) + ns - 1) / ns >= kPcMinTiles;
}

template <int D, int MT, bool WG>
cudaError_t set_smem() {
  return cudaFuncSetAttribute(sparse_attn_mma_kernel<D, MT, WG>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              MmaCfg<D, MT>::kSmem);
}

template <int D, int MT, bool WG>
int ctas_per_sm() {
  if (set_smem<D, MT, WG>() != cudaSuccess) return 1;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, sparse_attn_mma_kernel<D, MT, WG>, MmaCfg<D, MT>::kCtaThreads,
                                                    MmaCfg<D, MT>::kSmem) != cudaSuccess)
    return 1;
  return n > 0 ? n : 1;
}

int mma_ctas_per_sm(const SparseAttnArgs& a) {
  const int mt = mt_for(a);
  if (a.dim == 512) {
    if (mt == 4) return use_wgmma(a) ? ctas_per_sm<512, 4, true>() : ctas_per_sm<512, 4, false>();
    return ctas_per_sm<512, 1, false>();
  }
  return mt == 4 ? ctas_per_sm<128, 4, false>() : ctas_per_sm<128, 1, false>();
}

// The tensor-core and combine grids are launched with programmatic stream serialization (prefetch_first_rows says
// what they do before the wait). DSV4RT_ATTN_PDL=0: plain stream order (comparisons).
bool attn_pdl() {
  const char* v = std::getenv("DSV4RT_ATTN_PDL");
  return v == nullptr || v[0] == '\0' || v[0] != '0';
}

// The split partials combined (a second kernel), when the call is split.
cudaError_t launch_combine(const SparseAttnArgs& a, cudaStream_t stream) {
  if (a.n_splits == 1) return cudaSuccess;
  const dim3 cgrid(static_cast<unsigned>(a.n_tokens * a.heads), static_cast<unsigned>((a.dim + 127) / 128));
  return launch_ex(sparse_attn_combine_kernel<__nv_bfloat16>, cgrid, dim3(32 * kCombineWarps), 0, stream, 1,
                   attn_pdl(), a);
}

template <int D, int MT, bool WG>
cudaError_t launch_mma(const SparseAttnArgs& a, cudaStream_t stream) {
  using C = MmaCfg<D, MT>;
  cudaError_t err = set_smem<D, MT, WG>();
  if (err != cudaSuccess) return err;
  const int64_t n_hg = (a.heads + C::kRows - 1) / C::kRows;
  const dim3 grid(static_cast<unsigned>(a.n_tokens * n_hg), static_cast<unsigned>(a.n_splits));
  err = launch_ex(sparse_attn_mma_kernel<D, MT, WG>, grid, dim3(C::kCtaThreads), C::kSmem, stream, 1, attn_pdl(), a,
                  max_tiles(a));
  if (err != cudaSuccess) return err;
  return launch_combine(a, stream);
}

template <bool F8>
cudaError_t launch_pc_rows(const SparseAttnArgs& a, cudaStream_t stream) {
  cudaError_t err =
      cudaFuncSetAttribute(sparse_attn_pc_kernel<F8>, cudaFuncAttributeMaxDynamicSharedMemorySize, PcCfg::kSmem);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(a.n_tokens * ((a.heads + 63) / 64)), static_cast<unsigned>(a.n_splits));
  return launch_ex(sparse_attn_pc_kernel<F8>, grid, dim3(PcCfg::kThreads), PcCfg::kSmem, stream, 1, attn_pdl(), a,
                   max_tiles(a));
}

// The FP8 instance when the caches hold FP8 rows (the sliding ring's format decides: every attention layer has one).
cudaError_t launch_pc(const SparseAttnArgs& a, cudaStream_t stream) {
  const cudaError_t err = a.swa_fmt == kAttnFp8 ? launch_pc_rows<true>(a, stream) : launch_pc_rows<false>(a, stream);
  if (err != cudaSuccess) return err;
  return launch_combine(a, stream);
}

cudaError_t launch_mma_dim(const SparseAttnArgs& a, cudaStream_t stream) {
  const int mt = mt_for(a);
  if (use_pc(a)) return launch_pc(a, stream);
  if (a.dim == 512) {
    if (mt == 4) return use_wgmma(a) ? launch_mma<512, 4, true>(a, stream) : launch_mma<512, 4, false>(a, stream);
    return launch_mma<512, 1, false>(a, stream);
  }
  return mt == 4 ? launch_mma<128, 4, false>(a, stream) : launch_mma<128, 1, false>(a, stream);
}

template <typename T>
cudaError_t launch_generic(const SparseAttnArgs& a, cudaStream_t stream) {
  const size_t smem = sizeof(float) * (kGenWarps * static_cast<size_t>(a.dim) + 2 * kGenWarps);
  sparse_attn_generic_kernel<T><<<static_cast<unsigned>(a.n_tokens * a.heads), 32 * kGenWarps, smem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

int sparse_attn_splits(const SparseAttnArgs& a) {
  if (a.n_tokens == 0 || !use_mma(a)) return 1;
  const int tiles = max_tiles(a);
  const int cap = tiles < kMaxSplits ? tiles : kMaxSplits;
  if (const char* env = std::getenv("DSV4RT_ATTN_SPLITS")) {  // tests and benchmarks: force a split count
    const int k = std::atoi(env);
    if (k >= 1) return k < cap ? k : cap;
  }
  const int rows = mt_for(a) == 4 ? 64 : 16;
  const int64_t units = a.n_tokens * ((a.heads + rows - 1) / rows);
  const int64_t slots = static_cast<int64_t>(num_sms()) * mma_ctas_per_sm(a);
  // modelled time: waves x tiles per CTA x a tile's time (4 us for 64 heads of D = 512), plus, when split, the
  // partials written and read back (fp32 rows of every head and column, L2-resident at these sizes: 4 TB/s) and the
  // combine. The tile time is fitted to batch 1 at a 1M-token HCA context (131 tiles), where it picks 66 splits of
  // two tiles over 131 of one: 24.1 against 25.3 us on an H100, 23.55 against 23.8-24.0 us on an H200 (with the
  // kernel of 2026-11-26; 8 us, fitted to the earlier kernel, picked 131).
  const double tile_us = 4.0 * rows * a.dim / (64.0 * 512.0), partial_bytes_per_us = 4.0e6, combine_us = 3.0;
  int best = 1;
  double best_cost = -1.0;
  for (int ns = 1; ns <= cap; ++ns) {
    const int64_t tps = (tiles + ns - 1) / ns;
    const int64_t waves = (units * ns + slots - 1) / slots;
    double cost = static_cast<double>(waves * tps) * tile_us;
    if (ns > 1) cost += combine_us + 2.0 * units * ns * rows * a.dim * 4 / partial_bytes_per_us;
    if (best_cost < 0.0 || cost < best_cost) {
      best_cost = cost;
      best = ns;
    }
  }
  return best;
}

int64_t sparse_attn_workspace_floats(const SparseAttnArgs& a, int n_splits) {
  if (n_splits <= 1) return 0;
  return a.n_tokens * n_splits * a.heads * (static_cast<int64_t>(a.dim) + 2);
}

cudaError_t sparse_attn_launch(const SparseAttnArgs& a, cudaStream_t stream) {
  if (a.n_tokens == 0) return cudaSuccess;
  if (use_mma(a)) return launch_mma_dim(a, stream);
  if (a.n_splits != 1) return cudaErrorInvalidValue;
  switch (static_cast<DType>(a.dtype)) {
    case DType::kFloat32: return launch_generic<float>(a, stream);
    case DType::kBFloat16: return launch_generic<__nv_bfloat16>(a, stream);
    case DType::kFloat16: return launch_generic<__half>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace dsv4rt
