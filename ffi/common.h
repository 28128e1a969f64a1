// Helpers shared by the FFI handler files: dtype dispatch and error text.
#pragma once
#include <string>
#include <type_traits>
#include "cuda_src/common.h"
#include "xla/ffi/api/ffi.h"
#ifdef JAX_OPS_WITH_CUDA
#include <cuda_runtime.h>
#include "cuda_src/cuda_utils.cuh"  // cuda_error_message
#endif

namespace jax_ops {
namespace ffi = xla::ffi;

inline const char* dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::U32: return "uint32";
    default: return "unsupported dtype";
  }
}

inline std::string dims_str(ffi::AnyBuffer::Dimensions d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + (d.size() == 1 ? ",)" : ")");
}

// Calls fn(T{}, P{}) with the storage types of an activation dtype `xt` and a
// parameter dtype `pt` (float32 or the activation's own dtype).
template <typename Fn>
ffi::Error dispatch_act_param(ffi::DataType xt, ffi::DataType pt, Fn&& fn) {
  const bool p32 = pt == ffi::DataType::F32;
  switch (xt) {
    case ffi::DataType::F32:
      if (p32) return fn(float{}, float{});
      break;
    case ffi::DataType::BF16:
      if (p32) return fn(bf16_t{}, float{});
      if (pt == xt) return fn(bf16_t{}, bf16_t{});
      break;
    case ffi::DataType::F16:
      if (p32) return fn(f16_t{}, float{});
      if (pt == xt) return fn(f16_t{}, f16_t{});
      break;
    default:
      return ffi::Error::InvalidArgument(std::string("x has dtype ") + dtype_name(xt) +
                                         "; expected float32, bfloat16 or float16");
  }
  return ffi::Error::InvalidArgument(std::string("parameter dtype ") + dtype_name(pt) +
                                     " does not go with x dtype " + dtype_name(xt) +
                                     "; expected float32 or x's dtype");
}

// ------------------------------------------- operand checks (ReLU, BatchNorm) ---

// Returns the error of a check that failed.
#define JO_TRY(expr)                       \
  do {                                     \
    ffi::Error jo_err_ = (expr);           \
    if (jo_err_.failure()) return jo_err_; \
  } while (0)

inline std::string shape_dtype_str(const ffi::AnyBuffer& b) {
  return dims_str(b.dimensions()) + " " + dtype_name(b.element_type());
}

// b has ref's shape and dtype.
inline ffi::Error expect_like(const ffi::AnyBuffer& b, const char* name, const ffi::AnyBuffer& ref,
                              const char* ref_name) {
  const auto d = b.dimensions(), rd = ref.dimensions();
  bool same = b.element_type() == ref.element_type() && d.size() == rd.size();
  for (size_t i = 0; same && i < d.size(); ++i) same = d[i] == rd[i];
  if (same) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(name) + " must match " + ref_name + " (" + shape_dtype_str(ref) +
                                     ") in shape and dtype; got " + shape_dtype_str(b));
}

// A zero-element placeholder for an absent operand or result.
inline ffi::Error expect_empty(const ffi::AnyBuffer& b, const char* name, const char* when) {
  if (b.element_count() == 0) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(name) + " must be a zero-element placeholder " + when + "; got " +
                                     shape_dtype_str(b));
}

// A float32 vector of `count` elements.
inline ffi::Error expect_f32_vector(const ffi::AnyBuffer& b, const char* name, int64_t count) {
  if (b.element_type() == ffi::DataType::F32 && b.dimensions().size() == 1 && b.dimensions()[0] == count)
    return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(name) + " must be float32 of shape (" + std::to_string(count) +
                                     ",); got " + shape_dtype_str(b));
}

// The 1-bit mask of n elements: uint32 of shape (ceil(n / 32),).
inline ffi::Error expect_mask(const ffi::AnyBuffer& b, const char* name, int64_t n) {
  const int64_t words = (n + 31) / 32;
  if (b.element_type() == ffi::DataType::U32 && b.dimensions().size() == 1 && b.dimensions()[0] == words)
    return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(name) + " must be uint32 of shape (" + std::to_string(words) +
                                     ",) (one bit for each of " + std::to_string(n) + " elements); got " +
                                     shape_dtype_str(b));
}

// Calls fn(T{}) with the storage type of an activation dtype.
template <typename Fn>
ffi::Error dispatch_activation(ffi::DataType t, const char* name, Fn&& fn) {
  switch (t) {
    case ffi::DataType::F32: return fn(float{});
    case ffi::DataType::BF16: return fn(bf16_t{});
    case ffi::DataType::F16: return fn(f16_t{});
    default:
      return ffi::Error::InvalidArgument(std::string(name) + " has dtype " + dtype_name(t) +
                                         "; expected float32, bfloat16 or float16");
  }
}

#ifdef JAX_OPS_WITH_CUDA
// Our CUDA handlers may be recorded into XLA's command buffers (CUDA graphs): they only
// enqueue work on the stream XLA gives them (kernel launches, cudaMemsetAsync,
// cudaMemcpyAsync), never synchronize, allocate or read device memory on the host, and
// their launch configurations depend only on shapes, attributes and buffer addresses
// (XLA re-records a traced custom call when the addresses change).
#define JO_CUDA_TRAITS {ffi::Traits::kCmdBufferCompatible}

// A CUDA return code as the handler's result: Internal error naming the failed step.
inline ffi::Error cuda_status(cudaError_t err, const char* what) {
  return err == cudaSuccess ? ffi::Error::Success() : ffi::Error::Internal(cuda_error_message(what, err));
}
#endif

}  // namespace jax_ops
