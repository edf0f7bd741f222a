"""Network programs and the noise clamp on CUDA: a program's call runs on fp32_rule in one
launch (IDQL's LN-ResNet and its MLP with a LayerNorm over the whole input, DPPO's residual
MLP) against float64, alone or in clusters of every size, with the noise given, drawn from a
seed and from a generator, clipped by noise_clip; noise_clip on every engine kernel without a
program."""
import dataclasses

import pytest
import torch

import ddpm_ops
from ddpm_ops.cuda_plan import current_device
from ddpm_ops.calls import RULE, bias_net_args, op_args
from ddpm_ops.ops import _clamp_args
from network_problems import dppo_program, dppo_rule, idql_mlp_program, idql_rule, make_program_problem
from problems import make_rule, relative_error
from test_cuda_engine import ENGINE_KERNELS, engine, kernels_of, launched, log_name  # noqa: F401 (engine: a fixture)
from test_networks import ACTION, HIDDEN, PROGRAMS, STATE, TOLERANCE, _to, idql_problem

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

OBS = 11  # DPPO's observation: the columns of the first Linear that cond_net holds


def dppo_problem(batch, kind, activation="mish", **options):
    """DPPO's residual MLP: action 3 x chunk 4 (12), widths 512, the time features as time_bias
    rows and the observation's 11 columns of the first Linear as a cond_net; the whole chain,
    noise with values past the rule's clip of 3."""
    problem = make_program_problem(batch, 12, dppo_program(activation), [512, 512, 512, 12], dppo_rule(kind),
                                   time_rows=True, return_chain=True, **options)
    g = torch.Generator().manual_seed(batch)
    obs = torch.randn(batch, OBS, generator=g)
    problem.kwargs["cond_net"] = ddpm_ops.BiasNet(obs, [(torch.rand(512, OBS, generator=g) * 2 - 1) * OBS ** -0.5])
    if "noise" in problem.kwargs:
        problem.kwargs["noise"] = 2 * problem.kwargs["noise"]
    return problem


def idql_mlp_problem(batch, **options):
    """IDQL's default MLP: a LayerNorm over cat[a, s, time features (128)], three Mish layers of 256."""
    return make_program_problem(batch, ACTION, idql_mlp_program(), [HIDDEN, HIDDEN, HIDDEN, ACTION], idql_rule(),
                                in_width=ACTION + STATE + 128, time_rows=128, cond_rows=STATE, random_t=True,
                                **options)


SHAPES = {
    "idql": (idql_problem, [1, 64, 1024, 4096]),
    "idql_mlp": (idql_mlp_problem, [1, 64, 1024, 4096]),
    "dppo_ddpm_relu": (lambda batch, **o: dppo_problem(batch, "ddpm", "relu", **o), [1, 40, 256]),
    "dppo_ddpm_mish": (lambda batch, **o: dppo_problem(batch, "ddpm", "mish", **o), [1, 40, 256]),
    "dppo_ddim_relu": (lambda batch, **o: dppo_problem(batch, "ddim", "relu", **o), [1, 40, 256]),
    "dppo_ddim_mish": (lambda batch, **o: dppo_problem(batch, "ddim", "mish", **o), [1, 40, 256]),
}
CASES = [(shape, batch) for shape, (_, batches) in SHAPES.items() for batch in batches]


@pytest.fixture
def logged(monkeypatch):
    """DDPM_OPS_CUDA_LOG on, the plan's own choice (no kernel, cluster size or capability forced)."""
    monkeypatch.setenv("DDPM_OPS_CUDA_LOG", "1")
    for variable in ("DDPM_OPS_CUDA_KERNEL", "DDPM_OPS_CUDA_CLUSTER_SIZE", "DDPM_OPS_CUDA_CAPABILITY"):
        monkeypatch.delenv(variable, raising=False)


def with_noise_clip(rule, noise_clip):
    return dataclasses.replace(rule, noise_clip=noise_clip)


def on_cuda(shape, batch, **options):
    """The problem of ``shape`` and its float64 reference (computed on the CPU before the move)."""
    problem = SHAPES[shape][0](batch, **options)
    expected = problem.reference64()
    return _to(problem, "cuda"), expected


