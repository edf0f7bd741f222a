"""Builds ddpm_ops._C with torch.utils.cpp_extension and ninja.

The CUDA kernel is compiled when torch was built with CUDA and nvcc is found;
otherwise (or with DDPM_OPS_FORCE_CPU=1) the extension holds the CPU kernel
alone. TORCH_CUDA_ARCH_LIST picks the GPU targets (9.0 for H100/H200).
"""
import glob
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension


def build_with_cuda() -> bool:
    if os.environ.get("DDPM_OPS_FORCE_CPU", "0") not in ("", "0"):
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


def extension():
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    cxx_flags = ["-O3", "-std=c++17"]
    if not build_with_cuda():
        return CppExtension("ddpm_ops._C", sources, extra_compile_args={"cxx": cxx_flags})
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    nvcc_flags = ["-O3", "-std=c++17", "-lineinfo", "-Xptxas=-v"]
    return CUDAExtension(
        "ddpm_ops._C",
        sources,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension},
)
