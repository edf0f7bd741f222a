"""One line that says what a benchmark ran on: CPU model, ISA in use, threads;
GPU and driver; torch version."""
import platform

import torch


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def describe(device: str) -> str:
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        return (f"GPU {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
                f"CUDA {torch.version.cuda}")
    return (f"CPU {cpu_model()}, ISA {torch.backends.cpu.get_cpu_capability()}, "
            f"{torch.get_num_threads()} threads, torch {torch.__version__}")
