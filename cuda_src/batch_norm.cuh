// BatchNorm+ReLU / BatchNorm+Add+ReLU CUDA kernels and launchers (math in
// batch_norm_math.h). x is (rows, C), channels last.
//
// Forward, training:
//   1. stats_partials_kernel: grid (P' row chunks, channel tiles), blocks of
//      (TX channel packs) x (TY rows), TX <= 64, TX·TY <= 256. A thread keeps Welford
//      state for its PACK channels over the rows ty, ty + TY, ... of its block's chunk,
//      U rows per update (one division per update for the whole pack). The TY states of
//      a channel pack are merged by a fixed tree in shared memory; one (mean, M2, n)
//      per block and channel goes to work[0..2][p][c]. P' <= work's P, about 4 blocks
//      per multiprocessor in all.
//   2. stats_finalize_kernel: blocks of (TX channels) x (TY partial rows), 1024 threads; each thread
//      sums a strided set of partials, a fixed tree over TY finishes: Σn and Σn·mean
//      give the mean, then Σ(M2 + n·(mean_p − mean)²) the variance; mean, var, rstd.
//   3. masked_fwd_kernel (relu.cuh) with BnOp: warp tiles over the flat array, the
//      mask written a word at a time; each lane keeps its elements' mean, scale·rstd
//      and bias in registers (the warp count is chosen so a lane's channels repeat).
// Forward, inference: running_stats_kernel (copies, rstd), then 3.
// Backward:
//   1. grad_partials_kernel: the geometry of forward step 1; per block and channel
//      Σg and Σg·xhat into work[0..1][p][c].
//   2. grad_finalize_kernel: fixed-order sums over the partials -> dbias, dscale.
//   3. dx_kernel: warp tiles over the flat array; the dx coefficients a, b, c of a
//      lane's channels are computed in registers from the (C,) arrays.
// No atomics: every sum has a fixed order, results are bitwise reproducible.
#pragma once
#include <cuda_runtime.h>
#include "cuda_src/batch_norm_math.h"
#include "cuda_src/bitmask.h"
#include "cuda_src/common.h"
#include "cuda_src/cuda_utils.cuh"
#include "cuda_src/relu.cuh"