def call_op(problem, **changes):
    """The problem's call of the op itself, as ddpm_ops.sample makes it, with ``changes``
    (op arguments by name): for the arguments sample does not take (noise_seed)."""
    k, rule = problem.kwargs, problem.rule
    clip, clip_bounds = _clamp_args("clip", rule.clip, problem.x)
    post_clip, post_clip_bounds = _clamp_args("post_clip", rule.post_clip, problem.x)
    arguments = dict(x=problem.x, t_start=problem.t_start, weights=k["weights"], biases=k["biases"],
                     step_tables=rule.tables(), num_steps=problem.num_steps, activations=[],
                     time_bias=k.get("time_bias"), cond_bias=k.get("cond_bias"), clip=clip, post_clip=post_clip,
                     clip_bounds=clip_bounds, post_clip_bounds=post_clip_bounds, noise=k.get("noise"),
                     return_chain=k.get("return_chain", False), network=k["network"],
                     norm_weights=k["norm_weights"], norm_biases=k["norm_biases"], noise_clip=rule.noise_clip,
                     **bias_net_args("time", k.get("time_net")), **bias_net_args("cond", k.get("cond_net")),
                     **{name: k[name] for name in ("time_input", "cond_input") if name in k})
    arguments.update(changes)
    return torch.ops.ddpm.fused_sample.rule(*op_args(RULE, **arguments))


def poisoned(problem, **extra):
    """The call right after freeing a NaN block of the output's size on the GPU: an output
    element the kernel never writes shows up as NaN."""
    chain = problem.kwargs.get("return_chain", False)
    poison = torch.full(((problem.num_steps + 1 if chain else 1) * problem.x.numel(),), float("nan"), device="cuda")
    del poison
    return problem.call(**extra)


@pytest.mark.parametrize("shape, batch", CASES)
def test_programs_match_float64_in_one_launch(logged, capfd, shape, batch):
    """Noise given: one launch of fp32_rule, every element written, within 1e-5 of float64."""
    problem, expected = on_cuda(shape, batch)
    capfd.readouterr()
    out = poisoned(problem)
    torch.cuda.synchronize()
    assert launched(capfd) == ["rule"]
    assert out.shape == expected.shape
    assert not torch.isnan(out).any()
    assert relative_error(out, expected) <= TOLERANCE


def cluster_launches(size):
    """Whether clusters of ``size`` CTAs launch on this GPU with this build (the plan's own test)."""
    device = current_device()
    return device.sm90a_build and device.capability == (9, 0) and device.max_clusters[size] > 0


def forced_cluster(monkeypatch, capfd, size):
    """DDPM_OPS_CUDA_CLUSTER_SIZE=size (the log on, nothing else forced); skips a size this GPU
    does not launch."""
    if size > 1 and not cluster_launches(size):
        pytest.skip(f"clusters of {size} do not launch here")
    monkeypatch.setenv("DDPM_OPS_CUDA_CLUSTER_SIZE", str(size))
    capfd.readouterr()


def rule_log(capfd):
    """The fp32_rule launch lines printed since the last call."""
    return [line for line in capfd.readouterr().err.splitlines() if line.startswith("ddpm_ops rule kernel")]


def assert_ran_in(lines, size):
    """One fp32_rule launch, in clusters of ``size`` (1: a plain launch)."""
    assert len(lines) == 1, lines
    assert ("cluster size" not in lines[0]) if size == 1 else (f"cluster size {size} " in lines[0]), lines


def exact_in_clusters(monkeypatch, capfd, problem, expected, size):
    """The call in clusters of ``size``: one fp32_rule launch of that shape, every element
    written, within 1e-5 of float64."""
    forced_cluster(monkeypatch, capfd, size)
    out = poisoned(problem)
    torch.cuda.synchronize()
    assert_ran_in(rule_log(capfd), size)
    assert not torch.isnan(out).any()
    assert relative_error(out, expected) <= TOLERANCE


CLUSTER_SIZES = [1, 2, 3, 4, 8, 16]


@pytest.mark.parametrize("size", CLUSTER_SIZES)
@pytest.mark.parametrize("name", sorted(PROGRAMS))
@pytest.mark.parametrize("batch", [1, 6, 50])
def test_every_instruction_in_clusters_of_every_size(logged, monkeypatch, capfd, size, name, batch):
    """Each CTA of a cluster computes a share of every Linear's columns (widths 7 to 40, not
    multiples of the shares) and stores them into all; the LayerNorms (with and without affine
    parameters), nested residuals and activations run on every CTA's copy: within 1e-5 of
    float64, every element written, the chain too."""
    network, outs = PROGRAMS[name]
    rule = make_rule("ddim_eta", 9, clip=(-2.0, 2.0), post_clip=(-3.0, 3.0))
    problem = make_program_problem(batch, 7, network, outs, rule, time_rows=True, cond_rows=True, random_t=True,
                                   num_steps=5, return_chain=batch % 2 == 0)
    expected = problem.reference64()
    _to(problem, "cuda")
    exact_in_clusters(monkeypatch, capfd, problem, expected, size)


