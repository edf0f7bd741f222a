// A warning that ATen's at::vec headers raise under this project's -Wall but
// not in PyTorch's own build (which passes -Wno-maybe-uninitialized), quieted
// for the kernel files only. (Their "#pragma unroll" -Wunknown-pragmas warnings
// are raised by the preprocessor and need -Wno-unknown-pragmas in setup.py.)
#pragma once
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
