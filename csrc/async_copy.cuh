// cp.async helpers shared by the kernels (sm_80+): 16-byte global -> shared copies that complete
// asynchronously, cached in L2 only (.cg). A copy is visible to the issuing thread after cp_async_wait<N>()
// (at most N newer groups still in flight) or cp_async_wait_all(); other threads need a barrier after that.
// Variants a single kernel needs (zero-fill, L2 cache hints, 8-byte copies) stay in that kernel's file.
// No torch headers.
#pragma once

#include <cstdint>

namespace dsv4rt {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) { cp_async16(smem_u32(dst), src); }

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

}  // namespace dsv4rt
