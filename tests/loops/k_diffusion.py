"""Karras-preconditioned samplers (k-diffusion, EDM, BESO), small sizes: the network reads the
sample scaled by ``c_in = 1 / sqrt(sigma**2 + sigma_data**2)``, a number per step.

- k-diffusion's ``layers.Denoiser``: ``inner_model(input * c_in, sigma) * c_out + input * c_skip``,
  the scalings ``append_dims``-ed to the sample, driven by ``sampling.sample_euler`` (``s_churn =
  0``: no churn noise) or ``sample_euler_ancestral`` (``x + randn_like(x) * sigma_up``);
- EDM's ``EDMPrecond``: ``sigma.reshape(-1, 1)``, ``model((c_in * x).to(dtype), c_noise.flatten())``,
  ``c_skip * x + c_out * F_x``, with k-diffusion's Euler steps;
- BESO's ``GCDenoiser`` (``inner_model(state, action * c_in, goal, sigma)``) and its
  ``sample_ddim`` (``(sigma_fn(t_next) / sigma_fn(t)) * action - (-h).expm1() * denoised``);
- diffusers' ``EulerDiscreteScheduler``: ``scale_model_input`` divides, ``sample / ((sigma**2 +
  1) ** 0.5)``, and ``step`` takes an epsilon prediction to ``x - sigma * eps``.

Each inner network is an MLP of ``cat([x, condition, time features])``, the time features
k-diffusion's ``FourierFeatures`` (a random buffer) of ``c_noise = sigma.log() / 4`` through a
small MLP (BESO's ``GCTimeScoreNetwork`` in its MLP style). The schedule is Karras et al.'s,
``get_sigmas_karras`` with a zero appended, in a buffer.
"""
import math

import torch
from torch import nn


def append_dims(x, target_dims):
    """k-diffusion's ``utils.append_dims``."""
    dims_to_append = target_dims - x.ndim
    return x[(...,) + (None,) * dims_to_append]


def get_sigmas_karras(n, sigma_min, sigma_max, rho=7.):
    ramp = torch.linspace(0, 1, n)
    min_inv_rho = sigma_min ** (1 / rho)
    max_inv_rho = sigma_max ** (1 / rho)
    sigmas = (max_inv_rho + ramp * (min_inv_rho - max_inv_rho)) ** rho
    return torch.cat([sigmas, sigmas.new_zeros([1])])


