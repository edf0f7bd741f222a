"""The rule builders: :func:`ddpm`, :func:`ddim`, :func:`flow_euler` and
:func:`dpm_solver_pp`, each a :class:`~.rule.StepRule` from a noise schedule."""
import math
from collections.abc import Sequence

import torch

from .rule import EPS_TABLES, PREVIOUS_TABLE, TABLE_NAMES, StepRule, _as_range

PREDICTIONS = ("epsilon", "sample", "v_prediction")
VARIANCES = ("fixed_small", "fixed_large")
FINAL_SIGMAS = ("zero", "sigma_min")
# diffusers' DPMSolverMultistepScheduler takes its last step at first order
# with lower_order_final below this many steps.
_LOWER_ORDER_FINAL_STEPS = 15

# diffusers clamps the DDPM posterior variance here before it takes a log.
_MIN_VARIANCE = 1e-20


def ddpm(
    betas: torch.Tensor,
    *,
    prediction: str = "epsilon",
    clip: float | tuple[float, float] | None = None,
    variance: str = "fixed_small",
    noise: bool = True,
    min_std: float | None = None,
    final_noise: bool = False,
    noise_clip: float | None = None,
) -> StepRule:
    """The DDPM posterior step (Ho et al., 2020) for all ``T`` timesteps.

    Step index ``s`` is timestep ``t``. With ``abar`` the cumulative product of
    ``1 - betas`` (``abar[-1] = 1``): ``x0`` from the prediction (see
    :func:`ddim`), the posterior mean ``C = beta_t sqrt(abar_{t-1}) / (1 - abar_t)``,
    ``D = sqrt(1 - beta_t) (1 - abar_{t-1}) / (1 - abar_t)``, ``E = 0``, and
    ``S`` the square root of the variance: ``"fixed_small"`` is
    ``beta_t (1 - abar_{t-1}) / (1 - abar_t)`` clamped below at 1e-20,
    ``"fixed_large"`` is ``beta_t``, as diffusers' ``DDPMScheduler`` has them.
    ``S[0] = 0``: the last step adds no noise.

    Args:
        betas: 1-D float tensor of ``T`` betas in (0, 1).
        prediction: what the network predicts, one of ``PREDICTIONS``.
        clip: ``None``, ``(lo, hi)`` or ``c`` for ``(-c, c)``: the ``x0`` range.
        variance: one of ``VARIANCES``.
        noise: ``False`` gives ``S = 0`` everywhere (the posterior mean only).
        min_std: ``None`` or a floor of ``S`` at every step index that adds
            noise (DPPO clips ``exp(0.5 * logvar)`` below at 1e-3, and at
            ``min_sampling_denoising_std`` when fine-tuning).
        final_noise: add noise at step index 0 too (DPPO's fine-tuning
            sampler, with ``min_std``): its ``S[0]`` is the variance's square
            root (about 1e-10 for ``"fixed_small"``) or the floor.
        noise_clip: ``None`` or ``c > 0``: the noise clamped to ``[-c, c]``
            before it is scaled (:class:`StepRule`; DPPO's ``randn_clip_value``).

    Returns:
        A :class:`StepRule` of length ``T``.

    Raises:
        ValueError: bad ``betas``, ``prediction``, ``variance``, ``clip``,
            ``min_std`` or ``noise_clip``.
    """
    abar = torch.cumprod(1.0 - _check_betas(betas), 0)
    abar_prev = torch.cat([abar.new_ones(1), abar[:-1]])
    noise_mask = torch.arange(len(abar)) > 0 if noise else torch.zeros(len(abar), dtype=torch.bool)
    if noise and final_noise:
        noise_mask[0] = True
    tables = _floored(_ddpm_tables(abar, abar_prev, noise_mask, prediction, variance), noise_mask, min_std)
    return _rule(tables, clip, noise_clip)


