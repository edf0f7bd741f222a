"""A flow-matching (rectified-flow) policy's Euler sampler, as flow policies of offline RL and
robot learning write it: a velocity MLP of the action, the time as a float column and the
observation, integrated from noise (t = 0) to an action (t = 1) in n Euler steps."""
import torch
from torch import nn


class FlowPolicy(nn.Module):
    def __init__(self, obs_dim=11, action_dim=3, hidden=256, num_steps=10):
        super().__init__()
        self.velocity = nn.Sequential(nn.Linear(action_dim + 1 + obs_dim, hidden), nn.Mish(),
                                      nn.Linear(hidden, hidden), nn.Mish(), nn.Linear(hidden, action_dim))
        self.action_dim, self.num_steps = action_dim, num_steps

    def forward(self, obs, x):
        dt = 1.0 / self.num_steps
        for i in range(self.num_steps):
            t = torch.full((x.shape[0], 1), i / self.num_steps)
            x = x + dt * self.velocity(torch.cat([x, t, obs], dim=-1))
        return x.clamp(-1.0, 1.0)
