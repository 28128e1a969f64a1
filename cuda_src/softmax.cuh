// Softmax / LogSoftmax CUDA kernels (forward and backward) and their launchers.
//
// Rows are the flattened leading axes; the softmax runs over the last axis.
// Tiers, by row length (cols), forward and backward alike:
//   cols <= 1024  : a group of WIDTH lanes (1..32) per row, row in registers (forward:
//                   about 4 packs a lane, a thread per row for the shortest rows;
//                   backward: narrow groups take several rows at a time).
//   cols <= 16384 : a block per row (up to 512 threads; forward about 256), each
//                   thread holding up to 32 values (16 for unvectorized rows).
//   longer rows   : a block per row, row cached in shared memory, or read again
//                   from global memory when shared memory cannot hold it.
// The forward's register tiers take the row max, then one exp per element against
// it (kept for softmax), then the sum: two plain reductions, no exps inside them.
// The long-row tier merges per-pack (max, sum) pairs in its single read pass.
// Unmasked rows run kernels compiled without the mask/causal tests (MASKED=false);
// mask kind and log/softmax are runtime, warp-uniform branches.
// Reductions run in a fixed order: no atomics, bitwise reproducible.
#pragma once
#include <cuda_runtime.h>
#include "cuda_src/common.h"
#include "cuda_src/cuda_utils.cuh"
#include "cuda_src/softmax_math.h"

namespace jax_ops::softmax {

constexpr int kWarpThreads = 128;      // threads per block of the group-per-row kernels
constexpr int64_t kWarpMaxCols = 1024;  // 32 values a lane at most
// Block-per-row tier: at most 512 threads (so 128 registers a thread) holding up to
// 32 values each (x, as float logits or exps, next to the raw loads; 64 spilled) in
// the forward, 32 of y and of dy in the backward; unvectorized rows (PACK 1) half that.
constexpr int kBlockThreads = 512;
template <int PACK> constexpr int fwd_block_values() { return PACK == 1 ? 16 : 32; }
template <int PACK> constexpr int bwd_block_values() { return PACK == 1 ? 16 : 32; }
// The forward's per-row reductions are amortized over more values: about 256
// threads a row, 16+ values each, where the row allows.
constexpr int kFwdBlockTargetThreads = 256;

// ------------------------------------------------------------- element io ---

template <typename T, int PACK>
__device__ __forceinline__ void load_mask(const FwdArgs& a, int64_t mrow, int64_t col, float (&mv)[PACK]) {
  const int64_t off = mrow * a.cols + col;
  switch (a.mask_kind) {
    case kBoolMask: {
      const Pack<uint8_t, PACK> p = *reinterpret_cast<const Pack<uint8_t, PACK>*>(static_cast<const uint8_t*>(a.mask) + off);
#pragma unroll
      for (int k = 0; k < PACK; ++k) mv[k] = p.v[k] ? 1.f : 0.f;
      break;
    }
    case kAddMask: load_pack<T, PACK>(static_cast<const T*>(a.mask) + off, mv); break;
    case kAddMaskF32: load_pack<float, PACK>(static_cast<const float*>(a.mask) + off, mv); break;
    default:
#pragma unroll
      for (int k = 0; k < PACK; ++k) mv[k] = 0.f;
  }
}

// Logits of one pack starting at column `col` of a row whose mask row is mrow and
// causal limit climit (causal_limit()).
// MASKED (compile time): a mask or the causal rule is present. Unmasked rows skip
// the per-element mask and causal tests (a third of the forward's instructions).
template <typename T, int PACK, bool MASKED>
__device__ __forceinline__ void pack_logits(const FwdArgs& a, int64_t climit, int64_t mrow, int64_t col,
                                            const Pack<T, PACK>& raw, float (&z)[PACK]) {
  if constexpr (!MASKED) {
#pragma unroll
    for (int k = 0; k < PACK; ++k) z[k] = to_float(raw.v[k]) * a.scale;
    return;
  }
  float mv[PACK];
  load_mask<T, PACK>(a, mrow, col, mv);
#pragma unroll
  for (int k = 0; k < PACK; ++k)
    z[k] = logit(to_float(raw.v[k]), a.scale, a.mask_kind, mv[k], col + k <= climit);
}

template <int WIDTH>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int off = WIDTH / 2; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off, WIDTH));
  return v;
}

