// The body of one SIMD build of the CPU kernels. The including file defines
// DDPM_OPS_ISA_AVX2 or DDPM_OPS_ISA_AVX512, and DDPM_OPS_ISA_TARGET, the
// compiler target string. Functions in this file are
// compiled for that target; the build is used only when ATen reports (and
// cpuid confirms) the ISA at run time; see mlp_kernels_isa_prelude.h.
#include "mlp_kernels_isa_prelude.h"

// ATen's per-ISA macros, defined only after the prelude's baseline-ISA headers.
#if defined(DDPM_OPS_ISA_AVX512)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#else
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#endif

// Two levels, so that DDPM_OPS_ISA_TARGET expands before it is stringified.
#define DDPM_OPS_PRAGMA(text) DDPM_OPS_PRAGMA_STRING(text)
#define DDPM_OPS_PRAGMA_STRING(text) _Pragma(#text)

#if DDPM_OPS_CAN_TARGET_ISA
#if defined(__clang__)
DDPM_OPS_PRAGMA(clang attribute push(__attribute__((target(DDPM_OPS_ISA_TARGET))), apply_to = function))
#else
#pragma GCC push_options
DDPM_OPS_PRAGMA(GCC target(DDPM_OPS_ISA_TARGET))
#endif
#include "mlp_kernels_impl.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else
namespace ddpm_ops { namespace cpu { namespace CPU_CAPABILITY {
const Kernels* kernels() { return nullptr; }
}}}  // namespace ddpm_ops::cpu::CPU_CAPABILITY
#endif
