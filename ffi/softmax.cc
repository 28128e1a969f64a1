// XLA FFI handlers of the Softmax/LogSoftmax family ("jax_ops_softmax_fwd",
// "jax_ops_softmax_bwd"): CPU always, CUDA when this file is compiled by nvcc.
// x has the softmax axis last. The mask (has_mask) has x's rank, its last axis is
// x's, and mask_map (flat [inner, size, stride] triples) maps a row of x to a row
// of the mask (cuda_src/softmax_math.h). causal uses x's last two axes (q, k).
#include <cmath>
#include <string>
#include <vector>
#include "ffi/common.h"
#include "ffi/handlers.h"
#include "cuda_src/softmax_math.h"
#ifdef JAX_OPS_WITH_CUDA
#include "cuda_src/softmax.cuh"
#endif

namespace jax_ops::softmax {
namespace {

ffi::Error invalid(const std::string& what) { return ffi::Error::InvalidArgument(what); }

ffi::ErrorOr<MaskMap> parse_mask_map(ffi::Span<const int64_t> flat, int64_t rows, int64_t mask_rows) {
  MaskMap m;
  if (flat.size() % 3 != 0 || flat.size() / 3 > size_t(kMaxMaskGroups))
    return invalid("mask_map must hold 1 to " + std::to_string(kMaxMaskGroups) + " (inner, size, stride) triples; got " +
                   std::to_string(flat.size()) + " values");
  m.groups = int(flat.size() / 3);
  int64_t last = 0;  // the largest mask row the map can produce
  for (int g = 0; g < m.groups; ++g) {
    m.inner[g] = flat[3 * g]; m.size[g] = flat[3 * g + 1]; m.stride[g] = flat[3 * g + 2];
    if (m.inner[g] < 1 || m.size[g] < 1 || m.stride[g] < 0) return invalid("mask_map has a non-positive inner/size or a negative stride");
    last += (m.size[g] - 1) * m.stride[g];
  }
  if (rows > 0 && last >= mask_rows)
    return invalid("mask_map reaches mask row " + std::to_string(last) + " but the mask has " + std::to_string(mask_rows) + " rows");
  return m;
}

// x, the mask and the logits' attributes (every forward stage); y is set by the caller.
ffi::ErrorOr<FwdArgs> logits_args(ffi::AnyBuffer x, ffi::AnyBuffer mask, float scale, bool log, bool causal,
                                  bool has_mask, ffi::Span<const int64_t> mask_map) {
  const auto d = x.dimensions();
  if (d.size() < 1) return invalid("x must have rank >= 1 (the softmax axis last); got a scalar");
  FwdArgs a{};
  a.cols = d.back();
  a.rows = 1;
  for (size_t i = 0; i + 1 < d.size(); ++i) a.rows *= d[i];
  a.x = x.untyped_data(); a.y = nullptr;
  a.scale = scale; a.log = log; a.causal = causal;
  if (causal) {
    if (d.size() < 2) return invalid("causal needs x of rank >= 2 (..., q, k); got shape " + dims_str(d));
    a.q_len = d[d.size() - 2];
    a.offset = a.cols - a.q_len;  // bottom-right aligned
    if (a.q_len < 1) a.q_len = 1;  // no rows then
  }
  a.mask_kind = kNoMask;
  a.mask = nullptr;
  if (has_mask) {
    const auto md = mask.dimensions();
    if (md.size() != d.size() || md.back() != a.cols)
      return invalid("mask must have x's rank and last axis; got mask " + dims_str(md) + " for x " + dims_str(d));
    const ffi::DataType mt = mask.element_type();
    a.mask_kind = mt == ffi::DataType::PRED ? kBoolMask
                : mt == x.element_type() ? kAddMask
                : mt == ffi::DataType::F32 ? kAddMaskF32 : -1;
    if (a.mask_kind < 0)
      return invalid(std::string("mask must be bool, float32 or x's dtype; got ") + dtype_name(mt));
    const int64_t mask_rows = a.cols ? int64_t(mask.element_count()) / a.cols : 0;
    auto map = parse_mask_map(mask_map, a.rows, mask_rows);
    if (map.has_error()) return map.error();
    a.map = map.value();
    a.mask = mask.untyped_data();
  }
  return a;
}

ffi::ErrorOr<FwdArgs> fwd_args(ffi::AnyBuffer x, ffi::AnyBuffer mask, ffi::AnyBuffer y, float scale, bool log,
                               bool causal, bool has_mask, ffi::Span<const int64_t> mask_map) {
  if (y.element_type() != x.element_type() || y.element_count() != x.element_count())
    return invalid("y must match x in shape and dtype");
  auto a = logits_args(x, mask, scale, log, causal, has_mask, mask_map);
  if (a.has_error()) return a.error();
  FwdArgs out = a.value();
  out.y = y.untyped_data();
  return out;
}

ffi::ErrorOr<BwdArgs> bwd_args(ffi::AnyBuffer y, ffi::AnyBuffer dy, ffi::AnyBuffer dx, float scale, bool log) {
  const auto d = y.dimensions();
  if (d.size() < 1) return invalid("y must have rank >= 1 (the softmax axis last); got a scalar");
  if (dy.element_type() != y.element_type() || dy.element_count() != y.element_count())
    return invalid("dy must match y in shape and dtype");
  if (dx.element_type() != y.element_type() || dx.element_count() != y.element_count())
    return invalid("dx must match y in shape and dtype");
  BwdArgs a{};
  a.cols = d.back();
  a.rows = 1;
  for (size_t i = 0; i + 1 < d.size(); ++i) a.rows *= d[i];
  a.y = y.untyped_data(); a.dy = dy.untyped_data(); a.dx = dx.untyped_data();
  a.scale = scale; a.log = log;
  return a;
}

// Calls fn(T{}) with the storage type of an activation dtype.
template <typename Fn>
ffi::Error dispatch_act(ffi::DataType t, Fn&& fn) {
  switch (t) {
    case ffi::DataType::F32: return fn(float{});
    case ffi::DataType::BF16: return fn(bf16_t{});
    case ffi::DataType::F16: return fn(f16_t{});
    default: return invalid(std::string("x has dtype ") + dtype_name(t) + "; expected float32, bfloat16 or float16");
  }
}

// ------------------------------------------------------------------- CPU ---

template <typename T>
float mask_value(const FwdArgs& a, int64_t idx) {
  switch (a.mask_kind) {
    case kBoolMask: return static_cast<const uint8_t*>(a.mask)[idx] ? 1.f : 0.f;
    case kAddMask: return to_float(static_cast<const T*>(a.mask)[idx]);
    case kAddMaskF32: return static_cast<const float*>(a.mask)[idx];
    default: return 0.f;
  }
}

template <typename T>
void fwd_cpu(const FwdArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  T* y = static_cast<T*>(a.y);
  std::vector<float> z(a.cols);
  for (int64_t r = 0; r < a.rows; ++r) {
    const int64_t mrow = a.mask_kind != kNoMask ? mask_row(a.map, r) : 0;
    const int64_t climit = causal_limit(a, r);
    float m = neg_inf(), sum = 0.f;
    for (int64_t c = 0; c < a.cols; ++c) {
      const float mv = a.mask_kind != kNoMask ? mask_value<T>(a, mrow * a.cols + c) : 0.f;
      z[c] = logit(to_float(x[r * a.cols + c]), a.scale, a.mask_kind, mv, c <= climit);
      m = z[c] > m ? z[c] : m;
    }
    m = safe_max(m);
    for (int64_t c = 0; c < a.cols; ++c) sum += exp_f32(z[c] - m);
    const RowOut out = finish_row(m, sum, a.log);
    for (int64_t c = 0; c < a.cols; ++c) y[r * a.cols + c] = from_float<T>(softmax_out(z[c], out, a.log));
  }
}

template <typename T>
void bwd_cpu(const BwdArgs& a) {
  const T* y = static_cast<const T*>(a.y);
  const T* dy = static_cast<const T*>(a.dy);
  T* dx = static_cast<T*>(a.dx);
  for (int64_t r = 0; r < a.rows; ++r) {
    float dot = 0.f;
    for (int64_t c = 0; c < a.cols; ++c) dot += bwd_dot_term(to_float(y[r * a.cols + c]), to_float(dy[r * a.cols + c]), a.log);
    for (int64_t c = 0; c < a.cols; ++c)
      dx[r * a.cols + c] = from_float<T>(softmax_dx(to_float(y[r * a.cols + c]), to_float(dy[r * a.cols + c]), dot, a.scale, a.log));
  }
}

ffi::Error SoftmaxFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer mask, ffi::Result<ffi::AnyBuffer> y, float scale, bool log,
                         bool causal, bool has_mask, ffi::Span<const int64_t> mask_map) {
  auto args = fwd_args(x, mask, *y, scale, log, causal, has_mask, mask_map);
  if (args.has_error()) return args.error();
  return dispatch_act(x.element_type(), [&](auto t) {
    fwd_cpu<decltype(t)>(args.value());
    return ffi::Error::Success();
  });
}

ffi::Error SoftmaxBwdCpu(ffi::AnyBuffer y, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx, float scale, bool log) {
  auto args = bwd_args(y, dy, *dx, scale, log);
  if (args.has_error()) return args.error();
  return dispatch_act(y.element_type(), [&](auto t) {
    bwd_cpu<decltype(t)>(args.value());
    return ffi::Error::Success();
  });
}

#ifdef JAX_OPS_WITH_CUDA
// ------------------------------------------------------------------ CUDA ---

ffi::Error SoftmaxFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer mask, ffi::Result<ffi::AnyBuffer> y,
                          float scale, bool log, bool causal, bool has_mask, ffi::Span<const int64_t> mask_map) {
  auto args = fwd_args(x, mask, *y, scale, log, causal, has_mask, mask_map);
  if (args.has_error()) return args.error();
  return dispatch_act(x.element_type(), [&](auto t) {
    return cuda_status(launch_fwd<decltype(t)>(args.value(), stream), "jax_ops_softmax_fwd");
  });
}

