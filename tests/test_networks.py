"""Network programs (the op's ``network``, ``norm_weights``, ``norm_biases`` arguments) and the
noise clamp (``noise_clip``): IDQL's and DPPO's shapes against float64 on the CPU kernel and the
ATen loop, poisoned outputs, bad programs, opcheck."""
import dataclasses
import textwrap

import pytest
import torch
from torch.library import opcheck

import ddpm_ops
from network_problems import (dppo_program, dppo_rule, idql_mlp_program, idql_program, idql_rule,
                              make_program_problem)
from problems import make_rule, relative_error, run_python

TOLERANCE = 1e-5
ACTION, STATE, HIDDEN = 6, 17, 256


def idql_problem(batch, **options):
    """IDQL's LN-ResNet (action 6, hidden 256, inner 1024, 3 blocks, 5 steps), the state and the
    time features as the first Linear's bias rows."""
    return make_program_problem(batch, ACTION, idql_program(), [HIDDEN, *[4 * HIDDEN, HIDDEN] * 3, ACTION],
                                idql_rule(), time_rows=True, cond_rows=True, **options)


@pytest.mark.parametrize("batch", [1, 4, 7, 64, 97])
def test_idql_ln_resnet_matches_float64(batch):
    problem = idql_problem(batch)
    out = problem.poisoned_call()
    assert relative_error(out, problem.reference64()) <= TOLERANCE


def test_idql_ln_resnet_at_batch_4096_matches_float64():
    problem = idql_problem(4096)
    assert relative_error(problem.poisoned_call(), problem.reference64()) <= TOLERANCE


@pytest.mark.parametrize("activation", ["relu", "mish"])
@pytest.mark.parametrize("kind", ["ddpm", "ddim"])
@pytest.mark.parametrize("batch", [1, 40, 256])
def test_dppo_residual_mlp_matches_float64(activation, kind, batch):
    """DPPO's shape: action 3 x chunk 4, widths 512, 20 DDPM or 10 DDIM steps, the std floored and the
    noise clipped to 3, a noise tensor with values past the clip; the whole chain."""
    rule = dppo_rule(kind)
    problem = make_program_problem(batch, 12, dppo_program(activation), [512, 512, 512, 12], rule,
                                   time_rows=True, cond_rows=True, return_chain=True)
    problem.kwargs["noise"] = problem.kwargs["noise"] * 2.0  # about 13% of the draws beyond +-3
    out = problem.poisoned_call()
    expected = problem.reference64()
    assert out.shape == (len(rule) + 1, batch, 12)
    assert relative_error(out, expected) <= TOLERANCE


@pytest.mark.parametrize("batch", [1, 5, 33])
def test_idql_mlp_reads_the_whole_input(batch):
    """IDQL's MLP: a LayerNorm over cat[a, s, time features] before the first Linear; the op
    concatenates x, cond_input's row and time_input's row of the step index itself."""
    problem = make_program_problem(batch, ACTION, idql_mlp_program(), [256, 256, 256, ACTION], idql_rule(),
                                   in_width=ACTION + STATE + 128, time_rows=128, cond_rows=STATE, random_t=True)
    assert relative_error(problem.poisoned_call(), problem.reference64()) <= TOLERANCE


@pytest.mark.parametrize("order", ["x,cond,time", "time,x", "cond,x", "x"])
def test_input_parts_in_any_order(order):
    parts = order.split(",")
    width = {"x": 5, "cond": 3, "time": 4}
    problem = make_program_problem(9, 5, [f"input:{order}", "layer_norm:1e-05", "linear", "gelu", "linear"],
                                   [24, 5], make_rule("ddpm_v", 12), num_steps=6,
                                   in_width=sum(width[p] for p in parts),
                                   time_rows=4 if "time" in parts else None,
                                   cond_rows=3 if "cond" in parts else None, random_t=True)
    assert relative_error(problem.poisoned_call(), problem.reference64()) <= TOLERANCE


