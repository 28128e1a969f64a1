// LayerNorm / RMSNorm CUDA kernels (forward and backward) and their launchers.
//
// Rows are the flattened leading axes, normalization runs over the last axis.
// Forward tiers, by row length (cols):
//   row <= 8 KiB : a group of WIDTH lanes (1..32) per row, row held in registers;
//                  groups narrower than a warp take two rows at a time.
//   <= 4096 packs: a block per row, row in registers (up to 4 packs a thread, up to
//                  1024 threads; with a residual, rows over 4 KiB).
//   longer rows  : a block per row, row cached in shared memory, or read twice
//                  from global memory when shared memory cannot hold it; on sm_90
//                  rows over 64 KiB split over a cluster of 2-8 blocks, each caching
//                  its slice (statistics exchanged through distributed shared memory).
// Backward tiers:
//   cols <= 1024 : group per row, x and dy in registers, per-column dscale/dbias
//                  partials in registers, summed per block through shared memory
//                  (on sm_90 from 128 columns, and per pair of blocks through
//                  distributed shared memory).
//   cols <= 8192 : block per row, row and partials in registers; on sm_90 16-bit rows
//                  of 4096+ columns are staged in shared memory by bulk copies (TMA),
//                  3 a block in flight through the per-row barriers.
//   larger, sm_90: the same kernel with each row split over a thread-block cluster
//                  of 2-8 blocks (row sums exchanged through distributed shared
//                  memory), up to 8 values a thread: rows of up to 65536 (bf16);
//                  16-bit rows keep their dscale/dbias partials (and scale) in
//                  shared memory instead, one pack of each of two rows a thread,
//                  in clusters of any size from 2 to 8 (the most rows in flight).
//   larger       : block per row for dx (x, dy cached in shared memory or read
//                  twice) and a column-tiled kernel for the dscale/dbias partials.
// Partials are [partial_rows, cols] float32 and summed by a second kernel in a
// fixed order: no atomics, bitwise reproducible.
// add+norm (OneFlow-style functors): the forward kernels read their row through a
// Load functor (LoadX: x; LoadAdd: h = x + residual rounded to T, stored to h as it
// is read) and the backward kernels write dx through a Store functor (StoreDx, or
// StoreDxAddDh: dx + dh, dh prefetched to L2 with the row where it is not loaded with
// it), so every tier serves both with no copied kernels.
#pragma once
#include <cuda_runtime.h>
#include <algorithm>
#include <initializer_list>
#include <type_traits>
#include "cuda_src/common.h"
#include "cuda_src/cuda_utils.cuh"
#include "cuda_src/norm_math.h"

namespace jax_ops::norm {

constexpr int kRegsThreads = 128;
// The narrow backward's prefetching kernels: 20 warps an SM (five 128-thread blocks).
constexpr int kRegsPrefetchSmThreads = 640;
// Forward keeps a row of up to 8 KiB in registers (4096 16-bit or 2048 float32
// values; 1024 when unvectorized; 16 KiB rows measured slower: fewer warps fit);
// the backward, which also holds dy and the
// dscale/dbias partials, up to 1024 values.
constexpr int kFwdRegsMaxBytes = 8192;
constexpr int kRegsMaxCols = 1024;
template <typename T, int PACK>
constexpr int64_t fwd_regs_max_cols() { return PACK == 1 ? kRegsMaxCols : kFwdRegsMaxBytes / int(sizeof(T)); }
// Block-per-row backward keeps 8 elements of x, dy and partials per thread at most
// (about 64 registers at 1024 threads), so rows up to 8192 elements.
constexpr int kBlockRegsMaxCols = 8192;

template <typename P, int PACK>
__device__ __forceinline__ void load_param(const void* p, int64_t col, float fallback, float (&out)[PACK]) {
  if (p == nullptr) {
#pragma unroll
    for (int k = 0; k < PACK; ++k) out[k] = fallback;
  } else {
    load_pack<P, PACK>(static_cast<const P*>(p) + col, out);
  }
}

// The split column layout of a forward row (SPLIT kernels: 16-bit values, float32
// parameters). A pack of PACK contiguous columns needs 2 * PACK * 4 bytes of each
// parameter: a warp's two 16-byte loads each touch all 32 sectors of 1 KiB, half of
// every sector, and most second touches missed L1 (ncu, 65536 columns: parameters came
// from L2 1.3-1.6 times, the forward at the L2's limit; docs/perf-notes.md). Split, the
// 32 packs v0..v0+31 (v0 = v & ~31) still cover columns [v0 * PACK, (v0 + 32) * PACK),
// but lane v % 32 takes PACK / 2 of them in each half of that span, so a warp's
// parameter load reads 512 contiguous bytes. Needs whole groups of 32 packs (nvec % 32
// == 0); the statistics do not depend on the layout.
template <int PACK>
__device__ __forceinline__ int64_t split_col(int64_t v, int half) {
  return (v & ~int64_t(31)) * PACK + (v & 31) * (PACK / 2) + half * (16 * PACK);
}

// Pack v of a row (starting at flat index row_base) through the load functor.
template <int PACK, bool SPLIT, typename Load, typename T>
__device__ __forceinline__ void load_row_pack(const Load& load, int64_t row_base, int64_t v, Pack<T, PACK>& pk) {
  if constexpr (SPLIT) {
    Pack<T, PACK / 2> lo, hi;
    load(row_base + split_col<PACK>(v, 0), lo);
    load(row_base + split_col<PACK>(v, 1), hi);
#pragma unroll
    for (int k = 0; k < PACK / 2; ++k) { pk.v[k] = lo.v[k]; pk.v[PACK / 2 + k] = hi.v[k]; }
  } else {
    load(row_base + v * PACK, pk);
  }
}

// Pack v's parameter values (fallback where the parameter is absent).
template <typename P, int PACK, bool SPLIT>
__device__ __forceinline__ void load_pack_param(const void* p, int64_t v, float fallback, float (&out)[PACK]) {
  if constexpr (SPLIT) {
    float lo[PACK / 2], hi[PACK / 2];
    load_param<P, PACK / 2>(p, split_col<PACK>(v, 0), fallback, lo);
    load_param<P, PACK / 2>(p, split_col<PACK>(v, 1), fallback, hi);
#pragma unroll
    for (int k = 0; k < PACK / 2; ++k) { out[k] = lo[k]; out[PACK / 2 + k] = hi[k]; }
  } else {
    load_param<P, PACK>(p, v * PACK, fallback, out);
  }
}

// Welford/sum-of-squares merge over aligned groups of WIDTH lanes. The lower
// lane's state always goes first, so every lane ends with bitwise equal stats.
template <int WIDTH>
__device__ __forceinline__ NormAcc group_merge(NormAcc acc, bool rms) {
#pragma unroll
  for (int off = WIDTH / 2; off > 0; off /= 2) {
    NormAcc o;
    o.mean = __shfl_xor_sync(0xffffffffu, acc.mean, off, WIDTH);
    o.m2 = __shfl_xor_sync(0xffffffffu, acc.m2, off, WIDTH);
    o.count = __shfl_xor_sync(0xffffffffu, acc.count, off, WIDTH);
    if (threadIdx.x & off) { o.merge(acc, rms); acc = o; }
    else acc.merge(o, rms);
  }
  return acc;
}

// Merge over aligned groups of WIDTH lanes of any counts, by sums: the group's count and
// mean (one division), then M2 = sum of (m2 + count * (mean_lane - mean)^2). Butterfly
// sums end bitwise equal on every lane (a + b == b + a), and no lane waits on a divergent
// Welford merge (a warp's two branches, a division each, five times): a row's last pass
// leaves one warp of mixed counts (16392 columns at 5 packs on 416 threads), and the
// block waits for that warp.
template <int WIDTH>
__device__ __forceinline__ NormAcc group_merge_sums(NormAcc acc, bool rms) {
  float n = acc.count, s = acc.mean * acc.count;
#pragma unroll
  for (int off = WIDTH / 2; off > 0; off /= 2) {
    n += __shfl_xor_sync(0xffffffffu, n, off, WIDTH);
    if (!rms) s += __shfl_xor_sync(0xffffffffu, s, off, WIDTH);
  }
  const float mean = (rms || n == 0.f) ? 0.f : fast_div(s, n);
  const float d = acc.mean - mean;
  float q = rms ? acc.m2 : acc.m2 + acc.count * d * d;
#pragma unroll
  for (int off = WIDTH / 2; off > 0; off /= 2) q += __shfl_xor_sync(0xffffffffu, q, off, WIDTH);
  NormAcc out;
  out.mean = mean; out.m2 = q; out.count = n;
  return out;
}

// Chan's merge of two halves holding the same count n each: no division (the general
// Welford merge divides by the summed count, and lanes diverge on which state goes first).
// The lower lane's state goes first, so every lane ends with bitwise equal stats.
template <int WIDTH>
__device__ __forceinline__ void group_merge_equal(float& mean, float& m2, float& n, int lane, bool rms) {
#pragma unroll
  for (int off = WIDTH / 2; off > 0; off /= 2) {
    const float om = __shfl_xor_sync(0xffffffffu, mean, off), oq = __shfl_xor_sync(0xffffffffu, m2, off);
    const bool upper = lane & off;
    const float lo_m = upper ? om : mean, hi_m = upper ? mean : om;
    const float lo_q = upper ? oq : m2, hi_q = upper ? m2 : oq;
    const float d = hi_m - lo_m;
    mean = rms ? 0.f : 0.5f * (lo_m + hi_m);
    m2 = (lo_q + hi_q) + (rms ? 0.f : d * d * (0.5f * n));
    n *= 2.f;
  }
}

// Whole-block merge, the block's state valid in warp 0. `uniform`: every thread
// holds the same count (the row is K packs of every thread), so the warps merge equal
// halves without division, and warp 0 too when the warps are a power of two. (The
// general merges took 6-10 % of the LayerNorm forward at 16384-32768 columns on the
// H100: docs/perf-notes.md.) Other merges by sums (group_merge_sums; LayerNorm's forward
// 1.07-1.16x faster at 4352-22528 columns on the H200), or with SUMS false the Welford
// merges (group_merge).
template <bool SUMS = true>
__device__ __forceinline__ NormAcc block_acc_warp0(NormAcc acc, bool rms, bool uniform) {
  __shared__ float red[3][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = (blockDim.x + 31) / 32;
  uniform = uniform && blockDim.x % 32 == 0;
  if (uniform) group_merge_equal<32>(acc.mean, acc.m2, acc.count, lane, rms);
  else if constexpr (SUMS) acc = group_merge_sums<32>(acc, rms);
  else acc = group_merge<32>(acc, rms);
  if (lane == 0) { red[0][warp] = acc.mean; red[1][warp] = acc.m2; red[2][warp] = acc.count; }
  __syncthreads();
  if (warp == 0) {
    NormAcc w;
    if (lane < nwarps) { w.mean = red[0][lane]; w.m2 = red[1][lane]; w.count = red[2][lane]; }
    if (uniform && (nwarps & (nwarps - 1)) == 0) {
      // Lanes past nwarps exchange only among themselves (offsets < nwarps).
      if (nwarps == 32) group_merge_equal<32>(w.mean, w.m2, w.count, lane, rms);
      else if (nwarps == 16) group_merge_equal<16>(w.mean, w.m2, w.count, lane, rms);
      else if (nwarps == 8) group_merge_equal<8>(w.mean, w.m2, w.count, lane, rms);
      else if (nwarps == 4) group_merge_equal<4>(w.mean, w.m2, w.count, lane, rms);
      else if (nwarps == 2) group_merge_equal<2>(w.mean, w.m2, w.count, lane, rms);
    } else if constexpr (SUMS) {
      w = group_merge_sums<32>(w, rms);
    } else {
      w = group_merge<32>(w, rms);
    }
    acc = w;
  }
  return acc;
}

// The block's row statistics, returned to every thread.
template <bool SUMS = true>
__device__ __forceinline__ RowStats block_stats(NormAcc acc, int64_t cols, float eps, bool rms, bool uniform = false) {
  __shared__ RowStats bcast;
  const NormAcc w = block_acc_warp0<SUMS>(acc, rms, uniform);
  if (threadIdx.x == 0) bcast = finish_stats(w, cols, eps, rms);
  __syncthreads();
  return bcast;
}

// Sums of N values over the block (fixed order), valid in warp 0; red: [N][32] floats
// of shared memory.
template <int N>
__device__ __forceinline__ void block_sum_warp0(float (&v)[N], float (*red)[32]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = (blockDim.x + 31) / 32;
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = group_sum<32>(v[i]);
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) red[i][warp] = v[i];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = group_sum<32>(lane < nwarps ? red[i][lane] : 0.f);
  }
}

// Sums of two values over the block, returned to every thread (fixed order).
__device__ __forceinline__ float2 block_sum2(float a, float b) {
  __shared__ float red[2][32];
  __shared__ float2 bcast;
  float v[2] = {a, b};
  block_sum_warp0<2>(v, red);
  if (threadIdx.x == 0) bcast = make_float2(v[0], v[1]);
  __syncthreads();
  return bcast;
}

// ------------------------------------------- rows split over a cluster (sm_90) ---
// Backward rows longer than one block holds in registers are split over the blocks
// of a thread-block cluster: each block keeps its column slice and its dscale/dbias
// partials (across all of its rows) in registers or shared memory, and the row sums
// are exchanged through distributed shared memory (ClusterExchange). Without CLUSTER the
// same kernels run a block per row.

// A block's share of the work: its rows (those of its cluster) and, through its
// rank, its columns.
struct RowSplit {
  int rank, size;           // rank of the block in its cluster; blocks per cluster
  int64_t first_row, step;  // this block's rows: first_row, first_row + step, ...
  // The thread's index among the cluster's threads, and their number (columns of a
  // row go round-robin over them in packs).
  __device__ __forceinline__ int64_t thread() const { return int64_t(rank) * blockDim.x + threadIdx.x; }
  __device__ __forceinline__ int64_t threads() const { return int64_t(size) * blockDim.x; }
};

template <bool CLUSTER>
__device__ __forceinline__ RowSplit row_split() {
  if constexpr (CLUSTER) {
    const int size = cluster_size();
    return {cluster_rank(), size, int64_t(blockIdx.x) / size, int64_t(gridDim.x) / size};
  } else {
    return {0, 1, int64_t(blockIdx.x), int64_t(gridDim.x)};
  }
}

// N values a block exchanged over the cluster (row sums, or the blocks' row statistics),
// with no cluster barrier. Use u (a row, or a pair of rows) goes through buffer u % 2 of
// every block: warp 0 of each block pushes the block's values (st.async) into slot [its
// rank] of every block's buffer, the bytes completing on that buffer's mbarrier; a block
// waits for size * N floats there and combines the slots in a fixed tree, the same in
// every block, so all get bitwise equal results. (It replaced a cluster barrier a row, where warp 0 arrived with
// release and so waited for its stores in flight every row: the cluster backward is
// 1.07-1.10x faster at 16384-32768 bf16 columns, 1.25x at 65536, 1.03x with float32
// rows on the H100, docs/perf-notes.md.) Reuse is safe without more barriers: block A
// pushes use u + 2 into block B only once it has B's push of u + 1, which B sends after
// a block barrier that its threads pass only when done reading u's slots, and after its
// thread 0 re-armed the buffer.
template <int N>
struct ClusterExchange {
  struct alignas(16) Smem {
    uint64_t bar[2];
    float slot[2][kMaxClusterBlocks][N];
    float red[2][N][32];
  };
  static __device__ __forceinline__ Smem& smem() {
    __shared__ Smem storage;
    return storage;
  }
  static __device__ __forceinline__ uint32_t bytes() { return uint32_t(cluster_size() * N * sizeof(float)); }

  // By every thread of the cluster before the first use: both buffers' barriers
  // initialized and armed before any block pushes.
  static __device__ __forceinline__ void init() {
    if (threadIdx.x == 0) {
      for (int p = 0; p < 2; ++p) {
        mbarrier_init(&smem().bar[p], 1);
        mbarrier_arrive_expect(&smem().bar[p], bytes());
      }
    }
    cluster_sync();
  }

  // Warp 0's values w (lane 0's), pushed to every block of the cluster. Every thread of
  // the block calls it, after a block barrier since its last gather of this buffer.
  static __device__ __forceinline__ void push(const float (&w)[N], int use) {
    if (threadIdx.x < 32) {
      float v[N];  // lane 0's: the other lanes may hold partial merges
#pragma unroll
      for (int i = 0; i < N; ++i) v[i] = __shfl_sync(0xffffffffu, w[i], 0);
      if (int(threadIdx.x) < cluster_size())
        store_remote<N>(smem().slot[use & 1][cluster_rank()], v, &smem().bar[use & 1], int(threadIdx.x));
    }
  }

  // The block's sums of v (fixed order), pushed to every block of the cluster.
  static __device__ __forceinline__ void publish(const float (&v)[N], int use) {
    float w[N];
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = v[i];
    block_sum_warp0<N>(w, smem().red[use & 1]);
    push(w, use);
  }

  // Block r's values of use `use` to the lanes r (mod kMaxClusterBlocks), zeros past the
  // cluster's size; the buffer's barrier is then armed for use + 2.
  static __device__ __forceinline__ void gather(float (&out)[N], int use) {
    Smem& s = smem();
    const int p = use & 1;
    mbarrier_wait<true>(&s.bar[p], uint32_t(use >> 1) & 1u);
    const int r = int(threadIdx.x % kMaxClusterBlocks);
    const bool has = r < cluster_size();
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = has ? s.slot[p][r][i] : 0.f;
    if (threadIdx.x == 0) mbarrier_arrive_expect(&s.bar[p], bytes());
  }

  // The cluster's sums of use `use` (lanes add the blocks' values in a fixed tree).
  static __device__ __forceinline__ void collect(float (&out)[N], int use) {
    gather(out, use);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = group_sum<kMaxClusterBlocks>(out[i]);
  }
};

// The row statistics of a block (CLUSTER: of the cluster, the blocks' states exchanged
// as use `use` and merged in a fixed tree, the same in every block), to every thread.
template <bool CLUSTER, bool SUMS = true>
__device__ __forceinline__ RowStats row_stats(NormAcc acc, int64_t cols, float eps, bool rms, bool uniform, int use) {
  if constexpr (!CLUSTER) {
    return block_stats<SUMS>(acc, cols, eps, rms, uniform);
  } else {
    const NormAcc w = block_acc_warp0<SUMS>(acc, rms, uniform);
    float v[4] = {w.mean, w.m2, w.count, 0.f};
    ClusterExchange<4>::push(v, use);
    ClusterExchange<4>::gather(v, use);
    NormAcc c;
    c.mean = v[0]; c.m2 = v[1]; c.count = v[2];
    return finish_stats(group_merge<kMaxClusterBlocks>(c, rms), cols, eps, rms);
  }
}

// Sums of two values over the block or the cluster (use: the row's index among the
// block's rows), returned to every thread.
template <bool CLUSTER>
__device__ __forceinline__ float2 row_sum2(float a, float b, int use) {
  if constexpr (!CLUSTER) {
    return block_sum2(a, b);
  } else {
    float v[2] = {a, b};
    ClusterExchange<2>::publish(v, use);
    ClusterExchange<2>::collect(v, use);
    return make_float2(v[0], v[1]);
  }
}

// A block may leave only when no other block of its cluster still accesses its
// shared memory.
template <bool CLUSTER>
__device__ __forceinline__ void row_split_exit() {
  if constexpr (CLUSTER) cluster_sync();
}

// ---------------------------------------------------- load/store functors ---

// Forward row loads by flat element index i (PACK elements, i % PACK == 0): plain x.
template <typename T>
struct LoadX {
  using Args = FwdArgs;  // the kernels' parameter
  const T* x;
  __device__ __forceinline__ explicit LoadX(const FwdArgs& a) : x(static_cast<const T*>(a.x)) {}
  template <int PACK>
  __device__ __forceinline__ void operator()(int64_t i, Pack<T, PACK>& out) const {
    out = *reinterpret_cast<const Pack<T, PACK>*>(x + i);
  }
  // The block tier's view: one row's packs by pack index, the row starting at pack
  // `first`; reload() reads them again (second pass over a row not cached on chip).
  template <int PACK>
  struct Packs {
    const Pack<T, PACK>* x;
    __device__ __forceinline__ void operator()(int64_t v, Pack<T, PACK>& out) const { out = x[v]; }
    __device__ __forceinline__ void reload(int64_t v, Pack<T, PACK>& out) const { out = x[v]; }
  };
  template <int PACK>
  __device__ __forceinline__ Packs<PACK> packs(int64_t first) const {
    return {reinterpret_cast<const Pack<T, PACK>*>(x) + first};
  }
};

// Two float16 sums in one f16x2 add (HADD2): the values of add_rounded, as the float sum
// rounds to them exactly as the correctly rounded sum does (norm_math.h), and the sums
// stay two a register: as add_rounded's structs the warp-tier forward at 2048 columns kept
// them one a register, 102 registers against bfloat16's 70 (now 70; docs/perf-notes.md).
__device__ __forceinline__ uint32_t add_rounded_f16x2(uint32_t x, uint32_t r) {
  __half2 a, b;
  memcpy(&a, &x, 4);
  memcpy(&b, &r, 4);
  const __half2 c = __hadd2_rn(a, b);
  uint32_t out;
  memcpy(&out, &c, 4);
  return out;
}

// add_rounded of a Pack (float16 pairs as f16x2). The caller loads the Packs whole: read
// through references into memory here, each 16-byte load became 16-bit loads.
template <typename T, int PACK>
__device__ __forceinline__ Pack<T, PACK> add_packs_rounded(const Pack<T, PACK>& x, const Pack<T, PACK>& r) {
  Pack<T, PACK> out;
  if constexpr (std::is_same_v<T, f16_t> && PACK % 2 == 0) {
#pragma unroll
    for (int k = 0; k < PACK; k += 2) {
      uint32_t a, b;
      memcpy(&a, &x.v[k], 4);
      memcpy(&b, &r.v[k], 4);
      const uint32_t c = add_rounded_f16x2(a, b);
      memcpy(&out.v[k], &c, 4);
    }
  } else {
#pragma unroll
    for (int k = 0; k < PACK; ++k) out.v[k] = add_rounded(x.v[k], r.v[k]);
  }
  return out;
}

// add+norm: h = x + residual rounded to T, written to the h output as it is read;
// the kernels then normalize h (its statistics are those of the rounded values).
template <typename T>
struct LoadAdd {
  using Args = FwdAddArgs;
  const T* x;
  const T* residual;
  T* h;
  __device__ __forceinline__ explicit LoadAdd(const FwdAddArgs& a)
      : x(static_cast<const T*>(a.x)), residual(static_cast<const T*>(a.residual)), h(static_cast<T*>(a.h)) {}
  template <int PACK>
  __device__ __forceinline__ void operator()(int64_t i, Pack<T, PACK>& out) const {
    const Pack<T, PACK> px = *reinterpret_cast<const Pack<T, PACK>*>(x + i);
    const Pack<T, PACK> pr = *reinterpret_cast<const Pack<T, PACK>*>(residual + i);
    out = add_packs_rounded(px, pr);
    *reinterpret_cast<Pack<T, PACK>*>(h + i) = out;
  }
  template <int PACK>
  struct Packs {
    const Pack<T, PACK>* x;
    const Pack<T, PACK>* residual;
    Pack<T, PACK>* h;
    __device__ __forceinline__ void operator()(int64_t v, Pack<T, PACK>& out) const {
      const Pack<T, PACK> px = x[v], pr = residual[v];
      out = add_packs_rounded(px, pr);
      h[v] = out;
    }
    // The second pass re-reads h, which this very thread wrote in the first.
    __device__ __forceinline__ void reload(int64_t v, Pack<T, PACK>& out) const { out = h[v]; }
  };
  template <int PACK>
  __device__ __forceinline__ Packs<PACK> packs(int64_t first) const {
    return {reinterpret_cast<const Pack<T, PACK>*>(x) + first, reinterpret_cast<const Pack<T, PACK>*>(residual) + first,
            reinterpret_cast<Pack<T, PACK>*>(h) + first};
  }
};

// Backward dx stores by flat element index: plain dx ...
template <typename T>
struct StoreDx {
  using Args = BwdArgs;
  // What a store needs loaded besides dx's values (nothing here; dh for add+norm), which
  // the group tier loads with the row, ahead of the row sums.
  template <int PACK>
  struct Ahead {};
  T* dx;
  __device__ __forceinline__ explicit StoreDx(const BwdArgs& a) : dx(static_cast<T*>(a.dx)) {}
  template <int PACK>
  __device__ __forceinline__ Ahead<PACK> load_ahead(int64_t) const { return {}; }
  // Whether the tiers ask L2 ahead for what the store loads (add+norm's dh) by `prefetch`.
  static constexpr bool kPrefetch = false;
  __device__ __forceinline__ void prefetch(int64_t) const {}
  template <int PACK>
  __device__ __forceinline__ void operator()(int64_t i, const float (&v)[PACK]) const {
    store_pack<T, PACK>(dx + i, v);
  }
  template <int PACK>
  __device__ __forceinline__ void operator()(int64_t i, const float (&v)[PACK], const Ahead<PACK>&) const {
    store_pack<T, PACK>(dx + i, v);
  }
};

// ... or add+norm's dx = norm_backward(dy, h) + dh (h's cotangent flows into x and
// residual alike), rounded once.
template <typename T>
struct StoreDxAddDh {
  using Args = BwdAddArgs;
  template <int PACK>
  struct Ahead {
    Pack<T, PACK> dh;
  };
  T* dx;
  const T* dh;
  __device__ __forceinline__ explicit StoreDxAddDh(const BwdAddArgs& a)
      : dx(static_cast<T*>(a.dx)), dh(static_cast<const T*>(a.dh)) {}
  template <int PACK>
  __device__ __forceinline__ Ahead<PACK> load_ahead(int64_t i) const {
    return {*reinterpret_cast<const Pack<T, PACK>*>(dh + i)};
  }
  // Where dh is loaded only as dx is stored (after the row sums), the tiers ask L2 for
  // it after the row's x and dy loads (the bulk tier a row ahead), for 16-bit rows: its
  // load then waits on L2, not DRAM, and holds no registers until then. H100 bf16 backward:
  // 512-2048 columns 1.05-1.19x, 8192 1.11x, 4096 1.00x; float32 rows at 1024 were 1.03x
  // slower. Issued between a pack's loads, it kept them from being batched (1024: 1.23x
  // slower); by the bulk tier's issuing thread as one bulk prefetch 3 rows ahead, 1.06x.
  static constexpr bool kPrefetch = sizeof(T) == 2;
  __device__ __forceinline__ void prefetch(int64_t i) const { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(dh + i)); }
  template <int PACK>
  __device__ __forceinline__ void operator()(int64_t i, const float (&v)[PACK], const Ahead<PACK>& ahead) const {
    float out[PACK];
#pragma unroll
    for (int k = 0; k < PACK; ++k) out[k] = v[k] + to_float(ahead.dh.v[k]);
    store_pack<T, PACK>(dx + i, out);
  }
  template <int PACK>
  __device__ __forceinline__ void operator()(int64_t i, const float (&v)[PACK]) const {
    (*this)(i, v, load_ahead<PACK>(i));
  }
};