ffi::Error SoftmaxBwdCuda(cudaStream_t stream, ffi::AnyBuffer y, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx,
                          float scale, bool log) {
  auto args = bwd_args(y, dy, *dx, scale, log);
  if (args.has_error()) return args.error();
  return dispatch_act(y.element_type(), [&](auto t) {
    return cuda_status(launch_bwd<decltype(t)>(args.value(), stream), "jax_ops_softmax_bwd");
  });
}
#endif


// -------------------------------------------- hidden-sharded stages (issue 23) ---
// The per-device stages of a softmax whose axis is split over devices
// (cuda_src/softmax_math.h). offset: an int32 scalar, the device's causal offset
// (zero elements: the unsharded k - q). max/sum/dot: float32 per row.
//   partials:     (x, mask, offset) -> (max, sum)             attrs scale, causal, has_mask, mask_map
//   apply:        (x, mask, offset, max, sum) -> (y)          attrs scale, log, causal, has_mask, mask_map
//   bwd partials: (y, dy) -> (dot)                            attr log
//   bwd apply:    (y, dy, dot) -> (dx)                        attrs scale, log

ffi::Error expect_rows_f32(const ffi::AnyBuffer& b, const char* name, int64_t rows) {
  if (b.element_type() == ffi::DataType::F32 && int64_t(b.element_count()) == rows) return ffi::Error::Success();
  return invalid(std::string(name) + " must be float32 with one element per row (" + std::to_string(rows) +
                 "); got " + dims_str(b.dimensions()) + " " + dtype_name(b.element_type()));
}

