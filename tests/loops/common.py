"""Schedules and embeddings the loops below share, each written as its project writes it."""
import math

import torch
from torch import nn


def linear_beta_schedule(timesteps, beta_start=1e-4, beta_end=2e-2, dtype=torch.float32):
    return torch.linspace(beta_start, beta_end, timesteps, dtype=dtype)


def extract(a, t, x_shape):
    """Diffusion-QL's / the DDPM reference code's extract (gather, then reshape)."""
    b, *_ = t.shape
    out = a.gather(-1, t)
    return out.reshape(b, *((1,) * (len(x_shape) - 1)))


def extract_expand(arr, timesteps, broadcast_shape):
    """TabDDPM's extract: index, add trailing dims, ``.expand``."""
    res = arr[timesteps].float()
    while len(res.shape) < len(broadcast_shape):
        res = res[..., None]
    return res.expand(broadcast_shape)


class SinusoidalPosEmb(nn.Module):
    """Diffusion-QL's time embedding."""

    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        device = x.device
        half_dim = self.dim // 2
        emb = math.log(10000) / (half_dim - 1)
        emb = torch.exp(torch.arange(half_dim, device=device) * -emb)
        emb = x[:, None] * emb[None, :]
        emb = torch.cat((emb.sin(), emb.cos()), dim=-1)
        return emb


class PositionalEmbedding(nn.Module):
    """CleanDiffuser's positional timestep embedding. The frequencies are cast to the
    timestep's dtype (``x.ger(freqs.to(x.dtype))``): DiscreteDiffusionSDE passes int64
    timesteps, so the cast truncates the frequencies to 1, 0, ..., 0 there."""

    def __init__(self, dim, max_positions=10000, endpoint=False):
        super().__init__()
        self.dim, self.max_positions, self.endpoint = dim, max_positions, endpoint

    def forward(self, x):
        freqs = torch.arange(start=0, end=self.dim // 2, dtype=torch.float32, device=x.device)
        freqs = freqs / (self.dim // 2 - (1 if self.endpoint else 0))
        freqs = (1 / self.max_positions) ** freqs
        x = x.ger(freqs.to(x.dtype))
        return torch.cat([x.cos(), x.sin()], dim=1)


def ddpm_buffers(module, betas):
    """The buffers of Diffusion-QL's / TabDDPM's GaussianDiffusion, float32."""
    alphas = 1. - betas
    alphas_cumprod = torch.cumprod(alphas, dim=0)
    alphas_cumprod_prev = torch.cat([torch.ones(1), alphas_cumprod[:-1]])
    reg = module.register_buffer
    reg("betas", betas)
    reg("alphas_cumprod", alphas_cumprod)
    reg("alphas_cumprod_prev", alphas_cumprod_prev)
    reg("sqrt_recip_alphas_cumprod", torch.sqrt(1. / alphas_cumprod))
    reg("sqrt_recipm1_alphas_cumprod", torch.sqrt(1. / alphas_cumprod - 1))
    posterior_variance = betas * (1. - alphas_cumprod_prev) / (1. - alphas_cumprod)
    reg("posterior_variance", posterior_variance)
    reg("posterior_log_variance_clipped", torch.log(torch.clamp(posterior_variance, min=1e-20)))
    reg("posterior_mean_coef1", betas * torch.sqrt(alphas_cumprod_prev) / (1. - alphas_cumprod))
    reg("posterior_mean_coef2", (1. - alphas_cumprod_prev) * torch.sqrt(alphas) / (1. - alphas_cumprod))
