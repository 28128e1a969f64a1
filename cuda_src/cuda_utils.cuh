// CUDA-only helpers: vector packs, warp/block reductions, launch geometry.
#pragma once
#include <cuda_runtime.h>
#include <cstdlib>
#include <map>
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

// group_sum of N values at once, their shuffles interleaved (independent chains).
template <int WIDTH, int N>
__device__ __forceinline__ void group_sums(float (&v)[N]) {
#pragma unroll
  for (int off = WIDTH / 2; off > 0; off /= 2)
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], off, WIDTH);
}

// Host-side launch queries (occupancy, function and device attributes) cost up to
// microseconds each, and a jitted step calls our handlers hundreds of times with the same
// few kernels and shapes: on a host-bound step (XLA launching thunk by thunk) that time is
// the step's. Their answers are cached per device; only successful answers are kept.
struct LaunchQuery {
  int dev, kind, threads;
  const void* fn;
  size_t smem;
  bool operator<(const LaunchQuery& o) const {
    if (dev != o.dev) return dev < o.dev;
    if (kind != o.kind) return kind < o.kind;
    if (threads != o.threads) return threads < o.threads;
    if (fn != o.fn) return fn < o.fn;
    return smem < o.smem;
  }
};

enum LaunchQueryKind { kQuerySmCount, kQueryMaxSmem, kQueryCcMajor, kQueryBlocksPerSm, kQueryClusters,
                       kQueryStaticSmem, kQueryBinaryVersion, kQuerySmemOptIn, kQueryMemClockKhz, kQueryBusBits };

struct LaunchQueryCache {
  std::mutex mu;
  std::map<LaunchQuery, int> answers;
};

inline LaunchQueryCache& launch_query_cache() {
  static LaunchQueryCache cache;  // one per process: an inline function's static
  return cache;
}

// The cached value of `query`, computing it with `compute(int*)` on a miss.
template <typename Compute>
cudaError_t cached_launch_query(LaunchQuery query, int* value, Compute&& compute) {
  std::mutex& mu = launch_query_cache().mu;
  std::map<LaunchQuery, int>& answers = launch_query_cache().answers;
  if (cudaGetDevice(&query.dev) != cudaSuccess) {
    cudaGetLastError();
    query.dev = -1;
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto it = answers.find(query);
    if (it != answers.end()) {
      *value = it->second;
      return cudaSuccess;
    }
  }
  const cudaError_t err = compute(value);
  if (err == cudaSuccess) {
    std::lock_guard<std::mutex> lock(mu);
    answers[query] = *value;
  }
  return err;
}

inline int device_attribute(cudaDeviceAttr attr, LaunchQueryKind kind, int fallback) {
  int v = 0;
  const cudaError_t err = cached_launch_query({0, kind, 0, nullptr, 0}, &v, [&](int* out) {
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(out, attr, dev);
    return e;
  });
  if (err != cudaSuccess) cudaGetLastError();
  return err == cudaSuccess && v > 0 ? v : fallback;
}

// Number of multiprocessors of the current device.
inline int sm_count() { return device_attribute(cudaDevAttrMultiProcessorCount, kQuerySmCount, 132); }

// Peak DRAM bandwidth of the current device in GB/s: two transfers a memory clock (kHz)
// over the bus (bits); 0 where the device does not say. H100 SXM: 2619 MHz x 5120 bits,
// 3352 GB/s (the H200 by its specification: 4800).
inline double dram_peak_gbps() {
  const double khz = device_attribute(cudaDevAttrMemoryClockRate, kQueryMemClockKhz, 0);
  const double bits = device_attribute(cudaDevAttrGlobalMemoryBusWidth, kQueryBusBits, 0);
  return 2.0 * khz * 1e3 * bits / 8.0 / 1e9;
}

inline int max_smem_per_block() {
  return device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, kQueryMaxSmem, 48 * 1024);
}

template <typename Kernel>
cudaError_t max_blocks_per_sm(Kernel kernel, int threads, size_t smem, int* per_sm) {
  const void* fn = reinterpret_cast<const void*>(kernel);
  return cached_launch_query({0, kQueryBlocksPerSm, threads, fn, smem}, per_sm, [&](int* out) {
    const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(out, kernel, threads, smem);
    return err == cudaSuccess && *out < 1 ? cudaErrorInvalidConfiguration : err;
  });
}

