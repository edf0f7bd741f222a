// The AVX2 + FMA build of the CPU kernels, chosen at run time only when ATen
// reports (and cpuid confirms) AVX2 support; see mlp_kernels_isa_prelude.h.
#include "mlp_kernels_isa_prelude.h"

#if DDPM_OPS_CAN_TARGET_ISA
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx,avx2,fma,f16c")
#endif
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include "mlp_kernels_impl.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else
namespace ddpm_ops { namespace cpu { namespace AVX2 {
const Kernels* kernels() { return nullptr; }
}}}  // namespace ddpm_ops::cpu::AVX2
#endif
