// Helpers shared by the FFI handler files: dtype dispatch and error text.
#pragma once
#include <string>
#include <type_traits>
#include "cuda_src/common.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ops {
namespace ffi = xla::ffi;

inline const char* dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F64: return "float64";
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

}  // namespace jax_ops
