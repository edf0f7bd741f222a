"""The README's loop (SiLU MLP on [x, t/T]) in the spellings users write: the posterior form
(x0 first, then the posterior mean), TabDDPM's ``.expand`` extract, Python-int or ``torch.full``
timesteps, an observation concatenated, noise and clamps per step, the sample scaled for the
network (``c_in * x``) or an action chunk it reads channels first."""
import torch
from torch import nn

from .common import ddpm_buffers, extract, extract_expand, linear_beta_schedule


class PosteriorSampler(nn.Module):
    """``timesteps``: "tensor" (per-sample ``t_start - k``), "full" (``torch.full``) or "int"
    (Python-int indexing, 0-d coefficients); ``lookup``: "gather" (``extract``), "expand"
    (TabDDPM's) or "gather_expand" (``table.gather(-1, t)[..., None].expand(x.shape)``).

    ``c_in``: the network reads ``c_in[t] * x``, ``c_in = 1 / sqrt(sigma**2 + 1)`` of the VP
    sample's ``sigma = sqrt(1 / alpha_bar - 1)`` (k-diffusion's wrapping of a VP model). ``chunk``:
    ``(horizon, action_dim)``, the sample an action chunk the network reads channels first
    (``x.transpose(1, 2).reshape(B, -1)``) and whose output it lays out back
    (``.reshape(B, action_dim, horizon).transpose(1, 2)``; with ``write_back=False`` as
    ``(B, horizon, action_dim)`` directly, the elements in another order)."""

    def __init__(self, dim=4, hidden=32, num_steps=6, T=20, timesteps="tensor", lookup="gather",
                 obs_dim=0, noise=False, clip=None, post_clip=None, c_in=False, chunk=None, write_back=True):
        super().__init__()
        dim = dim if chunk is None else chunk[0] * chunk[1]
        self.eps_net = nn.Sequential(nn.Linear(dim + 1 + obs_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden),
                                     nn.SiLU(), nn.Linear(hidden, dim))
        self.dim, self.num_steps, self.T = dim, num_steps, T
        self.timesteps, self.lookup, self.obs_dim = timesteps, lookup, obs_dim
        self.noise, self.clip, self.post_clip = noise, clip, post_clip
        self.chunk, self.write_back = chunk, write_back
        ddpm_buffers(self, linear_beta_schedule(T))
        self.register_buffer("c_in", 1 / (self.sqrt_recipm1_alphas_cumprod ** 2 + 1).sqrt() if c_in else None)

    def shape(self, batch):
        """The sample's shape for ``batch`` rows."""
        return (batch, self.dim) if self.chunk is None else (batch, *self.chunk)

    def coef(self, table, t, x):
        if self.timesteps == "int":
            return table[t]
        if self.lookup == "gather_expand":
            return table.gather(-1, t)[..., None].expand(x.shape)
        return extract(table, t, x.shape) if self.lookup == "gather" else extract_expand(table, t, x.shape)

    def forward(self, x, t_start, obs=None, noise=None):
        b = x.shape[0]
        for k in range(self.num_steps):
            if self.timesteps == "tensor":
                t = t_start - k
                t_col = (t.float() / self.T)[:, None]
            else:
                i = int(t_start) - k
                t = i if self.timesteps == "int" else torch.full((b,), i, dtype=torch.long, device=x.device)
                t_col = torch.full((b, 1), i / self.T, device=x.device)
            x_in = x if self.chunk is None else x.transpose(1, 2).reshape(b, -1)
            if self.c_in is not None:
                x_in = self.coef(self.c_in, t, x_in) * x_in
            inp = torch.cat([x_in, t_col] + ([obs] if self.obs_dim else []), dim=1)
            eps = self.eps_net(inp)
            if self.chunk is not None:
                eps = eps.reshape(b, self.chunk[1], self.chunk[0]).transpose(1, 2) if self.write_back \
                    else eps.reshape(b, *self.chunk)
            x0 = self.coef(self.sqrt_recip_alphas_cumprod, t, x) * x - self.coef(self.sqrt_recipm1_alphas_cumprod, t, x) * eps
            if self.clip is not None:
                x0 = x0.clamp(*self.clip)
            x = self.coef(self.posterior_mean_coef1, t, x) * x0 + self.coef(self.posterior_mean_coef2, t, x) * x
            if self.noise:
                z = torch.randn_like(x) if noise is None else noise[k]
                x = x + self.coef(self.posterior_variance, t, x).sqrt() * z
            if self.post_clip is not None:
                x = x.clamp(*self.post_clip)
        return x


class ResidualSampler(PosteriorSampler):
    """The posterior-mean loop with DPPO's residual MLP (``use_layernorm``: its LayerNorms too)
    as the noise network, on a flat sample."""

    def __init__(self, use_layernorm=False, **kw):
        super().__init__(timesteps="int", **kw)
        from .dppo import ResidualMLP
        self.eps_net = ResidualMLP([self.dim + 1, 32, 32, 32, 32, 32, self.dim], use_layernorm=use_layernorm)