// Whole-block reduction (fixed order), result returned to every thread.
template <bool MAX>
__device__ __forceinline__ float block_reduce(float v) {
  __shared__ float red[32];
  __shared__ float bcast;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = (blockDim.x + 31) / 32;
  v = MAX ? group_max<32>(v) : group_sum<32>(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float w = lane < nwarps ? red[lane] : (MAX ? neg_inf() : 0.f);
    w = MAX ? group_max<32>(w) : group_sum<32>(w);
    if (lane == 0) bcast = w;
  }
  __syncthreads();
  return bcast;
}

__device__ __forceinline__ float block_sum(float v) { return block_reduce<false>(v); }

// One row's N values per thread (logits in, outputs out), with the row's max and
// sum reduced by max_all / sum_all (group or block): max first, then one exp per
// element against it (kept for softmax), then the sum. No exps inside the
// reductions, one reciprocal or log per row.
template <int N, typename MaxAll, typename SumAll>
__device__ __forceinline__ void softmax_values(float (&v)[N], bool log, MaxAll&& max_all, SumAll&& sum_all) {
  float lm = neg_inf();
#pragma unroll
  for (int i = 0; i < N; ++i) lm = fmaxf(lm, v[i]);
  const float m = safe_max(max_all(lm));
  float ls = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float e = exp_f32(v[i] - m);
    ls += e;
    if (!log) v[i] = e;
  }
  const RowOut r = finish_row(m, sum_all(ls), log);
#pragma unroll
  for (int i = 0; i < N; ++i)
    v[i] = log ? (r.empty ? neg_inf() : (v[i] - r.m) - r.log_s) : (r.empty ? 0.f : v[i] * r.inv_s);
}

// (max, sum) pairs over the block, for the long-row kernel's online pass: the
// max first, then each thread's sum rescaled to it.
__device__ __forceinline__ MaxSum block_max_sum(MaxSum ms) {
  MaxSum out;
  out.m = block_reduce<true>(ms.m);
  out.s = block_reduce<false>(out.m == neg_inf() ? ms.s : ms.s * exp_f32(ms.m - out.m));
  return out;
}

// ---------------------------------------------------------------- forward ---

