// Every FFI handler symbol of the extension; ffi/module.cc exports them.
#pragma once
#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsNormFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsNormBwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsDeviceCopyCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsSoftmaxFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsSoftmaxBwdCpu);
#ifdef JAX_OPS_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsNormFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsNormBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsDeviceCopyCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsSoftmaxFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxOpsSoftmaxBwdCuda);
#endif