namespace jax_ops::bn {

constexpr int kColThreads = 256;      // threads of the column-reduction blocks
constexpr int64_t kMaxTilePacks = 64;  // channel packs of one column tile
constexpr int kColBlocksPerSm = 4;     // partial blocks per multiprocessor
// Finalize blocks: (kFinalizeChannels channels) x (kFinalizeThreads / kFinalizeChannels
// partial rows), 8 loads in flight per thread. The partials are few and in L2, so the
// kernel is latency-bound: narrow channel tiles give each thread ~4 of P = 528 partials
// (one round of loads per pass). Measured on the H100: 256-thread blocks, one load at a
// time: ~29 us at C = 64; 32-channel tiles (17 partials a thread): 9.8 us (stats, two
// passes) and 5.0 us (gradients, one pass) at C = 32.
constexpr int kFinalizeThreads = 1024;
constexpr int kFinalizeChannels = 8;

// Geometry of the column reductions (forward statistics, backward sums).
struct ColumnGrid {
  int64_t rows, cols;
  int64_t npacks;      // cols / PACK
  int64_t tiles;       // channel tiles of TX packs
  int64_t parts;       // P': row chunks, one partial row of work each
  int64_t chunk_rows;  // rows per chunk
  int64_t work_parts;  // P: work's partial rows (its row stride)
  int tx, ty;
};

// Sums v over threadIdx.y for each threadIdx.x by a fixed pairwise tree in red
// (NV·blockDim.x·blockDim.y floats); every thread gets its column's totals.
template <int NV>
__device__ __forceinline__ void column_sums(float (&v)[NV], float* red) {
  const int TX = blockDim.x, threads = blockDim.x * blockDim.y;
  const int tid = threadIdx.y * TX + threadIdx.x;
#pragma unroll
  for (int k = 0; k < NV; ++k) red[k * threads + tid] = v[k];
  __syncthreads();
  for (int active = blockDim.y; active > 1;) {
    const int half = (active + 1) / 2;
    if (int(threadIdx.y) + half < active)
#pragma unroll
      for (int k = 0; k < NV; ++k) red[k * threads + tid] += red[k * threads + tid + half * TX];
    active = half;
    __syncthreads();
  }
#pragma unroll
  for (int k = 0; k < NV; ++k) v[k] = red[k * threads + threadIdx.x];
  __syncthreads();  // red is free again
}

// --------------------------------------------------------- forward, training ---

template <typename T, int PACK, int U>
__global__ void __launch_bounds__(kColThreads)
    stats_partials_kernel(const T* __restrict__ x, ColumnGrid g, float* __restrict__ work) {
  extern __shared__ __align__(16) float col_smem[];  // [2·PACK + 1][threads]
  const int tx = threadIdx.x, ty = threadIdx.y, TX = blockDim.x, TY = blockDim.y;
  const int threads = TX * TY, tid = ty * TX + tx;
  float* sm_mean = col_smem;
  float* sm_m2 = col_smem + PACK * threads;
  float* sm_count = col_smem + 2 * PACK * threads;
  const int64_t part = blockIdx.x;
  const int64_t r0 = part * g.chunk_rows;
  const int64_t r1 = r0 + g.chunk_rows < g.rows ? r0 + g.chunk_rows : g.rows;
  const int64_t plane = g.work_parts * g.cols;
  for (int64_t tile = blockIdx.y; tile < g.tiles; tile += gridDim.y) {
    const int64_t pk = tile * TX + tx;
    const bool valid = pk < g.npacks;
    const int64_t col = pk * PACK;
    PackWelford<PACK> st;
    st.reset();
    if (valid) {
      const T* xc = x + col;
      int64_t r = r0 + ty;
      for (; r + int64_t(U - 1) * TY < r1; r += int64_t(U) * TY) {
        float v[U][PACK];  // U loads in flight
#pragma unroll
        for (int u = 0; u < U; ++u) load_pack<T, PACK>(xc + (r + int64_t(u) * TY) * g.cols, v[u]);
        st.template add_rows<U>(v);
      }
      for (; r < r1; r += TY) {
        float v[1][PACK];
        load_pack<T, PACK>(xc + r * g.cols, v[0]);
        st.template add_rows<1>(v);
      }
    }
    auto store = [&]() {
#pragma unroll
      for (int k = 0; k < PACK; ++k) {
        sm_mean[k * threads + tid] = st.mean[k];
        sm_m2[k * threads + tid] = st.m2[k];
      }
      sm_count[tid] = st.count;
    };
    // Fixed merge tree over ty: row ty takes row ty + half; thread ty = 0 ends with all.
    store();
    __syncthreads();
    for (int active = TY; active > 1;) {
      const int half = (active + 1) / 2;
      if (ty + half < active) {
        const int other = tid + half * TX;
        float om[PACK], oq[PACK];
#pragma unroll
        for (int k = 0; k < PACK; ++k) {
          om[k] = sm_mean[k * threads + other];
          oq[k] = sm_m2[k * threads + other];
        }
        st.merge(om, oq, sm_count[other]);
        store();
      }
      active = half;
      __syncthreads();
    }
    if (ty == 0 && valid) {
      float* out = work + part * g.cols + col;
#pragma unroll
      for (int k = 0; k < PACK; ++k) {
        out[k] = st.mean[k];
        out[plane + k] = st.m2[k];
        out[2 * plane + k] = st.count;
      }
    }
  }
}

__global__ void __launch_bounds__(kFinalizeThreads)
    stats_finalize_kernel(const float* __restrict__ work, int64_t parts, int64_t work_parts, int64_t cols,
                          float eps, float* __restrict__ mean, float* __restrict__ var, float* __restrict__ rstd) {
  __shared__ float red[2 * kFinalizeThreads];
  const int64_t plane = work_parts * cols;
  for (int64_t c0 = int64_t(blockIdx.x) * blockDim.x; c0 < cols; c0 += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = c0 + threadIdx.x;
    const bool valid = c < cols;
    float s[2] = {0.f, 0.f};  // Σ n_p, Σ n_p·mean_p
    if (valid)
#pragma unroll 8
      for (int64_t p = threadIdx.y; p < parts; p += blockDim.y) {
        const float n = work[2 * plane + p * cols + c];
        s[0] += n;
        s[1] += n * work[p * cols + c];
      }
    column_sums<2>(s, red);
    const float m = s[1] / s[0];
    float q[1] = {0.f};  // Σ M2_p + n_p·(mean_p − mean)²
    if (valid)
#pragma unroll 8
      for (int64_t p = threadIdx.y; p < parts; p += blockDim.y)
        q[0] += chan_m2_term(work[plane + p * cols + c], work[2 * plane + p * cols + c], work[p * cols + c], m);
    column_sums<1>(q, red);
    if (threadIdx.y == 0 && valid) {
      const float v = q[0] / s[0];
      mean[c] = m;
      var[c] = v;
      rstd[c] = bn_rstd(v, eps);
    }
  }
}

// ------------------------------------------------------- forward, inference ---

__global__ void __launch_bounds__(kColThreads)
    running_stats_kernel(const float* __restrict__ mean_in, const float* __restrict__ var_in, int64_t cols,
                         float eps, float* __restrict__ mean, float* __restrict__ var, float* __restrict__ rstd) {
  for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < cols; c += int64_t(gridDim.x) * blockDim.x) {
    const float v = var_in[c];
    mean[c] = mean_in[c];
    var[c] = v;
    rstd[c] = bn_rstd(v, eps);
  }
}

