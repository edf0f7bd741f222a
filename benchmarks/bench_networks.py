"""Benchmark: diffusion and flow policies with LayerNorm and residual blocks (IDQL, DPPO,
ReinFlow, FQL) as one fused call.

Shapes (the networks and loops as the projects write them):
  idql      IDQL's LN-ResNet reverse encoder: cat[action 6, state 17, time
            features 128] into Linear(., 256), 3 blocks h + Linear(1024->256)
            (Mish(Linear(256->1024)(LayerNorm(h)))), Mish, Linear(256, 6); learned
            Fourier features through a (128, 128) Mish MLP; 5 VP steps, the v1
            update plus sqrt(beta) z, clipped every step.
  idql_mlp  IDQL's MLP reverse encoder (its other architecture): a LayerNorm over
            the whole input cat[action 6, state 17, time features 128], 3 Linear
            of 256 with Mish, Linear(256, 6); the time MLP and the sampler of idql.
            The sampler reads it with the op's "input:" instruction (the op
            concatenates the input itself, the time MLP evaluated per call).
  dppo      DPPO's residual MLP (DiffusionMLP, residual style): cat[action chunk
            3 x 4, time MLP(sinusoidal 16), obs 11] into Linear(., 512), one
            pre-activation block, Linear(512, 12), Mish (--dppo-act relu for
            ReLU); 20 cosine DDPM steps, x0 clipped, the std floored, the noise
            clipped to 3.
  dppo_ddim the same network with DPPO's fine-tuning DDIM sampler: 10 of 100
            cosine steps, eta 1, x0 clipped, the noise recomputed from the
            clipped x0, the std floored at 0.1, the noise clipped to 3.
  reinflow  ReinFlow's FlowMLP (residual style, gym configs): DPPO's residual
            MLP with ReLU over cat[action chunk 3 x 4, time MLP(sinusoidal 16),
            obs 11]; 4 Euler steps x <- x + v / 4 at t = linspace(0, 1, 4),
            clipped every step.
  fql       FQL's actor vector field: cat[obs 17, action 6, t] (t one column)
            through 4 Linear of 512 with GELU (tanh form: flax's nn.gelu) and
            Linear(512, 6); 10 Euler steps x <- x + v / 10 at t = i / 10, the
            action clipped once at the end.
The flow shapes' velocity points to the data (v = data - noise, t from 0 at
the noise to 1); their rule is flow_euler's steps with the sign of B turned
(flow_euler takes diffusers' velocity, noise - data).

Contenders (one process, the same inputs; --contenders names a subset):
  eager     the loop as the project writes it (noise drawn per step)
  graph     (CUDA) that loop captured in one CUDA graph, replayed
  compile-ro (CUDA) torch.compile(mode="reduce-overhead") of the loop
  sampler   ddpm_ops.DiffusionSampler on the project's own network modules
            (the noise drawn in the op), and what the loop does around it:
            the first draw, FQL's final clip
  sampler-graph (CUDA) that call in one CUDA graph
  op        the sampler's ddpm_ops.sample call alone, its arguments built once
            (what the kernel costs, without the sampler's per-call Python: the
            time embedding evaluated and projected, the parameters read)
  op-graph  (CUDA) that op call in one CUDA graph, replayed
  op@cN     (CUDA, --cluster-sizes N ...) op again with DDPM_OPS_CUDA_CLUSTER_SIZE=N
  rewrite   torch.compile of the loop (default mode) with ddpm_ops' rewrite on at
            its compilation; rewrite-ro (CUDA) the same in reduce-overhead mode.
            A loop the rewrite leaves alone is said so on the line.
Each line ends with the ratio of the best of eager, graph and compile-ro
(those timed) to each ddpm_ops contender.

CPU: contenders alternate round after round, each reports its median wall
time (bench_rule.py's method) at the thread count of --threads (default 2);
--clock process --threads 1 reports CPU time instead. --check times nothing:
it prints, for the shapes without noise, the largest difference between the
sampler's output and the eager loop's from the same x, relative to the
largest entry of the loop's.

    python benchmarks/bench_networks.py --device cpu
    python benchmarks/bench_networks.py --device cuda --shapes reinflow fql --contenders op op-graph \\
        --cluster-sizes 1 2 4
    python benchmarks/bench_networks.py --device cpu --shapes reinflow fql --check
"""
import argparse
import contextlib
import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import ddpm_ops
import machine  # this folder is on sys.path
from bench_rule import cpu_medians_us, cuda_gpu_us, graphed

