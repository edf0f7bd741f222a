"""Loads the compiled op library ``ddpm_ops._C`` into the dispatcher."""
import pathlib

import torch


def _load() -> str:
    package_dir = pathlib.Path(__file__).parent
    candidates = sorted(package_dir.glob("_C*.so")) + sorted(package_dir.glob("_C*.pyd"))
    if not candidates:
        raise ImportError(
            f"ddpm_ops: the compiled library _C was not found in {package_dir}; "
            "build it with `pip install --no-build-isolation -e .`"
        )
    torch.ops.load_library(str(candidates[0]))
    return str(candidates[0])


#: Path of the loaded shared library; a C++ program that runs an exported
#: model links or dlopens this file so the dispatcher knows ddpm::fused_sample.
LIBRARY_PATH = _load()


def has_fused_rule_kernel(device: torch.device) -> bool:
    """Whether ``ddpm::fused_sample.rule`` has a fused kernel of its own on
    ``device``'s type; every other device runs the op's loop of ATen ops (correct,
    not fast). Asked of the dispatcher, where the kernels are registered."""
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(torch.device(device).type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key("ddpm::fused_sample.rule", key)
