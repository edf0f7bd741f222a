// The activations the op's MLP may apply after a hidden layer, listed once:
// DDPM_OPS_ACTIVATIONS calls X(enumerator, name) for each, in the order the
// op's messages name them, and generates the enum, the names the schema's
// `activations` take (parsed once, checks.cpp) and visit_activation's switch.
//
// Each backend (the CPU kernel, the CUDA kernels, the bias networks' ATen ops)
// writes one overload per ActivationTag and dispatches through
// visit_activation, so a backend without some activation's overload does not
// compile instead of computing another activation.
#pragma once

#include <array>
#include <cstdint>

#include "host_device.h"

#define DDPM_OPS_ACTIVATIONS(X) \
  X(kSilu, "silu")              \
  X(kMish, "mish")              \
  X(kRelu, "relu")              \
  X(kGelu, "gelu")              \
  X(kGeluTanh, "gelu_tanh")     \
  X(kTanh, "tanh")              \
  X(kIdentity, "identity")

namespace ddpm_ops {

enum class Activation : int32_t {
#define DDPM_OPS_ACTIVATION_ENUMERATOR(enumerator, name) enumerator,
  DDPM_OPS_ACTIVATIONS(DDPM_OPS_ACTIVATION_ENUMERATOR)
#undef DDPM_OPS_ACTIVATION_ENUMERATOR
};

// The schema's name of each activation, indexed by its enumerator.
inline constexpr std::array kActivationNames{
#define DDPM_OPS_ACTIVATION_NAME(enumerator, name) name,
    DDPM_OPS_ACTIVATIONS(DDPM_OPS_ACTIVATION_NAME)
#undef DDPM_OPS_ACTIVATION_NAME
};

// One activation as a type. It does not convert to Activation, so a call
// with a tag no overload takes is an error rather than a call of the
// overload that takes the runtime value.
template <Activation A>
struct ActivationTag {
  static constexpr Activation value = A;
};

// fn(ActivationTag<act>{}): the activation as a type, so that a loop inside
// fn is compiled once per activation and the choice is made once, outside it.
// It runs where fn does (host code, or a kernel's device code), so nvcc's
// check that a host-and-device function calls no device-only one is off.
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <typename Fn>
DDPM_HD inline decltype(auto) visit_activation(Activation act, Fn&& fn) {
  switch (act) {
#define DDPM_OPS_ACTIVATION_CASE(enumerator, name) \
  case Activation::enumerator:                     \
    return fn(ActivationTag<Activation::enumerator>{});
    DDPM_OPS_ACTIVATIONS(DDPM_OPS_ACTIVATION_CASE)
#undef DDPM_OPS_ACTIVATION_CASE
  }
  // Every enumerator is a case above: only a value cast from outside the enum gets here.
  __builtin_unreachable();
}

}  // namespace ddpm_ops
