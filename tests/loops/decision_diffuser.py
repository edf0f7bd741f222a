"""Decision Diffuser (anuragajay/decision-diffuser, code/diffuser/models/diffusion.py
``ActionGaussianDiffusion.p_sample_loop`` / ``p_sample`` / ``p_mean_variance`` with
code/diffuser/models/temporal.py ``MLPnet``), small sizes, config/locomotion_config.py's choices:
``returns_condition=True``, ``condition_guidance_w=1.2``, ``condition_dropout=0.25``, ``clip_denoised=True``,
``predict_epsilon=True``, returns ``0.9`` (``test_ret``).

Classifier-free guidance: two network applications a step, ``model(x, cond, t, returns, use_dropout=False)``
and ``model(x, cond, t, returns, force_dropout=True)`` (MLPnet then also samples its Bernoulli mask,
``use_dropout`` defaulting to True, and multiplies the returns embedding by it and by 0);
``epsilon = epsilon_uncond + w * (epsilon_cond - epsilon_uncond)``. The draws are ``0.5 * torch.randn``:
the noise is given as tensors, ``noise[0]`` the initial draw, ``noise[1 + k]`` step ``k``'s."""
import numpy as np
import torch
from torch import nn
from torch.distributions import Bernoulli

from .common import SinusoidalPosEmb, extract
from .dppo import cosine_beta_schedule


class MLPnet(nn.Module):
    def __init__(self, transition_dim, cond_dim, dim=16, hidden=64, returns_condition=True, condition_dropout=0.25,
                 calc_energy=False):
        super().__init__()
        act_fn = nn.SiLU() if calc_energy else nn.Mish()
        self.time_dim = dim
        self.returns_dim = dim
        self.time_mlp = nn.Sequential(SinusoidalPosEmb(dim), nn.Linear(dim, dim * 4), act_fn, nn.Linear(dim * 4, dim))
        self.returns_condition = returns_condition
        self.condition_dropout = condition_dropout
        self.calc_energy = calc_energy
        self.transition_dim = transition_dim
        self.action_dim = transition_dim - cond_dim
        if self.returns_condition:
            self.returns_mlp = nn.Sequential(nn.Linear(1, dim), act_fn, nn.Linear(dim, dim * 4), act_fn,
                                             nn.Linear(dim * 4, dim))
            self.mask_dist = Bernoulli(probs=1 - self.condition_dropout)
            embed_dim = 2 * dim
        else:
            embed_dim = dim
        self.mlp = nn.Sequential(nn.Linear(embed_dim + transition_dim, hidden), act_fn, nn.Linear(hidden, hidden),
                                 act_fn, nn.Linear(hidden, self.action_dim))

    def forward(self, x, cond, time, returns=None, use_dropout=True, force_dropout=False):
        t = self.time_mlp(time)
        if self.returns_condition:
            assert returns is not None
            returns_embed = self.returns_mlp(returns)
            if use_dropout:
                mask = self.mask_dist.sample(sample_shape=(returns_embed.size(0), 1)).to(returns_embed.device)
                returns_embed = mask * returns_embed
            if force_dropout:
                returns_embed = 0 * returns_embed
            t = torch.cat([t, returns_embed], dim=-1)
        inp = torch.cat([t, cond, x], dim=-1)
        out = self.mlp(inp)
        return out


class ActionGaussianDiffusion(nn.Module):
    def __init__(self, observation_dim=11, action_dim=3, n_timesteps=6, clip_denoised=True, predict_epsilon=True,
                 returns_condition=True, condition_guidance_w=1.2):
        super().__init__()
        self.observation_dim = observation_dim
        self.action_dim = action_dim
        self.transition_dim = observation_dim + action_dim
        self.model = MLPnet(self.transition_dim, observation_dim, returns_condition=returns_condition)
        self.returns_condition = returns_condition
        self.condition_guidance_w = condition_guidance_w
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
        self.register_buffer('posterior_log_variance_clipped', torch.log(torch.clamp(posterior_variance, min=1e-20)))
        self.register_buffer('posterior_mean_coef1', betas * np.sqrt(alphas_cumprod_prev) / (1. - alphas_cumprod))
        self.register_buffer('posterior_mean_coef2',
                             (1. - alphas_cumprod_prev) * np.sqrt(alphas) / (1. - alphas_cumprod))

    def predict_start_from_noise(self, x_t, t, noise):
        if self.predict_epsilon:
            return (extract(self.sqrt_recip_alphas_cumprod, t, x_t.shape) * x_t -
                    extract(self.sqrt_recipm1_alphas_cumprod, t, x_t.shape) * noise)
        else:
            return noise

    def q_posterior(self, x_start, x_t, t):
        posterior_mean = (extract(self.posterior_mean_coef1, t, x_t.shape) * x_start +
                          extract(self.posterior_mean_coef2, t, x_t.shape) * x_t)
        posterior_variance = extract(self.posterior_variance, t, x_t.shape)
        posterior_log_variance_clipped = extract(self.posterior_log_variance_clipped, t, x_t.shape)
        return posterior_mean, posterior_variance, posterior_log_variance_clipped

    def p_mean_variance(self, x, cond, t, returns=None):
        if self.model.calc_energy:
            raise NotImplementedError
        if self.returns_condition:
            epsilon_cond = self.model(x, cond, t, returns, use_dropout=False)
            epsilon_uncond = self.model(x, cond, t, returns, force_dropout=True)
            epsilon = epsilon_uncond + self.condition_guidance_w * (epsilon_cond - epsilon_uncond)
        else:
            epsilon = self.model(x, cond, t)
        t = t.detach().to(torch.int64)
        x_recon = self.predict_start_from_noise(x, t=t, noise=epsilon)
        if self.clip_denoised:
            x_recon.clamp_(-1., 1.)
        else:
            assert RuntimeError()
        model_mean, posterior_variance, posterior_log_variance = self.q_posterior(x_start=x_recon, x_t=x, t=t)
        return model_mean, posterior_variance, posterior_log_variance

    def p_sample(self, x, cond, t, returns, draw):
        b, *_, device = *x.shape, x.device
        model_mean, _, model_log_variance = self.p_mean_variance(x=x, cond=cond, t=t, returns=returns)
        noise = 0.5 * draw  # 0.5*torch.randn_like(x)
        nonzero_mask = (1 - (t == 0).float()).reshape(b, *((1,) * (len(x.shape) - 1)))
        return model_mean + nonzero_mask * (0.5 * model_log_variance).exp() * noise

    def p_sample_loop(self, shape, cond, returns, noise):
        device = self.betas.device
        batch_size = shape[0]
        x = 0.5 * noise[0]  # 0.5*torch.randn(shape, device=device)
        for k, i in enumerate(reversed(range(0, self.n_timesteps))):
            timesteps = torch.full((batch_size,), i, device=device, dtype=torch.long)
            x = self.p_sample(x, cond, timesteps, returns, noise[1 + k])
        return x

    def conditional_sample(self, cond, returns, noise):
        batch_size = len(cond[0])
        shape = (batch_size, self.action_dim)
        cond = cond[0]
        return self.p_sample_loop(shape, cond, returns, noise)

    def forward(self, state, returns, noise):
        with torch.no_grad():
            return self.conditional_sample({0: state}, returns, noise)
