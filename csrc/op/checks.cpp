// Argument checks of ddpm::fused_sample, written once for every backend.
#include "fused_sample.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
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

// "float32" or "float64": a sample's dtype as torch names it in Python.
const char* sample_dtype_name(at::ScalarType type) { return type == at::kDouble ? "float64" : "float32"; }

// The step's own tensors (tables, clamp bounds, noise) are in the sample's
// dtype: the step computes in it, and only the network in float32.
void check_step_dtype_on(const at::Tensor& t, const std::string& name, const at::Tensor& x) {
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), "ddpm::fused_sample: ", name, " must be ",
              sample_dtype_name(x.scalar_type()), " (x's dtype, in which the step computes), got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == x.device(), "ddpm::fused_sample: ", name,
              " must be on x's device ", x.device(), ", got ", t.device());
}

// x: (batch, dim) float32, or float64 where `float64_sample` (the step-rule
// overload); t_start: (batch,) int64 or int32 on x's device.
void check_x_and_t_start(const at::Tensor& x, const at::Tensor& t_start, bool float64_sample) {
  TORCH_CHECK(x.dim() == 2,
              "ddpm::fused_sample: x must be 2-D (batch, dim), got shape ",
              shape_of(x));
  if (float64_sample) {
    TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble,
                "ddpm::fused_sample: x must be float32 or float64 (a float64 sample's step computes "
                "in float64, its network in float32), got ", x.scalar_type());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat,
                "ddpm::fused_sample: x must be float32 (fused_sample.rule takes a float64 sample), got ",
                x.scalar_type());
  }
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
}

// A chain of nn.Linear layers, float32 on x's device: weights[l] is
// (out_l, in_l) with in_0 = first_in_features, in_l = out_{l-1} and the last
// out_l = last_out_features; one (out_l,) bias per layer, but for the last when
// !last_has_bias. `name` is the arguments' prefix ("", "time_", "cond_").
struct LinearChain {
  std::string name;
  c10::SymInt first_in_features;
  std::string first_note;
  c10::SymInt last_out_features;
  std::string last_note;
  bool last_has_bias;
};

void check_linear_chain(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                        const LinearChain& chain) {
  const std::string weights_name = chain.name + "weights", biases_name = chain.name + "biases";
  TORCH_CHECK(!weights.empty(), "ddpm::fused_sample: ", weights_name,
              " must hold at least one Linear weight, got an empty list");
  const size_t num_biases = weights.size() - (chain.last_has_bias ? 0 : 1);
  TORCH_CHECK(biases.size() == num_biases, "ddpm::fused_sample: ", biases_name, " must hold one "
              "bias per weight", chain.last_has_bias ? "" : " but the last", " (", num_biases,
              "), got ", biases.size());
  c10::SymInt in_features = chain.first_in_features;
  for (size_t l = 0; l < weights.size(); ++l) {
    const std::string w_name = weights_name + "[" + std::to_string(l) + "]";
    const at::Tensor& w = weights[l];
    TORCH_CHECK(w.dim() == 2 && w.sym_size(1) == in_features, "ddpm::fused_sample: ", w_name,
                " must have the nn.Linear layout (out_features, ", in_features, ")",
                l == 0 ? chain.first_note : std::string(), ", got shape ", shape_of(w));
    const bool last = l + 1 == weights.size();
    TORCH_CHECK(!last || w.sym_size(0) == chain.last_out_features, "ddpm::fused_sample: ", w_name,
                " is the last layer and must output ", chain.last_note, " = ",
                chain.last_out_features, " features, got shape ", shape_of(w));
    TORCH_CHECK(w.sym_size(0) >= 1, "ddpm::fused_sample: ", w_name,
                " must have at least one output feature, got shape ", shape_of(w));
    check_float32_on(w, w_name, x);
    if (l < biases.size()) {
      const std::string b_name = biases_name + "[" + std::to_string(l) + "]";
      const at::Tensor& b = biases[l];
      TORCH_CHECK(b.dim() == 1 && b.sym_size(0) == w.sym_size(0), "ddpm::fused_sample: ", b_name,
                  " must have shape (", w.sym_size(0), ",) to match ", w_name, ", got shape ",
                  shape_of(b));
      check_float32_on(b, b_name, x);
    }
    in_features = w.sym_size(0);
  }
}

