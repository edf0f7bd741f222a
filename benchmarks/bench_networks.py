"""Benchmark: networks with LayerNorm and residual blocks (IDQL, DPPO) as one fused call.

Shapes:
  idql   IDQL's LN-ResNet reverse encoder: cat[action 6, state 17, time
         features 128] into Linear(., 256), 3 blocks h + Linear(1024->256)
         (Mish(Linear(256->1024)(LayerNorm(h)))), Mish, Linear(256, 6); learned
         Fourier features through a (128, 128) Mish MLP; 5 VP steps, the v1
         update plus sqrt(beta) z, clipped every step.
  dppo   DPPO's residual MLP (DiffusionMLP, residual style): cat[action chunk
         3 x 4, time MLP(sinusoidal 16), obs 11] into Linear(., 512), one
         pre-activation block, Linear(512, 12), Mish (--dppo-act relu for
         ReLU); 20 cosine DDPM steps, x0 clipped, the std floored, the noise
         clipped to 3.

Contenders (one process, the same inputs):
  eager     the loop as the project writes it (noise drawn per step)
  graph     (CUDA) that loop captured in one CUDA graph, replayed
  compile-ro (CUDA) torch.compile(mode="reduce-overhead") of the loop
  sampler   ddpm_ops.DiffusionSampler on the project's own network modules
            (the noise drawn in the op)
  sampler-graph (CUDA) that call in one CUDA graph
  op        the sampler's ddpm_ops.sample call alone, its arguments built once
            (what the kernel costs, without the sampler's per-call Python: the
            time embedding evaluated and projected, the parameters read)
CPU: contenders alternate round after round, each reports its median wall
time (bench_rule.py's method) at the thread count of --threads (default 2);
--clock process --threads 1 reports CPU time instead.

    python benchmarks/bench_networks.py --device cpu
    python benchmarks/bench_networks.py --device cuda
"""
import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

import ddpm_ops
import machine  # this folder is on sys.path
from bench_rule import cpu_medians_us, cuda_gpu_us, graphed


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


class IDQLPolicy(nn.Module):
    def __init__(self, action=6, state=17, T=5):
        super().__init__()
        self.time = nn.Sequential(Fourier(64), nn.Linear(64, 128), nn.Mish(), nn.Linear(128, 128))
        self.reverse = LNResNet(action + state + 128, action)
        t = torch.arange(1, T + 1, dtype=torch.float64)
        betas = 1 - torch.exp(-0.1 / T - 0.5 * 9.9 * (2 * t - 1) / T ** 2)
        alphas = 1 - betas
        abar = torch.cumprod(alphas, 0)
        for name, v in (("betas", betas), ("alphas", alphas), ("abar", abar)):
            self.register_buffer(name, v.float())
        self.action, self.T = action, T
        self.rule = ddpm_ops.StepRule(A=torch.ones(T), B=(1 - alphas) / (1 - abar).sqrt(), C=1 / alphas.sqrt(),
                                      D=torch.zeros(T), E=torch.zeros(T),
                                      S=torch.where(torch.arange(T) > 0, betas.sqrt(), torch.zeros(T)),
                                      post_clip=1.0)

    def forward(self, state):
        x = torch.randn(state.shape[0], self.action, device=state.device)
        for t in reversed(range(self.T)):
            emb = self.time(torch.full((state.shape[0],), float(t), device=state.device))
            eps = self.reverse(torch.cat([x, state, emb], -1))
            x = 1 / self.alphas[t].sqrt() * (x - (1 - self.alphas[t]) / (1 - self.abar[t]).sqrt() * eps)
            x = x + (t > 0) * self.betas[t].sqrt() * torch.randn_like(x)
            x = x.clamp(-1, 1)
        return x

    def sampler(self):
        return ddpm_ops.DiffusionSampler(self.reverse, self.rule, torch.arange(float(self.T)),
                                         layout=(("x", self.action), ("cond", 17), ("time", 128)),
                                         time_embedding=self.time)


