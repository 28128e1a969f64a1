// XLA FFI handlers of BatchNorm+ReLU / BatchNorm+Add+ReLU ("jax_ops_bn_relu_fwd",
// "jax_ops_bn_relu_bwd"): CPU always, CUDA when this file is compiled by nvcc.
// x is (..., C), channels last; parameters and statistics are float32 (C,); absent
// operands and results are zero-element placeholders. Math: cuda_src/batch_norm_math.h.
//   fwd (x, z, scale, bias, mean_in, var_in) -> (y, mask, mean, var, rstd, work)
//       attrs epsilon, training, has_z; work (3, P, C) f32 when training, else (0,)
//   bwd (dy, x, mask, mean, rstd, scale, gmean, gvar) -> (dx, dz, dscale, dbias, work)
//       attrs training, has_z; work (2, P, C) f32
// and the batch-sharded training stages ("jax_ops_bn_stats", "jax_ops_bn_grad_sums",
// "jax_ops_bn_dx"; see their section below).
// work holds per-block partials (P: the most row blocks the kernels may use).
#include <string>
#include <vector>
#include "ffi/common.h"
#include "ffi/handlers.h"
#include "cuda_src/batch_norm_math.h"
#include "cuda_src/bitmask.h"
#ifdef JAX_OPS_WITH_CUDA
#include "cuda_src/batch_norm.cuh"
#endif

