// Lightning-indexer family (ops/indexer.py): per query, score every visible indexer entry of its request,
// score[j] = sum_h w[h] * relu(q[h] . k_j) for j < (p+1) // ratio, and keep the top k (-1 padded, fixed width).
//
// One launch sequence per group of tokens (the group keeps the score scratch [G, n_cap] bounded):
//   1. memset of the group's histograms and counters (unless every token fits the one-CTA selection, which needs
//      neither);
//   2. score: CTAs split each token's visible entries into tiles; every score is written as an order-preserving
//      uint32 key to the scratch and, for the grid selection, counted in a 4096-bin histogram of its top 12 bits
//      (CTA c of a token adds into copy c mod 4 of it: scores crowd into a few bins, and one copy had every CTA
//      adding to the same words; the select sums the copies). Two implementations:
//        * tensor cores (sm_90a, bf16 q, bf16 or FP4 keys, <= 64 heads, head dim 64 or 128): wgmma with the
//          tile's 64 entries as M (A in registers, decoded by each lane from raw rows its warp cp.asyncs) and the
//          token's q as N = 64 heads (B in shared memory); relu, weight and the sum over heads on the fp32
//          accumulators (see "tensor-core scoring"). FP4 keys of head dim 128 in calls whose CTAs take many tiles
//          (launch_wgmma) run an instance that takes e4m3 operands when q converts exactly (WgWarp::decode_f8,
//          stage_q_f8), half the tensor-core work a tile;
//        * general (any dtype, fp32 arithmetic): CUDA cores, for the other shapes and dtypes.
//   3. select (programmatic dependent launch after the scoring grid, DSV4RT_INDEXER_PDL=0 turns it off). In groups
//      of few tokens, those of at most kSmallEntries visible entries (decode up to a 128K-token context): one CTA a
//      token, its keys in shared memory ("one-CTA selection" below). The others, the grid selection: every CTA
//      finds from the histogram the bin b1 holding the k-th largest key; CTAs split each token's
//      entries again; keys above bin b1 are emitted at once (they are in the top k), keys in bin b1 go to a
//      candidate list (bounded; past it the full scratch is rescanned) and a histogram of their next 12 bits.
//      The last CTA of the token (atomic ticket) resolves the remaining digits (score bits, then the index,
//      smaller first: ties at equal scores are broken deterministically), then sorts the k indices ascending,
//      so the output does not depend on the order in which CTAs ran.
// Tokens with at most k visible entries skip the scoring: their output is 0..n-1 then -1.
// Grid sizes depend on shapes only (multiprocessor count, T, block-table width); no host sync, no host planning.
#include <climits>
#include <cstdlib>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "indexer.h"
#include "async_copy.cuh"
#include "launch.cuh"

namespace dsv4rt {
namespace {

constexpr int kSimtTile = 32;         // entries per general-path tile
constexpr int kSimtThreads = 256;
constexpr int kSelectThreads = 512;
constexpr int kBins = 4096;           // histograms of 12-bit digits
constexpr int kDigitBins = 256;       // the last CTA's 8-bit digits
constexpr int kHistCopies = 4;        // copies of the first histogram (scores crowd into few bins: fewer CTAs
                                      // adding to one bin; the select sums the copies)
constexpr uint32_t kCandCap = 8192;   // candidates per token kept in the list
constexpr int kCtrWords = 8;          // per-token counters:
constexpr int kDone2 = 0, kEmit = 1, kCand = 2;
constexpr int kScratchWords = 64;
constexpr int64_t kKeyBudget = int64_t(256) << 20;  // bytes of score scratch per group of tokens

// Views of the workspace for one group of tokens.
struct Ws {
  uint32_t* keys;   // [G, n_cap] order-preserving keys of the scores
  uint2* cand;      // [G, kCandCap] (key, index) of keys in bin b1
  uint32_t* hist1;  // [G, kHistCopies, kBins] top 12 bits; scoring CTA c adds into copy c % kHistCopies
  uint32_t* hist2;  // [G, kBins] next 12 bits, keys in bin b1 only
  uint32_t* ctr;    // [G, kCtrWords]
  int64_t n_cap;
  int64_t small_max;  // tokens of at most this many visible entries are the one-CTA selection's (0: none)
};

struct Tok {
  int64_t slot;
  int64_t nv;  // visible entries
};

__device__ __forceinline__ Tok token_info(const IndexerArgs& a, int64_t t, int64_t n_cap) {
  Tok k{a.n_slots - 1, 0};
  const int r = a.req_slot[t];
  if (r >= 0 && r < a.n_slots) {  // else a padded token: no entry is visible
    k.slot = r;
    const int64_t p1 = static_cast<int64_t>(a.positions[t]) + 1;
    const int64_t n = p1 > 0 ? p1 / a.ratio : 0;
    k.nv = n < n_cap ? n : n_cap;
  }
  return k;
}

// Pool block of column `col` of a block-table row (the token's: block_table + slot * bt_stride).
__device__ __forceinline__ int64_t block_in_pool(const IndexerArgs& a, const int32_t* bt_row, int64_t col) {
  const int64_t b = __ldg(bt_row + col);
  return b < 0 ? 0 : (b >= a.n_blocks ? a.n_blocks - 1 : b);  // keep reads in the pool whatever the table holds
}

__device__ __forceinline__ int64_t block_of(const IndexerArgs& a, int64_t slot, int64_t col) {
  return block_in_pool(a, a.block_table + slot * a.bt_stride, col);
}

// Programmatic dependent launch (launch.cuh): the select grid is launched with programmatic stream serialization, so
// it may be scheduled once every scoring CTA has passed pdl_launch_dependents(); it calls pdl_wait() (the scoring
// grid has completed and its writes are visible) before it touches global memory.

// Larger score -> larger key; -0 counts as +0.
__device__ __forceinline__ uint32_t order_key(float s) {
  const uint32_t b = __float_as_uint(__fadd_rn(s, 0.0f));
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// ------------------------------------------------------------------------------------------ block utilities
// Inclusive prefix sum over the threads of the block; scratch: >= 32 words. Every thread must call.
__device__ __forceinline__ uint32_t block_inclusive_scan(uint32_t v, uint32_t* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t n = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += n;
  }
  __syncthreads();
  if (lane == 31) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {  // inclusive scan of the warp totals
    const int nw = (blockDim.x + 31) >> 5;
    uint32_t w = lane < nw ? scratch[lane] : 0u;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint32_t n = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += n;
    }
    if (lane < nw) scratch[lane] = w;
  }
  __syncthreads();
  return v + (warp > 0 ? scratch[warp - 1] : 0u);
}

// The bin holding the need-th largest element of a histogram (counted from the top bin down), the count of
// elements in the bins above it and in the bin itself. Needs 1 <= need <= total. h: shared memory, 16-byte aligned;
// scratch: >= 35 words. Every thread must call.
__device__ void select_bin(const uint32_t* h, int nbins, uint32_t need, uint32_t* scratch, uint32_t& bin,
                           uint32_t& above, uint32_t& count) {
  const int nt = blockDim.x;
  const int per = (nbins + nt - 1) / nt;
  const int hi = nbins - static_cast<int>(threadIdx.x) * per, lo = hi - per > 0 ? hi - per : 0;
  uint32_t sum = 0;
  if (per % 4 == 0 && hi - lo == per) {  // 16-byte reads (h is 16-byte aligned; lo is a multiple of 4)
    for (int b = lo; b < hi; b += 4) {
      const uint4 v = *reinterpret_cast<const uint4*>(h + b);
      sum += v.x + v.y + v.z + v.w;
    }
  } else {
    for (int b = hi - 1; b >= lo; --b) sum += h[b];
  }
  const uint32_t incl = block_inclusive_scan(sum, scratch);
  const uint32_t excl = incl - sum;
  if (excl < need && incl >= need) {
    uint32_t acc = excl;
    for (int b = hi - 1; b >= lo; --b) {
      const uint32_t c = h[b];
      if (acc + c >= need) {
        scratch[32] = static_cast<uint32_t>(b);
        scratch[33] = acc;
        scratch[34] = c;
        break;
      }
      acc += c;
    }
  }
  __syncthreads();
  bin = scratch[32];
  above = scratch[33];
  count = scratch[34];
  __syncthreads();
}

// Copy a global histogram of N bins (the sum of its P consecutive copies) into shared memory, NT threads, loads
// in flight together.
template <int N, int NT, int P = 1>
__device__ __forceinline__ void stage_hist(const uint32_t* g, uint32_t* s) {
  static_assert(N % NT == 0, "bins per thread");
  constexpr int kPer = N / NT, kBatch = kPer * P < 32 ? kPer : (32 / P > 0 ? 32 / P : 1);
  static_assert(kPer % kBatch == 0, "batches");
#pragma unroll
  for (int i0 = 0; i0 < kPer; i0 += kBatch) {
    uint32_t v[kBatch][P];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
#pragma unroll
      for (int p = 0; p < P; ++p) v[i][p] = __ldcg(g + p * N + (i0 + i) * NT + threadIdx.x);
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      uint32_t sum = 0;
#pragma unroll
      for (int p = 0; p < P; ++p) sum += v[i][p];
      s[(i0 + i) * NT + threadIdx.x] = sum;
    }
  }
}

// g[b] += hist[b] for the kBins bins of a shared histogram (16-byte aligned), NT threads; empty bins add nothing.
template <int NT>
__device__ __forceinline__ void add_hist(uint32_t* g, const uint32_t* hist) {
  for (int b = 4 * threadIdx.x; b < kBins; b += 4 * NT) {  // 16-byte reads
    const uint4 c = *reinterpret_cast<const uint4*>(hist + b);
    if (c.x) atomicAdd(g + b, c.x);
    if (c.y) atomicAdd(g + b + 1, c.y);
    if (c.z) atomicAdd(g + b + 2, c.z);
    if (c.w) atomicAdd(g + b + 3, c.w);
  }
}

// End of scoring CTA c of a token (NT threads): add its histogram to the token's copy c % kHistCopies.
template <int NT>
__device__ __forceinline__ void flush_hist(const Ws& ws, int64_t tl, int c, const uint32_t* hist) {
  __syncthreads();
  add_hist<NT>(ws.hist1 + (tl * kHistCopies + c % kHistCopies) * kBins, hist);
}

