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
"""
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

PREDICTIONS = ("epsilon", "sample", "v_prediction")
VARIANCES = ("fixed_small", "fixed_large")
FINAL_SIGMAS = ("zero", "sigma_min")
TABLE_NAMES = ("A", "B", "C", "D", "E", "S")
# The optional seventh table: the previous step's x0 coefficient.
PREVIOUS_TABLE = "P"
# diffusers' DPMSolverMultistepScheduler takes its last step at first order
# with lower_order_final below this many steps.
_LOWER_ORDER_FINAL_STEPS = 15

# diffusers clamps the DDPM posterior variance here before it takes a log.
_MIN_VARIANCE = 1e-20


@dataclass(frozen=True, eq=False, repr=False)
class StepRule:
    """The coefficient tables of one sampler, indexed by step index.

    Args:
        A, B, C, D, E, S: 1-D float32 or float64 tensors of one length, on one
            device (stored as contiguous float32; see the module docstring for
            the update they define).
        P: ``None`` or a seventh such table: the coefficient of the previous
            step's clamped ``x0`` (a multistep solver's term, zero at a call's
            first step).
        clip: ``None``, ``(lo, hi)`` or a number ``c`` meaning ``(-c, c)``: the
            range ``x0`` is clamped to. ``lo`` and ``hi`` are numbers, or
            ``(dim,)`` tensors of per-column bounds (a number beside a tensor
            is repeated), broadcast over the batch.
        post_clip: the same, for the new sample ``x``.
        noise_clip: ``None`` or a number ``c > 0``: the noise ``z`` is clamped
            to ``[-c, c]`` before it is scaled by ``S[s]`` (DPPO's
            ``randn_clip_value``), a given noise tensor and noise the op draws
            alike.

    A rule built while torch.compile or torch.export traces (inside a
    module's ``forward``, from its buffers) checks what does not need the
    tables' values only: the values are unknown until the traced program
    runs, and reading them is a data-dependent branch export refuses. Eager
    construction checks everything.

    Raises:
        TypeError: a table is not a tensor.
        ValueError: a table is not 1-D, is empty, is not float32/float64, has
            a non-finite entry (checked eagerly only), or differs from ``A``
            in length or device; a range has ``lo > hi`` or a non-finite
            bound, or bounds that are not 1-D real tensors of one length.

    Attributes:
        adds_noise: whether any ``S`` entry is nonzero (read once, here);
            ``True`` for a rule built under tracing, whose ``S`` cannot be
            read: a call then draws noise that zero entries of ``S`` drop.
        clip, post_clip: ``None``, a ``(lo, hi)`` pair of floats, or a
            ``(2, dim)`` float32 tensor on the tables' device (row 0 the lower
            bounds, row 1 the upper): ``lo, hi = rule.clip`` unpacks either.
    """

    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor
    E: torch.Tensor
    S: torch.Tensor
    P: torch.Tensor | None = None
    clip: tuple[float, float] | torch.Tensor | None = None
    post_clip: tuple[float, float] | torch.Tensor | None = None
    noise_clip: float | None = None
    adds_noise: bool = field(init=False)
    _tables: torch.Tensor = field(init=False)

    def __post_init__(self):
        names = TABLE_NAMES + ((PREVIOUS_TABLE,) if self.P is not None else ())
        given = [_check_table(name, getattr(self, name)) for name in names]
        for name, table in zip(names[1:], given[1:]):
            if table.shape != given[0].shape:
                raise ValueError(
                    f"{name}: expected the length of A ({given[0].numel()}), got {table.numel()}"
                )
            if table.device != given[0].device:
                raise ValueError(f"{name}: expected the device of A ({given[0].device}), got {table.device}")
        # One (6 or 7, len) block, so tables() costs nothing and A..S (P) are its rows.
        tables = torch.stack([t.to(torch.float32) for t in given]).contiguous()
        traced = torch.compiler.is_compiling()
        if not traced and not bool(torch.isfinite(tables).all()):
            bad = [n for n, t in zip(names, tables) if not bool(torch.isfinite(t).all())]
            raise ValueError(f"{', '.join(bad)}: expected finite values (in float32), got inf or nan")
        object.__setattr__(self, "_tables", tables)
        for name, row in zip(names, tables):
            object.__setattr__(self, name, row)
        object.__setattr__(self, "clip", _as_range("clip", self.clip, tables.device))
        object.__setattr__(self, "post_clip", _as_range("post_clip", self.post_clip, tables.device))
        object.__setattr__(self, "adds_noise", traced or bool((tables[5] != 0).any()))
        if self.noise_clip is not None:
            if isinstance(self.noise_clip, bool) or not isinstance(self.noise_clip, (int, float)) or \
                    not (math.isfinite(self.noise_clip) and self.noise_clip > 0):
                raise ValueError(f"noise_clip: expected None or a finite number > 0, got {self.noise_clip!r}")
            object.__setattr__(self, "noise_clip", float(self.noise_clip))

    @classmethod
    def from_coefficients(cls, sqrt_recip_alphas: torch.Tensor, coef_eps: torch.Tensor) -> "StepRule":
        """The rule of ``x = sqrt_recip_alphas[s] * (x - coef_eps[s] * e)``.

        That is the posterior-mean step without noise of the original op
        (tables from :func:`ddpm_ops.coefficient_tables`): ``A = 1``,
        ``B = coef_eps``, ``C = sqrt_recip_alphas``, ``D = E = S = 0``.

        Args:
            sqrt_recip_alphas, coef_eps: 1-D float tables of one length.

        Returns:
            The :class:`StepRule`.

        Raises:
            TypeError, ValueError: as :class:`StepRule`.
        """
        _check_table("sqrt_recip_alphas", sqrt_recip_alphas)
        _check_table("coef_eps", coef_eps)
        if sqrt_recip_alphas.shape != coef_eps.shape or sqrt_recip_alphas.device != coef_eps.device:
            raise ValueError(
                f"sqrt_recip_alphas: expected the length and device of coef_eps ({coef_eps.numel()} on "
                f"{coef_eps.device}), got {sqrt_recip_alphas.numel()} on {sqrt_recip_alphas.device}"
            )
        zeros = torch.zeros_like(coef_eps)
        return cls(A=torch.ones_like(coef_eps), B=coef_eps, C=sqrt_recip_alphas, D=zeros, E=zeros, S=zeros)

    def __len__(self) -> int:
        return self._tables.shape[1]

    @property
    def device(self) -> torch.device:
        return self._tables.device

    def tables(self) -> torch.Tensor:
        """The ``(6, len)`` float32 block ``[A, B, C, D, E, S]`` the op reads, ``(7, len)``
        with ``P`` (do not modify it)."""
        return self._tables

    def to(self, device: torch.device | str) -> "StepRule":
        """A copy of the rule with its tables on ``device``.

        Args:
            device: the target device.

        Returns:
            A new :class:`StepRule`.
        """
        tables = self._tables.to(device)
        return StepRule(*tables, clip=self.clip, post_clip=self.post_clip, noise_clip=self.noise_clip)

    def __repr__(self) -> str:
        return (
            f"StepRule(len={len(self)}, adds_noise={self.adds_noise}, "
            f"previous_x0={self.P is not None}, clip={_describe_range(self.clip)}, "
            f"post_clip={_describe_range(self.post_clip)}, noise_clip={self.noise_clip}, device={self.device})"
        )


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

    Returns:
        A :class:`StepRule` of length ``len(timesteps)``.

    Raises:
        ValueError: bad ``alphas_cumprod``, ``timesteps``, ``eta``,
            ``prediction``, ``clip``, ``min_std`` or ``noise_clip``.
    """
    abar_all = _check_alphas_cumprod(alphas_cumprod)
    steps = _check_timesteps(timesteps, len(abar_all))
    abar = abar_all[steps]
    abar_prev = torch.cat([abar.new_ones(1), abar[:-1]])
    tables = _ddim_tables(abar, abar_prev, eta, prediction, use_clipped_model_output)
    return _rule(_floored(tables, torch.ones(len(abar), dtype=torch.bool), min_std), clip, noise_clip)


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


