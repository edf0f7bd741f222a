"""ddpm_ops.DiffusionSampler and mlp_layers: a user's own network and a diffusers
scheduler, sampled as one fused op, against the scheduler's own loop."""
import copy
import math

import diffusers
import pytest
import torch
from torch import nn

import ddpm_ops
from problems import make_rule_problem, relative_error


class SinusoidalPosEmb(nn.Module):
    """Diffusion-QL's time embedding."""

    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, t):
        half = self.dim // 2
        freqs = torch.exp(torch.arange(half, device=t.device) * -(math.log(10000) / (half - 1)))
        angles = t[:, None].float() * freqs[None]
        return torch.cat([angles.sin(), angles.cos()], dim=-1)


def diffusion_ql_net(action_dim=6, state_dim=17, t_dim=16, hidden=256):
    time_mlp = nn.Sequential(SinusoidalPosEmb(t_dim), nn.Linear(t_dim, t_dim * 2), nn.Mish(),
                             nn.Linear(t_dim * 2, t_dim))
    mid = nn.Sequential(nn.Linear(action_dim + t_dim + state_dim, hidden), nn.Mish(),
                        nn.Linear(hidden, hidden), nn.Mish(), nn.Linear(hidden, hidden), nn.Mish(),
                        nn.Linear(hidden, action_dim))
    return time_mlp, mid


def scheduler_loop(scheduler, net, x, noise, **step_kwargs):
    """The diffusers loop, its noise draws replaced by ``noise[k]``."""
    import diffusers.schedulers.scheduling_ddim as ddim_module
    import diffusers.schedulers.scheduling_ddpm as ddpm_module
    for k, t in enumerate(scheduler.timesteps):
        draw = lambda *args, k=k, **kwargs: noise[k]  # noqa: E731
        saved = ddpm_module.randn_tensor, ddim_module.randn_tensor
        ddpm_module.randn_tensor = ddim_module.randn_tensor = draw
        try:
            x = scheduler.step(net(x, t), t, x, variance_noise=noise[k], **step_kwargs).prev_sample \
                if isinstance(scheduler, diffusers.DDIMScheduler) else \
                scheduler.step(net(x, t), t, x).prev_sample
        finally:
            ddpm_module.randn_tensor, ddim_module.randn_tensor = saved
    return x


@pytest.mark.parametrize("scheduler_cls, config, eta", [
    (diffusers.DDPMScheduler, dict(clip_sample=True, beta_schedule="squaredcos_cap_v2"), None),
    (diffusers.DDPMScheduler, dict(clip_sample=False, prediction_type="v_prediction",
                                   variance_type="fixed_large"), None),
    (diffusers.DDIMScheduler, dict(clip_sample=True, clip_sample_range=2.0), 0.0),
    (diffusers.DDIMScheduler, dict(clip_sample=False, prediction_type="sample"), 0.7),
])
def test_diffusion_ql_net_with_a_diffusers_scheduler(scheduler_cls, config, eta):
    torch.manual_seed(torch.seed())
    time_mlp, mid = diffusion_ql_net()
    scheduler = scheduler_cls(num_train_timesteps=100, **config)
    scheduler.set_timesteps(10)
    rule, timesteps = ddpm_ops.step_rules.from_diffusers(scheduler, **({} if eta is None else {"eta": eta}))
    sampler = ddpm_ops.DiffusionSampler(mid, rule, timesteps, layout=(("x", 6), ("time", 16), ("cond", 17)),
                                        time_embedding=time_mlp)
    state, x = torch.randn(50, 17), torch.randn(50, 6)
    noise = torch.randn(10, 50, 6)

    def net(sample, t):
        return mid(torch.cat([sample, time_mlp(t.expand(len(sample))), state], dim=1))

    with torch.no_grad():
        out = sampler(x, cond=state, noise=noise)
        expected = scheduler_loop(scheduler, net, x, noise, **({} if eta is None else {"eta": eta}))
        chain = sampler(x, cond=state, noise=noise, return_chain=True)
    # diffusers computes in float32: the bound allows for its rounding too.
    assert relative_error(out, expected.double()) <= 1e-5
    assert chain.shape == (11, 50, 6) and torch.equal(chain[-1], out) and torch.equal(chain[0], x)