// The kernel's static shared memory (kind kQueryStaticSmem) or binary version.
template <typename Kernel>
cudaError_t kernel_attribute(Kernel kernel, LaunchQueryKind kind, int* value) {
  const void* fn = reinterpret_cast<const void*>(kernel);
  return cached_launch_query({0, kind, 0, fn, 0}, value, [&](int* out) {
    cudaFuncAttributes fa;
    const cudaError_t err = cudaFuncGetAttributes(&fa, kernel);
    if (err == cudaSuccess) *out = kind == kQueryStaticSmem ? int(fa.sharedSizeBytes) : fa.binaryVersion;
    return err;
  });
}

// Blocks for a persistent grid: as many as can be resident at once (capped by
// the work available), so a few waves never leave the tail half empty.
template <typename Kernel>
cudaError_t resident_blocks(Kernel kernel, int threads, size_t smem, int64_t work_blocks, int* blocks) {
  int per_sm = 0;
  cudaError_t err = max_blocks_per_sm(kernel, threads, smem, &per_sm);
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

// Opt the kernel in to `smem` dynamic bytes (per device). The attribute is the kernel's
// maximum, so it is only ever raised: a smaller request after a larger one must not
// lower it under a size an earlier launch decision relied on (the cache keeps the
// largest size set for each kernel).
template <typename Kernel>
cudaError_t allow_smem(Kernel kernel, size_t smem) {
  if (smem <= 48 * 1024) return cudaSuccess;
  LaunchQuery key{0, kQuerySmemOptIn, 0, reinterpret_cast<const void*>(kernel), 0};
  if (cudaGetDevice(&key.dev) != cudaSuccess) {
    cudaGetLastError();
    key.dev = -1;
  }
  LaunchQueryCache& cache = launch_query_cache();
  std::lock_guard<std::mutex> lock(cache.mu);
  const auto it = cache.answers.find(key);
  if (it != cache.answers.end() && size_t(it->second) >= smem) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err == cudaSuccess) cache.answers[key] = int(smem);
  return err;
}

// Whether a shared-memory-caching kernel can run with `smem` dynamic bytes (its static
// shared memory counted too: the opt-in limit covers the sum), setting the opt-in and
// the grid. On any refusal the recorded error is cleared and the caller falls back to
// the uncached kernel.
template <typename Kernel>
bool cached_grid(Kernel kernel, int threads, size_t smem, int64_t work_blocks, int* blocks) {
  int static_smem = 0;
  if (kernel_attribute(kernel, kQueryStaticSmem, &static_smem) != cudaSuccess ||
      smem + size_t(static_smem) > size_t(max_smem_per_block()) ||
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

// The same, but rows of up to 3 * 2^k packs take three packs (3 * 2^k / 32) a lane, so
// that no slot idles at 384 / 768 / 1536 / 3072 16-bit columns, where the power-of-two
// shape leaves a quarter of the lanes' slots idle: with ON16, 33-48 packs on 16 lanes at
// three a lane; with ON32, 65-96 / 129-192 / 257-384 packs on 32 lanes at 3 / 6 / 12 a
// lane. `on` false: the power-of-two shapes only.
template <int PACK, int64_t MAX_COLS, bool ON16, bool ON32, typename Launch>
cudaError_t dispatch_group_shape_thirds(int64_t nvec, bool on, Launch&& launch) {
  using W32 = std::integral_constant<int, 32>;
  if constexpr (ON16 && 48 * PACK <= MAX_COLS)
    if (on && nvec > 32 && nvec <= 48) return launch(std::integral_constant<int, 3>{}, std::integral_constant<int, 16>{});
  if constexpr (ON32) {
    if constexpr (96 * PACK <= MAX_COLS)
      if (on && nvec > 64 && nvec <= 96) return launch(std::integral_constant<int, 3>{}, W32{});
    if constexpr (192 * PACK <= MAX_COLS)
      if (on && nvec > 128 && nvec <= 192) return launch(std::integral_constant<int, 6>{}, W32{});
    if constexpr (384 * PACK <= MAX_COLS)
      if (on && nvec > 256 && nvec <= 384) return launch(std::integral_constant<int, 12>{}, W32{});
  }
  return dispatch_group_shape<PACK, MAX_COLS>(nvec, launch);
}

// Threads for nvec packs at k packs a thread, in whole warps.
inline int warp_threads(int64_t nvec, int k) { return int(((nvec + k - 1) / k + 31) / 32 * 32); }

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

// Blocks in the cluster this block was launched in: 1 without a cluster, and on
// targets older than sm_90 (which cannot launch one), so kernels that only may be
// launched in clusters can ask.
__device__ __forceinline__ int launched_cluster_size() {
#ifdef JO_HAS_CLUSTERS
  return int(__clusterSizeInBlocks());
#else
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

// A flag one block raises for another of the same grid (gpu scope, sm_70+). Raised by one
// thread after the block's barrier, the release store orders the block's earlier writes
// before the flag (cumulativity; CUTLASS's serial split-K semaphore does the same); the
// acquire load, followed by the waiter's barrier, orders its block's later reads after
// it. A handshake, not a reduction: the values are added in a fixed order by ordinary
// loads and stores.
__device__ __forceinline__ void flag_raise(int* flag) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;\n" ::"l"(flag), "r"(1) : "memory");
}
__device__ __forceinline__ void flag_wait(const int* flag) {
  int v = 0;
  while (true) {
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(flag) : "memory");
    if (v != 0) return;
    __nanosleep(64);
  }
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

// ------------------------------------- bulk copies into shared memory (sm_90) ---
// Rows are staged in shared memory by asynchronous bulk copies (the Hopper TMA engine,
// no tensor map: contiguous runs of bytes, 16-byte aligned, multiples of 16 bytes), their
// completion counted in bytes on an mbarrier. The loads stay in flight while the block
// reduces and writes earlier rows, which registers cannot hold. sm_90 and later only;
// older targets trap (their launchers never pick them).
__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, unsigned arrivals) {
#ifdef JO_HAS_CLUSTERS
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(arrivals) : "memory");
  // Make the initialized barrier visible to the async proxy (the copy engine).
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#else
  __trap();
#endif
}

