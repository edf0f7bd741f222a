"""DPPO's diffusion policy sampler (model/diffusion/diffusion.py, ``forward``), small sizes: an
action chunk ``(B, horizon, action_dim)`` flattened for the MLP with the sinusoidal time
embedding and the observation, x0 clipped to the denoised range, the standard deviation
``exp(0.5 * logvar)`` clamped below, the noise clamped, and the action clipped after the
last step only."""
import numpy as np
import torch
from torch import nn

from .common import SinusoidalPosEmb, extract, linear_beta_schedule


class DiffusionMLP(nn.Module):
    """``residual_style``: DPPO's ResidualMLP (below) for ``mlp_mean``, as its configs choose."""

    def __init__(self, action_dim, horizon, cond_dim, time_dim=16, hidden=64, residual_style=False):
        super().__init__()
        self.time_embedding = nn.Sequential(SinusoidalPosEmb(time_dim), nn.Linear(time_dim, time_dim * 2),
                                            nn.Mish(), nn.Linear(time_dim * 2, time_dim))
        in_dim, out_dim = action_dim * horizon + time_dim + cond_dim, action_dim * horizon
        if residual_style:
            self.mlp_mean = ResidualMLP([in_dim, hidden, hidden, hidden, hidden, hidden, out_dim])
        else:
            self.mlp_mean = nn.Sequential(nn.Linear(in_dim, hidden), nn.Mish(), nn.Linear(hidden, hidden), nn.Mish(),
                                          nn.Linear(hidden, out_dim))

    def forward(self, x, time, cond):
        B, Ta, Da = x.shape
        x = x.view(B, -1)
        time_emb = self.time_embedding(time.view(B, 1)).view(B, -1)
        out = self.mlp_mean(torch.cat([x, time_emb, cond], dim=-1))
        return out.view(B, Ta, Da)


class DPPODiffusion(nn.Module):
    def __init__(self, obs_dim=11, action_dim=2, horizon=4, denoising_steps=6, denoised_clip_value=1.0,
                 min_sampling_denoising_std=0.1, randn_clip_value=3.0, final_action_clip_value=1.0,
                 residual_style=False):
        super().__init__()
        self.network = DiffusionMLP(action_dim, horizon, obs_dim, residual_style=residual_style)
        self.action_dim, self.horizon, self.denoising_steps = action_dim, horizon, denoising_steps
        self.denoised_clip_value, self.min_sampling_denoising_std = denoised_clip_value, min_sampling_denoising_std
        self.randn_clip_value, self.final_action_clip_value = randn_clip_value, final_action_clip_value
        betas = linear_beta_schedule(denoising_steps)
        alphas = 1.0 - betas
        alphas_cumprod = torch.cumprod(alphas, dim=0)
        alphas_cumprod_prev = torch.cat([torch.ones(1), alphas_cumprod[:-1]])
        self.register_buffer("sqrt_recip_alphas_cumprod", torch.sqrt(1.0 / alphas_cumprod))
        self.register_buffer("sqrt_recipm1_alphas_cumprod", torch.sqrt(1.0 / alphas_cumprod - 1))
        ddpm_var = betas * (1.0 - alphas_cumprod_prev) / (1.0 - alphas_cumprod)
        self.register_buffer("ddpm_logvar_clipped", torch.log(torch.clamp(ddpm_var, min=1e-20)))
        self.register_buffer("ddpm_mu_coef1", betas * torch.sqrt(alphas_cumprod_prev) / (1.0 - alphas_cumprod))
        self.register_buffer("ddpm_mu_coef2", (1.0 - alphas_cumprod_prev) * torch.sqrt(alphas) / (1.0 - alphas_cumprod))

    def p_mean_var(self, x, t, cond):
        noise = self.network(x, t, cond=cond)
        x_recon = extract(self.sqrt_recip_alphas_cumprod, t, x.shape) * x \
            - extract(self.sqrt_recipm1_alphas_cumprod, t, x.shape) * noise
        x_recon.clamp_(-self.denoised_clip_value, self.denoised_clip_value)
        mu = extract(self.ddpm_mu_coef1, t, x.shape) * x_recon + extract(self.ddpm_mu_coef2, t, x.shape) * x
        return mu, extract(self.ddpm_logvar_clipped, t, x.shape)

    def forward(self, cond, noise):
        """``noise[0]`` the initial chunk, ``noise[1 + k]`` step ``k``'s draw."""
        B = cond.shape[0]
        x = noise[0]
        t_all = list(reversed(range(self.denoising_steps)))
        for i, t in enumerate(t_all):
            t_b = torch.full((B,), t, dtype=torch.long, device=x.device)
            mean, logvar = self.p_mean_var(x=x, t=t_b, cond=cond)
            std = torch.exp(0.5 * logvar)
            std = torch.clip(std, min=self.min_sampling_denoising_std)
            z = noise[1 + i].clamp_(-self.randn_clip_value, self.randn_clip_value)
            x = mean + std * z
            if self.final_action_clip_value is not None and i == len(t_all) - 1:
                x = torch.clamp(x, -self.final_action_clip_value, self.final_action_clip_value)
        return x