PROGRAMS = {
    "nested residuals": (["linear", "save", "silu", "save", "linear", "tanh", "add", "layer_norm:0.001", "add",
                          "linear"], [19, 19, 7]),
    "norm first, no affine": (["layer_norm:1e-05", "linear", "save", "relu", "linear", "add", "gelu_tanh",
                               "linear"], [33, 33, 7]),
    "residual at the input": (["save", "linear", "mish", "linear", "add", "layer_norm_affine:1e-06", "linear",
                               "silu", "linear"], [40, 7, 17, 7]),
    "post-norm blocks": (["linear", *(["save", "linear", "identity", "add", "layer_norm_affine:1e-05"] * 2),
                          "linear", "layer_norm_affine:1e-05"], [20, 20, 20, 7]),
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@pytest.mark.parametrize("batch", [1, 3, 6, 50, 200])
def test_programs_on_every_tile_kernel(name, batch):
    """Programs of every instruction, at the batch sizes of each tile path (one row, a serial tile,
    register blocks, several tiles), with time and cond bias rows and the rule's clamps."""
    network, outs = PROGRAMS[name]
    rule = make_rule("ddim_eta", 9, clip=(-2.0, 2.0), post_clip=(-3.0, 3.0))
    problem = make_program_problem(batch, 7, network, outs, rule, time_rows=True, cond_rows=True, random_t=True,
                                   num_steps=5, return_chain=batch % 2 == 0)
    assert relative_error(problem.poisoned_call(), problem.reference64()) <= TOLERANCE


def test_a_plain_chain_as_a_program_is_the_plain_call():
    """The program "linear", act, ..., "linear" runs the same kernels as the network without one: equal bits."""
    problem = make_program_problem(37, 6, ["linear", "mish", "linear", "relu", "linear"], [64, 48, 6],
                                   make_rule("ddpm_epsilon", 10), time_rows=True, cond_rows=True, random_t=True)
    kwargs = dict(problem.kwargs)
    del kwargs["network"], kwargs["norm_weights"], kwargs["norm_biases"]
    plain = ddpm_ops.sample(problem.x, problem.t_start, rule=problem.rule, num_steps=problem.num_steps,
                            activations=["mish", "relu"], **kwargs)
    assert torch.equal(problem.call(), plain)


def test_bias_networks_with_a_program():
    g = torch.Generator().manual_seed(3)
    rule = dppo_rule("ddpm")
    problem = make_program_problem(11, 12, dppo_program("mish"), [64, 64, 64, 12], rule)
    time_net = ddpm_ops.BiasNet(torch.randn(len(rule), 16, generator=g), [torch.randn(32, 16, generator=g) * 0.2,
                                torch.randn(64, 32, generator=g) * 0.2], [torch.randn(32, generator=g)], "mish")
    cond_net = ddpm_ops.BiasNet(torch.randn(11, 5, generator=g), [torch.randn(64, 5, generator=g) * 0.3])
    problem.kwargs.update(time_net=time_net, cond_net=cond_net)
    assert relative_error(problem.poisoned_call(), problem.reference64()) <= TOLERANCE


def test_noise_clip_clamps_given_and_drawn_noise():
    """noise_clip clamps z before S scales it: a noise tensor of large values, and the op's own draws
    (their float64 values from ddpm_ops.seeded_noise), against the reference with the clamp; and the
    clamp binds."""
    rule = dppo_rule("ddpm", noise_clip=0.5)
    problem = make_program_problem(64, 12, dppo_program("relu"), [48, 48, 48, 12], rule, time_rows=True)
    problem.kwargs["noise"] = 3 * problem.kwargs["noise"]
    clipped = problem.poisoned_call()
    assert relative_error(clipped, problem.reference64()) <= TOLERANCE
    unclipped = ddpm_ops.StepRule(*rule.tables(), clip=rule.clip)
    free = ddpm_ops.sample(problem.x, problem.t_start, rule=unclipped, num_steps=problem.num_steps, **problem.kwargs)
    assert relative_error(clipped, free) > 1e-2
    # Noise drawn by the op, from a seed: the same clamp.
    del problem.kwargs["noise"]
    seed = torch.tensor([123456789])
    args = ddpm_ops.calls.op_args(
        ddpm_ops.calls.RULE, x=problem.x, t_start=problem.t_start, weights=problem.kwargs["weights"],
        biases=problem.kwargs["biases"], step_tables=rule.tables(), num_steps=problem.num_steps, activations=[],
        time_bias=problem.kwargs["time_bias"], clip=list(rule.clip), noise_seed=seed,
        network=problem.kwargs["network"], noise_clip=0.5)
    drawn = torch.ops.ddpm.fused_sample.rule(*args)
    problem.kwargs["noise"] = ddpm_ops.seeded_noise(seed, problem.num_steps, 64, 12).float()
    assert relative_error(drawn, problem.reference64()) <= TOLERANCE


def test_noise_clip_without_a_program():
    problem = make_program_problem(5, 4, ["linear", "silu", "linear"], [16, 4], dppo_rule("ddpm", noise_clip=1.0))
    problem.kwargs["activations"] = "silu"
    del problem.kwargs["network"], problem.kwargs["norm_weights"], problem.kwargs["norm_biases"]
    problem.kwargs["noise"] = 4 * problem.kwargs["noise"]
    assert relative_error(problem.call(), problem.reference64()) <= TOLERANCE


UNFUSED_SCRIPT = textwrap.dedent("""
    import torch
    from network_problems import *
    from problems import relative_error, make_rule
    worst = 0.0
    p = make_program_problem(5, 6, idql_program(1), [32, 128, 32, 6], idql_rule(), time_rows=True, cond_rows=True)
    worst = max(worst, relative_error(p.call(), p.reference64()))
    p = make_program_problem(7, 12, dppo_program("relu"), [40, 40, 40, 12], dppo_rule("ddim", noise_clip=0.7),
                             time_rows=True, return_chain=True)
    p.kwargs["noise"] *= 3
    worst = max(worst, relative_error(p.call(), p.reference64()))
    p = make_program_problem(4, 6, idql_mlp_program(hidden=2), [32, 32, 6], idql_rule(), in_width=6 + 5 + 8,
                             time_rows=8, cond_rows=5, random_t=True)
    worst = max(worst, relative_error(p.call(), p.reference64()))
    print(worst)
""")


def test_the_aten_loop_runs_programs():
    """The ATen loop (what devices without a fused kernel for programs run) forced on the CPU."""
    result = run_python(UNFUSED_SCRIPT, {"DDPM_OPS_CPU_UNFUSED": "1"})
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.strip().splitlines()[-1]) <= TOLERANCE