@pytest.mark.parametrize("size", CLUSTER_SIZES)
@pytest.mark.parametrize("shape, batch", [("idql", 1), ("idql", 37), ("idql_mlp", 8), ("dppo_ddpm_mish", 40),
                                          ("dppo_ddim_relu", 3)])
def test_project_programs_in_clusters_of_every_size(logged, monkeypatch, capfd, size, shape, batch):
    """IDQL's and DPPO's programs (1024- and 512-wide layers streamed from L2 in shares, an input
    LayerNorm over cat[a, s, time]) in clusters of every size, noise given and drawn from a seed."""
    problem, expected = on_cuda(shape, batch)
    exact_in_clusters(monkeypatch, capfd, problem, expected, size)
    seed = torch.tensor([1234567], device="cuda")
    noise = problem.kwargs.pop("noise")
    drawn = call_op(problem, noise_seed=seed)
    problem.kwargs["noise"] = ddpm_ops.seeded_noise(seed.cpu(), problem.num_steps, batch, noise.shape[2]).float()
    assert relative_error(drawn, _to(problem, "cpu").reference64()) <= TOLERANCE


@pytest.mark.parametrize("size", CLUSTER_SIZES)
@pytest.mark.parametrize("batch", [1, 50, 256])
def test_a_plain_chain_in_clusters_of_every_size(monkeypatch, capfd, size, batch):
    """Without a program, fp32_rule's chain of Linear layers (the Diffusion-QL policy's widths, a
    first layer read from a wider weight's columns) in clusters, time and cond rows, clip and
    noise: within 1e-5 of float64."""
    monkeypatch.setenv("DDPM_OPS_CUDA_LOG", "1")
    monkeypatch.setenv("DDPM_OPS_CUDA_KERNEL", "rule")
    problem = make_program_problem(batch, 6, ["linear", "mish", "linear", "mish", "linear", "mish", "linear"],
                                   [256, 256, 256, 6], dppo_rule("ddpm"), time_rows=True, cond_rows=True)
    for name in ("network", "norm_weights", "norm_biases"):
        del problem.kwargs[name]
    problem.kwargs["activations"] = "mish"
    expected = problem.reference64()
    _to(problem, "cuda")
    wide = torch.randn(256, 30, device="cuda")
    wide[:, 3:9] = problem.kwargs["weights"][0]
    problem.kwargs["weights"][0] = wide[:, 3:9]  # a view: row stride 30, offset 3
    exact_in_clusters(monkeypatch, capfd, problem, expected, size)


# Programs fp32_rule cannot hold: an input of 60004 columns (two buffers of it pass the shared
# memory), and 68 instructions (over kMaxProgramOps).
TOO_BIG = {
    "too wide for shared memory": dict(network=["input:x,cond", "layer_norm:1e-05", "linear", "relu", "linear"],
                                       outs=[8, 4], in_width=4 + 60000, cond_rows=60000),
    "too many instructions": dict(network=["linear", *["save", "relu", "linear", "add"] * 22, "linear"],
                                  outs=[16] * 23 + [4]),
}


@pytest.mark.parametrize("case", sorted(TOO_BIG))
def test_a_program_fp32_rule_cannot_hold_runs_the_aten_loop(logged, capfd, case):
    options = dict(TOO_BIG[case])
    problem = make_program_problem(3, 4, options.pop("network"), options.pop("outs"), make_rule("ddpm_epsilon", 6),
                                   num_steps=3, **options)
    expected = problem.reference64()
    _to(problem, "cuda")
    capfd.readouterr()
    out = problem.call()
    torch.cuda.synchronize()
    assert launched(capfd) == []  # no fused kernel's launch line
    assert relative_error(out, expected) <= TOLERANCE


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_one_cuda_kernel_per_program_call(shape):
    """The profiler's count of CUDA kernels in one call: noise given, and noise drawn from a generator."""
    problem, _ = on_cuda(shape, 40)
    assert len(kernels_of(lambda: problem.call())) == 1
    del problem.kwargs["noise"]
    generator = torch.Generator("cuda").manual_seed(5)
    assert len(kernels_of(lambda: problem.call(generator=generator))) == 1


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_noise_drawn_from_a_seed_and_clipped(shape):
    """The op's own draws (noise_seed; their float64 values from ddpm_ops.seeded_noise) clamped to
    the rule's noise_clip (DPPO's 3; IDQL's rule has none: 0.5 here), against float64."""
    problem, _ = on_cuda(shape, 64)
    if problem.rule.noise_clip is None:
        problem.rule = with_noise_clip(problem.rule, 0.5)
    seed = torch.tensor([987654321], device="cuda")
    del problem.kwargs["noise"]
    out = call_op(problem, noise_seed=seed)
    problem.kwargs["noise"] = ddpm_ops.seeded_noise(seed.cpu(), problem.num_steps, 64, problem.x.shape[1]).float()
    expected = _to(problem, "cpu").reference64()
    assert not torch.isnan(out).any()
    assert relative_error(out, expected) <= TOLERANCE


