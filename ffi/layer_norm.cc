// XLA FFI handlers of the LayerNorm/RMSNorm family ("jax_ops_norm_fwd",
// "jax_ops_norm_bwd"): CPU always, CUDA when this file is compiled by nvcc.
// Absent operands/results (no scale, no bias, statistics not wanted, no
// residual/h/dh outside add+norm) are passed as zero-element buffers. The
// backward's last result is a float32 workspace for the CUDA kernels'
// dscale/dbias partials (unused on CPU).
//   fwd: (x, residual, scale, bias) -> (y, h, mean, rstd)
//   bwd: (dy, dh, x, mean, rstd, scale) -> (dx, dscale, dbias, workspace)
// add+norm: h = x + residual (rounded to x's dtype) is written and normalized;
// the backward's x is that h and dx = norm_backward(dy, h) + dh.
#include <cmath>
#include <vector>
#include "ffi/common.h"
#include "ffi/handlers.h"
#include "cuda_src/norm_math.h"
#ifdef JAX_OPS_WITH_CUDA
#include "cuda_src/layer_norm.cuh"
#endif

namespace jax_ops::norm {
namespace {

// Validates shapes and dtypes shared by both platforms; fills args.
struct Shape2D { int64_t rows, cols; };

ffi::ErrorOr<Shape2D> rows_cols(const ffi::AnyBuffer& x, const char* name) {
  const auto d = x.dimensions();
  if (d.size() < 1) return ffi::Error::InvalidArgument(std::string(name) + " must have rank >= 1; got a scalar");
  if (d.back() < 1)
    return ffi::Error::InvalidArgument(std::string(name) + "'s last axis must have size >= 1; got shape " + dims_str(d));
  Shape2D s{1, d.back()};
  for (size_t i = 0; i + 1 < d.size(); ++i) s.rows *= d[i];
  return s;
}

ffi::Error expect_count(const ffi::AnyBuffer& b, const char* name, int64_t want, bool optional) {
  const int64_t n = int64_t(b.element_count());
  if (n == want || (optional && n == 0)) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(name) + " has shape " + dims_str(b.dimensions()) +
                                     "; expected " + std::to_string(want) + " elements" +
                                     (optional ? " (or 0 when absent)" : ""));
}

ffi::Error expect_f32(const ffi::AnyBuffer& b, const char* name) {
  if (b.element_count() == 0 || b.element_type() == ffi::DataType::F32) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(name) + " must be float32; got " + dtype_name(b.element_type()));
}

#define JO_RETURN_IF_ERROR(expr)              \
  do {                                        \
    ffi::Error _e = (expr);                   \
    if (_e.failure()) return _e;              \
  } while (0)

// Parameter dtype: that of scale, else bias, else float32 (no parameters).
ffi::ErrorOr<ffi::DataType> param_dtype(const ffi::AnyBuffer& scale, const ffi::AnyBuffer& bias) {
  const bool has_s = scale.element_count() > 0, has_b = bias.element_count() > 0;
  if (has_s && has_b && scale.element_type() != bias.element_type())
    return ffi::Error::InvalidArgument(std::string("scale (") + dtype_name(scale.element_type()) +
                                       ") and bias (" + dtype_name(bias.element_type()) + ") must share a dtype");
  return has_s ? scale.element_type() : has_b ? bias.element_type() : ffi::DataType::F32;
}

// An optional buffer like x: absent (0 elements) or x's element count and dtype.
ffi::Error expect_like_x(const ffi::AnyBuffer& b, const char* name, const ffi::AnyBuffer& x) {
  if (b.element_count() == 0) return ffi::Error::Success();  // absent (or x is empty too)
  if (b.element_count() == x.element_count() && b.element_type() == x.element_type()) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(name) + " must match x (" + dims_str(x.dimensions()) + " " +
                                     dtype_name(x.element_type()) + ") or be absent; got " +
                                     dims_str(b.dimensions()) + " " + dtype_name(b.element_type()));
}

ffi::ErrorOr<FwdAddArgs> fwd_args(ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer scale,
                               ffi::AnyBuffer bias, ffi::AnyBuffer y, ffi::AnyBuffer h,
                               ffi::AnyBuffer mean, ffi::AnyBuffer rstd, float eps, bool rms) {
  auto shape = rows_cols(x, "x");
  if (shape.has_error()) return shape.error();
  const auto [rows, cols] = shape.value();
  if (y.element_type() != x.element_type() || y.element_count() != x.element_count())
    return ffi::Error::InvalidArgument("y must match x in shape and dtype");
  JO_RETURN_IF_ERROR(expect_like_x(residual, "residual", x));
  JO_RETURN_IF_ERROR(expect_like_x(h, "h", x));
  if ((residual.element_count() == 0) != (h.element_count() == 0))
    return ffi::Error::InvalidArgument("residual and h must be both present (add+norm) or both absent");
  const bool add = residual.element_count() > 0;
  JO_RETURN_IF_ERROR(expect_count(scale, "scale", cols, true));
  JO_RETURN_IF_ERROR(expect_count(bias, "bias", cols, true));
  JO_RETURN_IF_ERROR(expect_count(mean, "mean", rows, true));
  JO_RETURN_IF_ERROR(expect_count(rstd, "rstd", rows, true));
  JO_RETURN_IF_ERROR(expect_f32(mean, "mean"));
  JO_RETURN_IF_ERROR(expect_f32(rstd, "rstd"));
  if (!(eps >= 0.f)) return ffi::Error::InvalidArgument("epsilon must be >= 0");
  const bool stats = rstd.element_count() > 0 && rows > 0;
  return FwdAddArgs{{x.untyped_data(), y.untyped_data(),
                 scale.element_count() ? scale.untyped_data() : nullptr,
                 bias.element_count() ? bias.untyped_data() : nullptr,
                 (stats && mean.element_count()) ? static_cast<float*>(mean.untyped_data()) : nullptr,
                 stats ? static_cast<float*>(rstd.untyped_data()) : nullptr,
                 rows, cols, eps, rms},
                    add ? residual.untyped_data() : nullptr, add ? h.untyped_data() : nullptr};
}