namespace jax_ops::bn {
namespace {

struct Layout { int64_t rows, cols; };

ffi::ErrorOr<Layout> channels_last(const ffi::AnyBuffer& x) {
  const auto d = x.dimensions();
  if (d.size() < 1) return ffi::Error::InvalidArgument("x must have rank >= 1 (channels last); got a scalar");
  Layout l{1, d.back()};
  for (size_t i = 0; i + 1 < d.size(); ++i) l.rows *= d[i];
  return l;
}

// work: float32 (planes, P, C) with P >= 1; returns P.
ffi::ErrorOr<int64_t> work_parts(const ffi::AnyBuffer& work, int64_t planes, const Layout& l) {
  const auto d = work.dimensions();
  if (work.element_type() == ffi::DataType::F32 && d.size() == 3 && d[0] == planes && d[1] >= 1 && d[2] == l.cols)
    return int64_t(d[1]);
  return ffi::Error::InvalidArgument("work must be float32 of shape (" + std::to_string(planes) + ", P, " +
                                     std::to_string(l.cols) + ") with P >= 1; got " + shape_dtype_str(work));
}

ffi::ErrorOr<FwdArgs> fwd_args(ffi::AnyBuffer x, ffi::AnyBuffer z, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                               ffi::AnyBuffer mean_in, ffi::AnyBuffer var_in, ffi::AnyBuffer y, ffi::AnyBuffer mask,
                               ffi::AnyBuffer mean, ffi::AnyBuffer var, ffi::AnyBuffer rstd, ffi::AnyBuffer work,
                               float epsilon, bool training, bool has_z) {
  auto layout = channels_last(x);
  if (layout.has_error()) return layout.error();
  const Layout l = layout.value();
  JO_TRY(expect_like(y, "y", x, "x"));
  JO_TRY(has_z ? expect_like(z, "z", x, "x") : expect_empty(z, "z", "when has_z is false"));
  JO_TRY(expect_f32_vector(scale, "scale", l.cols));
  JO_TRY(expect_f32_vector(bias, "bias", l.cols));
  if (training) {
    JO_TRY(expect_empty(mean_in, "mean_in", "in training"));
    JO_TRY(expect_empty(var_in, "var_in", "in training"));
  } else {
    JO_TRY(expect_f32_vector(mean_in, "mean_in", l.cols));
    JO_TRY(expect_f32_vector(var_in, "var_in", l.cols));
  }
  JO_TRY(expect_mask(mask, "mask", l.rows * l.cols));
  JO_TRY(expect_f32_vector(mean, "mean", l.cols));
  JO_TRY(expect_f32_vector(var, "var", l.cols));
  JO_TRY(expect_f32_vector(rstd, "rstd", l.cols));
  int64_t parts = 0;
  if (training) {
    auto p = work_parts(work, 3, l);
    if (p.has_error()) return p.error();
    parts = p.value();
  } else {
    JO_TRY(expect_empty(work, "work", "in inference"));
  }
  if (!(epsilon >= 0.f)) return ffi::Error::InvalidArgument("epsilon must be >= 0; got " + std::to_string(epsilon));
  return FwdArgs{x.untyped_data(), has_z ? z.untyped_data() : nullptr,
                 static_cast<const float*>(scale.untyped_data()), static_cast<const float*>(bias.untyped_data()),
                 training ? nullptr : static_cast<const float*>(mean_in.untyped_data()),
                 training ? nullptr : static_cast<const float*>(var_in.untyped_data()),
                 y.untyped_data(), static_cast<uint32_t*>(mask.untyped_data()),
                 static_cast<float*>(mean.untyped_data()), static_cast<float*>(var.untyped_data()),
                 static_cast<float*>(rstd.untyped_data()),
                 training ? static_cast<float*>(work.untyped_data()) : nullptr, parts,
                 l.rows, l.cols, epsilon, training};
}

// The backward's common operands; dscale/dbias are results (grad_sums) or operands (dx).
ffi::ErrorOr<BwdArgs> stage_bwd_args(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer mask, ffi::AnyBuffer mean,
                                     ffi::AnyBuffer rstd, ffi::AnyBuffer dscale, ffi::AnyBuffer dbias) {
  auto layout = channels_last(x);
  if (layout.has_error()) return layout.error();
  const Layout l = layout.value();
  JO_TRY(expect_like(dy, "dy", x, "x"));
  JO_TRY(expect_mask(mask, "mask", l.rows * l.cols));
  JO_TRY(expect_f32_vector(mean, "mean", l.cols));
  JO_TRY(expect_f32_vector(rstd, "rstd", l.cols));
  JO_TRY(expect_f32_vector(dscale, "dscale", l.cols));
  JO_TRY(expect_f32_vector(dbias, "dbias", l.cols));
  BwdArgs a{};
  a.dy = dy.untyped_data();
  a.x = x.untyped_data();
  a.mask = static_cast<const uint32_t*>(mask.untyped_data());
  a.mean = static_cast<const float*>(mean.untyped_data());
  a.rstd = static_cast<const float*>(rstd.untyped_data());
  a.dscale = static_cast<float*>(dscale.untyped_data());
  a.dbias = static_cast<float*>(dbias.untyped_data());
  a.rows = l.rows;
  a.cols = l.cols;
  return a;
}

ffi::ErrorOr<BwdArgs> bwd_args(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer mask, ffi::AnyBuffer mean,
                               ffi::AnyBuffer rstd, ffi::AnyBuffer scale, ffi::AnyBuffer gmean, ffi::AnyBuffer gvar,
                               ffi::AnyBuffer dx, ffi::AnyBuffer dz, ffi::AnyBuffer dscale, ffi::AnyBuffer dbias,
                               ffi::AnyBuffer work, bool training, bool has_z) {
  auto args = stage_bwd_args(dy, x, mask, mean, rstd, dscale, dbias);
  if (args.has_error()) return args.error();
  BwdArgs a = args.value();
  JO_TRY(expect_f32_vector(scale, "scale", a.cols));
  if (training) {
    JO_TRY(expect_f32_vector(gmean, "gmean", a.cols));
    JO_TRY(expect_f32_vector(gvar, "gvar", a.cols));
  } else {
    JO_TRY(expect_empty(gmean, "gmean", "in inference"));
    JO_TRY(expect_empty(gvar, "gvar", "in inference"));
  }
  JO_TRY(expect_like(dx, "dx", x, "x"));
  JO_TRY(has_z ? expect_like(dz, "dz", x, "x") : expect_empty(dz, "dz", "when has_z is false"));
  auto parts = work_parts(work, 2, Layout{a.rows, a.cols});
  if (parts.has_error()) return parts.error();
  a.scale = static_cast<const float*>(scale.untyped_data());
  a.gmean = training ? static_cast<const float*>(gmean.untyped_data()) : nullptr;
  a.gvar = training ? static_cast<const float*>(gvar.untyped_data()) : nullptr;
  a.dx = dx.untyped_data();
  a.dz = has_z ? dz.untyped_data() : nullptr;
  a.work = static_cast<float*>(work.untyped_data());
  a.work_parts = parts.value();
  a.training = training;
  return a;
}

// ------------------------------------------------------------------- CPU ---

// Row chunks of the CPU partials (one partial row of work each, at most P of them).
constexpr int64_t kCpuChunkRows = 256;
constexpr int kCpuRowsPerUpdate = 4;

struct Chunks { int64_t parts, rows_each; };

Chunks cpu_chunks(int64_t rows, int64_t work_parts) {
  if (rows == 0) return Chunks{0, 0};
  int64_t parts = (rows + kCpuChunkRows - 1) / kCpuChunkRows;
  parts = parts < work_parts ? parts : work_parts;
  const int64_t each = (rows + parts - 1) / parts;
  return Chunks{(rows + each - 1) / each, each};
}

// Training statistics: Welford partials per row chunk into work, then the fixed-order
// Chan combine per channel.
template <typename T>
void batch_stats_cpu(const FwdArgs& a) {
  constexpr int U = kCpuRowsPerUpdate;
  const T* x = static_cast<const T*>(a.x);
  const int64_t C = a.cols, plane = a.work_parts * C;
  const Chunks ch = cpu_chunks(a.rows, a.work_parts);
  std::vector<PackWelford<1>> st(C);
  for (int64_t p = 0; p < ch.parts; ++p) {
    for (auto& s : st) s.reset();
    const int64_t r0 = p * ch.rows_each, r1 = r0 + ch.rows_each < a.rows ? r0 + ch.rows_each : a.rows;
    int64_t r = r0;
    for (; r + U <= r1; r += U)
      for (int64_t c = 0; c < C; ++c) {
        float v[U][1];
        for (int u = 0; u < U; ++u) v[u][0] = to_float(x[(r + u) * C + c]);
        st[c].add_rows<U>(v);
      }
    for (; r < r1; ++r)
      for (int64_t c = 0; c < C; ++c) {
        const float v[1][1] = {{to_float(x[r * C + c])}};
        st[c].add_rows<1>(v);
      }
    for (int64_t c = 0; c < C; ++c) {
      a.work[p * C + c] = st[c].mean[0];
      a.work[plane + p * C + c] = st[c].m2[0];
      a.work[2 * plane + p * C + c] = st[c].count;
    }
  }
  for (int64_t c = 0; c < C; ++c) {
    float n = 0.f, s = 0.f, q = 0.f;
    for (int64_t p = 0; p < ch.parts; ++p) {
      const float np = a.work[2 * plane + p * C + c];
      n += np;
      s += np * a.work[p * C + c];
    }
    const float m = s / n;
    for (int64_t p = 0; p < ch.parts; ++p)
      q += chan_m2_term(a.work[plane + p * C + c], a.work[2 * plane + p * C + c], a.work[p * C + c], m);
    a.mean[c] = m;
    a.var[c] = q / n;
    a.rstd[c] = bn_rstd(a.var[c], a.eps);
  }
}

template <typename T>
void fwd_cpu(const FwdArgs& a) {
  const int64_t C = a.cols, n = a.rows * a.cols;
  if (C == 0) return;
  if (a.training) {
    batch_stats_cpu<T>(a);
  } else {
    for (int64_t c = 0; c < C; ++c) {
      a.mean[c] = a.mean_in[c];
      a.var[c] = a.var_in[c];
      a.rstd[c] = bn_rstd(a.var_in[c], a.eps);
    }
  }
  std::vector<float> scale_rstd(C);
  for (int64_t c = 0; c < C; ++c) scale_rstd[c] = a.scale[c] * a.rstd[c];
  const T* x = static_cast<const T*>(a.x);
  const T* z = static_cast<const T*>(a.z);
  T* y = static_cast<T*>(a.y);
  int64_t c = 0;  // channel of element i
  for (int64_t w = 0; w < mask_words(n); ++w) {
    const int64_t first = w * 32, end = first + 32 < n ? first + 32 : n;
    uint32_t word = 0;
    for (int64_t i = first; i < end; ++i) {
      float pre = bn_pre(to_float(x[i]), a.mean[c], scale_rstd[c], a.bias[c]);
      if (z) pre += to_float(z[i]);
      word |= relu_bit(pre) << (i - first);
      y[i] = from_float<T>(relu_out(pre));
      c = c + 1 == C ? 0 : c + 1;
    }
    a.mask[w] = word;
  }
}

// dbias = Σg, dscale = Σg·xhat: partials per row chunk, then fixed-order sums.
template <typename T>
void grad_sums_cpu(const BwdArgs& a) {
  const int64_t C = a.cols, plane = a.work_parts * C;
  const T* dy = static_cast<const T*>(a.dy);
  const T* x = static_cast<const T*>(a.x);
  const Chunks ch = cpu_chunks(a.rows, a.work_parts);
  for (int64_t p = 0; p < ch.parts; ++p) {
    float* sum_g = a.work + p * C;
    float* sum_gx = a.work + plane + p * C;
    for (int64_t c = 0; c < C; ++c) sum_g[c] = sum_gx[c] = 0.f;
    const int64_t r0 = p * ch.rows_each, r1 = r0 + ch.rows_each < a.rows ? r0 + ch.rows_each : a.rows;
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < C; ++c) {
        const int64_t i = r * C + c;
        const float g = masked_grad(get_bit(a.mask, i), to_float(dy[i]));
        sum_g[c] += g;
        sum_gx[c] += g * bn_xhat(to_float(x[i]), a.mean[c], a.rstd[c]);
      }
  }
  for (int64_t c = 0; c < C; ++c) {
    float db = 0.f, ds = 0.f;
    for (int64_t p = 0; p < ch.parts; ++p) {
      db += a.work[p * C + c];
      ds += a.work[plane + p * C + c];
    }
    a.dbias[c] = db;
    a.dscale[c] = ds;
  }
}

// dx (and dz) from a's dscale/dbias.
template <typename T>
void dx_cpu(const BwdArgs& a) {
  const int64_t C = a.cols;
  std::vector<DxCoef> coef(C);
  for (int64_t c = 0; c < C; ++c)
    coef[c] = dx_coefficients(a.scale[c], a.rstd[c], a.dscale[c], a.dbias[c], a.training ? a.gmean[c] : 0.f,
                              a.training ? a.gvar[c] : 0.f, bwd_count(a), a.training);
  const T* dy = static_cast<const T*>(a.dy);
  const T* x = static_cast<const T*>(a.x);
  T* dx = static_cast<T*>(a.dx);
  T* dz = static_cast<T*>(a.dz);
  const int64_t n = a.rows * C;
  int64_t c = 0;  // channel of element i
  for (int64_t i = 0; i < n; ++i) {
    const T g = masked_grad(get_bit(a.mask, i), dy[i]);
    dx[i] = from_float<T>(bn_dx(coef[c], to_float(g), bn_xhat(to_float(x[i]), a.mean[c], a.rstd[c])));
    if (dz) dz[i] = g;
    c = c + 1 == C ? 0 : c + 1;
  }
}

template <typename T>
void bwd_cpu(const BwdArgs& a) {
  if (a.cols == 0) return;
  grad_sums_cpu<T>(a);
  dx_cpu<T>(a);
}

// ------------------------------------------- batch-sharded training stages ---
// Per device, the rows sharded (ops/batch_norm.py's locals): the statistics of the
// local rows (combined across devices by an all_gather and Chan's merge), then the
// forward's inference pass with the global ones; backward, the local Σg and Σg·xhat
// (psum'ed), then dx with the global sums and the global row count.
//   stats     (x) -> (mean, var, rstd, work)                  attr epsilon; work (3, P, C)
//   grad_sums (dy, x, mask, mean, rstd) -> (dscale, dbias, work)          work (2, P, C)
//   dx        (dy, x, mask, mean, rstd, scale, gmean, gvar, dscale, dbias) -> (dx, dz)
//             attrs has_z, count (the global row count N)

ffi::ErrorOr<FwdArgs> stats_args(ffi::AnyBuffer x, ffi::AnyBuffer mean, ffi::AnyBuffer var, ffi::AnyBuffer rstd,
                                 ffi::AnyBuffer work, float epsilon) {
  auto layout = channels_last(x);
  if (layout.has_error()) return layout.error();
  const Layout l = layout.value();
  JO_TRY(expect_f32_vector(mean, "mean", l.cols));
  JO_TRY(expect_f32_vector(var, "var", l.cols));
  JO_TRY(expect_f32_vector(rstd, "rstd", l.cols));
  auto parts = work_parts(work, 3, l);
  if (parts.has_error()) return parts.error();
  if (!(epsilon >= 0.f)) return ffi::Error::InvalidArgument("epsilon must be >= 0; got " + std::to_string(epsilon));
  if (l.rows == 0) return ffi::Error::InvalidArgument("batch statistics need at least one row; x has none");
  FwdArgs a{};
  a.x = x.untyped_data();
  a.mean = static_cast<float*>(mean.untyped_data());
  a.var = static_cast<float*>(var.untyped_data());
  a.rstd = static_cast<float*>(rstd.untyped_data());
  a.work = static_cast<float*>(work.untyped_data());
  a.work_parts = parts.value();
  a.rows = l.rows;
  a.cols = l.cols;
  a.eps = epsilon;
  a.training = true;
  return a;
}

ffi::ErrorOr<BwdArgs> grad_sums_args(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer mask, ffi::AnyBuffer mean,
                                     ffi::AnyBuffer rstd, ffi::AnyBuffer dscale, ffi::AnyBuffer dbias,
                                     ffi::AnyBuffer work) {
  auto args = stage_bwd_args(dy, x, mask, mean, rstd, dscale, dbias);
  if (args.has_error()) return args.error();
  BwdArgs a = args.value();
  auto parts = work_parts(work, 2, Layout{a.rows, a.cols});
  if (parts.has_error()) return parts.error();
  a.work = static_cast<float*>(work.untyped_data());
  a.work_parts = parts.value();
  return a;
}

ffi::ErrorOr<BwdArgs> dx_args(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer mask, ffi::AnyBuffer mean,
                              ffi::AnyBuffer rstd, ffi::AnyBuffer scale, ffi::AnyBuffer gmean, ffi::AnyBuffer gvar,
                              ffi::AnyBuffer dscale, ffi::AnyBuffer dbias, ffi::AnyBuffer dx, ffi::AnyBuffer dz,
                              bool has_z, float count) {
  auto args = stage_bwd_args(dy, x, mask, mean, rstd, dscale, dbias);
  if (args.has_error()) return args.error();
  BwdArgs a = args.value();
  JO_TRY(expect_f32_vector(scale, "scale", a.cols));
  JO_TRY(expect_f32_vector(gmean, "gmean", a.cols));
  JO_TRY(expect_f32_vector(gvar, "gvar", a.cols));
  JO_TRY(expect_like(dx, "dx", x, "x"));
  JO_TRY(has_z ? expect_like(dz, "dz", x, "x") : expect_empty(dz, "dz", "when has_z is false"));
  if (!(count >= float(a.rows)) || !(count > 0.f))
    return ffi::Error::InvalidArgument("count (the global row count) must be >= the local rows (" +
                                       std::to_string(a.rows) + ") and > 0; got " + std::to_string(count));
  a.scale = static_cast<const float*>(scale.untyped_data());
  a.gmean = static_cast<const float*>(gmean.untyped_data());
  a.gvar = static_cast<const float*>(gvar.untyped_data());
  a.dx = dx.untyped_data();
  a.dz = has_z ? dz.untyped_data() : nullptr;
  a.training = true;
  a.count = count;
  return a;
}

ffi::Error BnReluFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer z, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                        ffi::AnyBuffer mean_in, ffi::AnyBuffer var_in, ffi::Result<ffi::AnyBuffer> y,
                        ffi::Result<ffi::AnyBuffer> mask, ffi::Result<ffi::AnyBuffer> mean,
                        ffi::Result<ffi::AnyBuffer> var, ffi::Result<ffi::AnyBuffer> rstd,
                        ffi::Result<ffi::AnyBuffer> work, float epsilon, bool training, bool has_z) {
  auto args = fwd_args(x, z, scale, bias, mean_in, var_in, *y, *mask, *mean, *var, *rstd, *work, epsilon, training,
                       has_z);
  if (args.has_error()) return args.error();
  return dispatch_activation(x.element_type(), "x", [&](auto t) {
    fwd_cpu<decltype(t)>(args.value());
    return ffi::Error::Success();
  });
}