ffi::ErrorOr<const int32_t*> offset_arg(const ffi::AnyBuffer& offset, bool causal) {
  if (offset.element_count() == 0) return static_cast<const int32_t*>(nullptr);
  if (!causal) return invalid("offset is the causal rule's; got one without causal");
  if (offset.element_type() != ffi::DataType::S32 || offset.element_count() != 1)
    return invalid("offset must be one int32; got " + dims_str(offset.dimensions()) + " " +
                   dtype_name(offset.element_type()));
  return static_cast<const int32_t*>(offset.untyped_data());
}

ffi::ErrorOr<PartArgs> part_args(ffi::AnyBuffer x, ffi::AnyBuffer mask, ffi::AnyBuffer offset, ffi::AnyBuffer max,
                                 ffi::AnyBuffer sum, float scale, bool causal, bool has_mask,
                                 ffi::Span<const int64_t> mask_map) {
  auto f = logits_args(x, mask, scale, false, causal, has_mask, mask_map);
  if (f.has_error()) return f.error();
  auto off = offset_arg(offset, causal);
  if (off.has_error()) return off.error();
  JO_TRY(expect_rows_f32(max, "max", f.value().rows));
  JO_TRY(expect_rows_f32(sum, "sum", f.value().rows));
  return PartArgs{f.value(), off.value(), static_cast<float*>(max.untyped_data()),
                  static_cast<float*>(sum.untyped_data())};
}