// Rows P of the [arrays, P, cols] float32 workspace: one array for each of dscale and
// dbias that is wanted (dscale's first).
int64_t partial_rows(ffi::AnyBuffer work, ffi::AnyBuffer dscale, ffi::AnyBuffer dbias, int64_t cols) {
  const int64_t arrays = (dscale.element_count() ? 1 : 0) + (dbias.element_count() ? 1 : 0);
  return arrays && cols ? int64_t(work.element_count()) / (arrays * cols) : 0;
}

ffi::ErrorOr<BwdAddArgs> bwd_args(ffi::AnyBuffer dy, ffi::AnyBuffer dh, ffi::AnyBuffer x,
                               ffi::AnyBuffer mean, ffi::AnyBuffer rstd, ffi::AnyBuffer scale,
                               ffi::AnyBuffer dx, ffi::AnyBuffer dscale, ffi::AnyBuffer dbias,
                               ffi::AnyBuffer work, bool rms) {
  auto shape = rows_cols(x, "x");
  if (shape.has_error()) return shape.error();
  const auto [rows, cols] = shape.value();
  if (dy.element_type() != x.element_type() || dy.element_count() != x.element_count())
    return ffi::Error::InvalidArgument("dy must match x in shape and dtype");
  if (dx.element_type() != x.element_type() || dx.element_count() != x.element_count())
    return ffi::Error::InvalidArgument("dx must match x in shape and dtype");
  JO_RETURN_IF_ERROR(expect_like_x(dh, "dh", x));
  JO_RETURN_IF_ERROR(expect_count(mean, "mean", rows, rms));
  JO_RETURN_IF_ERROR(expect_count(rstd, "rstd", rows, false));
  JO_RETURN_IF_ERROR(expect_f32(mean, "mean"));
  JO_RETURN_IF_ERROR(expect_f32(rstd, "rstd"));
  JO_RETURN_IF_ERROR(expect_count(scale, "scale", cols, true));
  JO_RETURN_IF_ERROR(expect_count(dscale, "dscale", cols, true));
  JO_RETURN_IF_ERROR(expect_count(dbias, "dbias", cols, true));
  if (dscale.element_count() && (!scale.element_count() || dscale.element_type() != scale.element_type()))
    return ffi::Error::InvalidArgument("dscale needs scale, in scale's dtype");
  if (dbias.element_count() && scale.element_count() && dbias.element_type() != scale.element_type())
    return ffi::Error::InvalidArgument(std::string("dbias (") + dtype_name(dbias.element_type()) +
                                       ") must have scale's dtype (" + dtype_name(scale.element_type()) + ")");
  JO_RETURN_IF_ERROR(expect_f32(work, "workspace"));
  const int64_t work_rows = partial_rows(work, dscale, dbias, cols);
  if ((dscale.element_count() || dbias.element_count()) && rows > 0 && work_rows < 1)
    return ffi::Error::InvalidArgument("workspace too small for the dscale/dbias partials");
  return BwdAddArgs{{dy.untyped_data(), x.untyped_data(),
                 rms ? nullptr : static_cast<const float*>(mean.untyped_data()),
                 static_cast<const float*>(rstd.untyped_data()),
                 scale.element_count() ? scale.untyped_data() : nullptr,
                 dx.untyped_data(),
                 dscale.element_count() ? dscale.untyped_data() : nullptr,
                 dbias.element_count() ? dbias.untyped_data() : nullptr,
                 rows, cols, rms, static_cast<float*>(work.untyped_data()), work_rows},
                    dh.element_count() ? dh.untyped_data() : nullptr};
}

// Parameter dtype of the backward: scale's, else dbias's, else float32.
ffi::DataType bwd_param_dtype(const ffi::AnyBuffer& scale, const ffi::AnyBuffer& dbias) {
  return scale.element_count() ? scale.element_type()
         : dbias.element_count() ? dbias.element_type() : ffi::DataType::F32;
}

// ------------------------------------------------------------------- CPU ---

