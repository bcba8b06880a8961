// KV compressor family (ops/compressor.py): store a step's (kv, score + ape) rows and emit the entry of every
// window that closes in the step. One launch per compressor per step, decode and prefill chunks alike.
//
// Work items are tokens; a cluster of K CTAs takes one token at a time, each CTA a slice of d/K channels (K > 1
// only for many-slot windows, HCA: one close reads 128 rows of state). Items stride over the tokens in batches of
// one token per thread: the batch's metadata is loaded at once and compacted to the tokens with work (most tokens
// of a prefill chunk have none); row-writing tokens go a warp each, all at once, closing tokens one at a time.
// For token t (position p of request slot r; the request's tokens in this call are [s, e), contiguous in the
// batch), window w = [w*m, (w+1)*m), w0 = s / m the window open when the call starts, open_end = (e / m) * m:
//   * if t closes window w, pool its slots (per-channel fp32 softmax), cast to the activation dtype, RMS-norm,
//     RoPE at position w*m, quantise, and write the entry through the block table;
//   * if p >= open_end, t is a new open token: its (kv, score + ape) row goes to open row p mod m.
// The reference gathers everything from the pre-step state before writing any state. Here, within one kernel:
//   * only the closers of w0 and (overlap) w0+1 read the state: the overlap rows (window w0-1, A halves) and the
//     open rows of positions [w0*m, s);
//   * so the work item that closes w0 (the request's "owner") also computes entry w0+1, and after a barrier writes
//     the state those reads depend on: the overlap rows (the last closed window's full rows) and the open rows
//     that the step's new open tokens put over rows of [w0*m, s);
//   * every other new open token writes its own row: nobody reads that row in this step.
// A request with no closing window reads no state, and each of its tokens writes its own open row.
#include <cmath>
#include <cstdlib>

#include "compressor.h"
#include "kv_quant.cuh"
#include "launch.cuh"

namespace dsv4rt {
namespace {

constexpr int kMaxThreads = 512;  // 256 threads a CTA (2 CTAs an SM: <= 128 registers), 512 for clusters
constexpr int kUnroll = 4;         // pooled slots loaded before they are reduced (memory-level parallelism)
constexpr float kNegInf = -__builtin_huge_valf();

__device__ __forceinline__ int64_t floor_div(int64_t a, int64_t b) {
  const int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

__device__ __forceinline__ int64_t mod_pos(int64_t a, int64_t b) { return a - floor_div(a, b) * b; }

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void st4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }

__device__ __forceinline__ float4 add4(float4 a, float4 b) {
  return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z), __fadd_rn(a.w, b.w));
}

// Barrier of the token's work item: the CTA, or the cluster when several CTAs share the token.
__device__ __forceinline__ void sync_item(int cluster) {
  if (cluster > 1) {
    cluster_sync();
  } else {
    __syncthreads();
  }
}

// Per-channel online softmax: running max, sum of exp, sum of exp * value.
struct Pool {
  float mx, z, acc;
  __device__ __forceinline__ void init() {
    mx = kNegInf;
    z = 0.0f;
    acc = 0.0f;
  }
  __device__ __forceinline__ void add(float s, float v) {
    if (s > mx) {
      const float f = expf(__fsub_rn(mx, s));  // 0 for the first slot (mx = -inf)
      z = __fmaf_rn(z, f, 1.0f);
      acc = __fmaf_rn(acc, f, v);
      mx = s;
    } else {
      const float f = expf(__fsub_rn(s, mx));
      z = __fadd_rn(z, f);
      acc = __fmaf_rn(f, v, acc);
    }
  }
};

struct Token {
  int64_t t, p, s, e, r;
  int64_t open_start;  // (s / m) * m
};

// Row of position q of the token's request: this call's kv/score rows when q >= s, else the state.
struct Src {
  const float* kv;
  const float* sc;
  const float* ape;  // non-null for this call's rows: their score gets ape[q mod m] added
};

