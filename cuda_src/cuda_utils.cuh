// CUDA-only helpers: vector packs, warp/block reductions, launch geometry.
#pragma once
#include <cuda_runtime.h>
#include <cstdlib>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include "cuda_src/common.h"

namespace jax_ops {

// PACK elements moved by one (up to 16-byte) load or store.
template <typename T, int PACK>
struct alignas(sizeof(T) * PACK) Pack {
  using value_type = T;
  T v[PACK];
};

template <typename T, int PACK>
__device__ __forceinline__ void load_pack(const T* p, float (&out)[PACK]) {
  const Pack<T, PACK> pk = *reinterpret_cast<const Pack<T, PACK>*>(p);
#pragma unroll
  for (int k = 0; k < PACK; ++k) out[k] = to_float(pk.v[k]);
}

template <typename T, int PACK>
__device__ __forceinline__ void store_pack(T* p, const float (&in)[PACK]) {
  Pack<T, PACK> pk;
#pragma unroll
  for (int k = 0; k < PACK; ++k) pk.v[k] = from_float<T>(in[k]);
  *reinterpret_cast<Pack<T, PACK>*>(p) = pk;
}

// Sum over aligned groups of WIDTH lanes; every lane of the group gets the same
// value (a + b == b + a exactly, so the butterfly is consistent across lanes).
template <int WIDTH>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int off = WIDTH / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off, WIDTH);
  return v;
}

// Number of multiprocessors of the current device, cached per device.
inline int sm_count() {
  static std::mutex mu;
  static int counts[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 132;
  std::lock_guard<std::mutex> lock(mu);
  if (counts[dev] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) n = 132;
    counts[dev] = n;
  }
  return counts[dev];
}

inline int max_smem_per_block() {
  int dev = 0, v = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 48 * 1024;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) return 48 * 1024;
  return v;
}

// Blocks for a persistent grid: as many as can be resident at once (capped by
// the work available), so a few waves never leave the tail half empty.
template <typename Kernel>
cudaError_t resident_blocks(Kernel kernel, int threads, size_t smem, int64_t work_blocks, int* blocks) {
  int per_sm = 0;
  cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem);
  if (err != cudaSuccess) return err;
  if (per_sm < 1) return cudaErrorInvalidConfiguration;
  const int64_t resident = int64_t(per_sm) * sm_count();
  *blocks = int(work_blocks < resident ? (work_blocks < 1 ? 1 : work_blocks) : resident);
  return cudaSuccess;
}

// ------------------------------------------------ launch helpers of row kernels ---

inline bool aligned_to(const void* p, size_t bytes) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

