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
    """``kind``: "ddpm" (variance fixed_small) or "ddim"; ``clip_sample`` clamps x0 to [-1, 1].

    ``prediction_type`` as in diffusers' schedulers: "epsilon", "sample" (the net gives x0) or
    "v_prediction" (x0 = sqrt(a) x - sqrt(1 - a) v, eps = sqrt(a) v + sqrt(1 - a) x); ``eta`` is
    DDIMScheduler.step's: ``std_dev_t = eta * variance ** 0.5`` shrinks the direction term and
    scales a draw of noise (none at eta = 0); ``use_clipped_model_output=False`` (DDIMScheduler's
    default) keeps the unclipped eps in the direction term."""

    def __init__(self, dim=4, obs_dim=3, num_train_timesteps=100, num_inference_steps=10, kind="ddpm",
                 clip_sample=True, prediction_type="epsilon", eta=0.0,
                 use_clipped_model_output=True):
        super().__init__()
        self.unet = Net(dim, obs_dim)
        self.dim, self.kind, self.clip_sample = dim, kind, clip_sample
        self.prediction_type, self.eta = prediction_type, eta
        self.use_clipped_model_output = use_clipped_model_output
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
        # DDIMScheduler.step's order: x0 and eps from the prediction, then x0 clipped; eps is read
        # again from the clipped x0 only with ``use_clipped_model_output``.
        if self.prediction_type == "epsilon":
            pred_original_sample = (sample - beta_prod_t ** 0.5 * model_output) / alpha_prod_t ** 0.5
            pred_epsilon = model_output
        elif self.prediction_type == "sample":
            pred_original_sample = model_output
            pred_epsilon = (sample - alpha_prod_t ** 0.5 * pred_original_sample) / beta_prod_t ** 0.5
        else:
            pred_original_sample = alpha_prod_t ** 0.5 * sample - beta_prod_t ** 0.5 * model_output
            pred_epsilon = alpha_prod_t ** 0.5 * model_output + beta_prod_t ** 0.5 * sample
        if self.clip_sample:
            pred_original_sample = pred_original_sample.clamp(-1.0, 1.0)
        if self.kind == "ddim":
            if self.use_clipped_model_output:
                pred_epsilon = (sample - alpha_prod_t ** 0.5 * pred_original_sample) / beta_prod_t ** 0.5
            variance = (beta_prod_t_prev / beta_prod_t) * (1 - alpha_prod_t / alpha_prod_t_prev)
            std_dev_t = self.eta * variance ** 0.5
            pred_sample_direction = (1 - alpha_prod_t_prev - std_dev_t ** 2) ** 0.5 * pred_epsilon
            prev_sample = alpha_prod_t_prev ** 0.5 * pred_original_sample + pred_sample_direction
            if self.eta > 0:
                variance_noise = torch.randn_like(model_output) if noise is None else noise
                prev_sample = prev_sample + std_dev_t * variance_noise
            return prev_sample
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
            model_output = self.unet(x, torch.full((obs.shape[0],), t, dtype=torch.long, device=obs.device), obs)
            x = self.step(model_output, t, x, None if noise is None else noise[k + 1])
        return x