// A group of WIDTH lanes per row (WIDTH 1: a thread per row); lane glane holds
// packs p * WIDTH + glane, p < VPT, of its row.
template <typename T, int PACK, int VPT, int WIDTH, bool MASKED>
__global__ void __launch_bounds__(kWarpThreads) fwd_warp_kernel(FwdArgs a) {
  constexpr int N = VPT * PACK, ROWS_PER_WARP = 32 / WIDTH;
  using PackT = Pack<T, PACK>;
  const int lane = threadIdx.x % 32, group = lane / WIDTH, glane = lane % WIDTH;
  const int64_t warps_total = int64_t(gridDim.x) * (kWarpThreads / 32);
  const T* x = static_cast<const T*>(a.x);
  T* y = static_cast<T*>(a.y);
  // Warp-uniform loop: every lane takes part in the shuffles, rows past the end are masked.
  for (int64_t tile = int64_t(blockIdx.x) * (kWarpThreads / 32) + threadIdx.x / 32;
       tile * ROWS_PER_WARP < a.rows; tile += warps_total) {
    const int64_t row = tile * ROWS_PER_WARP + group;
    const bool valid = row < a.rows;
    PackT raw[VPT];
#pragma unroll
    for (int p = 0; p < VPT; ++p) {
      const int64_t col = int64_t(p * WIDTH + glane) * PACK;
      if (valid && col < a.cols) raw[p] = *reinterpret_cast<const PackT*>(x + row * a.cols + col);
    }
    const int64_t mrow = (a.mask_kind != kNoMask && valid) ? mask_row(a.map, row) : 0;
    const int64_t climit = causal_limit(a, row);
    float v[N];
#pragma unroll
    for (int p = 0; p < VPT; ++p) {
      const int64_t col = int64_t(p * WIDTH + glane) * PACK;
      float z[PACK];
      if (valid && col < a.cols) {
        pack_logits<T, PACK, MASKED>(a, climit, mrow, col, raw[p], z);
      } else {
#pragma unroll
        for (int k = 0; k < PACK; ++k) z[k] = neg_inf();
      }
#pragma unroll
      for (int k = 0; k < PACK; ++k) v[p * PACK + k] = z[k];
    }
    softmax_values<N>(v, a.log, [](float m) { return group_max<WIDTH>(m); },
                      [](float s) { return group_sum<WIDTH>(s); });
    if (!valid) continue;
#pragma unroll
    for (int p = 0; p < VPT; ++p) {
      const int64_t col = int64_t(p * WIDTH + glane) * PACK;
      if (col >= a.cols) continue;
      float out[PACK];
#pragma unroll
      for (int k = 0; k < PACK; ++k) out[k] = v[p * PACK + k];
      store_pack<T, PACK>(y + row * a.cols + col, out);
    }
  }
}

// A block per row; thread t holds packs t + k * blockDim.x, k < K.
template <typename T, int PACK, int K, bool MASKED>
__global__ void __launch_bounds__(kBlockThreads) fwd_block_regs_kernel(FwdArgs a) {
  constexpr int N = K * PACK;
  using PackT = Pack<T, PACK>;
  const int64_t nvec = a.cols / PACK;
  const PackT* x = static_cast<const PackT*>(a.x);
  T* y = static_cast<T*>(a.y);
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    PackT raw[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t p = threadIdx.x + int64_t(k) * blockDim.x;
      if (p < nvec) raw[k] = x[row * nvec + p];
    }
    const int64_t mrow = a.mask_kind != kNoMask ? mask_row(a.map, row) : 0;
    const int64_t climit = causal_limit(a, row);
    float v[N];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t p = threadIdx.x + int64_t(k) * blockDim.x;
      float z[PACK];
      if (p < nvec) {
        pack_logits<T, PACK, MASKED>(a, climit, mrow, p * PACK, raw[k], z);
      } else {
#pragma unroll
        for (int j = 0; j < PACK; ++j) z[j] = neg_inf();
      }
#pragma unroll
      for (int j = 0; j < PACK; ++j) v[k * PACK + j] = z[j];
    }
    softmax_values<N>(v, a.log, [](float m) { return block_reduce<true>(m); },
                      [](float s) { return block_reduce<false>(s); });
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t p = threadIdx.x + int64_t(k) * blockDim.x;
      if (p >= nvec) continue;
      float out[PACK];
#pragma unroll
      for (int j = 0; j < PACK; ++j) out[j] = v[k * PACK + j];
      store_pack<T, PACK>(y + (row * nvec + p) * PACK, out);
    }
  }
}

