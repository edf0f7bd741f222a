"""The noise networks of IDQL, CleanDiffuser, DPPO and ReinFlow, written here in PyTorch after
each project's classes (IDQL's are Flax: jaxrl5's ``MLPResNet`` / ``MLPResNetBlock`` and ``MLP``
with ``use_layer_norm``, and its ``mish`` function; CleanDiffuser's ``IDQLMlp`` and its
``ResidualBlock``; DPPO's ``MLP`` and ``ResidualMLP`` with
``TwoLayerPreActivationResNetLinear`` and ``DiffusionMLP``; ReinFlow's ``FlowMLP``), for the
tests of the op's network programs and of ``DiffusionSampler``."""
import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

# ---- IDQL (jaxrl5). Flax's LayerNorm has eps 1e-6; its activations are functions.


def mish(x):
    """IDQL's Mish (ddpm_iql_learner.py: ``x * jnp.tanh(nn.softplus(x))``), its networks' activation."""
    return x * torch.tanh(F.softplus(x))


class FourierFeatures(nn.Module):
    """IDQL's learnable Fourier features of the raw timestep: ``cat[cos, sin](2 pi t W^T)``."""

    def __init__(self, output_size: int):
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(output_size // 2, 1) * 0.2)

    def forward(self, t):
        f = 2 * math.pi * t.reshape(-1, 1).to(self.kernel.dtype) @ self.kernel.T
        return torch.cat([torch.cos(f), torch.sin(f)], dim=-1)


class IDQLMLP(nn.Module):
    """jaxrl5's ``MLP``: an optional LayerNorm over the whole input, then Dense layers with the
    activation (and dropout) between them."""

    def __init__(self, in_dim, hidden_dims, activations=mish, activate_final=False, use_layer_norm=False,
                 dropout_rate=None):
        super().__init__()
        self.norm = nn.LayerNorm(in_dim, eps=1e-6) if use_layer_norm else None
        dims = [in_dim, *hidden_dims]
        self.denses = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.dropout = nn.Dropout(dropout_rate) if dropout_rate else None
        self.activations, self.activate_final = activations, activate_final

    def forward(self, x):
        if self.norm is not None:
            x = self.norm(x)
        for i, dense in enumerate(self.denses):
            x = dense(x)
            if i + 1 < len(self.denses) or self.activate_final:
                if self.dropout is not None:
                    x = self.dropout(x)
                x = self.activations(x)
        return x


class MLPResNetBlock(nn.Module):
    """``residual + Dense(features)(act(Dense(4 features)(LayerNorm(Dropout(x)))))``."""

    def __init__(self, features, act, dropout_rate=None, use_layer_norm=False):
        super().__init__()
        self.dropout = nn.Dropout(dropout_rate) if dropout_rate else None
        self.norm = nn.LayerNorm(features, eps=1e-6) if use_layer_norm else None
        self.dense1 = nn.Linear(features, features * 4)
        self.dense2 = nn.Linear(features * 4, features)
        self.act = act

    def forward(self, x):
        residual = x
        if self.dropout is not None:
            x = self.dropout(x)
        if self.norm is not None:
            x = self.norm(x)
        x = self.dense1(x)
        x = self.act(x)
        x = self.dense2(x)
        return residual + x


class MLPResNet(nn.Module):
    """IDQL's LN-ResNet reverse encoder: Dense(hidden), the blocks, the activation, Dense(out)."""

    def __init__(self, num_blocks, in_dim, out_dim, dropout_rate=None, use_layer_norm=False, hidden_dim=256,
                 activations=mish):
        super().__init__()
        self.dense_in = nn.Linear(in_dim, hidden_dim)
        self.blocks = nn.ModuleList(MLPResNetBlock(hidden_dim, activations, dropout_rate, use_layer_norm)
                                    for _ in range(num_blocks))
        self.dense_out = nn.Linear(hidden_dim, out_dim)
        self.activations = activations

    def forward(self, x):
        x = self.dense_in(x)
        for block in self.blocks:
            x = block(x)
        x = self.activations(x)
        return self.dense_out(x)


def idql_time_encoder(time_dim=64, hidden=128):
    """IDQL's time features: learned Fourier features, then its condition MLP (128, 128)."""
    return nn.Sequential(FourierFeatures(time_dim), IDQLMLP(time_dim, (hidden, hidden), activations=mish))


# ---- CleanDiffuser (cleandiffuser/nn_diffusion/idqlmlp.py).


class ResidualBlock(nn.Module):
    def __init__(self, hidden_dim, dropout=0.1):
        super().__init__()
        self.net = nn.Sequential(nn.Dropout(dropout), nn.LayerNorm(hidden_dim), nn.Linear(hidden_dim, hidden_dim * 4),
                                 nn.Mish(), nn.Linear(hidden_dim * 4, hidden_dim))

    def forward(self, x):
        return x + self.net(x)


class PositionalEmbedding(nn.Module):
    def __init__(self, dim, max_positions=10000):
        super().__init__()
        self.dim, self.max_positions = dim, max_positions

    def forward(self, x):
        dtype = x.dtype if x.is_floating_point() else torch.float32
        freqs = torch.arange(self.dim // 2, dtype=dtype, device=x.device) / (self.dim // 2)
        freqs = (1 / self.max_positions) ** freqs
        x = x.reshape(-1).to(dtype).outer(freqs)
        return torch.cat([x.cos(), x.sin()], dim=1)


class GaussianFourierProjection(nn.Module):
    """Score SDE's random Fourier features: a parameter that is never trained
    (``requires_grad=False``), or (``buffer``) a buffer as other projects keep them,
    ``cat[sin, cos](2 pi t W)``."""

    def __init__(self, embed_dim, scale=30.0, buffer=False):
        super().__init__()
        W = torch.randn(embed_dim // 2) * scale
        if buffer:
            self.register_buffer("W", W)
        else:
            self.W = nn.Parameter(W, requires_grad=False)

    def forward(self, x):
        x_proj = x[:, None] * self.W[None, :] * 2 * math.pi
        return torch.cat([torch.sin(x_proj), torch.cos(x_proj)], dim=-1)


class IDQLMlp(nn.Module):
    """CleanDiffuser's ``IDQLMlp``: the time MLP's output plus the condition, concatenated to x."""

    def __init__(self, x_dim, emb_dim=64, hidden_dim=256, n_blocks=3, dropout=0.1):
        super().__init__()
        self.map_noise = PositionalEmbedding(emb_dim)
        self.time_mlp = nn.Sequential(nn.Linear(emb_dim, emb_dim * 2), nn.Mish(), nn.Linear(emb_dim * 2, emb_dim))
        self.affine_in = nn.Linear(x_dim + emb_dim, hidden_dim)
        self.ln_resnet = nn.Sequential(*[ResidualBlock(hidden_dim, dropout) for _ in range(n_blocks)])
        self.affine_out = nn.Sequential(nn.Mish(), nn.Linear(hidden_dim, x_dim))

    def forward(self, x, noise, condition=None):
        emb = self.time_mlp(self.map_noise(noise))
        if condition is not None:
            emb = emb + condition
        x = torch.cat([x, emb], -1)
        return self.affine_out(self.ln_resnet(self.affine_in(x)))


# ---- DPPO (model/common/mlp.py, model/diffusion/mlp_diffusion.py).

activation_dict = nn.ModuleDict({"ReLU": nn.ReLU(), "ELU": nn.ELU(), "GELU": nn.GELU(), "Tanh": nn.Tanh(),
                                 "Mish": nn.Mish(), "Identity": nn.Identity(), "Softplus": nn.Softplus()})


class MLP(nn.Module):
    """DPPO's MLP: per layer an ``nn.Sequential`` of ``linear_1`` (``norm_1``, ``dropout_1``) ``act_1``
    in a ModuleList its forward loops over, an optional input appended at some layers."""

    def __init__(self, dim_list, append_dim=0, append_layers=None, activation_type="Tanh",
                 out_activation_type="Identity", use_layernorm=False, use_layernorm_final=False, dropout=0,
                 use_drop_final=False):
        super().__init__()
        self.moduleList = nn.ModuleList()
        self.append_layers = append_layers
        num_layer = len(dim_list) - 1
        for idx in range(num_layer):
            i_dim = dim_list[idx]
            o_dim = dim_list[idx + 1]
            if append_dim > 0 and idx in append_layers:
                i_dim += append_dim
            layers = [("linear_1", nn.Linear(i_dim, o_dim))]
            if use_layernorm and (idx < num_layer - 1 or use_layernorm_final):
                layers.append(("norm_1", nn.LayerNorm(o_dim)))
            if dropout > 0 and (idx < num_layer - 1 or use_drop_final):
                layers.append(("dropout_1", nn.Dropout(dropout)))
            act = activation_dict[activation_type] if idx != num_layer - 1 else activation_dict[out_activation_type]
            layers.append(("act_1", act))
            self.moduleList.append(nn.Sequential(OrderedDict(layers)))

    def forward(self, x, append=None):
        for layer_ind, m in enumerate(self.moduleList):
            if append is not None and layer_ind in self.append_layers:
                x = torch.cat((x, append), dim=-1)
            x = m(x)
        return x


class TwoLayerPreActivationResNetLinear(nn.Module):
    def __init__(self, hidden_dim, activation_type="Mish", use_layernorm=False):
        super().__init__()
        self.l1 = nn.Linear(hidden_dim, hidden_dim)
        self.l2 = nn.Linear(hidden_dim, hidden_dim)
        self.act = activation_dict[activation_type]
        if use_layernorm:
            self.norm1 = nn.LayerNorm(hidden_dim, eps=1e-06)
            self.norm2 = nn.LayerNorm(hidden_dim, eps=1e-06)

    def forward(self, x):
        x_input = x
        if hasattr(self, "norm1"):
            x = self.norm1(x)
        x = self.l1(self.act(x))
        if hasattr(self, "norm2"):
            x = self.norm2(x)
        x = self.l2(self.act(x))
        return x + x_input


class ResidualMLP(nn.Module):
    def __init__(self, dim_list, activation_type="Mish", out_activation_type="Identity", use_layernorm=False,
                 use_layernorm_final=False):
        super().__init__()
        hidden_dim = dim_list[1]
        num_hidden_layers = len(dim_list) - 3
        assert num_hidden_layers % 2 == 0
        self.layers = nn.ModuleList([nn.Linear(dim_list[0], hidden_dim)])
        self.layers.extend([TwoLayerPreActivationResNetLinear(hidden_dim, activation_type, use_layernorm)
                            for _ in range(1, num_hidden_layers, 2)])
        self.layers.append(nn.Linear(hidden_dim, dim_list[-1]))
        if use_layernorm_final:
            self.layers.append(nn.LayerNorm(dim_list[-1]))
        self.layers.append(activation_dict[out_activation_type])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class SinusoidalPosEmb(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        half_dim = self.dim // 2
        emb = math.log(10000) / (half_dim - 1)
        dtype = x.dtype if x.is_floating_point() else torch.float32
        emb = torch.exp(torch.arange(half_dim, device=x.device, dtype=dtype) * -emb)
        emb = x.reshape(-1, 1).to(dtype) * emb[None, :]
        return torch.cat((emb.sin(), emb.cos()), dim=-1)


class DiffusionMLP(nn.Module):
    """DPPO's noise network: ``cat[x (chunk flattened), time MLP(sinusoidal(t)), state]`` into the MLP."""

    def __init__(self, action_dim, horizon_steps, cond_dim, time_dim=16, mlp_dims=(512, 512, 512),
                 activation_type="Mish", residual_style=True, use_layernorm=False):
        super().__init__()
        output_dim = action_dim * horizon_steps
        self.time_embedding = nn.Sequential(SinusoidalPosEmb(time_dim), nn.Linear(time_dim, time_dim * 2), nn.Mish(),
                                            nn.Linear(time_dim * 2, time_dim))
        input_dim = time_dim + action_dim * horizon_steps + cond_dim
        model = ResidualMLP if residual_style else MLP
        self.mlp_mean = model([input_dim, *mlp_dims, output_dim], activation_type=activation_type,
                              use_layernorm=use_layernorm)
        self.time_dim = time_dim

    def forward(self, x, time, cond):
        B, Ta, Da = x.shape
        x = x.view(B, -1)
        time_emb = self.time_embedding(time.view(B, 1)).view(B, self.time_dim)
        out = self.mlp_mean(torch.cat([x, time_emb, cond], dim=-1))
        return out.view(B, Ta, Da)


# ---- ReinFlow (model/flow/mlp_flow.py): DPPO's networks as a velocity field.


class FlowMLP(nn.Module):
    """ReinFlow's velocity network: ``cat[action chunk (flattened), time MLP(sinusoidal(t)), obs]`` into
    DPPO's MLP (or ResidualMLP), the observation history read from ``cond["state"]``."""

    def __init__(self, horizon_steps, action_dim, cond_dim, time_dim=16, mlp_dims=(256, 256), activation_type="Mish",
                 out_activation_type="Identity", use_layernorm=False, residual_style=False):
        super().__init__()
        self.time_dim, self.act_dim_total = time_dim, action_dim * horizon_steps
        self.time_embedding = nn.Sequential(SinusoidalPosEmb(time_dim), nn.Linear(time_dim, time_dim * 2), nn.Mish(),
                                            nn.Linear(time_dim * 2, time_dim))
        model = ResidualMLP if residual_style else MLP
        input_dim = time_dim + action_dim * horizon_steps + cond_dim
        self.mlp_mean = model([input_dim, *mlp_dims, self.act_dim_total], activation_type=activation_type,
                              out_activation_type=out_activation_type, use_layernorm=use_layernorm)

    def forward(self, action, time, cond):
        B, Ta, Da = action.shape
        action = action.view(B, -1)
        state = cond["state"].view(B, -1)
        if isinstance(time, (int, float)):
            time = torch.ones((B, 1), device=action.device) * time
        time_emb = self.time_embedding(time.view(B, 1)).view(B, self.time_dim)
        feature = torch.cat([action, time_emb, state], dim=-1)
        return self.mlp_mean(feature).view(B, Ta, Da)
