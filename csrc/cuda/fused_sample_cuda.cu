// The CUDA entry of both overloads of ddpm::fused_sample: the arguments as
// the kernels take them, the device's description, the plan (csrc/plan:
// which kernel, in which shape) and its launch (launch.h, kernels/<name>.cu).
//
// The engine's kernels (fp32_resident, tf32x3_tiled, fp32_rule) take one
// EngineArgs, the general step: fused_sample.rule fills it from its arguments, and the
// time-column overload is an adapter onto it (layer 0's last weight column as
// the t / T bias row, its two tables as the rule's B and C). The kernels that
// run the time-column overload alone take SampleArgs. A network program
// runs on fp32_rule alone (ProgramArgs beside EngineArgs). What no kernel can
// run (more layers or program instructions than an argument block holds,
// sizes beyond int32, a net too wide for a row in shared memory) runs the
// ATen loop of the rule.
#include "../op/fused_sample.h"
#include "../plan/plan.h"
#include "launch.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <mutex>
#include <vector>

namespace ddpm_ops {
namespace {

using cuda_kernels::EngineArgs;
using cuda_kernels::ProgramArgs;
using cuda_kernels::ProgramOpArgs;

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
  // Cluster launch exists from compute capability 9.0; below, every size is 0.
  if (info.cc_major >= 9) co_resident_clusters(device, info.max_smem, info.max_clusters);
  cache[device] = info;
  return cache[device];
}

// The plan's precision enumerates the same modes (it is plain C++, without
// fused_sample.h's torch headers).
static_assert(static_cast<int>(Precision::kFloat32) == static_cast<int>(plan::Precision::kFloat32) &&
                  static_cast<int>(Precision::kTF32) == static_cast<int>(plan::Precision::kTF32) &&
                  static_cast<int>(Precision::kBFloat16) == static_cast<int>(plan::Precision::kBFloat16),
              "the same precisions");

bool is_engine_kernel(plan::Kernel kernel) {
  return kernel == plan::Kernel::kFp32Resident || kernel == plan::Kernel::kTf32x3Tiled ||
         kernel == plan::Kernel::kFp32Rule;
}

// Whether a call's sizes fit the kernels' int32 indexing and argument block.
bool fits_kernel_arguments(int64_t batch, int64_t num_layers, int64_t table_length, int64_t num_steps) {
  return num_layers <= kMaxLayers && batch <= INT32_MAX && table_length <= INT32_MAX && num_steps <= INT32_MAX;
}

// The tensors a call's kernel arguments point into, kept alive until the
// launch (contiguous copies only where needed), and the plan's problem.
struct Operands {
  std::vector<at::Tensor> keep;
  plan::Problem problem;

  const float* hold(const at::Tensor& t) {
    keep.push_back(t.contiguous());
    return keep.back().data_ptr<float>();
  }
  const float* hold_if(const std::optional<at::Tensor>& t) { return t.has_value() ? hold(*t) : nullptr; }

  // A weight as the engine's kernels read it: rows of stride ld, so that a
  // view of a Linear's columns (the x columns of a concatenated input) needs
  // no copy at every call.
  cuda_kernels::LayerArgs engine_layer(const at::Tensor& weight, const float* bias) {
    const at::Tensor w = weight.stride(1) == 1 && weight.stride(0) >= weight.size(1) && weight.stride(0) <= INT32_MAX
                             ? weight
                             : weight.contiguous();
    keep.push_back(w);
    const int in = static_cast<int>(w.size(1));
    return {w.data_ptr<float>(), bias, in, static_cast<int>(w.size(0)), static_cast<int>(w.stride(0))};
  }