@pytest.mark.parametrize("make", [
    lambda: diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
    lambda: diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
    lambda: diffusers.DPMSolverMultistepScheduler(num_train_timesteps=100),
    lambda: diffusers.DPMSolverMultistepScheduler(num_train_timesteps=100, prediction_type="v_prediction",
                                                  final_sigmas_type="sigma_min", lower_order_final=False),
], ids=["flow-shift", "flow-dynamic-shift", "dpm-solver++-2m", "dpm-solver++-2m-v-sigma-min"])
def test_diffusion_ql_net_with_flow_matching_and_dpm_solver(make):
    """Flow matching and DPM-Solver++ 2M end to end: the sampler against
    diffusers' own loop run in float64."""
    torch.manual_seed(torch.seed())
    time_mlp, mid = diffusion_ql_net()
    scheduler = make()
    scheduler.set_timesteps(10, **({"mu": 0.7} if scheduler.config.get("use_dynamic_shifting") else {}))
    rule, timesteps = ddpm_ops.step_rules.from_diffusers(scheduler)
    sampler = ddpm_ops.DiffusionSampler(mid, rule, timesteps, layout=(("x", 6), ("time", 16), ("cond", 17)),
                                        time_embedding=time_mlp)
    state, x = torch.randn(50, 17), torch.randn(50, 6)
    mid64, time64 = copy.deepcopy(mid).double(), copy.deepcopy(time_mlp[1:]).double()

    def net(sample, t):
        embedding = time64(time_mlp[0](t.expand(len(sample))).double())
        return mid64(torch.cat([sample, embedding, state.double()], dim=1))

    scheduler.sigmas = scheduler.sigmas.double()  # the same values: the step computes in float64
    with torch.no_grad():
        out = sampler(x, cond=state)
        expected = x.double()
        for t in scheduler.timesteps:
            expected = scheduler.step(net(expected, t), t, expected).prev_sample
    assert expected.dtype == torch.float64
    assert relative_error(out, expected) <= 1e-5


def test_layout_order_and_shared_condition():
    torch.manual_seed(torch.seed())
    mid = nn.Sequential(nn.Linear(3 + 4 + 1, 32), nn.GELU(approximate="tanh"), nn.Linear(32, 4))
    rule = ddpm_ops.step_rules.ddpm(ddpm_ops.linear_betas(20), noise=False)
    timesteps = torch.arange(20)
    sampler = ddpm_ops.DiffusionSampler(mid, rule, timesteps, layout=(("cond", 3), ("x", 4), ("time", 1)),
                                        time_embedding=lambda t: t[:, None].float() / 20)
    obs, x = torch.randn(3), torch.randn(5, 4)
    with torch.no_grad():
        out = sampler(x, cond=obs, num_steps=7)
        expected = x.double()
        for k in range(7):
            s = 19 - k
            e = mid.double()(torch.cat([obs.double().expand(5, 3), expected,
                                        torch.full((5, 1), s / 20, dtype=torch.float64)], 1))
            expected = rule.C[s].double() * (rule.A[s].double() * expected - rule.B[s].double() * e) \
                + rule.D[s].double() * expected
        mid.float()
    assert relative_error(out, expected) <= 1e-5


def test_errors_name_the_argument():
    time_mlp, mid = diffusion_ql_net()
    rule = ddpm_ops.step_rules.ddpm(ddpm_ops.linear_betas(5))
    with pytest.raises(ValueError, match=r"layout: expected columns summing to the first Linear's in_features 39"):
        ddpm_ops.DiffusionSampler(mid, rule, torch.arange(5), layout=(("x", 6), ("time", 16)),
                                  time_embedding=time_mlp)
    with pytest.raises(ValueError, match=r"time_embedding: expected one exactly when layout has 'time'"):
        ddpm_ops.DiffusionSampler(mid, rule, torch.arange(5), layout=(("x", 6), ("time", 16), ("cond", 17)))
    with pytest.raises(ValueError, match=r"timesteps: expected one per step index \(5\), got 4"):
        ddpm_ops.DiffusionSampler(mid, rule, torch.arange(4), layout=(("x", 6), ("time", 16), ("cond", 17)),
                                  time_embedding=time_mlp)
    sampler = ddpm_ops.DiffusionSampler(mid, rule, torch.arange(5), layout=(("x", 6), ("time", 16), ("cond", 17)),
                                        time_embedding=time_mlp)
    with pytest.raises(ValueError, match=r"cond: expected a tensor"):
        sampler(torch.randn(2, 6))