// One arrival that also expects `bytes` of bulk copies to complete on `bar`.
__device__ __forceinline__ void mbarrier_arrive_expect(uint64_t* bar, uint32_t bytes) {
#ifdef JO_HAS_CLUSTERS
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
#else
  __trap();
#endif
}

// Wait until the phase of `bar` with this parity has completed. Acquire: the bytes
// counted on it are visible to the block's reads after it; CLUSTER_SCOPE where they came
// from other blocks of the cluster (st.async), not from this block's bulk copies.
#define JO_MBARRIER_WAIT(SEM)                                            \
  "{\n.reg .pred done;\nWAIT:\nmbarrier.try_wait.parity" SEM ".shared::cta.b64 done, [%0], %1;\n" \
  "@!done bra WAIT;\n}\n"
template <bool CLUSTER_SCOPE = false>
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
#ifdef JO_HAS_CLUSTERS
  if constexpr (CLUSTER_SCOPE)
    asm volatile(JO_MBARRIER_WAIT(".acquire.cluster")::"r"(smem_address(bar)), "r"(parity) : "memory");
  else
    asm volatile(JO_MBARRIER_WAIT("")::"r"(smem_address(bar)), "r"(parity) : "memory");
#else
  __trap();
#endif
}
#undef JO_MBARRIER_WAIT

// Copy `bytes` from global memory into this block's shared memory, completing on `bar`.
// A buffer the block has read through ordinary loads is refilled only after a barrier
// and this fence, which orders those reads before the copy engine's writes.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#ifdef JO_HAS_CLUSTERS
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_address(dst)),
               "l"(src), "r"(bytes), "r"(smem_address(bar))
               : "memory");
#else
  __trap();
#endif
}

