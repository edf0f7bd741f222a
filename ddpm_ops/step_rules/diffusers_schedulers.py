"""The rule of a diffusers scheduler: :func:`from_diffusers` reads its tables,
timesteps and config (diffusers is not imported)."""
from collections.abc import Sequence

import torch

from .builders import (
    PREDICTIONS,
    VARIANCES,
    _check_alphas_cumprod,
    _check_timesteps,
    _ddim_tables,
    _ddpm_tables,
    _rule,
    dpm_solver_pp,
    flow_euler,
)
from .rule import StepRule


def from_diffusers(
    scheduler, *, eta: float = 0.0, use_clipped_model_output: bool = False
) -> tuple[StepRule, torch.Tensor]:
    """The rule of a diffusers scheduler: ``DDPMScheduler``, ``DDIMScheduler``,
    ``FlowMatchEulerDiscreteScheduler`` or ``DPMSolverMultistepScheduler``.

    Reads the scheduler after ``set_timesteps`` (diffusers is not imported):
    its tables, ``timesteps`` and config, and reproduces its ``step`` as
    diffusers' own loop calls it:

    - DDPM steps to the scheduler's next timestep (``-1``, i.e. ``abar = 1``,
      after the last) and draws noise only where the timestep is above 0;
    - DDIM steps to ``t - num_train_timesteps // num_inference_steps``
      whatever the spacing, and below 0 to ``final_alpha_cumprod``;
    - flow matching takes the Euler steps of :func:`flow_euler` between the
      scheduler's ``sigmas`` (``shift``, dynamic shifting, and every other
      option that only places the sigmas, included);
    - DPM-Solver++ is :func:`dpm_solver_pp` with the scheduler's
      ``solver_order`` (1 or 2), ``prediction_type``, ``lower_order_final`` and
      ``final_sigmas_type``.

    The x0 clamp is ``clip_sample_range`` when ``clip_sample`` is set (DDPM,
    DDIM).

    Args:
        scheduler: one of the four diffusers schedulers.
        eta, use_clipped_model_output: the ``DDIMScheduler.step`` arguments
            (``eta`` must be 0 and the flag off for the others).

    Returns:
        ``(rule, timesteps)``: ``timesteps`` is an ascending CPU tensor,
        ``timesteps[s]`` the timestep the network is given at step index
        ``s`` (int64; float32 for flow matching, whose timesteps are
        ``sigma * num_train_timesteps``), so a full run starts at
        ``t_start = len(timesteps) - 1``; ``rule`` has that length and lives
        on the CPU.

    Raises:
        TypeError: ``scheduler`` is none of the four classes.
        ValueError: ``set_timesteps`` was not called, or a setting the rule
            cannot express, named: ``thresholding``, a learned or
            ``"fixed_large_log"`` variance (diffusers' own step gives NaN for
            the latter), an unknown ``prediction_type``, timesteps outside the
            schedule; for flow matching ``stochastic_sampling`` and
            ``invert_sigmas``; for DPM-Solver++ an ``algorithm_type`` other
            than ``"dpmsolver++"``, ``solver_order`` 3, the ``"heun"`` solver
            at order 2, ``euler_at_final``, ``variance_type``, and the sigma
            schedules that leave the training timesteps (Karras,
            exponential, beta, Lu lambdas, flow sigmas).
    """
    kind = type(scheduler).__name__
    if kind not in _SCHEDULERS:
        raise TypeError(f"scheduler: expected a diffusers {', '.join(_SCHEDULERS[:-1])} or {_SCHEDULERS[-1]}, "
                        f"got {kind}")
    if kind != "DDIMScheduler" and (eta != 0 or use_clipped_model_output):
        raise ValueError(
            f"eta, use_clipped_model_output: DDIMScheduler.step arguments, got eta={eta}, "
            f"use_clipped_model_output={use_clipped_model_output} for a {kind}"
        )
    config = scheduler.config
    if getattr(config, "thresholding", False):
        raise ValueError(f"scheduler: thresholding=True ({kind}) is not supported (it is not a fixed clamp)")
    if getattr(scheduler, "num_inference_steps", None) is None and not getattr(scheduler, "custom_timesteps", False):
        raise ValueError(f"scheduler: call {kind}.set_timesteps(...) before from_diffusers")
    if kind == "FlowMatchEulerDiscreteScheduler":
        return _from_flow_match(scheduler)
    if kind == "DPMSolverMultistepScheduler":
        return _from_dpm_solver(scheduler)
    abar_all = _check_alphas_cumprod(scheduler.alphas_cumprod)
    total = int(config.num_train_timesteps)
    steps = _check_timesteps(torch.as_tensor(scheduler.timesteps).cpu().flip(0), min(total, len(abar_all)))
    abar = abar_all[steps]
    prediction = config.prediction_type
    clip = float(config.clip_sample_range) if config.clip_sample else None

    if kind == "DDPMScheduler":
        variance = config.variance_type
        # fixed_small_log draws exp(0.5 * log(var)) * z, the same std as fixed_small.
        if variance == "fixed_small_log":
            variance = "fixed_small"
        if variance not in VARIANCES:
            raise ValueError(
                f"scheduler: variance_type must be one of fixed_small, fixed_small_log, fixed_large, got {variance!r}"
            )
        abar_prev = torch.cat([abar.new_ones(1), abar[:-1]])
        tables = _ddpm_tables(abar, abar_prev, steps > 0, prediction, variance)
    else:
        prev = steps - total // int(scheduler.num_inference_steps)
        final = torch.as_tensor(scheduler.final_alpha_cumprod, dtype=torch.float64).cpu()
        abar_prev = torch.where(prev >= 0, abar_all[prev.clamp(min=0)], final)
        tables = _ddim_tables(abar, abar_prev, eta, prediction, use_clipped_model_output)
    return _rule(tables, clip), steps