ffi::Error BnReluBwdCpu(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer mask, ffi::AnyBuffer mean,
                        ffi::AnyBuffer rstd, ffi::AnyBuffer scale, ffi::AnyBuffer gmean, ffi::AnyBuffer gvar,
                        ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dz,
                        ffi::Result<ffi::AnyBuffer> dscale, ffi::Result<ffi::AnyBuffer> dbias,
                        ffi::Result<ffi::AnyBuffer> work, bool training, bool has_z) {
  auto args = bwd_args(dy, x, mask, mean, rstd, scale, gmean, gvar, *dx, *dz, *dscale, *dbias, *work, training,
                       has_z);
  if (args.has_error()) return args.error();
  return dispatch_activation(x.element_type(), "x", [&](auto t) {
    bwd_cpu<decltype(t)>(args.value());
    return ffi::Error::Success();
  });
}

ffi::Error BnStatsCpu(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> var,
                      ffi::Result<ffi::AnyBuffer> rstd, ffi::Result<ffi::AnyBuffer> work, float epsilon) {
  auto args = stats_args(x, *mean, *var, *rstd, *work, epsilon);
  if (args.has_error()) return args.error();
  return dispatch_activation(x.element_type(), "x", [&](auto t) {
    if (args.value().cols > 0) batch_stats_cpu<decltype(t)>(args.value());
    return ffi::Error::Success();
  });
}

