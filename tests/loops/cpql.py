"""CPQL, Consistency Policy Q-Learning (cccedric/cpql, agents/karras_diffusion.py
``KarrasDenoiser.sample`` / ``sample_multistep`` / ``denoise`` / ``get_scalings_for_boundary_condition``,
agents/model.py ``MLP``, agents/helpers.py ``append_dims``), small sizes.

A consistency model's multistep sampling: ``x = denoise(x_T, sigmas[0])``, then for each ``t`` of
``ts = [0, 20, 40]`` (a float from numpy, ``np.clip``-ped) fresh noise is added *before* the network
(``x = x + randn_like(x) * np.sqrt(t**2 - sigma_min**2)``) and ``x = denoise(x, t * s_in)``; ``denoise``
reads ``c_in * x_t`` and ``1000 * 0.25 * log(sigmas + 1e-44)``, returns ``c_out * F + c_skip * x_t``
clamped to [-1, 1] (``clip_denoised``), and ``sample`` clamps again. ``sampler="onestep"``: the first
denoise alone. The noise is given as tensors: ``noise[0]`` the ``x_T`` draw, ``noise[1 + i]`` step ``i``'s."""
import numpy as np
import torch
import torch as th
import torch.nn as nn

from .common import SinusoidalPosEmb


def append_dims(x, target_dims):
    dims_to_append = target_dims - x.ndim
    if dims_to_append < 0:
        raise ValueError(f"input has {x.ndim} dims but target_dims is {target_dims}, which is less")
    return x[(...,) + (None,) * dims_to_append]


def append_zero(x):
    return torch.cat([x, x.new_zeros([1])])


class MLP(nn.Module):
    def __init__(self, state_dim, action_dim, device="cpu", t_dim=16, hidden=64):
        super(MLP, self).__init__()
        self.device = device
        self.time_mlp = nn.Sequential(SinusoidalPosEmb(t_dim), nn.Linear(t_dim, t_dim * 2), nn.Mish(),
                                      nn.Linear(t_dim * 2, t_dim))
        input_dim = state_dim + action_dim + t_dim
        self.mid_layer = nn.Sequential(nn.Linear(input_dim, hidden), nn.Mish(), nn.Linear(hidden, hidden), nn.Mish(),
                                       nn.Linear(hidden, hidden), nn.Mish())
        self.final_layer = nn.Linear(hidden, action_dim)

    def forward(self, x, time, state):
        t = self.time_mlp(time)
        if state is not None:
            x = torch.cat([x, t, state], dim=1)
        else:
            x = torch.cat([x, t], dim=1)
        x = self.mid_layer(x)
        return self.final_layer(x)


class KarrasDenoiser:
    def __init__(self, action_dim, device, sigma_data=0.5, sigma_max=80.0, sigma_min=0.002, rho=7.0, steps=40,
                 sampler="multistep", clip_denoised=True):
        self.action_dim = action_dim
        self.sigma_data = sigma_data
        self.sigma_max = sigma_max
        self.sigma_min = sigma_min
        self.rho = rho
        self.device = device
        self.sampler = sampler
        self.steps = steps
        self.ts = [0, 20, 40]
        self.sigmas = self.get_sigmas_karras(self.steps, self.sigma_min, self.sigma_max, self.rho, self.device)
        self.clip_denoised = clip_denoised

    def get_scalings_for_boundary_condition(self, sigma):
        c_skip = self.sigma_data ** 2 / ((sigma - self.sigma_min) ** 2 + self.sigma_data ** 2)
        c_out = (sigma - self.sigma_min) * self.sigma_data / (sigma ** 2 + self.sigma_data ** 2) ** 0.5
        c_in = 1 / (sigma ** 2 + self.sigma_data ** 2) ** 0.5
        return c_skip, c_out, c_in

    def get_sigmas_karras(self, n, sigma_min, sigma_max, rho=7.0, device="cpu"):
        ramp = th.linspace(0, 1, n)
        min_inv_rho = sigma_min ** (1 / rho)
        max_inv_rho = sigma_max ** (1 / rho)
        sigmas = (max_inv_rho + ramp * (min_inv_rho - max_inv_rho)) ** rho
        return append_zero(sigmas).to(device)

    def denoise(self, model, x_t, sigmas, state):
        c_skip, c_out, c_in = [append_dims(x, x_t.ndim) for x in self.get_scalings_for_boundary_condition(sigmas)]
        rescaled_t = 1000 * 0.25 * th.log(sigmas + 1e-44)
        model_output = model(c_in * x_t, rescaled_t, state)
        denoised = c_out * model_output + c_skip * x_t
        if self.clip_denoised:
            denoised = denoised.clamp(-1, 1)
        return model_output, denoised

    def sample(self, model, state, noise):
        if self.sampler == "onestep":
            x_0 = self.sample_onestep(model, state, noise)
        elif self.sampler == "multistep":
            x_0 = self.sample_multistep(model, state, noise)
        else:
            raise ValueError(f"Unknown sampler {self.sampler}")
        if self.clip_denoised:
            x_0 = x_0.clamp(-1, 1)
        return x_0

    def sample_onestep(self, model, state, noise):
        x_T = noise[0] * self.sigma_max  # th.randn((state.shape[0], self.action_dim)) * self.sigma_max
        s_in = x_T.new_ones([x_T.shape[0]])
        return self.denoise(model, x_T, self.sigmas[0] * s_in, state)[1]

    def sample_multistep(self, model, state, noise):
        x_T = noise[0] * self.sigma_max  # th.randn((state.shape[0], self.action_dim)) * self.sigma_max
        t_max_rho = self.sigma_max ** (1 / self.rho)
        t_min_rho = self.sigma_min ** (1 / self.rho)
        s_in = x_T.new_ones([x_T.shape[0]])
        x = self.denoise(model, x_T, self.sigmas[0] * s_in, state)[1]
        for i in range(len(self.ts)):
            t = (t_max_rho + self.ts[i] / (self.steps - 1) * (t_min_rho - t_max_rho)) ** self.rho
            t = np.clip(t, self.sigma_min, self.sigma_max)
            x = x + noise[1 + i] * np.sqrt(t ** 2 - self.sigma_min ** 2)  # th.randn_like(x)
            x = self.denoise(model, x, t * s_in, state)[1]
        return x


class CPQLActor(nn.Module):
    """ql_cm.py's ``sample_action``: ``self.actor.sample(self.model, state)`` (the denoiser holds no module)."""

    def __init__(self, state_dim=11, action_dim=3, sampler="multistep", clip_denoised=True):
        super().__init__()
        self.model = MLP(state_dim, action_dim)
        self.actor = KarrasDenoiser(action_dim, "cpu", sampler=sampler, clip_denoised=clip_denoised)

    def forward(self, state, noise):
        with torch.no_grad():
            return self.actor.sample(self.model, state, noise)
