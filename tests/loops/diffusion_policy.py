"""diffusion_policy's lowdim ``conditional_sample`` (obs as global condition) with diffusers' own
``DDIMScheduler``, its ConditionalUnet1D's conditioning on an MLP noise net.

The net handles its timestep as ConditionalUnet1D does (a Python int becomes
``torch.tensor([t])``, then ``.expand(B)``), encodes it (a sinusoidal embedding and a Mish
MLP), appends the global condition to it (``global_feature = cat([time, global_cond])``) and
reads ``cat([sample flattened, global_feature])``: a cat inside the first layer's cat. The loop
walks ``scheduler.timesteps.tolist()`` (a tensor timestep makes diffusers' step branch on it,
which Dynamo cannot trace) and takes ``scheduler.step(...).prev_sample``; the action chunk is
``(B, horizon, action_dim)``.

``channels_first``: the net takes the chunk as ConditionalUnet1D does, channels first
(``einops.rearrange(sample, 'b h t -> b t h')``: ``moveaxis(-1, -2)``), flattens that, and lays its
output back out as the chunk (``'b t h -> b h t'``): the chunk read and written transposed."""
import torch
from torch import nn

from .common import SinusoidalPosEmb


class MlpNoiseNet(nn.Module):
    def __init__(self, horizon=4, action_dim=2, global_cond_dim=10, step_embed=16, hidden=64, channels_first=False):
        super().__init__()
        self.horizon, self.action_dim, self.channels_first = horizon, action_dim, channels_first
        self.diffusion_step_encoder = nn.Sequential(SinusoidalPosEmb(step_embed), nn.Linear(step_embed, step_embed * 4),
                                                    nn.Mish(), nn.Linear(step_embed * 4, step_embed))
        self.net = nn.Sequential(nn.Linear(horizon * action_dim + step_embed + global_cond_dim, hidden), nn.Mish(),
                                 nn.Linear(hidden, hidden), nn.Mish(), nn.Linear(hidden, horizon * action_dim))

    def forward(self, sample, timestep, global_cond):
        timesteps = timestep
        if not torch.is_tensor(timesteps):
            timesteps = torch.tensor([timesteps], dtype=torch.long, device=sample.device)
        elif len(timesteps.shape) == 0:
            timesteps = timesteps[None].to(sample.device)
        timesteps = timesteps.expand(sample.shape[0])
        global_feature = torch.cat([self.diffusion_step_encoder(timesteps), global_cond], axis=-1)
        batch = sample.shape[0]
        if self.channels_first:
            sample = sample.moveaxis(-1, -2)
        out = self.net(torch.cat([sample.reshape(batch, -1), global_feature], dim=-1))
        if self.channels_first:
            return out.reshape(batch, self.action_dim, self.horizon).moveaxis(-1, -2)
        return out.reshape(batch, self.horizon, self.action_dim)


class LowdimPolicy(nn.Module):
    def __init__(self, horizon=4, action_dim=2, obs_dim=5, n_obs_steps=2, num_inference_steps=8, channels_first=False):
        super().__init__()
        from diffusers import DDIMScheduler

        self.model = MlpNoiseNet(horizon, action_dim, obs_dim * n_obs_steps, channels_first=channels_first)
        self.noise_scheduler = DDIMScheduler(num_train_timesteps=100, beta_schedule="squaredcos_cap_v2",
                                             clip_sample=True, set_alpha_to_one=True, steps_offset=0,
                                             prediction_type="epsilon")
        self.horizon, self.action_dim, self.n_obs_steps = horizon, action_dim, n_obs_steps
        self.num_inference_steps = num_inference_steps

    def forward(self, nobs, trajectory):
        """``predict_action``'s sampling: ``trajectory`` is the initial noise (B, horizon, action_dim)."""
        global_cond = nobs[:, :self.n_obs_steps, :].reshape(nobs.shape[0], -1)
        scheduler = self.noise_scheduler
        scheduler.set_timesteps(self.num_inference_steps)
        for t in scheduler.timesteps.tolist():
            model_output = self.model(trajectory, t, global_cond=global_cond)
            trajectory = scheduler.step(model_output, t, trajectory).prev_sample
        return trajectory
