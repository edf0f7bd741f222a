"""CleanDiffuser (DiscreteDiffusionSDE with DQLMlp / MlpNNDiffusion): DDPM and DDIM sampling, small sizes.

Coefficients are indexed with the Python-int step (0-d tensors), the network
gets ``torch.full`` timesteps, the prediction is clipped to ``x_max`` and
noise is added except at the last step.
"""
import math

import torch
from torch import nn

from .common import PositionalEmbedding, linear_beta_schedule


class DQLMlp(nn.Module):
    def __init__(self, obs_dim, act_dim, emb_dim=16, hidden=256):
        super().__init__()
        self.map_noise = PositionalEmbedding(emb_dim)
        self.time_mlp = nn.Sequential(nn.Linear(emb_dim, emb_dim * 2), nn.Mish(), nn.Linear(emb_dim * 2, emb_dim))
        self.mid_layer = nn.Sequential(nn.Linear(obs_dim + act_dim + emb_dim, hidden), nn.Mish(),
                                       nn.Linear(hidden, hidden), nn.Mish(), nn.Linear(hidden, hidden), nn.Mish())
        self.final_layer = nn.Linear(hidden, act_dim)

    def forward(self, x, noise, condition):
        t = self.time_mlp(self.map_noise(noise.float()))
        x = torch.cat([x, t, condition], -1)
        return self.final_layer(self.mid_layer(x))