  // The layers, as every kernel takes them, and the plan's shapes. Layer 0
  // of fused_sample.rule keeps its row stride (a view of a Linear's x
  // columns); every other weight is read contiguous. The time-column
  // overload's layer 0 reads its first dim columns (the last is the time
  // column).
  void layers(at::TensorList weights, at::TensorList biases, int64_t dim, bool strided_first,
              cuda_kernels::LayerArgs* out) {
    problem.num_layers = static_cast<int>(weights.size());
    for (int l = 0; l < problem.num_layers; ++l) {
      const float* b = hold(biases[l]);
      out[l] = engine_layer(l == 0 && strided_first ? weights[l] : weights[l].contiguous(), b);
      if (l == 0) out[l].in = static_cast<int>(dim);
      problem.layers[l] = {static_cast<int>(weights[l].size(1)), out[l].out,
                           reinterpret_cast<uintptr_t>(out[l].weight) % 16 == 0 && out[l].ld % 4 == 0};
    }
  }
};

// Whether the arguments describe a bias network: an input with its layers
// (not an input a network program reads as raw features).
bool is_bias_net(const BiasNet& net) { return net.input.has_value() && net.weights.has_value(); }

// Whether the kernel can evaluate a bias network itself (its layers fit the
// argument block).
bool kernel_evaluates(const BiasNet& net) {
  return is_bias_net(net) && net.weights->size() <= static_cast<size_t>(cuda_kernels::kMaxBiasNetLayers);
}

int widest_hidden_of(const BiasNet& net) {
  int widest = 0;
  if (!is_bias_net(net)) return 0;
  for (size_t l = 0; l + 1 < net.weights->size(); ++l) widest = std::max<int>(widest, (*net.weights)[l].size(0));
  return widest;
}

// The kernel's arguments of a bias network it evaluates.
cuda_kernels::BiasNetArgs bias_net_args(const BiasNet& net, Operands& ops) {
  cuda_kernels::BiasNetArgs n = {};
  n.input = ops.hold(*net.input);
  const at::TensorList weights = *net.weights;
  const at::TensorList biases = net.biases.value_or(at::TensorList());
  const std::vector<Activation> acts = parse_activations(net.activations.value_or(std::vector<std::string>()),
                                                        static_cast<int64_t>(weights.size()));
  n.num_layers = static_cast<int>(weights.size());
  for (int l = 0; l < n.num_layers; ++l) {
    n.layers[l] = ops.engine_layer(weights[l], l + 1 < n.num_layers ? ops.hold(biases[l]) : nullptr);
    if (l + 1 < n.num_layers) n.activations[l] = acts[l];
  }
  n.widest_hidden = widest_hidden_of(net);
  return n;
}

// The call's Philox state from a CUDA generator, advanced as torch's random
// ops advance it (under its lock, by a multiple of 4), so that calls, and a
// CUDA graph's replays, draw different noise.
cuda_kernels::GeneratorArgs generator_args(const at::Generator& generator, int device) {
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(generator,
                                                                  at::cuda::detail::getDefaultCUDAGenerator(device));
  at::PhiloxCudaState state;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    state = gen->philox_cuda_state(4);
  }
  cuda_kernels::GeneratorArgs g = {};
  g.used = true;
  g.captured = state.captured_;
  if (state.captured_) {
    g.seed_ptr = state.seed_.ptr;
    g.offset_ptr = state.offset_.ptr;
    g.offset_intragraph = state.offset_intragraph_;
  } else {
    g.seed = state.seed_.val;
    g.offset = state.offset_.val;
  }
  return g;
}

// The program of a call without one (only fp32_rule takes a program: the
// plan gives a call with one to it alone).
const ProgramArgs kNoProgram = {};

void launch_engine(const plan::Plan& plan, const EngineArgs& a, const ProgramArgs& program, const LaunchContext& ctx) {
  if (plan.kernel == plan::Kernel::kFp32Resident) return launch_fp32_resident(plan, a, ctx);
  if (plan.kernel == plan::Kernel::kTf32x3Tiled) return launch_tf32x3_tiled(plan, a, ctx);
  launch_fp32_rule(plan, a, program, ctx);
}

