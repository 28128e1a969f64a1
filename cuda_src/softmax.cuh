// Softmax / LogSoftmax CUDA kernels (forward and backward) and their launchers.
//
// Rows are the flattened leading axes; the softmax runs over the last axis.
// Tiers, by row length (cols):
//   cols <= 1024  : a group of WIDTH lanes (1..32) per row, row in registers (forward:
//                   about 4 packs a lane, a thread per row for the shortest rows;
//                   backward: narrow groups take several rows at a time).
//   forward, longer rows: a block per row (about 8 packs a thread, <= 512 threads),
//                   the row staged in shared memory by cp.async (all of it in flight
//                   at once), or read twice from global memory when shared memory
//                   cannot hold it. (A block-register tier like the backward's ran
//                   2048-16384 columns 1.2-1.6x slower on the H200: one 512-thread
//                   block per SM never overlaps one row's loads with another's stores.)
//   backward, cols <= 16384: a block per row, up to 32 values of y and dy a thread
//                   in registers; longer rows: a block per row staged like the
//                   forward's.
// The group tier takes the row max, then one exp per element against it (kept for
// softmax), then the sum: two plain reductions, no exps inside them. The staged
// long-row forward reads shared memory three times (max, Σ, outputs) with one FMA per
// exponent; it is compiled per mask kind and causal rule and folds a bool mask or the
// rule into its row copy. Other unmasked rows run kernels compiled without the
// mask/causal tests (MASKED=false); there mask kind and log/softmax are runtime,
// warp-uniform branches.
// Reductions run in a fixed order: no atomics, bitwise reproducible.
#pragma once
#include <cuda_runtime.h>
#include "cuda_src/common.h"
#include "cuda_src/cuda_utils.cuh"
#include "cuda_src/softmax_math.h"

