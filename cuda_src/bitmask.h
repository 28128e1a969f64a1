// Host-device helpers of the ReLU family's 1-bit mask, shared by the CPU handlers
// and the CUDA kernels.
//
// Layout: bit i % 32 of uint32 word i / 32 is set iff the pre-activation of flat
// element i is > 0 (NaN -> 0); bits past the last element are 0.
#pragma once
#include <cstdint>
#include "cuda_src/common.h"

namespace jax_ops {

JO_HD int64_t mask_words(int64_t n) { return (n + 31) / 32; }

JO_HD bool get_bit(const uint32_t* mask, int64_t i) { return (mask[i >> 5] >> (i & 31)) & 1u; }

// The mask bit of a pre-activation (false for NaN: comparisons with NaN are false).
JO_HD uint32_t relu_bit(float pre) { return pre > 0.f ? 1u : 0u; }

// relu(pre) as jnp.maximum(pre, 0): NaN stays NaN, -0 and negatives give +0.
JO_HD float relu_out(float pre) { return pre > 0.f ? pre : (pre != pre ? pre : 0.f); }

// The bits of N consecutive pre-activations, element k at bit k.
template <int N>
JO_HD uint32_t relu_bits(const float (&pre)[N]) {
  uint32_t bits = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int k = 0; k < N; ++k) bits |= relu_bit(pre[k]) << k;
  return bits;
}

// The gradient through the mask: dy where the bit is set, else an exact zero (also
// where dy is NaN). Selects the stored value, so no rounding happens.
template <typename T>
JO_HD T masked_grad(bool bit, T dy) { return bit ? dy : T{}; }

}  // namespace jax_ops
