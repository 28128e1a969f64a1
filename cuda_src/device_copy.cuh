// A plain 16-byte-per-thread device copy: the bandwidth ceiling the benchmark
// compares every kernel with (same bytes moved, nothing computed).
#pragma once
#include <cuda_runtime.h>
#include <cstdint>
#include "cuda_src/cuda_utils.cuh"

namespace jax_ops {

__global__ void __launch_bounds__(256) copy16_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                                     int64_t n16, const uint8_t* src_tail, uint8_t* dst_tail,
                                                     int64_t tail) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n16; i += stride) dst[i] = src[i];
  if (blockIdx.x == 0 && threadIdx.x < tail) dst_tail[threadIdx.x] = src_tail[threadIdx.x];
}

inline cudaError_t launch_device_copy(const void* src, void* dst, int64_t bytes, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  if (reinterpret_cast<uintptr_t>(src) % 16 || reinterpret_cast<uintptr_t>(dst) % 16)
    return cudaMemcpyAsync(dst, src, size_t(bytes), cudaMemcpyDeviceToDevice, stream);
  const int64_t n16 = bytes / 16, tail = bytes % 16;
  int blocks = 0;
  cudaError_t err = resident_blocks(copy16_kernel, 256, 0, (n16 + 255) / 256, &blocks);
  if (err != cudaSuccess) return err;
  copy16_kernel<<<blocks, 256, 0, stream>>>(static_cast<const uint4*>(src), static_cast<uint4*>(dst), n16,
                                            static_cast<const uint8_t*>(src) + n16 * 16,
                                            static_cast<uint8_t*>(dst) + n16 * 16, tail);
  return cudaGetLastError();
}

}  // namespace jax_ops