def test_opcheck_with_a_program():
    problem = make_program_problem(6, 5, ["input:x,cond,time", "layer_norm_affine:1e-05", "linear", "save",
                                          "mish", "linear", "add", "linear"], [16, 16, 5],
                                   make_rule("ddpm_epsilon", 8), in_width=5 + 3 + 4, time_rows=4, cond_rows=3,
                                   num_steps=3, random_t=True)
    k = problem.kwargs
    args = ddpm_ops.calls.op_args(
        ddpm_ops.calls.RULE, x=problem.x, t_start=problem.t_start, weights=k["weights"], biases=k["biases"],
        step_tables=problem.rule.tables(), num_steps=3, activations=[], noise=k["noise"],
        time_input=k["time_input"], cond_input=k["cond_input"], network=k["network"],
        norm_weights=k["norm_weights"], norm_biases=k["norm_biases"], noise_clip=1.5)
    opcheck(torch.ops.ddpm.fused_sample.rule, args)


def _op_call(**changes):
    """A valid program call of the op with some arguments changed (as keywords)."""
    g = torch.Generator().manual_seed(0)
    arguments = dict(x=torch.randn(3, 4), t_start=torch.full((3,), 4), step_tables=make_rule("ddpm_epsilon", 5).tables(),
                     num_steps=2, activations=[], network=["linear", "save", "layer_norm_affine:1e-05", "linear",
                                                          "add", "linear"],
                     weights=[torch.randn(8, 4, generator=g), torch.randn(8, 8, generator=g),
                              torch.randn(4, 8, generator=g)],
                     biases=[torch.randn(8, generator=g), torch.randn(8, generator=g), torch.randn(4, generator=g)],
                     norm_weights=[torch.ones(8)], norm_biases=[torch.zeros(8)])
    arguments.update(changes)
    return torch.ops.ddpm.fused_sample.rule(*ddpm_ops.calls.op_args(ddpm_ops.calls.RULE, **arguments))


