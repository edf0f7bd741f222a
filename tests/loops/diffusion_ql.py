"""Diffusion-QL (agents/diffusion.py, agents/model.py): the policy's sampler, small sizes."""
import numpy as np
import torch
from torch import nn

from .common import SinusoidalPosEmb, ddpm_buffers, extract, linear_beta_schedule


class TimeColumn(nn.Module):
    """The raw timestep as one float column."""

    def forward(self, time):
        return time.float()[:, None]


class MLP(nn.Module):
    """``bias_free``: the Linears built with ``bias=False``, among "first" (mid_layer's first),
    "mid" (all of mid_layer's), "final" and "time" (the time MLP's). ``time_embedding``: "mlp"
    (the sinusoidal features through an MLP), "sinusoidal" (the features alone) or "column_mlp"
    (the raw timestep column through the MLP)."""

    def __init__(self, state_dim, action_dim, t_dim=16, hidden=256, bias_free=(), time_embedding="mlp"):
        super().__init__()

        def linear(a, b, *names):
            return nn.Linear(a, b, bias=not set(names) & set(bias_free))

        features, width = (TimeColumn(), 1) if time_embedding == "column_mlp" else (SinusoidalPosEmb(t_dim), t_dim)
        self.time_mlp = features if time_embedding == "sinusoidal" else nn.Sequential(
            features, linear(width, t_dim * 2, "time"), nn.Mish(), linear(t_dim * 2, t_dim, "time"))
        input_dim = state_dim + action_dim + t_dim
        self.mid_layer = nn.Sequential(linear(input_dim, hidden, "first", "mid"), nn.Mish(),
                                       linear(hidden, hidden, "mid"), nn.Mish(),
                                       linear(hidden, hidden, "mid"), nn.Mish())
        self.final_layer = linear(hidden, action_dim, "final")

    def forward(self, x, time, state):
        t = self.time_mlp(time)
        x = torch.cat([x, t, state], dim=1)
        x = self.mid_layer(x)
        return self.final_layer(x)


class Diffusion(nn.Module):
    """``forward(state, noise=None)``: ``noise`` (n_timesteps + 1, B, action_dim) replaces
    the draws (the initial x first) so that a compiled run can be compared with eager.
    ``mlp``: :class:`MLP`'s options."""

    def __init__(self, state_dim=17, action_dim=6, max_action=1.0, n_timesteps=5, hidden=256, **mlp):
        super().__init__()
        self.state_dim, self.action_dim, self.max_action = state_dim, action_dim, max_action
        self.model = MLP(state_dim, action_dim, hidden=hidden, **mlp)
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
            timesteps = self.make_timesteps(batch_size, i, state.device)
            x = self.p_sample(x, timesteps, state, None if noise is None else noise[self.n_timesteps - i])
        return x

    @staticmethod
    def make_timesteps(batch_size, i, device):
        return torch.full((batch_size,), i, device=device, dtype=torch.long)

    def sample(self, state, noise=None):
        batch_size = state.shape[0]
        shape = (batch_size, self.action_dim)
        action = self.p_sample_loop(state, shape, noise)
        return action.clamp_(-self.max_action, self.max_action)

    forward = sample


