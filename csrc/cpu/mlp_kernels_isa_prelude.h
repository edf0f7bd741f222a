// Included first by the AVX2 / AVX-512 kernel files, before they switch the
// compiler's target ISA: every header at::vec depends on (outside at::vec's own
// per-ISA namespace) is compiled here for the baseline ISA, so the inline
// functions it defines are identical in every object file. Only the code that
// follows the target switch (namespaces at::vec::<ISA> and
// ddpm_ops::cpu::<ISA>, unique per ISA) uses the wider instructions.
#pragma once

// at::vec's headers declare functions that pass vector types by value; built
// without -mavx on the command line GCC warns that their ABI depends on the
// ISA. Both sides of every such call are compiled here for the same ISA.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
#include "mlp_kernels_warnings.h"

#include <algorithm>
#include <cmath>
#include <complex>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>

#include <ATen/AccumulateType.h>
#include <ATen/NumericUtils.h>
#include <ATen/native/Math.h>
#include <ATen/native/cpu/zmath.h>
#include <ATen/native/quantized/AffineQuantizerBase.h>
#include <c10/util/BFloat16-math.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <c10/util/Load.h>
#include <c10/util/TypeCast.h>
#include <c10/util/complex.h>
#include <c10/util/irange.h>
#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif

#include "mlp_kernels.h"

// at::vec's AVX2/AVX-512 float vectors call SLEEF for exp; sleef.h declares
// those entry points only when the compiler's ISA macros say the vector types
// exist, which a target pragma does not set. Declare them here (declarations
// only: nothing is compiled for the wider ISA by this include). The functions
// are exported by libtorch_cpu.
#if defined(__x86_64__) || defined(__i386__)
#ifndef SLEEF_STATIC_LIBS
#define SLEEF_STATIC_LIBS
#endif
#pragma push_macro("__AVX__")
#pragma push_macro("__AVX2__")
#pragma push_macro("__FMA__")
#pragma push_macro("__AVX512F__")
#ifndef __AVX__
#define __AVX__ 1
#endif
#ifndef __AVX2__
#define __AVX2__ 1
#endif
#ifndef __FMA__
#define __FMA__ 1
#endif
#ifndef __AVX512F__
#define __AVX512F__ 1
#endif
#include <sleef.h>
#pragma pop_macro("__AVX512F__")
#pragma pop_macro("__FMA__")
#pragma pop_macro("__AVX2__")
#pragma pop_macro("__AVX__")
#endif

// The ISA switch below is supported with GCC and Clang on x86; elsewhere the
// file compiles to a stub returning nullptr and the generic kernels run.
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define DDPM_OPS_CAN_TARGET_ISA 1
#else
#define DDPM_OPS_CAN_TARGET_ISA 0
#endif