// The norm's kind at compile time: a load/store policy as the kernels take it. The
// kernels are instantiated for each, so RMSNorm's drop the mean, the sums of g it needs
// and dbias rather than branching on a flag (its 16-bit cluster backward ran 32 % fewer
// instructions a row pair, and measured 1.11-1.15x faster on the H200 at 16384-65536
// columns; docs/perf-notes.md).
template <typename Policy, bool RMS>
struct OfNorm : Policy {
  using Policy::Policy;
  static constexpr bool kRms = RMS;
};

// ---------------------------------------------------------------- forward ---

// A row held in 32-bit words: 16-bit values two a register (a Pack of 16-bit structs
// takes a register per value, which left no registers for the scale/bias loads: they
// waited behind every store, docs/perf-notes.md). Values are converted where used; the
// output pass converts with other instructions (ALT) than the statistics, so that the
// compiler recomputes the floats instead of keeping them live across the reduction.
template <typename T, bool ALT>
__device__ __forceinline__ float word_value(uint32_t w, int half) {
  if constexpr (std::is_same_v<T, float>) {
    return __uint_as_float(w);
  } else if constexpr (std::is_same_v<T, bf16_t>) {
    if (ALT) return __uint_as_float(__byte_perm(w, 0u, half ? 0x3244 : 0x1044));
    return __uint_as_float(half ? (w & 0xffff0000u) : (w << 16));
  } else {
    const uint32_t bits = ALT ? __byte_perm(w, 0u, half ? 0x4432 : 0x4410) : (half ? (w >> 16) : (w & 0xffffu));
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  }
}

template <typename T, int PACK>
struct RowWords {
  static constexpr int kValues = PACK;
  static constexpr int kWords = int((sizeof(T) * PACK + 3) / 4);
  uint32_t w[kWords];
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = 0u;
  }
  // The pack at p as 32-bit words: 16-byte loads where it has whole ones, else one 8-, 4-
  // or 2-byte load (the tail kernels' last columns, unvectorized rows). Through a Pack of 16-bit
  // structs, ptxas kept float16 values one a register (fwd_block_regs_kernel at 6 packs
  // spilled 24 / 48 bytes, bfloat16 8 / 8), and merged 16-bit halves with PRMT (the
  // 16-bit cluster backward's loop: 770 instructions a pair of rows, 674 this way).
  __device__ __forceinline__ void load(const T* p) {
    if constexpr (sizeof(T) * PACK % 16 == 0) {
#pragma unroll
      for (int i = 0; i < kWords; i += 4) {
        const uint4 q = reinterpret_cast<const uint4*>(p)[i / 4];
        w[i] = q.x; w[i + 1] = q.y; w[i + 2] = q.z; w[i + 3] = q.w;
      }
    } else if constexpr (sizeof(T) * PACK == 8) {  // through set(), a Pack of 16-bit structs took byte loads
      const uint2 q = *reinterpret_cast<const uint2*>(p);
      w[0] = q.x; w[1] = q.y;
    } else if constexpr (sizeof(T) * PACK == 4) {
      w[0] = *reinterpret_cast<const uint32_t*>(p);
    } else if constexpr (sizeof(T) * PACK == 2) {
      w[0] = *reinterpret_cast<const unsigned short*>(p);
    } else {
      set(*reinterpret_cast<const Pack<T, PACK>*>(p));
    }
  }
  // The words stored at p as load() reads them: whole 16-byte words, else one 8-, 4- or
  // 2-byte store.
  __device__ __forceinline__ void store(T* p) const {
    if constexpr (sizeof(T) * PACK % 16 == 0) {
#pragma unroll
      for (int i = 0; i < kWords; i += 4)
        reinterpret_cast<uint4*>(p)[i / 4] = make_uint4(w[i], w[i + 1], w[i + 2], w[i + 3]);
    } else if constexpr (sizeof(T) * PACK == 8) {
      *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
    } else if constexpr (sizeof(T) * PACK == 4) {
      *reinterpret_cast<uint32_t*>(p) = w[0];
    } else {
      static_assert(sizeof(T) * PACK == 2, "a whole number of 16-bit values");
      *reinterpret_cast<unsigned short*>(p) = static_cast<unsigned short>(w[0]);
    }
  }
  // x + residual rounded to T (add_rounded), 16-bit values: float16 pairs as f16x2.
  __device__ __forceinline__ void set_sum_rounded(const RowWords& x, const RowWords& r) {
    static_assert(sizeof(T) == 2, "16-bit values");
#pragma unroll
    for (int i = 0; i < kWords; ++i) {
      if constexpr (std::is_same_v<T, f16_t>) {
        w[i] = add_rounded_f16x2(x.w[i], r.w[i]);
      } else {
        w[i] = uint32_t(from_float<T>(x.template value<false>(2 * i) + r.template value<false>(2 * i)).bits) |
               (uint32_t(from_float<T>(x.template value<false>(2 * i + 1) + r.template value<false>(2 * i + 1)).bits)
                << 16);
      }
    }
  }
  // h = x + residual rounded to T, kept here and written to h: 16-bit whole words only
  // (a Pack of 16-bit structs spills as load's comment says).
  __device__ __forceinline__ void load_add(const T* x, const T* residual, T* h) {
    static_assert(sizeof(T) == 2 && PACK % 8 == 0, "16-byte words of 16-bit values");
    RowWords xw, rw;
    xw.load(x);
    rw.load(residual);
    set_sum_rounded(xw, rw);
    store(h);
  }
  __device__ __forceinline__ void set(const Pack<T, PACK>& pk) {
    w[kWords - 1] = 0u;
    memcpy(w, &pk, sizeof(pk));
  }
  template <bool ALT>
  __device__ __forceinline__ float value(int j) const {
    constexpr int kPerWord = sizeof(T) == 4 ? 1 : 2;
    return word_value<T, ALT>(w[j / kPerWord], j % kPerWord);
  }
};

template <typename T, int PACK>
__device__ __forceinline__ void store_values(T* p, const float (&v)[PACK]) {
  if constexpr (sizeof(T) == 2 && PACK % 2 == 0) {
    Pack<uint32_t, PACK / 2> out;  // pairs packed by hand: one vector store
#pragma unroll
    for (int i = 0; i < PACK / 2; ++i)
      out.v[i] = uint32_t(from_float<T>(v[2 * i]).bits) | (uint32_t(from_float<T>(v[2 * i + 1]).bits) << 16);
    *reinterpret_cast<Pack<uint32_t, PACK / 2>*>(p) = out;
  } else {
    store_pack<T, PACK>(p, v);
  }
}

// A Pack read through RowWords' interface. The warp tiers keep float16 rows so (and the
// rows-bulk backward every dtype): HADD2.F32 converts either half of a register in place,
// and as words (RowWords) the forward's output pass took 256 more PRMT and 16 more
// registers at 4096 columns (SASS).
template <typename T, int PACK>
struct RowPack {
  Pack<T, PACK> p;
  __device__ __forceinline__ void set(const Pack<T, PACK>& pk) { p = pk; }
  template <bool ALT>
  __device__ __forceinline__ float value(int j) const { return to_float(p.v[j]); }
};

// Exact two-pass statistics of a row held in registers by a group of WIDTH
// lanes (packs v*WIDTH + glane): mean first, then Σ(x - mean)²; no divisions,
// and at least as accurate as Welford. RMSNorm: Σx² only.
template <int WIDTH, bool RMS, int PACK, typename RowT, int VPT>
__device__ __forceinline__ RowStats row_stats_two_pass(const RowT (&raw)[VPT], bool valid_row, int glane,
                                                       const FwdArgs& a) {
  const float inv_n = 1.f / float(a.cols);
  float mean = 0.f;
  if constexpr (!RMS) {
    float s = 0.f;
#pragma unroll
    for (int v = 0; v < VPT; ++v)
      if (valid_row && int64_t(v * WIDTH + glane) * PACK < a.cols)
#pragma unroll
        for (int k = 0; k < PACK; ++k) s += raw[v].template value<false>(k);
    mean = group_sum<WIDTH>(s) * inv_n;
  }
  float q = 0.f;
#pragma unroll
  for (int v = 0; v < VPT; ++v)
    if (valid_row && int64_t(v * WIDTH + glane) * PACK < a.cols)
#pragma unroll
      for (int k = 0; k < PACK; ++k) {
        const float d = raw[v].template value<false>(k) - mean;
        q += d * d;
      }
  const float var = group_sum<WIDTH>(q) * inv_n;
  return RowStats{mean, rsqrt_f32(var + a.eps)};
}

// The same for the ROWS rows of a group's tile at once: their shuffle chains interleaved,
// so that a tile waits on one chain's latency, not ROWS of them in sequence. The one-row
// form above stays its own: written as a call of this one, the tile-a-warp kernels' row
// loop came out rolled (bf16 LayerNorm at 256 columns: 944 -> 584 SASS instructions, a
// different schedule for kernels measured as they are).
template <int WIDTH, bool RMS, int PACK, int ROWS, typename RowT, int VPT>
__device__ __forceinline__ void rows_stats_two_pass(const RowT (&raw)[ROWS][VPT], const bool (&valid)[ROWS],
                                                    int glane, const FwdArgs& a, RowStats (&st)[ROWS]) {
  const float inv_n = 1.f / float(a.cols);
  float mean[ROWS], q[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) mean[r] = 0.f;
  if constexpr (!RMS) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int v = 0; v < VPT; ++v)
        if (valid[r] && int64_t(v * WIDTH + glane) * PACK < a.cols)
#pragma unroll
          for (int k = 0; k < PACK; ++k) mean[r] += raw[r][v].template value<false>(k);
    group_sums<WIDTH, ROWS>(mean);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) mean[r] *= inv_n;
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    q[r] = 0.f;
#pragma unroll
    for (int v = 0; v < VPT; ++v)
      if (valid[r] && int64_t(v * WIDTH + glane) * PACK < a.cols)
#pragma unroll
        for (int k = 0; k < PACK; ++k) {
          const float d = raw[r][v].template value<false>(k) - mean[r];
          q[r] += d * d;
        }
  }
  group_sums<WIDTH, ROWS>(q);
#pragma unroll
  for (int r = 0; r < ROWS; ++r) st[r] = RowStats{mean[r], rsqrt_f32(q[r] * inv_n + a.eps)};
}

// Rows of up to kFwdRegsMaxBytes in registers, a group of WIDTH lanes a row, ROWS rows a
// group: a tile a warp (a grid of tiles), or with PREFETCH a persistent grid whose warps
// load their next tile before reducing this one, the tile's rows' statistics together.
template <typename T, typename P, int PACK, int VPT, int WIDTH, int ROWS, typename L, bool PREFETCH = false>
__global__ void __launch_bounds__(kRegsThreads) fwd_regs_kernel(typename L::Args a) {
  constexpr int GROUPS = 32 / WIDTH, ROWS_PER_WARP = GROUPS * ROWS;
  using PackT = Pack<T, PACK>;
  const int lane = threadIdx.x % 32, group = lane / WIDTH, glane = lane % WIDTH;
  const int64_t warps_total = int64_t(gridDim.x) * (kRegsThreads / 32);
  const L load(a);
  T* y = static_cast<T*>(a.y);
  // The row stays in registers in its storage type: bfloat16 and float32 as 32-bit words
  // (a Pack of bfloat16 structs took a register a value: at 4096 columns 174 registers
  // against 108 as words, twice the warps an SM; docs/perf-notes.md), float16 as a Pack
  // (HADD2 converts either half in place) but where a second tile is held (PREFETCH).
  constexpr bool kWords = !std::is_same_v<T, f16_t> || PREFETCH;
  using RowT = std::conditional_t<kWords, RowWords<T, PACK>, RowPack<T, PACK>>;
  constexpr bool kWordLoad = kWords && std::is_base_of_v<LoadX<T>, L>;
  constexpr bool kWordAdd = kWords && std::is_base_of_v<LoadAdd<T>, L> && sizeof(T) == 2 && PACK % 8 == 0;
  struct Tile {
    RowT raw[ROWS][VPT];
  };
  const auto load_tile = [&](int64_t tile, Tile& t) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int64_t row = tile * ROWS_PER_WARP + group * ROWS + r;
#pragma unroll
      for (int v = 0; v < VPT; ++v) {
        const int64_t col = int64_t(v * WIDTH + glane) * PACK;
        if (row >= a.rows || col >= a.cols) continue;
        const int64_t i = row * a.cols + col;
        if constexpr (kWordLoad) {
          t.raw[r][v].load(load.x + i);
        } else if constexpr (kWordAdd) {
          t.raw[r][v].load_add(load.x + i, load.residual + i, load.h + i);
        } else {
          PackT pk;
          load(i, pk);
          t.raw[r][v].set(pk);
        }
      }
    }
  };
  // With one or two packs a lane and several rows a group, the tile's rows share the
  // lane's scale/bias values: loaded once, with the rows (H100, bf16 LayerNorm: 12.8 ->
  // 11.3 µs at 128 columns; at 256, one row a group, it cost 0.7 µs). A prefetching grid
  // loads them once for all its tiles.
  constexpr bool SHARED_PARAMS = VPT <= 2 && (ROWS > 1 || PREFETCH);
  constexpr int SHARED_VPT = SHARED_PARAMS ? VPT : 1;
  using Params = float[SHARED_VPT][PACK];
  const auto load_shared_params = [&](Params& sc1, Params& bi1) {
    if constexpr (SHARED_PARAMS) {
#pragma unroll
      for (int v = 0; v < VPT; ++v) {
        const int64_t col = int64_t(v * WIDTH + glane) * PACK;
        if (col < a.cols) {
          load_param<P, PACK>(a.scale, col, 1.f, sc1[v]);
          load_param<P, PACK>(a.bias, col, 0.f, bi1[v]);
        }
      }
    }
  };
  const auto finish_tile = [&](int64_t tile, const Tile& t, const Params& sc1, const Params& bi1) {
    RowStats joint[ROWS];
    if constexpr (PREFETCH) {
      bool valid[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) valid[r] = tile * ROWS_PER_WARP + group * ROWS + r < a.rows;
      rows_stats_two_pass<WIDTH, L::kRms, PACK>(t.raw, valid, glane, a, joint);
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int64_t row = tile * ROWS_PER_WARP + group * ROWS + r;
      const RowStats st =
          PREFETCH ? joint[r] : row_stats_two_pass<WIDTH, L::kRms, PACK>(t.raw[r], row < a.rows, glane, a);
      if (row >= a.rows) continue;
#pragma unroll
      for (int v = 0; v < VPT; ++v) {
        const int64_t col = int64_t(v * WIDTH + glane) * PACK;
        if (col >= a.cols) continue;
        float sc[PACK], bi[PACK], out[PACK];
        if constexpr (SHARED_PARAMS) {
#pragma unroll
          for (int k = 0; k < PACK; ++k) { sc[k] = sc1[v][k]; bi[k] = bi1[v][k]; }
        } else {
          load_param<P, PACK>(a.scale, col, 1.f, sc);
          load_param<P, PACK>(a.bias, col, 0.f, bi);
        }
#pragma unroll
        for (int k = 0; k < PACK; ++k) out[k] = norm_out_as<T>(t.raw[r][v].template value<true>(k), st, sc[k], bi[k]);
        store_values<T, PACK>(y + row * a.cols + col, out);
      }
      if (glane == 0 && a.rstd != nullptr) {
        if (a.mean != nullptr) a.mean[row] = st.mean;
        a.rstd[row] = st.rstd;
      }
    }
  };
  // Warp-uniform loops: every lane takes part in the shuffles, rows past the end are masked.
  int64_t tile = int64_t(blockIdx.x) * (kRegsThreads / 32) + threadIdx.x / 32;
  if constexpr (PREFETCH) {  // a persistent grid, the warp's next tile loaded before this one is reduced
    Tile cur;
    Params sc1, bi1;
    if (tile * ROWS_PER_WARP < a.rows) load_tile(tile, cur);
    load_shared_params(sc1, bi1);
    for (; tile * ROWS_PER_WARP < a.rows; tile += warps_total) {
      Tile next;
      if ((tile + warps_total) * ROWS_PER_WARP < a.rows) load_tile(tile + warps_total, next);
      finish_tile(tile, cur, sc1, bi1);
      cur = next;
    }
  } else {
    for (; tile * ROWS_PER_WARP < a.rows; tile += warps_total) {
      Tile t;
      Params sc1, bi1;
      load_tile(tile, t);
      load_shared_params(sc1, bi1);
      finish_tile(tile, t, sc1, bi1);
    }
  }
}

// 16-bit rows of 256 + r columns, 0 < r <= 32 * E: a 16-byte pack a lane, and the last r
// columns E a lane on the first r / E lanes. Held as two packs a lane (fwd_regs_kernel),
// the second pack's code ran for the warp to serve the one to sixteen lanes holding it:
// 256 instructions a row at 264 columns against 162 at 256, issue-bound (ncu, thirty-second
// session). Two rows a tile, a persistent grid with the next tile ahead, the parameters
// loaded once a warp, as there. add+norm (LoadAdd): the tile ahead holds x and residual as
// loaded; h is summed and stored as the tile is reduced, so that no load waits for the
// next tile's sums.
template <typename T, typename P, int E, typename L>
__global__ void __launch_bounds__(kRegsThreads) fwd_tail_kernel(typename L::Args a) {
  static_assert(sizeof(T) == 2 && (E == 1 || E == 2 || E == 4), "16-bit rows, a tail of 1, 2 or 4 values a lane");
  constexpr int PACK = 8, ROWS = 2;
  constexpr bool kAdd = std::is_base_of_v<LoadAdd<T>, L>;
  constexpr int kArrays = kAdd ? 2 : 1;  // x (and residual) as loaded
  const int lane = threadIdx.x % 32;
  const int64_t warps_total = int64_t(gridDim.x) * (kRegsThreads / 32);
  const int main_col = lane * PACK, tail_col = 32 * PACK + lane * E;
  const bool has_tail = tail_col < a.cols;
  const L load(a);
  T* y = static_cast<T*>(a.y);
  struct Tile {
    RowWords<T, PACK> main[kArrays][ROWS];
    RowWords<T, E> tail[kArrays][ROWS];
  };
  const auto load_tile = [&](int64_t tile, Tile& t) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int64_t row = tile * ROWS + r;
      if (row >= a.rows) continue;
      const int64_t base = row * a.cols;
      t.main[0][r].load(load.x + base + main_col);
      if constexpr (kAdd) t.main[1][r].load(load.residual + base + main_col);
      if (has_tail) {
        t.tail[0][r].load(load.x + base + tail_col);
        if constexpr (kAdd) t.tail[1][r].load(load.residual + base + tail_col);
      }
    }
  };
  // add+norm: the tile's rows become h (x + residual rounded), written to the h output.
  const auto sum_tile = [&](int64_t tile, Tile& t) {
    if constexpr (kAdd) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const int64_t row = tile * ROWS + r;
        if (row >= a.rows) continue;
        const int64_t base = row * a.cols;
        t.main[0][r].set_sum_rounded(t.main[0][r], t.main[1][r]);
        t.main[0][r].store(load.h + base + main_col);
        if (has_tail) {
          t.tail[0][r].set_sum_rounded(t.tail[0][r], t.tail[1][r]);
          t.tail[0][r].store(load.h + base + tail_col);
        }
      }
    }
  };
  float sc_main[PACK], bi_main[PACK], sc_tail[E], bi_tail[E];
  load_param<P, PACK>(a.scale, main_col, 1.f, sc_main);
  load_param<P, PACK>(a.bias, main_col, 0.f, bi_main);
  if (has_tail) {
    load_param<P, E>(a.scale, tail_col, 1.f, sc_tail);
    load_param<P, E>(a.bias, tail_col, 0.f, bi_tail);
  }
  // A piece of a row (the main pack or the tail; N values): its sum of values, or of
  // squares about `center`, and its output values stored at flat index i.
  const auto piece_sum = [](const auto& w, float center, bool squares) {
    constexpr int N = std::remove_reference_t<decltype(w)>::kValues;
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float d = w.template value<false>(k) - center;
      sum += squares ? d * d : d;
    }
    return sum;
  };
  const auto piece_out = [&](int64_t i, const auto& w, const RowStats& st, const auto& sc, const auto& bi) {
    constexpr int N = std::remove_reference_t<decltype(w)>::kValues;
    float out[N];
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = norm_out_as<T>(w.template value<true>(k), st, sc[k], bi[k]);
    store_values<T, N>(y + i, out);
  };
  const auto finish_tile = [&](int64_t tile, const Tile& t) {
    const float inv_n = 1.f / float(a.cols);
    float mean[ROWS], q[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
      mean[r] = L::kRms ? 0.f
                        : piece_sum(t.main[0][r], 0.f, false) + (has_tail ? piece_sum(t.tail[0][r], 0.f, false) : 0.f);
    if constexpr (!L::kRms) {
      group_sums<32, ROWS>(mean);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) mean[r] *= inv_n;
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
      q[r] = piece_sum(t.main[0][r], mean[r], true) + (has_tail ? piece_sum(t.tail[0][r], mean[r], true) : 0.f);
    group_sums<32, ROWS>(q);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int64_t row = tile * ROWS + r;
      if (row >= a.rows) continue;
      const RowStats st{mean[r], rsqrt_f32(q[r] * inv_n + a.eps)};
      piece_out(row * a.cols + main_col, t.main[0][r], st, sc_main, bi_main);
      if (has_tail) piece_out(row * a.cols + tail_col, t.tail[0][r], st, sc_tail, bi_tail);
      if (lane == 0 && a.rstd != nullptr) {
        if (a.mean != nullptr) a.mean[row] = st.mean;
        a.rstd[row] = st.rstd;
      }
    }
  };
  // Warp-uniform loop: every lane takes part in the shuffles, rows past the end are masked.
  int64_t tile = int64_t(blockIdx.x) * (kRegsThreads / 32) + threadIdx.x / 32;
  Tile cur;
  if (tile * ROWS < a.rows) load_tile(tile, cur);
  for (; tile * ROWS < a.rows; tile += warps_total) {
    Tile next;
    if ((tile + warps_total) * ROWS < a.rows) load_tile(tile + warps_total, next);
    sum_tile(tile, cur);
    finish_tile(tile, cur);
    cur = next;
  }
}

// Pack v's output values into a row starting at y (the split layout: split_col).
template <typename T, int PACK, bool SPLIT>
__device__ __forceinline__ void store_row_pack(T* y, int64_t v, const float (&out)[PACK]) {
  if constexpr (SPLIT) {
    float lo[PACK / 2], hi[PACK / 2];
#pragma unroll
    for (int k = 0; k < PACK / 2; ++k) { lo[k] = out[k]; hi[k] = out[PACK / 2 + k]; }
    store_values<T, PACK / 2>(y + split_col<PACK>(v, 0), lo);
    store_values<T, PACK / 2>(y + split_col<PACK>(v, 1), hi);
  } else {
    store_values<T, PACK>(y + v * PACK, out);
  }
}

// Block per row, each thread holding K packs of the row in registers: no shared
// memory round trip, and all K loads of a thread are in flight at once. The first
// pack's scale/bias loads are issued before the row reduction, each next pack's before
// this pack's store. (A cluster version of this tier, the row split over 2-8 blocks,
// measured 1.5-2x slower on the H100 at 16384-32768 columns with a cluster barrier a
// row, 1.16-1.5x slower with ClusterExchange at 32768-65536: docs/perf-notes.md.)
constexpr int fwd_block_max_threads(int k) { return k >= 8 ? 512 : 1024; }

template <typename T, typename P, int PACK, int K, typename L, bool SPLIT = false>
__global__ void __launch_bounds__(fwd_block_max_threads(K)) fwd_block_regs_kernel(typename L::Args a) {
  using PackT = Pack<T, PACK>;
  const int64_t nvec = a.cols / PACK;
  const L load(a);
  T* y = static_cast<T*>(a.y);
  constexpr bool kWordLoad = !SPLIT && std::is_base_of_v<LoadX<T>, L>;
  constexpr bool kWordAdd = !SPLIT && std::is_base_of_v<LoadAdd<T>, L> && sizeof(T) == 2 && PACK % 8 == 0;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    RowWords<T, PACK> raw[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t v = threadIdx.x + int64_t(k) * blockDim.x;
      if constexpr (kWordLoad) {
        raw[k].zero();
        if (v < nvec) raw[k].load(load.x + row * a.cols + v * PACK);
      } else if constexpr (kWordAdd) {
        raw[k].zero();
        const int64_t i = row * a.cols + v * PACK;
        if (v < nvec) raw[k].load_add(load.x + i, load.residual + i, load.h + i);
      } else {
        PackT pk{};
        if (v < nvec) load_row_pack<PACK, SPLIT>(load, row * a.cols, v, pk);
        raw[k].set(pk);
      }
    }
    // This thread's packs: exact two-pass mean/M2 locally, then one merge per thread in
    // the block reduction (block_acc_warp0).
    float s = 0.f, q = 0.f, cnt = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k)
      if (threadIdx.x + int64_t(k) * blockDim.x < nvec) {
        cnt += float(PACK);
#pragma unroll
        for (int j = 0; j < PACK; ++j) s += raw[k].template value<false>(j);
      }
    const float local_mean = (L::kRms || cnt == 0.f) ? 0.f : s / cnt;
#pragma unroll
    for (int k = 0; k < K; ++k)
      if (threadIdx.x + int64_t(k) * blockDim.x < nvec)
