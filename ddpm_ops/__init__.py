"""ddpm_ops: K reverse-diffusion (DDPM) steps of a small MLP as one fused op.

Importing the package registers ``torch.ops.ddpm.fused_sample`` and installs
the torch.compile rewrite that runs users' own sampling loops as that one op
(see :mod:`ddpm_ops.graph_pass`, and :mod:`ddpm_ops.rewrite` for the loop reader;
off with :func:`disable_auto_rewrite` or ``DDPM_OPS_DISABLE_AUTO_REWRITE=1``).
:func:`fuse_exported_program` does the same for ``torch.export`` programs.

The op's contract is :func:`fused_sample`'s docstring; maintainers' notes
(kernels, their choice, the rewrite's rules) are in the repository's docs/.
"""
from ._version import __version__
from ._library import LIBRARY_PATH
from .export import fuse_exported_program
from .graph_pass import (
    DDPMSamplingRewrite,
    auto_rewrite_enabled,
    disable_auto_rewrite,
    enable_auto_rewrite,
)
from .layers import mlp_layers
from .modules import DiffusionSampler, FusedDDPMSampler
from .ops import fused_sample, mlp_parameters, sample, silu_mlp
from . import conditioning, sharding, step_rules
from .conditioning import BiasNet, cond_bias, split_first_linear, time_bias, time_bias_from_module
from .reference import reference, reference_sample, seeded_noise
from .schedules import coefficient_tables, cosine_betas, linear_betas
from .step_rules import StepRule


def rewrite_stats() -> dict:
    """Counts of the torch.compile / export rewrite in this process: ``loops_fused``,
    ``steps_fused``, ``loops_left_alone`` (also in ``torch._dynamo.utils.counters["ddpm_ops"]``).

    A graph ``torch.compile`` serves from inductor's FX graph cache is counted
    too, as the compilation that made it counted it (and its INFO lines are
    logged again), at the end of the Dynamo compilation that loaded it."""
    from .rewrite.report import stats
    return stats()

__all__ = [
    "BiasNet",
    "__version__",
    "DDPMSamplingRewrite",
    "DiffusionSampler",
    "LIBRARY_PATH",
    "auto_rewrite_enabled",
    "disable_auto_rewrite",
    "enable_auto_rewrite",
    "fuse_exported_program",
    "FusedDDPMSampler",
    "coefficient_tables",
    "cosine_betas",
    "fused_sample",
    "linear_betas",
    "mlp_layers",
    "mlp_parameters",
    "StepRule",
    "cond_bias",
    "conditioning",
    "reference",
    "reference_sample",
    "rewrite_stats",
    "sample",
    "seeded_noise",
    "sharding",
    "silu_mlp",
    "split_first_linear",
    "step_rules",
    "time_bias",
    "time_bias_from_module",
]

# DTensor's rules for the op (ddpm_ops/sharding.py): a batch sharded over devices.
sharding.register()

# The torch.compile pass (ddpm_ops/graph_pass.py): installed into inductor's
# config on import unless DDPM_OPS_DISABLE_AUTO_REWRITE=1.
from . import graph_pass as _graph_pass  # noqa: E402

if _graph_pass._enabled:
    _graph_pass.install()
