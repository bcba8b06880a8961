// Launchers of the MoE family (csrc/moe.cu), called by the torch binding (csrc/moe.cpp). No torch headers.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace dsv4rt {

// Element type of activations and expert weights.
enum MoeDType : int { kMoeF32 = 0, kMoeBF16 = 1, kMoeF16 = 2 };

// Router logits for a few tokens: logits [T, E] fp32 = x [T, D] (dtype, cast to fp32) . weight [E, D] (fp32, or bf16
// when weight_bf16: cast to fp32 exactly), one launch of the GEMV below (moe_gemv_launch with one weight), the weight
// loads issued before the wait for x. T <= moe_gate_max_tokens, D % 8 == 0.
constexpr int moe_gate_max_tokens = 8;
cudaError_t moe_gate_launch(const void* x, int dtype, const void* weight, bool weight_bf16, int64_t n_tokens,
                            int64_t dim, int64_t n_experts, float* logits, cudaStream_t stream, bool pdl);

// The same product for up to moe_gemv_max_weights weights of one type, each [rows_i, D] with its own output
// (out_i[t, r] = x[t, :] . w_i[r, :], fp32 sums): the rows of all of them form one grid, so the projections of one x
// take one launch. Two forms:
//   out_fp32: fp32 outputs (moe_gate, linear_fp32), weights fp32 or bf16 (weight_dtype), x of any MoeDType;
//   else (linear): x, weights and outputs all bf16 or all fp16, each sum rounded once.
// x [T, ldx] (D <= ldx); with group_rows > 0, grid row r of a weight reads x's columns [g * D, g * D + D) for
// g = r / group_rows (a grouped projection: one weight [G * group_rows, D]). Output i is [T, rows_i], contiguous.
// T <= moe_gate_max_tokens, D % 8 == 0, ldx % 8 == 0.
constexpr int moe_gemv_max_weights = 6;
struct GemvWeights {
  const void* w[moe_gemv_max_weights];
  void* out[moe_gemv_max_weights];
  int64_t end[moe_gemv_max_weights];  // cumulative rows: weight i holds grid rows [end[i - 1], end[i])
  int64_t group_rows;                 // 0: no groups
  int n;                              // weights, 1 .. moe_gemv_max_weights
};
cudaError_t moe_gemv_launch(const void* x, int dtype, const GemvWeights& ws, int weight_dtype, bool out_fp32,
                            int64_t n_tokens, int64_t dim, int64_t ldx, cudaStream_t stream, bool pdl);

// Top-k router: logits [T, E] fp32; bias [E] fp32 (bias_bf16: bf16). weights [T, k] fp32, ids [T, k] int32.
cudaError_t moe_route_launch(const float* logits, const void* bias, bool bias_bf16, int64_t n_tokens, int n_experts,
                             int topk, float scale, float* weights, int32_t* ids, cudaStream_t stream, bool pdl);

// Hash router: ids = tid2eid[token_ids] (tid2eid [V, k], int64 or int32; token_ids [T], int64 or int32).
cudaError_t moe_hash_route_launch(const float* logits, const void* tid2eid, bool tid2eid_i64, const void* token_ids,
                                  bool token_ids_i64, int64_t vocab, int64_t n_tokens, int n_experts, int topk,
                                  float scale, float* weights, int32_t* ids, cudaStream_t stream, bool pdl);

// Device-side routing plan of one moe_experts call (P = T * k pairs (token, choice), S = min(E, P) slots).
// int32 workspace, moe_plan_words(E, P) words:
//   expert_end [E]   cumulative pair counts (inclusive): the grouped-GEMM offsets
//   slot_expert [S]  the distinct chosen experts in ascending order, -1 past the last
//   slot_off [S+1]   first sorted pair of each slot; slot_off[s] = total valid pairs past the last slot
//   pair_tok [P]     token of each sorted pair (pairs grouped by expert); 0 past the valid pairs
//   pos_of [P]       sorted position of pair t*k+j, -1 when ids[t, j] is outside [0, E)
struct MoePlan {
  int32_t* expert_end;
  int32_t* slot_expert;
  int32_t* slot_off;
  int32_t* pair_tok;
  int32_t* pos_of;
};

inline int64_t moe_plan_words(int64_t n_experts, int64_t n_pairs) {
  const int64_t slots = n_experts < n_pairs ? n_experts : n_pairs;
  return n_experts + 2 * slots + 1 + 2 * n_pairs;
}

MoePlan moe_plan_views(int32_t* workspace, int64_t n_experts, int64_t n_pairs);

