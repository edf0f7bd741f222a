"""TabDDPM (tab_ddpm/modules.py, gaussian_multinomial_diffsuion.py): the numerical features' sampler.

The network adds its time embedding (and a label's) to ``proj(x)``; the step
is the posterior mean of x0 from eps with ``exp(0.5 * log_variance)`` noise,
none at t=0, and no clipping. As in the project, the model variance is built
each step from a float64 ``posterior_variance`` (``as_project=True``): the
chain then runs in float64 between the networks, which cast it back with
``.float()``. ``as_project=False`` keeps that variance float32.
"""
import math

import torch
from torch import nn

from .common import ddpm_buffers


def timestep_embedding(timesteps, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32)
                      / half).to(device=timesteps.device)
    args = timesteps[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class MLP(nn.Module):
    """rtdl's MLP.make_baseline: Linear-ReLU-Dropout blocks, then a head."""

    def __init__(self, d_in, d_layers, d_out, dropout=0.0):
        super().__init__()
        dims = [d_in, *d_layers]
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Dropout(dropout))
                                    for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(dims[-1], d_out)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class MLPDiffusion(nn.Module):
    def __init__(self, d_in, num_classes, d_layers=(64, 32, 32), dim_t=32):
        super().__init__()
        self.dim_t, self.num_classes = dim_t, num_classes
        self.mlp = MLP(dim_t, d_layers, d_in)
        self.label_emb = nn.Embedding(num_classes, dim_t) if num_classes > 0 else None
        self.proj = nn.Linear(d_in, dim_t)
        self.time_embed = nn.Sequential(nn.Linear(dim_t, dim_t), nn.SiLU(), nn.Linear(dim_t, dim_t))

    def forward(self, x, timesteps, y=None):
        emb = self.time_embed(timestep_embedding(timesteps, self.dim_t))
        if self.label_emb is not None and y is not None:
            emb += nn.functional.silu(self.label_emb(y.squeeze()))
        x = self.proj(x) + emb
        return self.mlp(x)


def extract(a, t, x_shape):
    b, *_ = t.shape
    out = a.gather(-1, t)
    while len(out.shape) < len(x_shape):
        out = out[..., None]
    return out.expand(x_shape)


class GaussianSampler(nn.Module):
    """``forward(y, noise=None)``: ``noise`` (T + 1, B, d_in) replaces the draws (the initial
    sample first) so that a compiled run can be compared with eager."""

    def __init__(self, d_in=6, num_classes=3, num_timesteps=8, as_project=True, long_after_full=False):
        super().__init__()
        # TabDDPM's sample(): ``torch.full((b,), i).long()``, a float full cast to int64.
        self.long_after_full = long_after_full
        self.d_in, self.num_timesteps = d_in, num_timesteps
        self._denoise_fn = MLPDiffusion(d_in, num_classes)
        steps = num_timesteps + 1
        s = torch.linspace(0, num_timesteps, steps, dtype=torch.float64) / num_timesteps
        alphas_cumprod = torch.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2
        betas = (1 - alphas_cumprod[1:] / alphas_cumprod[:-1]).clamp(max=0.999)
        ddpm_buffers(self, betas.float())
        self.register_buffer("alphas", 1. - betas.float())
        prev = torch.cat([torch.ones(1, dtype=torch.float64), torch.cumprod(1 - betas, 0)[:-1]])
        variance = betas * (1. - prev) / (1. - torch.cumprod(1 - betas, 0))
        self.posterior_variance64 = variance if as_project else variance.float()

    def gaussian_p_sample(self, model_out, x, t):
        model_variance = torch.cat([self.posterior_variance64[1].unsqueeze(0).to(x.device),
                                    (1. - self.alphas)[1:]], dim=0)
        model_log_variance = extract(torch.log(model_variance), t, x.shape)
        pred_xstart = (extract(self.sqrt_recip_alphas_cumprod, t, x.shape) * x
                       - extract(self.sqrt_recipm1_alphas_cumprod, t, x.shape) * model_out)
        mean = (extract(self.posterior_mean_coef1, t, x.shape) * pred_xstart
                + extract(self.posterior_mean_coef2, t, x.shape) * x)
        return mean, model_log_variance

    def forward(self, y, noise=None):
        b = y.shape[0]
        z_norm = torch.randn((b, self.d_in), device=y.device) if noise is None else noise[0]
        log_z = torch.zeros((b, 0), device=y.device).float()  # no categorical features
        for i in reversed(range(0, self.num_timesteps)):
            t = torch.full((b,), i, device=y.device).long() if self.long_after_full else \
                torch.full((b,), i, device=y.device, dtype=torch.long)
            model_out = self._denoise_fn(torch.cat([z_norm, log_z], dim=1).float(), t, y)
            mean, log_variance = self.gaussian_p_sample(model_out[:, :self.d_in], z_norm, t)
            z = torch.randn_like(z_norm) if noise is None else noise[self.num_timesteps - i]
            nonzero_mask = (t != 0).float().view(-1, *([1] * (len(z_norm.shape) - 1)))
            z_norm = mean + nonzero_mask * torch.exp(0.5 * log_variance) * z
        return z_norm


