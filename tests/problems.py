"""Random problems for ddpm::fused_sample and their float64 reference answers."""
import os
import pathlib
import subprocess
import sys
from dataclasses import dataclass

import torch

import ddpm_ops

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@dataclass
class Problem:
    x: torch.Tensor
    t_start: torch.Tensor
    weights: list
    biases: list
    sqrt_recip_alphas: torch.Tensor
    coef_eps: torch.Tensor
    num_steps: int
    total_timesteps: int

    def args(self):
        return (self.x, self.t_start, self.weights, self.biases, self.sqrt_recip_alphas,
                self.coef_eps, self.num_steps, self.total_timesteps)

    def reference64(self) -> torch.Tensor:
        """The reference loop evaluated in float64 on the CPU."""
        def f64(t):
            return t.detach().cpu().double()
        return ddpm_ops.reference(
            f64(self.x), self.t_start.cpu(), [f64(w) for w in self.weights],
            [f64(b) for b in self.biases], f64(self.sqrt_recip_alphas), f64(self.coef_eps),
            self.num_steps, self.total_timesteps)


def make_problem(batch, dim, hidden, num_steps, *, device="cpu", t_dtype=torch.int64,
                 total_timesteps=1000, schedule="linear", generator=None) -> Problem:
    """A random problem: ``hidden`` lists the widths of the hidden layers
    (empty for a single Linear); weights drawn like ``nn.Linear``'s default."""
    g = generator if generator is not None else torch.Generator().manual_seed(torch.seed())
    features = [dim + 1, *hidden, dim]
    weights, biases = [], []
    for fan_in, fan_out in zip(features[:-1], features[1:]):
        bound = fan_in ** -0.5
        weights.append((torch.rand(fan_out, fan_in, generator=g) * 2 - 1) * bound)
        biases.append((torch.rand(fan_out, generator=g) * 2 - 1) * bound)
    betas = (ddpm_ops.linear_betas if schedule == "linear" else ddpm_ops.cosine_betas)(total_timesteps)
    c1, c2 = ddpm_ops.coefficient_tables(betas)
    low = max(num_steps - 1, 0)
    t_start = torch.randint(low, total_timesteps, (batch,), generator=g, dtype=torch.int64)
    x = torch.randn(batch, dim, generator=g)
    return Problem(x.to(device), t_start.to(device=device, dtype=t_dtype),
                   [w.to(device) for w in weights], [b.to(device) for b in biases],
                   c1.to(device), c2.to(device), num_steps, total_timesteps)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; NaN anywhere gives inf."""
    out, ref = out.detach().cpu().double(), ref.detach().cpu().double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


def run_python(script: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter with tests/ importable (for
    settings read once per process, and for code that may crash)."""
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(__file__).parent),
                                              full_env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", script], env=full_env, capture_output=True,
                          text=True, timeout=timeout)


RULES = ("ddpm_epsilon", "ddpm_sample", "ddpm_v", "ddim_eta", "ddim_strided")


def make_rule(kind: str, table_length: int, clip=None, post_clip=None, previous=None, eps_read=None,
              eps_clip=None) -> "ddpm_ops.StepRule":
    """A step rule of ``table_length`` step indices: DDPM posteriors of each
    prediction type, or DDIM (eta 0.5 on every timestep, or eta 0 strided);
    ``previous``: a ``P`` table to add; ``eps_read``: ``(E, Q, R)``, an E table
    and the tables of the eps read back from x0, clamped to ``eps_clip``."""
    if kind.startswith("ddpm"):
        prediction = {"ddpm_epsilon": "epsilon", "ddpm_sample": "sample", "ddpm_v": "v_prediction"}[kind]
        variance = "fixed_large" if kind == "ddpm_v" else "fixed_small"
        rule = ddpm_ops.step_rules.ddpm(ddpm_ops.cosine_betas(table_length), prediction=prediction,
                                        variance=variance)
    else:
        alphas_cumprod = torch.cumprod(1 - ddpm_ops.linear_betas(10 * table_length), 0)
        stride = 1 if kind == "ddim_eta" else 10
        timesteps = torch.arange(table_length) * stride + (0 if stride == 1 else 9)
        rule = ddpm_ops.step_rules.ddim(alphas_cumprod[: timesteps[-1] + 1], timesteps,
                                        eta=0.5 if kind == "ddim_eta" else 0.0)
    tables = [getattr(rule, n) for n in "ABCDES"]
    read = {}
    if eps_read is not None:
        tables[4], read["Q"], read["R"] = eps_read
    return ddpm_ops.StepRule(*tables, previous, clip=clip, post_clip=post_clip, eps_clip=eps_clip, **read)


