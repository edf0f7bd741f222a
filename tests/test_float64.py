"""float64 samplers: a float64 sample whose step (tables, clamps, noise) computes in float64 and
whose network computes in float32, on the sample rounded to float32, its output widened back
(TabDDPM's sampler between its network calls). The op on every device (the CPU kernel, the ATen
loop CUDA runs for it), ``ddpm_ops.sample``, ``DiffusionSampler`` and the torch.compile rewrite,
against float64 references and the loops written with the casts; opcheck; bad dtypes named."""
import logging
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.library import opcheck

import ddpm_ops
from ddpm_ops.layers import ACTIVATIONS
from loops import tabddpm
from loops.common import SinusoidalPosEmb
from problems import DEVICES, make_rule_problem, relative_error
from test_rewrite import compile_run, fresh_compile  # noqa: F401  (autouse: each test compiles afresh)

TOLERANCE = 1e-5
RULE_CALL = re.compile(r"torch\.ops\.ddpm\.fused_sample\.rule\(")
MATMUL = re.compile(r"extern_kernels\.(mm|addmm|bmm)\b|cpp_gemm|_mkl_linear|mkldnn")

# Feature sets of make_rule_problem, each a float64 call of its own.
FEATURES = [
    (),
    ("clip", "noise"),
    ("time", "cond", "post_clip", "chain"),
    ("clip_bounds", "post_clip_bounds", "noise", "chain"),
    ("previous", "clip", "noise"),
    ("seeded", "clip"),
    ("row_seeds", "post_clip_bounds"),
    ("time_net", "cond_net", "noise", "clip"),
]


def cast_loop(problem, dtype=torch.float64) -> torch.Tensor:
    """``problem`` as a float64 sampler writes it: the step in ``dtype`` (the rule's tables for
    it), the network in float32 on the sample cast to float32 and its output cast back."""
    x = problem.x.to(dtype)
    noise = None if problem.noise is None else problem.noise.to(dtype)
    tables = problem.rule.tables(dtype)
    clip, post_clip = (None if c is None else tuple(c) for c in problem.rule.clamps(dtype))
    rows = problem.time_bias
    chain = [x]
    for k in range(problem.num_steps):
        s = problem.t_start - k
        h = F.linear(x.float(), problem.weights[0], problem.biases[0])
        if rows is not None:
            h = h + rows[s]
        if problem.cond_bias is not None:
            h = h + problem.cond_bias
        for layer, name in enumerate(problem.activations, 1):
            h = F.linear(ACTIVATIONS[name](h), problem.weights[layer], problem.biases[layer])
        e = h.to(dtype)
        c = tables[:, s, None]
        x0 = c[0] * x - c[1] * e
        if clip is not None:
            x0 = x0.clamp(*clip)
        x = c[2] * x0 + c[3] * x + c[4] * e
        if noise is not None:
            x = x + c[5] * noise[k]
        if post_clip is not None:
            x = x.clamp(*post_clip)
        chain.append(x)
    return torch.stack(chain) if problem.return_chain else x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "+".join(f) or "plain")
def test_float64_sample_matches_float64_reference(device, features):
    problem = make_rule_problem(37, 6, [64, 48], 5, features=features, activation="mixed", device=device)
    out = torch.ops.ddpm.fused_sample.rule(*problem.args(torch.float64))
    assert out.dtype == torch.float64 and out.device.type == device
    assert relative_error(out, problem.reference64()) <= TOLERANCE, features


@pytest.mark.parametrize("device", DEVICES)
def test_float64_sample_matches_the_loop_with_its_casts(device):
    """Against the loop the op stands for, the network in float32 between two casts: only the
    network's float32 sums may differ in order (the CPU kernel's products are not torch's)."""
    problem = make_rule_problem(50, 5, [128, 128], 8, features=("time", "cond", "clip", "noise", "chain"),
                                activation="silu", device=device)
    out = torch.ops.ddpm.fused_sample.rule(*problem.args(torch.float64))
    with torch.no_grad():
        expected = cast_loop(problem)
    assert relative_error(out, expected) <= 1e-6