def ddim(
    alphas_cumprod: torch.Tensor,
    timesteps: torch.Tensor | Sequence[int],
    *,
    eta: float = 0.0,
    prediction: str = "epsilon",
    clip: float | tuple[float, float] | None = None,
    use_clipped_model_output: bool = False,
    min_std: float | None = None,
    noise_clip: float | None = None,
    eps_clip: float | tuple[float, float] | None = None,
) -> StepRule:
    """The strided DDIM step (Song et al., 2021) over ``timesteps``.

    Step index ``s`` runs from training timestep ``timesteps[s]`` (``abar_t``)
    to ``timesteps[s - 1]`` (``abar_prev``; 1 for ``s = 0``). ``x0`` from the
    prediction: ``"epsilon"``: ``A = 1/sqrt(abar_t)``, ``B = sqrt(1/abar_t - 1)``;
    ``"sample"``: ``A = 0``, ``B = -1``; ``"v_prediction"``: ``A = sqrt(abar_t)``,
    ``B = sqrt(1 - abar_t)``. Then, as diffusers' ``DDIMScheduler`` steps::

        x_prev = sqrt(abar_prev) x0 + sqrt(1 - abar_prev - sigma^2) pred_eps + sigma z
        sigma = eta sqrt((1 - abar_prev) / (1 - abar_t) (1 - abar_t / abar_prev))

    where ``pred_eps`` is the noise implied by the prediction, an affine
    function of ``x`` and ``e`` (so it uses the unclipped ``x0``); with
    ``use_clipped_model_output`` it is recomputed from the clipped ``x0``.

    Args:
        alphas_cumprod: 1-D float tensor, ``abar`` of every training timestep.
        timesteps: strictly ascending training timesteps (1-D int tensor or
            sequence of ints), one per step index.
        eta: the noise weight (0: deterministic DDIM, 1: DDPM-like).
        prediction: one of ``PREDICTIONS``.
        clip: ``None``, ``(lo, hi)`` or ``c`` for ``(-c, c)``: the ``x0`` range.
        use_clipped_model_output: as the ``DDIMScheduler.step`` argument.
        min_std: ``None`` or a floor of the noise scale ``S`` at every step
            index (``sigma`` stays in the direction term): DPPO's fine-tuning
            DDIM sampler draws ``mean + max(std, min_sampling_denoising_std) z``.
        noise_clip: ``None`` or ``c > 0``: the noise clamped to ``[-c, c]``
            before it is scaled.
        eps_clip: ``None``, ``(lo, hi)`` or ``c`` for ``(-c, c)``: DPPO's DDIM
            ``eps_clip_value``. ``pred_eps`` is then read back from the
            clipped ``x0``, ``(x - sqrt(abar_t) x0) / sqrt(1 - abar_t)``, and
            clamped to this range (the rule's ``Q``, ``R`` and ``eps_clip``);
            beside ``clip`` that is ``use_clipped_model_output``, which must
            then be set.

    Returns:
        A :class:`StepRule` of length ``len(timesteps)``.

    Raises:
        ValueError: bad ``alphas_cumprod``, ``timesteps``, ``eta``,
            ``prediction``, ``clip``, ``min_std``, ``noise_clip`` or
            ``eps_clip``, or ``eps_clip`` and ``clip`` without
            ``use_clipped_model_output``.
    """
    abar_all = _check_alphas_cumprod(alphas_cumprod)
    steps = _check_timesteps(timesteps, len(abar_all))
    abar = abar_all[steps]
    abar_prev = torch.cat([abar.new_ones(1), abar[:-1]])
    if eps_clip is not None and clip is not None and not use_clipped_model_output:
        raise ValueError("eps_clip: clamps the eps read back from the clipped x0 (DPPO's DDIM), so beside clip it "
                         "needs use_clipped_model_output=True, got use_clipped_model_output=False")
    tables = _ddim_tables(abar, abar_prev, eta, prediction, use_clipped_model_output and eps_clip is None)
    tables = _floored(tables, torch.ones(len(abar), dtype=torch.bool), min_std)
    if eps_clip is None:
        return _rule(tables, clip, noise_clip)
    a, b, *_, s = tables
    # The E term reads Q*x - R*x0 in place of pred_eps: C is sqrt(abar_prev) alone, D zero.
    eps_tables = (1.0 / (1.0 - abar).sqrt(), (abar / (1.0 - abar)).sqrt())
    direction = _ddim_direction(abar, abar_prev, eta)
    return _rule((a, b, abar_prev.sqrt(), torch.zeros_like(a), direction, s), clip, noise_clip,
                 eps_tables=eps_tables, eps_clip=eps_clip)