// A block per row for long rows: an online (max, sum) pass, then the output pass
// over the row cached in shared memory (CACHE) or read again.
template <typename T, int PACK, bool CACHE, bool MASKED>
__global__ void fwd_block_kernel(FwdArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  using PackT = Pack<T, PACK>;
  PackT* cache = reinterpret_cast<PackT*>(smem_raw);
  const int64_t nvec = a.cols / PACK;
  const PackT* x = static_cast<const PackT*>(a.x);
  T* y = static_cast<T*>(a.y);
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const int64_t mrow = a.mask_kind != kNoMask ? mask_row(a.map, row) : 0;
    const int64_t climit = causal_limit(a, row);
    MaxSum ms;
    for (int64_t p = threadIdx.x; p < nvec; p += blockDim.x) {
      const PackT pk = x[row * nvec + p];
      if (CACHE) cache[p] = pk;
      float z[PACK];
      pack_logits<T, PACK, MASKED>(a, climit, mrow, p * PACK, pk, z);
      float pm = neg_inf();
#pragma unroll
      for (int j = 0; j < PACK; ++j) pm = fmaxf(pm, z[j]);
      const float shift = safe_max(pm);
      float ps = 0.f;
#pragma unroll
      for (int j = 0; j < PACK; ++j) ps += exp_f32(z[j] - shift);
      ms.merge(pm, ps);
    }
    const MaxSum whole = block_max_sum(ms);
    const RowOut r = finish_row(safe_max(whole.m), whole.s, a.log);
    for (int64_t p = threadIdx.x; p < nvec; p += blockDim.x) {
      const PackT pk = CACHE ? cache[p] : x[row * nvec + p];
      float z[PACK];
      pack_logits<T, PACK, MASKED>(a, climit, mrow, p * PACK, pk, z);
#pragma unroll
      for (int j = 0; j < PACK; ++j) z[j] = softmax_out(z[j], r, a.log);
      store_pack<T, PACK>(y + (row * nvec + p) * PACK, z);
    }
    if (CACHE) __syncthreads();  // the next row overwrites the cache
  }
}

// --------------------------------------------------------------- backward ---

template <typename T, int PACK, int VPT, int WIDTH, int ROWS>
__global__ void __launch_bounds__(kWarpThreads) bwd_warp_kernel(BwdArgs a) {
  constexpr int ROWS_PER_WARP = (32 / WIDTH) * ROWS;
  using PackT = Pack<T, PACK>;
  const int lane = threadIdx.x % 32, group = lane / WIDTH, glane = lane % WIDTH;
  const int64_t warps_total = int64_t(gridDim.x) * (kWarpThreads / 32);
  const T* yv = static_cast<const T*>(a.y);
  const T* dyv = static_cast<const T*>(a.dy);
  T* dx = static_cast<T*>(a.dx);
  for (int64_t tile = int64_t(blockIdx.x) * (kWarpThreads / 32) + threadIdx.x / 32;
       tile * ROWS_PER_WARP < a.rows; tile += warps_total) {
    PackT ry[ROWS][VPT], rd[ROWS][VPT];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int64_t row = tile * ROWS_PER_WARP + group * ROWS + r;
#pragma unroll
      for (int p = 0; p < VPT; ++p) {
        const int64_t col = int64_t(p * WIDTH + glane) * PACK;
        if (row < a.rows && col < a.cols) {
          ry[r][p] = *reinterpret_cast<const PackT*>(yv + row * a.cols + col);
          rd[r][p] = *reinterpret_cast<const PackT*>(dyv + row * a.cols + col);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int64_t row = tile * ROWS_PER_WARP + group * ROWS + r;
      float dot = 0.f;
#pragma unroll
      for (int p = 0; p < VPT; ++p) {
        const int64_t col = int64_t(p * WIDTH + glane) * PACK;
        if (row < a.rows && col < a.cols)
#pragma unroll
          for (int k = 0; k < PACK; ++k) dot += bwd_dot_term(to_float(ry[r][p].v[k]), to_float(rd[r][p].v[k]), a.log);
      }
      dot = group_sum<WIDTH>(dot);
      if (row >= a.rows) continue;
#pragma unroll
      for (int p = 0; p < VPT; ++p) {
        const int64_t col = int64_t(p * WIDTH + glane) * PACK;
        if (col >= a.cols) continue;
        float out[PACK];
#pragma unroll
        for (int k = 0; k < PACK; ++k)
          out[k] = softmax_dx(to_float(ry[r][p].v[k]), to_float(rd[r][p].v[k]), dot, a.scale, a.log);
        store_pack<T, PACK>(dx + row * a.cols + col, out);
      }
    }
  }
}

template <typename T, int PACK, int K>
__global__ void __launch_bounds__(kBlockThreads) bwd_block_regs_kernel(BwdArgs a) {
  using PackT = Pack<T, PACK>;
  const int64_t nvec = a.cols / PACK;
  const PackT* yv = static_cast<const PackT*>(a.y);
  const PackT* dyv = static_cast<const PackT*>(a.dy);
  T* dx = static_cast<T*>(a.dx);
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    PackT ry[K], rd[K];
    float dot = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t p = threadIdx.x + int64_t(k) * blockDim.x;
      if (p < nvec) { ry[k] = yv[row * nvec + p]; rd[k] = dyv[row * nvec + p]; }
    }
#pragma unroll
    for (int k = 0; k < K; ++k)
      if (threadIdx.x + int64_t(k) * blockDim.x < nvec)
#pragma unroll
        for (int j = 0; j < PACK; ++j) dot += bwd_dot_term(to_float(ry[k].v[j]), to_float(rd[k].v[j]), a.log);
    dot = block_sum(dot);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t p = threadIdx.x + int64_t(k) * blockDim.x;
      if (p >= nvec) continue;
      float out[PACK];
#pragma unroll
      for (int j = 0; j < PACK; ++j) out[j] = softmax_dx(to_float(ry[k].v[j]), to_float(rd[k].v[j]), dot, a.scale, a.log);
      store_pack<T, PACK>(dx + (row * nvec + p) * PACK, out);
    }
  }
}

