// Launch helpers shared by the kernels: SM count, thread-block-cluster launches and the cluster primitives
// (sm_90+: a cluster's CTAs run at once and read each other's shared memory). No torch headers.
#pragma once

#include <utility>

#include <cooperative_groups.h>
#include <cuda_runtime.h>

namespace dsv4rt {

// Multiprocessors of the current device (grid sizes of grid-stride kernels).
inline int num_sms() {
  int dev = 0, n = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  return n > 0 ? n : 1;
}

__device__ __forceinline__ unsigned cluster_rank() { return cooperative_groups::this_cluster().block_rank(); }

__device__ __forceinline__ void cluster_sync() { cooperative_groups::this_cluster().sync(); }

// The same shared-memory variable in CTA `rank` of this cluster.
template <typename T>
__device__ __forceinline__ T* cluster_map(T* p, unsigned rank) {
  return cooperative_groups::this_cluster().map_shared_rank(p, rank);
}

// Programmatic dependent launch (sm_90+, no-ops before): a grid launched with programmatic stream serialization
// may be scheduled once every CTA of the grid before it has called pdl_launch_dependents() (or exited); pdl_wait()
// returns when the previous grid has completed and its writes are visible. Every CTA calls pdl_wait() before it
// exits, so a grid completes only after the one before it, and so on back. Step metadata (request slots, positions,
// request bounds, block tables: the prepare step's inputs) may be read before the wait: no dsv4rt kernel writes
// them, and a grid that does (a torch op, any launch without early triggers) completes before the next grid starts,
// so it completes before any later grid starts too. Nothing is written before the wait: a grid that runs on may
// still read a tensor the caching allocator has freed (stream order) and given to this grid's outputs or scratch.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...), in clusters of `cluster` CTAs along x (1: no clusters) and, with
// `pdl`, with programmatic stream serialization: the grid may be scheduled while its predecessor on the stream still
// runs, so its kernel must pdl_wait() before it touches what the predecessor writes.
template <typename... Params, typename... Args>
cudaError_t launch_ex(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                      unsigned cluster, bool pdl, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (cluster > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster;
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace dsv4rt
