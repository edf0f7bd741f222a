"""CUDA-specific checks of ddpm::fused_sample.rule's fp32_rule kernel: every
rows-per-block instantiation and the tail of the last block, the no-sync NaN
rows, the seeded noise against the CPU kernel's, and the calls the kernel
hands to the op's ATen loop (too many layers, a layer too wide for shared
memory)."""
import dataclasses

import pytest
import torch

import ddpm_ops
from problems import make_rule_problem, relative_error
from test_sample import ALL_FEATURES, TOLERANCE, poisoned_call

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _sms():
    return torch.cuda.get_device_properties(0).multi_processor_count


# Batches around the SM count give 1, 2, 4, 8 and 16 rows per block, each
# with a partly filled last block; dims on and off the float4 path.
@pytest.mark.parametrize("rows_per_sm", [0.5, 1.0, 1.5, 3.2, 6.9, 12.3, 40.0])
@pytest.mark.parametrize("dim, hidden", [(1, [8]), (4, [64, 64]), (7, [33, 65]), (16, [256])])
def test_every_block_height_matches_float64(rows_per_sm, dim, hidden):
    batch = max(1, int(rows_per_sm * _sms()) + 1)
    problem = make_rule_problem(batch, dim, hidden, 4, features=ALL_FEATURES, activation="mixed",
                                rule="ddpm_epsilon", device="cuda")
    out = poisoned_call(problem)
    assert relative_error(out, problem.reference64()) <= TOLERANCE


@pytest.mark.parametrize("return_chain", [False, True])
def test_rows_out_of_range_are_nan_without_a_sync(return_chain):
    features = ("clip", "noise", "time_net") + (("chain",) if return_chain else ())
    problem = make_rule_problem(40, 5, [32], 4, features=features, device="cuda")
    bad = torch.tensor([1, 17, 33], device="cuda")  # below num_steps - 1, beyond the tables, far beyond
    problem.t_start[bad] = torch.tensor([1, 50, 10 ** 9], device="cuda")
    good = torch.ones(40, dtype=torch.bool, device="cuda")
    good[bad] = False
    out = poisoned_call(problem)
    assert torch.isnan(out[..., bad, :]).all()
    kept = dataclasses.replace(problem, x=problem.x[good], t_start=problem.t_start[good],
                               noise=problem.noise[:, good])
    assert relative_error(out[..., good, :], kept.reference64()) <= TOLERANCE
    args = list(problem.args())
    args[13] = True  # validate: the host check, a sync
    with pytest.raises(RuntimeError, match=r"t_start out of range"):
        torch.ops.ddpm.fused_sample.rule(*args)


@pytest.mark.parametrize("seeds", ["seeded", "row_seeds"])
def test_seeded_noise_equals_the_cpu_kernels(seeds):
    def problem_on(device):
        return make_rule_problem(300, 6, [48], 5, features=(seeds, "chain"), rule="ddpm_sample",
                                 device=device, generator=torch.Generator().manual_seed(5))
    on_gpu, on_cpu = problem_on("cuda"), problem_on("cpu")
    out = poisoned_call(on_gpu)
    assert relative_error(out.cpu(), poisoned_call(on_cpu)) <= TOLERANCE
    assert relative_error(out, on_gpu.reference64()) <= TOLERANCE


@pytest.mark.parametrize("case", ["33 layers", "a layer of 40000"])
def test_what_the_kernel_cannot_hold_runs_the_aten_loop(case):
    hidden = [6] * 32 if case == "33 layers" else [40000]
    problem = make_rule_problem(9, 3, hidden, 3, features=("clip", "noise", "cond_net"),
                                activation="tanh", device="cuda")
    assert relative_error(poisoned_call(problem), problem.reference64()) <= TOLERANCE


def test_non_contiguous_inputs():
    problem = make_rule_problem(20, 6, [16], 3, features=("time_net", "cond", "noise"), device="cuda")
    expected = problem.reference64()
    problem.x = torch.empty(6, 20, device="cuda").copy_(problem.x.T).T
    w0 = problem.weights[0]
    problem.weights[0] = torch.cat([w0, torch.zeros_like(w0)], dim=1)[:, :6]
    assert not problem.x.is_contiguous() and not problem.weights[0].is_contiguous()
    assert relative_error(poisoned_call(problem), expected) <= TOLERANCE


def test_sample_runs_the_kernel_in_a_cuda_graph_with_bias_nets():
    problem = make_rule_problem(64, 4, [32, 32], 5, features=("time_net", "cond_net", "clip"),
                                rule="ddpm_sample", device="cuda")
    args = (problem.x, problem.t_start, problem.weights, problem.biases, problem.rule, 5)
    kw = dict(activations=problem.activations, time_net=problem.time_net, cond_net=problem.cond_net)
    noise = torch.randn(5, 64, 4, device="cuda")
    eager = ddpm_ops.sample(*args, noise=noise, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ddpm_ops.sample(*args, noise=noise, **kw)
    noise.copy_(torch.randn(5, 64, 4, device="cuda"))
    graph.replay()
    assert torch.equal(captured, ddpm_ops.sample(*args, noise=noise, **kw))
    assert not torch.equal(captured, eager)