CONTENDERS = ("eager", "graph", "compile-ro", "sampler", "sampler-graph", "op", "op-graph", "rewrite", "rewrite-ro")
CUDA_ONLY = ("graph", "compile-ro", "sampler-graph", "op-graph", "rewrite-ro")
# What the ratios compare ddpm_ops against.
BASELINES = ("eager", "graph", "compile-ro")


class Policy(nn.Module):
    """What every shape's policy gives the contenders: ``forward(state, x=None)``, the loop as
    the project writes it (from ``x``, else from its own draw), ``sampler()``, the shapes, and
    ``final_clip``: whether the loop clamps the action once after its last step (which no
    step rule does: a rule's clamps apply at every step)."""

    final_clip = False

    def start(self, state):
        return torch.randn(state.shape[0], *self.x_shape, device=state.device)

    def through(self, sampler, state, x=None):
        """What the loop computes, through ``sampler``: the first draw, the call, the final clamp."""
        out = sampler(self.start(state) if x is None else x, cond=state)
        return out.clamp(-1, 1) if self.final_clip else out


# ---------------------------------------------------------------- IDQL


class Fourier(nn.Module):
    def __init__(self, size):
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(size // 2, 1) * 0.2)

    def forward(self, t):
        f = 2 * math.pi * t.reshape(-1, 1).float() @ self.kernel.T
        return torch.cat([f.cos(), f.sin()], -1)


class ResNetBlock(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width, eps=1e-6)
        self.dense1, self.dense2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.dense2(F.mish(self.dense1(self.norm(x))))


class LNResNet(nn.Module):
    def __init__(self, in_dim, out_dim, width=256, blocks=3):
        super().__init__()
        self.dense_in, self.dense_out = nn.Linear(in_dim, width), nn.Linear(width, out_dim)
        self.blocks = nn.Sequential(*[ResNetBlock(width) for _ in range(blocks)])

    def forward(self, x):
        return self.dense_out(F.mish(self.blocks(self.dense_in(x))))


class LayerNormMLP(nn.Module):
    """IDQL's MLP with use_layer_norm: one LayerNorm (flax's eps) over the input, then Dense
    layers with the activation between them, none after the last."""

    def __init__(self, in_dim, hidden_dims, out_dim):
        super().__init__()
        self.norm = nn.LayerNorm(in_dim, eps=1e-6)
        dims = [in_dim, *hidden_dims, out_dim]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x):
        x = self.norm(x)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = F.mish(x)
        return x


class IDQLPolicy(Policy):
    """IDQL's DDPM policy; ``architecture`` its actor_architecture, "ln_resnet" or "mlp"."""

    def __init__(self, architecture="ln_resnet", action=6, state=17, T=5):
        super().__init__()
        self.time = nn.Sequential(Fourier(64), nn.Linear(64, 128), nn.Mish(), nn.Linear(128, 128))
        in_dim = action + state + 128
        self.reverse = LNResNet(in_dim, action) if architecture == "ln_resnet" else \
            LayerNormMLP(in_dim, (256, 256, 256), action)
        t = torch.arange(1, T + 1, dtype=torch.float64)
        betas = 1 - torch.exp(-0.1 / T - 0.5 * 9.9 * (2 * t - 1) / T ** 2)
        alphas = 1 - betas
        abar = torch.cumprod(alphas, 0)
        for name, v in (("betas", betas), ("alphas", alphas), ("abar", abar)):
            self.register_buffer(name, v.float())
        self.action, self.obs_dim, self.T = action, state, T
        self.x_shape = (action,)
        self.rule = ddpm_ops.StepRule(A=torch.ones(T), B=(1 - alphas) / (1 - abar).sqrt(), C=1 / alphas.sqrt(),
                                      D=torch.zeros(T), E=torch.zeros(T),
                                      S=torch.where(torch.arange(T) > 0, betas.sqrt(), torch.zeros(T)),
                                      post_clip=1.0)

    def forward(self, state, x=None):
        x = self.start(state) if x is None else x
        for t in reversed(range(self.T)):
            emb = self.time(torch.full((state.shape[0],), float(t), device=state.device))
            eps = self.reverse(torch.cat([x, state, emb], -1))
            x = 1 / self.alphas[t].sqrt() * (x - (1 - self.alphas[t]) / (1 - self.abar[t]).sqrt() * eps)
            x = x + (t > 0) * self.betas[t].sqrt() * torch.randn_like(x)
            x = x.clamp(-1, 1)
        return x

    def sampler(self):
        return ddpm_ops.DiffusionSampler(self.reverse, self.rule, torch.arange(float(self.T)),
                                         layout=(("x", self.action), ("cond", self.obs_dim), ("time", 128)),
                                         time_embedding=self.time)


