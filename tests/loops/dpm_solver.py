"""DPM-Solver++ 2M samplers as projects write them: the previous step's x0 prediction kept in a
Python variable (a list, or one name), the first step first order.

- :class:`CleanDiffuser2M`: CleanDiffuser's ``DiscreteDiffusionSDE.sample`` with
  ``solver="ode_dpmsolver++_2M"``: ``alphas``, ``sigmas``, ``logSNRs`` of the sampling schedule
  indexed by the Python-int step, ``hs`` filled in place, every x0 prediction appended to
  ``buffer``; the last step is second order too. ``x_max`` a number: the x0 prediction clipped
  to it (``pred.clip`` on a data prediction, ``x_theta.clip`` on an eps one); ``eps_bounds``:
  CleanDiffuser's own clip of an eps prediction, to ``((xt - alpha * x_max) / sigma, (xt -
  alpha * x_min) / sigma)`` with its ``(1, x_dim)`` bound tensors, before ``x_theta``
  (``theta_sigma_offset`` 1: ``x_theta`` computed with the next step's sigma, which is no x0).
- :class:`DiffusersStyle2M`: ``DPMSolverMultistepScheduler.step`` (``dpmsolver++``, midpoint,
  ``solver_order=2``) inline, written with tensors: ``convert_model_output``,
  ``model_outputs`` shifted by one, ``lower_order_nums``, ``lower_order_final`` on the last
  step, the ``sigmas`` of ``final_sigmas_type``; epsilon, sample or v prediction.
- :class:`NamedPrevious2M`: the previous x0 in one variable (``x0_prev = None`` before the
  loop), the last step returning the clipped x0 itself.
- :class:`ThirdOrder3M`, :class:`PreviousBeforeClip`, :class:`PerSample2M`: multistep loops the
  rewrite leaves alone (the x0 of two steps back; the previous x0 taken before its clip while the
  update uses the clipped one; per-sample timesteps).
"""
import math

import numpy as np
import torch
from torch import nn

from .cleandiffuser import DQLMlp
from .common import SinusoidalPosEmb


class FloatTimeMlp(DQLMlp):
    """CleanDiffuser's DQLMlp given the sampler's float timesteps as they are (so that the whole
    sampler runs in float64 too, for the reference)."""

    def forward(self, x, noise, condition):
        t = self.time_mlp(self.map_noise(noise))
        return self.final_layer(self.mid_layer(torch.cat([x, t, condition], -1)))


class CleanDiffuser2M(nn.Module):
    """``forward(condition, xt, noise=None)``: ``xt`` the prior noise. ``solver``:
    ``"ode_dpmsolver++_2M"`` (no other draw) or ``"sde_dpmsolver++_2M"`` (a draw every step:
    ``noise[k]`` for step k where given, else ``randn_like``)."""

    def __init__(self, obs_dim=11, x_dim=3, diffusion_steps=20, sample_steps=6, predict_noise=True,
                 x_max=None, solver="ode_dpmsolver++_2M", eps_bounds=False, theta_sigma_offset=0):
        super().__init__()
        self.solver, self.theta_sigma_offset = solver, theta_sigma_offset
        # CleanDiffuser keeps its bounds as (1, x_dim) tensors, plain attributes.
        self.bounds = (-torch.tensor([[1.0, 0.5, 2.0]])[:, :x_dim], torch.tensor([[1.0, 2.0, 0.5]])[:, :x_dim]) \
            if eps_bounds else None
        self.model = FloatTimeMlp(obs_dim, x_dim, hidden=64)
        self.predict_noise, self.x_max = predict_noise, x_max
        # CleanDiffuser's discretization and linear schedule: t in [epsilon, 1], VP alpha / sigma.
        t_diffusion = torch.linspace(1e-3, 1.0, diffusion_steps)
        log_alpha = -(19.9 * t_diffusion ** 2 / 4 + 0.1 * t_diffusion / 2)
        alpha = log_alpha.exp()
        sigma = (1 - alpha ** 2).sqrt()
        self.register_buffer("alpha", alpha)
        self.register_buffer("sigma", sigma)
        self.register_buffer("logSNR", torch.log(alpha / sigma))
        self.sample_step_schedule = torch.linspace(0, diffusion_steps - 1, sample_steps + 1).long().tolist()
        self.sample_steps = sample_steps

    def forward(self, condition, xt, noise=None):
        n_samples = xt.shape[0]
        sample_step_schedule = self.sample_step_schedule
        alphas = self.alpha[sample_step_schedule]
        sigmas = self.sigma[sample_step_schedule]
        logSNRs = self.logSNR[sample_step_schedule]
        hs = torch.zeros_like(logSNRs)
        hs[1:] = logSNRs[:-1] - logSNRs[1:]  # hs[0] is never read
        buffer = []
        for i in reversed(range(1, self.sample_steps + 1)):
            t = torch.full((n_samples,), sample_step_schedule[i], dtype=xt.dtype, device=xt.device)
            pred = self.model(xt, t, condition)
            if self.bounds is not None:
                x_min, x_max = self.bounds
                pred = pred.clip((xt - alphas[i] * x_max) / sigmas[i], (xt - alphas[i] * x_min) / sigmas[i])
            if not self.predict_noise and self.x_max is not None:
                pred = pred.clip(-self.x_max, self.x_max)
            x_theta = pred if not self.predict_noise else (xt - sigmas[i - self.theta_sigma_offset] * pred) / alphas[i]
            if self.predict_noise and self.x_max is not None:
                x_theta = x_theta.clip(-self.x_max, self.x_max)
            buffer.append(x_theta)
            D = x_theta
            if i < self.sample_steps:
                r = hs[i + 1] / hs[i]
                D = (1 + 0.5 / r) * buffer[-1] - 0.5 / r * buffer[-2]
            if self.solver == "ode_dpmsolver++_2M":
                xt = (sigmas[i - 1] / sigmas[i]) * xt - alphas[i - 1] * torch.expm1(-hs[i]) * D
            else:
                z = torch.randn_like(xt) if noise is None else noise[self.sample_steps - i]
                xt = ((sigmas[i - 1] / sigmas[i]) * (-hs[i]).exp() * xt
                      - alphas[i - 1] * torch.expm1(-2 * hs[i]) * D
                      + sigmas[i - 1] * (-torch.expm1(-2 * hs[i])).sqrt() * z)
        return xt


