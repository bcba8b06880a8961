// Launchers of the mHC family (csrc/mhc.cu), called by the torch binding (csrc/mhc.cpp).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace dsv4rt {

// hc_pre (head = false) and hc_head (head = true). All tensors contiguous; fn, base, scale, post, comb fp32.
struct HcMixArgs {
  const void* x;      // [T, n, D] activation dtype
  const float* fn;    // [M, n*D], M = (2+n)n (pre) or n (head)
  const float* base;  // [M]
  const float* scale; // [3] (pre) or [1] (head)
  void* out;          // [T, D] activation dtype (collapsed streams)
  float* post;        // [T, n] (pre only)
  float* comb;        // [T, n, n] (pre only)
  int64_t n_tokens;
  int n;
  int d;
  int iters;
  int dtype;  // 0 float32, 1 bfloat16
  bool head;
  bool sinkhorn_smem = false;  // set by the launcher (DSV4RT_MHC_SINKHORN=smem): Sinkhorn in shared memory at every n
  float eps;
  float norm_eps;
  const float* norm_w = nullptr;  // [D] fp32, or null: out = rms_norm(collapsed, norm_w, out_eps)
  float out_eps = 0.0f;
  // hc_post_pre (hc_post_pre_launch): x is then the hc_post output these make, [T, n, D], written by the launch
  const void* post_x = nullptr;      // [T, n, D] the streams before
  const void* post_y = nullptr;      // [T, D] the sublayer's output
  const float* post_post = nullptr;  // [T, n]
  const float* post_comb = nullptr;  // [T, n, n]
  bool post_fused = false;           // set by the launcher: the partial grid writes x (the finish grid reads it late)
};

// hc_post: out[t, k] = post[t, k] * y[t] + sum_j comb[t, j, k] * x[t, j].
struct HcPostArgs {
  const void* x;        // [T, n, D]
  const void* y;        // [T, D]
  const float* post;    // [T, n]
  const float* comb;    // [T, n, n]
  void* out;            // [T, n, D]
  int64_t n_tokens;
  int n;
  int d;
  int dtype;  // 0 float32, 1 bfloat16
};

cudaError_t hc_mix_launch(const HcMixArgs& args, cudaStream_t stream);
// hc_post (post_x, post_y, post_post, post_comb -> x), then hc_mix on x: at decode the post runs inside the mix's
// partial grid (DSV4RT_MHC_POST_FUSE=0: hc_post's own grid first, always).
cudaError_t hc_post_pre_launch(const HcMixArgs& args, cudaStream_t stream);
cudaError_t hc_post_launch(const HcPostArgs& args, cudaStream_t stream);

}  // namespace dsv4rt