def extract_to(a, t, x_shape):
    """tab_ddpm/utils.py's extract: the index moved to the table's device, gather, trailing
    dims added one by one, ``expand``."""
    b, *_ = t.shape
    t = t.to(a.device)
    out = a.gather(-1, t)
    while len(out.shape) < len(x_shape):
        out = out[..., None]
    return out.expand(x_shape)


class MLPAsIs(MLP):
    """rtdl's MLP as tab_ddpm/modules.py copies it: ``x.float()`` first."""

    def forward(self, x):
        x = x.float()
        return super().forward(x)


class MLPDiffusionAsIs(MLPDiffusion):
    """tab_ddpm/modules.py's MLPDiffusion with ``is_y_cond``: for a classification target the
    label's Embedding of ``y.squeeze()``; for a regression target (``num_classes == 0``) a
    ``Linear(1, dim_t)`` of ``y.resize(y.size(0), 1).float()``; either added in place to the
    time embedding through SiLU."""

    def __init__(self, d_in, num_classes, d_layers=(64, 32, 32), dim_t=32):
        super().__init__(d_in, num_classes, d_layers, dim_t)
        self.mlp = MLPAsIs(dim_t, d_layers, d_in)
        if num_classes == 0:
            self.label_emb = nn.Linear(1, dim_t)

    def forward(self, x, timesteps, y=None):
        emb = self.time_embed(timestep_embedding(timesteps, self.dim_t))
        if y is not None:
            if self.num_classes > 0:
                y = y.squeeze()
            else:
                y = y.resize(y.size(0), 1).float()
            emb += nn.functional.silu(self.label_emb(y))
        x = self.proj(x) + emb
        return self.mlp(x)


