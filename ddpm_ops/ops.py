"""Typed Python entry points of ``torch.ops.ddpm.fused_sample``.

The schema, the argument checks and the fake (Meta) kernel all live in C++
(csrc/op/ops.cpp, csrc/op/checks.cpp), so eager calls, torch.compile, torch.export
and AOTInductor see one definition.
"""
import operator
from collections.abc import Sequence

import torch
from torch import nn

from .calls import RULE, TIME_COLUMN, bias_net_args, call
from .conditioning import BiasNet
from .layers import mlp_layers
from .reference import resolve_activations
from .step_rules import StepRule

PRECISIONS = ("fp32", "tf32", "bf16")
# Noise seeds are drawn from [0, NOISE_SEED_BOUND): 62 bits.
NOISE_SEED_BOUND = 1 << 62


def fused_sample(
    x: torch.Tensor,
    t_start: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor],
    sqrt_recip_alphas: torch.Tensor,
    coef_eps: torch.Tensor,
    num_steps: int,
    total_timesteps: int,
    *,
    validate: bool = False,
    precision: str = "fp32",
) -> torch.Tensor:
    """Run ``num_steps`` reverse-diffusion (DDPM) steps of an MLP noise network as one op.

    Equal to :func:`ddpm_ops.reference` (the plain loop)::

        for k in range(num_steps):
            t = t_start - k
            eps = mlp(cat([x, t / total_timesteps], dim=1))
            x = sqrt_recip_alphas[t] * (x - coef_eps[t] * eps)

    Args:
        x: ``(batch, dim)`` float32, the samples at timestep ``t_start``.
        t_start: ``(batch,)`` int64 or int32, each sample's first timestep, or
            a Python int shared by the whole batch.
        weights: the MLP's ``nn.Linear`` weights ``(out_l, in_l)``; ``in_0 = dim + 1``
            (the last input column is ``t / total_timesteps``), the last layer
            outputs ``dim``. SiLU between layers, none after the last.
        biases: one ``(out_l,)`` bias per weight.
        sqrt_recip_alphas, coef_eps: 1-D float32 tables of equal length, indexed
            by timestep (see :func:`ddpm_ops.coefficient_tables`).
        num_steps: how many steps K >= 0 to run, at most the tables' length;
            0 returns a copy of ``x``.
        total_timesteps: T, the divisor of the time input.
        validate: on CUDA, check every timestep on the host before launching
            and raise a ``RuntimeError`` for one outside the tables (this
            synchronises with the GPU). Without it the CUDA kernel never
            synchronises: a sample whose timesteps ``t_start - k`` fall outside
            the tables is never read out of bounds, and its output row is NaN.
            On the CPU the check always runs and always raises.
        precision: ``"fp32"`` (default): relative error at most 1e-5 against
            float64 (about 1.5e-7 measured), on every device and kernel.
            ``"tf32"`` and ``"bf16"`` allow relative error up to 5e-3 on CUDA
            in exchange for faster tensor-core kernels where those run; the
            CPU always computes in fp32. Which kernel runs where, and why, is
            in ``docs/kernels.md``.

    Returns:
        A new contiguous ``(batch, dim)`` float32 tensor; inputs are never
        mutated or aliased.

    Raises:
        RuntimeError: for a bad argument (the message names it, what was
            expected and what was given), and when called under grad mode with
            an input that requires grad: the op is inference-only.
        TypeError: for a count that is not an int.
    """
    return call(TIME_COLUMN, **_on_mesh_of(x, dict(x=x, t_start=_as_timesteps(t_start, x), weights=list(weights),
                                                   biases=list(biases), sqrt_recip_alphas=sqrt_recip_alphas,
                                                   coef_eps=coef_eps)),
                num_steps=_as_int("num_steps", num_steps),
                total_timesteps=_as_int("total_timesteps", total_timesteps), validate=validate,
                precision=precision)


