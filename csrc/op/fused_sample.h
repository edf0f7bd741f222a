// Declarations shared by the schema registration, the CPU kernel and the
// CUDA kernel of ddpm::fused_sample. The schema itself lives in ops.cpp.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <type_traits>
#include <string>
#include <utility>
#include <vector>

#include "../common/activation.h"
#include "../common/step_tables.h"

namespace ddpm_ops {

// A schema `float[]?` (clip ranges). Not c10::OptionalArrayRef: torch cannot
// infer a schema type from it.
using OptionalRange = std::optional<c10::ArrayRef<double>>;

// A small network whose output is added to layer 0's output, computed once a
// call: the rows of `input` through Linear layers, activations[l] after each but
// the last, and the last without a bias (it is layer 0's block of columns for
// this input; layer 0's bias is biases[0]). The schema's time_* arguments (one
// input row per step index: a time embedding's MLP and its columns) and cond_*
// arguments (one row per sample: an observation's columns). Absent when `input`
// is.
struct BiasNet {
  const std::optional<at::Tensor>& input;
  std::optional<at::TensorList> weights;
  std::optional<at::TensorList> biases;
  const std::optional<std::vector<std::string>>& activations;
};

// Shape, dtype and device checks that do not look at tensor values. Written
// against symbolic sizes so the Meta kernel (torch.compile, torch.export) runs
// exactly the checks the CPU and CUDA kernels run.
void check_fused_sample_args(const at::Tensor& x, const at::Tensor& t_start,
                             at::TensorList weights, at::TensorList biases,
                             const at::Tensor& sqrt_recip_alphas,
                             const at::Tensor& coef_eps, int64_t num_steps,
                             int64_t total_timesteps, c10::string_view precision);

// The arguments of one fused_sample.rule call, in the schema's order (ops.cpp),
// the bias networks' four arguments each as one BiasNet. Every kernel of the
// overload takes them as one value: `rule_kernel` adapts it to the schema's
// signature, so that signature is written out once.
struct SampleRuleCall {
  const at::Tensor& x;
  const at::Tensor& t_start;
  at::TensorList weights;
  at::TensorList biases;
  const at::Tensor& step_tables;
  int64_t num_steps;
  const std::vector<std::string>& activations;
  const std::optional<at::Tensor>& time_bias;
  const std::optional<at::Tensor>& cond_bias;
  OptionalRange clip;
  OptionalRange post_clip;
  const std::optional<at::Tensor>& noise;
  bool return_chain;
  bool validate;
  c10::string_view precision;
  const std::optional<at::Tensor>& noise_seed;
  BiasNet time_net;
  BiasNet cond_net;
  // The clamps as per-column bounds, (2, dim): row 0 the lower, row 1 the
  // upper (instead of clip / post_clip, never with them).
  const std::optional<at::Tensor>& clip_bounds;
  const std::optional<at::Tensor>& post_clip_bounds;
  // Where the noise comes from when neither noise nor noise_seed is given:
  // a generator of x's device (its state advanced by the call).
  const std::optional<at::Generator>& generator;
};

// The arguments the rule overload gained after `generator`: the network as a
// program, its LayerNorms' parameters, the noise clamp and the clamp of the
// eps read back from x0. Kept out of
// SampleRuleCall so that kernels written against it keep compiling:
// rule_kernel hands a kernel that takes only a SampleRuleCall the calls that
// use none of these, and runs the others as the ATen loop.
struct SampleRuleExtras {
  // The network program (ops.cpp documents the instructions); absent: the
  // plain chain of `weights` with `activations`.
  const std::optional<std::vector<std::string>>& network;
  // One (width,) weight and one bias per affine "layer_norm" instruction, in order.
  std::optional<at::TensorList> norm_weights;
  std::optional<at::TensorList> norm_biases;
  // z clamped to [-noise_clip, noise_clip] before it is scaled by S[s].
  std::optional<double> noise_clip;
  // (lo, hi): the eps read back from the clamped x0 (step_tables' rows Q and R)
  // clamped to it before the E term reads it.
  OptionalRange eps_clip;

