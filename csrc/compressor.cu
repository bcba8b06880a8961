// KV compressor family (ops/compressor.py): store a step's (kv, score + ape) rows and emit the entry of every
// window that closes in the step. One launch per compressor per step, decode and prefill chunks alike.
// Overlap compressors (CSA main and indexer: buffered state rows) run the general kernel (below); the no-overlap
// compressor (HCA: the open window as an online softmax state) runs compressor_online_kernel ("no overlap"
// section) and, in long calls, compressor_bulk_kernel behind it for the windows that read no state ("the bulk grid"
// section). The general kernel is written for any c; since the online state, the launcher sends it overlap calls
// only, and overlap calls of kWindowsMinTokens tokens or more (prefill chunks) take the windows path instead (a
// grid that pools every entry at once, then a grid that writes the state: "the windows path" section).
//
// Grid (from the shapes only): the tokens are cut into chunks of consecutive tokens; a cluster of K CTAs takes one
// chunk, CTA k the channel slice [k*d/K, (k+1)*d/K) (of both halves with overlap). In a CTA:
//   * the chunk's metadata is loaded at once (a token per thread) and sorted into closing and row-writing tokens
//     (most tokens of a prefill chunk do neither);
//   * the row-writing tokens' rows are copied by the whole CTA at once (nobody reads those rows in this step);
//   * closing tokens are taken one after another. Pooling runs on threads (quad, group): the 4 channels of `quad`,
//     slots j = group, group + G, ... (per-channel fp32 softmax: a batch of kBatch slots is loaded at once and
//     reduced exactly; batches merge as an online softmax, groups in a tree through shared memory). Then the first
//     `quads` threads (one quad each) cast to the activation dtype, RMS-norm (sum of squares over the CTA, then
//     over the cluster), RoPE, quantise and store the entry's slice. With several closing tokens a CTA and one
//     batch a thread, the slots of the next two closing tokens are copied to shared memory (cp.async, each thread
//     its own slots) while the current one is reduced and post-processed.
// A chunk of one token (decode) skips the sort: every thread loads the token's metadata. Such calls (no cluster, no
// pipeline) run the kOne instance of the kernel, with those as constants: a decode step runs its three compressors
// back to back from cold instruction caches, and the compact instance is about half the code.
// For token t (position p of request slot r; the request's tokens in this call are [s, e), contiguous in the
// batch), window w = [w*m, (w+1)*m), w0 = s / m the window open when the call starts, open_end = (e / m) * m:
//   * if t closes window w, pool its slots, cast, RMS-norm, RoPE at position w*m, quantise, and write the entry
//     through the block table;
//   * if p >= open_end, t is a new open token: its (kv, score + ape) row goes to open row p mod m.
// The reference gathers everything from the pre-step state before writing any state. Here, within one kernel:
//   * only the closers of w0 and (overlap) w0+1 read the state: the overlap rows (window w0-1, A halves) and the
//     open rows of positions [w0*m, s);
//   * so the CTAs that close w0 (the request's "owner") also compute entry w0+1, and after a barrier write the
//     state those reads depend on: the overlap rows (the last closed window's full rows) and the open rows that
//     the step's new open tokens put over rows of [w0*m, s). Every CTA reads and writes only its own channel
//     columns, so that barrier is the CTA's. When the owner's last entry is the last closed window (decode), the
//     overlap rows are copied inside its pooling, in the same load round: the thread that read an old overlap
//     row's columns writes the new row's, so no barrier is needed;
//   * every other new open token writes its own row: nobody reads that row in this step.
// A request with no closing window reads no state, and each of its tokens writes its own open row.
// A call's grids after its first are launched with programmatic stream serialization (the first is a plain launch:
// pdl_first); every kernel lets the next launch on the stream be scheduled while it runs, and waits for the
// previous grid's completion (griddepcontrol.wait) before it touches memory.
#include <cmath>
#include <cstdlib>
#include <type_traits>

#include "compressor.h"
#include "async_copy.cuh"
#include "kv_quant.cuh"
#include "launch.cuh"

namespace dsv4rt {
namespace {

constexpr int kMaxThreads = 512;
constexpr int kMaxWarps = kMaxThreads / 32;
constexpr int kBatch = 4;       // pooled slots a thread loads before reducing them (memory-level parallelism)
constexpr int kStages = 2;      // closing tokens whose slots are in flight ahead of the current one
constexpr int kCopyUnroll = 4;  // row copies: float4 columns a thread loads before storing them
constexpr float kNegInf = -__builtin_huge_valf();

__device__ __forceinline__ int floor_div(int a, int b) {
  const int q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

__device__ __forceinline__ int mod_pos(int a, int b) { return a - floor_div(a, b) * b; }

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void st4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }

__device__ __forceinline__ float4 add4(float4 a, float4 b) {
  return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z), __fadd_rn(a.w, b.w));
}

__device__ __forceinline__ float comp(const float4& v, int k) {
  return k == 0 ? v.x : (k == 1 ? v.y : (k == 2 ? v.z : v.w));
}

// e^(x - mx) of a softmax term (x <= mx, or x = -inf: 0) as 2^((x - mx) log2 e) on the MUFU: ex2.approx is within
// 2 ulp, and the product's rounding moves the result by about |x - mx| * 6e-8 relative, which matters only for
// terms of weight e^(x - mx) far below the pooling's 1e-6 tolerance. Three instructions where expf takes ten; the
// pooling runs one per slot and channel, which made it the largest part of a prefill entry's instructions.
// Results below 2^-126 flush to zero (ftz): such a term adds nothing next to the batch maximum's 1.
__device__ __forceinline__ float exp_sub(float x, float mx) {
  return fast_exp2(__fmul_rn(__fsub_rn(x, mx), 1.4426950408889634f));  // kv_quant.cuh
}


template <typename T>
__device__ __forceinline__ void store4(T* p, const float (&v)[4]);
template <>
__device__ __forceinline__ void store4<float>(float* p, const float (&v)[4]) {
  st4(p, make_float4(v[0], v[1], v[2], v[3]));
}
template <>
__device__ __forceinline__ void store4<__nv_bfloat16>(__nv_bfloat16* p, const float (&v)[4]) {
  __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]), hi = __floats2bfloat162_rn(v[2], v[3]);
  uint2 u;
  u.x = *reinterpret_cast<unsigned*>(&lo);
  u.y = *reinterpret_cast<unsigned*>(&hi);
  *reinterpret_cast<uint2*>(p) = u;
}
template <>
__device__ __forceinline__ void store4<__half>(__half* p, const float (&v)[4]) {
  __half2 lo = __floats2half2_rn(v[0], v[1]), hi = __floats2half2_rn(v[2], v[3]);
  uint2 u;
  u.x = *reinterpret_cast<unsigned*>(&lo);
  u.y = *reinterpret_cast<unsigned*>(&hi);
  *reinterpret_cast<uint2*>(p) = u;
}

// The thread's place in the CTA.
struct Ctx {
  int K, rank;    // CTAs per chunk, this CTA's rank
  int dk, ch0;    // channel slice [ch0, ch0 + dk)
  int quads, G;   // threads per slot group (4 channels each), slot groups
  int g_half;     // first step of the group tree: pow2ceil(G) / 2
  int n_pool;     // slots of an entry: c * m
  int tid, quad, g, col, post_warps;
  bool pools;     // g < G: pools slots of its quad
  bool post;      // tid < quads: post-processes its quad of every entry
};

// Shared memory of a CTA.
struct Shared {
  float4* stage;  // [kStages][kBatch][2][threads]: (kv, score) of the slots of closing tokens in flight
  float4* part;   // [3][G][quads]: per-group softmax partials (running max, sum of exp, sum of exp * value)
  float* red;     // [2][kMaxWarps]: per-warp sums of squares (two entries in flight), then [2]: the CTA's, for the
                  // cluster (and 2 floats of padding: `had` is read as float4)
  float* had;     // [d]: FP4 Hadamard butterflies across warps (d > 128)
  int* meta;      // [4][chunk]: slot, position, start, end of the chunk's tokens
  int* list;      // [2][chunk]: closing tokens, then row-writing tokens (chunk-local indices)
  int* counts;    // [2][kMaxWarps]
};

__host__ __device__ inline int had_floats(bool fp4, int quads) { return fp4 && quads > 32 ? 4 * quads : 0; }

__host__ __device__ inline size_t stage_float4s(bool pipe, int threads) {
  return pipe ? static_cast<size_t>(kStages) * kBatch * 2 * threads : 0;
}

__host__ __device__ inline size_t smem_bytes(bool pipe, int threads, int groups, int quads, int chunk, int had) {
  const size_t f4 = stage_float4s(pipe, threads) + (groups > 1 ? static_cast<size_t>(3) * groups * quads : 0);
  return sizeof(float4) * f4 + sizeof(float) * (2 * kMaxWarps + 4 + had) + sizeof(int) * (6 * chunk + 2 * kMaxWarps);
}

__device__ __forceinline__ Shared carve(float4* base, const Ctx& x, bool pipe, int chunk, int had) {
  Shared sh;
  sh.stage = base;
  sh.part = base + stage_float4s(pipe, blockDim.x);
  sh.red = reinterpret_cast<float*>(sh.part + (x.G > 1 ? 3 * x.G * x.quads : 0));
  sh.had = sh.red + 2 * kMaxWarps + 4;
  sh.meta = reinterpret_cast<int*>(sh.had + had);
  sh.list = sh.meta + 4 * chunk;
  sh.counts = sh.list + 2 * chunk;
  return sh;
}

__device__ __forceinline__ float4* stage_at(const Shared& sh, int buf, int u, int h) {
  return sh.stage + ((buf * kBatch + u) * 2 + h) * static_cast<int>(blockDim.x) + threadIdx.x;
}

struct Tok {
  int64_t t;  // row of kv/score
  int r, p, s, e;
  int open_start;  // (s / m) * m
};

// Token t's step metadata: request slot, position, the request's bounds in the call; r = -1 past the call's tokens.
struct Meta {
  int r, p, s, e;
};

__device__ __forceinline__ Meta token_meta(const CompressorArgs& a, int64_t t) {
  Meta mt{-1, 0, 0, 0};
  if (t < a.n_tokens) mt = {a.req_slot[t], a.positions[t], a.start_pos[t], a.end_pos[t]};
  return mt;
}

__device__ __forceinline__ Tok chunk_token(const CompressorArgs& a, const Shared& sh, int64_t t0, int chunk, int lt) {
  Tok tk;
  tk.t = t0 + lt;
  tk.r = sh.meta[lt];
  tk.p = sh.meta[chunk + lt];
  tk.s = sh.meta[2 * chunk + lt];
  tk.e = sh.meta[3 * chunk + lt];
  tk.open_start = floor_div(tk.s, a.ratio) * a.ratio;
  return tk;
}

// Row of position q (qm = q mod m) of the token's request: this call's kv/score rows when q >= s (`fresh`: their
// score gets ape[qm] added), else the state. `off` is the row's first element in kv/score or kv_state/score_state.
struct RowRef {
  int64_t off;
  bool fresh;
};

__device__ __forceinline__ RowRef row_ref(const CompressorArgs& a, const Tok& tk, int q, int qm) {
  const int64_t cw = static_cast<int64_t>(a.c) * a.d;
  if (q >= tk.s) return {(tk.t + (q - tk.p)) * cw, true};
  const int srow = q >= tk.open_start ? (a.c - 1) * a.ratio + qm : qm;
  return {(static_cast<int64_t>(tk.r) * a.c * a.ratio + srow) * cw, false};
}

// Columns [col, col + 4) of that row: kv, and score (+ ape), in two steps: issue_pair loads (kv, score and, for
// this call's rows, the ape row), done_pair adds the ape term. A batch issues every load before its first add: an
// add right behind its load (a use inside the load's branch) made the next rows' loads wait for it, one memory
// latency a row.
struct Pend {
  float4 v, s, ap;
  bool fresh;
};

__device__ __forceinline__ Pend no_pair() {
  const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  return {z, z, z, false};
}

__device__ __forceinline__ Pend issue_pair(const CompressorArgs& a, const RowRef& rr, int qm, int col) {
  const int64_t cw = static_cast<int64_t>(a.c) * a.d;
  Pend p;
  p.fresh = rr.fresh;
  p.v = ld4((rr.fresh ? a.kv : a.kv_state) + rr.off + col);
  p.s = ld4((rr.fresh ? a.score : a.score_state) + rr.off + col);
  p.ap = rr.fresh ? ld4(a.ape + qm * cw + col) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  return p;
}

__device__ __forceinline__ void done_pair(const Pend& p, float4& v, float4& s) {
  v = p.v;
  s = p.fresh ? add4(p.s, p.ap) : p.s;
}

// Slot j of the entry of window w (j < c*m) reads position (w - c + 1) * m + j: its position mod m and its column
// offset (with overlap: A half of window w - 1, B half of window w) need no division.
__device__ __forceinline__ int slot_qm(int j, int m) { return j >= m ? j - m : j; }
__device__ __forceinline__ int slot_half(const CompressorArgs& a, int j) { return a.c == 2 && j >= a.ratio ? a.d : 0; }

// Per-channel softmax partial of a thread's 4 channels: running max, sum of exp, sum of exp * value.
struct Pool {
  float mx[4], z[4], acc[4];
  __device__ __forceinline__ void init() {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      mx[k] = kNegInf;
      z[k] = 0.0f;
      acc[k] = 0.0f;
    }
  }
};