// ------------------------------------------------------------------------------------------ tensor-core scoring
// A warpgroup per CTA; a CTA takes a range of 64-entry tiles of one token. Per tile, D[64 entries x 64 heads] =
// K_tile[64 x DI] * q^T[DI x 64] by wgmma m64n64k16: A (keys) from registers, B (q, zero heads past n_heads) from
// shared memory, loaded once. Warp w owns tile rows 16w..16w+15: it copies their raw rows into its own ring (no
// block barrier), and lane (g, t) decodes rows g and g+8, k slice t (DI/4 values: one FP4 scale block when
// DI = 128) straight into its A fragments. FP4 rows in blocks of >= 16 entries (BULK: the warp's 16 rows are one
// contiguous run) go by one bulk copy of the run (lane 0; the stage's mbarrier counts its bytes); else each lane
// cp.asyncs 16-byte chunks. The k order inside a slice is the decoder's; q is staged in the same
// order. A tile's raw rows are read while the previous tile's wgmma runs, decoded once it has completed (the
// fragments are its operands); 4 CTAs an SM overlap each other's wgmmas. relu, weight and the sum over heads run
// on the accumulators (16 heads a lane, then 2 shuffles).
// a * b per bf16 half, exact for the power-of-two scales used here (adding -0 keeps an exact +0)
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

// an mbarrier no longer in use (no pending arrival or transaction), before mbar_init sets it up again
__device__ __forceinline__ void mbar_inval(uint32_t bar) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// prmt with the default mode: a selector nibble with its top bit set gives the selected byte's sign bit, replicated
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

constexpr int kWgTile = 64;   // entries per tile (wgmma M)
constexpr int kWgHeads = 64;  // wgmma N: heads, zero-padded

template <int DI, bool FP4>
struct WgCfg {
  static constexpr int kRow = FP4 ? DI / 2 + DI / 32 : DI * 2;  // bytes of a cache row
  static constexpr int kKSteps = DI / 16;
  static constexpr int kRegs = DI / 8;                           // A registers of one row (DI / 4 values)
  static_assert(kRegs == 2 * kKSteps, "two registers of a row per k step");
  static constexpr int kQBytes = kWgHeads * DI * 2;              // q^T, 128-byte swizzled atoms of 64 k
  static constexpr int kSeg = 16 * kRow;                         // one warp's rows of a tile
  static constexpr int kStages = FP4 ? 4 : 3;                    // raw ring depth (tiles)
  static constexpr size_t kSmem = 1024 + kQBytes + static_cast<size_t>(kStages) * 4 * kSeg +
                                  (kBins + kScratchWords) * sizeof(uint32_t) +
                                  static_cast<size_t>(kStages) * 4 * sizeof(uint64_t);  // the ring's mbarriers
  static_assert(DI == 64 || DI == 128, "tensor-core path: head dim 64 or 128");
  static_assert(kSeg % 16 == 0, "a warp's rows must be whole 16-byte chunks");
};

// Element of q (and of the key row) at k position `k` of the wgmma operands: position 16s + 8u + 2t + h is
// register 2s + u, half h, of lane slice t; FP4 registers hold elements (i, i + 4) of each 8-element word.
template <int DI, bool FP4>
__device__ __forceinline__ int k_element(int k) {
  const int m = 2 * (k >> 4) + ((k >> 3) & 1), t = (k >> 1) & 3, h = k & 1;
  return (DI / 4) * t + (FP4 ? 8 * (m >> 2) + (m & 3) + 4 * h : 2 * m + h);
}

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// Shared-memory descriptor of a K-major bf16 operand in 128-byte swizzled atoms (8 rows of 128 bytes = 1 KB).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

// wgmma m64n64 with A (4 registers) and B (a shared-memory descriptor): D[64 x 64] (+)= A * B, fp32 accumulators.
// NAME(d, a0..a3, desc, scale_d) adds to D (scale_d != 0) or overwrites it; NAME_first(d, a0..a3, desc) overwrites D,
// which is then not an input, so its registers need not be live before. TYPES: the shape and types, TAIL: the
// immediates (scales of A and B, and B's transpose where the types have one).
#define DSV4RT_WG_ACC(c) \
  c(d[0]), c(d[1]), c(d[2]), c(d[3]), c(d[4]), c(d[5]), c(d[6]), c(d[7]), \
  c(d[8]), c(d[9]), c(d[10]), c(d[11]), c(d[12]), c(d[13]), c(d[14]), c(d[15]), \
  c(d[16]), c(d[17]), c(d[18]), c(d[19]), c(d[20]), c(d[21]), c(d[22]), c(d[23]), \
  c(d[24]), c(d[25]), c(d[26]), c(d[27]), c(d[28]), c(d[29]), c(d[30]), c(d[31])
#define DSV4RT_WG_REGS                                       \
  "%0, %1, %2, %3, %4, %5, %6, %7, "                         \
  "%8, %9, %10, %11, %12, %13, %14, %15, "                   \
  "%16, %17, %18, %19, %20, %21, %22, %23, "                 \
  "%24, %25, %26, %27, %28, %29, %30, %31"
#define DSV4RT_WGMMA_64x64(NAME, TYPES, TAIL)                                                                      \
  __device__ __forceinline__ void NAME(float (&d)[32], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,          \
                                       uint64_t desc, int scale_d) {                                                \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                      \
                 "wgmma.mma_async.sync.aligned." TYPES " {" DSV4RT_WG_REGS "}, {%32, %33, %34, %35}, %36, p" TAIL \
                 ";\n}\n"                                                                                           \
                 : DSV4RT_WG_ACC("+f")                                                                              \
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(scale_d));                                  \
  }                                                                                                                 \
  __device__ __forceinline__ void NAME##_first(float (&d)[32], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, \
                                               uint64_t desc) {                                                     \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"                                                        \
                 "wgmma.mma_async.sync.aligned." TYPES " {" DSV4RT_WG_REGS "}, {%32, %33, %34, %35}, %36, p" TAIL \
                 ";\n}\n"                                                                                           \
                 : DSV4RT_WG_ACC("=f")                                                                              \
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));                                                 \
  }
// bf16: A[64 x 16] * B[16 x 64] (K-major)
DSV4RT_WGMMA_64x64(wgmma_m64n64k16, "m64n64k16.f32.bf16.bf16", ", 1, 1, 0")
// e4m3: A[64 x 32] * B[32 x 64] (K-major; 8-bit types have no transpose)
DSV4RT_WGMMA_64x64(wgmma_f8_m64n64k32, "m64n64k32.f32.e4m3.e4m3", ", 1, 1")
#undef DSV4RT_WGMMA_64x64
#undef DSV4RT_WG_REGS
#undef DSV4RT_WG_ACC

// block_in_pool in 32 bits (this path: n_blocks * per_block <= 2^32, so n_blocks < 2^31)
__device__ __forceinline__ uint32_t block_in_pool32(const int32_t* bt_row, int col, int n_blocks) {
  const int b = __ldg(bt_row + col);
  return static_cast<uint32_t>(min(max(b, 0), n_blocks - 1));
}

template <int DI, bool FP4, bool BULK>
struct WgWarp {
  using C = WgCfg<DI, FP4>;
  static_assert(!BULK || FP4, "bulk copies carry raw FP4 rows (bf16 rows are swizzled by chunk)");
  static constexpr int kRaw = DI / 32;  // FP4: 32-bit code words of a lane's slice of a row (8 codes each)
  uint32_t raw[2][kRaw];                // rows g, g + 8 (FP4)
  uint32_t scale[2];
  uint32_t frag[C::kKSteps][4];         // A fragments, wgmma operand order

  // Copy this warp's 16 rows of tile entries [j0, j0 + 64) into `seg` (FP4 rows raw; bf16 rows with their 16-byte
  // chunks swizzled by row). Rows past the visible count are skipped (or, within a block's run, copied and
  // ignored). bt_row: the token's block-table row. BULK: one bulk copy by lane 0 that completes the phase of `bar`
  // (lane 0 arrives without bytes when the run holds no visible row); else cp.async (the caller commits).
  static __device__ __forceinline__ void copy(const IndexerArgs& a, const int32_t* bt_row, int nv, int j0, int warp,
                                              int lane, uint8_t* seg, int log2e, uint32_t bar) {
    const uint8_t* cache = static_cast<const uint8_t*>(a.idx_cache);
    const int r0 = j0 + 16 * warp;
    if (BULK) {  // log2e >= 4
      if (lane != 0) return;
      if (r0 >= nv) {
        mbar_arrive(bar);
        return;
      }
      const uint32_t row = (block_in_pool32(bt_row, r0 >> log2e, static_cast<int>(a.n_blocks)) << log2e) |
                           (static_cast<uint32_t>(r0) & ((1u << log2e) - 1u));
      mbar_arrive_expect_tx(bar, C::kSeg);
      bulk_copy(smem_u32(seg), cache + static_cast<uint64_t>(row) * C::kRow, C::kSeg, bar);
      return;
    }
    if (log2e >= 4) {  // the warp's 16 rows are consecutive rows of one block: one lookup, one contiguous run
      if (r0 >= nv) return;
      const uint32_t row = (block_in_pool32(bt_row, r0 >> log2e, static_cast<int>(a.n_blocks)) << log2e) |
                           (static_cast<uint32_t>(r0) & ((1u << log2e) - 1u));
      const uint8_t* src = cache + static_cast<uint64_t>(row) * C::kRow;
      const uint32_t dst = smem_u32(seg);
      constexpr int kChunks = C::kRow;  // 16 rows of kRow bytes = kRow 16-byte chunks
#pragma unroll
      for (int c0 = 0; c0 < kChunks; c0 += 32) {
        const int c = c0 + lane;
        if (c0 + 32 <= kChunks || c < kChunks) {
          if (FP4) {
            cp_async16(dst + 16 * c, src + 16 * c);
          } else {
            constexpr int kPerRow = C::kRow / 16;
            const int rr = c / kPerRow, cc = c % kPerRow;
            cp_async16(dst + rr * C::kRow + 16 * (cc ^ (rr & 7)), src + 16 * c);
          }
        }
      }
      return;
    }
    const int per_block = 1 << log2e;
    for (int r = 0; r < 16; r += per_block) {
      const int64_t j = r0 + r;
      if (j >= nv) break;
      const int64_t blk = block_in_pool(a, bt_row, j >> log2e);
      const uint8_t* src = cache + ((blk << log2e) + (j & (per_block - 1))) * C::kRow;
      uint8_t* dst = seg + r * C::kRow;
      if (FP4) {
        const int chunks = per_block * C::kRow / 16;
        for (int c = lane; c < chunks; c += 32) cp_async16(smem_u32(dst + 16 * c), src + 16 * c);
      } else {
        constexpr int kPerRow = C::kRow / 16;
        for (int c = lane; c < per_block * kPerRow; c += 32) {
          const int rr = c / kPerRow, cc = c % kPerRow;
          cp_async16(smem_u32(dst + rr * C::kRow + 16 * (cc ^ ((r + rr) & 7))), src + 16 * c);
        }
      }
    }
  }

