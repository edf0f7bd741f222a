"""The reference semantics of ``ddpm::fused_sample`` as plain PyTorch.

This is the loop of DESIGN.md written against the op's arguments. It silently
wraps negative timesteps like any Python indexing does; the op refuses them.
"""
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def reference(
    x: torch.Tensor,
    t_start: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor],
    sqrt_recip_alphas: torch.Tensor,
    coef_eps: torch.Tensor,
    num_steps: int,
    total_timesteps: int,
) -> torch.Tensor:
    """Run ``num_steps`` DDPM posterior-mean steps with an MLP noise network.

    Computes in the dtype of ``x`` (pass float64 tensors for a reference of
    higher precision). Same arguments as :func:`ddpm_ops.fused_sample`.
    """
    x_cur = x
    for k in range(num_steps):
        t_idx = t_start - k
        t_norm = t_idx.to(x.dtype) / total_timesteps
        h = torch.cat([x_cur, t_norm[:, None]], dim=1)
        for layer, (w, b) in enumerate(zip(weights, biases)):
            h = F.linear(h, w, b)
            if layer + 1 < len(weights):
                h = F.silu(h)
        c1 = sqrt_recip_alphas[t_idx].view(-1, 1)
        c2 = coef_eps[t_idx].view(-1, 1)
        x_cur = c1 * (x_cur - c2 * h)
    return x_cur