// (m1, z1, a1) <- merged with (m2, z2, a2): one exp, the larger max stays.
__device__ __forceinline__ void merge_into(float& m1, float& z1, float& a1, float m2, float z2, float a2) {
  if (m2 == kNegInf) return;
  if (m1 == kNegInf) {
    m1 = m2;
    z1 = z2;
    a1 = a2;
  } else if (m1 >= m2) {
    const float f = exp_sub(m2, m1);
    z1 = __fmaf_rn(z2, f, z1);
    a1 = __fmaf_rn(a2, f, a1);
  } else {
    const float f = exp_sub(m1, m2);
    z1 = __fmaf_rn(z1, f, z2);
    a1 = __fmaf_rn(a1, f, a2);
    m1 = m2;
  }
}

// A batch of slots (ok[u]: the slot exists): exact softmax over the batch, merged into the partial.
template <int N>
__device__ __forceinline__ void reduce_batch(const float4 (&v)[N], const float4 (&s)[N], const bool (&ok)[N],
                                             Pool& ps) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float bm = kNegInf;
#pragma unroll
    for (int u = 0; u < N; ++u)
      if (ok[u]) bm = fmaxf(bm, comp(s[u], k));
    if (bm > kNegInf) {
      float bz = 0.0f, ba = 0.0f;
#pragma unroll
      for (int u = 0; u < N; ++u) {
        if (ok[u]) {
          const float e = exp_sub(comp(s[u], k), bm);
          bz = __fadd_rn(bz, e);
          ba = __fmaf_rn(e, comp(v[u], k), ba);
        }
      }
      merge_into(ps.mx[k], ps.z[k], ps.acc[k], bm, bz, ba);
    }
  }
}

// Pooling from registers: slots j = g, g + G, ... in batches of N (one load round a batch).
template <int N>
__device__ void pool_regs(const CompressorArgs& a, const Ctx& x, const Tok& tk, int w, Pool& ps) {
  const int m = a.ratio, wbase = (w - a.c + 1) * m;
  for (int jb = x.g; jb < x.n_pool; jb += N * x.G) {
    float4 v[N], s[N];
    Pend pd[N];
    bool ok[N];
#pragma unroll
    for (int u = 0; u < N; ++u) {
      const int j = jb + u * x.G, q = wbase + j;
      ok[u] = j < x.n_pool && q >= 0;  // q < 0: window -1 of the first entry, weight 0
      pd[u] = no_pair();
      if (ok[u]) {
        const int qm = slot_qm(j, m);
        pd[u] = issue_pair(a, row_ref(a, tk, q, qm), qm, slot_half(a, j) + x.col);
      }
    }
#pragma unroll
    for (int u = 0; u < N; ++u) done_pair(pd[u], v[u], s[u]);
    reduce_batch(v, s, ok, ps);
  }
}

// The slots of a closing token's entry w (one batch a thread) to this thread's stage `buf`, asynchronously. Every
// thread commits one group per call (maybe empty), so the waits count the same everywhere.
__device__ void prefetch_entry(const CompressorArgs& a, const Ctx& x, const Shared& sh, const Tok& tk, int w,
                               int buf) {
  if (x.pools) {
    const int m = a.ratio, wbase = (w - a.c + 1) * m;
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int j = x.g + u * x.G, q = wbase + j;
      if (j < x.n_pool && q >= 0) {
        const RowRef rr = row_ref(a, tk, q, slot_qm(j, m));
        const int64_t off = rr.off + slot_half(a, j) + x.col;
        cp_async16(stage_at(sh, buf, u, 0), (rr.fresh ? a.kv : a.kv_state) + off);
        cp_async16(stage_at(sh, buf, u, 1), (rr.fresh ? a.score : a.score_state) + off);
      }
    }
  }
  cp_async_commit();
}

// Pooling from the stage (after its group's wait); `ape` holds ape[slot mod m] of the thread's slots.
__device__ __forceinline__ void pool_staged(const CompressorArgs& a, const Ctx& x, const Shared& sh, const Tok& tk,
                                            int w, int buf, const float4 (&ape)[kBatch], Pool& ps) {
  const int wbase = (w - a.c + 1) * a.ratio;
  float4 v[kBatch], s[kBatch];
  bool ok[kBatch];
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    const int j = x.g + u * x.G, q = wbase + j;
    ok[u] = j < x.n_pool && q >= 0;
    v[u] = s[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (ok[u]) {
      v[u] = *stage_at(sh, buf, u, 0);
      s[u] = *stage_at(sh, buf, u, 1);
      if (q >= tk.s) s[u] = add4(s[u], ape[u]);
    }
  }
  reduce_batch(v, s, ok, ps);
}

// Pooling of the owner whose entry w is the last closed window, with its overlap-row copy (c == 2, G == m): slots g
// (A half of window w-1) and m + g (B half of window w), and window w's row g goes to overlap row g, in one load
// round. This thread read overlap row g's old columns (slot g, here or in the owner's first entry), so its stores
// need no barrier.
__device__ __forceinline__ void pool_fused(const CompressorArgs& a, const Ctx& x, const Tok& tk, int w, Pool& ps) {
  const int m = a.ratio, d = a.d;
  const int64_t cw = 2 * static_cast<int64_t>(d);
  const int q0 = (w - 1) * m + x.g;
  const bool ok0 = q0 >= 0;  // window -1 of the first entry: weight 0
  float4 v0, s0, v1, s1, fk, fs;
  const Pend p0 = ok0 ? issue_pair(a, row_ref(a, tk, q0, x.g), x.g, x.col) : no_pair();
  const RowRef rr = row_ref(a, tk, w * m + x.g, x.g);
  const Pend p1 = issue_pair(a, rr, x.g, d + x.col), pf = issue_pair(a, rr, x.g, x.col);
  done_pair(p0, v0, s0);
  done_pair(p1, v1, s1);
  done_pair(pf, fk, fs);
  const int64_t row = (static_cast<int64_t>(tk.r) * 2 * m + x.g) * cw;
  st4(a.kv_state + row + x.col, fk);
  st4(a.kv_state + row + d + x.col, v1);
  st4(a.score_state + row + x.col, fs);
  st4(a.score_state + row + d + x.col, s1);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float sa = comp(s0, k), sb = comp(s1, k);
    const float bm = ok0 ? fmaxf(sa, sb) : sb;
    const float eb = exp_sub(sb, bm);
    if (ok0) {
      const float ea = exp_sub(sa, bm);
      ps.z[k] = __fadd_rn(ea, eb);
      ps.acc[k] = __fmaf_rn(eb, comp(v1, k), __fmul_rn(ea, comp(v0, k)));
    } else {
      ps.z[k] = eb;
      ps.acc[k] = __fmul_rn(eb, comp(v1, k));
    }
    ps.mx[k] = bm;
  }
}

// Constants of the thread's quad when it post-processes entries.
struct Consts {
  float nw[4];  // norm weight
  float fr[2];  // rope frequencies of its two channel pairs (rope quads)
};

// The thread's place in a CTA that takes a channel slice of a.d / a.cluster channels (cluster rank = slice) with
// a.groups slot groups (the general and bulk kernels).
__device__ __forceinline__ Ctx slice_ctx(const CompressorArgs& a, bool one_cta = false) {
  Ctx x;
  x.K = one_cta ? 1 : a.cluster;
  x.rank = x.K > 1 ? static_cast<int>(cluster_rank()) : 0;
  x.dk = a.d / x.K;
  x.ch0 = x.rank * x.dk;
  x.quads = x.dk / 4;
  x.G = a.groups;
  x.g_half = 1;
  while (2 * x.g_half < x.G) x.g_half *= 2;
  x.n_pool = a.c * a.ratio;
  x.tid = threadIdx.x;
  x.quad = x.tid % x.quads;
  x.g = x.tid / x.quads;
  x.col = x.ch0 + 4 * x.quad;
  x.pools = x.g < x.G;
  x.post = x.tid < x.quads;
  x.post_warps = (x.quads + 31) / 32;
  return x;
}

// The post-processing constants of the thread's quad (post threads; weights, complete before any grid of the step).
__device__ __forceinline__ Consts load_consts(const CompressorArgs& a, const Ctx& x) {
  Consts cs = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f}};
  const int nope = a.d - a.rope_dim;
  if (x.post) {
#pragma unroll
    for (int k = 0; k < 4; ++k) cs.nw[k] = a.norm_weight[x.col + k];
    if (x.col >= nope) {
      cs.fr[0] = a.inv_freq[(x.col - nope) / 2];
      cs.fr[1] = a.inv_freq[(x.col - nope) / 2 + 1];
    }
  }
  return cs;
}

// RoPE rotation of the quad's two channel pairs at the window's first position (rope quads), computed before the
// pooling so that it runs while the slots load.
struct Rot {
  float cs[2], sn[2];
};

__device__ __forceinline__ Rot rope_rot(const CompressorArgs& a, const Ctx& x, const Consts& cs, int w) {
  Rot rt = {{1.0f, 1.0f}, {0.0f, 0.0f}};
  if (x.post && x.col >= a.d - a.rope_dim) {
    const float pos = static_cast<float>(static_cast<int64_t>(w) * a.ratio);
#pragma unroll
    for (int pr = 0; pr < 2; ++pr) {
      sincosf(__fmul_rn(pos, cs.fr[pr]), &rt.sn[pr], &rt.cs[pr]);  // one argument reduction for both
    }
  }
  return rt;
}

// x / 2^k as a product: the same single rounding as the division (2^-k is a normal float for k < 127).
__device__ __forceinline__ float div_pow2(float x, int k) {
  return k < 127 ? __fmul_rn(x, exp2_int(-k)) : __fdiv_rn(x, exp2_int(k));
}

// Destination of entry w through the block table (w clamped as the reference does); loaded before the pooling.
struct Dest {
  int64_t blk;
  int in_block;
};

__device__ __forceinline__ Dest entry_dest(const CompressorArgs& a, const Ctx& x, const Tok& tk, int w,
                                           bool l2_only = false) {
  const int n_entries = static_cast<int>(a.bt_cols * a.per_block), per_block = static_cast<int>(a.per_block);
  const int wc = w < 0 ? 0 : (w >= n_entries ? n_entries - 1 : w);
  const int col = wc / per_block;
  Dest dst{-1, wc - col * per_block};
  const int32_t* at = a.block_table + static_cast<int64_t>(tk.r) * a.bt_stride + col;
  if (x.post) dst.blk = l2_only ? __ldcg(at) : *at;
  return dst;
}

// The quad's pooled channels cast to the activation dtype (0 off the post threads); returns the warp's sum of their
// squares.
template <typename OutT>
__device__ __forceinline__ float cast_pooled(const Ctx& x, const Pool& ps, float (&val)[4]) {
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    val[k] = x.post ? round_to<OutT>(__fdividef(ps.acc[k], ps.z[k])) : 0.0f;  // 2 ulp; z >= 1 (the max's term)
    ss = __fmaf_rn(val[k], val[k], ss);
  }
  return warp_sum(ss);
}

template <typename OutT, int QUANT>
__device__ void store_entry(const CompressorArgs& a, const Ctx& x, float* had, const Consts& cs, const Rot& rt,
                            const Dest& dst, float (&val)[4], float tot);

// The groups' partials merged (a tree through shared memory, fixed order), then: cast, RMS-norm, RoPE, quantise
// and store this CTA's slice of entry w. Every thread of the CTA calls it (barriers, warp shuffles).
template <typename OutT, int QUANT>
__device__ void finish_entry(const CompressorArgs& a, const Ctx& x, const Shared& sh, const Consts& cs,
                             const Rot& rt, const Dest& dst, Pool& ps, int round) {
  if (x.G > 1) {
    float4* pm = sh.part;
    float4* pz = sh.part + x.G * x.quads;
    float4* pa = sh.part + 2 * x.G * x.quads;
    const int mine = x.g * x.quads + x.quad;
    if (x.pools) {
      pm[mine] = make_float4(ps.mx[0], ps.mx[1], ps.mx[2], ps.mx[3]);
      pz[mine] = make_float4(ps.z[0], ps.z[1], ps.z[2], ps.z[3]);
      pa[mine] = make_float4(ps.acc[0], ps.acc[1], ps.acc[2], ps.acc[3]);
    }
    for (int half = x.g_half; half >= 1; half >>= 1) {
      __syncthreads();
      if (x.pools && x.g < half && x.g + half < x.G) {
        const int o = mine + half * x.quads;
        const float4 m2 = pm[o], z2 = pz[o], a2 = pa[o];
#pragma unroll
        for (int k = 0; k < 4; ++k) merge_into(ps.mx[k], ps.z[k], ps.acc[k], comp(m2, k), comp(z2, k), comp(a2, k));
        if (half > 1) {
          pm[mine] = make_float4(ps.mx[0], ps.mx[1], ps.mx[2], ps.mx[3]);
          pz[mine] = make_float4(ps.z[0], ps.z[1], ps.z[2], ps.z[3]);
          pa[mine] = make_float4(ps.acc[0], ps.acc[1], ps.acc[2], ps.acc[3]);
        }
      }
    }
  }

  // --- cast to the activation dtype, sum of squares over the CTA, then the cluster (fixed order)
  float val[4];
  const float ss = cast_pooled<OutT>(x, ps, val);
  const int lane = x.tid & 31, warp = x.tid >> 5, buf = round & 1;
  if (lane == 0 && warp < x.post_warps) sh.red[buf * kMaxWarps + warp] = ss;
  __syncthreads();
  float tot = 0.0f;
  for (int i = 0; i < x.post_warps; ++i) tot = __fadd_rn(tot, sh.red[buf * kMaxWarps + i]);
  if (x.K > 1) {
    float* mine = sh.red + 2 * kMaxWarps + buf;
    if (x.tid == 0) *mine = tot;
    cluster_sync();
    tot = 0.0f;
    for (int rr = 0; rr < x.K; ++rr) tot = __fadd_rn(tot, *cluster_map(mine, rr));
  }

  store_entry<OutT, QUANT>(a, x, sh.had, cs, rt, dst, val, tot);
}