  // Register m of row rr (k position 16 (m >> 1) + 8 (m & 1) + 2t + h) in operand order.
  __device__ __forceinline__ uint32_t& at(int rr, int m) { return frag[m >> 1][rr + 2 * (m & 1)]; }

  // Lane (g, t), FP4: the code words and scales of rows g and g + 8 of `seg`, k slice t, to raw[]. (bf16 rows are
  // read by decode(): they go straight to frag[], which the previous tile's wgmma reads until it completes.)
  __device__ __forceinline__ void fetch(const uint8_t* seg, int g, int t) {
    if constexpr (FP4) {
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const uint8_t* row = seg + (g + 8 * rr) * C::kRow;
        const uint8_t* p = row + (DI / 8) * t;
        if constexpr (C::kRow % 4 == 0) {
#pragma unroll
          for (int i = 0; i < kRaw; ++i) raw[rr][i] = reinterpret_cast<const uint32_t*>(p)[i];
        } else {
#pragma unroll
          for (int i = 0; i < kRaw; ++i) {
            const uint16_t* p16 = reinterpret_cast<const uint16_t*>(p) + 2 * i;
            raw[rr][i] = static_cast<uint32_t>(p16[0]) | (static_cast<uint32_t>(p16[1]) << 16);
          }
        }
        scale[rr] = row[DI / 2 + (DI / 4) * t / 32];
      }
    }
  }

  // FP4 codes to exact bf16: codes c = s|eem at bf16 bits 15 and 8..6 are e2m1(c) * 2^-126 (subnormal for e = 0);
  // a multiply by 2^(scale - 1) gives the value; when that overflows bf16 (scale > 128), 2^126 then 2^(scale - 127).
  // Register k of a code word takes nibbles k and k + 4 (bits 4k and 16 + 4k, k < 2; of the word shifted right by 8
  // for k >= 2): the nibbles alone (mask), times 2^12 + 2^6 (or 2^8 + 2^2 for the upper nibble of a byte) puts
  // copies of each at bits 15..12 and 9..6 (31..28, 25..22) without carries, of which s at 15 and eem at 8..6 are
  // kept. Call only once the wgmma that read frag[] has completed.
  __device__ __forceinline__ void decode(const uint8_t* seg, int g, int t) {
    if constexpr (!FP4) {
      constexpr int kChunks = DI / 32;  // 16-byte chunks of the lane's slice (8 values each)
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int r = g + 8 * rr;
        const uint8_t* row = seg + r * C::kRow;
#pragma unroll
        for (int i = 0; i < kChunks; ++i) {
          const int cc = kChunks * t + i;
          const uint4 v = *reinterpret_cast<const uint4*>(row + 16 * (cc ^ (r & 7)));
          at(rr, 4 * i + 0) = v.x;
          at(rr, 4 * i + 1) = v.y;
          at(rr, 4 * i + 2) = v.z;
          at(rr, 4 * i + 3) = v.w;
        }
      }
    } else {
      uint32_t big[2];
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const uint32_t s = scale[rr];
        const uint32_t m1 = s > 128 ? (253u << 7) : ((s + 126u) << 7);
        const uint32_t m1x2 = m1 | (m1 << 16);
#pragma unroll
        for (int i = 0; i < kRaw; ++i) {
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const uint32_t w = k < 2 ? raw[rr][i] : raw[rr][i] >> 8;
            const uint32_t c = (k & 1) ? (w & 0x00F000F0u) * 0x104u : (w & 0x000F000Fu) * 0x1040u;
            at(rr, 4 * i + k) = bf16x2_mul(c & 0x81C081C0u, m1x2);
          }
        }
        big[rr] = s > 128 ? (s << 7) | (s << 23) : 0x3F803F80u;  // the second factor (1.0 if none)
      }
      if (__any_sync(0xffffffffu, scale[0] > 128 || scale[1] > 128)) {  // rare: keys of magnitude above 24
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
#pragma unroll
          for (int m = 0; m < C::kRegs; ++m) at(rr, m) = bf16x2_mul(at(rr, m), big[rr]);
        }
      }
    }
  }

  // desc0: smem_desc of q^T; step s adds its byte offset / 16 to the address field (no carry: q lies in shared
  // memory, below 256 KB)
  __device__ __forceinline__ void issue(float (&d)[32], uint64_t desc0) {
#pragma unroll
    for (int s = 0; s < C::kKSteps; ++s) fence_regs(frag[s]);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < C::kKSteps; ++s) {
      const uint64_t desc = desc0 + (((s >> 2) * (kWgHeads * 128) + (s & 3) * 32) >> 4);  // atom of 64 k; 16 k = 32 B
      if (s == 0) {
        wgmma_m64n64k16_first(d, frag[s][0], frag[s][1], frag[s][2], frag[s][3], desc);
      } else {
        wgmma_m64n64k16(d, frag[s][0], frag[s][1], frag[s][2], frag[s][3], desc, 1);
      }
    }
    wgmma_commit();
  }

  // after the wgmma reading frag[] has completed: keeps the compiler from reusing these registers earlier
  __device__ __forceinline__ void retire() {
#pragma unroll
    for (int s = 0; s < C::kKSteps; ++s) fence_regs(frag[s]);
  }

  // ---- FP8 operands (FP4 keys of head dim 128, q taken as e4m3: see stage_q_f8). Lane (g, t) holds block t (32
  // codes, scale byte s) of rows g and g + 8. With S the row's largest block scale, its codes become e4m3 values
  // e2m1 * 2^(s - S + 6): a table of the 8 magnitudes shifted by that many binades, exact for s - S + 6 in [-5, 6],
  // so the row is its e4m3 vector times 2^(S - 133), a factor applied to the row's score after the sum over heads.
  // Word i of the slice (codes 8i .. 8i + 7) is k step i: its low half the register of k 4t .. 4t + 3, its high
  // half that of k 16 + 4t .. 16 + 4t + 3 (f8_k_of_dim gives q's order). A row with a nonzero block more than 11
  // binades below its largest is read with the shift clamped, and its CTA then scores its range again with bf16
  // operands (score_wgmma_kernel).
  int rexp[2];  // S - 133 of rows g and g + 8

  // e4m3 bytes of the magnitudes e2m1(c) * 2^dl, c = 0..7, as the prmt table (bytes 0..3 lo, 4..7 hi); dl in [-5, 6]
  static __device__ __forceinline__ void f8_table(int dl, uint32_t& lo, uint32_t& hi) {
    lo = 0x3C383000u + static_cast<uint32_t>(dl) * 0x08080800u;
    hi = 0x4C484440u + static_cast<uint32_t>(dl) * 0x08080808u;
  }
  // 8 codes to 8 e4m3 bytes: the magnitudes through the table (codes 0..3 of the word to r0, 4..7 to r1), the signs
  // (bit 3 of each code) from prmt's sign-replicating selectors: the sign of code 2k + 1 is the top bit of byte k of
  // w, that of code 2k the top bit of byte k of w << 4
  static __device__ __forceinline__ void f8_word(uint32_t w, uint32_t lo, uint32_t hi, uint32_t& r0, uint32_t& r1) {
    const uint32_t m = w & 0x77777777u, a = w << 4;
    r0 = prmt(lo, hi, m) | (prmt(a, w, 0xD9C8u) & 0x80808080u);
    r1 = prmt(lo, hi, m >> 16) | (prmt(a, w, 0xFBEAu) & 0x80808080u);
  }

  // Fragments of steps 0..3 and rexp from raw[] and scale[]. `spread` gathers (S - s) + 0x7FF4 of each row of this
  // lane in its 16-bit half (rows g, g + 8; `rmask` clears the half of a row past the visible ones): bit 15 or 31
  // is set once a row's block lies more than 11 binades below its largest, which the table's shift then clamps (a
  // block of zero codes at the floor scale counts too, though it reads 0 whatever the shift). The check adds two
  // instructions a tile (a per-tile vote across the warpgroup cost 10% at batch 64); the rare CTA it flags scores
  // again. Call only once the wgmma that read frag[] has completed.
  __device__ __forceinline__ void decode_f8(uint32_t rmask, uint32_t& spread) {
    static_assert(DI == 128 && FP4, "FP8 operands: FP4 keys of head dim 128");
    const uint32_t own = scale[0] | (scale[1] << 16);
    uint32_t sp = __vmaxu2(own, __shfl_xor_sync(0xffffffffu, own, 1));  // the row's largest scale (its quad's)
    sp = __vmaxu2(sp, __shfl_xor_sync(0xffffffffu, sp, 2));
    uint32_t x = sp - own + 0x7FF47FF4u;  // per half: S - s <= 255, so no carry between the halves
    spread |= x & rmask;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int smax = static_cast<int>(rr ? sp >> 16 : sp & 0xFFFFu);
      const int dl = max(static_cast<int>(scale[rr]) + 6 - smax, -5);
      rexp[rr] = smax - 133;
      uint32_t lo, hi;
      f8_table(dl, lo, hi);
#pragma unroll
      for (int i = 0; i < kRaw; ++i) f8_word(raw[rr][i], lo, hi, frag[i][rr], frag[i][rr + 2]);
    }
  }

  __device__ __forceinline__ void issue_f8(float (&d)[32], uint64_t desc0) {
#pragma unroll
    for (int s = 0; s < 4; ++s) fence_regs(frag[s]);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < 4; ++s) {  // k step s: 32 bytes of each q^T row, in its one 128-byte swizzled atom
      if (s == 0) {
        wgmma_f8_m64n64k32_first(d, frag[0][0], frag[0][1], frag[0][2], frag[0][3], desc0);
      } else {
        wgmma_f8_m64n64k32(d, frag[s][0], frag[s][1], frag[s][2], frag[s][3], desc0 + 2 * s, 1);
      }
    }
    wgmma_commit();
  }

  __device__ __forceinline__ void retire_f8() {
#pragma unroll
    for (int s = 0; s < 4; ++s) fence_regs(frag[s]);
  }
};