  bool any() const {
    return network.has_value() || norm_weights.has_value() || norm_biases.has_value() ||
           noise_clip.has_value() || eps_clip.has_value();
  }
};

// A call that uses none of the extras.
inline const std::optional<std::vector<std::string>> kNoNetwork;
inline const SampleRuleExtras kNoExtras{kNoNetwork, std::nullopt, std::nullopt, std::nullopt, std::nullopt};

// One instruction of a parsed network program (parse_network).
struct NetworkOp {
  enum class Kind { kLinear, kActivation, kLayerNorm, kSave, kAdd };
  Kind kind;
  Activation activation = Activation::kIdentity;  // kActivation
  int64_t index = -1;  // kLinear: into weights / biases; kLayerNorm: into norm_weights / norm_biases, or -1
  double eps = 0.0;    // kLayerNorm
  int64_t position = -1;  // the instruction's index in `network` (for messages)
};

// Where the columns of a program's input come from: x, cond_input's row of the
// sample, time_input's row of the step index.
enum class InputPart { kX, kCond, kTime };

// A network program, parsed and checked against its tensors (checks.cpp).
struct NetworkProgram {
  // The program's input in column order ("input" instruction); {kX} without one.
  std::vector<InputPart> input{InputPart::kX};
  std::vector<NetworkOp> ops;
  int64_t max_saved = 0;  // the deepest the residual stack gets
  bool reads(InputPart part) const {
    for (InputPart p : input) if (p == part) return true;
    return false;
  }
};

// The program of a call: its `network` parsed (with only names and counts
// checked; check_sample_rule_args checks the shapes), or the plain chain
// Linear (act Linear)* that `weights` and `activations` describe.
NetworkProgram parse_network(const SampleRuleCall& call, const SampleRuleExtras& extras);

// The checks of the step-rule overload (fused_sample.rule), the same way.
void check_sample_rule_args(const SampleRuleCall& call, const SampleRuleExtras& extras = kNoExtras);

// `bias` plus `net`'s output (either may be absent), contiguous: the rows the
// kernels add to layer 0. Checked arguments only.
std::optional<at::Tensor> with_bias_net(const std::optional<at::Tensor>& bias, const BiasNet& net);

// An activation by ATen ops.
at::Tensor activate(const at::Tensor& h, Activation act);

// One activation per hidden layer (num_layers - 1 names), or an error naming
// the argument (`name`).
std::vector<Activation> parse_activations(const std::vector<std::string>& names,
                                          int64_t num_layers, const char* name = "activations");

// A clamp range (lo, hi) with lo <= hi, or nullopt; `name` is the argument's.
// In double: a float32 sample's kernels round the bounds to float32, as
// torch's clamp of a float32 tensor does.
std::optional<std::pair<double, double>> parse_clip(OptionalRange range,
                                                    const char* name);

// Whether a checked noise_seed holds one seed per row rather than one for the
// batch. A batch of one draws the same numbers either way (seeded_noise.h).
inline bool seed_per_row(const at::Tensor& noise_seed) { return noise_seed.numel() != 1; }

// The data-dependent check of per-column bounds (clip_bounds or
// post_clip_bounds, named by `name`): lo <= hi in every column. Reads the
// values, so on CUDA it synchronises with the host; kernels off the CPU call
// it only when asked to validate.
void check_bounds_ordered(const at::Tensor& bounds, const char* name);

// Seeds drawn for the op's noise are in [0, kNoiseSeedBound): 62 bits
// (ddpm_ops.NOISE_SEED_BOUND).
constexpr int64_t kNoiseSeedBound = int64_t{1} << 62;

// The seed of a call's noise drawn from its generator (one int64 element on
// x's device; torch.randint's draw, so a CUDA graph's replays draw anew), or
// the call's noise_seed; none where the call gives neither.
std::optional<at::Tensor> noise_seed_of(const SampleRuleCall& call);

// The data-dependent check: every timestep t_start - k, k < num_steps, must
// index the coefficient tables. Reads t_start's values, so on CUDA it
// synchronises with the host; the CUDA kernel calls it only when asked to.
void check_timesteps_in_range(const at::Tensor& t_start, int64_t num_steps,
                              int64_t table_length);

// How the matrix products are computed. kFloat32 keeps fp32 accuracy (fp32
// FMAs, or on CUDA's tensor cores at large batch a bf16x3 split (the split
// kernel) or a 3xTF32 split (the tiled kernel)); the others are opt-in
// tensor-core paths on CUDA: single TF32 products where the tiled kernel
// runs, and for kBFloat16 bf16 operands with fp32 accumulation where the
// wgmma kernel runs (the split kernel, where it runs, is exact in every
// precision; the CPU always computes in fp32, which is at least as accurate).
enum class Precision { kFloat32, kTF32, kBFloat16 };
Precision parse_precision(c10::string_view precision);

// The time-column overload's signature, as the schema in ops.cpp fixes it,
// written once: every backend's kernel of it is declared with this type (the
// rule overload's kernels take a SampleRuleCall, through rule_kernel).
using FusedSampleKernel = at::Tensor(const at::Tensor& x, const at::Tensor& t_start,
                                     at::TensorList weights, at::TensorList biases,
                                     const at::Tensor& sqrt_recip_alphas,
                                     const at::Tensor& coef_eps, int64_t num_steps,
                                     int64_t total_timesteps, bool validate,
                                     c10::string_view precision);
// The step-rule overload as a loop of ATen ops, for any device (the kernel of
// devices without a fused one, and of calls a device's kernel does not take).
at::Tensor fused_sample_rule_unfused(const SampleRuleCall& call, const SampleRuleExtras& extras = kNoExtras);

// fused_sample.rule's signature, as the dispatcher calls its kernels. Kernel
// takes (const SampleRuleCall&, const SampleRuleExtras&), or only the call: a
// kernel that does not know the extras gets the calls that use none of them,
// and the ATen loop runs the others.
template <auto Kernel>
at::Tensor rule_kernel(const at::Tensor& x, const at::Tensor& t_start, at::TensorList weights,
                       at::TensorList biases, const at::Tensor& step_tables, int64_t num_steps,
                       const std::vector<std::string>& activations,
                       const std::optional<at::Tensor>& time_bias,
                       const std::optional<at::Tensor>& cond_bias, OptionalRange clip,
                       OptionalRange post_clip, const std::optional<at::Tensor>& noise,
                       bool return_chain, bool validate, c10::string_view precision,
                       const std::optional<at::Tensor>& noise_seed,
                       const std::optional<at::Tensor>& time_input,
                       std::optional<at::TensorList> time_weights,
                       std::optional<at::TensorList> time_biases,
                       const std::optional<std::vector<std::string>>& time_activations,
                       const std::optional<at::Tensor>& cond_input,
                       std::optional<at::TensorList> cond_weights,
                       std::optional<at::TensorList> cond_biases,
                       const std::optional<std::vector<std::string>>& cond_activations,
                       const std::optional<at::Tensor>& clip_bounds,
                       const std::optional<at::Tensor>& post_clip_bounds,
                       const std::optional<at::Generator>& generator,
                       const std::optional<std::vector<std::string>>& network,
                       std::optional<at::TensorList> norm_weights,
                       std::optional<at::TensorList> norm_biases,
                       std::optional<double> noise_clip, OptionalRange eps_clip) {
  const SampleRuleCall call{x, t_start, weights, biases, step_tables, num_steps, activations, time_bias,
                            cond_bias, clip, post_clip, noise, return_chain, validate, precision, noise_seed,
                            {time_input, time_weights, time_biases, time_activations},
                            {cond_input, cond_weights, cond_biases, cond_activations}, clip_bounds,
                            post_clip_bounds, generator};
  const SampleRuleExtras extras{network, norm_weights, norm_biases, noise_clip, eps_clip};
  if constexpr (std::is_invocable_v<decltype(Kernel), const SampleRuleCall&, const SampleRuleExtras&>) {
    return Kernel(call, extras);
  } else {
    if (extras.any()) return fused_sample_rule_unfused(call, extras);
    return Kernel(call);
  }
}

FusedSampleKernel fused_sample_cpu;
FusedSampleKernel fused_sample_cuda;
// The step-rule overload's CPU kernel.
at::Tensor fused_sample_rule_cpu(const SampleRuleCall& call, const SampleRuleExtras& extras);
// The step-rule overload's CUDA kernel (csrc/cuda/fused_sample_cuda.cu).
at::Tensor fused_sample_rule_cuda(const SampleRuleCall& call, const SampleRuleExtras& extras);

}  // namespace ddpm_ops
