"""CleanDiffuser (DiscreteDiffusionSDE with DQLMlp / MlpNNDiffusion): DDPM and DDIM sampling, small sizes.

Coefficients are indexed with the Python-int step (0-d tensors), the network
gets ``torch.full`` timesteps, the prediction is clipped to ``x_max`` and
noise is added except at the last step.
"""
import math

import torch
from torch import nn

from .common import PositionalEmbedding, linear_beta_schedule


class DQLMlp(nn.Module):
    def __init__(self, obs_dim, act_dim, emb_dim=16, hidden=256):
        super().__init__()
        self.map_noise = PositionalEmbedding(emb_dim)
        self.time_mlp = nn.Sequential(nn.Linear(emb_dim, emb_dim * 2), nn.Mish(), nn.Linear(emb_dim * 2, emb_dim))
        self.mid_layer = nn.Sequential(nn.Linear(obs_dim + act_dim + emb_dim, hidden), nn.Mish(),
                                       nn.Linear(hidden, hidden), nn.Mish(), nn.Linear(hidden, hidden), nn.Mish())
        self.final_layer = nn.Linear(hidden, act_dim)

    def forward(self, x, noise, condition):
        t = self.time_mlp(self.map_noise(noise.float()))
        x = torch.cat([x, t, condition], -1)
        return self.final_layer(self.mid_layer(x))