ffi::ErrorOr<ApplyArgs> apply_args(ffi::AnyBuffer x, ffi::AnyBuffer mask, ffi::AnyBuffer offset, ffi::AnyBuffer max,
                                   ffi::AnyBuffer sum, ffi::AnyBuffer y, float scale, bool log, bool causal,
                                   bool has_mask, ffi::Span<const int64_t> mask_map) {
  auto f = fwd_args(x, mask, y, scale, log, causal, has_mask, mask_map);
  if (f.has_error()) return f.error();
  auto off = offset_arg(offset, causal);
  if (off.has_error()) return off.error();
  JO_TRY(expect_rows_f32(max, "max", f.value().rows));
  JO_TRY(expect_rows_f32(sum, "sum", f.value().rows));
  return ApplyArgs{f.value(), off.value(), static_cast<const float*>(max.untyped_data()),
                   static_cast<const float*>(sum.untyped_data())};
}

ffi::ErrorOr<BwdPartArgs> bwd_part_args(ffi::AnyBuffer y, ffi::AnyBuffer dy, ffi::AnyBuffer dot, bool log) {
  const auto d = y.dimensions();
  if (d.size() < 1) return invalid("y must have rank >= 1 (the softmax axis last); got a scalar");
  if (dy.element_type() != y.element_type() || dy.element_count() != y.element_count())
    return invalid("dy must match y in shape and dtype");
  BwdPartArgs a{};
  a.cols = d.back();
  a.rows = 1;
  for (size_t i = 0; i + 1 < d.size(); ++i) a.rows *= d[i];
  JO_TRY(expect_rows_f32(dot, "dot", a.rows));
  a.y = y.untyped_data(); a.dy = dy.untyped_data(); a.dot = static_cast<float*>(dot.untyped_data());
  a.log = log;
  return a;
}

ffi::ErrorOr<BwdApplyArgs> bwd_apply_args(ffi::AnyBuffer y, ffi::AnyBuffer dy, ffi::AnyBuffer dot, ffi::AnyBuffer dx,
                                          float scale, bool log) {
  auto b = bwd_args(y, dy, dx, scale, log);
  if (b.has_error()) return b.error();
  JO_TRY(expect_rows_f32(dot, "dot", b.value().rows));
  return BwdApplyArgs{b.value(), static_cast<const float*>(dot.untyped_data())};
}

// The causal offset of the CPU handlers (host memory).
int64_t host_offset(const FwdArgs& f, const int32_t* offset) { return offset ? int64_t(*offset) : f.offset; }

