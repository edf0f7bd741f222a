// tf32x3_tiled's instantiations (16, 32 or 64 rows; 3xTF32 or one tf32
// product), its weight-chunk tensor maps and launch.
#include "../launch.h"
#include "tf32x3_tiled.cuh"

#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

namespace ddpm_ops {
namespace {

using cuda_kernels::EngineArgs;
using cuda_kernels::TileMaps;
using shapes::TilePlan;

// The driver's tensor-map encoder, through the runtime (no link against
// libcuda); null where the driver lacks it.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// TileMaps::weight[l] for every layer the plan copies by TMA; a layer whose
// descriptor the driver refuses falls back to cp.async.
void make_tile_maps(const EngineArgs& a, TilePlan* plan, TileMaps* maps) {
  *maps = {};
  for (int l = 0; l < a.num_layers; ++l) {
    if (!plan->tma[l]) continue;
    const cuda_kernels::LayerArgs& la = a.layers[l];
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(la.in), static_cast<cuuint64_t>(la.out)};
    const cuuint64_t row_bytes[1] = {static_cast<cuuint64_t>(la.ld) * sizeof(float)};
    const cuuint32_t box[2] = {shapes::kTileKChunk, static_cast<cuuint32_t>(shapes::tile_pass_cols(*plan, l))};
    const cuuint32_t element_strides[2] = {1, 1};
    const CUresult result = tensor_map_encoder()(
        &maps->weight[l], CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<float*>(la.weight), dims, row_bytes,
        box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    plan->tma[l] = result == CUDA_SUCCESS;
  }
}

template <int MT>
void launch_rows(const plan::Plan& plan, const EngineArgs& a, const LaunchContext& ctx, const TileMaps& maps) {
  void (*kernel)(EngineArgs, TilePlan, TileMaps) = plan.products == 3 ? cuda_kernels::tf32x3_tiled_kernel<MT, 3>
                                                                      : cuda_kernels::tf32x3_tiled_kernel<MT, 1>;
  launch_kernel(kernel, plan, ctx, a, plan.tile_plan, maps);
}

}  // namespace

bool has_tensor_map_encoder() { return tensor_map_encoder() != nullptr; }

void launch_tf32x3_tiled(const plan::Plan& planned, const EngineArgs& a, const LaunchContext& ctx) {
  plan::Plan plan = planned;
  TileMaps maps;
  make_tile_maps(a, &plan.tile_plan, &maps);
  switch (plan.rows) {
    case 16:
      return launch_rows<1>(plan, a, ctx, maps);
    case 32:
      return launch_rows<2>(plan, a, ctx, maps);
    default:
      return launch_rows<4>(plan, a, ctx, maps);
  }
}

}  // namespace ddpm_ops