class MlpNNDiffusion(nn.Module):
    """The plain MLP (ReLU): x concatenated with the timestep embedding."""

    def __init__(self, x_dim, emb_dim=16, hidden_dims=(256, 256)):
        super().__init__()
        self.map_noise = PositionalEmbedding(emb_dim)
        dims = [x_dim + emb_dim, *hidden_dims]
        layers = []
        for a, b in zip(dims[:-1], dims[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.mlp = nn.Sequential(*layers, nn.Linear(dims[-1], x_dim))

    def forward(self, x, noise, condition=None):
        t = self.map_noise(noise.float())
        return self.mlp(torch.cat([x, t], -1))


class DiscreteDiffusionSDE(nn.Module):
    """``forward(condition, noise=None)``: ``noise`` (sampling_steps + 1, B, dim) replaces the draws."""

    def __init__(self, model, x_dim, diffusion_steps=5, sampling_steps=5, solver="ddpm", x_max=1.0):
        super().__init__()
        self.model, self.x_dim, self.solver, self.x_max = model, x_dim, solver, x_max
        betas = linear_beta_schedule(diffusion_steps)
        alphas_cumprod = torch.cumprod(1 - betas, 0)
        alpha = torch.cat([torch.ones(1), alphas_cumprod.sqrt()])  # index 0: the clean sample
        sigma = torch.cat([torch.full((1,), 1e-3), (1 - alphas_cumprod).sqrt()])
        self.sample_step_schedule = torch.linspace(0, diffusion_steps, sampling_steps + 1).long().tolist()
        self.register_buffer("alphas", alpha[self.sample_step_schedule])
        self.register_buffer("sigmas", sigma[self.sample_step_schedule])
        self.sampling_steps = sampling_steps

    def forward(self, condition, noise=None):
        n_samples = condition.shape[0]
        xt = torch.randn(n_samples, self.x_dim) if noise is None else noise[0]
        alphas, sigmas = self.alphas, self.sigmas
        for i in reversed(range(1, self.sampling_steps + 1)):
            t = torch.full((n_samples,), self.sample_step_schedule[i], dtype=torch.long, device=xt.device)
            eps_theta = self.model(xt, t, condition)
            x_theta = (xt - sigmas[i] * eps_theta) / alphas[i]
            x_theta = x_theta.clip(-self.x_max, self.x_max)
            eps_theta = (xt - alphas[i] * x_theta) / sigmas[i]
            if self.solver == "ddpm":
                alpha_ratio = alphas[i] / alphas[i - 1]
                beta_i = 1 - alpha_ratio ** 2
                xt = (1 / alpha_ratio) * (xt - beta_i / sigmas[i] * eps_theta)
                if i > 1:
                    std = (beta_i * sigmas[i - 1] ** 2 / sigmas[i] ** 2).sqrt()
                    xt = xt + std * (torch.randn_like(xt) if noise is None else noise[self.sampling_steps + 1 - i])
            else:  # ddim, eta = 0
                xt = alphas[i - 1] * x_theta + sigmas[i - 1] * eps_theta
        return xt.clip(-self.x_max, self.x_max)


def at_least_ndim(x, ndim):
    """CleanDiffuser's utils.at_least_ndim: trailing singleton dims up to ``ndim`` (a reshape)."""
    if isinstance(x, torch.Tensor):
        return x.reshape(*x.shape, *((1,) * max(ndim - x.dim(), 0)))
    return x


class SampleStepSchedule(nn.Module):
    """DiscreteDiffusionSDE.sample as the library writes it (the class above simplifies it):

    - float timesteps, ``torch.full((n,), schedule[i], dtype=prior.dtype)``;
    - a precomputed ``stds`` table, the DDPM update
      ``(alphas[i-1] / alphas[i]) * (xt - sigmas[i] * eps) + (sigmas[i-1]**2 - stds[i]**2 + 1e-8).sqrt() * eps``
      and the noise added in place, ``xt += stds[i] * z``;
    - ``x_max`` / ``x_min`` per-dimension tensors: the prediction clipped with ``pred.clip(lo, hi)``
      (``clip``: "eps" bounds eps by ``(xt - alpha * x_max) / sigma``, sample-dependent bounds;
      "x0" predicts x0 and clips it to the tensors), then ``xt.clip(x_min, x_max)`` after the loop;
    - ``fix_mask``: the known portion blended in every step, ``xt * (1 - fix_mask) + prior * fix_mask``;
    - ``per_sample``: the coefficients read per sample, ``at_least_ndim(alpha[t], xt.dim())``
      with ``t`` the integer schedule's column (its continuous-time sampler's spelling);
    - ``tables="floats"``: the tables as Python lists (``.tolist()``), each coefficient a float
      that compiles to a constant."""

    def __init__(self, x_dim=3, obs_dim=11, diffusion_steps=20, sampling_steps=5, solver="ddpm", clip=None,
                 fix_mask=False, per_sample=False, tables="tensors"):
        super().__init__()
        self.model = DQLMlp(obs_dim, x_dim)
        self.x_dim, self.solver, self.clip, self.fix, self.per_sample = x_dim, solver, clip, fix_mask, per_sample
        self.sampling_steps = sampling_steps
        betas = linear_beta_schedule(diffusion_steps)
        alphas_cumprod = torch.cumprod(1 - betas, 0)
        alpha = torch.cat([torch.ones(1), alphas_cumprod.sqrt()])
        sigma = torch.cat([torch.full((1,), 1e-3), (1 - alphas_cumprod).sqrt()])
        self.register_buffer("alpha", alpha)
        self.register_buffer("sigma", sigma)
        self.schedule = torch.linspace(0, diffusion_steps, sampling_steps + 1).long().tolist()
        alphas, sigmas = alpha[self.schedule], sigma[self.schedule]
        stds = torch.zeros(sampling_steps + 1)
        stds[1:] = sigmas[:-1] / sigmas[1:] * (1 - (alphas[1:] / alphas[:-1]) ** 2).sqrt()
        self.register_buffer("alphas", alphas)
        self.register_buffer("sigmas", sigmas)
        self.register_buffer("stds", stds)
        self.float_tables = [v.tolist() for v in (alphas, sigmas, stds)] if tables == "floats" else None
        # Per-dimension bounds (CleanDiffuser's x_max / x_min are tensors of the sample's shape).
        self.register_buffer("x_max", torch.tensor([1.0, 0.5, 2.0])[:x_dim])
        self.register_buffer("x_min", -torch.tensor([1.0, 2.0, 0.5])[:x_dim])
        self.register_buffer("fix_mask", torch.zeros(x_dim))

    def coefs(self, i, n):
        if self.float_tables is not None:
            alphas, sigmas, stds = self.float_tables
            return alphas[i], sigmas[i], alphas[i - 1], sigmas[i - 1], stds[i]
        if not self.per_sample:
            return self.alphas[i], self.sigmas[i], self.alphas[i - 1], self.sigmas[i - 1], self.stds[i]
        col = torch.full((n,), i, dtype=torch.long, device=self.alphas.device)
        return (at_least_ndim(self.alphas[col], 2), at_least_ndim(self.sigmas[col], 2),
                at_least_ndim(self.alphas[col - 1], 2), at_least_ndim(self.sigmas[col - 1], 2),
                at_least_ndim(self.stds[col], 2))

    def forward(self, condition, prior, noise):
        """``noise[0]`` the initial sample, ``noise[k]`` the draw of step ``k`` (the last one unused)."""
        n = condition.shape[0]
        xt = noise[0]
        if self.fix:
            xt = xt * (1.0 - self.fix_mask) + prior * self.fix_mask
        for k, i in enumerate(reversed(range(1, self.sampling_steps + 1))):
            t = torch.full((n,), self.schedule[i], dtype=prior.dtype, device=prior.device)
            a, s, a_prev, s_prev, std = self.coefs(i, n)
            pred = self.model(xt, t, condition)
            if self.clip == "eps":
                pred = pred.clip((xt - a * self.x_max) / s, (xt - a * self.x_min) / s)
            elif self.clip == "x0":
                pred = pred.clip(self.x_min, self.x_max)
            if self.clip == "x0":
                x_theta, eps_theta = pred, (xt - a * pred) / s
            else:
                eps_theta, x_theta = pred, (xt - s * pred) / a
            if self.solver == "ddpm":
                var = s_prev ** 2 - std ** 2 + 1e-8
                root = var.sqrt() if isinstance(var, torch.Tensor) else math.sqrt(var)
                xt = (a_prev / a) * (xt - s * eps_theta) + root * eps_theta
                if i > 1:
                    xt += std * noise[k + 1]
            else:
                xt = a_prev * ((xt - s * eps_theta) / a) + s_prev * eps_theta
            if self.fix:
                xt = xt * (1.0 - self.fix_mask) + prior * self.fix_mask
        if self.clip is not None:
            xt = xt.clip(self.x_min, self.x_max)
        return xt


# ---------------------------------------------------------------------------------------------
# CleanDiffuser as its current release writes it (cleandiffuser/diffusion/diffusionsde.py,
# nn_diffusion/{dqlmlp,idqlmlp,mlps}.py, utils/utils.py), with the defaults its DQL / IDQL
# pipelines sample with.


class DQLMlpAsIs(nn.Module):
    """nn_diffusion.DQLMlp: the timestep into the embedding as it comes, zeros for a missing
    condition."""

    def __init__(self, obs_dim, act_dim, emb_dim=16, hidden=256):
        super().__init__()
        self.obs_dim = obs_dim
        self.map_noise = PositionalEmbedding(emb_dim)
        self.time_mlp = nn.Sequential(nn.Linear(emb_dim, emb_dim * 2), nn.Mish(), nn.Linear(emb_dim * 2, emb_dim))
        self.mid_layer = nn.Sequential(nn.Linear(obs_dim + act_dim + emb_dim, hidden), nn.Mish(),
                                       nn.Linear(hidden, hidden), nn.Mish(), nn.Linear(hidden, hidden), nn.Mish())
        self.final_layer = nn.Linear(hidden, act_dim)

    def forward(self, x, noise, condition=None):
        if condition is None:
            condition = torch.zeros(x.shape[0], self.obs_dim).to(x.device)
        t = self.time_mlp(self.map_noise(noise))
        x = torch.cat([x, t, condition], -1)
        x = self.mid_layer(x)
        return self.final_layer(x)


class ResidualBlockAsIs(nn.Module):
    """nn_diffusion.idqlmlp.ResidualBlock: ``x + net(x)``, net = Dropout, LayerNorm, Linear(4H),
    Mish, Linear(H)."""

    def __init__(self, hidden_dim, dropout=0.1):
        super().__init__()
        self.net = nn.Sequential(nn.Dropout(dropout), nn.LayerNorm(hidden_dim),
                                 nn.Linear(hidden_dim, hidden_dim * 4), nn.Mish(),
                                 nn.Linear(hidden_dim * 4, hidden_dim))

    def forward(self, x):
        return x + self.net(x)


class IDQLMlpAsIs(nn.Module):
    """nn_diffusion.IDQLMlp: ``affine_in``, the LN-ResNet blocks, ``affine_out`` (no activation
    before it)."""

    def __init__(self, obs_dim, act_dim, emb_dim=16, hidden_dim=32, n_blocks=2, dropout=0.1):
        super().__init__()
        self.obs_dim = obs_dim
        self.map_noise = PositionalEmbedding(emb_dim)
        self.time_mlp = nn.Sequential(nn.Linear(emb_dim, emb_dim * 2), nn.Mish(), nn.Linear(emb_dim * 2, emb_dim))
        self.affine_in = nn.Linear(obs_dim + act_dim + emb_dim, hidden_dim)
        self.ln_resnet = nn.Sequential(*[ResidualBlockAsIs(hidden_dim, dropout) for _ in range(n_blocks)])
        self.affine_out = nn.Linear(hidden_dim, act_dim)

    def forward(self, x, noise, condition=None):
        if condition is None:
            condition = torch.zeros(x.shape[0], self.obs_dim).to(x.device)
        t = self.time_mlp(self.map_noise(noise))
        x = torch.cat([x, t, condition], -1)
        x = self.affine_in(x)
        x = self.ln_resnet(x)
        return self.affine_out(x)


class MlpAsIs(nn.Module):
    """utils.building_blocks.Mlp: (Linear, activation) blocks, a Linear, an Identity."""

    def __init__(self, in_dim, hidden_dims, out_dim, activation=nn.ReLU(), out_activation=nn.Identity()):
        super().__init__()
        self.mlp = nn.Sequential(
            *[nn.Sequential(nn.Linear(in_dim if i == 0 else hidden_dims[i - 1], hidden_dims[i]), activation)
              for i in range(len(hidden_dims))],
            nn.Linear(hidden_dims[-1], out_dim), out_activation)

    def forward(self, x):
        return self.mlp(x)


class MlpNNDiffusionAsIs(nn.Module):
    """nn_diffusion.MlpNNDiffusion: the condition (an ``emb_dim`` vector) added in place to the
    timestep features, zeros added where there is none."""

    def __init__(self, x_dim, emb_dim=16, hidden_dims=(256, 256)):
        super().__init__()
        self.map_noise = PositionalEmbedding(emb_dim)
        self.mlp = MlpAsIs(x_dim + emb_dim, hidden_dims, x_dim)

    def forward(self, x, noise, condition=None):
        t = self.map_noise(noise)
        if condition is not None:
            t += condition
        else:
            t += torch.zeros_like(t)
        return self.mlp(torch.cat([x, t], -1))


class IdentityConditionAsIs(nn.Module):
    """nn_condition.IdentityCondition: ``condition * mask``, the mask 1. out of training."""

    def __init__(self, dropout=0.25):
        super().__init__()
        self.dropout = dropout

    def forward(self, condition, mask=None):
        if self.training:
            mask = (torch.rand((condition.shape[0],), device=condition.device) > self.dropout).float()
        else:
            mask = 1. if mask is None else mask
        return condition * at_least_ndim(mask, condition.dim())


def cosine_noise_schedule(t_diffusion, s=0.008):
    alpha = (math.pi / 2.0 * ((t_diffusion).clip(0., 0.9946) + s) / (1 + s)).cos() / math.cos(
        math.pi / 2.0 * s / (1 + s))
    sigma = (1.0 - alpha ** 2).sqrt()
    return alpha, sigma


class DiscreteSDESample(nn.Module):
    """``DiscreteDiffusionSDE.sample`` with the pipelines' arguments (``condition_cfg=obs,
    w_cfg=1.0``, no classifier, no warm start, ``fix_mask`` None):

    - ``alpha`` / ``sigma`` plain tensor attributes (no buffers), the cosine schedule on
      ``linspace(epsilon, 1, T)``; the sampling schedule a long tensor
      ``linspace(0, T - 1, steps + 1, dtype=long)`` and the step tables gathered with it,
      ``logSNRs`` / ``hs`` / ``stds`` (written in place) computed in the sampler, every call;
    - the timesteps ``torch.full((n,), schedule[i], dtype=torch.long)``: a 0-d tensor fill;
    - ``model`` a ModuleDict {"diffusion", "condition"} in eval, the condition through
      IdentityCondition (``condition * 1.``) before the loop;
    - guidance at ``w = 1``: ``w * pred + (1 - w) * 0.``;
    - ``fix_mask`` 0.: ``xt * (1. - 0.) + prior * 0.`` after the initial draw and every step;
    - ``x_max`` / ``x_min`` ``(1, act_dim)`` tensors: with ``predict_noise`` the noise clipped to
      ``((xt - alpha * x_max) / sigma, (xt - alpha * x_min) / sigma)`` (the x0 clip written on
      eps), else the x0 prediction clipped to them; ``xt.clip(x_min, x_max)`` after the loop;
    - ``temperature`` scaling the initial draw.

    ``forward(condition, prior, noise)``: ``noise[0]`` the initial draw, ``noise[k]`` step
    ``k``'s (the last unused)."""

    def __init__(self, net="dql", obs_dim=11, act_dim=3, diffusion_steps=5, sample_steps=5, solver="ddpm",
                 predict_noise=True, clip=True, temperature=0.5, epsilon=1e-3):
        super().__init__()
        nets = {"dql": lambda: DQLMlpAsIs(obs_dim, act_dim),
                "idql": lambda: IDQLMlpAsIs(obs_dim, act_dim),
                "mlp": lambda: MlpNNDiffusionAsIs(act_dim, emb_dim=obs_dim)}  # the condition adds to the features
        self.model = nn.ModuleDict({"diffusion": nets[net](), "condition": IdentityConditionAsIs(dropout=0.0)})
        self.model.eval()
        self.net, self.obs_dim, self.act_dim = net, obs_dim, act_dim
        self.solver, self.predict_noise, self.temperature = solver, predict_noise, temperature
        self.diffusion_steps, self.sample_steps = diffusion_steps, sample_steps
        self.t_diffusion = torch.linspace(epsilon, 1.0, diffusion_steps)
        self.alpha, self.sigma = cosine_noise_schedule(self.t_diffusion)
        self.fix_mask = 0.
        self.x_max = +1. * torch.ones((1, act_dim)) if clip else None
        self.x_min = -1. * torch.ones((1, act_dim)) if clip else None

    @property
    def clip_pred(self):
        return (self.x_max is not None) or (self.x_min is not None)

    def clip_prediction(self, pred, xt, alpha, sigma):
        if self.predict_noise:
            if self.clip_pred:
                upper_bound = (xt - alpha * self.x_min) / sigma if self.x_min is not None else None
                lower_bound = (xt - alpha * self.x_max) / sigma if self.x_max is not None else None
                pred = pred.clip(lower_bound, upper_bound)
        else:
            if self.clip_pred:
                pred = pred.clip(self.x_min, self.x_max)
        return pred

    def guided(self, xt, t, condition, w=1.0):
        pred = self.model["diffusion"](xt, t, condition)
        pred_uncond = 0.
        return w * pred + (1 - w) * pred_uncond

    def forward(self, condition, prior, noise):
        model = self.model
        n_samples = prior.shape[0]
        xt = noise[0] * self.temperature
        if self.fix_mask is not None:
            xt = xt * (1. - self.fix_mask) + prior * self.fix_mask
        condition_vec_cfg = model["condition"](condition, None)
        sample_step_schedule = torch.linspace(0, self.diffusion_steps - 1, self.sample_steps + 1, dtype=torch.long)
        alphas = self.alpha[sample_step_schedule]
        sigmas = self.sigma[sample_step_schedule]
        logSNRs = torch.log(alphas / sigmas)
        hs = torch.zeros_like(logSNRs)
        hs[1:] = logSNRs[:-1] - logSNRs[1:]
        stds = torch.zeros((self.sample_steps + 1,), device=prior.device)
        stds[1:] = sigmas[:-1] / sigmas[1:] * (1 - (alphas[1:] / alphas[:-1]) ** 2).sqrt()
        for k, i in enumerate(reversed(range(1, self.sample_steps + 1))):
            t = torch.full((n_samples,), sample_step_schedule[i], dtype=torch.long, device=prior.device)
            pred = self.guided(xt, t, condition_vec_cfg)
            pred = self.clip_prediction(pred, xt, alphas[i], sigmas[i])
            eps_theta = pred if self.predict_noise else (xt - alphas[i] * pred) / sigmas[i]
            if self.solver == "ddpm":
                xt = ((alphas[i - 1] / alphas[i]) * (xt - sigmas[i] * eps_theta)
                      + (sigmas[i - 1] ** 2 - stds[i] ** 2 + 1e-8).sqrt() * eps_theta)
                if i > 1:
                    xt += (stds[i] * noise[k + 1])
            else:
                xt = (alphas[i - 1] * ((xt - sigmas[i] * eps_theta) / alphas[i]) + sigmas[i - 1] * eps_theta)
            if self.fix_mask is not None:
                xt = xt * (1. - self.fix_mask) + prior * self.fix_mask
        if self.clip_pred:
            xt = xt.clip(self.x_min, self.x_max)
        return xt
