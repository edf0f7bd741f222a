// The schema of ddpm::fused_sample (the one place it is written), its Meta
// kernels for torch.compile / torch.export, and its inference-only Autograd
// kernels. Backend kernels register themselves in csrc/cpu and csrc/cuda.
//
// Two overloads:
//   fused_sample       the time-column loop: input cat([x, t / T]), SiLU,
//                      x = sqrt_recip_alphas[t] * (x - coef_eps[t] * eps);
//   fused_sample.rule  the general step: layer 0 on x alone plus bias rows
//                      (time_bias[s], cond_bias, and the time_* and cond_* bias
//                      networks' outputs), an activation per layer, the
//                      step rule's six or seven tables, clamps (two floats
//                      or per-column bounds), noise, optionally the chain;
//                      or, with `network`, any network program below.
//
// fused_sample.rule's trailing arguments (after `generator`):
//   str[]? network      the noise network as a program over one row vector h
//                       (absent: Linear (activations[l] Linear)*, as before).
//                       With it, `activations` must be empty. Instructions, run
//                       in order; h starts as x's row (dim columns):
//     "input:<parts>"   first instruction only: h = the concatenation of the
//                       parts named, in order, from "x" (the current sample),
//                       "cond" (cond_input's row of the sample) and "time"
//                       (time_input's row of the step index s): the raw
//                       features of a network whose first layer is not a
//                       Linear (a LayerNorm over cat[x, cond, time]). An input
//                       a part names comes without its *_weights.
//     "linear"          h = h @ weights[i].T + biases[i], i counting the
//                       "linear" instructions; the first also adds the bias
//                       rows (time_bias[s], cond_bias, the time_* and cond_*
//                       networks' outputs), as layer 0 does without a program.
//     an activation's name (DDPM_OPS_ACTIVATIONS in csrc/common/activation.h)
//                       h = act(h).
//     "layer_norm:<eps>"        h = (h - mean(h)) / sqrt(var(h) + eps), over
//                               h's columns (biased variance), no affine part;
//     "layer_norm_affine:<eps>" the same, then * norm_weights[j] + norm_biases[j],
//                               j counting the affine LayerNorms. <eps> is a
//                               decimal float (nn.LayerNorm's eps).
//     "save"            push h on the residual stack.
//     "add"             h = h + (the stack's top, popped): a residual block is
//                       "save", the block's layers, "add".
//                       The program ends with h of dim columns and an empty stack.
//   Tensor[]? norm_weights, Tensor[]? norm_biases
//                       the affine LayerNorms' (width,) parameters, in order.
//   float? noise_clip   z (given or drawn) clamped to [-noise_clip, noise_clip]
//                       before it is scaled by S[s]; noise_clip > 0.
//   float[]? eps_clip   (lo, hi): with step_tables of 9 rows (A, B, C, D, E, S,
//                       P, Q, R), the E term reads the eps read back from the
//                       clamped x0, Q[s] x - R[s] x0, instead of the network's e;
//                       eps_clip clamps it to [lo, hi] first (DPPO's DDIM
//                       eps_clip_value). Only with 9 rows.
#include "fused_sample.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