@pytest.mark.parametrize("changes, message", [
    (dict(network=["linear", "swish", "linear", "linear"]), r'network\[1\] must be "linear", an activation .* got "swish"'),
    (dict(network=["linear", "add", "linear", "linear"]), r'network\[1\] "add" needs a saved h'),
    (dict(network=["linear", "save", "linear", "linear"]), r"network leaves 1 saved h unused"),
    (dict(network=["linear", "linear"]), r'one "linear" instruction per weight \(3\) and at least one, got 2'),
    (dict(network=["linear", "layer_norm:-1", "linear", "linear"]), r"expected a finite eps >= 0, got -1"),
    (dict(network=["linear", "layer_norm:abc", "linear", "linear"]), r'got "layer_norm:abc"'),
    (dict(network=["linear", "input:x", "linear", "linear"]), r'"input" instruction must be the first'),
    (dict(network=["input:x,state", "linear", "linear", "linear"]), r'parts must be x, cond or time.*got "state"'),
    (dict(network=["input:cond,x", "layer_norm_affine:1e-05", "linear", "linear", "linear"]), r"network reads cond_input .* but cond_input is None"),
    (dict(norm_weights=[]), r"norm_weights and norm_biases must hold one tensor per \"layer_norm_affine\" "
                            r"instruction \(1\), got 0 and 1"),
    (dict(norm_weights=[torch.ones(7)]), r"norm_weights\[0\] \(network\[2\] \"layer_norm_affine:1e-05\"\) must have "
                                         r"shape \(8,\) \(h's width there\), got shape \[7\]"),
    (dict(activations=["silu", "silu"]), r"activations must be empty with a network program"),
    (dict(network=None), r"norm_weights and norm_biases are the LayerNorms of a network program"),
    (dict(network=["linear", "save", "linear", "linear", "add"], norm_weights=[], norm_biases=[],
          weights=[torch.randn(8, 4), torch.randn(6, 8), torch.randn(4, 6)],
          biases=[torch.randn(8), torch.randn(6), torch.randn(4)]),
     r'network\[4\] "add" adds the saved h of 8 columns to h of 4 columns: expected equal widths'),
    (dict(weights=[torch.randn(8, 5), torch.randn(8, 8), torch.randn(4, 8)]),
     r"weights\[0\] \(network\[0\] \"linear\"\) must have the nn.Linear layout \(out_features, 4\) where "
     r"in_features = x's columns, got shape \[8, 5\]"),
    (dict(network=["linear", "save", "layer_norm_affine:1e-05", "linear", "add"], weights=[torch.randn(8, 4)] * 2
          + [torch.randn(4, 8)]), r"network must have one \"linear\" instruction per weight"),
    (dict(network=["linear", "save", "layer_norm_affine:1e-05", "linear", "add", "linear", "relu"],
          weights=[torch.randn(8, 4), torch.randn(8, 8), torch.randn(5, 8)],
          biases=[torch.randn(8), torch.randn(8), torch.randn(5)]),
     r"network must end with h of dim = 4 columns \(the network's output\), got 5"),
    (dict(noise_clip=0.0), r"noise_clip must be > 0 .* got 0"),
    (dict(noise_clip=float("nan")), r"noise_clip must be > 0"),
])
def test_bad_programs_are_refused_naming_the_argument(changes, message):
    with pytest.raises(RuntimeError, match=message):
        _op_call(**changes)
    # The Meta kernel runs the same checks.
    meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) else
                [t.to("meta") for t in v] if isinstance(v, list) and v and isinstance(v[0], torch.Tensor) else v)
            for k, v in changes.items()}
    with pytest.raises(RuntimeError, match=message):
        _op_call_meta(**meta)