__device__ __forceinline__ Src source_row(const CompressorArgs& a, const Token& tok, int64_t q) {
  const int64_t m = a.ratio, cw = static_cast<int64_t>(a.c) * a.d;
  if (q >= tok.s) {
    const int64_t row = tok.t + (q - tok.p);
    return {a.kv + row * cw, a.score + row * cw, a.ape + mod_pos(q, m) * cw};
  }
  const int64_t srow = q >= tok.open_start ? (a.c - 1) * m + mod_pos(q, m) : mod_pos(q, m);
  const int64_t off = (tok.r * a.c * m + srow) * cw;
  return {a.kv_state + off, a.score_state + off, nullptr};
}

// Shared memory of a CTA: weights (the norm weight slice, inv_freq), the token batch, the entry's work space.
struct Smem {
  float* norm_w;   // [dk]
  float* freq;     // [rope_dim / 2]
  int* list;       // [threads]: batch index of each token with work (closing ones from the front, row-writing
                   // ones from the back), then its metadata:
  int* pos;        // [threads]
  int* start;      // [threads]
  int* end;        // [threads]
  int* slot;       // [threads]
  int* counts;     // [2 * threads / 32]: closing tokens, then row-writing tokens, per warp
  float* vals;     // [dk]
  float* part;     // [3 * groups * dk]
  float* scratch;  // [33]
};

__host__ __device__ inline size_t smem_floats(int dk, int rope_dim, int threads) {
  const int groups = threads / (dk / 4);
  return static_cast<size_t>(dk) + rope_dim / 2 + 5 * threads + 2 * (threads / 32) + dk + 3 * groups * dk + 33;
}

__device__ __forceinline__ Smem carve_smem(float* base, int dk, int rope_dim) {
  const int threads = blockDim.x, groups = threads / (dk / 4);
  Smem sm;
  sm.norm_w = base;
  sm.freq = sm.norm_w + dk;
  sm.list = reinterpret_cast<int*>(sm.freq + rope_dim / 2);
  sm.pos = sm.list + threads;
  sm.start = sm.pos + threads;
  sm.end = sm.start + threads;
  sm.slot = sm.end + threads;
  sm.counts = sm.slot + threads;
  sm.vals = reinterpret_cast<float*>(sm.counts + 2 * (threads / 32));
  sm.part = sm.vals + dk;
  sm.scratch = sm.part + 3 * groups * dk;
  return sm;
}