def test_float64_step_keeps_the_increments_float32_rounds():
    """Small steps of a sample far from zero: float32 rounds most of each increment away, the
    float64 step keeps it. x ~ 1000 moves by 1e-4 * e a step (a flow's Euler step, A = D = 1)."""
    problem = make_rule_problem(16, 4, [32], 6, activation="tanh")
    length = len(problem.rule)
    ones, zeros = torch.ones(length, dtype=torch.float64), torch.zeros(length, dtype=torch.float64)
    problem.rule = ddpm_ops.StepRule(ones, zeros, zeros, ones, torch.full((length,), 1e-4, dtype=torch.float64),
                                     zeros)
    problem.x = 1000.0 + torch.randn(16, 4)
    x64 = problem.x.double()
    out64 = torch.ops.ddpm.fused_sample.rule(*problem.args(torch.float64))
    out32 = torch.ops.ddpm.fused_sample.rule(*problem.args(torch.float32))
    with torch.no_grad():
        expected = cast_loop(problem)
    assert relative_error(out64 - x64, expected - x64) <= 1e-6
    assert relative_error(out32.double() - x64, expected - x64) > 1e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("features", [("clip_bounds", "noise", "chain"), ("previous", "seeded", "post_clip"),
                                      ("time_net", "cond_net", "row_seeds")], ids="+".join)
def test_opcheck_float64(device, features):
    problem = make_rule_problem(5, 3, [16], 3, features=features, device=device)
    opcheck(torch.ops.ddpm.fused_sample.rule, problem.args(torch.float64))


def test_meta_gives_the_sample_dtype():
    problem = make_rule_problem(4, 3, [8], 2, features=("noise", "chain"))
    args = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in problem.args(torch.float64)]
    args[2], args[3] = [w.to("meta") for w in args[2]], [b.to("meta") for b in args[3]]
    out = torch.ops.ddpm.fused_sample.rule(*args)
    assert out.dtype == torch.float64 and out.shape == (3, 4, 3)


def _bad_dtype(change):
    problem = make_rule_problem(4, 5, [8], 3, features=("noise", "clip_bounds"))
    names = ["x", "t_start", "weights", "biases", "step_tables", "num_steps", "activations", "time_bias",
             "cond_bias", "clip", "post_clip", "noise", "return_chain", "validate", "precision", "noise_seed",
             "time_input", "time_weights", "time_biases", "time_activations", "cond_input", "cond_weights",
             "cond_biases", "cond_activations", "clip_bounds", "post_clip_bounds"]
    args = dict(zip(names, problem.args(torch.float64)))
    args.update(change(args))
    return args


