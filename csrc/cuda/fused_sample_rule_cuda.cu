// CUDA kernel of ddpm::fused_sample.rule: the arguments as fp32_rule takes
// them, the bias networks evaluated first (with_bias_net), and the launch.
// What fp32_rule cannot run (more layers than its argument block holds,
// sizes beyond int32, a layer too wide for one row in shared memory) and the
// calls without a step run the ATen loop, so every call is served.
#include "../fused_sample.h"
#include "launch.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace ddpm_ops {
namespace {

using cuda_kernels::kMaxLayers;
using cuda_kernels::round_up4;

const float* data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

int device_attribute(cudaDeviceAttr attribute, int device) {
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attribute, device));
  return value;
}

}  // namespace

at::Tensor fused_sample_rule_cuda(const SampleRuleCall& call) {
  check_sample_rule_args(call);
  const auto& [x, t_start, weights, biases, step_tables, num_steps, activations, time_bias, cond_bias,
               clip, post_clip, noise, return_chain, validate, precision, noise_seed, time_net,
               cond_net] = call;
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t batch = x.size(0), dim = x.size(1), table_length = step_tables.size(1);
  const int num_layers = static_cast<int>(weights.size());
  int widest = static_cast<int>(dim);
  for (const at::Tensor& w : weights) widest = static_cast<int>(std::max<int64_t>(widest, w.size(0)));
  const int device = x.get_device();
  const int max_smem = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  const int sm_count = device_attribute(cudaDevAttrMultiProcessorCount, device);
  const int rows = batch <= INT32_MAX ? cuda_kernels::rule_rows_per_block(batch, sm_count,
                                                                           round_up4(static_cast<int>(dim)),
                                                                           round_up4(widest), max_smem)
                                      : 0;
  const bool fits = rows > 0 && num_layers <= kMaxLayers && table_length <= INT32_MAX &&
                    num_steps <= INT32_MAX;
  if (num_steps == 0 || batch == 0 || !fits) return fused_sample_rule_unfused(call);
  if (validate) check_timesteps_in_range(t_start, num_steps, table_length);

  // Contiguous views (copies only where needed), kept alive until the launch.
  const at::Tensor x_c = x.contiguous(), t_c = t_start.contiguous(), tables = step_tables.contiguous();
  const at::Tensor time_rows = with_bias_net(time_bias, time_net).value_or(at::Tensor());
  const at::Tensor cond_rows = with_bias_net(cond_bias, cond_net).value_or(at::Tensor());
  const at::Tensor z = noise.has_value() ? noise->contiguous() : at::Tensor();
  const at::Tensor seeds = noise_seed.has_value() ? noise_seed->contiguous() : at::Tensor();
  std::vector<at::Tensor> keep;
  keep.reserve(2 * num_layers);
  const std::vector<Activation> acts = parse_activations(activations, num_layers);
  cuda_kernels::RuleArgs a = {};
  for (int l = 0; l < num_layers; ++l) {
    keep.push_back(weights[l].contiguous());
    keep.push_back(biases[l].contiguous());
    a.layers[l] = {keep[2 * l].data_ptr<float>(), keep[2 * l + 1].data_ptr<float>(),
                   static_cast<int>(weights[l].size(1)), static_cast<int>(weights[l].size(0))};
    if (l + 1 < num_layers) a.activations[l] = acts[l];
  }
  at::Tensor out = return_chain ? at::empty({num_steps + 1, batch, dim}, x.options())
                                : at::empty({batch, dim}, x.options());
  a.num_layers = num_layers;
  a.width = round_up4(widest);
  a.dim_ld = round_up4(static_cast<int>(dim));
  a.x = x_c.data_ptr<float>();
  a.t_start = t_c.data_ptr();
  a.t_is_int64 = t_c.scalar_type() == at::kLong;
  a.tables = tables.data_ptr<float>();
  a.table_length = static_cast<int>(table_length);
  a.time_rows = data_or_null(time_rows);
  a.cond_rows = data_or_null(cond_rows);
  a.noise = data_or_null(z);
  a.noise_seed = seeds.defined() ? seeds.data_ptr<int64_t>() : nullptr;
  a.seed_per_row = seeds.defined() && seed_per_row(seeds);
  if (const auto range = parse_clip(clip, "clip")) {
    a.clip = true;
    std::tie(a.clip_lo, a.clip_hi) = *range;
  }
  if (const auto range = parse_clip(post_clip, "post_clip")) {
    a.post_clip = true;
    std::tie(a.post_lo, a.post_hi) = *range;
  }
  a.out = out.data_ptr<float>();
  a.chain = return_chain;
  a.batch = static_cast<int>(batch);
  a.dim = static_cast<int>(dim);
  a.num_steps = static_cast<int>(num_steps);
  const LaunchContext ctx{device, max_smem, c10::cuda::getCurrentCUDAStream(device).stream(), false, nullptr};
  launch_fp32_rule(rows, a, ctx);
  return out;
}

TORCH_LIBRARY_IMPL(ddpm, CUDA, m) { m.impl("fused_sample.rule", &rule_kernel<&fused_sample_rule_cuda>); }

}  // namespace ddpm_ops