#pragma unroll
        for (int j = 0; j < PACK; ++j) {
          const float d = raw[k].template value<false>(j) - local_mean;
          q += d * d;
        }
    NormAcc acc;
    acc.mean = local_mean; acc.m2 = q; acc.count = cnt;
    float sc[PACK], bi[PACK];
    if (threadIdx.x < nvec) {
      load_pack_param<P, PACK, SPLIT>(a.scale, threadIdx.x, 1.f, sc);
      load_pack_param<P, PACK, SPLIT>(a.bias, threadIdx.x, 0.f, bi);
    }
    const RowStats st = block_stats(acc, a.cols, a.eps, L::kRms, nvec == int64_t(K) * blockDim.x);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t v = threadIdx.x + int64_t(k) * blockDim.x;
      if (v >= nvec) break;
      float out[PACK];
#pragma unroll
      for (int j = 0; j < PACK; ++j) out[j] = norm_out(raw[k].template value<true>(j), st, sc[j], bi[j]);
      const int64_t next = v + blockDim.x;
      if (k + 1 < K && next < nvec) {
        load_pack_param<P, PACK, SPLIT>(a.scale, next, 1.f, sc);
        load_pack_param<P, PACK, SPLIT>(a.bias, next, 0.f, bi);
      }
      store_row_pack<T, PACK, SPLIT>(y + row * a.cols, v, out);
    }
    if (threadIdx.x == 0 && a.rstd != nullptr) {
      if (a.mean != nullptr) a.mean[row] = st.mean;
      a.rstd[row] = st.rstd;
    }
  }
}

template <typename T, typename P, int PACK, bool CACHE, typename L, bool CLUSTER, bool SPLIT>
__device__ __forceinline__ void fwd_block_body(const typename L::Args& a) {
  static_assert(!SPLIT || CACHE, "the split layout's second pass reads the cache");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  using PackT = Pack<T, PACK>;
  PackT* cache = reinterpret_cast<PackT*>(smem_raw);  // the block's packs of the row
  const int64_t nvec = a.cols / PACK;
  const L load(a);
  T* y = static_cast<T*>(a.y);
  // With CLUSTER the row's packs are split over the cluster's threads (RowSplit), each
  // block caching its own, and the blocks' statistics exchanged (row_stats).
  const RowSplit sp = row_split<CLUSTER>();
  const int64_t tid = sp.thread(), span = sp.threads();
  if constexpr (CLUSTER) ClusterExchange<4>::init();
  int use = 0;
  for (int64_t row = sp.first_row; row < a.rows; row += sp.step, ++use) {
    const auto xr = load.template packs<PACK>(row * nvec);  // this row
    NormAcc acc;
#pragma unroll 4
    for (int64_t v = tid, c = threadIdx.x; v < nvec; v += span, c += blockDim.x) {
      PackT pk;
      if constexpr (SPLIT) load_row_pack<PACK, true>(load, row * a.cols, v, pk);
      else xr(v, pk);
      if (CACHE) cache[c] = pk;
      float f[PACK];
#pragma unroll
      for (int k = 0; k < PACK; ++k) f[k] = to_float(pk.v[k]);
      acc.add_pack(f, L::kRms);
    }
    // The split cluster kernel keeps the Welford merges: at its 40 registers the merge by
    // sums spilled 4 more bytes, and LayerNorm's 65536-column forward ran 2.7 % slower
    // (H200, docs/perf-notes.md), though its rows there are uniform.
    const RowStats st = row_stats<CLUSTER, !SPLIT>(acc, a.cols, a.eps, L::kRms, nvec % span == 0, use);
#pragma unroll 4
    for (int64_t v = tid, c = threadIdx.x; v < nvec; v += span, c += blockDim.x) {
      PackT pk;
      if (CACHE) pk = cache[c];
      else xr.reload(v, pk);
      float sc[PACK], bi[PACK], out[PACK];
      load_pack_param<P, PACK, SPLIT>(a.scale, v, 1.f, sc);
      load_pack_param<P, PACK, SPLIT>(a.bias, v, 0.f, bi);
#pragma unroll
      for (int k = 0; k < PACK; ++k) out[k] = norm_out(to_float(pk.v[k]), st, sc[k], bi[k]);
      if constexpr (SPLIT) store_row_pack<T, PACK, true>(y + row * a.cols, v, out);
      else store_pack<T, PACK>(y + row * a.cols + v * PACK, out);
    }
    if (tid == 0 && a.rstd != nullptr) {
      if (a.mean != nullptr) a.mean[row] = st.mean;
      a.rstd[row] = st.rstd;
    }
    // The next row overwrites the cache only after every thread has read it.
    if (CACHE) __syncthreads();
  }
  row_split_exit<CLUSTER>();
}

template <typename T, typename P, int PACK, bool CACHE, typename L, bool CLUSTER = false>
__global__ void fwd_block_kernel(typename L::Args a) {
  fwd_block_body<T, P, PACK, CACHE, L, CLUSTER, false>(a);
}

// The cluster forward in the split layout. Its addressing takes more registers: capped
// at three blocks an SM, as the other layout runs (40 registers, 8 bytes spilled; 63 at
// two blocks an SM measured 1.08x slower: docs/perf-notes.md).
template <typename T, typename P, int PACK, typename L>
__global__ void __launch_bounds__(512, 3) fwd_cluster_split_kernel(typename L::Args a) {
  fwd_block_body<T, P, PACK, true, L, true, true>(a);
}

// --------------------------------------------------------------- backward ---

// A block's dscale/dbias partials from each warp's sums in `red` ([2][warps][cols], written
// by the block's threads before the call; bwd_group_store_partials describes the order).
template <int THREADS, bool DB>
__device__ __forceinline__ void bwd_block_sum_partials(const BwdArgs& a, float* red, float* part_ds, float* part_db) {
  constexpr int WARPS = THREADS / 32;
  float* red_ds = red;
  float* red_db = red + WARPS * a.cols;
  __syncthreads();
  const int cs = launched_cluster_size();
  // Bigger blocks: runs of `per` warp rows, each summed into its first row first, with
  // (run, column, array) items over the block's threads.
  int per = 1;
  if constexpr (THREADS > kRegsThreads) {
    const int cols = int(a.cols), items = (DB ? 2 : 1) * cols;
    const int runs = THREADS / items < 1 ? 1 : (THREADS / items > WARPS ? WARPS : THREADS / items);
    per = runs > 1 ? (WARPS + runs - 1) / runs : 1;  // one run: the warp rows as they are
    for (int i = threadIdx.x; runs > 1 && i < items * runs; i += THREADS) {
      const int item = i % items, w0 = (i / items) * per, w1 = w0 + per < WARPS ? w0 + per : WARPS;
      float* base = red + item + (item >= cols ? (WARPS - 1) * cols : 0);
      float sum = 0.f;
      for (int w = w0; w < w1; ++w) sum += base[w * cols];
      if (w0 < w1) base[w0 * cols] = sum;
    }
    __syncthreads();
  }
  for (int64_t col = threadIdx.x; col < a.cols; col += THREADS) {
    float s_ds = 0.f, s_db = 0.f;
    for (int w = 0; w < WARPS; w += per) {
      s_ds += red_ds[w * a.cols + col];
      if constexpr (DB) s_db += red_db[w * a.cols + col];
    }
    if (cs > 1) {
      red_ds[col] = s_ds;
      if constexpr (DB) red_db[col] = s_db;
    } else {
      if (part_ds) part_ds[blockIdx.x * a.cols + col] = s_ds;
      if (DB && part_db) part_db[blockIdx.x * a.cols + col] = s_db;
    }
  }
  if (cs == 1) return;
  cluster_sync();  // every block's sums are visible to the cluster
  const int64_t part = int64_t(blockIdx.x) / cs;
  for (int64_t col = int64_t(cluster_rank()) * THREADS + threadIdx.x; col < a.cols; col += int64_t(cs) * THREADS) {
    float s_ds = 0.f, s_db = 0.f;
    for (int q = 0; q < cs; ++q) {
      const float* other = cluster_map(red, q);
      s_ds += other[col];
      if constexpr (DB) s_db += other[WARPS * a.cols + col];
    }
    if (part_ds) part_ds[part * a.cols + col] = s_ds;
    if (DB && part_db) part_db[part * a.cols + col] = s_db;
  }
  cluster_sync();  // no block leaves while another still reads its shared memory
}

// The dscale/dbias partials of a block of row groups (WIDTH lanes a row, packs v * WIDTH +
// glane of every row). A warp's groups hold the same columns: their sums are first added
// across the warp (a fixed xor tree, the same value in every lane), then each warp's go
// to shared memory `red` ([2][warps][cols] floats), are added in warp order (in runs
// first where the block has more threads than columns to add) into row blockIdx of the
// workspace. Every thread of the block calls it. Launched in a cluster only to merge its
// blocks' partials (bwd_group_merge_blocks): each block's sums go to row 0 of its buffers
// (a column is read and rewritten by the same thread), then block rank r adds every
// cs-th run of THREADS columns over the cluster's blocks in rank order, into row
// blockIdx / cs. DB: whether there are dbias partials (not for RMSNorm).
template <int PACK, int VPT, int WIDTH, int THREADS, bool DB>
__device__ __forceinline__ void bwd_group_store_partials(const BwdArgs& a, float (&ds)[VPT * PACK],
                                                         float (&db)[VPT * PACK], float* red, float* part_ds,
                                                         float* part_db) {
  constexpr int N = VPT * PACK, WARPS = THREADS / 32;
  static_assert(WIDTH <= 32 && THREADS % 32 == 0, "groups within a warp");
  const int warp = threadIdx.x / 32, glane = threadIdx.x % WIDTH;
#pragma unroll
  for (int off = WIDTH; off < 32; off *= 2)
#pragma unroll
    for (int i = 0; i < N; ++i) {
      ds[i] += __shfl_xor_sync(0xffffffffu, ds[i], off);
      if constexpr (DB) db[i] += __shfl_xor_sync(0xffffffffu, db[i], off);
    }
  float* red_ds = red;
  float* red_db = red + WARPS * a.cols;
  if (int(threadIdx.x % 32) < WIDTH) {
#pragma unroll
    for (int v = 0; v < VPT; ++v) {
      const int64_t col = int64_t(v * WIDTH + glane) * PACK;
      if (col >= a.cols) continue;
#pragma unroll
      for (int k = 0; k < PACK; ++k) {
        red_ds[warp * a.cols + col + k] = ds[v * PACK + k];
        if constexpr (DB) red_db[warp * a.cols + col + k] = db[v * PACK + k];
      }
    }
  }
  bwd_block_sum_partials<THREADS, DB>(a, red, part_ds, part_db);
}

// The lane's scale values of a row group (packs v * WIDTH + glane; 0 past the row's end).
template <typename P, int PACK, int VPT, int WIDTH>
__device__ __forceinline__ void group_scale(const BwdArgs& a, int glane, float (&sc)[VPT * PACK]) {
#pragma unroll
  for (int v = 0; v < VPT; ++v) {
    const int64_t col = int64_t(v * WIDTH + glane) * PACK;
    float s[PACK];
    if (col < a.cols) load_param<P, PACK>(a.scale, col, 1.f, s);
#pragma unroll
    for (int k = 0; k < PACK; ++k) sc[v * PACK + k] = col < a.cols ? s[k] : 0.f;
  }
}

// One row of the group tier's backward, from the group's packs of x and dy (lane glane
// holds packs v * WIDTH + glane): dx is stored and dy·xhat, dy go to the lane's
// dscale/dbias partials. With one 16-bit pack a lane each value is converted and
// normalized once: g and xhat stay as floats for the second pass (the tier is
// issue-bound at 128-256 16-bit columns, ncu: 1.04-1.09x). With more packs, keeping them
// costs occupancy (512 16-bit columns: 96 -> 137 registers), and float32 rows measured
// 1-4 % slower, so there they are recomputed from the packs. Group-uniform: every lane
// takes part in the shuffles, a row past the end (valid false) adds zeros. scale_of(v, s)
// gives pack v's scale values (from registers, or loaded where used); with AHEAD, the
// store takes what was loaded with the row (add+norm's dh).
template <typename T, int PACK, int VPT, int WIDTH, bool AHEAD, typename S, typename ScaleOf, typename RowT>
__device__ __forceinline__ void bwd_group_row(const BwdArgs& a, const S& store, int64_t row, bool valid, int glane,
                                              float mean, float rstd, const RowT (&rx)[VPT], const RowT (&rd)[VPT],
                                              const typename S::template Ahead<PACK> (&ahead)[VPT],
                                              const ScaleOf& scale_of, float (&ds)[VPT * PACK],
                                              float (&db)[VPT * PACK]) {
  constexpr int N = VPT * PACK;
  constexpr bool KEEP = VPT == 1 && sizeof(T) == 2;
  float g[KEEP ? N : 1], xh[KEEP ? N : 1], sum_g = 0.f, sum_gx = 0.f;
#pragma unroll
  for (int v = 0; v < VPT; ++v) {
    if (!valid || int64_t(v * WIDTH + glane) * PACK >= a.cols) {
      if constexpr (KEEP)
#pragma unroll
        for (int k = 0; k < PACK; ++k) g[v * PACK + k] = xh[v * PACK + k] = 0.f;
      continue;
    }
    float sc[PACK];
    scale_of(v, sc);
#pragma unroll
    for (int k = 0; k < PACK; ++k) {
      const int i = v * PACK + k;
      const float d = rd[v].template value<false>(k), xhv = norm_xhat<T>(rx[v].template value<false>(k), mean, rstd),
                  gv = d * sc[k];
      sum_g += gv;
      sum_gx += gv * xhv;
      if constexpr (KEEP) {
        g[i] = gv;
        xh[i] = xhv;
        ds[i] += d * xhv;
        db[i] += d;
      }
    }
  }
  const float inv_n = 1.f / float(a.cols);
  const float mg = S::kRms ? 0.f : group_sum<WIDTH>(sum_g) * inv_n;
  const float mgx = group_sum<WIDTH>(sum_gx) * inv_n;
  if (!valid) return;
#pragma unroll
  for (int v = 0; v < VPT; ++v) {
    const int64_t col = int64_t(v * WIDTH + glane) * PACK;
    if (col >= a.cols) continue;
    float out[PACK], sc[PACK];
    if constexpr (!KEEP) scale_of(v, sc);
#pragma unroll
    for (int k = 0; k < PACK; ++k) {
      const int i = v * PACK + k;
      if constexpr (KEEP) {
        out[k] = norm_dx_of<S::kRms>(g[i], xh[i], rstd, mg, mgx);
      } else {
        const float d = rd[v].template value<true>(k), xhv = norm_xhat<T>(rx[v].template value<true>(k), mean, rstd);
        out[k] = norm_dx_of<S::kRms>(d * sc[k], xhv, rstd, mg, mgx);
        ds[i] += d * xhv;
        db[i] += d;
      }
    }
    if constexpr (AHEAD)
      store(row * a.cols + col, out, ahead[v]);
    else
      store(row * a.cols + col, out);
  }
}

// Rows of up to kRegsMaxCols values, a group of WIDTH lanes a row, ROWS rows a group
// loaded together; a persistent grid of warps. The scale stays in registers across rows
// at one 16-bit pack a lane, and with HOIST at more (which costs registers: LayerNorm bf16
// at 512 columns 95 -> 124; the launchers decide, bwd_hoist_scale).
// PREFETCH: the warp's next tile is loaded before the current one is reduced, two tiles a
// warp in flight (one pack a lane, or two as bfloat16 words: the registers of a second
// tile); below 32 lanes a row of packs, kRegsPrefetchSmThreads an SM (at most 96
// registers: ptxas otherwise took up to 101; a minimum of 0 blocks leaves the others'
// registers to ptxas: 1 took up to 25 % more, and 5 took the unvectorized kernels from
// 32-40 to 72).
template <typename T, typename P, int PACK, int VPT, int WIDTH, int ROWS, typename S, bool PREFETCH,
          int THREADS = kRegsThreads, bool HOIST = false>
__global__ void __launch_bounds__(THREADS,
                                  PREFETCH && WIDTH < 32 && PACK > 1 ? kRegsPrefetchSmThreads / THREADS : 0)
    bwd_regs_kernel(typename S::Args a, float* part_ds, float* part_db) {
  constexpr int N = VPT * PACK, GROUPS = 32 / WIDTH, ROWS_PER_WARP = GROUPS * ROWS;
  constexpr bool HOIST_SCALE = (VPT == 1 || HOIST) && sizeof(T) == 2;
  // add+norm's dh loaded with the row at one pack a lane; with more it would cost the
  // registers of a pack a lane (1024 16-bit columns: 167 -> 218), so it is loaded where stored.
  constexpr bool AHEAD = VPT == 1;
  static_assert(!PREFETCH || VPT == 1 || (VPT == 2 && std::is_same_v<T, bf16_t>),
                "a second tile in registers at one pack a lane (bfloat16 words: two, launch_bwd_regs)");
  using PackT = Pack<T, PACK>;
  using AheadT = typename S::template Ahead<PACK>;
  const int lane = threadIdx.x % 32, group = lane / WIDTH, glane = lane % WIDTH;
  const int64_t warps_total = int64_t(gridDim.x) * (THREADS / 32);
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  const S store(a);
  float ds[N], db[N], sc[HOIST_SCALE ? N : 1];
#pragma unroll
  for (int i = 0; i < N; ++i) { ds[i] = 0.f; db[i] = 0.f; }
  if constexpr (HOIST_SCALE) group_scale<P, PACK, VPT, WIDTH>(a, glane, sc);
  const auto scale_of = [&](int v, float (&s)[PACK]) {
    if constexpr (HOIST_SCALE) {
#pragma unroll
      for (int k = 0; k < PACK; ++k) s[k] = sc[v * PACK + k];
    } else {
      load_param<P, PACK>(a.scale, int64_t(v * WIDTH + glane) * PACK, 1.f, s);
    }
  };
  // A tile's rows of the group: x and dy in their storage type (half the registers of
  // float; bfloat16 as 32-bit words, see fwd_regs_kernel), add+norm's dh (AHEAD), the
  // row statistics; nothing past the last row.
  constexpr bool kWords = std::is_same_v<T, bf16_t>;
  using RowT = std::conditional_t<kWords, RowWords<T, PACK>, RowPack<T, PACK>>;
  struct Tile {
    RowT rx[ROWS][VPT], rd[ROWS][VPT];
    AheadT ahead[ROWS][VPT];
    float mean[ROWS], rstd[ROWS];
  };
  const auto load_tile = [&](int64_t tile, Tile& t) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int64_t row = tile * ROWS_PER_WARP + group * ROWS + r;
      const bool valid = row < a.rows;
      t.mean[r] = (valid && !S::kRms) ? a.mean[row] : 0.f;
      t.rstd[r] = valid ? a.rstd[row] : 0.f;
#pragma unroll
      for (int v = 0; v < VPT; ++v) {
        const int64_t col = int64_t(v * WIDTH + glane) * PACK;
        if (valid && col < a.cols) {
          if constexpr (kWords) {
            t.rx[r][v].load(x + row * a.cols + col);
            t.rd[r][v].load(dy + row * a.cols + col);
          } else {
            t.rx[r][v].set(*reinterpret_cast<const PackT*>(x + row * a.cols + col));
            t.rd[r][v].set(*reinterpret_cast<const PackT*>(dy + row * a.cols + col));
          }
          if (AHEAD) t.ahead[r][v] = store.template load_ahead<PACK>(row * a.cols + col);
        }
      }
    }
    if constexpr (!AHEAD && S::kPrefetch) {  // after the tile's loads: none waits on these
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const int64_t row = tile * ROWS_PER_WARP + group * ROWS + r;
#pragma unroll
        for (int v = 0; v < VPT; ++v) {
          const int64_t col = int64_t(v * WIDTH + glane) * PACK;
          if (row < a.rows && col < a.cols) store.prefetch(row * a.cols + col);
        }
      }
    }
  };
  const auto reduce_tile = [&](int64_t tile, const Tile& t) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int64_t row = tile * ROWS_PER_WARP + group * ROWS + r;
      bwd_group_row<T, PACK, VPT, WIDTH, AHEAD>(a, store, row, row < a.rows, glane, t.mean[r], t.rstd[r], t.rx[r],
                                                t.rd[r], t.ahead[r], scale_of, ds, db);
    }
  };
  int64_t tile = int64_t(blockIdx.x) * (THREADS / 32) + threadIdx.x / 32;
  if constexpr (PREFETCH) {
    Tile cur;
    if (tile * ROWS_PER_WARP < a.rows) load_tile(tile, cur);
    for (; tile * ROWS_PER_WARP < a.rows; tile += warps_total) {
      Tile next;
      const int64_t next_tile = tile + warps_total;
      if (next_tile * ROWS_PER_WARP < a.rows) load_tile(next_tile, next);
      reduce_tile(tile, cur);
      cur = next;
    }
  } else {
    for (; tile * ROWS_PER_WARP < a.rows; tile += warps_total) {
      Tile t;
      load_tile(tile, t);
      reduce_tile(tile, t);
    }
  }
  if (part_ds == nullptr && part_db == nullptr) return;
  extern __shared__ float red[];  // [2 (RMSNorm: 1)][warps][cols]
  bwd_group_store_partials<PACK, VPT, WIDTH, THREADS, !S::kRms>(a, ds, db, red, part_ds, part_db);
}

// The backward of fwd_tail_kernel's rows (16-bit, 256 + r columns, 0 < r <= 32 * E, a
// 16-byte pack a lane and the last r columns E a lane on the first r / E lanes): ROWS rows
// a warp, their shuffle chains interleaved, and the next tile loaded ahead (a persistent
// grid); the scale and the lane's dscale/dbias partials in registers across rows. At two
// packs a lane (bwd_regs_kernel) the second pack's code ran for the warp to serve the
// lanes holding it.
template <typename T, typename P, int E, int ROWS, typename S>
__global__ void __launch_bounds__(kRegsThreads) bwd_tail_kernel(typename S::Args a, float* part_ds, float* part_db) {
  static_assert(sizeof(T) == 2 && (E == 1 || E == 2 || E == 4), "16-bit rows, a tail of 1, 2 or 4 values a lane");
  constexpr int PACK = 8, WARPS = kRegsThreads / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t warps_total = int64_t(gridDim.x) * WARPS;
  const int main_col = lane * PACK, tail_col = 32 * PACK + lane * E;
  const bool has_tail = tail_col < a.cols;
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  const S store(a);
  float sc_m[PACK], sc_t[E], ds_m[PACK], db_m[PACK], ds_t[E], db_t[E];
  load_param<P, PACK>(a.scale, main_col, 1.f, sc_m);
#pragma unroll
  for (int k = 0; k < PACK; ++k) ds_m[k] = db_m[k] = 0.f;
#pragma unroll
  for (int k = 0; k < E; ++k) sc_t[k] = ds_t[k] = db_t[k] = 0.f;
  if (has_tail) load_param<P, E>(a.scale, tail_col, 1.f, sc_t);
  struct Row {
    RowWords<T, PACK> xm, dm;
    RowWords<T, E> xt, dt;
    float mean, rstd;
  };
  struct Tile {
    Row r[ROWS];
  };
  const auto load_row = [&](int64_t row, Row& r) {
    if (row >= a.rows) return;
    r.mean = S::kRms ? 0.f : a.mean[row];
    r.rstd = a.rstd[row];
    const int64_t base = row * a.cols;
    r.xm.load(x + base + main_col);
    r.dm.load(dy + base + main_col);
    if (has_tail) {
      r.xt.load(x + base + tail_col);
      r.dt.load(dy + base + tail_col);
    }
    if constexpr (S::kPrefetch) {  // after the row's loads: none waits on these
      store.prefetch(base + main_col);
      if (has_tail) store.prefetch(base + tail_col);
    }
  };
  const auto load_tile = [&](int64_t tile, Tile& t) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) load_row(tile * ROWS + r, t.r[r]);
  };
  // A piece of a row (the main pack or the tail; N values of x and dy): its sums of g and
  // g·xhat, and its dx stored at flat index i, dy·xhat and dy added to its partials.
  const auto piece_sums = [](const Row& r, const auto& xw, const auto& dw, const auto& sc, float& sum_g, float& sum_gx) {
    constexpr int N = std::remove_reference_t<decltype(xw)>::kValues;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float g = dw.template value<false>(k) * sc[k];
      sum_g += g;
      sum_gx += g * norm_xhat<T>(xw.template value<false>(k), r.mean, r.rstd);
    }
  };
  const auto piece_dx = [&](int64_t i, const Row& r, const auto& xw, const auto& dw, const auto& sc, float mg,
                            float mgx, auto& ds, auto& db) {
    constexpr int N = std::remove_reference_t<decltype(xw)>::kValues;
    float out[N];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float d = dw.template value<true>(k), xh = norm_xhat<T>(xw.template value<true>(k), r.mean, r.rstd);
      out[k] = norm_dx_of<S::kRms>(d * sc[k], xh, r.rstd, mg, mgx);
      ds[k] += d * xh;
      db[k] += d;
    }
    store(i, out);
  };
  // Rows past the end (warp-uniform) add zeros to the shuffles and store nothing.
  const auto reduce_tile = [&](int64_t tile, const Tile& t) {
    float sum_g[ROWS], sum_gx[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      sum_g[r] = sum_gx[r] = 0.f;
      if (tile * ROWS + r >= a.rows) continue;
      piece_sums(t.r[r], t.r[r].xm, t.r[r].dm, sc_m, sum_g[r], sum_gx[r]);
      if (has_tail) piece_sums(t.r[r], t.r[r].xt, t.r[r].dt, sc_t, sum_g[r], sum_gx[r]);
    }
    if constexpr (!S::kRms) group_sums<32, ROWS>(sum_g);
    group_sums<32, ROWS>(sum_gx);
    const float inv_n = 1.f / float(a.cols);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int64_t row = tile * ROWS + r;
      if (row >= a.rows) continue;
      const float mg = S::kRms ? 0.f : sum_g[r] * inv_n, mgx = sum_gx[r] * inv_n;
      piece_dx(row * a.cols + main_col, t.r[r], t.r[r].xm, t.r[r].dm, sc_m, mg, mgx, ds_m, db_m);
      if (has_tail) piece_dx(row * a.cols + tail_col, t.r[r], t.r[r].xt, t.r[r].dt, sc_t, mg, mgx, ds_t, db_t);
    }
  };
  // Warp-uniform: a warp's rows are its own, every lane takes part in the shuffles.
  int64_t tile = int64_t(blockIdx.x) * WARPS + warp;
  Tile cur;
  load_tile(tile, cur);
  for (; tile * ROWS < a.rows; tile += warps_total) {
    Tile next;
    load_tile(tile + warps_total, next);
    reduce_tile(tile, cur);
    cur = next;
  }
  if (part_ds == nullptr && part_db == nullptr) return;
  extern __shared__ float red[];  // [2 (RMSNorm: 1)][warps][cols]
  float* red_ds = red + warp * a.cols;
  float* red_db = red + (WARPS + warp) * a.cols;
  const auto piece_partials = [&](int col, const auto& ds, const auto& db) {
#pragma unroll
    for (int k = 0; k < int(std::extent_v<std::remove_reference_t<decltype(ds)>>); ++k) {
      red_ds[col + k] = ds[k];
      if constexpr (!S::kRms) red_db[col + k] = db[k];
    }
  };
  piece_partials(main_col, ds_m, db_m);
  if (has_tail) piece_partials(tail_col, ds_t, db_t);
  bwd_block_sum_partials<kRegsThreads, !S::kRms>(a, red, part_ds, part_db);
}

