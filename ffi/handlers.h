// Every FFI handler symbol of the extension; ffi/module.cc exports them.
#pragma once
#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsNormFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsNormBwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsDeviceCopyCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsSoftmaxFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsSoftmaxBwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsReluFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsReluBwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsBnReluFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsBnReluBwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsBnStatsCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsBnGradSumsCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsBnDxCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsCeFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsCeBwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsNormPartCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsNormApplyCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsNormBwdPartCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsNormBwdApplyCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsSoftmaxPartCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsSoftmaxApplyCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsSoftmaxBwdPartCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsSoftmaxBwdApplyCpu);
#ifdef JAX_OPS_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsNormFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsNormBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsDeviceCopyCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsSoftmaxFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsSoftmaxBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsReluFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsReluBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsBnReluFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsBnReluBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsBnStatsCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsBnGradSumsCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsBnDxCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsCeFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsCeBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsNormPartCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsNormApplyCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsNormBwdPartCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsNormBwdApplyCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsSoftmaxPartCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsSoftmaxApplyCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsSoftmaxBwdPartCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsSoftmaxBwdApplyCuda);
#endif

#ifdef JAX_OPS_WITH_CUDA
#include <cstdint>
namespace jax_ops::norm {
// ffi/layer_norm.cc: the partial rows of the CUDA backward's workspace (its grid on
// the current device), -1 when unknown.
int64_t bwd_partial_rows(const char* x_dtype, const char* param_dtype, int64_t rows, int64_t cols, bool rms,
                         bool add, bool dscale, bool dbias);
}  // namespace jax_ops::norm
#endif
