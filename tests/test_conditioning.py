"""A Diffusion-QL-style policy, cat([x, time_mlp(t), state]), in the op's split form."""
import math

import pytest
import torch
from torch import nn

import ddpm_ops
from ddpm_ops.conditioning import cond_bias, split_first_linear, time_bias, time_bias_from_module
from ddpm_ops.reference import reference_sample
from ddpm_ops.step_rules import ddpm

ACTION, STATE, T_DIM, HIDDEN = 6, 11, 16, 256


def rel(actual, expected):
    return float((actual - expected).norm() / expected.norm())


class SinusoidalPosEmb(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        half = self.dim // 2
        freqs = torch.exp(torch.arange(half, device=x.device) * -(math.log(10000) / (half - 1)))
        emb = x[:, None] * freqs[None, :]
        return torch.cat((emb.sin(), emb.cos()), dim=-1)


class DiffusionQLMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.time_mlp = nn.Sequential(
            SinusoidalPosEmb(T_DIM), nn.Linear(T_DIM, T_DIM * 2), nn.Mish(), nn.Linear(T_DIM * 2, T_DIM)
        )
        self.mid_layer = nn.Sequential(
            nn.Linear(ACTION + T_DIM + STATE, HIDDEN), nn.Mish(),
            nn.Linear(HIDDEN, HIDDEN), nn.Mish(),
            nn.Linear(HIDDEN, HIDDEN), nn.Mish(),
        )
        self.final_layer = nn.Linear(HIDDEN, ACTION)

    def forward(self, x, time, state):
        t = self.time_mlp(time)
        return self.final_layer(self.mid_layer(torch.cat([x, t, state], dim=1)))

    def split(self, timesteps, state, dtype=torch.float32):
        """(weights, biases, time_bias, cond_bias) of the op's form."""
        first = self.mid_layer[0]
        w_x, (w_t, w_s) = split_first_linear(first, (ACTION, T_DIM, STATE))
        linears = [m for m in self.mid_layer if isinstance(m, nn.Linear)] + [self.final_layer]
        weights = [w_x] + [m.weight.detach() for m in linears[1:]]
        biases = [m.bias.detach() for m in linears]
        tb = time_bias_from_module(self.time_mlp, w_t, timesteps, dtype=dtype, out_dtype=dtype)
        return weights, biases, tb, cond_bias(w_s, state, dtype=dtype)


def rest(h, weights, biases):
    """Everything after the first Linear's pre-activation, Mish between layers."""
    for w, b in zip(weights[1:], biases[1:]):
        h = nn.functional.linear(nn.functional.mish(h), w, b)
    return h


def make(seed, dtype=torch.float32, batch=32, S=100):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = DiffusionQLMLP().to(dtype)
    x = torch.randn(batch, ACTION, generator=g, dtype=dtype)
    state = torch.randn(batch, STATE, generator=g, dtype=dtype)
    s = torch.randint(0, S, (batch,), generator=g)
    return net, x, state, s


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_split_form_equals_plain_net(dtype, tol):
    S = 100
    net, x, state, s = make(0, dtype, S=S)
    timesteps = torch.arange(S) * 7 + 3  # the training timestep of each step index
    weights, biases, tb, cb = net.split(timesteps, state, dtype)
    assert tb.shape == (S, HIDDEN) and cb.shape == (x.shape[0], HIDDEN) and tb.dtype == cb.dtype == dtype

    with torch.no_grad():
        expected = net(x, timesteps[s].to(dtype), state)
        h = x @ weights[0].T + biases[0] + tb[s] + cb
        actual = rest(h, weights, biases)
    assert rel(actual, expected) < tol


def test_float32_biases_are_near_float64():
    S = 50
    net, x, state, s = make(1, torch.float64, S=S)
    timesteps = torch.arange(S)
    _, _, tb64, cb64 = net.split(timesteps, state, torch.float64)
    net32 = net.float()
    _, _, tb32, cb32 = net32.split(timesteps, state.float(), torch.float32)
    assert rel(tb32.double(), tb64) < 1e-6 and rel(cb32.double(), cb64) < 1e-6


def test_full_sampling_loop_split_equals_plain():
    """The policy's own DDPM loop (as Diffusion-QL samples) equals reference_sample."""
    T = 40
    net, x, state, _ = make(2, torch.float64, batch=16, S=T)
    g = torch.Generator().manual_seed(3)
    betas = ddpm_ops.linear_betas(T)
    rule = ddpm(betas, clip=1.0)
    z = torch.randn(T, *x.shape, generator=g, dtype=torch.float64)
    abar = torch.cumprod(1 - betas, 0)

    expected = x
    with torch.no_grad():
        for k, t in enumerate(range(T - 1, -1, -1)):
            eps = net(expected, torch.full((x.shape[0],), float(t), dtype=torch.float64), state)
            abar_prev = abar[t - 1] if t > 0 else torch.tensor(1.0, dtype=torch.float64)
            x0 = ((expected - (1 - abar[t]).sqrt() * eps) / abar[t].sqrt()).clamp(-1, 1)
            mean = abar_prev.sqrt() * betas[t] / (1 - abar[t]) * x0
            mean = mean + (1 - betas[t]).sqrt() * (1 - abar_prev) / (1 - abar[t]) * expected
            sigma = (betas[t] * (1 - abar_prev) / (1 - abar[t])).sqrt() if t > 0 else 0.0
            expected = mean + sigma * z[k]

    weights, biases, tb, cb = net.split(torch.arange(T), state, torch.float64)
    actual = reference_sample(x, torch.full((x.shape[0],), T - 1), weights, biases, rule, T,
                              activations="mish", time_bias=tb, cond_bias=cb, noise=z)
    assert rel(actual, expected) < 1e-5


def test_time_bias_matches_matmul():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(24, 5, generator=g)
    feats = torch.randn(30, 5, generator=g)
    out = time_bias(w, feats)
    assert out.shape == (30, 24) and out.dtype == torch.float32
    assert rel(out.double(), feats.double() @ w.double().T) < 1e-7


def test_split_first_linear_views_and_errors():
    lin = nn.Linear(10, 7)
    w_x, parts = split_first_linear(lin, (4, 2, 4))
    assert w_x.shape == (7, 4) and [p.shape for p in parts] == [(7, 2), (7, 4)]
    assert torch.equal(torch.cat([w_x, *parts], dim=1), lin.weight) and not w_x.requires_grad
    with pytest.raises(ValueError, match="^sizes:.*10.*9"):
        split_first_linear(lin, (4, 2, 3))
    with pytest.raises(ValueError, match="^sizes:"):
        split_first_linear(lin, (10, 0))
    with pytest.raises(TypeError, match="^linear:"):
        split_first_linear(nn.Mish(), (10,))


def test_shape_errors():
    w = torch.randn(8, 3)
    with pytest.raises(ValueError, match="^cond:.*3"):
        cond_bias(w, torch.randn(4, 5))
    with pytest.raises(ValueError, match="^time_features:"):
        time_bias(w, torch.randn(3))
    with pytest.raises(ValueError, match="^timesteps:"):
        time_bias_from_module(nn.Identity(), w, torch.zeros(2, 2))
    with pytest.raises(ValueError, match="^time_embedding output:"):
        time_bias_from_module(SinusoidalPosEmb(4), w, torch.arange(5))