ffi::Error BnGradSumsCpu(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer mask, ffi::AnyBuffer mean,
                         ffi::AnyBuffer rstd, ffi::Result<ffi::AnyBuffer> dscale, ffi::Result<ffi::AnyBuffer> dbias,
                         ffi::Result<ffi::AnyBuffer> work) {
  auto args = grad_sums_args(dy, x, mask, mean, rstd, *dscale, *dbias, *work);
  if (args.has_error()) return args.error();
  return dispatch_activation(x.element_type(), "x", [&](auto t) {
    grad_sums_cpu<decltype(t)>(args.value());
    return ffi::Error::Success();
  });
}

ffi::Error BnDxCpu(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer mask, ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                   ffi::AnyBuffer scale, ffi::AnyBuffer gmean, ffi::AnyBuffer gvar, ffi::AnyBuffer dscale,
                   ffi::AnyBuffer dbias, ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dz, bool has_z,
                   float count) {
  auto args = dx_args(dy, x, mask, mean, rstd, scale, gmean, gvar, dscale, dbias, *dx, *dz, has_z, count);
  if (args.has_error()) return args.error();
  return dispatch_activation(x.element_type(), "x", [&](auto t) {
    dx_cpu<decltype(t)>(args.value());
    return ffi::Error::Success();
  });
}

