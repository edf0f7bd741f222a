"""Step rules: the per-step coefficient tables of a reverse-diffusion sampler.

Every sampler the op runs is one update, applied at step index ``s`` (a row of
each table) to the current sample ``x`` and the network output ``e``::

    x0 = A[s] * x - B[s] * e                      # the predicted clean sample
    x0 = x0.clamp(*clip)                          # when clip is not None
    x  = C[s] * x0 + D[s] * x + E[s] * e + S[s] * z
    x  = x.clamp(*post_clip)                      # when post_clip is not None

with ``z`` standard normal noise. :class:`StepRule` holds the six tables and
the two optional ranges; :func:`ddpm`, :func:`ddim` and :func:`from_diffusers`
build them. Every table is computed in float64 and stored in float32.
"""
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

PREDICTIONS = ("epsilon", "sample", "v_prediction")
VARIANCES = ("fixed_small", "fixed_large")
TABLE_NAMES = ("A", "B", "C", "D", "E", "S")

# diffusers clamps the DDPM posterior variance here before it takes a log.
_MIN_VARIANCE = 1e-20


@dataclass(frozen=True, eq=False, repr=False)
class StepRule:
    """The six coefficient tables of one sampler, indexed by step index.

    Args:
        A, B, C, D, E, S: 1-D float32 or float64 tensors of one length, on one
            device (stored as contiguous float32; see the module docstring for
            the update they define).
        clip: ``None``, ``(lo, hi)`` or a number ``c`` meaning ``(-c, c)``: the
            range ``x0`` is clamped to.
        post_clip: the same, for the new sample ``x``.

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
            bound.

    Attributes:
        adds_noise: whether any ``S`` entry is nonzero (read once, here);
            ``True`` for a rule built under tracing, whose ``S`` cannot be
            read: a call then draws noise that zero entries of ``S`` drop.
    """

    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor
    E: torch.Tensor
    S: torch.Tensor
    clip: tuple[float, float] | None = None
    post_clip: tuple[float, float] | None = None
    adds_noise: bool = field(init=False)
    _tables: torch.Tensor = field(init=False)

    def __post_init__(self):
        given = [_check_table(name, getattr(self, name)) for name in TABLE_NAMES]
        for name, table in zip(TABLE_NAMES[1:], given[1:]):
            if table.shape != given[0].shape:
                raise ValueError(
                    f"{name}: expected the length of A ({given[0].numel()}), got {table.numel()}"
                )
            if table.device != given[0].device:
                raise ValueError(f"{name}: expected the device of A ({given[0].device}), got {table.device}")
        # One (6, len) block, so tables() costs nothing and A..S are its rows.
        tables = torch.stack([t.to(torch.float32) for t in given]).contiguous()
        traced = torch.compiler.is_compiling()
        if not traced and not bool(torch.isfinite(tables).all()):
            bad = [n for n, t in zip(TABLE_NAMES, tables) if not bool(torch.isfinite(t).all())]
            raise ValueError(f"{', '.join(bad)}: expected finite values (in float32), got inf or nan")
        object.__setattr__(self, "_tables", tables)
        for name, row in zip(TABLE_NAMES, tables):
            object.__setattr__(self, name, row)
        object.__setattr__(self, "clip", _as_range("clip", self.clip))
        object.__setattr__(self, "post_clip", _as_range("post_clip", self.post_clip))
        object.__setattr__(self, "adds_noise", traced or bool((tables[5] != 0).any()))

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
        """The ``(6, len)`` float32 block ``[A, B, C, D, E, S]`` the op reads (do not modify it)."""
        return self._tables

    def to(self, device: torch.device | str) -> "StepRule":
        """A copy of the rule with its tables on ``device``.

        Args:
            device: the target device.

        Returns:
            A new :class:`StepRule`.
        """
        tables = self._tables.to(device)
        return StepRule(*tables, clip=self.clip, post_clip=self.post_clip)

    def __repr__(self) -> str:
        return (
            f"StepRule(len={len(self)}, adds_noise={self.adds_noise}, clip={self.clip}, "
            f"post_clip={self.post_clip}, device={self.device})"
        )