@dataclass
class RuleProblem:
    """Arguments of ``fused_sample.rule`` (every optional feature given or None)."""
    x: torch.Tensor
    t_start: torch.Tensor
    weights: list
    biases: list
    rule: "ddpm_ops.StepRule"
    num_steps: int
    activations: list
    time_bias: torch.Tensor | None
    cond_bias: torch.Tensor | None
    noise: torch.Tensor | None
    return_chain: bool = False
    noise_seed: torch.Tensor | None = None
    time_net: "ddpm_ops.BiasNet | None" = None
    cond_net: "ddpm_ops.BiasNet | None" = None

    def args(self, dtype=torch.float32):
        """The op's arguments for a sample of ``dtype``: float32, or float64 (x, the tables, the
        clamps' bounds and the noise in float64; the network's tensors float32)."""
        clamps = self.rule.clamps(dtype)
        clip, clip_bounds = _clamp_args(clamps[0])
        post_clip, post_clip_bounds = _clamp_args(clamps[1])
        noise = None if self.noise is None else self.noise.to(dtype)
        args = (self.x.to(dtype), self.t_start, self.weights, self.biases, self.rule.tables(dtype), self.num_steps,
                self.activations, self.time_bias, self.cond_bias, clip, post_clip, noise,
                self.return_chain, False, "fp32", self.noise_seed,
                *_net_args(self.time_net), *_net_args(self.cond_net), clip_bounds, post_clip_bounds)
        if self.rule.eps_clip is None:
            return args
        # generator, network, norm_weights, norm_biases and noise_clip at their defaults: then eps_clip.
        return (*args, None, None, None, None, None, list(self.rule.eps_clip))

    def reference64(self) -> torch.Tensor:
        def f64(t):
            return None if t is None else t.detach().cpu().double()
        return ddpm_ops.reference_sample(
            f64(self.x), self.t_start.cpu(), [f64(w) for w in self.weights],
            [f64(b) for b in self.biases], self.rule.to("cpu"), self.num_steps,
            activations=self.activations, time_bias=f64(self.time_bias),
            cond_bias=f64(self.cond_bias), noise=self.noise64(), return_chain=self.return_chain,
            time_net=_net64(self.time_net), cond_net=_net64(self.cond_net))

    def noise64(self) -> torch.Tensor | None:
        """The noise the op adds, in float64: the given tensor or the seeded one."""
        if self.noise_seed is not None:
            return ddpm_ops.seeded_noise(self.noise_seed.cpu(), self.num_steps, *self.x.shape)
        return None if self.noise is None else self.noise.detach().cpu().double()


def _clamp_args(bounds) -> tuple:
    """A rule's clamp as the op's (floats, per-column bounds) pair of arguments."""
    if bounds is None:
        return None, None
    return (None, bounds) if isinstance(bounds, torch.Tensor) else (list(bounds), None)


def _net_args(net) -> tuple:
    return (None,) * 4 if net is None else net.op_args()


def _net64(net):
    if net is None:
        return None
    def f64(t):
        return t.detach().cpu().double()
    return ddpm_ops.BiasNet(f64(net.input), [f64(w) for w in net.weights], [f64(b) for b in net.biases],
                            net.activations)


def random_bias_net(rows, h0, widths, activations, generator, device="cpu") -> "ddpm_ops.BiasNet":
    """A ``BiasNet`` of ``rows`` input rows: Linear layers ``widths[0] -> ... -> widths[-1] -> h0``
    (the last without bias), drawn like ``nn.Linear``'s default, its input of scale 1."""
    g = generator
    features = [*widths, h0]
    weights, biases = [], []
    for fan_in, fan_out in zip(features[:-1], features[1:]):
        bound = fan_in ** -0.5
        weights.append(((torch.rand(fan_out, fan_in, generator=g) * 2 - 1) * bound).to(device))
        biases.append(((torch.rand(fan_out, generator=g) * 2 - 1) * bound).to(device))
    return ddpm_ops.BiasNet(torch.randn(rows, widths[0], generator=g).to(device), weights, biases[:-1],
                            activations)


