// XLA FFI handlers of the fused cross-entropy ("jax_ops_ce_fwd", "jax_ops_ce_bwd"):
// CPU always, CUDA when this file is compiled by nvcc. The math is
// cuda_src/cross_entropy_math.h's.
//
// jax_ops_ce_fwd(logits [..., V], labels [...] s32, weight [...] f32, mask)
//     -> (loss [...] f32, lse [...] f32, dlogits [..., V] or a placeholder)
//   attrs label_smoothing, z_loss (f32), with_grad, has_mask (bool). mask: bools of
//   element count V (one mask row for every row) or rows * V, or a zero-element
//   placeholder when has_mask is false; dlogits: a placeholder when with_grad is false.
// jax_ops_ce_bwd(dlogits [..., V], g [...] f32) -> dlogits scaled by g per row; XLA
//   aliases the result to the operand (in place), so rows with g == 1 are skipped.
// jax_ops_ce_partials / jax_ops_ce_apply: the vocabulary-sharded stages (below).
#include <cmath>
#include <cstring>
#include <string>
#include <vector>
#include "ffi/common.h"
#include "ffi/handlers.h"
#include "cuda_src/cross_entropy_math.h"
#ifdef JAX_OPS_WITH_CUDA
#include "cuda_src/cross_entropy.cuh"
#endif

