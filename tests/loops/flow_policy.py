"""A flow-matching (rectified-flow) policy's Euler sampler, as flow policies of offline RL and
robot learning write it: a velocity MLP of the action, the time as a float column and the
observation, integrated from noise (t = 0) to an action (t = 1) in n Euler steps."""
import math

import torch
from torch import nn


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
            t = torch.full((x.shape[0], 1), i / self.num_steps)
            x = x + dt * self.velocity(torch.cat([x, self.time(t), obs], dim=-1))
        return x.clamp(-1.0, 1.0)
