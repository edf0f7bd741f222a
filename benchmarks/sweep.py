"""The kernels' rules, measured (CUDA): graph-replayed gpu us per call of
ddpm::fused_sample by the rule (`auto`) against the kernels forced, with the
relative error against float64 in brackets. A forced size that cannot hold
the net is ignored, so its row repeats the rule's.
  - default (sm_90): the split kernel in clusters of 1, 2 and 4 (`s1`, `s2`,
    `s4`) and the cluster kernel (`cl`, up to batch 1024);
  - --bf16: "bf16" by the rule against the bf16 wgmma kernel;
  - --resident: the resident kernel in clusters of 16, 8, 4 and 2 (`r16`,
    `r8`, `r4`, `r2`) and the cluster kernel;
  - --narrow: the narrow kernel in clusters of C with tiles of R rows
    (`nCxR`, C = 1, 2, 4, R = 8, 16, 24, 32) against the split kernel in
    clusters of 2 and 4.

    python benchmarks/sweep.py --shapes seed small --batches 128 256 512
    python benchmarks/sweep.py --bf16 --batches 512 1920
    python benchmarks/sweep.py --resident --batches 1 8 64
    python benchmarks/sweep.py --narrow --batches 256 512
"""
import argparse
import sys

import torch

import ddpm_ops
from bench import TOTAL_TIMESTEPS, Clock, Sampler, capture, forced, rel_err

# name: (dim, hidden, depth, steps)
SHAPES = {"seed": (64, 256, 3, 16), "small": (12, 256, 3, 5), "h128": (32, 128, 4, 10), "h64": (16, 64, 3, 10)}


def variants(batch, mode):
    """(label, environment, precision) of every run at this batch."""
    if mode == "bf16":
        return [("auto", {}, "bf16"), ("wgmma", {"DDPM_OPS_CUDA_KERNEL": "wgmma"}, "bf16")]
    runs = [("auto", {}, "fp32")]
    if mode == "resident":
        runs += [(f"r{size}", {"DDPM_OPS_CUDA_KERNEL": "resident", "DDPM_OPS_CUDA_CLUSTER_SIZE": str(size)}, "fp32")
                 for size in (16, 8, 4, 2)]
    elif mode == "narrow":
        runs += [(f"s{size}", {"DDPM_OPS_CUDA_KERNEL": "split", "DDPM_OPS_CUDA_CLUSTER_SIZE": str(size)}, "fp32")
                 for size in (2, 4)]
        runs += [(f"n{size}x{rows}", {"DDPM_OPS_CUDA_KERNEL": "narrow", "DDPM_OPS_CUDA_CLUSTER_SIZE": str(size),
                                      "DDPM_OPS_CUDA_TILE_ROWS": str(rows)}, "fp32")
                 for size in (1, 2, 4) for rows in (8, 16, 24, 32)]
    else:
        runs += [(f"s{size}", {"DDPM_OPS_CUDA_KERNEL": "split", "DDPM_OPS_CUDA_CLUSTER_SIZE": str(size)}, "fp32")
                 for size in (1, 2, 4)]
    if batch <= 1024:
        runs.append(("cl", {"DDPM_OPS_CUDA_KERNEL": "cluster"}, "fp32"))
    return runs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--batches", nargs="+", type=int, default=[128, 256, 512, 1024, 2048, 4096])
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--bf16", action="store_true", help='"bf16": the rule against the wgmma kernel')
    modes.add_argument("--resident", action="store_true", help="the resident kernel against the cluster kernel")
    modes.add_argument("--narrow", action="store_true", help="the narrow kernel against the split kernel")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sweep.py needs a CUDA GPU (an sm_90 one for the split, narrow and wgmma kernels)")
    mode = next((m for m in ("bf16", "resident", "narrow") if getattr(args, m)), "split")
    clock = Clock("cuda")
    for name in args.shapes:
        dim, hidden, depth, steps = SHAPES[name]
        torch.manual_seed(0)
        model = Sampler(dim, hidden, depth, steps).cuda().eval()
        weights, biases = ddpm_ops.mlp_parameters(model.eps_net)
        for batch in args.batches:
            x = torch.randn(batch, dim, device="cuda")
            t = torch.randint(steps - 1, TOTAL_TIMESTEPS, (batch,), device="cuda")
            ref = ddpm_ops.reference(x.double(), t, [w.double() for w in weights], [b.double() for b in biases],
                                     model.sqrt_recip_alphas.double(), model.coef_eps.double(), steps,
                                     TOTAL_TIMESTEPS)
            row = []
            for label, env, precision in variants(batch, mode):
                def call(p=precision):
                    return ddpm_ops.fused_sample(x, t, weights, biases, model.sqrt_recip_alphas, model.coef_eps,
                                                 steps, TOTAL_TIMESTEPS, precision=p)
                with torch.inference_mode():
                    # The kernel is chosen at capture: the graph keeps it.
                    graph, out = forced(env, lambda: capture(call))
                    graph.replay()
                    us = clock.gpu_us(graph.replay, reps=5 if batch >= 8192 else 20, rounds=7)
                row.append(f"{label} {us:6.1f} ({rel_err(out, ref):.1e})")
            print(f"{mode} {name} {batch:5d}: " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
