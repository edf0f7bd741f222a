"""ddpm_ops: K reverse-diffusion (DDPM) steps of a small MLP as one fused op.

Importing the package registers ``torch.ops.ddpm.fused_sample``.
"""
from ._library import LIBRARY_PATH
from .ops import FusedDDPMSampler, fused_sample, mlp_parameters
from .reference import reference
from .schedules import coefficient_tables, cosine_betas, linear_betas

__all__ = [
    "LIBRARY_PATH",
    "FusedDDPMSampler",
    "coefficient_tables",
    "cosine_betas",
    "fused_sample",
    "linear_betas",
    "mlp_parameters",
    "reference",
]