class TwoLayerPreActivationResNetLinear(nn.Module):
    """DPPO's residual block (model/common/mlp.py): ``x + l2(act(l1(act(x))))``, LayerNorms
    before each activation where ``use_layernorm``."""

    def __init__(self, hidden_dim, use_layernorm=False):
        super().__init__()
        self.l1 = nn.Linear(hidden_dim, hidden_dim)
        self.l2 = nn.Linear(hidden_dim, hidden_dim)
        self.act = nn.Mish()
        if use_layernorm:
            self.norm1 = nn.LayerNorm(hidden_dim, eps=1e-06)
            self.norm2 = nn.LayerNorm(hidden_dim, eps=1e-06)

    def forward(self, x):
        x_input = x
        if hasattr(self, "norm1"):
            x = self.norm1(x)
        x = self.l1(self.act(x))
        if hasattr(self, "norm2"):
            x = self.norm2(x)
        x = self.l2(self.act(x))
        return x + x_input


class ResidualMLP(nn.Module):
    """DPPO's ResidualMLP: Linear(in, H), residual blocks, Linear(H, out), Identity."""

    def __init__(self, dim_list, use_layernorm=False):
        super().__init__()
        hidden_dim = dim_list[1]
        num_hidden_layers = len(dim_list) - 3
        self.layers = nn.ModuleList([nn.Linear(dim_list[0], hidden_dim)])
        self.layers.extend([TwoLayerPreActivationResNetLinear(hidden_dim, use_layernorm)
                            for _ in range(1, num_hidden_layers, 2)])
        self.layers.append(nn.Linear(hidden_dim, dim_list[-1]))
        self.layers.append(nn.Identity())

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class DPPODDIM(DPPODiffusion):
    """DPPO's DDIM branch (``use_ddim``): ``ddim_steps`` of the training schedule, the tables
    ``ddim_alphas`` / ``ddim_alphas_prev`` / ``ddim_sqrt_one_minus_alphas`` / ``ddim_sigmas``
    (``eta``) flipped with ``torch.flip`` so that the loop's position ``i`` indexes them, read with
    ``extract`` at ``torch.full((B,), i)``, the network at the training timestep ``ddim_t[i]``;
    x0 clamped in place and eps read again from it, ``dir_xt = (1 - alpha_prev - sigma**2).sqrt()
    * eps``, ``logvar = torch.log(sigma ** 2)``. At eta = 0 (its evaluation) the standard deviation
    is replaced by ``torch.zeros_like(std)`` (``log(0) = -inf`` never reaches the sample); at eta > 0
    (fine-tuning) it is clipped below."""

    def __init__(self, ddim_steps=4, eta=0.0, **kw):
        super().__init__(denoising_steps=12, **kw)
        step_ratio = self.denoising_steps // ddim_steps
        ddim_t = torch.arange(0, self.denoising_steps, step_ratio)
        self.ddim_steps, self.eta = ddim_steps, eta
        betas = linear_beta_schedule(self.denoising_steps)
        alphas_cumprod = torch.cumprod(1 - betas, 0)
        ddim_alphas = alphas_cumprod[ddim_t]
        ddim_alphas_prev = torch.cat([torch.tensor([1.0]), alphas_cumprod[ddim_t[:-1]]])
        ddim_sigmas = eta * ((1 - ddim_alphas_prev) / (1 - ddim_alphas) * (1 - ddim_alphas / ddim_alphas_prev)) ** 0.5
        self.ddim_t = torch.flip(ddim_t, [0]).tolist()
        self.register_buffer("ddim_alphas", torch.flip(ddim_alphas, [0]))
        self.register_buffer("ddim_alphas_prev", torch.flip(ddim_alphas_prev, [0]))
        self.register_buffer("ddim_sqrt_one_minus_alphas", torch.flip((1.0 - ddim_alphas) ** 0.5, [0]))
        self.register_buffer("ddim_sigmas", torch.flip(ddim_sigmas, [0]))

    def forward(self, cond, noise):
        """``noise[0]`` the initial chunk, ``noise[1 + k]`` step ``k``'s draw."""
        B = cond.shape[0]
        x = noise[0]
        for i, t in enumerate(self.ddim_t):
            t_b = torch.full((B,), t, dtype=torch.long, device=x.device)
            index_b = torch.full((B,), i, dtype=torch.long, device=x.device)
            eps = self.network(x, t_b, cond=cond)
            alpha = extract(self.ddim_alphas, index_b, x.shape)
            alpha_prev = extract(self.ddim_alphas_prev, index_b, x.shape)
            sqrt_one_minus_alpha = extract(self.ddim_sqrt_one_minus_alphas, index_b, x.shape)
            x_recon = (x - sqrt_one_minus_alpha * eps) / (alpha ** 0.5)
            x_recon.clamp_(-self.denoised_clip_value, self.denoised_clip_value)
            eps = (x - alpha ** 0.5 * x_recon) / sqrt_one_minus_alpha
            sigma = extract(self.ddim_sigmas, index_b, x.shape)
            dir_xt = (1.0 - alpha_prev - sigma ** 2).sqrt() * eps
            mean = (alpha_prev ** 0.5) * x_recon + dir_xt
            std = torch.exp(0.5 * torch.log(sigma ** 2))
            std = torch.zeros_like(std) if self.eta == 0 else torch.clip(std, min=self.min_sampling_denoising_std)
            z = noise[1 + i].clamp_(-self.randn_clip_value, self.randn_clip_value)
            x = mean + std * z
            if i == self.ddim_steps - 1:
                x = torch.clamp(x, -self.final_action_clip_value, self.final_action_clip_value)
        return x


