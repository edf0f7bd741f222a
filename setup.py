"""Builds ddpm_ops._C with torch.utils.cpp_extension and ninja.

The CUDA kernels are compiled when the installed torch has CUDA, nvcc is found
(CUDA_HOME) and there is an architecture to build for: TORCH_CUDA_ARCH_LIST,
or else the GPUs this machine sees. Without one (a CUDA build of torch on a
machine with no GPU, the default of ``pip install torch`` on Linux), or with
DDPM_OPS_FORCE_CPU=1, the extension holds the CPU kernel alone and the build
says so. Any combination of 8.0, 8.6, 8.7, 8.9 and 9.0 (each optionally
+PTX) builds: the Hopper kernels' bodies are compiled for 9.0 alone (a trap
elsewhere, never launched there), so one binary holds every architecture.
9.0 is built as 9.0a: sm_90a runs on the same GPUs (H100, H200) and has
wgmma, which the bf16x3 and bf16 kernels need.

The CPU kernel's AVX2 and AVX-512 builds are compiled on x86-64 only; on any
other machine (aarch64: Jetson, Grace, Apple silicon) the default build alone,
with no x86 flag.

The C++ standard is left to torch.utils.cpp_extension, which passes the one
the installed torch's headers require (C++17 or C++20, by version).
"""
import glob
import os
import platform
import sys

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension


def cuda_arch_list() -> tuple[str | None, str]:
    """The architectures to build CUDA for (9.0 as 9.0a), or None with the reason."""
    if os.environ.get("DDPM_OPS_FORCE_CPU", "0") not in ("", "0"):
        return None, "DDPM_OPS_FORCE_CPU is set"
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} is a CPU build"
    if CUDA_HOME is None:
        return None, "nvcc was not found (set CUDA_HOME)"
    if not os.path.exists(os.path.join(CUDA_HOME, "include", "cuda_runtime.h")):
        # torch takes CUDA_HOME from nvcc's path; a wrapper script in /usr/local/bin misleads it.
        return None, (f"CUDA_HOME={CUDA_HOME} has no include/cuda_runtime.h "
                      "(set CUDA_HOME to the CUDA toolkit, for example /usr/local/cuda)")
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(" ", ";")
    if not archs and torch.cuda.is_available():
        archs = ";".join(sorted({"%d.%d" % torch.cuda.get_device_capability(i)
                                 for i in range(torch.cuda.device_count())}))
    if not archs:
        return None, ("no GPU is visible and TORCH_CUDA_ARCH_LIST is unset "
                      "(for example TORCH_CUDA_ARCH_LIST=9.0 builds the CUDA kernels for H100/H200)")
    return build_arch_list(archs), ""


def build_arch_list(archs: str) -> str:
    """TORCH_CUDA_ARCH_LIST (';'-separated) as BuildExtension is to read it: 9.0 as 9.0a.

    torch would expand the name Hopper to 9.0+PTX, so it is expanded here first.
    """
    archs = archs.replace("Hopper", "9.0+PTX")
    return ";".join(a.replace("9.0", "9.0a", 1) if a.split("+")[0] == "9.0" else a
                    for a in archs.split(";") if a)


def is_x86_64(machine: str) -> bool:
    """Whether platform.machine()'s answer names x86-64 (Linux, macOS: x86_64; Windows: AMD64)."""
    return machine.lower() in ("x86_64", "amd64")


# The CPU kernel's builds for x86 ISAs; DDPM_OPS_X86_ISA_KERNELS tells its
# dispatch (csrc/cpu/fused_sample_cpu.cpp) that they are linked in.
X86_ISA_SOURCES = ("mlp_kernels_avx2.cpp", "mlp_kernels_avx512.cpp")


def cpu_sources(machine: str) -> list[str]:
    """The C++ sources: csrc/, csrc/plan/ and the CPU kernel, whose AVX2 and
    AVX-512 files (built for those ISAs by target pragmas, picked at run time
    where the CPU has them) only on x86-64."""
    sources = [path for part in ("op", "aten", "cpu", "plan") for path in glob.glob(f"csrc/{part}/*.cpp")]
    if not is_x86_64(machine):
        sources = [s for s in sources if os.path.basename(s) not in X86_ISA_SOURCES]
    return sorted(sources)


def cxx_flags(machine: str) -> list[str]:
    """The C++ compiler's flags: none that names an x86 ISA (the ISA builds
    switch targets by pragma), so that they hold on any machine."""
    return ["-O3"] + openmp_flags() + (["-DDDPM_OPS_X86_ISA_KERNELS"] if is_x86_64(machine) else [])


def openmp_flags() -> list[str]:
    """-fopenmp where torch's intra-op threads are OpenMP's.

    at::parallel_for is a header template: compiled without -fopenmp it runs
    its range on the calling thread, so the CPU kernel would use one core
    whatever torch.set_num_threads says. The extension then needs libgomp.so.1,
    which resolves to the one torch has already loaded (torch.set_num_threads
    sets that runtime's thread count).
    """
    if torch.backends.openmp.is_available() and sys.platform.startswith("linux"):
        return ["-fopenmp"]
    return []


def extension(machine: str):
    sources = cpu_sources(machine)
    cxx = cxx_flags(machine)
    link_flags = openmp_flags()
    archs, why_not = cuda_arch_list()
    if archs is None:
        print(f"ddpm_ops: building the CPU kernel only: {why_not}", file=sys.stderr)
        return CppExtension("ddpm_ops._C", sources, extra_compile_args={"cxx": cxx},
                            extra_link_args=link_flags)
    print(f"ddpm_ops: building the CPU kernel and the CUDA kernels for {archs}", file=sys.stderr)
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs  # read by BuildExtension
    nvcc_flags = ["-O3", "-lineinfo", "-Xptxas=-v"]
    if any(a.split("+")[0] == "9.0a" for a in archs.split(";")):
        nvcc_flags.append("-DDDPM_OPS_SM90A")
    return CUDAExtension(
        "ddpm_ops._C",
        sources + sorted(glob.glob("csrc/cuda/**/*.cu", recursive=True)),
        extra_compile_args={"cxx": cxx, "nvcc": nvcc_flags},
        extra_link_args=link_flags,
    )


# Run by pip and by `python setup.py`; tests/test_setup.py imports the functions.
if __name__ == "__main__":
    setup(
        ext_modules=[extension(platform.machine())],
        cmdclass={"build_ext": BuildExtension},
    )
