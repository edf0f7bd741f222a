"""Calls from several threads at once: each gets its own numbers (CPU threads,
CUDA streams), and what is kept across calls (the rewrite's counts, the CUDA
plan) loses nothing."""
import sys
import threading

import pytest
import torch

import ddpm_ops
from ddpm_ops.cuda_plan import plan_for
from ddpm_ops.rewrite import report
from problems import make_problem, make_rule_problem, relative_error
from test_sample import TOLERANCE

THREADS = 4


def run_together(work, count=THREADS):
    """Run ``work(i)`` for i < count on as many threads started at one barrier;
    re-raise the first error; return the results in order."""
    barrier = threading.Barrier(count)
    results, errors = [None] * count, []

    def body(i):
        try:
            barrier.wait()
            results[i] = work(i)
        except BaseException as error:  # noqa: BLE001 (re-raised below, in the test's thread)
            errors.append(error)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as Python allows
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    if errors:
        raise errors[0]
    return results


def problems(device):
    """One problem per thread, each of its own shape and features."""
    return [
        make_rule_problem(33, 6, [32, 32], 5, features=("noise", "cond", "chain"), device=device),
        make_rule_problem(7, 3, [16], 4, features=("row_seeds", "time_net", "clip"), rule="ddpm_sample",
                          device=device),
        make_rule_problem(300, 9, [64], 3, features=("seeded", "time", "post_clip"), rule="ddim_eta",
                          device=device),
        make_problem(20, 5, [24, 24], 6, device=device),
    ]


def call(problem):
    if hasattr(problem, "rule"):
        return torch.ops.ddpm.fused_sample.rule(*problem.args())
    return ddpm_ops.fused_sample(*problem.args())


def test_threads_each_get_their_own_numbers():
    cases = problems("cpu")
    expected = [p.reference64() for p in cases]
    outs = run_together(lambda i: [call(cases[i]) for _ in range(5)])
    for out, reference in zip(outs, expected):
        assert all(relative_error(o, reference) <= TOLERANCE for o in out)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_streams_each_get_their_own_numbers():
    cases = problems("cuda")
    expected = [p.reference64() for p in cases]
    streams = [torch.cuda.Stream() for _ in cases]
    torch.cuda.synchronize()

    def work(i):
        with torch.cuda.stream(streams[i]):
            outs = [call(cases[i]) for _ in range(5)]
        streams[i].synchronize()
        return outs

    for out, reference in zip(run_together(work), expected):
        assert all(relative_error(o, reference) <= TOLERANCE for o in out)


def test_rewrite_counts_lose_nothing_under_threads():
    before = ddpm_ops.rewrite_stats()
    counters = torch._dynamo.utils.counters
    inductor_before = counters["inductor"]["ddpm_ops.loops_fused"]
    rounds = 2000
    seen = []

    def work(i):
        for _ in range(rounds):
            report.count("loops_fused")
            report.count("steps_fused", 3)
            seen.append(ddpm_ops.rewrite_stats()["loops_fused"])

    run_together(work)
    after = ddpm_ops.rewrite_stats()
    assert after["loops_fused"] - before["loops_fused"] == THREADS * rounds
    assert after["steps_fused"] - before["steps_fused"] == 3 * THREADS * rounds
    assert counters["inductor"]["ddpm_ops.loops_fused"] - inductor_before == THREADS * rounds
    assert max(seen) == after["loops_fused"]
    # What a compilation's end reports is what the cache replayed, none of it here.
    report._report_replayed()
    assert ddpm_ops.rewrite_stats() == after


def test_cuda_plan_under_threads():
    shapes = [(512, 64, [256, 256], 16), (3, 4, [16], 5), (4096, 8, [128], 10), (64, 32, [64, 64, 64], 20)]
    expected = [plan_for(*shape) for shape in shapes]
    assert run_together(lambda i: [plan_for(*shapes[i]) for _ in range(20)]) == [[e] * 20 for e in expected]
