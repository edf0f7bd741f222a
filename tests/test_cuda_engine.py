"""The engine on CUDA: every kernel that runs the general step (fp32_resident,
tf32x3_tiled in each tile height and in clusters, fp32_rule), forced through
DDPM_OPS_CUDA_KERNEL (and DDPM_OPS_CUDA_CLUSTER_SIZE) and checked by its launch line,
with every feature of the rule against float64; the time-column overload
through the engine's adapter; the portable path (a plan for compute
capability 8.x, DDPM_OPS_CUDA_CAPABILITY) for both overloads; and the kernels
one call launches."""
import copy

import pytest
import torch

import ddpm_ops
import ddpm_ops.cuda_plan
from problems import make_problem, make_rule_problem, relative_error
from test_sample import ALL_FEATURES, FEATURES, TOLERANCE, poisoned_call

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# A kernel's DDPM_OPS_CUDA_KERNEL name, with "@n" for DDPM_OPS_CUDA_CLUSTER_SIZE=n.
TILED_KERNELS = ("tiled16", "tiled32", "tiled64", "tiled16@4", "tiled16@16")
ENGINE_KERNELS = ("fp32_resident", *TILED_KERNELS, "fp32_rule")


def log_name(kernel):
    """The name a kernel's DDPM_OPS_CUDA_LOG line gives."""
    return "tiled" if kernel.startswith("tiled") else {"fp32_resident": "resident", "fp32_rule": "rule"}[kernel]


PLAN_NAMES = {"fp32_resident": "resident", "tf32x3_tiled": "tiled", "fp32_rule": "rule"}


def expected_launch(kernel, batch, dim, hidden, num_steps, features):
    """What a forced engine kernel launches for a call: itself where the plan
    fits it to the call, else the plan's fallback (fp32_rule: a 32- or 64-row
    tile of 1024-wide activations, or with a previous-x0 buffer beside it,
    can outgrow shared memory). Asked of the plan for this GPU, so the test
    checks that the plan and the launch agree."""
    name, _, cluster_size = kernel.partition("@")
    overrides = {"DDPM_OPS_CUDA_KERNEL": name}
    if cluster_size:
        overrides["DDPM_OPS_CUDA_CLUSTER_SIZE"] = cluster_size
    plan = ddpm_ops.cuda_plan.plan_for(batch, dim, hidden, num_steps, general_step=True,
                                       previous_x0="previous" in features, overrides=overrides,
                                       device=ddpm_ops.cuda_plan.current_device())
    return PLAN_NAMES[plan["kernel"]]


def launched(capfd):
    """The kernels named by the DDPM_OPS_CUDA_LOG lines printed since the last call."""
    return [line.split()[1] for line in capfd.readouterr().err.splitlines() if line.startswith("ddpm_ops ")]


@pytest.fixture
def engine(monkeypatch):
    def force(kernel, capability=None):
        monkeypatch.setenv("DDPM_OPS_CUDA_LOG", "1")
        name, _, cluster_size = (kernel or "").partition("@")
        for variable, value in (("DDPM_OPS_CUDA_KERNEL", name), ("DDPM_OPS_CUDA_CLUSTER_SIZE", cluster_size)):
            if value:
                monkeypatch.setenv(variable, value)
            else:
                monkeypatch.delenv(variable, raising=False)
        if capability:
            monkeypatch.setenv("DDPM_OPS_CUDA_CAPABILITY", capability)
        else:
            monkeypatch.delenv("DDPM_OPS_CUDA_CAPABILITY", raising=False)
    return force


# Shapes inside fp32_resident's envelope (2 to 4 layers, one hidden width of
# at most 256, dim at most 64) at its edges: 1 to 8 rows per cluster, every
# outputs-per-warp choice, a partly filled last cluster.
RESIDENT_SHAPES = [
    (1, 6, [256, 256, 256], 5),
    (50, 6, [256, 256, 256], 5),
    (7, 64, [256, 256], 3),
    (33, 1, [64], 4),
    (100, 17, [128, 128, 128], 6),
    (3, 12, [32, 32], 2),
]