@pytest.mark.parametrize("net, message", [
    (nn.Sequential(nn.Linear(3, 4), nn.LeakyReLU(), nn.Linear(4, 3)), r"layer 1 should be one of SiLU"),
    (nn.Sequential(nn.Linear(3, 4, bias=False)), r"layer 0 should be nn.Linear with bias"),
    (nn.Sequential(nn.Linear(3, 4), nn.ReLU()), r"expected Linear, activation, \.\.\., Linear, got 2 layers"),
    (nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 3)), r"layer 1 should be one of"),
])
def test_mlp_layers_refuses_what_the_op_does_not_compute(net, message):
    with pytest.raises(ValueError, match=message):
        ddpm_ops.mlp_layers(net)


def test_mlp_layers_reads_every_activation():
    acts = [nn.SiLU(), nn.Mish(), nn.ReLU(), nn.GELU(), nn.GELU(approximate="tanh"), nn.Tanh(), nn.Identity()]
    layers = [nn.Linear(4, 4)]
    for act in acts:
        layers += [act, nn.Linear(4, 4)]
    weights, biases, names = ddpm_ops.mlp_layers(nn.Sequential(*layers))
    assert names == ["silu", "mish", "relu", "gelu", "gelu_tanh", "tanh", "identity"]
    assert len(weights) == len(biases) == 8


def test_activation_vocabulary_is_the_ops():
    """The op's activation names (listed, in its order, by its message for an unknown one) and
    the Python vocabulary agree."""
    import re
    from ddpm_ops.layers import ACTIVATIONS, VOCABULARY
    with pytest.raises(RuntimeError, match="must be one of") as refused:
        torch.ops.ddpm.fused_sample.rule(*make_rule_problem(2, 3, [4], 1, activation="unknown").args())
    listed = re.search(r"must be one of (.*), got \"unknown\"", str(refused.value)).group(1)
    assert listed.split(", ") == [a.name for a in VOCABULARY]
    assert list(ACTIVATIONS) == [a.name for a in VOCABULARY]
    h = torch.randn(5, 7, dtype=torch.float64)
    for a in VOCABULARY:
        module = a.module() if a.name != "gelu_tanh" else a.module(approximate="tanh")
        assert a.computed_by(module)
        assert torch.equal(module(h), a.function(h))


def test_diffusion_sampler_with_bias_networks_compiles_and_exports():
    """The time MLP and condition columns handed to the op as bias networks survive tracing:
    torch.compile and torch.export give eager's numbers, and the eager sampler is unchanged after."""
    import math

    class Sinusoidal(nn.Module):
        def forward(self, t):
            freqs = torch.exp(torch.arange(8) * -(math.log(10000) / 7))
            angles = t[:, None].float() * freqs[None]
            return torch.cat([angles.sin(), angles.cos()], -1)

    torch.manual_seed(0)
    time_mlp = nn.Sequential(Sinusoidal(), nn.Linear(16, 32), nn.Mish(), nn.Linear(32, 16))
    mid = nn.Sequential(nn.Linear(6 + 16 + 17, 64), nn.Mish(), nn.Linear(64, 6))
    rule = ddpm_ops.step_rules.ddpm(ddpm_ops.linear_betas(5, 1e-4, 0.1), clip=1.0)
    sampler = ddpm_ops.DiffusionSampler(mid, rule, torch.arange(5), time_embedding=time_mlp,
                                        layout=(("x", 6), ("time", 16), ("cond", 17)))

    class Policy(nn.Module):
        def __init__(self):
            super().__init__()
            self.sampler = sampler

        def forward(self, x, cond, noise):
            return self.sampler(x, cond=cond, noise=noise)

    x, cond, noise = torch.randn(4, 6), torch.randn(4, 17), torch.randn(5, 4, 6)
    with torch.no_grad():
        eager = sampler(x, cond=cond, noise=noise)
        assert torch.equal(torch.compile(Policy())(x, cond, noise), eager)
        assert torch.equal(torch.export.export(Policy(), (x, cond, noise)).module()(x, cond, noise), eager)
        assert torch.equal(sampler(x, cond=cond, noise=noise), eager)