# ---------------------------------------------------------------- DPPO


class SinusoidalPosEmb(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        half = self.dim // 2
        emb = torch.exp(torch.arange(half, device=x.device) * -(math.log(10000) / (half - 1)))
        emb = x.reshape(-1, 1).float() * emb[None]
        return torch.cat([emb.sin(), emb.cos()], -1)


def time_mlp(dim=16):
    """DPPO's time embedding, and ReinFlow's FlowMLP's: sinusoidal features, Linear, Mish, Linear."""
    return nn.Sequential(SinusoidalPosEmb(dim), nn.Linear(dim, 2 * dim), nn.Mish(), nn.Linear(2 * dim, dim))


class PreActBlock(nn.Module):
    def __init__(self, width, act):
        super().__init__()
        self.l1, self.l2, self.act = nn.Linear(width, width), nn.Linear(width, width), act

    def forward(self, x):
        return self.l2(self.act(self.l1(self.act(x)))) + x


def residual_mlp(in_dim, out_dim, act, width=512):
    """DPPO's ResidualMLP of mlp_dims [width] * 3 (ReinFlow's too): one pre-activation block."""
    activation = nn.Mish() if act == "mish" else nn.ReLU()
    return nn.Sequential(nn.Linear(in_dim, width), PreActBlock(width, activation), nn.Linear(width, out_dim))


class DPPOPolicy(Policy):
    """DPPO's diffusion policy: 20 DDPM steps, or (``ddim``) its fine-tuning DDIM sampler."""

    def __init__(self, act="mish", ddim=False, action=3, horizon=4, obs=11, min_std=0.1):
        super().__init__()
        self.time = time_mlp(16)
        self.mlp = residual_mlp(action * horizon + 16 + obs, action * horizon, act)
        self.x_shape, self.obs_dim = (horizon, action), obs
        if ddim:
            self._ddim_schedule(min_std)
        else:
            self._ddpm_schedule()
        # Each step index's training timestep, the time embedding's input (a list: no tensor read per step).
        self.step_t = self.timesteps.tolist()

    def _ddpm_schedule(self, steps=20):
        betas = ddpm_ops.cosine_betas(steps).double()
        alphas = 1 - betas
        abar = torch.cumprod(alphas, 0)
        abar_prev = torch.cat([torch.ones(1, dtype=torch.float64), abar[:-1]])
        var = (betas * (1 - abar_prev) / (1 - abar)).clamp(min=1e-20)
        for name, v in (("a", (1 / abar).sqrt()), ("b", (1 / abar - 1).sqrt()),
                        ("c1", betas * abar_prev.sqrt() / (1 - abar)),
                        ("c2", (1 - abar_prev) * alphas.sqrt() / (1 - abar)), ("logvar", var.log())):
            self.register_buffer(name, v.float())
        self.ddim, self.timesteps = False, torch.arange(steps)
        self.rule = ddpm_ops.step_rules.ddpm(ddpm_ops.cosine_betas(steps), clip=1.0, min_std=1e-3, noise_clip=3.0)

    def _ddim_schedule(self, min_std, total=100, steps=10):
        """DPPO's uniform DDIM discretisation: training timesteps 0, 10, ..., 90."""
        abar_all = torch.cumprod(1 - ddpm_ops.cosine_betas(total).double(), 0)
        ddim_t = torch.arange(0, total, total // steps)
        alpha = abar_all[ddim_t]
        alpha_prev = torch.cat([torch.ones(1, dtype=torch.float64), alpha[:-1]])
        sigma = ((1 - alpha_prev) / (1 - alpha) * (1 - alpha / alpha_prev)).sqrt()  # eta 1
        for name, v in (("ddim_alpha", alpha), ("ddim_alpha_prev", alpha_prev), ("ddim_sigma", sigma)):
            self.register_buffer(name, v.float())
        self.ddim, self.min_std, self.timesteps = True, min_std, ddim_t
        self.rule = ddpm_ops.step_rules.ddim(abar_all, ddim_t, eta=1.0, clip=1.0, use_clipped_model_output=True,
                                            min_std=min_std, noise_clip=3.0)

    def forward(self, cond, x=None):
        B = cond.shape[0]
        x = self.start(cond) if x is None else x
        for s in reversed(range(len(self.step_t))):
            emb = self.time(torch.full((B,), self.step_t[s], device=cond.device))
            eps = self.mlp(torch.cat([x.view(B, -1), emb, cond], -1)).view(B, *self.x_shape)
            mean, std = self._ddim_mean_std(x, eps, s) if self.ddim else self._ddpm_mean_std(x, eps, s)
            x = mean + std * torch.randn_like(x).clamp_(-3, 3)
        return x

    def _ddpm_mean_std(self, x, eps, t):
        """Timestep ``t`` (the step index): x0 clipped, the std floored, none at t = 0."""
        x0 = (self.a[t] * x - self.b[t] * eps).clamp(-1, 1)
        mean = self.c1[t] * x0 + self.c2[t] * x
        std = torch.exp(0.5 * self.logvar[t])
        return mean, (torch.zeros_like(std) if t == 0 else std.clamp(min=1e-3))

    def _ddim_mean_std(self, x, eps, i):
        """Step index ``i``: x0 clipped, the noise recomputed from it, the std floored."""
        alpha, alpha_prev, sigma = self.ddim_alpha[i], self.ddim_alpha_prev[i], self.ddim_sigma[i]
        x0 = ((x - (1 - alpha).sqrt() * eps) / alpha.sqrt()).clamp(-1, 1)
        eps = (x - alpha.sqrt() * x0) / (1 - alpha).sqrt()
        mean = alpha_prev.sqrt() * x0 + (1 - alpha_prev - sigma ** 2).sqrt() * eps
        return mean, sigma.clamp(min=self.min_std)

    def sampler(self):
        return ddpm_ops.DiffusionSampler(self.mlp, self.rule, self.timesteps, time_embedding=self.time,
                                         layout=(("x", math.prod(self.x_shape)), ("time", 16),
                                                 ("cond", self.obs_dim)))


# ---------------------------------------------------------------- flow matching: ReinFlow, FQL


def towards_data_euler(steps, clip_every_step):
    """The rule of ``steps`` Euler steps x <- x + v / steps from t = 0 (noise) to 1 (data), the
    velocity v = data - noise (ReinFlow's and FQL's). flow_euler takes diffusers' velocity,
    noise - data, over sigma = 1 - t: the same steps for v are its rule with B negated
    (x0 = x + sigma v); C and D move x to x + dt v whatever the sign."""
    rule = ddpm_ops.step_rules.flow_euler(torch.linspace(0, 1, steps + 1, dtype=torch.float64))
    return ddpm_ops.StepRule(rule.A, -rule.B, rule.C, rule.D, rule.E, rule.S,
                             post_clip=1.0 if clip_every_step else None)


class FlowPolicy(Policy):
    """Euler integration of a velocity network, as ReinFlow's ReFlow.sample and FQL's
    compute_flow_actions write it: ``times`` the network's time input at each step, the action
    clamped to [-1, 1] at every step (``clip_every_step``) or after the last. Subclasses give
    ``velocity(x, t, state)`` (``t`` a ``(batch, 1)`` column) and the sampler's layout."""

    def __init__(self, times, clip_every_step):
        super().__init__()
        self.times, self.clip_every_step = [float(t) for t in times], clip_every_step
        self.final_clip = not clip_every_step
        self.rule = towards_data_euler(len(self.times), clip_every_step)

    def forward(self, state, x=None):
        B, steps = state.shape[0], len(self.times)
        x = self.start(state) if x is None else x
        for i, t in enumerate(self.times):
            v = self.velocity(x, torch.full((B, 1), t, device=state.device), state)
            x = x + v / steps
            if self.clip_every_step or i == steps - 1:
                x = x.clamp(-1, 1)
        return x

    def sampler(self):
        # Step index s is Euler step len - 1 - s: the time inputs in reverse.
        timesteps = torch.tensor(self.times[::-1])
        return ddpm_ops.DiffusionSampler(self.net, self.rule, timesteps, layout=self.layout,
                                         time_embedding=self.time)


class ReinFlowPolicy(FlowPolicy):
    """ReinFlow's FlowMLP (residual_style, mlp_dims [512] * 3, ReLU, time_dim 16) under
    ReFlow.sample: 4 steps at t = linspace(0, 1, 4), clip_intermediate_actions."""

    def __init__(self, action=3, horizon=4, obs=11, steps=4):
        super().__init__(torch.linspace(0, 1, steps).tolist(), clip_every_step=True)
        self.time = time_mlp(16)
        self.net = residual_mlp(action * horizon + 16 + obs, action * horizon, "relu")
        self.x_shape, self.obs_dim = (horizon, action), obs
        self.layout = (("x", action * horizon), ("time", 16), ("cond", obs))

    def velocity(self, x, t, state):
        B = x.shape[0]
        emb = self.time(t.view(B, 1)).view(B, -1)
        return self.net(torch.cat([x.view(B, -1), emb, state], -1)).view(B, *self.x_shape)


class TimeColumn(nn.Module):
    """FQL's time input: t itself, one column."""

    def forward(self, t):
        return t.reshape(-1, 1).float()


class FQLPolicy(FlowPolicy):
    """FQL's actor_bc_flow (ActorVectorField, actor_hidden_dims (512,) * 4, no layer norm)
    under compute_flow_actions: 10 steps at t = i / 10, the action clipped at the end."""

    def __init__(self, action=6, obs=17, steps=10, width=512, depth=4):
        super().__init__([i / steps for i in range(steps)], clip_every_step=False)
        dims = [obs + action + 1] + [width] * depth
        layers = [m for a, b in zip(dims, dims[1:]) for m in (nn.Linear(a, b), nn.GELU(approximate="tanh"))]
        self.net = nn.Sequential(*layers, nn.Linear(width, action))
        self.time = TimeColumn()
        self.x_shape, self.obs_dim = (action,), obs
        self.layout = (("cond", obs), ("x", action), ("time", 1))

    def velocity(self, x, t, state):
        return self.net(torch.cat([state, x, t], -1))


SHAPES = {
    "idql": (lambda act: IDQLPolicy("ln_resnet"), [1, 8, 64, 1024]),
    "idql_mlp": (lambda act: IDQLPolicy("mlp"), [64, 1024]),
    "dppo": (lambda act: DPPOPolicy(act), [1, 8, 40, 64, 256]),
    "dppo_ddim": (lambda act: DPPOPolicy(act, ddim=True), [1, 8, 40, 64, 256]),
    "reinflow": (lambda act: ReinFlowPolicy(), [1, 40, 256, 4096]),
    "fql": (lambda act: FQLPolicy(), [1, 40, 256, 4096]),
}
# The shapes --dppo-act applies to.
DPPO_SHAPES = ("dppo", "dppo_ddim")


# ---------------------------------------------------------------- contenders


def op_call(sampler, x, state):
    """The ddpm_ops.sample call ``sampler(x, cond=state)`` makes, as a function of nothing: its
    arguments taken from one call (no time embedding, parameter reading or argument building
    per call; the noise drawn in the op)."""
    captured = {}
    real_sample = ddpm_ops.modules.sample

    def spy(*args, **kwargs):
        captured.update(args=args, kwargs=kwargs)
        return real_sample(*args, **kwargs)
    ddpm_ops.modules.sample = spy
    try:
        # The general path's call: an eager call of the common form skips ddpm_ops.sample.
        sampler._sample(x, state, None, None, None, False, None)
    finally:
        ddpm_ops.modules.sample = real_sample
    return lambda: real_sample(*captured["args"], **captured["kwargs"])


def contender_builders(policy, sampler, state):
    """Each contender's name and a function that builds it (so that a contender not asked for
    costs no compilation or capture)."""
    def through_sampler(s):
        return policy.through(sampler, s)

    def op():
        return op_call(sampler, policy.start(state), state)

    def op_graph():
        call = op()  # its arguments built before the capture
        return graphed(lambda _: call(), None)

    def compile_ro():
        compiled = torch.compile(policy, mode="reduce-overhead")
        return lambda: compiled(state)

    def rewritten(mode):
        def build():
            compiled = torch.compile(policy, mode=mode)
            fused = ddpm_ops.rewrite_stats()["loops_fused"]
            ddpm_ops.enable_auto_rewrite()
            try:
                compiled(state)  # compiled here, the rewrite on
            finally:
                ddpm_ops.disable_auto_rewrite()
            if ddpm_ops.rewrite_stats()["loops_fused"] == fused:
                print(f"      ({mode or 'default'} mode: the rewrite left the loop alone)", flush=True)
            return lambda: compiled(state)
        return build

    return {
        "eager": lambda: (lambda: policy(state)),
        "graph": lambda: graphed(policy, state),
        "compile-ro": compile_ro,
        "sampler": lambda: (lambda: through_sampler(state)),
        "sampler-graph": lambda: graphed(through_sampler, state),
        "op": op,
        "op-graph": op_graph,
        "rewrite": rewritten(None),
        "rewrite-ro": rewritten("reduce-overhead"),
    }


@contextlib.contextmanager
def environment(name, value):
    """``name`` set to ``value`` inside, restored after (the op reads its overrides at every call)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def time_contenders(policy, batch, args, clock):
    """Microseconds per call of each contender asked for (and op@cN on CUDA), in order."""
    device = args.device
    policy = policy.to(device).eval()
    sampler = policy.sampler().to(device)
    state = torch.randn(batch, policy.obs_dim, device=device)
    builders = contender_builders(policy, sampler, state)
    names = [n for n in args.contenders if device == "cuda" or n not in CUDA_ONLY]
    built = {name: builders[name]() for name in names}
    if device != "cuda":
        return cpu_medians_us(built, args.rounds, args.budget, clock)
    times = cuda_gpu_us(built)
    if args.cluster_sizes:
        op = built["op"] if "op" in built else builders["op"]()
        for size in args.cluster_sizes:
            with environment("DDPM_OPS_CUDA_CLUSTER_SIZE", str(size)):
                times.update(cuda_gpu_us({f"op@c{size}": op}))
    return times


def ratios(times):
    """The best baseline's time over each ddpm_ops contender's, or "" when no baseline was timed."""
    baselines = [us for name, us in times.items() if name in BASELINES]
    if not baselines:
        return ""
    best = min(baselines)
    ours = ", ".join(f"{name} {best / us:.1f}x" for name, us in times.items() if name not in BASELINES)
    return f"  | {ours} the best other" if ours else ""


def relative_error(policy, batch, device):
    """max |sampler - loop| / max |loop| from one x, in float64."""
    policy = policy.to(device).eval()
    sampler = policy.sampler().to(device)
    state = torch.randn(batch, policy.obs_dim, device=device)
    x = policy.start(state)
    expected = policy(state, x).double()
    actual = policy.through(sampler, state, x).double()
    return float((actual - expected).abs().max() / expected.abs().max())


def shape_label(shape, args):
    return f"{shape} {args.dppo_act}" if shape in DPPO_SHAPES else shape


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--shapes", nargs="+", default=["idql", "dppo"], choices=list(SHAPES))
    parser.add_argument("--batches", nargs="+", type=int, default=None)
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS,
                        help="time only these (the CUDA-only ones are skipped on the CPU)")
    parser.add_argument("--cluster-sizes", nargs="+", type=int, default=[],
                        help="CUDA: time op again with DDPM_OPS_CUDA_CLUSTER_SIZE set to each (op@cN)")
    parser.add_argument("--dppo-act", default="mish", choices=["mish", "relu"])
    parser.add_argument("--check", action="store_true",
                        help="time nothing: print the sampler's relative error against the loop (shapes without "
                             "noise)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--budget", type=float, default=0.05, help="CPU: seconds of calls per contender and round")
    parser.add_argument("--clock", choices=["wall", "process"], default="wall",
                        help="CPU: wall time, or the process's CPU time (use with --threads 1: on a shared "
                             "machine it is far steadier than wall time)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "process" else time.perf_counter
    ddpm_ops.disable_auto_rewrite()
    print(f"{machine.describe(args.device)}; {args.threads} threads; {time.strftime('%Y-%m-%d')}")
    if args.cluster_sizes and args.device != "cuda":
        print("--cluster-sizes: CUDA only, ignored")
    unit = "GPU" if args.device == "cuda" else ("CPU-time" if args.clock == "process" else "wall")
    with torch.inference_mode():
        for shape in args.shapes:
            make, default_batches = SHAPES[shape]
            if args.check:
                if make(args.dppo_act).rule.adds_noise:
                    print(f"[{shape_label(shape, args)}] adds noise: not compared")
                    continue
                print(f"\n[{shape_label(shape, args)}] sampler against the loop, max relative error")
            else:
                print(f"\n[{shape_label(shape, args)}] {unit} us per call, median")
            for batch in args.batches or default_batches:
                if args.check:
                    print(f"  batch {batch:>5}: {relative_error(make(args.dppo_act), batch, args.device):.2e}",
                          flush=True)
                    continue
                times = time_contenders(make(args.dppo_act), batch, args, clock)
                cells = "  ".join(f"{name} {us:9.1f}" for name, us in times.items())
                print(f"  batch {batch:>5}: {cells}{ratios(times)}", flush=True)


if __name__ == "__main__":
    main()