// Row r of what the CPU forward normalizes: x, or for add+norm h = x + residual
// (rounded to T), written to h first.
template <typename T>
const T* row_to_normalize(const T* x, const void* residual, void* h, int64_t r, int64_t cols) {
  const T* xr = x + r * cols;
  if (residual == nullptr) return xr;
  const T* res = static_cast<const T*>(residual) + r * cols;
  T* hr = static_cast<T*>(h) + r * cols;
  for (int64_t c = 0; c < cols; ++c) hr[c] = add_rounded(xr[c], res[c]);
  return hr;
}

template <typename T, typename P>
void fwd_cpu(const FwdAddArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  T* y = static_cast<T*>(a.y);
  const P* scale = static_cast<const P*>(a.scale);
  const P* bias = static_cast<const P*>(a.bias);
  for (int64_t r = 0; r < a.rows; ++r) {
    const T* xr = row_to_normalize(x, a.residual, a.h, r, a.cols);
    NormAcc acc;
    for (int64_t c = 0; c < a.cols; ++c) acc.add(to_float(xr[c]), a.rms);
    const RowStats st = finish_stats(acc, a.cols, a.eps, a.rms);
    for (int64_t c = 0; c < a.cols; ++c)
      y[r * a.cols + c] = from_float<T>(norm_out(to_float(xr[c]), st, scale ? to_float(scale[c]) : 1.f,
                                                 bias ? to_float(bias[c]) : 0.f));
    if (a.rstd) {
      if (a.mean) a.mean[r] = st.mean;
      a.rstd[r] = st.rstd;
    }
  }
}

template <typename T, typename P>
void bwd_cpu(const BwdAddArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  T* dx = static_cast<T*>(a.dx);
  const P* scale = static_cast<const P*>(a.scale);
  std::vector<double> ds(a.dscale ? a.cols : 0, 0.0), db(a.dbias ? a.cols : 0, 0.0);
  std::vector<float> xh(a.cols), g(a.cols);
  const float inv_n = 1.f / float(a.cols);
  for (int64_t r = 0; r < a.rows; ++r) {
    const float mean = a.rms ? 0.f : a.mean[r], rstd = a.rstd[r];
    float sum_g = 0.f, sum_gx = 0.f;
    for (int64_t c = 0; c < a.cols; ++c) {
      const float d = to_float(dy[r * a.cols + c]);
      xh[c] = (to_float(x[r * a.cols + c]) - mean) * rstd;
      g[c] = d * (scale ? to_float(scale[c]) : 1.f);
      sum_g += g[c];
      sum_gx += g[c] * xh[c];
      if (a.dscale) ds[c] += double(d) * xh[c];
      if (a.dbias) db[c] += d;
    }
    const float mg = a.rms ? 0.f : sum_g * inv_n, mgx = sum_gx * inv_n;
    const T* dh = a.dh ? static_cast<const T*>(a.dh) + r * a.cols : nullptr;
    for (int64_t c = 0; c < a.cols; ++c)
      dx[r * a.cols + c] = from_float<T>(norm_dx(g[c], xh[c], rstd, mg, mgx) + (dh ? to_float(dh[c]) : 0.f));
  }
  for (int64_t c = 0; c < int64_t(ds.size()); ++c) static_cast<P*>(a.dscale)[c] = from_float<P>(float(ds[c]));
  for (int64_t c = 0; c < int64_t(db.size()); ++c) static_cast<P*>(a.dbias)[c] = from_float<P>(float(db[c]));
}

// Checks the operands, then calls run(T{}, P{}, args) with the storage types of x and
// of the parameters: the CPU and CUDA handlers differ only in `run`.
template <typename Run>
ffi::Error with_fwd_args(ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                         ffi::AnyBuffer y, ffi::AnyBuffer h, ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                         float epsilon, bool rms, Run&& run) {
  auto args = fwd_args(x, residual, scale, bias, y, h, mean, rstd, epsilon, rms);
  if (args.has_error()) return args.error();
  auto pt = param_dtype(scale, bias);
  if (pt.has_error()) return pt.error();
  return dispatch_act_param(x.element_type(), pt.value(), [&](auto t, auto p) { return run(t, p, args.value()); });
}

template <typename Run>
ffi::Error with_bwd_args(ffi::AnyBuffer dy, ffi::AnyBuffer dh, ffi::AnyBuffer x, ffi::AnyBuffer mean,
                         ffi::AnyBuffer rstd, ffi::AnyBuffer scale, ffi::AnyBuffer dx, ffi::AnyBuffer dscale,
                         ffi::AnyBuffer dbias, ffi::AnyBuffer work, bool rms, Run&& run) {
  auto args = bwd_args(dy, dh, x, mean, rstd, scale, dx, dscale, dbias, work, rms);
  if (args.has_error()) return args.error();
  return dispatch_act_param(x.element_type(), bwd_param_dtype(scale, dbias),
                            [&](auto t, auto p) { return run(t, p, args.value()); });
}

ffi::Error NormFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                      ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> h,
                      ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd, float epsilon,
                      bool rms) {
  return with_fwd_args(x, residual, scale, bias, *y, *h, *mean, *rstd, epsilon, rms,
                       [](auto t, auto p, const FwdAddArgs& a) {
                         fwd_cpu<decltype(t), decltype(p)>(a);
                         return ffi::Error::Success();
                       });
}