def _reference_loop(mid, time_mlp, rule, timesteps, x, state, noise):
    """The sampler's loop in float64 (the network concatenates x, the time MLP and the state)."""
    mid64, time64 = copy.deepcopy(mid).double(), copy.deepcopy(time_mlp[1:]).double()
    tables = rule.tables().double()
    lo, hi = rule.clip if rule.clip is not None else (-math.inf, math.inf)
    x = x.double()
    for k, s in enumerate(reversed(range(len(rule)))):
        t = timesteps[s:s + 1].expand(len(x))
        e = mid64(torch.cat([x, time64(time_mlp[0](t).double()), state.double()], dim=1))
        A, B, C, D, E, S = tables[:, s]
        x0 = (A * x - B * e).clamp(lo, hi)
        x = C * x0 + D * x + E * e + S * noise[k].double()
    return x


def test_direct_call_reads_the_parameters_of_every_call():
    """An eager call goes to the op with an argument list kept from the last call: it must
    still read every change of the modules between calls (in place, a new parameter, new
    storage under the first weight, a replaced layer of the network or of the time MLP, a
    new rule, new time features), at any batch size, and give the numbers of the general
    path bit for bit and the float64 loop's."""
    torch.manual_seed(torch.seed())
    time_mlp, mid = diffusion_ql_net()
    rule = ddpm_ops.step_rules.ddpm(ddpm_ops.linear_betas(5, 1e-4, 0.1), clip=1.0)
    timesteps = torch.arange(5)
    sampler = ddpm_ops.DiffusionSampler(mid, rule, timesteps, layout=(("x", 6), ("time", 16), ("cond", 17)),
                                        time_embedding=time_mlp)
    changes = [
        lambda: None,
        lambda: mid[2].weight.mul_(1.5),                                       # in place
        lambda: setattr(mid[4], "weight", nn.Parameter(torch.randn(256, 256) / 16)),   # a new parameter
        lambda: setattr(mid[0].weight, "data", torch.randn(256, 39) / 6),      # new storage, first weight
        lambda: mid[0].weight[:, :6].mul_(-1),                                 # in place, the x columns
        lambda: mid.__setitem__(6, nn.Linear(256, 6)),                         # a replaced layer
        lambda: nn.utils.parametrizations.weight_norm(mid[2]),                 # a parametrized one
        lambda: time_mlp.__setitem__(3, nn.Linear(32, 16)),                    # the time MLP's
        lambda: setattr(sampler, "rule", ddpm_ops.step_rules.ddpm(ddpm_ops.linear_betas(5, 1e-3, 0.2), clip=0.5)),
    ]
    # New time features (halved: the float64 loop's are not), then the first ones back.
    features = sampler.time_features
    halved = lambda: setattr(sampler, "time_features", features * 0.5)  # noqa: E731
    changes[5:5] = [halved, lambda: setattr(sampler, "time_features", features)]
    for i, change in enumerate(changes):
        with torch.no_grad():
            change()
            batch = 5 + i % 3  # the kept t_start follows the batch size
            x, state, noise = torch.randn(batch, 6), torch.randn(batch, 17), torch.randn(5, batch, 6)
            out = sampler(x, cond=state, noise=noise)
            general = sampler._sample(x, state, None, noise, None, False, None)
            expected = _reference_loop(mid, time_mlp, sampler.rule, timesteps, x, state, noise)
        assert torch.equal(out, general), change
        assert (relative_error(out, expected) > 1e-3) if change is halved else \
            (relative_error(out, expected) <= 1e-5), changes.index(change)


def test_direct_call_draws_as_the_general_path_and_refuses_hooks():
    torch.manual_seed(torch.seed())
    time_mlp, mid = diffusion_ql_net()
    rule = ddpm_ops.step_rules.ddpm(ddpm_ops.linear_betas(5, 1e-4, 0.1), clip=1.0)
    sampler = ddpm_ops.DiffusionSampler(mid, rule, torch.arange(5), layout=(("x", 6), ("time", 16), ("cond", 17)),
                                        time_embedding=time_mlp)
    x, state = torch.randn(3, 6), torch.randn(3, 17)
    with torch.no_grad():
        seed = int(torch.randint(0, 2 ** 31, ()))
        out = sampler(x, cond=state, generator=torch.Generator().manual_seed(seed))
        general = sampler._sample(x, state, None, None, torch.Generator().manual_seed(seed), False, None)
        assert torch.equal(out, general)
        assert not torch.equal(out, sampler(x, cond=state))  # the default generator moves on
        chain = sampler(x, cond=state, return_chain=True, num_steps=3, t_start=torch.tensor([4, 3, 2]))
        assert chain.shape == (4, 3, 6) and torch.equal(chain[0], x)
        mid[2].register_forward_hook(lambda *args: None)
        with pytest.raises(ValueError, match="forward hooks"):
            sampler(x, cond=state)