def _op_call_meta(**changes):
    g = torch.Generator().manual_seed(0)
    base = dict(x=torch.randn(3, 4, generator=g), step_tables=make_rule("ddpm_epsilon", 5).tables(),
                weights=[torch.randn(8, 4, generator=g), torch.randn(8, 8, generator=g),
                         torch.randn(4, 8, generator=g)],
                biases=[torch.randn(8, generator=g), torch.randn(8, generator=g), torch.randn(4, generator=g)],
                norm_weights=[torch.ones(8)], norm_biases=[torch.zeros(8)])
    base = {k: (v.to("meta") if isinstance(v, torch.Tensor) else [t.to("meta") for t in v]) for k, v in base.items()}
    base.update(t_start=torch.full((3,), 4, device="meta"), num_steps=2, activations=[],
                network=["linear", "save", "layer_norm_affine:1e-05", "linear", "add", "linear"])
    base.update(changes)
    return torch.ops.ddpm.fused_sample.rule(*ddpm_ops.calls.op_args(ddpm_ops.calls.RULE, **base))


def test_sample_refuses_activations_beside_a_program():
    problem = make_program_problem(2, 3, ["linear", "relu", "linear"], [4, 3], make_rule("ddpm_epsilon", 3))
    with pytest.raises(ValueError, match="activations: expected none beside a network program"):
        problem.call(activations="relu")


def test_min_std_floors_the_noise_scale():
    betas = ddpm_ops.cosine_betas(20)
    plain = ddpm_ops.step_rules.ddpm(betas)
    floored = ddpm_ops.step_rules.ddpm(betas, min_std=0.1)
    assert torch.equal(floored.S[1:], plain.S[1:].clamp(min=0.1)) and floored.S[0] == 0
    assert bool((plain.S[1:] < 0.1).any())  # the floor binds somewhere
    last = ddpm_ops.step_rules.ddpm(betas, min_std=0.1, final_noise=True)
    assert last.S[0] == pytest.approx(0.1)
    assert torch.equal(floored.tables()[:5], plain.tables()[:5])
    abar = torch.cumprod(1 - betas, 0)
    ddim = ddpm_ops.step_rules.ddim(abar, torch.arange(0, 20, 4), eta=0.0, min_std=0.05)
    assert torch.equal(ddim.S, torch.full((5,), 0.05))
    with pytest.raises(ValueError, match="min_std: expected None or a finite number >= 0"):
        ddpm_ops.step_rules.ddpm(betas, min_std=-1.0)


def test_step_rule_noise_clip():
    rule = ddpm_ops.step_rules.ddpm(ddpm_ops.cosine_betas(5), noise_clip=3)
    assert rule.noise_clip == 3.0 and rule.to("cpu").noise_clip == 3.0
    assert "noise_clip=3.0" in repr(rule)
    for bad in (0, -1.0, float("inf"), True, "3"):
        with pytest.raises(ValueError, match="noise_clip: expected None or a finite number > 0"):
            ddpm_ops.StepRule(*rule.tables(), noise_clip=bad)