// The post-processing of this CTA's slice of an entry from the post threads' cast pooled values `val` and the
// entry's sum of squares `tot`: RMS-norm, RoPE, quantise, store. Every thread of the CTA calls it (FP4 with more
// than 32 quads: barriers around `had`).
template <typename OutT, int QUANT>
__device__ void store_entry(const CompressorArgs& a, const Ctx& x, float* had, const Consts& cs, const Rot& rt,
                            const Dest& dst, float (&val)[4], float tot) {
  const int d = a.d, col = x.col;
  // --- RMSNorm (fp32, weight after the normalisation, as the reference), cast; RoPE at the window's first
  // position on the last rope_dim channels (interleaved pairs), cast
  const float rs = rsqrtf(__fadd_rn(__fdiv_rn(tot, static_cast<float>(d)), a.eps));
#pragma unroll
  for (int k = 0; k < 4; ++k) val[k] = round_to<OutT>(__fmul_rn(cs.nw[k], __fmul_rn(val[k], rs)));
  const int nope = d - a.rope_dim;
  if (x.post && col >= nope) {
#pragma unroll
    for (int pr = 0; pr < 2; ++pr) {
      const float cn = rt.cs[pr], sn = rt.sn[pr];
      const float x0 = val[2 * pr], x1 = val[2 * pr + 1];
      val[2 * pr] = round_to<OutT>(__fsub_rn(__fmul_rn(x0, cn), __fmul_rn(x1, sn)));
      val[2 * pr + 1] = round_to<OutT>(__fadd_rn(__fmul_rn(x1, cn), __fmul_rn(x0, sn)));
    }
  }

  // --- quantise, store
  const bool store = x.post && dst.blk >= 0 && dst.blk < a.n_blocks;  // else nothing is stored
  const int64_t dst_row = store ? dst.blk * a.per_block + dst.in_block : 0;
  if constexpr (QUANT == kQuantNone) {
    if (store) store4<OutT>(static_cast<OutT*>(a.entry_cache) + dst_row * a.row + col, val);
  } else if constexpr (QUANT == kQuantFp8 || QUANT == kQuantFp8Sim) {
    // blocks of 64 channels = 16 quads = half a warp (slices hold whole blocks: the launcher picks K so)
    float am = fmaxf(fmaxf(fabsf(val[0]), fabsf(val[1])), fmaxf(fabsf(val[2]), fabsf(val[3])));
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, o));
    if (store) {
      if (col < nope) {
        const int e8 = pow2_scale_exp(am, kFp8AmaxFloor, kFp8InvMax);
        const float scale = exp2_int(e8);
        uint8_t q[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {  // fp8_encode with the division by the power of two as a product
          const float y = fminf(fmaxf(div_pow2(val[k], e8), -kFp8Max), kFp8Max);
          q[k] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3));
        }
        if constexpr (QUANT == kQuantFp8) {
          uint8_t* out = static_cast<uint8_t*>(a.entry_cache) + dst_row * a.row;
          *reinterpret_cast<uint32_t*>(out + col) = static_cast<uint32_t>(q[0]) | (static_cast<uint32_t>(q[1]) << 8) |
                                                    (static_cast<uint32_t>(q[2]) << 16) |
                                                    (static_cast<uint32_t>(q[3]) << 24);
          if ((x.quad & 15) == 0) out[nope + 2 * a.rope_dim + col / kFp8Block] = static_cast<uint8_t>(e8 + 127);
        } else {
          float o[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) o[k] = __fmul_rn(fp8_decode(q[k]), scale);
          store4<OutT>(static_cast<OutT*>(a.entry_cache) + dst_row * a.row + col, o);
        }
      } else {
        if constexpr (QUANT == kQuantFp8) {
          // whole 32-bit stores of bf16 pairs (storing the bytes of a bf16 separately wrote wrong low bytes on an
          // H200, nvcc 13.0, sm_90a)
          uint8_t* out = static_cast<uint8_t*>(a.entry_cache) + dst_row * a.row + nope + 2 * (col - nope);
          __nv_bfloat162 lo = __floats2bfloat162_rn(val[0], val[1]), hi = __floats2bfloat162_rn(val[2], val[3]);
          reinterpret_cast<uint32_t*>(out)[0] = *reinterpret_cast<uint32_t*>(&lo);
          reinterpret_cast<uint32_t*>(out)[1] = *reinterpret_cast<uint32_t*>(&hi);
        } else {
          float o[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) o[k] = round_to<__nv_bfloat16>(val[k]);
          store4<OutT>(static_cast<OutT*>(a.entry_cache) + dst_row * a.row + col, o);
        }
      }
      if constexpr (QUANT == kQuantFp8) {
        if (x.rank == 0 && x.quad == 0) {  // the row's padding bytes
          uint8_t* out = static_cast<uint8_t*>(a.entry_cache) + dst_row * a.row;
          for (int64_t i = nope + 2 * a.rope_dim + nope / kFp8Block; i < a.row; ++i) out[i] = 0;
        }
      }
    }
  } else {  // FP4 formats (whole rows: K == 1): normalised Walsh-Hadamard (Sylvester order, the reference's
            // butterflies), then e2m1 in blocks of 32 channels = 8 quads
    {
      const float t0 = __fadd_rn(val[0], val[1]), t1 = __fsub_rn(val[0], val[1]);
      const float t2 = __fadd_rn(val[2], val[3]), t3 = __fsub_rn(val[2], val[3]);
      val[0] = __fadd_rn(t0, t2);
      val[1] = __fadd_rn(t1, t3);
      val[2] = __fsub_rn(t0, t2);
      val[3] = __fsub_rn(t1, t3);
    }
    for (int hq = 1; hq < x.quads; hq <<= 1) {  // h = 4 * hq: the partner quad is quad ^ hq
      float pv[4];
      if (hq < 32) {
#pragma unroll
        for (int k = 0; k < 4; ++k) pv[k] = __shfl_xor_sync(0xffffffffu, val[k], hq);
      } else {
        __syncthreads();  // the previous stage's reads are done
        if (x.post) st4(had + 4 * x.quad, make_float4(val[0], val[1], val[2], val[3]));
        __syncthreads();
        const float4 t = x.post ? ld4(had + 4 * (x.quad ^ hq)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        pv[0] = t.x;
        pv[1] = t.y;
        pv[2] = t.z;
        pv[3] = t.w;
      }
      const bool lower = (x.quad & hq) == 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) val[k] = lower ? __fadd_rn(val[k], pv[k]) : __fsub_rn(pv[k], val[k]);
    }
    const float hs = static_cast<float>(1.0 / sqrt(static_cast<double>(d)));
#pragma unroll
    for (int k = 0; k < 4; ++k) val[k] = __fmul_rn(val[k], hs);
    float am = fmaxf(fmaxf(fabsf(val[0]), fabsf(val[1])), fmaxf(fabsf(val[2]), fabsf(val[3])));
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, o));
    if (store) {
      const int e4 = pow2_scale_exp(am, kFp4AmaxFloor, kFp4InvMax);
      const float scale = exp2_int(e4);
      float y[4];
      uint8_t code[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        y[k] = div_pow2(val[k], e4);
        code[k] = e2m1_encode(y[k]);
      }
      if constexpr (QUANT == kQuantFp4) {
        uint8_t* out = static_cast<uint8_t*>(a.entry_cache) + dst_row * a.row;
        out[col / 2] = static_cast<uint8_t>(code[0] | (code[1] << 4));
        out[col / 2 + 1] = static_cast<uint8_t>(code[2] | (code[3] << 4));
        if ((x.quad & 7) == 0) out[d / 2 + col / kFp4Block] = static_cast<uint8_t>(e4 + 127);
      } else {
        float o[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) o[k] = __fmul_rn(copysignf(e2m1_magnitude(code[k] & 7), y[k]), scale);
        store4<OutT>(static_cast<OutT*>(a.entry_cache) + dst_row * a.row + col, o);
      }
    }
  }
}


// This CTA's columns of kv_state/score_state rows dst0 + j <- rows of positions q0 + j, j < n_rows, of the token's
// request (this call's rows get score + ape). Each thread loads kCopyUnroll float4 columns before storing them.
// Sources and destinations must not overlap.
__device__ void copy_rows(const CompressorArgs& a, const Ctx& x, const Tok& tk, int dst0, int q0, int n_rows) {
  const int m = a.ratio, c = a.c, d = a.d, ncol = c * x.quads;
  const int64_t cw = static_cast<int64_t>(c) * d;
  const int64_t base = (static_cast<int64_t>(tk.r) * c * m + dst0) * cw;
  const int items = n_rows * ncol;
  for (int i0 = x.tid; i0 < items; i0 += kCopyUnroll * blockDim.x) {
    Pend pd[kCopyUnroll];
    int64_t dst[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int idx = i0 + u * static_cast<int>(blockDim.x);
      dst[u] = -1;
      pd[u] = no_pair();
      if (idx < items) {
        const int j = idx / ncol, cc = idx - j * ncol;
        const int col = (cc / x.quads) * d + x.ch0 + 4 * (cc % x.quads);
        const int q = q0 + j, qm = mod_pos(q, m);
        pd[u] = issue_pair(a, row_ref(a, tk, q, qm), qm, col);
        dst[u] = base + j * cw + col;
      }
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      if (dst[u] >= 0) {
        float4 v, s;
        done_pair(pd[u], v, s);
        st4(a.kv_state + dst[u], v);
        st4(a.score_state + dst[u], s);
      }
    }
  }
}

// Row-writing item cc of token row t (request slot r, position mod m pm): loads columns [col, col + 4) of its kv,
// score and ape row (col: the cc-th of this CTA's 16-byte columns of the c halves); returns its open row's offset.
__device__ __forceinline__ int64_t open_row_load(const CompressorArgs& a, const Ctx& x, int64_t t, int r, int pm,
                                                 int cc, float4& v, float4& s, float4& ap) {
  const int m = a.ratio, c = a.c, d = a.d;
  const int64_t cw = static_cast<int64_t>(c) * d;
  const int col = (cc / x.quads) * d + x.ch0 + 4 * (cc % x.quads);
  const int64_t src = t * cw + col;
  v = ld4(a.kv + src);
  s = ld4(a.score + src);
  ap = ld4(a.ape + pm * cw + col);
  return (static_cast<int64_t>(r) * c * m + (c - 1) * m + pm) * cw + col;
}

// The loaded items to their open rows (dst < 0: none), the score + ape adds after every load went out (see
// issue_pair).
__device__ __forceinline__ void open_rows_store(const CompressorArgs& a, const int64_t (&dst)[kCopyUnroll],
                                                const float4 (&v)[kCopyUnroll], const float4 (&s)[kCopyUnroll],
                                                const float4 (&ap)[kCopyUnroll]) {
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u) {
    if (dst[u] >= 0) {
      st4(a.kv_state + dst[u], v[u]);
      st4(a.score_state + dst[u], add4(s[u], ap[u]));
    }
  }
}

// The chunk's row-writing tokens: (kv, score + ape) rows to open row p mod m, this CTA's columns, all at once.
__device__ void write_rows(const CompressorArgs& a, const Ctx& x, const Shared& sh, int64_t t0, int chunk, int n_row) {
  const int m = a.ratio, ncol = a.c * x.quads;
  const int items = n_row * ncol;
  for (int i0 = x.tid; i0 < items; i0 += kCopyUnroll * blockDim.x) {
    float4 v[kCopyUnroll], s[kCopyUnroll], ap[kCopyUnroll];
    int64_t dst[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int idx = i0 + u * static_cast<int>(blockDim.x);
      dst[u] = -1;
      if (idx < items) {
        const int k = idx / ncol, lt = sh.list[chunk + k];
        dst[u] = open_row_load(a, x, t0 + lt, sh.meta[lt], mod_pos(sh.meta[chunk + lt], m), idx - k * ncol, v[u],
                               s[u], ap[u]);
      }
    }
    open_rows_store(a, dst, v, s, ap);
  }
}

// The same for a chunk of one token, whose metadata every thread holds (no shared-memory lists).
__device__ void write_row_one(const CompressorArgs& a, const Ctx& x, int64_t t, int r, int p) {
  const int items = a.c * x.quads, pm = mod_pos(p, a.ratio);
  for (int i0 = x.tid; i0 < items; i0 += kCopyUnroll * blockDim.x) {
    float4 v[kCopyUnroll], s[kCopyUnroll], ap[kCopyUnroll];
    int64_t dst[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int idx = i0 + u * static_cast<int>(blockDim.x);
      dst[u] = idx < items ? open_row_load(a, x, t, r, pm, idx, v[u], s[u], ap[u]) : -1;
    }
    open_rows_store(a, dst, v, s, ap);
  }
}

// What the token must do in this kernel (see the file comment): nothing (most tokens of a prefill chunk), write its
// own open row (kWriteRow), or close a window (kClose: an entry, and the owner's state writes).
enum Work : int { kNone = 0, kWriteRow = 1, kClose = 2 };

__device__ __forceinline__ int token_work(const CompressorArgs& a, int p, int s, int e) {
  const int m = a.ratio, open_start = floor_div(s, m) * m, open_end = floor_div(e, m) * m;
  const bool has_close = open_end > open_start;
  if (mod_pos(p + 1, m) == 0) return (a.c == 2 && floor_div(p + 1, m) - 1 == open_start / m + 1) ? kNone : kClose;
  return (p >= open_end && !(has_close && p - open_end < s - open_start)) ? kWriteRow : kNone;
}

