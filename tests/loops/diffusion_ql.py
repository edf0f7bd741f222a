"""Diffusion-QL (agents/diffusion.py, agents/model.py): the policy's sampler, small sizes."""
import torch
from torch import nn

from .common import SinusoidalPosEmb, ddpm_buffers, extract, linear_beta_schedule


class MLP(nn.Module):
    def __init__(self, state_dim, action_dim, t_dim=16, hidden=256):
        super().__init__()
        self.time_mlp = nn.Sequential(SinusoidalPosEmb(t_dim), nn.Linear(t_dim, t_dim * 2), nn.Mish(),
                                      nn.Linear(t_dim * 2, t_dim))
        input_dim = state_dim + action_dim + t_dim
        self.mid_layer = nn.Sequential(nn.Linear(input_dim, hidden), nn.Mish(),
                                       nn.Linear(hidden, hidden), nn.Mish(),
                                       nn.Linear(hidden, hidden), nn.Mish())
        self.final_layer = nn.Linear(hidden, action_dim)

    def forward(self, x, time, state):
        t = self.time_mlp(time)
        x = torch.cat([x, t, state], dim=1)
        x = self.mid_layer(x)
        return self.final_layer(x)


class Diffusion(nn.Module):
    """``forward(state, noise=None)``: ``noise`` (n_timesteps + 1, B, action_dim) replaces
    the draws (the initial x first) so that a compiled run can be compared with eager."""

    def __init__(self, state_dim=17, action_dim=6, max_action=1.0, n_timesteps=5, hidden=256):
        super().__init__()
        self.state_dim, self.action_dim, self.max_action = state_dim, action_dim, max_action
        self.model = MLP(state_dim, action_dim, hidden=hidden)
        self.n_timesteps = n_timesteps
        self.clip_denoised = True
        ddpm_buffers(self, linear_beta_schedule(n_timesteps))

    def predict_start_from_noise(self, x_t, t, noise):
        return (extract(self.sqrt_recip_alphas_cumprod, t, x_t.shape) * x_t
                - extract(self.sqrt_recipm1_alphas_cumprod, t, x_t.shape) * noise)

    def q_posterior(self, x_start, x_t, t):
        posterior_mean = (extract(self.posterior_mean_coef1, t, x_t.shape) * x_start
                          + extract(self.posterior_mean_coef2, t, x_t.shape) * x_t)
        posterior_variance = extract(self.posterior_variance, t, x_t.shape)
        posterior_log_variance_clipped = extract(self.posterior_log_variance_clipped, t, x_t.shape)
        return posterior_mean, posterior_variance, posterior_log_variance_clipped

    def p_mean_variance(self, x, t, s):
        x_recon = self.predict_start_from_noise(x, t=t, noise=self.model(x, t, s))
        if self.clip_denoised:
            x_recon.clamp_(-self.max_action, self.max_action)
        model_mean, posterior_variance, posterior_log_variance = self.q_posterior(x_start=x_recon, x_t=x, t=t)
        return model_mean, posterior_variance, posterior_log_variance

    def p_sample(self, x, t, s, noise=None):
        b, *_ = x.shape
        model_mean, _, model_log_variance = self.p_mean_variance(x=x, t=t, s=s)
        noise = torch.randn_like(x) if noise is None else noise
        nonzero_mask = (1 - (t == 0).float()).reshape(b, *((1,) * (len(x.shape) - 1)))
        return model_mean + nonzero_mask * (0.5 * model_log_variance).exp() * noise

    def p_sample_loop(self, state, shape, noise=None):
        batch_size = shape[0]
        x = torch.randn(shape, device=state.device) if noise is None else noise[0]
        for i in reversed(range(0, self.n_timesteps)):
            timesteps = torch.full((batch_size,), i, device=state.device, dtype=torch.long)
            x = self.p_sample(x, timesteps, state, None if noise is None else noise[self.n_timesteps - i])
        return x

    def sample(self, state, noise=None):
        batch_size = state.shape[0]
        shape = (batch_size, self.action_dim)
        action = self.p_sample_loop(state, shape, noise)
        return action.clamp_(-self.max_action, self.max_action)

    forward = sample
