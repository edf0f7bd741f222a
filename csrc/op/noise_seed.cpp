// The seed a call of fused_sample.rule draws its noise from, for the kernels
// that take one seed tensor (the CPU kernel, the ATen loop): the call's
// noise_seed, or one drawn from its generator.
#include "fused_sample.h"

#include <ATen/ATen.h>

namespace ddpm_ops {

std::optional<at::Tensor> noise_seed_of(const SampleRuleCall& call) {
  if (call.noise_seed.has_value() || !call.generator.has_value() || !call.generator->defined()) {
    return call.noise_seed;
  }
  return at::randint(0, kNoiseSeedBound, {1}, *call.generator, call.x.options().dtype(at::kLong));
}

}  // namespace ddpm_ops