namespace jax_ops::ce {
namespace {

ffi::Error invalid(const std::string& what) { return ffi::Error::InvalidArgument(what); }

// rows = the product of all but the last dimension.
ffi::ErrorOr<std::pair<int64_t, int64_t>> rows_cols(const ffi::AnyBuffer& x, const char* name) {
  const auto d = x.dimensions();
  if (d.size() < 1) return invalid(std::string(name) + " must have rank >= 1 (the vocabulary last); got a scalar");
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < d.size(); ++i) rows *= d[i];
  return std::make_pair(rows, int64_t(d.back()));
}

ffi::Error expect_rows(const ffi::AnyBuffer& b, const char* name, ffi::DataType t, const char* tname, int64_t rows) {
  if (b.element_type() == t && int64_t(b.element_count()) == rows) return ffi::Error::Success();
  return invalid(std::string(name) + " must be " + tname + " with one element per row (" + std::to_string(rows) +
                 "); got " + shape_dtype_str(b));
}

// a.mask and a.mask_rows from the mask operand (a.rows, a.cols set).
ffi::Error mask_args(FwdArgs& a, const ffi::AnyBuffer& logits, const ffi::AnyBuffer& mask, bool has_mask) {
  a.mask = nullptr;
  a.mask_rows = 0;
  if (!has_mask) return expect_empty(mask, "mask", "without has_mask");
  const int64_t count = int64_t(mask.element_count());
  if (mask.element_type() != ffi::DataType::PRED || a.cols == 0 || count % a.cols != 0 ||
      (count / a.cols != 1 && count / a.cols != a.rows))
    return invalid("mask must be bool with " + std::to_string(a.cols) + " or " + std::to_string(a.rows * a.cols) +
                   " elements (one row for every row, or one per row of logits " + dims_str(logits.dimensions()) +
                   "); got " + shape_dtype_str(mask));
  a.mask = static_cast<const uint8_t*>(mask.untyped_data());
  a.mask_rows = count / a.cols;
  return ffi::Error::Success();
}

// FwdArgs with the logits' rows and columns and the labels (int32, one per row) checked.
ffi::ErrorOr<FwdArgs> logits_labels(const ffi::AnyBuffer& logits, const ffi::AnyBuffer& labels) {
  auto rc = rows_cols(logits, "logits");
  if (rc.has_error()) return rc.error();
  FwdArgs a{};
  a.rows = rc.value().first;
  a.cols = rc.value().second;
  JO_TRY(expect_rows(labels, "labels", ffi::DataType::S32, "int32", a.rows));
  a.logits = logits.untyped_data();
  a.labels = static_cast<const int32_t*>(labels.untyped_data());
  return a;
}

ffi::ErrorOr<FwdArgs> fwd_args(ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::AnyBuffer weight,
                               ffi::AnyBuffer mask, ffi::AnyBuffer loss, ffi::AnyBuffer lse, ffi::AnyBuffer dlogits,
                               float label_smoothing, float z_loss, bool with_grad, bool has_mask) {
  auto base = logits_labels(logits, labels);
  if (base.has_error()) return base.error();
  FwdArgs a = base.value();
  JO_TRY(expect_rows(weight, "weight", ffi::DataType::F32, "float32", a.rows));
  JO_TRY(expect_rows(loss, "loss", ffi::DataType::F32, "float32", a.rows));
  JO_TRY(expect_rows(lse, "lse", ffi::DataType::F32, "float32", a.rows));
  if (with_grad) {
    JO_TRY(expect_like(dlogits, "dlogits", logits, "logits"));
  } else {
    JO_TRY(expect_empty(dlogits, "dlogits", "without with_grad"));
  }
  if (!(label_smoothing >= 0.f && label_smoothing <= 1.f))
    return invalid("label_smoothing must be in [0, 1]; got " + std::to_string(label_smoothing));
  if (!(z_loss >= 0.f && std::isfinite(z_loss))) return invalid("z_loss must be finite and >= 0; got " + std::to_string(z_loss));
  a.weight = static_cast<const float*>(weight.untyped_data());
  a.loss = static_cast<float*>(loss.untyped_data());
  a.lse = static_cast<float*>(lse.untyped_data());
  a.dlogits = with_grad ? dlogits.untyped_data() : nullptr;
  a.label_smoothing = label_smoothing;
  a.z_loss = z_loss;
  JO_TRY(mask_args(a, logits, mask, has_mask));
  return a;
}

ffi::ErrorOr<BwdArgs> bwd_args(ffi::AnyBuffer in, ffi::AnyBuffer g, ffi::AnyBuffer out) {
  auto rc = rows_cols(in, "dlogits");
  if (rc.has_error()) return rc.error();
  BwdArgs a{};
  a.rows = rc.value().first;
  a.cols = rc.value().second;
  JO_TRY(expect_rows(g, "g", ffi::DataType::F32, "float32", a.rows));
  JO_TRY(expect_like(out, "the result", in, "dlogits"));
  a.in = in.untyped_data();
  a.out = out.untyped_data();
  a.g = static_cast<const float*>(g.untyped_data());
  a.skip_ones = a.in == a.out;
  return a;
}

// The vocabulary-sharded stages (ops/cross_entropy.py's local; labels: local columns):
//   jax_ops_ce_partials(logits, labels, mask) -> parts [..., 5] f32   attr has_mask
//   jax_ops_ce_apply(logits, labels, weight, mask, stats [..., 5]) -> (loss, lse, dlogits)
//     attrs label_smoothing, z_loss, has_mask; stats: the whole rows' statistics
ffi::ErrorOr<FwdArgs> partials_args(ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::AnyBuffer mask,
                                    ffi::AnyBuffer parts, bool has_mask) {
  auto base = logits_labels(logits, labels);
  if (base.has_error()) return base.error();
  FwdArgs a = base.value();
  JO_TRY(expect_rows(parts, "parts", ffi::DataType::F32, "float32", a.rows * kStatCount));
  if (a.cols == 0 && a.rows > 0) return invalid("logits need at least one column; got " + shape_dtype_str(logits));
  JO_TRY(mask_args(a, logits, mask, has_mask));
  a.parts = static_cast<float*>(parts.untyped_data());
  return a;
}

ffi::ErrorOr<FwdArgs> apply_args(ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::AnyBuffer weight,
                                 ffi::AnyBuffer mask, ffi::AnyBuffer stats, ffi::AnyBuffer loss, ffi::AnyBuffer lse,
                                 ffi::AnyBuffer dlogits, float label_smoothing, float z_loss, bool has_mask) {
  auto args = fwd_args(logits, labels, weight, mask, loss, lse, dlogits, label_smoothing, z_loss, true, has_mask);
  if (args.has_error()) return args.error();
  FwdArgs a = args.value();
  JO_TRY(expect_rows(stats, "stats", ffi::DataType::F32, "float32", a.rows * kStatCount));
  a.stats = static_cast<const float*>(stats.untyped_data());
  return a;
}

// ------------------------------------------------------------------- CPU ---

template <typename T>
void fwd_cpu(const FwdArgs& a) {
  const T* x = static_cast<const T*>(a.logits);
  T* dx = static_cast<T*>(a.dlogits);
  std::vector<float> z(a.cols);
  for (int64_t r = 0; r < a.rows; ++r) {
    const T* xr = x + r * a.cols;
    const uint8_t* keep = a.mask == nullptr ? nullptr : a.mask + (a.mask_rows == 1 ? 0 : r) * a.cols;
    float m = neg_inf();
    for (int64_t c = 0; c < a.cols; ++c) {
      z[c] = to_float(xr[c]);
      if (keep == nullptr || keep[c]) m = max_f(m, z[c]);  // a NaN reaches s, hence the row's outputs
    }
    const float ms = safe_max(m);
    // Double accumulators: a sequential float32 sum over 262144 terms would lose about
    // 1e-5 of its value (the GPU's tree of per-thread sums does not).
    double s = 0.0, sum_z = 0.0, n = 0.0;
    for (int64_t c = 0; c < a.cols; ++c) {
      if (keep != nullptr && !keep[c]) continue;
      s += row_exp(z[c], ms);
      sum_z += z[c];
      n += 1.0;
    }
    const int32_t label = a.labels[r];
    const bool in_range = label_in_range(label, a.cols);
    float zl = in_range ? z[label] : (a.parts != nullptr ? 0.f : NAN);
    if (a.parts != nullptr) {  // a shard's statistics only
      float* out = a.parts + r * kStatCount;
      out[0] = m;
      out[1] = float(s);
      out[2] = float(sum_z);
      out[3] = float(n);
      out[4] = zl;
      continue;
    }
    float fs = float(s), fsum_z = float(sum_z), fn = float(n);
    if (a.stats != nullptr) {  // the whole row's, merged over the shards
      const float* st = a.stats + r * kStatCount;
      m = st[0], fs = st[1], fsum_z = st[2], fn = st[3], zl = st[4];
    }
    const RowOut out = finish_row(m, fs, fsum_z, fn, zl, a.weight[r], a.label_smoothing, a.z_loss);
    a.loss[r] = out.loss;
    a.lse[r] = out.lse;
    if (dx == nullptr) continue;
    T* dr = dx + r * a.cols;
    for (int64_t c = 0; c < a.cols; ++c)
      dr[c] = from_float<T>(out.zero ? 0.f : grad_elem(z[c], keep == nullptr || keep[c], c == label, out));
  }
}

template <typename T>
void bwd_cpu(const BwdArgs& a) {
  const T* in = static_cast<const T*>(a.in);
  T* out = static_cast<T*>(a.out);
  for (int64_t r = 0; r < a.rows; ++r) {
    const float g = a.g[r];
    if (g == 1.f) {
      if (!a.skip_ones) std::memcpy(out + r * a.cols, in + r * a.cols, sizeof(T) * size_t(a.cols));
      continue;
    }
    for (int64_t c = 0; c < a.cols; ++c) out[r * a.cols + c] = from_float<T>(g * to_float(in[r * a.cols + c]));
  }
}

ffi::Error CeFwdCpu(ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::AnyBuffer weight, ffi::AnyBuffer mask,
                    ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> dlogits,
                    float label_smoothing, float z_loss, bool with_grad, bool has_mask) {
  auto args = fwd_args(logits, labels, weight, mask, *loss, *lse, *dlogits, label_smoothing, z_loss, with_grad, has_mask);
  if (args.has_error()) return args.error();
  return dispatch_activation(logits.element_type(), "logits", [&](auto t) {
    fwd_cpu<decltype(t)>(args.value());
    return ffi::Error::Success();
  });
}

ffi::Error CeBwdCpu(ffi::AnyBuffer dlogits, ffi::AnyBuffer g, ffi::Result<ffi::AnyBuffer> out) {
  auto args = bwd_args(dlogits, g, *out);
  if (args.has_error()) return args.error();
  return dispatch_activation(dlogits.element_type(), "dlogits", [&](auto t) {
    bwd_cpu<decltype(t)>(args.value());
    return ffi::Error::Success();
  });
}

ffi::Error CePartialsCpu(ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::AnyBuffer mask,
                         ffi::Result<ffi::AnyBuffer> parts, bool has_mask) {
  auto args = partials_args(logits, labels, mask, *parts, has_mask);
  if (args.has_error()) return args.error();
  return dispatch_activation(logits.element_type(), "logits", [&](auto t) {
    fwd_cpu<decltype(t)>(args.value());
    return ffi::Error::Success();
  });
}

ffi::Error CeApplyCpu(ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::AnyBuffer weight, ffi::AnyBuffer mask,
                      ffi::AnyBuffer stats, ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> lse,
                      ffi::Result<ffi::AnyBuffer> dlogits, float label_smoothing, float z_loss, bool has_mask) {
  auto args = apply_args(logits, labels, weight, mask, stats, *loss, *lse, *dlogits, label_smoothing, z_loss, has_mask);
  if (args.has_error()) return args.error();
  return dispatch_activation(logits.element_type(), "logits", [&](auto t) {
    fwd_cpu<decltype(t)>(args.value());
    return ffi::Error::Success();
  });
}

#ifdef JAX_OPS_WITH_CUDA
// ------------------------------------------------------------------ CUDA ---

ffi::Error CePartialsCuda(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::AnyBuffer mask,
                          ffi::Result<ffi::AnyBuffer> parts, bool has_mask) {
  auto args = partials_args(logits, labels, mask, *parts, has_mask);
  if (args.has_error()) return args.error();
  return dispatch_activation(logits.element_type(), "logits", [&](auto t) {
    return cuda_status(launch_fwd<decltype(t)>(args.value(), stream), "jax_ops_ce_partials");
  });
}

ffi::Error CeApplyCuda(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::AnyBuffer weight,
                       ffi::AnyBuffer mask, ffi::AnyBuffer stats, ffi::Result<ffi::AnyBuffer> loss,
                       ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> dlogits, float label_smoothing,
                       float z_loss, bool has_mask) {
  auto args = apply_args(logits, labels, weight, mask, stats, *loss, *lse, *dlogits, label_smoothing, z_loss, has_mask);
  if (args.has_error()) return args.error();
  return dispatch_activation(logits.element_type(), "logits", [&](auto t) {
    return cuda_status(launch_fwd<decltype(t)>(args.value(), stream), "jax_ops_ce_apply");
  });
}

ffi::Error CeFwdCuda(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::AnyBuffer weight,
                     ffi::AnyBuffer mask, ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> lse,
                     ffi::Result<ffi::AnyBuffer> dlogits, float label_smoothing, float z_loss, bool with_grad,
                     bool has_mask) {
  auto args = fwd_args(logits, labels, weight, mask, *loss, *lse, *dlogits, label_smoothing, z_loss, with_grad, has_mask);
  if (args.has_error()) return args.error();
  return dispatch_activation(logits.element_type(), "logits", [&](auto t) {
    return cuda_status(launch_fwd<decltype(t)>(args.value(), stream), "jax_ops_ce_fwd");
  });
}

ffi::Error CeBwdCuda(cudaStream_t stream, ffi::AnyBuffer dlogits, ffi::AnyBuffer g, ffi::Result<ffi::AnyBuffer> out) {
  auto args = bwd_args(dlogits, g, *out);
  if (args.has_error()) return args.error();
  return dispatch_activation(dlogits.element_type(), "dlogits", [&](auto t) {
    return cuda_status(launch_bwd<decltype(t)>(args.value(), stream), "jax_ops_ce_bwd");
  });
}
#endif

}  // namespace
}  // namespace jax_ops::ce