class GaussianDDIMSampler(GaussianSampler):
    """GaussianMultinomialDiffusion.sample_ddim's numerical features (``gaussian_ddim_step``,
    eta = 0): the model variance still built from the float64 ``posterior_variance`` in
    ``gaussian_p_mean_variance`` but unused, so the sample stays float32; eps read back from x0
    (``_predict_eps_from_xstart``: a division by ``sqrt_recipm1_alphas_cumprod``), ``sigma`` from
    ``alphas_cumprod`` / ``alphas_cumprod_prev`` at every step, the noise times ``nonzero_mask *
    sigma`` (zero). ``spelling="ddim_sample"``: ``gaussian_ddim_sample``'s loop, the network fed
    the sample directly and ``t_array = (torch.ones(b) * t).long()``. ``num_classes=0``: a
    regression target ``y`` (float), the label Linear."""

    def __init__(self, spelling="sample_ddim", num_classes=3, eta=0.0, **kw):
        super().__init__(as_project=True, **kw)
        self.spelling, self.eta = spelling, eta
        self._denoise_fn = MLPDiffusionAsIs(self.d_in, num_classes)

    def gaussian_p_mean_variance(self, model_output, x, t):
        model_variance = torch.cat([self.posterior_variance64[1].unsqueeze(0).to(x.device),
                                    (1. - self.alphas)[1:]], dim=0)
        model_log_variance = torch.log(model_variance)
        model_variance = extract_to(model_variance, t, x.shape)
        model_log_variance = extract_to(model_log_variance, t, x.shape)
        pred_xstart = (extract_to(self.sqrt_recip_alphas_cumprod, t, x.shape) * x
                       - extract_to(self.sqrt_recipm1_alphas_cumprod, t, x.shape) * model_output)
        return {"variance": model_variance, "log_variance": model_log_variance, "pred_xstart": pred_xstart}

    def gaussian_ddim_step(self, model_out_num, x, t, z):
        out = self.gaussian_p_mean_variance(model_out_num, x, t)
        eps = ((extract_to(self.sqrt_recip_alphas_cumprod, t, x.shape) * x - out["pred_xstart"])
               / extract_to(self.sqrt_recipm1_alphas_cumprod, t, x.shape))
        alpha_bar = extract_to(self.alphas_cumprod, t, x.shape)
        alpha_bar_prev = extract_to(self.alphas_cumprod_prev, t, x.shape)
        sigma = (self.eta * torch.sqrt((1 - alpha_bar_prev) / (1 - alpha_bar))
                 * torch.sqrt(1 - alpha_bar / alpha_bar_prev))
        mean_pred = out["pred_xstart"] * torch.sqrt(alpha_bar_prev) + torch.sqrt(1 - alpha_bar_prev - sigma ** 2) * eps
        nonzero_mask = (t != 0).float().view(-1, *([1] * (len(x.shape) - 1)))
        return mean_pred + nonzero_mask * sigma * z

    def forward(self, y, noise):
        """``noise[0]`` the initial sample, ``noise[1 + k]`` step ``k``'s draw."""
        b = y.shape[0]
        z_norm = noise[0]
        out_dict = {"y": y}
        log_z = torch.zeros((b, 0), device=y.device).float()
        for k, i in enumerate(reversed(range(0, self.num_timesteps))):
            if self.spelling == "ddim_sample":
                t = (torch.ones(b, device=y.device) * i).long()
                model_out = self._denoise_fn(z_norm, t, **out_dict)
            else:
                t = torch.full((b,), i, device=y.device, dtype=torch.long)
                model_out = self._denoise_fn(torch.cat([z_norm, log_z], dim=1).float(), t, **out_dict)
            z_norm = self.gaussian_ddim_step(model_out[:, :self.d_in], z_norm, t, noise[1 + k])
        return z_norm


def get_named_beta_schedule(schedule_name, num_diffusion_timesteps):
    """tab_ddpm's schedules: float64 betas (numpy there, float64 tensors here)."""
    if schedule_name == "linear":
        scale = 1000 / num_diffusion_timesteps
        return torch.linspace(scale * 0.0001, scale * 0.02, num_diffusion_timesteps, dtype=torch.float64)
    return betas_for_alpha_bar(num_diffusion_timesteps,
                               lambda t: math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2)


def betas_for_alpha_bar(num_diffusion_timesteps, alpha_bar, max_beta=0.999):
    betas = []
    for i in range(num_diffusion_timesteps):
        t1 = i / num_diffusion_timesteps
        t2 = (i + 1) / num_diffusion_timesteps
        betas.append(min(1 - alpha_bar(t2) / alpha_bar(t1), max_beta))
    return torch.tensor(betas, dtype=torch.float64)