// relu, weight, sum over the 64 heads of D rows g and g + 8: lane t = 0 stores row g, t = 1 row g + 8.
// wv: this lane's 16 head weights (heads 8c + 2t + e at 2c + e) in shared memory (registers are short here).
// F8: each row's sum times 2^rexp (two normal factors: exact unless the score is below 2^-60).
template <bool F8>
__device__ __forceinline__ void wg_epilogue(const float (&d)[32], const float* wv, uint32_t* keys, int nv, int j0,
                                            uint32_t* hist, const int (&rexp)[2]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
  for (int c4 = 0; c4 < 4; ++c4) {
    const float4 w4 = reinterpret_cast<const float4*>(wv)[c4];
    const float w[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int c = 2 * c4 + (i >> 1), e = i & 1;
      s0 = fmaf(w[i], fmaxf(d[4 * c + e], 0.0f), s0);
      s1 = fmaf(w[i], fmaxf(d[4 * c + 2 + e], 0.0f), s1);
    }
  }
  const bool odd = t & 1;  // even lanes sum row g, odd lanes row g + 8 (same addition order as before)
  float r = (odd ? s1 : s0) + __shfl_xor_sync(0xffffffffu, odd ? s0 : s1, 1);
  r += __shfl_xor_sync(0xffffffffu, r, 2);
  if constexpr (F8) {
    const int e = odd ? rexp[1] : rexp[0], e1 = e >> 1;
    r = __fmul_rn(__fmul_rn(r, __int_as_float((e1 + 127) << 23)), __int_as_float((e - e1 + 127) << 23));
  }
  const int j = j0 + 16 * warp + g + 8 * t;
  if (t < 2 && j < nv) {
    const uint32_t key = order_key(r);
    keys[j] = key;
    if (hist != nullptr) atomicAdd(hist + (key >> 20), 1u);
  }
}

// k position (of the FP8 operands' order, see decode_f8) of q's dim d = 32t + 8i + 4u + e: 32i + 16u + 4t + e.
__host__ __device__ constexpr int f8_k_of_dim(int d) {
  return 32 * ((d >> 3) & 3) + 16 * ((d >> 2) & 1) + 4 * (d >> 5) + (d & 3);
}

// q^T as e4m3 operands (head dim 128) and the weights for them, when q allows: for head h with E the largest biased
// exponent of its bf16 values, q8 = q * 2^(134 - E) (its largest value in [128, 256)) and w8 = w * 2^(E - 134), so
// relu and the sum over heads see the same products. Taken when every q8 value is exact (an e4m3 number; checked
// through fp16, which cannot tell values below 2^-25, that is 2^-32 of the head's largest, from zero, so those count
// as zero) and every w8 is a normal float that scales back to w. The model's q (FP4 e2m1 blocks of 32 with
// power-of-two scales, ops/kv_quant.py) converts whenever a head's block scales lie within 10 binades of each other,
// as those of a Hadamard-rotated q do. Else the bf16 operands run. v: this thread's 8-element chunks of q, chunk
// tid + 128 i (head (tid >> 4) + 8 i, elements 8 (tid & 15) ..). Every thread calls it; the answer is the CTA's.
__device__ __forceinline__ bool stage_q_f8(const IndexerArgs& a, int64_t t, const uint4 (&v)[8], uint8_t* qsm,
                                           float* wv_s) {
  const int tid = threadIdx.x, c = tid & 15;
  bool ok = true;
  uint32_t q8[8][2];
  float w8[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int h = (tid >> 4) + 8 * i;
    const uint32_t x[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
    const uint32_t m = __vmaxu2(__vmaxu2(x[0] & 0x7F807F80u, x[1] & 0x7F807F80u),
                                __vmaxu2(x[2] & 0x7F807F80u, x[3] & 0x7F807F80u));
    int e = static_cast<int>(max(m & 0xFFFFu, m >> 16) >> 7);
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) e = max(e, __shfl_xor_sync(0xffffffffu, e, o));  // the head's 16 lanes
    ok &= e == 0 || (e >= 8 && e <= 254);  // (0: zeros, or subnormals, which the check below takes as zeros)
    const int es = (e >= 8 && e <= 254) ? e : 134;
    const float f = __int_as_float((261 - es) << 23);  // 2^(134 - es)
    uint32_t p8[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float y0 = __fmul_rn(__uint_as_float(x[j] << 16), f), y1 = __fmul_rn(__uint_as_float(x[j] & 0xFFFF0000u), f);
      const __nv_fp8x2_storage_t b8 = __nv_cvt_float2_to_fp8x2(make_float2(y0, y1), __NV_SATFINITE, __NV_E4M3);
      const __half2_raw back = __nv_cvt_fp8x2_to_halfraw2(b8, __NV_E4M3);
      const __half2 yh = __floats2half2_rn(y0, y1);
      const __half2_raw yr = *reinterpret_cast<const __half2_raw*>(&yh);
      ok &= (static_cast<uint32_t>(back.x) | (static_cast<uint32_t>(back.y) << 16)) ==
            (static_cast<uint32_t>(yr.x) | (static_cast<uint32_t>(yr.y) << 16));
      p8[j] = b8;
    }
    q8[i][0] = p8[0] | (p8[1] << 16);
    q8[i][1] = p8[2] | (p8[3] << 16);
    w8[i] = 0.0f;
    if (c == 0 && h < a.n_heads) {
      const float w = a.weights[t * a.n_heads + h];
      w8[i] = __fmul_rn(w, __int_as_float((es - 7) << 23));  // w * 2^(es - 134)
      ok &= __fmul_rn(w8[i], f) == w;
    }
  }
  if (__syncthreads_or(!ok)) return false;
  const int k0 = f8_k_of_dim(8 * c);  // elements 8c .. 8c + 3 at k0 .., 8c + 4 .. at k0 + 16
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int h = (tid >> 4) + 8 * i;
    uint8_t* row = qsm + h * 128;
    *reinterpret_cast<uint32_t*>(row + ((((k0 >> 4)) ^ (h & 7)) << 4) + (k0 & 15)) = q8[i][0];
    *reinterpret_cast<uint32_t*>(row + ((((k0 >> 4) + 1) ^ (h & 7)) << 4) + (k0 & 15)) = q8[i][1];
    if (c == 0) wv_s[16 * ((h >> 1) & 3) + (((h >> 3) << 1) | (h & 1))] = w8[i];  // as the bf16 path's order
  }
  return true;
}
#endif  // sm_90a