class DiffusersNet(nn.Module):
    def __init__(self, dim, obs_dim, hidden=64, t_dim=16):
        super().__init__()
        self.temb = SinusoidalPosEmb(t_dim)
        self.net = nn.Sequential(nn.Linear(dim + t_dim + obs_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden),
                                 nn.SiLU(), nn.Linear(hidden, dim))

    def forward(self, x, t, obs):
        return self.net(torch.cat([x, self.temb(t), obs], dim=-1))


class DiffusersStyle2M(nn.Module):
    """``forward(obs, x)``. ``final_sigmas_type``: "zero" (the last step to sigma 0, first order)
    or "sigma_min"; ``clip``: a clamp of ``x0_pred`` (diffusers' own option here is dynamic
    thresholding, which is not a clamp)."""

    def __init__(self, dim=4, obs_dim=3, num_train_timesteps=100, num_inference_steps=8,
                 prediction_type="epsilon", final_sigmas_type="zero", lower_order_final=True, clip=None):
        super().__init__()
        self.unet = DiffusersNet(dim, obs_dim)
        # A scheduler's tables are on the CPU (numpy reads them); the sigmas buffer moves with the module.
        betas = torch.linspace(1e-4, 0.02, num_train_timesteps, dtype=torch.float32, device="cpu")
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        # set_timesteps with timestep_spacing="linspace"
        timesteps = np.linspace(0, num_train_timesteps - 1, num_inference_steps + 1).round()[::-1][:-1].copy()
        sigmas = ((1 - alphas_cumprod) / alphas_cumprod) ** 0.5
        sigmas = np.interp(timesteps, np.arange(len(sigmas)), sigmas.numpy())
        sigma_last = 0.0 if final_sigmas_type == "zero" else float(((1 - alphas_cumprod[0]) / alphas_cumprod[0]) ** 0.5)
        self.register_buffer("sigmas", torch.from_numpy(np.concatenate([sigmas, [sigma_last]])).float())
        self.alphas_cumprod = alphas_cumprod  # for tests: the schedule step_rules.dpm_solver_pp reads
        self.timesteps = [int(t) for t in timesteps]
        self.prediction_type, self.final_sigmas_type = prediction_type, final_sigmas_type
        self.lower_order_final, self.clip, self.dim = lower_order_final, clip, dim

    def _sigma_to_alpha_sigma_t(self, sigma):
        alpha_t = 1 / ((sigma ** 2 + 1) ** 0.5)
        sigma_t = sigma * alpha_t
        return alpha_t, sigma_t

    def convert_model_output(self, model_output, sample, step_index):
        if self.prediction_type == "epsilon":
            alpha_t, sigma_t = self._sigma_to_alpha_sigma_t(self.sigmas[step_index])
            x0_pred = (sample - sigma_t * model_output) / alpha_t
        elif self.prediction_type == "sample":
            x0_pred = model_output
        else:  # v_prediction
            alpha_t, sigma_t = self._sigma_to_alpha_sigma_t(self.sigmas[step_index])
            x0_pred = alpha_t * sample - sigma_t * model_output
        if self.clip is not None:
            x0_pred = x0_pred.clamp(-self.clip, self.clip)
        return x0_pred

    def first_order_update(self, model_output, sample, step_index):
        alpha_t, sigma_t = self._sigma_to_alpha_sigma_t(self.sigmas[step_index + 1])
        alpha_s, sigma_s = self._sigma_to_alpha_sigma_t(self.sigmas[step_index])
        lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
        lambda_s = torch.log(alpha_s) - torch.log(sigma_s)
        h = lambda_t - lambda_s
        return (sigma_t / sigma_s) * sample - (alpha_t * (torch.exp(-h) - 1.0)) * model_output

    def second_order_update(self, model_output_list, sample, step_index):
        alpha_t, sigma_t = self._sigma_to_alpha_sigma_t(self.sigmas[step_index + 1])
        alpha_s0, sigma_s0 = self._sigma_to_alpha_sigma_t(self.sigmas[step_index])
        alpha_s1, sigma_s1 = self._sigma_to_alpha_sigma_t(self.sigmas[step_index - 1])
        lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
        lambda_s0 = torch.log(alpha_s0) - torch.log(sigma_s0)
        lambda_s1 = torch.log(alpha_s1) - torch.log(sigma_s1)
        m0, m1 = model_output_list[-1], model_output_list[-2]
        h, h_0 = lambda_t - lambda_s0, lambda_s0 - lambda_s1
        r0 = h_0 / h
        D0, D1 = m0, (1.0 / r0) * (m0 - m1)
        return ((sigma_t / sigma_s0) * sample - (alpha_t * (torch.exp(-h) - 1.0)) * D0
                - 0.5 * (alpha_t * (torch.exp(-h) - 1.0)) * D1)

    def forward(self, obs, x):
        model_outputs = [None, None]
        lower_order_nums = 0
        n = len(self.timesteps)
        for step_index, t in enumerate(self.timesteps):
            model_output = self.unet(x, torch.full((x.shape[0],), t, dtype=torch.long, device=x.device), obs)
            lower_order_final = step_index == n - 1 and (
                (self.lower_order_final and n < 15) or self.final_sigmas_type == "zero")
            model_output = self.convert_model_output(model_output, x, step_index)
            model_outputs[0] = model_outputs[1]
            model_outputs[-1] = model_output
            sample = x  # diffusers upcasts to float32 here: a no-op for float32, kept out of the float64 reference
            if lower_order_nums < 1 or lower_order_final:
                x = self.first_order_update(model_output, sample, step_index)
            else:
                x = self.second_order_update(model_outputs, sample, step_index)
            if lower_order_nums < 2:
                lower_order_nums += 1
        return x