_SCHEDULERS = ("DDPMScheduler", "DDIMScheduler", "FlowMatchEulerDiscreteScheduler", "DPMSolverMultistepScheduler")


def _refuse_options(kind: str, config, options: Sequence[str]) -> None:
    """A ``ValueError`` naming the first of ``options`` the scheduler's config switches on."""
    for option in options:
        if getattr(config, option, False):
            raise ValueError(f"scheduler: {option}={getattr(config, option)!r} ({kind}) is not supported")


def _from_flow_match(scheduler) -> tuple[StepRule, torch.Tensor]:
    """FlowMatchEulerDiscreteScheduler: Euler steps between its sigmas (descending, ending at 0)."""
    # stochastic_sampling replaces the step by a fresh draw around x0;
    # invert_sigmas runs the schedule from data to noise.
    _refuse_options("FlowMatchEulerDiscreteScheduler", scheduler.config, ("stochastic_sampling", "invert_sigmas"))
    sigmas = torch.as_tensor(scheduler.sigmas).detach().cpu().flip(0)
    timesteps = torch.as_tensor(scheduler.timesteps).detach().to("cpu", torch.float32).flip(0)
    return flow_euler(sigmas), timesteps


def _from_dpm_solver(scheduler) -> tuple[StepRule, torch.Tensor]:
    """DPMSolverMultistepScheduler with algorithm_type="dpmsolver++"."""
    kind, config = "DPMSolverMultistepScheduler", scheduler.config
    if config.algorithm_type != "dpmsolver++":
        raise ValueError(f"scheduler: algorithm_type={config.algorithm_type!r} ({kind}) is not supported; "
                         "expected 'dpmsolver++'")
    if config.solver_order not in (1, 2):
        raise ValueError(f"scheduler: solver_order={config.solver_order} ({kind}) is not supported; expected 1 or 2")
    if config.solver_order == 2 and config.solver_type != "midpoint":
        raise ValueError(f"scheduler: solver_type={config.solver_type!r} ({kind}) is not supported; "
                         "expected 'midpoint'")
    if config.prediction_type not in PREDICTIONS:
        raise ValueError(f"scheduler: prediction_type={config.prediction_type!r} ({kind}) is not supported; "
                         f"expected one of {', '.join(PREDICTIONS)}")
    # euler_at_final changes which step is first order; variance_type slices
    # the network's output; the others place sigmas off the training timesteps.
    _refuse_options(kind, config, ("euler_at_final", "variance_type", "use_karras_sigmas", "use_exponential_sigmas",
                                   "use_beta_sigmas", "use_lu_lambdas", "use_flow_sigmas"))
    timesteps = torch.as_tensor(scheduler.timesteps).cpu().flip(0)
    rule = dpm_solver_pp(scheduler.alphas_cumprod, timesteps, order=config.solver_order,
                         prediction=config.prediction_type, lower_order_final=config.lower_order_final,
                         final_sigmas_type=config.final_sigmas_type)
    return rule, timesteps.to(torch.int64)
