// Host-device math of the LayerNorm/RMSNorm family, shared by the CPU handlers
// and the CUDA kernels so both compute the same function the same way.
#pragma once
#include "cuda_src/common.h"

namespace jax_ops {

// Row statistics accumulator. LayerNorm: Welford mean/M2. RMSNorm: the sum of
// squares lives in m2 and mean stays 0.
struct NormAcc : Welford {
  JO_HD void add(float x, bool rms) {
    if (rms) { count += 1.f; m2 += x * x; }
    else Welford::add(x);
  }
  // A pack of N values: exact two-pass statistics of the pack, then one Welford
  // merge (one division per pack instead of one per element).
  template <int N>
  JO_HD void add_pack(const float (&v)[N], bool rms) {
    float s = 0.f, ss = 0.f;
    if (rms) {
      for (int k = 0; k < N; ++k) ss += v[k] * v[k];
      count += float(N); m2 += ss;
      return;
    }
    for (int k = 0; k < N; ++k) s += v[k];
    const float pm = s * (1.f / float(N));
    for (int k = 0; k < N; ++k) ss += (v[k] - pm) * (v[k] - pm);
    Welford::merge(pm, ss, float(N));
  }
  JO_HD void merge(const NormAcc& o, bool rms) {
    if (rms) { count += o.count; m2 += o.m2; }
    else Welford::merge(o.mean, o.m2, o.count);
  }
};

struct RowStats { float mean, rstd; };

namespace norm {
// Arguments of one forward / backward call (CPU handler or CUDA launcher).
struct FwdArgs {
  const void* x; void* y;
  const void* scale; const void* bias;  // null when absent
  float* mean; float* rstd;              // null when the statistics are not wanted
  int64_t rows; int64_t cols; float eps; bool rms;
};

// add+norm: the row normalized is h = x + residual rounded to T, written to h;
// dx = norm_backward(dy, h) + dh. The pointers are null for the plain norms, whose
// kernels take the base structs (their parameter layout, hence code, unchanged).
struct FwdAddArgs : FwdArgs {
  const void* residual; void* h;
};

struct BwdArgs {
  const void* dy; const void* x;
  const float* mean; const float* rstd;  // mean is null for RMSNorm
  const void* scale;                      // null when absent
  void* dx; void* dscale; void* dbias;    // dscale/dbias null when not wanted
  int64_t rows; int64_t cols; bool rms;
  float* work; int64_t work_rows;         // CUDA: [2, work_rows, cols] float32 partials
};

struct BwdAddArgs : BwdArgs {
  const void* dh;                         // h's cotangent, added to dx
};
}  // namespace norm

JO_HD float rsqrt_f32(float v) {
#if defined(__CUDA_ARCH__)
  return rsqrtf(v);
#else
  return 1.f / std::sqrt(v);
#endif
}

// mean/rstd of a row from its accumulated statistics over `cols` elements.
JO_HD RowStats finish_stats(const NormAcc& acc, int64_t cols, float eps, bool rms) {
  const float var = acc.m2 / float(cols);  // biased variance, or mean square for RMS
  return RowStats{rms ? 0.f : acc.mean, rsqrt_f32(var + eps)};
}

// y = (x - mean) * rstd * scale + bias
JO_HD float norm_out(float x, RowStats s, float scale, float bias) {
  return (x - s.mean) * s.rstd * scale + bias;
}

// xhat = (x - mean) * rstd. For 16-bit x as x * rstd - mean * rstd: the product of the
// row's constants is formed once, then one FMA a value (one instruction of the ~15 a
// value of the narrow rows' group tier). Its rounding, |mean| * rstd * 2^-24, is 2^-16
// (bfloat16) or 2^-13 (float16) of the input's own, |x| * rstd * 2^-8 or 2^-11; float32 x
// keeps the exact form.
template <typename T>
JO_HD float norm_xhat(float x, float mean, float rstd) {
  if constexpr (sizeof(T) == 2) return x * rstd - mean * rstd;
  else return (x - mean) * rstd;
}

// y for 16-bit x: norm_xhat's form, two FMAs a value.
template <typename T>
JO_HD float norm_out_as(float x, RowStats s, float scale, float bias) {
  if constexpr (sizeof(T) == 2) return norm_xhat<T>(x, s.mean, s.rstd) * scale + bias;
  else return norm_out(x, s, scale, bias);
}

// Backward per element, with g = dy * scale, xhat = (x - mean) * rstd and row
// sums sum_g = Σ g, sum_gxhat = Σ g·xhat over the n columns:
//   LayerNorm: dx = rstd · (g − sum_g/n − xhat · sum_gxhat/n)
//   RMSNorm:   dx = rstd · (g − xhat · sum_gxhat/n)
// Written as g·rstd − rstd·sum_g/n − xhat·(rstd·sum_gxhat/n): the two products of
// the row's constants are formed once, then two FMAs a value (three before).
JO_HD float norm_dx(float g, float xhat, float rstd, float mean_g, float mean_gxhat) {
  return g * rstd - rstd * mean_g - xhat * (rstd * mean_gxhat);
}
// The kernels' form, RMS known at compile time: RMSNorm's leaves out mean_g (0), which
// the compiler does not fold away (rstd * 0 is not 0 for an infinite rstd); the same
// value wherever rstd is finite.
template <bool RMS>
JO_HD float norm_dx_of(float g, float xhat, float rstd, float mean_g, float mean_gxhat) {
  if constexpr (RMS) return g * rstd - xhat * (rstd * mean_gxhat);
  else return norm_dx(g, xhat, rstd, mean_g, mean_gxhat);
}

// add+norm: h = x + residual, rounded once to the storage type (what `x + residual`
// gives in jnp for same-dtype operands: the float sum of two 16-bit values rounds
// to them exactly as the correctly rounded 16-bit sum would).
template <typename T>
JO_HD T add_rounded(T x, T residual) { return from_float<T>(to_float(x) + to_float(residual)); }


// ----------------------------------------------- hidden-sharded stages (issue 23) ---
// With the normalized axis split over devices each device reduces its columns of every
// row to partials, jax_ops/ops/layer_norm.py combines them across devices (O(rows)
// data), and a pass finishes with the combined statistics:
//   partials:      LayerNorm: local mean and M2 (Chan's merge combines equal-count
//                  shards exactly); RMSNorm: Σx² in m2; add+norm also writes h.
//   apply:         y = (x − mean)·rstd·scale + bias with the given mean/rstd.
//   bwd partials:  Σg and Σg·x̂ (g = dy·scale) of the local columns.
//   bwd apply:     dx = rstd·(g − Σg/n − x̂·Σg·x̂/n) [+ dh] with the whole row's sums and
//                  length n, and float32 dscale/dbias sums over the local rows.
namespace norm {
struct PartArgs {
  const void* x; const void* residual; void* h;  // residual/h: add+norm, else null
  float* mean; float* m2;                        // mean null for RMSNorm
  int64_t rows, cols; bool rms;
};

struct ApplyArgs {
  const void* x; const float* mean; const float* rstd;  // mean null for RMSNorm
  const void* scale; const void* bias;                  // null when absent
  void* y;
  int64_t rows, cols;
};

struct BwdPartArgs {
  const void* dy; const void* x; const float* mean; const float* rstd; const void* scale;
  float* sum_g; float* sum_gx;  // sum_g null for RMSNorm
  int64_t rows, cols;
};

struct BwdApplyArgs {
  const void* dy; const void* dh; const void* x;  // dh: add+norm's h cotangent, else null
  const float* mean; const float* rstd; const void* scale;
  const float* sum_g; const float* sum_gx;         // whole-row sums (sum_g null for RMSNorm)
  void* dx; float* dscale; float* dbias;           // float32 column sums; null when not wanted
  int64_t rows, cols; float inv_n;                 // inv_n = 1 / the whole row's length
  float* work; int64_t work_rows;                  // CUDA: [2, work_rows, cols] partials
};
}  // namespace norm
}  // namespace jax_ops