// Store N floats (2 or 4) to block `rank` of the cluster, at the address `dst` has in
// this block's shared memory, their bytes completing on that block's barrier at the
// address of `bar`. Asynchronous: nothing waits for it here, not even its release.
template <int N>
__device__ __forceinline__ void store_remote(float* dst, const float (&v)[N], uint64_t* bar, int rank) {
  static_assert(N == 2 || N == 4, "st.async vectors of 2 or 4");
#ifdef JO_HAS_CLUSTERS
  if constexpr (N == 4) {
    asm volatile(
        "{\n.reg .b32 rd, rb;\n"
        "mapa.shared::cluster.u32 rd, %0, %2;\n"
        "mapa.shared::cluster.u32 rb, %1, %2;\n"
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [rd], {%3, %4, %5, %6}, [rb];\n}\n" ::"r"(
            smem_address(dst)),
        "r"(smem_address(bar)), "r"(rank), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3])
        : "memory");
  } else {
    asm volatile(
        "{\n.reg .b32 rd, rb;\n"
        "mapa.shared::cluster.u32 rd, %0, %2;\n"
        "mapa.shared::cluster.u32 rb, %1, %2;\n"
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [rd], {%3, %4}, [rb];\n}\n" ::"r"(
            smem_address(dst)),
        "r"(smem_address(bar)), "r"(rank), "f"(v[0]), "f"(v[1])
        : "memory");
  }
#else
  __trap();
#endif
}

// Largest cluster size used (portable: no opt-in attribute needed).
constexpr int kMaxClusterBlocks = 8;

