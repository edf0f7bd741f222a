// Warnings that ATen's at::vec headers raise under this project's -Wall but
// not in PyTorch's own build (which passes -Wno-maybe-uninitialized; GCC's
// AVX-512 intrinsics read an _mm512_undefined_ps() on purpose), quieted
// for the kernel files only. (Their "#pragma unroll" -Wunknown-pragmas warnings
// are raised by the preprocessor and need -Wno-unknown-pragmas in setup.py.)
#pragma once
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