def sample(
    x: torch.Tensor,
    t_start: torch.Tensor | int,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor],
    rule: StepRule,
    num_steps: int,
    *,
    activations: str | Sequence[str] = "silu",
    time_bias: torch.Tensor | None = None,
    cond_bias: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    return_chain: bool = False,
    precision: str = "fp32",
    validate: bool = False,
    time_net: BiasNet | None = None,
    cond_net: BiasNet | None = None,
    network: Sequence[str] | None = None,
    norm_weights: Sequence[torch.Tensor] = (),
    norm_biases: Sequence[torch.Tensor] = (),
    time_input: torch.Tensor | None = None,
    cond_input: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run ``num_steps`` steps of a diffusion sampler with an MLP network as one op.

    Equal to :func:`ddpm_ops.reference_sample`: at step ``k`` every sample is at
    step index ``s = t_start - k`` (an index into the rule's tables, not
    necessarily a training timestep: a strided DDIM rule has one entry per
    inference step), and::

        h  = x @ weights[0].T + biases[0] + time_bias[s] + cond_bias
                                        + time_net.rows()[s] + cond_net.rows()
        e  = the rest of the MLP on h (activations[l] after every Linear but the last)
        x0 = rule.A[s] * x - rule.B[s] * e,   clamped to rule.clip
        x  = rule.C[s] * x0 + rule.D[s] * x + rule.E[s] * e + rule.S[s] * z_k
             + rule.P[s] * x0_prev,            clamped to rule.post_clip

    (``x0_prev`` the previous step's clamped ``x0``, zero at the call's first
    step; no term for a rule without ``P``; for a rule with ``Q`` and ``R``,
    ``e`` in the ``E`` term is ``rule.Q[s] * x - rule.R[s] * x0``, clamped to
    ``rule.eps_clip``: the eps read back from the clamped ``x0``).

    Args:
        x: ``(batch, dim)`` float32, or ``(batch, *event)`` (an action chunk
            ``(batch, horizon, action_dim)``, say), flattened to ``dim``
            features for the network and shaped back on return. Or float64
            (TabDDPM's sample between network calls): the step (``x0``,
            ``x``, the rule's tables and clamps, the noise) then computes in
            float64 and the network in float32, on ``x`` rounded to float32,
            its output widened back, as a loop that casts around its
            network does; the network's tensors stay float32.
        t_start: ``(batch,)`` int64/int32 step indices, or one Python int for
            the whole batch; every ``t_start - k`` must index the rule's tables.
        weights, biases: the MLP's ``nn.Linear`` parameters; ``weights[0]`` is
            ``(H0, dim)``, the first Linear's columns for x alone (see
            :func:`ddpm_ops.split_first_linear` for a network whose input
            concatenates x with a time embedding or an observation); the last
            layer outputs ``dim``.
        rule: the :class:`~ddpm_ops.StepRule` (see :mod:`ddpm_ops.step_rules`);
            moved to x's device if it lives elsewhere. Its clamps' per-column
            bounds, when it has them, are ``dim`` values, or as many as the
            last dimension of ``x`` of shape ``(batch, *event)``, repeated
            over the others (one bound per action dimension of an action
            chunk).
        num_steps: K >= 0, at most ``len(rule)``.
        activations: one name for every hidden layer, or one per hidden layer:
            ``"silu"``, ``"mish"``, ``"relu"``, ``"gelu"``, ``"gelu_tanh"``,
            ``"tanh"``, ``"identity"``.
        time_bias: ``(len(rule), H0)``: row ``s`` is added to the first Linear's
            output at step index ``s`` (:func:`ddpm_ops.time_bias_from_module`).
        cond_bias: ``(batch, H0)``, or ``(H0,)`` for the whole batch: added to the
            first Linear's output at every step (:func:`ddpm_ops.cond_bias`).
        noise: ``z``, shaped ``(num_steps, *x.shape)``, of ``x``'s dtype. When it is not given and
            the rule adds noise, the op draws it itself, in parallel with the
            steps, from one int64 seed for the call taken from ``generator``
            (or torch's default generator of x's device), so a run is
            reproducible from the generator's state, and inside a CUDA graph
            every replay draws fresh noise. The op takes the generator (its
            ``generator`` argument): on CUDA the seed comes from the
            generator's Philox state inside the op's one launch; under
            torch.compile or export the seed is drawn with ``torch.randint``
            and passed as ``noise_seed``. The noise a seed gives is
            :func:`ddpm_ops.reference.seeded_noise`. For a DTensor ``x`` (a
            batch sharded over devices) it draws one seed per row instead,
            on the first device of the mesh, and sends every device its rows'
            seeds: no two rows share noise, and the numbers do not depend on
            how the batch is sharded.
        generator: the ``torch.Generator`` to take the noise seed from.
        return_chain: return every sample ``x_0 .. x_K`` stacked,
            ``(num_steps + 1, *x.shape)``, ``x_0`` being the input.
        precision: ``"fp32"``: relative error at most 1e-5 against float64.
        validate: on CUDA, check the step indices on the host and raise for one
            outside the tables (a sync); without it such rows are NaN. The CPU
            always checks and raises.
        time_net: a :class:`~ddpm_ops.conditioning.BiasNet` with one input row
            per step index (``len(rule)`` rows): a time embedding's MLP and the
            first Linear's time columns, run by the op once a call; its row
            ``s`` is added like ``time_bias[s]``.
        cond_net: a ``BiasNet`` with one input row per sample (the
            observation and the first Linear's columns for it), added like
            ``cond_bias``.
        network: the network as a program instead of ``Linear (activation
            Linear)*`` (``activations`` is then not given): instructions
            ``"linear"`` (the next of ``weights`` / ``biases``; the first
            also adds the bias rows above), an activation name,
            ``"layer_norm:<eps>"``, ``"layer_norm_affine:<eps>"`` (the next of
            ``norm_weights`` / ``norm_biases``), ``"save"`` and ``"add"`` (a
            residual block: ``h + block(h)``), and first, optionally,
            ``"input:<parts>"``: the network's input is the concatenation of
            ``x``, ``cond`` (``cond_input``) and ``time`` (``time_input[s]``)
            in the order named, for a network whose first layer is not a
            Linear (a LayerNorm over the whole input). See
            :func:`ddpm_ops.layers.read_network` for reading one off a module.
        norm_weights, norm_biases: the affine LayerNorms' ``(width,)``
            parameters, one each per ``"layer_norm_affine"``.
        time_input: ``(len(rule), n)``: the time features at every step index
            an ``"input:"`` program's ``time`` part reads.
        cond_input: ``(batch, n)`` or ``(n,)``: the condition an ``"input:"``
            program's ``cond`` part reads.

    The rule's ``noise_clip`` (:class:`~ddpm_ops.StepRule`) clamps the noise
    before it is scaled.

    Every argument may be a DTensor (see :mod:`ddpm_ops.sharding`); with a
    DTensor ``x``, plain tensors among the others are taken as replicated,
    the same on every device.

    Returns:
        A new tensor of ``x``'s dtype shaped like ``x`` (or the chain); inputs
        are never mutated.

    Raises:
        RuntimeError: a bad argument (the message names it, what was expected
            and what was given), or a call under grad mode with an input that
            requires grad (the op is inference-only).
        TypeError, ValueError: a count that is not an int; unknown activations.
    """
    if not isinstance(rule, StepRule):
        raise TypeError(f"rule: expected a ddpm_ops.StepRule, got {type(rule).__name__}")
    if x.dim() < 2:
        raise ValueError(f"x: expected (batch, dim) or (batch, *event), got shape {tuple(x.shape)}")
    num_steps = _as_int("num_steps", num_steps)
    batch, event = x.shape[0], x.shape[1:]
    flat = x if x.dim() == 2 else x.reshape(batch, -1)
    if rule.device != x.device:
        rule = rule.to(x.device)
    if cond_bias is not None and cond_bias.dim() == 1:
        cond_bias = cond_bias.expand(batch, -1)
    if noise is not None:
        if noise.shape != (num_steps, *x.shape):
            raise ValueError(f"noise: expected shape {(num_steps, *x.shape)} (num_steps, *x.shape), "
                             f"got {tuple(noise.shape)}")
        noise = noise.reshape(num_steps, batch, -1)
    noise_seed = draw_from = None
    if noise is None and rule.adds_noise and num_steps > 0:
        if _is_dtensor(x):
            noise_seed = _row_seeds(x, generator)
        elif torch.compiler.is_compiling():
            # A traced call carries its seed as a tensor: generators are no graph inputs.
            noise_seed = torch.randint(0, NOISE_SEED_BOUND, (1,), generator=generator, device=x.device)
        else:
            draw_from = generator if generator is not None else _default_generator(x.device)
    rule_clip, rule_post_clip = rule.clamps(x.dtype)
    clip, clip_bounds = _clamp_args("clip", rule_clip, x)
    post_clip, post_clip_bounds = _clamp_args("post_clip", rule_post_clip, x)
    program = {}
    if network is not None:
        if activations != "silu":
            raise ValueError("activations: expected none beside a network program (its instructions name the "
                             f"activations), got {activations!r}")
        if (time_input is not None and time_net is not None) or (cond_input is not None and cond_net is not None):
            raise ValueError("time_input, cond_input: the raw features of a program's \"input:\" instruction, "
                             "expected none beside a time_net / cond_net of the same input")
        if cond_input is not None and cond_input.dim() == 1:
            cond_input = cond_input.expand(batch, -1)
        program = dict(network=list(network), **({"norm_weights": list(norm_weights),
                                                  "norm_biases": list(norm_biases)} if len(norm_weights) else {}))
        if time_input is not None:
            program["time_input"] = time_input
        if cond_input is not None:
            program["cond_input"] = cond_input
    elif len(norm_weights) or time_input is not None or cond_input is not None:
        raise ValueError("norm_weights, norm_biases, time_input, cond_input: parts of a network program, "
                         "expected none without network")
    tensors = dict(x=flat, t_start=_as_timesteps(t_start, x), weights=list(weights), biases=list(biases),
                   step_tables=rule.tables(x.dtype), time_bias=time_bias, cond_bias=cond_bias, noise=noise,
                   noise_seed=noise_seed, clip_bounds=clip_bounds, post_clip_bounds=post_clip_bounds,
                   **bias_net_args("time", time_net), **bias_net_args("cond", cond_net), **program)
    out = call(RULE, **_on_mesh_of(x, tensors), num_steps=num_steps,
               activations=[] if network is not None else resolve_activations(activations, len(weights) - 1),
               clip=clip, post_clip=post_clip, return_chain=return_chain, validate=validate, precision=precision,
               **({} if draw_from is None else {"generator": draw_from}),
               **({} if rule.noise_clip is None else {"noise_clip": rule.noise_clip}),
               **({} if rule.eps_clip is None else {"eps_clip": list(rule.eps_clip)}))
    if x.dim() == 2:
        return out
    return out.reshape(num_steps + 1, *x.shape) if return_chain else out.reshape(x.shape)


def _default_generator(device: torch.device) -> torch.Generator:
    """torch's default generator of ``device`` (what ``torch.randn`` draws from there)."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def _is_dtensor(t) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def _on_mesh_of(x: torch.Tensor, args: dict) -> dict:
    """``args`` (the op's arguments by name) as the op takes them with ``x``:
    unchanged for a plain ``x``; for a DTensor ``x``, every plain tensor (also
    in a list) made a DTensor replicated on ``x``'s mesh, as it is on every
    device (DTensor refuses to mix the two)."""
    if not _is_dtensor(x):
        return args
    from torch.distributed.tensor import DTensor, Replicate

    replicated = [Replicate()] * x.device_mesh.ndim

    def on_mesh(value):
        if isinstance(value, (list, tuple)):
            return [on_mesh(item) for item in value]
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            return DTensor.from_local(value, x.device_mesh, replicated, run_check=False)
        return value

    return {name: on_mesh(value) for name, value in args.items()}


def _row_seeds(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One noise seed per row of the DTensor ``x``, sharded along the batch as
    ``x`` is: drawn on each mesh dimension's first device and scattered, so
    every device holds the seeds of the same whole batch whatever its own
    generator's state."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    seeds = torch.randint(0, NOISE_SEED_BOUND, (x.shape[0],), generator=generator, device=x.device)
    placements = [Shard(0) if p == Shard(0) else Replicate() for p in x.placements]
    return distribute_tensor(seeds, x.device_mesh, placements)


def _clamp_args(name: str, bounds, x: torch.Tensor) -> tuple[list[float] | None, torch.Tensor | None]:
    """A rule's clamp as the op takes it: two floats as ``clip``, or per-column
    bounds as ``clip_bounds``, ``(2, dim)`` for ``x`` flattened to ``(batch, dim)``."""
    if bounds is None:
        return None, None
    if not isinstance(bounds, torch.Tensor):
        return list(bounds), None
    event = x.shape[1:]
    if bounds.shape[1] != event.numel():
        # Bounds of the event's last dimension, repeated over the others.
        try:
            bounds = bounds.view(2, *[1] * (len(event) - 1), -1).expand(2, *event)
        except RuntimeError:
            raise ValueError(f"{name}: expected per-column bounds of {event.numel()} values or of a shape that "
                             f"broadcasts to x's event shape {tuple(event)}, got {bounds.shape[1]} values") from None
    return None, bounds.reshape(2, -1).contiguous()


def _as_timesteps(t_start, x: torch.Tensor) -> torch.Tensor:
    """``t_start`` as the op takes it: a Python int becomes one int64 timestep per row of ``x``."""
    if isinstance(t_start, torch.Tensor):
        return t_start
    return torch.full((x.shape[0],), _as_int("t_start", t_start), dtype=torch.int64, device=x.device)


def _as_int(name: str, value) -> int:
    """``value`` as a Python int (ints, numpy and 0-d integer tensors), else a
    ``TypeError`` that names the argument; a bool is not a count."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")


def mlp_parameters(eps_net: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The weights and biases of an ``nn.Sequential`` of ``Linear`` and ``SiLU``.

    Raises ``ValueError`` unless ``eps_net`` is Linear (SiLU Linear)*, each
    Linear with a bias: the network of the time-column op
    (:func:`~ddpm_ops.layers.mlp_layers` restricted to SiLU). Subclasses that
    keep ``nn.Linear``'s / ``nn.SiLU``'s own ``forward`` (a parametrized
    Linear, e.g. weight norm) count; one that overrides it, or a module with
    forward hooks, is refused: it computes something else.
    """
    weights, biases, _ = mlp_layers(eps_net, activations=("silu",), name="eps_net")
    return weights, biases


def silu_mlp(widths: list[int], *, bias: bool = True) -> nn.Sequential:
    """The network the op computes, as a fresh ``nn.Sequential``: ``Linear``
    layers of ``widths[0] -> widths[1] -> ... -> widths[-1]`` with ``SiLU``
    between them and none after the last (default ``nn.Linear`` init). For the
    op, ``widths[0]`` is ``dim + 1`` and ``widths[-1]`` is ``dim``."""
    if len(widths) < 2:
        raise ValueError(f"widths: expected at least an input and an output width, got {list(widths)}")
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        if i:
            layers.append(nn.SiLU())
        layers.append(nn.Linear(fan_in, fan_out, bias=bias))
    return nn.Sequential(*layers)