template <typename T, int PACK, bool CACHE>
__global__ void bwd_block_kernel(BwdArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  using PackT = Pack<T, PACK>;
  const int64_t nvec = a.cols / PACK;
  PackT* cache_y = reinterpret_cast<PackT*>(smem_raw);
  PackT* cache_dy = cache_y + nvec;
  const PackT* yv = static_cast<const PackT*>(a.y);
  const PackT* dyv = static_cast<const PackT*>(a.dy);
  T* dx = static_cast<T*>(a.dx);
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    float dot = 0.f;
    for (int64_t p = threadIdx.x; p < nvec; p += blockDim.x) {
      const PackT py = yv[row * nvec + p], pd = dyv[row * nvec + p];
      if (CACHE) { cache_y[p] = py; cache_dy[p] = pd; }
#pragma unroll
      for (int j = 0; j < PACK; ++j) dot += bwd_dot_term(to_float(py.v[j]), to_float(pd.v[j]), a.log);
    }
    dot = block_sum(dot);
    for (int64_t p = threadIdx.x; p < nvec; p += blockDim.x) {
      const PackT py = CACHE ? cache_y[p] : yv[row * nvec + p];
      const PackT pd = CACHE ? cache_dy[p] : dyv[row * nvec + p];
      float out[PACK];
#pragma unroll
      for (int j = 0; j < PACK; ++j) out[j] = softmax_dx(to_float(py.v[j]), to_float(pd.v[j]), dot, a.scale, a.log);
      store_pack<T, PACK>(dx + (row * nvec + p) * PACK, out);
    }
    if (CACHE) __syncthreads();
  }
}

// -------------------------------------------------------------- launchers ---

// Blocks of the group-per-row kernels: enough for every row group, at most 64 per SM.
inline int warp_tier_blocks(int64_t rows, int rows_per_block) {
  const int64_t needed = (rows + rows_per_block - 1) / rows_per_block;
  const int64_t cap = int64_t(sm_count()) * 64;
  return int(needed < cap ? needed : cap);
}