namespace jax_ops::softmax {

constexpr int kWarpThreads = 128;      // threads per block of the group-per-row kernels
constexpr int64_t kWarpMaxCols = 1024;  // 32 values a lane at most
// Backward block-per-row tier: at most 512 threads (so 128 registers a thread) holding
// up to 32 values of y and of dy each; unvectorized rows (PACK 1) half that.
constexpr int kBlockThreads = 512;
template <int PACK> constexpr int bwd_block_values() { return PACK == 1 ? 16 : 32; }

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

// One row's N values per lane of a WIDTH-lane group (logits in, outputs out): the
// group max first, then one exp per element against it (kept for softmax), then the
// group sum. No exps inside the reductions, one reciprocal or log per row.
template <int N, int WIDTH>
__device__ __forceinline__ void group_softmax_values(float (&v)[N], bool log) {
  float lm = neg_inf();
#pragma unroll
  for (int i = 0; i < N; ++i) lm = fmaxf(lm, v[i]);
  const float m = safe_max(group_max<WIDTH>(lm));
  float ls = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float e = exp_f32(v[i] - m);
    ls += e;
    if (!log) v[i] = e;
  }
  const RowOut r = finish_row(m, group_sum<WIDTH>(ls), log);
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
    group_softmax_values<N, WIDTH>(v, a.log);
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

// ------------------------------------------------------- long-row forward ---
//
// Mask and causal rule of the long-row tier known at compile time (MK a MaskKind, or
// kRuntimeMask: pack_logits' runtime branches, for unvectorized rows).
constexpr int kRuntimeMask = -1;
// Long-row blocks: at most 512 threads (128 registers each).
constexpr int kLongThreads = 512;

// A pack read through the read-only data path (ld.global.nc): the compiler may move
// it ahead of shared-memory stores, which a plain load through a generic pointer
// forbids.
template <typename P>
__device__ __forceinline__ P ldg_pack(const P* ptr) {
  P out;
  if constexpr (sizeof(P) % 16 == 0) {
#pragma unroll
    for (int i = 0; i < int(sizeof(P) / 16); ++i)
      reinterpret_cast<uint4*>(&out)[i] = __ldg(reinterpret_cast<const uint4*>(ptr) + i);
  } else if constexpr (sizeof(P) == 8) {
    *reinterpret_cast<uint2*>(&out) = __ldg(reinterpret_cast<const uint2*>(ptr));
  } else if constexpr (sizeof(P) == 4) {
    *reinterpret_cast<unsigned*>(&out) = __ldg(reinterpret_cast<const unsigned*>(ptr));
  } else if constexpr (sizeof(P) == 2) {
    *reinterpret_cast<unsigned short*>(&out) = __ldg(reinterpret_cast<const unsigned short*>(ptr));
  } else {
    out = *ptr;
  }
  return out;
}

// A pack of x as floats; bf16 pairs through 32-bit words (one shift or mask each).
template <typename T, int PACK>
__device__ __forceinline__ void unpack_floats(const Pack<T, PACK>& pk, float (&f)[PACK]) {
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

template <typename T, int PACK, int MK> struct MaskPackIO {  // kNoMask, kRuntimeMask
  struct Raw {};
  static __device__ __forceinline__ Raw load(const void*, int64_t) { return {}; }
  static __device__ __forceinline__ void apply(const Raw&, float (&)[PACK]) {}
};
template <typename T, int PACK> struct MaskPackIO<T, PACK, kBoolMask> {
  using Raw = Pack<uint8_t, PACK>;
  static __device__ __forceinline__ Raw load(const void* m, int64_t p) { return ldg_pack(static_cast<const Raw*>(m) + p); }
  // Element k is kept iff its byte is nonzero: one AND-to-predicate a byte from words.
  static __device__ __forceinline__ bool keep(const Raw& r, int k) {
    if constexpr (PACK % 4 == 0) return reinterpret_cast<const uint32_t*>(&r)[k / 4] & (0xffu << (8 * (k % 4)));
    else return r.v[k] != 0;
  }
  static __device__ __forceinline__ void apply(const Raw& r, float (&z)[PACK]) {
#pragma unroll
    for (int k = 0; k < PACK; ++k) z[k] = keep(r, k) ? z[k] : neg_inf();
  }
};
template <typename T, int PACK, typename M> struct AddMaskPackIO {
  using Raw = Pack<M, PACK>;
  static __device__ __forceinline__ Raw load(const void* m, int64_t p) { return ldg_pack(static_cast<const Raw*>(m) + p); }
  static __device__ __forceinline__ void apply(const Raw& r, float (&z)[PACK]) {
    float v[PACK];
    unpack_floats(r, v);
#pragma unroll
    for (int k = 0; k < PACK; ++k) z[k] += v[k];
  }
};
template <typename T, int PACK> struct MaskPackIO<T, PACK, kAddMask> : AddMaskPackIO<T, PACK, T> {};
template <typename T, int PACK> struct MaskPackIO<T, PACK, kAddMaskF32> : AddMaskPackIO<T, PACK, float> {};

// Whether the causal rule masks any element of pack p (climit: causal_limit()).
template <int PACK>
__device__ __forceinline__ bool causal_reaches(int64_t climit, int64_t p) { return climit - p * PACK < PACK - 1; }

// Logits of pack p: x scaled, the mask applied, then the causal rule, as logit() does.
// The causal test is one compare per pack (and per element only past the diagonal).
template <typename T, int PACK, int MK, bool CAUSAL>
__device__ __forceinline__ void long_logits(const FwdArgs& a, int64_t climit, int64_t mrow, int64_t p,
                                            const Pack<T, PACK>& raw, const typename MaskPackIO<T, PACK, MK>::Raw& mraw,
                                            float (&z)[PACK]) {
  if constexpr (MK == kRuntimeMask) {
    pack_logits<T, PACK, true>(a, climit, mrow, p * PACK, raw, z);
  } else {
    unpack_floats(raw, z);
#pragma unroll
    for (int k = 0; k < PACK; ++k) z[k] *= a.scale;
    MaskPackIO<T, PACK, MK>::apply(mraw, z);
    if constexpr (CAUSAL) {
      if (causal_reaches<PACK>(climit, p)) {  // rare: the packs past the diagonal
        const int64_t room = climit - p * PACK;  // keep z[k] for k <= room
        const int last = room < 0 ? -1 : int(room);
#pragma unroll
        for (int k = 0; k < PACK; ++k) z[k] = k <= last ? z[k] : neg_inf();
      }
    }
  }
}

// x with -inf where z is -inf (the fold of the long-row kernel).
template <typename T, int PACK>
__device__ __forceinline__ void fold_by_logits(Pack<T, PACK>& pk, const float (&z)[PACK]) {
  const T masked_x = from_float<T>(neg_inf());
#pragma unroll
  for (int k = 0; k < PACK; ++k) pk.v[k] = z[k] == neg_inf() ? masked_x : pk.v[k];
}

// x with -inf where a bool mask pack (bytes 0/1, as XLA stores PRED) is 0: for 16-bit
// x, each byte pair spread to a halfword (PRMT), times 0xffff, selects per halfword
// in one LOP3 per 32-bit word.
template <typename T, int PACK>
__device__ __forceinline__ void fold_by_bool_mask(Pack<T, PACK>& pk, const Pack<uint8_t, PACK>& m) {
  if constexpr (sizeof(T) == 2 && PACK % 4 == 0) {
    constexpr uint32_t kNegInf2 = std::is_same_v<T, bf16_t> ? 0xff80ff80u : 0xfc00fc00u;
    uint32_t* w = reinterpret_cast<uint32_t*>(&pk);
    const uint32_t* mw = reinterpret_cast<const uint32_t*>(&m);
#pragma unroll
    for (int k = 0; k < PACK / 2; ++k) {
      const uint32_t spread = __byte_perm(mw[k / 2], 0, (k % 2) ? 0x4342 : 0x4140);  // 0x00b1'00b0
      const uint32_t keep = spread * 0xffffu;
      w[k] = (w[k] & keep) | (kNegInf2 & ~keep);
    }
  } else {
    const T masked_x = from_float<T>(neg_inf());
#pragma unroll
    for (int k = 0; k < PACK; ++k) pk.v[k] = MaskPackIO<T, PACK, kBoolMask>::keep(m, k) ? pk.v[k] : masked_x;
  }
}

// Copies this thread's packs p = threadIdx.x + k * blockDim.x of a row from global to
// shared memory; wait_row_copies() then waits for them. cp.async (sm_80+, 4/8/16-byte
// packs) puts all of them in flight at once without staging them in registers (a
// load-then-store loop keeps about one pack per thread in flight: short of the H200's
// copy bandwidth). Only the copying thread reads a pack back, so waiting for its own
// copies is enough (no block barrier).
template <typename PackT>
__device__ __forceinline__ void copy_row_to_smem(PackT* dst, const PackT* src, int64_t nvec) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (sizeof(PackT) == 4 || sizeof(PackT) == 8 || sizeof(PackT) == 16) {
    for (int64_t p = threadIdx.x; p < nvec; p += blockDim.x) {
      const unsigned saddr = static_cast<unsigned>(__cvta_generic_to_shared(dst + p));
      if constexpr (sizeof(PackT) == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(saddr), "l"(src + p) : "memory");
      else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(saddr), "l"(src + p), "n"(sizeof(PackT)) : "memory");
    }
    return;
  }
#endif
  for (int64_t p = threadIdx.x; p < nvec; p += blockDim.x) dst[p] = src[p];
}

