"""CPU timing: the eager sampling loop (bench.Sampler) against ddpm::fused_sample.

Median of alternating runs in one process, torch's default thread count (the
seed shape: 16 steps, dim 64, hidden 256, depth 3). bench.py --device cpu
times every contender one after the other; this script alternates the two.
Usage: python benchmarks/cpu_quick.py [--batches 1 8 64 512 4096] [--rounds N]
"""
import argparse
import statistics
import time

import torch

import ddpm_ops
from bench import Sampler  # the plain loop (this folder is on sys.path)


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
    m = Sampler(dim=64, hidden=256, depth=3, steps=16).eval()
    ws, bs = ddpm_ops.mlp_parameters(m.eps_net)
    ws = [w.detach() for w in ws]
    bs = [b.detach() for b in bs]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"ddpm_ops from {ddpm_ops.__file__}")
    print(f"{'batch':>6} {'eager us':>10} {'fused us':>10} {'speedup':>8} {'rel err vs eager':>17}")
    with torch.inference_mode():
        for b in args.batches:
            x = torch.randn(b, 64)
            t = torch.randint(m.K - 1, m.T, (b,))
            eager = lambda: m(x, t)
            fused = lambda: ddpm_ops.fused_sample(x, t, ws, bs, m.sqrt_recip_alphas,
                                                  m.coef_eps, m.K, m.T)
            ref, got = eager(), fused()
            err = ((got - ref).norm() / ref.norm()).item()
            # calibrate reps so one timed run takes ~budget
            reps_e = max(1, int(args.budget_ms * 1e3 / max(timed(eager, 2), 1.0)))
            reps_f = max(1, int(args.budget_ms * 1e3 / max(timed(fused, 2), 1.0)))
            te, tf = [], []
            for _ in range(args.rounds):
                te.append(timed(eager, reps_e))
                tf.append(timed(fused, reps_f))
            me, mf = statistics.median(te), statistics.median(tf)
            print(f"{b:>6} {me:>10.1f} {mf:>10.1f} {me / mf:>7.2f}x {err:>17.2e}", flush=True)


if __name__ == "__main__":
    main()