def flow_euler(
    sigmas: torch.Tensor | Sequence[float],
    *,
    clip: float | tuple | None = None,
) -> StepRule:
    """Euler steps of a flow-matching (rectified-flow) velocity network.

    ``sigmas`` runs from the data end ``sigmas[0]`` (usually 0) to the noise
    end ``sigmas[S]`` (usually 1). Step index ``s`` moves from ``sigmas[s + 1]``
    to ``sigmas[s]``::

        x <- x + (sigmas[s] - sigmas[s + 1]) * v

    with ``v`` the network's output, the velocity ``noise - x0`` as diffusers'
    ``FlowMatchEulerDiscreteScheduler`` and rectified flow train it. The rule
    writes the step through ``x0 = x - sigmas[s + 1] * v``, the range ``clip``
    bounds (``A = 1``, ``B = sigmas[s + 1]``)::

        x <- r x + (1 - r) x0,   r = sigmas[s] / sigmas[s + 1]

    (``C = 1 - r``, ``D = r``, ``E = S = 0``), the same update while ``x0`` is
    inside the range. A full run starts at ``t_start = S - 1``.

    Args:
        sigmas: 1-D float tensor or sequence of ``S + 1 >= 2`` strictly
            ascending values, ``sigmas[0] >= 0``.
        clip: ``None``, ``(lo, hi)`` or ``c`` for ``(-c, c)``: the ``x0`` range
            (numbers or ``(dim,)`` tensors, as :class:`StepRule` takes it).

    Returns:
        A :class:`StepRule` of length ``S``.

    Raises:
        ValueError: bad ``sigmas`` or ``clip``.
    """
    # A sequence is read in float64, as the tables are computed.
    levels = sigmas if isinstance(sigmas, torch.Tensor) else torch.tensor(sigmas, dtype=torch.float64)
    if levels.dim() != 1 or levels.numel() < 2 or not levels.is_floating_point():
        raise ValueError(f"sigmas: expected a 1-D float tensor of at least 2 values, got {_describe(levels)}")
    levels = levels.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(levels).all()) or float(levels[0]) < 0 or bool((levels[1:] <= levels[:-1]).any()):
        raise ValueError(f"sigmas: expected finite, strictly ascending values from sigmas[0] >= 0, got "
                         f"{levels.tolist()}")
    current, target = levels[1:], levels[:-1]
    ratio = target / current
    ones, zeros = torch.ones_like(current), torch.zeros_like(current)
    return _rule((ones, current, 1.0 - ratio, ratio, zeros, zeros), clip)


def dpm_solver_pp(
    alphas_cumprod: torch.Tensor,
    timesteps: torch.Tensor | Sequence[int],
    *,
    order: int = 2,
    prediction: str = "epsilon",
    clip: float | tuple | None = None,
    lower_order_final: bool = True,
    final_sigmas_type: str = "zero",
) -> StepRule:
    """DPM-Solver++ (Lu et al., 2022), multistep, over ``timesteps``, as diffusers'
    ``DPMSolverMultistepScheduler`` (``algorithm_type="dpmsolver++"``, midpoint) steps.

    Step index ``s`` runs from training timestep ``timesteps[s]`` to
    ``timesteps[s - 1]``, and for ``s = 0`` to the end of the schedule:
    ``abar = 1`` (``final_sigmas_type="zero"``) or ``abar =
    alphas_cumprod[0]`` (``"sigma_min"``). With ``alpha = sqrt(abar)``,
    ``sigma = sqrt(1 - abar)``, ``lambda = log(alpha / sigma)`` and ``h`` the
    step's increase of ``lambda``: ``x0`` from the prediction (see
    :func:`ddim`), then the first-order step::

        x <- (sigma_t / sigma_s) x + alpha_t (1 - exp(-h)) x0

    and with ``order=2`` the 2M step, which also uses the previous step's
    ``x0`` (the ``P`` table; ``r = h_prev / h``)::

        x <- (sigma_t / sigma_s) x + alpha_t (1 - exp(-h)) ((1 + 1/(2r)) x0 - 1/(2r) x0_prev)

    The first step of a full run (``s = len(timesteps) - 1``) is first order,
    and so is the last (``s = 0``) when it goes to ``abar = 1`` or when
    ``lower_order_final`` and there are fewer than 15 steps, as diffusers
    does. The op's ``x0_prev`` is zero at a call's first step: a call that
    starts below the full run's first step gives its first step without the
    previous ``x0`` (a full run, or a call split only where the rule is first
    order, is unaffected).

    Args:
        alphas_cumprod: 1-D float tensor, ``abar`` of every training timestep.
        timesteps: strictly ascending training timesteps, one per step index.
        order: 1 or 2.
        prediction: one of ``PREDICTIONS``.
        clip: ``None``, ``(lo, hi)`` or ``c`` for ``(-c, c)``: the ``x0`` range.
        lower_order_final: as the scheduler's option of that name.
        final_sigmas_type: one of ``FINAL_SIGMAS``, as the scheduler's option.

    Returns:
        A :class:`StepRule` of length ``len(timesteps)``, with a ``P`` table
        when some step is second order.

    Raises:
        ValueError: bad ``alphas_cumprod``, ``timesteps``, ``order``,
            ``prediction``, ``final_sigmas_type`` or ``clip``.
    """
    if isinstance(order, bool) or order not in (1, 2):
        raise ValueError(f"order: expected 1 or 2, got {order!r}")
    if final_sigmas_type not in FINAL_SIGMAS:
        raise ValueError(f"final_sigmas_type: expected one of {', '.join(FINAL_SIGMAS)}, got {final_sigmas_type!r}")
    abar_all = _check_alphas_cumprod(alphas_cumprod)
    steps = _check_timesteps(timesteps, len(abar_all))
    abar = abar_all[steps]
    final = abar.new_ones(1) if final_sigmas_type == "zero" else abar_all[:1]
    abar_next = torch.cat([final, abar[:-1]])
    a, b = _x0_coefficients(abar, prediction)
    alpha_t, sigma_t = abar_next.sqrt(), (1.0 - abar_next).sqrt()
    lam = 0.5 * (torch.log(abar) - torch.log1p(-abar))
    lam_next = 0.5 * (torch.log(abar_next) - torch.log1p(-abar_next))  # inf at abar = 1
    first_order = alpha_t * -torch.expm1(lam - lam_next)
    d = sigma_t / (1.0 - abar).sqrt()
    count = len(steps)
    second = torch.zeros(count, dtype=torch.bool)
    if order == 2:
        second[:-1] = True  # every step but a run's first
        if final_sigmas_type == "zero" or (lower_order_final and count < _LOWER_ORDER_FINAL_STEPS):
            second[0] = False
    zeros = torch.zeros_like(abar)
    if not bool(second.any()):
        return _rule((a, b, first_order, d, zeros, zeros), clip)
    # 1 / (2r) = h / (2 h_prev), h_prev the previous step's (index s + 1) increase of lambda.
    h_prev = torch.cat([lam[:-1] - lam[1:], abar.new_ones(1)])
    half_inv_r = torch.where(second, (lam_next - lam) / (2.0 * h_prev), zeros)
    return _rule((a, b, first_order * (1.0 + half_inv_r), d, zeros, zeros, -first_order * half_inv_r), clip)


