// Fused cross-entropy CUDA kernels (forward with the gradient in the same pass, and the
// backward's in-place row scaling) and their launchers. The math is
// cross_entropy_math.h's (the CPU handlers run the same formulas).
//
// A block per row (a persistent grid walks the rows; 32..512 threads, about 8 packs a
// thread). Rows of any length are read in 16-byte packs: a row starting off a 16-byte
// boundary (cols not a multiple of the pack) has a scalar head and tail around an
// aligned body (RowGeom), so an odd vocabulary (50257) is read at full width too.
//   forward with the gradient (training), row in shared memory: the row is staged by
//     cp.async (every pack in flight at once), then three shared-memory passes: the
//     max of the kept logits (block-reduced), Σ exp, Σ z and the kept count
//     (block-reduced together), then dlogits. Logits are read from HBM once and
//     dlogits written once: the byte floor of a fused forward + backward.
//   rows past shared memory, and the forward without the gradient: one pass merging
//     per-pack (max, Σ exp) pairs (online softmax) over global memory; with the
//     gradient a second pass re-reads the row. Measured on the H100 (bf16, 128256 and
//     262144 columns): 1.46x the time of a copy, i.e. the second read misses L2 (with
//     one or two blocks per SM, or the second pass run backwards, it was slower or the
//     same). Thread-block clusters staging a row in 2-4 SMs' shared memory are the
//     way to one read there.
//   backward: dlogits scaled by g row by row, in place (XLA aliases the result to the
//     operand); rows with g == 1 (the usual cotangent of a mean or sum) are skipped,
//     so a reduced loss costs one pass over the logits in all.
// No atomics: every reduction runs in a fixed order, results are bitwise reproducible.
#pragma once
#include <cuda_runtime.h>
#include <type_traits>
#include "cuda_src/common.h"
#include "cuda_src/cuda_utils.cuh"
#include "cuda_src/cross_entropy_math.h"

namespace jax_ops::ce {

constexpr int kMaxThreads = 512;

// ------------------------------------------------------------ reductions ---

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// Block max, returned to every thread (fixed order).
__device__ __forceinline__ float block_max(float v) {
  __shared__ float red[32];
  __shared__ float bcast;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = (blockDim.x + 31) / 32;
  v = warp_max(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float w = lane < nwarps ? red[lane] : neg_inf();
    w = warp_max(w);
    if (lane == 0) bcast = w;
  }
  __syncthreads();
  return bcast;
}

// Block sums of N values, returned to every thread (fixed order).
template <int N>
__device__ __forceinline__ void block_sums(float (&v)[N]) {
  __shared__ float red[N][32];
  __shared__ float bcast[N];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = (blockDim.x + 31) / 32;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    v[i] = group_sum<32>(v[i]);
    if (lane == 0) red[i][warp] = v[i];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      float w = lane < nwarps ? red[i][lane] : 0.f;
      w = group_sum<32>(w);
      if (lane == 0) bcast[i] = w;
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = bcast[i];
}

// -------------------------------------------------------------- row io ---

// Where a row's 16-byte packs are: the base pointers are 16-byte aligned, so row r
// starts `off` = (r * cols) % PACK elements past a pack boundary. Columns [0, head)
// and [body_end, cols) are read one by one (scalars), [head, body_end) as nbody packs.
template <int PACK>
struct RowGeom {
  int64_t off = 0, head = 0, nbody, body_end, nscalar = 0;
  __device__ __forceinline__ RowGeom(int64_t row, int64_t cols) {
    if constexpr (PACK == 1) {
      nbody = cols;
      body_end = cols;
    } else {
      off = (row * cols) % PACK;
      head = off ? PACK - off : 0;
      if (head > cols) head = cols;
      nbody = (cols - head) / PACK;
      body_end = head + nbody * PACK;
      nscalar = head + (cols - body_end);
    }
  }
  // The column of this row's i-th scalar (head first, then tail).
  __device__ __forceinline__ int64_t scalar_col(int64_t i) const { return i < head ? i : body_end + (i - head); }
};

// fp(p, col) for this thread's body packs (col: the pack's first column), fs(col) for
// its scalar columns. Every pass of a row gives a thread the same packs and scalars.
template <int PACK, typename FP, typename FS>
__device__ __forceinline__ void for_each_own(const RowGeom<PACK>& g, FP&& fp, FS&& fs) {
#pragma unroll 4
  for (int64_t p = threadIdx.x; p < g.nbody; p += blockDim.x) fp(p, g.head + p * PACK);
  if constexpr (PACK > 1)
    for (int64_t i = threadIdx.x; i < g.nscalar; i += blockDim.x) fs(g.scalar_col(i));
}

// A pack through the read-only path (16-byte packs as one ld.global.nc.v4).
template <typename P>
__device__ __forceinline__ P load_global(const P* ptr) {
  if constexpr (sizeof(P) == 16) {
    P out;
    *reinterpret_cast<uint4*>(&out) = __ldg(reinterpret_cast<const uint4*>(ptr));
    return out;
  } else {
    return *ptr;
  }
}

// A pack as floats; bf16 pairs through 32-bit words (one shift or mask each).
template <typename T, int PACK>
__device__ __forceinline__ void unpack(const Pack<T, PACK>& pk, float (&f)[PACK]) {
  if constexpr (std::is_same_v<T, bf16_t> && PACK % 2 == 0) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(&pk);
#pragma unroll
    for (int k = 0; k < PACK / 2; ++k) {
      f[2 * k] = __uint_as_float(w[k] << 16);
      f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int k = 0; k < PACK; ++k) f[k] = to_float(pk.v[k]);
  }
}