// Pool, norm, RoPE, quantise and write this CTA's channel slice [ch0, ch0 + dk) of the entry of window w.
// Reads this call's rows and the pre-step state.
template <typename OutT, int QUANT>
__device__ void emit_entry(const CompressorArgs& a, const Token& tok, int64_t w, const Smem& sm, int rank) {
  const int d = a.d, m = a.ratio, c = a.c, n_pool = c * m, k_cl = a.cluster;
  const int dk = d / k_cl, ch0 = rank * dk;
  const int quads = dk / 4, groups = blockDim.x / quads;
  float* vals = sm.vals;
  float* part = sm.part;
  float* scratch = sm.scratch;
  const int tid = threadIdx.x;
  // destination through the block table (w clamped as the reference does); loaded before the pooling's loads
  const int64_t n_entries = a.bt_cols * a.per_block;
  const int64_t wc = w < 0 ? 0 : (w >= n_entries ? n_entries - 1 : w);
  const int64_t blk = a.block_table[tok.r * a.bt_stride + wc / a.per_block];
  __syncthreads();  // smem of the previous entry is free

  // --- pooling: thread (group g, quad) runs an online softmax over slots j = g, g + G, ... of 4 channels
  const int quad = tid % quads, g = tid / quads;
  if (g < groups) {
    Pool pool[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) pool[k].init();
    for (int j0 = g; j0 < n_pool; j0 += kUnroll * groups) {
      float4 v[kUnroll], s[kUnroll];
      bool ok[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = j0 + u * groups;
        const int64_t q = (w - (c - 1)) * m + j;
        ok[u] = j < n_pool && q >= 0;  // q < 0: window -1 of the first entry, score -inf, weight 0
        if (ok[u]) {
          const Src src = source_row(a, tok, q);
          const int off = (c == 2 && j >= m ? d : 0) + ch0 + 4 * quad;  // A halves of w-1, B halves of w
          v[u] = ld4(src.kv + off);
          s[u] = ld4(src.sc + off);
          if (src.ape != nullptr) s[u] = add4(s[u], ld4(src.ape + off));
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (ok[u]) {
          pool[0].add(s[u].x, v[u].x);
          pool[1].add(s[u].y, v[u].y);
          pool[2].add(s[u].z, v[u].z);
          pool[3].add(s[u].w, v[u].w);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int ch = 4 * quad + k;
      part[(0 * groups + g) * dk + ch] = pool[k].mx;
      part[(1 * groups + g) * dk + ch] = pool[k].z;
      part[(2 * groups + g) * dk + ch] = pool[k].acc;
    }
  }
  __syncthreads();

  // --- merge the groups, cast to the activation dtype, sum of squares (over the cluster: fixed order)
  float ss = 0.0f;
  for (int ch = tid; ch < dk; ch += blockDim.x) {
    float mx = kNegInf;
    for (int gg = 0; gg < groups; ++gg) mx = fmaxf(mx, part[gg * dk + ch]);
    float z = 0.0f, acc = 0.0f;
    for (int gg = 0; gg < groups; ++gg) {
      const float f = expf(__fsub_rn(part[gg * dk + ch], mx));  // 0 for a group that saw no slot
      z = __fmaf_rn(part[(groups + gg) * dk + ch], f, z);
      acc = __fmaf_rn(part[(2 * groups + gg) * dk + ch], f, acc);
    }
    const float x = round_to<OutT>(__fdiv_rn(acc, z));
    vals[ch] = x;
    ss = __fmaf_rn(x, x, ss);
  }
  ss = block_sum(ss, scratch);
  if (k_cl > 1) {
    if (tid == 0) scratch[32] = ss;
    cluster_sync();
    ss = 0.0f;
    for (int rr = 0; rr < k_cl; ++rr) ss = __fadd_rn(ss, *cluster_map(scratch + 32, rr));
    cluster_sync();  // every CTA has read the partials before any overwrites them
  }

  // --- RMSNorm (fp32, weight after the normalisation, as the reference), cast
  const float rs = rsqrtf(__fadd_rn(__fdiv_rn(ss, static_cast<float>(d)), a.eps));
  for (int ch = tid; ch < dk; ch += blockDim.x)
    vals[ch] = round_to<OutT>(__fmul_rn(sm.norm_w[ch], __fmul_rn(vals[ch], rs)));
  __syncthreads();

  // --- RoPE at the window's first position on the last rope_dim channels (interleaved pairs), cast
  const int nope = d - a.rope_dim;
  const float pos = static_cast<float>(w * m);
  for (int i = 2 * tid; i < dk; i += 2 * blockDim.x) {
    if (ch0 + i < nope) continue;
    const float ang = __fmul_rn(pos, sm.freq[(ch0 + i - nope) / 2]);
    const float cs = cosf(ang), sn = sinf(ang);
    const float x0 = vals[i], x1 = vals[i + 1];
    vals[i] = round_to<OutT>(__fsub_rn(__fmul_rn(x0, cs), __fmul_rn(x1, sn)));
    vals[i + 1] = round_to<OutT>(__fadd_rn(__fmul_rn(x1, cs), __fmul_rn(x0, sn)));
  }
  __syncthreads();

  if (blk < 0 || blk >= a.n_blocks) return;  // uniform over the work item
  const int64_t dst_row = blk * a.per_block + wc % a.per_block;
  const int lane = tid & 31, warp = tid >> 5, n_warps = blockDim.x >> 5;

  if constexpr (QUANT == kQuantNone) {
    OutT* out = static_cast<OutT*>(a.entry_cache) + dst_row * a.row + ch0;
    for (int ch = tid; ch < dk; ch += blockDim.x) out[ch] = Num<OutT>::store(vals[ch]);
  } else if constexpr (QUANT == kQuantFp8 || QUANT == kQuantFp8Sim) {
    // the slice holds whole 64-blocks (the launcher picks K so): block b0 + lb is local block lb
    const int n_blocks = nope / kFp8Block, b0 = ch0 / kFp8Block;
    for (int lb = warp; lb < dk / kFp8Block && b0 + lb < n_blocks; lb += n_warps) {
      const int i = lb * kFp8Block + 2 * lane;
      const float v0 = vals[i], v1 = vals[i + 1];
      const int k = pow2_scale_exp(warp_max(fmaxf(fabsf(v0), fabsf(v1))), kFp8AmaxFloor, kFp8InvMax);
      const float scale = exp2_int(k);
      const uint8_t c0 = fp8_encode(v0, scale), c1 = fp8_encode(v1, scale);
      if constexpr (QUANT == kQuantFp8) {
        uint8_t* out = static_cast<uint8_t*>(a.entry_cache) + dst_row * a.row;
        out[ch0 + i] = c0;
        out[ch0 + i + 1] = c1;
        if (lane == 0) out[nope + 2 * a.rope_dim + b0 + lb] = static_cast<uint8_t>(k + 127);
      } else {
        OutT* out = static_cast<OutT*>(a.entry_cache) + dst_row * a.row + ch0;
        out[i] = Num<OutT>::store(__fmul_rn(fp8_decode(c0), scale));
        out[i + 1] = Num<OutT>::store(__fmul_rn(fp8_decode(c1), scale));
      }
    }
    const int rope0 = nope > ch0 ? nope - ch0 : 0;  // first local rope channel
    if constexpr (QUANT == kQuantFp8) {
      uint8_t* out = static_cast<uint8_t*>(a.entry_cache) + dst_row * a.row;
      // one 16-bit store per value, as in swa.cu: storing the two bytes of the bf16 separately wrote wrong low
      // bytes on an H200 (nvcc 13.0, sm_90a)
      __nv_bfloat16* rope = reinterpret_cast<__nv_bfloat16*>(out + nope);
      for (int i = rope0 + tid; i < dk; i += blockDim.x) rope[ch0 + i - nope] = __float2bfloat16_rn(vals[i]);
      if (rank == 0) {
        for (int i = nope + 2 * a.rope_dim + n_blocks + tid; i < a.row; i += blockDim.x) out[i] = 0;
      }
    } else {
      OutT* out = static_cast<OutT*>(a.entry_cache) + dst_row * a.row + ch0;
      for (int i = rope0 + tid; i < dk; i += blockDim.x) out[i] = Num<OutT>::store(round_to<__nv_bfloat16>(vals[i]));
    }
  } else {  // FP4 formats (whole rows: K == 1): normalised Walsh-Hadamard (Sylvester order, the reference's
            // butterflies), then e2m1 in blocks of 32
    for (int h = 1; h < d; h <<= 1) {
      for (int idx = tid; idx < d / 2; idx += blockDim.x) {
        const int i = (idx / h) * 2 * h + idx % h, j = i + h;
        const float x0 = vals[i], x1 = vals[j];
        vals[i] = __fadd_rn(x0, x1);
        vals[j] = __fsub_rn(x0, x1);
      }
      __syncthreads();
    }
    const float hs = static_cast<float>(1.0 / sqrt(static_cast<double>(d)));
    const int n_blocks = d / kFp4Block;
    for (int b = warp; b < n_blocks; b += n_warps) {
      const int i = b * kFp4Block + lane;
      const float v = __fmul_rn(vals[i], hs);
      const int k = pow2_scale_exp(warp_max(fabsf(v)), kFp4AmaxFloor, kFp4InvMax);
      const float scale = exp2_int(k);
      const float y = __fdiv_rn(v, scale);
      const uint8_t code = e2m1_encode(y);
      if constexpr (QUANT == kQuantFp4) {
        uint8_t* out = static_cast<uint8_t*>(a.entry_cache) + dst_row * a.row;
        const unsigned hi = __shfl_down_sync(0xffffffffu, static_cast<unsigned>(code), 1);
        if ((lane & 1) == 0) out[i / 2] = static_cast<uint8_t>(code | (hi << 4));
        if (lane == 0) out[d / 2 + b] = static_cast<uint8_t>(k + 127);
      } else {
        OutT* out = static_cast<OutT*>(a.entry_cache) + dst_row * a.row;
        out[i] = Num<OutT>::store(__fmul_rn(copysignf(e2m1_magnitude(code & 7), y), scale));
      }
    }
  }
}

// This CTA's column slice of kv_state/score_state rows dst0 + j <- rows of positions q0 + j, j < n_rows (this
// call's rows get score + ape), by threads first, first + stride, ... Each thread loads up to 4 rows' columns before
// storing them, so a copy costs one memory round trip, not one per row. Sources and destinations must not overlap.
__device__ __forceinline__ void copy_rows(const CompressorArgs& a, const Token& tok, int64_t dst0, int64_t q0,
                                          int64_t n_rows, int rank, int first, int stride) {
  const int64_t cw = static_cast<int64_t>(a.c) * a.d, rows = static_cast<int64_t>(a.c) * a.ratio;
  const int64_t part = cw / a.cluster, lo = rank * part;
  float* kd = a.kv_state + (tok.r * rows + dst0) * cw;
  float* sd = a.score_state + (tok.r * rows + dst0) * cw;
  for (int64_t i = lo + 4 * first; i < lo + part; i += 4 * stride) {
    for (int64_t j0 = 0; j0 < n_rows; j0 += 4) {
      float4 kv[4], sc[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        if (j0 + u < n_rows) {
          const Src src = source_row(a, tok, q0 + j0 + u);
          kv[u] = ld4(src.kv + i);
          sc[u] = ld4(src.sc + i);
          if (src.ape != nullptr) sc[u] = add4(sc[u], ld4(src.ape + i));
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        if (j0 + u < n_rows) {
          st4(kd + (j0 + u) * cw + i, kv[u]);
          st4(sd + (j0 + u) * cw + i, sc[u]);
        }
      }
    }
  }
}

// What the token must do in this kernel (see the file comment): nothing (most tokens of a prefill chunk), write its
// own open row (kWriteRow), or close a window (kClose: an entry, and the owner's state writes).
enum Work : int { kNone = 0, kWriteRow = 1, kClose = 2 };

__device__ __forceinline__ int token_work(const CompressorArgs& a, int64_t p, int64_t s, int64_t e) {
  const int64_t m = a.ratio, open_start = floor_div(s, m) * m, open_end = floor_div(e, m) * m;
  const bool has_close = open_end > open_start;
  if (mod_pos(p + 1, m) == 0) return (a.c == 2 && floor_div(p + 1, m) - 1 == open_start / m + 1) ? kNone : kClose;
  return (p >= open_end && !(has_close && p - open_end < s - open_start)) ? kWriteRow : kNone;
}

// A closing token (see token_work): its entry (the owner: entries w0 and w0 + 1), then the owner's state writes.
template <typename OutT, int QUANT>
__device__ void process_token(const CompressorArgs& a, int64_t t, int64_t r, int64_t p, int64_t s, int64_t e,
                              const Smem& sm, int rank) {
  Token tok;
  tok.t = t;
  tok.r = r;
  const int64_t m = a.ratio;
  tok.p = p;
  tok.s = s;
  tok.e = e;
  tok.open_start = floor_div(tok.s, m) * m;
  const int64_t open_end = floor_div(tok.e, m) * m;
  const bool has_close = open_end > tok.open_start;  // some window of the request closes in [s, e)
  const bool closes = mod_pos(tok.p + 1, m) == 0;
  const int64_t w = floor_div(tok.p + 1, m) - 1;
  const int64_t w0 = tok.open_start / m, w_last = open_end / m - 1;
  const bool owner = has_close && closes && w == w0;

  if (closes) {
    if (!(a.c == 2 && w == w0 + 1)) emit_entry<OutT, QUANT>(a, tok, w, sm, rank);  // w0 + 1: the owner's
    if (owner && a.c == 2 && w0 + 1 <= w_last) emit_entry<OutT, QUANT>(a, tok, w0 + 1, sm, rank);
  }

  // --- the owner's state writes: (overlap) the last closed window's rows, and the new open rows over rows of
  // [w0*m, s) (rows j < s - w0*m; the other new open tokens write their own rows, see token_work)
  if (!owner) return;
  const int64_t open_row0 = static_cast<int64_t>(a.c - 1) * m;
  sync_item(a.cluster);  // the owner's reads of the pre-step state are done, in every CTA of the item
  if (a.c == 2) {
    copy_rows(a, tok, 0, w_last * m, m, rank, threadIdx.x, blockDim.x);
    sync_item(a.cluster);  // those copies read open rows that the copy below may overwrite
  }
  const int64_t n_new = tok.e - open_end, n_read = tok.s - tok.open_start;
  copy_rows(a, tok, open_row0, open_end, n_new < n_read ? n_new : n_read, rank, threadIdx.x, blockDim.x);
}

template <typename OutT, int QUANT>
__global__ void __launch_bounds__(kMaxThreads) compressor_update_kernel(const CompressorArgs a) {
  extern __shared__ float smem[];
  const int rank = a.cluster > 1 ? static_cast<int>(cluster_rank()) : 0;
  const int dk = a.d / a.cluster, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const Smem sm = carve_smem(smem, dk, a.rope_dim);
  for (int i = tid; i < dk; i += blockDim.x) sm.norm_w[i] = a.norm_weight[rank * dk + i];
  for (int i = tid; i < a.rope_dim / 2; i += blockDim.x) sm.freq[i] = a.inv_freq[i];
  const int64_t item = blockIdx.x / a.cluster, n_items = gridDim.x / a.cluster;
  for (int64_t base = item; base < a.n_tokens; base += n_items * blockDim.x) {
    // the batch: token base + i * n_items for thread i; keep the tokens with work, in order
    const int64_t t = base + tid * n_items;
    int r = -1, p = 0, s = 0, e = 0, work = kNone;
    if (t < a.n_tokens) {
      r = a.req_slot[t];
      if (r >= 0 && r < a.n_slots) {  // else a PAD token (the reference uses the spare slot)
        p = a.positions[t];
        s = a.start_pos[t];
        e = a.end_pos[t];
        work = token_work(a, p, s, e);
      }
    }
    const unsigned close_ballot = __ballot_sync(0xffffffffu, work == kClose);
    const unsigned row_ballot = __ballot_sync(0xffffffffu, work == kWriteRow);
    const int n_warps = static_cast<int>(blockDim.x >> 5);
    __syncthreads();  // the previous batch's lists are consumed
    if (lane == 0) {
      sm.counts[warp] = __popc(close_ballot);
      sm.counts[n_warps + warp] = __popc(row_ballot);
    }
    __syncthreads();
    int at_close = 0, n_close = 0, at_row = 0, n_row = 0;
    for (int wi = 0; wi < n_warps; ++wi) {
      at_close += wi < warp ? sm.counts[wi] : 0;
      n_close += sm.counts[wi];
      at_row += wi < warp ? sm.counts[n_warps + wi] : 0;
      n_row += sm.counts[n_warps + wi];
    }
    if (work != kNone) {
      const unsigned below = (1u << lane) - 1u;
      const int at = work == kClose ? at_close + __popc(close_ballot & below)
                                    : static_cast<int>(blockDim.x) - 1 - (at_row + __popc(row_ballot & below));
      sm.list[at] = tid;
      sm.pos[at] = p;
      sm.start[at] = s;
      sm.end[at] = e;
      sm.slot[at] = r;
    }
    __syncthreads();
    // row-writing tokens: a warp each, all at once (nobody reads those rows in this step)
    for (int k = warp; k < n_row; k += n_warps) {
      const int at = static_cast<int>(blockDim.x) - 1 - k;
      Token tok;
      tok.t = base + sm.list[at] * n_items;
      tok.r = sm.slot[at];
      tok.p = sm.pos[at];
      tok.s = sm.start[at];
      tok.e = sm.end[at];
      tok.open_start = floor_div(tok.s, a.ratio) * a.ratio;
      copy_rows(a, tok, static_cast<int64_t>(a.c - 1) * a.ratio + mod_pos(tok.p, a.ratio), tok.p, 1, rank, lane, 32);
    }
    // closing tokens: one after another, the whole CTA (cluster) each
    for (int k = 0; k < n_close; ++k)
      process_token<OutT, QUANT>(a, base + sm.list[k] * n_items, sm.slot[k], sm.pos[k], sm.start[k], sm.end[k], sm,
                                 rank);
  }
}

// CTAs per token: channel slices for windows of many slots (one HCA close reads c*m*d*8 bytes of state), as
// long as a slice keeps whole FP8 blocks (FP4 rows need the whole row for the Hadamard transform).
int pick_cluster(const CompressorArgs& a) {
  if (const char* env = std::getenv("DSV4RT_COMPRESSOR_CLUSTER")) {  // tests and benchmarks: force a size
    const int k = std::atoi(env);
    if (k == 1 || k == 2 || k == 4 || k == 8) return k;
  }
  if (a.c * a.ratio < 32 || a.quant == kQuantFp4 || a.quant == kQuantFp4Sim) return 1;
  const bool fp8 = a.quant == kQuantFp8 || a.quant == kQuantFp8Sim;
  for (int k = 8; k > 1; k /= 2) {
    const int dk = a.d / k;
    if (a.d % k == 0 && dk % 4 == 0 && (!fp8 || dk % kFp8Block == 0)) return k;
  }
  return 1;
}

template <typename OutT, int QUANT>
cudaError_t launch_typed(CompressorArgs a, cudaStream_t stream) {
  a.cluster = pick_cluster(a);
  if ((QUANT == kQuantFp4 || QUANT == kQuantFp4Sim) && a.cluster != 1) a.cluster = 1;
  if (QUANT == kQuantFp8 || QUANT == kQuantFp8Sim) {
    while (a.cluster > 1 && (a.d / a.cluster) % kFp8Block != 0) a.cluster /= 2;
  }
  // clusters: 512 threads (one CTA an SM), else 256 (two); an odd number of items, so that closers (every m-th
  // token) spread over all of them
  const int threads = a.cluster > 1 ? 512 : 256, ctas_per_sm = a.cluster > 1 ? 1 : 2;
  const int dk = a.d / a.cluster;
  const size_t smem = sizeof(float) * smem_floats(dk, a.rope_dim, threads);
  int64_t items = static_cast<int64_t>(num_sms()) * ctas_per_sm / a.cluster;
  items -= (items % 2 == 0) ? 1 : 0;
  if (items > a.n_tokens) items = a.n_tokens;
  if (items < 1) items = 1;
  return launch_clustered(compressor_update_kernel<OutT, QUANT>, static_cast<unsigned>(items * a.cluster),
                          static_cast<unsigned>(threads), smem, stream, static_cast<unsigned>(a.cluster), a);
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

}  // namespace

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