// ------------------------------------------------------ forward, elementwise ---

// pre = (x − mean)·(scale·rstd) + bias for masked_fwd_kernel; a lane's PACK elements'
// per-channel values live in registers.
template <int PACK>
struct BnOp {
  const float* mean; const float* rstd; const float* scale; const float* bias;
  int64_t cols;
  float m[PACK], sr[PACK], b[PACK];

  __device__ __forceinline__ void prepare(int64_t base, bool load) {
    if (!load) return;
    int64_t c = base % cols;
#pragma unroll
    for (int k = 0; k < PACK; ++k) {
      m[k] = mean[c];
      sr[k] = scale[c] * rstd[c];
      b[k] = bias[c];
      c = c + 1 == cols ? 0 : c + 1;
    }
  }
  __device__ __forceinline__ float pre(int k, float x) const { return bn_pre(x, m[k], sr[k], b[k]); }
  __device__ __forceinline__ float scalar_pre(int64_t i, float x) const {
    const int64_t c = i % cols;
    return bn_pre(x, mean[c], scale[c] * rstd[c], bias[c]);
  }
};

// ------------------------------------------------------------------ backward ---

template <typename T, int PACK, int U>
__global__ void __launch_bounds__(kColThreads)
    grad_partials_kernel(const T* __restrict__ dy, const T* __restrict__ x, const uint32_t* __restrict__ mask,
                         const float* __restrict__ mean, const float* __restrict__ rstd, ColumnGrid g,
                         float* __restrict__ work) {
  extern __shared__ __align__(16) float col_smem[];  // [2·PACK][threads]
  const int ty = threadIdx.y, TX = blockDim.x, TY = blockDim.y;
  const int64_t part = blockIdx.x;
  const int64_t r0 = part * g.chunk_rows;
  const int64_t r1 = r0 + g.chunk_rows < g.rows ? r0 + g.chunk_rows : g.rows;
  const int64_t plane = g.work_parts * g.cols;
  for (int64_t tile = blockIdx.y; tile < g.tiles; tile += gridDim.y) {
    const int64_t pk = tile * TX + threadIdx.x;
    const bool valid = pk < g.npacks;
    const int64_t col = pk * PACK;
    float mu[PACK], rs[PACK];
    float acc[2 * PACK];  // Σg, then Σg·xhat, per channel
#pragma unroll
    for (int k = 0; k < PACK; ++k) {
      mu[k] = valid ? mean[col + k] : 0.f;
      rs[k] = valid ? rstd[col + k] : 0.f;
      acc[k] = acc[PACK + k] = 0.f;
    }
    // One row's pack: PACK | C, so the pack's bits lie in one mask word.
    auto add_row = [&](const float (&d)[PACK], const float (&xv)[PACK], uint32_t bits) {
#pragma unroll
      for (int k = 0; k < PACK; ++k) {
        const float gk = masked_grad((bits >> k) & 1u, d[k]);
        acc[k] += gk;
        acc[PACK + k] += gk * bn_xhat(xv[k], mu[k], rs[k]);
      }
    };
    if (valid) {
      int64_t r = r0 + ty;
      for (; r + int64_t(U - 1) * TY < r1; r += int64_t(U) * TY) {
        float d[U][PACK], xv[U][PACK];
        uint32_t bits[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t i = (r + int64_t(u) * TY) * g.cols + col;
          load_pack<T, PACK>(dy + i, d[u]);
          load_pack<T, PACK>(x + i, xv[u]);
          bits[u] = mask[i >> 5] >> (i & 31);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) add_row(d[u], xv[u], bits[u]);
      }
      for (; r < r1; r += TY) {
        const int64_t i = r * g.cols + col;
        float d[PACK], xv[PACK];
        load_pack<T, PACK>(dy + i, d);
        load_pack<T, PACK>(x + i, xv);
        add_row(d, xv, mask[i >> 5] >> (i & 31));
      }
    }
    column_sums<2 * PACK>(acc, col_smem);
    if (ty == 0 && valid) {
      float* out = work + part * g.cols + col;
#pragma unroll
      for (int k = 0; k < PACK; ++k) {
        out[k] = acc[k];
        out[plane + k] = acc[PACK + k];
      }
    }
  }
}