// Copies this thread's packs (p = threadIdx.x + k * blockDim.x) from global to shared
// memory by cp.async (sm_80+, 16-byte packs; all of them in flight at once, none staged
// in registers); wait_copies() waits for them. Only the copying thread reads a pack back.
template <typename PackT>
__device__ __forceinline__ void copy_packs_to_smem(PackT* dst, const PackT* src, int64_t n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (sizeof(PackT) == 16) {
    for (int64_t p = threadIdx.x; p < n; p += blockDim.x) {
      const unsigned saddr = static_cast<unsigned>(__cvta_generic_to_shared(dst + p));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(saddr), "l"(src + p) : "memory");
    }
  } else
#endif
  {
    for (int64_t p = threadIdx.x; p < n; p += blockDim.x) dst[p] = src[p];
  }
}

__device__ __forceinline__ void wait_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
#endif
}

// ---------------------------------------------------------------- forward ---

// Merges N logits (kept where k) into the running row statistics: their own max and
// Σ exp against it, then one merge (online softmax).
template <bool MASKED, int N>
__device__ __forceinline__ void add_online(RowStats& st, const float (&z)[N], const bool (&k)[N]) {
  float pm = neg_inf();
#pragma unroll
  for (int j = 0; j < N; ++j)
    if (k[j]) pm = fmaxf(pm, z[j]);
  const float sh = safe_max(pm);
  float ps = 0.f;
#pragma unroll
  for (int j = 0; j < N; ++j)
    if (k[j]) {
      ps += row_exp(z[j], sh);
      st.sum_z += z[j];
      if constexpr (MASKED) st.n += 1.f;
    }
  st.merge(pm, ps);
}