// Whether `kernel` can be launched in clusters on the current device: compute
// capability 9.0 or later and the kernel's machine code built for it.
template <typename Kernel>
bool clusters_supported(Kernel kernel) {
  int version = 0;
  const int major = device_attribute(cudaDevAttrComputeCapabilityMajor, kQueryCcMajor, 0);
  if (kernel_attribute(kernel, kQueryBinaryVersion, &version) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return major >= 9 && version >= 90;
}

inline cudaLaunchConfig_t cluster_config(cudaLaunchAttribute* attr, int cs, int threads, int64_t clusters,
                                         cudaStream_t stream, size_t smem = 0) {
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = unsigned(cs);
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(clusters * cs));
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// Clusters of `cs` blocks of `threads` (and `smem` bytes of dynamic shared memory) for a
// persistent 1-D grid of `kernel`: as many as can be resident at once, at most
// work_clusters.
template <typename... KArgs>
cudaError_t cluster_grid(void (*kernel)(KArgs...), int cs, int threads, int64_t work_clusters, int64_t* clusters,
                         size_t smem = 0) {
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = cluster_config(&attr, cs, threads, 1, nullptr, smem);
  int resident = 0;
  const cudaError_t err = cached_launch_query(
      // key: cs (at most 16) and smem in one field
      {0, kQueryClusters, threads, reinterpret_cast<const void*>(kernel), size_t(cs) + (smem << 5)}, &resident,
      [&](int* out) { return cudaOccupancyMaxActiveClusters(out, kernel, &cfg); });
  cudaGetLastError();  // the query's own error is returned, not left for a later check
  if (err != cudaSuccess) return err;
  if (resident < 1) return cudaErrorInvalidConfiguration;
  *clusters = work_clusters < 1 ? 1 : (work_clusters < resident ? work_clusters : resident);
  return cudaSuccess;
}

template <typename... KArgs, typename... Args>
cudaError_t launch_clusters_smem(void (*kernel)(KArgs...), int cs, int threads, size_t smem, int64_t clusters,
                                 cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = cluster_config(&attr, cs, threads, clusters, stream, smem);
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

template <typename... KArgs, typename... Args>
cudaError_t launch_clusters(void (*kernel)(KArgs...), int cs, int threads, int64_t clusters, cudaStream_t stream,
                            Args&&... args) {
  return launch_clusters_smem(kernel, cs, threads, 0, clusters, stream, std::forward<Args>(args)...);
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


// ===================================================================================
// Row-partial and apply skeletons of the hidden-sharded stages (issue 23).
// When a row op's row (the normalized axis) is split over devices, each device reduces
// its columns of every row to a small accumulator (the "partials" stages), the
// accumulators are combined across devices (jax_ops/ops: O(rows) data), and an
// elementwise pass finishes with the combined per-row constants (the "apply" stages).
// layer_norm.cuh and softmax.cuh supply the policies. A policy R has
//   Args, Acc (float fields), Ctx (per-row constants),
//   kPack, rows(a), nvec(a): elements a pack, rows, packs a row; init(): the neutral Acc;
//   ctx(a, row);
//   reductions: add(a, ctx, row, v, acc) folds pack v of the row into acc,
//     merge(a, lo, hi): lo ⊕= hi (lo from the lower lanes: one fixed order),
//     store(a, row, acc);
//   maps: apply(a, ctx, row, v) writes pack v of the row.
// Column-tiled passes (policy E: Args, Col, kPack, kPartials, rows(a), nvec(a), column(a, v),
// apply(a, col, row, v, p0, p1)): per-column constants loaded once per thread, optional
// per-column float32 partial sums over a chunk of rows (no atomics).
// ===================================================================================

// An accumulator of 32-bit words exchanged with the lane `off` away in its WIDTH group.
template <typename Acc>
__device__ __forceinline__ Acc shfl_xor_words(const Acc& in, int off, int width) {
  static_assert(sizeof(Acc) % 4 == 0, "accumulators are 32-bit words");
  constexpr int kWords = int(sizeof(Acc) / 4);
  uint32_t w[kWords];
  memcpy(w, &in, sizeof(Acc));
#pragma unroll
  for (int i = 0; i < kWords; ++i) w[i] = __shfl_xor_sync(0xffffffffu, w[i], off, width);
  Acc out;
  memcpy(&out, w, sizeof(Acc));
  return out;
}

// Merge over aligned groups of WIDTH lanes, the lower lanes' state first: every lane of
// the group ends with the bitwise same accumulator.
template <typename R, int WIDTH>
__device__ __forceinline__ typename R::Acc group_combine(const typename R::Args& a, typename R::Acc acc) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int off = WIDTH / 2; off > 0; off /= 2) {
    typename R::Acc o = shfl_xor_words(acc, off, WIDTH);
    if (lane & off) {
      R::merge(a, o, acc);
      acc = o;
    } else {
      R::merge(a, acc, o);
    }
  }
  return acc;
}

constexpr int kRowsThreads = 128;      // threads of the group-per-row kernels
constexpr int kRowsBlockThreads = 512;  // at most, block-per-row reductions
constexpr int kMapBlockThreads = 256;   // elementwise row passes
constexpr int kTileThreads = 256;       // column-tiled passes

// Loads in flight a lane: four 16-byte packs; unvectorized rows (kPack 1) two (four
// made ptxas spill the add+norm partials kernel at 32 registers).
template <typename R>
constexpr int kReduceUnroll = R::kPack > 1 ? 4 : 2;

// A group of WIDTH lanes (1..32) per row, each lane folding packs glane, glane + WIDTH, ...
template <typename R, int WIDTH>
__global__ void __launch_bounds__(kRowsThreads) rows_reduce_group_kernel(const typename R::Args a) {
  constexpr int ROWS_PER_WARP = 32 / WIDTH;
  const int lane = threadIdx.x % 32, group = lane / WIDTH, glane = lane % WIDTH;
  const int64_t warps_total = int64_t(gridDim.x) * (kRowsThreads / 32);
  const int64_t nvec = R::nvec(a);
  // Warp-uniform loop: every lane takes part in the shuffles, rows past the end are masked.
  for (int64_t tile = int64_t(blockIdx.x) * (kRowsThreads / 32) + threadIdx.x / 32;
       tile * ROWS_PER_WARP < R::rows(a); tile += warps_total) {
    const int64_t row = tile * ROWS_PER_WARP + group;
    typename R::Acc acc = R::init();
    if (row < R::rows(a)) {
      const typename R::Ctx c = R::ctx(a, row);
#pragma unroll(kReduceUnroll<R>)
      for (int64_t v = glane; v < nvec; v += WIDTH) R::add(a, c, row, v, acc);
    }
    acc = group_combine<R, WIDTH>(a, acc);
    if (row < R::rows(a) && glane == 0) R::store(a, row, acc);
  }
}

// A block per row (long rows, few of them): warps merged through shared memory in
// warp order.
template <typename R>
__global__ void __launch_bounds__(kRowsBlockThreads) rows_reduce_block_kernel(const typename R::Args a) {
  using Acc = typename R::Acc;
  __shared__ __align__(16) unsigned char red_raw[(kRowsBlockThreads / 32) * sizeof(Acc)];
  Acc* red = reinterpret_cast<Acc*>(red_raw);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = (blockDim.x + 31) / 32;
  const int64_t nvec = R::nvec(a);
  for (int64_t row = blockIdx.x; row < R::rows(a); row += gridDim.x) {
    Acc acc = R::init();
    const typename R::Ctx c = R::ctx(a, row);
#pragma unroll(kReduceUnroll<R>)
    for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) R::add(a, c, row, v, acc);
    acc = group_combine<R, 32>(a, acc);
    if (lane == 0) red[warp] = acc;
    __syncthreads();
    if (warp == 0) {
      Acc w = lane < nwarps ? red[lane] : R::init();
      w = group_combine<R, 32>(a, w);
      if (lane == 0) R::store(a, row, w);
    }
    __syncthreads();  // red is rewritten by the next row
  }
}

