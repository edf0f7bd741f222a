"""Random network-program problems (IDQL's and DPPO's shapes and others) for the tests of the
op's ``network`` argument, with their float64 reference answers."""
from dataclasses import dataclass, field

import torch

import ddpm_ops


def idql_program(blocks: int = 3, eps: float = 1e-6) -> list[str]:
    """IDQL's LN-ResNet: Linear(., H), blocks of h + Linear(4H->H)(Mish(Linear(H->4H)(LN(h)))), Mish, Linear."""
    program = ["linear"]
    for _ in range(blocks):
        program += ["save", f"layer_norm_affine:{eps!r}", "linear", "mish", "linear", "add"]
    return program + ["mish", "linear"]


def dppo_program(activation: str, blocks: int = 1) -> list[str]:
    """DPPO's residual MLP: Linear(., H), pre-activation blocks h + Linear(act(Linear(act(h)))), Linear."""
    return ["linear", *(["save", activation, "linear", activation, "linear", "add"] * blocks), "linear"]


def idql_mlp_program(parts: str = "x,cond,time", hidden: int = 3) -> list[str]:
    """IDQL's MLP with a LayerNorm over the whole input cat[a, s, time features]."""
    return [f"input:{parts}", "layer_norm_affine:1e-06", *(["linear", "mish"] * hidden), "linear"]


def idql_rule(T: int = 5, temperature: float = 1.0) -> "ddpm_ops.StepRule":
    """IDQL's sampler: the v1 update plus sqrt(beta_t) temperature z for t > 0, clipped to [-1, 1] every step
    (its VP beta schedule)."""
    t = torch.arange(1, T + 1, dtype=torch.float64)
    betas = 1 - torch.exp(-0.1 / T - 0.5 * (10.0 - 0.1) * (2 * t - 1) / T ** 2)
    alphas = 1 - betas
    abar = torch.cumprod(alphas, 0)
    s = torch.where(torch.arange(T) > 0, betas.sqrt() * temperature, torch.zeros(T, dtype=torch.float64))
    return ddpm_ops.StepRule(A=torch.ones(T), B=(1 - alphas) / (1 - abar).sqrt(), C=1 / alphas.sqrt(),
                             D=torch.zeros(T), E=torch.zeros(T), S=s, post_clip=1.0)


def dppo_rule(kind: str, *, min_std: float = 0.1, noise_clip: float = 3.0) -> "ddpm_ops.StepRule":
    """DPPO's samplers: 20 DDPM steps (cosine) or 10 DDIM steps of 100 (eta 1), x0 clipped to 1, the
    noise scale floored, the noise clipped."""
    if kind == "ddpm":
        return ddpm_ops.step_rules.ddpm(ddpm_ops.cosine_betas(20), clip=1.0, min_std=min_std, noise_clip=noise_clip)
    abar = torch.cumprod(1 - ddpm_ops.cosine_betas(100), 0)
    return ddpm_ops.step_rules.ddim(abar, torch.arange(0, 100, 10), eta=1.0, clip=1.0,
                                   use_clipped_model_output=True, min_std=min_std, noise_clip=noise_clip)


def random_parameters(network, in_width: int, outs, generator):
    """Weights like nn.Linear's default and LayerNorm parameters around (1, 0), for the program's widths:
    ``outs`` lists every Linear's out_features."""
    weights, biases, norm_weights, norm_biases = [], [], [], []
    width, linear = in_width, 0
    for instruction in network:
        if instruction == "linear":
            out = outs[linear]
            linear += 1
            bound = width ** -0.5
            weights.append((torch.rand(out, width, generator=generator) * 2 - 1) * bound)
            biases.append((torch.rand(out, generator=generator) * 2 - 1) * bound)
            width = out
        elif instruction.startswith("layer_norm_affine"):
            norm_weights.append(1 + 0.3 * torch.randn(width, generator=generator))
            norm_biases.append(0.3 * torch.randn(width, generator=generator))
    return weights, biases, norm_weights, norm_biases


@dataclass
class ProgramProblem:
    """Keyword arguments of ddpm_ops.sample with a network program."""
    x: torch.Tensor
    t_start: torch.Tensor
    rule: "ddpm_ops.StepRule"
    num_steps: int
    kwargs: dict = field(default_factory=dict)

    def call(self, **extra):
        return ddpm_ops.sample(self.x, self.t_start, rule=self.rule, num_steps=self.num_steps, **self.kwargs,
                               **extra)

    def poisoned_call(self, **extra):
        """The call right after freeing a NaN block of the output's size: an output element the kernel
        never writes shows up as NaN."""
        chain = self.kwargs.get("return_chain", False)
        poison = torch.full(((self.num_steps + 1 if chain else 1) * self.x.numel(),), float("nan"))
        del poison
        return self.call(**extra)

    def reference64(self):
        def f64(value):
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return value.detach().double()
            if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
                return [f64(v) for v in value]
            if isinstance(value, ddpm_ops.BiasNet):
                return ddpm_ops.BiasNet(f64(value.input), f64(list(value.weights)), f64(list(value.biases)),
                                        value.activations)
            return value
        kwargs = {k: f64(v) for k, v in self.kwargs.items() if k not in ("generator",)}
        return ddpm_ops.reference_sample(f64(self.x), self.t_start, rule=self.rule, num_steps=self.num_steps,
                                         **kwargs)


def make_program_problem(batch, dim, network, outs, rule, *, num_steps=None, in_width=None, time_rows=None,
                         cond_rows=None, noise=True, generator=None, random_t=False, **options) -> ProgramProblem:
    """A random problem of ``network``: ``in_width`` its input's width (dim without an "input:"),
    ``time_rows`` / ``cond_rows``: widths of raw time / cond features, or of bias rows (then
    given as time_bias / cond_bias of the first Linear's width)."""
    g = generator if generator is not None else torch.Generator().manual_seed(torch.seed())
    num_steps = len(rule) if num_steps is None else num_steps
    weights, biases, norm_weights, norm_biases = random_parameters(network, in_width or dim, outs, g)
    kwargs = dict(weights=weights, biases=biases, network=network, norm_weights=norm_weights,
                  norm_biases=norm_biases, **options)
    if network[0].startswith("input:"):
        if time_rows:
            kwargs["time_input"] = torch.randn(len(rule), time_rows, generator=g)
        if cond_rows:
            kwargs["cond_input"] = torch.randn(batch, cond_rows, generator=g)
    else:
        if time_rows:
            kwargs["time_bias"] = 0.5 * torch.randn(len(rule), outs[0], generator=g)
        if cond_rows:
            kwargs["cond_bias"] = 0.5 * torch.randn(batch, outs[0], generator=g)
    if noise:
        kwargs["noise"] = torch.randn(num_steps, batch, dim, generator=g)
    low = max(num_steps - 1, 0)
    t_start = torch.randint(low, len(rule), (batch,), generator=g) if random_t else torch.full((batch,), len(rule) - 1)
    return ProgramProblem(torch.randn(batch, dim, generator=g), t_start, rule, num_steps, kwargs)
