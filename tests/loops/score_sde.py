"""score_sde (yang-song/score_sde_pytorch): sampling.py ``get_pc_sampler`` with ``EulerMaruyamaPredictor``
or ``ReverseDiffusionPredictor`` and ``NoneCorrector``, sde_lib.py ``VPSDE`` (``sde``, ``marginal_prob``,
``discretize``, ``reverse``), models/utils.py ``get_score_fn`` (continuous: labels ``t * 999``, std from
``marginal_prob``; discrete: labels ``t * (N - 1)``, std ``sqrt_1m_alphas_cumprod[labels.long()]``), on
an MLP score network for ``(B, D)`` data (``[:, None, None, None]`` written ``[:, None]``), small sizes.

Time is continuous: ``timesteps = torch.linspace(sde.T, eps, sde.N)``, ``vec_t = torch.ones(B) * t``.
The sampler returns ``x_mean`` of the last step (``denoise=True``), the inverse scaler the identity
(``data.centered=False``). The noise is given as tensors: ``noise[0]`` the prior draw, ``noise[1 + i]``
step ``i``'s ``torch.randn_like(x)``."""
import abc
import math

import numpy as np
import torch
from torch import nn


class GaussianFourierOrSinusoidal(nn.Module):
    """models/layers.py ``get_timestep_embedding`` (DDPM's sinusoidal embedding of the float labels)."""

    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, timesteps, max_positions=10000):
        half_dim = self.dim // 2
        emb = math.log(max_positions) / (half_dim - 1)
        emb = torch.exp(torch.arange(half_dim, dtype=torch.float32, device=timesteps.device) * -emb)
        emb = timesteps.float()[:, None] * emb[None, :]
        emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1)
        return emb


