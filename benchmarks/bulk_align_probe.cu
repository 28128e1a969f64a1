// Probe (issue 20, forty-second session): do bulk copies (cp.async.bulk) of a row from a
// source that is 16-byte but not 128-byte aligned run slower on sm_90? A block-per-row
// loop shaped like bwd_bulk_kernel (3 stages of x and dy, a barrier a row, one 16-byte
// word a thread read from shared memory and stored to dx), bf16 rows of `cols` columns:
//   mode 0: each row's copy starts at the row (cols % 8 == 0: 16-byte rows);
//   mode 1: at the row's first 16-byte word of the flat buffer (the shifted kernel);
//   mode 2: at the row's first 128-byte line (more bytes, aligned source);
//   mode 3: 16 bytes past the row's start (16-byte rows: as many bytes as mode 0, from a
//           source not 128-byte aligned).
// GB/s count the rows' bytes (modes 1-3 copy, and store, a few more).
// store 0/1: without / with the dx stores. Prints us per call (cudaEvent, median of 7).
// Build: nvcc -O3 -std=c++17 -gencode arch=compute_90,code=sm_90 -I. bulk_align_probe.cu
#include <algorithm>
#include <cstdio>
#include <vector>
#include "cuda_src/cuda_utils.cuh"

using namespace jax_ops;
constexpr int kStages = 3;

__global__ void __launch_bounds__(1024) probe(const uint4* x, const uint4* dy, uint4* dx, long rows, long cols,
                                               int mode, int store, int words, float* sink) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem);
  uint4* staged = reinterpret_cast<uint4*>(smem + 128);
  const long G = gridDim.x;
  const auto first_byte = [&](long row) {
    const long b = row * cols * 2;
    return mode == 0 ? b : mode == 1 ? b / 16 * 16 : mode == 2 ? b / 128 * 128 : b + 16;
  };
  const auto fill = [&](int st, long row) {
    const long f = first_byte(row);
    const uint32_t bytes = uint32_t(words) * 16;
    mbarrier_arrive_expect(&bars[st], 2 * bytes);
    bulk_load(staged + (st * 2 + 0) * words, reinterpret_cast<const char*>(x) + f, bytes, &bars[st]);
    bulk_load(staged + (st * 2 + 1) * words, reinterpret_cast<const char*>(dy) + f, bytes, &bars[st]);
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbarrier_init(&bars[s], 1);
    for (int s = 0; s < kStages; ++s)
      if (blockIdx.x + s * G < rows) fill(s, blockIdx.x + s * G);
  }
  __syncthreads();
  float acc = 0.f;
  int st = 0;
  uint32_t phase = 0;
  __shared__ float red[32];
  for (long row = blockIdx.x; row < rows; row += G) {
    mbarrier_wait(&bars[st], phase);
    uint4 a = {}, b = {};
    if (threadIdx.x < words) { a = staged[(st * 2) * words + threadIdx.x]; b = staged[(st * 2 + 1) * words + threadIdx.x]; }
    float v = __int_as_float(a.x ^ b.y) + __int_as_float(a.z ^ b.w);
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(~0u, v, o);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    acc += red[0];
    if (threadIdx.x == 0 && row + kStages * G < rows) fill(st, row + kStages * G);
    if (store && threadIdx.x < words) {
      const long f = first_byte(row) / 16 + threadIdx.x;
      uint4 o = a; o.x ^= __float_as_int(acc);
      dx[f] = o;
    }
    __syncthreads();
    if (++st == kStages) { st = 0; phase ^= 1u; }
  }
  if (acc == 12345.f) *sink = acc;
}

int main() {
  const long rows = 49152;
  std::vector<long> widths = {2048, 2052, 4096, 4100};
  for (long cols : widths) {
    const size_t bytes = size_t(rows) * cols * 2 + 4096;
    uint4 *x, *dy, *dx;
    float* sink;
    cudaMalloc(&x, bytes); cudaMalloc(&dy, bytes); cudaMalloc(&dx, bytes); cudaMalloc(&sink, 4);
    cudaMemset(x, 1, bytes); cudaMemset(dy, 2, bytes);
    for (int mode = 0; mode < 4; ++mode) {
      if ((mode == 0 || mode == 3) && cols % 8) continue;
      const int words = mode == 2 ? int((cols * 2 + 127 + 127) / 128 * 8)
                      : mode == 1 ? int((cols * 2 + 15 + 14) / 16) : int(cols * 2 / 16);
      const int threads = (words + 31) / 32 * 32;
      if (threads > 1024) continue;
      const size_t smem = 128 + size_t(kStages) * 2 * words * 16;
      cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
      int per_sm = 0, sms = 0;
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, probe, threads, smem);
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
      const int grid = per_sm * sms;
      for (int store = 0; store < 2; ++store) {
        cudaEvent_t e0, e1;
        cudaEventCreate(&e0); cudaEventCreate(&e1);
        std::vector<float> ts;
        for (int rep = 0; rep < 8; ++rep) {
          cudaEventRecord(e0);
          probe<<<grid, threads, smem>>>(x, dy, dx, rows, cols, mode, store, words, sink);
          cudaEventRecord(e1);
          cudaEventSynchronize(e1);
          float ms = 0; cudaEventElapsedTime(&ms, e0, e1);
          if (rep) ts.push_back(ms * 1000);
        }
        std::sort(ts.begin(), ts.end());
        const cudaError_t err = cudaGetLastError();
        const double gb = double(rows) * cols * 2 * (store ? 3 : 2) / 1e9;
        printf("cols %ld mode %d store %d words %d threads %d blocks/SM %d: %.1f us, %.0f GB/s %s\n", cols, mode,
               store, words, threads, per_sm, ts[ts.size() / 2], gb / (ts[ts.size() / 2] * 1e-6),
               err == cudaSuccess ? "" : cudaGetErrorString(err));
      }
    }
    cudaFree(x); cudaFree(dy); cudaFree(dx); cudaFree(sink);
  }
  return 0;
}
