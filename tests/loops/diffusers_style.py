"""A diffusers-scheduler-style loop written in one graph: DDPMScheduler.step / DDIMScheduler.step's
arithmetic inline, with ``alphas_cumprod`` indexed by the Python-int timestep."""
import torch
from torch import nn

from .common import SinusoidalPosEmb


class Net(nn.Module):
    def __init__(self, dim, obs_dim, hidden=64, t_dim=16):
        super().__init__()
        self.temb = SinusoidalPosEmb(t_dim)
        self.net = nn.Sequential(nn.Linear(dim + t_dim + obs_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden),
                                 nn.SiLU(), nn.Linear(hidden, dim))

    def forward(self, x, t, obs):
        return self.net(torch.cat([x, self.temb(t), obs], dim=-1))


class SchedulerLoop(nn.Module):
    """``kind``: "ddpm" (variance fixed_small) or "ddim" (eta = 0); ``clip_sample`` clamps x0 to [-1, 1]."""

    def __init__(self, dim=4, obs_dim=3, num_train_timesteps=100, num_inference_steps=10, kind="ddpm",
                 clip_sample=True):
        super().__init__()
        self.unet = Net(dim, obs_dim)
        self.dim, self.kind, self.clip_sample = dim, kind, clip_sample
        betas = torch.linspace(1e-4, 0.02, num_train_timesteps, dtype=torch.float32)
        self.register_buffer("alphas_cumprod", torch.cumprod(1.0 - betas, dim=0))
        self.one = torch.tensor(1.0)
        step = num_train_timesteps // num_inference_steps
        self.timesteps = list(range(0, num_train_timesteps, step))[::-1]
        self.step_ratio = step

    def step(self, model_output, t, sample, noise):
        prev_t = t - self.step_ratio
        alpha_prod_t = self.alphas_cumprod[t]
        alpha_prod_t_prev = self.alphas_cumprod[prev_t] if prev_t >= 0 else self.one
        beta_prod_t = 1 - alpha_prod_t
        beta_prod_t_prev = 1 - alpha_prod_t_prev
        pred_original_sample = (sample - beta_prod_t ** 0.5 * model_output) / alpha_prod_t ** 0.5
        if self.clip_sample:
            pred_original_sample = pred_original_sample.clamp(-1.0, 1.0)
        if self.kind == "ddim":
            pred_epsilon = (sample - alpha_prod_t ** 0.5 * pred_original_sample) / beta_prod_t ** 0.5
            return alpha_prod_t_prev ** 0.5 * pred_original_sample + (1 - alpha_prod_t_prev) ** 0.5 * pred_epsilon
        current_alpha_t = alpha_prod_t / alpha_prod_t_prev
        current_beta_t = 1 - current_alpha_t
        pred_original_sample_coeff = (alpha_prod_t_prev ** 0.5 * current_beta_t) / beta_prod_t
        current_sample_coeff = current_alpha_t ** 0.5 * beta_prod_t_prev / beta_prod_t
        pred_prev_sample = pred_original_sample_coeff * pred_original_sample + current_sample_coeff * sample
        if t > 0:
            variance = torch.clamp(beta_prod_t_prev / beta_prod_t * current_beta_t, min=1e-20)
            variance_noise = torch.randn_like(model_output) if noise is None else noise
            pred_prev_sample = pred_prev_sample + variance ** 0.5 * variance_noise
        return pred_prev_sample

    def forward(self, obs, noise=None):
        x = torch.randn(obs.shape[0], self.dim) if noise is None else noise[0]
        for k, t in enumerate(self.timesteps):
            model_output = self.unet(x, torch.full((obs.shape[0],), t, dtype=torch.long), obs)
            x = self.step(model_output, t, x, None if noise is None else noise[k + 1])
        return x