// F8 (FP4 keys of head dim 128): e4m3 operands when q allows (stage_q_f8), else bf16 ones; the launcher picks this
// instance for calls whose CTAs take many tiles each (launch_wgmma).
template <int DI, bool FP4, bool BULK, bool F8>
__global__ void __launch_bounds__(128, 4) score_wgmma_kernel(const IndexerArgs a, const Ws ws, const int64_t t0,
                                                             const int ctas, const int log2e) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = WgCfg<DI, FP4>;
  using W = WgWarp<DI, FP4, BULK>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);  // swizzle atoms are 1 KB aligned
  uint8_t* qsm = base;                                                        // q^T
  uint8_t* ring = base + C::kQBytes;                                          // [kStages][4 warps][kSeg]
  uint32_t* hist = reinterpret_cast<uint32_t*>(ring + C::kStages * 4 * C::kSeg);

  // 128 threads: the mask tells the compiler tid is in [0, 128), so the staging's index math folds
  const int tid = static_cast<int>(threadIdx.x & 127u), lane = tid & 31, warp = tid >> 5, g = lane >> 2;
  const int t4 = lane & 3;
  const int64_t tl = blockIdx.x / ctas, t = t0 + tl;
  const int c = static_cast<int>(blockIdx.x % ctas);
  const Tok tok = token_info(a, t, ws.n_cap);
  if (tok.nv <= a.topk) return;  // every visible entry is selected: nothing to score
  const int nv = static_cast<int>(tok.nv);  // < 2^31 (use_tensor_cores)
  const int64_t n_tiles = (tok.nv + kWgTile - 1) / kWgTile;
  const int tb = static_cast<int>(n_tiles * c / ctas);
  const int n = static_cast<int>(n_tiles * (c + 1) / ctas - tb);
  if (n == 0) return;  // no tile (a token far shorter than the block table): nothing to stage, count or flush
  const bool counts = tok.nv > ws.small_max;  // else the one-CTA selection builds its own histogram
  if (counts)
    for (int b = tid; b < kBins; b += 128) hist[b] = 0;
  uint32_t* const hist_or_null = counts ? hist : nullptr;

  // q^T into shared memory (row = head, k order of the operands), zero heads past n_heads: 16-byte loads, all
  // in flight, then as e4m3 operands when q allows (FP4 keys of head dim 128, stage_q_f8), else each pair of
  // elements that share a bf16 register to its k position
  constexpr bool kF8 = F8 && FP4 && DI == 128;
  constexpr int kChunks = kWgHeads * DI / 8 / 128;  // 8-element chunks per thread
  float* wv_s = reinterpret_cast<float*>(hist + kBins);  // [4 lanes t][16 weights]
  auto load_q = [&](uint4 (&v)[kChunks]) {
    const uint4* q4 = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a.q) + t * a.n_heads * DI);
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int ch = tid + 128 * i, h = tid / (DI / 8) + i * (128 / (DI / 8));
      v[i] = h < a.n_heads ? q4[ch] : make_uint4(0, 0, 0, 0);
    }
  };
  static_assert(128 % (DI / 8) == 0, "a thread's chunks share one position in a head row");
  auto stage_bf16 = [&](const uint4 (&v)[kChunks]) {
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int h = tid / (DI / 8) + i * (128 / (DI / 8)), e0 = (tid % (DI / 8)) * 8;  // chunk tid + 128 i
      const int ts = e0 / (DI / 4), ci = (e0 % (DI / 4)) >> 3;  // lane slice, 8-element chunk within it
      const uint32_t w[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
#pragma unroll
      for (int p = 0; p < 4; ++p) {  // register m = 4 ci + p holds elements (e0 + p, e0 + p + 4) or (e0 + 2p, +1)
        const uint32_t pair = FP4 ? __byte_perm(w[p >> 1], w[2 + (p >> 1)], (p & 1) ? 0x7632 : 0x5410) : w[p];
        const int m = 4 * ci + p, k = 16 * (m >> 1) + 8 * (m & 1) + 2 * ts;
        *reinterpret_cast<uint32_t*>(qsm + (k >> 6) * (kWgHeads * 128) + h * 128 +
                                     ((((k & 63) >> 3) ^ (h & 7)) << 4) + 2 * (k & 7)) = pair;
      }
    }
    if (tid < 64) {
      const int tt = tid >> 4, i = tid & 15, h = 8 * (i >> 1) + 2 * tt + (i & 1);
      wv_s[tid] = h < a.n_heads ? a.weights[t * a.n_heads + h] : 0.0f;
    }
  };
  bool f8 = false;
  {
    uint4 v[kChunks];
    load_q(v);
    if constexpr (kF8) {
      f8 = stage_q_f8(a, t, v, qsm, wv_s);
    }
    if (!f8) stage_bf16(v);
  }
  const float* wv = wv_s + 16 * t4;
  // the ring's mbarriers (BULK), [kStages][4 warps]: stage i % kStages of warp w completes its phase (i / kStages)
  // once tile i's run has landed
  const uint32_t bars = smem_u32(wv_s + kScratchWords) + 8 * warp;
  auto bar = [&](int i) { return bars + (i % C::kStages) * 4 * 8; };
  auto init_ring = [&]() {
    if (BULK && lane == 0) {
#pragma unroll
      for (int i = 0; i < C::kStages; ++i) mbar_init(bar(i), 1);
      mbar_init_fence();
    }
    fence_proxy_async_shared();
    __syncthreads();
  };
  init_ring();

  const int32_t* bt_row = a.block_table + tok.slot * a.bt_stride;
  uint8_t* my_ring = ring + warp * C::kSeg;
  auto seg = [&](int i) { return my_ring + (i % C::kStages) * 4 * C::kSeg; };
  auto prologue = [&]() {
#pragma unroll
    for (int i = 0; i < C::kStages - 1; ++i) {
      if (i < n) W::copy(a, bt_row, nv, (tb + i) * kWgTile, warp, lane, seg(i), log2e, bar(i));
      if (!BULK) cp_async_commit();
    }
  };
  prologue();
  const uint64_t desc0 = smem_desc(smem_u32(qsm));
  uint32_t* keys = ws.keys + tl * ws.n_cap;
  W w;
  w.rexp[0] = w.rexp[1] = 0;
  float d[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) d[i] = 0.0f;
  uint32_t spread = 0u;  // F8: bit 15 or 31 once a row of this thread's was read with its shift clamped (decode_f8)
  // F8: which of this thread's two rows (g, g + 8) of the CTA's last tile are visible (every earlier tile is full)
  const int last_rows = nv - (tb + n - 1) * kWgTile - 16 * warp;
  const uint32_t last_mask =
      last_rows >= 16 ? 0xFFFFFFFFu : (g < last_rows ? 0xFFFFu : 0u) | (g + 8 < last_rows ? 0xFFFF0000u : 0u);
  // per tile: raw rows of tile i to registers, refill the ring, finish tile i - 1 (its wgmma read the fragments
  // that tile i's decode overwrites), decode and start tile i
  auto tiles = [&](auto f8c) {
    constexpr bool kE4m3 = decltype(f8c)::value;
    // the last wgmma has completed (its fragments may be overwritten); if DONE, its tile's scores to the keys
#define DSV4RT_FINISH_TILE(DONE, J0)                                            \
  wgmma_wait0();                                                                \
  fence_regs(d);                                                                \
  if constexpr (kE4m3) {                                                        \
    w.retire_f8();                                                              \
  } else {                                                                      \
    w.retire();                                                                 \
  }                                                                             \
  if (DONE) wg_epilogue<kE4m3>(d, wv, keys, nv, (J0), hist_or_null, w.rexp);
// 4 = the FP4 ring's stages: offsets, barrier addresses and wait parities become constants (29 fewer instructions a
// warp and tile in the e4m3 instance); b64 over 256K entries 7% shorter on an H100, b1 unchanged
#pragma unroll 4
    for (int i = 0; i < n; ++i) {
      if (BULK) {
        mbar_wait(bar(i), static_cast<uint32_t>(i / C::kStages) & 1u);
      } else {
        cp_async_wait<C::kStages - 2>();
        __syncwarp();
      }
      w.fetch(seg(i), g, t4);
      __syncwarp();  // every lane has read the stage before it is refilled
      if (i + C::kStages - 1 < n) W::copy(a, bt_row, nv, (tb + i + C::kStages - 1) * kWgTile, warp, lane,
                                          seg(i + C::kStages - 1), log2e, bar(i + C::kStages - 1));
      if (!BULK) cp_async_commit();
      DSV4RT_FINISH_TILE(i > 0, (tb + i - 1) * kWgTile)
      if constexpr (kE4m3) {
        w.decode_f8(i == n - 1 ? last_mask : 0xFFFFFFFFu, spread);
        w.issue_f8(d, desc0);
      } else {
        w.decode(seg(i), g, t4);  // bf16: reads stage i, which is refilled only at step i + 1 (after its __syncwarp)
        w.issue(d, desc0);
      }
    }
    DSV4RT_FINISH_TILE(n > 0, (tb + n - 1) * kWgTile)
#undef DSV4RT_FINISH_TILE
  };
  bool bf16_pass = true;
  if constexpr (kF8) {
    if (f8) {
      tiles(std::true_type{});
      if (!BULK) cp_async_wait<0>();
      // Rare: a row's block scales lie more than 11 binades apart, so one shift could not hold it. Every wgmma and
      // copy is complete (each warp waited for its last), so after the barrier the CTA stages q as bf16, clears its
      // histogram, starts the ring again and scores its range anew, over the keys it wrote.
      bf16_pass = __syncthreads_or((spread & 0x80008000u) != 0u);
      if (bf16_pass) {
        if (BULK && lane == 0) {
#pragma unroll
          for (int i = 0; i < C::kStages; ++i) mbar_inval(bar(i));
        }
        uint4 v[kChunks];
        load_q(v);
        stage_bf16(v);
        if (counts)
          for (int b = tid; b < kBins; b += 128) hist[b] = 0;
        init_ring();
        prologue();
      }
    }
  }
  if (bf16_pass) tiles(std::false_type{});
  if (!BULK) cp_async_wait<0>();  // (BULK: every run copied was waited for)
  pdl_launch_dependents();  // the select grid may be scheduled (it waits for this grid's completion)
  if (counts) flush_hist<128>(ws, tl, c, hist);
#endif
}

// ------------------------------------------------------------------------------------------ general scoring
__device__ __forceinline__ float fp4_value(uint32_t code, uint32_t s) {
  const uint32_t e = (code >> 1) & 3, m = code & 1;
  const float mag = e ? __uint_as_float(((e + 126u) << 23) | (m << 22)) : 0.5f * static_cast<float>(m);
  const float scale = s == 0 ? __uint_as_float(0x00400000u) : __uint_as_float(s << 23);  // 2^(s-127); 255: inf
  const float v = mag * scale;
  return (code & 8) ? -v : v;
}

__device__ __forceinline__ float load_value(const void* p, int64_t i, int dtype) {
  switch (dtype) {
    case 0: return static_cast<const float*>(p)[i];
    case 1: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: return __half2float(static_cast<const __half*>(p)[i]);
  }
}

__host__ __device__ inline size_t simt_smem_bytes(int n_heads, int head_dim) {
  return sizeof(float) * (static_cast<size_t>(n_heads) * head_dim + n_heads + kSimtTile * (head_dim + 1) +
                          8 * kSimtTile) +
         sizeof(uint32_t) * (kBins + kScratchWords + 4);  // + 4: the histogram's alignment
}

__global__ void __launch_bounds__(kSimtThreads) score_simt_kernel(const IndexerArgs a, const Ws ws, const int64_t t0,
                                                                  const int ctas) {
  extern __shared__ float sm[];
  const int nh = a.n_heads, di = a.head_dim, ld = di + 1, tid = threadIdx.x;
  float* q_s = sm;                     // [nh, di]
  float* w_s = q_s + nh * di;          // [nh]
  float* k_s = w_s + nh;               // [kSimtTile, di + 1]
  float* part = k_s + kSimtTile * ld;  // [8, kSimtTile]
  uint32_t* hist = reinterpret_cast<uint32_t*>(part + 8 * kSimtTile);
  hist += (4 - (smem_u32(hist) >> 2) % 4) % 4;  // 16-byte aligned (add_hist)

  const int64_t tl = blockIdx.x / ctas, t = t0 + tl;
  const int c = static_cast<int>(blockIdx.x % ctas);
  const Tok tok = token_info(a, t, ws.n_cap);
  if (tok.nv <= a.topk) return;
  const int64_t n_tiles = (tok.nv + kSimtTile - 1) / kSimtTile;
  const int64_t tb = n_tiles * c / ctas, te = n_tiles * (c + 1) / ctas;
  if (tb == te) return;  // no tile (a token far shorter than the block table)
  const bool counts = tok.nv > ws.small_max;  // else the one-CTA selection builds its own histogram
  if (counts)
    for (int b = tid; b < kBins; b += blockDim.x) hist[b] = 0;
  for (int i = tid; i < nh * di; i += blockDim.x) q_s[i] = load_value(a.q, t * nh * di + i, a.q_dtype);
  for (int i = tid; i < nh; i += blockDim.x) w_s[i] = a.weights[t * nh + i];
  const uint8_t* cache = static_cast<const uint8_t*>(a.idx_cache);
  for (int64_t tile = tb; tile < te; ++tile) {
    const int64_t j0 = tile * kSimtTile;
    __syncthreads();  // q/w loaded; the previous tile's keys and partials consumed
    for (int i = tid; i < kSimtTile * di; i += blockDim.x) {
      const int e = i / di, d = i % di;
      const int64_t j = j0 + e;
      float v = 0.0f;
      if (j < tok.nv) {
        const int64_t blk = block_of(a, tok.slot, j / a.per_block);
        const uint8_t* row = cache + (blk * a.per_block + j % a.per_block) * a.row_bytes;
        if (a.format == static_cast<int>(IdxFormat::kFp4)) {
          const uint32_t byte = row[d >> 1];
          v = fp4_value((d & 1) ? byte >> 4 : byte & 15, row[di / 2 + d / 32]);
        } else {
          v = load_value(row, d, a.format);
        }
      }
      k_s[e * ld + d] = v;
    }
    __syncthreads();
    const int e = tid % kSimtTile, hg = tid / kSimtTile;
    float acc = 0.0f;
    for (int h = hg; h < nh; h += 8) {
      const float* qh = q_s + h * di;
      const float* ke = k_s + e * ld;
      float dot = 0.0f;
      for (int d = 0; d < di; ++d) dot = fmaf(qh[d], ke[d], dot);
      acc = fmaf(w_s[h], fmaxf(dot, 0.0f), acc);
    }
    part[hg * kSimtTile + e] = acc;
    __syncthreads();
    if (tid < kSimtTile && j0 + tid < tok.nv) {
      float s = 0.0f;
      for (int i = 0; i < 8; ++i) s += part[i * kSimtTile + tid];
      const uint32_t key = order_key(s);
      ws.keys[tl * ws.n_cap + j0 + tid] = key;
      if (counts) atomicAdd(hist + (key >> 20), 1u);
    }
  }
  pdl_launch_dependents();
  if (counts) flush_hist<kSimtThreads>(ws, tl, c, hist);
}

