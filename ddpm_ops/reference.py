"""The reference semantics of ``ddpm::fused_sample`` as plain PyTorch.

:func:`reference` is the original contract written against the op's
arguments: ``num_steps`` DDPM posterior-mean steps of a SiLU MLP whose input is
``cat([x, t / total_timesteps])``, each ``x = sqrt_recip_alphas[t] * (x -
coef_eps[t] * eps)`` at timestep ``t = t_start - k``. It silently wraps
negative timesteps like any Python indexing does; the op refuses them.

:func:`reference_sample` is the general form: any :class:`~ddpm_ops.step_rules.StepRule`,
per-layer activations, a per-step time bias and a per-sample conditioning bias
on the first layer, and explicit noise.

:func:`seeded_noise` is the noise the op draws itself from a ``noise_seed``,
in float64.
"""
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .layers import ACTIVATIONS, run_program
from .step_rules import StepRule

def reference(
    x: torch.Tensor,
    t_start: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor],
    sqrt_recip_alphas: torch.Tensor,
    coef_eps: torch.Tensor,
    num_steps: int,
    total_timesteps: int,
) -> torch.Tensor:
    """Run ``num_steps`` DDPM posterior-mean steps with an MLP noise network.

    Computes in the dtype of ``x`` (pass float64 tensors for a reference of
    higher precision). Same arguments as :func:`ddpm_ops.fused_sample`.
    """
    x_cur = x
    for k in range(num_steps):
        t_idx = t_start - k
        t_norm = t_idx.to(x.dtype) / total_timesteps
        h = torch.cat([x_cur, t_norm[:, None]], dim=1)
        for layer, (w, b) in enumerate(zip(weights, biases)):
            h = F.linear(h, w, b)
            if layer + 1 < len(weights):
                h = F.silu(h)
        c1 = sqrt_recip_alphas[t_idx].view(-1, 1)
        c2 = coef_eps[t_idx].view(-1, 1)
        x_cur = c1 * (x_cur - c2 * h)
    return x_cur


def resolve_activations(activations: str | Sequence[str], num_hidden: int) -> list[str]:
    """One activation name per hidden layer.

    Args:
        activations: one name from ``ACTIVATIONS`` for every hidden layer, or a
            sequence of ``num_hidden`` names.
        num_hidden: the number of hidden layers (Linear layers but the last).

    Returns:
        The list of ``num_hidden`` names.

    Raises:
        ValueError: an unknown name, or a sequence of the wrong length.
    """
    names = [activations] * num_hidden if isinstance(activations, str) else list(activations)
    if len(names) != num_hidden:
        raise ValueError(
            f"activations: expected one name or {num_hidden} (one per hidden layer), got {len(names)}"
        )
    for name in names:
        if name not in ACTIVATIONS:
            raise ValueError(f"activations: expected names from {', '.join(ACTIVATIONS)}, got {name!r}")
    return names


