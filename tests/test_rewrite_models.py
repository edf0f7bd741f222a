"""Sampling loops written the way users write them, for test_rewrite*.py and test_export*.py.

Holds no tests. Each model's ``forward(x, t_start)`` is a DDPM sampling loop
(or a near miss of one); ``make_inputs`` draws fresh random inputs.
"""
import torch
import torch.nn.functional as F
from torch import nn

import ddpm_ops  # also registers the op and the rewrite

DEVICES = ["cpu", "cuda"]


def tables(total_timesteps):
    betas = torch.linspace(1e-4, 0.02, total_timesteps)
    alphas = 1.0 - betas
    alphas_cumprod = torch.cumprod(alphas, 0)
    return 1.0 / torch.sqrt(alphas), betas / torch.sqrt(1.0 - alphas_cumprod)


class Sampler(nn.Module):
    """The plain sampling loop (ddpm_ops.reference), with knobs for the spellings users write."""

    def __init__(self, dim=4, hidden=(16,), num_steps=3, total_timesteps=1000, *,
                 bcast="index", tcast="float", cat_dim=1, first_plain=False, lookup="index"):
        super().__init__()
        self.K, self.T = num_steps, total_timesteps
        self.eps_net = ddpm_ops.silu_mlp([dim + 1, *hidden, dim])
        sra, ce = tables(total_timesteps)
        self.register_buffer("sqrt_recip_alphas", sra)
        self.register_buffer("coef_eps", ce)
        self.bcast, self.tcast, self.cat_dim, self.first_plain = bcast, tcast, cat_dim, first_plain
        self.lookup = lookup

    def coefficient(self, table, t_idx):
        if self.lookup == "gather":  # the DDPM reference code's extract()
            return table.gather(-1, t_idx).reshape(t_idx.shape[0], 1)
        return self.column(table[t_idx])

    def column(self, v):
        if self.bcast == "index":
            return v[:, None]
        if self.bcast == "unsqueeze":
            return v.unsqueeze(1)
        return v.view(-1, 1)

    def forward(self, x, t_start):
        x_cur = x
        for k in range(self.K):
            t_idx = t_start if (k == 0 and self.first_plain) else t_start - k
            if self.tcast == "column_first":  # reshaped before the cast and the division
                t_col = self.column(t_idx).float() / self.T
            else:
                if self.tcast == "none":  # true division of the int timesteps
                    t_norm = t_idx / self.T
                else:
                    tf = t_idx.float() if self.tcast == "float" else t_idx.to(torch.float32)
                    t_norm = tf / self.T
                t_col = self.column(t_norm)
            eps = self.eps_net(torch.cat([x_cur, t_col], dim=self.cat_dim))
            c1 = self.coefficient(self.sqrt_recip_alphas, t_idx)
            c2 = self.coefficient(self.coef_eps, t_idx)
            x_cur = c1 * (x_cur - c2 * eps)
        return x_cur


class HelperSampler(nn.Module):
    """Separate ``nn.Linear`` attributes, ``F.silu`` in helper methods, other names,
    a cumulative ``t = t - 1``, commuted multiplications and ``cat`` on dim -1."""

    def __init__(self, dim=3, width=8, depth=3, steps=4, T=500):
        super().__init__()
        self.first = nn.Linear(dim + 1, width)
        self.middle = nn.ModuleList(nn.Linear(width, width) for _ in range(depth - 2))
        self.last = nn.Linear(width, dim)
        self.steps, self.T = steps, T
        a, b = tables(T)
        self.register_buffer("a_tab", a)
        self.register_buffer("b_tab", b)

    def hidden(self, h):
        h = F.silu(self.first(h))
        for lin in self.middle:
            h = F.silu(lin(h))
        return h

    def predict_noise(self, sample, tt):
        inp = torch.cat((sample, (tt.to(torch.float32) / self.T).unsqueeze(-1)), -1)
        return self.last(self.hidden(inp))

    def forward(self, sample, t):
        for _ in range(self.steps):
            noise = self.predict_noise(sample, t)
            sample = (sample - noise * self.b_tab[t].unsqueeze(1)) * self.a_tab[t].unsqueeze(1)
            t = t - 1
        return sample


class OneLayerSampler(Sampler):
    """A single Linear (no hidden layer)."""

    def __init__(self, **kw):
        super().__init__(hidden=(), **kw)


# ----------------------------------------------------------------------------- near misses