// ------------------------------------------------------------------------------------------ selection
// Digits of the composite key (score key, ~index): level 0 = key bits 31..20 (b1), 1 = bits 19..8, 2 = bits
// 7..0, 3..6 = the bytes of ~index from the top (so the smaller index wins a tie of scores).
__device__ __forceinline__ uint32_t digit_of(int level, uint32_t key, uint32_t j) {
  const uint32_t nj = ~j;
  switch (level) {
    case 1: return (key >> 8) & 0xFFF;
    case 2: return key & 0xFF;
    case 3: return nj >> 24;
    case 4: return (nj >> 16) & 0xFF;
    case 5: return (nj >> 8) & 0xFF;
    default: return nj & 0xFF;
  }
}

// All lanes of the warp call; lanes with `pred` write j at consecutive slots claimed with one atomic.
__device__ __forceinline__ void emit_warp(bool pred, int32_t j, uint32_t* counter, int32_t* out_row) {
  const unsigned m = __ballot_sync(0xffffffffu, pred);
  if (!m) return;
  const int lane = threadIdx.x & 31, leader = __ffs(m) - 1;
  uint32_t base = 0;
  if (lane == leader) base = atomicAdd(counter, static_cast<uint32_t>(__popc(m)));
  base = __shfl_sync(0xffffffffu, base, leader);
  if (pred) out_row[base + __popc(m & ((1u << lane) - 1u))] = j;
}

__host__ __device__ inline int pow2_at_least(int n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

constexpr int kSmemCand = 4096;  // candidates the last CTA keeps in shared memory

__host__ __device__ inline size_t select_smem_bytes(int topk) {
  const int p = pow2_at_least(topk);
  return sizeof(uint32_t) * ((p > kBins ? p : kBins) + 2 * kSmemCand + kDigitBins + kScratchWords);
}

__global__ void __launch_bounds__(kSelectThreads) select_kernel(const IndexerArgs a, const Ws ws, const int64_t t0,
                                                                const int ctas) {
  extern __shared__ uint32_t ssm[];
  const int p2 = pow2_at_least(a.topk);
  uint32_t* hist = ssm;                                                  // [kBins]; at the end the sort array
  uint2* cs = reinterpret_cast<uint2*>(ssm + (p2 > kBins ? p2 : kBins));  // [kSmemCand]
  uint32_t* dh = reinterpret_cast<uint32_t*>(cs + kSmemCand);            // [kDigitBins]
  uint32_t* scratch = dh + kDigitBins;
  const int tid = threadIdx.x, nt = kSelectThreads;
  const int64_t tl = blockIdx.x / ctas, t = t0 + tl;
  const int c = static_cast<int>(blockIdx.x % ctas);
  // With the one-CTA selection behind this grid, that grid's CTAs may be scheduled at once: they wait for this
  // grid's completion (pdl_wait) before they touch memory, and are resident by then.
  if (ws.small_max > 0) pdl_launch_dependents();
  const Tok tok = token_info(a, t, ws.n_cap);  // step metadata: before the wait (launch.cuh)
  if (ws.small_max > 0 && tok.nv <= ws.small_max) {  // the one-CTA selection's token: this grid ends after the scoring
    if (blockIdx.x == 0) pdl_wait();
    return;
  }
  pdl_wait();  // before any other global access: the scoring grid (or whatever ran before) has completed
  const uint32_t topk = static_cast<uint32_t>(a.topk);
  int32_t* out_row = a.out + t * a.topk;
  if (tok.nv <= a.topk) {  // all visible entries, in order, then -1
    for (int64_t j = static_cast<int64_t>(c) * nt + tid; j < a.topk; j += static_cast<int64_t>(ctas) * nt)
      out_row[j] = j < tok.nv ? static_cast<int32_t>(j) : -1;
    return;
  }
  uint32_t* ctr = ws.ctr + tl * kCtrWords;
  const uint32_t* keys = ws.keys + tl * ws.n_cap;
  uint2* cand = ws.cand + tl * kCandCap;

  // b1: the bin of the k-th largest key (every CTA of the token finds the same)
  stage_hist<kBins, kSelectThreads, kHistCopies>(ws.hist1 + tl * kHistCopies * kBins, hist);
  __syncthreads();
  uint32_t b1, above1, count;
  select_bin(hist, kBins, topk, scratch, b1, above1, count);
  for (int b = tid; b < kBins; b += nt) hist[b] = 0;  // now the histogram of the next 12 bits in bin b1
  __syncthreads();

  // keys above bin b1 are in; keys in b1 are candidates
  const int64_t lo = tok.nv * c / ctas, hi = tok.nv * (c + 1) / ctas;
  constexpr int kUnroll = 8;  // loads in flight
  for (int64_t base = lo; base < hi; base += kUnroll * nt) {
    uint32_t kv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = base + u * nt + tid;
      kv[u] = j < hi ? keys[j] : 0u;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = base + u * nt + tid;
      const uint32_t key = kv[u], bin = key >> 20;
      const bool in = j < hi && bin > b1, is_cand = j < hi && bin == b1;
      emit_warp(in, static_cast<int32_t>(j), ctr + kEmit, out_row);
      if (is_cand) atomicAdd(hist + ((key >> 8) & 0xFFF), 1u);
      const unsigned m = __ballot_sync(0xffffffffu, is_cand);
      if (m) {
        const int lane = tid & 31, leader = __ffs(m) - 1;
        uint32_t pos = 0;
        if (lane == leader) pos = atomicAdd(ctr + kCand, static_cast<uint32_t>(__popc(m)));
        pos = __shfl_sync(0xffffffffu, pos, leader) + __popc(m & ((1u << lane) - 1u));
        if (is_cand && pos < kCandCap) cand[pos] = make_uint2(key, static_cast<uint32_t>(j));
      }
    }
  }
  __syncthreads();
  uint32_t* g2 = ws.hist2 + tl * kBins;
  add_hist<kSelectThreads>(g2, hist);
  __syncthreads();  // every thread's additions precede thread 0's fence and ticket (the grid-barrier pattern)
  if (tid == 0) {
    __threadfence();
    scratch[40] = atomicAdd(ctr + kDone2, 1u) == static_cast<uint32_t>(ctas - 1) ? 1u : 0u;
  }
  __syncthreads();
  if (!scratch[40]) return;
  __threadfence();

  // the last CTA of the token: the remaining digits among the keys of bin b1, read from a shared copy of the
  // candidate list, the list in global memory, or (when it overflowed) the token's keys. When topk <= threads,
  // thread i holds output i for the sort: the keys above bin b1 (out_row[0, above1), written by every CTA) are
  // loaded now, the rest go to shared memory (the first histogram's words, once it has been read)
  const bool small = p2 <= kSelectThreads;
  const int x_first = small && tid < static_cast<int>(above1) ? __ldcg(out_row + tid) : INT_MAX;
  const uint32_t n_cand = __ldcg(ctr + kCand);
  const int src = n_cand <= kSmemCand ? 0 : (n_cand <= kCandCap ? 1 : 2);
  if (tid == 0) scratch[41] = above1;
  stage_hist<kBins, kSelectThreads>(g2, hist);
  if (src == 0) {
    constexpr int kPer = kSmemCand / kSelectThreads;
    uint2 e[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const uint32_t i = tid + k * nt;
      e[k] = i < n_cand ? __ldcg(cand + i) : make_uint2(0, 0);
    }
#pragma unroll
    for (int k = 0; k < kPer; ++k) cs[tid + k * nt] = e[k];
  }
  __syncthreads();
  auto for_each = [&](auto&& f) {
    if (src == 0) {
      for (uint32_t i = tid; i < n_cand; i += nt) f(cs[i].x, cs[i].y);
    } else if (src == 1) {
      for (uint32_t i0 = 0; i0 < n_cand; i0 += 4 * nt) {
        uint2 e[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const uint32_t i = i0 + u * nt + tid;
          e[u] = i < n_cand ? __ldcg(cand + i) : make_uint2(0, 0);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u)
          if (i0 + u * nt + tid < n_cand) f(e[u].x, e[u].y);
      }
    } else {
      for (int64_t j0 = 0; j0 < tok.nv; j0 += 4 * nt) {
        uint32_t kv[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int64_t j = j0 + u * nt + tid;
          kv[u] = j < tok.nv ? __ldcg(keys + j) : 0u;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int64_t j = j0 + u * nt + tid;
          if (j < tok.nv && (kv[u] >> 20) == b1) f(kv[u], static_cast<uint32_t>(j));
        }
      }
    }
  };
  uint32_t v[7];
  v[0] = b1;
  uint32_t need = topk - above1, bin, above;
  select_bin(hist, kBins, need, scratch, bin, above, count);
  v[1] = bin;
  need -= above;
  bool all = count == need;
  for (int level = 1; level <= 6; ++level) {
    for (int b = tid; b < kDigitBins; b += nt) dh[b] = 0;
    __syncthreads();
    for_each([&](uint32_t key, uint32_t j) {
      for (int l = 1; l < level; ++l)
        if (digit_of(l, key, j) != v[l]) return;
      const uint32_t d = digit_of(level, key, j);
      if (d > v[level] || (d == v[level] && all)) {
        if (small) {
          hist[atomicAdd(scratch + 41, 1u)] = j;
        } else {
          out_row[atomicAdd(ctr + kEmit, 1u)] = static_cast<int32_t>(j);
        }
      } else if (d == v[level]) {
        atomicAdd(dh + digit_of(level + 1, key, j), 1u);
      }
    });
    __syncthreads();
    if (all || level == 6) break;
    select_bin(dh, kDigitBins, need, scratch, bin, above, count);
    v[level + 1] = bin;
    need -= above;
    all = count == need;
  }

  // ascending index order: the output does not depend on which CTA emitted what
  __syncthreads();
  int* arr = reinterpret_cast<int*>(hist);
  if (small) {  // one element a thread: exchanges within a warp by shuffles
    int x = tid < static_cast<int>(above1) ? x_first : (tid < a.topk ? static_cast<int>(hist[tid]) : INT_MAX);
    for (int k = 2; k <= p2; k <<= 1) {
      for (int s = k >> 1; s > 0; s >>= 1) {
        int y;
        if (s >= 32) {
          arr[tid] = x;
          __syncthreads();
          y = arr[tid ^ s];
          __syncthreads();
        } else {
          y = __shfl_xor_sync(0xffffffffu, x, s);
        }
        const bool keep_min = ((tid & k) == 0) == ((tid & s) == 0);
        x = keep_min ? min(x, y) : max(x, y);
      }
    }
    if (tid < a.topk) out_row[tid] = x;
    return;
  }
  for (int i = tid; i < p2; i += nt) arr[i] = i < a.topk ? __ldcg(out_row + i) : INT_MAX;
  for (int k = 2; k <= p2; k <<= 1) {
    for (int s = k >> 1; s > 0; s >>= 1) {
      __syncthreads();
      for (int i = tid; i < p2; i += nt) {
        const int o = i ^ s;
        if (o > i) {
          const int x = arr[i], y = arr[o];
          if ((x > y) == ((i & k) == 0)) {
            arr[i] = y;
            arr[o] = x;
          }
        }
      }
    }
  }
  __syncthreads();
  for (int i = tid; i < a.topk; i += nt) out_row[i] = arr[i];
}

