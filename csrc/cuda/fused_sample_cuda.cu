// CUDA kernel of ddpm::fused_sample: the arguments, the device's description,
// the plan (csrc/plan: which kernel, in which shape) and its launch
// (launch.h, kernels/<name>.cu).
#include "../fused_sample.h"
#include "../plan/plan.h"
#include "launch.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <mutex>
#include <vector>

namespace ddpm_ops {
namespace {

using cuda_kernels::kMaxLayers;

const plan::Device& device_info(int device) {
  static std::mutex mutex;
  static std::vector<plan::Device> cache(64);
  std::lock_guard<std::mutex> lock(mutex);
  TORCH_CHECK(device < static_cast<int>(cache.size()), "ddpm::fused_sample: device index ", device,
              " is beyond the supported 64 devices");
  if (cache[device].sm_count != 0) return cache[device];
  // Filled in a local and cached only when complete: a failed query is retried.
  plan::Device info;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.sm_count, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.cc_major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.cc_minor, cudaDevAttrComputeCapabilityMinor, device));
#ifdef DDPM_OPS_SM90A  // setup.py: the extension's sm_90 code was built as sm_90a
  info.sm90a_build = true;
#endif
  info.tma_encoder = has_tensor_map_encoder();
  // Elsewhere the cluster kernels' code is a trap (an 8.x GPU launches no
  // clusters at all): their counts stay 0, and the plan says why no kernel runs.
  if (info.hopper()) co_resident_clusters(device, info.max_smem, info.max_clusters);
  cache[device] = info;
  return cache[device];
}

// The plan's precision enumerates the same modes (it is plain C++, without
// fused_sample.h's torch headers).
static_assert(static_cast<int>(Precision::kFloat32) == static_cast<int>(plan::Precision::kFloat32) &&
                  static_cast<int>(Precision::kTF32) == static_cast<int>(plan::Precision::kTF32) &&
                  static_cast<int>(Precision::kBFloat16) == static_cast<int>(plan::Precision::kBFloat16),
              "the same precisions");

void launch(const plan::Plan& plan, const SampleArgs& a, const LaunchContext& ctx) {
  switch (plan.kernel) {
    case plan::Kernel::kFp32Resident:
      return launch_fp32_resident(plan, a, ctx);
    case plan::Kernel::kFp32Smem:
      return launch_fp32_smem(plan, a, ctx);
    case plan::Kernel::kTf32x3Tiled:
      return launch_tf32x3_tiled(plan, a, ctx);
    case plan::Kernel::kBf16Wgmma:
      return launch_bf16_wgmma(plan, a, ctx);
    case plan::Kernel::kBf16x3WgmmaM64:
      return launch_bf16x3_wgmma_m64(plan, a, ctx);
    case plan::Kernel::kBf16x3WgmmaSwapab:
      return launch_bf16x3_wgmma_swapab(plan, a, ctx);
  }
}

// The device's description as ddpm::cuda_plan takes it (ddpm_ops/cuda_plan.py:
// Device.as_list): sm_count, max_smem, cc_major, cc_minor, sm90a_build,
// tma_encoder, then max_clusters[0 .. kMaxClusterSize].
std::vector<int64_t> cuda_device_info(int64_t device) {
  const plan::Device& d = device_info(static_cast<int>(device));
  std::vector<int64_t> out = {d.sm_count, d.max_smem, d.cc_major, d.cc_minor, d.sm90a_build, d.tma_encoder};
  out.insert(out.end(), d.max_clusters, d.max_clusters + plan::kMaxClusterSize + 1);
  return out;
}

}  // namespace