__global__ void __launch_bounds__(kFinalizeThreads)
    grad_finalize_kernel(const float* __restrict__ work, int64_t parts, int64_t work_parts, int64_t cols,
                         float* __restrict__ dscale, float* __restrict__ dbias) {
  __shared__ float red[2 * kFinalizeThreads];
  const int64_t plane = work_parts * cols;
  for (int64_t c0 = int64_t(blockIdx.x) * blockDim.x; c0 < cols; c0 += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = c0 + threadIdx.x;
    const bool valid = c < cols;
    float s[2] = {0.f, 0.f};  // Σg, Σg·xhat
    if (valid)
#pragma unroll 8
      for (int64_t p = threadIdx.y; p < parts; p += blockDim.y) {
        s[0] += work[p * cols + c];
        s[1] += work[plane + p * cols + c];
      }
    column_sums<2>(s, red);
    if (threadIdx.y == 0 && valid) {
      dbias[c] = s[0];
      dscale[c] = s[1];
    }
  }
}

// Per-channel values of the dx kernel.
struct DxChannel { float mean, rstd; DxCoef coef; };

__device__ __forceinline__ DxChannel dx_channel(const BwdArgs& a, int64_t c) {
  const float rstd = a.rstd[c];
  return DxChannel{a.mean[c], rstd,
                   dx_coefficients(a.scale[c], rstd, a.dscale[c], a.dbias[c], a.training ? a.gmean[c] : 0.f,
                                   a.training ? a.gvar[c] : 0.f, bwd_count(a), a.training)};
}