namespace ffi = xla::ffi;

#define JO_CE_FWD_SIGNATURE(bind)                                                                   \
  bind.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()     \
      .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()                            \
      .Attr<float>("label_smoothing").Attr<float>("z_loss").Attr<bool>("with_grad").Attr<bool>("has_mask")
#define JO_CE_BWD_SIGNATURE(bind) bind.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsCeFwdCpu, jax_ops::ce::CeFwdCpu, JO_CE_FWD_SIGNATURE(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsCeBwdCpu, jax_ops::ce::CeBwdCpu, JO_CE_BWD_SIGNATURE(ffi::Ffi::Bind()));
#ifdef JAX_OPS_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsCeFwdCuda, jax_ops::ce::CeFwdCuda,
                              JO_CE_FWD_SIGNATURE(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()), JO_CUDA_TRAITS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsCeBwdCuda, jax_ops::ce::CeBwdCuda,
                              JO_CE_BWD_SIGNATURE(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()), JO_CUDA_TRAITS);
#endif

#define JO_CE_PARTIALS_SIGNATURE(bind)                                                              \
  bind.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()     \
      .Attr<bool>("has_mask")
#define JO_CE_APPLY_SIGNATURE(bind)                                                                 \
  bind.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()     \
      .Arg<ffi::AnyBuffer>()                                                                        \
      .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()                            \
      .Attr<float>("label_smoothing").Attr<float>("z_loss").Attr<bool>("has_mask")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsCePartialsCpu, jax_ops::ce::CePartialsCpu, JO_CE_PARTIALS_SIGNATURE(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsCeApplyCpu, jax_ops::ce::CeApplyCpu, JO_CE_APPLY_SIGNATURE(ffi::Ffi::Bind()));
#ifdef JAX_OPS_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsCePartialsCuda, jax_ops::ce::CePartialsCuda,
                              JO_CE_PARTIALS_SIGNATURE(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              JO_CUDA_TRAITS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsCeApplyCuda, jax_ops::ce::CeApplyCuda,
                              JO_CE_APPLY_SIGNATURE(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              JO_CUDA_TRAITS);
#endif
