// The schema of ddpm::fused_sample (the one place it is written), its Meta
// kernel for torch.compile / torch.export, and its inference-only Autograd
// kernel. Backend kernels register themselves in csrc/cpu and csrc/cuda.
#include "fused_sample.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace ddpm_ops {
namespace {

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

// There is no backward formula. Refusing here, at the call, is the only way to
// never hand back a silently wrong (zero or missing) gradient.
at::Tensor fused_sample_autograd(const at::Tensor& x, const at::Tensor& t_start,
                                 at::TensorList weights, at::TensorList biases,
                                 const at::Tensor& sqrt_recip_alphas,
                                 const at::Tensor& coef_eps, int64_t num_steps,
                                 int64_t total_timesteps, bool validate,
                                 c10::string_view precision) {
  // Neither derivative exists: refuse a call that would need one, instead of
  // returning an output whose gradient or tangent is silently missing.
  // Forward-mode tangents (torch.func.jvp, torch.autograd.forward_ad) are
  // carried whatever the grad mode.
  const bool grad_mode = at::GradMode::is_enabled();
  auto refuse_derivatives = [grad_mode](const at::Tensor& t, const char* name, int64_t index) {
    const bool needs_grad = grad_mode && t.requires_grad();
    const bool has_tangent = t._fw_grad(/*level=*/0).defined();
    if (!needs_grad && !has_tangent) return;
    const std::string what = index < 0 ? std::string(name)
                                       : std::string(name) + "[" + std::to_string(index) + "]";
    TORCH_CHECK(!needs_grad, "ddpm::fused_sample is inference-only (it has no backward), but ",
                what, " requires grad. Call it under torch.no_grad() or torch.inference_mode(), "
                "or pass detached tensors.");
    TORCH_CHECK(false, "ddpm::fused_sample is inference-only (it has no forward-mode derivative), "
                "but ", what, " carries a forward-mode tangent (torch.func.jvp or "
                "torch.autograd.forward_ad). Pass the primal tensor instead.");
  };
  refuse_derivatives(x, "x", -1);
  for (size_t l = 0; l < weights.size(); ++l) refuse_derivatives(weights[l], "weights", l);
  for (size_t l = 0; l < biases.size(); ++l) refuse_derivatives(biases[l], "biases", l);
  refuse_derivatives(sqrt_recip_alphas, "sqrt_recip_alphas", -1);
  refuse_derivatives(coef_eps, "coef_eps", -1);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ddpm::fused_sample", "")
                       .typed<decltype(fused_sample_autograd)>();
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(x, t_start, weights, biases, sqrt_recip_alphas, coef_eps, num_steps,
                 total_timesteps, validate, precision);
}

}  // namespace

TORCH_LIBRARY(ddpm, m) {
  // New capabilities arrive as trailing arguments with defaults, so programs
  // saved with an older schema keep loading.
  m.def(
      "fused_sample(Tensor x, Tensor t_start, Tensor[] weights, Tensor[] biases, "
      "Tensor sqrt_recip_alphas, Tensor coef_eps, int num_steps, int total_timesteps, "
      "bool validate=False, str precision=\"fp32\") -> Tensor");
}

TORCH_LIBRARY_IMPL(ddpm, Meta, m) { m.impl("fused_sample", &fused_sample_meta); }

TORCH_LIBRARY_IMPL(ddpm, Autograd, m) { m.impl("fused_sample", &fused_sample_autograd); }

}  // namespace ddpm_ops
