"""tiny-diffusion (ddpm.py): an MLP on [x, linear time embedding], GELU, its NoiseScheduler.step."""
import numpy as np
import torch
from torch import nn

from .common import ddpm_buffers, linear_beta_schedule


class LinearEmbedding(nn.Module):
    def __init__(self, size, scale=1.0):
        super().__init__()
        self.size, self.scale = size, scale

    def forward(self, x):
        x = x / self.size * self.scale
        return x.unsqueeze(-1)


class MLP(nn.Module):
    def __init__(self, hidden_size=64, hidden_layers=2, num_timesteps=50):
        super().__init__()
        self.time_mlp = LinearEmbedding(num_timesteps)
        layers = [nn.Linear(2 + 1, hidden_size), nn.GELU()]
        for _ in range(hidden_layers):
            layers += [nn.Linear(hidden_size, hidden_size), nn.GELU()]
        layers.append(nn.Linear(hidden_size, 2))
        self.joint_mlp = nn.Sequential(*layers)

    def forward(self, x, t):
        return self.joint_mlp(torch.cat((x, self.time_mlp(t)), dim=-1))


class TinyDiffusion(nn.Module):
    def __init__(self, num_timesteps=50):
        super().__init__()
        self.model = MLP(num_timesteps=num_timesteps)
        self.num_timesteps = num_timesteps
        ddpm_buffers(self, linear_beta_schedule(num_timesteps))

    def get_variance(self, t):
        if t == 0:
            return 0
        variance = self.betas[t] * (1. - self.alphas_cumprod_prev[t]) / (1. - self.alphas_cumprod[t])
        return variance.clip(1e-20)

    def step(self, model_output, timestep, sample, noise):
        t = timestep
        pred_original_sample = (self.sqrt_recip_alphas_cumprod[t] * sample
                                - self.sqrt_recipm1_alphas_cumprod[t] * model_output)
        pred_prev_sample = self.posterior_mean_coef1[t] * pred_original_sample + self.posterior_mean_coef2[t] * sample
        return pred_prev_sample + self.variance_term(t, model_output, noise)

    def variance_term(self, t, model_output, noise):
        """The step's noise, none at t = 0 (a Python-int branch, as tiny-diffusion writes it)."""
        variance = 0
        if t > 0:
            noise = torch.randn_like(model_output) if noise is None else noise
            variance = (self.get_variance(t) ** 0.5) * noise
        return variance

    def forward(self, batch, noise=None):
        sample = torch.randn(batch, 2) if noise is None else noise[0]
        for k, t in enumerate(reversed(range(self.num_timesteps))):
            ts = torch.full((batch,), t, dtype=torch.long, device=sample.device)
            residual = self.model(sample, ts)
            sample = self.step(residual, t, sample, None if noise is None else noise[k + 1])
        return sample


class SinusoidalEmbedding(nn.Module):
    """tiny-diffusion's positional_embeddings.SinusoidalEmbedding (``scale`` applied first)."""

    def __init__(self, size, scale=1.0):
        super().__init__()
        self.size, self.scale = size, scale

    def forward(self, x):
        x = x * self.scale
        half_size = self.size // 2
        emb = torch.log(torch.tensor([10000.0])) / (half_size - 1)
        emb = torch.exp(-emb * torch.arange(half_size)).to(x.device)
        emb = x.unsqueeze(-1) * emb.unsqueeze(0)
        return torch.cat((torch.sin(emb), torch.cos(emb)), dim=-1)


class IdentityEmbedding(nn.Module):
    def forward(self, x):
        return x.unsqueeze(-1)


class Block(nn.Module):
    """tiny-diffusion's residual block: ``x + GELU(Linear(x))``."""

    def __init__(self, size):
        super().__init__()
        self.ff, self.act = nn.Linear(size, size), nn.GELU()

    def forward(self, x):
        return x + self.act(self.ff(x))


class ProjectMLP(nn.Module):
    """tiny-diffusion's MLP as it ships: each coordinate of x embedded on its own
    (``input_emb``: "identity", or "sinusoidal" with scale 25, its default), the sinusoidal time
    embedding, residual GELU blocks."""

    def __init__(self, hidden_size=32, hidden_layers=2, emb_size=16, input_emb="identity"):
        super().__init__()
        self.time_mlp = SinusoidalEmbedding(emb_size)
        make = (lambda: SinusoidalEmbedding(emb_size, scale=25.0)) if input_emb == "sinusoidal" else IdentityEmbedding
        self.input_mlp1, self.input_mlp2 = make(), make()
        in_size = emb_size + (2 * emb_size if input_emb == "sinusoidal" else 2)
        layers = [nn.Linear(in_size, hidden_size), nn.GELU()]
        layers += [Block(hidden_size) for _ in range(hidden_layers)]
        layers.append(nn.Linear(hidden_size, 2))
        self.joint_mlp = nn.Sequential(*layers)

    def forward(self, x, t):
        x = torch.cat((self.input_mlp1(x[:, 0]), self.input_mlp2(x[:, 1]), self.time_mlp(t)), dim=-1)
        return self.joint_mlp(x)


class ProjectSampler(TinyDiffusion):
    """tiny-diffusion's sampling loop as its script writes it: the network's timesteps built with
    numpy, ``torch.from_numpy(np.repeat(t, batch)).long()``, the tables read as
    ``table[t].reshape(-1, 1)``. The script steps its scheduler with ``t[0]``, a 0-d tensor; its
    ``if t > 0`` on that tensor is a data-dependent branch that breaks dynamo's graph at every step
    (no loop is left in one graph to fuse), so the scheduler is stepped here with the Python int."""

    def __init__(self, num_timesteps=10, input_emb="identity"):
        super().__init__(num_timesteps)
        self.model = ProjectMLP(input_emb=input_emb)

    def step(self, model_output, timestep, sample, noise):
        t = timestep
        s1 = self.sqrt_recip_alphas_cumprod[t].reshape(-1, 1)
        s2 = self.sqrt_recipm1_alphas_cumprod[t].reshape(-1, 1)
        pred_original_sample = s1 * sample - s2 * model_output
        c1 = self.posterior_mean_coef1[t].reshape(-1, 1)
        c2 = self.posterior_mean_coef2[t].reshape(-1, 1)
        pred_prev_sample = c1 * pred_original_sample + c2 * sample
        return pred_prev_sample + self.variance_term(t, model_output, noise)

    def forward(self, batch, noise=None):
        sample = torch.randn(batch, 2) if noise is None else noise[0]
        for k, t in enumerate(list(range(self.num_timesteps))[::-1]):
            ts = torch.from_numpy(np.repeat(t, batch)).long().to(sample.device)
            residual = self.model(sample, ts)
            sample = self.step(residual, t, sample, None if noise is None else noise[k + 1])
        return sample