// Logits of one local row (the unsharded op's formula, logit()).
template <typename T>
void row_logits(const FwdArgs& f, const int32_t* offset, int64_t r, float* z) {
  const T* x = static_cast<const T*>(f.x);
  const int64_t mrow = f.mask_kind != kNoMask ? mask_row(f.map, r) : 0;
  const int64_t climit = causal_limit_at(f, r, host_offset(f, offset));
  for (int64_t c = 0; c < f.cols; ++c) {
    const float mv = f.mask_kind != kNoMask ? mask_value<T>(f, mrow * f.cols + c) : 0.f;
    z[c] = logit(to_float(x[r * f.cols + c]), f.scale, f.mask_kind, mv, c <= climit);
  }
}

template <typename T>
void part_cpu(const PartArgs& a) {
  std::vector<float> z(a.f.cols);
  for (int64_t r = 0; r < a.f.rows; ++r) {
    row_logits<T>(a.f, a.offset, r, z.data());
    float m = neg_inf(), s = 0.f;
    for (int64_t c = 0; c < a.f.cols; ++c) m = z[c] > m ? z[c] : m;
    const float shift = safe_max(m);
    for (int64_t c = 0; c < a.f.cols; ++c) s += exp_f32(z[c] - shift);
    a.max[r] = m;
    a.sum[r] = s;
  }
}

template <typename T>
void apply_cpu(const ApplyArgs& a) {
  T* y = static_cast<T*>(a.f.y);
  std::vector<float> z(a.f.cols);
  for (int64_t r = 0; r < a.f.rows; ++r) {
    row_logits<T>(a.f, a.offset, r, z.data());
    const RowOut out = finish_row(safe_max(a.max[r]), a.sum[r], a.f.log);
    for (int64_t c = 0; c < a.f.cols; ++c) y[r * a.f.cols + c] = from_float<T>(softmax_out(z[c], out, a.f.log));
  }
}

template <typename T>
void bwd_part_cpu(const BwdPartArgs& a) {
  const T* y = static_cast<const T*>(a.y);
  const T* dy = static_cast<const T*>(a.dy);
  for (int64_t r = 0; r < a.rows; ++r) {
    float dot = 0.f;
    for (int64_t c = 0; c < a.cols; ++c) dot += bwd_dot_term(to_float(y[r * a.cols + c]), to_float(dy[r * a.cols + c]), a.log);
    a.dot[r] = dot;
  }
}

template <typename T>
void bwd_apply_cpu(const BwdApplyArgs& a) {
  const T* y = static_cast<const T*>(a.b.y);
  const T* dy = static_cast<const T*>(a.b.dy);
  T* dx = static_cast<T*>(a.b.dx);
  for (int64_t r = 0; r < a.b.rows; ++r)
    for (int64_t c = 0; c < a.b.cols; ++c) {
      const int64_t i = r * a.b.cols + c;
      dx[i] = from_float<T>(softmax_dx(to_float(y[i]), to_float(dy[i]), a.dot[r], a.b.scale, a.b.log));
    }
}

ffi::Error SoftmaxPartCpu(ffi::AnyBuffer x, ffi::AnyBuffer mask, ffi::AnyBuffer offset, ffi::Result<ffi::AnyBuffer> max,
                          ffi::Result<ffi::AnyBuffer> sum, float scale, bool causal, bool has_mask,
                          ffi::Span<const int64_t> mask_map) {
  auto args = part_args(x, mask, offset, *max, *sum, scale, causal, has_mask, mask_map);
  if (args.has_error()) return args.error();
  return dispatch_act(x.element_type(), [&](auto t) {
    part_cpu<decltype(t)>(args.value());
    return ffi::Error::Success();
  });
}