__device__ __forceinline__ int closed_window(const CompressorArgs& a, const Tok& tk) {
  return floor_div(tk.p + 1, a.ratio) - 1;
}

// Closing token k of the chunk: its entry (the owner: entries w0 and w0 + 1), then the owner's state writes. With
// the pipeline (`pipe`), its slots are in stage k % kStages, and closing token k + kStages is prefetched there.
template <typename OutT, int QUANT>
__device__ void process_closer(const CompressorArgs& a, const Ctx& x, const Shared& sh, const Consts& cs, int64_t t0,
                               int chunk, int k, int n_close, bool pipe, const float4 (&ape)[kBatch], int& round,
                               const Tok& one) {
  const int m = a.ratio, c = a.c;
  const Tok tk = chunk == 1 ? one : chunk_token(a, sh, t0, chunk, sh.list[k]);  // chunk 1: in registers
  const int open_end = floor_div(tk.e, m) * m;
  const int w = closed_window(a, tk);
  const int w0 = tk.open_start / m, w_last = open_end / m - 1;
  const bool owner = w == w0;  // this token closes a window, so some window of the request closes
  const bool second = owner && c == 2 && w0 + 1 <= w_last;
  const bool fused = owner && c == 2 && x.G == m && (second ? w0 + 1 == w_last : true);  // last entry is w_last

  // One loop body for the entries (w, then the owner's w0 + 1), not two copies: a CTA runs the owner's path once,
  // from cold instruction caches, so its length in code (not in instructions executed) sets its time.
  const int n_entries = second ? 2 : 1;
#pragma unroll 1
  for (int ei = 0; ei < n_entries; ++ei) {
    const int we = w + ei;  // ei == 1: w0 + 1 (the owner's w == w0)
    const bool last = ei == n_entries - 1;
    Pool ps;
    ps.init();
    const Dest dst = entry_dest(a, x, tk, we);
    const Rot rt = rope_rot(a, x, cs, we);
    if (ei == 0 && pipe) cp_async_wait<kStages - 1>();  // this closing token's group has landed
    if (x.pools) {
      if (fused && last) {
        pool_fused(a, x, tk, we, ps);
      } else if (ei == 0 && pipe) {
        pool_staged(a, x, sh, tk, we, k % kStages, ape, ps);
      } else {
        pool_regs<kBatch>(a, x, tk, we, ps);
      }
    }
    if (ei == 0 && pipe) {  // the stage is consumed: closing token k + kStages goes there
      if (k + kStages < n_close) {
        const Tok nt = chunk_token(a, sh, t0, chunk, sh.list[k + kStages]);
        prefetch_entry(a, x, sh, nt, closed_window(a, nt), k % kStages);
      } else {
        cp_async_commit();
      }
    }
    finish_entry<OutT, QUANT>(a, x, sh, cs, rt, dst, ps, round++);
  }
  if (!owner) return;

  // --- the owner's state writes: (overlap) the last closed window's rows, and the new open rows over rows of
  // [w0*m, s) (rows j < s - w0*m; the other new open tokens write their own rows, see token_work)
  const int n_new = tk.e - open_end, n_read = tk.s - tk.open_start;
  const int n_over = n_new < n_read ? n_new : n_read;
  if ((c == 2 && !fused) || n_over > 0) __syncthreads();  // this CTA's reads of the pre-step state are done
  // the copies in one loop body (see above): (overlap) the last closed window's rows to overlap rows [0, m), then the
  // new open rows over open rows [0, n_over) (after a barrier: the first copy reads open rows that it may overwrite)
  const int first = (c == 2 && !fused) ? 0 : 1;
#pragma unroll 1
  for (int ci = first; ci < (n_over > 0 ? 2 : 1); ++ci) {
    if (ci == 1 && first == 0) __syncthreads();
    copy_rows(a, x, tk, ci == 0 ? 0 : (c - 1) * m, ci == 0 ? w_last * m : open_end, ci == 0 ? m : n_over);
  }
}

// kOne: the decode instance (a token a CTA, no cluster, no pipeline) with those as constants, so that the code a
// decode step runs is compact (the three compressors of a step run back to back from cold instruction caches).
// The kernel's body for CTA `block` of the call's grid (the pair kernel runs two calls' bodies in one grid).
template <typename OutT, int QUANT, bool kOne>
__device__ __forceinline__ void update_body(const CompressorArgs& a, int64_t block) {
  pdl_launch_dependents();
  extern __shared__ float4 smem[];
  constexpr bool kFp4 = QUANT == kQuantFp4 || QUANT == kQuantFp4Sim;
  const Ctx x = slice_ctx(a, kOne);
  const int chunk = kOne ? 1 : a.chunk;
  const bool pipe = kOne ? false : a.pipe != 0;
  const Shared sh = carve(smem, x, pipe, chunk, had_floats(kFp4, x.quads));
  const int m = a.ratio;
  const int64_t cw = static_cast<int64_t>(a.c) * a.d;

  // constants of the quad's post-processing and (pipeline) the ape rows of the thread's slots: weights, complete
  // before any grid of the step, so they load while the previous grid finishes
  const Consts cs = load_consts(a, x);
  float4 ape[kBatch];
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    const int j = x.g + u * x.G;
    ape[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (pipe && x.pools && j < x.n_pool) ape[u] = ld4(a.ape + slot_qm(j, m) * cw + slot_half(a, j) + x.col);
  }
  // The chunk's metadata (step metadata, launch.cuh: loaded before the wait)
  const int64_t t0 = block / x.K * chunk;
  int n_close = 0, n_row = 0;
  Tok one{};  // chunk == 1: the token, in every thread's registers
  if (chunk == 1) {  // one token (decode): every thread loads its metadata, no lists, no barriers
    if (t0 < a.n_tokens) {
      one.t = t0;
      one.r = a.req_slot[t0];
      one.p = a.positions[t0];
      one.s = a.start_pos[t0];
      one.e = a.end_pos[t0];
    }
  } else {
    // --- the chunk's metadata (a token per thread), sorted: closing tokens, row-writing tokens (in order)
    int work = kNone;
    if (x.tid < chunk) {
      auto [r, p, s, e] = token_meta(a, t0 + x.tid);
      if (r >= 0 && r < a.n_slots) {
        work = token_work(a, p, s, e);
      } else {
        r = -1;  // a PAD token (the reference uses the spare slot), or past the call's tokens
      }
      sh.meta[x.tid] = r;
      sh.meta[chunk + x.tid] = p;
      sh.meta[2 * chunk + x.tid] = s;
      sh.meta[3 * chunk + x.tid] = e;
    }
    const int lane = x.tid & 31, warp = x.tid >> 5, meta_warps = (chunk + 31) / 32;
    const unsigned close_ballot = __ballot_sync(0xffffffffu, work == kClose);
    const unsigned row_ballot = __ballot_sync(0xffffffffu, work == kWriteRow);
    if (lane == 0 && warp < meta_warps) {
      sh.counts[warp] = __popc(close_ballot);
      sh.counts[kMaxWarps + warp] = __popc(row_ballot);
    }
    __syncthreads();
    int at_close = 0, at_row = 0;
    for (int wi = 0; wi < meta_warps; ++wi) {
      const int nc = sh.counts[wi], nr = sh.counts[kMaxWarps + wi];
      at_close += wi < warp ? nc : 0;
      at_row += wi < warp ? nr : 0;
      n_close += nc;
      n_row += nr;
    }
    const unsigned below = (1u << lane) - 1u;
    if (work == kClose) sh.list[at_close + __popc(close_ballot & below)] = x.tid;
    if (work == kWriteRow) sh.list[chunk + at_row + __popc(row_ballot & below)] = x.tid;
    __syncthreads();
  }
  pdl_wait();  // the previous grid's writes are visible
  if (chunk == 1) {
    if (t0 >= a.n_tokens) return;
    if (one.r < 0 || one.r >= a.n_slots) return;  // a PAD token (the reference uses the spare slot)
    one.open_start = floor_div(one.s, m) * m;
    const int work = token_work(a, one.p, one.s, one.e);
    if (work == kWriteRow) {  // its own open row, and nothing else (a return here also keeps the registers in bounds)
      write_row_one(a, x, one.t, one.r, one.p);
      return;
    }
    n_close = work == kClose ? 1 : 0;
  }

  // the first closing tokens' slots in flight before the row copies
  if (pipe) {
#pragma unroll
    for (int k = 0; k < kStages; ++k) {
      if (k < n_close) {
        const Tok tk = chunk_token(a, sh, t0, chunk, sh.list[k]);
        prefetch_entry(a, x, sh, tk, closed_window(a, tk), k);
      } else {
        cp_async_commit();
      }
    }
  }
  if (n_row > 0) write_rows(a, x, sh, t0, chunk, n_row);
  int round = 0;
  for (int k = 0; k < n_close; ++k)
    process_closer<OutT, QUANT>(a, x, sh, cs, t0, chunk, k, n_close, pipe, ape, round, one);
  if (pipe) cp_async_wait<0>();
  if (x.K > 1 && n_close > 0) cluster_sync();  // no CTA exits while another may still read its shared memory
}

template <typename OutT, int QUANT, bool kOne>
__global__ void __launch_bounds__(kMaxThreads) compressor_update_kernel(const __grid_constant__ CompressorArgs a) {
  update_body<OutT, QUANT, kOne>(a, blockIdx.x);
}

// Two decode calls (the CSA main and indexer compressors of one layer: a token a CTA each, no cluster, no pipeline)
// in one grid: CTAs [0, T1) run the first call's kOne body, the rest the second's, with the larger call's block
// size (the other's extra threads pool nothing and post-process nothing). The two calls touch disjoint tensors
// apart from the shared metadata, so they need no order; one grid is one launch and one wait less in the chain.
template <typename OutT, int Q1, int Q2>
__global__ void __launch_bounds__(kMaxThreads)
    compressor_pair_kernel(const __grid_constant__ CompressorArgs a1, const __grid_constant__ CompressorArgs a2) {
  if (static_cast<int64_t>(blockIdx.x) < a1.n_tokens) {
    update_body<OutT, Q1, true>(a1, blockIdx.x);
  } else {
    update_body<OutT, Q2, true>(a2, static_cast<int64_t>(blockIdx.x) - a1.n_tokens);
  }
}

// ------------------------------------------------------------------ overlap calls of many tokens: the windows path
// In a prefill chunk the general kernel's CTAs take their chunk's closing tokens one after another, so a call's time
// is a chain of dependent memory round trips. The windows path (overlap calls of at least kWindowsMinTokens tokens;
// DSV4RT_COMPRESSOR_WINDOWS=1 forces it wherever it applies, 0 turns it off) runs two grids instead:
//   * the windows grid pools every entry of the call at once. A team of d / 4 threads (a quad of channels each)
//     takes a span of m consecutive tokens and the closing tokens in it in turn (one in a prefill chunk; several
//     only when the span holds several requests' tokens): all 2m slots of the entry in one load round (the state's
//     rows for the windows w0 and w0 + 1 that began before the call, this call's rows otherwise), the exact
//     per-channel softmax, then cast, RMS-norm (the team's sum of squares), RoPE, quantise and store (store_entry,
//     as the general kernel). It writes entries only, never the state;
//   * the state grid, launched behind it, waits for it in every CTA (pdl_wait) and writes each request's state
//     from its last token: with a close, the last closed window's rows to overlap rows [0, m) and the new open rows
//     of [open_end, e) to rows [m, ...): one copy when that window is all this call's rows (the rows read are never
//     state rows), else the overlap rows first and, after a barrier (those reads may be of open rows), the open rows;
//     without a close, its rows of [s, e) to their open rows.
// The windows grid is kWinThreads threads a CTA, the state grid kStateThreads (below).
constexpr int kWinThreads = 128;
constexpr int kWinSlots = 8;  // slots a load round (2m for the CSA ratio 4: the whole entry)
constexpr int64_t kWindowsMinTokens = 1024;
constexpr int kCsaRatio = 4;  // the windows kernel's instance with the CSA shape as constants (windows_body)

// The team's place: one team of QD threads (the whole row, a quad a thread), kWinThreads / QD teams a CTA.
template <int QD>
__device__ __forceinline__ Ctx team_ctx(const CompressorArgs& a) {
  Ctx x{};
  x.K = 1;
  x.dk = a.d;
  x.quads = QD;
  x.G = 1;
  x.g_half = 1;
  x.n_pool = a.c * a.ratio;
  x.tid = static_cast<int>(threadIdx.x) % QD;
  x.quad = x.tid;
  x.col = 4 * x.quad;
  x.pools = true;
  x.post = true;
  x.post_warps = QD / 32;
  return x;
}