def _ddim_tables(abar, abar_prev, eta, prediction, use_clipped_model_output):
    """DDIMScheduler.step's coefficients, float64, for the given abar pairs."""
    eta = float(eta)
    if not (math.isfinite(eta) and eta >= 0):
        raise ValueError(f"eta: expected a finite number >= 0, got {eta}")
    a, b = _x0_coefficients(abar, prediction)
    sigma = eta * ((1.0 - abar_prev) / (1.0 - abar) * (1.0 - abar / abar_prev)).sqrt()
    dir_var = 1.0 - abar_prev - sigma**2
    # Exactly 0 when abar_prev = 1; anything visibly negative is eta too large.
    if bool((dir_var < -1e-12).any()):
        raise ValueError(f"eta: {eta} makes sigma^2 exceed 1 - abar_prev (diffusers would return NaN)")
    direction = dir_var.clamp(min=0).sqrt()
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


def _rule(tables, clip, noise_clip=None) -> StepRule:
    clip = _as_range("clip", clip)
    for name, table in zip(TABLE_NAMES + (PREVIOUS_TABLE,), tables):
        if not bool(torch.isfinite(table).all()):
            raise ValueError(
                f"{name}: the schedule gives a non-finite coefficient (alphas_cumprod 0 with prediction='epsilon'?)"
            )
    return StepRule(*tables, clip=clip, noise_clip=noise_clip)


