"""nn.Modules that run a whole sampler of a user's own MLP as one fused op."""
from collections.abc import Callable, Sequence
from operator import getitem, is_

import torch
from torch import nn

from .calls import RULE, arg_slots
from .conditioning import BiasNet, cond_bias, device_of, time_bias_from_module
from .layers import ACTIVATIONS, Program, bias_or_zeros, plain_activations, read_network, refuse_hooks
from .ops import PRECISIONS, _as_int, _clamp_args, _default_generator, mlp_parameters, sample
from .step_rules import StepRule


class _TimeNet:
    """A time embedding the op evaluates as its ``time_net``: the feature map's output at the
    rule's timesteps, then ``program``'s Linears (each followed by its activation in
    ``activations``), then the first Linear's time columns. ``per_call``: whether the feature
    map holds tensors (IDQL's learned Fourier features, a parameter; random features in a
    buffer, which a checkpoint loads after the sampler is built): then it is evaluated at
    every call, else its features are computed once. ``modules``: what a call checks for
    hooks."""

    def __init__(self, features, program: Program | None = None, activations=(), modules=()):
        self.features, self.per_call = features, not _stateless(features)
        self.program, self.activations = program, tuple(activations)
        self.modules = (*modules, *(features.modules() if self.per_call else ()))

    def parameters(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The Linears' ``(weights, biases)`` as they are now (zeros for a missing bias)."""
        if self.program is None:
            return [], []
        return self.program.parameters()[:2]

    def refs(self) -> tuple:
        """Where the Linears' weights and biases are, each weight then its bias."""
        return () if self.program is None else self.program.linear_refs()

    def features_at(self, timesteps: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The feature map's float32 output at ``timesteps``, computed where the map's own
        tensors are, else on ``device`` (the network's): a policy on the GPU whose sampler
        is given ``torch.arange(T)`` on the CPU."""
        with torch.no_grad():
            return self.features(timesteps.to(device_of(self.features, device), torch.float32)).to(torch.float32)


def _time_net(time_embedding) -> _TimeNet | None:
    """``time_embedding`` read as a :class:`_TimeNet`: a parameter-free module (features alone,
    such as a sinusoidal map or the t/T column), or an ``nn.Sequential`` of a feature map with
    no Linear followed by an MLP ``Linear (activation? Linear)* activation?`` however written
    (as modules or functions, in modules of their own such as IDQL's MLP: :func:`read_network`,
    on the width of its first Linear's input); None for any other form."""
    if _parameter_free(time_embedding):
        return _TimeNet(time_embedding)  # features alone
    if not isinstance(time_embedding, nn.Sequential):
        return None
    layers = list(time_embedding.children())
    first = next((i for i, m in enumerate(layers) if any(isinstance(n, nn.Linear) for n in m.modules())), None)
    if not first:  # no Linear, or no feature map before the first one
        return None
    mlp = nn.Sequential(*layers[first:])
    width = next(m for m in mlp.modules() if isinstance(m, nn.Linear)).in_features
    try:
        program = read_network(mlp, width, name="time_embedding")
    except ValueError:
        return None
    instructions = program.instructions
    last = instructions[-1] if instructions[-1] in ACTIVATIONS else "identity"  # before the time columns
    activations = plain_activations(instructions if last == "identity" else instructions[:-1])
    if activations is None:  # a LayerNorm, a residual block, two activations in a row
        return None
    return _TimeNet(nn.Sequential(*layers[:first]), program, (*activations, last), mlp.modules())


def _read_mlp(mlp: nn.Module, layout: Sequence[tuple[str, int]]) -> Program:
    """``mlp`` read as a network program on the layout's columns (:func:`read_network`, whose
    ValueError names the node it cannot read and why)."""
    width = sum(n for _, n in layout)
    in_features = [m.in_features for m in mlp.modules() if isinstance(m, nn.Linear)]
    # Checked before tracing, which would fail on any such network (its first layer a Linear,
    # or a LayerNorm or activation before one), with fewer words.
    if in_features and width not in in_features:
        raise ValueError(f"layout: expected columns summing to the first Linear's in_features {in_features[0]}, "
                         f"got {list(layout)}")
    return read_network(mlp, width, name="mlp")


class DiffusionSampler(nn.Module):
    """A full sampling run of a user's MLP under a step rule, as one fused op.

    The network is ``mlp(cat(inputs, dim=1))`` with ``inputs`` the samples ``x``
    and, optionally, a time embedding and a conditioning vector, in the order
    ``layout`` gives. The first Linear's time and conditioning columns go to
    the op at every call (so trained parameters are always the current ones):
    a time embedding written as a feature map followed by an MLP
    (``nn.Sequential(SinusoidalPosEmb(16), nn.Linear(16, 32), nn.Mish(),
    nn.Linear(32, 16))``) becomes the op's ``time_net``, its features of the
    rule's timesteps computed once, here, where the feature map holds no
    tensors, else (IDQL's learned Fourier features, random features in a
    buffer) at every call, before the op; and a ``(batch, n)`` condition the
    op's ``cond_net``: the op evaluates both inside its one launch. An MLP in
    modules of its own (IDQL's ``MLP``) is read once, here, as the network is:
    its parameters are read at every call, a layer replaced later is not seen.
    Any other time embedding is evaluated at every call into ``time_bias``.

    Args:
        mlp: any network of Linears, activations, LayerNorms, Dropout and
            residual blocks ``h + block(h)``, however its forward writes them
            (an ``nn.Sequential``, layers looped over in a ``ModuleList``,
            activations as modules, functions or formulas such as IDQL's Mish
            ``x * tanh(softplus(x))``, ``F.layer_norm``): traced once here with
            ``torch.export`` and read with the torch.compile rewrite's reader
            (:func:`ddpm_ops.layers.read_network`; a node it cannot read is
            named in the ValueError, with its module and why), read again
            when ``mlp`` or one of its children is replaced; its parameters
            are read at every call. Its output is what the rule expects
            (epsilon, x0 or v). A network whose first layer is not a Linear
            gets the time embedding's output and the condition themselves
            (the op's ``"input:"`` instruction).
        rule: the :class:`~ddpm_ops.StepRule` of the sampler (DDPM, DDIM,
            flow-matching Euler, DPM-Solver++: see :mod:`ddpm_ops.step_rules`).
        timesteps: ``(len(rule),)``: the training timestep of each step index,
            the input of ``time_embedding`` (``torch.arange(T)`` for
            :func:`ddpm_ops.step_rules.ddpm`; float timesteps for flow
            matching, as :func:`~ddpm_ops.step_rules.from_diffusers` gives them),
            on any device: the features are computed where the time
            embedding's tensors are, else where the network's are.
        layout: ``(name, columns)`` pairs in the order the first Linear's input
            concatenates them; names ``"x"`` (required), ``"time"`` and
            ``"cond"``.
        time_embedding: maps ``(S,)`` timesteps to ``(S, n)`` features; needed
            when the layout has ``"time"`` (``lambda t: t[:, None]`` for a raw
            timestep column).
        precision: passed to :func:`ddpm_ops.sample`.

    Example (a diffusers scheduler and a Diffusion-QL-style network)::

        scheduler.set_timesteps(10)
        rule, timesteps = ddpm_ops.step_rules.from_diffusers(scheduler)
        sampler = ddpm_ops.DiffusionSampler(
            mid, rule, timesteps, layout=(("x", 6), ("time", 16), ("cond", 17)),
            time_embedding=time_mlp)
        with torch.no_grad():
            actions = sampler(torch.randn(50, 6), cond=state)
    """

    def __init__(self, mlp: nn.Module, rule: StepRule, timesteps: torch.Tensor | None = None, *,
                 layout: Sequence[tuple[str, int]], time_embedding: Callable | None = None,
                 precision: str = "fp32"):
        super().__init__()
        names = [name for name, _ in layout]
        if names.count("x") != 1 or any(n not in ("x", "time", "cond") for n in names) or \
                len(set(names)) != len(names):
            raise ValueError(f"layout: expected 'x' once and optionally 'time' and 'cond', got {names}")
        if ("time" in names) != (time_embedding is not None):
            raise ValueError("time_embedding: expected one exactly when layout has 'time', got "
                             f"{'none' if time_embedding is None else 'one'} for layout {names}")
        if "time" in names and (timesteps is None or len(timesteps) != len(rule)):
            raise ValueError(f"timesteps: expected one per step index ({len(rule)}), got "
                             f"{None if timesteps is None else len(timesteps)}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
        self.mlp = mlp
        self.layout = tuple(layout)
        self._network_key = None
        self._network()  # read once: fail at construction, not at the first call
        self.rule = rule
        self.time_embedding = time_embedding
        self.register_buffer("timesteps", None if timesteps is None else torch.as_tensor(timesteps))
        self.precision = precision
        self.register_buffer("time_features", None)
        self._read_time_net()
        self._t_start_cache = (None, None)
        self._direct = None          # what an eager call reads, by structure (see _direct_plan)

    def _network(self) -> Program:
        """The network as read (:func:`_read_mlp`): read again where ``mlp`` or one of its
        layers (children) has been replaced since, except while traced (a trace reads the
        program read in eager)."""
        if torch.compiler.is_compiling():
            return self._program
        mlp = self._modules["mlp"]
        key = (mlp, tuple(mlp._modules.values()))
        if key != self._network_key:
            self._program = _read_mlp(mlp, self.layout)
            # The modules' hook dictionaries (registering a hook adds to one): a call checks
            # them without walking the modules.
            self._program_hooks = tuple(d for m in mlp.modules() for d in (m._forward_hooks, m._forward_pre_hooks))
            self._network_key = key
        return self._program

    def _read_time_net(self) -> None:
        """Read the time embedding as the op's time net (``_time_net``, not a module attribute,
        so that the embedding's modules are not registered twice) and compute its features
        where they are fixed. ``_time_net`` None: the embedding is evaluated at every call into
        ``time_bias``, or (a network whose first layer is not a Linear) the op reads its output
        itself."""
        first_is_linear = self._program.first_is_linear
        has_time = any(name == "time" for name, _ in self.layout)
        self._time_net = _time_net(self.time_embedding) if has_time and first_is_linear else None
        # Evaluated here also where it is evaluated again at every call:
        # a feature map that cannot take the timesteps fails here, not at a call.
        features = None if self._time_net is None else self._evaluate_time_features()
        self._buffers["time_features"] = None if self._time_net is None or self._time_net.per_call else features

    def _time_features(self) -> torch.Tensor:
        """The time net's input: the features computed at construction, or those of a feature map
        that holds tensors (learned Fourier features), evaluated now on the current ones."""
        if not self._time_net.per_call:
            return self._buffers["time_features"]
        return self._evaluate_time_features()

    def _evaluate_time_features(self) -> torch.Tensor:
        return self._time_net.features_at(self.timesteps, next(self.mlp.parameters()).device)

    def _rule_on(self, device: torch.device) -> StepRule:
        """The rule on ``device``, moved once (a move builds and checks the
        tables: kernels that a call would otherwise pay every time)."""
        if self.rule.device == device:
            return self.rule
        if torch.compiler.is_compiling():  # no state written while traced
            return self.rule.to(device)
        self.rule = self.rule.to(device)
        return self.rule

    def _t_start(self, x: torch.Tensor) -> torch.Tensor:
        """The last step index for every row, as a tensor kept for the batch
        size and device (a new one would cost a kernel per call)."""
        if torch.compiler.is_compiling():  # a traced tensor must not outlive the trace
            return torch.full((x.shape[0],), len(self.rule) - 1, dtype=torch.int64, device=x.device)
        key = (x.shape[0], x.device, len(self.rule))
        if self._t_start_cache[0] != key:
            self._t_start_cache = (key, torch.full((x.shape[0],), len(self.rule) - 1, dtype=torch.int64,
                                                   device=x.device))
        return self._t_start_cache[1]

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None, *,
                num_steps: int | None = None, noise: torch.Tensor | None = None,
                generator: torch.Generator | None = None, return_chain: bool = False,
                t_start: torch.Tensor | int | None = None) -> torch.Tensor:
        """Sample from ``x`` at the rule's last step index (or each row's
        ``t_start``), ``num_steps`` steps (all of them by default); ``cond``:
        ``(batch, n)`` or ``(n,)``, float32 like the network. ``noise``,
        ``generator`` and ``return_chain`` as :func:`ddpm_ops.sample`. A
        float64 ``x`` (TabDDPM's sample) is sampled with the step in float64
        (the rule's tables as given) and the network in float32, on ``x``
        rounded to float32, as ``mlp(cat([x.float(), ...])).double()``.

        Every call reads the modules' current parameters. An eager call of
        the common form (a ``(batch, dim)`` tensor or an action chunk ``(batch, horizon,
        action_dim)`` the network reads flattened, a ``(batch, n)`` or no
        condition, a time embedding the op evaluates) goes straight to the op
        with an argument list kept from the last call; anything else, and
        every call under torch.compile or export, goes through
        :func:`ddpm_ops.sample`."""
        if type(x) is torch.Tensor and x.dim() >= 2 and (cond is None or cond.dim() == 2) \
                and not torch.compiler.is_compiling():
            direct = self._direct_call(x, cond, num_steps, noise, generator, return_chain, t_start)
            if direct is not None:
                return direct
        return self._sample(x, cond, num_steps, noise, generator, return_chain, t_start)

    # ------------------------------------------------------------------ the eager call, direct

    def _direct_plan(self, structure: tuple):
        """What a direct call needs that depends on the modules' ``structure`` only (where each
        weight and bias is, the activations or the program, the op's argument slots), made
        again when a layer of the network or the time MLP is replaced; or ``False`` when the
        form is not the direct call's (a time embedding evaluated in Python)."""
        program = self._network()
        # The time embedding, or a layer of it, may have been replaced: it is read again.
        self._read_time_net()
        time_net = self._time_net
        plan = False
        # A network whose input is not split into bias rows (an "input:" instruction) goes
        # through sample().
        if program.first_is_linear and (self.time_embedding is None or time_net is not None):
            modules = list(self.mlp.modules())  # hooks anywhere in the network
            time_refs = ()
            template, slot = arg_slots(RULE)
            activations = program.activations
            template[slot["activations"]] = [] if activations is None else list(activations)
            if activations is None:  # LayerNorms, residual blocks: the op's program
                template[slot["network"]] = list(program.instructions)
            template[slot["precision"]] = self.precision
            if time_net is not None:
                modules += time_net.modules
                time_refs = time_net.refs()
                template[slot["time_activations"]] = list(time_net.activations)
            plan = _DirectPlan(modules, program.linear_refs(), time_refs, program.norm_refs(), template, slot,
                               [n for _, n in self.layout], [name for name, _ in self.layout], time_net)
        self._direct = (structure, plan)
        return plan

    def _direct_call(self, x, cond, num_steps, noise, generator, return_chain, t_start):
        """The op called with the argument list prepared at an earlier call, this call's tensors
        in their slots; ``None`` where the call is not of the direct form. At batch 1 the op
        takes some 65 us on a CPU, and the Python run before it slows the op itself down too
        (by about its own time, measured): the common call reads the parameters and checks
        that nothing the list was made from has changed, no more. Dictionaries are read
        directly (``nn.Module.__getattr__`` is a Python call per read)."""
        # The modules read by identity (the network, the time embedding and their layers), here
        # rather than in a call of its own: on the common call every step counts.
        modules = self._modules
        mlp, embedding = modules["mlp"], modules.get("time_embedding", self.__dict__.get("time_embedding"))
        structure = (mlp, tuple(mlp._modules.values()), embedding,
                     tuple(embedding._modules.values()) if isinstance(embedding, nn.Module) else ())
        direct = self._direct
        plan = direct[1] if direct is not None and direct[0] == structure else self._direct_plan(structure)
        if not plan or plan.has_cond != (cond is not None) or any(plan.hooks):
            return None  # the general path builds the call, names the mismatch, or refuses hooks
        if plan.owners is None:  # a parametrized tensor: computed when read
            params = tuple(None if ref is None else ref.read() for ref in plan.refs)
        else:
            try:
                params = tuple(map(getitem, plan.owners, plan.keys))
            except KeyError:  # a Linear parametrized since (its class swapped in place)
                self._direct = None
                return None
        shape = x.shape
        if len(shape) > 2:  # an action chunk: the op runs the flattened rows
            x = x.reshape(shape[0], -1)
        device = x.device
        ready = plan.ready
        if ready is None or ready.rule is not self.rule or ready.device != device or ready.dtype != x.dtype \
                or ready.features is not self._buffers["time_features"] \
                or ready.pointer != params[0].data_ptr() or not all(map(is_, ready.params, params)):
            ready = plan.ready = self._prepare(plan, params, x)
        steps = ready.steps if num_steps is None else num_steps
        i_x, i_t_start, i_steps, i_chain, i_cond, i_noise, i_generator = plan.per_call
        args = list(ready.args)
        if plan.features_per_call:
            args[plan.slot["time_input"]] = self._time_features()
        args[i_x] = x
        args[i_steps] = steps
        args[i_chain] = return_chain
        args[i_cond] = cond
        if t_start is None:
            kept = ready.t_start  # (batch, t_start): one read, so that threads see a pair
            if kept[0] != x.shape[0]:
                kept = ready.t_start = (x.shape[0], self._t_start(x))
            t_start = kept[1]
        elif not isinstance(t_start, torch.Tensor):
            t_start = torch.full((x.shape[0],), t_start, dtype=torch.int64, device=device)
        args[i_t_start] = t_start
        if noise is not None:
            if noise.shape != (steps, *shape):
                raise ValueError(f"noise: expected shape {(steps, *shape)} (num_steps, *x.shape), "
                                 f"got {tuple(noise.shape)}")
            args[i_noise] = noise if len(shape) == 2 else noise.reshape(steps, *x.shape)
            args[i_generator] = None
        elif not (ready.adds_noise and steps > 0):
            args[i_generator] = None
        elif generator is not None:
            args[i_generator] = generator  # else the list's: the device's default generator
        out = RULE(*args)
        return out if len(shape) == 2 else out.view(*out.shape[:-2], *shape)

    def _prepare(self, plan, params, x) -> "_Prepared":
        """The op's argument list for the parameters ``params`` (the Linears' weights and biases
        in turn, then the time MLP's, then the LayerNorms'; a missing bias None) and ``x``'s
        device, every per-call slot at its default."""
        n = 2 * plan.linears
        m = n + 2 * plan.time_linears

        def biases_of(start, stop=None):  # zeros, made here once, for a layer without bias
            return [bias_or_zeros(w, b) for w, b in zip(params[start:stop:2], params[start + 1:stop:2])]

        weights, biases = list(params[0:n:2]), biases_of(0, n)
        # Views of the first weight's column blocks: they follow in-place updates; a new
        # parameter, or new storage under it (``.data =``), makes new ones.
        columns = dict(zip(plan.names, weights[0].detach().split(plan.widths, dim=1)))
        weights[0] = columns["x"]
        device = x.device
        rule = self._rule_on(device)
        slot = plan.slot
        args = list(plan.template)
        args[slot["weights"]] = weights
        args[slot["biases"]] = biases
        clip, post_clip = rule.clamps(x.dtype)
        args[slot["clip"]], args[slot["clip_bounds"]] = _clamp_args("clip", clip, x)
        args[slot["post_clip"]], args[slot["post_clip_bounds"]] = _clamp_args("post_clip", post_clip, x)
        args[slot["step_tables"]] = rule.tables(x.dtype)
        args[slot["noise_clip"]] = rule.noise_clip
        args[slot["eps_clip"]] = None if rule.eps_clip is None else list(rule.eps_clip)
        features = self._buffers["time_features"]
        if plan.time_net:
            args[slot["time_input"]] = features
            args[slot["time_weights"]] = [*params[n:m:2], columns["time"]]
            args[slot["time_biases"]] = biases_of(n, m)
        if plan.norms:
            args[slot["norm_weights"]] = list(params[m::2])
            args[slot["norm_biases"]] = biases_of(m)
        if plan.has_cond:
            args[slot["cond_weights"]] = [columns["cond"]]
            args[slot["cond_activations"]] = []
        if rule.adds_noise:
            args[slot["generator"]] = _default_generator(device)
        return _Prepared(params, params[0].data_ptr(), rule, device, x.dtype, features, args, len(rule),
                         rule.adds_noise)

    # ------------------------------------------------------------------ every other call

    def _sample(self, x, cond, num_steps, noise, generator, return_chain, t_start):
        """The call through :func:`ddpm_ops.sample`, everything read from the modules."""
        names = [name for name, _ in self.layout]
        if ("cond" in names) != (cond is not None):
            raise ValueError(f"cond: expected {'a tensor' if 'cond' in names else 'None'} for "
                             f"layout {names}, got {'None' if cond is None else 'a tensor'}")
        network = self._network()
        if any(self._program_hooks):  # registered since the network was read
            refuse_hooks(self.mlp, "mlp")
        weights, biases, norm_weights, norm_biases = network.parameters()
        activations, program = network.activations, {}
        if activations is None:  # LayerNorms, residual blocks: the op's program
            activations = "silu"  # (sample()'s default: none given beside a program)
            program = dict(network=list(network.instructions), norm_weights=norm_weights, norm_biases=norm_biases)
        if not network.first_is_linear:
            return self._sample_whole_input(x, cond, weights, biases, program, num_steps=num_steps,
                                            noise=noise, generator=generator, return_chain=return_chain,
                                            t_start=t_start)
        columns = dict(zip(names, weights[0].detach().split([n for _, n in self.layout], dim=1)))
        time = time_net = None
        if self._time_net is not None:
            time_weights, time_biases = self._time_net.parameters()
            time_net = BiasNet(self._time_features(), [*time_weights, columns["time"]], time_biases,
                               list(self._time_net.activations))
        elif self.time_embedding is not None:
            time = time_bias_from_module(self.time_embedding, columns["time"], self.timesteps)
        conditioning = cond_net = None
        if cond is not None and cond.dim() >= 2:
            cond_net = BiasNet(cond.reshape(-1, columns["cond"].shape[1]), [columns["cond"]])
        elif cond is not None:
            conditioning = cond_bias(columns["cond"], cond.reshape(-1, columns["cond"].shape[1]))[0]
        steps = len(self.rule) if num_steps is None else num_steps
        t_start = self._t_start(x) if t_start is None else t_start
        return sample(x, t_start, [columns["x"]] + weights[1:], biases, self._rule_on(x.device), steps,
                      activations=activations, time_bias=time, cond_bias=conditioning, noise=noise,
                      generator=generator, return_chain=return_chain, precision=self.precision,
                      time_net=time_net, cond_net=cond_net, **program)

    def _sample_whole_input(self, x, cond, weights, biases, program, **options) -> torch.Tensor:
        """A network whose first layer is not a Linear: the op concatenates x, the condition and
        the time embedding's output (at every step index, evaluated here) in the layout's order."""
        names = [name for name, _ in self.layout]
        time_input = None
        if self.time_embedding is not None:
            with torch.no_grad():
                time_input = self.time_embedding(self.timesteps.to(device=x.device, dtype=torch.float32))
            time_input = time_input.to(torch.float32)
        program["network"] = [f"input:{','.join(names)}", *program["network"]]
        num_steps, t_start = options.pop("num_steps"), options.pop("t_start")
        steps = len(self.rule) if num_steps is None else num_steps
        t_start = self._t_start(x) if t_start is None else t_start
        return sample(x, t_start, weights, biases, self._rule_on(x.device), steps,
                      precision=self.precision, time_input=time_input,
                      cond_input=None if cond is None else cond.reshape(-1, dict(self.layout)["cond"]),
                      **options, **program)


class FusedDDPMSampler(DiffusionSampler):
    """The time-column sampler, kept for code written against earlier versions: a
    :class:`DiffusionSampler` whose network reads ``cat([x, t / total_timesteps])`` and whose
    rule is :meth:`StepRule.from_coefficients` (``x = sqrt_recip_alphas[t] * (x - coef_eps[t]
    * eps)``), ``num_steps`` steps from each row's ``t_start``: ``forward(x, t_start)`` equals
    :func:`ddpm_ops.reference` with these arguments. New code builds the ``DiffusionSampler``
    itself (any rule, activation and time embedding).

    Raises ``ValueError`` at construction for a network other than ``Linear (SiLU Linear)*``
    (:func:`ddpm_ops.mlp_parameters`), an unknown precision, or counts that cannot describe a
    run: ``num_steps`` beyond the tables' length or beyond ``total_timesteps`` (the usual
    sign of the two counts given in the other order).
    """

    def __init__(self, eps_net: nn.Module, sqrt_recip_alphas: torch.Tensor, coef_eps: torch.Tensor,
                 num_steps: int, total_timesteps: int, *, precision: str = "fp32"):
        weights, _ = mlp_parameters(eps_net)  # fail at construction, not at the first call
        num_steps = _as_int("num_steps", num_steps)
        total_timesteps = _as_int("total_timesteps", total_timesteps)
        if num_steps > total_timesteps:
            raise ValueError(
                f"num_steps: expected at most total_timesteps = {total_timesteps}, got {num_steps}; "
                "the arguments are (eps_net, sqrt_recip_alphas, coef_eps, num_steps, total_timesteps): "
                "are the two counts swapped?")
        if num_steps > sqrt_recip_alphas.numel():
            raise ValueError(f"num_steps: expected at most the tables' length "
                             f"{sqrt_recip_alphas.numel()}, got {num_steps}")
        rule = StepRule.from_coefficients(sqrt_recip_alphas, coef_eps)
        dim = weights[0].shape[1] - 1
        super().__init__(eps_net, rule, torch.arange(len(rule)), layout=(("x", dim), ("time", 1)),
                         time_embedding=_TimeColumn(total_timesteps), precision=precision)
        self.num_steps = num_steps
        self.total_timesteps = total_timesteps

    @property
    def eps_net(self) -> nn.Module:
        """The noise network (the sampler's ``mlp``), under its earlier name."""
        return self.mlp

    def forward(self, x: torch.Tensor, t_start: torch.Tensor | int) -> torch.Tensor:
        return super().forward(x, num_steps=self.num_steps, t_start=t_start)


class _TimeColumn(nn.Module):
    """``t / total_timesteps`` as one column: the time-column network's time input."""

    def __init__(self, total_timesteps: int):
        super().__init__()
        self.total_timesteps = total_timesteps

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return (t.to(torch.float32) / self.total_timesteps)[:, None]


#: Where the direct call reads a missing bias (as None, for which zeros are made once).
_ABSENT = {"": None}


class _DirectPlan:
    """The structure a direct call reads its parameters through (see
    :meth:`DiffusionSampler._direct_plan`), and the argument list it prepared last.
    ``linear_refs``, ``time_refs``, ``norm_refs``: where the network's Linears', the time
    MLP's and the network's LayerNorms' weights and biases are (:class:`TensorRef`, each
    weight then its bias, None for a missing bias)."""

    def __init__(self, modules, linear_refs, time_refs, norm_refs, template, slot, widths, names, time_net):
        self.modules = modules
        self.linears, self.time_linears, self.norms = len(linear_refs) // 2, len(time_refs) // 2, len(norm_refs) // 2
        self.template, self.slot, self.widths, self.names = template, slot, widths, names
        self.has_cond, self.time_net = "cond" in names, time_net is not None
        self.features_per_call = time_net is not None and time_net.per_call
        # Registering a hook adds to these dictionaries: one ``any`` over them sees it.
        self.hooks = tuple(d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks))
        # The dictionaries that hold the tensors, read directly at a call (no
        # nn.Module.__getattr__); None where one is computed when read (torch.nn.utils.parametrize).
        self.refs = (*linear_refs, *time_refs, *norm_refs)
        holders = tuple(_ABSENT if ref is None else ref.holder() for ref in self.refs)
        self.owners = None if any(h is None for h in holders) else holders
        self.keys = tuple("" if ref is None else ref.name for ref in self.refs)
        self.per_call = tuple(slot[name] for name in ("x", "t_start", "num_steps", "return_chain", "cond_input",
                                                      "noise", "generator"))
        self.ready = None


class _Prepared:
    """A direct call's argument list and what it was made from (see
    :meth:`DiffusionSampler._prepare`)."""

    __slots__ = ("params", "pointer", "rule", "device", "dtype", "features", "args", "steps", "adds_noise", "t_start")

    def __init__(self, params, pointer, rule, device, dtype, features, args, steps, adds_noise):
        self.params, self.pointer, self.rule, self.device, self.features = params, pointer, rule, device, features
        self.dtype = dtype
        self.args, self.steps, self.adds_noise = args, steps, adds_noise
        self.t_start = (None, None)


def _parameter_free(module) -> bool:
    """An ``nn.Module`` without parameters."""
    return isinstance(module, nn.Module) and next(module.parameters(), None) is None


def _stateless(module) -> bool:
    """An ``nn.Module`` without parameters or buffers: its output depends on its input alone."""
    return _parameter_free(module) and next(module.buffers(), None) is None