namespace ddpm_ops {
namespace {

// Neither derivative exists: refuse a call that would need one, instead of
// returning an output whose gradient or tangent is silently missing.
// Forward-mode tangents (torch.func.jvp, torch.autograd.forward_ad) are
// carried whatever the grad mode.
void refuse_derivatives(const at::Tensor& t, const std::string& what) {
  const bool needs_grad = at::GradMode::is_enabled() && t.requires_grad();
  const bool has_tangent = t._fw_grad(/*level=*/0).defined();
  TORCH_CHECK(!needs_grad, "ddpm::fused_sample is inference-only (it has no backward), but ",
              what, " requires grad. Call it under torch.no_grad() or torch.inference_mode(), "
              "or pass detached tensors.");
  TORCH_CHECK(!has_tangent, "ddpm::fused_sample is inference-only (it has no forward-mode "
              "derivative), but ", what, " carries a forward-mode tangent (torch.func.jvp or "
              "torch.autograd.forward_ad). Pass the primal tensor instead.");
}

// One argument of a call, named as the schema names it: a tensor, or each
// tensor of a list (absent arguments and the others have no derivative).
void refuse_derivatives_of(const c10::IValue& argument, const std::string& name) {
  if (argument.isTensor()) return refuse_derivatives(argument.toTensor(), name);
  if (!argument.isTensorList()) return;
  const c10::List<at::Tensor> list = argument.toTensorList();
  for (size_t i = 0; i < list.size(); ++i) {
    refuse_derivatives(list.get(i), name + "[" + std::to_string(i) + "]");
  }
}

at::Tensor fused_sample_meta(const at::Tensor& x, const at::Tensor& t_start,
                             at::TensorList weights, at::TensorList biases,
                             const at::Tensor& sqrt_recip_alphas,
                             const at::Tensor& coef_eps, int64_t num_steps,
                             int64_t total_timesteps, bool /*validate*/,
                             c10::string_view precision) {
  check_fused_sample_args(x, t_start, weights, biases, sqrt_recip_alphas, coef_eps,
                          num_steps, total_timesteps, precision);
  return at::empty_symint(x.sym_sizes(), x.options());
}

at::Tensor fused_sample_rule_meta(const SampleRuleCall& call, const SampleRuleExtras& extras) {
  check_sample_rule_args(call, extras);
  const at::Tensor& x = call.x;
  if (call.return_chain) {
    return at::empty_symint({call.num_steps + 1, x.sym_size(0), x.sym_size(1)}, x.options());
  }
  return at::empty_symint(x.sym_sizes(), x.options());
}

// The Autograd kernel of both overloads. There is no backward formula:
// refusing here, at the call, is the only way to never hand back a silently
// wrong (zero or missing) gradient. Boxed, so that every tensor argument of
// the schema is checked without being listed again.
void fused_sample_autograd(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const std::vector<c10::Argument>& parameters = op.schema().arguments();
  const at::ArrayRef<c10::IValue> arguments = torch::jit::last(stack, parameters.size());
  for (size_t i = 0; i < parameters.size(); ++i) refuse_derivatives_of(arguments[i], parameters[i].name());
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  op.callBoxed(stack);
}

}  // namespace

TORCH_LIBRARY(ddpm, m) {
  // New capabilities arrive as trailing arguments with defaults, or as a new
  // overload, so programs saved with an older schema keep loading.
  m.def(
      "fused_sample(Tensor x, Tensor t_start, Tensor[] weights, Tensor[] biases, "
      "Tensor sqrt_recip_alphas, Tensor coef_eps, int num_steps, int total_timesteps, "
      "bool validate=False, str precision=\"fp32\") -> Tensor");
  m.def(
      "fused_sample.rule(Tensor x, Tensor t_start, Tensor[] weights, Tensor[] biases, "
      "Tensor step_tables, int num_steps, str[] activations, Tensor? time_bias=None, "
      "Tensor? cond_bias=None, float[]? clip=None, float[]? post_clip=None, "
      "Tensor? noise=None, bool return_chain=False, bool validate=False, "
      "str precision=\"fp32\", Tensor? noise_seed=None, Tensor? time_input=None, "
      "Tensor[]? time_weights=None, Tensor[]? time_biases=None, str[]? time_activations=None, "
      "Tensor? cond_input=None, Tensor[]? cond_weights=None, Tensor[]? cond_biases=None, "
      "str[]? cond_activations=None, Tensor? clip_bounds=None, "
      "Tensor? post_clip_bounds=None, Generator? generator=None, str[]? network=None, "
      "Tensor[]? norm_weights=None, Tensor[]? norm_biases=None, float? noise_clip=None, "
      "float[]? eps_clip=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(ddpm, Meta, m) {
  m.impl("fused_sample", &fused_sample_meta);
  m.impl("fused_sample.rule", &rule_kernel<&fused_sample_rule_meta>);
}

TORCH_LIBRARY_IMPL(ddpm, Autograd, m) {
  m.impl("fused_sample", torch::CppFunction::makeFromBoxedFunction<&fused_sample_autograd>());
  m.impl("fused_sample.rule", torch::CppFunction::makeFromBoxedFunction<&fused_sample_autograd>());
}

}  // namespace ddpm_ops