ffi::Error SoftmaxApplyCpu(ffi::AnyBuffer x, ffi::AnyBuffer mask, ffi::AnyBuffer offset, ffi::AnyBuffer max,
                           ffi::AnyBuffer sum, ffi::Result<ffi::AnyBuffer> y, float scale, bool log, bool causal,
                           bool has_mask, ffi::Span<const int64_t> mask_map) {
  auto args = apply_args(x, mask, offset, max, sum, *y, scale, log, causal, has_mask, mask_map);
  if (args.has_error()) return args.error();
  return dispatch_act(x.element_type(), [&](auto t) {
    apply_cpu<decltype(t)>(args.value());
    return ffi::Error::Success();
  });
}

ffi::Error SoftmaxBwdPartCpu(ffi::AnyBuffer y, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dot, bool log) {
  auto args = bwd_part_args(y, dy, *dot, log);
  if (args.has_error()) return args.error();
  return dispatch_act(y.element_type(), [&](auto t) {
    bwd_part_cpu<decltype(t)>(args.value());
    return ffi::Error::Success();
  });
}

ffi::Error SoftmaxBwdApplyCpu(ffi::AnyBuffer y, ffi::AnyBuffer dy, ffi::AnyBuffer dot, ffi::Result<ffi::AnyBuffer> dx,
                              float scale, bool log) {
  auto args = bwd_apply_args(y, dy, dot, *dx, scale, log);
  if (args.has_error()) return args.error();
  return dispatch_act(y.element_type(), [&](auto t) {
    bwd_apply_cpu<decltype(t)>(args.value());
    return ffi::Error::Success();
  });
}

#ifdef JAX_OPS_WITH_CUDA
ffi::Error SoftmaxPartCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer mask, ffi::AnyBuffer offset,
                           ffi::Result<ffi::AnyBuffer> max, ffi::Result<ffi::AnyBuffer> sum, float scale, bool causal,
                           bool has_mask, ffi::Span<const int64_t> mask_map) {
  auto args = part_args(x, mask, offset, *max, *sum, scale, causal, has_mask, mask_map);
  if (args.has_error()) return args.error();
  return dispatch_act(x.element_type(), [&](auto t) {
    return cuda_status(launch_part<decltype(t)>(args.value(), stream), "jax_ops_softmax_partials");
  });
}

ffi::Error SoftmaxApplyCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer mask, ffi::AnyBuffer offset,
                            ffi::AnyBuffer max, ffi::AnyBuffer sum, ffi::Result<ffi::AnyBuffer> y, float scale,
                            bool log, bool causal, bool has_mask, ffi::Span<const int64_t> mask_map) {
  auto args = apply_args(x, mask, offset, max, sum, *y, scale, log, causal, has_mask, mask_map);
  if (args.has_error()) return args.error();
  return dispatch_act(x.element_type(), [&](auto t) {
    return cuda_status(launch_apply<decltype(t)>(args.value(), stream), "jax_ops_softmax_apply");
  });
}

ffi::Error SoftmaxBwdPartCuda(cudaStream_t stream, ffi::AnyBuffer y, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dot,
                              bool log) {
  auto args = bwd_part_args(y, dy, *dot, log);
  if (args.has_error()) return args.error();
  return dispatch_act(y.element_type(), [&](auto t) {
    return cuda_status(launch_bwd_part<decltype(t)>(args.value(), stream), "jax_ops_softmax_bwd_partials");
  });
}

ffi::Error SoftmaxBwdApplyCuda(cudaStream_t stream, ffi::AnyBuffer y, ffi::AnyBuffer dy, ffi::AnyBuffer dot,
                               ffi::Result<ffi::AnyBuffer> dx, float scale, bool log) {
  auto args = bwd_apply_args(y, dy, dot, *dx, scale, log);
  if (args.has_error()) return args.error();
  return dispatch_act(y.element_type(), [&](auto t) {
    return cuda_status(launch_bwd_apply<decltype(t)>(args.value(), stream), "jax_ops_softmax_bwd_apply");
  });
}
#endif

}  // namespace
}  // namespace jax_ops::softmax