def _x0_coefficients(abar: torch.Tensor, prediction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)`` with ``x0 = A x - B e`` for the prediction type."""
    if prediction == "epsilon":
        return 1.0 / abar.sqrt(), (1.0 / abar - 1.0).sqrt()
    if prediction == "sample":
        return torch.zeros_like(abar), -torch.ones_like(abar)
    if prediction == "v_prediction":
        return abar.sqrt(), (1.0 - abar).sqrt()
    raise ValueError(f"prediction: expected one of {', '.join(PREDICTIONS)}, got {prediction!r}")


def _ddpm_tables(abar, abar_prev, noise_mask, prediction, variance):
    """DDPMScheduler.step's coefficients, float64, for the given abar pairs."""
    if variance not in VARIANCES:
        raise ValueError(f"variance: expected one of {', '.join(VARIANCES)}, got {variance!r}")
    a, b = _x0_coefficients(abar, prediction)
    alpha = abar / abar_prev
    beta = 1.0 - alpha
    c = abar_prev.sqrt() * beta / (1.0 - abar)
    d = alpha.sqrt() * (1.0 - abar_prev) / (1.0 - abar)
    if variance == "fixed_small":
        var = ((1.0 - abar_prev) / (1.0 - abar) * beta).clamp(min=_MIN_VARIANCE)
    else:
        var = beta
    s = torch.where(noise_mask, var.sqrt(), torch.zeros_like(var))
    return a, b, c, d, torch.zeros_like(abar), s


def _ddim_sigma(abar, abar_prev, eta):
    return eta * ((1.0 - abar_prev) / (1.0 - abar) * (1.0 - abar / abar_prev)).sqrt()


def _ddim_direction(abar, abar_prev, eta):
    """``sqrt(1 - abar_prev - sigma^2)``, pred_eps's coefficient."""
    dir_var = 1.0 - abar_prev - _ddim_sigma(abar, abar_prev, eta) ** 2
    # Exactly 0 when abar_prev = 1; anything visibly negative is eta too large.
    if bool((dir_var < -1e-12).any()):
        raise ValueError(f"eta: {eta} makes sigma^2 exceed 1 - abar_prev (diffusers would return NaN)")
    return dir_var.clamp(min=0).sqrt()