// CACHE: the row is staged in shared memory (cols + PACK elements: column c at element
// c + off, so the body packs are aligned there too); else it is read from global memory
// (twice with the gradient). MASKED: a bool mask row says which columns are kept.
template <typename T, int PACK, bool CACHE, bool MASKED>
__global__ void __launch_bounds__(kMaxThreads) fwd_kernel(FwdArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  using PackT = Pack<T, PACK>;
  T* cache = reinterpret_cast<T*>(smem_raw);
  const float ls = a.label_smoothing, zl = a.z_loss;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const RowGeom<PACK> geo(row, a.cols);
    const T* x = static_cast<const T*>(a.logits) + row * a.cols;
    const PackT* xbody = reinterpret_cast<const PackT*>(x + geo.head);
    PackT* cbody = reinterpret_cast<PackT*>(cache + (geo.off ? PACK : 0));
    const uint8_t* keep = nullptr;
    if constexpr (MASKED) keep = a.mask + (a.mask_rows == 1 ? 0 : row) * a.cols;
    auto kept = [&](int64_t col) -> bool {
      if constexpr (MASKED) return __ldg(keep + col) != 0;
      else return true;
    };
    const int32_t label = a.labels[row];
    const float w = a.weight == nullptr ? 0.f : a.weight[row];
    // One address for the block. A shard's partials count a label elsewhere as 0.
    float z_label = label_in_range(label, a.cols) ? to_float(x[label]) : (a.parts != nullptr ? 0.f : NAN);

    // The row into shared memory. The packs' shared-memory slots move with the row's
    // alignment: a thread could overwrite a slot another thread still reads from the
    // previous row. The scalar head/tail are read by other threads than their writers
    // (the first block reduction, or the barrier of apply mode, orders them).
    auto stage_row = [&]() {
      if (a.cols % PACK != 0) __syncthreads();
      copy_packs_to_smem(cbody, xbody, geo.nbody);
      if constexpr (PACK > 1)
        for (int64_t i = threadIdx.x; i < geo.nscalar; i += blockDim.x) {
          const int64_t col = geo.scalar_col(i);
          cache[col + geo.off] = x[col];
        }
      wait_copies();
    };

    float m = neg_inf(), sums[3] = {0.f, 0.f, 0.f};  // Σ exp, Σ z, kept count
    const float* given = a.stats == nullptr ? nullptr : a.stats + row * kStatCount;
    if (given != nullptr) {  // apply: the whole row's statistics, merged over the shards
      m = given[0];
      sums[0] = given[1];
      sums[1] = given[2];
      sums[2] = given[3];
      z_label = given[4];
      if constexpr (CACHE) {  // staged for the gradient pass only
        stage_row();
        __syncthreads();
      }
    } else if constexpr (CACHE) {
      stage_row();
      float mx = neg_inf();
      for_each_own<PACK>(geo, [&](int64_t p, int64_t col) {
        float z[PACK];
        unpack(cbody[p], z);
#pragma unroll
        for (int k = 0; k < PACK; ++k)
          if (kept(col + k)) mx = fmaxf(mx, z[k]);
      }, [&](int64_t col) {
        if (kept(col)) mx = fmaxf(mx, to_float(cache[col + geo.off]));
      });
      m = block_max(mx);
      const float ms = safe_max(m);
      auto add = [&](float z, bool k) {
        if (!k) return;
        sums[0] += row_exp(z, ms);
        sums[1] += z;
        if constexpr (MASKED) sums[2] += 1.f;
      };
      for_each_own<PACK>(geo, [&](int64_t p, int64_t col) {
        float z[PACK];
        unpack(cbody[p], z);
#pragma unroll
        for (int k = 0; k < PACK; ++k) add(z[k], kept(col + k));
      }, [&](int64_t col) { add(to_float(cache[col + geo.off]), kept(col)); });
      block_sums(sums);
    } else {
      RowStats st;
      for_each_own<PACK>(geo, [&](int64_t p, int64_t col) {
        float z[PACK];
        bool k[PACK];
        unpack(load_global(xbody + p), z);
#pragma unroll
        for (int j = 0; j < PACK; ++j) k[j] = kept(col + j);
        add_online<MASKED>(st, z, k);
      }, [&](int64_t col) {
        const float z[1] = {to_float(x[col])};
        const bool k[1] = {kept(col)};
        add_online<MASKED>(st, z, k);
      });
      m = block_max(st.m);
      sums[0] = m == neg_inf() ? st.s : st.s * exp_f32(st.m - m);
      sums[1] = st.sum_z;
      sums[2] = st.n;
      block_sums(sums);
    }
    const float n = given != nullptr || MASKED ? sums[2] : float(a.cols);
    if (a.parts != nullptr) {  // partials: the shard's statistics only
      if (threadIdx.x == 0) {
        float* out = a.parts + row * kStatCount;
        out[0] = m;
        out[1] = sums[0];
        out[2] = sums[1];
        out[3] = n;
        out[4] = z_label;
      }
      continue;
    }
    const RowOut r = finish_row(m, sums[0], sums[1], n, z_label, w, ls, zl);
    if (threadIdx.x == 0) {
      a.loss[row] = r.loss;
      a.lse[row] = r.lse;
    }
    if (a.dlogits == nullptr) continue;

    T* d = static_cast<T*>(a.dlogits) + row * a.cols;
    PackT* dbody = reinterpret_cast<PackT*>(d + geo.head);
    if (r.zero) {  // an ignored row: zeros, whatever its logits hold
      float zero[PACK] = {};
      for_each_own<PACK>(geo, [&](int64_t p, int64_t) { store_pack<T, PACK>(reinterpret_cast<T*>(dbody + p), zero); },
                         [&](int64_t col) { d[col] = from_float<T>(0.f); });
      continue;
    }
    for_each_own<PACK>(geo, [&](int64_t p, int64_t col) {
      float z[PACK];
      unpack(CACHE ? cbody[p] : load_global(xbody + p), z);
      const int64_t lk = int64_t(label) - col;  // the label's place in this pack, if any
#pragma unroll
      for (int k = 0; k < PACK; ++k) z[k] = grad_elem(z[k], kept(col + k), k == lk, r);
      store_pack<T, PACK>(reinterpret_cast<T*>(dbody + p), z);
    }, [&](int64_t col) {
      const float z = to_float(CACHE ? cache[col + geo.off] : x[col]);
      d[col] = from_float<T>(grad_elem(z, kept(col), col == label, r));
    });
  }
}

