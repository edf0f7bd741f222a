"""The :class:`StepRule`: a sampler's coefficient tables and ranges, checked
and stored as the op reads them."""
import math
from dataclasses import dataclass, field

import torch

TABLE_NAMES = ("A", "B", "C", "D", "E", "S")
# The optional seventh table: the previous step's x0 coefficient.
PREVIOUS_TABLE = "P"
# The optional eighth and ninth: the eps read back from the clamped x0, Q*x - R*x0.
EPS_TABLES = ("Q", "R")


@dataclass(frozen=True, eq=False, repr=False)
class StepRule:
    """The coefficient tables of one sampler, indexed by step index.

    Args:
        A, B, C, D, E, S: 1-D float32 or float64 tensors of one length, on one
            device (stored as contiguous float32, the tables of a float32
            sample, and as given in float64, those of a float64 sample; see
            :mod:`ddpm_ops.step_rules` for the update they define).
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
        Q, R: ``None``, or two more such tables: the ``E`` term then reads
            the eps read back from the clamped ``x0``, ``Q[s] * x - R[s] * x0``,
            instead of the network's ``e`` (both or neither).
        eps_clip: ``None``, ``(lo, hi)`` or a number ``c`` meaning ``(-c, c)``
            (numbers only): the read-back eps is clamped to it first (DPPO's
            DDIM ``eps_clip_value``). Needs ``Q`` and ``R``.

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
            bound, or bounds that are not 1-D real tensors of one length;
            ``Q`` without ``R`` or the reverse; ``eps_clip`` without them, or
            with tensor bounds.

    Attributes:
        adds_noise: whether any ``S`` entry is nonzero (read once, here);
            ``True`` for a rule built under tracing, whose ``S`` cannot be
            read: a call then draws noise that zero entries of ``S`` drop.
        clip, post_clip: ``None``, a ``(lo, hi)`` pair of floats, or a
            ``(2, dim)`` float32 tensor on the tables' device (row 0 the lower
            bounds, row 1 the upper): ``lo, hi = rule.clip`` unpacks either.
            :meth:`clamps` gives them as a float64 sample is clamped.
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
    Q: torch.Tensor | None = None
    R: torch.Tensor | None = None
    eps_clip: tuple[float, float] | None = None
    adds_noise: bool = field(init=False)
    _tables: torch.Tensor = field(init=False)
    # The tables and per-column bounds as given, in float64: a float64 sample's.
    _tables64: torch.Tensor = field(init=False)
    _clamps64: tuple = field(init=False)

    def __post_init__(self):
        if (self.Q is None) != (self.R is None):
            raise ValueError(f"Q, R: expected both tables of the read-back eps or neither, got "
                             f"{'Q' if self.R is None else 'R'} alone")
        if self.eps_clip is not None and self.Q is None:
            raise ValueError("eps_clip: expected the tables Q and R of the eps it clamps (Q*x - R*x0, read back "
                             "from the clamped x0), got neither")
        names = TABLE_NAMES + ((PREVIOUS_TABLE,) if self.P is not None else ())
        names += EPS_TABLES if self.Q is not None else ()
        given = [_check_table(name, getattr(self, name)) for name in names]
        for name, table in zip(names[1:], given[1:]):
            if table.shape != given[0].shape:
                raise ValueError(
                    f"{name}: expected the length of A ({given[0].numel()}), got {table.numel()}"
                )
            if table.device != given[0].device:
                raise ValueError(f"{name}: expected the device of A ({given[0].device}), got {table.device}")
        # One (6, 7 or 9, len) block, so tables() costs nothing and A..S (P, Q, R) are its rows;
        # the op reads Q and R as rows 7 and 8, after a P of zeros where the rule has none.
        block = given if self.Q is None or self.P is not None else given[:6] + [torch.zeros_like(given[0])] + given[6:]
        tables = torch.stack([t.to(torch.float32) for t in block]).contiguous()
        tables64 = torch.stack([t.to(torch.float64) for t in block]).contiguous()
        traced = torch.compiler.is_compiling()
        if not traced and not bool(torch.isfinite(tables).all()):
            bad = [n for n, t in zip(names, tables) if not bool(torch.isfinite(t).all())]
            raise ValueError(f"{', '.join(bad)}: expected finite values (in float32), got inf or nan")
        object.__setattr__(self, "_tables", tables)
        object.__setattr__(self, "_tables64", tables64)
        rows = dict(zip(TABLE_NAMES + (PREVIOUS_TABLE,) + EPS_TABLES, tables))
        for name in names:
            object.__setattr__(self, name, rows[name])
        clamps64 = (_as_range("clip", self.clip, tables.device), _as_range("post_clip", self.post_clip, tables.device))
        object.__setattr__(self, "_clamps64", clamps64)
        for name, bounds in zip(("clip", "post_clip"), clamps64):
            object.__setattr__(self, name, bounds.to(torch.float32) if isinstance(bounds, torch.Tensor) else bounds)
        object.__setattr__(self, "adds_noise", traced or bool((tables[5] != 0).any()))
        if self.noise_clip is not None:
            if isinstance(self.noise_clip, bool) or not isinstance(self.noise_clip, (int, float)) or \
                    not (math.isfinite(self.noise_clip) and self.noise_clip > 0):
                raise ValueError(f"noise_clip: expected None or a finite number > 0, got {self.noise_clip!r}")
            object.__setattr__(self, "noise_clip", float(self.noise_clip))
        if self.eps_clip is not None:
            eps_clip = _as_range("eps_clip", self.eps_clip)
            if isinstance(eps_clip, torch.Tensor):
                raise ValueError(f"eps_clip: expected None, (lo, hi) or a number c with number bounds, got "
                                 f"per-column bounds {self.eps_clip!r}")
            object.__setattr__(self, "eps_clip", eps_clip)

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

    def tables(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``(6, len)`` block ``[A, B, C, D, E, S]`` the op reads, ``(7, len)`` with ``P``,
        ``(9, len)`` with ``Q`` and ``R`` (after ``P``, zeros where the rule has none; do not
        modify it): for ``dtype`` float64, a float64 sample's, the tables as given in
        float64; for any other ``dtype``, the float32 block (a float32 sample's)."""
        return self._tables64 if dtype == torch.float64 else self._tables

    def clamps(self, dtype: torch.dtype = torch.float32) -> tuple:
        """``(clip, post_clip)`` as :meth:`tables` gives the tables for ``dtype``: per-column
        bounds in float64 as given for float64, else the float32 attributes; pairs of floats
        and ``None`` as they are."""
        return self._clamps64 if dtype == torch.float64 else (self.clip, self.post_clip)

    def to(self, device: torch.device | str) -> "StepRule":
        """A copy of the rule with its tables on ``device``.

        Args:
            device: the target device.

        Returns:
            A new :class:`StepRule`.
        """
        tables = dict(zip(TABLE_NAMES + (PREVIOUS_TABLE,) + EPS_TABLES, self._tables64.to(device)))
        if self.P is None:
            tables.pop(PREVIOUS_TABLE, None)
        clip, post_clip = self._clamps64
        return StepRule(**tables, clip=clip, post_clip=post_clip, noise_clip=self.noise_clip, eps_clip=self.eps_clip)

    def __repr__(self) -> str:
        return (
            f"StepRule(len={len(self)}, adds_noise={self.adds_noise}, "
            f"previous_x0={self.P is not None}, clip={_describe_range(self.clip)}, "
            f"post_clip={_describe_range(self.post_clip)}, noise_clip={self.noise_clip}, "
            f"eps_readback={self.Q is not None}, eps_clip={self.eps_clip}, device={self.device})"
        )


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
    float64 tensor of per-column bounds on ``device``."""
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
    return table.to(device=device).contiguous()


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
