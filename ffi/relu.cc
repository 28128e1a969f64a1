// XLA FFI handlers of ReLU / Add+ReLU with a 1-bit mask ("jax_ops_relu_fwd",
// "jax_ops_relu_bwd"): CPU always, CUDA when this file is compiled by nvcc.
// Forward (x, z) -> (y, mask), attribute has_z (z is a zero-element placeholder
// without it); backward (dy, mask) -> dx. Mask layout: cuda_src/bitmask.h.
#include <string>
#include "ffi/common.h"
#include "ffi/handlers.h"
#include "cuda_src/bitmask.h"
#ifdef JAX_OPS_WITH_CUDA
#include "cuda_src/relu.cuh"
#endif

namespace jax_ops::relu {
namespace {

struct FwdArgs { const void* x; const void* z; void* y; uint32_t* mask; int64_t n; };
struct BwdArgs { const void* dy; const uint32_t* mask; void* dx; int64_t n; };

ffi::ErrorOr<FwdArgs> fwd_args(ffi::AnyBuffer x, ffi::AnyBuffer z, ffi::AnyBuffer y, ffi::AnyBuffer mask, bool has_z) {
  const int64_t n = int64_t(x.element_count());
  JO_TRY(expect_like(y, "y", x, "x"));
  JO_TRY(has_z ? expect_like(z, "z", x, "x") : expect_empty(z, "z", "when has_z is false"));
  JO_TRY(expect_mask(mask, "mask", n));
  return FwdArgs{x.untyped_data(), has_z ? z.untyped_data() : nullptr, y.untyped_data(),
                 static_cast<uint32_t*>(mask.untyped_data()), n};
}

ffi::ErrorOr<BwdArgs> bwd_args(ffi::AnyBuffer dy, ffi::AnyBuffer mask, ffi::AnyBuffer dx) {
  const int64_t n = int64_t(dy.element_count());
  JO_TRY(expect_like(dx, "dx", dy, "dy"));
  JO_TRY(expect_mask(mask, "mask", n));
  return BwdArgs{dy.untyped_data(), static_cast<const uint32_t*>(mask.untyped_data()), dx.untyped_data(), n};
}

// ------------------------------------------------------------------- CPU ---

template <typename T>
void fwd_cpu(const FwdArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  const T* z = static_cast<const T*>(a.z);
  T* y = static_cast<T*>(a.y);
  for (int64_t w = 0; w < mask_words(a.n); ++w) {
    const int64_t first = w * 32, end = first + 32 < a.n ? first + 32 : a.n;
    uint32_t word = 0;
    for (int64_t i = first; i < end; ++i) {
      const float pre = z ? to_float(x[i]) + to_float(z[i]) : to_float(x[i]);
      word |= relu_bit(pre) << (i - first);
      y[i] = from_float<T>(relu_out(pre));
    }
    a.mask[w] = word;
  }
}

template <typename T>
void bwd_cpu(const BwdArgs& a) {
  const T* dy = static_cast<const T*>(a.dy);
  T* dx = static_cast<T*>(a.dx);
  for (int64_t i = 0; i < a.n; ++i) dx[i] = masked_grad(get_bit(a.mask, i), dy[i]);
}

ffi::Error ReluFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer z, ffi::Result<ffi::AnyBuffer> y,
                      ffi::Result<ffi::AnyBuffer> mask, bool has_z) {
  auto args = fwd_args(x, z, *y, *mask, has_z);
  if (args.has_error()) return args.error();
  return dispatch_activation(x.element_type(), "x", [&](auto t) {
    fwd_cpu<decltype(t)>(args.value());
    return ffi::Error::Success();
  });
}

ffi::Error ReluBwdCpu(ffi::AnyBuffer dy, ffi::AnyBuffer mask, ffi::Result<ffi::AnyBuffer> dx) {
  auto args = bwd_args(dy, mask, *dx);
  if (args.has_error()) return args.error();
  return dispatch_activation(dy.element_type(), "dy", [&](auto t) {
    bwd_cpu<decltype(t)>(args.value());
    return ffi::Error::Success();
  });
}

#ifdef JAX_OPS_WITH_CUDA
// ------------------------------------------------------------------ CUDA ---

ffi::Error ReluFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer z, ffi::Result<ffi::AnyBuffer> y,
                       ffi::Result<ffi::AnyBuffer> mask, bool has_z) {
  auto args = fwd_args(x, z, *y, *mask, has_z);
  if (args.has_error()) return args.error();
  const FwdArgs& a = args.value();
  return dispatch_activation(x.element_type(), "x", [&](auto t) {
    return cuda_status(launch_fwd<decltype(t)>(a.x, a.z, a.y, a.mask, a.n, stream), "jax_ops_relu_fwd");
  });
}

ffi::Error ReluBwdCuda(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer mask, ffi::Result<ffi::AnyBuffer> dx) {
  auto args = bwd_args(dy, mask, *dx);
  if (args.has_error()) return args.error();
  const BwdArgs& a = args.value();
  return dispatch_activation(dy.element_type(), "dy", [&](auto t) {
    return cuda_status(launch_bwd<decltype(t)>(a.dy, a.mask, a.dx, a.n, stream), "jax_ops_relu_bwd");
  });
}
#endif

}  // namespace
}  // namespace jax_ops::relu

namespace ffi = xla::ffi;

#define JO_RELU_FWD_SIGNATURE(bind) \
  bind.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<bool>("has_z")
#define JO_RELU_BWD_SIGNATURE(bind) bind.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsReluFwdCpu, jax_ops::relu::ReluFwdCpu, JO_RELU_FWD_SIGNATURE(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsReluBwdCpu, jax_ops::relu::ReluBwdCpu, JO_RELU_BWD_SIGNATURE(ffi::Ffi::Bind()));
#ifdef JAX_OPS_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsReluFwdCuda, jax_ops::relu::ReluFwdCuda,
                              JO_RELU_FWD_SIGNATURE(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()), JO_CUDA_TRAITS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsReluBwdCuda, jax_ops::relu::ReluBwdCuda,
                              JO_RELU_BWD_SIGNATURE(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()), JO_CUDA_TRAITS);
#endif