// A network program as fp32_rule runs it (ProgramArgs, fp32_rule.h): each
// instruction with the buffers it reads and writes, a Linear's activation
// folded into a.activations (but the last Linear's: rule_layer applies none
// there), identities dropped. A buffer stays untouched from its "save" to
// its "add", so the buffers number at most 2 + program.max_saved (a fresh
// one avoids h's and the saved ones). A Linear's fresh buffer also avoids,
// where one is left within that count, those touched since the Linear
// before it, or else is fenced (ProgramOpArgs::fence: in a cluster the
// partners store into it). False where the program does not fit the
// argument block (the call then runs the ATen loop).
bool compile_program(const NetworkProgram& program, const SampleRuleCall& call, const SampleRuleExtras& extras,
                     Operands& ops, EngineArgs& a, ProgramArgs& p) {
  // Each saved buffer is read by an "add" instruction, so a deeper stack
  // has more instructions than fit (and buffer numbers stay within int8).
  if (program.max_saved > cuda_kernels::kMaxProgramOps) return false;
  const at::TensorList norm_weights = extras.norm_weights.value_or(at::TensorList());
  if (norm_weights.size() > static_cast<size_t>(cuda_kernels::kMaxProgramNorms)) return false;
  for (size_t j = 0; j < norm_weights.size(); ++j) {
    p.norm_weights[j] = ops.hold(norm_weights[j]);
    p.norm_biases[j] = ops.hold((*extras.norm_biases)[j]);
  }
  int cur = cuda_kernels::kProgramX;
  std::vector<int> saved, touched;  // touched: since the last Linear (a step starts after a cluster barrier)
  const auto holds = [](const std::vector<int>& v, int b) { return std::find(v.begin(), v.end(), b) != v.end(); };
  const auto fresh = [&]() {
    int b = 0;
    while (b == cur || holds(saved, b)) ++b;
    return b;
  };
  const auto fresh_for_linear = [&]() {
    for (int b = 0; b < 2 + static_cast<int>(program.max_saved); ++b) {
      if (b != cur && !holds(saved, b) && !holds(touched, b)) return b;
    }
    return fresh();
  };
  // In place where h's buffer is an activation buffer no "save" holds.
  const auto writable = [&]() { return cur >= 0 && !holds(saved, cur) ? cur : fresh(); };
  std::vector<ProgramOpArgs> out;
  const auto emit = [&](ProgramOpArgs o, int dst, int64_t width) {
    o.src = static_cast<int8_t>(cur);
    o.dst = static_cast<int8_t>(dst);
    o.width = static_cast<int>(width);
    if (o.kind == ProgramOpArgs::kLinear) {
      o.fence = holds(touched, dst);
      touched.clear();
    } else {
      touched.insert(touched.end(), {cur, dst, o.kind == ProgramOpArgs::kAdd ? o.other : cur});
    }
    out.push_back(o);
    cur = dst;
  };
  const bool own_input = program.input.size() > 1 || program.input[0] != InputPart::kX;
  if (own_input) {
    int64_t width = 0;
    for (InputPart part : program.input) {
      const bool cond = part == InputPart::kCond;
      if (part == InputPart::kX) {
        p.input_parts[p.num_input_parts++] = cuda_kernels::kPartX;
        width += call.x.size(1);
        continue;
      }
      const at::Tensor& rows = cond ? *call.cond_net.input : *call.time_net.input;
      p.input_parts[p.num_input_parts++] = cond ? cuda_kernels::kPartCond : cuda_kernels::kPartTime;
      (cond ? p.cond_input : p.time_input) = ops.hold(rows);
      (cond ? p.cond_cols : p.time_cols) = static_cast<int>(rows.size(1));
      width += rows.size(1);
    }
    p.input_width = static_cast<int>(width);
    emit({0.f, 0, ProgramOpArgs::kInput}, fresh(), width);
  }
  int64_t width = own_input ? p.input_width : call.x.size(1);
  const std::vector<NetworkOp>& instructions = program.ops;
  for (size_t i = 0; i < instructions.size(); ++i) {
    const NetworkOp& op = instructions[i];
    switch (op.kind) {
      case NetworkOp::Kind::kLinear: {
        const bool last = op.index + 1 == static_cast<int64_t>(call.weights.size());
        a.activations[op.index] = Activation::kIdentity;
        if (!last && i + 1 < instructions.size() && instructions[i + 1].kind == NetworkOp::Kind::kActivation) {
          a.activations[op.index] = instructions[++i].activation;
        }
        width = call.weights[op.index].size(0);
        emit({0.f, 0, ProgramOpArgs::kLinear, 0, static_cast<int8_t>(op.index)}, fresh_for_linear(), width);
        break;
      }
      case NetworkOp::Kind::kActivation:
        if (op.activation == Activation::kIdentity) break;
        emit({0.f, 0, ProgramOpArgs::kActivation, static_cast<int8_t>(op.activation)}, writable(), width);
        break;
      case NetworkOp::Kind::kLayerNorm:
        emit({static_cast<float>(op.eps), 0, ProgramOpArgs::kLayerNorm, 0, static_cast<int8_t>(op.index)},
             writable(), width);
        break;
      case NetworkOp::Kind::kSave:
        saved.push_back(cur);
        break;
      case NetworkOp::Kind::kAdd: {
        ProgramOpArgs o{0.f, 0, ProgramOpArgs::kAdd};
        o.other = static_cast<int8_t>(saved.back());
        saved.pop_back();
        emit(o, writable(), width);
        break;
      }
    }
  }
  if (out.size() > static_cast<size_t>(cuda_kernels::kMaxProgramOps)) return false;
  int buffers = 2;
  for (const ProgramOpArgs& o : out) buffers = std::max(buffers, o.dst + 1);
  TORCH_INTERNAL_ASSERT(buffers <= 2 + program.max_saved, "ddpm::fused_sample: a program's buffers exceed its plan");
  p.saved_buffers = static_cast<int>(program.max_saved);
  p.num_ops = static_cast<int>(out.size());
  std::copy(out.begin(), out.end(), p.ops);
  return true;
}