BAD = {
    "tables float32": (lambda a: dict(step_tables=a["step_tables"].float()),
                       r"step_tables must be float64 \(x's dtype, in which the step computes\), got Float"),
    "noise float32": (lambda a: dict(noise=a["noise"].float()),
                      r"noise must be float64 \(x's dtype, in which the step computes\), got Float"),
    "clip_bounds float32": (lambda a: dict(clip_bounds=a["clip_bounds"].float()),
                            r"clip_bounds must be float64 \(x's dtype, in which the step computes\), got Float"),
    "network float64": (lambda a: dict(weights=[w.double() for w in a["weights"]]),
                        r"weights\[0\] must be float32, got Double"),
    "x float16": (lambda a: dict(x=a["x"].half(), step_tables=a["step_tables"].half()),
                  r"x must be float32 or float64 \(a float64 sample's step computes in float64, its network in "
                  r"float32\), got Half"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_dtype_names_argument(case):
    change, message = BAD[case]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.ddpm.fused_sample.rule(**_bad_dtype(change))


def test_time_column_overload_names_the_rule_overload_for_float64():
    x = torch.randn(3, 2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"x must be float32 \(fused_sample.rule takes a float64 sample\), "
                                           r"got Double"):
        torch.ops.ddpm.fused_sample(x, torch.full((3,), 4), [torch.randn(2, 3)], [torch.randn(2)],
                                    torch.rand(5), torch.rand(5), 3, 5)


# ---------------------------------------------------------------------------- StepRule, sample()

def test_step_rule_keeps_float64_tables_and_bounds_as_given():
    g = torch.Generator().manual_seed(torch.seed())
    tables = [torch.rand(7, generator=g, dtype=torch.float64) + 0.1 for _ in range(6)]
    lo, hi = -1 - torch.rand(3, generator=g, dtype=torch.float64), 1 + torch.rand(3, generator=g, dtype=torch.float64)
    rule = ddpm_ops.StepRule(*tables, clip=(lo, hi), post_clip=(-2.0, 2.0))
    for r in (rule, rule.to("cpu"), ddpm_ops.StepRule(*rule.tables(torch.float64), clip=rule.clamps(torch.float64)[0])):
        assert torch.equal(r.tables(torch.float64), torch.stack(tables))
        assert torch.equal(r.tables(), torch.stack(tables).float()) and r.tables().dtype == torch.float32
        assert torch.equal(r.clamps(torch.float64)[0], torch.stack([lo, hi]))
        assert torch.equal(r.clamps()[0], r.clip) and r.clip.dtype == torch.float32
    assert rule.clamps(torch.float64)[1] == (-2.0, 2.0)


@pytest.mark.parametrize("device", DEVICES)
def test_sample_passes_a_float64_chunk_through(device):
    """ddpm_ops.sample with a float64 action chunk (B, horizon, action_dim): the rule's float64
    tables (a float64 schedule) and per-action-dimension bounds as given, the noise float64."""
    g = torch.Generator().manual_seed(torch.seed())
    betas = ddpm_ops.cosine_betas(12).double()
    lo, hi = -1 - torch.rand(2, generator=g, dtype=torch.float64), 1 + torch.rand(2, generator=g, dtype=torch.float64)
    rule = ddpm_ops.step_rules.ddpm(betas, clip=(lo, hi))
    widths = [6, 64, 64, 6]
    weights = [torch.randn(o, i, generator=g) * i ** -0.5 for i, o in zip(widths[:-1], widths[1:])]
    biases = [torch.randn(o, generator=g) * 0.1 for o in widths[1:]]
    time_bias = torch.randn(12, 64, generator=g) * 0.3
    x = torch.randn(20, 3, 2, generator=g, dtype=torch.float64)
    noise = torch.randn(12, 20, 3, 2, generator=g, dtype=torch.float64)
    on = [t.to(device) for t in (x, noise, time_bias)]
    # The reference's rows are the chunk's flattened: its bounds repeat over the horizon.
    flat_rule = ddpm_ops.StepRule(*rule.tables(torch.float64), clip=(lo.repeat(3), hi.repeat(3)))
    with torch.no_grad():
        out = ddpm_ops.sample(on[0], 11, [w.to(device) for w in weights], [b.to(device) for b in biases],
                              rule, 12, activations="mish", time_bias=on[2], noise=on[1])
        expected = ddpm_ops.reference_sample(
            x.reshape(20, 6), torch.full((20,), 11), [w.double() for w in weights], [b.double() for b in biases],
            flat_rule, 12, activations="mish", time_bias=time_bias.double(), noise=noise.reshape(12, 20, 6))
    assert out.dtype == torch.float64 and out.shape == x.shape
    assert relative_error(out.reshape(20, 6), expected) <= TOLERANCE


def test_sample_draws_float64_noise_from_a_generator():
    problem = make_rule_problem(30, 4, [32], 6, features=("noise",))
    args = (problem.x.double(), problem.t_start, problem.weights, problem.biases, problem.rule, 6)
    runs = [ddpm_ops.sample(*args, activations=problem.activations, generator=torch.Generator().manual_seed(5))
            for _ in range(2)]
    assert runs[0].dtype == torch.float64 and torch.equal(runs[0], runs[1])
    assert bool(torch.isfinite(runs[0]).all())
    without = ddpm_ops.sample(*args, activations=problem.activations, noise=torch.zeros(6, 30, 4, dtype=torch.float64))
    assert relative_error(runs[0], without) > 1e-3


# ---------------------------------------------------------------------------- DiffusionSampler

def _sampler(T=10):
    time_mlp = nn.Sequential(SinusoidalPosEmb(16), nn.Linear(16, 32), nn.Mish(), nn.Linear(32, 16))
    mid = nn.Sequential(nn.Linear(5 + 16 + 7, 128), nn.Mish(), nn.Linear(128, 128), nn.Mish(), nn.Linear(128, 5))
    rule = ddpm_ops.step_rules.ddpm(ddpm_ops.cosine_betas(T).double(), clip=1.0)
    sampler = ddpm_ops.DiffusionSampler(mid, rule, torch.arange(T), time_embedding=time_mlp,
                                        layout=(("x", 5), ("time", 16), ("cond", 7)))
    return sampler, time_mlp, mid, rule


def _sampler_loop(time_mlp, mid, rule, x, cond, noise):
    """The sampler's loop as a float64 sampler writes it: mlp(cat([x.float(), temb, cond])).double()."""
    dtype = x.dtype
    tables = rule.tables(dtype)
    T = tables.shape[1]
    for k in range(T):
        s = T - 1 - k
        t = torch.full((x.shape[0],), s)
        e = mid(torch.cat([x.float(), time_mlp(t), cond.expand(x.shape[0], -1)], 1)).to(dtype)
        c = tables[:, s]
        x0 = (c[0] * x - c[1] * e).clamp(-1.0, 1.0)
        x = c[2] * x0 + c[3] * x + c[4] * e + c[5] * noise[k]
    return x


def test_diffusion_sampler_samples_float64_between_float32_calls():
    """The direct call keeps its argument list per dtype: float32, float64, float32 again, each with
    its own tables; a (n,) condition goes through ddpm_ops.sample."""
    sampler, time_mlp, mid, rule = _sampler()
    cond = torch.randn(40, 7)
    with torch.no_grad():
        for dtype in (torch.float32, torch.float64, torch.float32):
            x, noise = torch.randn(40, 5, dtype=dtype), torch.randn(10, 40, 5, dtype=dtype)
            out = sampler(x, cond, noise=noise)
            expected = _sampler_loop(time_mlp, mid, rule, x.double(), cond, noise.double())
            assert out.dtype == dtype
            assert relative_error(out, expected) <= TOLERANCE, dtype
        x, noise = torch.randn(40, 5, dtype=torch.float64), torch.randn(10, 40, 5, dtype=torch.float64)
        out = sampler(x, cond[0], noise=noise)
        assert out.dtype == torch.float64
        assert relative_error(out, _sampler_loop(time_mlp, mid, rule, x, cond[0], noise)) <= TOLERANCE


# ---------------------------------------------------------------------------- the rewrite

def test_tabddpm_sampler_fuses_with_eager_numbers(caplog):
    """TabDDPM's GaussianMultinomialDiffusion.sample, numerical features only, as the project
    writes it (tests/loops/tabddpm.py): its float64 model variance makes the sample float64 from
    the first step on, each network call reading it cast to float32. One fused call, no matmul
    left, eager's float64 numbers (the noise given)."""
    torch.seed()
    model = tabddpm.GaussianMultinomialDiffusion(num_timesteps=10)
    y, noise = torch.randint(0, 3, (256,)), torch.randn(11, 256, 6)
    with caplog.at_level(logging.DEBUG, logger="ddpm_ops.rewrite"):
        out, code = compile_run(model, y, noise)
    with torch.no_grad():
        ref = model(y, noise)
    assert out.dtype == ref.dtype == torch.float64
    assert len(RULE_CALL.findall(code)) == 1, code
    assert not MATMUL.findall(code), code
    assert relative_error(out, ref) <= TOLERANCE
    assert any("fused 10 steps" in r.getMessage() for r in caplog.records)


class Float64Posterior(nn.Module):
    """A DDPM posterior loop over a float64 schedule, its sample float64 from the start: the network
    reads ``x.float()`` with the time column, its output is widened (``.double()``), x0 is clamped
    to per-column float64 bounds, noise given."""

    def __init__(self, dim=4, T=12):
        super().__init__()
        self.T = T
        self.net = nn.Sequential(nn.Linear(dim + 1, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(), nn.Linear(64, dim))
        betas = ddpm_ops.cosine_betas(T).double()
        abar = torch.cumprod(1 - betas, 0)
        abar_prev = torch.cat([torch.ones(1, dtype=torch.float64), abar[:-1]])
        self.register_buffer("recip", (1 / abar).sqrt())
        self.register_buffer("recipm1", (1 / abar - 1).sqrt())
        self.register_buffer("coef1", betas * abar_prev.sqrt() / (1 - abar))
        self.register_buffer("coef2", (1 - abar_prev) * (1 - betas).sqrt() / (1 - abar))
        self.register_buffer("sigma", (betas * (1 - abar_prev) / (1 - abar)).sqrt())
        self.register_buffer("x_max", torch.linspace(1.0, 2.0, dim, dtype=torch.float64))

    def forward(self, x, noise):
        for i in reversed(range(self.T)):
            t = torch.full((x.shape[0], 1), i / self.T)
            eps = self.net(torch.cat([x.float(), t], 1)).double()
            x0 = (self.recip[i] * x - self.recipm1[i] * eps).clamp(-self.x_max, self.x_max)
            x = self.coef1[i] * x0 + self.coef2[i] * x
            if i > 0:
                x = x + self.sigma[i] * noise[i]
        return x


def test_float64_loop_with_float64_bounds_fuses_with_eager_numbers():
    model = Float64Posterior()
    x, noise = torch.randn(32, 4, dtype=torch.float64), torch.randn(12, 32, 4, dtype=torch.float64)
    out, code = compile_run(model, x, noise)
    with torch.no_grad():
        ref = model(x, noise)
        unclamped = Float64Posterior.forward(_without_clamp(model), x, noise)
    assert out.dtype == torch.float64
    assert len(RULE_CALL.findall(code)) == 1, code
    assert not MATMUL.findall(code), code
    assert relative_error(out, ref) <= TOLERANCE
    assert relative_error(unclamped, ref) > 1e-3  # the bounds bind


def _without_clamp(model):
    loose = Float64Posterior(dim=model.x_max.numel(), T=model.T)
    loose.load_state_dict(model.state_dict())
    loose.x_max.fill_(1e9)
    return loose