// dx = a·g + b·xhat + c, dz = g; warp tiles as in the forward (no shuffles here, the
// tiles keep a lane's channels fixed so their values stay in registers).
template <typename T, int PACK, bool HAS_Z>
__global__ void __launch_bounds__(kElemThreads) dx_kernel(BwdArgs a, WarpTiles plan) {
  using PackT = Pack<T, PACK>;
  constexpr int TILE = 32 * PACK;
  const int lane = threadIdx.x % 32;
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (warp >= plan.warps) return;
  const T* dy = static_cast<const T*>(a.dy);
  const T* x = static_cast<const T*>(a.x);
  T* dx = static_cast<T*>(a.dx);
  T* dz = static_cast<T*>(a.dz);
  DxChannel ch[PACK];
  for (int64_t t = warp; t < plan.tiles; t += plan.warps) {
    const int64_t base = t * TILE + int64_t(lane) * PACK;
    if (t == warp || plan.reload) {
      int64_t c = base % a.cols;
#pragma unroll
      for (int k = 0; k < PACK; ++k) {
        ch[k] = dx_channel(a, c);
        c = c + 1 == a.cols ? 0 : c + 1;
      }
    }
    if (base >= plan.covered) continue;
    const uint32_t bits = a.mask[base >> 5] >> (base & 31);  // a pack's bits share a word
    const PackT d = *reinterpret_cast<const PackT*>(dy + base);
    float xv[PACK], out[PACK];
    load_pack<T, PACK>(x + base, xv);
    PackT gz;
#pragma unroll
    for (int k = 0; k < PACK; ++k) {
      gz.v[k] = masked_grad((bits >> k) & 1u, d.v[k]);
      out[k] = bn_dx(ch[k].coef, to_float(gz.v[k]), bn_xhat(xv[k], ch[k].mean, ch[k].rstd));
    }
    store_pack<T, PACK>(dx + base, out);
    if constexpr (HAS_Z) *reinterpret_cast<PackT*>(dz + base) = gz;
  }
  const int64_t n = a.rows * a.cols;
  if (warp == 0 && plan.covered + lane < n) {  // fewer than PACK elements
    const int64_t i = plan.covered + lane;
    const DxChannel c = dx_channel(a, i % a.cols);
    const T gi = masked_grad(get_bit(a.mask, i), dy[i]);
    dx[i] = from_float<T>(bn_dx(c.coef, to_float(gi), bn_xhat(to_float(x[i]), c.mean, c.rstd)));
    if constexpr (HAS_Z) dz[i] = gi;
  }
}

// -------------------------------------------------------------- launchers ---

// Column tiles of at most kMaxTilePacks packs, TY rows of threads (TX·TY <= 256), and
// P' row chunks so that about kColBlocksPerSm blocks per multiprocessor run in all.
// Chunks are whole rounds of U·TY rows (U rows in flight per thread): a partial round
// runs row by row, one load at a time (measured at C = 32 f32: 380-row chunks, i.e. two
// rounds and up to four single rows per thread).
template <typename Kernel>
cudaError_t plan_columns(Kernel kernel, int floats_per_thread, int64_t rows, int64_t cols, int pack, int unroll,
                         int64_t work_parts, ColumnGrid* g, size_t* smem) {
  g->rows = rows;
  g->cols = cols;
  g->work_parts = work_parts;
  g->npacks = cols / pack;
  g->tiles = (g->npacks + kMaxTilePacks - 1) / kMaxTilePacks;
  g->tx = int((g->npacks + g->tiles - 1) / g->tiles);
  g->ty = kColThreads / g->tx;
  const int threads = g->tx * g->ty;
  *smem = size_t(floats_per_thread) * threads * sizeof(float);
  int per_sm = 0;
  cudaError_t err = max_blocks_per_sm(kernel, threads, *smem, &per_sm);
  if (err != cudaSuccess) return err;
  if (per_sm < 1) return cudaErrorInvalidConfiguration;
  if (per_sm > kColBlocksPerSm) per_sm = kColBlocksPerSm;
  const int64_t target = int64_t(per_sm) * sm_count();
  int64_t parts = (target + g->tiles - 1) / g->tiles;
  const int64_t max_parts = work_parts < rows ? work_parts : rows;
  parts = parts > max_parts ? max_parts : parts;
  parts = parts < 1 ? 1 : parts;
  const int64_t round_rows = int64_t(unroll) * g->ty;
  g->chunk_rows = ((rows + parts - 1) / parts + round_rows - 1) / round_rows * round_rows;
  g->parts = (rows + g->chunk_rows - 1) / g->chunk_rows;  // no empty chunks, parts <= before
  return cudaSuccess;
}

