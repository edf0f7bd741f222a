"""Step rules: the per-step coefficient tables of a reverse-diffusion sampler.

Every sampler the op runs is one update, applied at step index ``s`` (a row of
each table) to the current sample ``x`` and the network output ``e``::

    x0 = A[s] * x - B[s] * e                      # the predicted clean sample
    x0 = x0.clamp(*clip)                          # when clip is not None
    x  = C[s] * x0 + D[s] * x + E[s] * e + S[s] * z + P[s] * x0_prev
    x  = x.clamp(*post_clip)                      # when post_clip is not None

with ``z`` standard normal noise and ``x0_prev`` the previous step's clamped
``x0`` (zero at a call's first step; the ``P`` table is optional, for
multistep solvers). :class:`StepRule` holds the tables and the two optional
ranges, each two floats or per-column bounds; :func:`ddpm`, :func:`ddim`,
:func:`flow_euler`, :func:`dpm_solver_pp` and :func:`from_diffusers` build
them. Every table is computed in float64 and stored in float32.

The modules, one concern each: :mod:`.rule` (:class:`StepRule` and the
checks of its tables and ranges), :mod:`.builders` (the rules of a noise
schedule) and :mod:`.diffusers_schedulers` (:func:`from_diffusers`).
"""
from .builders import FINAL_SIGMAS, PREDICTIONS, VARIANCES, ddim, ddpm, dpm_solver_pp, flow_euler
from .diffusers_schedulers import from_diffusers
from .rule import EPS_TABLES, PREVIOUS_TABLE, TABLE_NAMES, StepRule

__all__ = [
    "EPS_TABLES",
    "FINAL_SIGMAS",
    "PREDICTIONS",
    "PREVIOUS_TABLE",
    "StepRule",
    "TABLE_NAMES",
    "VARIANCES",
    "ddim",
    "ddpm",
    "dpm_solver_pp",
    "flow_euler",
    "from_diffusers",
]