def ddpm(
    betas: torch.Tensor,
    *,
    prediction: str = "epsilon",
    clip: float | tuple[float, float] | None = None,
    variance: str = "fixed_small",
    noise: bool = True,
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

    Returns:
        A :class:`StepRule` of length ``T``.

    Raises:
        ValueError: bad ``betas``, ``prediction``, ``variance`` or ``clip``.
    """
    abar = torch.cumprod(1.0 - _check_betas(betas), 0)
    abar_prev = torch.cat([abar.new_ones(1), abar[:-1]])
    noise_mask = torch.arange(len(abar)) > 0 if noise else torch.zeros(len(abar), dtype=torch.bool)
    return _rule(_ddpm_tables(abar, abar_prev, noise_mask, prediction, variance), clip)


def ddim(
    alphas_cumprod: torch.Tensor,
    timesteps: torch.Tensor | Sequence[int],
    *,
    eta: float = 0.0,
    prediction: str = "epsilon",
    clip: float | tuple[float, float] | None = None,
    use_clipped_model_output: bool = False,
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

    Returns:
        A :class:`StepRule` of length ``len(timesteps)``.

    Raises:
        ValueError: bad ``alphas_cumprod``, ``timesteps``, ``eta``,
            ``prediction`` or ``clip``.
    """
    abar_all = _check_alphas_cumprod(alphas_cumprod)
    steps = _check_timesteps(timesteps, len(abar_all))
    abar = abar_all[steps]
    abar_prev = torch.cat([abar.new_ones(1), abar[:-1]])
    return _rule(_ddim_tables(abar, abar_prev, eta, prediction, use_clipped_model_output), clip)


def from_diffusers(
    scheduler, *, eta: float = 0.0, use_clipped_model_output: bool = False
) -> tuple[StepRule, torch.Tensor]:
    """The rule of a diffusers ``DDPMScheduler`` or ``DDIMScheduler``.

    Reads the scheduler after ``set_timesteps`` (diffusers is not imported):
    its ``alphas_cumprod``, ``timesteps`` and config, and reproduces its
    ``step``: DDPM steps to the scheduler's next timestep (``-1``, i.e.
    ``abar = 1``, after the last) and draws noise only where the timestep is
    above 0; DDIM steps to ``t - num_train_timesteps // num_inference_steps``
    whatever the spacing, and below 0 to ``final_alpha_cumprod``. The x0 clamp
    is ``clip_sample_range`` when ``clip_sample`` is set.

    Args:
        scheduler: a diffusers ``DDPMScheduler`` or ``DDIMScheduler``.
        eta, use_clipped_model_output: the ``DDIMScheduler.step`` arguments
            (``eta`` must be 0 and the flag off for a ``DDPMScheduler``).

    Returns:
        ``(rule, timesteps)``: ``timesteps`` is an ascending int64 CPU tensor,
        ``timesteps[s]`` the training timestep of step index ``s``, so a full
        run starts at ``t_start = len(timesteps) - 1``; ``rule`` has that
        length and lives on the CPU.

    Raises:
        TypeError: ``scheduler`` is neither class.
        ValueError: ``set_timesteps`` was not called, or a setting the rule
            cannot express: ``thresholding``, a learned or ``"fixed_large_log"``
            variance (diffusers' own step gives NaN for the latter), an
            unknown ``prediction_type``, timesteps outside the schedule.
    """
    kind = type(scheduler).__name__
    if kind not in ("DDPMScheduler", "DDIMScheduler"):
        raise TypeError(f"scheduler: expected a diffusers DDPMScheduler or DDIMScheduler, got {kind}")
    config = scheduler.config
    if getattr(config, "thresholding", False):
        raise ValueError(f"scheduler: thresholding=True ({kind}) is not supported (it is not a fixed clamp)")
    if scheduler.num_inference_steps is None and not getattr(scheduler, "custom_timesteps", False):
        raise ValueError(f"scheduler: call {kind}.set_timesteps(...) before from_diffusers")
    abar_all = _check_alphas_cumprod(scheduler.alphas_cumprod)
    total = int(config.num_train_timesteps)
    steps = _check_timesteps(torch.as_tensor(scheduler.timesteps).cpu().flip(0), min(total, len(abar_all)))
    abar = abar_all[steps]
    prediction = config.prediction_type
    clip = float(config.clip_sample_range) if config.clip_sample else None

    if kind == "DDPMScheduler":
        if eta != 0 or use_clipped_model_output:
            raise ValueError(
                f"eta, use_clipped_model_output: DDIMScheduler.step arguments, got eta={eta}, "
                f"use_clipped_model_output={use_clipped_model_output} for a DDPMScheduler"
            )
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


def _rule(tables, clip) -> StepRule:
    clip = _as_range("clip", clip)
    for name, table in zip(TABLE_NAMES, tables):
        if not bool(torch.isfinite(table).all()):
            raise ValueError(
                f"{name}: the schedule gives a non-finite coefficient (alphas_cumprod 0 with prediction='epsilon'?)"
            )
    return StepRule(*tables, clip=clip)


def _check_table(name: str, table) -> torch.Tensor:
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"{name}: expected a 1-D float32 or float64 tensor, got {type(table).__name__}")
    if table.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{name}: expected dtype float32 or float64, got {table.dtype}")
    if table.dim() != 1 or table.numel() == 0:
        raise ValueError(f"{name}: expected a non-empty 1-D tensor, got shape {tuple(table.shape)}")
    return table


def _as_range(name: str, value) -> tuple[float, float] | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected None, (lo, hi) or a number c, got {value!r}")
    if isinstance(value, (int, float)):
        lo, hi = -float(value), float(value)
    else:
        try:
            lo, hi = (float(v) for v in value)
        except (TypeError, ValueError):
            raise ValueError(f"{name}: expected None, (lo, hi) or a number c, got {value!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"{name}: expected finite bounds, got ({lo}, {hi})")
    if lo > hi:
        raise ValueError(f"{name}: expected lo <= hi, got ({lo}, {hi})")
    return lo, hi


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
