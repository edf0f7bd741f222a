"""denoising-diffusion-pytorch's GaussianDiffusion sampler (lucidrains), on an MLP noise net.

``p_sample_loop`` walks ``t`` as a Python int, ``p_sample`` reads its tables with ``extract``
at ``torch.full((b,), t)`` and adds ``(0.5 * log_variance).exp() * noise`` where ``noise`` is
``randn_like(x) if t > 0 else 0.``: the last step adds ``std * 0.`` instead of a draw. The
objectives are the project's ``pred_noise``, ``pred_x0`` and ``pred_v``; x_start is clamped to
[-1, 1] when ``clip_denoised``. ``noise`` given to :meth:`forward` replaces the draws (one
``(b, dim)`` slice per step)."""
import torch
from torch import nn
from torch.nn import functional as F

from .common import SinusoidalPosEmb, extract, linear_beta_schedule


class GaussianDiffusion(nn.Module):
    def __init__(self, dim=4, obs_dim=5, hidden=64, timesteps=8, objective="pred_noise", clip_denoised=True):
        super().__init__()
        self.dim, self.objective, self.clip_denoised, self.num_timesteps = dim, objective, clip_denoised, timesteps
        self.time_mlp = nn.Sequential(SinusoidalPosEmb(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.net = nn.Sequential(nn.Linear(dim + 16 + obs_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden),
                                 nn.SiLU(), nn.Linear(hidden, dim))
        scale = min(1000 / timesteps, 10)  # the project's linear schedule, scaled to few timesteps
        betas = linear_beta_schedule(timesteps, scale * 1e-4, scale * 2e-2, torch.float64)
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        alphas_cumprod_prev = F.pad(alphas_cumprod[:-1], (1, 0), value=1.0)
        posterior_variance = betas * (1.0 - alphas_cumprod_prev) / (1.0 - alphas_cumprod)
        for name, value in dict(
                sqrt_alphas_cumprod=alphas_cumprod.sqrt(),
                sqrt_one_minus_alphas_cumprod=(1.0 - alphas_cumprod).sqrt(),
                sqrt_recip_alphas_cumprod=(1.0 / alphas_cumprod).sqrt(),
                sqrt_recipm1_alphas_cumprod=(1.0 / alphas_cumprod - 1).sqrt(),
                posterior_log_variance_clipped=posterior_variance.clamp(min=1e-20).log(),
                posterior_mean_coef1=betas * alphas_cumprod_prev.sqrt() / (1.0 - alphas_cumprod),
                posterior_mean_coef2=(1.0 - alphas_cumprod_prev) * (1.0 - betas).sqrt() / (1.0 - alphas_cumprod),
        ).items():
            self.register_buffer(name, value.float())

    def model(self, x, t, obs):
        return self.net(torch.cat([x, self.time_mlp(t.float()), obs], dim=-1))

    def x_start_of(self, x, t, out):
        if self.objective == "pred_noise":
            return (extract(self.sqrt_recip_alphas_cumprod, t, x.shape) * x
                    - extract(self.sqrt_recipm1_alphas_cumprod, t, x.shape) * out)
        if self.objective == "pred_x0":
            return out
        return extract(self.sqrt_alphas_cumprod, t, x.shape) * x - extract(self.sqrt_one_minus_alphas_cumprod, t,
                                                                             x.shape) * out

    def p_sample(self, x, t: int, obs, noise):
        batched_times = torch.full((x.shape[0],), t, device=x.device, dtype=torch.long)
        x_start = self.x_start_of(x, batched_times, self.model(x, batched_times, obs))
        if self.clip_denoised:
            x_start.clamp_(-1.0, 1.0)
        model_mean = (extract(self.posterior_mean_coef1, batched_times, x.shape) * x_start
                      + extract(self.posterior_mean_coef2, batched_times, x.shape) * x)
        model_log_variance = extract(self.posterior_log_variance_clipped, batched_times, x.shape)
        noise = (torch.randn_like(x) if noise is None else noise) if t > 0 else 0.0  # no noise if t == 0
        return model_mean + (0.5 * model_log_variance).exp() * noise

    def forward(self, obs, noise=None):
        """``p_sample_loop``; ``noise[0]`` is x_T and ``noise[k + 1]`` step k's draw where given."""
        img = torch.randn(obs.shape[0], self.dim, device=obs.device) if noise is None else noise[0]
        for k, t in enumerate(reversed(range(0, self.num_timesteps))):
            img = self.p_sample(img, t, obs, None if noise is None else noise[k + 1])
        return img