ffi::Error NormBwdCpu(ffi::AnyBuffer dy, ffi::AnyBuffer dh, ffi::AnyBuffer x, ffi::AnyBuffer mean,
                      ffi::AnyBuffer rstd, ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> dx,
                      ffi::Result<ffi::AnyBuffer> dscale, ffi::Result<ffi::AnyBuffer> dbias,
                      ffi::Result<ffi::AnyBuffer> work, bool rms) {
  return with_bwd_args(dy, dh, x, mean, rstd, scale, *dx, *dscale, *dbias, *work, rms,
                       [](auto t, auto p, const BwdAddArgs& a) {
                         bwd_cpu<decltype(t), decltype(p)>(a);
                         return ffi::Error::Success();
                       });
}

#ifdef JAX_OPS_WITH_CUDA
// ------------------------------------------------------------------ CUDA ---

ffi::Error NormFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer scale,
                       ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> h,
                       ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd, float epsilon,
                       bool rms) {
  return with_fwd_args(x, residual, scale, bias, *y, *h, *mean, *rstd, epsilon, rms,
                       [stream](auto t, auto p, const FwdAddArgs& a) {
                         return cuda_status(launch_fwd<decltype(t), decltype(p)>(a, stream), "jax_ops_norm_fwd");
                       });
}

ffi::Error NormBwdCuda(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer dh, ffi::AnyBuffer x,
                       ffi::AnyBuffer mean, ffi::AnyBuffer rstd, ffi::AnyBuffer scale,
                       ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dscale,
                       ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> work, bool rms) {
  return with_bwd_args(dy, dh, x, mean, rstd, scale, *dx, *dscale, *dbias, *work, rms,
                       [stream](auto t, auto p, const BwdAddArgs& a) {
                         return cuda_status(launch_bwd<decltype(t), decltype(p)>(a, stream), "jax_ops_norm_bwd");
                       });
}
#endif


// -------------------------------------------- hidden-sharded stages (issue 23) ---
// The per-device stages of a norm whose normalized axis is split over devices
// (cuda_src/norm_math.h). Operands/results like the ones above; absent ones are
// zero-element buffers.
//   partials:     (x, residual) -> (mean, m2, h)                    attr rms
//   apply:        (x, mean, rstd, scale, bias) -> (y)
//   bwd partials: (dy, x, mean, rstd, scale) -> (sum_g, sum_gx)     attr rms
//   bwd apply:    (dy, dh, x, mean, rstd, scale, sum_g, sum_gx) -> (dx, dscale, dbias, workspace)
//                 attrs rms, inv_n (1 / the whole row's length); dscale/dbias float32

// A float32 per-row buffer: `rows` elements, or absent (0) where `optional`.
ffi::Error expect_rows_f32(const ffi::AnyBuffer& b, const char* name, int64_t rows, bool optional) {
  JO_RETURN_IF_ERROR(expect_count(b, name, rows, optional));
  return expect_f32(b, name);
}

template <typename Ptr>
Ptr ptr_or_null(const ffi::AnyBuffer& b) {
  return b.element_count() ? static_cast<Ptr>(b.untyped_data()) : nullptr;
}

ffi::ErrorOr<PartArgs> part_args(ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer mean, ffi::AnyBuffer m2,
                                 ffi::AnyBuffer h, bool rms) {
  auto shape = rows_cols(x, "x");
  if (shape.has_error()) return shape.error();
  const auto [rows, cols] = shape.value();
  JO_RETURN_IF_ERROR(expect_like_x(residual, "residual", x));
  JO_RETURN_IF_ERROR(expect_like_x(h, "h", x));
  if ((residual.element_count() == 0) != (h.element_count() == 0))
    return ffi::Error::InvalidArgument("residual and h must be both present (add+norm) or both absent");
  JO_RETURN_IF_ERROR(expect_rows_f32(m2, "m2", rows, false));
  JO_RETURN_IF_ERROR(expect_rows_f32(mean, "mean", rms ? 0 : rows, false));
  return PartArgs{x.untyped_data(), ptr_or_null<const void*>(residual), ptr_or_null<void*>(h),
                  ptr_or_null<float*>(mean), static_cast<float*>(m2.untyped_data()), rows, cols, rms};
}

ffi::ErrorOr<ApplyArgs> apply_args(ffi::AnyBuffer x, ffi::AnyBuffer mean, ffi::AnyBuffer rstd, ffi::AnyBuffer scale,
                                   ffi::AnyBuffer bias, ffi::AnyBuffer y) {
  auto shape = rows_cols(x, "x");
  if (shape.has_error()) return shape.error();
  const auto [rows, cols] = shape.value();
  if (y.element_type() != x.element_type() || y.element_count() != x.element_count())
    return ffi::Error::InvalidArgument("y must match x in shape and dtype");
  JO_RETURN_IF_ERROR(expect_rows_f32(mean, "mean", rows, true));
  JO_RETURN_IF_ERROR(expect_rows_f32(rstd, "rstd", rows, false));
  JO_RETURN_IF_ERROR(expect_count(scale, "scale", cols, true));
  JO_RETURN_IF_ERROR(expect_count(bias, "bias", cols, true));
  return ApplyArgs{x.untyped_data(), ptr_or_null<const float*>(mean), static_cast<const float*>(rstd.untyped_data()),
                   ptr_or_null<const void*>(scale), ptr_or_null<const void*>(bias), y.untyped_data(), rows, cols};
}