def make_rule_problem(batch, dim, hidden, num_steps, *, features=(), activation="mish",
                      rule="ddpm_epsilon", table_length=50, device="cpu", t_dtype=torch.int64,
                      generator=None) -> RuleProblem:
    """A random problem of the step-rule overload. ``features`` names the
    optional parts to give: "time", "cond", "clip", "post_clip", "noise", "chain",
    "seeded" (a noise_seed instead of "noise"), "row_seeds" (a noise_seed per
    row), "time_net" (a time MLP of
    two layers and the time columns, Mish between), "cond_net" (an
    observation's columns alone), "clip_bounds" and "post_clip_bounds"
    (the clamps with random per-column bounds instead of floats), "previous"
    (a random P table: the previous step's x0 term), "eps_read" (random E, Q
    and R tables: the E term reads the eps read back from x0, Q x - R x0),
    "eps_clip" (with "eps_read": that eps clamped to (-0.3, 0.4));
    ``activation`` one name for every hidden layer or "mixed" (a different one
    per layer)."""
    g = generator if generator is not None else torch.Generator().manual_seed(torch.seed())
    widths = [dim, *hidden, dim]
    weights, biases = [], []
    for fan_in, fan_out in zip(widths[:-1], widths[1:]):
        bound = fan_in ** -0.5
        weights.append((torch.rand(fan_out, fan_in, generator=g) * 2 - 1) * bound)
        biases.append((torch.rand(fan_out, generator=g) * 2 - 1) * bound)
    names = ["silu", "mish", "relu", "gelu", "gelu_tanh", "tanh", "identity"]
    activations = ([names[(i + int(torch.randint(7, (), generator=g))) % 7] for i in range(len(hidden))]
                   if activation == "mixed" else [activation] * len(hidden))
    clip = (-1.0, 1.0) if "clip" in features else None
    post_clip = (-1.5, 1.2) if "post_clip" in features else None
    if "clip_bounds" in features:
        clip = (-1.0 - 0.5 * torch.rand(dim, generator=g), 0.7 + 0.5 * torch.rand(dim, generator=g))
    if "post_clip_bounds" in features:
        post_clip = (-1.5 + 0.5 * torch.rand(dim, generator=g), 1.0 + 0.4 * torch.rand(dim, generator=g))
    previous = 0.4 * torch.rand(table_length, generator=g) - 0.2 if "previous" in features else None
    eps_read = ((0.2 + 0.3 * torch.rand(table_length, generator=g), 0.5 + torch.rand(table_length, generator=g),
                 0.2 + 0.8 * torch.rand(table_length, generator=g)) if "eps_read" in features else None)
    step_rule = make_rule(rule, table_length, clip=clip, post_clip=post_clip, previous=previous, eps_read=eps_read,
                          eps_clip=(-0.3, 0.4) if "eps_clip" in features else None)
    h0 = widths[1]
    t_start = torch.randint(max(num_steps - 1, 0), table_length, (batch,), generator=g)
    x = torch.randn(batch, dim, generator=g) * 1.5
    problem = RuleProblem(
        x=x, t_start=t_start.to(t_dtype), weights=weights, biases=biases, rule=step_rule,
        num_steps=num_steps, activations=activations,
        time_bias=torch.randn(table_length, h0, generator=g) * 0.5 if "time" in features else None,
        cond_bias=torch.randn(batch, h0, generator=g) * 0.5 if "cond" in features else None,
        noise=torch.randn(num_steps, batch, dim, generator=g) if "noise" in features else None,
        return_chain="chain" in features,
        noise_seed=(torch.randint(-2 ** 63, 2 ** 63 - 1, (1,) if "seeded" in features else (batch,),
                                  generator=g)
                    if "seeded" in features or "row_seeds" in features else None),
        time_net=(random_bias_net(table_length, h0, [6, 10, 5], ["mish", "identity"], g, device)
                  if "time_net" in features else None),
        cond_net=random_bias_net(batch, h0, [3], [], g, device) if "cond_net" in features else None)
    for name in ("x", "t_start", "time_bias", "cond_bias", "noise", "noise_seed"):
        value = getattr(problem, name)
        if value is not None:
            setattr(problem, name, value.to(device))
    problem.weights = [w.to(device) for w in weights]
    problem.biases = [b.to(device) for b in biases]
    problem.rule = step_rule.to(device)
    return problem
