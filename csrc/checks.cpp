// Argument checks of ddpm::fused_sample, written once for every backend.
#include "fused_sample.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <sstream>

namespace ddpm_ops {
namespace {

std::string shape_of(const at::Tensor& t) {
  std::ostringstream out;
  out << t.sym_sizes();
  return out.str();
}

void check_float32_on(const at::Tensor& t, const std::string& name,
                      const at::Tensor& x) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "ddpm::fused_sample: ", name,
              " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.device() == x.device(), "ddpm::fused_sample: ", name,
              " must be on x's device ", x.device(), ", got ", t.device());
}

}  // namespace

void check_fused_sample_args(const at::Tensor& x, const at::Tensor& t_start,
                             at::TensorList weights, at::TensorList biases,
                             const at::Tensor& sqrt_recip_alphas,
                             const at::Tensor& coef_eps, int64_t num_steps,
                             int64_t total_timesteps, c10::string_view precision) {
  TORCH_CHECK(x.dim() == 2,
              "ddpm::fused_sample: x must be 2-D (batch, dim), got shape ",
              shape_of(x));
  TORCH_CHECK(x.scalar_type() == at::kFloat,
              "ddpm::fused_sample: x must be float32, got ", x.scalar_type());
  const c10::SymInt& batch = x.sym_size(0);
  const c10::SymInt& dim = x.sym_size(1);
  TORCH_CHECK(dim >= 1, "ddpm::fused_sample: x must have at least one column, got shape ",
              shape_of(x));

  TORCH_CHECK(t_start.dim() == 1 && t_start.sym_size(0) == batch,
              "ddpm::fused_sample: t_start must have shape (batch,) = (", batch,
              ",) to match x, got shape ", shape_of(t_start));
  TORCH_CHECK(t_start.scalar_type() == at::kLong || t_start.scalar_type() == at::kInt,
              "ddpm::fused_sample: t_start must be int64 or int32, got ",
              t_start.scalar_type());
  TORCH_CHECK(t_start.device() == x.device(),
              "ddpm::fused_sample: t_start must be on x's device ", x.device(),
              ", got ", t_start.device());

  TORCH_CHECK(!weights.empty(),
              "ddpm::fused_sample: weights must hold at least one Linear weight, got an empty list");
  TORCH_CHECK(biases.size() == weights.size(), "ddpm::fused_sample: biases must hold one bias per "
              "weight (", weights.size(), "), got ", biases.size());
  c10::SymInt in_features = dim + 1;  // the last input column is t / total_timesteps
  for (size_t l = 0; l < weights.size(); ++l) {
    const std::string w_name = "weights[" + std::to_string(l) + "]";
    const std::string b_name = "biases[" + std::to_string(l) + "]";
    const at::Tensor& w = weights[l];
    const at::Tensor& b = biases[l];
    TORCH_CHECK(w.dim() == 2 && w.sym_size(1) == in_features, "ddpm::fused_sample: ", w_name,
                " must have the nn.Linear layout (out_features, ", in_features, ")",
                l == 0 ? " where in_features = dim + 1 (the time column)" : "",
                ", got shape ", shape_of(w));
    const bool last = l + 1 == weights.size();
    TORCH_CHECK(!last || w.sym_size(0) == dim, "ddpm::fused_sample: ", w_name,
                " is the last layer and must output dim = ", dim,
                " features, got shape ", shape_of(w));
    TORCH_CHECK(w.sym_size(0) >= 1, "ddpm::fused_sample: ", w_name,
                " must have at least one output feature, got shape ", shape_of(w));
    TORCH_CHECK(b.dim() == 1 && b.sym_size(0) == w.sym_size(0), "ddpm::fused_sample: ", b_name,
                " must have shape (", w.sym_size(0), ",) to match ", w_name, ", got shape ",
                shape_of(b));
    check_float32_on(w, w_name, x);
    check_float32_on(b, b_name, x);
    in_features = w.sym_size(0);
  }

  TORCH_CHECK(sqrt_recip_alphas.dim() == 1 && sqrt_recip_alphas.sym_size(0) >= 1,
              "ddpm::fused_sample: sqrt_recip_alphas must be a non-empty 1-D table, got shape ",
              shape_of(sqrt_recip_alphas));
  TORCH_CHECK(coef_eps.dim() == 1 && coef_eps.sym_size(0) == sqrt_recip_alphas.sym_size(0),
              "ddpm::fused_sample: coef_eps must be 1-D with the length of sqrt_recip_alphas (",
              sqrt_recip_alphas.sym_size(0), "), got shape ", shape_of(coef_eps));
  check_float32_on(sqrt_recip_alphas, "sqrt_recip_alphas", x);
  check_float32_on(coef_eps, "coef_eps", x);

  TORCH_CHECK(num_steps >= 0, "ddpm::fused_sample: num_steps must be >= 0, got ", num_steps);
  // Step k reads timestep t_start - k, so K steps need K distinct table rows:
  // more steps than rows cannot be in range for any t_start.
  TORCH_CHECK(sqrt_recip_alphas.sym_size(0) >= num_steps, "ddpm::fused_sample: num_steps must "
              "be at most the length of the coefficient tables (", sqrt_recip_alphas.sym_size(0),
              "), got ", num_steps);
  TORCH_CHECK(total_timesteps >= 1,
              "ddpm::fused_sample: total_timesteps must be >= 1 (it divides t), got ",
              total_timesteps);
  parse_precision(precision);
}

void check_timesteps_in_range(const at::Tensor& t_start, int64_t num_steps,
                              int64_t table_length) {
  if (num_steps == 0 || t_start.numel() == 0) {
    return;  // no step reads the tables
  }
  auto [lowest, highest] = at::aminmax(t_start);
  const int64_t lo = lowest.item<int64_t>();
  const int64_t hi = highest.item<int64_t>();
  // lo >= num_steps - 1, not lo - (num_steps - 1) >= 0: that overflows for t near INT64_MIN.
  TORCH_CHECK(lo >= num_steps - 1 && hi < table_length,
              "ddpm::fused_sample: t_start out of range: step k uses timestep t_start - k, so "
              "every t_start must lie in [num_steps - 1, table length - 1] = [",
              num_steps - 1, ", ", table_length - 1, "] (num_steps = ", num_steps,
              ", table length = ", table_length, "), got t_start in [", lo, ", ", hi, "]");
}

Precision parse_precision(c10::string_view precision) {
  if (precision == "fp32") return Precision::kFloat32;
  if (precision == "tf32") return Precision::kTF32;
  if (precision == "bf16") return Precision::kBFloat16;
  TORCH_CHECK(false, "ddpm::fused_sample: precision must be one of \"fp32\", \"tf32\", "
              "\"bf16\", got \"", std::string(precision), "\"");
}

}  // namespace ddpm_ops