// --------------------------------------------------------------- backward ---

template <typename T, int PACK>
__global__ void __launch_bounds__(kMaxThreads) bwd_kernel(BwdArgs a) {
  using PackT = Pack<T, PACK>;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const float g = a.g[row];
    if (a.skip_ones && g == 1.f) continue;  // in place: nothing to do
    const RowGeom<PACK> geo(row, a.cols);
    const T* in = static_cast<const T*>(a.in) + row * a.cols;
    T* out = static_cast<T*>(a.out) + row * a.cols;
    const PackT* ibody = reinterpret_cast<const PackT*>(in + geo.head);
    T* obody = out + geo.head;
    for_each_own<PACK>(geo, [&](int64_t p, int64_t) {
      float v[PACK];
      unpack(ibody[p], v);  // a plain load: the result aliases dlogits
#pragma unroll
      for (int k = 0; k < PACK; ++k) v[k] *= g;
      store_pack<T, PACK>(obody + p * PACK, v);
    }, [&](int64_t col) { out[col] = from_float<T>(g * to_float(in[col])); });
  }
}

// -------------------------------------------------------------- launchers ---

// About 8 packs a thread, 32..kMaxThreads threads.
inline int row_threads(int64_t cols, int pack) {
  const int64_t want = ((cols + pack - 1) / pack + 7) / 8;
  const int64_t rounded = (want + 31) / 32 * 32;
  return int(rounded < 32 ? 32 : rounded > kMaxThreads ? kMaxThreads : rounded);
}

template <typename T, int PACK, bool MASKED>
cudaError_t launch_fwd_as(const FwdArgs& a, cudaStream_t stream) {
  const int threads = row_threads(a.cols, PACK);
  int blocks = 0;
  if (a.dlogits != nullptr) {  // training: the row staged in shared memory when it fits
    const size_t smem = size_t(a.cols + PACK) * sizeof(T);
    auto cached = fwd_kernel<T, PACK, true, MASKED>;
    if (cached_grid(cached, threads, smem, a.rows, &blocks)) {
      cached<<<blocks, threads, smem, stream>>>(a);
      return cudaGetLastError();
    }
  }
  auto uncached = fwd_kernel<T, PACK, false, MASKED>;
  const cudaError_t err = resident_blocks(uncached, threads, 0, a.rows, &blocks);
  if (err != cudaSuccess) return err;

  uncached<<<blocks, threads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_fwd(const FwdArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.cols == 0) return cudaSuccess;
  constexpr int VEC = 16 / sizeof(T);
  const bool vec_ok = aligned_to(a.logits, 16) && aligned_to(a.dlogits, 16);
  if (a.mask != nullptr)
    return vec_ok ? launch_fwd_as<T, VEC, true>(a, stream) : launch_fwd_as<T, 1, true>(a, stream);
  return vec_ok ? launch_fwd_as<T, VEC, false>(a, stream) : launch_fwd_as<T, 1, false>(a, stream);
}

template <typename T, int PACK>
cudaError_t launch_bwd_as(const BwdArgs& a, cudaStream_t stream) {
  auto kernel = bwd_kernel<T, PACK>;
  const int threads = row_threads(a.cols, PACK);
  int blocks = 0;
  const cudaError_t err = resident_blocks(kernel, threads, 0, a.rows, &blocks);
  if (err != cudaSuccess) return err;
  kernel<<<blocks, threads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_bwd(const BwdArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.cols == 0) return cudaSuccess;
  constexpr int VEC = 16 / sizeof(T);
  const bool vec_ok = aligned_to(a.in, 16) && aligned_to(a.out, 16);
  return vec_ok ? launch_bwd_as<T, VEC>(a, stream) : launch_bwd_as<T, 1>(a, stream);
}

}  // namespace jax_ops::ce
