"""The eps read back from the clamped x0 (a step rule's Q and R tables) and its clamp (eps_clip):
DPPO's DDIM sampler with ``eps_clip_value``. The op on every device (the CPU kernel, and the ATen
loop CUDA runs it as), float32 and float64 samples, against float64 references; the ``ddim``
builder against DPPO's step written out; ``ddpm_ops.sample`` and ``DiffusionSampler``; opcheck;
the errors, each naming its argument."""
import copy
import dataclasses
import math

import pytest
import torch
from torch.library import opcheck

import ddpm_ops
from ddpm_ops.step_rules import StepRule, ddim
from problems import DEVICES, make_rule_problem, relative_error
from test_modules import diffusion_ql_net

FEATURES = [
    ("eps_read",),
    ("eps_read", "eps_clip", "clip", "noise"),
    ("eps_read", "eps_clip", "previous", "clip_bounds", "chain"),
    ("eps_read", "eps_clip", "seeded", "time", "cond", "post_clip"),
]


def fused(problem, dtype=torch.float32):
    return torch.ops.ddpm.fused_sample.rule(*problem.args(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("features", FEATURES, ids="+".join)
def test_op_matches_float64_reference(device, dtype, features):
    problem = make_rule_problem(29, 5, [48, 40], 6, features=features, activation="mixed", device=device)
    out = fused(problem, dtype)
    assert out.dtype == dtype and out.device.type == device
    assert relative_error(out, problem.reference64()) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_eps_clip_binds(device):
    """The clamp changes the result (most read-back eps leave (-0.3, 0.4)), and without it the op
    still reads the eps back: both against their references."""
    problem = make_rule_problem(40, 4, [32], 5, features=("eps_read", "eps_clip", "clip", "noise"), device=device)
    clamped = fused(problem)
    assert relative_error(clamped, problem.reference64()) <= 1e-5
    problem.rule = dataclasses.replace(problem.rule, eps_clip=None)
    unclamped = fused(problem)
    assert relative_error(unclamped, problem.reference64()) <= 1e-5
    assert relative_error(clamped, unclamped) > 1e-2
    problem.rule = dataclasses.replace(problem.rule, Q=None, R=None)
    assert relative_error(fused(problem), unclamped) > 1e-2  # E now reads the network's e


def dppo_ddim_step(x, e, a, a_prev, sigma, clip, eps_clip, z):
    """DPPO's DDIM step (model/diffusion/diffusion.py, p_mean_var and forward): x0 from eps,
    clamped; eps read back from the clamped x0 where x0 is clamped; eps clamped; the direction."""
    x0 = (x - math.sqrt(1 - a) * e) / math.sqrt(a)
    if clip is not None:
        x0 = x0.clamp(-clip, clip)
        e = (x - math.sqrt(a) * x0) / math.sqrt(1 - a)
    e = e.clamp(-eps_clip, eps_clip)
    return math.sqrt(a_prev) * x0 + math.sqrt(1 - a_prev - sigma ** 2) * e + sigma * z


@pytest.mark.parametrize("clip, eta", [(1.0, 0.0), (None, 0.0), (0.5, 0.7)])
def test_ddim_eps_clip_is_dppos_step(clip, eta):
    g = torch.Generator().manual_seed(torch.seed())
    abar = torch.cumprod(1 - ddpm_ops.cosine_betas(100), 0)
    timesteps = list(range(9, 100, 10))
    K, batch, dim = len(timesteps), 24, 4
    rule = ddim(abar, timesteps, eta=eta, clip=clip, use_clipped_model_output=clip is not None, eps_clip=0.8)
    assert rule.tables().shape == (9, K) and rule.eps_clip == (-0.8, 0.8)
    w = [torch.randn(32, dim, generator=g, dtype=torch.float64) * 0.5,
         torch.randn(dim, 32, generator=g, dtype=torch.float64) * 0.5]
    b = [torch.randn(32, generator=g, dtype=torch.float64), torch.randn(dim, generator=g, dtype=torch.float64)]
    x = torch.randn(batch, dim, generator=g, dtype=torch.float64) * 2
    z = torch.randn(K, batch, dim, generator=g, dtype=torch.float64)
    expected = x
    for k, s in enumerate(range(K - 1, -1, -1)):
        e = torch.nn.functional.linear(torch.nn.functional.silu(torch.nn.functional.linear(expected, w[0], b[0])),
                                       w[1], b[1])
        a, a_prev = float(abar[timesteps[s]]), float(abar[timesteps[s - 1]]) if s > 0 else 1.0
        sigma = eta * math.sqrt((1 - a_prev) / (1 - a) * (1 - a / a_prev))
        expected = dppo_ddim_step(expected, e, a, a_prev, sigma, clip, 0.8, z[k])
    actual = ddpm_ops.reference_sample(x, torch.full((batch,), K - 1), w, b, rule, K, noise=z)
    assert relative_error(actual, expected) <= 1e-10
    fused_out = ddpm_ops.sample(x.float(), K - 1, [t.float() for t in w], [t.float() for t in b], rule, K,
                                noise=z.float())
    assert relative_error(fused_out, expected) <= 1e-5


def test_diffusion_sampler_passes_eps_clip():
    """Diffusion-QL's network under DPPO's DDIM with eps_clip_value, against the loop in float64;
    the same sampler without eps_clip gives other numbers."""
    torch.manual_seed(torch.seed())
    time_mlp, mid = diffusion_ql_net()
    abar = torch.cumprod(1 - ddpm_ops.cosine_betas(50), 0)
    # The first half of the schedule: an untrained network's x0 at abar near 0 would leave every clip.
    timesteps = torch.arange(0, 24, 3)
    rule = ddim(abar, timesteps, clip=1.5, use_clipped_model_output=True, eps_clip=0.2)
    sampler = ddpm_ops.DiffusionSampler(mid, rule, timesteps, layout=(("x", 6), ("time", 16), ("cond", 17)),
                                        time_embedding=time_mlp)
    state, x = torch.randn(20, 17), torch.randn(20, 6)
    mid64, time64 = copy.deepcopy(mid).double(), copy.deepcopy(time_mlp[1:]).double()
    expected = [x.double()]
    K = len(timesteps)
    with torch.no_grad():
        chain = sampler(x, cond=state, return_chain=True)
        for s in range(K - 1, -1, -1):
            t = timesteps[s].expand(len(x))
            e = mid64(torch.cat([expected[-1], time64(time_mlp[0](t).double()), state.double()], dim=1))
            a, a_prev = float(abar[timesteps[s]]), float(abar[timesteps[s - 1]]) if s > 0 else 1.0
            expected.append(dppo_ddim_step(expected[-1], e, a, a_prev, 0.0, 1.5, 0.2, 0.0))
        sampler.rule = ddim(abar, timesteps, clip=1.5, use_clipped_model_output=True)
        unclipped = sampler(x, cond=state, return_chain=True)
    expected = torch.stack(expected)
    assert relative_error(chain, expected) <= 1e-5
    # The last step's result is its x0 (alpha_prev = 1): the clamp shows in the steps before it.
    assert relative_error(unclipped, expected) > 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_eps_clip(device):
    problem = make_rule_problem(5, 3, [16], 3, features=("eps_read", "eps_clip", "clip", "noise", "chain"),
                                device=device)
    opcheck(torch.ops.ddpm.fused_sample.rule, problem.args())
    opcheck(torch.ops.ddpm.fused_sample.rule, problem.args(torch.float64))


def test_meta_checks_eps_clip():
    problem = make_rule_problem(4, 3, [8], 2, features=("eps_read", "eps_clip"))
    args = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in problem.args()]
    args[2], args[3] = [w.to("meta") for w in args[2]], [b.to("meta") for b in args[3]]
    assert torch.ops.ddpm.fused_sample.rule(*args).shape == (4, 3)
    args[4] = args[4][:6]
    with pytest.raises(RuntimeError, match=r"eps_clip clamps the eps read back from x0 .* expected step_tables of "
                                           r"9 rows, got shape \[6, 50\]"):
        torch.ops.ddpm.fused_sample.rule(*args)


@pytest.mark.parametrize("change, words", [
    (lambda a: {4: a[4][:6]}, r"eps_clip clamps the eps read back from x0 .* 9 rows, got shape \[6, 50\]"),
    (lambda a: {4: a[4][:8]}, r"step_tables must have shape \(6, steps\) .* or \(9, steps\) .* got shape \[8, 50\]"),
    (lambda a: {-1: [0.5, -0.5]}, r"eps_clip must have lo <= hi, got \(0.5, -0.5\)"),
    (lambda a: {-1: [0.5]}, r"eps_clip must be a \(lo, hi\) pair, got 1 values"),
], ids=["six rows", "eight rows", "crossed", "one value"])
def test_op_errors_name_eps_clip(change, words):
    problem = make_rule_problem(4, 3, [8], 2, features=("eps_read", "eps_clip"))
    args = list(problem.args())
    for position, value in change(args).items():
        args[position] = value
    with pytest.raises(RuntimeError, match=words):
        torch.ops.ddpm.fused_sample.rule(*args)


def test_step_rule_errors():
    tables = [torch.rand(5, dtype=torch.float64) + 0.1 for _ in range(6)]
    q, r = torch.rand(5), torch.rand(5)
    with pytest.raises(ValueError, match=r"^Q, R: expected both tables of the read-back eps or neither, got Q alone"):
        StepRule(*tables, Q=q)
    with pytest.raises(ValueError, match=r"^eps_clip: expected the tables Q and R of the eps it clamps"):
        StepRule(*tables, eps_clip=1.0)
    with pytest.raises(ValueError, match=r"^eps_clip: expected None, \(lo, hi\) or a number c with number bounds"):
        StepRule(*tables, Q=q, R=r, eps_clip=(torch.zeros(3), torch.ones(3)))
    with pytest.raises(ValueError, match=r"^eps_clip: expected lo <= hi, got \(1.0, -1.0\)"):
        StepRule(*tables, Q=q, R=r, eps_clip=(1.0, -1.0))
    with pytest.raises(ValueError, match=r"^R: expected the length of A \(5\), got 4"):
        StepRule(*tables, Q=q, R=r[:4])
    rule = StepRule(*tables, Q=q, R=r, eps_clip=0.5)
    assert rule.eps_clip == (-0.5, 0.5) and rule.P is None
    assert rule.tables().shape == (9, 5) and bool((rule.tables()[6] == 0).all())
    assert torch.equal(rule.Q, rule.tables()[7]) and torch.equal(rule.R, rule.tables()[8])
    moved = rule.to("cpu")
    assert torch.equal(moved.tables(), rule.tables()) and moved.eps_clip == rule.eps_clip and moved.P is None
    assert "eps_readback=True, eps_clip=(-0.5, 0.5)" in repr(rule)
    abar = torch.cumprod(1 - ddpm_ops.cosine_betas(20), 0)
    with pytest.raises(ValueError, match=r"^eps_clip: .* needs use_clipped_model_output=True"):
        ddim(abar, range(20), clip=1.0, eps_clip=1.0)