// All slots of entry w, kWinSlots a load round: the kv and score loads of the round first, then this call's rows get
// the ape term (rows that every team reads: L1 hits), so that only the loaded values take registers.
__device__ __forceinline__ void pool_window(const CompressorArgs& a, const Ctx& x, const Tok& tk, int w, Pool& ps) {
  const int m = a.ratio, wbase = (w - a.c + 1) * m;
  const int64_t cw = static_cast<int64_t>(a.c) * a.d;
#pragma unroll 1
  for (int jb = 0; jb < x.n_pool; jb += kWinSlots) {
    float4 v[kWinSlots], s[kWinSlots];
    bool ok[kWinSlots];
    unsigned fresh = 0u;
#pragma unroll
    for (int u = 0; u < kWinSlots; ++u) {
      const int j = jb + u, q = wbase + j;
      ok[u] = j < x.n_pool && q >= 0;  // q < 0: window -1 of the first entry, weight 0
      v[u] = s[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (ok[u]) {
        const RowRef rr = row_ref(a, tk, q, slot_qm(j, m));
        const int64_t off = rr.off + slot_half(a, j) + x.col;
        v[u] = ld4((rr.fresh ? a.kv : a.kv_state) + off);
        s[u] = ld4((rr.fresh ? a.score : a.score_state) + off);
        fresh |= rr.fresh ? 1u << u : 0u;
      }
    }
#pragma unroll
    for (int u = 0; u < kWinSlots; ++u) {
      const int j = jb + u;
      if (fresh & (1u << u)) s[u] = add4(s[u], __ldg(reinterpret_cast<const float4*>(a.ape + slot_qm(j, m) * cw +
                                                                                   slot_half(a, j) + x.col)));
    }
    reduce_batch(v, s, ok, ps);
  }
}

// The same for an interior entry (every slot a row of this call: (w - 1) * m >= s) of 2m = kWinSlots slots: the
// rows are consecutive, so one base address and constant strides, and no slot is absent (the same arithmetic as
// reduce_batch with every slot present, in fewer instructions).
__device__ __forceinline__ void pool_interior(const CompressorArgs& a, const Ctx& x, const Tok& tk, int w, Pool& ps) {
  const int m = a.ratio, d = a.d;
  const int64_t cw = 2 * static_cast<int64_t>(d);
  const int64_t base = (tk.t - tk.p + static_cast<int64_t>(w - 1) * m) * cw + x.col;
  float4 v[kWinSlots], s[kWinSlots];
#pragma unroll
  for (int u = 0; u < kWinSlots; ++u) {
    const int64_t off = base + u * cw + (u >= m ? d : 0);
    v[u] = ld4(a.kv + off);
    s[u] = ld4(a.score + off);
  }
#pragma unroll
  for (int u = 0; u < kWinSlots; ++u) {
    const int qm = u >= m ? u - m : u;
    s[u] = add4(s[u], __ldg(reinterpret_cast<const float4*>(a.ape + qm * cw + (u >= m ? d : 0) + x.col)));
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float bm = comp(s[0], k);
#pragma unroll
    for (int u = 1; u < kWinSlots; ++u) bm = fmaxf(bm, comp(s[u], k));
    float bz = 0.0f, ba = 0.0f;
#pragma unroll
    for (int u = 0; u < kWinSlots; ++u) {
      const float e = exp_sub(comp(s[u], k), bm);
      bz = __fadd_rn(bz, e);
      ba = __fmaf_rn(e, comp(v[u], k), ba);
    }
    ps.mx[k] = bm;
    ps.z[k] = bz;
    ps.acc[k] = ba;
  }
}

template <typename OutT, int QUANT, int QD, int kM>
__device__ __forceinline__ void windows_body(const CompressorArgs& args, int64_t block) {
  static_assert(QD == 32 || QD == kWinThreads, "a team is a warp or the CTA");
  // kM > 0 (the CSA shape, picked by the launcher): ratio kM, overlap and d = 4 QD as constants, so that the slots'
  // strides and offsets, the windows' arithmetic and the post-processing's loops fold (every callee is inlined)
  CompressorArgs a = args;
  if constexpr (kM > 0) {
    a.ratio = kM;
    a.c = 2;
    a.d = 4 * QD;
  }
  constexpr int kTeams = kWinThreads / QD;
  __shared__ float red[2][kWinThreads / 32];  // the team's warp sums of squares (two entries in flight)
  if (a.chain != 1) pdl_launch_dependents();  // chain 1: after the wait (see launch_windows_pair_typed)
  const int m = a.ratio, team = static_cast<int>(threadIdx.x) / QD, lane = threadIdx.x & 31;
  const Ctx x = team_ctx<QD>(a);
  const Consts cs = load_consts(a, x);  // weights: complete before any grid of the step
  const int64_t t0 = (block * kTeams + team) * m;
  // the span's metadata, lane j < m of every warp holding token t0 + j (step metadata: before the wait)
  const auto [r, p, s, e] = lane < m ? token_meta(a, t0 + lane) : Meta{-1, 0, 0, 0};
  unsigned todo = __ballot_sync(0xffffffffu, r >= 0 && r < a.n_slots && mod_pos(p + 1, m) == 0);
  if (a.chain != 2) pdl_wait();  // the previous grid's writes (this call's rows) are visible (chain 2: already)
  if (a.chain == 1) pdl_launch_dependents();
  int round = 0;
#pragma unroll 1
  while (todo != 0u) {
    const int j = __ffs(todo) - 1;
    todo &= todo - 1u;
    Tok tk;
    tk.t = t0 + j;
    tk.r = __shfl_sync(0xffffffffu, r, j);
    tk.p = __shfl_sync(0xffffffffu, p, j);
    tk.s = __shfl_sync(0xffffffffu, s, j);
    tk.e = __shfl_sync(0xffffffffu, e, j);
    tk.open_start = floor_div(tk.s, m) * m;
    const int w = closed_window(a, tk);
    const Dest dst = entry_dest(a, x, tk, w);
    const Rot rt = rope_rot(a, x, cs, w);
    Pool ps;
    ps.init();
    if (x.n_pool == kWinSlots && (w - 1) * m >= tk.s) {
      pool_interior(a, x, tk, w, ps);
    } else {
      pool_window(a, x, tk, w, ps);
    }
    float val[4];
    float tot = cast_pooled<OutT>(x, ps, val);  // the warp's sum
    if constexpr (QD > 32) {  // the team's (the CTA's): its warps' sums in order
      float* rb = red[round & 1];
      if (lane == 0) rb[x.tid >> 5] = tot;
      __syncthreads();
      tot = 0.0f;
#pragma unroll
      for (int i = 0; i < QD / 32; ++i) tot = __fadd_rn(tot, rb[i]);
    }
    store_entry<OutT, QUANT>(a, x, nullptr, cs, rt, dst, val, tot);
    ++round;
  }
  if (a.chain == 2 && blockIdx.x == 0) pdl_wait();  // complete only after the first call's windows grid
}

// 4 CTAs an SM: 128 registers a thread, no spills (H200, prefill 8,192 tokens fp8, the three: 51.3 us at 4 CTAs an
// SM, 53.9 us at 3; before exp_sub, bounds for 3, 4 or 5 timed the same)
constexpr int kWinMinBlocks = 4;

template <typename OutT, int QUANT, int QD, int kM>
__global__ void __launch_bounds__(kWinThreads, kWinMinBlocks)
    compressor_windows_kernel(const __grid_constant__ CompressorArgs a) {
  windows_body<OutT, QUANT, QD, kM>(a, blockIdx.x);
}

// The state grid's CTA `block`: tokens [block, block + 1) * kStateThreads, a token a thread, and the whole CTA on
// each request's last token in turn. 512 threads: a CSA main request's state rows after a long call (the last closed
// window's 4 rows and up to 3 open rows, both halves of kv and score) are one load round a thread (copy_rows).
constexpr int kStateThreads = 512;

__device__ __forceinline__ void state_body(const CompressorArgs& a, int64_t block) {
  __shared__ int meta[4][kStateThreads];
  __shared__ unsigned lasts[kStateThreads / 32];
  if (a.chain != 1) pdl_launch_dependents();  // chain 1: after the wait (see launch_windows_pair_typed)
  const int m = a.ratio, tid = threadIdx.x;
  const auto [r, p, s, e] = token_meta(a, block * kStateThreads + tid);
  meta[0][tid] = r;
  meta[1][tid] = p;
  meta[2][tid] = s;
  meta[3][tid] = e;
  const unsigned b = __ballot_sync(0xffffffffu, r >= 0 && r < a.n_slots && p == e - 1);
  if ((tid & 31) == 0) lasts[tid >> 5] = b;
  __syncthreads();
  if (a.chain != 2) pdl_wait();  // every CTA: the windows grid, which reads the state, is complete (chain 2: already)
  if (a.chain == 1) pdl_launch_dependents();
  Ctx x{};
  x.K = 1;
  x.dk = a.d;
  x.quads = a.d / 4;
  x.tid = tid;
#pragma unroll 1
  for (int wi = 0; wi < kStateThreads / 32; ++wi) {
    unsigned todo = lasts[wi];
#pragma unroll 1
    while (todo != 0u) {
      const int j = 32 * wi + __ffs(todo) - 1;
      todo &= todo - 1u;
      Tok tk;
      tk.t = block * kStateThreads + j;
      tk.r = meta[0][j];
      tk.p = meta[1][j];
      tk.s = meta[2][j];
      tk.e = meta[3][j];
      tk.open_start = floor_div(tk.s, m) * m;
      const int open_end = floor_div(tk.e, m) * m;
      if (open_end - m >= tk.s) {
        // the last closed window is all this call's rows: its rows and the new open rows are one run of positions
        // [open_end - m, e) whose state rows are [0, m + e - open_end), read from kv/score only, so one copy
        copy_rows(a, x, tk, 0, open_end - m, m + (tk.e - open_end));
      } else if (open_end > tk.open_start) {
        copy_rows(a, x, tk, 0, open_end - m, m);
        __syncthreads();  // the overlap rows' reads (maybe of open rows) are done
        if (tk.e > open_end) copy_rows(a, x, tk, m, open_end, tk.e - open_end);
      } else {
        copy_rows(a, x, tk, m + (tk.s - tk.open_start), tk.s, tk.e - tk.s);
      }
    }
  }
  if (a.chain == 2 && block == 0) pdl_wait();  // complete only after the first call's state grid
}

__global__ void __launch_bounds__(kStateThreads) compressor_state_kernel(const __grid_constant__ CompressorArgs a) {
  state_body(a, blockIdx.x);
}

// ------------------------------------------------------------------ launch configuration (shapes only)

// ------------------------------------------------------------------ no overlap: online softmax state (HCA)
// The state of request slot r is the open window as a per-channel online softmax (ops/compressor.py):
// score_state[r] = (M, Z) [2][d], kv_state[r] = A [d]; a channel with Z == 0 is empty. Nothing is buffered, so a
// closing token reads one state row triple instead of m rows.
// Items of a call: the tokens that close a window, and each request's owner: its token that closes the window
// w0 = s / m open when the call starts or, when w0 does not close in the call, its last token. An item pools its
// window's rows of this call (positions [max(s, w*m), p]; the owner also merges the state, which holds the
// window's rows before s); a closing item writes its entry; the owner then writes the state: the merged window if
// it does not close, else the request's new open window [e/m*m, e) pooled the same way (zeros when empty). Only
// the owner reads or writes the state, so no other CTA orders against it.
// Grid (shapes only): a cluster of R CTAs (4 in long calls) takes `chunk` consecutive tokens and runs their items one
// after another. The CTAs hold G slot groups (2 when a bulk grid runs behind, else 1) of d / 4 threads; group g of CTA
// k pools part k * G + g of R * G contiguous parts of an item's rows over the whole row (a thread: 4 channels,
// kOnlineBatch rows loaded at once, exact softmax a batch, batches merged online); the groups merge in shared memory
// in group order, the CTAs' partials go to rank 0 through distributed shared memory, merged in rank order
// (deterministic); rank 0 post-processes the entry (store_entry, whole rows in one CTA) and writes the state.
// Decode: R = G = 1 and a token a CTA, so an item is one round of loads (metadata, then the row and the state
// together) before the stores.
constexpr int kOnlineBatch = 8;
constexpr int kOnlineMaxThreads = 256;  // d <= 1024 (the binding's bound)

struct OnlineShared {
  float4* part;  // [3][threads] a CTA's partial (R > 1), and before that its slot groups' (G > 1)
  float* red;    // [kMaxWarps] per-warp sums of squares
  float* had;    // [4 * quads] FP4 Hadamard butterflies across warps
  int* meta;     // [5][chunk]: the items' chunk index, slot, position, start, end
  int* counts;   // [kMaxWarps]
};

__host__ __device__ inline size_t online_smem_bytes(int threads, int cluster, int groups, int chunk, int had) {
  return sizeof(float4) * (cluster > 1 || groups > 1 ? 3 * static_cast<size_t>(threads) : 0) +
         sizeof(float) * (kMaxWarps + had) + sizeof(int) * (5 * chunk + kMaxWarps);
}

// Part `rank` of R (contiguous, in row order) of the rows of positions [lo, hi] (this call's rows of the request
// whose token at position p is row t), merged into ps.
__device__ __forceinline__ void online_rows(const CompressorArgs& a, int col, int64_t t, int p, int lo, int hi,
                                            int rank, int R, Pool& ps) {
  const int n = hi - lo + 1;
  if (n <= 0) return;
  const int per = (n + R - 1) / R, q0 = lo + rank * per, q1 = min(hi + 1, q0 + per);
  const int64_t d = a.d;
  if (q1 - q0 == 1) {  // one row (decode): a batch of one, without the predicated slots of a full batch
    const int64_t row = (t + (q0 - p)) * d + col;
    float4 v[1] = {ld4(a.kv + row)}, sc[1] = {ld4(a.score + row)};
    const float4 ap = ld4(a.ape + mod_pos(q0, a.ratio) * d + col);
    const bool ok[1] = {true};
    sc[0] = add4(sc[0], ap);
    reduce_batch(v, sc, ok, ps);
    return;
  }
  for (int qb = q0; qb < q1; qb += kOnlineBatch) {
    float4 v[kOnlineBatch], sc[kOnlineBatch], ap[kOnlineBatch];
    bool ok[kOnlineBatch];
    int qm = mod_pos(qb, a.ratio);
#pragma unroll
    for (int u = 0; u < kOnlineBatch; ++u) {  // every load of the batch before the first add (see issue_pair)
      const int q = qb + u;
      ok[u] = q < q1;
      v[u] = sc[u] = ap[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (ok[u]) {
        const int64_t row = (t + (q - p)) * d + col;
        v[u] = ld4(a.kv + row);
        sc[u] = ld4(a.score + row);
        ap[u] = ld4(a.ape + qm * d + col);
      }
      qm = qm + 1 == a.ratio ? 0 : qm + 1;
    }
#pragma unroll
    for (int u = 0; u < kOnlineBatch; ++u) sc[u] = add4(sc[u], ap[u]);
    reduce_batch(v, sc, ok, ps);
  }
}

// The cluster's partials merged into rank 0's ps (rank order). Every thread of every CTA of the cluster calls it.
__device__ __forceinline__ void online_merge(const OnlineShared& sh, int R, int rank, Pool& ps) {
  if (R == 1) return;
  const int tid = threadIdx.x, nt = blockDim.x;
  sh.part[tid] = make_float4(ps.mx[0], ps.mx[1], ps.mx[2], ps.mx[3]);
  sh.part[nt + tid] = make_float4(ps.z[0], ps.z[1], ps.z[2], ps.z[3]);
  sh.part[2 * nt + tid] = make_float4(ps.acc[0], ps.acc[1], ps.acc[2], ps.acc[3]);
  cluster_sync();
  if (rank == 0) {
    for (int rr = 1; rr < R; ++rr) {
      const float4* o = cluster_map(sh.part, static_cast<unsigned>(rr));
      const float4 m2 = o[tid], z2 = o[nt + tid], a2 = o[2 * nt + tid];
#pragma unroll
      for (int k = 0; k < 4; ++k) merge_into(ps.mx[k], ps.z[k], ps.acc[k], comp(m2, k), comp(z2, k), comp(a2, k));
    }
  }
  cluster_sync();  // rank 0 has read every partial: they may be overwritten, and the CTAs may exit
}

// The CTA's slot groups merged into group 0's ps (group order; group 0's threads then hold the CTA's partial). Every
// thread of the CTA calls it.
__device__ __forceinline__ void online_merge_groups(const OnlineShared& sh, const Ctx& x, Pool& ps) {
  if (x.G == 1) return;
  const int nt = blockDim.x;
  __syncthreads();  // the previous use of sh.part is over
  if (x.g > 0 && x.pools) {
    sh.part[x.tid] = make_float4(ps.mx[0], ps.mx[1], ps.mx[2], ps.mx[3]);
    sh.part[nt + x.tid] = make_float4(ps.z[0], ps.z[1], ps.z[2], ps.z[3]);
    sh.part[2 * nt + x.tid] = make_float4(ps.acc[0], ps.acc[1], ps.acc[2], ps.acc[3]);
  }
  __syncthreads();
  if (x.g == 0) {
    for (int gg = 1; gg < x.G; ++gg) {
      const int o = gg * x.quads + x.quad;
      const float4 m2 = sh.part[o], z2 = sh.part[nt + o], a2 = sh.part[2 * nt + o];
#pragma unroll
      for (int k = 0; k < 4; ++k) merge_into(ps.mx[k], ps.z[k], ps.acc[k], comp(m2, k), comp(z2, k), comp(a2, k));
    }
  }
  __syncthreads();  // read before online_merge writes sh.part
}

// kOne: the decode instance (a token a CTA, no cluster, no bulk grid behind it), see compressor_update_kernel.
template <typename OutT, int QUANT, bool kOne>
__global__ void __launch_bounds__(kOnlineMaxThreads) compressor_online_kernel(const __grid_constant__ CompressorArgs a) {
  const bool bulk = !kOne && a.bulk;  // a bulk grid runs behind this one
  if (!bulk) pdl_launch_dependents();  // with a bulk grid next: after the wait (see compressor_bulk_kernel)
  extern __shared__ float4 smem[];
  constexpr bool kFp4 = QUANT == kQuantFp4 || QUANT == kQuantFp4Sim;
  const int R = kOne ? 1 : a.cluster, chunk = kOne ? 1 : a.chunk, G = kOne ? 1 : a.groups;
  const int rank = R > 1 ? static_cast<int>(cluster_rank()) : 0;
  const int d = a.d, m = a.ratio;
  Ctx x;
  x.K = 1;
  x.rank = 0;
  x.dk = d;
  x.ch0 = 0;
  x.quads = d / 4;
  x.G = G;
  x.g_half = 1;
  x.n_pool = m;
  x.tid = threadIdx.x;
  x.quad = x.tid % x.quads;
  x.g = x.tid / x.quads;
  x.col = 4 * x.quad;
  x.pools = x.g < G;
  x.post = x.tid < x.quads;
  x.post_warps = (x.quads + 31) / 32;
  const int nt = blockDim.x;
  OnlineShared sh;
  sh.part = smem;
  sh.red = reinterpret_cast<float*>(smem + (R > 1 || G > 1 ? 3 * nt : 0));
  const int had = had_floats(kFp4, x.quads);
  sh.had = sh.red + kMaxWarps;
  sh.meta = reinterpret_cast<int*>(sh.had + had);
  sh.counts = sh.meta + 5 * chunk;

  // constants of the post-processing (weights: complete before the previous grid started)
  const Consts cs = load_consts(a, x);

  // --- the chunk's items (a token per thread), in token order; step metadata, loaded before the wait (launch.cuh)
  const int64_t t0 = static_cast<int64_t>(blockIdx.x / R) * chunk;
  const int lane = x.tid & 31, warp = x.tid >> 5;
  int r = -1, p = 0, s = 0, e = 0;
  bool item = false;
  const int lt = chunk == 1 ? 0 : x.tid;  // one token: every thread loads it (no barrier)
  if (lt < chunk && t0 + lt < a.n_tokens) {
    const int64_t t = t0 + lt;
    r = a.req_slot[t];
    p = a.positions[t];
    s = a.start_pos[t];
    e = a.end_pos[t];
    if (r >= 0 && r < a.n_slots) {  // else a PAD token: nothing (the reference uses the spare slot)
      const bool closes = mod_pos(p + 1, m) == 0, owner = floor_div(p, m) == floor_div(s, m);
      item = (closes && (owner || !bulk)) || (p == e - 1 && owner);  // with a bulk grid: only the owner's close
    }
  }
  pdl_wait();  // the previous grid's writes are visible
  if (bulk) pdl_launch_dependents();
  const unsigned ballot = __ballot_sync(0xffffffffu, item);
  int n_items = 0;
  if (chunk == 1) {
    n_items = item ? 1 : 0;
  } else {
    const int meta_warps = (chunk + 31) / 32;
    if (lane == 0 && warp < meta_warps) sh.counts[warp] = __popc(ballot);
    __syncthreads();
    int at = 0;
    for (int wi = 0; wi < meta_warps; ++wi) {
      at += wi < warp ? sh.counts[wi] : 0;
      n_items += sh.counts[wi];
    }
    if (item) {
      const int k = at + __popc(ballot & ((1u << lane) - 1u));
      sh.meta[5 * k] = x.tid;
      sh.meta[5 * k + 1] = r;
      sh.meta[5 * k + 2] = p;
      sh.meta[5 * k + 3] = s;
      sh.meta[5 * k + 4] = e;
    }
    __syncthreads();
  }

  for (int k = 0; k < n_items; ++k) {
    Tok tk;
    if (chunk == 1) {
      tk.t = t0;
      tk.r = r;
      tk.p = p;
      tk.s = s;
      tk.e = e;
    } else {
      tk.t = t0 + sh.meta[5 * k];
      tk.r = sh.meta[5 * k + 1];
      tk.p = sh.meta[5 * k + 2];
      tk.s = sh.meta[5 * k + 3];
      tk.e = sh.meta[5 * k + 4];
    }
    const int w = floor_div(tk.p, m), ws = w * m, w0 = floor_div(tk.s, m);
    tk.open_start = w0 * m;
    const bool closes = mod_pos(tk.p + 1, m) == 0, owner = w == w0, with_state = owner && ws < tk.s;
    const int64_t st_sc = static_cast<int64_t>(tk.r) * 2 * d + x.col, st_kv = static_cast<int64_t>(tk.r) * d + x.col;
    // the state's loads go out with the rows' (rank 0, owner only)
    float4 sm = make_float4(0.0f, 0.0f, 0.0f, 0.0f), sz = sm, sa = sm;
    if (with_state && rank == 0 && x.post) {
      sm = ld4(a.score_state + st_sc);
      sz = ld4(a.score_state + st_sc + d);
      sa = ld4(a.kv_state + st_kv);
    }
    Dest dst{-1, 0};
    Rot rt = {{1.0f, 1.0f}, {0.0f, 0.0f}};
    if (closes && rank == 0) {
      dst = entry_dest(a, x, tk, w);
      rt = rope_rot(a, x, cs, w);
    }
    // Phase 0: the item's rows (with the state: the owner), then its entry when it closes the window; phase 1 (an
    // owner that closes it): the state it leaves, the new open window's rows or an empty window. One loop body, not
    // two copies of the row loop (see process_closer: the owner's path runs once, from cold instruction caches).
    const int open_end = floor_div(tk.e, m) * m;
    Pool ps;
#pragma unroll 1
    for (int ph = 0; ph < 2; ++ph) {
      if (ph == 1 && !(owner && closes)) break;
      ps.init();
      if (ph == 1 && tk.e <= open_end) {
#pragma unroll
        for (int c4 = 0; c4 < 4; ++c4) ps.mx[c4] = 0.0f;  // empty: zeros
        break;
      }
      if (x.pools)  // part rank * G + g of R * G, in row order
        online_rows(a, x.col, tk.t, tk.p, ph == 0 ? max(tk.s, ws) : open_end, ph == 0 ? tk.p : tk.e - 1,
                    rank * G + x.g, R * G, ps);
      online_merge_groups(sh, x, ps);
      online_merge(sh, R, rank, ps);
      if (ph == 1) break;
      if (with_state && rank == 0 && x.post) {
#pragma unroll
        for (int c4 = 0; c4 < 4; ++c4) {
          if (comp(sz, c4) > 0.0f) merge_into(ps.mx[c4], ps.z[c4], ps.acc[c4], comp(sm, c4), comp(sz, c4), comp(sa, c4));
        }
      }
      if (closes && rank == 0) {  // cast, sum of squares over the CTA (fixed order), store_entry
        float val[4];
        const float ss = cast_pooled<OutT>(x, ps, val);
        if (lane == 0 && warp < x.post_warps) sh.red[warp] = ss;
        __syncthreads();
        float tot = 0.0f;
        for (int i = 0; i < x.post_warps; ++i) tot = __fadd_rn(tot, sh.red[i]);
        store_entry<OutT, QUANT>(a, x, sh.had, cs, rt, dst, val, tot);
        __syncthreads();  // sh.red and sh.had are reused by the next item
      }
    }
    if (!owner) continue;
    if (rank == 0 && x.post) {
      st4(a.score_state + st_sc, make_float4(ps.mx[0], ps.mx[1], ps.mx[2], ps.mx[3]));
      st4(a.score_state + st_sc + d, make_float4(ps.z[0], ps.z[1], ps.z[2], ps.z[3]));
      st4(a.kv_state + st_kv, make_float4(ps.acc[0], ps.acc[1], ps.acc[2], ps.acc[3]));
    }
  }
}

// ------------------------------------------------------------------ no overlap, long calls: the bulk grid
// Window w of a request closes in the "interior" of the call when every row it pools is a row of this call: w > w0
// (w0 = s / m, the window open when the call starts). Those entries read and write no state, so in long calls a
// second grid takes them and the online kernel (a.bulk set) keeps only the owner's items: its window w0, the state,
// the open rows. Tokens are cut into spans of m; a span holds at most one interior closer (two would need two
// requests each with m tokens in the span). A cluster of K CTAs (channel slices of d / K, whole FP8 blocks) takes a
// span: thread (quad, g) pools the slots g, g + G, ... of its quad's 4 channels, kBatch rows a load round, read
// L2-only; the groups merge and the entry is post-processed as in the general kernel (finish_entry).
// Ordering (programmatic dependent launch): this grid is launched right behind the online kernel of the same call,
// which allows the launch only after its own pdl_wait: when a CTA of this grid runs, the grids before the call are
// complete, so it reads the step's rows, metadata and block table without waiting. It writes only interior entries,
// which that kernel does not touch, and its CTA 0 waits for that kernel (pdl_wait) before it exits, so the grid after
// this one, which waits for it, sees both. (The other order, this grid first, was slower: H200, 8,192 tokens, HCA
// alone 23.9 against 21.6 us; the owner's few dependent loads then queue behind this grid's stream.)
// H200, 8,192 tokens, HCA alone: 25.0 us against 36.7 us in the online kernel (the owner's path there sets that time).
constexpr int kBulkMaxThreads = 256;
// at most 80 registers a thread (at 64, 168 bytes spilled, much of it in the pooling loop): an SM holds the 2 CTAs
// that an 8,192-token call gives it and an online-kernel CTA beside them
constexpr int kBulkMinBlocks = 3;

// Slots j = g, g + G, ... of interior entry w of the token tk, merged into ps. No overlap (c == 1) and every slot a
// row of this call: slot j is the row of position w*m + j and takes ape row j, so one base address and constant
// strides; full load rounds carry no predicates.
__device__ void bulk_pool(const CompressorArgs& a, const Ctx& x, const Tok& tk, int w, Pool& ps) {
  const int m = a.ratio, G = x.G;
  const int64_t d = a.d, step = static_cast<int64_t>(G) * d;
  const int64_t base = (tk.t + (static_cast<int64_t>(w) * m - tk.p) + x.g) * d + x.col;  // slot g's row
  const float* kv = a.kv + base;
  const float* sc = a.score + base;
  const float* ap = a.ape + static_cast<int64_t>(x.g) * d + x.col;
  int jb = x.g;
  for (; jb + (kBatch - 1) * G < m; jb += kBatch * G) {
    float4 v[kBatch], s[kBatch];
    static_assert(kBatch == 4, "one flag a slot");
    constexpr bool ok[kBatch] = {true, true, true, true};
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {  // every load of the batch before the first add (see issue_pair)
      v[u] = __ldcg(reinterpret_cast<const float4*>(kv + u * step));
      s[u] = __ldcg(reinterpret_cast<const float4*>(sc + u * step));
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) s[u] = add4(s[u], ld4(ap + u * step));
    reduce_batch(v, s, ok, ps);
    kv += kBatch * step;
    sc += kBatch * step;
    ap += kBatch * step;
  }
  if (jb < m) {  // the last, partial round
    float4 v[kBatch], s[kBatch];
    bool ok[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      ok[u] = jb + u * G < m;
      v[u] = s[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (ok[u]) {
        v[u] = __ldcg(reinterpret_cast<const float4*>(kv + u * step));
        s[u] = __ldcg(reinterpret_cast<const float4*>(sc + u * step));
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
      if (ok[u]) s[u] = add4(s[u], ld4(ap + u * step));
    reduce_batch(v, s, ok, ps);
  }
}

__host__ __device__ inline size_t bulk_smem_bytes(int groups, int quads, int had) {
  return sizeof(float4) * (groups > 1 ? static_cast<size_t>(3) * groups * quads : 0) +
         sizeof(float) * (2 * kMaxWarps + 4 + had) + sizeof(int) * 4;
}

template <typename OutT, int QUANT>
__global__ void __launch_bounds__(kBulkMaxThreads, kBulkMinBlocks)
    compressor_bulk_kernel(const __grid_constant__ CompressorArgs a) {
  pdl_launch_dependents();  // the next grid waits for this one's completion (pdl_wait at its start)
  extern __shared__ float4 smem[];
  constexpr bool kFp4 = QUANT == kQuantFp4 || QUANT == kQuantFp4Sim;
  const Ctx x = slice_ctx(a);
  Shared sh{};
  sh.part = smem;
  sh.red = reinterpret_cast<float*>(smem + (x.G > 1 ? 3 * x.G * x.quads : 0));
  sh.had = sh.red + 2 * kMaxWarps + 4;
  sh.meta = reinterpret_cast<int*>(sh.had + had_floats(kFp4, x.quads));  // [4]: the closer's lt, r, p
  const int m = a.ratio;

  const Consts cs = load_consts(a, x);

  // --- the span's interior closer, if any (its metadata in one round of loads)
  const int64_t t0 = static_cast<int64_t>(blockIdx.x / x.K) * m;
  if (x.tid == 0) sh.meta[0] = -1;
  __syncthreads();
  for (int lt = x.tid; lt < m && t0 + lt < a.n_tokens; lt += blockDim.x) {
    const int64_t t = t0 + lt;
    const int p = __ldcg(a.positions + t), r = __ldcg(a.req_slot + t), s = __ldcg(a.start_pos + t);
    if (mod_pos(p + 1, m) == 0 && r >= 0 && r < a.n_slots && floor_div(p + 1, m) - 1 >= floor_div(s, m) + a.c) {
      sh.meta[0] = lt;
      sh.meta[1] = r;
      sh.meta[2] = p;
    }
  }
  __syncthreads();
  if (sh.meta[0] >= 0) {
    Tok tk{};
    tk.t = t0 + sh.meta[0];
    tk.r = sh.meta[1];
    tk.p = sh.meta[2];
    const int w = closed_window(a, tk);
    Pool ps;
    ps.init();
    if (x.pools) bulk_pool(a, x, tk, w, ps);
    const Dest dst = entry_dest(a, x, tk, w, true);  // after the pooling: fewer registers live across its loads
    const Rot rt = rope_rot(a, x, cs, w);
    finish_entry<OutT, QUANT>(a, x, sh, cs, rt, dst, ps, 0);
    if (x.K > 1) cluster_sync();  // no CTA exits while another may still read its shared memory
  }
  // complete only after the grid before this one (see above): one CTA's wait is enough for the grid, and the others
  // leave their SM to the CTAs behind them
  if (blockIdx.x == 0) pdl_wait();
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? std::atoi(v) : fallback;
}

// Programmatic launch of a call's first grid. In the model torch ops (the kv and score projections) run right before
// every compressor call, and a grid launched with programmatic stream serialization behind a grid that never allows
// its successor early starts later than a plain launch: H200, decode batch 64 (fp8), each call after a one-element
// torch kernel, CSA pair 5.76-5.79 -> 5.47 us and HCA 4.02-4.07 -> 3.69-3.70 us with the first grid plain. So a
// call's first grid is a plain launch and only the grids behind it in the same call are programmatic
// (DSV4RT_COMPRESSOR_PDL_FIRST=1: the first one too, for comparisons; DSV4RT_COMPRESSOR_PDL=0: none).
bool pdl_first() {
  return env_int("DSV4RT_COMPRESSOR_PDL", 1) != 0 && env_int("DSV4RT_COMPRESSOR_PDL_FIRST", 0) != 0;
}

int pow2_ceil(int64_t v) {
  int p = 1;
  while (p < v && p < (1 << 30)) p <<= 1;
  return p;
}

struct Config {
  int cluster, groups, chunk, threads, pipe;
  size_t smem;
  bool pdl;
};

// K: channel slices for windows of many slots (c * m >= 32: none of the overlap compressors by default; HCA, which
// took 8, has its own kernel now; DSV4RT_COMPRESSOR_CLUSTER forces it), as long as a slice keeps
// whole FP8 blocks (FP4 rows need the whole row for the Hadamard transform) and fits a CTA of `max_threads`.
template <int QUANT>
bool slice_ok(const CompressorArgs& a, int k, int max_threads) {
  constexpr bool kFp4 = QUANT == kQuantFp4 || QUANT == kQuantFp4Sim;
  constexpr bool kFp8 = QUANT == kQuantFp8 || QUANT == kQuantFp8Sim;
  if (a.d % k != 0) return false;
  const int dk = a.d / k;
  return dk % 4 == 0 && dk / 4 <= max_threads && (!kFp8 || dk % kFp8Block == 0) && (!kFp4 || k == 1);
}

template <int QUANT>
int pick_cluster(const CompressorArgs& a, int max_threads) {
  auto slice_ok = [&](int k) { return dsv4rt::slice_ok<QUANT>(a, k, max_threads); };
  int cluster = 1;
  if (a.c * a.ratio >= 32) {
    for (int k = 8; k > 1; k /= 2) {
      if (slice_ok(k)) {
        cluster = k;
        break;
      }
    }
  }
  const int k_env = env_int("DSV4RT_COMPRESSOR_CLUSTER", 0);
  if ((k_env == 1 || k_env == 2 || k_env == 4 || k_env == 8) && slice_ok(k_env)) cluster = k_env;
  return slice_ok(cluster) ? cluster : 0;
}

template <int QUANT>
Config pick_config(const CompressorArgs& a) {
  constexpr bool kFp4 = QUANT == kQuantFp4 || QUANT == kQuantFp4Sim;
  const int n_pool = a.c * a.ratio;
  Config cfg;
  cfg.cluster = pick_cluster<QUANT>(a, kMaxThreads);
  if (cfg.cluster == 0) cfg.cluster = 1;  // the binding's checks keep d / 4 <= kMaxThreads
  const int quads = a.d / cfg.cluster / 4;
  // Two regimes (the defaults are the best of the sweep in tests/bench/test_bench_cache_write.py on an H200):
  //   * small calls (decode: few tokens for the SMs): one load round an entry. G = m with overlap (two slots a
  //     thread: the owner copies its overlap rows inside the pooling, see pool_fused), else kBatch slots a thread;
  //     a CTA takes one token or a few (about half a wave of CTAs);
  //   * large calls (prefill): up to 4 batches of kBatch slots a thread, at least 2 groups below 128 quads (small
  //     CTAs: several an SM, whose entries' latency chains overlap), a few closing tokens a CTA. CSA main (128
  //     quads) takes one group: 36 against 46 us alone, 116 against 133 us for the three (H200, 8,192 tokens).
  const int g_max = kMaxThreads / quads;
  const bool small = a.n_tokens * cfg.cluster <= 8 * static_cast<int64_t>(num_sms());
  int g;
  if (small) {
    g = (a.c == 2 && a.ratio <= g_max) ? a.ratio : (n_pool + kBatch - 1) / kBatch;
  } else {  // one group for whole 512-channel rows (CSA main: 128 threads, 8 slots a thread in two batches)
    g = (n_pool + 4 * kBatch - 1) / (4 * kBatch);
    if (g < 2 && quads < 128) g = n_pool < 2 ? n_pool : 2;
  }
  const int g_env = env_int("DSV4RT_COMPRESSOR_GROUPS", 0);
  if (g_env > 0) g = g_env;
  g = g < 1 ? 1 : (g > g_max ? g_max : (g > n_pool ? n_pool : g));
  cfg.groups = g;
  cfg.threads = (quads * g + 31) / 32 * 32;
  // chunk: the tokens a CTA takes, so that the grid has about (threads an SM) * SMs threads
  const int64_t per_sm = small ? 512 : 1024;
  const int64_t sm_threads = static_cast<int64_t>(num_sms()) * per_sm;
  const int64_t want = (a.n_tokens * cfg.cluster * cfg.threads + sm_threads - 1) / sm_threads;
  int chunk = pow2_ceil(want);
  const int c_env = env_int("DSV4RT_COMPRESSOR_CHUNK", 0);
  if (c_env > 0) chunk = c_env;
  cfg.chunk = chunk < 1 ? 1 : (chunk > cfg.threads ? cfg.threads : chunk);
  // the pipeline: several closing tokens a CTA (a chunk longer than m), one batch of slots a thread
  cfg.pipe = (cfg.chunk > a.ratio && n_pool <= kBatch * cfg.groups && env_int("DSV4RT_COMPRESSOR_PIPE", 1) != 0);
  cfg.smem = smem_bytes(cfg.pipe, cfg.threads, cfg.groups, quads, cfg.chunk, had_floats(kFp4, quads));
  cfg.pdl = pdl_first();  // the call's only grid
  return cfg;
}

// The online kernel's configuration: a cluster of 4 CTAs (rows of an item split 4 ways) over chunks of about the
// tokens a request has in the call (its average, at most m: one window's closing token a chunk in a long prefill),
// or a CTA a token when the call has about one token a request (decode); two slot groups a CTA when a bulk grid runs
// behind it (H200, 8,192 tokens, HCA alone: 17.8 against 20.8 us with one). CLUSTER, GROUPS and CHUNK override.
template <int QUANT>
Config pick_online(const CompressorArgs& a) {
  constexpr bool kFp4 = QUANT == kQuantFp4 || QUANT == kQuantFp4Sim;
  Config cfg;
  const int quads = a.d / 4;
  // groups: with a bulk grid behind, the kernel's only work is the owner's path (its window's rows, then the new open
  // window's), which ends within a few us of the bulk grid: its rows split over twice the threads, two slot groups of
  // a CTA
  int groups = a.bulk ? 2 : 1;
  const int g_env = env_int("DSV4RT_COMPRESSOR_GROUPS", 0);
  if (g_env > 0) groups = g_env;
  const int g_max = kOnlineMaxThreads / quads > 1 ? kOnlineMaxThreads / quads : 1;
  cfg.groups = groups < 1 ? 1 : (groups > g_max ? g_max : groups);
  cfg.threads = (quads * cfg.groups + 31) / 32 * 32;
  cfg.pipe = 0;
  int chunk = 1;
  while (2 * chunk <= a.n_tokens / (a.n_slots > 0 ? a.n_slots : 1) && 2 * chunk <= a.ratio) chunk *= 2;
  const int c_env = env_int("DSV4RT_COMPRESSOR_CHUNK", 0);
  if (c_env > 0) chunk = c_env;
  cfg.chunk = chunk < 1 ? 1 : (chunk > cfg.threads ? cfg.threads : chunk);
  int cluster = cfg.chunk >= 16 ? 4 : 1;  // H200, 8,192 tokens: R = 4 37 us, 2 34, 8 42, 1 52 alone
  const int k_env = env_int("DSV4RT_COMPRESSOR_CLUSTER", 0);
  if (k_env == 1 || k_env == 2 || k_env == 4 || k_env == 8) cluster = k_env;
  cfg.cluster = cluster;
  cfg.smem = online_smem_bytes(cfg.threads, cfg.cluster, cfg.groups, cfg.chunk, had_floats(kFp4, quads));
  cfg.pdl = pdl_first();  // the call's first grid (the bulk grid behind it is programmatic)
  return cfg;
}

// The bulk grid's configuration, or false when the call has none: no-overlap calls of at least kBulkMinTokens tokens
// (DSV4RT_COMPRESSOR_BULK=1: whenever an interior window is possible, 0: never). K = 4 channel slices, G = 8 slot
// groups (16 rows a thread in 4 load rounds); DSV4RT_COMPRESSOR_BULK_K and _BULK_G override them. H200, 8,192
// tokens, HCA alone: K 4 25.0 us, K 8 G 16 33.5, K 8 G 8 25.3, K 2 G 4 31.3.
constexpr int64_t kBulkMinTokens = 512;

template <int QUANT>
bool pick_bulk(const CompressorArgs& a, Config& cfg) {
  constexpr bool kFp4 = QUANT == kQuantFp4 || QUANT == kQuantFp4Sim;
  const int on = env_int("DSV4RT_COMPRESSOR_BULK", -1);
  if (a.c != 1 || on == 0 || a.n_tokens <= a.ratio || (on != 1 && a.n_tokens < kBulkMinTokens)) return false;
  int k = 4;
  const int k_env = env_int("DSV4RT_COMPRESSOR_BULK_K", 0);
  if (k_env == 1 || k_env == 2 || k_env == 4 || k_env == 8) k = k_env;
  while (k > 1 && !slice_ok<QUANT>(a, k, kBulkMaxThreads)) k /= 2;
  if (!slice_ok<QUANT>(a, k, kBulkMaxThreads)) return false;
  const int quads = a.d / k / 4, n_pool = a.c * a.ratio;
  int g = 8;
  const int g_env = env_int("DSV4RT_COMPRESSOR_BULK_G", 0);
  if (g_env > 0) g = g_env;
  const int g_max = kBulkMaxThreads / quads;
  g = g < 1 ? 1 : (g > g_max ? g_max : (g > n_pool ? n_pool : g));
  cfg.cluster = k;
  cfg.groups = g;
  cfg.threads = (quads * g + 31) / 32 * 32;
  cfg.chunk = a.ratio;  // a span of m tokens a cluster
  cfg.pipe = 0;
  cfg.smem = bulk_smem_bytes(g, quads, had_floats(kFp4, quads));
  cfg.pdl = env_int("DSV4RT_COMPRESSOR_PDL", 1) != 0;
  return true;
}

template <typename Kernel>
cudaError_t launch_grid(Kernel kernel, const CompressorArgs& a, const Config& cfg, cudaStream_t stream) {
  if (cfg.smem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(cfg.smem));
    if (err != cudaSuccess) return err;
  }
  // DSV4RT_COMPRESSOR_CARVEOUT=0..100: the preferred shared-memory carveout (percent), for comparisons
  const int carveout = env_int("DSV4RT_COMPRESSOR_CARVEOUT", -1);
  if (carveout >= 0 && carveout <= 100) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, carveout);
    if (err != cudaSuccess) return err;
  }
  const int64_t n_chunks = (a.n_tokens + cfg.chunk - 1) / cfg.chunk;
  return launch_ex(kernel, dim3(static_cast<unsigned>(n_chunks * cfg.cluster)), dim3(static_cast<unsigned>(cfg.threads)),
                   cfg.smem, stream, static_cast<unsigned>(cfg.cluster), cfg.pdl, a);
}

// Whether an overlap call takes the windows path (see there): a span's tokens fit a warp (m <= 32) and a team is
// d / 4 = 32 or 128 threads (FP4 rows: 32, the Hadamard transform within a warp).
template <int QUANT>
bool windows_ok(const CompressorArgs& a) {
  constexpr bool kFp4 = QUANT == kQuantFp4 || QUANT == kQuantFp4Sim;
  const int on = env_int("DSV4RT_COMPRESSOR_WINDOWS", -1);
  if (on == 0 || a.c != 2 || a.ratio > 32 || (a.d != 128 && a.d != 512) || (kFp4 && a.d != 128)) return false;
  return on == 1 || a.n_tokens >= kWindowsMinTokens;
}

// Blocks of the windows grid (a span of m tokens a team) and of the state grid (kStateThreads tokens a CTA).
inline unsigned windows_blocks(const CompressorArgs& a) {
  const int64_t spans = (a.n_tokens + a.ratio - 1) / a.ratio, teams = kWinThreads / (a.d / 4);
  return static_cast<unsigned>((spans + teams - 1) / teams);
}
inline unsigned state_blocks(const CompressorArgs& a) {
  return static_cast<unsigned>((a.n_tokens + kStateThreads - 1) / kStateThreads);
}

template <typename OutT, int QUANT>
auto windows_kernel(const CompressorArgs& a) {
  constexpr bool kFp4 = QUANT == kQuantFp4 || QUANT == kQuantFp4Sim;
  const bool csa = a.ratio == kCsaRatio;  // (c == 2 and d == 4 QD: windows_ok)
  // the instance for team size QD: the CSA shape's, else the general one
  auto pick = [csa](auto qd) {
    constexpr int QD = decltype(qd)::value;
    return csa ? compressor_windows_kernel<OutT, QUANT, QD, kCsaRatio> : compressor_windows_kernel<OutT, QUANT, QD, 0>;
  };
  if constexpr (kFp4) {  // d = 128 (windows_ok)
    return pick(std::integral_constant<int, 32>{});
  } else {
    return a.d == 128 ? pick(std::integral_constant<int, 32>{}) : pick(std::integral_constant<int, 128>{});
  }
}

template <typename OutT, int QUANT>
cudaError_t launch_windows(const CompressorArgs& a, cudaStream_t stream) {
  const bool pdl = env_int("DSV4RT_COMPRESSOR_PDL", 1) != 0;
  const cudaError_t err = launch_ex(windows_kernel<OutT, QUANT>(a), dim3(windows_blocks(a)), dim3(kWinThreads), 0,
                                    stream, 1, pdl_first(), a);
  if (err != cudaSuccess) return err;
  return launch_ex(compressor_state_kernel, dim3(state_blocks(a)), dim3(kStateThreads), 0, stream, 1, pdl, a);
}

// The windows paths of a pair's two calls (the same tokens; disjoint tensors apart from the metadata), with
// programmatic dependent launch: the first call's windows grid, the second's, then each call's state grid. The first
// windows grid allows the next launch only after its pdl_wait (chain 1), so when a CTA of the second windows grid
// runs, the grids before the pair are complete and it reads its rows and state without waiting (chain 2); it streams
// in the first grid's tail instead of behind the first call's state grid. Its CTA 0 waits for the first grid before
// it exits, so the first state grid (every CTA waits) runs after both windows grids, as each call's state grid must.
// The state grids pair up the same way: the first allows the next launch after its wait (both windows grids are
// complete then), the second writes its call's state without waiting, beside the first, and its CTA 0 waits for the
// first before it exits, so the grid after the pair sees both.
template <typename OutT, int Q1, int Q2>
bool launch_windows_pair_typed(CompressorArgs a1, CompressorArgs a2, cudaStream_t stream, cudaError_t& err) {
  if (a1.quant != Q1 || a2.quant != Q2 || !windows_ok<Q1>(a1) || !windows_ok<Q2>(a2) ||
      env_int("DSV4RT_COMPRESSOR_PDL", 1) == 0)
    return false;
  a1.bulk = a2.bulk = 0;
  a1.chain = 1;
  a2.chain = 2;
  err = launch_ex(windows_kernel<OutT, Q1>(a1), dim3(windows_blocks(a1)), dim3(kWinThreads), 0, stream, 1,
                  pdl_first(), a1);
  if (err == cudaSuccess)
    err = launch_ex(windows_kernel<OutT, Q2>(a2), dim3(windows_blocks(a2)), dim3(kWinThreads), 0, stream, 1, true, a2);
  if (err == cudaSuccess)
    err = launch_ex(compressor_state_kernel, dim3(state_blocks(a1)), dim3(kStateThreads), 0, stream, 1, true, a1);
  if (err == cudaSuccess)
    err = launch_ex(compressor_state_kernel, dim3(state_blocks(a2)), dim3(kStateThreads), 0, stream, 1, true, a2);
  return true;
}

template <typename OutT, int QUANT>
cudaError_t launch_typed(CompressorArgs a, cudaStream_t stream) {
  Config cfg;
  a.bulk = a.chain = 0;
  if (a.c == 1) {  // no overlap: the online softmax state, and in long calls the bulk grid behind it
    Config bulk;
    a.bulk = pick_bulk<QUANT>(a, bulk) ? 1 : 0;
    cfg = pick_online<QUANT>(a);
    a.cluster = cfg.cluster;
    a.groups = cfg.groups;
    a.chunk = cfg.chunk;
    a.pipe = cfg.pipe;
    const bool one = cfg.chunk == 1 && cfg.cluster == 1 && !a.bulk;
    const cudaError_t err = one ? launch_grid(compressor_online_kernel<OutT, QUANT, true>, a, cfg, stream)
                                : launch_grid(compressor_online_kernel<OutT, QUANT, false>, a, cfg, stream);
    if (err != cudaSuccess || !a.bulk) return err;
    a.cluster = bulk.cluster;
    a.groups = bulk.groups;
    a.chunk = bulk.chunk;
    a.pipe = bulk.pipe;
    return launch_grid(compressor_bulk_kernel<OutT, QUANT>, a, bulk, stream);
  }
  if (windows_ok<QUANT>(a)) return launch_windows<OutT, QUANT>(a, stream);
  cfg = pick_config<QUANT>(a);
  a.cluster = cfg.cluster;
  a.groups = cfg.groups;
  a.chunk = cfg.chunk;
  a.pipe = cfg.pipe;
  if (cfg.chunk == 1 && cfg.cluster == 1 && !cfg.pipe)
    return launch_grid(compressor_update_kernel<OutT, QUANT, true>, a, cfg, stream);
  return launch_grid(compressor_update_kernel<OutT, QUANT, false>, a, cfg, stream);
}

template <typename OutT>
cudaError_t launch_quant(const CompressorArgs& a, cudaStream_t stream) {
  switch (a.quant) {
    case kQuantNone: return launch_typed<OutT, kQuantNone>(a, stream);
    case kQuantFp8: return launch_typed<OutT, kQuantFp8>(a, stream);
    case kQuantFp4: return launch_typed<OutT, kQuantFp4>(a, stream);
    case kQuantFp8Sim: return launch_typed<OutT, kQuantFp8Sim>(a, stream);
    case kQuantFp4Sim: return launch_typed<OutT, kQuantFp4Sim>(a, stream);
  }
  return cudaErrorInvalidValue;
}

// The pair kernel when both calls run the kOne instance with these quantisations and this dtype; else false.
template <typename OutT, int Q1, int Q2>
bool launch_pair_typed(CompressorArgs a1, CompressorArgs a2, cudaStream_t stream, cudaError_t& err) {
  if (a1.quant != Q1 || a2.quant != Q2 || windows_ok<Q1>(a1) || windows_ok<Q2>(a2)) return false;
  const Config c1 = pick_config<Q1>(a1), c2 = pick_config<Q2>(a2);
  const bool one1 = c1.chunk == 1 && c1.cluster == 1 && !c1.pipe, one2 = c2.chunk == 1 && c2.cluster == 1 && !c2.pipe;
  if (!one1 || !one2 || c1.pdl != c2.pdl) return false;
  for (auto* p : {&a1, &a2}) {
    const Config& c = p == &a1 ? c1 : c2;
    p->cluster = c.cluster;
    p->groups = c.groups;
    p->chunk = c.chunk;
    p->pipe = c.pipe;
    p->bulk = p->chain = 0;
  }
  Config cfg = c1;
  cfg.threads = c1.threads > c2.threads ? c1.threads : c2.threads;
  cfg.smem = c1.smem > c2.smem ? c1.smem : c2.smem;
  auto kernel = compressor_pair_kernel<OutT, Q1, Q2>;
  if (cfg.smem > 48 * 1024) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(cfg.smem));
    if (err != cudaSuccess) return true;
  }
  err = launch_ex(kernel, dim3(static_cast<unsigned>(a1.n_tokens + a2.n_tokens)),
                  dim3(static_cast<unsigned>(cfg.threads)), cfg.smem, stream, 1, cfg.pdl, a1, a2);
  return true;
}

}  // namespace

