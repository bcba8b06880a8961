// Helpers shared by the torch bindings (csrc/*.cpp; never included by the torch-free .cu files).
#pragma once

#include <cstdint>
#include <string>

#include <c10/core/Device.h>

namespace dsv4rt {

// Numbers and devices in TORCH_CHECK messages are formatted with std::to_string / Device::str, never streamed:
// on the GPU image, streaming an integer into a check message (std::ostream::operator<<(long) in the extension)
// crashed the process instead of raising the error.
inline std::string num(int64_t v) { return std::to_string(v); }
inline std::string dev_str(const c10::Device& d) { return d.str(); }

}  // namespace dsv4rt
