"""A quick call of every CUDA kernel the plan can pick, for compute-sanitizer.

    compute-sanitizer --tool memcheck python tools/sanitize_kernels.py
    compute-sanitizer --tool racecheck python tools/sanitize_kernels.py --kernels tiled16 rule

Each kernel is forced through DDPM_OPS_CUDA_KERNEL (with "@n" for
DDPM_OPS_CUDA_CLUSTER_SIZE=n) and runs both overloads on small problems with
every feature of the rule (bias rows and networks, clamps as floats and as
per-column bounds, the previous x0 term, noise given, from a seed, a seed per
row and a generator, the chain), fp32_rule (alone and in clusters, "rule@n")
a network program too (IDQL's LN-ResNet: LayerNorms, residual adds); each
result is checked against float64, so
a run that the sanitizer passes also computed the right numbers. Kernels the
build or the device cannot run (the Hopper kernels in a build of 8.x code)
are skipped with a line saying so.
"""
import argparse
import os
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
import ddpm_ops  # noqa: E402
import ddpm_ops.cuda_plan  # noqa: E402
from network_problems import idql_program, idql_rule, make_program_problem  # noqa: E402
from problems import make_problem, make_rule_problem, relative_error  # noqa: E402

TOLERANCE = 1e-5
ENGINE = ["resident", "tiled16", "tiled64", "tiled16@4", "rule", "rule@2", "rule@5", "rule@16"]
TIME_COLUMN_ONLY = ["cluster", "narrow", "split"]
FEATURE_SETS = [
    ("time", "cond", "clip", "post_clip", "noise", "chain", "time_net", "cond_net"),
    ("seeded", "previous", "clip_bounds", "post_clip_bounds", "time"),
    ("row_seeds", "clip", "chain", "cond_net"),
]


# The time-column problem: a batch every forced kernel holds in one wave.
TIME_COLUMN = (300, 12, [64, 64], 3)


def on_cuda(value):
    """A tensor, or a list of tensors, on the GPU; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.cuda()
    if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
        return [v.cuda() for v in value]
    return value


def runs_here(kernel: str) -> bool:
    """Forces kernel; whether the plan runs it here (this build, this device)."""
    name, _, cluster_size = kernel.partition("@")
    overrides = {"DDPM_OPS_CUDA_KERNEL": name}
    if cluster_size:
        overrides["DDPM_OPS_CUDA_CLUSTER_SIZE"] = cluster_size
    os.environ.pop("DDPM_OPS_CUDA_CLUSTER_SIZE", None)
    os.environ.update(overrides)
    batch, dim, hidden, steps = TIME_COLUMN
    plan = ddpm_ops.cuda_plan.plan_for(batch, dim, hidden, steps, overrides=overrides,
                                       device=ddpm_ops.cuda_plan.current_device())
    planned = plan["log"].split()[1]
    if planned != name.rstrip("0123456789"):
        print(f"{kernel}: not run here ({planned} would run instead)")
        return False
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", nargs="+", default=ENGINE + TIME_COLUMN_ONLY)
    args = parser.parse_args()
    for kernel in args.kernels:
        def run():
            if kernel in ENGINE:
                for i, features in enumerate(FEATURE_SETS):
                    problem = make_rule_problem(9 + 20 * i, 6, [64, 64, 64], 4, features=features,
                                                activation="mixed", device="cuda",
                                                generator=torch.Generator().manual_seed(i))
                    err = relative_error(torch.ops.ddpm.fused_sample.rule(*problem.args()), problem.reference64())
                    assert err <= TOLERANCE, (kernel, features, err)
            if kernel.startswith("rule"):
                program = make_program_problem(5, 6, idql_program(blocks=2), [64, 132, 64, 132, 64, 6], idql_rule(),
                                               time_rows=True, cond_rows=True, return_chain=True,
                                               generator=torch.Generator().manual_seed(7))
                expected = program.reference64()
                program.x, program.t_start, program.rule = on_cuda(program.x), on_cuda(program.t_start), program.rule.to("cuda")
                program.kwargs = {k: on_cuda(v) for k, v in program.kwargs.items()}
                err = relative_error(program.call(), expected)
                assert err <= TOLERANCE, (kernel, "program", err)
            problem = make_problem(*TIME_COLUMN, device="cuda")
            err = relative_error(torch.ops.ddpm.fused_sample(*problem.args()), problem.reference64())
            assert err <= TOLERANCE, (kernel, "time-column", err)
        if runs_here(kernel):
            run()
            torch.cuda.synchronize()
            print(f"{kernel}: ran, exact")


if __name__ == "__main__":
    main()