#ifdef JAX_OPS_WITH_CUDA
// ------------------------------------------------------------------ CUDA ---

ffi::Error BnReluFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer z, ffi::AnyBuffer scale,
                         ffi::AnyBuffer bias, ffi::AnyBuffer mean_in, ffi::AnyBuffer var_in,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> mask,
                         ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> var,
                         ffi::Result<ffi::AnyBuffer> rstd, ffi::Result<ffi::AnyBuffer> work, float epsilon,
                         bool training, bool has_z) {
  auto args = fwd_args(x, z, scale, bias, mean_in, var_in, *y, *mask, *mean, *var, *rstd, *work, epsilon, training,
                       has_z);
  if (args.has_error()) return args.error();
  return dispatch_activation(x.element_type(), "x", [&](auto t) {
    return cuda_status(launch_fwd<decltype(t)>(args.value(), stream), "jax_ops_bn_relu_fwd");
  });
}

ffi::Error BnReluBwdCuda(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer mask,
                         ffi::AnyBuffer mean, ffi::AnyBuffer rstd, ffi::AnyBuffer scale, ffi::AnyBuffer gmean,
                         ffi::AnyBuffer gvar, ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dz,
                         ffi::Result<ffi::AnyBuffer> dscale, ffi::Result<ffi::AnyBuffer> dbias,
                         ffi::Result<ffi::AnyBuffer> work, bool training, bool has_z) {
  auto args = bwd_args(dy, x, mask, mean, rstd, scale, gmean, gvar, *dx, *dz, *dscale, *dbias, *work, training,
                       has_z);
  if (args.has_error()) return args.error();
  return dispatch_activation(x.element_type(), "x", [&](auto t) {
    return cuda_status(launch_bwd<decltype(t)>(args.value(), stream), "jax_ops_bn_relu_bwd");
  });
}

