"""CleanDiffuser (DiscreteDiffusionSDE with DQLMlp / MlpNNDiffusion): DDPM and DDIM sampling, small sizes.

Coefficients are indexed with the Python-int step (0-d tensors), the network
gets ``torch.full`` timesteps, the prediction is clipped to ``x_max`` and
noise is added except at the last step.
"""
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