class ReluSampler(Sampler):
    """ReLU instead of SiLU: never rewritten."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.eps_net[1] = nn.ReLU()


class ScaledEpsSampler(Sampler):
    """A step interrupted by other work (eps rescaled): never rewritten."""

    def forward(self, x, t_start):
        x_cur = x
        for k in range(self.K):
            t_idx = t_start - k
            eps = self.eps_net(torch.cat([x_cur, (t_idx.float() / self.T)[:, None]], dim=1))
            eps = eps * 0.5
            x_cur = self.sqrt_recip_alphas[t_idx][:, None] * (
                x_cur - self.coef_eps[t_idx][:, None] * eps)
        return x_cur


class WrongTimeSampler(Sampler):
    """The time column divides by T + 0.5: never rewritten."""

    def forward(self, x, t_start):
        x_cur = x
        for k in range(self.K):
            t_idx = t_start - k
            eps = self.eps_net(torch.cat([x_cur, (t_idx.float() / (self.T + 0.5))[:, None]], 1))
            x_cur = self.sqrt_recip_alphas[t_idx][:, None] * (
                x_cur - self.coef_eps[t_idx][:, None] * eps)
        return x_cur


class MismatchedTimestepSampler(Sampler):
    """c1 indexed by t - k - 1 (another step's timestep): never rewritten."""

    def forward(self, x, t_start):
        x_cur = x
        for k in range(self.K):
            t_idx = t_start - k
            eps = self.eps_net(torch.cat([x_cur, (t_idx.float() / self.T)[:, None]], 1))
            x_cur = self.sqrt_recip_alphas[t_idx - 1][:, None] * (
                x_cur - self.coef_eps[t_idx][:, None] * eps)
        return x_cur


class NoisySampler(Sampler):
    """Fresh noise added between steps (work between steps): each step is fused alone."""

    def forward(self, x, t_start, noise):
        x_cur = x
        for k in range(self.K):
            t_idx = t_start - k
            eps = self.eps_net(torch.cat([x_cur, (t_idx.float() / self.T)[:, None]], 1))
            x_cur = self.sqrt_recip_alphas[t_idx][:, None] * (
                x_cur - self.coef_eps[t_idx][:, None] * eps)
            x_cur = x_cur + 0.01 * noise[k]
        return x_cur


class LeakyEpsSampler(Sampler):
    """Returns the eps of step 1 as well: step 1 is left alone, the others fused."""

    def forward(self, x, t_start):
        x_cur, kept = x, None
        for k in range(self.K):
            t_idx = t_start - k
            eps = self.eps_net(torch.cat([x_cur, (t_idx.float() / self.T)[:, None]], 1))
            if k == 1:
                kept = eps
            x_cur = self.sqrt_recip_alphas[t_idx][:, None] * (
                x_cur - self.coef_eps[t_idx][:, None] * eps)
        return x_cur, kept


class TrajectorySampler(Sampler):
    """Keeps every x (a trajectory): each step fused alone, values unchanged."""

    def forward(self, x, t_start):
        xs = [x]
        for k in range(self.K):
            t_idx = t_start - k
            eps = self.eps_net(torch.cat([xs[-1], (t_idx.float() / self.T)[:, None]], 1))
            xs.append(self.sqrt_recip_alphas[t_idx][:, None] * (
                xs[-1] - self.coef_eps[t_idx][:, None] * eps))
        return torch.stack(xs)


class DecayingWeightSampler(Sampler):
    """Weights that change between steps: each step fused alone with its own weights."""

    def forward(self, x, t_start):
        x_cur = x
        lin0, lin1 = self.eps_net[0], self.eps_net[2]
        for k in range(self.K):
            t_idx = t_start - k
            h = torch.cat([x_cur, (t_idx.float() / self.T)[:, None]], 1)
            h = F.silu(F.linear(h, lin0.weight * (1.0 - 0.1 * k), lin0.bias))
            eps = F.linear(h, lin1.weight, lin1.bias)
            x_cur = self.sqrt_recip_alphas[t_idx][:, None] * (
                x_cur - self.coef_eps[t_idx][:, None] * eps)
        return x_cur


class WarmStartSampler(Sampler):
    """Step 0 uses another network; steps 1..K-1 are the loop: fused from t_start - 1."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.warm = nn.Linear(self.eps_net[0].in_features, self.eps_net[-1].out_features)

    def forward(self, x, t_start):
        x_cur = x
        for k in range(self.K):
            t_idx = t_start - k
            inp = torch.cat([x_cur, (t_idx.float() / self.T)[:, None]], 1)
            eps = self.warm(inp) if k == 0 else self.eps_net(inp)
            x_cur = self.sqrt_recip_alphas[t_idx][:, None] * (
                x_cur - self.coef_eps[t_idx][:, None] * eps)
        return x_cur


def make_inputs(model, batch=5, *, device="cpu", dtype=torch.float32, seed=None, t_dtype=torch.int64):
    """Fresh random ``(x, t_start)`` with every timestep of the loop inside the tables."""
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    dim = _dim(model)
    T = model.T
    steps = getattr(model, "K", getattr(model, "steps", 1))
    x = torch.randn(batch, dim, generator=g, dtype=torch.float64).to(dtype)
    t = torch.randint(steps + 1, T, (batch,), generator=g).to(t_dtype)
    return x.to(device), t.to(device)


def _dim(model):
    if hasattr(model, "eps_net"):
        return model.eps_net[-1].out_features
    return model.last.out_features


def relative_error(out, ref):
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