// Elementwise over rows: `width` lanes per row (a power of two dividing the block), the
// per-row constants computed once per lane and row.
template <typename R>
__global__ void __launch_bounds__(kMapBlockThreads) rows_map_kernel(const typename R::Args a, int width) {
  const int64_t nvec = R::nvec(a);
  const int glane = threadIdx.x % width;
  const int64_t groups_total = int64_t(gridDim.x) * (blockDim.x / width);
  for (int64_t row = int64_t(blockIdx.x) * (blockDim.x / width) + threadIdx.x / width; row < R::rows(a);
       row += groups_total) {
    const typename R::Ctx c = R::ctx(a, row);
#pragma unroll 4
    for (int64_t v = glane; v < nvec; v += width) R::apply(a, c, row, v);
  }
}

// Column-tiled: block (TX column packs) x (TY = 256 / TX rows) over one chunk of rows;
// thread (tx, ty) owns column pack blockIdx.x * TX + tx and walks rows r0 + ty, + TY, ...
// With E::kPartials, its float32 per-column sums (two per element) are reduced over ty
// in order and written to row blockIdx.y of part0/part1 ([chunks, cols]; null: not wanted),
// which the op's own column-sum kernel then adds up in a fixed order.
template <typename E>
__global__ void __launch_bounds__(kTileThreads) cols_tiled_kernel(const typename E::Args a, int tx_log2,
                                                                 int64_t chunk_rows, float* part0, float* part1) {
  constexpr int PACK = E::kPack;
  const int tx = threadIdx.x & ((1 << tx_log2) - 1), ty = threadIdx.x >> tx_log2;
  const int TY = kTileThreads >> tx_log2;
  const int64_t nvec = E::nvec(a);
  const int64_t v = (int64_t(blockIdx.x) << tx_log2) + tx;
  const int64_t r0 = int64_t(blockIdx.y) * chunk_rows;
  const int64_t r1 = r0 + chunk_rows < E::rows(a) ? r0 + chunk_rows : E::rows(a);
  float p0[PACK], p1[PACK];
#pragma unroll
  for (int k = 0; k < PACK; ++k) p0[k] = p1[k] = 0.f;
  if (v < nvec) {
    const typename E::Col col = E::column(a, v);
#pragma unroll 4
    for (int64_t row = r0 + ty; row < r1; row += TY) E::apply(a, col, row, v, p0, p1);
  }
  if constexpr (E::kPartials) {
    __shared__ float red[2][kTileThreads * PACK];
#pragma unroll
    for (int k = 0; k < PACK; ++k) {
      red[0][threadIdx.x * PACK + k] = p0[k];
      red[1][threadIdx.x * PACK + k] = p1[k];
    }
    __syncthreads();
    if (ty == 0 && v < nvec) {
      const int64_t cols = nvec * PACK;
#pragma unroll
      for (int k = 0; k < PACK; ++k) {
        float s0 = 0.f, s1 = 0.f;
        for (int j = 0; j < TY; ++j) {
          s0 += red[0][((j << tx_log2) + tx) * PACK + k];
          s1 += red[1][((j << tx_log2) + tx) * PACK + k];
        }
        if (part0) part0[int64_t(blockIdx.y) * cols + v * PACK + k] = s0;
        if (part1) part1[int64_t(blockIdx.y) * cols + v * PACK + k] = s1;
      }
    }
  }
}

// -- launchers of the skeletons --

// Lanes per row for about four packs a lane (1..32), as launch(WIDTH constant).
template <typename Launch>
cudaError_t dispatch_row_width(int64_t nvec, Launch&& launch) {
  const int64_t w = nvec / 4;
  if (w < 2) return launch(std::integral_constant<int, 1>{});
  if (w < 4) return launch(std::integral_constant<int, 2>{});
  if (w < 8) return launch(std::integral_constant<int, 4>{});
  if (w < 16) return launch(std::integral_constant<int, 8>{});
  if (w < 32) return launch(std::integral_constant<int, 16>{});
  return launch(std::integral_constant<int, 32>{});
}