// Everything a moe_experts path needs. Shapes: x [T, D]; w13 [E, 2I, D] (gate rows, then up rows); w2 [E, D, I];
// shared_gate, shared_up [I, D] and shared_down [D, I] (the shared expert, weight 1 for every token; all three
// null when absent); weights [T, k] fp32; ids [T, k] int32; out [T, D] (dtype).
struct MoeExpertsArgs {
  const void* x;
  const void* w13;
  const void* w2;
  const void* shared_gate;
  const void* shared_up;
  const void* shared_down;
  const float* weights;
  const int32_t* ids;
  void* out;
  MoePlan plan;
  int64_t n_tokens;
  int64_t dim;    // D
  int64_t inter;  // I
  int n_experts;
  int topk;
  float limit;
  int dtype;  // MoeDType
  bool pdl;   // programmatic dependent launches (overlap each kernel's start with its predecessor's tail)
  bool tiny_prefetch;  // tiny path: the gate/up kernel prefetches the down kernel's first expert into L2
  // x was complete before the kernel that precedes this call's first launch started (the model's order: x, then the
  // router kernels, then this call). The plan kernel then lets its successor start at once, and the shared expert's
  // gate/up work (which needs x but no routing) runs before the wait for the routing.
  bool x_ready;
  // Small path, one token (and k <= E): slot s is choice s, its expert ids[0, s] read directly by the GEMV and
  // combine kernels, and no plan kernel runs (the routing chain ends at the router). Set by the binding when allowed
  // (DSV4RT_MOE_DIRECT=0: never); the small-path launcher applies it to one-token calls only.
  bool direct;
  // With x_ready, the small path's shared-expert up CTAs also prefetch the shared down rows into L2 (last to be
  // evicted) while the routing runs; the down kernel reads them from there and resets their priority (the binding
  // sets it for calls of up to 8 tokens; DSV4RT_MOE_KEEP=0: never).
  bool keep_shared;
};

// Tiny batches (T <= moe_tiny_max_tokens, T * k <= moe_tiny_max_pairs, bf16/fp16, D and I multiples of 32; the
// binding sends batches here only up to its kTinyTokens / DSV4RT_MOE_TINY): two
// launches and no plan kernel. Every CTA derives the plan (distinct experts, per-token weights) from ids itself;
// the gate/up kernel loops over all chosen experts for its 8 channels, the down kernel over all of them for its 16
// output rows and writes out directly (the weighted combine folded in). act: [(min(E, P) + shared) * T, I] scratch.
constexpr int moe_tiny_max_tokens = 8;
constexpr int moe_tiny_max_pairs = 64;
inline int64_t moe_tiny_act_rows(int64_t n_experts, int64_t n_tokens, int64_t topk, bool shared) {
  const int64_t pairs = n_tokens * topk;
  return ((n_experts < pairs ? n_experts : pairs) + (shared ? 1 : 0)) * n_tokens;
}
cudaError_t moe_experts_tiny_launch(const MoeExpertsArgs& a, void* act, cudaStream_t stream);

// Small batches: plan, then the gate/up GEMV + activation and the down GEMV over the chosen experts only (each
// chosen expert's weights read once per 8 * groups tokens; the shared expert is one more slot holding every token),
// then the weighted combine. act: [P + T_shared, I] dtype, y: [P + T_shared, D] fp32 scratch (T_shared = T with a
// shared expert, else 0; its rows follow the P routed pairs). tensor_cores: mma path (bf16/fp16, D and I multiples
// of 32); otherwise a plain fp32-FMA path.
cudaError_t moe_experts_small_launch(const MoeExpertsArgs& a, void* act, float* y, bool tensor_cores,
                                     cudaStream_t stream);

// Grouped GEMMs of the routed experts for large batches (bf16, sm_90 only: moe_gmm_supported), one launch each:
//   up (up = true):  act[p, i] = clamped SwiGLU(a[p] . w13[e, i], a[p] . w13[e, I + i]), a = xs [P, D], K = D;
//   down:            out[p, n] = a[p] . w2[e, n] (bf16), a = act [P, I], K = I;
// for the rows p of expert e: [expert_end[e - 1], expert_end[e]) (the plan's inclusive offsets). The launcher encodes
// the TMA tensor maps of a and b (host-side, no stream work: capture-safe).
struct MoeGmmArgs {
  const void* a;               // [P, K] bf16, rows in expert order
  const void* b;               // [E, b_rows, K] bf16 (w13: b_rows = 2I; w2: b_rows = D)
  const int32_t* expert_end;   // [E]
  void* out;                   // up: act [P, I]; down: y [P, D] (bf16, row stride ldo elements)
  int64_t k, b_rows, ldo, inter;
  float limit;
  int64_t a_rows;              // P: rows of a
  int n_experts;               // E
};
// D a multiple of 256, I of 128, E at most 384, an sm_90 device and the driver's tensor-map encoder
bool moe_gmm_supported(int64_t dim, int64_t inter, int64_t n_experts);
cudaError_t moe_gmm_launch(const MoeGmmArgs& g, bool up, cudaStream_t stream);

// Large batches (the grouped GEMMs above or at::_grouped_mm, and the shared expert's plain GEMMs, run by the binding
// between these launches):
//   moe_plan_launch:   the routing plan;
//   moe_act_launch:    act[p] = clamped SwiGLU of (gate[p], up[p]) (row stride h_stride, elements) for p < n_rows;
//   moe_combine_launch: out[t] = sum_j weights[t, j] * y[pos_of[t, j]] (+ shared_y[t] when not null) (y [P, D] and
//                      shared_y [T, D] of dtype, row strides y_stride and shared_stride).
cudaError_t moe_plan_launch(const MoeExpertsArgs& a, cudaStream_t stream);
cudaError_t moe_act_launch(const MoeExpertsArgs& a, const void* gate, const void* up, int64_t h_stride, void* act,
                           int64_t n_rows, cudaStream_t stream);
cudaError_t moe_combine_launch(const MoeExpertsArgs& a, const void* y, bool y_f32, int64_t y_stride,
                               const void* shared_y, int64_t shared_stride, cudaStream_t stream);

}  // namespace dsv4rt
