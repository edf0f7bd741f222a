"""DIPO (BellmanTimeHut/DIPO, agent/diffusion.py ``Diffusion.p_sample_loop`` / ``sample``, agent/model.py
``Model``, agent/helpers.py), small sizes, the noise given as tensors: ``noise[0]`` the initial draw
(``torch.randn(shape)``), ``noise[1 + k]`` step ``k``'s ``torch.randn_like(x)``.

DIPO scales the step's noise by ``self.noise_ratio`` (0 when ``eval``, ``max_noise_ratio`` otherwise),
clamps x0 in place (``x_recon.clamp_(-1., 1.)``), builds ``posterior_mean_coef*`` with ``np.sqrt`` of
tensors, and clamps the action in place after the loop (``action.clamp_(-1., 1.)``)."""
import numpy as np
import torch
import torch.nn as nn

from .common import SinusoidalPosEmb, extract


def init_weights(m):
    def truncated_normal_init(t, mean=0.0, std=0.01):
        torch.nn.init.normal_(t, mean=mean, std=std)
        while True:
            cond = torch.logical_or(t < mean - 2 * std, t > mean + 2 * std)
            if not torch.sum(cond):
                break
            t = torch.where(cond, torch.nn.init.normal_(torch.ones(t.shape), mean=mean, std=std), t)
        return t

    if type(m) == nn.Linear:
        input_dim = m.in_features
        truncated_normal_init(m.weight, std=1 / (2 * np.sqrt(input_dim)))
        m.bias.data.fill_(0.0)


def vp_beta_schedule(timesteps, dtype=torch.float32):
    t = np.arange(1, timesteps + 1)
    T = timesteps
    b_max = 10.
    b_min = 0.1
    alpha = np.exp(-b_min / T - 0.5 * (b_max - b_min) * (2 * t - 1) / T ** 2)
    betas = 1 - alpha
    return torch.tensor(betas, dtype=dtype)


class Model(nn.Module):
    def __init__(self, state_dim, action_dim, hidden_size=64, time_dim=16):
        super(Model, self).__init__()
        self.time_mlp = nn.Sequential(
            SinusoidalPosEmb(time_dim),
            nn.Linear(time_dim, hidden_size),
            nn.Mish(),
            nn.Linear(hidden_size, time_dim),
        )
        input_dim = state_dim + action_dim + time_dim
        self.layer = nn.Sequential(nn.Linear(input_dim, hidden_size),
                                   nn.Mish(),
                                   nn.Linear(hidden_size, hidden_size),
                                   nn.Mish(),
                                   nn.Linear(hidden_size, hidden_size),
                                   nn.Mish(),
                                   nn.Linear(hidden_size, action_dim))
        self.apply(init_weights)

    def forward(self, x, time, state):
        t = self.time_mlp(time)
        out = torch.cat([x, t, state], dim=-1)
        out = self.layer(out)
        return out


class DIPODiffusion(nn.Module):
    """``eval``: DIPO's ``sample(state, eval=True)`` (noise_ratio 0: the noise term times 0.)."""

    def __init__(self, state_dim=11, action_dim=3, noise_ratio=1.0, n_timesteps=5, clip_denoised=True,
                 predict_epsilon=True, eval=False):
        super(DIPODiffusion, self).__init__()
        self.state_dim = state_dim
        self.action_dim = action_dim
        self.model = Model(state_dim, action_dim)
        self.max_noise_ratio = noise_ratio
        self.noise_ratio = noise_ratio
        self.eval_mode = eval
        betas = vp_beta_schedule(n_timesteps)
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

    def p_mean_variance(self, x, t, s):
        x_recon = self.predict_start_from_noise(x, t=t, noise=self.model(x, t, s))
        if self.clip_denoised:
            x_recon.clamp_(-1., 1.)
        else:
            assert RuntimeError()
        model_mean, posterior_variance, posterior_log_variance = self.q_posterior(x_start=x_recon, x_t=x, t=t)
        return model_mean, posterior_variance, posterior_log_variance

    def p_sample(self, x, t, s, draw):
        b, *_, device = *x.shape, x.device
        model_mean, _, model_log_variance = self.p_mean_variance(x=x, t=t, s=s)
        noise = draw  # torch.randn_like(x)
        nonzero_mask = (1 - (t == 0).float()).reshape(b, *((1,) * (len(x.shape) - 1)))
        return model_mean + nonzero_mask * (0.5 * model_log_variance).exp() * noise * self.noise_ratio

    def p_sample_loop(self, state, shape, noise):
        device = self.betas.device
        batch_size = shape[0]
        x = noise[0]  # torch.randn(shape, device=device)
        for k, i in enumerate(reversed(range(0, self.n_timesteps))):
            timesteps = torch.full((batch_size,), i, device=device, dtype=torch.long)
            x = self.p_sample(x, timesteps, state, noise[1 + k])
        return x

    def sample(self, state, noise, eval=False):
        self.noise_ratio = 0 if eval else self.max_noise_ratio
        batch_size = state.shape[0]
        shape = (batch_size, self.action_dim)
        action = self.p_sample_loop(state, shape, noise)
        return action.clamp_(-1., 1.)

    def forward(self, state, noise):
        with torch.no_grad():
            return self.sample(state, noise, self.eval_mode)