_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
_UNIFORM_BITS = 24


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash on int64 lanes holding values below 2^32; the products
    are taken by 16-bit halves so that none overflows int64."""
    for shift, mul in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        x = x ^ (x >> shift)
        x = ((x & 0xFFFF) * mul + ((((x >> 16) * mul) & 0xFFFF) << 16)) & _MASK32
    return x ^ (x >> 16)


def seeded_noise(seed: "int | torch.Tensor | Sequence[int]", num_steps: int, batch: int,
                 dim: int) -> torch.Tensor:
    """The noise ``z`` that ``fused_sample.rule`` draws from ``noise_seed``, in float64.

    ``z[k, r, j]`` (step ``k``, sample ``r``, feature ``j`` of the flattened
    sample) is a standard normal that depends on ``(seed, k, r, j)`` alone::

        key  = mix64((k * batch + r) ^ mix64(seed))       (SplitMix64's finaliser)
        bits = mix32(mix32(j ^ (key mod 2^32)) + (key >> 32))  mod 2^32
        u    = ((bits >> 8) + 1/2) / 2^24
        z    = sqrt(2) * erfinv(2u - 1)

    With one seed per row (``seed`` of length ``batch``), row ``r`` uses
    ``key = mix64(k ^ mix64(seed[r]))``: what a batch of one draws from
    ``seed[r]``, whatever the row's position or the batch size, so a batch
    cut into shards draws the numbers of the whole.

    The op computes ``erfinv`` in float32 (relative error below 3e-7).

    Args:
        seed: the int64 seed (negative values are taken modulo 2^64): an int or
            a one-element tensor for the whole batch, or a 1-D tensor or
            sequence of ``batch`` seeds, one per row.
        num_steps, batch, dim: the shape ``(num_steps, batch, dim)``.

    Returns:
        A float64 tensor ``(num_steps, batch, dim)``.

    Raises:
        ValueError: a sequence of seeds whose length is neither 1 nor ``batch``.
    """
    if isinstance(seed, torch.Tensor):
        seed = seed.reshape(-1).tolist()
    seeds = [int(s) & _MASK64 for s in (seed if isinstance(seed, Sequence) else [seed])]
    if len(seeds) == 1:
        seed_key = _mix64(seeds[0])
        keys = [_mix64(q ^ seed_key) for q in range(num_steps * batch)]
    elif len(seeds) == batch:
        row_keys = [_mix64(s) for s in seeds]
        keys = [_mix64(k ^ row_key) for k in range(num_steps) for row_key in row_keys]
    else:
        raise ValueError(f"seed: expected one seed or one per row ({batch}), got {len(seeds)}")
    low = torch.tensor([k & _MASK32 for k in keys], dtype=torch.int64).view(-1, 1)
    high = torch.tensor([k >> 32 for k in keys], dtype=torch.int64).view(-1, 1)
    bits = _mix32((_mix32(torch.arange(dim) ^ low) + high) & _MASK32)
    v = (2 * (bits >> (32 - _UNIFORM_BITS)) + 1 - (1 << _UNIFORM_BITS)).double() / (1 << _UNIFORM_BITS)
    return (torch.erfinv(v) * math.sqrt(2)).view(num_steps, batch, dim)


def reference_sample(
    x: torch.Tensor,
    t_start: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor],
    rule: StepRule,
    num_steps: int,
    *,
    activations: str | Sequence[str] = "silu",
    time_bias: torch.Tensor | None = None,
    cond_bias: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    return_chain: bool = False,
    time_net: "BiasNet | None" = None,
    cond_net: "BiasNet | None" = None,
    network: Sequence[str] | None = None,
    norm_weights: Sequence[torch.Tensor] = (),
    norm_biases: Sequence[torch.Tensor] = (),
    time_input: torch.Tensor | None = None,
    cond_input: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run ``num_steps`` steps of ``rule`` with an MLP network, as plain PyTorch.

    Step ``k`` uses step index ``s = t_start - k`` (per sample) into every
    table::

        h = x @ weights[0].T + biases[0] (+ time_bias[s]) (+ cond_bias)
              (+ time_net.rows()[s]) (+ cond_net.rows())
        e = the remaining Linear layers, activations[i] after each but the last
        x0 = A[s] x - B[s] e, clamped to rule.clip
        x = C[s] x0 + D[s] x + E[s] e + S[s] noise[k] + P[s] x0_prev,
            clamped to rule.post_clip

    ``x0_prev`` is the previous step's clamped ``x0``: zero at the first step,
    and no term at all for a rule without ``P``. A clamp's bounds are two
    numbers or per-column ``(dim,)`` rows, broadcast over the batch.

    Computes in the dtype of ``x``: the rule's tables (for float64, the
    tables as given: :meth:`~ddpm_ops.StepRule.tables`) and every other
    tensor are converted to it (float64 ``x`` gives a float64 reference).

    Args:
        x: ``(batch, dim)`` samples at step index ``t_start``.
        t_start: ``(batch,)`` integer tensor, each sample's first step index;
            needs ``num_steps - 1 <= t_start < len(rule)``.
        weights, biases: the MLP's Linear layers; ``weights[0]`` is
            ``(H0, dim)`` (it sees ``x`` alone), the last outputs ``dim``.
        rule: the :class:`StepRule`.
        num_steps: K >= 0.
        activations: a name from ``ACTIVATIONS`` or one per hidden layer.
        time_bias: ``(len(rule), H0)`` or ``None``: added to the first layer at
            each step index.
        cond_bias: ``(batch, H0)`` or ``None``: added to the first layer.
        noise: ``(num_steps, batch, dim)`` or ``None`` (no noise).
        return_chain: return every sample ``(num_steps + 1, batch, dim)``,
            the input first, instead of the last.
        time_net, cond_net: :class:`ddpm_ops.conditioning.BiasNet` or
            ``None``: networks whose output rows are added like ``time_bias``
            (one input row per step index) and ``cond_bias`` (one per sample).

        network, norm_weights, norm_biases, time_input, cond_input: a
            network program instead of the chain of ``weights`` with
            ``activations``, as :func:`ddpm_ops.sample` takes them
            (:func:`ddpm_ops.layers.run_program`). The rule's ``noise_clip``
            clamps the noise before it is scaled.

    Returns:
        ``(batch, dim)`` (or the chain) in the dtype of ``x``.

    Raises:
        ValueError: step indices outside the tables, a noise tensor of the
            wrong shape, or bad activations.
    """
    names = resolve_activations(activations, len(weights) - 1) if network is None else []
    batch = x.shape[0]
    if num_steps < 0:
        raise ValueError(f"num_steps: expected an integer >= 0, got {num_steps}")
    if num_steps > 0 and (int(t_start.min()) < num_steps - 1 or int(t_start.max()) >= len(rule)):
        raise ValueError(
            f"t_start: expected values in [{num_steps - 1}, {len(rule)}) for {num_steps} steps of a rule "
            f"of length {len(rule)}, got {int(t_start.min())}..{int(t_start.max())}"
        )
    if noise is not None and tuple(noise.shape) != (num_steps, *x.shape):
        raise ValueError(f"noise: expected shape {(num_steps, *x.shape)}, got {tuple(noise.shape)}")

    def cast(t):
        return None if t is None else t.to(device=x.device, dtype=x.dtype)

    tables = cast(rule.tables(x.dtype))
    A, B, C, D, E, S = tables[:6]
    P = None if rule.P is None else tables[6]
    Q, R = (None, None) if rule.Q is None else tables[7:9]
    clip, post_clip = (tuple(cast(r)) if isinstance(r, torch.Tensor) else r for r in rule.clamps(x.dtype))
    weights = [cast(w) for w in weights]
    biases = [cast(b) for b in biases]
    time_bias, cond_bias, noise = cast(time_bias), cast(cond_bias), cast(noise)
    time_bias = _plus_rows(time_bias, time_net, x)
    cond_bias = _plus_rows(cond_bias, cond_net, x)
    t_start = t_start.to(x.device)
    norm_weights, norm_biases = [cast(w) for w in norm_weights], [cast(b) for b in norm_biases]
    time_input, cond_input = cast(time_input), cast(cond_input)
    if cond_input is not None and cond_input.dim() == 1:
        cond_input = cond_input.expand(batch, -1)
    parts = []
    if network is not None and len(network) and network[0].startswith("input:"):
        parts = network[0][len("input:"):].split(",")
    if noise is not None and rule.noise_clip is not None:
        noise = noise.clamp(-rule.noise_clip, rule.noise_clip)

    chain = [x]
    x_cur = x
    x0_prev = torch.zeros_like(x)
    for k in range(num_steps):
        s = t_start - k
        if network is not None:
            rows = None
            if time_bias is not None:
                rows = time_bias[s]
            if cond_bias is not None:
                rows = cond_bias if rows is None else rows + cond_bias
            named = {"x": x_cur, "cond": cond_input, "time": None if time_input is None else time_input[s]}
            h = torch.cat([named[p] for p in parts], dim=1) if parts else x_cur
            e = run_program(network, h, weights, biases, norm_weights, norm_biases, first_rows=rows)
        else:
            h = F.linear(x_cur, weights[0], biases[0])
            if time_bias is not None:
                h = h + time_bias[s]
            if cond_bias is not None:
                h = h + cond_bias
            for layer in range(1, len(weights)):
                h = F.linear(ACTIVATIONS[names[layer - 1]](h), weights[layer], biases[layer])
            e = h

        def col(table):
            return table[s].view(batch, 1)

        x0 = col(A) * x_cur - col(B) * e
        if clip is not None:
            x0 = x0.clamp(*clip)
        if Q is not None:  # the eps read back from the clamped x0
            e = col(Q) * x_cur - col(R) * x0
            if rule.eps_clip is not None:
                e = e.clamp(*rule.eps_clip)
        x_cur = col(C) * x0 + col(D) * x_cur + col(E) * e
        if P is not None:
            x_cur = x_cur + col(P) * x0_prev
            x0_prev = x0
        if noise is not None:
            x_cur = x_cur + col(S) * noise[k]
        if post_clip is not None:
            x_cur = x_cur.clamp(*post_clip)
        chain.append(x_cur)
    return torch.stack(chain) if return_chain else x_cur


def _plus_rows(bias, net, x):
    """``bias`` plus ``net``'s rows in ``x``'s dtype and device (either may be ``None``)."""
    if net is None:
        return bias
    rows = net.rows(x.dtype).to(x.device)
    return rows if bias is None else bias + rows