ffi::ErrorOr<BwdPartArgs> bwd_part_args(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                                        ffi::AnyBuffer scale, ffi::AnyBuffer sum_g, ffi::AnyBuffer sum_gx, bool rms) {
  auto shape = rows_cols(x, "x");
  if (shape.has_error()) return shape.error();
  const auto [rows, cols] = shape.value();
  if (dy.element_type() != x.element_type() || dy.element_count() != x.element_count())
    return ffi::Error::InvalidArgument("dy must match x in shape and dtype");
  JO_RETURN_IF_ERROR(expect_rows_f32(mean, "mean", rms ? 0 : rows, false));
  JO_RETURN_IF_ERROR(expect_rows_f32(rstd, "rstd", rows, false));
  JO_RETURN_IF_ERROR(expect_count(scale, "scale", cols, true));
  JO_RETURN_IF_ERROR(expect_rows_f32(sum_g, "sum_g", rms ? 0 : rows, false));
  JO_RETURN_IF_ERROR(expect_rows_f32(sum_gx, "sum_gx", rows, false));
  return BwdPartArgs{dy.untyped_data(), x.untyped_data(), ptr_or_null<const float*>(mean),
                     static_cast<const float*>(rstd.untyped_data()), ptr_or_null<const void*>(scale),
                     ptr_or_null<float*>(sum_g), static_cast<float*>(sum_gx.untyped_data()), rows, cols};
}

ffi::ErrorOr<BwdApplyArgs> bwd_apply_args(ffi::AnyBuffer dy, ffi::AnyBuffer dh, ffi::AnyBuffer x, ffi::AnyBuffer mean,
                                          ffi::AnyBuffer rstd, ffi::AnyBuffer scale, ffi::AnyBuffer sum_g,
                                          ffi::AnyBuffer sum_gx, ffi::AnyBuffer dx, ffi::AnyBuffer dscale,
                                          ffi::AnyBuffer dbias, ffi::AnyBuffer work, bool rms, float inv_n) {
  auto shape = rows_cols(x, "x");
  if (shape.has_error()) return shape.error();
  const auto [rows, cols] = shape.value();
  if (dy.element_type() != x.element_type() || dy.element_count() != x.element_count())
    return ffi::Error::InvalidArgument("dy must match x in shape and dtype");
  if (dx.element_type() != x.element_type() || dx.element_count() != x.element_count())
    return ffi::Error::InvalidArgument("dx must match x in shape and dtype");
  JO_RETURN_IF_ERROR(expect_like_x(dh, "dh", x));
  JO_RETURN_IF_ERROR(expect_rows_f32(mean, "mean", rms ? 0 : rows, false));
  JO_RETURN_IF_ERROR(expect_rows_f32(rstd, "rstd", rows, false));
  JO_RETURN_IF_ERROR(expect_count(scale, "scale", cols, true));
  JO_RETURN_IF_ERROR(expect_rows_f32(sum_g, "sum_g", rms ? 0 : rows, false));
  JO_RETURN_IF_ERROR(expect_rows_f32(sum_gx, "sum_gx", rows, false));
  JO_RETURN_IF_ERROR(expect_count(dscale, "dscale", cols, true));
  JO_RETURN_IF_ERROR(expect_count(dbias, "dbias", cols, true));
  JO_RETURN_IF_ERROR(expect_f32(dscale, "dscale"));
  JO_RETURN_IF_ERROR(expect_f32(dbias, "dbias"));
  JO_RETURN_IF_ERROR(expect_f32(work, "workspace"));
  if (!(inv_n > 0.f)) return ffi::Error::InvalidArgument("inv_n (1 / the row length) must be > 0");
  const int64_t work_rows = partial_rows(work, dscale, dbias, cols);
  if ((dscale.element_count() || dbias.element_count()) && rows > 0 && work_rows < 1)
    return ffi::Error::InvalidArgument("workspace too small for the dscale/dbias partials");
  return BwdApplyArgs{dy.untyped_data(), ptr_or_null<const void*>(dh), x.untyped_data(),
                      ptr_or_null<const float*>(mean), static_cast<const float*>(rstd.untyped_data()),
                      ptr_or_null<const void*>(scale), ptr_or_null<const float*>(sum_g),
                      static_cast<const float*>(sum_gx.untyped_data()), dx.untyped_data(),
                      ptr_or_null<float*>(dscale), ptr_or_null<float*>(dbias), rows, cols, inv_n,
                      static_cast<float*>(work.untyped_data()), work_rows};
}

template <typename T>
void part_cpu(const PartArgs& a) {
  for (int64_t r = 0; r < a.rows; ++r) {
    const T* xr = row_to_normalize(static_cast<const T*>(a.x), a.residual, a.h, r, a.cols);
    NormAcc acc;
    for (int64_t c = 0; c < a.cols; ++c) acc.add(to_float(xr[c]), a.rms);
    if (a.mean) a.mean[r] = acc.mean;
    a.m2[r] = acc.m2;
  }
}