// The network of the time_* or cond_* arguments (`prefix`): its input has
// `rows` rows (`rows_note` says which) and its output layer 0's width.
void check_bias_net(const at::Tensor& x, const BiasNet& net, const std::string& prefix,
                    const c10::SymInt& rows, const char* rows_note, const c10::SymInt& hidden0,
                    bool raw_input) {
  const std::string input_name = prefix + "input";
  if (raw_input) {
    // The program's "input" instruction reads these rows as they are.
    TORCH_CHECK(net.input.has_value(), "ddpm::fused_sample: network reads ", input_name, " (its \"input\" "
                "instruction names \"", prefix.substr(0, prefix.size() - 1), "\"), but ", input_name, " is None");
    TORCH_CHECK(!net.weights.has_value() && !net.biases.has_value() && !net.activations.has_value(),
                "ddpm::fused_sample: ", input_name, " is read by the network's \"input\" instruction as "
                "raw features: expected no ", prefix, "weights, ", prefix, "biases or ", prefix,
                "activations, got ", net.weights.has_value() ? "weights" : net.biases.has_value() ? "biases" : "activations");
    const at::Tensor& input = *net.input;
    TORCH_CHECK(input.dim() == 2 && input.sym_size(0) == rows && input.sym_size(1) >= 1, "ddpm::fused_sample: ",
                input_name, " must have shape (", rows_note, ", features) = (", rows, ", features), got shape ",
                shape_of(input));
    check_float32_on(input, input_name, x);
    return;
  }
  if (!net.input.has_value()) {
    TORCH_CHECK(!net.weights.has_value() && !net.biases.has_value() && !net.activations.has_value(),
                "ddpm::fused_sample: ", prefix, "weights, ", prefix, "biases and ", prefix,
                "activations describe the network of ", input_name, ": expected none of them "
                "without ", input_name, ", got ",
                net.weights.has_value() ? "weights" : net.biases.has_value() ? "biases" : "activations");
    return;
  }
  const at::Tensor& input = *net.input;
  TORCH_CHECK(input.dim() == 2 && input.sym_size(0) == rows, "ddpm::fused_sample: ", input_name,
              " must have shape (", rows_note, ", features) = (", rows, ", features), got shape ",
              shape_of(input));
  check_float32_on(input, input_name, x);
  TORCH_CHECK(net.weights.has_value(), "ddpm::fused_sample: ", input_name, " needs ", prefix,
              "weights (at least layer 0's columns for it), got none");
  const at::TensorList weights = *net.weights;
  check_linear_chain(x, weights, net.biases.value_or(at::TensorList()),
                     {prefix, input.sym_size(1), " where in_features = " + input_name + "'s columns",
                      hidden0, "the out_features of weights[0]", /*last_has_bias=*/false});
  parse_activations(net.activations.value_or(std::vector<std::string>()),
                    static_cast<int64_t>(weights.size()), (prefix + "activations").c_str());
}

// One clamp, given as two floats (`range`) or as per-column bounds (`bounds`,
// (2, dim) float32 on x's device), or not at all.
void check_clamp(const at::Tensor& x, OptionalRange range, const std::optional<at::Tensor>& bounds,
                 const char* range_name, const char* bounds_name) {
  parse_clip(range, range_name);
  if (!bounds.has_value()) return;
  TORCH_CHECK(!range.has_value(), "ddpm::fused_sample: ", range_name, " and ", bounds_name,
              ": expected at most one of them (a clamp to two floats, or to per-column bounds), "
              "got both");
  TORCH_CHECK(bounds->dim() == 2 && bounds->sym_size(0) == 2 && bounds->sym_size(1) == x.sym_size(1),
              "ddpm::fused_sample: ", bounds_name, " must have shape (2, dim) = (2, ",
              x.sym_size(1), ") (row 0 the lower bounds, row 1 the upper), got shape ",
              shape_of(*bounds));
  check_step_dtype_on(*bounds, bounds_name, x);
}

}  // namespace