@pytest.mark.parametrize("kernel", ENGINE_KERNELS)
@pytest.mark.parametrize("batch, dim, hidden, num_steps", RESIDENT_SHAPES)
@pytest.mark.parametrize("features", [(), FEATURES, ALL_FEATURES, ("seeded", "clip", "post_clip", "time_net"),
                                      ("previous", "clip_bounds", "post_clip_bounds", "noise", "time"),
                                      ("row_seeds", "previous", "clip", "chain", "cond_net")])
def test_every_engine_kernel_every_feature(engine, capfd, kernel, batch, dim, hidden, num_steps, features):
    engine(kernel)
    problem = make_rule_problem(batch, dim, hidden, num_steps, features=features, activation="mixed",
                                rule="ddim_strided" if "chain" in features else "ddpm_epsilon", device="cuda")
    capfd.readouterr()
    out = poisoned_call(problem)
    assert launched(capfd) == [expected_launch(kernel, batch, dim, hidden, num_steps, features)]
    assert relative_error(out, problem.reference64()) <= TOLERANCE


@pytest.mark.parametrize("activation", ["silu", "mish", "relu", "gelu", "gelu_tanh", "tanh", "identity"])
def test_every_activation_on_the_resident_kernel(engine, capfd, activation):
    engine("fp32_resident")
    problem = make_rule_problem(9, 5, [64, 64, 64], 4, features=("time", "noise"), activation=activation,
                                device="cuda")
    capfd.readouterr()
    out = poisoned_call(problem)
    assert launched(capfd) == ["resident"]
    assert relative_error(out, problem.reference64()) <= TOLERANCE


@pytest.mark.parametrize("kernel", ENGINE_KERNELS)
def test_odd_layouts(engine, capfd, kernel):
    """Strided, offset and transposed inputs reach the kernels as contiguous copies."""
    engine(kernel)
    problem = make_rule_problem(20, 6, [64, 64], 3, features=("time", "cond", "noise", "clip"), device="cuda")
    expected = problem.reference64()
    problem.x = torch.empty(6, 20, device="cuda").copy_(problem.x.T).T
    problem.t_start = torch.stack([problem.t_start, problem.t_start], dim=1)[:, 1]
    w0 = problem.weights[0]
    problem.weights[0] = torch.cat([torch.zeros_like(w0), w0], dim=1)[:, 6:]
    problem.biases[1] = torch.cat([torch.zeros(1, device="cuda"), problem.biases[1]])[1:]
    capfd.readouterr()
    assert relative_error(poisoned_call(problem), expected) <= TOLERANCE
    assert launched(capfd) == [log_name(kernel)]


@pytest.mark.parametrize("kernel", ENGINE_KERNELS)
def test_rows_out_of_range_are_nan(engine, kernel):
    engine(kernel)
    problem = make_rule_problem(12, 5, [32, 32], 4, features=("clip", "noise", "chain"), device="cuda")
    problem.t_start[3] = 1  # below num_steps - 1
    problem.t_start[7] = 10 ** 6  # beyond the tables
    out = poisoned_call(problem)
    assert torch.isnan(out[:, [3, 7]]).all()
    assert not torch.isnan(out[:, [0, 1, 2, 4, 5, 6, 8, 9, 10, 11]]).any()


def test_seeded_noise_is_the_same_on_every_kernel(engine):
    outs = []
    for kernel in ENGINE_KERNELS:
        engine(kernel)
        problem = make_rule_problem(40, 6, [128, 128], 5, features=("seeded", "chain"), rule="ddpm_sample",
                                    device="cuda", generator=torch.Generator().manual_seed(11))
        outs.append(poisoned_call(problem))
        assert relative_error(outs[-1], problem.reference64()) <= TOLERANCE
    for out in outs[1:]:
        assert relative_error(outs[0], out.cpu().double()) <= TOLERANCE


# tf32x3_tiled at its envelope's edges: a tile exactly full and one row over,
# 64-row tiles, dim 1 and dim beyond fp32_resident's 64, widths off every
# multiple of 8 and 32, a 1024-wide policy net, five layers, one hidden layer.
TILED_SHAPES = [
    (16, 6, [256, 256, 256], 5),
    (17, 1, [200, 72], 3),
    (65, 100, [256, 256], 4),
    (300, 12, [1024, 1024, 1024], 5),
    (130, 11, [96, 96, 96, 96], 6),
    (5, 3, [40], 7),
]


