// The launch path every kernel takes (launch.h).
#include "launch.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <mutex>
#include <set>
#include <utility>

namespace ddpm_ops {

void prepare_kernel(const void* kernel, int device, int max_smem, bool cluster) {
  static std::mutex mutex;
  static std::set<std::pair<const void*, int>> done;
  std::lock_guard<std::mutex> lock(mutex);
  const std::pair<const void*, int> key{kernel, device};
  if (done.count(key) != 0) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem));
  if (cluster) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  }
  done.insert(key);  // only once both attributes are set: a failure is retried, not remembered
}

LaunchConfig::LaunchConfig(int64_t grid, int cluster_size, unsigned threads, size_t smem, cudaStream_t stream) {
  const int64_t ctas = grid * (cluster_size > 0 ? cluster_size : 1);
  TORCH_CHECK(ctas <= INT32_MAX, "ddpm::fused_sample: this batch needs more thread blocks than one launch allows (",
              ctas, ")");
  config.gridDim = dim3(static_cast<unsigned>(ctas));
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  if (cluster_size == 0) return;
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = static_cast<unsigned>(cluster_size);
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
}

void log_launch(const plan::Plan& plan, const LaunchContext& ctx) {
  std::fprintf(stderr, "%s\n", plan::describe(plan, *ctx.problem).c_str());
}

}  // namespace ddpm_ops