// Block (or cluster) per row; each thread owns K packs of every row (fixed
// columns), so its dscale/dbias partials stay in registers across rows. Partial row
// j of part_ds/part_db is block j's (cluster j's: its blocks write disjoint columns).
// The pieces below are shared by the kernel that loads rows into registers and the
// one that stages them in shared memory by bulk copies.
template <typename P, int PACK, int K>
__device__ __forceinline__ void bwd_thread_scale(const BwdArgs& a, const RowSplit& sp, float (&sc)[K * PACK]) {
  const int64_t tid = sp.thread(), span = sp.threads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t col = (tid + int64_t(k) * span) * PACK;
    float s[PACK];
    if (col < a.cols) load_param<P, PACK>(a.scale, col, 1.f, s);
#pragma unroll
    for (int j = 0; j < PACK; ++j) sc[k * PACK + j] = col < a.cols ? s[j] : 0.f;
  }
}

// One row: the thread's x and dy packs (zeros past the row's end) give dx, stored, and
// the dscale/dbias partials. `after_sums` runs once the row sums are known, i.e. after
// every thread of the block (cluster) has passed the reduction's barriers.
template <typename T, int PACK, int K, bool CLUSTER, typename S, typename AfterSums>
__device__ __forceinline__ void bwd_block_row(const BwdArgs& a, const S& store, const RowSplit& sp, int64_t row,
                                              float mean, float rstd, const Pack<T, PACK> (&xc)[K],
                                              const Pack<T, PACK> (&dc)[K], const float (&sc)[K * PACK],
                                              float (&ds)[K * PACK], float (&db)[K * PACK], int use,
                                              AfterSums&& after_sums) {
  constexpr int N = K * PACK;
  const int64_t tid = sp.thread(), span = sp.threads();
  float xh[N], g[N], dyv[N], sum_g = 0.f, sum_gx = 0.f;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const bool in = (tid + int64_t(k) * span) * PACK < a.cols;
#pragma unroll
    for (int j = 0; j < PACK; ++j) {
      const int i = k * PACK + j;
      const float xv = in ? to_float(xc[k].v[j]) : mean, dv = in ? to_float(dc[k].v[j]) : 0.f;
      dyv[i] = dv;
      xh[i] = (xv - mean) * rstd;
      g[i] = dv * sc[i];
      sum_g += g[i];
      sum_gx += g[i] * xh[i];
    }
  }
  const float2 sums = row_sum2<CLUSTER>(sum_g, sum_gx, use);
  after_sums();
  const float inv_n = 1.f / float(a.cols);
  const float mg = S::kRms ? 0.f : sums.x * inv_n, mgx = sums.y * inv_n;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t col = (tid + int64_t(k) * span) * PACK;
    if (col >= a.cols) continue;
    float out[PACK];
#pragma unroll
    for (int j = 0; j < PACK; ++j) {
      const int i = k * PACK + j;
      out[j] = norm_dx_of<S::kRms>(g[i], xh[i], rstd, mg, mgx);
      ds[i] += dyv[i] * xh[i];
      db[i] += dyv[i];
    }
    store(row * a.cols + col, out);
  }
}

// The block's (cluster's) dscale/dbias partials, row sp.first_row of the workspace (DB:
// whether there are dbias partials; not for RMSNorm).
template <int PACK, int K, bool DB>
__device__ __forceinline__ void bwd_store_partials(const BwdArgs& a, const RowSplit& sp, const float (&ds)[K * PACK],
                                                   const float (&db)[K * PACK], float* part_ds, float* part_db) {
  const int64_t tid = sp.thread(), span = sp.threads();
  const int64_t part = sp.first_row;  // the block's (cluster's) index in the grid
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t col = (tid + int64_t(k) * span) * PACK;
    if (col >= a.cols) continue;
#pragma unroll
    for (int j = 0; j < PACK; ++j) {
      if (part_ds) part_ds[part * a.cols + col + j] = ds[k * PACK + j];
      if (DB && part_db) part_db[part * a.cols + col + j] = db[k * PACK + j];
    }
  }
}

// The partials of a cluster of blocks that each take their own rows (launched in
// clusters only to merge them): every block parks its partials in its shared memory
// `buf` (2 * K * PACK * blockDim floats, free by now), block rank r adds the elements
// i = r (mod size) of every block in rank order and writes row blockIdx / size of the
// workspace: size times fewer partial rows, the same sums in a fixed order. Without
// a cluster (size 1) the block writes its own row.
template <int PACK, int K, bool DB>
__device__ __forceinline__ void bwd_merge_store_partials(const BwdArgs& a, const RowSplit& sp, const float (&ds)[K * PACK],
                                                         const float (&db)[K * PACK], float* part_ds, float* part_db,
                                                         float* buf) {
  constexpr int N = K * PACK;
  const int cs = cluster_size();
  if (cs == 1) return bwd_store_partials<PACK, K, DB>(a, sp, ds, db, part_ds, part_db);
  const int t = threadIdx.x, nt = blockDim.x;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    buf[i * nt + t] = ds[i];
    if constexpr (DB) buf[(N + i) * nt + t] = db[i];
  }
  cluster_sync();  // every block's partials are visible to the cluster
  const int64_t part = int64_t(blockIdx.x) / cs, tid = sp.thread(), span = sp.threads();
  for (int i = cluster_rank(); i < N; i += cs) {
    const int64_t col = (tid + int64_t(i / PACK) * span) * PACK + i % PACK;
    float sd = 0.f, sb = 0.f;
    for (int q = 0; q < cs; ++q) {
      const float* other = cluster_map(buf, q);
      sd += other[i * nt + t];
      if constexpr (DB) sb += other[(N + i) * nt + t];
    }
    if (col < a.cols) {
      if (part_ds) part_ds[part * a.cols + col] = sd;
      if (DB && part_db) part_db[part * a.cols + col] = sb;
    }
  }
  cluster_sync();  // no block leaves while another still reads its shared memory
}

template <typename T, typename P, int PACK, int K, typename S, bool CLUSTER = false>
__global__ void __launch_bounds__(1024) bwd_block_regs_kernel(typename S::Args a, float* part_ds, float* part_db) {
  constexpr int N = K * PACK;
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  const S store(a);
  const RowSplit sp = row_split<CLUSTER>();
  const int64_t tid = sp.thread(), span = sp.threads();
  float ds[N], db[N], sc[N];
#pragma unroll
  for (int i = 0; i < N; ++i) { ds[i] = 0.f; db[i] = 0.f; }
  bwd_thread_scale<P, PACK, K>(a, sp, sc);
  // A block per row loads the next row's x and dy before this row's block sums: they
  // stay in flight through its barriers (LayerNorm bwd at 8192 columns: 1036 -> 965 us
  // on the H100). In a cluster (8 values a thread, partials and scale in registers)
  // the extra registers would spill, so there the row is loaded when it starts. Every
  // element is written (zeros past the row's end): nothing of a row stays live into the
  // next.
  Pack<T, PACK> xn[K], dn[K];
  float mean_n = 0.f, rstd_n = 0.f;
  const auto load_row = [&](int64_t row) {
    mean_n = S::kRms ? 0.f : a.mean[row];
    rstd_n = a.rstd[row];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t col = (tid + int64_t(k) * span) * PACK;
      if (col < a.cols) {
        xn[k] = *reinterpret_cast<const Pack<T, PACK>*>(x + row * a.cols + col);
        dn[k] = *reinterpret_cast<const Pack<T, PACK>*>(dy + row * a.cols + col);
      } else {
        xn[k] = Pack<T, PACK>{};
        dn[k] = Pack<T, PACK>{};
      }
    }
    if constexpr (S::kPrefetch && !CLUSTER) {  // dh to L2 after the row's loads (StoreDxAddDh)
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t col = (tid + int64_t(k) * span) * PACK;
        if (col < a.cols) store.prefetch(row * a.cols + col);
      }
    }
  };
  if constexpr (CLUSTER) ClusterExchange<2>::init();
  if (!CLUSTER && sp.first_row < a.rows) load_row(sp.first_row);
  int use = 0;
  for (int64_t row = sp.first_row; row < a.rows; row += sp.step, ++use) {
    if constexpr (CLUSTER) load_row(row);
    const float mean = mean_n, rstd = rstd_n;
    Pack<T, PACK> xc[K], dc[K];
#pragma unroll
    for (int k = 0; k < K; ++k) { xc[k] = xn[k]; dc[k] = dn[k]; }
    if (!CLUSTER && row + sp.step < a.rows) load_row(row + sp.step);
    bwd_block_row<T, PACK, K, CLUSTER>(a, store, sp, row, mean, rstd, xc, dc, sc, ds, db, use, [] {});
  }
  row_split_exit<CLUSTER>();
  bwd_store_partials<PACK, K, !S::kRms>(a, sp, ds, db, part_ds, part_db);
}

// The cluster tier for 16-bit rows, two rows at a time. In registers, the dscale/dbias
// partials take 2 of about 4 registers an element, so at 64 registers a thread (1024
// threads an SM) a thread holds 8 elements: 16 bytes of x and 16 of dy in flight through
// each row's exchange, half what float32 rows have (their cluster backward ran at 93 %
// of the 3X floor, 16-bit at 79 %). Here a thread holds one pack of K = 2 rows
// (32 + 32 bytes in flight), and adds to its partials in shared memory, and reads its
// scale values from there: a row of 3 * PACK + 1 floats a thread (scale, ds, db), so
// that every access is one base register plus an immediate offset, and the odd stride
// keeps a warp's accesses on 32 different banks. The rows share one cluster exchange,
// and their partials one accumulator: the partial rows (one per cluster) are those of
// the register kernel. (The first version, two packs of one row a thread, had twice
// the partial rows: 15.5 MiB of workspace for LayerNorm at 16384-32768 columns. The
// next two rows loaded ahead of the exchange spill at 64 registers, whether held in
// registers or copied into shared memory by cp.async: 1.15-1.4x slower, measured.)
// VEC: the row is 3 * PACK + 4 floats, so that scale, ds and db move in 16-byte accesses
// (2 + 4 + 4 a pack and row instead of 8 + 16 + 16); 7 * 16 bytes apart, each
// quarter-warp's 128-bit accesses still fall on 32 different banks.
template <int PACK, bool VEC>
constexpr int bwd_cluster_smem_stride() { return VEC ? 3 * PACK + 4 : 3 * PACK + 1; }

// A folded cluster's dscale/dbias partials (its blocks own disjoint columns): cluster c
// writes row c % fold; block (c, rank) first waits for block (c - fold, rank), which owns
// the same columns, to raise its flag and adds its partials to that row's (in that
// order), then raises its own flag if a later cluster adds to the row. The release by one
// thread after the block's barrier covers the block's writes, as in CUTLASS's serial
// split-K semaphore. A thread's PACK values move in 16-byte accesses (PACK % 4 == 0,
// col % PACK == 0): 4-byte ones fetched 8 sectors a useful one across a warp, and with a
// fence in every thread a link took about 10 µs at 65536 columns (H200). Not inlined: it
// kept the fold variant's main loop within 8 instructions of the unfolded kernel's.
template <int PACK>
__device__ __noinline__ void store_folded_partials(int64_t cols, const RowSplit& sp, int64_t col, bool owns,
                                                   float (&ds)[PACK], float (&db)[PACK], float* part_ds,
                                                   float* part_db, int* flags, int64_t fold) {
  static_assert(PACK % 4 == 0, "16-byte accesses");
  const int cluster = int(sp.first_row), folds = int(fold);  // fewer than 2^31 clusters
  const int64_t at = int64_t(cluster % folds) * cols + col;
  const auto add = [&](const float* part, float (&v)[PACK]) {
#pragma unroll
    for (int q = 0; q < PACK; q += 4) {  // from L2: written by another SM
      const float4 p = __ldcg(reinterpret_cast<const float4*>(part + at + q));
      v[q] = p.x + v[q], v[q + 1] = p.y + v[q + 1], v[q + 2] = p.z + v[q + 2], v[q + 3] = p.w + v[q + 3];
    }
  };
  const auto put = [&](float* part, const float (&v)[PACK]) {
#pragma unroll
    for (int q = 0; q < PACK; q += 4)
      *reinterpret_cast<float4*>(part + at + q) = make_float4(v[q], v[q + 1], v[q + 2], v[q + 3]);
  };
  if (cluster >= folds) {
    if (threadIdx.x == 0) flag_wait(flags + (cluster - folds) * sp.size + sp.rank);
    __syncthreads();
    if (owns && part_ds) add(part_ds, ds);
    if (owns && part_db) add(part_db, db);
  }
  if (owns && part_ds) put(part_ds, ds);
  if (owns && part_db) put(part_db, db);
  if (cluster + folds < int(sp.step)) {
    __syncthreads();
    if (threadIdx.x == 0) flag_raise(flags + cluster * sp.size + sp.rank);
  }
}

// FOLD: cluster c adds its partials to those of clusters c - fold, c - 2 fold, ... in row
// c % fold of the workspace (bwd_cluster_fold_rows), through `flags`. A variant of its
// own: in the kernel without it the main loop takes 8 fewer instructions (bf16, 674), and
// the backward at 32768 columns measured 1.0-1.6 % faster (H200).
template <typename T, typename P, int PACK, int K, typename S, bool VEC, bool FOLD = false>
__global__ void __launch_bounds__(1024) bwd_cluster_smem_kernel(typename S::Args a, float* part_ds, float* part_db,
                                                                int* flags, int64_t fold) {
  static_assert(K == 2, "two rows an exchange");
  static_assert(!VEC || PACK % 4 == 0, "16-byte accesses of whole packs");
  constexpr bool RMS = S::kRms;
  extern __shared__ __align__(16) float acc_rows[];  // [blockDim][stride]: scale, ds, db
  float* sc = acc_rows + threadIdx.x * bwd_cluster_smem_stride<PACK, VEC>();
  float* acc = sc + PACK;
  // n values of a thread's shared row (n a multiple of 4 where VEC: 16-byte accesses).
  const auto get = [](const float* from, float* to, int n) {
    if constexpr (VEC) {
#pragma unroll
      for (int q = 0; q < n; q += 4) {
        const float4 v = *reinterpret_cast<const float4*>(from + q);
        to[q] = v.x, to[q + 1] = v.y, to[q + 2] = v.z, to[q + 3] = v.w;
      }
    } else {
      for (int q = 0; q < n; ++q) to[q] = from[q];
    }
  };
  const auto put = [](float* to, const float* from, int n) {
    if constexpr (VEC) {
#pragma unroll
      for (int q = 0; q < n; q += 4)
        *reinterpret_cast<float4*>(to + q) = make_float4(from[q], from[q + 1], from[q + 2], from[q + 3]);
    } else {
      for (int q = 0; q < n; ++q) to[q] = from[q];
    }
  };
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  const S store(a);
  const RowSplit sp = row_split<true>();
  const int64_t col = sp.thread() * PACK;
  const bool owns = col < a.cols;
  {
    float scale[PACK], zero[2 * PACK] = {};
    bwd_thread_scale<P, PACK, 1>(a, sp, scale);
    put(sc, scale, PACK);
    put(acc, zero, 2 * PACK);
  }
  // RMSNorm: no mean, so no sum of g to exchange and no dbias.
  constexpr int NS = RMS ? K : 2 * K;
  ClusterExchange<NS>::init();
  const float inv_n = 1.f / float(a.cols);
  int use = 0;
  for (int64_t row0 = sp.first_row; row0 < a.rows; row0 += K * sp.step, ++use) {
    // Two values a register (see fwd_block_regs_kernel), loaded as words: ptxas spills
    // 16-24 bytes more, all outside the loop (SASS), and the loop runs 13 % fewer
    // instructions (H200 backward 1.03-1.08x faster at 16384-65536 columns).
    RowWords<T, PACK> xc[K], dc[K];
    float mean[K], rstd[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t row = row0 + k * sp.step;
      const bool live = row < a.rows;
      mean[k] = (RMS || !live) ? 0.f : a.mean[row];
      rstd[k] = live ? a.rstd[row] : 0.f;
      xc[k].zero();  // dy = 0 past the row's end and the last row: no contribution
      dc[k].zero();
      if (owns && live) {
        xc[k].load(x + row * a.cols + col);
        dc[k].load(dy + row * a.cols + col);
      }
    }
    float sum_g[K] = {}, sum_gx[K] = {};
    constexpr int Q = VEC ? 4 : PACK;  // values a round: a 16-byte access each of scale, ds, db
#pragma unroll
    for (int j0 = 0; j0 < PACK; j0 += Q) {
      float s[Q];
      get(sc + j0, s, Q);
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int i = 0; i < Q; ++i) {
          const float g = dc[k].template value<false>(j0 + i) * s[i];
          if constexpr (!RMS) sum_g[k] += g;
          sum_gx[k] += g * ((xc[k].template value<false>(j0 + i) - mean[k]) * rstd[k]);
        }
    }
    float sums[NS];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if constexpr (RMS) sums[k] = sum_gx[k];
      else sums[2 * k] = sum_g[k], sums[2 * k + 1] = sum_gx[k];
    }
    ClusterExchange<NS>::publish(sums, use);
    ClusterExchange<NS>::collect(sums, use);
    float mg[K], mgx[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      mg[k] = RMS ? 0.f : sums[2 * k] * inv_n;
      mgx[k] = (RMS ? sums[k] : sums[2 * k + 1]) * inv_n;
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t row = row0 + k * sp.step;
      if (!owns || row >= a.rows) continue;
      float out[PACK];
#pragma unroll
      for (int j0 = 0; j0 < PACK; j0 += Q) {
        float s[Q], ds[Q], db[Q];
        get(sc + j0, s, Q);
        get(acc + j0, ds, Q);
        if constexpr (!RMS) get(acc + PACK + j0, db, Q);
#pragma unroll
        for (int i = 0; i < Q; ++i) {
          const int j = j0 + i;
          const float dv = dc[k].template value<true>(j), xh = (xc[k].template value<true>(j) - mean[k]) * rstd[k];
          out[j] = norm_dx_of<RMS>(dv * s[i], xh, rstd[k], mg[k], mgx[k]);
          ds[i] += dv * xh;
          if constexpr (!RMS) db[i] += dv;
        }
        put(acc + j0, ds, Q);
        if constexpr (!RMS) put(acc + PACK + j0, db, Q);
      }
      store(row * a.cols + col, out);
    }
  }
  row_split_exit<true>();
  // The cluster's partial row: its blocks own disjoint columns.
  float ds[PACK], db[PACK] = {};
  get(acc, ds, PACK);
  if constexpr (!RMS) get(acc + PACK, db, PACK);
  if constexpr (FOLD) {
    store_folded_partials<PACK>(a.cols, sp, col, owns, ds, db, part_ds, RMS ? nullptr : part_db, flags, fold);
  } else {
    bwd_store_partials<PACK, 1, !RMS>(a, sp, ds, db, part_ds, part_db);  // its one pack: col, if owned
  }
}

// The block-per-row backward with x and dy staged in shared memory by bulk copies
// (sm_90), `stages` rows a block in flight: a row is K runs of blockDim packs (one copy
// each, x and dy), refilled with the block's next-but-`stages` row once the row sums'
// barriers show every thread has read it. The loads stay in flight through the
// per-row barriers, and no register holds a row that is not being worked on.
// (The same staging in the cluster tier measured 1.3-1.4x slower than its register
// kernel at 16384-32768 columns: docs/perf-notes.md.)
// Layout: `stages` mbarriers (kBulkBarrierBytes), then [stage][x, dy][K][blockDim] packs.
// With one pack a thread, two blocks of up to 512 threads an SM: 64 registers (ptxas
// took more otherwise, one block fit, and 2048-4096 columns ran 5-10 % slower than the
// register kernel); with more, 64 registers spill, so one block. WIDE: one pack a thread
// in one block of up to 1024 threads (64 registers), for rows of 513-1023 packs, which
// two packs a thread run on 288-512 threads, the SM's only block; WIDE_BLOCKS = 2: the
// same in two blocks of up to kBwdBulkPairThreads an SM (56 registers, 8 bytes spilled).
constexpr int kBulkBarrierBytes = 128;  // room for 16 mbarriers, one a stage
constexpr int kBwdBulkMaxThreads = 512;
constexpr int kBwdBulkPairThreads = 576;
constexpr int kBwdBulkMinCols = kRegsMaxCols + 1;  // every 16-bit row of the block tiers
template <typename T, typename P, int PACK, int K, typename S, bool WIDE = false, int WIDE_BLOCKS = 1>
__global__ void __launch_bounds__(WIDE ? (WIDE_BLOCKS == 2 ? kBwdBulkPairThreads : 1024) : kBwdBulkMaxThreads,
                                  WIDE ? WIDE_BLOCKS : (K == 1 ? 2 : 1))
    bwd_bulk_kernel(typename S::Args a, float* part_ds, float* part_db, int stages) {
  static_assert(!WIDE || K == 1, "the wide block holds one pack a thread");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  using PackT = Pack<T, PACK>;
  constexpr int N = K * PACK;
  const S store(a);
  const RowSplit sp = row_split<false>();
  const int64_t tid = sp.thread(), span = sp.threads(), nvec = a.cols / PACK;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem_raw);
  PackT* staged = reinterpret_cast<PackT*>(smem_raw + kBulkBarrierBytes);
  const auto slot = [&](int stage, int src, int k) { return staged + ((size_t(stage) * 2 + src) * K + k) * blockDim.x; };
  // Run k of the block's slice: packs first_pack(k) .. +run_packs(k) of every row.
  const auto first_pack = [&](int k) { return int64_t(k) * span; };
  const auto run_packs = [&](int k) {
    const int64_t left = nvec - first_pack(k);
    return left <= 0 ? int64_t(0) : (left < blockDim.x ? left : int64_t(blockDim.x));
  };
  const auto fill = [&](int stage, int64_t row) {
    uint32_t bytes = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) bytes += uint32_t(run_packs(k) * sizeof(PackT));
    mbarrier_arrive_expect(&bars[stage], 2 * bytes);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const uint32_t b = uint32_t(run_packs(k) * sizeof(PackT));
      if (b == 0) continue;
      const int64_t off = row * a.cols + first_pack(k) * PACK;
      bulk_load(slot(stage, 0, k), static_cast<const T*>(a.x) + off, b, &bars[stage]);
      bulk_load(slot(stage, 1, k), static_cast<const T*>(a.dy) + off, b, &bars[stage]);
    }
  };
  float ds[N], db[N], sc[N];
#pragma unroll
  for (int i = 0; i < N; ++i) { ds[i] = 0.f; db[i] = 0.f; }
  bwd_thread_scale<P, PACK, K>(a, sp, sc);
  const bool issuer = threadIdx.x == 0;
  if (issuer) {
    for (int st = 0; st < stages; ++st) mbarrier_init(&bars[st], 1);
    for (int st = 0; st < stages; ++st)
      if (sp.first_row + int64_t(st) * sp.step < a.rows) fill(st, sp.first_row + int64_t(st) * sp.step);
  }
  __syncthreads();  // the barriers are initialized before anyone waits on them
  float mean_n = 0.f, rstd_n = 0.f;  // the row's statistics, loaded a row ahead
  if (sp.first_row < a.rows) {
    mean_n = S::kRms ? 0.f : a.mean[sp.first_row];
    rstd_n = a.rstd[sp.first_row];
  }
  int stage = 0;
  uint32_t phase = 0;
  for (int64_t row = sp.first_row; row < a.rows; row += sp.step) {
    const float mean = mean_n, rstd = rstd_n;
    if (row + sp.step < a.rows) {
      mean_n = S::kRms ? 0.f : a.mean[row + sp.step];
      rstd_n = a.rstd[row + sp.step];
      if constexpr (S::kPrefetch) {  // the next row's dh to L2, a row ahead of its store (StoreDxAddDh)
#pragma unroll
        for (int k = 0; k < K; ++k)
          if (tid + int64_t(k) * span < nvec) store.prefetch((row + sp.step) * a.cols + (tid + int64_t(k) * span) * PACK);
      }
    }
    mbarrier_wait(&bars[stage], phase);
    PackT xc[K], dc[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const bool in = (tid + int64_t(k) * span) < nvec;
      xc[k] = in ? slot(stage, 0, k)[threadIdx.x] : PackT{};
      dc[k] = in ? slot(stage, 1, k)[threadIdx.x] : PackT{};
    }
    const int64_t next = row + int64_t(stages) * sp.step;
    const int cur = stage;
    bwd_block_row<T, PACK, K, false>(a, store, sp, row, mean, rstd, xc, dc, sc, ds, db, 0, [&] {
      if (issuer && next < a.rows) fill(cur, next);
    });
    if (++stage == stages) { stage = 0; phase ^= 1u; }
  }
  __syncthreads();  // every thread is done with the staged rows before they hold partials
  bwd_merge_store_partials<PACK, K, !S::kRms>(a, sp, ds, db, part_ds, part_db,
                                              reinterpret_cast<float*>(smem_raw + kBulkBarrierBytes));
}

// The group tier's backward (rows of up to kRegsMaxCols values, WIDTH lanes a row) with
// x and dy staged in shared memory by bulk copies (sm_90): a stage holds a chunk of
// CHUNK = groups * RPG consecutive rows (contiguous: one copy each of x and dy) and
// `stages` chunks a block are in flight whatever the registers. A group takes rows
// j * groups + group of the chunk; the chunk's statistics come into registers a chunk
// ahead; a stage is refilled once a block barrier shows every thread has read it.
// float32 rows of 256+ columns only: there it is 1.03-1.05x faster than the register
// kernel (H100); at 128 float32 columns 0.96x, and with 16-bit rows, whose register
// kernel is issue-bound rather than short of loads in flight (ncu, 256 columns: 57 %
// issue slots, 2.0 TB/s), 0.94-1.06x (docs/perf-notes.md).
// Layout: `stages` mbarriers (kBulkBarrierBytes), then [stage][x, dy][CHUNK * cols] T;
// at the end the same memory holds the partials of bwd_group_store_partials.
template <int VPT>
constexpr int bwd_rows_bulk_rpg() { return VPT >= 8 ? 1 : 8 / VPT; }  // 16 KiB chunks of 16-byte packs