def _vp_schedule(T, steps):
    betas = torch.linspace(1e-4, 0.02, T, dtype=torch.float64)
    abar = torch.cumprod(1 - betas, 0)
    times = torch.linspace(T - 1, 0, steps + 1).round().long()
    alpha, sigma = abar[times].sqrt(), (1 - abar[times]).sqrt()
    alpha[-1], sigma[-1] = 1.0, 0.0  # the data end
    return [int(s) for s in times], alpha, sigma


class NamedPrevious2M(nn.Module):
    """The previous x0 in one variable; the last step returns the clipped x0 (sigma 0)."""

    def __init__(self, obs_dim=11, action_dim=3, hidden=64, num_steps=6, T=1000, clip=1.0):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(action_dim + 1 + obs_dim, hidden), nn.Mish(),
                                 nn.Linear(hidden, hidden), nn.Mish(), nn.Linear(hidden, action_dim))
        self.times, alpha, sigma = _vp_schedule(T, num_steps)
        self.register_buffer("alpha", alpha.float())
        self.register_buffer("sigma", sigma.float())
        self.register_buffer("lam", (alpha / sigma.clamp(min=1e-12)).log().float())
        self.num_steps, self.T, self.clip = num_steps, T, clip

    def forward(self, obs, x):
        x0_prev = None
        for i in range(self.num_steps):
            t = torch.full((x.shape[0], 1), self.times[i] / self.T, device=x.device)
            eps = self.net(torch.cat([x, t, obs], dim=-1))
            x0 = (x - self.sigma[i] * eps) / self.alpha[i]
            if self.clip is not None:
                x0 = x0.clamp(-self.clip, self.clip)
            if i + 1 == self.num_steps:
                x = x0
                break
            h = self.lam[i + 1] - self.lam[i]
            d = x0
            if x0_prev is not None:
                r = (self.lam[i] - self.lam[i - 1]) / h
                d = (1 + 1 / (2 * r)) * x0 - 1 / (2 * r) * x0_prev
            x = self.sigma[i + 1] / self.sigma[i] * x - self.alpha[i + 1] * torch.expm1(-h) * d
            x0_prev = x0
        return x


