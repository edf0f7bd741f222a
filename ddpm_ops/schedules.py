"""Noise schedules: betas, and the two coefficient tables the op reads."""
import math

import torch


def linear_betas(total_timesteps: int, beta_start: float = 1e-4, beta_end: float = 0.02) -> torch.Tensor:
    """The linear schedule of Ho et al. (2020), in float64."""
    _check_total_timesteps(total_timesteps)
    return torch.linspace(beta_start, beta_end, total_timesteps, dtype=torch.float64)


def cosine_betas(total_timesteps: int, s: float = 0.008, max_beta: float = 0.999) -> torch.Tensor:
    """The cosine schedule of Nichol & Dhariwal (2021), in float64, clipped at ``max_beta``."""
    _check_total_timesteps(total_timesteps)
    steps = torch.arange(total_timesteps + 1, dtype=torch.float64) / total_timesteps
    alpha_bar = torch.cos((steps + s) / (1 + s) * math.pi / 2) ** 2
    betas = 1 - alpha_bar[1:] / alpha_bar[:-1]
    return betas.clamp(max=max_beta)


def coefficient_tables(betas: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn betas into ``(sqrt_recip_alphas, coef_eps)``, the tables of the DDPM update.

    ``sqrt_recip_alphas[t] = 1 / sqrt(1 - beta_t)`` and
    ``coef_eps[t] = beta_t / sqrt(1 - prod_{s<=t} (1 - beta_s))``, computed in
    float64 and returned in ``dtype``.
    """
    if betas.dim() != 1 or betas.numel() == 0:
        raise ValueError(f"betas: expected a non-empty 1-D tensor, got shape {tuple(betas.shape)}")
    if not bool(((betas > 0) & (betas < 1)).all()):
        raise ValueError("betas: expected every beta in the open interval (0, 1)")
    betas = betas.to(torch.float64)
    alphas = 1.0 - betas
    alphas_cumprod = torch.cumprod(alphas, 0)
    sqrt_recip_alphas = 1.0 / torch.sqrt(alphas)
    coef_eps = betas / torch.sqrt(1.0 - alphas_cumprod)
    return sqrt_recip_alphas.to(dtype), coef_eps.to(dtype)


def _check_total_timesteps(total_timesteps: int) -> None:
    if total_timesteps < 1:
        raise ValueError(f"total_timesteps: expected an integer >= 1, got {total_timesteps}")
