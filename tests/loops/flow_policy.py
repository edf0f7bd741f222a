"""A flow-matching (rectified-flow) policy's Euler sampler, as flow policies of offline RL and
robot learning write it: a velocity MLP of the action, the time as a float column and the
observation, integrated from noise (t = 0) to an action (t = 1) in n Euler steps."""
import math

import torch
from torch import nn

from .common import SinusoidalPosEmb


class FourierTime(nn.Module):
    """sin/cos features of a float time in [0, 1], then a small MLP."""

    def __init__(self, dim=16):
        super().__init__()
        self.register_buffer("freqs", torch.exp(torch.arange(dim // 2) * -(math.log(1000) / (dim // 2 - 1))))
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.Mish(), nn.Linear(2 * dim, dim))

    def forward(self, t):
        angles = 1000 * t * self.freqs[None]
        return self.mlp(torch.cat([angles.sin(), angles.cos()], dim=-1))


class FlowPolicy(nn.Module):
    def __init__(self, obs_dim=11, action_dim=3, hidden=256, num_steps=10, time_embedding=False):
        super().__init__()
        time_dim = 16 if time_embedding else 1
        self.time = FourierTime(time_dim) if time_embedding else nn.Identity()
        self.velocity = nn.Sequential(nn.Linear(action_dim + time_dim + obs_dim, hidden), nn.Mish(),
                                      nn.Linear(hidden, hidden), nn.Mish(), nn.Linear(hidden, action_dim))
        self.action_dim, self.num_steps = action_dim, num_steps

    def forward(self, obs, x):
        dt = 1.0 / self.num_steps
        for i in range(self.num_steps):
            t = torch.full((x.shape[0], 1), i / self.num_steps, device=x.device)
            x = x + dt * self.velocity(torch.cat([x, self.time(t), obs], dim=-1))
        return x.clamp(-1.0, 1.0)


class FlowSpellings(nn.Module):
    """The same Euler loop in the other ways flow policies write the time and the step:

    - ``"ones"``: ``t = torch.ones(B, 1, device=x.device) * (i / n)``;
    - ``"float_arg"``: ``t = i / n`` a Python float, which the network turns into a column
      (``t * torch.ones_like(x[:, :1])``);
    - ``"linspace"``: ``ts = torch.linspace(0, 1, n + 1, device=x.device)``, ``t = ts[i].expand(B, 1)``,
      ``dt = ts[i + 1] - ts[i]`` a 0-d tensor;
    - ``"repeat"``: ``ts[i].repeat(B, 1)`` and ``x = x + v * dt``;
    - ``"inplace"``: ``x += dt * v`` (functionalized);
    - ``"embedding"``: ``t = torch.full((B, 1), i / n, device=x.device)`` through Fourier features and an MLP,
      the velocity network's input ``cat[x, temb, obs]``;
    - ``"sinusoidal"``: ``t = torch.full((B,), i / n, device=x.device)`` through Diffusion-QL's sinusoidal
      embedding and a Linear-Mish-Linear;
    - ``"tensor_loop"``: ``for t in ts[:-1]`` over the linspace, ``t.expand(B, 1)``.

    ``fourier_time``: the time column through :class:`FourierTime` (as ``"embedding"``).
    """

    def __init__(self, spelling, obs_dim=11, action_dim=3, hidden=128, num_steps=8, fourier_time=False):
        super().__init__()
        fourier_time = fourier_time or spelling == "embedding"
        time_dim = 16 if fourier_time or spelling == "sinusoidal" else 1
        self.time = FourierTime(time_dim) if fourier_time else nn.Sequential(
            SinusoidalPosEmb(time_dim), nn.Linear(time_dim, 2 * time_dim), nn.Mish(),
            nn.Linear(2 * time_dim, time_dim)) if spelling == "sinusoidal" else nn.Identity()
        self.velocity = nn.Sequential(nn.Linear(action_dim + time_dim + obs_dim, hidden), nn.SiLU(),
                                      nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, action_dim))
        self.spelling, self.num_steps = spelling, num_steps

    def net(self, x, t, obs):
        if self.spelling == "float_arg":
            t = t * torch.ones_like(x[:, :1])
        return self.velocity(torch.cat([x, self.time(t), obs], dim=-1))

    def forward(self, obs, x):
        n, B = self.num_steps, x.shape[0]
        if self.spelling == "inplace":
            x = x.clone()  # the caller's noise, updated in place below
        ts = torch.linspace(0, 1, n + 1, device=x.device)
        if self.spelling == "tensor_loop":
            for t in ts[:-1]:
                x = x + (1.0 / n) * self.net(x, t.expand(B, 1), obs)
            return x
        for i in range(n):
            dt = 1.0 / n
            if self.spelling == "ones":
                t = torch.ones(B, 1, device=x.device) * (i / n)
            elif self.spelling == "float_arg":
                t = i / n
            elif self.spelling in ("linspace", "repeat"):
                t = ts[i].expand(B, 1) if self.spelling == "linspace" else ts[i].repeat(B, 1)
                dt = ts[i + 1] - ts[i]
            elif self.spelling == "sinusoidal":
                t = torch.full((B,), i / n, device=x.device)
            else:
                t = torch.full((B, 1), i / n, device=x.device)
            v = self.net(x, t, obs)
            if self.spelling == "inplace":
                x += dt * v
            elif self.spelling == "repeat":
                x = x + v * dt
            else:
                x = x + dt * v
        return x
