// The AVX-512 (F, BW, VL, DQ, the set ATen's AVX512 kernels need) build of the
// CPU kernels, chosen at run time only when ATen reports (and cpuid confirms)
// AVX-512 support; see mlp_kernels_isa_prelude.h.
#include "mlp_kernels_isa_prelude.h"

#if DDPM_OPS_CAN_TARGET_ISA
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
#endif
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#include "mlp_kernels_impl.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else
namespace ddpm_ops { namespace cpu { namespace AVX512 {
const Kernels* kernels() { return nullptr; }
}}}  // namespace ddpm_ops::cpu::AVX512
#endif