class SinusoidalPosEmb(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        half = self.dim // 2
        emb = torch.exp(torch.arange(half, device=x.device) * -(math.log(10000) / (half - 1)))
        emb = x.reshape(-1, 1).float() * emb[None]
        return torch.cat([emb.sin(), emb.cos()], -1)


class PreActBlock(nn.Module):
    def __init__(self, width, act):
        super().__init__()
        self.l1, self.l2, self.act = nn.Linear(width, width), nn.Linear(width, width), act

    def forward(self, x):
        return self.l2(self.act(self.l1(self.act(x)))) + x


class DPPOPolicy(nn.Module):
    def __init__(self, act="mish", action=3, horizon=4, obs=11, width=512, steps=20):
        super().__init__()
        activation = nn.Mish() if act == "mish" else nn.ReLU()
        self.time = nn.Sequential(SinusoidalPosEmb(16), nn.Linear(16, 32), nn.Mish(), nn.Linear(32, 16))
        self.mlp = nn.Sequential(nn.Linear(action * horizon + 16 + obs, width), PreActBlock(width, activation),
                                 nn.Linear(width, action * horizon))
        betas = ddpm_ops.cosine_betas(steps).double()
        alphas = 1 - betas
        abar = torch.cumprod(alphas, 0)
        abar_prev = torch.cat([torch.ones(1, dtype=torch.float64), abar[:-1]])
        var = (betas * (1 - abar_prev) / (1 - abar)).clamp(min=1e-20)
        for name, v in (("a", (1 / abar).sqrt()), ("b", (1 / abar - 1).sqrt()),
                        ("c1", betas * abar_prev.sqrt() / (1 - abar)),
                        ("c2", (1 - abar_prev) * alphas.sqrt() / (1 - abar)), ("logvar", var.log())):
            self.register_buffer(name, v.float())
        self.shape, self.steps = (horizon, action), steps
        self.rule = ddpm_ops.step_rules.ddpm(ddpm_ops.cosine_betas(steps), clip=1.0, min_std=1e-3, noise_clip=3.0)

    def forward(self, cond):
        B = cond.shape[0]
        x = torch.randn(B, *self.shape, device=cond.device)
        for t in reversed(range(self.steps)):
            emb = self.time(torch.full((B,), t, device=cond.device))
            eps = self.mlp(torch.cat([x.view(B, -1), emb, cond], -1)).view(B, *self.shape)
            x0 = (self.a[t] * x - self.b[t] * eps).clamp(-1, 1)
            mean = self.c1[t] * x0 + self.c2[t] * x
            std = torch.exp(0.5 * self.logvar[t])
            std = torch.zeros_like(std) if t == 0 else std.clamp(min=1e-3)
            x = mean + std * torch.randn_like(x).clamp_(-3, 3)
        return x

    def sampler(self):
        return ddpm_ops.DiffusionSampler(self.mlp, self.rule, torch.arange(self.steps),
                                         layout=(("x", 12), ("time", 16), ("cond", 11)), time_embedding=self.time)


def contenders(shape, batch, device, dppo_act):
    policy = (IDQLPolicy() if shape == "idql" else DPPOPolicy(dppo_act)).to(device).eval()
    sampler = policy.sampler().to(device)
    state = torch.randn(batch, 17 if shape == "idql" else 11, device=device)
    x_shape = (policy.action,) if shape == "idql" else policy.shape

    def through_sampler(s):
        return sampler(torch.randn(s.shape[0], *x_shape, device=s.device), cond=s)
    # The op alone: the sampler's ddpm_ops.sample call with its arguments as one call made them (no
    # time embedding, parameter reading or argument building per call; the noise drawn in the op).
    captured = {}
    real_sample = ddpm_ops.modules.sample

    def spy(*args, **kwargs):
        captured.update(args=args, kwargs=kwargs)
        return real_sample(*args, **kwargs)
    ddpm_ops.modules.sample = spy
    # (the general path's call: an eager call of the common form skips ddpm_ops.sample)
    sampler._sample(torch.randn(batch, *x_shape, device=device), state, None, None, None, False, None)
    ddpm_ops.modules.sample = real_sample
    out = {"eager": lambda: policy(state), "sampler": lambda: through_sampler(state),
           "op": lambda: real_sample(*captured["args"], **captured["kwargs"])}
    if device == "cuda":
        out["graph"] = graphed(policy, state)
        out["sampler-graph"] = graphed(through_sampler, state)
        compiled = torch.compile(policy, mode="reduce-overhead")
        out["compile-ro"] = lambda: compiled(state)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--shapes", nargs="+", default=["idql", "dppo"], choices=["idql", "dppo"])
    parser.add_argument("--batches", nargs="+", type=int, default=None)
    parser.add_argument("--dppo-act", default="mish", choices=["mish", "relu"])
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
    default = {"idql": [1, 8, 64, 1024], "dppo": [1, 8, 40, 64, 256]}
    with torch.inference_mode():
        for shape in args.shapes:
            unit = "GPU" if args.device == "cuda" else ("CPU-time" if args.clock == "process" else "wall")
            print(f"\n[{shape}{'' if shape == 'idql' else ' ' + args.dppo_act}] {unit} us per call, median")
            for batch in args.batches or default[shape]:
                c = contenders(shape, batch, args.device, args.dppo_act)
                times = cuda_gpu_us(c) if args.device == "cuda" else cpu_medians_us(c, args.rounds, args.budget, clock)
                cells = "  ".join(f"{name} {us:9.1f}" for name, us in times.items())
                best = min(us for name, us in times.items() if not name.startswith("sampler") and name != "op")
                cells += f"  | sampler {best / times['sampler']:.1f}x, op {best / times['op']:.1f}x the best other"
                print(f"  batch {batch:>5}: {cells}", flush=True)


if __name__ == "__main__":
    main()
