// Host-device math of BatchNorm+ReLU / BatchNorm+Add+ReLU, shared by the CPU
// handlers and the CUDA kernels so both compute the same function the same way.
//
// x is (rows, C), channels last. Per channel c, over the rows:
//   training:  mean, var = batch mean and biased variance, from per-block Welford
//              partials (mean_p, M2_p, n_p) combined in a fixed order (Chan):
//              N = Σ n_p, mean = Σ n_p·mean_p / N, M2 = Σ (M2_p + n_p·(mean_p − mean)²)
//   inference: mean, var = the running statistics passed in
//   rstd = 1 / sqrt(var + eps)
//   pre  = (x − mean) · (scale·rstd) + bias [+ z],  y = relu(pre), mask bit = pre > 0
// Backward, with g = bit ? dy : 0 and xhat = (x − mean)·rstd:
//   dbias = Σ g, dscale = Σ g·xhat
//   dx = a·g + b·xhat + c,  a = scale·rstd,
//   training:  b = (−a·dscale + 2·gvar/rstd) / N,  c = (−a·dbias + gmean) / N
//   inference: b = c = 0
//   (gmean, gvar: the cotangents of the returned batch mean and variance)
#pragma once
#include <cmath>
#include <cstdint>
#include "cuda_src/common.h"

// Loops over compile-time trip counts are unrolled on the GPU (arrays stay in registers).
#if defined(__CUDA_ARCH__)
#define JO_UNROLL _Pragma("unroll")
#else
#define JO_UNROLL
#endif

namespace jax_ops::bn {

// Arguments of one forward / backward call (CPU handler or CUDA launcher). Absent
// operands and results are null; parameters and statistics are float32 (C,).
struct FwdArgs {
  const void* x; const void* z;           // z: null without the residual add
  const float* scale; const float* bias;
  const float* mean_in; const float* var_in;  // inference only
  void* y; uint32_t* mask;
  float* mean; float* var; float* rstd;
  float* work; int64_t work_parts;        // training: (3, work_parts, C) Welford partials
  int64_t rows, cols;
  float eps; bool training;
};

struct BwdArgs {
  const void* dy; const void* x; const uint32_t* mask;
  const float* mean; const float* rstd; const float* scale;
  const float* gmean; const float* gvar;  // training only
  void* dx; void* dz;                     // dz: null without the residual add
  float* dscale; float* dbias;
  float* work; int64_t work_parts;        // (2, work_parts, C): partial Σg, Σg·xhat
  int64_t rows, cols;
  bool training;
  // N of the dx coefficients when it is not `rows`: the global row count of a device's
  // rows when the batch is sharded (dscale/dbias are then the psum'ed sums); 0: rows.
  float count = 0.f;
};

JO_HD float bwd_count(const BwdArgs& a) { return a.count > 0.f ? a.count : float(a.rows); }

// Rounded products and sums: on the GPU nvcc would otherwise fuse a*b + c into one
// FMA, and the mask bits (pre > 0) would then differ from the CPU handler's near 0.
JO_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
JO_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// (x − mean)·(scale·rstd) + bias, each operation rounded; scale_rstd = scale·rstd.
JO_HD float bn_pre(float x, float mean, float scale_rstd, float bias) {
  return add_rn(mul_rn(x - mean, scale_rstd), bias);
}

// IEEE division and square root on both platforms (per channel, so cheap).
JO_HD float bn_rstd(float var, float eps) { return 1.f / sqrtf(var + eps); }

JO_HD float bn_xhat(float x, float mean, float rstd) { return (x - mean) * rstd; }

// ------------------------------------------------------------ statistics ---

// Welford statistics of N channels over the same rows (so one shared count, and
// one division per merge for all N channels).
template <int N>
struct PackWelford {
  float mean[N], m2[N], count;

  JO_HD void reset() {
    JO_UNROLL for (int k = 0; k < N; ++k) { mean[k] = 0.f; m2[k] = 0.f; }
    count = 0.f;
  }

  // Chan et al.: merge o_count values with means o_mean and M2s o_m2.
  JO_HD void merge(const float (&o_mean)[N], const float (&o_m2)[N], float o_count) {
    if (o_count == 0.f) return;
    const float total = count + o_count;
    const float w = fast_div(o_count, total);
    JO_UNROLL for (int k = 0; k < N; ++k) {
      const float delta = o_mean[k] - mean[k];
      mean[k] += delta * w;
      m2[k] += o_m2[k] + delta * delta * count * w;
    }
    count = total;
  }

  // U rows at once: exact two-pass mean/M2 of the U values of each channel, then one
  // merge (U = 1 is the plain Welford update).
  template <int U>
  JO_HD void add_rows(const float (&v)[U][N]) {
    float cm[N], cq[N];
    JO_UNROLL for (int k = 0; k < N; ++k) {
      float s = 0.f, q = 0.f;
      JO_UNROLL for (int u = 0; u < U; ++u) s += v[u][k];
      const float m = s * (1.f / float(U));
      JO_UNROLL for (int u = 0; u < U; ++u) q += (v[u][k] - m) * (v[u][k] - m);
      cm[k] = m;
      cq[k] = q;
    }
    merge(cm, cq, float(U));
  }
};

// One partial's term of the combined M2: M2_p + n_p·(mean_p − mean)².
JO_HD float chan_m2_term(float m2_p, float n_p, float mean_p, float mean) {
  const float d = mean_p - mean;
  return m2_p + n_p * d * d;
}

// ---------------------------------------------------------------- backward ---

struct DxCoef { float a, b, c; };

// count: N, the number of rows (training only).
JO_HD DxCoef dx_coefficients(float scale, float rstd, float dscale, float dbias, float gmean,
                             float gvar, float count, bool training) {
  const float a = scale * rstd;
  if (!training) return DxCoef{a, 0.f, 0.f};
  return DxCoef{a, (-a * dscale + 2.f * gvar / rstd) / count, (-a * dbias + gmean) / count};
}

JO_HD float bn_dx(const DxCoef& k, float g, float xhat) { return k.a * g + k.b * xhat + k.c; }

}  // namespace jax_ops::bn
