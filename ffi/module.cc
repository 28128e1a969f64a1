// The nanobind extension jax_ops._ffi: hands XLA FFI handler capsules to Python.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include "ffi/handlers.h"

namespace nb = nanobind;

namespace {
template <typename Fn>
nb::capsule capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_ffi, m) {
  m.doc() = "jax_ops XLA FFI handlers";
  // {platform: {target name: handler capsule}} for jax.ffi.register_ffi_target.
  m.def("registrations", []() {
    nb::dict cpu, cuda, out;
    cpu["jax_ops_norm_fwd"] = capsule(JaxOpsNormFwdCpu);
    cpu["jax_ops_norm_bwd"] = capsule(JaxOpsNormBwdCpu);
    cpu["jax_ops_device_copy"] = capsule(JaxOpsDeviceCopyCpu);
    cpu["jax_ops_softmax_fwd"] = capsule(JaxOpsSoftmaxFwdCpu);
    cpu["jax_ops_softmax_bwd"] = capsule(JaxOpsSoftmaxBwdCpu);
    cpu["jax_ops_relu_fwd"] = capsule(JaxOpsReluFwdCpu);
    cpu["jax_ops_relu_bwd"] = capsule(JaxOpsReluBwdCpu);
    cpu["jax_ops_bn_relu_fwd"] = capsule(JaxOpsBnReluFwdCpu);
    cpu["jax_ops_bn_relu_bwd"] = capsule(JaxOpsBnReluBwdCpu);
    // batch-sharded BatchNorm training stages (issue 23)
    cpu["jax_ops_bn_stats"] = capsule(JaxOpsBnStatsCpu);
    cpu["jax_ops_bn_grad_sums"] = capsule(JaxOpsBnGradSumsCpu);
    cpu["jax_ops_bn_dx"] = capsule(JaxOpsBnDxCpu);
    cpu["jax_ops_ce_fwd"] = capsule(JaxOpsCeFwdCpu);
    cpu["jax_ops_ce_bwd"] = capsule(JaxOpsCeBwdCpu);
    cpu["jax_ops_ce_partials"] = capsule(JaxOpsCePartialsCpu);
    cpu["jax_ops_ce_apply"] = capsule(JaxOpsCeApplyCpu);
    // hidden-sharded stages of the norms and softmax (issue 23)
    cpu["jax_ops_norm_partials"] = capsule(JaxOpsNormPartCpu);
    cpu["jax_ops_norm_apply"] = capsule(JaxOpsNormApplyCpu);
    cpu["jax_ops_norm_bwd_partials"] = capsule(JaxOpsNormBwdPartCpu);
    cpu["jax_ops_norm_bwd_apply"] = capsule(JaxOpsNormBwdApplyCpu);
    cpu["jax_ops_softmax_partials"] = capsule(JaxOpsSoftmaxPartCpu);
    cpu["jax_ops_softmax_apply"] = capsule(JaxOpsSoftmaxApplyCpu);
    cpu["jax_ops_softmax_bwd_partials"] = capsule(JaxOpsSoftmaxBwdPartCpu);
    cpu["jax_ops_softmax_bwd_apply"] = capsule(JaxOpsSoftmaxBwdApplyCpu);
#ifdef JAX_OPS_WITH_CUDA
    cuda["jax_ops_norm_fwd"] = capsule(JaxOpsNormFwdCuda);
    cuda["jax_ops_norm_bwd"] = capsule(JaxOpsNormBwdCuda);
    cuda["jax_ops_device_copy"] = capsule(JaxOpsDeviceCopyCuda);
    cuda["jax_ops_softmax_fwd"] = capsule(JaxOpsSoftmaxFwdCuda);
    cuda["jax_ops_softmax_bwd"] = capsule(JaxOpsSoftmaxBwdCuda);
    cuda["jax_ops_relu_fwd"] = capsule(JaxOpsReluFwdCuda);
    cuda["jax_ops_relu_bwd"] = capsule(JaxOpsReluBwdCuda);
    cuda["jax_ops_bn_relu_fwd"] = capsule(JaxOpsBnReluFwdCuda);
    cuda["jax_ops_bn_relu_bwd"] = capsule(JaxOpsBnReluBwdCuda);
    cuda["jax_ops_bn_stats"] = capsule(JaxOpsBnStatsCuda);
    cuda["jax_ops_bn_grad_sums"] = capsule(JaxOpsBnGradSumsCuda);
    cuda["jax_ops_bn_dx"] = capsule(JaxOpsBnDxCuda);
    cuda["jax_ops_ce_fwd"] = capsule(JaxOpsCeFwdCuda);
    cuda["jax_ops_ce_bwd"] = capsule(JaxOpsCeBwdCuda);
    cuda["jax_ops_ce_partials"] = capsule(JaxOpsCePartialsCuda);
    cuda["jax_ops_ce_apply"] = capsule(JaxOpsCeApplyCuda);
    cuda["jax_ops_norm_partials"] = capsule(JaxOpsNormPartCuda);
    cuda["jax_ops_norm_apply"] = capsule(JaxOpsNormApplyCuda);
    cuda["jax_ops_norm_bwd_partials"] = capsule(JaxOpsNormBwdPartCuda);
    cuda["jax_ops_norm_bwd_apply"] = capsule(JaxOpsNormBwdApplyCuda);
    cuda["jax_ops_softmax_partials"] = capsule(JaxOpsSoftmaxPartCuda);
    cuda["jax_ops_softmax_apply"] = capsule(JaxOpsSoftmaxApplyCuda);
    cuda["jax_ops_softmax_bwd_partials"] = capsule(JaxOpsSoftmaxBwdPartCuda);
    cuda["jax_ops_softmax_bwd_apply"] = capsule(JaxOpsSoftmaxBwdApplyCuda);
#endif
    out["cpu"] = cpu;
    out["CUDA"] = cuda;
    return out;
  });
#ifdef JAX_OPS_WITH_CUDA
  // The LayerNorm/RMSNorm backward's workspace rows on the current device (lowering).
  m.def("norm_bwd_partial_rows",
        [](const std::string& x_dtype, const std::string& param_dtype, int64_t rows, int64_t cols, bool rms,
           bool add, bool dscale, bool dbias) {
          return jax_ops::norm::bwd_partial_rows(x_dtype.c_str(), param_dtype.c_str(), rows, cols, rms, add,
                                                 dscale, dbias);
        },
        nb::arg("x_dtype"), nb::arg("param_dtype"), nb::arg("rows"), nb::arg("cols"), nb::arg("rms"),
        nb::arg("add"), nb::arg("dscale"), nb::arg("dbias"));
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  // The CUDA architectures the kernels were compiled for (CMake's CUDA_ARCHITECTURES,
  // e.g. "80-real,90-real,90-virtual"); "" without CUDA or when the build didn't say.
#ifdef JAX_OPS_CUDA_ARCHS
  m.attr("cuda_archs") = JAX_OPS_CUDA_ARCHS;
#else
  m.attr("cuda_archs") = "";
#endif
}
