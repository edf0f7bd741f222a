// The bias networks of fused_sample.rule (the time_* and cond_* arguments),
// evaluated once per call by ATen ops before any step runs: their rows are
// fixed over the loop, so every kernel adds them to layer 0 like time_bias and
// cond_bias.
#include "../op/fused_sample.h"

#include <ATen/ATen.h>

namespace ddpm_ops {

namespace {

// One overload per activation (visit_activation picks it).
at::Tensor activate(const at::Tensor& h, ActivationTag<Activation::kSilu>) { return at::silu(h); }
at::Tensor activate(const at::Tensor& h, ActivationTag<Activation::kMish>) { return at::mish(h); }
at::Tensor activate(const at::Tensor& h, ActivationTag<Activation::kRelu>) { return at::relu(h); }
at::Tensor activate(const at::Tensor& h, ActivationTag<Activation::kGelu>) { return at::gelu(h, "none"); }
at::Tensor activate(const at::Tensor& h, ActivationTag<Activation::kGeluTanh>) { return at::gelu(h, "tanh"); }
at::Tensor activate(const at::Tensor& h, ActivationTag<Activation::kTanh>) { return at::tanh(h); }
at::Tensor activate(const at::Tensor& h, ActivationTag<Activation::kIdentity>) { return h; }

}  // namespace

at::Tensor activate(const at::Tensor& h, Activation act) {
  return visit_activation(act, [&](auto tag) { return activate(h, tag); });
}

std::optional<at::Tensor> with_bias_net(const std::optional<at::Tensor>& bias, const BiasNet& net) {
  // No input, or an input a network program reads as raw features (no weights).
  if (!net.input.has_value() || !net.weights.has_value()) {
    return bias.has_value() ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
  }
  const at::TensorList weights = *net.weights;
  const at::TensorList biases = net.biases.value_or(at::TensorList());
  const std::vector<Activation> acts = parse_activations(
      net.activations.value_or(std::vector<std::string>()), static_cast<int64_t>(weights.size()));
  at::Tensor h = *net.input;
  for (size_t l = 0; l + 1 < weights.size(); ++l) {
    h = activate(at::linear(h, weights[l], biases[l]), acts[l]);
  }
  h = at::linear(h, weights.back());
  return (bias.has_value() ? *bias + h : h).contiguous();
}

}  // namespace ddpm_ops
