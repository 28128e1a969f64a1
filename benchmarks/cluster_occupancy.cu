// How many thread-block clusters of each size an H100 keeps resident, and on which SMs:
// the GPC structure that decides whether a cluster kernel leaves SMs idle.
// nvcc -std=c++17 -arch=sm_90 -o cluster_occupancy benchmarks/cluster_occupancy.cu
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cooperative_groups.h>

#define CHECK(x)                                                                 \
  do {                                                                           \
    cudaError_t e_ = (x);                                                        \
    if (e_ != cudaSuccess) {                                                     \
      std::printf("%s failed: %s\n", #x, cudaGetErrorString(e_));                \
      std::exit(1);                                                              \
    }                                                                            \
  } while (0)

__global__ void __launch_bounds__(1024) where(int* sm, int* rank) {
  extern __shared__ char pad[];
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  if (threadIdx.x == 0) {
    sm[blockIdx.x] = int(id);
    rank[blockIdx.x] = int(cooperative_groups::this_cluster().block_rank());
    pad[0] = 0;
  }
  cooperative_groups::this_cluster().sync();
}

int main() {
  CHECK(cudaFuncSetAttribute(where, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  CHECK(cudaFuncSetAttribute(where, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::printf("SMs %d\n", sms);
  struct Cfg { int threads; int smem_kib; };
  for (Cfg c : {Cfg{1024, 112}, Cfg{512, 56}, Cfg{512, 112}}) {
    for (int cs = 1; cs <= 16; ++cs) {
      cudaLaunchAttribute attr;
      attr.id = cudaLaunchAttributeClusterDimension;
      attr.val.clusterDim.x = cs, attr.val.clusterDim.y = 1, attr.val.clusterDim.z = 1;
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(cs);
      cfg.blockDim = dim3(c.threads);
      cfg.dynamicSmemBytes = size_t(c.smem_kib) * 1024;
      cfg.attrs = &attr;
      cfg.numAttrs = 1;
      int n = 0;
      cudaError_t e = cudaOccupancyMaxActiveClusters(&n, where, &cfg);
      if (e != cudaSuccess) { std::printf("threads %d smem %d KiB cs %2d: %s\n", c.threads, c.smem_kib, cs, cudaGetErrorString(e)); cudaGetLastError(); continue; }
      // Launch that many clusters and count the distinct SMs they land on.
      const int blocks = n * cs;
      int *sm = nullptr, *rank = nullptr;
      CHECK(cudaMalloc(&sm, blocks * sizeof(int)));
      CHECK(cudaMalloc(&rank, blocks * sizeof(int)));
      cfg.gridDim = dim3(blocks);
      CHECK(cudaLaunchKernelEx(&cfg, where, sm, rank));
      CHECK(cudaDeviceSynchronize());
      std::vector<int> h(blocks);
      CHECK(cudaMemcpy(h.data(), sm, blocks * sizeof(int), cudaMemcpyDeviceToHost));
      std::vector<int> used(sms, 0);
      for (int b : h) used[b]++;
      int distinct = 0;
      for (int u : used) distinct += u > 0;
      std::printf("threads %4d smem %3d KiB cs %2d: %3d clusters, %3d blocks on %3d SMs\n", c.threads, c.smem_kib, cs, n,
                  blocks, distinct);
      if (c.threads == 1024 && (cs == 2 || cs == 8 || cs == 16)) {
        std::printf("  SMs by cluster:");
        for (int b = 0; b < blocks; ++b) std::printf("%s%d", b % cs == 0 ? " |" : ",", h[b]);
        std::printf("\n");
      }
      CHECK(cudaFree(sm));
      CHECK(cudaFree(rank));
    }
  }
  return 0;
}