template <typename T, typename P>
void apply_cpu(const ApplyArgs& a) {
  const P* scale = static_cast<const P*>(a.scale);
  const P* bias = static_cast<const P*>(a.bias);
  for (int64_t r = 0; r < a.rows; ++r) {
    const RowStats st{a.mean ? a.mean[r] : 0.f, a.rstd[r]};
    const T* xr = static_cast<const T*>(a.x) + r * a.cols;
    T* yr = static_cast<T*>(a.y) + r * a.cols;
    for (int64_t c = 0; c < a.cols; ++c)
      yr[c] = from_float<T>(norm_out(to_float(xr[c]), st, scale ? to_float(scale[c]) : 1.f, bias ? to_float(bias[c]) : 0.f));
  }
}

template <typename T, typename P>
void bwd_part_cpu(const BwdPartArgs& a) {
  const P* scale = static_cast<const P*>(a.scale);
  for (int64_t r = 0; r < a.rows; ++r) {
    const float mean = a.mean ? a.mean[r] : 0.f, rstd = a.rstd[r];
    const T* xr = static_cast<const T*>(a.x) + r * a.cols;
    const T* dyr = static_cast<const T*>(a.dy) + r * a.cols;
    float sg = 0.f, sgx = 0.f;
    for (int64_t c = 0; c < a.cols; ++c) {
      const float g = to_float(dyr[c]) * (scale ? to_float(scale[c]) : 1.f);
      sg += g;
      sgx += g * ((to_float(xr[c]) - mean) * rstd);
    }
    if (a.sum_g) a.sum_g[r] = sg;
    a.sum_gx[r] = sgx;
  }
}

template <typename T, typename P>
void bwd_apply_cpu(const BwdApplyArgs& a) {
  const P* scale = static_cast<const P*>(a.scale);
  std::vector<double> ds(a.dscale ? a.cols : 0, 0.0), db(a.dbias ? a.cols : 0, 0.0);
  for (int64_t r = 0; r < a.rows; ++r) {
    const float mean = a.mean ? a.mean[r] : 0.f, rstd = a.rstd[r];
    const float mg = a.sum_g ? a.sum_g[r] * a.inv_n : 0.f, mgx = a.sum_gx[r] * a.inv_n;
    const T* xr = static_cast<const T*>(a.x) + r * a.cols;
    const T* dyr = static_cast<const T*>(a.dy) + r * a.cols;
    const T* dhr = a.dh ? static_cast<const T*>(a.dh) + r * a.cols : nullptr;
    T* dxr = static_cast<T*>(a.dx) + r * a.cols;
    for (int64_t c = 0; c < a.cols; ++c) {
      const float d = to_float(dyr[c]), xhat = (to_float(xr[c]) - mean) * rstd;
      const float g = d * (scale ? to_float(scale[c]) : 1.f);
      dxr[c] = from_float<T>(norm_dx(g, xhat, rstd, mg, mgx) + (dhr ? to_float(dhr[c]) : 0.f));
      if (a.dscale) ds[c] += double(d) * xhat;
      if (a.dbias) db[c] += d;
    }
  }
  for (int64_t c = 0; c < int64_t(ds.size()); ++c) a.dscale[c] = float(ds[c]);
  for (int64_t c = 0; c < int64_t(db.size()); ++c) a.dbias[c] = float(db[c]);
}

// Each stage handler: parse, dispatch on the storage types, then run(T{}, P{}, args).
template <typename Run>
ffi::Error with_part_args(ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer mean, ffi::AnyBuffer m2,
                          ffi::AnyBuffer h, bool rms, Run&& run) {
  auto args = part_args(x, residual, mean, m2, h, rms);
  if (args.has_error()) return args.error();
  return dispatch_act_param(x.element_type(), ffi::DataType::F32,
                            [&](auto t, auto) { return run(t, args.value()); });
}

template <typename Run>
ffi::Error with_apply_args(ffi::AnyBuffer x, ffi::AnyBuffer mean, ffi::AnyBuffer rstd, ffi::AnyBuffer scale,
                           ffi::AnyBuffer bias, ffi::AnyBuffer y, Run&& run) {
  auto args = apply_args(x, mean, rstd, scale, bias, y);
  if (args.has_error()) return args.error();
  auto pt = param_dtype(scale, bias);
  if (pt.has_error()) return pt.error();
  return dispatch_act_param(x.element_type(), pt.value(), [&](auto t, auto p) { return run(t, p, args.value()); });
}

template <typename Run>
ffi::Error with_bwd_part_args(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                              ffi::AnyBuffer scale, ffi::AnyBuffer sum_g, ffi::AnyBuffer sum_gx, bool rms, Run&& run) {
  auto args = bwd_part_args(dy, x, mean, rstd, scale, sum_g, sum_gx, rms);
  if (args.has_error()) return args.error();
  const ffi::DataType pt = scale.element_count() ? scale.element_type() : ffi::DataType::F32;
  return dispatch_act_param(x.element_type(), pt, [&](auto t, auto p) { return run(t, p, args.value()); });
}