namespace ffi = xla::ffi;

#define JO_SOFTMAX_FWD_SIGNATURE(bind)                                                      \
  bind.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()                   \
      .Attr<float>("scale").Attr<bool>("log").Attr<bool>("causal").Attr<bool>("has_mask")  \
      .Attr<ffi::Span<const int64_t>>("mask_map")
#define JO_SOFTMAX_BWD_SIGNATURE(bind)                                                      \
  bind.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()                   \
      .Attr<float>("scale").Attr<bool>("log")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsSoftmaxFwdCpu, jax_ops::softmax::SoftmaxFwdCpu, JO_SOFTMAX_FWD_SIGNATURE(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsSoftmaxBwdCpu, jax_ops::softmax::SoftmaxBwdCpu, JO_SOFTMAX_BWD_SIGNATURE(ffi::Ffi::Bind()));
#ifdef JAX_OPS_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsSoftmaxFwdCuda, jax_ops::softmax::SoftmaxFwdCuda,
                              JO_SOFTMAX_FWD_SIGNATURE(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()), JO_CUDA_TRAITS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsSoftmaxBwdCuda, jax_ops::softmax::SoftmaxBwdCuda,
                              JO_SOFTMAX_BWD_SIGNATURE(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()), JO_CUDA_TRAITS);
#endif

// hidden-sharded stages (see above)
#define JO_SOFTMAX_PART_SIGNATURE(bind)                                                         \
  bind.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>() \
      .Ret<ffi::AnyBuffer>().Attr<float>("scale").Attr<bool>("causal").Attr<bool>("has_mask")  \
      .Attr<ffi::Span<const int64_t>>("mask_map")
#define JO_SOFTMAX_APPLY_SIGNATURE(bind)                                                        \
  bind.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>() \
      .Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<float>("scale").Attr<bool>("log")      \
      .Attr<bool>("causal").Attr<bool>("has_mask").Attr<ffi::Span<const int64_t>>("mask_map")
#define JO_SOFTMAX_BWD_PART_SIGNATURE(bind) \
  bind.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<bool>("log")
#define JO_SOFTMAX_BWD_APPLY_SIGNATURE(bind)                                                    \
  bind.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>() \
      .Attr<float>("scale").Attr<bool>("log")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsSoftmaxPartCpu, jax_ops::softmax::SoftmaxPartCpu,
                              JO_SOFTMAX_PART_SIGNATURE(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsSoftmaxApplyCpu, jax_ops::softmax::SoftmaxApplyCpu,
                              JO_SOFTMAX_APPLY_SIGNATURE(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsSoftmaxBwdPartCpu, jax_ops::softmax::SoftmaxBwdPartCpu,
                              JO_SOFTMAX_BWD_PART_SIGNATURE(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsSoftmaxBwdApplyCpu, jax_ops::softmax::SoftmaxBwdApplyCpu,
                              JO_SOFTMAX_BWD_APPLY_SIGNATURE(ffi::Ffi::Bind()));
#ifdef JAX_OPS_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsSoftmaxPartCuda, jax_ops::softmax::SoftmaxPartCuda,
                              JO_SOFTMAX_PART_SIGNATURE(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()), JO_CUDA_TRAITS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsSoftmaxApplyCuda, jax_ops::softmax::SoftmaxApplyCuda,
                              JO_SOFTMAX_APPLY_SIGNATURE(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()), JO_CUDA_TRAITS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsSoftmaxBwdPartCuda, jax_ops::softmax::SoftmaxBwdPartCuda,
                              JO_SOFTMAX_BWD_PART_SIGNATURE(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()), JO_CUDA_TRAITS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsSoftmaxBwdApplyCuda, jax_ops::softmax::SoftmaxBwdApplyCuda,
                              JO_SOFTMAX_BWD_APPLY_SIGNATURE(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()), JO_CUDA_TRAITS);
#endif