cudaError_t compressor_update_pair_launch(const CompressorArgs& a1, const CompressorArgs& a2, cudaStream_t stream) {
  if (a1.n_tokens == 0 || a2.n_tokens == 0) {
    const cudaError_t err = compressor_update_launch(a1, stream);
    return err != cudaSuccess ? err : compressor_update_launch(a2, stream);
  }
  cudaError_t err = cudaSuccess;
  if (a1.c == 2 && a2.c == 2 && a1.dtype == a2.dtype && env_int("DSV4RT_COMPRESSOR_PAIR", 1) != 0) {
    bool done = false;
    switch (static_cast<DType>(a1.dtype)) {
      case DType::kBFloat16:
        done = launch_windows_pair_typed<__nv_bfloat16, kQuantFp8, kQuantFp4>(a1, a2, stream, err) ||
               launch_windows_pair_typed<__nv_bfloat16, kQuantNone, kQuantNone>(a1, a2, stream, err) ||
               launch_pair_typed<__nv_bfloat16, kQuantFp8, kQuantFp4>(a1, a2, stream, err) ||
               launch_pair_typed<__nv_bfloat16, kQuantNone, kQuantNone>(a1, a2, stream, err);
        break;
      default:
        break;
    }
    if (done) return err;
  }
  err = compressor_update_launch(a1, stream);  // two launches: other shapes, formats and dtypes
  return err != cudaSuccess ? err : compressor_update_launch(a2, stream);
}

cudaError_t compressor_update_launch(const CompressorArgs& a, cudaStream_t stream) {
  if (a.n_tokens == 0) return cudaSuccess;
  switch (static_cast<DType>(a.dtype)) {
    case DType::kFloat32: return launch_quant<float>(a, stream);
    case DType::kBFloat16: return launch_quant<__nv_bfloat16>(a, stream);
    case DType::kFloat16: return launch_quant<__half>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace dsv4rt