template <typename Run>
ffi::Error with_bwd_apply_args(ffi::AnyBuffer dy, ffi::AnyBuffer dh, ffi::AnyBuffer x, ffi::AnyBuffer mean,
                               ffi::AnyBuffer rstd, ffi::AnyBuffer scale, ffi::AnyBuffer sum_g, ffi::AnyBuffer sum_gx,
                               ffi::AnyBuffer dx, ffi::AnyBuffer dscale, ffi::AnyBuffer dbias, ffi::AnyBuffer work,
                               bool rms, float inv_n, Run&& run) {
  auto args = bwd_apply_args(dy, dh, x, mean, rstd, scale, sum_g, sum_gx, dx, dscale, dbias, work, rms, inv_n);
  if (args.has_error()) return args.error();
  const ffi::DataType pt = scale.element_count() ? scale.element_type() : ffi::DataType::F32;
  return dispatch_act_param(x.element_type(), pt, [&](auto t, auto p) { return run(t, p, args.value()); });
}

ffi::Error NormPartCpu(ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::Result<ffi::AnyBuffer> mean,
                       ffi::Result<ffi::AnyBuffer> m2, ffi::Result<ffi::AnyBuffer> h, bool rms) {
  return with_part_args(x, residual, *mean, *m2, *h, rms, [](auto t, const PartArgs& a) {
    part_cpu<decltype(t)>(a);
    return ffi::Error::Success();
  });
}

ffi::Error NormApplyCpu(ffi::AnyBuffer x, ffi::AnyBuffer mean, ffi::AnyBuffer rstd, ffi::AnyBuffer scale,
                        ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y) {
  return with_apply_args(x, mean, rstd, scale, bias, *y, [](auto t, auto p, const ApplyArgs& a) {
    apply_cpu<decltype(t), decltype(p)>(a);
    return ffi::Error::Success();
  });
}

ffi::Error NormBwdPartCpu(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                          ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> sum_g, ffi::Result<ffi::AnyBuffer> sum_gx,
                          bool rms) {
  return with_bwd_part_args(dy, x, mean, rstd, scale, *sum_g, *sum_gx, rms, [](auto t, auto p, const BwdPartArgs& a) {
    bwd_part_cpu<decltype(t), decltype(p)>(a);
    return ffi::Error::Success();
  });
}

ffi::Error NormBwdApplyCpu(ffi::AnyBuffer dy, ffi::AnyBuffer dh, ffi::AnyBuffer x, ffi::AnyBuffer mean,
                           ffi::AnyBuffer rstd, ffi::AnyBuffer scale, ffi::AnyBuffer sum_g, ffi::AnyBuffer sum_gx,
                           ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dscale,
                           ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> work, bool rms, float inv_n) {
  return with_bwd_apply_args(dy, dh, x, mean, rstd, scale, sum_g, sum_gx, *dx, *dscale, *dbias, *work, rms, inv_n,
                             [](auto t, auto p, const BwdApplyArgs& a) {
                               bwd_apply_cpu<decltype(t), decltype(p)>(a);
                               return ffi::Error::Success();
                             });
}

#ifdef JAX_OPS_WITH_CUDA
ffi::Error NormPartCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer residual,
                        ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> m2,
                        ffi::Result<ffi::AnyBuffer> h, bool rms) {
  return with_part_args(x, residual, *mean, *m2, *h, rms, [stream](auto t, const PartArgs& a) {
    return cuda_status(launch_part<decltype(t)>(a, stream), "jax_ops_norm_partials");
  });
}

ffi::Error NormApplyCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                         ffi::AnyBuffer scale, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y) {
  return with_apply_args(x, mean, rstd, scale, bias, *y, [stream](auto t, auto p, const ApplyArgs& a) {
    return cuda_status(launch_apply<decltype(t), decltype(p)>(a, stream), "jax_ops_norm_apply");
  });
}

ffi::Error NormBwdPartCuda(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer mean,
                           ffi::AnyBuffer rstd, ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> sum_g,
                           ffi::Result<ffi::AnyBuffer> sum_gx, bool rms) {
  return with_bwd_part_args(dy, x, mean, rstd, scale, *sum_g, *sum_gx, rms,
                            [stream](auto t, auto p, const BwdPartArgs& a) {
                              return cuda_status(launch_bwd_part<decltype(t), decltype(p)>(a, stream),
                                                 "jax_ops_norm_bwd_partials");
                            });
}

ffi::Error NormBwdApplyCuda(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer dh, ffi::AnyBuffer x,
                            ffi::AnyBuffer mean, ffi::AnyBuffer rstd, ffi::AnyBuffer scale, ffi::AnyBuffer sum_g,
                            ffi::AnyBuffer sum_gx, ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dscale,
                            ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> work, bool rms,
                            float inv_n) {
  return with_bwd_apply_args(dy, dh, x, mean, rstd, scale, sum_g, sum_gx, *dx, *dscale, *dbias, *work, rms, inv_n,
                             [stream](auto t, auto p, const BwdApplyArgs& a) {
                               return cuda_status(launch_bwd_apply<decltype(t), decltype(p)>(a, stream),
                                                  "jax_ops_norm_bwd_apply");
                             });
}
#endif

}  // namespace

