"""Every path of the CPU kernel (ISA build x tile kernel x BLAS), forced through
its environment knobs in a fresh process, against the float64 reference, on
shapes at the vector, register-block and tile boundaries."""
import pathlib
import sys
import textwrap

import pytest
import torch

from problems import run_python

# Each entry forces one path; the knobs are read once per process.
PATHS = {
    "default isa, dot kernel on every tile": {"ATEN_CPU_CAPABILITY": "default", "DDPM_OPS_CPU_DOT_ROWS": "1000000"},
    "default isa, BLAS tiles": {"ATEN_CPU_CAPABILITY": "default", "DDPM_OPS_CPU_BLAS": "1",
                                "DDPM_OPS_CPU_VEC_TILE": "1", "DDPM_OPS_CPU_BLAS_TILE": "3"},
    "avx2, dot kernel on every tile": {"ATEN_CPU_CAPABILITY": "avx2", "DDPM_OPS_CPU_DOT_ROWS": "1000000"},
    "avx2, register-blocked tiles": {"ATEN_CPU_CAPABILITY": "avx2", "DDPM_OPS_CPU_SERIAL_BATCH": "0",
                                     "DDPM_OPS_CPU_DOT_ROWS": "0", "DDPM_OPS_CPU_VEC_TILE": "7"},
    "native isa, small register-blocked tiles": {"DDPM_OPS_CPU_SERIAL_BATCH": "0", "DDPM_OPS_CPU_DOT_ROWS": "0",
                                                 "DDPM_OPS_CPU_VEC_TILE": "7"},
    "native isa, one thread": {"OMP_NUM_THREADS": "1"},
    "native isa, layers split between threads": {"OMP_NUM_THREADS": "2", "DDPM_OPS_CPU_SPLIT_WEIGHTS": "1"},
    "avx2, layers split between threads": {"ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "3",
                                           "DDPM_OPS_CPU_SPLIT_WEIGHTS": "1"},
}

SCRIPT = textwrap.dedent("""
    import torch
    from problems import make_problem, relative_error
    import ddpm_ops
    cases = [(b, 7, [w], 2, torch.int64) for w in (1, 3, 15, 17, 33, 129) for b in (1, 5, 13)]
    cases += [
        (1, 64, [256, 256], 16, torch.int64), (3, 1, [], 5, torch.int32),
        (13, 7, [33, 1, 300], 9, torch.int64), (40, 130, [7], 3, torch.int32),
        (257, 12, [1024], 2, torch.int64), (6, 5, [17, 9, 31, 8], 100, torch.int64),
        (6, 17, [5, 65], 4, torch.int32),
    ]
    worst = 0.0
    for batch, dim, hidden, steps, t_dtype in cases:
        p = make_problem(batch, dim, hidden, steps, t_dtype=t_dtype)
        worst = max(worst, relative_error(ddpm_ops.fused_sample(*p.args()), p.reference64()))
    p = make_problem(5, 4, [8], 1, total_timesteps=1)      # a table of length 1
    worst = max(worst, relative_error(ddpm_ops.fused_sample(*p.args()), p.reference64()))
    p = make_problem(6, 5, [9], 3)
    p.x = torch.randn(1, 5).expand(6, 5)                     # stride-0 rows
    worst = max(worst, relative_error(ddpm_ops.fused_sample(*p.args()), p.reference64()))
    print(worst)
""")


@pytest.mark.parametrize("path", sorted(PATHS))
def test_cpu_path_matches_float64_reference(path):
    result = run_python(SCRIPT, PATHS[path])
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.strip().splitlines()[-1]) <= 1e-5


# The rule overload's script, for a sample of DTYPE (float32, or float64: the step in float64).
RULE_SCRIPT = textwrap.dedent("""
    import itertools
    import torch
    from problems import RULES, make_rule_problem, relative_error
    DTYPE = torch.{dtype}
    features = ("time", "cond", "clip", "post_clip", "noise", "chain", "time_net", "cond_net")
    worst = 0.0
    shapes = [(1, 6, [32, 32], 5), (5, 7, [15, 17], 3), (13, 1, [], 4), (40, 17, [33, 65, 9], 3),
              (257, 12, [64], 2)]
    for i, shape in enumerate(shapes):
        for j, activation in enumerate(("mixed", "mish", "gelu", "relu")):
            subset = features[: (i + j) % (len(features) + 1)] + features[len(features) - j:]
            p = make_rule_problem(*shape, features=subset, activation=activation,
                                  rule=RULES[(i + j) % len(RULES)])
            out = torch.ops.ddpm.fused_sample.rule(*p.args(DTYPE))
            assert out.dtype == DTYPE
            worst = max(worst, relative_error(out, p.reference64()))
        # The noise drawn from a seed, by every rule (those without noise
        # ignore it), and from a seed per row.
        for k, rule in enumerate(RULES):
            seeds = "row_seeds" if k % 2 else "seeded"
            p = make_rule_problem(*shape, features=(seeds, "clip", "chain"), rule=rule)
            worst = max(worst, relative_error(torch.ops.ddpm.fused_sample.rule(*p.args(DTYPE)), p.reference64()))
        # The previous x0's term and per-column clamp bounds.
        for extra in (("previous", "clip", "noise"), ("previous", "clip_bounds", "post_clip_bounds", "chain"),
                      ("clip_bounds", "post_clip", "seeded")):
            p = make_rule_problem(*shape, features=extra, activation="mixed", rule=RULES[i % len(RULES)])
            worst = max(worst, relative_error(torch.ops.ddpm.fused_sample.rule(*p.args(DTYPE)), p.reference64()))
    print(worst)
""")


# The rule overload also has the ATen loop that devices without a fused kernel run.
RULE_PATHS = {**PATHS, "unfused ATen loop": {"DDPM_OPS_CPU_UNFUSED": "1"}}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("path", sorted(RULE_PATHS))
def test_cpu_path_of_the_rule_overload_matches_float64_reference(path, dtype):
    result = run_python(RULE_SCRIPT.format(dtype=dtype), RULE_PATHS[path])
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.strip().splitlines()[-1]) <= 1e-5


@pytest.mark.skipif(not (torch.backends.openmp.is_available() and sys.platform.startswith("linux")),
                    reason="torch's intra-op threads are not OpenMP's here")
def test_cpu_kernel_is_built_to_run_on_torchs_threads():
    """at::parallel_for is a header template: built without -fopenmp it runs on
    the calling thread alone, whatever torch.set_num_threads says. Built with
    it, the extension calls libgomp's parallel region."""
    import ddpm_ops
    library = pathlib.Path(ddpm_ops.LIBRARY_PATH).read_bytes()
    assert b"GOMP_parallel" in library
