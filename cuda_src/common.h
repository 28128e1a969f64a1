// Host-device helpers shared by the CPU handlers and the CUDA kernels:
// 16-bit float storage types with float conversion, Welford statistics.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define JO_HD __host__ __device__ __forceinline__
#else
#define JO_HD inline
#endif

namespace jax_ops {

// Storage types: plain 16-bit words, so host code needs no CUDA headers.
struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };

JO_HD float bits_to_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
JO_HD uint32_t float_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

JO_HD float to_float(float v) { return v; }
JO_HD float to_float(bf16_t v) {
#if defined(__CUDA_ARCH__)
  return __bfloat162float(__ushort_as_bfloat16(v.bits));
#else
  return bits_to_float(uint32_t(v.bits) << 16);
#endif
}
JO_HD float to_float(f16_t v) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(v.bits));
#else
  const uint32_t sign = uint32_t(v.bits & 0x8000u) << 16;
  const uint32_t exp = (v.bits >> 10) & 0x1f, man = v.bits & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));  // inf/nan
  if (exp != 0) return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
  // subnormal half: man * 2^-24, exact in float
  const float mag = float(man) * 5.9604644775390625e-8f;
  return sign ? -mag : mag;
#endif
}

template <typename T> JO_HD T from_float(float v);
template <> JO_HD float from_float<float>(float v) { return v; }
template <> JO_HD bf16_t from_float<bf16_t>(float v) {
#if defined(__CUDA_ARCH__)
  return bf16_t{__bfloat16_as_ushort(__float2bfloat16_rn(v))};
#else
  uint32_t u = float_to_bits(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{uint16_t((u >> 16) | 0x40)};  // quiet nan
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return bf16_t{uint16_t(u >> 16)};
#endif
}
template <> JO_HD f16_t from_float<f16_t>(float v) {
#if defined(__CUDA_ARCH__)
  return f16_t{__half_as_ushort(__float2half_rn(v))};
#else
  const uint32_t u = float_to_bits(v);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t au = u & 0x7fffffffu;
  if (au > 0x7f800000u) return f16_t{uint16_t(sign | 0x7e00u)};      // nan
  if (au >= 0x477ff000u) return f16_t{uint16_t(sign | 0x7c00u)};     // rounds to inf
  if (au < 0x38800000u) {                                            // subnormal or zero
    // value * 2^24 rounded to nearest even integer is the half mantissa.
    const float scaled = bits_to_float(au) * 16777216.0f;
    float r = std::nearbyint(scaled);
    return f16_t{uint16_t(sign | uint16_t(r))};
  }
  uint32_t m = au + 0x0fffu + ((au >> 13) & 1u);  // round mantissa to 10 bits, nearest even
  return f16_t{uint16_t(sign | ((m - 0x38000000u) >> 13))};
#endif
}

// a / b; the fast approximate division on the GPU (2 ulp), where exact IEEE
// division would make the statistics, not memory, the bottleneck.
JO_HD float fast_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdividef(a, b);
#else
  return a / b;
#endif
}

// Welford running statistics; merge() combines two partial states exactly as
// the sequential update would (Chan et al.), so any fixed reduction tree gives
// the same, deterministic result.
struct Welford {
  float mean = 0.f, m2 = 0.f, count = 0.f;
  JO_HD void add(float x) {
    count += 1.f;
    const float delta = x - mean;
    mean += fast_div(delta, count);
    m2 += delta * (x - mean);
  }
  JO_HD void merge(float o_mean, float o_m2, float o_count) {
    if (o_count == 0.f) return;
    const float n = count + o_count;
    const float delta = o_mean - mean;
    const float w = fast_div(o_count, n);
    mean += delta * w;
    m2 += o_m2 + delta * delta * count * w;
    count = n;
  }
  JO_HD float variance() const { return count > 0.f ? m2 / count : 0.f; }  // biased
};

}  // namespace jax_ops
