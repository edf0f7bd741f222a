"""Janner et al.'s diffuser (jannerm/diffuser, diffuser/models/diffusion.py ``GaussianDiffusion.p_sample_loop``
/ ``p_sample`` / ``p_mean_variance``, diffuser/models/helpers.py ``apply_conditioning``, ``extract``,
``cosine_beta_schedule``), an MLP over the flattened trajectory in place of the TemporalUnet (it takes
``(x, cond, t)`` and ignores ``cond``, as TemporalUnet does), small sizes.

The trajectory ``(B, horizon, action_dim + observation_dim)`` is conditioned by inpainting: after the
initial draw and after every step ``x[:, 0, action_dim:] = state.clone()`` (``conditions = {0: state}``).
The noise is given as tensors: ``noise[0]`` the initial draw, ``noise[1 + k]`` step ``k``'s draw.
``predict_epsilon=False`` is the locomotion configs' choice (the network gives x0); ``clip_denoised``
False is the class default (``assert RuntimeError()`` is a no-op)."""
import numpy as np
import torch
from torch import nn

from .common import SinusoidalPosEmb, extract
from .dppo import cosine_beta_schedule


def apply_conditioning(x, conditions, action_dim):
    for t, val in conditions.items():
        x[:, t, action_dim:] = val.clone()
    return x


class TrajectoryMLP(nn.Module):
    """TemporalUnet's interface (``x : [batch x horizon x transition]``, ``time_mlp`` = SinusoidalPosEmb,
    Linear, Mish, Linear) with an MLP body on the flattened trajectory."""

    def __init__(self, horizon, transition_dim, dim=16, hidden=64):
        super().__init__()
        self.horizon, self.transition_dim = horizon, transition_dim
        self.time_mlp = nn.Sequential(SinusoidalPosEmb(dim), nn.Linear(dim, dim * 4), nn.Mish(), nn.Linear(dim * 4, dim))
        self.mlp = nn.Sequential(nn.Linear(horizon * transition_dim + dim, hidden), nn.Mish(), nn.Linear(hidden, hidden),
                                 nn.Mish(), nn.Linear(hidden, horizon * transition_dim))

    def forward(self, x, cond, time):
        b = x.shape[0]
        t = self.time_mlp(time)
        out = self.mlp(torch.cat([x.reshape(b, -1), t], dim=-1))
        return out.reshape(b, self.horizon, self.transition_dim)


class GaussianDiffusion(nn.Module):
    def __init__(self, horizon=4, observation_dim=5, action_dim=2, n_timesteps=6, clip_denoised=False,
                 predict_epsilon=False, conditioning=True):
        super().__init__()
        self.horizon = horizon
        self.observation_dim = observation_dim
        self.action_dim = action_dim
        self.transition_dim = observation_dim + action_dim
        self.model = TrajectoryMLP(horizon, self.transition_dim)
        self.conditioning = conditioning

        betas = cosine_beta_schedule(n_timesteps)
        alphas = 1. - betas
        alphas_cumprod = torch.cumprod(alphas, axis=0)
        alphas_cumprod_prev = torch.cat([torch.ones(1), alphas_cumprod[:-1]])

        self.n_timesteps = int(n_timesteps)
        self.clip_denoised = clip_denoised
        self.predict_epsilon = predict_epsilon

        self.register_buffer('betas', betas)
        self.register_buffer('alphas_cumprod', alphas_cumprod)
        self.register_buffer('alphas_cumprod_prev', alphas_cumprod_prev)
        self.register_buffer('sqrt_alphas_cumprod', torch.sqrt(alphas_cumprod))
        self.register_buffer('sqrt_one_minus_alphas_cumprod', torch.sqrt(1. - alphas_cumprod))
        self.register_buffer('log_one_minus_alphas_cumprod', torch.log(1. - alphas_cumprod))
        self.register_buffer('sqrt_recip_alphas_cumprod', torch.sqrt(1. / alphas_cumprod))
        self.register_buffer('sqrt_recipm1_alphas_cumprod', torch.sqrt(1. / alphas_cumprod - 1))
        posterior_variance = betas * (1. - alphas_cumprod_prev) / (1. - alphas_cumprod)
        self.register_buffer('posterior_variance', posterior_variance)
        self.register_buffer('posterior_log_variance_clipped',
                             torch.log(torch.clamp(posterior_variance, min=1e-20)))
        self.register_buffer('posterior_mean_coef1',
                             betas * np.sqrt(alphas_cumprod_prev) / (1. - alphas_cumprod))
        self.register_buffer('posterior_mean_coef2',
                             (1. - alphas_cumprod_prev) * np.sqrt(alphas) / (1. - alphas_cumprod))

    def _condition(self, x, cond):
        return apply_conditioning(x, cond, self.action_dim) if self.conditioning else x

    def predict_start_from_noise(self, x_t, t, noise):
        if self.predict_epsilon:
            return (
                extract(self.sqrt_recip_alphas_cumprod, t, x_t.shape) * x_t -
                extract(self.sqrt_recipm1_alphas_cumprod, t, x_t.shape) * noise
            )
        else:
            return noise

    def q_posterior(self, x_start, x_t, t):
        posterior_mean = (
            extract(self.posterior_mean_coef1, t, x_t.shape) * x_start +
            extract(self.posterior_mean_coef2, t, x_t.shape) * x_t
        )
        posterior_variance = extract(self.posterior_variance, t, x_t.shape)
        posterior_log_variance_clipped = extract(self.posterior_log_variance_clipped, t, x_t.shape)
        return posterior_mean, posterior_variance, posterior_log_variance_clipped

    def p_mean_variance(self, x, cond, t):
        x_recon = self.predict_start_from_noise(x, t=t, noise=self.model(x, cond, t))
        if self.clip_denoised:
            x_recon.clamp_(-1., 1.)
        else:
            assert RuntimeError()
        model_mean, posterior_variance, posterior_log_variance = self.q_posterior(x_start=x_recon, x_t=x, t=t)
        return model_mean, posterior_variance, posterior_log_variance

    def p_sample(self, x, cond, t, draw):
        b, *_, device = *x.shape, x.device
        model_mean, _, model_log_variance = self.p_mean_variance(x=x, cond=cond, t=t)
        noise = draw  # torch.randn_like(x)
        nonzero_mask = (1 - (t == 0).float()).reshape(b, *((1,) * (len(x.shape) - 1)))
        return model_mean + nonzero_mask * (0.5 * model_log_variance).exp() * noise

    def p_sample_loop(self, shape, cond, noise):
        device = self.betas.device
        batch_size = shape[0]
        x = noise[0].clone()  # torch.randn(shape, device=device): a fresh tensor apply_conditioning writes into
        x = self._condition(x, cond)
        for k, i in enumerate(reversed(range(0, self.n_timesteps))):
            timesteps = torch.full((batch_size,), i, device=device, dtype=torch.long)
            x = self.p_sample(x, cond, timesteps, noise[1 + k])
            x = self._condition(x, cond)
        return x

    def conditional_sample(self, cond, noise, horizon=None):
        batch_size = len(cond[0])
        horizon = horizon or self.horizon
        shape = (batch_size, horizon, self.transition_dim)
        return self.p_sample_loop(shape, cond, noise)

    def forward(self, state, noise):
        with torch.no_grad():
            return self.conditional_sample({0: state}, noise)