ffi::Error BnStatsCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> mean,
                       ffi::Result<ffi::AnyBuffer> var, ffi::Result<ffi::AnyBuffer> rstd,
                       ffi::Result<ffi::AnyBuffer> work, float epsilon) {
  auto args = stats_args(x, *mean, *var, *rstd, *work, epsilon);
  if (args.has_error()) return args.error();
  return dispatch_activation(x.element_type(), "x", [&](auto t) {
    return cuda_status(launch_stats<decltype(t)>(args.value(), stream), "jax_ops_bn_stats");
  });
}

ffi::Error BnGradSumsCuda(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer mask,
                          ffi::AnyBuffer mean, ffi::AnyBuffer rstd, ffi::Result<ffi::AnyBuffer> dscale,
                          ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> work) {
  auto args = grad_sums_args(dy, x, mask, mean, rstd, *dscale, *dbias, *work);
  if (args.has_error()) return args.error();
  return dispatch_activation(x.element_type(), "x", [&](auto t) {
    return cuda_status(launch_grad_sums<decltype(t)>(args.value(), stream), "jax_ops_bn_grad_sums");
  });
}

ffi::Error BnDxCuda(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer mask,
                    ffi::AnyBuffer mean, ffi::AnyBuffer rstd, ffi::AnyBuffer scale, ffi::AnyBuffer gmean,
                    ffi::AnyBuffer gvar, ffi::AnyBuffer dscale, ffi::AnyBuffer dbias, ffi::Result<ffi::AnyBuffer> dx,
                    ffi::Result<ffi::AnyBuffer> dz, bool has_z, float count) {
  auto args = dx_args(dy, x, mask, mean, rstd, scale, gmean, gvar, dscale, dbias, *dx, *dz, has_z, count);
  if (args.has_error()) return args.error();
  return dispatch_activation(x.element_type(), "x", [&](auto t) {
    return cuda_status(launch_dx_any<decltype(t)>(args.value(), stream), "jax_ops_bn_dx");
  });
}
#endif

}  // namespace
}  // namespace jax_ops::bn