void launch_time_column(const plan::Plan& plan, const SampleArgs& a, const LaunchContext& ctx) {
  switch (plan.kernel) {
    case plan::Kernel::kFp32Smem:
      return launch_fp32_smem(plan, a, ctx);
    case plan::Kernel::kBf16Wgmma:
      return launch_bf16_wgmma(plan, a, ctx);
    case plan::Kernel::kBf16x3WgmmaM64:
      return launch_bf16x3_wgmma_m64(plan, a, ctx);
    case plan::Kernel::kBf16x3WgmmaSwapab:
      return launch_bf16x3_wgmma_swapab(plan, a, ctx);
    case plan::Kernel::kFp32Resident:
    case plan::Kernel::kTf32x3Tiled:
    case plan::Kernel::kFp32Rule:
      break;
  }
  TORCH_CHECK(false, "ddpm::fused_sample: ", plan::kernel_name(plan.kernel),
              " runs through the engine's arguments (internal error)");
}

struct Planned {
  plan::Plan plan;
  LaunchContext ctx;
};

Planned plan_call(const at::Tensor& x, Operands& ops, Precision mode, int64_t batch, int64_t num_steps) {
  ops.problem.batch = batch;
  ops.problem.dim = static_cast<int>(x.size(1));
  ops.problem.num_steps = static_cast<int>(num_steps);
  ops.problem.precision = static_cast<plan::Precision>(mode);
  const int device = x.get_device();
  const plan::Overrides overrides = plan::overrides_from_environment();
  const plan::Device info = plan::described_as(device_info(device), overrides);
  Planned p{plan::choose_plan(ops.problem, info, overrides),
            LaunchContext{device, info.max_smem, c10::cuda::getCurrentCUDAStream(device).stream(), overrides.log,
                          nullptr}};
  return p;
}

// The part of EngineArgs both overloads fill alike.
void fill_batch(EngineArgs& a, const at::Tensor& x_c, const at::Tensor& t_c, int64_t table_length,
                int64_t num_steps) {
  a.x = x_c.data_ptr<float>();
  a.t_start = t_c.data_ptr();
  a.t_is_int64 = t_c.scalar_type() == at::kLong;
  a.table_length = static_cast<int>(table_length);
  a.batch = static_cast<int>(x_c.size(0));
  a.dim = static_cast<int>(x_c.size(1));
  a.num_steps = static_cast<int>(num_steps);
}

}  // namespace