inline dim3 column_grid_dims(const ColumnGrid& g) {
  return dim3(unsigned(g.parts), unsigned(g.tiles < 65535 ? g.tiles : 65535));
}

// Blocks of (TX channels) x (kFinalizeThreads / TX partial rows) for the finalize kernels.
inline void finalize_geometry(int64_t cols, dim3* block, int* blocks) {
  int tx = 1;
  while (tx < kFinalizeChannels && tx < cols) tx *= 2;
  *block = dim3(unsigned(tx), unsigned(kFinalizeThreads / tx));
  const int64_t tiles = (cols + tx - 1) / tx;
  const int64_t cap = int64_t(sm_count()) * 8;
  *blocks = int(tiles < cap ? tiles : cap);
}

template <typename T, int PACK>
cudaError_t launch_stats_partials(const FwdArgs& a, int64_t* parts, cudaStream_t stream) {
  constexpr int U = PACK == 1 ? 8 : 4;
  auto kernel = stats_partials_kernel<T, PACK, U>;
  ColumnGrid g;
  size_t smem = 0;
  cudaError_t err = plan_columns(kernel, 2 * PACK + 1, a.rows, a.cols, PACK, U, a.work_parts, &g, &smem);
  if (err != cudaSuccess) return err;
  kernel<<<column_grid_dims(g), dim3(unsigned(g.tx), unsigned(g.ty)), smem, stream>>>(
      static_cast<const T*>(a.x), g, a.work);
  *parts = g.parts;
  return cudaGetLastError();
}