template <typename T, typename P, int PACK, int VPT, int WIDTH, typename S>
__global__ void __launch_bounds__(kRegsThreads) bwd_rows_bulk_kernel(typename S::Args a, float* part_ds,
                                                                     float* part_db, int stages) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  constexpr int N = VPT * PACK, GROUPS = kRegsThreads / WIDTH, RPG = bwd_rows_bulk_rpg<VPT>(),
                CHUNK = GROUPS * RPG;
  using PackT = Pack<T, PACK>;
  const int group = threadIdx.x / WIDTH, glane = threadIdx.x % WIDTH;
  const S store(a);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem_raw);
  T* staged = reinterpret_cast<T*>(smem_raw + kBulkBarrierBytes);
  const int64_t chunk_elems = int64_t(CHUNK) * a.cols, chunks = (a.rows + CHUNK - 1) / CHUNK;
  const auto fill = [&](int stage, int64_t c) {
    const int64_t first = c * CHUNK, n = a.rows - first < CHUNK ? a.rows - first : CHUNK;
    const uint32_t bytes = uint32_t(n * a.cols * int64_t(sizeof(T)));
    mbarrier_arrive_expect(&bars[stage], 2 * bytes);
    bulk_load(staged + 2 * stage * chunk_elems, static_cast<const T*>(a.x) + first * a.cols, bytes, &bars[stage]);
    bulk_load(staged + (2 * stage + 1) * chunk_elems, static_cast<const T*>(a.dy) + first * a.cols, bytes,
              &bars[stage]);
  };
  float ds[N], db[N], sc[N];
#pragma unroll
  for (int i = 0; i < N; ++i) { ds[i] = 0.f; db[i] = 0.f; }
  group_scale<P, PACK, VPT, WIDTH>(a, glane, sc);
  const auto scale_of = [&](int v, float (&s)[PACK]) {
#pragma unroll
    for (int k = 0; k < PACK; ++k) s[k] = sc[v * PACK + k];
  };
  const bool issuer = threadIdx.x == 0;
  if (issuer) {
    for (int st = 0; st < stages; ++st) mbarrier_init(&bars[st], 1);
    for (int st = 0; st < stages; ++st)
      if (blockIdx.x + int64_t(st) * gridDim.x < chunks) fill(st, blockIdx.x + int64_t(st) * gridDim.x);
  }
  __syncthreads();  // the barriers are initialized before anyone waits on them
  float mean_n[RPG], rstd_n[RPG];
  const auto load_stats = [&](int64_t c) {
#pragma unroll
    for (int j = 0; j < RPG; ++j) {
      const int64_t row = c * CHUNK + j * GROUPS + group;
      mean_n[j] = row < a.rows && !S::kRms ? a.mean[row] : 0.f;
      rstd_n[j] = row < a.rows ? a.rstd[row] : 0.f;
    }
  };
  if (blockIdx.x < chunks) load_stats(blockIdx.x);
  int stage = 0;
  uint32_t phase = 0;
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    float mean[RPG], rstd[RPG];
#pragma unroll
    for (int j = 0; j < RPG; ++j) { mean[j] = mean_n[j]; rstd[j] = rstd_n[j]; }
    if (c + gridDim.x < chunks) load_stats(c + gridDim.x);
    mbarrier_wait(&bars[stage], phase);
    const T* xs = staged + 2 * stage * chunk_elems;
    const T* dys = xs + chunk_elems;
#pragma unroll
    for (int j = 0; j < RPG; ++j) {
      const int r = j * GROUPS + group;
      const int64_t row = c * CHUNK + r;
      const bool valid = row < a.rows;
      RowPack<T, PACK> rx[VPT], rd[VPT];
      typename S::template Ahead<PACK> ahead[VPT];
#pragma unroll
      for (int v = 0; v < VPT; ++v) {
        const int64_t col = int64_t(v * WIDTH + glane) * PACK;
        if (valid && col < a.cols) {
          rx[v].set(*reinterpret_cast<const PackT*>(xs + r * a.cols + col));
          rd[v].set(*reinterpret_cast<const PackT*>(dys + r * a.cols + col));
        }
      }
      bwd_group_row<T, PACK, VPT, WIDTH, false>(a, store, row, valid, glane, mean[j], rstd[j], rx, rd, ahead, scale_of,
                                                ds, db);
    }
    __syncthreads();  // every thread has read the stage
    if (issuer && c + int64_t(stages) * gridDim.x < chunks) fill(stage, c + int64_t(stages) * gridDim.x);
    if (++stage == stages) { stage = 0; phase ^= 1u; }
  }
  if (part_ds == nullptr && part_db == nullptr) return;
  bwd_group_store_partials<PACK, VPT, WIDTH, kRegsThreads, !S::kRms>(
      a, ds, db, reinterpret_cast<float*>(smem_raw + kBulkBarrierBytes), part_ds, part_db);
}

// Block per row for long rows: dx only (x and dy cached in shared memory, or
// read twice); dscale/dbias come from param_grad_kernel.
template <typename T, typename P, int PACK, bool CACHE, typename S>
__global__ void bwd_block_kernel(typename S::Args a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  using PackT = Pack<T, PACK>;
  const int64_t nvec = a.cols / PACK;
  PackT* cache_x = reinterpret_cast<PackT*>(smem_raw);
  PackT* cache_dy = cache_x + nvec;
  const PackT* x = static_cast<const PackT*>(a.x);
  const PackT* dy = static_cast<const PackT*>(a.dy);
  const S store(a);
  const float inv_n = 1.f / float(a.cols);
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const float mean = S::kRms ? 0.f : a.mean[row];
    const float rstd = a.rstd[row];
    float sum_g = 0.f, sum_gx = 0.f;
    for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
      const PackT px = x[row * nvec + v], pd = dy[row * nvec + v];
      if (CACHE) { cache_x[v] = px; cache_dy[v] = pd; }
      float sc[PACK];
      load_param<P, PACK>(a.scale, v * PACK, 1.f, sc);
#pragma unroll
      for (int k = 0; k < PACK; ++k) {
        const float g = to_float(pd.v[k]) * sc[k];
        sum_g += g;
        sum_gx += g * (to_float(px.v[k]) - mean) * rstd;
      }
    }
    const float2 sums = block_sum2(sum_g, sum_gx);
    const float mg = S::kRms ? 0.f : sums.x * inv_n, mgx = sums.y * inv_n;
    for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
      const PackT px = CACHE ? cache_x[v] : x[row * nvec + v];
      const PackT pd = CACHE ? cache_dy[v] : dy[row * nvec + v];
      float sc[PACK], out[PACK];
      load_param<P, PACK>(a.scale, v * PACK, 1.f, sc);
#pragma unroll
      for (int k = 0; k < PACK; ++k)
        out[k] = norm_dx_of<S::kRms>(to_float(pd.v[k]) * sc[k], (to_float(px.v[k]) - mean) * rstd, rstd, mg, mgx);
      store(row * a.cols + v * PACK, out);
    }
    if (CACHE) __syncthreads();
  }
}

// Column-tiled dscale/dbias partials for long rows: block (32, 8) covers 32
// columns of one chunk of rows; partial row = chunk index.
template <typename T>
__global__ void __launch_bounds__(256) param_grad_kernel(BwdArgs a, int64_t chunk_rows, float* part_ds, float* part_db) {
  __shared__ float red[2][8][33];
  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  const int64_t col = int64_t(blockIdx.x) * 32 + tx;
  const int64_t r0 = int64_t(blockIdx.y) * chunk_rows;
  const int64_t r1 = r0 + chunk_rows < a.rows ? r0 + chunk_rows : a.rows;
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  float ds = 0.f, db = 0.f;
  if (col < a.cols) {
    for (int64_t row = r0 + ty; row < r1; row += 8) {
      const float mean = a.rms ? 0.f : a.mean[row];
      const float d = to_float(dy[row * a.cols + col]);
      ds += d * (to_float(x[row * a.cols + col]) - mean) * a.rstd[row];
      db += d;
    }
  }
  red[0][ty][tx] = ds; red[1][ty][tx] = db;
  __syncthreads();
  if (ty == 0 && col < a.cols) {
    float s_ds = 0.f, s_db = 0.f;
    for (int j = 0; j < 8; ++j) { s_ds += red[0][j][tx]; s_db += red[1][j][tx]; }
    if (part_ds) part_ds[blockIdx.y * a.cols + col] = s_ds;
    if (part_db) part_db[blockIdx.y * a.cols + col] = s_db;
  }
}