def cosine_beta_schedule(timesteps, s=0.008, dtype=torch.float32):
    """DPPO's model/diffusion/sampling.py schedule (numpy, float64, then ``dtype``)."""
    steps = timesteps + 1
    x = np.linspace(0, steps, steps)
    alphas_cumprod = np.cos(((x / steps) + s) / (1 + s) * np.pi * 0.5) ** 2
    alphas_cumprod = alphas_cumprod / alphas_cumprod[0]
    betas = 1 - (alphas_cumprod[1:] / alphas_cumprod[:-1])
    return torch.tensor(np.clip(betas, a_min=0, a_max=0.999), dtype=dtype)


def make_timesteps(batch_size, i, device):
    return torch.full((batch_size,), i, device=device, dtype=torch.long)


class DiffusionMLPAsIs(nn.Module):
    """model/diffusion/mlp_diffusion.py's DiffusionMLP: the observation history read from the
    ``cond`` dict (``cond["state"].view(B, -1)``), the time embedding of ``time.view(B, 1)``
    viewed to ``(B, time_dim)``, MLP blocks ``Linear, Mish`` with an Identity output."""

    def __init__(self, action_dim, horizon_steps, cond_dim, time_dim=16, mlp_dims=(64, 64)):
        super().__init__()
        self.time_embedding = nn.Sequential(SinusoidalPosEmb(time_dim), nn.Linear(time_dim, time_dim * 2),
                                            nn.Mish(), nn.Linear(time_dim * 2, time_dim))
        dims = [time_dim + action_dim * horizon_steps + cond_dim, *mlp_dims, action_dim * horizon_steps]
        self.mlp_mean = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b), nn.Mish() if k < len(dims) - 2 else nn.Identity())
            for k, (a, b) in enumerate(zip(dims[:-1], dims[1:])))
        self.time_dim = time_dim

    def forward(self, x, time, cond, **kwargs):
        B, Ta, Da = x.shape
        x = x.view(B, -1)
        state = cond["state"].view(B, -1)
        time = time.view(B, 1)
        time_emb = self.time_embedding(time).view(B, self.time_dim)
        x = torch.cat([x, time_emb, state], dim=-1)
        for m in self.mlp_mean:
            x = m(x)
        return x.view(B, Ta, Da)