class MlpNNDiffusion(nn.Module):
    """The plain MLP (ReLU): x concatenated with the timestep embedding."""

    def __init__(self, x_dim, emb_dim=16, hidden_dims=(256, 256)):
        super().__init__()
        self.map_noise = PositionalEmbedding(emb_dim)
        dims = [x_dim + emb_dim, *hidden_dims]
        layers = []
        for a, b in zip(dims[:-1], dims[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.mlp = nn.Sequential(*layers, nn.Linear(dims[-1], x_dim))

    def forward(self, x, noise, condition=None):
        t = self.map_noise(noise.float())
        return self.mlp(torch.cat([x, t], -1))


class DiscreteDiffusionSDE(nn.Module):
    """``forward(condition, noise=None)``: ``noise`` (sampling_steps + 1, B, dim) replaces the draws."""

    def __init__(self, model, x_dim, diffusion_steps=5, sampling_steps=5, solver="ddpm", x_max=1.0):
        super().__init__()
        self.model, self.x_dim, self.solver, self.x_max = model, x_dim, solver, x_max
        betas = linear_beta_schedule(diffusion_steps)
        alphas_cumprod = torch.cumprod(1 - betas, 0)
        alpha = torch.cat([torch.ones(1), alphas_cumprod.sqrt()])  # index 0: the clean sample
        sigma = torch.cat([torch.full((1,), 1e-3), (1 - alphas_cumprod).sqrt()])
        self.sample_step_schedule = torch.linspace(0, diffusion_steps, sampling_steps + 1).long().tolist()
        self.register_buffer("alphas", alpha[self.sample_step_schedule])
        self.register_buffer("sigmas", sigma[self.sample_step_schedule])
        self.sampling_steps = sampling_steps

    def forward(self, condition, noise=None):
        n_samples = condition.shape[0]
        xt = torch.randn(n_samples, self.x_dim) if noise is None else noise[0]
        alphas, sigmas = self.alphas, self.sigmas
        for i in reversed(range(1, self.sampling_steps + 1)):
            t = torch.full((n_samples,), self.sample_step_schedule[i], dtype=torch.long)
            eps_theta = self.model(xt, t, condition)
            x_theta = (xt - sigmas[i] * eps_theta) / alphas[i]
            x_theta = x_theta.clip(-self.x_max, self.x_max)
            eps_theta = (xt - alphas[i] * x_theta) / sigmas[i]
            if self.solver == "ddpm":
                alpha_ratio = alphas[i] / alphas[i - 1]
                beta_i = 1 - alpha_ratio ** 2
                xt = (1 / alpha_ratio) * (xt - beta_i / sigmas[i] * eps_theta)
                if i > 1:
                    std = (beta_i * sigmas[i - 1] ** 2 / sigmas[i] ** 2).sqrt()
                    xt = xt + std * (torch.randn_like(xt) if noise is None else noise[self.sampling_steps + 1 - i])
            else:  # ddim, eta = 0
                xt = alphas[i - 1] * x_theta + sigmas[i - 1] * eps_theta
        return xt.clip(-self.x_max, self.x_max)


def at_least_ndim(x, ndim):
    """CleanDiffuser's utils.at_least_ndim: trailing singleton dims up to ``ndim`` (a reshape)."""
    if isinstance(x, torch.Tensor):
        return x.reshape(*x.shape, *((1,) * max(ndim - x.dim(), 0)))
    return x


class SampleStepSchedule(nn.Module):
    """DiscreteDiffusionSDE.sample as the library writes it (the class above simplifies it):

    - float timesteps, ``torch.full((n,), schedule[i], dtype=prior.dtype)``;
    - a precomputed ``stds`` table, the DDPM update
      ``(alphas[i-1] / alphas[i]) * (xt - sigmas[i] * eps) + (sigmas[i-1]**2 - stds[i]**2 + 1e-8).sqrt() * eps``
      and the noise added in place, ``xt += stds[i] * z``;
    - ``x_max`` / ``x_min`` per-dimension tensors: the prediction clipped with ``pred.clip(lo, hi)``
      (``clip``: "eps" bounds eps by ``(xt - alpha * x_max) / sigma``, sample-dependent bounds;
      "x0" predicts x0 and clips it to the tensors), then ``xt.clip(x_min, x_max)`` after the loop;
    - ``fix_mask``: the known portion blended in every step, ``xt * (1 - fix_mask) + prior * fix_mask``;
    - ``per_sample``: the coefficients read per sample, ``at_least_ndim(alpha[t], xt.dim())``
      with ``t`` the integer schedule's column (its continuous-time sampler's spelling);
    - ``tables="floats"``: the tables as Python lists (``.tolist()``), each coefficient a float
      that compiles to a constant."""

    def __init__(self, x_dim=3, obs_dim=11, diffusion_steps=20, sampling_steps=5, solver="ddpm", clip=None,
                 fix_mask=False, per_sample=False, tables="tensors"):
        super().__init__()
        self.model = DQLMlp(obs_dim, x_dim)
        self.x_dim, self.solver, self.clip, self.fix, self.per_sample = x_dim, solver, clip, fix_mask, per_sample
        self.sampling_steps = sampling_steps
        betas = linear_beta_schedule(diffusion_steps)
        alphas_cumprod = torch.cumprod(1 - betas, 0)
        alpha = torch.cat([torch.ones(1), alphas_cumprod.sqrt()])
        sigma = torch.cat([torch.full((1,), 1e-3), (1 - alphas_cumprod).sqrt()])
        self.register_buffer("alpha", alpha)
        self.register_buffer("sigma", sigma)
        self.schedule = torch.linspace(0, diffusion_steps, sampling_steps + 1).long().tolist()
        alphas, sigmas = alpha[self.schedule], sigma[self.schedule]
        stds = torch.zeros(sampling_steps + 1)
        stds[1:] = sigmas[:-1] / sigmas[1:] * (1 - (alphas[1:] / alphas[:-1]) ** 2).sqrt()
        self.register_buffer("alphas", alphas)
        self.register_buffer("sigmas", sigmas)
        self.register_buffer("stds", stds)
        self.float_tables = [v.tolist() for v in (alphas, sigmas, stds)] if tables == "floats" else None
        # Per-dimension bounds (CleanDiffuser's x_max / x_min are tensors of the sample's shape).
        self.register_buffer("x_max", torch.tensor([1.0, 0.5, 2.0])[:x_dim])
        self.register_buffer("x_min", -torch.tensor([1.0, 2.0, 0.5])[:x_dim])
        self.register_buffer("fix_mask", torch.zeros(x_dim))

    def coefs(self, i, n):
        if self.float_tables is not None:
            alphas, sigmas, stds = self.float_tables
            return alphas[i], sigmas[i], alphas[i - 1], sigmas[i - 1], stds[i]
        if not self.per_sample:
            return self.alphas[i], self.sigmas[i], self.alphas[i - 1], self.sigmas[i - 1], self.stds[i]
        col = torch.full((n,), i, dtype=torch.long)
        return (at_least_ndim(self.alphas[col], 2), at_least_ndim(self.sigmas[col], 2),
                at_least_ndim(self.alphas[col - 1], 2), at_least_ndim(self.sigmas[col - 1], 2),
                at_least_ndim(self.stds[col], 2))

    def forward(self, condition, prior, noise):
        """``noise[0]`` the initial sample, ``noise[k]`` the draw of step ``k`` (the last one unused)."""
        n = condition.shape[0]
        xt = noise[0]
        if self.fix:
            xt = xt * (1.0 - self.fix_mask) + prior * self.fix_mask
        for k, i in enumerate(reversed(range(1, self.sampling_steps + 1))):
            t = torch.full((n,), self.schedule[i], dtype=prior.dtype)
            a, s, a_prev, s_prev, std = self.coefs(i, n)
            pred = self.model(xt, t, condition)
            if self.clip == "eps":
                pred = pred.clip((xt - a * self.x_max) / s, (xt - a * self.x_min) / s)
            elif self.clip == "x0":
                pred = pred.clip(self.x_min, self.x_max)
            if self.clip == "x0":
                x_theta, eps_theta = pred, (xt - a * pred) / s
            else:
                eps_theta, x_theta = pred, (xt - s * pred) / a
            if self.solver == "ddpm":
                var = s_prev ** 2 - std ** 2 + 1e-8
                root = var.sqrt() if isinstance(var, torch.Tensor) else math.sqrt(var)
                xt = (a_prev / a) * (xt - s * eps_theta) + root * eps_theta
                if i > 1:
                    xt += std * noise[k + 1]
            else:
                xt = a_prev * ((xt - s * eps_theta) / a) + s_prev * eps_theta
            if self.fix:
                xt = xt * (1.0 - self.fix_mask) + prior * self.fix_mask
        if self.clip is not None:
            xt = xt.clip(self.x_min, self.x_max)
        return xt
