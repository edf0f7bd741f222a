"""Benchmark: what the rewrite costs and saves at compile time.

For a 100-step Diffusion-QL loop (tests/loops/diffusion_ql.py, T=100) and for
every loop of tests/loops/cases.py: the first call of ``torch.compile``
(wall time, after ``torch._dynamo.reset()`` and inside a fresh, empty inductor
cache, so that every kernel is really compiled), with the rewrite on and off
(``ddpm_ops.enable_auto_rewrite()`` / ``disable_auto_rewrite()``), median of
``--runs`` runs. Each row also gives, for the rewritten compile, the fused calls
in the generated code, the matmuls left in it, and the relative error of its
output against eager (the noise given as a tensor where the loop takes one).

    python benchmarks/compile_time.py            # all loops
    python benchmarks/compile_time.py --runs 1 --only diffusion_ql_T100
"""
import argparse
import pathlib
import re
import statistics
import sys
import time

import torch
from torch._inductor.utils import fresh_cache, run_and_get_code

import ddpm_ops
import machine  # this folder is on sys.path

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from loops import diffusion_ql  # noqa: E402
from loops.cases import CASES  # noqa: E402

FUSED_CALL = re.compile(r"torch\.ops\.ddpm\.fused_sample\.(rule|default)\(")
MATMUL = re.compile(r"extern_kernels\.(mm|addmm|bmm)\b|cpp_gemm|_mkl_linear|mkldnn")


def _dql_T100():
    torch.manual_seed(0)
    m = diffusion_ql.Diffusion(state_dim=17, action_dim=6, n_timesteps=100)
    return m, (torch.randn(50, 17),), (101, 50, 6)


LOOPS = {"diffusion_ql_T100": _dql_T100, **CASES}


def _compile_once(model, args, rewrite: bool):
    """(seconds to the first compiled result, generated code, output) of one real compile."""
    (ddpm_ops.enable_auto_rewrite if rewrite else ddpm_ops.disable_auto_rewrite)()
    torch._dynamo.reset()
    with fresh_cache():
        start = time.perf_counter()
        out, code = run_and_get_code(torch.compile(model), *args)
        seconds = time.perf_counter() - start
    return seconds, "\n".join(code), out


def measure(name: str, runs: int) -> dict:
    model, args, noise_shape = LOOPS[name]()
    if noise_shape:
        torch.manual_seed(1)
        args = (*args, torch.randn(noise_shape))
    ref = model(*args)
    times = {True: [], False: []}
    for _ in range(runs):
        for rewrite in (True, False):  # alternate, so that a busy moment hits both alike
            seconds, code, out = _compile_once(model, args, rewrite)
            times[rewrite].append(seconds)
            if rewrite:
                fused_code, fused_out = code, out
    ddpm_ops.enable_auto_rewrite()
    return dict(
        name=name,
        fused=len(FUSED_CALL.findall(fused_code)),
        mm=len(MATMUL.findall(fused_code)),
        err=((fused_out - ref).norm() / ref.norm()).item(),
        on=statistics.median(times[True]),
        off=statistics.median(times[False]),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="compiles per loop and setting (median)")
    parser.add_argument("--only", nargs="*", choices=sorted(LOOPS), help="these loops only")
    opts = parser.parse_args()
    if opts.runs < 1:
        parser.error(f"--runs must be at least 1, got {opts.runs}")
    print(machine.describe("cpu"))
    print(f"compile time: first call of torch.compile, fresh cache, median of {opts.runs}")
    header = f"{'loop':26} {'fused':>5} {'mm left':>7} {'rel err':>9} {'rewrite on':>11} {'off':>8} {'off/on':>7}"
    print(header)
    print("-" * len(header))
    with torch.inference_mode():
        # The process's first compile also pays for importing and setting up inductor.
        _compile_once(torch.nn.Linear(2, 2), (torch.randn(1, 2),), rewrite=True)
        for name in opts.only or LOOPS:
            r = measure(name, opts.runs)
            print(f"{r['name']:26} {r['fused']:5d} {r['mm']:7d} {r['err']:9.1e} {r['on']:10.2f}s "
                  f"{r['off']:7.2f}s {r['off'] / r['on']:6.2f}x", flush=True)


if __name__ == "__main__":
    main()