void check_fused_sample_args(const at::Tensor& x, const at::Tensor& t_start,
                             at::TensorList weights, at::TensorList biases,
                             const at::Tensor& sqrt_recip_alphas,
                             const at::Tensor& coef_eps, int64_t num_steps,
                             int64_t total_timesteps, c10::string_view precision) {
  check_x_and_t_start(x, t_start, /*float64_sample=*/false);
  check_linear_chain(x, weights, biases, {"", x.sym_size(1) + 1, " where in_features = dim + 1 (the time column)",
                                          x.sym_size(1), "dim", /*last_has_bias=*/true});

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

namespace {

// The shapes of a network program's tensors, by walking it with h's width.
void check_program_shapes(const SampleRuleCall& call, const SampleRuleExtras& extras,
                          const NetworkProgram& program) {
  const at::Tensor& x = call.x;
  c10::SymInt width = 0;
  std::string input_note;
  for (InputPart part : program.input) {
    const char* name = part == InputPart::kX ? "x" : part == InputPart::kCond ? "cond_input" : "time_input";
    const std::optional<at::Tensor>& rows = part == InputPart::kCond ? call.cond_net.input : call.time_net.input;
    width = width + (part == InputPart::kX ? x.sym_size(1) : rows->sym_size(1));
    input_note += (input_note.empty() ? "" : " + ") + std::string(name) + "'s columns";
  }
  TORCH_CHECK(call.biases.size() == call.weights.size(), "ddpm::fused_sample: biases must hold one bias per "
              "weight (", call.weights.size(), "), got ", call.biases.size());
  const at::TensorList norm_weights = extras.norm_weights.value_or(at::TensorList());
  const at::TensorList norm_biases = extras.norm_biases.value_or(at::TensorList());
  std::vector<c10::SymInt> saved;
  const std::vector<std::string>& network = *extras.network;
  for (const NetworkOp& op : program.ops) {
    const std::string where = "network[" + std::to_string(op.position) + "] \"" + network[op.position] + "\"";
    if (op.kind == NetworkOp::Kind::kLinear) {
      const std::string w_name = "weights[" + std::to_string(op.index) + "]";
      const std::string b_name = "biases[" + std::to_string(op.index) + "]";
      const at::Tensor& w = call.weights[op.index];
      const at::Tensor& b = call.biases[op.index];
      TORCH_CHECK(w.dim() == 2 && w.sym_size(1) == width && w.sym_size(0) >= 1, "ddpm::fused_sample: ", w_name,
                  " (", where, ") must have the nn.Linear layout (out_features, ", width, ")",
                  op.index == 0 && program.ops[0].kind == NetworkOp::Kind::kLinear ? " where in_features = " +
                  (input_note.empty() ? std::string("dim") : input_note) : std::string(" (h's width there)"),
                  ", got shape ", shape_of(w));
      check_float32_on(w, w_name, x);
      TORCH_CHECK(b.dim() == 1 && b.sym_size(0) == w.sym_size(0), "ddpm::fused_sample: ", b_name,
                  " must have shape (", w.sym_size(0), ",) to match ", w_name, ", got shape ", shape_of(b));
      check_float32_on(b, b_name, x);
      width = w.sym_size(0);
    } else if (op.kind == NetworkOp::Kind::kLayerNorm && op.index >= 0) {
      for (const auto& [list, name] : {std::make_pair(norm_weights, "norm_weights"),
                                       std::make_pair(norm_biases, "norm_biases")}) {
        const std::string t_name = std::string(name) + "[" + std::to_string(op.index) + "]";
        const at::Tensor& t = list[op.index];
        TORCH_CHECK(t.dim() == 1 && t.sym_size(0) == width, "ddpm::fused_sample: ", t_name, " (", where,
                    ") must have shape (", width, ",) (h's width there), got shape ", shape_of(t));
        check_float32_on(t, t_name, x);
      }
    } else if (op.kind == NetworkOp::Kind::kSave) {
      saved.push_back(width);
    } else if (op.kind == NetworkOp::Kind::kAdd) {
      TORCH_CHECK(saved.back() == width, "ddpm::fused_sample: ", where, " adds the saved h of ", saved.back(),
                  " columns to h of ", width, " columns: expected equal widths");
      saved.pop_back();
    }
  }
  TORCH_CHECK(width == x.sym_size(1), "ddpm::fused_sample: network must end with h of dim = ", x.sym_size(1),
              " columns (the network's output), got ", width);
}

}  // namespace

void check_sample_rule_args(const SampleRuleCall& call, const SampleRuleExtras& extras) {
  const at::Tensor& x = call.x;
  check_x_and_t_start(x, call.t_start, /*float64_sample=*/true);
  if (!extras.network.has_value()) {
    check_linear_chain(x, call.weights, call.biases, {"", x.sym_size(1), " where in_features = dim (x alone)",
                                                      x.sym_size(1), "dim", /*last_has_bias=*/true});
  }
  const NetworkProgram program = parse_network(call, extras);
  if (extras.noise_clip.has_value()) {
    // !(c > 0) also refuses NaN.
    TORCH_CHECK(*extras.noise_clip > 0, "ddpm::fused_sample: noise_clip must be > 0 (z is clamped to "
                "[-noise_clip, noise_clip]), got ", *extras.noise_clip);
  }

  TORCH_CHECK(call.step_tables.dim() == 2 &&
                  (call.step_tables.sym_size(0) == kStepTables ||
                   call.step_tables.sym_size(0) == kStepTablesWithPrevious ||
                   call.step_tables.sym_size(0) == kStepTablesWithEpsReadback) &&
                  call.step_tables.sym_size(1) >= 1,
              "ddpm::fused_sample: step_tables must have shape (6, steps) (the rows A, B, C, D, "
              "E, S of the step rule), (7, steps) (and P, the previous step's x0 coefficient) or "
              "(9, steps) (and Q, R: the eps read back from x0), got shape ", shape_of(call.step_tables));
  if (parse_clip(extras.eps_clip, "eps_clip").has_value()) {
    TORCH_CHECK(call.step_tables.sym_size(0) == kStepTablesWithEpsReadback,
                "ddpm::fused_sample: eps_clip clamps the eps read back from x0 (the rows Q and R of "
                "step_tables): expected step_tables of 9 rows, got shape ", shape_of(call.step_tables));
  }
  check_step_dtype_on(call.step_tables, "step_tables", x);
  const c10::SymInt& table_length = call.step_tables.sym_size(1);
  TORCH_CHECK(call.num_steps >= 0, "ddpm::fused_sample: num_steps must be >= 0, got ", call.num_steps);
  TORCH_CHECK(table_length >= call.num_steps, "ddpm::fused_sample: num_steps must be at most the "
              "length of the step tables (", table_length, "), got ", call.num_steps);

  TORCH_CHECK(call.weights[0].dim() == 2, "ddpm::fused_sample: weights[0] must have the nn.Linear layout "
              "(out_features, in_features), got shape ", shape_of(call.weights[0]));
  const c10::SymInt& hidden0 = call.weights[0].sym_size(0);
  if (call.time_bias.has_value()) {
    TORCH_CHECK(call.time_bias->dim() == 2 && call.time_bias->sym_size(0) == table_length &&
                    call.time_bias->sym_size(1) == hidden0,
                "ddpm::fused_sample: time_bias must have shape (steps, out_features of "
                "weights[0]) = (", table_length, ", ", hidden0, "), got shape ",
                shape_of(*call.time_bias));
    check_float32_on(*call.time_bias, "time_bias", x);
  }
  if (call.cond_bias.has_value()) {
    TORCH_CHECK(call.cond_bias->dim() == 2 && call.cond_bias->sym_size(0) == x.sym_size(0) &&
                    call.cond_bias->sym_size(1) == hidden0,
                "ddpm::fused_sample: cond_bias must have shape (batch, out_features of "
                "weights[0]) = (", x.sym_size(0), ", ", hidden0, "), got shape ",
                shape_of(*call.cond_bias));
    check_float32_on(*call.cond_bias, "cond_bias", x);
  }
  check_bias_net(x, call.time_net, "time_", table_length, "steps", hidden0, program.reads(InputPart::kTime));
  check_bias_net(x, call.cond_net, "cond_", x.sym_size(0), "batch", hidden0, program.reads(InputPart::kCond));
  if (extras.network.has_value()) check_program_shapes(call, extras, program);
  check_clamp(x, call.clip, call.clip_bounds, "clip", "clip_bounds");
  check_clamp(x, call.post_clip, call.post_clip_bounds, "post_clip", "post_clip_bounds");
  if (call.noise.has_value()) {
    TORCH_CHECK(call.noise->dim() == 3 && call.noise->sym_size(0) == call.num_steps &&
                    call.noise->sym_size(1) == x.sym_size(0) && call.noise->sym_size(2) == x.sym_size(1),
                "ddpm::fused_sample: noise must have shape (num_steps, batch, dim) = (",
                call.num_steps, ", ", x.sym_size(0), ", ", x.sym_size(1), "), got shape ",
                shape_of(*call.noise));
    check_step_dtype_on(*call.noise, "noise", x);
  }
  if (call.noise_seed.has_value()) {
    TORCH_CHECK(!call.noise.has_value(), "ddpm::fused_sample: noise and noise_seed: expected at most "
                "one of them (the noise, or a seed to draw it from), got both");
    TORCH_CHECK(call.noise_seed->scalar_type() == at::kLong, "ddpm::fused_sample: noise_seed must be "
                "int64, got ", call.noise_seed->scalar_type());
    // Read without a guard on the batch: a seed per row of a dynamic batch is
    // (batch,) symbolically, and a one-element seed has a concrete size.
    const std::optional<int64_t> numel = call.noise_seed->sym_numel().maybe_as_int();
    TORCH_CHECK((numel.has_value() && *numel == 1) ||
                    (call.noise_seed->dim() == 1 && call.noise_seed->sym_size(0) == x.sym_size(0)),
                "ddpm::fused_sample: noise_seed must be one element (a seed for the batch) or have "
                "shape (batch,) = (", x.sym_size(0), ",) (a seed per row), got shape ",
                shape_of(*call.noise_seed));
    TORCH_CHECK(call.noise_seed->device() == x.device(), "ddpm::fused_sample: noise_seed must be on "
                "x's device (", x.device(), "), got ", call.noise_seed->device());
  }
  if (call.generator.has_value() && call.generator->defined()) {
    TORCH_CHECK(!call.noise.has_value() && !call.noise_seed.has_value(), "ddpm::fused_sample: generator: expected "
                "no noise and no noise_seed beside it (it is where the op draws its noise from), got ",
                call.noise.has_value() ? "noise" : "noise_seed");
    TORCH_CHECK(call.generator->device().type() == x.device().type(), "ddpm::fused_sample: generator must be "
                "a generator of x's device type (", x.device().type(), "), got one of ",
                call.generator->device().type());
  }
  parse_precision(call.precision);
}

namespace {

// The activations by their names in the schema.
std::optional<Activation> find_activation(const std::string& name) {
  const auto hit = std::find(kActivationNames.begin(), kActivationNames.end(), name);
  if (hit == kActivationNames.end()) return std::nullopt;
  return static_cast<Activation>(hit - kActivationNames.begin());
}

// "silu, mish, ...": the names find_activation knows, for the messages.
std::string activation_names() { return c10::Join(", ", kActivationNames); }

// "<prefix><decimal float>" -> the float, or nullopt.
std::optional<double> parse_suffix_float(const std::string& text, const std::string& prefix) {
  if (text.rfind(prefix, 0) != 0 || text.size() == prefix.size()) return std::nullopt;
  const std::string number = text.substr(prefix.size());
  char* end = nullptr;
  const double value = std::strtod(number.c_str(), &end);
  if (end != number.c_str() + number.size()) return std::nullopt;
  return value;
}

}  // namespace

std::vector<Activation> parse_activations(const std::vector<std::string>& names,
                                          int64_t num_layers, const char* name) {
  TORCH_CHECK(static_cast<int64_t>(names.size()) == num_layers - 1,
              "ddpm::fused_sample: ", name, " must name one activation per hidden layer (",
              num_layers - 1, " for ", num_layers, " weights), got ", names.size());
  std::vector<Activation> parsed;
  for (size_t l = 0; l < names.size(); ++l) {
    const std::optional<Activation> hit = find_activation(names[l]);
    TORCH_CHECK(hit.has_value(), "ddpm::fused_sample: ", name, "[", l, "] must be one of ",
                activation_names(), ", got \"", names[l], "\"");
    parsed.push_back(*hit);
  }
  return parsed;
}

NetworkProgram parse_network(const SampleRuleCall& call, const SampleRuleExtras& extras) {
  NetworkProgram program;
  const int64_t num_weights = static_cast<int64_t>(call.weights.size());
  if (!extras.network.has_value()) {
    TORCH_CHECK(!extras.norm_weights.has_value() && !extras.norm_biases.has_value(),
                "ddpm::fused_sample: norm_weights and norm_biases are the LayerNorms of a network program: "
                "expected none of them without network, got ",
                extras.norm_weights.has_value() ? "norm_weights" : "norm_biases");
    const std::vector<Activation> acts = parse_activations(call.activations, num_weights);
    for (int64_t l = 0; l < num_weights; ++l) {
      if (l > 0) program.ops.push_back({NetworkOp::Kind::kActivation, acts[l - 1]});
      program.ops.push_back({NetworkOp::Kind::kLinear, Activation::kIdentity, l});
    }
    return program;
  }
  const std::vector<std::string>& network = *extras.network;
  TORCH_CHECK(call.activations.empty(), "ddpm::fused_sample: activations must be empty with a network "
              "program (its instructions name the activations), got ", call.activations.size(), " names");
  int64_t linears = 0, affine_norms = 0, depth = 0;
  for (size_t i = 0; i < network.size(); ++i) {
    const std::string& text = network[i];
    const std::string where = "ddpm::fused_sample: network[" + std::to_string(i) + "] ";
    if (text.rfind("input:", 0) == 0) {
      TORCH_CHECK(i == 0, where, "\"", text, "\": the \"input\" instruction must be the first, got it at "
                  "position ", i);
      program.input.clear();
      std::string rest = text.substr(6);
      size_t start = 0;
      while (true) {
        const size_t comma = rest.find(',', start);
        const std::string part = rest.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        const InputPart parsed = part == "x" ? InputPart::kX : part == "cond" ? InputPart::kCond
                               : part == "time" ? InputPart::kTime : static_cast<InputPart>(-1);
        TORCH_CHECK(static_cast<int>(parsed) >= 0, where, "\"", text, "\": the input's parts must be x, cond "
                    "or time, comma-separated, got \"", part, "\"");
        TORCH_CHECK(!program.reads(parsed) || program.input.empty(), where, "\"", text,
                    "\": expected each part at most once, got \"", part, "\" twice");
        program.input.push_back(parsed);
        if (comma == std::string::npos) break;
        start = comma + 1;
      }
      TORCH_CHECK(program.reads(InputPart::kX), where, "\"", text, "\": the input must contain x");
      continue;
    }
    const size_t before = program.ops.size();
    if (text == "linear") {
      program.ops.push_back({NetworkOp::Kind::kLinear, Activation::kIdentity, linears++});
    } else if (text == "save") {
      program.ops.push_back({NetworkOp::Kind::kSave});
      program.max_saved = std::max(program.max_saved, ++depth);
    } else if (text == "add") {
      TORCH_CHECK(depth > 0, where, "\"add\" needs a saved h (a \"save\" before it), got none left");
      --depth;
      program.ops.push_back({NetworkOp::Kind::kAdd});
    } else if (const std::optional<Activation> act = find_activation(text)) {
      program.ops.push_back({NetworkOp::Kind::kActivation, *act});
    } else {
      const bool affine = text.rfind("layer_norm_affine:", 0) == 0;
      const std::optional<double> eps =
          parse_suffix_float(text, affine ? "layer_norm_affine:" : "layer_norm:");
      TORCH_CHECK(eps.has_value(), where, "must be \"linear\", an activation (", activation_names(),
                  "), \"layer_norm:<eps>\", \"layer_norm_affine:<eps>\", \"save\", "
                  "\"add\" or (first) \"input:<parts>\", got \"", text, "\"");
      TORCH_CHECK(std::isfinite(*eps) && *eps >= 0, where, "\"", text, "\": expected a finite eps >= 0, got ",
                  *eps);
      program.ops.push_back({NetworkOp::Kind::kLayerNorm, Activation::kIdentity,
                             affine ? affine_norms++ : -1, *eps});
    }
    if (program.ops.size() > before) program.ops.back().position = static_cast<int64_t>(i);
  }
  TORCH_CHECK(depth == 0, "ddpm::fused_sample: network leaves ", depth, " saved h unused: expected an \"add\" "
              "for every \"save\"");
  TORCH_CHECK(linears >= 1 && linears == num_weights, "ddpm::fused_sample: network must have one \"linear\" "
              "instruction per weight (", num_weights, ") and at least one, got ", linears);
  const int64_t norm_weights = static_cast<int64_t>(extras.norm_weights.value_or(at::TensorList()).size());
  const int64_t norm_biases = static_cast<int64_t>(extras.norm_biases.value_or(at::TensorList()).size());
  TORCH_CHECK(norm_weights == affine_norms && norm_biases == affine_norms, "ddpm::fused_sample: norm_weights "
              "and norm_biases must hold one tensor per \"layer_norm_affine\" instruction (", affine_norms,
              "), got ", norm_weights, " and ", norm_biases);
  return program;
}

std::optional<std::pair<double, double>> parse_clip(OptionalRange range,
                                                    const char* name) {
  if (!range.has_value()) return std::nullopt;
  TORCH_CHECK(range->size() == 2, "ddpm::fused_sample: ", name, " must be a (lo, hi) pair, got ",
              range->size(), " values");
  const double lo = (*range)[0], hi = (*range)[1];
  // !(lo <= hi) also refuses NaN bounds.
  TORCH_CHECK(lo <= hi, "ddpm::fused_sample: ", name, " must have lo <= hi, got (", lo, ", ",
              hi, ")");
  return std::make_pair(lo, hi);
}

void check_bounds_ordered(const at::Tensor& bounds, const char* name) {
  // A scan by pointer: ATen ops per call would cost a small batch's call more than its steps.
  const at::Tensor host = bounds.to(at::kCPU).contiguous();
  const int64_t dim = host.size(1);
  AT_DISPATCH_FLOATING_TYPES(host.scalar_type(), "check_bounds_ordered", [&] {
    const scalar_t* lo = host.data_ptr<scalar_t>();
    const scalar_t* hi = lo + dim;
    for (int64_t j = 0; j < dim; ++j) {
      // !(lo <= hi) also refuses NaN bounds.
      TORCH_CHECK(lo[j] <= hi[j], "ddpm::fused_sample: ", name, " must have lo <= hi in every "
                  "column, got lo = ", lo[j], " and hi = ", hi[j], " in column ", j);
    }
  });
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
