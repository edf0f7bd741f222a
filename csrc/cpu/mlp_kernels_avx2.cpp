// The AVX2 + FMA build of the CPU kernels.
#define DDPM_OPS_ISA_AVX2
#define DDPM_OPS_ISA_TARGET "avx,avx2,fma,f16c"
#include "mlp_kernels_isa_build.h"