__device__ __forceinline__ void wait_row_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
#endif
}

// Row outputs from base-2 exponents e = (z - max) * log2(e) + c, where c is any
// constant common to the row (the rounding of the shift): it cancels in e - log2(s),
// s = Σ 2^e. A fully masked row (s = 0, every e = -inf) gives 0 / -inf.
struct RowOut2 {
  float inv_s, log2_s;
  __device__ __forceinline__ RowOut2(float s, bool log) {
    inv_s = log || s == 0.f ? 0.f : 1.f / s;
    log2_s = log && s != 0.f ? __log2f(s) : 0.f;
  }
  __device__ __forceinline__ float out(float e, bool log) const {
    constexpr float kLn2 = 0.6931471805599453f;
    return log ? (e - log2_s) * kLn2 : exp2_f32(e) * inv_s;
  }
};

// A block per row for long rows.
// CACHE: the row is staged in shared memory (copy_row_to_smem), then read three times:
// the row max (block-reduced), Σ 2^e (block-reduced), the outputs. With one shift for
// the whole row, the exponent is one FMA, e = x * (scale * log2 e) - max * log2 e,
// the same in the sum and output passes (RowOut2). A bool mask or the causal rule
// (with scale > 0: -inf * scale = -inf) is folded into the cache as -inf entries by
// the max pass, so the later passes run the unmasked math on the same logits.
// Without CACHE (rows past shared memory): one read pass merging per-pack (max, sum)
// pairs, then the output pass reading x again.
template <typename T, int PACK, bool CACHE, int MK, bool CAUSAL>
__global__ void __launch_bounds__(kLongThreads, 3) fwd_block_kernel(FwdArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  using PackT = Pack<T, PACK>;
  using MaskIO = MaskPackIO<T, PACK, MK>;
  using MaskRaw = typename MaskIO::Raw;
  constexpr bool UNMASKED = MK == kNoMask && !CAUSAL;
  constexpr bool FOLDABLE = CACHE && (MK == kBoolMask || (MK == kNoMask && CAUSAL));
  PackT* cache = reinterpret_cast<PackT*>(smem_raw);
  const int64_t nvec = a.cols / PACK;
  const bool fold = FOLDABLE && a.scale > 0.f;
  const bool plain = UNMASKED || fold;  // after the max pass: logits = x * scale
  const float x_to_e = a.scale * kLog2e;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const int64_t mrow = (MK != kNoMask && a.mask_kind != kNoMask) ? mask_row(a.map, row) : 0;
    const int64_t climit = causal_limit(a, row);
    const PackT* x = static_cast<const PackT*>(a.x) + row * nvec;
    T* y = static_cast<T*>(a.y) + row * a.cols;
    const void* mask = nullptr;
    if constexpr (MK != kNoMask && MK != kRuntimeMask)
      mask = static_cast<const unsigned char*>(a.mask) + mrow * a.cols * int64_t(sizeof(typename MaskRaw::value_type));
    // Masked logits of pack p (from the cache, or x without CACHE).
    auto masked_logits = [&](int64_t p, float (&z)[PACK]) {
      long_logits<T, PACK, MK, CAUSAL>(a, climit, mrow, p, CACHE ? cache[p] : x[p], MaskIO::load(mask, p), z);
    };
    if constexpr (CACHE) {
      const int n = int(nvec);  // the row fits in shared memory
      copy_row_to_smem(cache, x, nvec);
      float m = neg_inf();
      if constexpr (UNMASKED) {
        wait_row_copies();
#pragma unroll 4
        for (int p = threadIdx.x; p < n; p += blockDim.x) {
          float z[PACK];
          unpack_floats(cache[p], z);
#pragma unroll
          for (int k = 0; k < PACK; ++k) m = fmaxf(m, z[k] * a.scale);
        }
      } else {
        // kMaskAhead mask packs (up to 32 bytes) loaded at a time, the first ones before
        // the wait for the row copy (their latency overlaps it).
        constexpr int kMaskAhead = sizeof(MaskRaw) <= 8 ? 4 : sizeof(MaskRaw) <= 16 ? 2 : 1;
#pragma unroll 1
        for (int base = threadIdx.x; base < n; base += kMaskAhead * blockDim.x) {
          MaskRaw mk[kMaskAhead];
#pragma unroll
          for (int u = 0; u < kMaskAhead; ++u) {
            const int p = base + u * blockDim.x;
            if (p < n) mk[u] = MaskIO::load(mask, p);
          }
          wait_row_copies();
#pragma unroll
          for (int u = 0; u < kMaskAhead; ++u) {
            const int p = base + u * blockDim.x;
            if (p >= n) break;
            PackT pk = cache[p];
            float z[PACK];
            long_logits<T, PACK, MK, CAUSAL>(a, climit, mrow, p, pk, mk[u], z);
#pragma unroll
            for (int k = 0; k < PACK; ++k) m = fmaxf(m, z[k]);
            if constexpr (FOLDABLE) {
              const bool rule = CAUSAL && causal_reaches<PACK>(climit, p);
              if (fold && (MK == kBoolMask || rule)) {
                if constexpr (MK == kBoolMask) {
                  if (rule) fold_by_logits(pk, z);
                  else fold_by_bool_mask(pk, mk[u]);
                } else {
                  fold_by_logits(pk, z);
                }
                cache[p] = pk;
              }
            }
          }
        }
      }
      const float shift_e = safe_max(block_reduce<true>(m)) * kLog2e;
      // Exponents of pack p against the row max: from x alone (PLAIN) or the masked logits.
      auto exponents = [&](auto plain_tag, int p, float (&e)[PACK]) {
        if constexpr (decltype(plain_tag)::value) {
          unpack_floats(cache[p], e);
#pragma unroll
          for (int k = 0; k < PACK; ++k) e[k] = fmaf(e[k], x_to_e, -shift_e);
        } else {
          masked_logits(p, e);
#pragma unroll
          for (int k = 0; k < PACK; ++k) e[k] = fmaf(e[k], kLog2e, -shift_e);
        }
      };
      auto sum_pass = [&](auto plain_tag) {
        float s = 0.f;
#pragma unroll 4
        for (int p = threadIdx.x; p < n; p += blockDim.x) {
          float e[PACK];
          exponents(plain_tag, p, e);
#pragma unroll
          for (int k = 0; k < PACK; ++k) s += exp2_f32(e[k]);
        }
        return s;
      };
      float s = 0.f;
      if (plain) s = sum_pass(std::true_type{});
      else if constexpr (!UNMASKED) s = sum_pass(std::false_type{});
      const RowOut2 r(block_reduce<false>(s), a.log);
      // Softmax and log_softmax loops apart: a runtime flag inside would be predicated,
      // issuing both paths' instructions.
      auto output_pass = [&](auto plain_tag, auto log_tag) {
#pragma unroll 4
        for (int p = threadIdx.x; p < n; p += blockDim.x) {
          float e[PACK];
          exponents(plain_tag, p, e);
#pragma unroll
          for (int k = 0; k < PACK; ++k) e[k] = r.out(e[k], decltype(log_tag)::value);
          store_pack<T, PACK>(y + int64_t(p) * PACK, e);
        }
      };
      auto output_log = [&](auto plain_tag) {
        if (a.log) output_pass(plain_tag, std::true_type{});
        else output_pass(plain_tag, std::false_type{});
      };
      if (plain) output_log(std::true_type{});
      else if constexpr (!UNMASKED) output_log(std::false_type{});
      // No barrier before the next row's copy: each thread reads only the packs it
      // copied itself.
    } else {
      MaxSum ms;
      for (int64_t p = threadIdx.x; p < nvec; p += blockDim.x) {
        float z[PACK];
        masked_logits(p, z);
        float pm = neg_inf();
#pragma unroll
        for (int k = 0; k < PACK; ++k) pm = fmaxf(pm, z[k]);
        const float shift = safe_max(pm);
        float ps = 0.f;
#pragma unroll
        for (int k = 0; k < PACK; ++k) ps += exp_f32(z[k] - shift);
        ms.merge(pm, ps);
      }
      const MaxSum whole = block_max_sum(ms);
      const RowOut r = finish_row(safe_max(whole.m), whole.s, a.log);
      for (int64_t p = threadIdx.x; p < nvec; p += blockDim.x) {
        float z[PACK];
        masked_logits(p, z);
#pragma unroll
        for (int k = 0; k < PACK; ++k) z[k] = softmax_out(z[k], r, a.log);
        store_pack<T, PACK>(y + p * PACK, z);
      }
    }
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

// A block per row for long rows: the Σ pass, then the dx pass. CACHE: y and dy are
// staged in shared memory first (copy_row_to_smem); otherwise both passes read them.
template <typename T, int PACK, bool CACHE>
__global__ void __launch_bounds__(kLongThreads) bwd_block_kernel(BwdArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  using PackT = Pack<T, PACK>;
  const int64_t nvec = a.cols / PACK;
  PackT* cache_y = reinterpret_cast<PackT*>(smem_raw);
  PackT* cache_dy = cache_y + nvec;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const PackT* yv = static_cast<const PackT*>(a.y) + row * nvec;
    const PackT* dyv = static_cast<const PackT*>(a.dy) + row * nvec;
    if constexpr (CACHE) {
      copy_row_to_smem(cache_y, yv, nvec);
      copy_row_to_smem(cache_dy, dyv, nvec);
      wait_row_copies();
    }
    float dot = 0.f;
#pragma unroll 4
    for (int64_t p = threadIdx.x; p < nvec; p += blockDim.x) {
      const PackT py = CACHE ? cache_y[p] : yv[p], pd = CACHE ? cache_dy[p] : dyv[p];
#pragma unroll
      for (int j = 0; j < PACK; ++j) dot += bwd_dot_term(to_float(py.v[j]), to_float(pd.v[j]), a.log);
    }
    dot = block_sum(dot);
#pragma unroll 4
    for (int64_t p = threadIdx.x; p < nvec; p += blockDim.x) {
      const PackT py = CACHE ? cache_y[p] : yv[p], pd = CACHE ? cache_dy[p] : dyv[p];
      float out[PACK];
#pragma unroll
      for (int j = 0; j < PACK; ++j) out[j] = softmax_dx(to_float(py.v[j]), to_float(pd.v[j]), dot, a.scale, a.log);
      store_pack<T, PACK>(static_cast<T*>(a.dx) + (row * nvec + p) * PACK, out);
    }
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
template <int PACK, int MAX_VALUES, int K = 1, typename Launch>
cudaError_t dispatch_block_k(int64_t nvec, Launch&& launch) {
  constexpr bool last = K * 2 * PACK > MAX_VALUES;
  if (nvec <= int64_t(kBlockThreads) * K) {
    const int threads = warp_threads(nvec, K);
    return launch(std::integral_constant<int, K>{}, threads);
  }
  if constexpr (!last) return dispatch_block_k<PACK, MAX_VALUES, K * 2>(nvec, launch);
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
// Threads: about 8 packs each (measured on the H200 at 16384 and 32768 bf16 columns:
// 4 or 16 packs a thread ran the masked forward 6-13 % slower), 128..kLongThreads;
// threads_knob > 0 overrides (rounded up to a multiple of 32, clamped likewise).
template <typename Args>
cudaError_t launch_block_long(void (*cached)(Args), void (*uncached)(Args), const Args& a,
                              size_t row_bytes, int64_t nvec, int threads_knob, cudaStream_t stream) {
  const int64_t want = threads_knob > 0 ? threads_knob : (nvec + 7) / 8;
  const int64_t rounded = (want + 31) / 32 * 32;
  const int threads = int(rounded < 128 ? 128 : rounded > kLongThreads ? kLongThreads : rounded);
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

// Tuning knobs (cuda_utils.cuh env_knob): the long-row tiers' block size (0: about 8
// packs a thread).
inline int fwd_long_threads() {
  static const int v = env_knob("JAX_OPS_SOFTMAX_FWD_LONG_THREADS", 0);
  return v;
}
inline int bwd_long_threads() {
  static const int v = env_knob("JAX_OPS_SOFTMAX_BWD_LONG_THREADS", 0);
  return v;
}

template <typename T, int PACK, int MK, bool CAUSAL>
cudaError_t launch_fwd_long_as(const FwdArgs& a, cudaStream_t stream) {
  return launch_block_long(fwd_block_kernel<T, PACK, true, MK, CAUSAL>, fwd_block_kernel<T, PACK, false, MK, CAUSAL>, a,
                           size_t(a.cols) * sizeof(T), a.cols / PACK, fwd_long_threads(), stream);
}

// The long-row forward compiled for the row's mask kind and causal rule
// (unvectorized rows: one kernel with runtime mask branches).
template <typename T, int PACK, bool MASKED>
cudaError_t launch_fwd_long(const FwdArgs& a, cudaStream_t stream) {
  if constexpr (!MASKED) {
    return launch_fwd_long_as<T, PACK, kNoMask, false>(a, stream);
  } else if constexpr (PACK == 1) {
    return launch_fwd_long_as<T, 1, kRuntimeMask, false>(a, stream);
  } else {
    auto with_rule = [&](auto causal) {
      constexpr bool C = decltype(causal)::value;
      switch (a.mask_kind) {
        case kBoolMask: return launch_fwd_long_as<T, PACK, kBoolMask, C>(a, stream);
        case kAddMask: return launch_fwd_long_as<T, PACK, kAddMask, C>(a, stream);
        case kAddMaskF32: return launch_fwd_long_as<T, PACK, kAddMaskF32, C>(a, stream);
        default: return launch_fwd_long_as<T, PACK, kNoMask, C>(a, stream);
      }
    };
    return a.causal ? with_rule(std::true_type{}) : with_rule(std::false_type{});
  }
}

template <typename T, int PACK, bool MASKED>
cudaError_t launch_fwd_packed(const FwdArgs& a, cudaStream_t stream) {
  const int64_t nvec = a.cols / PACK;
  if (a.cols <= kWarpMaxCols)
    return dispatch_row_shape<kWarpMaxCols / (32 * PACK)>(nvec, [&](auto vpt, auto width) {
      return launch_fwd_warp<T, PACK, decltype(vpt)::value, decltype(width)::value, MASKED>(a, stream);
    });
  return launch_fwd_long<T, PACK, MASKED>(a, stream);
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
                           2 * size_t(a.cols) * sizeof(T), nvec, bwd_long_threads(), stream);
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

// =====================================================================================
// NEW SECTION: hidden-sharded stages (issue 23). Kernels of the per-device stages that
// run when the softmax axis is split over devices (cuda_src/softmax_math.h: PartArgs,
// ApplyArgs, BwdPartArgs, BwdApplyArgs): policies for the row skeletons of
// cuda_utils.cuh, and their launchers. The logits come from pack_logits (scale, mask,
// causal rule) exactly as in the kernels above, with the causal limit from the device's
// offset operand.
//   partials     : a group of lanes (or a block, for few long rows) per row streams the
//                  local columns: per pack its max and Σ exp(z − max), merged into the
//                  lane's running (max, sum) with one exp; lanes merged in a fixed order.
//   apply        : elementwise, y = softmax_out(z, finish_row(m, s)) with the row's m, s.
//   bwd partials : Σ dy·y (log: Σ dy) per row.
//   bwd apply    : elementwise, dx = softmax_dx(y, dy, dot).
// 16-byte packs where cols and every pointer allow it, else scalars.
// =====================================================================================
namespace jax_ops::softmax {

// Row constants of the forward stages: the mask row and the causal limit.
struct StageRow { int64_t mrow, climit; };

__device__ __forceinline__ StageRow stage_row(const FwdArgs& f, const int32_t* offset, int64_t row) {
  const int64_t off = offset != nullptr ? int64_t(*offset) : f.offset;
  return StageRow{f.mask_kind != kNoMask ? mask_row(f.map, row) : 0, causal_limit_at(f, row, off)};
}

template <typename T, int PACK, bool MASKED>
struct PartPolicy {
  static constexpr int kPack = PACK;
  using Args = PartArgs;
  struct Acc { float m, s; };
  using Ctx = StageRow;
  static __device__ __host__ __forceinline__ int64_t rows(const Args& a) { return a.f.rows; }
  static __device__ __host__ __forceinline__ int64_t nvec(const Args& a) { return a.f.cols / PACK; }
  static __device__ __forceinline__ Acc init() { return Acc{neg_inf(), 0.f}; }
  static __device__ __forceinline__ Ctx ctx(const Args& a, int64_t row) { return stage_row(a.f, a.offset, row); }
  static __device__ __forceinline__ void add(const Args& a, const Ctx& c, int64_t row, int64_t v, Acc& acc) {
    const Pack<T, PACK> raw = *reinterpret_cast<const Pack<T, PACK>*>(static_cast<const T*>(a.f.x) + row * a.f.cols + v * PACK);
    float z[PACK];
    pack_logits<T, PACK, MASKED>(a.f, c.climit, c.mrow, v * PACK, raw, z);
    float pm = neg_inf();
#pragma unroll
    for (int k = 0; k < PACK; ++k) pm = fmaxf(pm, z[k]);
    const float shift = safe_max(pm);
    float ps = 0.f;
#pragma unroll
    for (int k = 0; k < PACK; ++k) ps += exp_f32(z[k] - shift);
    merge_max_sum(acc.m, acc.s, pm, ps);
  }
  static __device__ __forceinline__ void merge(const Args&, Acc& lo, const Acc& hi) { merge_max_sum(lo.m, lo.s, hi.m, hi.s); }
  static __device__ __forceinline__ void store(const Args& a, int64_t row, const Acc& acc) {
    a.max[row] = acc.m;
    a.sum[row] = acc.s;
  }
};

template <typename T, int PACK, bool MASKED>
struct ApplyPolicy {
  using Args = ApplyArgs;
  struct Ctx { StageRow r; RowOut out; };
  static __device__ __host__ __forceinline__ int64_t rows(const Args& a) { return a.f.rows; }
  static __device__ __host__ __forceinline__ int64_t nvec(const Args& a) { return a.f.cols / PACK; }
  static __device__ __forceinline__ Ctx ctx(const Args& a, int64_t row) {
    return Ctx{stage_row(a.f, a.offset, row), finish_row(safe_max(a.max[row]), a.sum[row], a.f.log)};
  }
  static __device__ __forceinline__ void apply(const Args& a, const Ctx& c, int64_t row, int64_t v) {
    const int64_t i = row * a.f.cols + v * PACK;
    const Pack<T, PACK> raw = *reinterpret_cast<const Pack<T, PACK>*>(static_cast<const T*>(a.f.x) + i);
    float z[PACK], out[PACK];
    pack_logits<T, PACK, MASKED>(a.f, c.r.climit, c.r.mrow, v * PACK, raw, z);
#pragma unroll
    for (int k = 0; k < PACK; ++k) out[k] = softmax_out(z[k], c.out, a.f.log);
    store_pack<T, PACK>(static_cast<T*>(a.f.y) + i, out);
  }
};

template <typename T, int PACK>
struct BwdPartPolicy {
  static constexpr int kPack = PACK;
  using Args = BwdPartArgs;
  struct Acc { float dot; };
  struct Ctx {};
  static __device__ __host__ __forceinline__ int64_t rows(const Args& a) { return a.rows; }
  static __device__ __host__ __forceinline__ int64_t nvec(const Args& a) { return a.cols / PACK; }
  static __device__ __forceinline__ Acc init() { return Acc{0.f}; }
  static __device__ __forceinline__ Ctx ctx(const Args&, int64_t) { return {}; }
  static __device__ __forceinline__ void add(const Args& a, Ctx, int64_t row, int64_t v, Acc& acc) {
    const int64_t i = row * a.cols + v * PACK;
    float y[PACK], dy[PACK];
    load_pack<T, PACK>(static_cast<const T*>(a.y) + i, y);
    load_pack<T, PACK>(static_cast<const T*>(a.dy) + i, dy);
#pragma unroll
    for (int k = 0; k < PACK; ++k) acc.dot += bwd_dot_term(y[k], dy[k], a.log);
  }
  static __device__ __forceinline__ void merge(const Args&, Acc& lo, const Acc& hi) { lo.dot += hi.dot; }
  static __device__ __forceinline__ void store(const Args& a, int64_t row, const Acc& acc) { a.dot[row] = acc.dot; }
};

template <typename T, int PACK>
struct BwdApplyPolicy {
  using Args = BwdApplyArgs;
  struct Ctx { float dot; };
  static __device__ __host__ __forceinline__ int64_t rows(const Args& a) { return a.b.rows; }
  static __device__ __host__ __forceinline__ int64_t nvec(const Args& a) { return a.b.cols / PACK; }
  static __device__ __forceinline__ Ctx ctx(const Args& a, int64_t row) { return Ctx{a.dot[row]}; }
  static __device__ __forceinline__ void apply(const Args& a, const Ctx& c, int64_t row, int64_t v) {
    const int64_t i = row * a.b.cols + v * PACK;
    float y[PACK], dy[PACK], out[PACK];
    load_pack<T, PACK>(static_cast<const T*>(a.b.y) + i, y);
    load_pack<T, PACK>(static_cast<const T*>(a.b.dy) + i, dy);
#pragma unroll
    for (int k = 0; k < PACK; ++k) out[k] = softmax_dx(y[k], dy[k], c.dot, a.b.scale, a.b.log);
    store_pack<T, PACK>(static_cast<T*>(a.b.dx) + i, out);
  }
};

// Whether the forward stages' x (and y, mask) take 16-byte packs.
template <typename T>
bool stage_fwd_vec(const FwdArgs& f) {
  constexpr int VEC = 16 / sizeof(T);
  return f.cols % VEC == 0 && aligned_to(f.x, 16) && aligned_to(f.y, 16) &&
         aligned_to(f.mask, VEC * mask_item_bytes(f.mask_kind, sizeof(T)));
}

template <typename T, template <typename, int, bool> class Policy, bool REDUCE, typename Args>
cudaError_t launch_fwd_stage(const Args& a, cudaStream_t stream) {
  if (a.f.rows == 0 || a.f.cols == 0) return cudaSuccess;
  constexpr int VEC = 16 / sizeof(T);
  const bool vec = stage_fwd_vec<T>(a.f), masked = a.f.mask_kind != kNoMask || a.f.causal;
  auto go = [&](auto pol) {
    using R = decltype(pol);
    if constexpr (REDUCE) return launch_rows_reduce<R>(a, stream);
    else return launch_rows_map<R>(a, stream);
  };
  if (masked) return vec ? go(Policy<T, VEC, true>{}) : go(Policy<T, 1, true>{});
  return vec ? go(Policy<T, VEC, false>{}) : go(Policy<T, 1, false>{});
}

template <typename T>
cudaError_t launch_part(const PartArgs& a, cudaStream_t stream) {
  return launch_fwd_stage<T, PartPolicy, true>(a, stream);
}

template <typename T>
cudaError_t launch_apply(const ApplyArgs& a, cudaStream_t stream) {
  return launch_fwd_stage<T, ApplyPolicy, false>(a, stream);
}

template <typename T>
cudaError_t launch_bwd_part(const BwdPartArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.cols == 0) return cudaSuccess;
  constexpr int VEC = 16 / sizeof(T);
  const bool vec = a.cols % VEC == 0 && aligned_to(a.y, 16) && aligned_to(a.dy, 16);
  return vec ? launch_rows_reduce<BwdPartPolicy<T, VEC>>(a, stream) : launch_rows_reduce<BwdPartPolicy<T, 1>>(a, stream);
}

template <typename T>
cudaError_t launch_bwd_apply(const BwdApplyArgs& a, cudaStream_t stream) {
  if (a.b.rows == 0 || a.b.cols == 0) return cudaSuccess;
  constexpr int VEC = 16 / sizeof(T);
  const bool vec = a.b.cols % VEC == 0 && aligned_to(a.b.y, 16) && aligned_to(a.b.dy, 16) && aligned_to(a.b.dx, 16);
  return vec ? launch_rows_map<BwdApplyPolicy<T, VEC>>(a, stream) : launch_rows_map<BwdApplyPolicy<T, 1>>(a, stream);
}

}  // namespace jax_ops::softmax
