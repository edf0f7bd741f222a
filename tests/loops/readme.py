"""The README's time-column loop (``ddpm_ops.reference``) with a draw of noise added, or the
sample clamped, at every step."""
import torch
from torch import nn

import ddpm_ops


class TimeColumnLoop(nn.Module):
    def __init__(self, dim=4, hidden=16, num_steps=5, total_timesteps=100, noise=False, clamp=None):
        super().__init__()
        self.eps_net = ddpm_ops.silu_mlp([dim + 1, hidden, hidden, dim])
        sqrt_recip_alphas, coef_eps = ddpm_ops.coefficient_tables(ddpm_ops.linear_betas(total_timesteps))
        self.register_buffer("sqrt_recip_alphas", sqrt_recip_alphas)
        self.register_buffer("coef_eps", coef_eps)
        self.register_buffer("sigma", ddpm_ops.linear_betas(total_timesteps).sqrt().float())
        self.num_steps, self.total_timesteps, self.noise, self.clamp = num_steps, total_timesteps, noise, clamp

    def forward(self, x, t_start, noise=None):
        x_cur = x
        for k in range(self.num_steps):
            t_idx = t_start - k
            t_norm = t_idx.float() / self.total_timesteps
            eps = self.eps_net(torch.cat([x_cur, t_norm[:, None]], dim=1))
            x_cur = self.sqrt_recip_alphas[t_idx].view(-1, 1) * (x_cur - self.coef_eps[t_idx].view(-1, 1) * eps)
            if self.noise:
                x_cur = x_cur + self.sigma[t_idx].view(-1, 1) * noise[k]
            if self.clamp is not None:
                x_cur = x_cur.clamp(-self.clamp, self.clamp)
        return x_cur