PATHS_SCRIPT = textwrap.dedent("""
    import torch
    from network_problems import *
    from problems import relative_error, make_rule
    worst = 0.0
    for batch in (1, 2, 5, 13, 40):
        p = make_program_problem(batch, 6, idql_program(2), [32, 128, 32, 128, 32, 6], idql_rule(), time_rows=True,
                                 cond_rows=True, random_t=True)
        worst = max(worst, relative_error(p.call(), p.reference64()))
        p = make_program_problem(batch, 7, ["input:time,x,cond", "layer_norm_affine:1e-05", "linear", "save", "relu",
                                            "linear", "relu", "linear", "add", "linear"], [33, 33, 33, 7],
                                 make_rule("ddim_eta", 6), in_width=7 + 3 + 5, time_rows=3, cond_rows=5, random_t=True,
                                 num_steps=4, return_chain=True)
        worst = max(worst, relative_error(p.call(), p.reference64()))
    print(worst)
""")

PROGRAM_PATHS = {
    "dot kernel on every tile": {"DDPM_OPS_CPU_STREAMED_DOT_ROWS": "1000000", "DDPM_OPS_CPU_DOT_ROWS": "1000000"},
    "register blocks on every tile": {"DDPM_OPS_CPU_STREAMED_DOT_ROWS": "0", "DDPM_OPS_CPU_DOT_ROWS": "0",
                                      "DDPM_OPS_CPU_SERIAL_BATCH": "0", "DDPM_OPS_CPU_VEC_TILE": "7"},
    "default isa": {"ATEN_CPU_CAPABILITY": "default", "DDPM_OPS_CPU_VEC_TILE": "3"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "DDPM_OPS_CPU_DOT_ROWS": "5"},
    "layers split between threads": {"OMP_NUM_THREADS": "2", "DDPM_OPS_CPU_SPLIT_WEIGHTS": "1"},
    "avx2, layers split between threads": {"ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "3",
                                           "DDPM_OPS_CPU_SPLIT_WEIGHTS": "1"},
}


@pytest.mark.parametrize("path", sorted(PROGRAM_PATHS))
def test_program_cpu_paths(path):
    """Each CPU path a program can take (the ISA builds, the single- and multi-row dot kernels, register
    blocks, the generic build whose large tiles would use BLAS without a program, a small batch's layers
    split between the threads), forced in a fresh process."""
    result = run_python(PATHS_SCRIPT, PROGRAM_PATHS[path])
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.strip().splitlines()[-1]) <= TOLERANCE


def _to(problem, device):
    """The problem's tensors on ``device``: the rule's, the lists' and the bias networks' too."""
    def move(value):
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            return [v.to(device) for v in value]
        if isinstance(value, ddpm_ops.BiasNet):
            return dataclasses.replace(value, input=move(value.input), weights=move(list(value.weights)),
                                       biases=move(list(value.biases)))
        return value
    problem.x, problem.t_start, problem.rule = problem.x.to(device), problem.t_start.to(device), problem.rule.to(device)
    problem.kwargs = {k: move(v) for k, v in problem.kwargs.items()}
    return problem


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", ["idql", "idql_mlp", "dppo_ddpm", "dppo_ddim"])
@pytest.mark.parametrize("batch", [1, 40, 256])
def test_programs_on_cuda(shape, batch):
    """The shapes on CUDA (fp32_rule; tests/test_cuda_networks.py checks its one launch), against
    float64, noise clipped, drawn noise too."""
    if shape == "idql":
        problem = idql_problem(batch)
    elif shape == "idql_mlp":
        problem = make_program_problem(batch, ACTION, idql_mlp_program(), [256, 256, 256, ACTION], idql_rule(),
                                       in_width=ACTION + STATE + 128, time_rows=128, cond_rows=STATE, random_t=True)
    else:
        problem = make_program_problem(batch, 12, dppo_program("mish"), [512, 512, 512, 12], dppo_rule(shape[5:]),
                                       time_rows=True, cond_rows=True, return_chain=True)
        problem.kwargs["noise"] = 2 * problem.kwargs["noise"]
    expected = problem.reference64()
    out = _to(problem, "cuda").call()
    assert relative_error(out, expected) <= TOLERANCE
    del problem.kwargs["noise"]
    drawn = problem.call(generator=torch.Generator("cuda").manual_seed(0))
    assert torch.isfinite(drawn).all() and drawn.shape == out.shape