class ThirdOrder3M(NamedPrevious2M):
    """DPM-Solver++ 3M's data: each step also reads the x0 of two steps back (simplified
    coefficients; the op carries one previous x0, not two)."""

    def forward(self, obs, x):
        history = []
        for i in range(self.num_steps):
            t = torch.full((x.shape[0], 1), self.times[i] / self.T, device=x.device)
            eps = self.net(torch.cat([x, t, obs], dim=-1))
            x0 = (x - self.sigma[i] * eps) / self.alpha[i]
            history.append(x0)
            d = x0 if len(history) < 3 else 1.5 * history[-1] - 0.75 * history[-2] + 0.25 * history[-3]
            if i + 1 == self.num_steps:
                return d
            h = self.lam[i + 1] - self.lam[i]
            x = self.sigma[i + 1] / self.sigma[i] * x - self.alpha[i + 1] * torch.expm1(-h) * d
        return x


class PreviousBeforeClip(NamedPrevious2M):
    """The update uses the clipped x0, the next step the unclipped one (the op's previous x0 is
    the clipped one)."""

    def forward(self, obs, x):
        x0_prev = None
        for i in range(self.num_steps - 1):
            t = torch.full((x.shape[0], 1), self.times[i] / self.T, device=x.device)
            eps = self.net(torch.cat([x, t, obs], dim=-1))
            raw = (x - self.sigma[i] * eps) / self.alpha[i]
            x0 = raw.clamp(-1.0, 1.0)
            h = self.lam[i + 1] - self.lam[i]
            d = x0 if x0_prev is None else 1.5 * x0 - 0.5 * x0_prev
            x = self.sigma[i + 1] / self.sigma[i] * x - self.alpha[i + 1] * torch.expm1(-h) * d
            x0_prev = raw
        return x


class PerSample2M(nn.Module):
    """2M from tables a user precomputed per training timestep, read at per-sample timesteps
    ``t_start - k``: the op's P table is read for timesteps shared by the batch only."""

    def __init__(self, obs_dim=11, action_dim=3, hidden=64, num_steps=5, T=20):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(action_dim + 1 + obs_dim, hidden), nn.Mish(),
                                 nn.Linear(hidden, hidden), nn.Mish(), nn.Linear(hidden, action_dim))
        abar = torch.cumprod(1 - torch.linspace(1e-4, 0.2, T, dtype=torch.float64), 0)
        alpha, sigma = abar.sqrt(), (1 - abar).sqrt()
        lam = (alpha / sigma).log()
        alpha_next, sigma_next = torch.cat([alpha.new_ones(1), alpha[:-1]]), torch.cat([sigma.new_zeros(1), sigma[:-1]])
        h = torch.cat([lam.new_full((1,), math.inf), lam[:-1]]) - lam
        h_prev = torch.cat([lam[:-1] - lam[1:], lam.new_ones(1)])
        half_inv_r = h / (2 * h_prev)
        half_inv_r[0] = 0.0  # the last step, to sigma 0: first order
        first = -alpha_next * torch.expm1(-h)
        self.register_buffer("a", (1 / alpha).float())
        self.register_buffer("b", (sigma / alpha).float())
        self.register_buffer("d", (sigma_next / sigma).float())
        self.register_buffer("c", (first * (1 + half_inv_r)).float())
        self.register_buffer("p", (-first * half_inv_r).float())
        self.num_steps, self.T = num_steps, T

    def forward(self, obs, x, t_start):
        x0_prev = None
        for k in range(self.num_steps):
            t = t_start - k
            eps = self.net(torch.cat([x, (t.float() / self.T)[:, None], obs], dim=-1))
            x0 = self.a[t][:, None] * x - self.b[t][:, None] * eps
            x = self.d[t][:, None] * x + self.c[t][:, None] * x0
            if x0_prev is not None:
                x = x + self.p[t][:, None] * x0_prev
            x0_prev = x0
        return x
