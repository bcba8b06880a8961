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

}  // namespace dsv4rt
