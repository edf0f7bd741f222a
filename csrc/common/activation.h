// The activations the op's MLP may apply after a hidden layer: the names in
// the schema's `activations` argument, parsed once (checks.cpp) into this enum.
#pragma once

#include <cstdint>

namespace ddpm_ops {

enum class Activation : int32_t { kIdentity, kSilu, kMish, kRelu, kGelu, kGeluTanh, kTanh };

}  // namespace ddpm_ops
