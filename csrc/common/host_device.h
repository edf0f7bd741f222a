// DDPM_HD: functions that host code and CUDA kernels share (layouts the plan
// and the kernels agree on, the seeded noise's hashes).
#pragma once

#if defined(__CUDACC__)
#define DDPM_HD __host__ __device__
#else
#define DDPM_HD
#endif