// ------------------------------------------------------------------------------------------ one-CTA selection
// Tokens of at most kSmallEntries visible entries, in groups of few tokens (decode at contexts up to 4 x
// kSmallEntries, whatever the block table's width): one CTA selects a token's top k with its keys in shared memory,
// so that every step is shared-memory work between block barriers (the grid selection's global histograms, lists,
// tickets and last-CTA pass take about 12 us whatever the entry count). Digits of the composite
// c = key << 32 | ~index, as in the grid selection (12, 12 and 8 bits of the key, then the bytes of ~index): level
// 0's histogram is counted as the keys load (the scoring grid keeps none for these tokens), each further level
// counts the keys that match the digits found so far, until every key left in the bin is in. The selected entries
// set their bits in a bitmap of the token's entries, whose words, counted and scanned in order, give each its
// output slot: ascending index order, as the grid selection's sort gives.
constexpr int kSmallEntries = 32768;
constexpr int kSmallThreads = 1024;
constexpr int kSmallWords = kSmallEntries / 32;  // bitmap words: one a thread
static_assert(kSmallWords == kSmallThreads, "one bitmap word a thread");

__host__ __device__ inline size_t small_smem_bytes() {
  return sizeof(uint32_t) * (kSmallEntries + kBins + kSmallWords + kScratchWords);
}

// Bits [digit_lo(L), digit_lo(L) + width) of the composite hold digit L (widths 12, 12, 8, 8, 8, 8, 8).
__device__ __forceinline__ int digit_lo(int level) {
  return level == 0 ? 52 : (level == 1 ? 40 : 32 - 8 * (level - 2));
}

__global__ void __launch_bounds__(kSmallThreads) select_small_kernel(const IndexerArgs a, const Ws ws,
                                                                     const int64_t t0) {
  extern __shared__ __align__(16) uint32_t sm_small[];
  uint32_t* ks = sm_small;                 // [kSmallEntries] the token's keys
  uint32_t* hist = ks + kSmallEntries;     // [kBins] (16-byte aligned)
  uint32_t* bits = hist + kBins;           // [kSmallWords] selected entries
  uint32_t* scratch = bits + kSmallWords;  // [kScratchWords]
  const int tid = threadIdx.x, nt = kSmallThreads;
  const int64_t tl = blockIdx.x, t = t0 + tl;
  const Tok tok = token_info(a, t, ws.n_cap);  // step metadata: before the wait (launch.cuh)
  if (tok.nv > ws.small_max) {  // the grid selection's token (done before this grid); it ends after that one
    if (blockIdx.x == 0) pdl_wait();
    return;
  }
  for (int b = tid; b < kBins; b += nt) hist[b] = 0u;
  bits[tid] = 0u;
  pdl_wait();
  int32_t* out_row = a.out + t * a.topk;
  if (tok.nv <= a.topk) {  // all visible entries, in order, then -1
    for (int j = tid; j < a.topk; j += nt) out_row[j] = j < tok.nv ? j : -1;
    return;
  }
  const int n = static_cast<int>(tok.nv);  // <= small_max <= kSmallEntries
  const uint32_t* keys = ws.keys + tl * ws.n_cap;
  __syncthreads();
  // the keys to shared memory (16-byte loads when the token's keys are 16-byte aligned), counted into level 0's
  // histogram as they arrive
  if ((reinterpret_cast<uintptr_t>(keys) & 15) == 0) {
    constexpr int kPer = kSmallEntries / (4 * kSmallThreads);
    uint4 v[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int j = 4 * (tid + i * nt);
      v[i] = j < n ? __ldcg(reinterpret_cast<const uint4*>(keys + j)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int j = 4 * (tid + i * nt);
      if (j < n) {
        reinterpret_cast<uint4*>(ks)[j / 4] = v[i];
        const uint32_t k4[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (j + e < n) atomicAdd(hist + (k4[e] >> 20), 1u);
      }
    }
  } else {
    for (int j = tid; j < n; j += nt) {
      const uint32_t key = __ldcg(keys + j);
      ks[j] = key;
      atomicAdd(hist + (key >> 20), 1u);
    }
  }
  __syncthreads();

  // the digits of the k-th largest composite, level by level
  uint64_t prefix = 0;  // the digits found, in place
  uint32_t need = static_cast<uint32_t>(a.topk);
  int level = 0;
  for (;; ++level) {
    const int nb = level < 2 ? kBins : kDigitBins, lo_l = digit_lo(level);
    const uint32_t mask = level < 2 ? 0xFFFu : 0xFFu;
    if (level > 0) {
      for (int b = tid; b < nb; b += nt) hist[b] = 0u;
      __syncthreads();
      const int plo = digit_lo(level - 1);
      const uint64_t want = prefix >> plo;
      if (level <= 2) {  // the digits so far and this one are the key's: 32-bit arithmetic
        const uint32_t want32 = static_cast<uint32_t>(want);
        for (int j = tid; j < n; j += nt) {
          const uint32_t key = ks[j];
          if ((key >> (plo - 32)) == want32) atomicAdd(hist + ((key >> (lo_l - 32)) & mask), 1u);
        }
      } else {
        for (int j = tid; j < n; j += nt) {
          const uint64_t c = (static_cast<uint64_t>(ks[j]) << 32) | ~static_cast<uint32_t>(j);
          if ((c >> plo) == want) atomicAdd(hist + ((c >> lo_l) & mask), 1u);
        }
      }
      __syncthreads();
    }
    uint32_t bin, above, count;
    select_bin(hist, nb, need, scratch, bin, above, count);
    prefix |= static_cast<uint64_t>(bin) << lo_l;
    need -= above;
    if (count == need || level == 6) break;
  }

  // every composite at or above the threshold (the digits found, lower bits zero) is in
  const int lo_f = digit_lo(level);
  const uint64_t thr = prefix >> lo_f;
  if (lo_f >= 32) {  // the threshold's digits are the key's
    const int sh = lo_f - 32;
    const uint32_t thr32 = static_cast<uint32_t>(thr);
    for (int j = tid; j < n; j += nt)
      if ((ks[j] >> sh) >= thr32) atomicOr(bits + (j >> 5), 1u << (j & 31));
  } else {
    for (int j = tid; j < n; j += nt) {
      const uint64_t c = (static_cast<uint64_t>(ks[j]) << 32) | ~static_cast<uint32_t>(j);
      if ((c >> lo_f) >= thr) atomicOr(bits + (j >> 5), 1u << (j & 31));
    }
  }
  __syncthreads();
  uint32_t w = bits[tid];
  const uint32_t cnt = __popc(w);
  uint32_t off = block_inclusive_scan(cnt, scratch) - cnt;
  while (w) {
    const int b = __ffs(w) - 1;
    w &= w - 1u;
    if (off < static_cast<uint32_t>(a.topk)) out_row[off] = 32 * tid + b;
    ++off;
  }
}

// ------------------------------------------------------------------------------------------ host side
int64_t n_cap_of(const IndexerArgs& a) { return a.bt_cols * a.per_block; }

int64_t group_tokens(const IndexerArgs& a) {
  const int64_t per_token = n_cap_of(a) * 4;
  int64_t g = per_token > 0 ? kKeyBudget / per_token : a.n_tokens;
  if (g < 1) g = 1;
  if (g > a.n_tokens) g = a.n_tokens;
  return g;
}

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

struct WsLayout {
  size_t keys, cand, zero, zero_bytes, total;
};

WsLayout ws_layout(const IndexerArgs& a) {
  const int64_t g = group_tokens(a), n_cap = n_cap_of(a);
  WsLayout l{};
  l.keys = 0;
  l.cand = align256(sizeof(uint32_t) * g * n_cap);
  l.zero = l.cand + align256(sizeof(uint2) * g * kCandCap);
  l.zero_bytes = sizeof(uint32_t) * g * ((kHistCopies + 1) * kBins + kCtrWords);
  l.total = l.zero + align256(l.zero_bytes);
  return l;
}

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}

// DSV4RT_INDEXER_PDL=0: plain stream order between the scoring and select grids (comparisons).
bool pdl_enabled() {
  const char* v = std::getenv("DSV4RT_INDEXER_PDL");
  return v == nullptr || v[0] == '\0' || v[0] != '0';
}

int log2_exact(int64_t v) {  // log2 of a power of two, else -1
  if (v < 1 || (v & (v - 1))) return -1;
  int l = 0;
  while ((int64_t(1) << l) < v) ++l;
  return l;
}

bool use_tensor_cores(const IndexerArgs& a) {
  if (env_flag("DSV4RT_INDEXER_GENERAL")) return false;  // tests: force the general path
  int dev = 0, major = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  const bool fp4 = a.format == static_cast<int>(IdxFormat::kFp4);
  // a warp copies 16 rows: whole 16-byte chunks of one block (per_block >= 16) or of each block of them
  const int64_t run = a.per_block < 16 ? a.per_block : 16;
  return major == 9 && a.q_dtype == 1 && (fp4 || a.format == static_cast<int>(IdxFormat::kBFloat16)) &&
         a.n_heads >= 1 && a.n_heads <= kWgHeads && (a.head_dim == 64 || a.head_dim == 128) &&
         log2_exact(a.per_block) >= 0 && a.n_blocks * a.per_block <= (int64_t(1) << 32) &&  // 32-bit row numbers
         n_cap_of(a) <= INT_MAX - kWgTile &&                                                 // 32-bit entry indices
         (run * a.row_bytes) % 16 == 0 && (fp4 || a.row_bytes % 16 == 0) &&
         reinterpret_cast<uintptr_t>(a.idx_cache) % 16 == 0 && reinterpret_cast<uintptr_t>(a.q) % 16 == 0;
}

// The FP8 instance pays more a CTA (q's check and e4m3 staging) and less a tile (half the tensor-core work; H200,
// 64 queries over 256K FP4 entries: score 679-683 against 758-759 us; at batch 1, 8 tiles a CTA, it loses: 256K
// entries 32.6 against 31.9-32.0 us a call (score 18.9-19.0 against 17.9-18.1), 16K 14.8-14.9 against 13.7), so it
// runs when the CTAs take at least kF8MinTiles tiles each. DSV4RT_INDEXER_F8=0 never takes it, =1 always
// (comparisons, tests).
constexpr int64_t kF8MinTiles = 32;

template <int DI, bool FP4>
cudaError_t launch_wgmma(const IndexerArgs& a, const Ws& ws, int64_t t0, int64_t g, cudaStream_t stream) {
  using C = WgCfg<DI, FP4>;
  const int64_t tiles = (n_cap_of(a) + kWgTile - 1) / kWgTile;
  int64_t ctas = static_cast<int64_t>(num_sms()) * (FP4 ? 4 : 2) / g;  // CTAs an SM: registers (FP4), smem (bf16)
  if (ctas > tiles) ctas = tiles;
  if (ctas < 1) ctas = 1;
  // FP4 rows in blocks of >= 16 entries: a warp's 16 rows are one run, copied in bulk
  const bool bulk = FP4 && a.per_block >= 16 && !env_flag("DSV4RT_INDEXER_CP_ASYNC");
  auto kernel = bulk ? score_wgmma_kernel<DI, FP4, FP4, false> : score_wgmma_kernel<DI, FP4, false, false>;
  if constexpr (DI == 128 && FP4) {  // with the rows' bulk copies only (blocks of >= 16 entries, as the model's)
    const char* env = std::getenv("DSV4RT_INDEXER_F8");
    const bool want = env != nullptr && env[0] != '\0' ? env[0] != '0' : (tiles + ctas - 1) / ctas >= kF8MinTiles;
    if (want && bulk) kernel = score_wgmma_kernel<DI, FP4, true, true>;
  }
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(C::kSmem));
  if (err != cudaSuccess) return err;
  kernel<<<static_cast<unsigned>(g * ctas), 128, C::kSmem, stream>>>(a, ws, t0, static_cast<int>(ctas),
                                                                     log2_exact(a.per_block));
  return cudaGetLastError();
}

