// CUDA-only helpers: vector packs, warp/block reductions, launch geometry.
#pragma once
#include <cuda_runtime.h>
#include <cstdlib>
#include <mutex>
#include <string>
#include <type_traits>
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
