// fp32_resident's instantiations (outputs per warp, rows, depth: those that
// fit the registers) and launch.
#include "../launch.h"
#include "fp32_resident.cuh"

namespace ddpm_ops {
namespace {

using ResidentKernel = void (*)(cuda_kernels::EngineArgs);

// The instantiation for this shape; only those that fit the registers exist
// (the plan offers no other).
template <int kOpw, int kRows, int kLayers>
ResidentKernel kernel_if_it_fits() {
  if constexpr (shapes::resident_fits(kOpw, kRows, kLayers)) {
    return cuda_kernels::fp32_resident_kernel<kOpw, kRows, kLayers>;
  } else {
    return nullptr;
  }
}

template <int kOpw, int kRows>
ResidentKernel kernel_of_depth(int num_layers) {
  switch (num_layers) {
    case 2:
      return kernel_if_it_fits<kOpw, kRows, 2>();
    case 3:
      return kernel_if_it_fits<kOpw, kRows, 3>();
    default:
      return kernel_if_it_fits<kOpw, kRows, 4>();
  }
}

template <int kOpw>
ResidentKernel kernel_of_rows(int rows, int num_layers) {
  switch (rows) {
    case 1:
      return kernel_of_depth<kOpw, 1>(num_layers);
    case 2:
      return kernel_of_depth<kOpw, 2>(num_layers);
    case 4:
      return kernel_of_depth<kOpw, 4>(num_layers);
    default:
      return kernel_of_depth<kOpw, 8>(num_layers);
  }
}

}  // namespace

void launch_fp32_resident(const plan::Plan& plan, const cuda_kernels::EngineArgs& a, const LaunchContext& ctx) {
  const ResidentKernel kernel = plan.opw == 2   ? kernel_of_rows<2>(plan.rows, a.num_layers)
                                : plan.opw == 4 ? kernel_of_rows<4>(plan.rows, a.num_layers)
                                                : kernel_of_rows<16>(plan.rows, a.num_layers);
  TORCH_CHECK(kernel != nullptr, "ddpm::fused_sample: no resident kernel for ", plan.opw, " outputs per warp, ",
              plan.rows, " rows and ", a.num_layers, " layers (internal error)");
  launch_kernel(kernel, plan, ctx, a);
}

}  // namespace ddpm_ops
