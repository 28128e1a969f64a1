// "jax_ops_device_copy": y = x, as a kernel; the benchmark's bandwidth ceiling.
#include <cstring>
#include "ffi/common.h"
#include "ffi/handlers.h"
#ifdef JAX_OPS_WITH_CUDA
#include "cuda_src/device_copy.cuh"
#endif

namespace jax_ops {
namespace {

ffi::Error check_copy(const ffi::AnyBuffer& x, const ffi::AnyBuffer& y) {
  if (x.size_bytes() != y.size_bytes())
    return ffi::Error::InvalidArgument("device_copy: x and y differ in size");
  return ffi::Error::Success();
}

ffi::Error DeviceCopyCpu(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  ffi::Error e = check_copy(x, *y);
  if (e.failure()) return e;
  if (x.size_bytes()) std::memcpy(y->untyped_data(), x.untyped_data(), x.size_bytes());
  return ffi::Error::Success();
}

#ifdef JAX_OPS_WITH_CUDA
ffi::Error DeviceCopyCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  ffi::Error e = check_copy(x, *y);
  if (e.failure()) return e;
  const cudaError_t err = launch_device_copy(x.untyped_data(), y->untyped_data(), int64_t(x.size_bytes()), stream);
  return cuda_status(err, "device_copy");
}
#endif

}  // namespace
}  // namespace jax_ops

namespace ffi = xla::ffi;
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsDeviceCopyCpu, jax_ops::DeviceCopyCpu,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
#ifdef JAX_OPS_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOpsDeviceCopyCuda, jax_ops::DeviceCopyCuda,
                              ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>(), JO_CUDA_TRAITS);
#endif