#ifdef JAX_OPS_WITH_CUDA
// The partial rows ([arrays, P, cols] workspace) the CUDA backward writes on the current
// device for these operands: its launchers' dry run, so the workspace XLA allocates
// is the grid's (resident blocks), known at lowering. -1 when it cannot be asked (no
// device, unsupported dtypes). rows < 0: unknown (symbolic), the largest grid.
int64_t bwd_partial_rows(const char* x_dtype, const char* param_dtype, int64_t rows, int64_t cols, bool rms,
                         bool add, bool dscale, bool dbias) {
  const auto dtype = [](std::string n) {
    return n == "float32" ? ffi::DataType::F32 : n == "bfloat16" ? ffi::DataType::BF16
         : n == "float16" ? ffi::DataType::F16 : ffi::DataType::INVALID;
  };
  // Never dereferenced in a dry run: only null / not null and alignment matter.
  void* const some = reinterpret_cast<void*>(uintptr_t(256));
  BwdAddArgs a{{some, some, rms ? nullptr : static_cast<const float*>(some), static_cast<const float*>(some),
                nullptr, some, dscale ? some : nullptr, dbias ? some : nullptr,
                rows < 0 ? (int64_t(1) << 40) : rows, cols, rms, static_cast<float*>(some), int64_t(1) << 40},
               add ? some : nullptr};
  if (cols < 1) return -1;
  int64_t parts = -1;
  const ffi::Error err = dispatch_act_param(dtype(x_dtype), dtype(param_dtype), [&](auto t, auto p) {
    if (launch_bwd<decltype(t), decltype(p)>(a, nullptr, &parts) != cudaSuccess) {
      cudaGetLastError();
      parts = -1;
    }
    return ffi::Error::Success();
  });
  return err.failure() ? -1 : parts;
}
#endif
}  // namespace jax_ops::norm

namespace ffi = xla::ffi;

// fwd: x, residual, scale, bias -> y, h, mean, rstd
#define JO_NORM_FWD_SIGNATURE(bind)                                                           \
  bind.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>() \
      .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>() \
      .Attr<float>("epsilon").Attr<bool>("rms")
// bwd: dy, dh, x, mean, rstd, scale -> dx, dscale, dbias, workspace
#define JO_NORM_BWD_SIGNATURE(bind)                                                           \
  bind.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>() \
      .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>() \
      .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<bool>("rms")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsNormFwdCpu, jax_ops::norm::NormFwdCpu, JO_NORM_FWD_SIGNATURE(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsNormBwdCpu, jax_ops::norm::NormBwdCpu, JO_NORM_BWD_SIGNATURE(ffi::Ffi::Bind()));
#ifdef JAX_OPS_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsNormFwdCuda, jax_ops::norm::NormFwdCuda,
                              JO_NORM_FWD_SIGNATURE(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()), JO_CUDA_TRAITS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsNormBwdCuda, jax_ops::norm::NormBwdCuda,
                              JO_NORM_BWD_SIGNATURE(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()), JO_CUDA_TRAITS);
#endif

// hidden-sharded stages: partials (x, residual -> mean, m2, h), apply (x, mean, rstd,
// scale, bias -> y), bwd partials (dy, x, mean, rstd, scale -> sum_g, sum_gx), bwd apply
// (dy, dh, x, mean, rstd, scale, sum_g, sum_gx -> dx, dscale, dbias, workspace)
#define JO_NORM_PART_SIGNATURE(bind) \
  bind.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>() \
      .Attr<bool>("rms")
#define JO_NORM_APPLY_SIGNATURE(bind)                                                                   \
  bind.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()          \
      .Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
#define JO_NORM_BWD_PART_SIGNATURE(bind)                                                                \
  bind.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()          \
      .Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<bool>("rms")
#define JO_NORM_BWD_APPLY_SIGNATURE(bind)                                                               \
  bind.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()          \
      .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()          \
      .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()          \
      .Attr<bool>("rms").Attr<float>("inv_n")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsNormPartCpu, jax_ops::norm::NormPartCpu, JO_NORM_PART_SIGNATURE(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsNormApplyCpu, jax_ops::norm::NormApplyCpu, JO_NORM_APPLY_SIGNATURE(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsNormBwdPartCpu, jax_ops::norm::NormBwdPartCpu,
                              JO_NORM_BWD_PART_SIGNATURE(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsNormBwdApplyCpu, jax_ops::norm::NormBwdApplyCpu,
                              JO_NORM_BWD_APPLY_SIGNATURE(ffi::Ffi::Bind()));
#ifdef JAX_OPS_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsNormPartCuda, jax_ops::norm::NormPartCuda,
                              JO_NORM_PART_SIGNATURE(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()), JO_CUDA_TRAITS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsNormApplyCuda, jax_ops::norm::NormApplyCuda,
                              JO_NORM_APPLY_SIGNATURE(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()), JO_CUDA_TRAITS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsNormBwdPartCuda, jax_ops::norm::NormBwdPartCuda,
                              JO_NORM_BWD_PART_SIGNATURE(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()), JO_CUDA_TRAITS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsNormBwdApplyCuda, jax_ops::norm::NormBwdApplyCuda,
                              JO_NORM_BWD_APPLY_SIGNATURE(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()), JO_CUDA_TRAITS);
#endif