@pytest.mark.parametrize("kernel", TILED_KERNELS)
@pytest.mark.parametrize("batch, dim, hidden, num_steps", TILED_SHAPES)
@pytest.mark.parametrize("features", [ALL_FEATURES, ("seeded", "previous", "clip_bounds", "time_net", "cond_net"),
                                      ("row_seeds", "post_clip_bounds", "chain", "time", "cond")])
def test_tiled_shapes_every_feature(engine, capfd, kernel, batch, dim, hidden, num_steps, features):
    engine(kernel)
    problem = make_rule_problem(batch, dim, hidden, num_steps, features=features, activation="mixed",
                                rule="ddim_strided" if "chain" in features else "ddpm_epsilon", device="cuda")
    capfd.readouterr()
    out = poisoned_call(problem)
    expected = expected_launch(kernel, batch, dim, hidden, num_steps, features)
    # 16-row tiles fit every shape here: the test cannot pass by falling back everywhere.
    assert expected == "tiled" or not kernel.startswith("tiled16")
    assert launched(capfd) == [expected]
    assert relative_error(out, problem.reference64()) <= TOLERANCE


@pytest.mark.parametrize("kernel", ENGINE_KERNELS)
@pytest.mark.parametrize("batch, dim, hidden, num_steps", [(1, 64, [256, 256, 256], 16), (40, 7, [64, 64], 5),
                                                           (3, 2, [128], 9)])
def test_time_column_overload_through_the_engine(engine, capfd, kernel, batch, dim, hidden, num_steps):
    engine(kernel)
    problem = make_problem(batch, dim, hidden, num_steps, device="cuda")
    capfd.readouterr()
    out = torch.ops.ddpm.fused_sample(*problem.args())
    assert launched(capfd) == [log_name(kernel)]
    assert relative_error(out, problem.reference64()) <= TOLERANCE


@pytest.mark.parametrize("capability", ["8.0", "8.6", "8.7", "8.9"])
@pytest.mark.parametrize("kernel, expected", [(None, "rule"), ("tiled16", "tiled"), ("tiled64", "tiled"),
                                              ("fp32_resident", "rule"), ("rule", "rule")])
def test_portable_path_runs_both_overloads(engine, capfd, capability, kernel, expected):
    """A plan for a GPU without clusters, wgmma or TMA: below batch 768
    fp32_rule, and tf32x3_tiled in tiles of one CTA (a plain launch, "cluster
    size 0"; cp.async chunks) where asked for (a Hopper kernel asked for
    leaves the call to fp32_rule)."""
    engine(kernel, capability)
    rule = make_rule_problem(70, 6, [256, 256, 256], 5, features=ALL_FEATURES, activation="mixed",
                             device="cuda")
    seed = make_problem(30, 64, [256, 256, 256], 16, device="cuda")
    capfd.readouterr()
    out_rule = poisoned_call(rule)
    out_seed = torch.ops.ddpm.fused_sample(*seed.args())
    lines = capfd.readouterr().err
    assert [line.split()[1] for line in lines.splitlines() if line.startswith("ddpm_ops ")] == [expected] * 2
    if expected == "tiled":
        assert "cluster size 0" in lines and " tma" not in lines, lines
    assert relative_error(out_rule, rule.reference64()) <= TOLERANCE
    assert relative_error(out_seed, seed.reference64()) <= TOLERANCE