@pytest.mark.parametrize("shape", ["idql", "idql_mlp", "dppo_ddpm_mish", "dppo_ddim_relu"])
def test_a_tiny_noise_clip_binds(shape):
    """noise_clip 1e-3: with the noise given, the result differs from the unclipped one and is
    the float64 reference of the clamped noise (no clip in its rule); drawn from a generator, the
    same seed gives the same numbers twice, a clipped draw differs from an unclipped one and is
    close to the result without noise."""
    problem, _ = on_cuda(shape, 40)
    clip = 1e-3
    noise = problem.kwargs["noise"]
    rule = problem.rule
    problem.rule = with_noise_clip(rule, clip)
    clipped = problem.call()
    problem.rule = with_noise_clip(rule, None)
    free = problem.call()
    assert relative_error(clipped, free.double()) > 1e-2
    problem.kwargs["noise"] = noise.clamp(-clip, clip)
    assert relative_error(clipped, _to(problem, "cpu").reference64()) <= TOLERANCE
    _to(problem, "cuda")
    problem.kwargs["noise"] = torch.zeros_like(noise)
    noiseless = _to(problem, "cpu").reference64()
    _to(problem, "cuda")
    del problem.kwargs["noise"]

    def drawn(seed, noise_clip):
        problem.rule = with_noise_clip(rule, noise_clip)
        return problem.call(generator=torch.Generator("cuda").manual_seed(seed))
    first, again, other = drawn(7, clip), drawn(7, clip), drawn(8, clip)
    assert torch.isfinite(first).all()
    assert torch.equal(first, again) and not torch.equal(first, other)
    unclipped = drawn(7, None)
    assert relative_error(first, unclipped.double()) > 1e-2
    # Every z is within 1e-3: the result is the noiseless one but for S[s] 1e-3 per step.
    assert relative_error(first, noiseless) < relative_error(unclipped, noiseless) / 10


@pytest.mark.parametrize("kernel", ENGINE_KERNELS)
def test_noise_clip_on_every_engine_kernel(engine, capfd, kernel):  # noqa: F811 (engine: the fixture)
    """noise_clip without a program, in the epilogue every engine kernel shares: noise given
    (three times the rule's clip of 0.5) and drawn from a seed."""
    engine(kernel)
    problem = make_program_problem(50, 6, ["linear", "mish", "linear", "mish", "linear", "mish", "linear"],
                                   [256, 256, 256, 6], dppo_rule("ddpm", noise_clip=0.5), time_rows=True,
                                   cond_rows=True)
    for name in ("network", "norm_weights", "norm_biases"):
        del problem.kwargs[name]
    problem.kwargs["activations"] = "mish"
    problem.kwargs["noise"] = 3 * problem.kwargs["noise"]
    expected = problem.reference64()
    _to(problem, "cuda")
    capfd.readouterr()
    out = problem.call()
    assert launched(capfd) == [log_name(kernel)]
    assert relative_error(out, expected) <= TOLERANCE
    seed = torch.tensor([42], device="cuda")
    k, rule = problem.kwargs, problem.rule
    clip, _ = _clamp_args("clip", rule.clip, problem.x)
    drawn = torch.ops.ddpm.fused_sample.rule(*op_args(
        RULE, x=problem.x, t_start=problem.t_start, weights=k["weights"], biases=k["biases"],
        step_tables=rule.tables(), num_steps=problem.num_steps, activations=["mish"] * 3,
        time_bias=k["time_bias"], cond_bias=k["cond_bias"], clip=clip, noise_seed=seed, noise_clip=0.5))
    assert launched(capfd) == [log_name(kernel)]
    problem.kwargs["noise"] = ddpm_ops.seeded_noise(seed.cpu(), problem.num_steps, 50, 6).float()
    assert relative_error(drawn, _to(problem, "cpu").reference64()) <= TOLERANCE
