#pragma once
// Programmatic dependent launch (PDL) for the layer's kernels. A decode step
// is ~20 small dependent kernels per layer; launched plainly, each one's
// launch and ramp-up waits for the previous one to drain. Launched with
// pdl_launch, a kernel's CTAs may become resident while the previous kernel
// still runs; they must call pdl_start() before touching memory that an
// earlier kernel writes (or reads: its outputs may still be in use). Nothing
// else changes: griddepcontrol.wait returns once every earlier grid has
// completed and its writes are visible, so results are those of plain stream
// order. A kernel may read data that no kernel writes (weights) before
// pdl_start() to overlap that traffic with the previous kernel's tail, and
// so the step metadata (DeviceStep's arrays, the real token count): copies
// and plain launches build it, and a kernel launched without PDL is complete
// before any kernel after it starts. The same holds for the output of a
// kernel that never calls launch_dependents (the indexer's and the
// attention's plan kernels): nothing after it starts before it ends. Every CTA calls pdl_start() before it
// exits, even one with nothing to do: a grid's completion then implies its
// predecessors', which the next kernel's wait relies on.
#include <cuda_runtime.h>

#include <utility>

namespace dsv4::cuda {

// Lets the grid launched after this one (with the PDL attribute) start
// before this one ends.
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
// Waits until the grids this one depends on have completed and their memory
// is visible (a no-op when it was launched without the attribute).
__device__ __forceinline__ void wait_for_prior_grids() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

// First statement of a kernel launched with pdl_launch: the next kernel may
// start its CTAs, and this one waits for everything before it.
__device__ __forceinline__ void pdl_start() {
  launch_dependents();
  wait_for_prior_grids();
}

// The launch attribute for clusters of `cluster` CTAs (an int: along x;
// also what the linears ask the occupancy API about).
inline cudaLaunchAttribute cluster_attribute(dim3 cluster) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = cluster.x;
  attr.val.clusterDim.y = cluster.y;
  attr.val.clusterDim.z = cluster.z;
  return attr;
}

// How many clusters of `cluster` CTAs (of `threads` threads and `smem`
// bytes of dynamic shared memory) of `kernel` the device holds resident at
// once, into *count: what the linears choose their splits of k by.
template <typename Kernel>
inline cudaError_t max_active_clusters(Kernel kernel, dim3 cluster, unsigned threads, size_t smem, int* count) {
  cudaLaunchAttribute attr = cluster_attribute(cluster);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = cluster;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return cudaOccupancyMaxActiveClusters(count, kernel, &cfg);
}

// kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream
// serialization allowed, its CTAs in clusters of `cluster` (an int: along x;
// 1: no clusters). Errors surface in the caller's cudaGetLastError().
template <typename... Params, typename... Args>
inline void pdl_launch_clustered(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                 dim3 cluster, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2]{};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  attr[1] = cluster_attribute(cluster);
  cfg.attrs = attr;
  cfg.numAttrs = cluster.x * cluster.y * cluster.z > 1 ? 2 : 1;
  cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

template <typename... Params, typename... Args>
inline void pdl_launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  pdl_launch_clustered(kernel, grid, block, smem, stream, dim3(1), std::forward<Args>(args)...);
}

}  // namespace dsv4::cuda
