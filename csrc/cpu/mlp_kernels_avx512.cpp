// The AVX-512 build of the CPU kernels (F, BW, VL, DQ: the set ATen's AVX512
// kernels need).
#define DDPM_OPS_ISA_AVX512
#define DDPM_OPS_ISA_TARGET "avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq"
#include "mlp_kernels_isa_build.h"
