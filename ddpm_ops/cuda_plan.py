"""Which CUDA kernel ``ddpm::fused_sample`` runs a problem on, and in which shape.

The rule is one C++ function (``csrc/plan/plan.cpp: choose_plan``), built into
every extension, CPU-only ones included, and exposed as the debug op
``torch.ops.ddpm.cuda_plan``; this module wraps it::

    from ddpm_ops.cuda_plan import H200, plan_for
    plan_for(512, 64, [256, 256], 16)            # on an H200, precision "fp32"
    # {'kernel': 'bf16x3_wgmma_swapab', 'cluster_size': 2, 'rows': 8, ...,
    #  'log': 'ddpm_ops narrow kernel: batch 512, 8 rows x 64 tiles on ...'}

``log`` is the line ``DDPM_OPS_CUDA_LOG=1`` makes the launch print. Other
described GPUs: ``A100``, ``RTX_4090``, ``L4``, ``JETSON_AGX_ORIN`` (compute
capability 8.x, no clusters: ``fp32_rule``), e.g. ``plan_for(..., device=L4)``.
"""
from __future__ import annotations

import dataclasses

import torch

from . import _library  # noqa: F401  (registers the ops)

MAX_CLUSTER_SIZE = 16


@dataclasses.dataclass(frozen=True)
class Device:
    """What the plan reads of a GPU and of the build (csrc/plan/plan.h: Device)."""

    sm_count: int
    max_smem: int  # opt-in dynamic shared memory per block, bytes
    # Co-resident clusters of each size 0 to 16 (one CTA per SM, all of the
    # shared memory; cudaOccupancyMaxActiveClusters), 0 where it does not launch.
    max_clusters: tuple[int, ...]
    capability: tuple[int, int] = (9, 0)
    sm90a_build: bool = True  # the extension's sm_90 code built as sm_90a (setup.py)
    tma_encoder: bool = True  # the driver has cuTensorMapEncodeTiled

    def as_list(self) -> list[int]:
        """The fields in ddpm::cuda_plan's order."""
        assert len(self.max_clusters) == MAX_CLUSTER_SIZE + 1
        return [self.sm_count, self.max_smem, *self.capability, int(self.sm90a_build), int(self.tma_encoder),
                *self.max_clusters]


# An H200 (SXM, 132 SMs, 227 KB of shared memory per block). Clusters must fit
# in one GPC: cudaOccupancyMaxActiveClusters there gives 132 of 1, 66 of 2, 30
# of 4, 15 of 8 and 7 of 16 (BENCHMARKS.md); the other sizes follow from the
# GPCs those imply (six of 18 SMs, one of 16, one of 8), which also give the
# sizes the rule picked on the H200 (BENCHMARKS.md: clusters of 3 for 32
# tiles, 6 for 16, 9 for 8).
H200 = Device(
    sm_count=132,
    max_smem=227 * 1024,
    max_clusters=(0, 132, 66, 43, 30, 22, 21, 15, 15, 13, 7, 7, 7, 7, 7, 7, 7),
)


# GPUs without thread-block clusters (compute capability 8.x: every
# max_clusters count is 0, as the op reads them there), each as the build its
# README install line makes (TORCH_CUDA_ARCH_LIST of its capability alone: no
# sm_90a code). Opt-in shared memory per block is
# cudaDevAttrMaxSharedMemoryPerBlockOptin: 163 KB on the 164 KB multiprocessors
# of the A100 and Orin, 99 KB on Ada's 100 KB ones.
_NO_CLUSTERS = (0,) * (MAX_CLUSTER_SIZE + 1)
A100 = Device(sm_count=108, max_smem=163 * 1024, max_clusters=_NO_CLUSTERS, capability=(8, 0),
              sm90a_build=False)  # SXM, 40 or 80 GB
RTX_4090 = Device(sm_count=128, max_smem=99 * 1024, max_clusters=_NO_CLUSTERS, capability=(8, 9), sm90a_build=False)
L4 = Device(sm_count=58, max_smem=99 * 1024, max_clusters=_NO_CLUSTERS, capability=(8, 9), sm90a_build=False)
JETSON_AGX_ORIN = Device(sm_count=16, max_smem=163 * 1024, max_clusters=_NO_CLUSTERS, capability=(8, 7),
                         sm90a_build=False)


def current_device(index: int = 0) -> Device:
    """The description of CUDA device ``index`` as the op reads it (needs a CUDA build)."""
    fields = torch.ops.ddpm.cuda_device_info(index)
    return Device(sm_count=fields[0], max_smem=fields[1], capability=(fields[2], fields[3]),
                  sm90a_build=bool(fields[4]), tma_encoder=bool(fields[5]), max_clusters=tuple(fields[6:]))


def _value(text: str):
    return int(text) if text.lstrip("-").isdigit() else text


def plan_for(batch: int, dim: int, hidden: list[int], num_steps: int, precision: str = "fp32",
             device: Device = H200, aligned: list[bool] | None = None,
             overrides: dict[str, str] | None = None, general_step: bool = False,
             previous_x0: bool = False, program_saved: int | None = None, program_input: int = 0) -> dict:
    """The plan for a net of Linear widths ``[dim + 1, *hidden, dim]``.

    general_step: plan a call of ``fused_sample.rule`` instead (layer 0 of
    width ``dim``, the bias rows added to its output): only the engine's
    kernels (``fp32_resident``, ``tf32x3_tiled``, ``fp32_rule``) run it.
    previous_x0: that call has a previous-x0 table (a multistep rule such as
    DPM-Solver++ 2M), whose carried x0 takes shared memory too.

    program_saved: plan a call of ``fused_sample.rule`` with a network
    program whose residual stack gets this deep (its Linear widths
    ``hidden``), program_input its ``"input:"`` instruction's width (0: none):
    ``fp32_rule`` alone runs it, with that many more activation buffers.

    aligned: per layer, whether its weight starts on a 16-byte boundary
    (default: all, as torch allocates them). overrides: DDPM_OPS_CUDA_*
    variables as the environment would hold them (the environment itself is
    not read). Returns the plan's fields (kernel, cluster_size, rows, ...) and
    ``log``, its launch line; raises RuntimeError naming why where no kernel
    runs the call there (as the op would), or where the description or the
    sizes are out of range.
    """
    text = ";".join(f"{k}={v}" for k, v in (overrides or {}).items())
    fields, log = torch.ops.ddpm.cuda_plan(batch, dim, list(hidden), num_steps, precision, device.as_list(),
                                           [int(a) for a in aligned or []], text,
                                           general_step or program_saved is not None, previous_x0,
                                           -1 if program_saved is None else program_saved,
                                           program_input).split("\n")
    plan = {key: _value(value) for key, value in (pair.split("=", 1) for pair in fields.split())}
    plan["log"] = log
    return plan
