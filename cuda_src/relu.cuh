// ReLU / Add+ReLU with a 1-bit mask: CUDA kernels and launchers, and the masked
// elementwise forward that BatchNorm+ReLU (batch_norm.cuh) reuses.
//
// Forward: x is flat (any shape). A warp takes a tile of 32 packs (PACK = 16 bytes of
// elements; 1 when a pointer is not 16-byte aligned), so the 32 / PACK lanes whose
// packs make up one 32-bit mask word OR their bits together with shuffles and one of
// them stores the word. Tiles cover the whole words [0, 32·floor(n/32)); warp 0 does
// the last, partial word element by element (ballot). Loop trip counts are per warp,
// so every lane takes part in every shuffle (lanes past the end add zero bits).
// Backward: each thread reads the word holding its PACK bits and selects dy or 0.
#pragma once
#include <cuda_runtime.h>
#include <numeric>
#include <type_traits>
#include "cuda_src/bitmask.h"
#include "cuda_src/common.h"
#include "cuda_src/cuda_utils.cuh"

namespace jax_ops {

constexpr int kElemThreads = 256;
constexpr int kElemWarps = kElemThreads / 32;

// The mask word of 32 consecutive elements held PACK per lane by 32 / PACK aligned lanes;
// `bits` holds this lane's PACK bits (element k at bit k). Every lane of the group gets it.
template <int PACK>
__device__ __forceinline__ uint32_t mask_word(uint32_t bits, int lane) {
  constexpr int LANES = 32 / PACK;
  if constexpr (LANES == 32) {
    return __ballot_sync(0xffffffffu, bits != 0u);
  } else {
    uint32_t word = bits << ((lane % LANES) * PACK);
#pragma unroll
    for (int off = 1; off < LANES; off *= 2) word |= __shfl_xor_sync(0xffffffffu, word, off);
    return word;
  }
}

// Geometry of a warp-tiled elementwise loop: warp w takes tiles w, w + warps, ... of
// 32 packs; elements [covered, n) are the scalar tail.
struct WarpTiles {
  int64_t covered;  // elements handled in packs
  int64_t tiles;    // ceil(covered / (32 * PACK))
  int64_t warps;    // warps taking part (>= 1: warp 0 also does the tail)
  int blocks;       // of kElemThreads threads
  // Per-channel values a lane keeps in registers must be reloaded between its tiles:
  // false when warps·32·PACK is a multiple of the channel count (the lane's channels
  // are then the same in every tile).
  bool reload;
};

// channels: the channel count of a channels-last layout whose per-channel values the
// kernel keeps in registers (0: none). The warp count is a multiple of the channel
// period where that still fills the machine, so lanes keep their channels.
template <typename Kernel>
cudaError_t plan_warp_tiles(Kernel kernel, int64_t covered, int pack, int64_t channels, WarpTiles* plan) {
  const int64_t tile_elems = 32 * int64_t(pack);
  plan->covered = covered;
  plan->tiles = (covered + tile_elems - 1) / tile_elems;
  int blocks = 0;
  const cudaError_t err = resident_blocks(kernel, kElemThreads, 0, (plan->tiles + kElemWarps - 1) / kElemWarps, &blocks);
  if (err != cudaSuccess) return err;
  const int64_t resident = int64_t(blocks) * kElemWarps;
  int64_t warps = plan->tiles < resident ? plan->tiles : resident;
  if (channels > 0 && plan->tiles > resident) {
    const int64_t period = channels / std::gcd(channels, tile_elems);  // tiles until channels repeat
    if (period <= resident) warps = resident / period * period;
  }
  plan->warps = warps < 1 ? 1 : warps;
  plan->reload = channels > 0 && (plan->warps * tile_elems) % channels != 0;
  plan->blocks = int((plan->warps + kElemWarps - 1) / kElemWarps);
  return cudaSuccess;
}

// y = relu(pre), mask bits of pre, pre = op(x) [+ z]. Op: prepare(base, load) is
// called once per tile for the lane's pack at flat index base (load: its per-element
// values must be (re)loaded); pre(k, x) for element k of that pack; scalar_pre(i, x)
// for tail element i.
template <typename T, int PACK, bool HAS_Z, typename Op>
__global__ void __launch_bounds__(kElemThreads)
    masked_fwd_kernel(const T* __restrict__ x, const T* __restrict__ z, T* __restrict__ y,
                      uint32_t* __restrict__ mask, int64_t n, WarpTiles plan, Op op_in) {
  constexpr int TILE = 32 * PACK;
  const int lane = threadIdx.x % 32;
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (warp >= plan.warps) return;  // whole warps only
  Op op = op_in;
  for (int64_t t = warp; t < plan.tiles; t += plan.warps) {
    const int64_t base = t * TILE + int64_t(lane) * PACK;
    op.prepare(base, t == warp || plan.reload);
    // Packs never straddle a word (PACK divides 32), and covered is whole words: a
    // word's packs are all in range or all out of it.
    const bool active = base < plan.covered;
    uint32_t bits = 0;
    if (active) {
      float xv[PACK], zv[PACK], pre[PACK], out[PACK];
      load_pack<T, PACK>(x + base, xv);
      if constexpr (HAS_Z) load_pack<T, PACK>(z + base, zv);
#pragma unroll
      for (int k = 0; k < PACK; ++k) {
        pre[k] = op.pre(k, xv[k]);
        if constexpr (HAS_Z) pre[k] += zv[k];
        out[k] = relu_out(pre[k]);
      }
      bits = relu_bits(pre);
      store_pack<T, PACK>(y + base, out);
    }
    const uint32_t word = mask_word<PACK>(bits, lane);
    if (active && lane % (32 / PACK) == 0) mask[base / 32] = word;
  }
  if (warp == 0 && plan.covered < n) {  // the last, partial word
    const int64_t i = plan.covered + lane;
    uint32_t bit = 0;
    if (i < n) {
      float pre = op.scalar_pre(i, to_float(x[i]));
      if constexpr (HAS_Z) pre += to_float(z[i]);
      bit = relu_bit(pre);
      y[i] = from_float<T>(relu_out(pre));
    }
    const uint32_t word = __ballot_sync(0xffffffffu, bit != 0u);
    if (lane == 0) mask[plan.covered / 32] = word;
  }
}

// Launches masked_fwd_kernel over n elements; channels as for plan_warp_tiles.
template <typename T, int PACK, bool HAS_Z, typename Op>
cudaError_t launch_masked_fwd(const T* x, const T* z, T* y, uint32_t* mask, int64_t n, int64_t channels,
                              const Op& op, cudaStream_t stream) {
  auto kernel = masked_fwd_kernel<T, PACK, HAS_Z, Op>;
  WarpTiles plan;
  const cudaError_t err = plan_warp_tiles(kernel, n / 32 * 32, PACK, channels, &plan);
  if (err != cudaSuccess) return err;
  kernel<<<plan.blocks, kElemThreads, 0, stream>>>(x, z, y, mask, n, plan, op);
  return cudaGetLastError();
}

// Launches the forward with 16-byte packs when x, z and y allow it, else one element
// per lane; make_op(std::integral_constant<int, PACK>) gives the kernel's Op.
template <typename T, typename MakeOp>
cudaError_t launch_masked_fwd_any(const void* x, const void* z, void* y, uint32_t* mask, int64_t n,
                                  int64_t channels, MakeOp&& make_op, cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(T);
  using Vec = std::integral_constant<int, VEC>;
  using One = std::integral_constant<int, 1>;
  const T* xt = static_cast<const T*>(x);
  const T* zt = static_cast<const T*>(z);
  T* yt = static_cast<T*>(y);
  const bool vec = aligned_to(x, 16) && aligned_to(z, 16) && aligned_to(y, 16);
  if (z != nullptr)
    return vec ? launch_masked_fwd<T, VEC, true>(xt, zt, yt, mask, n, channels, make_op(Vec{}), stream)
               : launch_masked_fwd<T, 1, true>(xt, zt, yt, mask, n, channels, make_op(One{}), stream);
  return vec ? launch_masked_fwd<T, VEC, false>(xt, zt, yt, mask, n, channels, make_op(Vec{}), stream)
             : launch_masked_fwd<T, 1, false>(xt, zt, yt, mask, n, channels, make_op(One{}), stream);
}

namespace relu {

// pre = x (the engine adds z).
struct IdentityOp {
  __device__ __forceinline__ void prepare(int64_t, bool) {}
  __device__ __forceinline__ float pre(int, float x) const { return x; }
  __device__ __forceinline__ float scalar_pre(int64_t, float x) const { return x; }
};

template <typename T, int PACK>
__global__ void __launch_bounds__(kElemThreads)
    relu_bwd_kernel(const T* __restrict__ dy, const uint32_t* __restrict__ mask, T* __restrict__ dx, int64_t n) {
  using PackT = Pack<T, PACK>;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t npacks = n / PACK;
  for (int64_t v = first; v < npacks; v += stride) {
    const int64_t base = v * PACK;
    const uint32_t bits = mask[base >> 5] >> (base & 31);  // a pack's bits share a word
    const PackT d = reinterpret_cast<const PackT*>(dy)[v];
    PackT out;
#pragma unroll
    for (int k = 0; k < PACK; ++k) out.v[k] = masked_grad((bits >> k) & 1u, d.v[k]);
    reinterpret_cast<PackT*>(dx)[v] = out;
  }
  for (int64_t i = npacks * PACK + first; i < n; i += stride) dx[i] = masked_grad(get_bit(mask, i), dy[i]);
}

template <typename T>
cudaError_t launch_fwd(const void* x, const void* z, void* y, uint32_t* mask, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return launch_masked_fwd_any<T>(x, z, y, mask, n, 0, [](auto) { return IdentityOp{}; }, stream);
}

template <typename T, int PACK>
cudaError_t launch_bwd_packed(const T* dy, const uint32_t* mask, T* dx, int64_t n, cudaStream_t stream) {
  auto kernel = relu_bwd_kernel<T, PACK>;
  const int64_t items = n / PACK > 0 ? n / PACK : 1;
  int blocks = 0;
  const cudaError_t err = resident_blocks(kernel, kElemThreads, 0, (items + kElemThreads - 1) / kElemThreads, &blocks);
  if (err != cudaSuccess) return err;
  kernel<<<blocks, kElemThreads, 0, stream>>>(dy, mask, dx, n);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_bwd(const void* dy, const uint32_t* mask, void* dx, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  constexpr int VEC = 16 / sizeof(T);
  const T* dyt = static_cast<const T*>(dy);
  T* dxt = static_cast<T*>(dx);
  return aligned_to(dy, 16) && aligned_to(dx, 16) ? launch_bwd_packed<T, VEC>(dyt, mask, dxt, n, stream)
                                                  : launch_bwd_packed<T, 1>(dyt, mask, dxt, n, stream);
}

}  // namespace relu
}  // namespace jax_ops
