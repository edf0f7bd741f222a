// The generic (baseline ISA) build of the CPU kernels: the fallback on any CPU.
#include "mlp_kernels_warnings.h"

#define CPU_CAPABILITY DEFAULT
#include "mlp_kernels_impl.h"
