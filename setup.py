"""Builds ddpm_ops._C with torch.utils.cpp_extension and ninja.

The CUDA kernel is compiled when torch was built with CUDA and nvcc is found;
otherwise (or with DDPM_OPS_FORCE_CPU=1) the extension holds the CPU kernel
alone. TORCH_CUDA_ARCH_LIST picks the GPU targets (9.0 for H100/H200); 9.0
is built as 9.0a (sm_90a runs on the same GPUs and has wgmma, which the bf16
and split kernels need).
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


def sm90a_arch_list() -> str | None:
    """TORCH_CUDA_ARCH_LIST (or, unset, the visible GPUs' architectures) with
    9.0 as 9.0a; None where neither names one."""
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(" ", ";")
    if not archs and torch.cuda.is_available():
        archs = ";".join(sorted({"%d.%d" % torch.cuda.get_device_capability(i)
                                 for i in range(torch.cuda.device_count())}))
    if not archs:
        return None
    archs = archs.replace("Hopper", "9.0+PTX")
    return ";".join(a.replace("9.0", "9.0a", 1) if a.split("+")[0] == "9.0" else a
                    for a in archs.split(";") if a)


def extension():
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    cxx_flags = ["-O3", "-std=c++17"]
    if not build_with_cuda():
        return CppExtension("ddpm_ops._C", sources, extra_compile_args={"cxx": cxx_flags})
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    nvcc_flags = ["-O3", "-std=c++17", "-lineinfo", "-Xptxas=-v"]
    archs = sm90a_arch_list()
    if archs is not None:
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs  # read by BuildExtension
        if any(a.split("+")[0] == "9.0a" for a in archs.split(";")):
            nvcc_flags.append("-DDDPM_OPS_SM90A")
    return CUDAExtension(
        "ddpm_ops._C",
        sources,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension},
)