cudaError_t launch_score(const IndexerArgs& a, const Ws& ws, int64_t t0, int64_t g, cudaStream_t stream) {
  if (use_tensor_cores(a)) {
    const bool fp4 = a.format == static_cast<int>(IdxFormat::kFp4);
    if (a.head_dim == 128) {
      return fp4 ? launch_wgmma<128, true>(a, ws, t0, g, stream) : launch_wgmma<128, false>(a, ws, t0, g, stream);
    }
    return fp4 ? launch_wgmma<64, true>(a, ws, t0, g, stream) : launch_wgmma<64, false>(a, ws, t0, g, stream);
  }
  const size_t smem = simt_smem_bytes(a.n_heads, a.head_dim);
  cudaError_t err = cudaFuncSetAttribute(score_simt_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  const int64_t tiles = (n_cap_of(a) + kSimtTile - 1) / kSimtTile;
  int64_t ctas = static_cast<int64_t>(num_sms()) * 4 / g;
  if (ctas > tiles) ctas = tiles;
  if (ctas < 1) ctas = 1;
  score_simt_kernel<<<static_cast<unsigned>(g * ctas), kSimtThreads, smem, stream>>>(a, ws, t0, static_cast<int>(ctas));
  return cudaGetLastError();
}

// The one-CTA selection (select_small_kernel) takes the tokens of at most kSmallEntries visible entries when a group
// has at most as many tokens as SMs (decode); the grid selection the others. When every token fits (the block table
// holds at most kSmallEntries entries), the one-CTA selection alone runs, and the call needs no memset; else the
// grid selection runs first and the one-CTA selection after it, each leaving the other's tokens (which are which is
// known on the device only). DSV4RT_INDEXER_SELECT (tests, comparisons): "grid" turns the one-CTA selection off,
// "small" on whatever the group's size.
int64_t small_max_of(const IndexerArgs& a, int64_t g) {
  const char* v = std::getenv("DSV4RT_INDEXER_SELECT");
  if (v != nullptr && v[0] == 'g') return 0;
  if ((v != nullptr && v[0] == 's') || g <= num_sms()) return kSmallEntries;
  return 0;
}

cudaError_t launch_small_select(const IndexerArgs& a, const Ws& ws, int64_t t0, int64_t g, cudaStream_t stream) {
  const size_t smem = small_smem_bytes();
  cudaError_t err = cudaFuncSetAttribute(select_small_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  return launch_ex(select_small_kernel, dim3(static_cast<unsigned>(g)), dim3(kSmallThreads), smem, stream, 1,
                   pdl_enabled(), a, ws, t0);
}

cudaError_t launch_select(const IndexerArgs& a, const Ws& ws, int64_t t0, int64_t g, cudaStream_t stream) {
  const size_t smem = select_smem_bytes(a.topk);
  cudaError_t err =
      cudaFuncSetAttribute(select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  const int64_t chunks = (n_cap_of(a) + 4095) / 4096;
  int64_t ctas = static_cast<int64_t>(num_sms()) * 2 / g;
  if (ctas > chunks) ctas = chunks;
  if (ctas < 1) ctas = 1;
  return launch_ex(select_kernel, dim3(static_cast<unsigned>(g * ctas)), dim3(kSelectThreads), smem, stream, 1,
                   pdl_enabled(), a, ws, t0, static_cast<int>(ctas));
}

}  // namespace

size_t indexer_workspace_bytes(const IndexerArgs& a) { return a.n_tokens > 0 ? ws_layout(a).total : 0; }

bool indexer_supported(const IndexerArgs& a, const char** why) {
  if (a.topk < 1) {
    *why = "topk must be positive";
    return false;
  }
  if (select_smem_bytes(a.topk) > 200 * 1024) {
    *why = "topk too large (at most 32768)";
    return false;
  }
  if (a.format == static_cast<int>(IdxFormat::kFp4) && a.head_dim % 32 != 0) {
    *why = "FP4 keys need a head dim divisible by 32";
    return false;
  }
  if (!use_tensor_cores(a) && (a.head_dim > 512 || simt_smem_bytes(a.n_heads, a.head_dim) > 200 * 1024)) {
    *why = "n_heads * head_dim too large for the general path (at most 16384, head dim at most 512)";
    return false;
  }
  return true;
}

cudaError_t indexer_topk_launch(const IndexerArgs& a, cudaStream_t stream) {
  if (a.n_tokens == 0) return cudaSuccess;
  const WsLayout l = ws_layout(a);
  const int64_t g_max = group_tokens(a), n_cap = n_cap_of(a);
  uint8_t* w = static_cast<uint8_t*>(a.workspace);
  Ws ws;
  ws.keys = reinterpret_cast<uint32_t*>(w + l.keys);
  ws.cand = reinterpret_cast<uint2*>(w + l.cand);
  ws.hist1 = reinterpret_cast<uint32_t*>(w + l.zero);
  ws.hist2 = ws.hist1 + g_max * kHistCopies * kBins;
  ws.ctr = ws.hist2 + g_max * kBins;
  ws.n_cap = n_cap;
  for (int64_t t0 = 0; t0 < a.n_tokens; t0 += g_max) {
    const int64_t g = a.n_tokens - t0 < g_max ? a.n_tokens - t0 : g_max;
    ws.small_max = small_max_of(a, g);
    const bool grid = n_cap > ws.small_max;  // some token may need the grid selection
    // the grid selection's histograms, lists and counters start at zero (the one-CTA selection needs none)
    cudaError_t err = grid ? cudaMemsetAsync(w + l.zero, 0, l.zero_bytes, stream) : cudaSuccess;
    if (err != cudaSuccess) return err;
    if (n_cap > 0) {
      err = launch_score(a, ws, t0, g, stream);
      if (err != cudaSuccess) return err;
    }
    if (grid) {
      err = launch_select(a, ws, t0, g, stream);
      if (err != cudaSuccess) return err;
    }
    if (ws.small_max > 0) {
      err = launch_small_select(a, ws, t0, g, stream);
      if (err != cudaSuccess) return err;
    }
  }
  return cudaSuccess;
}

}  // namespace dsv4rt