at::Tensor fused_sample_rule_cuda(const SampleRuleCall& call, const SampleRuleExtras& extras) {
  check_sample_rule_args(call, extras);
  const at::Tensor& x = call.x;
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t batch = x.size(0), dim = x.size(1), table_length = call.step_tables.size(1);
  // The engine's epilogue computes the step in float32 and reads the network's e in the E term: a
  // float64 sample and an eps read back from x0 (step_tables' rows Q and R) run as the ATen loop.
  if (call.num_steps == 0 || batch == 0 || x.scalar_type() != at::kFloat ||
      call.step_tables.size(0) == kStepTablesWithEpsReadback ||
      !fits_kernel_arguments(batch, static_cast<int64_t>(call.weights.size()), table_length, call.num_steps)) {
    return fused_sample_rule_unfused(call, extras);
  }
  Operands ops;
  EngineArgs a = {};
  ProgramArgs program = {};
  if (extras.network.has_value()) {
    const NetworkProgram parsed = parse_network(call, extras);
    if (!compile_program(parsed, call, extras, ops, a, program)) return fused_sample_rule_unfused(call, extras);
    ops.problem.program = true;
    ops.problem.program_saved = program.saved_buffers;
    ops.problem.program_input = program.input_width;
  }
  ops.problem.general_step = true;
  ops.problem.time_net = kernel_evaluates(call.time_net);
  ops.problem.cond_net = kernel_evaluates(call.cond_net);
  ops.problem.bias_net_hidden = std::max(widest_hidden_of(call.time_net), widest_hidden_of(call.cond_net));
  ops.problem.previous_x0 = call.step_tables.size(0) == kStepTablesWithPrevious;
  // Layer 0 reads x's columns, or a program's concatenated input.
  ops.layers(call.weights, call.biases, call.weights[0].size(1), /*strided_first=*/true, a.layers);
  a.num_layers = ops.problem.num_layers;
  Planned p = plan_call(x, ops, parse_precision(call.precision), batch, call.num_steps);
  if (!p.plan.error.empty()) return fused_sample_rule_unfused(call, extras);
  if (call.validate) {
    check_timesteps_in_range(call.t_start, call.num_steps, table_length);
    if (call.clip_bounds.has_value()) check_bounds_ordered(*call.clip_bounds, "clip_bounds");
    if (call.post_clip_bounds.has_value()) check_bounds_ordered(*call.post_clip_bounds, "post_clip_bounds");
  }

  const at::Tensor x_c = x.contiguous(), t_c = call.t_start.contiguous(), tables = call.step_tables.contiguous();
  if (!ops.problem.program) {
    const std::vector<Activation> acts = parse_activations(call.activations, ops.problem.num_layers);
    for (int l = 0; l + 1 < ops.problem.num_layers; ++l) a.activations[l] = acts[l];
  }
  fill_batch(a, x_c, t_c, table_length, call.num_steps);
  // The networks run in the kernel where the plan found them room, else
  // before it (ATen ops, added to the given rows).
  const bool in_kernel = p.plan.bias_window > 0;
  const std::optional<at::Tensor> no_input;
  const std::optional<std::vector<std::string>> no_activations;
  const BiasNet none{no_input, std::nullopt, std::nullopt, no_activations};
  const BiasNet& time_by_aten = in_kernel && ops.problem.time_net ? none : call.time_net;
  const BiasNet& cond_by_aten = in_kernel && ops.problem.cond_net ? none : call.cond_net;
  a.bias_rows.time_rows = ops.hold_if(with_bias_net(call.time_bias, time_by_aten));
  a.bias_rows.cond_rows = ops.hold_if(with_bias_net(call.cond_bias, cond_by_aten));
  if (in_kernel && ops.problem.time_net) a.bias_rows.time_net = bias_net_args(call.time_net, ops);
  if (in_kernel && ops.problem.cond_net) a.bias_rows.cond_net = bias_net_args(call.cond_net, ops);
  a.bias_rows.window = std::max(p.plan.bias_window, 1);
  a.bias_rows.time_divisor = 1.f;
  for (int64_t q = 0; q < tables.size(0); ++q) a.step.tables[q] = tables.data_ptr<float>() + q * table_length;
  if (const auto range = parse_clip(call.clip, "clip")) {
    a.step.clip = true;
    std::tie(a.step.clip_lo, a.step.clip_hi) = *range;
  }
  if (const auto range = parse_clip(call.post_clip, "post_clip")) {
    a.step.post_clip = true;
    std::tie(a.step.post_lo, a.step.post_hi) = *range;
  }
  a.step.clip_bounds = ops.hold_if(call.clip_bounds);
  a.step.post_clip_bounds = ops.hold_if(call.post_clip_bounds);
  a.step.noise = ops.hold_if(call.noise);
  // A clip below float's range still clamps: to the least float, as 0 there means no clamp.
  a.step.noise_clip = extras.noise_clip.has_value()
                          ? std::max(static_cast<float>(*extras.noise_clip), std::numeric_limits<float>::denorm_min())
                          : 0.f;
  if (call.noise_seed.has_value()) {
    const at::Tensor& seeds = ops.keep.emplace_back(call.noise_seed->contiguous());
    a.step.noise_seed = seeds.data_ptr<int64_t>();
    a.step.seed_per_row = seed_per_row(seeds);
  } else if (call.generator.has_value() && call.generator->defined()) {
    a.step.generator = generator_args(*call.generator, x.get_device());
  }
  at::Tensor out = call.return_chain ? at::empty({call.num_steps + 1, batch, dim}, x.options())
                                     : at::empty({batch, dim}, x.options());
  a.step.out = out.data_ptr<float>();
  a.step.chain = call.return_chain;
  p.ctx.problem = &ops.problem;
  launch_engine(p.plan, a, program, p.ctx);
  return out;
}

