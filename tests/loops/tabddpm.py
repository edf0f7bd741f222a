"""TabDDPM (tab_ddpm/modules.py, gaussian_multinomial_diffsuion.py): the numerical features' sampler.

The network adds its time embedding (and a label's) to ``proj(x)``; the step
is the posterior mean of x0 from eps with ``exp(0.5 * log_variance)`` noise,
none at t=0, and no clipping. As in the project, the model variance is built
each step from a float64 ``posterior_variance`` (``as_project=True``): the
chain then runs in float64 between the networks, which cast it back with
``.float()``. ``as_project=False`` keeps that variance float32.
"""
import math

import torch
from torch import nn

from .common import ddpm_buffers


def timestep_embedding(timesteps, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32)
                      / half).to(device=timesteps.device)
    args = timesteps[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class MLP(nn.Module):
    """rtdl's MLP.make_baseline: Linear-ReLU-Dropout blocks, then a head."""

    def __init__(self, d_in, d_layers, d_out, dropout=0.0):
        super().__init__()
        dims = [d_in, *d_layers]
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Dropout(dropout))
                                    for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(dims[-1], d_out)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class MLPDiffusion(nn.Module):
    def __init__(self, d_in, num_classes, d_layers=(64, 32, 32), dim_t=32):
        super().__init__()
        self.dim_t, self.num_classes = dim_t, num_classes
        self.mlp = MLP(dim_t, d_layers, d_in)
        self.label_emb = nn.Embedding(num_classes, dim_t) if num_classes > 0 else None
        self.proj = nn.Linear(d_in, dim_t)
        self.time_embed = nn.Sequential(nn.Linear(dim_t, dim_t), nn.SiLU(), nn.Linear(dim_t, dim_t))

    def forward(self, x, timesteps, y=None):
        emb = self.time_embed(timestep_embedding(timesteps, self.dim_t))
        if self.label_emb is not None and y is not None:
            emb += nn.functional.silu(self.label_emb(y.squeeze()))
        x = self.proj(x) + emb
        return self.mlp(x)


def extract(a, t, x_shape):
    b, *_ = t.shape
    out = a.gather(-1, t)
    while len(out.shape) < len(x_shape):
        out = out[..., None]
    return out.expand(x_shape)


class GaussianSampler(nn.Module):
    """``forward(y, noise=None)``: ``noise`` (T + 1, B, d_in) replaces the draws (the initial
    sample first) so that a compiled run can be compared with eager."""

    def __init__(self, d_in=6, num_classes=3, num_timesteps=8, as_project=True, long_after_full=False):
        super().__init__()
        # TabDDPM's sample(): ``torch.full((b,), i).long()``, a float full cast to int64.
        self.long_after_full = long_after_full
        self.d_in, self.num_timesteps = d_in, num_timesteps
        self._denoise_fn = MLPDiffusion(d_in, num_classes)
        steps = num_timesteps + 1
        s = torch.linspace(0, num_timesteps, steps, dtype=torch.float64) / num_timesteps
        alphas_cumprod = torch.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2
        betas = (1 - alphas_cumprod[1:] / alphas_cumprod[:-1]).clamp(max=0.999)
        ddpm_buffers(self, betas.float())
        self.register_buffer("alphas", 1. - betas.float())
        prev = torch.cat([torch.ones(1, dtype=torch.float64), torch.cumprod(1 - betas, 0)[:-1]])
        variance = betas * (1. - prev) / (1. - torch.cumprod(1 - betas, 0))
        self.posterior_variance64 = variance if as_project else variance.float()

    def gaussian_p_sample(self, model_out, x, t):
        model_variance = torch.cat([self.posterior_variance64[1].unsqueeze(0).to(x.device),
                                    (1. - self.alphas)[1:]], dim=0)
        model_log_variance = extract(torch.log(model_variance), t, x.shape)
        pred_xstart = (extract(self.sqrt_recip_alphas_cumprod, t, x.shape) * x
                       - extract(self.sqrt_recipm1_alphas_cumprod, t, x.shape) * model_out)
        mean = (extract(self.posterior_mean_coef1, t, x.shape) * pred_xstart
                + extract(self.posterior_mean_coef2, t, x.shape) * x)
        return mean, model_log_variance

    def forward(self, y, noise=None):
        b = y.shape[0]
        z_norm = torch.randn((b, self.d_in), device=y.device) if noise is None else noise[0]
        log_z = torch.zeros((b, 0), device=y.device).float()  # no categorical features
        for i in reversed(range(0, self.num_timesteps)):
            t = torch.full((b,), i, device=y.device).long() if self.long_after_full else \
                torch.full((b,), i, device=y.device, dtype=torch.long)
            model_out = self._denoise_fn(torch.cat([z_norm, log_z], dim=1).float(), t, y)
            mean, log_variance = self.gaussian_p_sample(model_out[:, :self.d_in], z_norm, t)
            z = torch.randn_like(z_norm) if noise is None else noise[self.num_timesteps - i]
            nonzero_mask = (t != 0).float().view(-1, *([1] * (len(z_norm.shape) - 1)))
            z_norm = mean + nonzero_mask * torch.exp(0.5 * log_variance) * z
        return z_norm