at::Tensor fused_sample_cuda(const at::Tensor& x, const at::Tensor& t_start,
                             at::TensorList weights, at::TensorList biases,
                             const at::Tensor& sqrt_recip_alphas,
                             const at::Tensor& coef_eps, int64_t num_steps,
                             int64_t total_timesteps, bool validate,
                             c10::string_view precision) {
  check_fused_sample_args(x, t_start, weights, biases, sqrt_recip_alphas, coef_eps, num_steps,
                          total_timesteps, precision);
  const Precision mode = parse_precision(precision);
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t table_length = sqrt_recip_alphas.size(0);
  if (validate) {
    check_timesteps_in_range(t_start, num_steps, table_length);
  }
  const int64_t batch = x.size(0);
  if (num_steps == 0 || batch == 0) {
    return x.clone(at::MemoryFormat::Contiguous);
  }
  const int num_layers = static_cast<int>(weights.size());
  TORCH_CHECK(num_layers <= kMaxLayers, "ddpm::fused_sample: weights holds ", num_layers,
              " layers; the CUDA kernel supports at most ", kMaxLayers);
  TORCH_CHECK(batch <= INT32_MAX && table_length <= INT32_MAX && num_steps <= INT32_MAX,
              "ddpm::fused_sample: batch, num_steps and the table length must fit in int32 on CUDA");

  // Contiguous views (copies only for non-contiguous inputs), kept alive here.
  const at::Tensor x_c = x.contiguous();
  const at::Tensor t_c = t_start.contiguous();
  const at::Tensor c1_c = sqrt_recip_alphas.contiguous();
  const at::Tensor c2_c = coef_eps.contiguous();
  std::vector<at::Tensor> keep;
  keep.reserve(2 * num_layers);
  SampleArgs a = {};
  plan::Problem problem;
  for (int l = 0; l < num_layers; ++l) {
    keep.push_back(weights[l].contiguous());
    keep.push_back(biases[l].contiguous());
    a.layers[l].weight = keep[2 * l].data_ptr<float>();
    a.layers[l].bias = keep[2 * l + 1].data_ptr<float>();
    a.layers[l].out = static_cast<int>(weights[l].size(0));
    a.layers[l].in = static_cast<int>(weights[l].size(1));
    problem.layers[l] = {a.layers[l].in, a.layers[l].out, reinterpret_cast<uintptr_t>(a.layers[l].weight) % 16 == 0};
  }
  at::Tensor out = at::empty({batch, x.size(1)}, x.options());
  a.num_layers = num_layers;
  a.x = x_c.data_ptr<float>();
  a.t_start = t_c.data_ptr();
  a.t_is_int64 = t_c.scalar_type() == at::kLong;
  a.sqrt_recip_alphas = c1_c.data_ptr<float>();
  a.coef_eps = c2_c.data_ptr<float>();
  a.table_length = static_cast<int>(table_length);
  a.out = out.data_ptr<float>();
  a.batch = static_cast<int>(batch);
  a.dim = static_cast<int>(x.size(1));
  a.num_steps = static_cast<int>(num_steps);
  a.total_timesteps = static_cast<float>(total_timesteps);
  problem.batch = a.batch;
  problem.dim = a.dim;
  problem.num_steps = a.num_steps;
  problem.num_layers = num_layers;
  problem.precision = static_cast<plan::Precision>(mode);

  const int device = x.get_device();
  const plan::Device& info = device_info(device);
  const plan::Overrides overrides = plan::overrides_from_environment();
  const plan::Plan plan = plan::choose_plan(problem, info, overrides);
  TORCH_CHECK(plan.error.empty(), plan.error);
  const LaunchContext ctx{device, info.max_smem, c10::cuda::getCurrentCUDAStream(device).stream(), overrides.log,
                          &problem};
  launch(plan, a, ctx);
  return out;
}

TORCH_LIBRARY_IMPL(ddpm, CUDA, m) { m.impl("fused_sample", &fused_sample_cuda); }

// The description of a GPU that ddpm::cuda_plan takes (tests, diagnostics).
TORCH_LIBRARY_FRAGMENT(ddpm, m) { m.def("cuda_device_info(int device) -> int[]", &cuda_device_info); }

}  // namespace ddpm_ops