at::Tensor fused_sample_cuda(const at::Tensor& x, const at::Tensor& t_start, at::TensorList weights,
                             at::TensorList biases, const at::Tensor& sqrt_recip_alphas, const at::Tensor& coef_eps,
                             int64_t num_steps, int64_t total_timesteps, bool validate, c10::string_view precision) {
  check_fused_sample_args(x, t_start, weights, biases, sqrt_recip_alphas, coef_eps, num_steps, total_timesteps,
                          precision);
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t table_length = sqrt_recip_alphas.size(0);
  if (validate) check_timesteps_in_range(t_start, num_steps, table_length);
  const int64_t batch = x.size(0), dim = x.size(1);
  if (num_steps == 0 || batch == 0) return x.clone(at::MemoryFormat::Contiguous);
  TORCH_CHECK(weights.size() <= static_cast<size_t>(kMaxLayers), "ddpm::fused_sample: weights holds ",
              weights.size(), " layers; the CUDA kernel supports at most ", kMaxLayers);
  TORCH_CHECK(fits_kernel_arguments(batch, static_cast<int64_t>(weights.size()), table_length, num_steps),
              "ddpm::fused_sample: batch, num_steps and the table length must fit in int32 on CUDA");

  Operands ops;
  cuda_kernels::LayerArgs layers[kMaxLayers];
  // Contiguous weights: the time-column kernels outside the engine read
  // rows of stride in (layer 0: dim + 1, its last column the time column).
  ops.layers(weights, biases, dim, /*strided_first=*/false, layers);
  Planned p = plan_call(x, ops, parse_precision(precision), batch, num_steps);
  TORCH_CHECK(p.plan.error.empty(), p.plan.error);
  p.ctx.problem = &ops.problem;
  const at::Tensor x_c = x.contiguous(), t_c = t_start.contiguous();
  const float* c1 = ops.hold(sqrt_recip_alphas);
  const float* c2 = ops.hold(coef_eps);
  at::Tensor out = at::empty({batch, dim}, x.options());

  if (is_engine_kernel(p.plan.kernel)) {
    // The adapter: x = c1 (x - c2 e) is the rule with A = 1, B = c2, C = c1
    // and D = E = S = 0; t / T times layer 0's last column is its time row.
    EngineArgs a = {};
    std::copy(layers, layers + ops.problem.num_layers, a.layers);
    a.num_layers = ops.problem.num_layers;
    for (int l = 0; l + 1 < ops.problem.num_layers; ++l) a.activations[l] = Activation::kSilu;
    fill_batch(a, x_c, t_c, table_length, num_steps);
    a.bias_rows.time_column = layers[0].weight + dim;
    a.bias_rows.time_column_ld = layers[0].ld;
    a.bias_rows.time_divisor = static_cast<float>(total_timesteps);
    a.step.tables[kB] = c2;
    a.step.tables[kC] = c1;
    a.step.out = out.data_ptr<float>();
    launch_engine(p.plan, a, kNoProgram, p.ctx);
    return out;
  }
  SampleArgs a = {};
  std::copy(layers, layers + ops.problem.num_layers, a.layers);
  a.layers[0].in = layers[0].ld;  // these kernels read [x, t / T] as layer 0's input
  a.num_layers = ops.problem.num_layers;
  a.x = x_c.data_ptr<float>();
  a.t_start = t_c.data_ptr();
  a.t_is_int64 = t_c.scalar_type() == at::kLong;
  a.sqrt_recip_alphas = c1;
  a.coef_eps = c2;
  a.table_length = static_cast<int>(table_length);
  a.out = out.data_ptr<float>();
  a.batch = static_cast<int>(batch);
  a.dim = static_cast<int>(dim);
  a.num_steps = static_cast<int>(num_steps);
  a.total_timesteps = static_cast<float>(total_timesteps);
  launch_time_column(p.plan, a, p.ctx);
  return out;
}

namespace {

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

TORCH_LIBRARY_IMPL(ddpm, CUDA, m) {
  m.impl("fused_sample", &fused_sample_cuda);
  m.impl("fused_sample.rule", &rule_kernel<&fused_sample_rule_cuda>);
}

// The description of a GPU that ddpm::cuda_plan takes (tests, diagnostics).
TORCH_LIBRARY_FRAGMENT(ddpm, m) { m.def("cuda_device_info(int device) -> int[]", &cuda_device_info); }

}  // namespace ddpm_ops
