"""Quick CPU timing: eager Sampler loop (DESIGN.md) vs ddpm::fused_sample.

Median of alternating runs in one process, torch's default thread count.
Usage: python benchmarks/cpu_quick.py [--batches 1 8 64 512 4096] [--rounds N]
"""
import argparse
import statistics
import time

import torch
from torch import nn

import ddpm_ops


class Sampler(nn.Module):
    def __init__(self, dim=64, num_fused_steps=16, total_timesteps=1000):
        super().__init__()
        h = 4 * dim
        self.K, self.T = num_fused_steps, total_timesteps
        self.eps_net = nn.Sequential(nn.Linear(dim + 1, h), nn.SiLU(),
                                     nn.Linear(h, h), nn.SiLU(), nn.Linear(h, dim))
        betas = torch.linspace(1e-4, 0.02, total_timesteps)
        alphas = 1.0 - betas
        alphas_cumprod = torch.cumprod(alphas, 0)
        self.register_buffer("sqrt_recip_alphas", 1.0 / torch.sqrt(alphas))
        self.register_buffer("coef_eps", betas / torch.sqrt(1.0 - alphas_cumprod))

    def forward(self, x, t_start):
        x_cur = x
        for k in range(self.K):
            t_idx = t_start - k
            t_norm = t_idx.float() / self.T
            eps = self.eps_net(torch.cat([x_cur, t_norm[:, None]], dim=1))
            c1 = self.sqrt_recip_alphas[t_idx].view(-1, 1)
            c2 = self.coef_eps[t_idx].view(-1, 1)
            x_cur = c1 * (x_cur - c2 * eps)
        return x_cur


def timed(fn, reps):
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="*", default=[1, 8, 64, 512, 4096])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--budget-ms", type=float, default=20.0, help="per timed run")
    args = p.parse_args()
    torch.manual_seed(0)
    m = Sampler().eval()
    ws, bs = ddpm_ops.mlp_parameters(m.eps_net)
    ws = [w.detach() for w in ws]
    bs = [b.detach() for b in bs]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"ddpm_ops from {ddpm_ops.__file__}")
    print(f"{'batch':>6} {'eager us':>10} {'fused us':>10} {'speedup':>8} {'max rel err':>12}")
    with torch.inference_mode():
        for b in args.batches:
            x = torch.randn(b, 64)
            t = torch.randint(m.K - 1, m.T, (b,))
            eager = lambda: m(x, t)
            fused = lambda: ddpm_ops.fused_sample(x, t, ws, bs, m.sqrt_recip_alphas,
                                                  m.coef_eps, m.K, m.T)
            ref, got = eager(), fused()
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            # calibrate reps so one timed run takes ~budget
            per = max(timed(eager, 1), timed(fused, 1), 1.0)
            reps_e = max(1, int(args.budget_ms * 1e3 / max(timed(eager, 2), 1.0)))
            reps_f = max(1, int(args.budget_ms * 1e3 / max(timed(fused, 2), 1.0)))
            te, tf = [], []
            for _ in range(args.rounds):
                te.append(timed(eager, reps_e))
                tf.append(timed(fused, reps_f))
            me, mf = statistics.median(te), statistics.median(tf)
            print(f"{b:>6} {me:>10.1f} {mf:>10.1f} {me / mf:>7.2f}x {err:>12.2e}", flush=True)


if __name__ == "__main__":
    main()