class GaussianMultinomialDiffusion(nn.Module):
    """tab_ddpm/gaussian_multinomial_diffsuion.py's GaussianMultinomialDiffusion with numerical
    features only (no categorical columns: ``log_z`` is ``(b, 0)``). Its schedule is computed in
    float64 and registered as float32 buffers, but for ``posterior_variance``, a float64 attribute,
    and the posterior mean's coefficients, float32 attributes. ``gaussian_p_mean_variance``
    builds the model variance as ``cat([posterior_variance[1:2], (1 - alphas)[1:]])``, which is
    float64, so ``sample()`` makes ``z_norm`` float64 at its first step (``mean`` float32 plus a
    float64 noise term) and keeps it float64; each network call reads
    ``cat([z_norm, log_z]).float()``.

    ``forward(y, noise=None)``: ``sample()`` with the labels ``y`` given (the project draws them
    from ``y_dist``); ``noise`` (T + 1, B, d_in), the initial sample first, replaces the draws so
    that a compiled run can be compared with eager."""

    def __init__(self, num_numerical_features=6, num_classes=3, num_timesteps=10, scheduler="cosine",
                 d_layers=(128, 128), dim_t=128):
        super().__init__()
        self.num_numerical_features, self.num_timesteps = num_numerical_features, num_timesteps
        self._denoise_fn = MLPDiffusionAsIs(num_numerical_features, num_classes, d_layers, dim_t)
        alphas = 1. - get_named_beta_schedule(scheduler, num_timesteps)
        betas = 1. - alphas
        alphas_cumprod = torch.cumprod(alphas, 0)
        alphas_cumprod_prev = torch.cat([torch.ones(1, dtype=torch.float64), alphas_cumprod[:-1]])
        self.posterior_variance = betas * (1.0 - alphas_cumprod_prev) / (1.0 - alphas_cumprod)
        self.posterior_mean_coef1 = (betas * torch.sqrt(alphas_cumprod_prev) / (1.0 - alphas_cumprod)).float()
        self.posterior_mean_coef2 = ((1.0 - alphas_cumprod_prev) * torch.sqrt(alphas) / (1.0 - alphas_cumprod)).float()
        self.register_buffer("alphas", alphas.float())
        self.register_buffer("sqrt_recip_alphas_cumprod", torch.sqrt(1.0 / alphas_cumprod).float())
        self.register_buffer("sqrt_recipm1_alphas_cumprod", torch.sqrt(1.0 / alphas_cumprod - 1).float())

    def gaussian_q_posterior_mean_variance(self, x_start, x_t, t):
        return (extract_to(self.posterior_mean_coef1, t, x_t.shape) * x_start
                + extract_to(self.posterior_mean_coef2, t, x_t.shape) * x_t)

    def _predict_xstart_from_eps(self, x_t, t, eps):
        return (extract_to(self.sqrt_recip_alphas_cumprod, t, x_t.shape) * x_t
                - extract_to(self.sqrt_recipm1_alphas_cumprod, t, x_t.shape) * eps)

    def gaussian_p_mean_variance(self, model_output, x, t):
        model_variance = torch.cat([self.posterior_variance[1].unsqueeze(0).to(x.device), (1. - self.alphas)[1:]],
                                   dim=0)
        model_log_variance = torch.log(model_variance)
        model_variance = extract_to(model_variance, t, x.shape)
        model_log_variance = extract_to(model_log_variance, t, x.shape)
        pred_xstart = self._predict_xstart_from_eps(x_t=x, t=t, eps=model_output)
        model_mean = self.gaussian_q_posterior_mean_variance(x_start=pred_xstart, x_t=x, t=t)
        return {"mean": model_mean, "variance": model_variance, "log_variance": model_log_variance,
                "pred_xstart": pred_xstart}

    def gaussian_p_sample(self, model_out, x, t, noise=None):
        out = self.gaussian_p_mean_variance(model_out, x, t)
        noise = torch.randn_like(x) if noise is None else noise
        nonzero_mask = (t != 0).float().view(-1, *([1] * (len(x.shape) - 1)))
        sample = out["mean"] + nonzero_mask * torch.exp(0.5 * out["log_variance"]) * noise
        return {"sample": sample, "pred_xstart": out["pred_xstart"]}

    def forward(self, y, noise=None):
        b = y.shape[0]
        device = self.alphas.device
        z_norm = torch.randn((b, self.num_numerical_features), device=device) if noise is None else noise[0]
        log_z = torch.zeros((b, 0), device=device).float()
        out_dict = {"y": y.long().to(device)}
        for i in reversed(range(0, self.num_timesteps)):
            t = torch.full((b,), i, device=device, dtype=torch.long)
            model_out = self._denoise_fn(torch.cat([z_norm, log_z], dim=1).float(), t, **out_dict)
            model_out_num = model_out[:, :self.num_numerical_features]
            z = None if noise is None else noise[self.num_timesteps - i]
            z_norm = self.gaussian_p_sample(model_out_num, z_norm, t, noise=z)["sample"]
        return z_norm