def _ddim_tables(abar, abar_prev, eta, prediction, use_clipped_model_output):
    """DDIMScheduler.step's coefficients, float64, for the given abar pairs."""
    eta = float(eta)
    if not (math.isfinite(eta) and eta >= 0):
        raise ValueError(f"eta: expected a finite number >= 0, got {eta}")
    a, b = _x0_coefficients(abar, prediction)
    sigma = _ddim_sigma(abar, abar_prev, eta)
    direction = _ddim_direction(abar, abar_prev, eta)
    c = abar_prev.sqrt()
    # pred_eps = eps_x * x + eps_e * e, from the unclipped x0 of each prediction.
    if use_clipped_model_output:
        # pred_eps = (x - sqrt(abar) x0_clipped) / sqrt(1 - abar): folds into C.
        c = c - direction * (abar / (1.0 - abar)).sqrt()
        eps_x, eps_e = 1.0 / (1.0 - abar).sqrt(), torch.zeros_like(abar)
    elif prediction == "epsilon":
        eps_x, eps_e = torch.zeros_like(abar), torch.ones_like(abar)
    elif prediction == "sample":
        eps_x, eps_e = 1.0 / (1.0 - abar).sqrt(), -(abar / (1.0 - abar)).sqrt()
    else:
        eps_x, eps_e = (1.0 - abar).sqrt(), abar.sqrt()
    return a, b, c, direction * eps_x, direction * eps_e, sigma


def _floored(tables, mask, min_std):
    """``tables`` with ``S`` raised to ``min_std`` where ``mask`` holds (``min_std`` None: unchanged)."""
    if min_std is None:
        return tables
    if isinstance(min_std, bool) or not isinstance(min_std, (int, float)) or \
            not (math.isfinite(min_std) and min_std >= 0):
        raise ValueError(f"min_std: expected None or a finite number >= 0, got {min_std!r}")
    *rest, s = tables
    return (*rest, torch.where(mask, s.clamp(min=float(min_std)), s))


def _rule(tables, clip, noise_clip=None, eps_tables=None, eps_clip=None) -> StepRule:
    clip = _as_range("clip", clip)
    named = list(zip(TABLE_NAMES + (PREVIOUS_TABLE,), tables)) + list(zip(EPS_TABLES, eps_tables or ()))
    for name, table in named:
        if not bool(torch.isfinite(table).all()):
            raise ValueError(
                f"{name}: the schedule gives a non-finite coefficient (alphas_cumprod 0 with prediction='epsilon'?)"
            )
    return StepRule(**dict(named), clip=clip, noise_clip=noise_clip, eps_clip=eps_clip)


def _check_betas(betas: torch.Tensor) -> torch.Tensor:
    if not isinstance(betas, torch.Tensor) or betas.dim() != 1 or betas.numel() == 0:
        raise ValueError(f"betas: expected a non-empty 1-D tensor, got {_describe(betas)}")
    betas = betas.to(torch.float64)
    if not bool(((betas > 0) & (betas < 1)).all()):
        raise ValueError("betas: expected every beta in the open interval (0, 1)")
    return betas


def _check_alphas_cumprod(alphas_cumprod: torch.Tensor) -> torch.Tensor:
    if not isinstance(alphas_cumprod, torch.Tensor) or alphas_cumprod.dim() != 1 or alphas_cumprod.numel() == 0:
        raise ValueError(f"alphas_cumprod: expected a non-empty 1-D tensor, got {_describe(alphas_cumprod)}")
    abar = alphas_cumprod.detach().to("cpu", torch.float64)
    # 0 is a zero-terminal-SNR schedule: fine for "sample" and "v_prediction".
    if not bool(((abar >= 0) & (abar < 1)).all()):
        raise ValueError("alphas_cumprod: expected every value in [0, 1)")
    return abar


def _check_timesteps(timesteps, total: int) -> torch.Tensor:
    steps = torch.as_tensor(timesteps)
    if steps.dim() != 1 or steps.numel() == 0 or steps.is_floating_point() or steps.dtype == torch.bool:
        raise ValueError(f"timesteps: expected a non-empty 1-D integer sequence, got {_describe(steps)}")
    steps = steps.to("cpu", torch.int64)
    if bool((steps[1:] <= steps[:-1]).any()):
        raise ValueError(f"timesteps: expected strictly ascending values, got {steps.tolist()}")
    if int(steps[0]) < 0 or int(steps[-1]) >= total:
        raise ValueError(f"timesteps: expected values in [0, {total}), got {int(steps[0])}..{int(steps[-1])}")
    return steps


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__