class FourierFeatures(nn.Module):
    """k-diffusion's ``layers.FourierFeatures``."""

    def __init__(self, in_features, out_features, std=1.):
        super().__init__()
        self.register_buffer("weight", torch.randn([out_features // 2, in_features]) * std)

    def forward(self, input):
        f = 2 * math.pi * input @ self.weight.T
        return torch.cat([f.cos(), f.sin()], dim=-1)


class ScoreMLP(nn.Module):
    """The inner network, ``layers(cat([x, cond, time features]))``: ``forward(x, sigma, cond)``
    takes sigma and embeds ``c_noise = sigma.log() / 4`` (k-diffusion's and BESO's networks),
    ``mlp(x, c_noise, cond)`` the noise conditioning itself (EDM's, diffusers')."""

    def __init__(self, dim=3, cond_dim=11, time_dim=16, hidden=64):
        super().__init__()
        self.embed = nn.Sequential(FourierFeatures(1, time_dim), nn.Linear(time_dim, time_dim * 2), nn.GELU(),
                                   nn.Linear(time_dim * 2, time_dim))
        self.layers = nn.Sequential(nn.Linear(dim + cond_dim + time_dim, hidden), nn.GELU(),
                                    nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x, sigma, cond):
        return self.mlp(x, sigma.log() / 4, cond)

    def mlp(self, x, c_noise, cond):
        return self.layers(torch.cat([x, cond, self.embed(c_noise[:, None])], dim=-1))


class Denoiser(nn.Module):
    """k-diffusion's ``layers.Denoiser`` (forward only)."""

    def __init__(self, inner_model, sigma_data=1.):
        super().__init__()
        self.inner_model, self.sigma_data = inner_model, sigma_data

    def get_scalings(self, sigma):
        c_skip = self.sigma_data ** 2 / (sigma ** 2 + self.sigma_data ** 2)
        c_out = sigma * self.sigma_data / (sigma ** 2 + self.sigma_data ** 2) ** 0.5
        c_in = 1 / (sigma ** 2 + self.sigma_data ** 2) ** 0.5
        return c_skip, c_out, c_in

    def forward(self, input, sigma, cond):
        c_skip, c_out, c_in = [append_dims(x, input.ndim) for x in self.get_scalings(sigma)]
        return self.inner_model(input * c_in, sigma, cond) * c_out + input * c_skip


class EDMPrecond(nn.Module):
    """EDM's ``training/networks.py`` ``EDMPrecond.forward`` for a ``(B, dim)`` sample (its
    ``reshape(-1, 1, 1, 1)`` of an image's sigma is ``reshape(-1, 1)`` here). ``float``: the
    dtype EDM casts to, ``torch.float32`` (float64 for a reference run)."""

    def __init__(self, model, sigma_data=0.5):
        super().__init__()
        self.model, self.sigma_data, self.float = model, sigma_data, torch.float32

    def forward(self, x, sigma, cond):
        x = x.to(self.float)
        sigma = sigma.to(self.float).reshape(-1, 1)
        dtype = self.float
        c_skip = self.sigma_data ** 2 / (sigma ** 2 + self.sigma_data ** 2)
        c_out = sigma * self.sigma_data / (sigma ** 2 + self.sigma_data ** 2).sqrt()
        c_in = 1 / (self.sigma_data ** 2 + sigma ** 2).sqrt()
        c_noise = sigma.log() / 4
        F_x = self.model.mlp((c_in * x).to(dtype), c_noise.flatten(), cond)
        return c_skip * x + c_out * F_x.to(self.float)


class KarrasSampler(nn.Module):
    """``sampler``: "euler" (k-diffusion's ``sample_euler`` with ``s_churn = 0``; its ``s_tmin <=
    sigmas[i] <= s_tmax``, a branch on a tensor that would break the graph, dropped: it only
    picks ``gamma = 0`` there too), "euler_ancestral"
    (``sample_euler_ancestral``; its draws given as ``noise[1 + i]``), "edm_euler" (``sample_euler``
    on ``EDMPrecond``) or "beso_ddim" (BESO's ``sample_ddim`` on its ``GCDenoiser``, whose inner
    network reads ``(state, action * c_in, goal, sigma)``). ``forward(cond, noise)``: ``noise[0] *
    sigmas[0]`` the initial sample."""

    def __init__(self, sampler="euler", dim=3, cond_dim=11, steps=6, sigma_min=0.002, sigma_max=80.):
        super().__init__()
        inner = ScoreMLP(dim, cond_dim)
        self.model = EDMPrecond(inner) if sampler == "edm_euler" else Denoiser(inner, sigma_data=0.5)
        self.sampler = sampler
        self.register_buffer("sigmas", get_sigmas_karras(steps, sigma_min, sigma_max))

    def forward(self, cond, noise):
        x = noise[0] * self.sigmas[0]
        return getattr(self, self.sampler.replace("edm_", ""))(x, cond, noise)

    def euler(self, x, cond, noise):
        sigmas, s_churn, s_noise = self.sigmas, 0., 1.
        s_in = x.new_ones([x.shape[0]])
        for i in range(len(sigmas) - 1):
            gamma = min(s_churn / (len(sigmas) - 1), 2 ** 0.5 - 1)
            eps = torch.randn_like(x) * s_noise
            sigma_hat = sigmas[i] * (gamma + 1)
            if gamma > 0:
                x = x + eps * (sigma_hat ** 2 - sigmas[i] ** 2) ** 0.5
            denoised = self.model(x, sigma_hat * s_in, cond)
            d = (x - denoised) / append_dims(sigma_hat, x.ndim)
            dt = sigmas[i + 1] - sigma_hat
            x = x + d * dt
        return x

    def euler_ancestral(self, x, cond, noise):
        sigmas = self.sigmas
        s_in = x.new_ones([x.shape[0]])
        for i in range(len(sigmas) - 1):
            denoised = self.model(x, sigmas[i] * s_in, cond)
            sigma_from, sigma_to = sigmas[i], sigmas[i + 1]
            sigma_up = (sigma_to ** 2 * (sigma_from ** 2 - sigma_to ** 2) / sigma_from ** 2) ** 0.5
            sigma_down = (sigma_to ** 2 - sigma_up ** 2) ** 0.5
            d = (x - denoised) / append_dims(sigmas[i], x.ndim)
            dt = sigma_down - sigmas[i]
            x = x + d * dt
            x = x + noise[1 + i] * sigma_up
        return x

    def beso_ddim(self, action, cond, noise):
        sigmas = self.sigmas
        s_in = action.new_ones([action.shape[0]])
        sigma_fn = lambda t: t.neg().exp()  # noqa: E731
        t_fn = lambda sigma: sigma.log().neg()  # noqa: E731
        for i in range(len(sigmas) - 1):
            denoised = self.gc_denoiser(cond, action, sigmas[i] * s_in)
            t, t_next = t_fn(sigmas[i]), t_fn(sigmas[i + 1])
            h = t_next - t
            action = (sigma_fn(t_next) / sigma_fn(t)) * action - (-h).expm1() * denoised
        return action

    def gc_denoiser(self, state, action, sigma):
        """BESO's ``GCDenoiser.forward`` (no goal): the inner network reads the scaled action."""
        c_skip, c_out, c_in = [append_dims(x, action.ndim) for x in self.model.get_scalings(sigma)]
        return self.model.inner_model(action * c_in, sigma, state) * c_out + action * c_skip


class EulerDiscrete(nn.Module):
    """diffusers' ``EulerDiscreteScheduler`` written out in the policy's loop: the sigmas of a
    scaled-linear DDPM schedule at ``steps`` leading timesteps (and a zero), the network given
    ``scale_model_input``'s ``sample / ((sigma**2 + 1) ** 0.5)`` and the timestep (over the
    training steps), epsilon
    prediction, ``prev_sample = sample + (sample - (sample - sigma * eps)) / sigma * dt``.
    ``forward(cond, noise)``: ``noise[0] * init_noise_sigma`` the initial sample."""

    def __init__(self, dim=3, cond_dim=11, steps=6, train_steps=100):
        super().__init__()
        self.net = ScoreMLP(dim, cond_dim)
        betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, train_steps) ** 2
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        timesteps = (torch.arange(0, steps) * (train_steps // steps)).flip(0)
        sigmas = (((1 - alphas_cumprod) / alphas_cumprod) ** 0.5)[timesteps]
        self.register_buffer("sigmas", torch.cat([sigmas, sigmas.new_zeros([1])]))
        self.register_buffer("timesteps", timesteps / train_steps)

    def forward(self, cond, noise):
        sample = noise[0] * (self.sigmas.max() ** 2 + 1) ** 0.5
        for i in range(len(self.timesteps)):
            sigma = self.sigmas[i]
            model_input = sample / ((sigma ** 2 + 1) ** 0.5)
            eps = self.net.mlp(model_input, self.timesteps[i].expand(sample.shape[0]), cond)
            pred_original_sample = sample - sigma * eps
            derivative = (sample - pred_original_sample) / sigma
            dt = self.sigmas[i + 1] - sigma
            sample = sample + derivative * dt
        return sample