class DPPOEval(nn.Module):
    """model/diffusion/diffusion.py's DiffusionModel, ``forward`` (evaluation sampling) as the
    project writes it: the tables plain tensor attributes (no buffers) of the cosine schedule;
    ``cond`` a dict with ``state`` ``(B, To, Do)``; x0 clamped in place; the standard deviation
    zeroed at ``t == 0`` (a Python branch) and clipped below at 1e-3 elsewhere; the draw clamped
    in place to ``randn_clip_value``; the action clipped after the last step only.

    ``use_ddim``: its DDIM branch, ``ddim_t`` a flipped long tensor whose 0-d elements the loop
    iterates (``make_timesteps(B, t)``: a ``torch.full`` of a 0-d tensor), the tables read at the
    loop's position ``index_b``, eps recomputed from the clamped x0 and clamped to
    ``eps_clip_value`` (in place) where that is set, the standard deviation always zero.

    ``forward(cond, noise)``: ``noise[0]`` the initial chunk, ``noise[1 + i]`` step ``i``'s draw."""

    def __init__(self, obs_dim=11, cond_steps=2, action_dim=2, horizon_steps=4, denoising_steps=8,
                 denoised_clip_value=1.0, randn_clip_value=10, final_action_clip_value=1.0, eps_clip_value=None,
                 use_ddim=False, ddim_steps=4):
        super().__init__()
        self.network = DiffusionMLPAsIs(action_dim, horizon_steps, obs_dim * cond_steps)
        self.horizon_steps, self.action_dim, self.obs_dim = horizon_steps, action_dim, obs_dim
        self.denoising_steps, self.use_ddim, self.ddim_steps = denoising_steps, use_ddim, ddim_steps
        self.denoised_clip_value, self.randn_clip_value = denoised_clip_value, randn_clip_value
        self.final_action_clip_value, self.eps_clip_value = final_action_clip_value, eps_clip_value
        self.betas = cosine_beta_schedule(denoising_steps)
        self.alphas = 1.0 - self.betas
        self.alphas_cumprod = torch.cumprod(self.alphas, axis=0)
        self.alphas_cumprod_prev = torch.cat([torch.ones(1), self.alphas_cumprod[:-1]])
        self.sqrt_recip_alphas_cumprod = torch.sqrt(1.0 / self.alphas_cumprod)
        self.sqrt_recipm1_alphas_cumprod = torch.sqrt(1.0 / self.alphas_cumprod - 1)
        self.ddpm_var = self.betas * (1.0 - self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        self.ddpm_logvar_clipped = torch.log(torch.clamp(self.ddpm_var, min=1e-20))
        self.ddpm_mu_coef1 = self.betas * torch.sqrt(self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        self.ddpm_mu_coef2 = (1.0 - self.alphas_cumprod_prev) * torch.sqrt(self.alphas) / (1.0 - self.alphas_cumprod)
        if use_ddim:
            step_ratio = denoising_steps // ddim_steps
            self.ddim_t = torch.arange(0, ddim_steps) * step_ratio
            self.ddim_alphas = self.alphas_cumprod[self.ddim_t].clone().to(torch.float32)
            self.ddim_alphas_prev = torch.cat([torch.tensor([1.0]).to(torch.float32),
                                               self.alphas_cumprod[self.ddim_t[:-1]]])
            self.ddim_sqrt_one_minus_alphas = (1.0 - self.ddim_alphas) ** 0.5
            ddim_eta = 0
            self.ddim_sigmas = ddim_eta * ((1 - self.ddim_alphas_prev) / (1 - self.ddim_alphas)
                                           * (1 - self.ddim_alphas / self.ddim_alphas_prev)) ** 0.5
            self.ddim_t = torch.flip(self.ddim_t, [0])
            self.ddim_alphas = torch.flip(self.ddim_alphas, [0])
            self.ddim_alphas_prev = torch.flip(self.ddim_alphas_prev, [0])
            self.ddim_sqrt_one_minus_alphas = torch.flip(self.ddim_sqrt_one_minus_alphas, [0])
            self.ddim_sigmas = torch.flip(self.ddim_sigmas, [0])

    def p_mean_var(self, x, t, cond, index=None):
        noise = self.network(x, t, cond=cond)
        if self.use_ddim:
            alpha = extract(self.ddim_alphas, index, x.shape)
            alpha_prev = extract(self.ddim_alphas_prev, index, x.shape)
            sqrt_one_minus_alpha = extract(self.ddim_sqrt_one_minus_alphas, index, x.shape)
            x_recon = (x - sqrt_one_minus_alpha * noise) / (alpha ** 0.5)
        else:
            x_recon = (extract(self.sqrt_recip_alphas_cumprod, t, x.shape) * x
                       - extract(self.sqrt_recipm1_alphas_cumprod, t, x.shape) * noise)
        if self.denoised_clip_value is not None:
            x_recon.clamp_(-self.denoised_clip_value, self.denoised_clip_value)
            if self.use_ddim:
                noise = (x - alpha ** (0.5) * x_recon) / sqrt_one_minus_alpha
        if self.use_ddim and self.eps_clip_value is not None:
            noise.clamp_(-self.eps_clip_value, self.eps_clip_value)
        if self.use_ddim:
            sigma = extract(self.ddim_sigmas, index, x.shape)
            dir_xt = (1.0 - alpha_prev - sigma ** 2).sqrt() * noise
            mu = (alpha_prev ** 0.5) * x_recon + dir_xt
            logvar = torch.log(sigma ** 2)
        else:
            mu = extract(self.ddpm_mu_coef1, t, x.shape) * x_recon + extract(self.ddpm_mu_coef2, t, x.shape) * x
            logvar = extract(self.ddpm_logvar_clipped, t, x.shape)
        return mu, logvar

    def forward(self, cond, noise):
        sample_data = cond["state"]
        B = len(sample_data)
        x = noise[0]
        t_all = self.ddim_t if self.use_ddim else list(reversed(range(self.denoising_steps)))
        for i, t in enumerate(t_all):
            t_b = make_timesteps(B, t, x.device)
            index_b = make_timesteps(B, i, x.device)
            mean, logvar = self.p_mean_var(x=x, t=t_b, cond=cond, index=index_b)
            std = torch.exp(0.5 * logvar)
            if self.use_ddim:
                std = torch.zeros_like(std)
            else:
                if t == 0:
                    std = torch.zeros_like(std)
                else:
                    std = torch.clip(std, min=1e-3)
            z = noise[1 + i].clamp_(-self.randn_clip_value, self.randn_clip_value)
            x = mean + std * z
            if self.final_action_clip_value is not None and i == len(t_all) - 1:
                x = torch.clamp(x, -self.final_action_clip_value, self.final_action_clip_value)
        return x
