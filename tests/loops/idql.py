"""IDQL's DDPM sampler (jaxrl5's ``ddpm_sampler``, written here in PyTorch) with an MLP reverse
encoder: learned Fourier features of the raw timestep through a condition MLP, the input
``cat([x, observation, time features])``, the coefficients computed from the tables at every
step (``1 / sqrt(alphas[t])``, ``(1 - alphas[t]) / sqrt(1 - alpha_hats[t])``), the noise added
as ``(t > 0) * (sqrt(betas[t]) * temperature * z)``, the sample clipped every step."""
import math

import torch
from torch import nn

from .common import linear_beta_schedule


class FourierFeatures(nn.Module):
    def __init__(self, output_size, learnable=True):
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(output_size // 2, 1) * 0.2)

    def forward(self, x):
        f = 2 * math.pi * x @ self.kernel.T
        return torch.cat([torch.cos(f), torch.sin(f)], dim=-1)


class MLPResNetBlock(nn.Module):
    """jaxrl5's block: ``residual + Dense(Dense4H(act(LayerNorm(Dropout(x)))))``."""

    def __init__(self, features, act, dropout_rate=0.1):
        super().__init__()
        self.dropout = nn.Dropout(dropout_rate)
        self.norm = nn.LayerNorm(features)
        self.dense1 = nn.Linear(features, features * 4)
        self.dense2 = nn.Linear(features * 4, features)
        self.act = act

    def forward(self, x):
        residual = x
        x = self.dropout(x)
        x = self.norm(x)
        x = self.dense1(x)
        x = self.act(x)
        x = self.dense2(x)
        return residual + x


class MLPResNet(nn.Module):
    """jaxrl5's MLPResNet, IDQL's reverse encoder: Dense(H), blocks, act, Dense(out)."""

    def __init__(self, in_dim, out_dim, num_blocks=2, hidden=32, act=nn.Mish()):
        super().__init__()
        self.dense_in = nn.Linear(in_dim, hidden)
        self.blocks = nn.ModuleList(MLPResNetBlock(hidden, act) for _ in range(num_blocks))
        self.act = act
        self.dense_out = nn.Linear(hidden, out_dim)

    def forward(self, x):
        x = self.dense_in(x)
        for block in self.blocks:
            x = block(x)
        return self.dense_out(self.act(x))


class IDQLActor(nn.Module):
    """``network``: "mlp" (IDQL's MLP reverse encoder) or "ln_resnet" (its LN-ResNet: eval mode
    for sampling, Dropout the identity)."""

    def __init__(self, obs_dim=11, action_dim=3, time_dim=16, hidden=64, T=5, temperature=1.0,
                 clip_sampler=1.0, network="mlp", time_spelling="full"):
        super().__init__()
        self.time_preprocess = FourierFeatures(time_dim)
        self.cond_encoder = nn.Sequential(nn.Linear(time_dim, time_dim * 2), nn.Mish(),
                                          nn.Linear(time_dim * 2, time_dim))
        if network == "ln_resnet":
            self.reverse_encoder = MLPResNet(action_dim + obs_dim + time_dim, action_dim)
        else:
            self.reverse_encoder = nn.Sequential(nn.Linear(action_dim + obs_dim + time_dim, hidden), nn.Mish(),
                                                 nn.Linear(hidden, hidden), nn.Mish(), nn.Linear(hidden, action_dim))
        self.action_dim, self.T, self.temperature, self.clip_sampler = action_dim, T, temperature, clip_sampler
        # "repeat": jaxrl5's ``expand_dims(array([time]).repeat(batch), 1)``, an int column cast to float.
        self.time_spelling = time_spelling
        betas = linear_beta_schedule(T)
        alphas = 1 - betas
        self.register_buffer("betas", betas)
        self.register_buffer("alphas", alphas)
        self.register_buffer("alpha_hats", torch.cumprod(alphas, 0))

    def forward(self, observations, noise):
        """``noise[0]`` the initial sample, ``noise[1 + k]`` step ``k``'s draw."""
        batch = observations.shape[0]
        current_x = noise[0]
        for k, time in enumerate(reversed(range(self.T))):
            if self.time_spelling == "repeat":
                input_time = torch.tensor([time]).repeat(batch).unsqueeze(1).float().to(observations.device)
            else:
                input_time = torch.full((batch, 1), time, dtype=torch.float32, device=observations.device)
            cond = self.cond_encoder(self.time_preprocess(input_time))
            eps_pred = self.reverse_encoder(torch.cat([current_x, observations, cond], dim=-1))
            alpha_1 = 1 / torch.sqrt(self.alphas[time])
            alpha_2 = (1 - self.alphas[time]) / torch.sqrt(1 - self.alpha_hats[time])
            current_x = alpha_1 * (current_x - alpha_2 * eps_pred)
            z_scaled = self.temperature * noise[1 + k]
            current_x = current_x + (time > 0) * (torch.sqrt(self.betas[time]) * z_scaled)
            current_x = torch.clip(current_x, -self.clip_sampler, self.clip_sampler)
        return current_x
