"""setup.py's choices, with the machine faked: the x86 ISA builds of the CPU
kernel only on x86-64, and TORCH_CUDA_ARCH_LIST as the CUDA build reads it."""
import pathlib
import runpy

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
X86_FILES = {"csrc/cpu/mlp_kernels_avx2.cpp", "csrc/cpu/mlp_kernels_avx512.cpp"}


@pytest.fixture
def setup_py(monkeypatch):
    """setup.py's functions (importing it does not build: setup() runs only as __main__)."""
    monkeypatch.chdir(ROOT)
    return runpy.run_path(str(ROOT / "setup.py"), run_name="setup_py_under_test")


@pytest.mark.parametrize("machine", ["x86_64", "AMD64", "amd64"])
def test_x86_64_builds_the_isa_files(setup_py, machine):
    sources = set(setup_py["cpu_sources"](machine))
    assert X86_FILES <= sources and "csrc/cpu/mlp_kernels_default.cpp" in sources
    assert "-DDDPM_OPS_X86_ISA_KERNELS" in setup_py["cxx_flags"](machine)


@pytest.mark.parametrize("machine", ["aarch64", "arm64", "ppc64le", "i686", "riscv64"])
def test_other_machines_build_the_default_kernel_alone(setup_py, machine):
    """Jetson (aarch64) and the rest: the default build, no x86 file or flag."""
    sources = set(setup_py["cpu_sources"](machine))
    assert not X86_FILES & sources
    assert {"csrc/cpu/mlp_kernels_default.cpp", "csrc/cpu/fused_sample_cpu.cpp", "csrc/plan/plan.cpp"} <= sources
    flags = setup_py["cxx_flags"](machine)
    assert not [f for f in flags if "X86" in f or f.startswith(("-mavx", "-mfma", "-march", "-msse"))], flags


def test_every_source_but_the_isa_files_everywhere(setup_py):
    assert set(setup_py["cpu_sources"]("x86_64")) - set(setup_py["cpu_sources"]("aarch64")) == X86_FILES


@pytest.mark.parametrize("given, built", [
    ("9.0", "9.0a"), ("9.0+PTX", "9.0a+PTX"), ("Hopper", "9.0a+PTX"), ("9.0a", "9.0a"),
    ("8.0;8.6;8.7;8.9", "8.0;8.6;8.7;8.9"), ("8.0;9.0", "8.0;9.0a"), ("8.0+PTX;9.0", "8.0+PTX;9.0a"),
    ("8.9;9.0+PTX", "8.9;9.0a+PTX"), ("8.0;8.6;8.7;8.9;9.0", "8.0;8.6;8.7;8.9;9.0a"), ("8.7", "8.7"),
    ("8.0;;9.0", "8.0;9.0a")])
def test_arch_list(setup_py, given, built):
    """9.0 is built as 9.0a (wgmma); 8.x as given, PTX kept."""
    assert setup_py["build_arch_list"](given) == built
