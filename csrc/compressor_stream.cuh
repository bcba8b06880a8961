// Streaming path of the KV compressor update (csrc/compressor.cu dispatches here first): large calls (prefill
// chunks), where the cost is streaming the step's fp32 kv/score rows at memory bandwidth.
// compressor_stream_launch returns false when it does not take the call (decided from the shapes and the
// DSV4RT_COMPRESSOR_STREAM environment variable only); the general kernel in compressor.cu then runs.
#pragma once

#include <cuda_runtime_api.h>

#include "compressor.h"

namespace dsv4rt {
namespace stream {

inline bool compressor_stream_launch(const CompressorArgs& /*a*/, cudaStream_t /*stream*/, cudaError_t* /*err*/) {
  return false;
}

}  // namespace stream
}  // namespace dsv4rt