// Column sums of partial rows ([nrows, cols] float32): blockIdx.y picks dscale's (0) or
// dbias's (1) array, a null one is skipped. A block takes CW consecutive columns, its
// threads CW a row: thread t adds rows t / CW, + slots, ... (slots = blockDim / CW), four
// loads in flight (four accumulators); the threads of a column are then added by warp
// shuffles, the warps' sums in warp order: a fixed order for a given grid, so bitwise
// reproducible. The launch sizes CW and the block so that a narrow row's few hundred
// columns still spread over many SMs and a thread has about four rows, one round of loads
// (H100, 32-256 columns: 2.1-2.4 µs; 32 columns a block with 16 rows a warp took 2.9-3.5).
template <typename P, int CW>
__global__ void __launch_bounds__(1024) sum_partials_kernel(const float* part0, const float* part1, int64_t nrows,
                                                            int64_t cols, P* out0, P* out1) {
  static_assert(CW >= 1 && CW <= 32 && 32 % CW == 0, "CW divides a warp");
  const float* part = blockIdx.y == 0 ? part0 : part1;
  P* out = blockIdx.y == 0 ? out0 : out1;
  if (part == nullptr) return;  // the whole block
  __shared__ float red[32][CW];
  const int c = threadIdx.x % CW, lane = threadIdx.x % 32, w = threadIdx.x / 32, nw = blockDim.x / 32;
  const int64_t slot = threadIdx.x / CW, slots = blockDim.x / CW;
  const int64_t col = int64_t(blockIdx.x) * CW + c;
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
  if (col < cols) {
    const float* p = part + col;
    int64_t j = slot;
    for (; j + 3 * slots < nrows; j += 4 * slots) {
      a0 += p[j * cols];
      a1 += p[(j + slots) * cols];
      a2 += p[(j + 2 * slots) * cols];
      a3 += p[(j + 3 * slots) * cols];
    }
    if (j < nrows) a0 += p[j * cols];
    if (j + slots < nrows) a1 += p[(j + slots) * cols];
    if (j + 2 * slots < nrows) a2 += p[(j + 2 * slots) * cols];
  }
  float s = (a0 + a1) + (a2 + a3);
#pragma unroll
  for (int off = CW; off < 32; off *= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (lane < CW) red[w][lane] = s;
  __syncthreads();
  if (w != 0) return;
  // Warp 0: lane l adds warps l / CW, + 32 / CW, ... of column l % CW, then the lanes of
  // a column are added as above.
  float t = 0.f;
  for (int k = lane / CW; k < nw; k += 32 / CW) t += red[k][c];
#pragma unroll
  for (int off = CW; off < 32; off *= 2) t += __shfl_xor_sync(0xffffffffu, t, off);
  if (lane < CW && col < cols) out[col] = from_float<P>(t);
}

template <typename P, int CW>
cudaError_t launch_sum_partials_cw(const float* part_ds, const float* part_db, int64_t nrows, int64_t cols, P* dscale,
                                   P* dbias, int threads, cudaStream_t stream) {
  const dim3 grid(unsigned((cols + CW - 1) / CW), part_db != nullptr ? 2u : 1u);
  sum_partials_kernel<P, CW><<<grid, unsigned(threads), 0, stream>>>(part_ds, part_db, nrows, cols, dscale, dbias);
  return cudaGetLastError();
}

// One launch for both arrays. Columns a block: the fewest of 4-32 that keep the grid
// within two blocks an SM; threads: four rows each, 32-1024.
template <typename P>
cudaError_t launch_sum_partials(const float* part_ds, const float* part_db, int64_t nrows, int64_t cols,
                                P* dscale, P* dbias, cudaStream_t stream) {
  if (part_ds == nullptr && part_db == nullptr) return cudaSuccess;
  const int64_t arrays = part_db != nullptr ? 2 : 1, max_blocks = 2 * int64_t(sm_count());
  int cw = 4;
  while (cw < 32 && (cols + cw - 1) / cw * arrays > max_blocks) cw *= 2;
  const int64_t want = (std::max<int64_t>(nrows, 1) + 3) / 4 * cw;
  const int threads = int(std::min<int64_t>(1024, (want + 31) / 32 * 32));
  switch (cw) {
    case 4: return launch_sum_partials_cw<P, 4>(part_ds, part_db, nrows, cols, dscale, dbias, threads, stream);
    case 8: return launch_sum_partials_cw<P, 8>(part_ds, part_db, nrows, cols, dscale, dbias, threads, stream);
    case 16: return launch_sum_partials_cw<P, 16>(part_ds, part_db, nrows, cols, dscale, dbias, threads, stream);
    default: return launch_sum_partials_cw<P, 32>(part_ds, part_db, nrows, cols, dscale, dbias, threads, stream);
  }
}

// -------------------------------------------------------------- launchers ---

// The tail kernels' rows (fwd_tail_kernel, bwd_tail_kernel): 16-bit rows of 257-384
// columns, the last cols - 256 at E values a lane, the least of 1, 2 or 4 that holds them;
// 0 for other rows.
inline int tail_values_per_lane(int64_t cols) {
  const int64_t r = cols - 256;
  return r <= 0 || r > 128 ? 0 : (r <= 32 ? 1 : (r <= 64 ? 2 : 4));
}

// The tail kernels' knobs JAX_OPS_NORM_FWD_TAIL / JAX_OPS_NORM_BWD_TAIL: 0 never, 1 where
// the rules below take them (default), 2 as on a fast-DRAM GPU, whatever the device.
// add+norm's rules differ between the two GPUs measured (both sm_90 with 132 SMs), so they
// key on what tells those apart: the peak DRAM bandwidth, H100 SXM 3.35 and H200 4.9 TB/s
// (docs/perf-notes.md, thirty-fifth and thirty-sixth sessions). The cut lies between HBM3
// parts (at most 4.0 TB/s) and HBM3e ones (4.8 and up); unmeasured on other GPUs.
constexpr double kTailFastDramGbps = 4400;

inline bool tail_by_device(int knob) { return knob == 2 || dram_peak_gbps() >= kTailFastDramGbps; }

// launch(std::integral_constant<int, E>{}) for e = 1, 2 or 4.
template <typename Launch>
cudaError_t with_tail_values(int e, Launch&& launch) {
  if (e == 1) return launch(std::integral_constant<int, 1>{});
  if (e == 2) return launch(std::integral_constant<int, 2>{});
  return launch(std::integral_constant<int, 4>{});
}

template <typename T, typename P, int PACK, int VPT, int WIDTH, int ROWS, typename L>
cudaError_t launch_fwd_regs_rows(const FwdAddArgs& a, cudaStream_t stream, bool ahead_vpt2 = false) {
  constexpr int ROWS_PER_BLOCK = (kRegsThreads / WIDTH) * ROWS;
  // 16-bit LayerNorm at one pack a lane from 64 columns: a persistent grid whose warps load
  // their next tile before reducing this one, the tile's rows' statistics as interleaved
  // shuffle chains (H200, 49152 rows, µs: bf16 64 5.4 -> 5.0, 128 8.85 -> 8.4, 256 15.7 ->
  // 14.7; float16, its rows then as words, 1.07x; fwd_bwd 1.01-1.03x). Measured slower or
  // the same (so not taken): RMSNorm, add+norm at 32 and 256 columns, float16 rows as Packs
  // (a register a value: 128 columns 8.85 -> 9.6), float32, 32 columns; the interleaved
  // statistics alone changed nothing. 16-byte packs only (the measured rows; the scalar
  // kernels of other widths are unmeasured). Knob JAX_OPS_NORM_FWD_REGS_PREFETCH=0 turns it off.
  // At two packs a lane the caller decides (ahead_vpt2; launch_fwd_regs).
  constexpr bool kPrefetchVpt1 =
      VPT == 1 && WIDTH >= 8 && PACK == 8 && sizeof(T) == 2 && std::is_base_of_v<LoadX<T>, L> && !L::kRms;
  constexpr bool kPrefetchVpt2 = VPT == 2 && WIDTH == 32 && PACK == 8 && sizeof(T) == 2 && std::is_base_of_v<LoadX<T>, L>;
  if constexpr (kPrefetchVpt1 || kPrefetchVpt2) {
    static const int prefetch = env_knob("JAX_OPS_NORM_FWD_REGS_PREFETCH", 1);
    if (kPrefetchVpt1 ? prefetch != 0 : ahead_vpt2) {
      auto kernel = fwd_regs_kernel<T, P, PACK, VPT, WIDTH, ROWS, L, true>;
      int blocks = 0;
      const int64_t needed = (a.rows + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK;
      cudaError_t err = resident_blocks(kernel, kRegsThreads, 0, needed, &blocks);
      if (err != cudaSuccess) return err;
      kernel<<<blocks, kRegsThreads, 0, stream>>>(a);
      return cudaGetLastError();
    }
  }
  auto kernel = fwd_regs_kernel<T, P, PACK, VPT, WIDTH, ROWS, L>;
  // One tile per warp rather than a persistent grid: with few tiles per warp a
  // persistent grid leaves a partly idle last round, the scheduler balances better.
  int blocks = 0;
  cudaError_t err = resident_blocks(kernel, kRegsThreads, 0, 1, &blocks);
  if (err != cudaSuccess) return err;
  const int64_t needed = (a.rows + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK;
  blocks = int(needed < int64_t(sm_count()) * 64 ? needed : int64_t(sm_count()) * 64);
  kernel<<<blocks, kRegsThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, typename P, int E, typename L>
cudaError_t launch_fwd_tail(const FwdAddArgs& a, cudaStream_t stream) {
  auto kernel = fwd_tail_kernel<T, P, E, L>;
  int blocks = 0;
  const int64_t needed = (a.rows + 2 * (kRegsThreads / 32) - 1) / (2 * (kRegsThreads / 32));
  cudaError_t err = resident_blocks(kernel, kRegsThreads, 0, needed, &blocks);
  if (err != cudaSuccess) return err;
  kernel<<<blocks, kRegsThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, typename P, int PACK, int VPT, int WIDTH, typename L>
cudaError_t launch_fwd_regs(const FwdAddArgs& a, cudaStream_t stream) {
  // Rows a group of fewer than 32 lanes: 2 for a plain norm, 1 for add+norm, whose
  // residual doubles the loads a row (H100, bf16, 32-128 columns, µs against 4 rows a
  // group: LayerNorm 32 4.4 -> 4.0, 128 11.3 -> 10.8, add_layer_norm 32 7.7 -> 6.0;
  // docs/perf-notes.md; knob JAX_OPS_NORM_FWD_GROUP_ROWS = 1, 2 or 4 overrides). At 32
  // lanes and one pack a lane: 2 for a plain norm (a tile then had one row, 512 bytes,
  // in flight a warp: bf16 256 / float32 128 columns 1.03-1.04x), 1 for add+norm (1-2 %
  // slower with 2).
  constexpr bool kPlain = std::is_base_of_v<LoadX<T>, L>;
  if constexpr (WIDTH < 32) {
    static const int knob = env_knob("JAX_OPS_NORM_FWD_GROUP_ROWS", 0);
    const int group_rows = knob == 1 || knob == 2 || knob == 4 ? knob : (kPlain ? 2 : 1);
    if (group_rows == 1) return launch_fwd_regs_rows<T, P, PACK, VPT, WIDTH, 1, L>(a, stream);
    if (group_rows == 2) return launch_fwd_regs_rows<T, P, PACK, VPT, WIDTH, 2, L>(a, stream);
    return launch_fwd_regs_rows<T, P, PACK, VPT, WIDTH, 4, L>(a, stream);
  } else if constexpr (VPT == 2 && PACK == 8 && sizeof(T) == 2 && kPlain) {
    // The plain norms' 16-bit rows of 33-56 packs (264-448 columns; RMSNorm 33-48), where
    // the second pack a lane is on a few lanes: the warp tier there was issue-bound (ncu,
    // LayerNorm 264 bf16: 279 instructions a row against 162 at 256, issue slots 80 % busy, L1 70 %
    // with the strided float32 scale and bias reloaded each row). Two rows a tile, a
    // persistent grid with the next tile ahead, the parameters loaded once a warp (96
    // registers): H200 bf16, 49152 rows, µs, LayerNorm 264 20.85 -> 19.0, 320 21.85 ->
    // 19.55, 384 23.25 -> 22.05, 448 25.55 -> 25.35; RMSNorm 264 17.9 -> 16.75, 320 19.25 ->
    // 18.65, 384 the same, 448 1.01x slower (so RMSNorm to 48 packs); at 57-64 packs (512)
    // 1.02-1.03x slower, so not there. float16 the same (LayerNorm 264 20.5 -> 19.7). Two
    // rows a tile alone, or the persistent grid alone: up to 1.11x slower; 8 lanes a row at 5-8
    // packs: LayerNorm 264 18.5 but 1.05-1.13x slower from 384 (docs/perf-notes.md,
    // thirty-second session). Knob JAX_OPS_NORM_FWD_VPT2_TILE=0 turns it off. With the tail
    // kernel on (fwd_regs_dispatch), it serves LayerNorm's 49-56 packs (392-448 columns) only.
    static const bool tile2 = env_knob("JAX_OPS_NORM_FWD_VPT2_TILE", 1) != 0;
    if (tile2 && a.cols / PACK <= (L::kRms ? 48 : 56))
      return launch_fwd_regs_rows<T, P, PACK, VPT, WIDTH, 2, L>(a, stream, true);
    return launch_fwd_regs_rows<T, P, PACK, VPT, WIDTH, 1, L>(a, stream);
  } else {
    constexpr int ROWS = VPT == 1 && kPlain ? 2 : 1;
    return launch_fwd_regs_rows<T, P, PACK, VPT, WIDTH, ROWS, L>(a, stream);
  }
}

// 16-bit rows of 16-byte packs at 384 / 768 / 1536 / 3072 columns: row shapes with no idle
// slot (dispatch_group_shape_thirds) where they measured faster (H200 bf16, 49152 rows,
// against the power-of-two shapes, µs; docs/perf-notes.md, thirty-first session):
// add+norm's forward on 32 lanes (1536: add_layer_norm 156.5 -> 150.8, add_rms_norm 151.3
// -> 149.0; 768 / 3072 the same); the plain norms' forward the same at 768-3072, RMSNorm
// and add_layer_norm 1.01-1.02x slower on 16 lanes at 384. Knob
// JAX_OPS_NORM_FWD_REGS_THIRDS=0 turns them off.
template <typename T, int PACK>
constexpr bool kThirdsTypes = sizeof(T) == 2 && PACK == 8;

template <typename T, typename P, int PACK, typename L>
cudaError_t fwd_regs_dispatch(const FwdAddArgs& a, cudaStream_t stream) {
  static const bool thirds = env_knob("JAX_OPS_NORM_FWD_REGS_THIRDS", 1) != 0;
  constexpr bool kAdd = std::is_base_of_v<LoadAdd<T>, L>;
  // 16-bit rows of 257-384 columns: the last cols - 256 spread over the lanes, 1, 2 or 4 a
  // lane (fwd_tail_kernel), against two packs a lane on 32 lanes: H200, 49152 rows, fwd
  // µs, bf16 (f16): LayerNorm 264 19.05 -> 15.8 (19.7 -> 15.8), 320 19.5 -> 17.8, 336 19.95
  // -> 19.6, 384 22.0 -> 20.9 (21.6 -> 21.2); RMSNorm 264 16.55 -> 15.1, 384 21.15 -> 20.5
  // (thirty-third session). add+norm to 352 columns: add_layer_norm 288 35.3 -> 30.65,
  // 320 36.7 -> 34.55, 336 37.9 -> 35.95; add_rms_norm 288 33.1 -> 30.3, 336 the same; at
  // 384, every lane's tail full, 1.04x slower (add_layer_norm 39.35 -> 41.1, add_rms_norm
  // 38.55 -> 40.25); 337-383 not measured, the cut at 352 a guess between (thirty-fourth
  // session; docs/perf-notes.md). On the H100 add+norm's forward tail measured 1.02-1.06x
  // slower (add_layer_norm 320 45.7 -> 47.6, add_rms_norm 352 49.5 -> 51.9; thirty-fifth
  // session), so add+norm takes it only where tail_by_device. Knob JAX_OPS_NORM_FWD_TAIL.
  if constexpr (sizeof(T) == 2 && PACK == 8) {
    static const int tail = env_knob("JAX_OPS_NORM_FWD_TAIL", 1);
    const int e = tail != 0 ? tail_values_per_lane(a.cols) : 0;
    if (e != 0 && (!kAdd || (a.cols <= 352 && tail_by_device(tail))))
      return with_tail_values(e, [&](auto ev) { return launch_fwd_tail<T, P, decltype(ev)::value, L>(a, stream); });
  }
  return dispatch_group_shape_thirds<PACK, fwd_regs_max_cols<T, PACK>(), false, kThirdsTypes<T, PACK> && kAdd>(
      a.cols / PACK, thirds, [&](auto vpt, auto width) {
        return launch_fwd_regs<T, P, PACK, decltype(vpt)::value, decltype(width)::value, L>(a, stream);
      });
}

// Whether a forward of the block tiers may take the split column layout (split_col): the
// plain norms' 16-bit rows with float32 parameters, in whole groups of 32 packs (knob
// JAX_OPS_NORM_FWD_SPLIT=0: never). Not add+norm: its x, residual and h in half packs
// cost more than the parameter loads save (H100, 32768 columns: 1.18x slower).
template <typename T, typename P, int PACK, typename L>
constexpr bool kSplitTypes = sizeof(T) == 2 && sizeof(P) == 4 && PACK == 8 && std::is_base_of_v<LoadX<T>, L>;

inline bool use_split(const FwdAddArgs& a) {
  static const int knob = env_knob("JAX_OPS_NORM_FWD_SPLIT", 1);
  return knob != 0 && (a.scale != nullptr || a.bias != nullptr) && (a.cols / 8) % 32 == 0;
}

// sm_90: rows over 64 KiB, whose cached copy leaves one block an SM with nothing to
// overlap its reduction and output pass, split over a cluster of 2-8 blocks of up to 512
// threads, each caching a slice of at most 64 KiB, so that two or more rows an SM are
// in flight (knob JAX_OPS_NORM_FWD_CLUSTER_MIN_BYTES: rows of at least this many bytes;
// 0 = off). False (nothing launched) where it does not apply.
template <typename T, typename P, int PACK, typename L>
bool launch_fwd_block_cluster(const FwdAddArgs& a, cudaStream_t stream, cudaError_t* err) {
  static const int min_bytes = env_knob("JAX_OPS_NORM_FWD_CLUSTER_MIN_BYTES", 65536 + 1);
  constexpr int64_t kSliceBytes = 65536;
  auto kernel = fwd_block_kernel<T, P, PACK, true, L, true>;
  // In the cluster tier only with both parameters (LayerNorm: 1.03x faster at 65536
  // columns); RMSNorm's one array measured 1.10x slower split.
  if constexpr (kSplitTypes<T, P, PACK, L>)
    if (a.scale != nullptr && a.bias != nullptr && use_split(a)) kernel = fwd_cluster_split_kernel<T, P, PACK, L>;
  const int64_t row_bytes = a.cols * int64_t(sizeof(T)), nvec = a.cols / PACK;
  if (min_bytes <= 0 || row_bytes < min_bytes || !clusters_supported(kernel)) return false;
  int cs = 2;
  while (cs < kMaxClusterBlocks && row_bytes > cs * kSliceBytes) cs *= 2;
  const int threads = std::min(block_threads((nvec + cs - 1) / cs), 512);
  // A thread's packs are every (cs * threads)-th: ceil(nvec / (cs * threads)) of them.
  const size_t smem = size_t((nvec + int64_t(cs) * threads - 1) / (int64_t(cs) * threads)) * size_t(threads) *
                      sizeof(Pack<T, PACK>);
  if (smem > size_t(kSliceBytes)) return false;
  int64_t clusters = 0;
  if (allow_smem(kernel, smem) != cudaSuccess ||
      cluster_grid(kernel, cs, threads, a.rows, &clusters, smem) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  *err = launch_clusters_smem(kernel, cs, threads, smem, clusters, stream, static_cast<const typename L::Args&>(a));
  return true;
}

template <typename T, typename P, int PACK, typename L>
cudaError_t launch_fwd_block(const FwdAddArgs& a, cudaStream_t stream) {
  cudaError_t cluster_err = cudaSuccess;
  if (launch_fwd_block_cluster<T, P, PACK, L>(a, stream, &cluster_err)) return cluster_err;
  const int64_t nvec = a.cols / PACK;
  const int threads = block_threads(nvec);
  const size_t smem = size_t(a.cols) * sizeof(T);
  int blocks = 0;
  if (cached_grid(fwd_block_kernel<T, P, PACK, true, L>, threads, smem, a.rows, &blocks)) {
    fwd_block_kernel<T, P, PACK, true, L><<<blocks, threads, smem, stream>>>(a);
    return cudaGetLastError();
  }
  auto kernel = fwd_block_kernel<T, P, PACK, false, L>;
  const cudaError_t err = resident_blocks(kernel, threads, 0, a.rows, &blocks);
  if (err != cudaSuccess) return err;
  kernel<<<blocks, threads, 0, stream>>>(a);
  return cudaGetLastError();
}

// Block-per-row in registers: rows of up to 4096 packs (4 packs a thread at 1024
// threads; 8 at 512 by knob: 64 registers of row data, which never spill).
constexpr int64_t kFwdBlockRegsMaxVec = 4096;

template <typename T, typename P, int PACK, int K, typename L>
cudaError_t launch_fwd_block_regs_k(const FwdAddArgs& a, int threads, cudaStream_t stream) {
  auto kernel = fwd_block_regs_kernel<T, P, PACK, K, L>;
  // Split only past 2048 packs (1024 threads): at 32768 16-bit columns 2-2.5 % faster, at
  // 8192-16384 the same, and at 4352 4.5 % slower (H100, docs/perf-notes.md).
  if constexpr (kSplitTypes<T, P, PACK, L> && K == 4)
    if (threads > 512 && use_split(a)) kernel = fwd_block_regs_kernel<T, P, PACK, K, L, true>;
  int blocks = 0;
  cudaError_t err = resident_blocks(kernel, threads, 0, a.rows, &blocks);
  if (err != cudaSuccess) return err;
  kernel<<<blocks, threads, 0, stream>>>(a);
  return cudaGetLastError();
}

// Rows an SM holds in flight with K packs a thread (0 where K cannot take the row).
template <typename T, typename P, int PACK, int K, typename L>
int fwd_block_rows_per_sm(int64_t nvec) {
  const int threads = warp_threads(nvec, K);
  int per_sm = 0;
  if (threads > fwd_block_max_threads(K) ||
      max_blocks_per_sm(fwd_block_regs_kernel<T, P, PACK, K, L>, threads, 0, &per_sm) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return per_sm;
}

// 16-bit rows where 4 packs a thread would be chosen (H100, bf16, 49152 rows; docs/perf-notes.md):
// - where 4 leave one row an SM, 5 packs if they keep two (2049-2560 packs: 16392-20480
//   columns; 1.01-1.30x faster than 6 packs, float16 most), else 6 packs (64 registers,
//   no spill since the row is loaded as words) if they do: 24576 columns, LayerNorm 1.13x
//   and RMSNorm 1.04x faster than 4.
// - else 5 packs with a bias or a residual where 4 leave threads idle (a row of 544 packs
//   on 160 threads) or 5 keep more of two rows an SM: LayerNorm 1.05-1.12x faster at
//   4352-6656 and 12288 columns, add_layer_norm 1.02-1.06x; RMSNorm ran 3-7 % slower.
// Knob JAX_OPS_NORM_FWD_BLOCK_K forces 4, 5, 6 or 8 packs where they fit.
template <typename T, int PACK>
constexpr bool kFwdBlockMorePacks = sizeof(T) == 2 && PACK == 8;

template <typename T, typename P, int PACK, typename L>
int fwd_block_packs(const FwdAddArgs& a, int forced) {
  const int64_t nvec = a.cols / PACK;
  if (forced == 5 || forced == 6 || forced == 8) {
    const int rows = forced == 5   ? fwd_block_rows_per_sm<T, P, PACK, 5, L>(nvec)
                     : forced == 6 ? fwd_block_rows_per_sm<T, P, PACK, 6, L>(nvec)
                                   : fwd_block_rows_per_sm<T, P, PACK, 8, L>(nvec);
    return rows > 0 ? forced : 4;
  }
  if (forced == 4) return 4;
  const int rows4 = fwd_block_rows_per_sm<T, P, PACK, 4, L>(nvec);
  const int rows5 = fwd_block_rows_per_sm<T, P, PACK, 5, L>(nvec);
  if (rows4 == 1 && rows5 >= 2) return 5;
  if (rows4 == 1 && fwd_block_rows_per_sm<T, P, PACK, 6, L>(nvec) >= 2) return 6;
  const bool biased = std::is_base_of_v<LoadAdd<T>, L> || a.bias != nullptr;
  if (biased && (nvec % 128 != 0 || (rows4 <= 2 && rows5 > rows4))) return 5;
  return 4;
}

// About 256 threads per row, more packs a thread for longer rows up to 4, then more
// threads (512 threads at 2048 packs, 1024 at 4096). Up to 8 packs a thread (knob
// JAX_OPS_NORM_FWD_BLOCK_MAX_PACKS=8) takes 90 registers: two 256-thread rows an SM at
// 2048 packs, where two 512-thread rows of 4 packs measured 1.13x faster (LayerNorm,
// 16384 bf16 columns; add+norm 1.29x), and one 1024-thread row 1.05x faster than one
// of 512 threads at 4096 packs (add+norm 1.32x). At most 2 or 1 packs (knob 2, 1): as fast to
// 2.3x slower at 4352-7168 columns (docs/perf-notes.md). 16-bit rows may take 5 or 6
// (fwd_block_packs).
template <typename T, typename P, int PACK, typename L>
cudaError_t launch_fwd_block_regs(const FwdAddArgs& a, cudaStream_t stream) {
  static const int knob = env_knob("JAX_OPS_NORM_FWD_BLOCK_MAX_PACKS", 4);
  static const int max_packs = knob >= 8 ? 8 : (knob == 2 || knob == 1 ? knob : 4);
  static const int forced = env_knob("JAX_OPS_NORM_FWD_BLOCK_K", 0);
  const int64_t nvec = a.cols / PACK;
  int k = 1;
  while (k < max_packs && nvec > int64_t(256) * k) k *= 2;
  while (nvec > int64_t(1024) * k) k *= 2;  // a knob's 1 or 2 packs: at most 1024 threads
  if constexpr (kFwdBlockMorePacks<T, PACK>)
    if (k == 4 && max_packs == 4) k = fwd_block_packs<T, P, PACK, L>(a, forced);
  const int threads = warp_threads(nvec, k);
  if constexpr (kFwdBlockMorePacks<T, PACK>) {
    if (k == 5) return launch_fwd_block_regs_k<T, P, PACK, 5, L>(a, threads, stream);
    if (k == 6) return launch_fwd_block_regs_k<T, P, PACK, 6, L>(a, threads, stream);
  }
  switch (k) {
    case 1: return launch_fwd_block_regs_k<T, P, PACK, 1, L>(a, threads, stream);
    case 2: return launch_fwd_block_regs_k<T, P, PACK, 2, L>(a, threads, stream);
    case 4: return launch_fwd_block_regs_k<T, P, PACK, 4, L>(a, threads, stream);
    default: return launch_fwd_block_regs_k<T, P, PACK, 8, L>(a, threads, stream);
  }
}

// Cluster tier of the backward (sm_90): a row of nvec packs split over cs blocks (a
// power of two up to 8) of `threads`, k packs a thread.
struct ClusterShape { int cs, threads, k; };

inline ClusterShape cluster_shape(int64_t nvec, int max_threads, int k) {
  // The fewest blocks of <= max_threads threads; threads trimmed to what the row needs.
  int cs = 1;
  while (cs < kMaxClusterBlocks && nvec > int64_t(cs) * max_threads * k) cs *= 2;
  return {cs, warp_threads(nvec, cs * k), k};
}

// Values of T in a 16-byte word: the widest pack a thread loads.
template <typename T>
constexpr int kVec = 16 / int(sizeof(T));

// launch(std::integral_constant<int, PACK>{}) with the pack a launch takes: kVec<T> where
// every row is whole 16-byte words and every row pointer (null ones aside) 16-byte aligned,
// the parameters aligned to a pack of theirs; else half that where the same holds for 8-byte
// words (16-bit rows of 4k columns, float32 of 2k: H100, bf16 LayerNorm, one value a load ->
// half words, 268 columns fwd 39.4 -> 21.4 us, bwd 52.4 -> 37.8; 4100 fwd 899 -> 337, bwd
// 1326 -> 750; docs/perf-notes.md, thirty-ninth session); else one value a load.
template <typename T, typename P, typename Launch>
cudaError_t with_row_pack(int64_t cols, std::initializer_list<const void*> row_ptrs,
                          std::initializer_list<const void*> param_ptrs, Launch&& launch) {
  const auto fits = [&](int pack) {
    bool ok = cols % pack == 0;
    for (const void* p : row_ptrs) ok = ok && aligned_to(p, sizeof(T) * pack);
    for (const void* p : param_ptrs) ok = ok && aligned_to(p, sizeof(P) * pack);
    return ok;
  };
  if (fits(kVec<T>)) return launch(std::integral_constant<int, kVec<T>>{});
  if (fits(kVec<T> / 2)) return launch(std::integral_constant<int, kVec<T> / 2>{});
  return launch(std::integral_constant<int, 1>{});
}

template <typename T, typename P, int PACK, typename L>
cudaError_t launch_fwd_packed(const FwdAddArgs& a, cudaStream_t stream) {
  // With a residual, rows over 4 KiB go to the block tier: the warp tier's 8 KiB rows
  // (x and residual loads in flight, 172 registers, 8 warps an SM) measured 70 % of
  // copy (knob JAX_OPS_NORM_FWD_ADD_REGS_MAX_BYTES, bytes of a row). float16 as well
  // since its sums stay two a register (add_packs_rounded): at 1536 / 2048 columns the
  // warp tier is 1.04-1.13x faster than the block tier on the H200.
  static const int add_regs_max_bytes = env_knob("JAX_OPS_NORM_FWD_ADD_REGS_MAX_BYTES", kFwdRegsMaxBytes / 2);
  int64_t regs_max_cols = std::is_base_of_v<LoadAdd<T>, L>
      ? std::min<int64_t>(fwd_regs_max_cols<T, PACK>(), add_regs_max_bytes / int64_t(sizeof(T)))
      : fwd_regs_max_cols<T, PACK>();
  if constexpr (PACK * sizeof(T) == 8) {
    // Half-word packs: the warp tier to fewer bytes than 16-byte packs where the block
    // tiers measured faster (H100, 49152 rows, fwd µs, warp -> block tier; docs/perf-notes.md,
    // fortieth session): float32 LayerNorm 514 83.2 -> 89.2, 1002 166.1 -> 152.3, 2002
    // 467.5 -> 282.2; float32 add_rms_norm 266 79.6 -> 80.2, 514 168.4 -> 146.8; bf16
    // LayerNorm 3076 240.1 -> 259.0; bf16 add_rms_norm 516 78.0 -> 80.6, 1004 151.3 -> 142.2.
    // Knob JAX_OPS_NORM_FWD_HALF_REGS_MAX_BYTES (bytes of a row; 0: these cuts).
    static const int knob = env_knob("JAX_OPS_NORM_FWD_HALF_REGS_MAX_BYTES", 0);
    constexpr bool kAdd = std::is_base_of_v<LoadAdd<T>, L>;
    constexpr int kCut = sizeof(T) == 4 ? (kAdd ? 1024 : 3072) : (kAdd ? 1536 : kFwdRegsMaxBytes);
    regs_max_cols = std::min<int64_t>(regs_max_cols, (knob > 0 ? knob : kCut) / int64_t(sizeof(T)));
  }
  if (a.cols <= regs_max_cols) return fwd_regs_dispatch<T, P, PACK, L>(a, stream);
  if (a.cols / PACK <= kFwdBlockRegsMaxVec) return launch_fwd_block_regs<T, P, PACK, L>(a, stream);
  return launch_fwd_block<T, P, PACK, L>(a, stream);
}

template <typename T, typename P, int PACK>
cudaError_t launch_fwd_load(const FwdAddArgs& a, cudaStream_t stream) {
  if (a.residual)
    return a.rms ? launch_fwd_packed<T, P, PACK, OfNorm<LoadAdd<T>, true>>(a, stream)
                 : launch_fwd_packed<T, P, PACK, OfNorm<LoadAdd<T>, false>>(a, stream);
  return a.rms ? launch_fwd_packed<T, P, PACK, OfNorm<LoadX<T>, true>>(a, stream)
               : launch_fwd_packed<T, P, PACK, OfNorm<LoadX<T>, false>>(a, stream);
}

template <typename T, typename P>
cudaError_t launch_fwd(const FwdAddArgs& a, cudaStream_t stream) {
  if (a.rows == 0) return cudaSuccess;
  return with_row_pack<T, P>(a.cols, {a.x, a.y, a.residual, a.h}, {a.scale, a.bias},
                            [&](auto pack) { return launch_fwd_load<T, P, decltype(pack)::value>(a, stream); });
}

// Backward: dscale/dbias partials go to the XLA-allocated workspace a.work
// ([arrays, work_rows, cols] float32: dscale's then dbias's, those wanted); grids
// are capped at work_rows blocks. Every
// launcher takes `plan`: when not null nothing runs and *plan gets the number of
// partial rows the call would write (0 without dscale/dbias), which sizes the
// workspace at lowering time (norm_bwd_partial_rows).

template <typename P>
cudaError_t finish_param_grads(const BwdArgs& a, const float* part_ds, const float* part_db,
                               int64_t nparts, cudaStream_t stream) {
  return launch_sum_partials<P>(part_ds, part_db, nparts, a.cols, static_cast<P*>(a.dscale),
                                static_cast<P*>(a.dbias), stream);
}

inline bool wants_param_grads(const BwdArgs& a) { return a.dscale || a.dbias; }

inline cudaError_t partial_buffers(const BwdArgs& a, int64_t nparts, float** ds, float** db) {
  *ds = *db = nullptr;
  if (!wants_param_grads(a)) return cudaSuccess;
  if (a.work == nullptr || nparts > a.work_rows) return cudaErrorInvalidValue;
  if (a.dscale) *ds = a.work;
  if (a.dbias) *db = a.work + (a.dscale ? a.work_rows * a.cols : 0);  // [arrays, P, cols]
  return cudaSuccess;
}

inline int64_t cap_blocks(const BwdArgs& a, int64_t blocks) {
  return wants_param_grads(a) && a.work_rows < blocks ? a.work_rows : blocks;
}

// The dry run's answer: partial rows written by a grid of `parts`.
inline cudaError_t plan_parts(const BwdArgs& a, int64_t parts, int64_t* plan) {
  *plan = wants_param_grads(a) ? parts : 0;
  return cudaSuccess;
}

// Partial rows, workspace, launch and the final sums of a block-regs grid of `parts`
// blocks or clusters; launch(ds, db) starts the kernel.
template <typename P, typename Launch>
cudaError_t run_bwd_grid(const BwdAddArgs& a, int64_t parts, cudaStream_t stream, int64_t* plan, Launch&& launch) {
  if (plan) return plan_parts(a, parts, plan);
  float *ds = nullptr, *db = nullptr;
  cudaError_t err;
  if ((err = partial_buffers(a, parts, &ds, &db)) != cudaSuccess) return err;
  if ((err = launch(ds, db)) != cudaSuccess) return err;
  return wants_param_grads(a) ? finish_param_grads<P>(a, ds, db, parts, stream) : cudaSuccess;
}

// Blocks a cluster merges its dscale/dbias partials over, in the tiers whose blocks take
// their own rows: the partial rows, and so the workspace, shrink by that factor (1 =
// none, at most kMaxClusterBlocks). Only when there are partials to merge.
// The bulk kernel (knob JAX_OPS_NORM_BWD_MERGE_BLOCKS), 2: the same speed (H100); 4 and
// 8 leave SMs of odd-sized GPCs short of a whole cluster (248 of 264 blocks resident at
// 4096 columns, 120 of 132 at 8192) and measured 3-10 % slower.
inline int bwd_merge_blocks(const BwdArgs& a) {
  static const int cs = env_knob("JAX_OPS_NORM_BWD_MERGE_BLOCKS", 2);
  return wants_param_grads(a) && cs >= 2 && cs <= kMaxClusterBlocks ? cs : 1;
}
// The group tier (knob JAX_OPS_NORM_BWD_GROUP_MERGE_BLOCKS), from
// JAX_OPS_NORM_BWD_GROUP_MERGE_MIN_COLS columns: 2 costs 1-2 µs a call (H100: 1024
// columns 117.5 -> 119.2 µs, 32 columns 10.0 -> 10.9). Since the column sums take every
// partial row in one round of loads, one partial row a block is 1.01-1.06x faster at
// 128-512 columns (bf16 LayerNorm 128 20.0 -> 18.9 µs; workspace +0.2-0.8 MiB at 49152
// rows); at 768+ columns, where it is 0-1.4 % and the partials are 1-3 MiB, pairs merge.
inline int bwd_group_merge_blocks(const BwdArgs& a) {
  static const int cs = env_knob("JAX_OPS_NORM_BWD_GROUP_MERGE_BLOCKS", 2);
  static const int min_cols = env_knob("JAX_OPS_NORM_BWD_GROUP_MERGE_MIN_COLS", 768);
  return wants_param_grads(a) && a.cols >= min_cols && cs >= 2 && cs <= kMaxClusterBlocks ? cs : 1;
}

// The workspace stays lean where rows are few: while a grid leaves more partial rows than
// rows * sizeof(T) / 512 (a float32 array of partials over 1/128 of x's bytes), its
// clusters double, up to JAX_OPS_NORM_BWD_MERGE_MAX_BLOCKS (4) blocks; only grids that
// already merge (bwd_merge_blocks, bwd_group_merge_blocks). H100 bf16, 2 -> 4 blocks:
// 8192 x 4096 backward LayerNorm 89.4 -> 87.8 µs, RMSNorm 84.6 -> 86.2, workspace 4.1 ->
// 1.9 MiB; 49152 x 768 / 1024 backward 1.6-3.3 % slower, step <= 1.1 %, 1.2 / 1.6 -> 0.5
// / 0.7 MiB; at 49152 x 4096, where it does not apply, 4 blocks were 4 % slower.
// query(cs, &parts) sizes the grid for clusters of cs; the choice is made before the
// work_rows cap (so that the dry run at lowering and the launch decide alike), which is
// applied to *parts at the end; *cs ends at the last that fit.
template <typename T, typename Query>
cudaError_t lean_merge_grid(const BwdArgs& a, int* cs, int64_t* parts, Query&& query) {
  static const int max_cs = std::min(env_knob("JAX_OPS_NORM_BWD_MERGE_MAX_BLOCKS", 4), kMaxClusterBlocks);
  const int64_t lean_rows = std::max<int64_t>(1, a.rows * int64_t(sizeof(T)) / 512);
  cudaError_t err = query(*cs, parts);
  while (err == cudaSuccess && *cs > 1 && *cs * 2 <= max_cs && *parts > lean_rows) {
    int64_t more = 0;
    if (query(*cs * 2, &more) != cudaSuccess) {
      cudaGetLastError();
      break;
    }
    *cs *= 2;
    *parts = more;
  }
  if (err == cudaSuccess) *parts = cap_blocks(a, *parts);
  return err;
}

// The group tier staged by bulk copies (bwd_rows_bulk_kernel): JAX_OPS_NORM_BWD_ROWS_BULK_STAGES
// chunks a block in flight (0 = off; 2: three blocks an SM, 1-2 % faster than 3),
// rows of at most JAX_OPS_NORM_BWD_ROWS_BULK_MAX_COLS values; plain norms only (add+norm's
// dh would be loaded in each row's chain: not measured). sm_90 code and device, 16-byte
// packs. False (nothing launched) where it does not apply.
template <typename T, typename P, int PACK, int VPT, int WIDTH, typename S>
bool launch_bwd_rows_bulk(const BwdAddArgs& a, cudaStream_t stream, int64_t* plan, cudaError_t* err) {
  static_assert(PACK * sizeof(T) == 16 && std::is_base_of_v<StoreDx<T>, S>, "plain norms, 16-byte packs");
  static const int stages = env_knob("JAX_OPS_NORM_BWD_ROWS_BULK_STAGES", 2);
  static const int max_cols = env_knob("JAX_OPS_NORM_BWD_ROWS_BULK_MAX_COLS", kRegsMaxCols);
  if (stages < 2 || stages > kBulkBarrierBytes / 8 || a.cols > max_cols) return false;
  auto kernel = bwd_rows_bulk_kernel<T, P, PACK, VPT, WIDTH, S>;
  if (!clusters_supported(kernel)) return false;
  constexpr int CHUNK = (kRegsThreads / WIDTH) * bwd_rows_bulk_rpg<VPT>();
  const size_t smem = kBulkBarrierBytes + size_t(stages) * 2 * CHUNK * size_t(a.cols) * sizeof(T);
  const int64_t chunks = (a.rows + CHUNK - 1) / CHUNK;
  int cs = bwd_group_merge_blocks(a);
  int64_t parts = 0;
  cudaError_t qerr = allow_smem(kernel, smem);
  if (qerr == cudaSuccess && cs > 1) {  // clusters of cs blocks, one partial row each
    qerr = lean_merge_grid<T>(a, &cs, &parts, [&](int c, int64_t* n) {
      return cluster_grid(kernel, c, kRegsThreads, (chunks + c - 1) / c, n, smem);
    });
  } else if (qerr == cudaSuccess) {
    int blocks = 0;
    qerr = resident_blocks(kernel, kRegsThreads, smem, chunks, &blocks);
    parts = cap_blocks(a, blocks);
  }
  if (qerr != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  *err = run_bwd_grid<P>(a, parts, stream, plan, [&](float* ds, float* db) {
    if (cs > 1)
      return launch_clusters_smem(kernel, cs, kRegsThreads, smem, parts, stream,
                                  static_cast<const typename S::Args&>(a), ds, db, stages);
    kernel<<<unsigned(parts), kRegsThreads, smem, stream>>>(a, ds, db, stages);
    return cudaGetLastError();
  });
  return true;
}

// The grid of a warp-tier backward kernel (rows_per_block rows a block of THREADS
// threads, a row a warp of each partial array in shared memory): resident blocks, or with
// partials on sm_90 clusters merging them; its partial rows, workspace and column sums.
template <typename T, typename P, typename S, int THREADS, typename Kernel>
cudaError_t launch_bwd_warps(Kernel kernel, int64_t rows_per_block, const BwdAddArgs& a, cudaStream_t stream,
                             int64_t* plan) {
  const bool partials = wants_param_grads(a);
  // a row a warp of each partial array (RMSNorm's one: dscale)
  const size_t smem = partials ? (S::kRms ? 1 : 2) * size_t(THREADS / 32) * size_t(a.cols) * sizeof(float) : 0;
  cudaError_t err;
  if ((err = allow_smem(kernel, smem)) != cudaSuccess) return err;
  const int64_t work_blocks = (a.rows + rows_per_block - 1) / rows_per_block;
  // With partials on sm_90: clusters of cs blocks, one partial row each.
  int cs = partials && clusters_supported(kernel) ? bwd_group_merge_blocks(a) : 1;
  if (cs > 1) {
    int64_t clusters = 0;
    if ((err = lean_merge_grid<T>(a, &cs, &clusters, [&](int c, int64_t* n) {
           return cluster_grid(kernel, c, THREADS, (work_blocks + c - 1) / c, n, smem);
         })) != cudaSuccess)
      return err;
    return run_bwd_grid<P>(a, clusters, stream, plan, [&](float* ds, float* db) {
      return launch_clusters_smem(kernel, cs, THREADS, smem, clusters, stream,
                                  static_cast<const typename S::Args&>(a), ds, db);
    });
  }
  int blocks = 0;
  if ((err = resident_blocks(kernel, THREADS, smem, work_blocks, &blocks)) != cudaSuccess) return err;
  const int64_t parts = cap_blocks(a, blocks);
  return run_bwd_grid<P>(a, parts, stream, plan, [&](float* ds, float* db) {
    kernel<<<unsigned(parts), THREADS, smem, stream>>>(a, ds, db);
    return cudaGetLastError();
  });
}

template <typename T, typename P, int PACK, int VPT, int WIDTH, typename S, bool PREFETCH,
          int ROWS = (WIDTH < 32 ? 2 : 1), int THREADS = kRegsThreads, bool HOIST = false>
cudaError_t launch_bwd_regs_as(const BwdAddArgs& a, cudaStream_t stream, int64_t* plan) {
  // float32 rows of two or more packs a lane (256+ columns) of the plain norms are staged
  // by bulk copies; at one pack a lane (<= 128) the register kernel measured 1-4 % faster.
  if constexpr (sizeof(T) == 4 && PACK * sizeof(T) == 16 && VPT >= 2 && std::is_base_of_v<StoreDx<T>, S>) {
    cudaError_t err = cudaSuccess;
    if (launch_bwd_rows_bulk<T, P, PACK, VPT, WIDTH, S>(a, stream, plan, &err)) return err;
  }
  // ROWS rows a group; without the next tile's prefetch (float32, or the knob off) two
  // below 32 lanes (H100, 16-bit, 32-256 columns: 1 and 2 within 0.5 µs of each other).
  constexpr int ROWS_PER_BLOCK = (THREADS / WIDTH) * ROWS;
  return launch_bwd_warps<T, P, S, THREADS>(bwd_regs_kernel<T, P, PACK, VPT, WIDTH, ROWS, S, PREFETCH, THREADS, HOIST>,
                                            ROWS_PER_BLOCK, a, stream, plan);
}

// Where a lane holds one 16-bit pack below 32 lanes a row (up to 128 columns), the
// kernel's 81-96 registers fit five 128-thread blocks an SM, as many warps as two blocks
// of 320 or one of 640: fewer partial rows. H100 bf16 backward, 128 / 320 / 640 threads:
// 128 columns the same at 320 (LayerNorm 18.5 / 18.6 / 19.3 µs, add_layer_norm 22.0 /
// 21.9 / 22.8) with 264 partial rows instead of 660 (RMSNorm (49152, 128): 0.3 MiB of
// temporaries against autodiff's 0.4, was 0.5); 32-64 columns 3-6 % slower at 320, 640
// slower everywhere (not built). So 320 at 16 lanes a row, else 128 (knob
// JAX_OPS_NORM_BWD_REGS_BLOCK_THREADS: 128 or 320 at every width).
template <int WIDTH>
int bwd_regs_block_threads() {
  static const int knob = env_knob("JAX_OPS_NORM_BWD_REGS_BLOCK_THREADS", 0);
  return knob == 128 || knob == 320 ? knob : (WIDTH == 16 ? 320 : 128);
}

// At one 16-bit pack a lane (up to 256 columns) the warp's next tile is loaded before the
// current one is reduced, one row a group. H100 bf16 backward: 256 columns 1.01-1.03x
// (LayerNorm 33.3 -> 32.4 µs); 32-128 columns, against two rows a group and no prefetch,
// 1.01-1.15x (RMSNorm 128 19.85 -> 18.4 µs, add_layer_norm 128 24.45 -> 22.25; 93
// instead of 117 registers there, five blocks an SM instead of four). The prefetch
// measured slower with two rows a group (up to 1.10x), with two packs a lane (384-512
// columns, 118 registers: 1.03-1.06x) and for float32 (0.97-1.00x).
// JAX_OPS_NORM_BWD_REGS_PREFETCH=0 turns it off (then two rows a group below 32 lanes).
// Since bfloat16 rows are held as words (72 registers at two packs a lane), LayerNorm's
// bf16 backward at two packs a lane (257-512 columns) loads its next tile ahead as well (95
// registers; H200: 384 40.7 -> 39.7 µs, 512 50.1 -> 48.9); RMSNorm's (72 registers either
// way) measured 1.01-1.03x slower with it, add+norm's (80 -> 96) 1.06-1.09x slower.
// 16-byte packs only (the measured rows). JAX_OPS_NORM_BWD_REGS_PREFETCH2=0 turns it off.
// At two or three 16-bit packs a lane the scale stays in registers across rows too, where
// that measured faster: it was reloaded (float32, strided) for each row and each of the
// row's two passes (ncu, LayerNorm 384 bf16: L1 70 % -> 33 % busy). H200 bf16, 49152
// rows, bwd µs, two runs each: LayerNorm 264 31.5 -> 29.65, 384 37.45 -> 34.6, 448 44.7 ->
// 39.6, 512 49.2 -> 42.4; RMSNorm 384 36.3 -> 33.25, 512 46.15 -> 41.65; add+norm 640-768
// and add_layer_norm 512 1.02-1.03x. Where the row fills under three quarters of the
// lane's slots the registers cost more than the loads save (RMSNorm 264 26.5 -> 28.1,
// add_rms_norm 264 33.25 -> 35.15), so there only LayerNorm's, whose registers leave its
// blocks an SM as they were (127 at 264-384). Knob JAX_OPS_NORM_BWD_HOIST_SCALE=0 turns it off.
// Since the tail rule (bwd_regs_dispatch) takes 16-bit rows of 257-384 columns, these two
// serve them only with JAX_OPS_NORM_BWD_TAIL=0, add_rms_norm's past 288 and, below the
// tail's DRAM bandwidth (tail_by_device), add_layer_norm's past 288.
template <typename T, int PACK, int VPT, int WIDTH, typename S>
bool bwd_hoist_scale(const BwdArgs& a) {
  static const bool on = env_knob("JAX_OPS_NORM_BWD_HOIST_SCALE", 1) != 0;
  constexpr bool kLayerNorm = !S::kRms && std::is_base_of_v<StoreDx<T>, S>;
  return on && (kLayerNorm || a.cols / PACK * 4 >= int64_t(VPT) * WIDTH * 3);
}

// One row a group, the scale in registers across rows at two or three 16-bit packs a lane
// where bwd_hoist_scale says so.
template <typename T, typename P, int PACK, int VPT, int WIDTH, typename S, bool PREFETCH>
cudaError_t launch_bwd_regs_row(const BwdAddArgs& a, cudaStream_t stream, int64_t* plan) {
  if constexpr ((VPT == 2 || VPT == 3) && PACK == 8 && sizeof(T) == 2)
    if (bwd_hoist_scale<T, PACK, VPT, WIDTH, S>(a))
      return launch_bwd_regs_as<T, P, PACK, VPT, WIDTH, S, PREFETCH, 1, kRegsThreads, true>(a, stream, plan);
  return launch_bwd_regs_as<T, P, PACK, VPT, WIDTH, S, PREFETCH, 1>(a, stream, plan);
}

template <typename T, typename P, int PACK, int VPT, int WIDTH, typename S>
cudaError_t launch_bwd_regs_pow2(const BwdAddArgs& a, cudaStream_t stream, int64_t* plan) {
  if constexpr (VPT == 1 && sizeof(T) == 2) {
    static const int prefetch = env_knob("JAX_OPS_NORM_BWD_REGS_PREFETCH", 1);
    if constexpr (WIDTH < 32)
      if (prefetch && bwd_regs_block_threads<WIDTH>() == 320)
        return launch_bwd_regs_as<T, P, PACK, VPT, WIDTH, S, true, 1, 320>(a, stream, plan);
    if (prefetch) return launch_bwd_regs_as<T, P, PACK, VPT, WIDTH, S, true, 1>(a, stream, plan);
  }
  if constexpr (VPT == 2 && PACK == 8 && std::is_same_v<T, bf16_t> && !S::kRms && std::is_base_of_v<StoreDx<T>, S>) {
    static const int prefetch2 = env_knob("JAX_OPS_NORM_BWD_REGS_PREFETCH2", 1);
    if (prefetch2) return launch_bwd_regs_row<T, P, PACK, VPT, WIDTH, S, true>(a, stream, plan);
  }
  if constexpr (VPT >= 2)  // 32 lanes a row: one row a group
    return launch_bwd_regs_row<T, P, PACK, VPT, WIDTH, S, false>(a, stream, plan);
  else
    return launch_bwd_regs_as<T, P, PACK, VPT, WIDTH, S, false>(a, stream, plan);
}

template <typename T, typename P, int PACK, int VPT, int WIDTH, typename S>
cudaError_t launch_bwd_regs(const BwdAddArgs& a, cudaStream_t stream, int64_t* plan) {
  // three packs a lane on 16 lanes: one row a group (two: 1.00-1.08x slower, 135 registers)
  if constexpr (VPT == 3 && WIDTH < 32) {
    return launch_bwd_regs_row<T, P, PACK, VPT, WIDTH, S, false>(a, stream, plan);
  } else {
    return launch_bwd_regs_pow2<T, P, PACK, VPT, WIDTH, S>(a, stream, plan);
  }
}

// Rows a warp of the tail backward: two, their shuffle chains interleaved, against one
// (both with the next rows ahead; 127 registers against 72): H200, 49152 rows, bwd µs,
// bf16, two runs each (docs/perf-notes.md, thirty-fourth session): LayerNorm 264 28.9 ->
// 24.7, 288 30.2 -> 26.1, 336 31.3 -> 29.25, 384 33.4 -> 32.75; RMSNorm 264 26.05 ->
// 23.5, 320 28.85 -> 27.55, 384 32.85 -> 31.65 (f16 alike); add_layer_norm 264 35.2 ->
// 34.05, 336 44.1 -> 42.25, but 384 45.85 -> 46.45, so there one; add_rms_norm 264 the same,
// 288 34.65 -> 35.65, so one. Knob JAX_OPS_NORM_BWD_TAIL_ROWS = 1 or 2 forces it.
template <typename T, typename S>
int bwd_tail_rows(int64_t cols) {
  static const int knob = env_knob("JAX_OPS_NORM_BWD_TAIL_ROWS", 0);
  if (knob == 1 || knob == 2) return knob;
  if (!std::is_base_of_v<StoreDxAddDh<T>, S>) return 2;
  return !S::kRms && cols <= 352 ? 2 : 1;
}

template <typename T, typename P, int E, typename S>
cudaError_t launch_bwd_tail(const BwdAddArgs& a, cudaStream_t stream, int64_t* plan) {
  if (bwd_tail_rows<T, S>(a.cols) == 2)
    return launch_bwd_warps<T, P, S, kRegsThreads>(bwd_tail_kernel<T, P, E, 2, S>, 2 * (kRegsThreads / 32), a, stream,
                                                   plan);
  return launch_bwd_warps<T, P, S, kRegsThreads>(bwd_tail_kernel<T, P, E, 1, S>, kRegsThreads / 32, a, stream, plan);
}

// The backward's row shapes with no idle slot (dispatch_group_shape_thirds), where they
// measured faster (H200 bf16, 49152 rows, µs against the power-of-two shapes; two runs
// each, docs/perf-notes.md): the plain norms on 16 lanes, one row a group (LayerNorm 320
// 36.4 -> 34.1, 384 39.7 -> 37.45; RMSNorm 1.02-1.03x; two rows a group slower; not
// add+norm: add_layer_norm 1.00-1.02x, add_rms_norm 1.02-1.03x slower); add+norm on 32 lanes
// (add_layer_norm 640 80.75 -> 74.65, 768 92.35 -> 86.8; add_rms_norm 1.01-1.06x;
// LayerNorm the same, RMSNorm 640 1.04x slower). Knob JAX_OPS_NORM_BWD_REGS_THIRDS=0
// turns them off. At 257-384 16-bit columns the tail rule below comes first (the plain
// norms' 16-lane shapes there serve JAX_OPS_NORM_BWD_TAIL=0).
template <typename T, typename P, int PACK, typename S>
cudaError_t bwd_regs_dispatch(const BwdAddArgs& a, cudaStream_t stream, int64_t* plan) {
  static const bool thirds = env_knob("JAX_OPS_NORM_BWD_REGS_THIRDS", 1) != 0;
  constexpr bool kAdd = std::is_base_of_v<StoreDxAddDh<T>, S>;
  // 16-bit rows of 257-384 columns: the last cols - 256 spread over the lanes
  // (bwd_tail_kernel), where that measured faster than two packs a lane on 32 lanes (or
  // three on 16). H200, 49152 rows, bwd µs, bf16, tail against not, two runs each
  // (docs/perf-notes.md, thirty-third session, one row a warp): at 1 a lane (264-288) every
  // op (add_layer_norm 264 39.45 -> 35.35, add_rms_norm 264 33.35 -> 32.1, RMSNorm 288
  // 29.0 -> 27.1); at 2 or 4 add_rms_norm 1.01x slower (320 37.25 -> 37.7, 384 43.15 ->
  // 43.6), so not it; add_layer_norm 320 43.05 -> 40.55; RMSNorm 336 f16 31.1 -> 31.4 (bf16
  // 31.1 -> 30.8). Rows a warp (bwd_tail_rows): LayerNorm at 2 a lane (296-320), 1.02x slower
  // at one row a warp (320 31.45 -> 32.05), is taken at two (thirty-fourth session: 320
  // 31.8 -> 27.9, 296 31.05 -> 26.55). On the H100 add_layer_norm's tail at 2 or 4 a lane
  // measured the same or slower (320 51.6 -> 54.4, 352 55.6 -> 57.9; thirty-fifth session),
  // so there it takes it only where tail_by_device. So does bfloat16 add_rms_norm at 1 a
  // lane past 280 columns: on the H100 288 took 45.8-46.0 µs against 45.1-45.4 without
  // (six passes), 264-280 the same, float16 264-280 0.7-1.0 µs faster with it (thirty-
  // seventh and thirty-eighth sessions). Knob JAX_OPS_NORM_BWD_TAIL.
  if constexpr (sizeof(T) == 2 && PACK == 8) {
    static const int tail = env_knob("JAX_OPS_NORM_BWD_TAIL", 1);
    const int e = tail != 0 ? tail_values_per_lane(a.cols) : 0;
    const bool one_by_device = kAdd && S::kRms && std::is_same_v<T, bf16_t> && a.cols > 280;
    if ((e == 1 && !one_by_device) || (e != 0 && !kAdd) ||
        (e != 0 && tail_by_device(tail) && (e == 1 || !S::kRms)))
      return with_tail_values(
          e, [&](auto ev) { return launch_bwd_tail<T, P, decltype(ev)::value, S>(a, stream, plan); });
  }
  return dispatch_group_shape_thirds<PACK, kRegsMaxCols, kThirdsTypes<T, PACK> && !kAdd, kThirdsTypes<T, PACK> && kAdd>(
      a.cols / PACK, thirds, [&](auto vpt, auto width) {
        return launch_bwd_regs<T, P, PACK, decltype(vpt)::value, decltype(width)::value, S>(a, stream, plan);
      });
}

// The block tier's rows staged by bulk copies: JAX_OPS_NORM_BWD_BULK_STAGES rows a block
// (0 turns it off), from JAX_OPS_NORM_BWD_BULK_MIN_COLS columns (default kBwdBulkMinCols).
inline int bwd_bulk_stages() {
  static const int stages = env_knob("JAX_OPS_NORM_BWD_BULK_STAGES", 3);
  return stages >= 2 && stages <= kBulkBarrierBytes / 8 ? stages : 0;
}

// The bulk kernel's grid when it applies (sm_90 code and device, its shared memory
// granted): *parts blocks of `threads` (<= kBwdBulkMaxThreads, or 1024 if WIDE), or
// *parts clusters of *cs blocks (bwd_merge_blocks).
template <typename T, typename P, int PACK, int K, typename S, bool WIDE, int WIDE_BLOCKS>
bool bwd_bulk_grid(const BwdAddArgs& a, int threads, int64_t* parts, size_t* smem, int* cs) {
  const int stages = bwd_bulk_stages();
  auto kernel = bwd_bulk_kernel<T, P, PACK, K, S, WIDE, WIDE_BLOCKS>;
  if (stages == 0 || !clusters_supported(kernel)) return false;
  *smem = kBulkBarrierBytes + size_t(stages) * 2 * K * size_t(threads) * sizeof(Pack<T, PACK>);
  *cs = bwd_merge_blocks(a);
  cudaError_t err = allow_smem(kernel, *smem);
  if (err == cudaSuccess && *cs > 1) {  // clusters of cs blocks, one partial row each (at most work_rows)
    err = lean_merge_grid<T>(a, cs, parts, [&](int c, int64_t* n) {
      return cluster_grid(kernel, c, threads, (a.rows + c - 1) / c, n, *smem);
    });
  } else if (err == cudaSuccess) {
    int blocks = 0;
    err = resident_blocks(kernel, threads, *smem, a.rows, &blocks);
    *parts = cap_blocks(a, blocks);
  }
  if (err != cudaSuccess) cudaGetLastError();
  return err == cudaSuccess;
}

// The block tier with its rows staged by bulk copies: K packs a thread so that a block
// has at most kBwdBulkMaxThreads, or one pack a thread on up to 1024 (WIDE). False
// (nothing launched) where it does not apply.
template <typename T, typename P, int PACK, typename S, int K, bool WIDE, int WIDE_BLOCKS = 1>
bool launch_bwd_bulk_k(const BwdAddArgs& a, int threads, cudaStream_t stream, int64_t* plan, cudaError_t* err) {
  int64_t parts = 0;
  size_t smem = 0;
  int cs = 1;
  if (!bwd_bulk_grid<T, P, PACK, K, S, WIDE, WIDE_BLOCKS>(a, threads, &parts, &smem, &cs)) return false;
  auto kernel = bwd_bulk_kernel<T, P, PACK, K, S, WIDE, WIDE_BLOCKS>;
  *err = run_bwd_grid<P>(a, parts, stream, plan, [&](float* ds, float* db) {
    if (cs > 1)
      return launch_clusters_smem(kernel, cs, threads, smem, parts, stream, static_cast<const typename S::Args&>(a),
                                  ds, db, bwd_bulk_stages());
    kernel<<<unsigned(parts), threads, smem, stream>>>(a, ds, db, bwd_bulk_stages());
    return cudaGetLastError();
  });
  return true;
}

// add+norm's rows of 513-1023 packs take the wide block: 1.06-1.13x faster at 4352-6144
// bf16 columns, 1.02-1.03x slower at 8192 (H100). The plain norms' backward measured
// -4 % to +3 % there, so keeps two packs a thread (docs/perf-notes.md). Knob
// JAX_OPS_NORM_BWD_BULK_WIDE: 0 = never, 2 = every op.
// Rows of 513-576 packs (4104-4608 16-bit columns) take it two blocks an SM, every op:
// the plain norms' backward 1.06-1.22x faster than two packs a thread (9 warps, the SM's
// only block; LayerNorm 4352 571 -> 487 µs, 80 -> 94 % of 3X), add+norm's 1.00-1.07x
// faster than one wide block (H100 bf16, 49152 rows). Knob JAX_OPS_NORM_BWD_BULK_PAIR: 0 = never.
template <typename T, typename P, int PACK, typename S, int K = 1>
bool launch_bwd_block_bulk(const BwdAddArgs& a, cudaStream_t stream, int64_t* plan, cudaError_t* err) {
  static const int knob = env_knob("JAX_OPS_NORM_BWD_BULK_WIDE", 1);
  static const bool pair = env_knob("JAX_OPS_NORM_BWD_BULK_PAIR", 1) != 0;
  const bool wide = knob == 2 || (knob == 1 && std::is_base_of_v<StoreDxAddDh<T>, S>);
  const int64_t nvec = a.cols / PACK;
  if (K == 1 && pair && nvec > kBwdBulkMaxThreads && nvec <= kBwdBulkPairThreads)
    return launch_bwd_bulk_k<T, P, PACK, S, 1, true, 2>(a, warp_threads(nvec, 1), stream, plan, err);
  if (K == 1 && wide && nvec > kBwdBulkMaxThreads && nvec < 1024)
    return launch_bwd_bulk_k<T, P, PACK, S, 1, true>(a, warp_threads(nvec, 1), stream, plan, err);
  if (nvec > int64_t(kBwdBulkMaxThreads) * K) {
    if constexpr (K * 2 * PACK <= 16) return launch_bwd_block_bulk<T, P, PACK, S, K * 2>(a, stream, plan, err);
    else return false;
  }
  return launch_bwd_bulk_k<T, P, PACK, S, K, false>(a, warp_threads(nvec, K), stream, plan, err);
}

template <typename T, typename P, int PACK, typename S, int K = 1>
cudaError_t launch_bwd_block_regs(const BwdAddArgs& a, cudaStream_t stream, int64_t* plan) {
  const int64_t nvec = a.cols / PACK;
  if (nvec > int64_t(1024) * K) {
    if constexpr (K * 2 * PACK <= 8) return launch_bwd_block_regs<T, P, PACK, S, K * 2>(a, stream, plan);
    else return cudaErrorInvalidValue;
  } else {
    // 16-bit rows: 1.02-1.33x faster than the register kernel at 1536-3584 columns
    // (H200, the four ops, bf16 and f16; docs/perf-notes.md), H100 8192 1.10x, 4096
    // 1.02-1.04x (an older bulk kernel ran 2-3 % slower there at 2048); not float32 rows
    // (slower at 4096).
    if constexpr (sizeof(T) == 2 && PACK == 8) {
      static const int bulk_min_cols = env_knob("JAX_OPS_NORM_BWD_BULK_MIN_COLS", kBwdBulkMinCols);
      cudaError_t err = cudaSuccess;
      if (bulk_min_cols > 0 && a.cols >= bulk_min_cols && launch_bwd_block_bulk<T, P, PACK, S>(a, stream, plan, &err))
        return err;
    }
    const int threads = warp_threads(nvec, K);
    auto kernel = bwd_block_regs_kernel<T, P, PACK, K, S>;
    cudaError_t err;
    int blocks = 0;
    if ((err = resident_blocks(kernel, threads, 0, a.rows, &blocks)) != cudaSuccess) return err;
    return run_bwd_grid<P>(a, cap_blocks(a, blocks), stream, plan, [&](float* ds, float* db) {
      kernel<<<unsigned(cap_blocks(a, blocks)), threads, 0, stream>>>(a, ds, db);
      return cudaGetLastError();
    });
  }
}

// Cluster tier of the backward (sm_90): block_regs' kernel with the row split over
// a cluster, up to 8 elements a thread (x, dy, partials in registers).
template <typename T, typename P, int PACK, typename S, int K>
cudaError_t launch_bwd_cluster_k(const BwdAddArgs& a, const ClusterShape& shape, cudaStream_t stream,
                                 int64_t* plan) {
  auto kernel = bwd_block_regs_kernel<T, P, PACK, K, S, true>;
  // Partial rows: one per cluster, so at most work_rows clusters.
  int64_t clusters = 0;
  cudaError_t err = cluster_grid(kernel, shape.cs, shape.threads, cap_blocks(a, a.rows), &clusters);
  if (err != cudaSuccess) return err;
  return run_bwd_grid<P>(a, clusters, stream, plan, [&](float* ds, float* db) {
    return launch_clusters(kernel, shape.cs, shape.threads, clusters, stream,
                           static_cast<const typename S::Args&>(a), ds, db);
  });
}

template <typename T, typename P, int PACK, typename S>
bool bwd_cluster_shape(const BwdAddArgs& a, ClusterShape* shape) {
  static const int min_cols = env_knob("JAX_OPS_NORM_BWD_CLUSTER_MIN_COLS", kBlockRegsMaxCols + 1);
  static const int threads = env_knob("JAX_OPS_NORM_BWD_CLUSTER_THREADS", 512);
  constexpr int K = PACK >= 8 ? 1 : 8 / PACK;  // 8 elements a thread
  if (min_cols <= 0 || a.cols < min_cols) return false;
  if (!clusters_supported(bwd_block_regs_kernel<T, P, PACK, K, S, true>)) return false;
  const int64_t nvec = a.cols / PACK;
  // Blocks of `threads` first; when 8 of them are too few, blocks of up to 1024.
  for (const int t : {threads < 32 ? 32 : (threads > 1024 ? 1024 : threads), 1024}) {
    *shape = cluster_shape(nvec, t, K);
    if (shape->threads <= t && int64_t(shape->cs) * shape->threads * K >= nvec) return true;
  }
  return false;
}

template <typename T, typename P, int PACK, typename S>
cudaError_t launch_bwd_block(const BwdAddArgs& a, cudaStream_t stream, int64_t* plan) {
  const int64_t nvec = a.cols / PACK;
  const int threads = block_threads(nvec);
  const size_t smem = 2 * size_t(a.cols) * sizeof(T);
  cudaError_t err;
  int blocks = 0;
  const bool cached = cached_grid(bwd_block_kernel<T, P, PACK, true, S>, threads, smem, a.rows, &blocks);
  if (!cached && (err = resident_blocks(bwd_block_kernel<T, P, PACK, false, S>, threads, 0, a.rows, &blocks)) != cudaSuccess)
    return err;
  // Enough row chunks to fill the machine a few times over with 32-column tiles.
  const int64_t col_tiles = (a.cols + 31) / 32;
  int64_t chunks = (int64_t(sm_count()) * 16 + col_tiles - 1) / col_tiles;
  chunks = chunks < 1 ? 1 : (chunks > a.rows ? a.rows : chunks);
  chunks = cap_blocks(a, chunks);
  const int64_t chunk_rows = (a.rows + chunks - 1) / chunks;
  chunks = (a.rows + chunk_rows - 1) / chunk_rows;
  if (plan) return plan_parts(a, chunks, plan);
  if (cached) bwd_block_kernel<T, P, PACK, true, S><<<blocks, threads, smem, stream>>>(a);
  else bwd_block_kernel<T, P, PACK, false, S><<<blocks, threads, 0, stream>>>(a);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  if (!wants_param_grads(a)) return cudaSuccess;
  float *ds = nullptr, *db = nullptr;
  if ((err = partial_buffers(a, chunks, &ds, &db)) != cudaSuccess) return err;
  param_grad_kernel<T><<<dim3(unsigned(col_tiles), unsigned(chunks)), 256, 0, stream>>>(a, chunk_rows, ds, db);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  return finish_param_grads<P>(a, ds, db, chunks, stream);
}

// Rows of the cluster kernel's workspace: a partial row a cluster, unless those exceed
// both kBwdFoldBytes and 1/128 of x's bytes (LayerNorm at 4096 x 65536: 15 clusters'
// rows of two arrays took 7.5 MiB, autodiff 4.05) and each cluster has kBwdFoldMinRows
// rows or more; then as many rows as fit that, and the clusters fold onto them
// (bwd_cluster_smem_kernel), their flags in the parameter gradient's memory. H200 bf16
// LayerNorm backward, unfolded -> folded: 4096 x 65536 (273 rows a cluster) 602.9 ->
// 602.7 µs, 8192 x 32768 540 -> 537, 16384 x 16384 521 -> 514; but 512 x 65536 (34 rows
// a cluster, the last links wait at the end) 93 -> 100, and 49152 x 32768 3061 -> 3098
// (where x / 128 keeps it unfolded). Knob JAX_OPS_NORM_BWD_CLUSTER_FOLD=0: never.
constexpr int64_t kBwdFoldBytes = int64_t(4) << 20;
constexpr int64_t kBwdFoldMinRows = 128;
template <typename P>
bool fold_fits(const BwdArgs& a, int64_t clusters, int cs) {
  return clusters * cs * int64_t(sizeof(int)) <= a.cols * int64_t(sizeof(P));
}
template <typename T, typename P>
int64_t bwd_cluster_fold_rows(const BwdArgs& a, int64_t clusters, int cs) {
  static const int on = env_knob("JAX_OPS_NORM_BWD_CLUSTER_FOLD", 1);
  const int64_t row_bytes = ((a.dscale ? 1 : 0) + (a.dbias ? 1 : 0)) * a.cols * int64_t(sizeof(float));
  const int64_t budget = std::max(kBwdFoldBytes, a.rows * a.cols / 128 * int64_t(sizeof(T)));
  const int64_t rows = row_bytes ? budget / row_bytes : clusters;
  return on && rows >= 2 && rows < clusters && a.rows >= kBwdFoldMinRows * clusters && fold_fits<P>(a, clusters, cs)
             ? rows
             : clusters;
}

// The cluster tier's 16-bit rows with partials in shared memory (bwd_cluster_smem_kernel;
// knob JAX_OPS_NORM_BWD_CLUSTER_SMEM, 0 = the register kernel) where clusters of up to
// 8 blocks of JAX_OPS_NORM_BWD_CLUSTER_SMEM_THREADS (1024) threads, one pack a thread,
// hold the row: up to 65536 columns. (Blocks of 1024 against 512 threads, H100, bf16
// backward: 1.04x at 16384 columns, even at 32768, 1.17x at 65536, where 512 did not
// reach.) Its partial rows are one per cluster, as many as the register kernel's.
// Longer rows keep the register kernel. False where it does not apply.
template <typename T, typename P, int PACK, typename S>
bool launch_bwd_cluster_smem(const BwdAddArgs& a, cudaStream_t stream, int64_t* plan, cudaError_t* err) {
  constexpr int K = 2;
  static const int on = env_knob("JAX_OPS_NORM_BWD_CLUSTER_SMEM", 1);
  static const int knob_threads = env_knob("JAX_OPS_NORM_BWD_CLUSTER_SMEM_THREADS", 1024);
  static const int vec = env_knob("JAX_OPS_NORM_BWD_CLUSTER_SMEM_VEC", 1);
  const int max_threads = knob_threads < 32 ? 32 : (knob_threads > 1024 ? 1024 : knob_threads);
  auto kernel = vec ? bwd_cluster_smem_kernel<T, P, PACK, K, S, true>  // 16-byte shared accesses (default)
                    : bwd_cluster_smem_kernel<T, P, PACK, K, S, false>;
  const int stride = vec ? bwd_cluster_smem_stride<PACK, true>() : bwd_cluster_smem_stride<PACK, false>();
  if (!on || !clusters_supported(kernel)) return false;
  const int64_t nvec = a.cols / PACK;
  // Each cluster works on two rows at a time, so the rows in flight are the resident
  // clusters; any size of 2-8 blocks is legal. The power-of-two sizes (cluster_shape)
  // left one block of 576-768 threads an SM at 9216-12288 and 20480-24576 bf16 columns.
  // Rule (knob JAX_OPS_NORM_BWD_CLUSTER_SMEM_CS = 0): of the sizes within kNearClusters
  // of the most resident clusters, the one with the smallest blocks (measured faster
  // than the most clusters in larger blocks, e.g. 8 x 320 against 5 x 512 threads at
  // 20480). H100 bf16 backward against the power of two: 1.03-1.19x at 9216-32768
  // columns, the same at 16384 (docs/perf-notes.md, twenty-third session).
  // -1 = cluster_shape's power of two; 2-8 = that size where it fits.
  static const int knob_cs = env_knob("JAX_OPS_NORM_BWD_CLUSTER_SMEM_CS", 0);
  constexpr double kNearClusters = 0.92;
  const auto smem_of = [&](const ClusterShape& s) { return size_t(stride) * size_t(s.threads) * sizeof(float); };
  const auto fit = [&](int cs, ClusterShape* shape, int64_t* clusters) {
    *shape = cs > 0 ? ClusterShape{cs, warp_threads(nvec, cs), 1} : cluster_shape(nvec, max_threads, 1);
    if (shape->threads > max_threads || int64_t(shape->cs) * shape->threads < nvec) return false;
    if (allow_smem(kernel, smem_of(*shape)) != cudaSuccess ||
        cluster_grid(kernel, shape->cs, shape->threads, int64_t(1) << 40, clusters, smem_of(*shape)) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return true;
  };
  ClusterShape shape{};
  int64_t clusters = 0;
  if (knob_cs < 0 || (knob_cs >= 2 && knob_cs <= kMaxClusterBlocks)) {
    if (!fit(knob_cs, &shape, &clusters)) return false;
  } else {
    ClusterShape fits[kMaxClusterBlocks + 1];
    int64_t resident[kMaxClusterBlocks + 1] = {}, most = 0;
    for (int cs = 2; cs <= kMaxClusterBlocks; ++cs)
      if (fit(cs, &fits[cs], &resident[cs])) most = std::max(most, resident[cs]);
    if (most == 0) return false;
    for (int cs = 2; cs <= kMaxClusterBlocks; ++cs)
      if (resident[cs] >= kNearClusters * double(most) && (clusters == 0 || fits[cs].threads < shape.threads))
        shape = fits[cs], clusters = resident[cs];
  }
  const size_t smem = smem_of(shape);
  const auto fold_kernel = bwd_cluster_smem_kernel<T, P, PACK, K, S, true, true>;
  const auto launch = [&](float* ds, float* db, int* flags, int64_t fold) {
    return launch_clusters_smem(flags ? fold_kernel : kernel, shape.cs, shape.threads, smem, clusters, stream,
                                static_cast<const typename S::Args&>(a), ds, db, flags, fold);
  };
  if (!wants_param_grads(a)) {
    clusters = std::min(clusters, a.rows);
    *err = plan ? plan_parts(a, 0, plan) : launch(nullptr, nullptr, nullptr, 0);
    return true;
  }
  // The fold's kernel where it keeps the other's resident clusters (the 16-byte layout only).
  int64_t fold_clusters = 0;
  const bool can_fold = vec && allow_smem(fold_kernel, smem) == cudaSuccess &&
                        cluster_grid(fold_kernel, shape.cs, shape.threads, int64_t(1) << 40, &fold_clusters, smem) ==
                            cudaSuccess && fold_clusters >= clusters;
  if (!can_fold) cudaGetLastError();
  clusters = std::min(clusters, a.rows);
  if (plan) {
    *err = plan_parts(a, can_fold ? bwd_cluster_fold_rows<T, P>(a, clusters, shape.cs) : clusters, plan);
    return true;
  }
  // The workspace has the rows the dry run planned: a row a cluster, or fewer when folded.
  // The flags of a fold are in dscale's (or dbias's) memory until the column sums
  // overwrite it: cols * sizeof(P) bytes, more than the clusters' blocks need.
  float *ds = nullptr, *db = nullptr;
  int* flags = nullptr;
  const int64_t parts = std::min(clusters, a.work_rows);
  if ((*err = partial_buffers(a, parts, &ds, &db)) != cudaSuccess) return true;
  if (can_fold && parts < clusters && parts >= 2 && fold_fits<P>(a, clusters, shape.cs)) {
    flags = static_cast<int*>(a.dscale ? a.dscale : a.dbias);
    *err = cudaMemsetAsync(flags, 0, size_t(clusters * shape.cs) * sizeof(int), stream);
  } else {
    clusters = parts;  // a workspace smaller than planned: fewer clusters
  }
  if (*err == cudaSuccess) *err = launch(ds, db, flags, flags ? parts : 0);
  if (*err == cudaSuccess) *err = finish_param_grads<P>(a, ds, db, parts, stream);
  return true;
}

template <typename T, typename P, int PACK, typename S>
cudaError_t launch_bwd_packed(const BwdAddArgs& a, cudaStream_t stream, int64_t* plan) {
  ClusterShape shape;
  if (a.cols > kRegsMaxCols && bwd_cluster_shape<T, P, PACK, S>(a, &shape)) {
    if constexpr (sizeof(T) == 2 && PACK == 8) {
      cudaError_t err = cudaSuccess;
      if (launch_bwd_cluster_smem<T, P, PACK, S>(a, stream, plan, &err)) return err;
    }
    constexpr int K = PACK >= 8 ? 1 : 8 / PACK;
    return launch_bwd_cluster_k<T, P, PACK, S, K>(a, shape, stream, plan);
  }
  int64_t regs_max_cols = kRegsMaxCols;
  if constexpr (PACK * sizeof(T) == 8) {
    // Half-word packs of float32 past 256 columns: the block tier (H100, 49152 rows, bwd µs,
    // warp -> block tier: LayerNorm 266 59.7 -> 60.8, 514 121.4 -> 107.0, 1002 227.5 ->
    // 206.6; add_rms_norm 266 88.5 -> 74.6, 1002 404.6 -> 261.2); 16-bit rows keep the warp
    // tier (bf16 LayerNorm 1004 124.4 -> 150.7, add_rms_norm 164.6 -> 169.5; fortieth
    // session). Knob JAX_OPS_NORM_BWD_HALF_REGS_MAX_COLS (0: these cuts).
    static const int knob = env_knob("JAX_OPS_NORM_BWD_HALF_REGS_MAX_COLS", 0);
    constexpr int kCut = sizeof(T) == 4 ? 256 : kRegsMaxCols;
    regs_max_cols = std::min<int64_t>(regs_max_cols, knob > 0 ? knob : kCut);
  }
  if (a.cols <= regs_max_cols) return bwd_regs_dispatch<T, P, PACK, S>(a, stream, plan);
  if (a.cols <= kBlockRegsMaxCols) {
    if constexpr (PACK * sizeof(T) == 8) {
      // Half-word packs' block tier two packs a thread from the start (a thread's 16 bytes
      // of a row, as at 16-byte packs) for 16-bit rows: H100 bf16, 49152 rows, bwd µs, one
      // -> two packs a thread: LayerNorm 1028 183.0 -> 149.4, 2052 513.6 -> 288.4, 3076
      // 596.4 -> 439.0; add_rms_norm 2052 348.6 -> 333.8, 3076 622.9 -> 498.6; 4100 and 6148
      // the same (docs/perf-notes.md, forty-first session). float32 rows (0.91-1.04x a copy
      // at one pack) not measured at two. Knob JAX_OPS_NORM_BWD_HALF_BLOCK_K (1 or 2).
      static const int half_k = env_knob("JAX_OPS_NORM_BWD_HALF_BLOCK_K", sizeof(T) == 2 ? 2 : 1);
      if (half_k == 2) return launch_bwd_block_regs<T, P, PACK, S, 2>(a, stream, plan);
    }
    return launch_bwd_block_regs<T, P, PACK, S>(a, stream, plan);
  }
  return launch_bwd_block<T, P, PACK, S>(a, stream, plan);
}

template <typename T, typename P, int PACK>
cudaError_t launch_bwd_store(const BwdAddArgs& a, cudaStream_t stream, int64_t* plan) {
  if (a.dh)
    return a.rms ? launch_bwd_packed<T, P, PACK, OfNorm<StoreDxAddDh<T>, true>>(a, stream, plan)
                 : launch_bwd_packed<T, P, PACK, OfNorm<StoreDxAddDh<T>, false>>(a, stream, plan);
  return a.rms ? launch_bwd_packed<T, P, PACK, OfNorm<StoreDx<T>, true>>(a, stream, plan)
               : launch_bwd_packed<T, P, PACK, OfNorm<StoreDx<T>, false>>(a, stream, plan);
}

template <typename T, typename P>
cudaError_t launch_bwd(const BwdAddArgs& a, cudaStream_t stream, int64_t* plan = nullptr) {
  if (a.rows == 0) {
    if (plan) return plan_parts(a, 0, plan);
    // No rows: dscale/dbias are sums over nothing.
    cudaError_t err = cudaSuccess;
    if (a.dscale) err = cudaMemsetAsync(a.dscale, 0, size_t(a.cols) * sizeof(P), stream);
    if (err == cudaSuccess && a.dbias) err = cudaMemsetAsync(a.dbias, 0, size_t(a.cols) * sizeof(P), stream);
    return err;
  }
  return with_row_pack<T, P>(a.cols, {a.x, a.dy, a.dx, a.dh}, {a.scale},
                            [&](auto pack) { return launch_bwd_store<T, P, decltype(pack)::value>(a, stream, plan); });
}

}  // namespace jax_ops::norm

// =====================================================================================
// NEW SECTION: hidden-sharded stages (issue 23). Kernels of the per-device stages that
// run when the normalized axis is split over devices (cuda_src/norm_math.h: PartArgs,
// ApplyArgs, BwdPartArgs, BwdApplyArgs): policies for the row-partial and column-tiled
// skeletons of cuda_utils.cuh, and their launchers. Nothing above this line is changed
// or depended on except load_param, NormAcc and sum_partials_kernel.
//   partials     : a group of lanes (or a block, for few long rows) per row streams the
//                  local columns: Welford per pack (LayerNorm) or Σx² (RMSNorm), merged
//                  across lanes in a fixed order; add+norm writes h as it reads.
//   apply        : column-tiled: each thread owns a column pack (scale/bias loaded once)
//                  and walks a chunk of rows.
//   bwd partials : as partials, Σg and Σg·x̂ per row.
//   bwd apply    : column-tiled dx, with the dscale/dbias partials of its rows in
//                  registers, reduced per block into the [arrays, P, cols] workspace and
//                  summed over P by sum_partials_kernel (fixed order, no atomics).
// 16-byte packs where cols and every pointer allow it, else scalars.
// =====================================================================================
namespace jax_ops::norm {

template <typename T, int PACK, bool ADD>
struct PartPolicy {
  static constexpr int kPack = PACK;
  using Args = PartArgs;
  using Acc = NormAcc;
  struct Ctx {};
  static __device__ __host__ __forceinline__ int64_t rows(const Args& a) { return a.rows; }
  static __device__ __host__ __forceinline__ int64_t nvec(const Args& a) { return a.cols / PACK; }
  static __device__ __forceinline__ Acc init() { return NormAcc{}; }
  static __device__ __forceinline__ Ctx ctx(const Args&, int64_t) { return {}; }
  static __device__ __forceinline__ void add(const Args& a, Ctx, int64_t row, int64_t v, Acc& acc) {
    const int64_t i = row * a.cols + v * PACK;
    Pack<T, PACK> pk = *reinterpret_cast<const Pack<T, PACK>*>(static_cast<const T*>(a.x) + i);
    if constexpr (ADD) {  // h = x + residual rounded to T, written as it is read
      const Pack<T, PACK> pr = *reinterpret_cast<const Pack<T, PACK>*>(static_cast<const T*>(a.residual) + i);
#pragma unroll
      for (int k = 0; k < PACK; ++k) pk.v[k] = add_rounded(pk.v[k], pr.v[k]);
      *reinterpret_cast<Pack<T, PACK>*>(static_cast<T*>(a.h) + i) = pk;
    }
    float f[PACK];
#pragma unroll
    for (int k = 0; k < PACK; ++k) f[k] = to_float(pk.v[k]);
    acc.add_pack(f, a.rms);
  }
  static __device__ __forceinline__ void merge(const Args& a, Acc& lo, const Acc& hi) { lo.merge(hi, a.rms); }
  static __device__ __forceinline__ void store(const Args& a, int64_t row, const Acc& acc) {
    if (a.mean != nullptr) a.mean[row] = acc.mean;
    a.m2[row] = acc.m2;
  }
};

template <typename T, typename P, int PACK>
struct ApplyPolicy {
  using Args = ApplyArgs;
  static constexpr int kPack = PACK;
  static constexpr bool kPartials = false;
  struct Col { float sc[PACK], bi[PACK]; };
  static __device__ __host__ __forceinline__ int64_t rows(const Args& a) { return a.rows; }
  static __device__ __host__ __forceinline__ int64_t nvec(const Args& a) { return a.cols / PACK; }
  static __device__ __forceinline__ Col column(const Args& a, int64_t v) {
    Col c;
    load_param<P, PACK>(a.scale, v * PACK, 1.f, c.sc);
    load_param<P, PACK>(a.bias, v * PACK, 0.f, c.bi);
    return c;
  }
  static __device__ __forceinline__ void apply(const Args& a, const Col& c, int64_t row, int64_t v,
                                               float (&)[PACK], float (&)[PACK]) {
    const RowStats st{a.mean != nullptr ? a.mean[row] : 0.f, a.rstd[row]};
    const int64_t i = row * a.cols + v * PACK;
    float f[PACK], out[PACK];
    load_pack<T, PACK>(static_cast<const T*>(a.x) + i, f);
#pragma unroll
    for (int k = 0; k < PACK; ++k) out[k] = norm_out(f[k], st, c.sc[k], c.bi[k]);
    store_pack<T, PACK>(static_cast<T*>(a.y) + i, out);
  }
};

template <typename T, typename P, int PACK>
struct BwdPartPolicy {
  static constexpr int kPack = PACK;
  using Args = BwdPartArgs;
  struct Acc { float sg, sgx; };
  struct Ctx { float mean, rstd; };
  static __device__ __host__ __forceinline__ int64_t rows(const Args& a) { return a.rows; }
  static __device__ __host__ __forceinline__ int64_t nvec(const Args& a) { return a.cols / PACK; }
  static __device__ __forceinline__ Acc init() { return Acc{0.f, 0.f}; }
  static __device__ __forceinline__ Ctx ctx(const Args& a, int64_t row) {
    return Ctx{a.mean != nullptr ? a.mean[row] : 0.f, a.rstd[row]};
  }
  static __device__ __forceinline__ void add(const Args& a, const Ctx& c, int64_t row, int64_t v, Acc& acc) {
    const int64_t i = row * a.cols + v * PACK;
    float x[PACK], dy[PACK], sc[PACK];
    load_pack<T, PACK>(static_cast<const T*>(a.x) + i, x);
    load_pack<T, PACK>(static_cast<const T*>(a.dy) + i, dy);
    load_param<P, PACK>(a.scale, v * PACK, 1.f, sc);
#pragma unroll
    for (int k = 0; k < PACK; ++k) {
      const float g = dy[k] * sc[k];
      acc.sg += g;
      acc.sgx += g * ((x[k] - c.mean) * c.rstd);
    }
  }
  static __device__ __forceinline__ void merge(const Args&, Acc& lo, const Acc& hi) {
    lo.sg += hi.sg;
    lo.sgx += hi.sgx;
  }
  static __device__ __forceinline__ void store(const Args& a, int64_t row, const Acc& acc) {
    if (a.sum_g != nullptr) a.sum_g[row] = acc.sg;
    a.sum_gx[row] = acc.sgx;
  }
};

template <typename T, typename P, int PACK, bool DH, bool PARTIALS>
struct BwdApplyPolicy {
  using Args = BwdApplyArgs;
  static constexpr int kPack = PACK;
  static constexpr bool kPartials = PARTIALS;
  struct Col { float sc[PACK]; };
  static __device__ __host__ __forceinline__ int64_t rows(const Args& a) { return a.rows; }
  static __device__ __host__ __forceinline__ int64_t nvec(const Args& a) { return a.cols / PACK; }
  static __device__ __forceinline__ Col column(const Args& a, int64_t v) {
    Col c;
    load_param<P, PACK>(a.scale, v * PACK, 1.f, c.sc);
    return c;
  }
  static __device__ __forceinline__ void apply(const Args& a, const Col& c, int64_t row, int64_t v,
                                               float (&ds)[PACK], float (&db)[PACK]) {
    const float mean = a.mean != nullptr ? a.mean[row] : 0.f, rstd = a.rstd[row];
    const float mean_g = a.sum_g != nullptr ? a.sum_g[row] * a.inv_n : 0.f;
    const float mean_gx = a.sum_gx[row] * a.inv_n;
    const int64_t i = row * a.cols + v * PACK;
    float x[PACK], dy[PACK], out[PACK];
    load_pack<T, PACK>(static_cast<const T*>(a.x) + i, x);
    load_pack<T, PACK>(static_cast<const T*>(a.dy) + i, dy);
#pragma unroll
    for (int k = 0; k < PACK; ++k) {
      const float xhat = (x[k] - mean) * rstd;
      out[k] = norm_dx(dy[k] * c.sc[k], xhat, rstd, mean_g, mean_gx);
      if constexpr (PARTIALS) {
        ds[k] += dy[k] * xhat;
        db[k] += dy[k];
      }
    }
    if constexpr (DH) {
      float d[PACK];
      load_pack<T, PACK>(static_cast<const T*>(a.dh) + i, d);
#pragma unroll
      for (int k = 0; k < PACK; ++k) out[k] += d[k];
    }
    store_pack<T, PACK>(static_cast<T*>(a.dx) + i, out);
  }
};

template <typename T>
constexpr int stage_vec() { return 16 / int(sizeof(T)); }

template <typename T>
cudaError_t launch_part(const PartArgs& a, cudaStream_t stream) {
  constexpr int VEC = stage_vec<T>();
  const bool vec = a.cols % VEC == 0 && aligned_to(a.x, 16) && aligned_to(a.residual, 16) && aligned_to(a.h, 16);
  if (a.residual != nullptr)
    return vec ? launch_rows_reduce<PartPolicy<T, VEC, true>>(a, stream) : launch_rows_reduce<PartPolicy<T, 1, true>>(a, stream);
  return vec ? launch_rows_reduce<PartPolicy<T, VEC, false>>(a, stream) : launch_rows_reduce<PartPolicy<T, 1, false>>(a, stream);
}

template <typename T, typename P>
cudaError_t launch_apply(const ApplyArgs& a, cudaStream_t stream) {
  constexpr int VEC = stage_vec<T>();
  const bool vec = a.cols % VEC == 0 && aligned_to(a.x, 16) && aligned_to(a.y, 16) &&
                   aligned_to(a.scale, sizeof(P) * VEC) && aligned_to(a.bias, sizeof(P) * VEC);
  const int pack = vec ? VEC : 1;
  const TileGrid g = tile_grid(a.rows, a.cols / pack, INT64_MAX);
  if (g.chunks == 0) return cudaSuccess;
  return vec ? launch_cols_tiled<ApplyPolicy<T, P, VEC>>(a, g, nullptr, nullptr, stream)
             : launch_cols_tiled<ApplyPolicy<T, P, 1>>(a, g, nullptr, nullptr, stream);
}

template <typename T, typename P>
cudaError_t launch_bwd_part(const BwdPartArgs& a, cudaStream_t stream) {
  constexpr int VEC = stage_vec<T>();
  const bool vec = a.cols % VEC == 0 && aligned_to(a.x, 16) && aligned_to(a.dy, 16) &&
                   aligned_to(a.scale, sizeof(P) * VEC);
  return vec ? launch_rows_reduce<BwdPartPolicy<T, P, VEC>>(a, stream)
             : launch_rows_reduce<BwdPartPolicy<T, P, 1>>(a, stream);
}

template <typename T, typename P, int PACK, bool DH>
cudaError_t launch_bwd_apply_as(const BwdApplyArgs& a, cudaStream_t stream) {
  const bool partials = a.dscale != nullptr || a.dbias != nullptr;
  if (partials && (a.work == nullptr || a.work_rows < 1)) return cudaErrorInvalidValue;
  const TileGrid g = tile_grid(a.rows, a.cols / PACK, partials ? a.work_rows : INT64_MAX);
  if (!partials) return launch_cols_tiled<BwdApplyPolicy<T, P, PACK, DH, false>>(a, g, nullptr, nullptr, stream);
  float* ds = a.dscale != nullptr ? a.work : nullptr;
  float* db = a.dbias != nullptr ? a.work + (ds != nullptr ? a.work_rows * a.cols : 0) : nullptr;
  cudaError_t err = launch_cols_tiled<BwdApplyPolicy<T, P, PACK, DH, true>>(a, g, ds, db, stream);
  if (err != cudaSuccess) return err;
  return launch_sum_partials<float>(ds, db, g.chunks, a.cols, a.dscale, a.dbias, stream);
}

template <typename T, typename P>
cudaError_t launch_bwd_apply(const BwdApplyArgs& a, cudaStream_t stream) {
  if (a.rows == 0) {  // dscale/dbias: sums over no rows
    cudaError_t err = cudaSuccess;
    if (a.dscale != nullptr) err = cudaMemsetAsync(a.dscale, 0, size_t(a.cols) * sizeof(float), stream);
    if (err == cudaSuccess && a.dbias != nullptr) err = cudaMemsetAsync(a.dbias, 0, size_t(a.cols) * sizeof(float), stream);
    return err;
  }
  constexpr int VEC = stage_vec<T>();
  const bool vec = a.cols % VEC == 0 && aligned_to(a.x, 16) && aligned_to(a.dy, 16) && aligned_to(a.dx, 16) &&
                   aligned_to(a.dh, 16) && aligned_to(a.scale, sizeof(P) * VEC);
  if (a.dh != nullptr)
    return vec ? launch_bwd_apply_as<T, P, VEC, true>(a, stream) : launch_bwd_apply_as<T, P, 1, true>(a, stream);
  return vec ? launch_bwd_apply_as<T, P, VEC, false>(a, stream) : launch_bwd_apply_as<T, P, 1, false>(a, stream);
}

}  // namespace jax_ops::norm