class ScoreMLP(nn.Module):
    def __init__(self, dim=4, t_dim=16, hidden=64):
        super().__init__()
        self.temb = GaussianFourierOrSinusoidal(t_dim)
        self.temb_mlp = nn.Sequential(nn.Linear(t_dim, t_dim * 4), nn.SiLU(), nn.Linear(t_dim * 4, t_dim))
        self.net = nn.Sequential(nn.Linear(dim + t_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
                                 nn.Linear(hidden, dim))

    def forward(self, x, labels):
        return self.net(torch.cat([x, self.temb_mlp(self.temb(labels))], dim=1))


class SDE(abc.ABC):
    def __init__(self, N):
        super().__init__()
        self.N = N

    def reverse(self, score_fn, probability_flow=False):
        N = self.N
        T = self.T
        sde_fn = self.sde
        discretize_fn = self.discretize

        class RSDE(self.__class__):
            def __init__(self):
                self.N = N
                self.probability_flow = probability_flow

            @property
            def T(self):
                return T

            def sde(self, x, t):
                drift, diffusion = sde_fn(x, t)
                score = score_fn(x, t)
                drift = drift - diffusion[:, None] ** 2 * score * (0.5 if self.probability_flow else 1.)
                diffusion = 0. if self.probability_flow else diffusion
                return drift, diffusion

            def discretize(self, x, t):
                f, G = discretize_fn(x, t)
                rev_f = f - G[:, None] ** 2 * score_fn(x, t) * (0.5 if self.probability_flow else 1.)
                rev_G = torch.zeros_like(G) if self.probability_flow else G
                return rev_f, rev_G

        return RSDE()


class VPSDE(SDE):
    def __init__(self, beta_min=0.1, beta_max=20, N=1000):
        super().__init__(N)
        self.beta_0 = beta_min
        self.beta_1 = beta_max
        self.N = N
        self.discrete_betas = torch.linspace(beta_min / N, beta_max / N, N)
        self.alphas = 1. - self.discrete_betas
        self.alphas_cumprod = torch.cumprod(self.alphas, dim=0)
        self.sqrt_alphas_cumprod = torch.sqrt(self.alphas_cumprod)
        self.sqrt_1m_alphas_cumprod = torch.sqrt(1. - self.alphas_cumprod)

    @property
    def T(self):
        return 1

    def sde(self, x, t):
        beta_t = self.beta_0 + t * (self.beta_1 - self.beta_0)
        drift = -0.5 * beta_t[:, None] * x
        diffusion = torch.sqrt(beta_t)
        return drift, diffusion

    def marginal_prob(self, x, t):
        log_mean_coeff = -0.25 * t ** 2 * (self.beta_1 - self.beta_0) - 0.5 * t * self.beta_0
        mean = torch.exp(log_mean_coeff[:, None]) * x
        std = torch.sqrt(1. - torch.exp(2. * log_mean_coeff))
        return mean, std

    def prior_sampling(self, shape):
        return torch.randn(*shape)

    def discretize(self, x, t):
        timestep = (t * (self.N - 1) / self.T).long()
        beta = self.discrete_betas.to(x.device)[timestep]
        alpha = self.alphas.to(x.device)[timestep]
        sqrt_beta = torch.sqrt(beta)
        f = torch.sqrt(alpha)[:, None] * x - x
        G = sqrt_beta
        return f, G


def get_score_fn(sde, model, train=False, continuous=False):
    model_fn = model  # get_model_fn: model.eval(); model(x, labels)

    def score_fn(x, t):
        if continuous:
            labels = t * 999
            score = model_fn(x, labels)
            std = sde.marginal_prob(torch.zeros_like(x), t)[1]
        else:
            labels = t * (sde.N - 1)
            score = model_fn(x, labels)
            std = sde.sqrt_1m_alphas_cumprod.to(labels.device)[labels.long()]
        score = -score / std[:, None]
        return score
    return score_fn


class EulerMaruyamaPredictor:
    def __init__(self, sde, score_fn, probability_flow=False):
        self.sde = sde
        self.rsde = sde.reverse(score_fn, probability_flow)
        self.score_fn = score_fn

    def update_fn(self, x, t, z):
        dt = -1. / self.rsde.N
        # z = torch.randn_like(x)
        drift, diffusion = self.rsde.sde(x, t)
        x_mean = x + drift * dt
        x = x_mean + diffusion[:, None] * np.sqrt(-dt) * z
        return x, x_mean


class ReverseDiffusionPredictor:
    def __init__(self, sde, score_fn, probability_flow=False):
        self.sde = sde
        self.rsde = sde.reverse(score_fn, probability_flow)
        self.score_fn = score_fn

    def update_fn(self, x, t, z):
        f, G = self.rsde.discretize(x, t)
        # z = torch.randn_like(x)
        x_mean = x - f
        x = x_mean + G[:, None] * z
        return x, x_mean


class NoneCorrector:
    def __init__(self, sde, score_fn, snr, n_steps):
        pass

    def update_fn(self, x, t):
        return x, x


class PCSampler(nn.Module):
    """``get_pc_sampler(sde, shape, predictor, NoneCorrector, inverse_scaler, snr, n_steps=1,
    probability_flow, continuous, denoise=True, eps=1e-3)`` applied to the model. ``beta_max``: VPSDE's (20,
    with N = 1000 in the configs; a few-step discrete probe needs ``beta_max / N < 1``, else the discrete
    alphas are negative and ``torch.sqrt(alpha)`` is NaN in eager too)."""

    def __init__(self, dim=4, N=6, predictor="euler_maruyama", continuous=True, probability_flow=False, eps=1e-3,
                 denoise=True, beta_max=20.):
        super().__init__()
        self.model = ScoreMLP(dim)
        self.sde = VPSDE(beta_min=0.1, beta_max=beta_max, N=N)
        self.predictor, self.continuous, self.probability_flow = predictor, continuous, probability_flow
        self.eps, self.denoise, self.dim = eps, denoise, dim

    def forward(self, noise):
        sde, eps = self.sde, self.eps
        shape = (noise.shape[1], self.dim)
        device = noise.device
        score_fn = get_score_fn(sde, self.model, train=False, continuous=self.continuous)
        predictor_cls = EulerMaruyamaPredictor if self.predictor == "euler_maruyama" else ReverseDiffusionPredictor
        predictor_obj = predictor_cls(sde, score_fn, self.probability_flow)
        corrector_obj = NoneCorrector(sde, score_fn, 0.16, 1)
        with torch.no_grad():
            x = noise[0]  # sde.prior_sampling(shape).to(device)
            timesteps = torch.linspace(sde.T, eps, sde.N, device=device)
            for i in range(sde.N):
                t = timesteps[i]
                vec_t = torch.ones(shape[0], device=t.device) * t
                x, x_mean = corrector_obj.update_fn(x, vec_t)
                x, x_mean = predictor_obj.update_fn(x, vec_t, noise[1 + i])
            return x_mean if self.denoise else x