namespace ffi = xla::ffi;

#define JO_BN_RELU_FWD_SIGNATURE(bind)                                                                          \
  bind.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()                  \
      .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()                                                              \
      .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()                  \
      .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()                                                              \
      .Attr<float>("epsilon").Attr<bool>("training").Attr<bool>("has_z")
#define JO_BN_RELU_BWD_SIGNATURE(bind)                                                                          \
  bind.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()                  \
      .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()                  \
      .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()                  \
      .Ret<ffi::AnyBuffer>()                                                                                    \
      .Attr<bool>("training").Attr<bool>("has_z")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsBnReluFwdCpu, jax_ops::bn::BnReluFwdCpu, JO_BN_RELU_FWD_SIGNATURE(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsBnReluBwdCpu, jax_ops::bn::BnReluBwdCpu, JO_BN_RELU_BWD_SIGNATURE(ffi::Ffi::Bind()));
#ifdef JAX_OPS_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsBnReluFwdCuda, jax_ops::bn::BnReluFwdCuda,
                              JO_BN_RELU_FWD_SIGNATURE(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()), JO_CUDA_TRAITS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsBnReluBwdCuda, jax_ops::bn::BnReluBwdCuda,
                              JO_BN_RELU_BWD_SIGNATURE(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()), JO_CUDA_TRAITS);
#endif

#define JO_BN_STATS_SIGNATURE(bind)                                                                             \
  bind.Arg<ffi::AnyBuffer>()                                                                                    \
      .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()                  \
      .Attr<float>("epsilon")
#define JO_BN_GRAD_SUMS_SIGNATURE(bind)                                                                         \
  bind.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()                  \
      .Arg<ffi::AnyBuffer>()                                                                                    \
      .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
#define JO_BN_DX_SIGNATURE(bind)                                                                                \
  bind.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()                  \
      .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()                  \
      .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()                                                              \
      .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()                                                              \
      .Attr<bool>("has_z").Attr<float>("count")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsBnStatsCpu, jax_ops::bn::BnStatsCpu, JO_BN_STATS_SIGNATURE(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsBnGradSumsCpu, jax_ops::bn::BnGradSumsCpu,
                              JO_BN_GRAD_SUMS_SIGNATURE(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsBnDxCpu, jax_ops::bn::BnDxCpu, JO_BN_DX_SIGNATURE(ffi::Ffi::Bind()));
#ifdef JAX_OPS_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsBnStatsCuda, jax_ops::bn::BnStatsCuda,
                              JO_BN_STATS_SIGNATURE(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()), JO_CUDA_TRAITS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsBnGradSumsCuda, jax_ops::bn::BnGradSumsCuda,
                              JO_BN_GRAD_SUMS_SIGNATURE(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              JO_CUDA_TRAITS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsBnDxCuda, jax_ops::bn::BnDxCuda,
                              JO_BN_DX_SIGNATURE(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()), JO_CUDA_TRAITS);
#endif