// Long rows too few to fill the GPU with a warp each get a block each.
inline bool rows_want_blocks(int64_t rows, int64_t nvec) {
  return nvec > 512 && rows < int64_t(sm_count()) * 8;
}

template <typename R>
cudaError_t launch_rows_reduce(const typename R::Args& a, cudaStream_t stream) {
  if (R::rows(a) == 0) return cudaSuccess;
  const int64_t nvec = R::nvec(a);
  if (rows_want_blocks(R::rows(a), nvec)) {
    const int64_t want = ((nvec + 7) / 8 + 31) / 32 * 32;
    const int threads = int(want < 128 ? 128 : want > kRowsBlockThreads ? kRowsBlockThreads : want);
    const int64_t blocks = R::rows(a);  // fewer than 8 per SM by rows_want_blocks
    rows_reduce_block_kernel<R><<<unsigned(blocks), threads, 0, stream>>>(a);
    return cudaGetLastError();
  }
  return dispatch_row_width(nvec, [&](auto width) {
    constexpr int WIDTH = decltype(width)::value;
    constexpr int rows_per_block = (kRowsThreads / WIDTH);
    const int64_t needed = (R::rows(a) + rows_per_block - 1) / rows_per_block;
    const int64_t cap = int64_t(sm_count()) * 64;
    rows_reduce_group_kernel<R, WIDTH><<<unsigned(needed < cap ? needed : cap), kRowsThreads, 0, stream>>>(a);
    return cudaGetLastError();
  });
}

template <typename R>
cudaError_t launch_rows_map(const typename R::Args& a, cudaStream_t stream) {
  if (R::rows(a) == 0) return cudaSuccess;
  const int64_t nvec = R::nvec(a);
  int width = kMapBlockThreads;  // a block per row
  if (!rows_want_blocks(R::rows(a), nvec)) {
    width = 1;
    while (width < 32 && int64_t(width) * 8 <= nvec) width *= 2;  // about 4 packs a lane
  }
  const int rows_per_block = kMapBlockThreads / width;
  const int64_t needed = (R::rows(a) + rows_per_block - 1) / rows_per_block;
  const int64_t cap = int64_t(sm_count()) * 32;
  rows_map_kernel<R><<<unsigned(needed < cap ? needed : cap), kMapBlockThreads, 0, stream>>>(a, width);
  return cudaGetLastError();
}

// Chunks of rows of a column-tiled pass: enough blocks to fill the GPU about eight
// times over, at most max_chunks (the partials' workspace rows) and 65535 (grid y).
struct TileGrid {
  int tx_log2;
  int64_t col_tiles, chunks, chunk_rows;
};

inline TileGrid tile_grid(int64_t rows, int64_t nvec, int64_t max_chunks) {
  TileGrid g{0, 0, 0, 0};
  if (rows <= 0 || nvec <= 0) return g;  // nothing to launch
  while (g.tx_log2 < 5 && (int64_t(1) << g.tx_log2) < nvec) ++g.tx_log2;
  const int64_t ty = kTileThreads >> g.tx_log2;
  g.col_tiles = (nvec + (int64_t(1) << g.tx_log2) - 1) >> g.tx_log2;
  int64_t chunks = (int64_t(sm_count()) * 8 + g.col_tiles - 1) / g.col_tiles;
  const int64_t by_rows = (rows + ty - 1) / ty;
  chunks = chunks > by_rows ? by_rows : chunks;
  chunks = chunks > max_chunks ? max_chunks : chunks;
  chunks = chunks > 65535 ? 65535 : (chunks < 1 ? 1 : chunks);
  g.chunk_rows = (rows + chunks - 1) / chunks;
  g.chunks = (rows + g.chunk_rows - 1) / g.chunk_rows;
  return g;
}

template <typename E>
cudaError_t launch_cols_tiled(const typename E::Args& a, const TileGrid& g, float* part0, float* part1,
                              cudaStream_t stream) {
  cols_tiled_kernel<E><<<dim3(unsigned(g.col_tiles), unsigned(g.chunks)), kTileThreads, 0, stream>>>(
      a, g.tx_log2, g.chunk_rows, part0, part1);
  return cudaGetLastError();
}

}  // namespace jax_ops