template <typename T, int PACK, int VPT, int WIDTH, bool MASKED>
cudaError_t launch_fwd_warp(const FwdArgs& a, cudaStream_t stream) {
  fwd_warp_kernel<T, PACK, VPT, WIDTH, MASKED><<<warp_tier_blocks(a.rows, kWarpThreads / WIDTH), kWarpThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

// Forward row shape: lanes per row so that each lane has about 4 packs (a thread
// per row for rows of up to 7 packs). With one pack a lane the per-row reductions
// cost more instructions than the elements (measured on the H100: 64 instructions
// an element, compute-bound at half the copy bandwidth).
template <int W, int VPT, int MAX_VPT, typename Launch>
cudaError_t launch_with_vpt(int64_t nvec, Launch&& launch) {
  if (nvec <= int64_t(W) * VPT) return launch(std::integral_constant<int, VPT>{}, std::integral_constant<int, W>{});
  if constexpr (VPT * 2 <= MAX_VPT) return launch_with_vpt<W, VPT * 2, MAX_VPT>(nvec, launch);
  return cudaErrorInvalidValue;
}

template <int MAX_VPT, typename Launch>
cudaError_t dispatch_row_shape(int64_t nvec, Launch&& launch) {
  const int64_t w = nvec / 4;
  if (w < 2) return launch_with_vpt<1, 1, 8>(nvec, launch);
  if (w < 4) return launch_with_vpt<2, 2, 8>(nvec, launch);
  if (w < 8) return launch_with_vpt<4, 4, 8>(nvec, launch);
  if (w < 16) return launch_with_vpt<8, 4, 8>(nvec, launch);
  if (w < 32) return launch_with_vpt<16, 4, 8>(nvec, launch);
  return launch_with_vpt<32, 4, MAX_VPT>(nvec, launch);
}

template <typename T, int PACK, int VPT, int WIDTH>
cudaError_t launch_bwd_warp(const BwdArgs& a, cudaStream_t stream) {
  constexpr int ROWS = WIDTH < 32 ? (WIDTH < 8 ? 4 : 2) : 1;
  constexpr int ROWS_PER_BLOCK = (kWarpThreads / WIDTH) * ROWS;
  bwd_warp_kernel<T, PACK, VPT, WIDTH, ROWS><<<warp_tier_blocks(a.rows, ROWS_PER_BLOCK), kWarpThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

// Block-per-row in registers: K packs a thread (K * PACK <= MAX_VALUES), at most
// kBlockThreads threads: the smallest K that fits the row (more threads per row
// put more of its loads in flight at once).
template <int PACK, int MAX_VALUES, int K = 1, int TARGET = kBlockThreads, typename Launch>
cudaError_t dispatch_block_k(int64_t nvec, Launch&& launch) {
  constexpr bool last = K * 2 * PACK > MAX_VALUES;
  if (nvec <= int64_t(TARGET) * K || (last && nvec <= int64_t(kBlockThreads) * K)) {
    const int threads = int(((nvec + K - 1) / K + 31) / 32 * 32);
    return launch(std::integral_constant<int, K>{}, threads);
  }
  if constexpr (!last) return dispatch_block_k<PACK, MAX_VALUES, K * 2, TARGET>(nvec, launch);
  return cudaErrorInvalidValue;
}

template <typename Args>
cudaError_t launch_block_regs(void (*kernel)(Args), const Args& a, int threads, cudaStream_t stream) {
  int blocks = 0;
  cudaError_t err = resident_blocks(kernel, threads, 0, a.rows, &blocks);
  if (err != cudaSuccess) return err;
  kernel<<<blocks, threads, 0, stream>>>(a);
  return cudaGetLastError();
}

// Long rows: cached in shared memory when it fits (row_bytes per block), else re-read.
template <typename Args>
cudaError_t launch_block_long(void (*cached)(Args), void (*uncached)(Args), const Args& a,
                              size_t row_bytes, int64_t nvec, cudaStream_t stream) {
  const int threads = block_threads(nvec);
  int blocks = 0;
  if (cached_grid(cached, threads, row_bytes, a.rows, &blocks)) {
    cached<<<blocks, threads, row_bytes, stream>>>(a);
    return cudaGetLastError();
  }
  const cudaError_t err = resident_blocks(uncached, threads, 0, a.rows, &blocks);
  if (err != cudaSuccess) return err;
  uncached<<<blocks, threads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, int PACK, bool MASKED>
cudaError_t launch_fwd_packed(const FwdArgs& a, cudaStream_t stream) {
  const int64_t nvec = a.cols / PACK;
  if (a.cols <= kWarpMaxCols)
    return dispatch_row_shape<kWarpMaxCols / (32 * PACK)>(nvec, [&](auto vpt, auto width) {
      return launch_fwd_warp<T, PACK, decltype(vpt)::value, decltype(width)::value, MASKED>(a, stream);
    });
  if (nvec <= int64_t(kBlockThreads) * (fwd_block_values<PACK>() / PACK))
    return dispatch_block_k<PACK, fwd_block_values<PACK>(), 1, kFwdBlockTargetThreads>(nvec, [&](auto k, int threads) {
      constexpr int K = decltype(k)::value;
      return launch_block_regs(fwd_block_regs_kernel<T, PACK, K, MASKED>, a, threads, stream);
    });
  return launch_block_long(fwd_block_kernel<T, PACK, true, MASKED>, fwd_block_kernel<T, PACK, false, MASKED>, a,
                           size_t(a.cols) * sizeof(T), nvec, stream);
}

template <typename T, int PACK>
cudaError_t launch_bwd_packed(const BwdArgs& a, cudaStream_t stream) {
  const int64_t nvec = a.cols / PACK;
  if (a.cols <= kWarpMaxCols)
    return dispatch_group_shape<PACK, kWarpMaxCols>(nvec, [&](auto vpt, auto width) {
      return launch_bwd_warp<T, PACK, decltype(vpt)::value, decltype(width)::value>(a, stream);
    });
  if (nvec <= int64_t(kBlockThreads) * (bwd_block_values<PACK>() / PACK))
    return dispatch_block_k<PACK, bwd_block_values<PACK>()>(nvec, [&](auto k, int threads) {
      constexpr int K = decltype(k)::value;
      return launch_block_regs(bwd_block_regs_kernel<T, PACK, K>, a, threads, stream);
    });
  return launch_block_long(bwd_block_kernel<T, PACK, true>, bwd_block_kernel<T, PACK, false>, a,
                           2 * size_t(a.cols) * sizeof(T), nvec, stream);
}

inline size_t mask_item_bytes(int kind, size_t x_item) {
  return kind == kBoolMask ? 1 : kind == kAddMask ? x_item : kind == kAddMaskF32 ? 4 : 0;
}

template <typename T>
cudaError_t launch_fwd(const FwdArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.cols == 0) return cudaSuccess;
  constexpr int VEC = 16 / sizeof(T);
  const bool vec_ok = a.cols % VEC == 0 && aligned_to(a.x, 16) && aligned_to(a.y, 16) &&
                      aligned_to(a.mask, VEC * mask_item_bytes(a.mask_kind, sizeof(T)));
  if (a.mask_kind != kNoMask || a.causal)
    return vec_ok ? launch_fwd_packed<T, VEC, true>(a, stream) : launch_fwd_packed<T, 1, true>(a, stream);
  return vec_ok ? launch_fwd_packed<T, VEC, false>(a, stream) : launch_fwd_packed<T, 1, false>(a, stream);
}

template <typename T>
cudaError_t launch_bwd(const BwdArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.cols == 0) return cudaSuccess;
  constexpr int VEC = 16 / sizeof(T);
  const bool vec_ok = a.cols % VEC == 0 && aligned_to(a.y, 16) && aligned_to(a.dy, 16) && aligned_to(a.dx, 16);
  return vec_ok ? launch_bwd_packed<T, VEC>(a, stream) : launch_bwd_packed<T, 1>(a, stream);
}

}  // namespace jax_ops::softmax