template <typename Kernel>
cudaError_t allow_smem(Kernel kernel, size_t smem) {
  if (smem <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
}

// Whether a shared-memory-caching kernel can run with `smem` dynamic bytes (its static
// shared memory counted too: the opt-in limit covers the sum), setting the opt-in and
// the grid. On any refusal the recorded error is cleared and the caller falls back to
// the uncached kernel.
template <typename Kernel>
bool cached_grid(Kernel kernel, int threads, size_t smem, int64_t work_blocks, int* blocks) {
  cudaFuncAttributes fa;
  if (cudaFuncGetAttributes(&fa, kernel) != cudaSuccess ||
      smem + fa.sharedSizeBytes > size_t(max_smem_per_block()) ||
      allow_smem(kernel, smem) != cudaSuccess ||
      resident_blocks(kernel, threads, smem, work_blocks, blocks) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return true;
}

// Row-group shape for a row of nvec packs, as launch(VPT, WIDTH) with compile-time
// constants: the next power of two of lanes (1..16) with one pack each when that covers
// the row, else 32 lanes with the next power of two of packs each, up to MAX_COLS values.
template <int PACK, int64_t MAX_COLS, int VPT = 1, typename Launch>
cudaError_t dispatch_group_shape(int64_t nvec, Launch&& launch) {
  using One = std::integral_constant<int, 1>;
  if constexpr (VPT == 1) {
    if (nvec <= 1) return launch(One{}, One{});
    if (nvec <= 2) return launch(One{}, std::integral_constant<int, 2>{});
    if (nvec <= 4) return launch(One{}, std::integral_constant<int, 4>{});
    if (nvec <= 8) return launch(One{}, std::integral_constant<int, 8>{});
    if (nvec <= 16) return launch(One{}, std::integral_constant<int, 16>{});
  }
  if constexpr (VPT * 32 * PACK <= MAX_COLS) {
    if (nvec <= 32 * VPT) return launch(std::integral_constant<int, VPT>{}, std::integral_constant<int, 32>{});
    return dispatch_group_shape<PACK, MAX_COLS, VPT * 2>(nvec, launch);
  }
  return cudaErrorInvalidValue;
}

// Threads for a block-per-row kernel: about four packs each, 128..1024, so that
// several rows per multiprocessor are in flight between the block barriers.
inline int block_threads(int64_t nvec) {
  const int64_t t = ((nvec + 3) / 4 + 31) / 32 * 32;
  return int(t < 128 ? 128 : (t > 1024 ? 1024 : t));
}

// ------------------------------------------- thread-block clusters (sm_90) ---
// A row can be split over the blocks of a Hopper thread-block cluster, which exchange
// row reductions through distributed shared memory. These wrappers compile to the
// cluster instructions for sm_90 and later; older targets never launch a cluster
// kernel (launch_clusters refuses), and trap if they somehow did.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define JO_HAS_CLUSTERS 1
#endif

__device__ __forceinline__ int cluster_rank() {
#ifdef JO_HAS_CLUSTERS
  return int(__clusterRelativeBlockRank());
#else
  __trap();
  return 0;
#endif
}

__device__ __forceinline__ int cluster_size() {
#ifdef JO_HAS_CLUSTERS
  return int(__clusterSizeInBlocks());
#else
  __trap();
  return 1;
#endif
}

// Barrier over every thread of the cluster; release/acquire, so shared-memory writes
// before it are visible to the other blocks' reads after it.
__device__ __forceinline__ void cluster_sync() {
#ifdef JO_HAS_CLUSTERS
  __cluster_barrier_arrive();
  __cluster_barrier_wait();
#else
  __trap();
#endif
}

// The address of `p` (this block's shared memory) in block `rank` of the cluster.
template <typename V>
__device__ __forceinline__ const V* cluster_map(const V* p, int rank) {
#ifdef JO_HAS_CLUSTERS
  return static_cast<const V*>(__cluster_map_shared_rank(p, unsigned(rank)));
#else
  __trap();
  return p;
#endif
}

// Largest cluster size used (portable: no opt-in attribute needed).
constexpr int kMaxClusterBlocks = 8;

// Whether `kernel` can be launched in clusters on the current device: compute
// capability 9.0 or later and the kernel's machine code built for it.
template <typename Kernel>
bool clusters_supported(Kernel kernel) {
  int dev = 0, major = 0;
  cudaFuncAttributes fa;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaFuncGetAttributes(&fa, kernel) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  cudaGetLastError();
  return major >= 9 && fa.binaryVersion >= 90;
}

inline cudaLaunchConfig_t cluster_config(cudaLaunchAttribute* attr, int cs, int threads, int64_t clusters,
                                         cudaStream_t stream) {
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = unsigned(cs);
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(clusters * cs));
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// Clusters of `cs` blocks of `threads` for a persistent 1-D grid of `kernel`: as many
// as can be resident at once, at most work_clusters.
template <typename... KArgs>
cudaError_t cluster_grid(void (*kernel)(KArgs...), int cs, int threads, int64_t work_clusters, int64_t* clusters) {
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = cluster_config(&attr, cs, threads, 1, nullptr);
  int resident = 0;
  const cudaError_t err = cudaOccupancyMaxActiveClusters(&resident, kernel, &cfg);
  cudaGetLastError();  // the query's own error is returned, not left for a later check
  if (err != cudaSuccess) return err;
  if (resident < 1) return cudaErrorInvalidConfiguration;
  *clusters = work_clusters < 1 ? 1 : (work_clusters < resident ? work_clusters : resident);
  return cudaSuccess;
}

template <typename... KArgs, typename... Args>
cudaError_t launch_clusters(void (*kernel)(KArgs...), int cs, int threads, int64_t clusters, cudaStream_t stream,
                            Args&&... args) {
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = cluster_config(&attr, cs, threads, clusters, stream);
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

// A tuning knob from the environment: the integer value of `name`, or `fallback` when
// it is unset or not an integer. Callers read it once (a function-local static). The
// defaults are the measured choices; the knobs let the GPU benchmarks measure the
// alternatives without a rebuild.
inline int env_knob(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  return *end == '\0' ? int(n) : fallback;
}

inline std::string cuda_error_message(const char* what, cudaError_t err) {
  return std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
}

}  // namespace jax_ops
