// Launchers of the row-norm and rotation family (csrc/norm.cu), called by the torch binding (csrc/norm.cpp).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace dsv4rt {

// dtype codes of x / out (both the same): 0 float32, 1 bfloat16, 2 float16.

// out[r, :] = (w * (x[r, :] * rsqrt(mean(x[r, :]^2) + eps))) in x's dtype, fp32 math; x, out [rows, d]; w [d] fp32.
void rms_norm_launch(const void* x, const float* w, void* out, int dtype, int64_t rows, int64_t d, float eps,
                     cudaStream_t stream);

// x, out [tokens, heads, d]; cos, sin [tokens, half] fp32. Each (token, head) row: y = x * T(rsqrt(mean(x^2) + eps))
// (the factor rounded to x's dtype, the product too), then its last 2 * half channels rotated pairwise by
// (cos, sin) of its token in fp32 (`norm` false: no normalisation, a rotation only; `inverse`: by the negated angle).
void rope_rows_launch(const void* x, const float* cos, const float* sin, void* out, int dtype, int64_t tokens,
                      int64_t heads, int64_t d, int64_t half, bool norm, bool inverse, float eps,
                      cudaStream_t stream);

// x, out [rows, d]: the FP8 row format's quantise-dequantise (ops/kv_quant.py kv_fp8_fake_quant): the first
// d - rope_dim channels in blocks of 64 through e4m3 with a power-of-two scale, the rest rounded to bf16.
void kv_fp8_fake_quant_launch(const void* x, void* out, int dtype, int64_t rows, int64_t d, int64_t rope_dim,
                              cudaStream_t stream);

// x, out [rows, d], d in {32, 64, 128, 256}: the normalised Hadamard transform of each row (fp32), then FP4 e2m1
// quantise-dequantise in blocks of 32 with a power-of-two scale (kv_quant.py idx_fp4_fake_quant(hadamard(x))).
void idx_fp4_hadamard_fake_quant_launch(const void* x, void* out, int dtype, int64_t rows, int64_t d, float inv_sqrt_d,
                                        cudaStream_t stream);

// x, out [rows, d]; w [d] fp32; cos, sin [rows, half] fp32: rms_norm_launch, then rope_rows_launch (no norm, not
// inverse) on its output, then (fp8) kv_fp8_fake_quant_launch with rope_dim = 2 * half, in one launch and bit for bit.
// Returns false, launching nothing, where that kernel does not apply (d or d - 2 * half not a multiple of 16 bytes,
// more than 256 such groups, with fp8 d - 2 * half not a positive multiple of 64, x / w / out not 16-byte aligned):
// the caller then runs the three.
bool kv_norm_rope_quant_launch(const void* x, const float* w, const float* cos, const float* sin, void* out, int dtype,
                               int64_t rows, int64_t d, int64_t half, bool fp8, float eps, cudaStream_t stream);

}  // namespace dsv4rt
