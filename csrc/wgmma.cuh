// Warpgroup helpers shared by the tensor-core kernels (attention.cu, moe.cu). No torch headers.
//   * wgmma fences, commits and waits run on sm_90a only: other targets compile a trap (the hosts launch these
//     kernels for compute capability 9.0 only). DSV4RT_WGMMA wraps a kernel file's own wgmma (and TMA) instructions
//     the same way.
//   * setmaxnreg (sm_90a, sm_100a): a warpgroup's register count per thread, raised or lowered; elsewhere a no-op (the
//     kernel then keeps the count its launch bounds give). It only moves registers within the launch's allocation,
//     and an increase the decreases do not cover waits forever.
#pragma once

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DSV4RT_WGMMA(...) asm volatile(__VA_ARGS__)
#else
#define DSV4RT_WGMMA(...) __trap()
#endif

namespace dsv4rt {

__device__ __forceinline__ void wgmma_fence() { DSV4RT_WGMMA("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { DSV4RT_WGMMA("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// until at most N of the warpgroup's committed groups are still in flight
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  DSV4RT_WGMMA("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void wgmma_wait_all() { wgmma_wait<0>(); }

template <int N>
__device__ __forceinline__ void reg_alloc() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(__CUDA_ARCH_FEAT_SM100_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void reg_dealloc() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(__CUDA_ARCH_FEAT_SM100_ALL)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

}  // namespace dsv4rt