// Training statistics of a's rows: Welford partials, then the fixed-order combine into
// mean, var, rstd (also the batch-sharded forward's per-device stage).
template <typename T>
cudaError_t launch_stats(const FwdArgs& a, cudaStream_t stream) {
  if (a.cols == 0) return cudaSuccess;
  dim3 block;
  int blocks = 0;
  finalize_geometry(a.cols, &block, &blocks);
  // No rows (never sent by the Python layer): no partials, and 0/0 statistics.
  int64_t parts = 0;
  if (a.rows > 0) {
    constexpr int VEC = 16 / sizeof(T);
    const cudaError_t err = a.cols % VEC == 0 && aligned_to(a.x, 16) ? launch_stats_partials<T, VEC>(a, &parts, stream)
                                                                     : launch_stats_partials<T, 1>(a, &parts, stream);
    if (err != cudaSuccess) return err;
  }
  stats_finalize_kernel<<<blocks, block, 0, stream>>>(a.work, parts, a.work_parts, a.cols, a.eps, a.mean, a.var,
                                                      a.rstd);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_fwd(const FwdArgs& a, cudaStream_t stream) {
  if (a.cols == 0) return cudaSuccess;
  cudaError_t err;
  if (a.training) {
    err = launch_stats<T>(a, stream);
  } else {
    dim3 block;
    int blocks = 0;
    finalize_geometry(a.cols, &block, &blocks);
    const int64_t needed = (a.cols + kColThreads - 1) / kColThreads;
    running_stats_kernel<<<int(needed < blocks ? needed : blocks), kColThreads, 0, stream>>>(
        a.mean_in, a.var_in, a.cols, a.eps, a.mean, a.var, a.rstd);
    err = cudaGetLastError();
  }
  if (err != cudaSuccess) return err;
  const int64_t n = a.rows * a.cols;
  if (n == 0) return cudaSuccess;
  auto make_op = [&](auto pack) {
    return BnOp<decltype(pack)::value>{a.mean, a.rstd, a.scale, a.bias, a.cols, {}, {}, {}};
  };
  return launch_masked_fwd_any<T>(a.x, a.z, a.y, a.mask, n, a.cols, make_op, stream);
}

template <typename T, int PACK>
cudaError_t launch_grad_partials(const BwdArgs& a, int64_t* parts, cudaStream_t stream) {
  constexpr int U = PACK == 1 ? 8 : 4;
  auto kernel = grad_partials_kernel<T, PACK, U>;
  ColumnGrid g;
  size_t smem = 0;
  cudaError_t err = plan_columns(kernel, 2 * PACK, a.rows, a.cols, PACK, U, a.work_parts, &g, &smem);
  if (err != cudaSuccess) return err;
  kernel<<<column_grid_dims(g), dim3(unsigned(g.tx), unsigned(g.ty)), smem, stream>>>(
      static_cast<const T*>(a.dy), static_cast<const T*>(a.x), a.mask, a.mean, a.rstd, g, a.work);
  *parts = g.parts;
  return cudaGetLastError();
}

template <typename T, int PACK, bool HAS_Z>
cudaError_t launch_dx(const BwdArgs& a, cudaStream_t stream) {
  auto kernel = dx_kernel<T, PACK, HAS_Z>;
  WarpTiles plan;
  const cudaError_t err = plan_warp_tiles(kernel, a.rows * a.cols / PACK * PACK, PACK, a.cols, &plan);
  if (err != cudaSuccess) return err;
  kernel<<<plan.blocks, kElemThreads, 0, stream>>>(a, plan);
  return cudaGetLastError();
}

// dbias = Σg, dscale = Σg·xhat over a's rows (also the batch-sharded backward's first
// per-device stage).
template <typename T>
cudaError_t launch_grad_sums(const BwdArgs& a, cudaStream_t stream) {
  if (a.cols == 0) return cudaSuccess;
  cudaError_t err;
  if (a.rows == 0) {  // sums over no rows
    if ((err = cudaMemsetAsync(a.dscale, 0, size_t(a.cols) * sizeof(float), stream)) != cudaSuccess) return err;
    return cudaMemsetAsync(a.dbias, 0, size_t(a.cols) * sizeof(float), stream);
  }
  constexpr int VEC = 16 / sizeof(T);
  int64_t parts = 0;
  err = a.cols % VEC == 0 && aligned_to(a.x, 16) && aligned_to(a.dy, 16)
            ? launch_grad_partials<T, VEC>(a, &parts, stream)
            : launch_grad_partials<T, 1>(a, &parts, stream);
  if (err != cudaSuccess) return err;
  dim3 block;
  int blocks = 0;
  finalize_geometry(a.cols, &block, &blocks);
  grad_finalize_kernel<<<blocks, block, 0, stream>>>(a.work, parts, a.work_parts, a.cols, a.dscale, a.dbias);
  return cudaGetLastError();
}

// dx (and dz) from the given dscale/dbias (the batch-sharded backward's second stage).
template <typename T>
cudaError_t launch_dx_any(const BwdArgs& a, cudaStream_t stream) {
  if (a.cols == 0 || a.rows == 0) return cudaSuccess;
  constexpr int VEC = 16 / sizeof(T);
  const bool vec = aligned_to(a.dy, 16) && aligned_to(a.x, 16) && aligned_to(a.dx, 16) && aligned_to(a.dz, 16);
  if (a.dz != nullptr) return vec ? launch_dx<T, VEC, true>(a, stream) : launch_dx<T, 1, true>(a, stream);
  return vec ? launch_dx<T, VEC, false>(a, stream) : launch_dx<T, 1, false>(a, stream);
}

template <typename T>
cudaError_t launch_bwd(const BwdArgs& a, cudaStream_t stream) {
  const cudaError_t err = launch_grad_sums<T>(a, stream);
  if (err != cudaSuccess) return err;
  return launch_dx_any<T>(a, stream);
}

}  // namespace jax_ops::bn