def kernels_of(fn):
    """The CUDA kernels one call of fn launches (after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def dql_sampler(batch):
    """A Diffusion-QL-shaped DiffusionSampler (sinusoidal time MLP, state columns, 3 Mish layers)."""
    import math
    from torch import nn

    class Sinusoidal(nn.Module):
        def forward(self, t):
            freqs = torch.exp(torch.arange(8, device=t.device) * -(math.log(10000) / 7))
            angles = t[:, None].float() * freqs[None]
            return torch.cat([angles.sin(), angles.cos()], dim=-1)

    time_mlp = nn.Sequential(Sinusoidal(), nn.Linear(16, 32), nn.Mish(), nn.Linear(32, 16))
    mid = nn.Sequential(nn.Linear(6 + 16 + 17, 256), nn.Mish(), nn.Linear(256, 256), nn.Mish(),
                        nn.Linear(256, 256), nn.Mish(), nn.Linear(256, 6))
    rule = ddpm_ops.step_rules.ddpm(ddpm_ops.linear_betas(5, 1e-4, 0.1), clip=1.0)
    sampler = ddpm_ops.DiffusionSampler(mid, rule, torch.arange(5), time_embedding=time_mlp,
                                        layout=(("x", 6), ("time", 16), ("cond", 17))).cuda()
    return sampler, time_mlp, mid


def test_kernels_per_call():
    """The op with bias networks, sample and DiffusionSampler: one launch each, the noise
    given or drawn from a generator's Philox state inside the launch."""
    problem = make_rule_problem(50, 6, [256, 256, 256], 5, features=("time_net", "cond_net", "clip", "seeded"),
                                device="cuda")
    assert len(kernels_of(lambda: torch.ops.ddpm.fused_sample.rule(*problem.args()))) == 1
    args = (problem.x, problem.t_start, problem.weights, problem.biases, problem.rule, 5)
    kw = dict(activations=problem.activations, time_net=problem.time_net, cond_net=problem.cond_net)
    noise = torch.randn(5, 50, 6, device="cuda")
    assert len(kernels_of(lambda: ddpm_ops.sample(*args, noise=noise, **kw))) == 1
    assert len(kernels_of(lambda: ddpm_ops.sample(*args, **kw))) == 1
    sampler, _, _ = dql_sampler(50)
    x, state = torch.randn(50, 6, device="cuda"), torch.randn(50, 17, device="cuda")
    with torch.no_grad():
        assert len(kernels_of(lambda: sampler(x, cond=state, noise=noise))) == 1
        assert len(kernels_of(lambda: sampler(x, cond=state))) == 1


def test_diffusion_sampler_matches_its_modules():
    """DiffusionSampler's bias networks against the project's own loop in float64."""
    sampler, time_mlp, mid = dql_sampler(33)
    x, state = torch.randn(33, 6, device="cuda"), torch.randn(33, 17, device="cuda")
    noise = torch.randn(5, 33, 6, device="cuda")
    with torch.no_grad():
        out = sampler(x, cond=state, noise=noise)
        A, B, C, D, E, S = (getattr(sampler.rule, name).double().cuda() for name in "ABCDES")
        x64, time64, mid64 = x.double(), copy.deepcopy(time_mlp[1:]).double(), copy.deepcopy(mid).double()
        for k in range(5):
            s = 4 - k
            t = torch.full((33,), s, device="cuda")
            e = mid64(torch.cat([x64, time64(time_mlp[0](t).double()), state.double()], dim=1))
            x0 = (A[s] * x64 - B[s] * e).clamp(-1, 1)
            x64 = C[s] * x0 + D[s] * x64 + E[s] * e + S[s] * noise[k].double()
    assert relative_error(out, x64) <= TOLERANCE


def test_cuda_graph_replays_draw_fresh_seeds():
    problem = make_rule_problem(16, 6, [64, 64], 5, features=("clip",), rule="ddpm_sample", device="cuda")
    args = (problem.x, problem.t_start, problem.weights, problem.biases, problem.rule, 5)
    torch.manual_seed(3)
    ddpm_ops.sample(*args, activations=problem.activations)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ddpm_ops.sample(*args, activations=problem.activations)
    graph.replay()
    first = out.clone()
    graph.replay()
    assert torch.isfinite(first).all() and not torch.equal(first, out)


@pytest.mark.parametrize("kernel", ENGINE_KERNELS)
def test_generator_noise_has_the_normal_moments(engine, kernel):
    """Noise from the generator's Philox state: standard normal, fresh at every call."""
    engine(kernel)
    problem = make_rule_problem(64, 6, [64, 64], 1, device="cuda")
    ones = torch.ones(len(problem.rule), device="cuda")
    zeros = torch.zeros_like(ones)
    pure_noise = ddpm_ops.StepRule(ones, zeros, zeros, zeros, zeros, ones)  # x1 = z
    x = torch.randn(64, 6, device="cuda")
    draws = [ddpm_ops.sample(x, problem.t_start, problem.weights, problem.biases, pure_noise, 1,
                             activations=problem.activations) for _ in range(8)]
    z = torch.stack(draws).double()
    assert abs(z.mean().item()) < 0.05 and abs(z.std().item() - 1) < 0.05
    assert not torch.equal(draws[0], draws[1])
