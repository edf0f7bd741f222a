"""Sweep: fp32_rule's shapes for network programs and plain chains on one GPU.

For each shape and batch, the op's GPU time replayed from a CUDA graph (noise
drawn in the kernel from the default generator) in every cluster size named, forced with
DDPM_OPS_CUDA_CLUSTER_SIZE (1: blocks alone), next to the plan's own choice
(`plan`), whose launch line follows. What the plan's cost model
(csrc/plan/fp32_shapes.cpp: the kRule* constants) is fitted to.

Shapes (random weights of the projects' widths):
  idql      IDQL's LN-ResNet: Linear(6, 256), 3 blocks of LN, 256 -> 1024 ->
            256 with Mish, + skip; Mish, Linear; 5 VP steps, clip every step
  idql_mlp  IDQL's MLP: a LayerNorm over cat[a 6, s 17, time 128], 3 Mish
            Linear of 256; the same sampler
  dppo      DPPO's residual MLP of 512 (Mish), action chunk 4 x 3, obs 11 as
            condition rows, 20 cosine DDPM steps, std floor, noise clip
  reinflow  ReinFlow's FlowMLP: DPPO's residual MLP of 512 with ReLU, action
            chunk 4 x 3, time and obs as bias rows, 4 Euler steps clipped
  fql       FQL's vector field: cat[a 6, s 17, t] into 4 GELU (tanh) Linear of
            512, 10 Euler steps, clipped at the end
  dql       the Diffusion-QL policy's chain: 3 Mish Linear of 256, time and
            condition rows, 5 steps (fp32_rule forced: DDPM_OPS_CUDA_KERNEL=rule)

    python benchmarks/sweep_rule.py --shapes idql dppo --batches 1 8 64 --sizes 1 2 4 8 16
"""
import argparse
import os
import pathlib
import statistics
import sys

import torch

import ddpm_ops
import machine  # this folder is on sys.path

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
from network_problems import dppo_program, dppo_rule, idql_mlp_program, idql_program, idql_rule  # noqa: E402
from network_problems import make_program_problem  # noqa: E402

SHAPES = {
    "idql": lambda batch: make_program_problem(batch, 6, idql_program(), [256, *[1024, 256] * 3, 6], idql_rule(),
                                               time_rows=True, cond_rows=True),
    "idql_mlp": lambda batch: make_program_problem(batch, 6, idql_mlp_program(), [256, 256, 256, 6], idql_rule(),
                                                   in_width=6 + 17 + 128, time_rows=128, cond_rows=17),
    "dppo": lambda batch: make_program_problem(batch, 12, dppo_program("mish"), [512, 512, 512, 12],
                                               dppo_rule("ddpm"), time_rows=True, cond_rows=True),
    "reinflow": lambda batch: make_program_problem(batch, 12, dppo_program("relu"), [512, 512, 512, 12],
                                                   ddpm_ops.step_rules.flow_euler(torch.linspace(0, 1, 5), clip=1.0),
                                                   time_rows=True, cond_rows=True),
    "fql": lambda batch: make_program_problem(batch, 6, ["input:x,cond,time", *["linear", "gelu_tanh"] * 4, "linear"],
                                              [512] * 4 + [6], ddpm_ops.step_rules.flow_euler(torch.linspace(0, 1, 11)),
                                              in_width=6 + 17 + 1, time_rows=1, cond_rows=17),
    "dql": lambda batch: chain(make_program_problem(batch, 6, ["linear", "mish"] * 3 + ["linear"],
                                                    [256, 256, 256, 6], dppo_rule("ddpm", noise_clip=1e9),
                                                    num_steps=5, time_rows=True, cond_rows=True)),
}


def chain(problem):
    """The problem as a plain chain of Mish layers (no program)."""
    for name in ("network", "norm_weights", "norm_biases"):
        del problem.kwargs[name]
    problem.kwargs["activations"] = "mish"
    return problem


def on_cuda(problem):
    problem.x, problem.t_start, problem.rule = problem.x.cuda(), problem.t_start.cuda(), problem.rule.to("cuda")
    problem.kwargs = {k: ([t.cuda() for t in v] if isinstance(v, list) and v and isinstance(v[0], torch.Tensor)
                          else v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in problem.kwargs.items()}
    problem.kwargs.pop("noise", None)
    return problem


def graph_us(problem, replays=50, rounds=7):
    """The call in one CUDA graph (noise from the default generator, which each replay
    advances), median GPU us per replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            problem.call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        problem.call()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / replays)
    return statistics.median(times)


def launch_line(problem):
    """The plan's DDPM_OPS_CUDA_LOG line for the call (a child process: the log goes to stderr)."""
    os.environ["DDPM_OPS_CUDA_LOG"] = "1"
    r, w = os.pipe()
    saved = os.dup(2)
    os.dup2(w, 2)
    try:
        problem.call()
        torch.cuda.synchronize()
    finally:
        os.dup2(saved, 2)
        os.close(w)
        del os.environ["DDPM_OPS_CUDA_LOG"]
    with os.fdopen(r) as f:
        return f.read().strip()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 40, 64, 256, 1024])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    args = parser.parse_args()
    ddpm_ops.disable_auto_rewrite()
    print(f"{machine.describe('cuda')}; GPU us per call replayed from a CUDA graph, median")
    for shape in args.shapes:
        if shape == "dql":
            os.environ["DDPM_OPS_CUDA_KERNEL"] = "rule"
        print(f"\n[{shape}]")
        for batch in args.batches:
            problem = on_cuda(SHAPES[shape](batch))
            cells = []
            for size in args.sizes:
                os.environ["DDPM_OPS_CUDA_CLUSTER_SIZE"] = str(size)
                cells.append(f"c{size} {graph_us(problem):8.1f}")
            del os.environ["DDPM_OPS_CUDA_CLUSTER_SIZE"]
            cells.append(f"plan {graph_us(problem):8.1f}")
            print(f"  batch {batch:>5}: " + "  ".join(cells), flush=True)
            print(f"      {launch_line(problem)}", flush=True)
        os.environ.pop("DDPM_OPS_CUDA_KERNEL", None)


if __name__ == "__main__":
    main()