def _check_table(name: str, table) -> torch.Tensor:
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"{name}: expected a 1-D float32 or float64 tensor, got {type(table).__name__}")
    if table.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{name}: expected dtype float32 or float64, got {table.dtype}")
    if table.dim() != 1 or table.numel() == 0:
        raise ValueError(f"{name}: expected a non-empty 1-D tensor, got shape {tuple(table.shape)}")
    return table


def _as_range(name: str, value, device: torch.device | str = "cpu"):
    """``value`` as a range: ``None``, ``(lo, hi)`` floats, or a ``(2, dim)``
    float32 tensor of per-column bounds on ``device``."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected None, (lo, hi) or a number c, got {value!r}")
    if isinstance(value, (int, float)):
        value = (-float(value), float(value))
    try:
        lo, hi = value
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected None, (lo, hi) or a number c, got {value!r}") from None
    bounds = [_as_bound(name, v, value) for v in (lo, hi)]
    if all(isinstance(b, float) for b in bounds):
        lo, hi = bounds
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise ValueError(f"{name}: expected finite bounds, got ({lo}, {hi})")
        if lo > hi:
            raise ValueError(f"{name}: expected lo <= hi, got ({lo}, {hi})")
        return lo, hi
    lengths = {b.numel() for b in bounds if isinstance(b, torch.Tensor)}
    if len(lengths) > 1:
        raise ValueError(f"{name}: expected lo and hi of one length, got {' and '.join(map(str, sorted(lengths)))}")
    dim = lengths.pop()
    table = torch.stack([b if isinstance(b, torch.Tensor) else torch.full((dim,), b, dtype=torch.float64)
                         for b in bounds])
    if not bool(torch.isfinite(table).all()):
        raise ValueError(f"{name}: expected finite bounds, got inf or nan")
    crossed = (table[0] > table[1]).nonzero()
    if len(crossed):
        j = int(crossed[0])
        raise ValueError(f"{name}: expected lo <= hi in every column, got lo = {float(table[0, j])} > "
                         f"hi = {float(table[1, j])} in column {j}")
    return table.to(device=device, dtype=torch.float32).contiguous()


def _as_bound(name: str, value, whole) -> float | torch.Tensor:
    """One bound of the range ``whole``: a float, or a non-empty 1-D float64
    CPU tensor of per-column bounds."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.is_complex():
            raise ValueError(f"{name}: expected real bounds, got a {value.dtype} tensor")
        if value.dim() == 0:
            return float(value)
        if value.dim() != 1 or value.numel() == 0:
            raise ValueError(f"{name}: expected numbers or non-empty 1-D (dim,) tensors as bounds, got a "
                             f"tensor of shape {tuple(value.shape)}")
        return value.detach().to("cpu", torch.float64)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: expected None, (lo, hi) or a number c, lo and hi numbers or (dim,) "
                         f"tensors, got {whole!r}")
    return float(value)


def _describe_range(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"per-column bounds of {value.shape[1]} columns"
    return str(value)


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