class DiffusionVariants(Diffusion):
    """Diffusion-QL's other spellings of the same sampler:

    - ``predict_epsilon=False`` (its flag): the network gives x0, ``predict_start_from_noise``
      returns it unchanged;
    - ``mask``: "where" spells the last step's mask ``torch.where(t > 0, 1.0, 0.0)[:, None]``
      and multiplies the noise first, ``noise * (0.5 * log_var).exp()``; "select" picks between
      the two samples, ``torch.where((t > 0)[:, None], mean + std * z, mean)``;
    - ``inloop_sqrt``: x0 from ``alphas_cumprod`` gathered per sample and square-rooted in the
      loop, ``(x - (1 - a).sqrt() * eps) / a.sqrt()``;
    - ``t_arg``: the per-sample ``t`` given by the caller (a start per row, stepped down by one
      for ``steps`` steps: rows starting low reach t = 0, where the mask drops the noise);
    - ``time_spelling``: each step's timesteps as ``torch.full`` ("full"), IDQL's
      ``array([time]).repeat(batch)`` ("repeat"), ConditionalUnet1D's ``tensor([t]).expand(B)``
      ("expand") or a schedule's 0-d entry expanded, ``timestep_seq[i].expand(B)``
      ("index_expand")."""

    def __init__(self, predict_epsilon=True, mask="nonzero", inloop_sqrt=False, t_arg=False, steps=5,
                 time_spelling="full", **kw):
        super().__init__(**kw)
        self.predict_epsilon, self.mask, self.inloop_sqrt, self.t_arg = predict_epsilon, mask, inloop_sqrt, t_arg
        self.steps, self.time_spelling = steps, time_spelling
        self.register_buffer("timestep_seq", torch.arange(self.n_timesteps))

    def make_timesteps(self, batch_size, i, device):
        if self.time_spelling == "repeat":
            return torch.tensor([i], device=device).repeat(batch_size)
        if self.time_spelling == "expand":
            return torch.tensor([i], dtype=torch.long, device=device).expand(batch_size)
        if self.time_spelling == "index_expand":
            return self.timestep_seq[i].expand(batch_size)
        return super().make_timesteps(batch_size, i, device)

    def predict_start_from_noise(self, x_t, t, noise):
        if not self.predict_epsilon:
            return noise
        if self.inloop_sqrt:
            a = extract(self.alphas_cumprod, t, x_t.shape)
            return (x_t - (1 - a).sqrt() * noise) / a.sqrt()
        return super().predict_start_from_noise(x_t, t, noise)

    def p_sample(self, x, t, s, noise=None):
        if self.mask == "nonzero":
            return super().p_sample(x, t, s, noise)
        model_mean, _, model_log_variance = self.p_mean_variance(x=x, t=t, s=s)
        noise = torch.randn_like(x) if noise is None else noise
        if self.mask == "select":
            return torch.where((t > 0)[:, None], model_mean + (0.5 * model_log_variance).exp() * noise, model_mean)
        return model_mean + torch.where(t > 0, 1.0, 0.0)[:, None] * noise * (0.5 * model_log_variance).exp()

    def forward(self, state, *rest):
        """``(state, noise=None)``, or ``(state, t_start, noise=None)`` with ``t_arg``."""
        if not self.t_arg:
            return super().forward(state, *rest)
        t_start, noise = (*rest, None)[:2]
        x = torch.randn(state.shape[0], self.action_dim, device=state.device) if noise is None else noise[0]
        for k in range(self.steps):
            x = self.p_sample(x, t_start - k, state, None if noise is None else noise[k + 1])
        return x.clamp_(-self.max_action, self.max_action)


class SampleAction(Diffusion):
    """Diffusion_QL.sample_action (agents/ql_diffusion.py) up to the sampled actions: one state
    ``(1, state_dim)`` repeated ``repeats`` times (``torch.repeat_interleave``) and sampled,
    with the tables built as agents/diffusion.py builds them (numpy linspace betas,
    ``np.sqrt`` of tensors). ``forward(state, noise)``: ``noise`` (n_timesteps + 1, repeats,
    action_dim) as above."""

    def __init__(self, repeats=50, **kw):
        super().__init__(**kw)
        self.repeats = repeats
        # On the CPU, as the project builds its modules before moving them (np.sqrt reads them).
        betas = torch.tensor(np.linspace(1e-4, 2e-2, self.n_timesteps), dtype=torch.float32, device="cpu")
        alphas = 1. - betas
        alphas_cumprod = torch.cumprod(alphas, axis=0)
        alphas_cumprod_prev = torch.cat([torch.ones(1, device="cpu"), alphas_cumprod[:-1]])
        posterior_variance = betas * (1. - alphas_cumprod_prev) / (1. - alphas_cumprod)
        for name, value in [
                ("betas", betas), ("alphas_cumprod", alphas_cumprod), ("alphas_cumprod_prev", alphas_cumprod_prev),
                ("sqrt_recip_alphas_cumprod", torch.sqrt(1. / alphas_cumprod)),
                ("sqrt_recipm1_alphas_cumprod", torch.sqrt(1. / alphas_cumprod - 1)),
                ("posterior_variance", posterior_variance),
                ("posterior_log_variance_clipped", torch.log(torch.clamp(posterior_variance, min=1e-20))),
                ("posterior_mean_coef1", betas * np.sqrt(alphas_cumprod_prev) / (1. - alphas_cumprod)),
                ("posterior_mean_coef2", (1. - alphas_cumprod_prev) * np.sqrt(alphas) / (1. - alphas_cumprod))]:
            setattr(self, name, value.to(torch.float32))

    def forward(self, state, noise=None):
        state = state.reshape(1, -1)
        state_rpt = torch.repeat_interleave(state, repeats=self.repeats, dim=0)
        return self.sample(state_rpt, noise)
