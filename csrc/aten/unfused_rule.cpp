// fused_sample.rule as a loop of ATen ops: the kernel of every device that has
// no fused kernel for the general step, and of the calls a device's kernel
// does not take (on CUDA, among others, a float64 sample). It keeps the op's
// contract (one call, the same numbers as the reference, torch.compile,
// export and AOTInductor capture the call), not its speed.
#include "../op/fused_sample.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>

#include "../common/seeded_noise.h"

namespace ddpm_ops {
namespace {

// Unsigned integer arithmetic in int64 lanes, for the seeded noise.
// v >> s of the unsigned 64-bit value v holds: the arithmetic shift, sign bits masked.
at::Tensor shift_right(const at::Tensor& v, int s) {
  return at::bitwise_and(at::bitwise_right_shift(v, s), (int64_t{1} << (64 - s)) - 1);
}

// mod 2^64: int64 products wrap.
at::Tensor mix64(at::Tensor z) {
  namespace sn = seeded_noise;
  z = at::bitwise_xor(z, shift_right(z, sn::kMix64Shift1)) * static_cast<int64_t>(sn::kMix64Mul1);
  z = at::bitwise_xor(z, shift_right(z, sn::kMix64Shift2)) * static_cast<int64_t>(sn::kMix64Mul2);
  return at::bitwise_xor(z, shift_right(z, sn::kMix64Shift3));
}

// (a * b) mod 2^32 for 0 <= a < 2^32, exact: by 16-bit halves of a, every
// product stays below 2^48.
at::Tensor mul_mod32(const at::Tensor& a, uint32_t b) {
  const int64_t m = b;
  const at::Tensor low = at::bitwise_and(a, 0xffff) * m;
  const at::Tensor high = at::bitwise_left_shift(
      at::bitwise_and(at::bitwise_right_shift(a, 16) * m, 0xffff), 16);
  return at::bitwise_and(low + high, 0xffffffff);
}

// 0 <= x < 2^32.
at::Tensor mix32(at::Tensor x) {
  namespace sn = seeded_noise;
  x = mul_mod32(at::bitwise_xor(x, at::bitwise_right_shift(x, sn::kMix32Shift1)), sn::kMix32Mul1);
  x = mul_mod32(at::bitwise_xor(x, at::bitwise_right_shift(x, sn::kMix32Shift2)), sn::kMix32Mul2);
  return at::bitwise_xor(x, at::bitwise_right_shift(x, sn::kMix32Shift3));
}

// The (K, batch, dim) noise drawn from `seed` (seeded_noise.h: one seed, or
// one per row), on the seed's device and without reading it on the host.
at::Tensor seeded_noise_of(const at::Tensor& seed, int64_t num_steps, int64_t batch, int64_t dim,
                           const at::TensorOptions& float_options) {
  const at::TensorOptions long_options = seed.options().dtype(at::kLong);
  // The counter q of noise_key, and mix64 of the seed, broadcast to (K, batch).
  const bool per_row = seed_per_row(seed);
  const at::Tensor counters = per_row ? at::arange(num_steps, long_options).unsqueeze(1)
                                      : at::arange(num_steps * batch, long_options).view({num_steps, batch});
  const at::Tensor seed_keys = per_row ? mix64(seed.reshape({1, batch})) : mix64(seed.reshape({}));
  const at::Tensor keys = mix64(at::bitwise_xor(counters, seed_keys)).reshape({num_steps * batch, 1});
  const at::Tensor low = at::bitwise_and(keys, 0xffffffff), high = shift_right(keys, 32);
  const at::Tensor columns = at::arange(dim, long_options);
  const at::Tensor bits = mix32(at::bitwise_and(mix32(at::bitwise_xor(columns, low)) + high, 0xffffffff));
  constexpr int64_t kRange = int64_t{1} << seeded_noise::kUniformBits;
  const at::Tensor top = at::bitwise_right_shift(bits, 32 - seeded_noise::kUniformBits);
  const at::Tensor v = (top.to(at::kDouble) * 2 + (1 - kRange)) / static_cast<double>(kRange);
  return (at::erfinv(v) * M_SQRT2).to(float_options.dtype()).view({num_steps, batch, dim});
}

// The network program on the rows `current` at step indices `s`: e, in
// current's dtype. The network computes in float32: a float64 sample is
// rounded to float32 for it and its output widened back.
at::Tensor run_network(const NetworkProgram& program, const SampleRuleCall& call,
                       const SampleRuleExtras& extras, const at::Tensor& sample, const at::Tensor& s,
                       const std::optional<at::Tensor>& time_rows, const std::optional<at::Tensor>& cond_rows) {
  const at::Tensor current = sample.to(at::kFloat);
  at::Tensor h = current;
  if (program.input.size() > 1 || program.input[0] != InputPart::kX) {
    std::vector<at::Tensor> parts;
    for (InputPart part : program.input) {
      parts.push_back(part == InputPart::kX      ? current
                      : part == InputPart::kCond ? *call.cond_net.input
                                                 : call.time_net.input->index_select(0, s));
    }
    h = at::cat(parts, 1);
  }
  std::vector<at::Tensor> saved;
  for (const NetworkOp& op : program.ops) {
    switch (op.kind) {
      case NetworkOp::Kind::kLinear:
        h = at::linear(h, call.weights[op.index], call.biases[op.index]);
        if (op.index == 0 && time_rows.has_value()) h = h + time_rows->index_select(0, s);
        if (op.index == 0 && cond_rows.has_value()) h = h + *cond_rows;
        break;
      case NetworkOp::Kind::kActivation:
        h = activate(h, op.activation);
        break;
      case NetworkOp::Kind::kLayerNorm: {
        const bool affine = op.index >= 0;
        h = at::layer_norm(h, {h.size(1)},
                           affine ? std::optional<at::Tensor>((*extras.norm_weights)[op.index]) : std::nullopt,
                           affine ? std::optional<at::Tensor>((*extras.norm_biases)[op.index]) : std::nullopt,
                           op.eps);
        break;
      }
      case NetworkOp::Kind::kSave:
        saved.push_back(h);
        break;
      case NetworkOp::Kind::kAdd:
        h = h + saved.back();
        saved.pop_back();
        break;
    }
  }
  return h.to(sample.scalar_type());
}

}  // namespace

at::Tensor fused_sample_rule_unfused(const SampleRuleCall& call, const SampleRuleExtras& extras) {
  check_sample_rule_args(call, extras);
  const at::Tensor& x = call.x;
  const int64_t table_length = call.step_tables.size(1);
  // Off the CPU the default never synchronises: a row whose step indices leave
  // the tables reads clamped indices and ends as NaN, as the fused kernels do.
  if (call.validate || x.is_cpu()) {
    check_timesteps_in_range(call.t_start, call.num_steps, table_length);
    if (call.clip_bounds.has_value()) check_bounds_ordered(*call.clip_bounds, "clip_bounds");
    if (call.post_clip_bounds.has_value()) check_bounds_ordered(*call.post_clip_bounds, "post_clip_bounds");
  }
  const NetworkProgram program = parse_network(call, extras);
  const auto x0_range = parse_clip(call.clip, "clip");
  const auto x_range = parse_clip(call.post_clip, "post_clip");
  // Either clamp of the step: to two floats, or to per-column bounds broadcast over the batch.
  auto clamp_to = [](const at::Tensor& t, const std::optional<std::pair<double, double>>& range,
                     const std::optional<at::Tensor>& bounds) {
    if (range) return t.clamp(range->first, range->second);
    if (bounds) return at::clamp(t, (*bounds)[0], (*bounds)[1]);
    return t;
  };
  const bool eps_readback = call.step_tables.size(0) == kStepTablesWithEpsReadback;
  const bool has_previous = call.step_tables.size(0) >= kStepTablesWithPrevious;
  const auto eps_range = parse_clip(extras.eps_clip, "eps_clip");

  const std::optional<at::Tensor> seed = noise_seed_of(call);
  const std::optional<at::Tensor> z =
      seed.has_value()
          ? std::optional<at::Tensor>(seeded_noise_of(*seed, call.num_steps, x.size(0), x.size(1), x.options()))
          : call.noise;
  const std::optional<at::Tensor> time_rows = with_bias_net(call.time_bias, call.time_net);
  const std::optional<at::Tensor> cond_rows = with_bias_net(call.cond_bias, call.cond_net);
  const at::Tensor t = call.t_start.to(at::kLong);
  at::Tensor current = x.clone(at::MemoryFormat::Contiguous);
  at::Tensor x0_prev;  // the previous step's clamped x0; none before the first step
  std::vector<at::Tensor> chain{current};
  for (int64_t k = 0; k < call.num_steps; ++k) {
    const at::Tensor s = (t - k).clamp(0, table_length - 1);
    const at::Tensor h = run_network(program, call, extras, current, s, time_rows, cond_rows);
    const at::Tensor c = call.step_tables.index_select(1, s).unsqueeze(2);  // (rows, batch, 1)
    const at::Tensor x0 = clamp_to(c[kA] * current - c[kB] * h, x0_range, call.clip_bounds);
    const at::Tensor e = eps_readback ? clamp_to(c[kQ] * current - c[kR] * x0, eps_range, std::nullopt) : h;
    at::Tensor next = c[kC] * x0 + c[kD] * current + c[kE] * e;
    if (has_previous && k > 0) next = next + c[kP] * x0_prev;
    if (z.has_value()) {
      const at::Tensor zk = extras.noise_clip.has_value()
                                ? (*z)[k].clamp(-*extras.noise_clip, *extras.noise_clip) : (*z)[k];
      next = next + c[kS] * zk;
    }
    current = clamp_to(next, x_range, call.post_clip_bounds);
    if (has_previous) x0_prev = x0;
    if (call.return_chain) chain.push_back(current);
  }
  at::Tensor out = call.return_chain ? at::stack(chain) : current;
  if (call.num_steps > 0 && !x.is_cpu()) {
    const at::Tensor in_range = (t - (call.num_steps - 1) >= 0) & (t < table_length);
    out = at::where(in_range.unsqueeze(1), out, at::full({}, NAN, out.options()));
  }
  return out;
}

// Every backend without a kernel of its own (the CPU registers one).
TORCH_LIBRARY_IMPL(ddpm, CompositeExplicitAutograd, m) {
  m.impl("fused_sample.rule", &rule_kernel<&fused_sample_rule_unfused>);
}

}  // namespace ddpm_ops
