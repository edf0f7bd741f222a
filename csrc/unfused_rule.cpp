// fused_sample.rule as a loop of ATen ops: the kernel of every device that has
// no fused kernel for the general step (CUDA among them, for now). It keeps
// the op's contract (one call, the same numbers as the reference, torch.compile,
// export and AOTInductor capture the call), not its speed.
#include "fused_sample.h"

#include <ATen/ATen.h>
#include <torch/library.h>

namespace ddpm_ops {
namespace {

at::Tensor activate(const at::Tensor& h, Activation act) {
  switch (act) {
    case Activation::kSilu: return at::silu(h);
    case Activation::kMish: return at::mish(h);
    case Activation::kRelu: return at::relu(h);
    case Activation::kGelu: return at::gelu(h, "none");
    case Activation::kGeluTanh: return at::gelu(h, "tanh");
    case Activation::kTanh: return at::tanh(h);
    case Activation::kIdentity: return h;
  }
  return h;
}

}  // namespace

at::Tensor fused_sample_rule_unfused(const at::Tensor& x, const at::Tensor& t_start,
                                     at::TensorList weights, at::TensorList biases,
                                     const at::Tensor& step_tables, int64_t num_steps,
                                     const std::vector<std::string>& activations,
                                     const std::optional<at::Tensor>& time_bias,
                                     const std::optional<at::Tensor>& cond_bias,
                                     OptionalRange clip, OptionalRange post_clip,
                                     const std::optional<at::Tensor>& noise, bool return_chain,
                                     bool validate, c10::string_view precision) {
  check_sample_rule_args(x, t_start, weights, biases, step_tables, num_steps, activations,
                         time_bias, cond_bias, clip, post_clip, noise, precision);
  const int64_t table_length = step_tables.size(1);
  // Off the CPU the default never synchronises: a row whose step indices leave
  // the tables reads clamped indices and ends as NaN, as the fused kernels do.
  if (validate || x.is_cpu()) check_timesteps_in_range(t_start, num_steps, table_length);
  const std::vector<Activation> acts =
      parse_activations(activations, static_cast<int64_t>(weights.size()));
  const auto x0_range = parse_clip(clip, "clip");
  const auto x_range = parse_clip(post_clip, "post_clip");

  const at::Tensor t = t_start.to(at::kLong);
  at::Tensor current = x.clone(at::MemoryFormat::Contiguous);
  std::vector<at::Tensor> chain{current};
  for (int64_t k = 0; k < num_steps; ++k) {
    const at::Tensor s = (t - k).clamp(0, table_length - 1);
    at::Tensor h = at::linear(current, weights[0], biases[0]);
    if (time_bias.has_value()) h = h + time_bias->index_select(0, s);
    if (cond_bias.has_value()) h = h + *cond_bias;
    for (size_t l = 1; l < weights.size(); ++l) {
      h = at::linear(activate(h, acts[l - 1]), weights[l], biases[l]);
    }
    const at::Tensor c = step_tables.index_select(1, s).unsqueeze(2);  // (6, batch, 1)
    at::Tensor x0 = c[kA] * current - c[kB] * h;
    if (x0_range) x0 = x0.clamp(x0_range->first, x0_range->second);
    at::Tensor next = c[kC] * x0 + c[kD] * current + c[kE] * h;
    if (noise.has_value()) next = next + c[kS] * (*noise)[k];
    if (x_range) next = next.clamp(x_range->first, x_range->second);
    current = next;
    if (return_chain) chain.push_back(current);
  }
  at::Tensor out = return_chain ? at::stack(chain) : current;
  if (num_steps > 0 && !x.is_cpu()) {
    const at::Tensor in_range = (t - (num_steps - 1) >= 0) & (t < table_length);
    out = at::where(in_range.unsqueeze(1), out, at::full({}, NAN, out.options()));
  }
  return out;
}

// Every backend without a kernel of its own (the CPU registers one).
TORCH_LIBRARY_IMPL(ddpm, CompositeExplicitAutograd, m) {
  m.impl("fused_sample.rule", &fused_sample_rule_unfused);
}

}  // namespace ddpm_ops