def test_direct_call_clamps_the_noise_as_the_rule_says():
    """A rule's noise_clip reaches the op on the direct call too: the general path's numbers,
    which a clamp of large given noise changes."""
    torch.manual_seed(torch.seed())
    time_mlp, mid = diffusion_ql_net()
    betas = ddpm_ops.linear_betas(5, 1e-4, 0.1)
    clipped = ddpm_ops.step_rules.ddpm(betas, clip=1.0, noise_clip=0.5)
    sampler = ddpm_ops.DiffusionSampler(mid, clipped, torch.arange(5), layout=(("x", 6), ("time", 16), ("cond", 17)),
                                        time_embedding=time_mlp)
    x, state, noise = torch.randn(4, 6), torch.randn(4, 17), 3 * torch.randn(5, 4, 6)
    with torch.no_grad():
        out = sampler(x, cond=state, noise=noise)
        assert sampler._direct[1], "the direct form"
        assert torch.equal(out, sampler._sample(x, state, None, noise, None, False, None))
        sampler.rule = ddpm_ops.step_rules.ddpm(betas, clip=1.0)
        assert relative_error(sampler(x, cond=state, noise=noise), out.double()) > 1e-3


def test_fused_ddpm_sampler_is_a_diffusion_sampler():
    """The time-column sampler kept for earlier code: a DiffusionSampler with the t/T column
    as its time embedding, equal to the time-column reference loop."""
    torch.manual_seed(torch.seed())
    net = ddpm_ops.silu_mlp([5, 32, 32, 4])
    c1, c2 = ddpm_ops.coefficient_tables(ddpm_ops.linear_betas(100))
    sampler = ddpm_ops.FusedDDPMSampler(net, c1, c2, 16, 100)
    assert isinstance(sampler, ddpm_ops.DiffusionSampler)
    x, t = torch.randn(9, 4), torch.randint(20, 100, (9,))
    with torch.no_grad():
        out = sampler(x, t)
        net64 = copy.deepcopy(net).double()
        expected = x.double()
        for k in range(16):
            tk = t - k
            e = net64(torch.cat([expected, (tk.double() / 100)[:, None]], dim=1))
            expected = c1.double()[tk][:, None] * (expected - c2.double()[tk][:, None] * e)
    assert relative_error(out, expected) <= 1e-5


def test_rewrite_reads_activations_by_the_vocabulary():
    """The rewrite's activation reader names what it reads from layers.VOCABULARY (each
    function's one ATen call), never by a name of its own."""
    from ddpm_ops.layers import VOCABULARY
    from ddpm_ops.rewrite.activations import _aten_forms
    assert sorted(_aten_forms().values()) == sorted(a.name for a in VOCABULARY if a.name != "identity")


@pytest.mark.parametrize("replacement", ["features", "features_and_mlp"])
def test_a_time_embedding_replaced_after_construction_is_read_again(replacement):
    """``sampler.time_embedding = other`` after a call: the next direct call reads the new
    embedding (its features, its MLP), as a sampler built with it does."""
    from loops.common import PositionalEmbedding
    torch.manual_seed(7)
    mlp = nn.Sequential(nn.Linear(6 + 16 + 5, 32), nn.Mish(), nn.Linear(32, 6))
    rule = ddpm_ops.step_rules.ddpm(ddpm_ops.cosine_betas(10), clip=1.0)
    layout = (("x", 6), ("time", 16), ("cond", 5))
    before = PositionalEmbedding(16)
    after = PositionalEmbedding(16, max_positions=100) if replacement == "features" else \
        nn.Sequential(PositionalEmbedding(16), nn.Linear(16, 32), nn.Mish(), nn.Linear(32, 16))
    sampler = ddpm_ops.DiffusionSampler(mlp, rule, torch.arange(10.0), layout=layout, time_embedding=before)
    x, cond, noise = torch.randn(4, 6), torch.randn(4, 5), torch.randn(10, 4, 6)
    with torch.no_grad():
        first = sampler(x, cond=cond, noise=noise)
        sampler.time_embedding = after
        again = sampler(x, cond=cond, noise=noise)
        fresh = ddpm_ops.DiffusionSampler(mlp, rule, torch.arange(10.0), layout=layout, time_embedding=after)
        expected = fresh(x, cond=cond, noise=noise)
    assert relative_error(again, first) > 1e-3
    assert torch.equal(again, expected)
