"""Quickstart: train a tiny DDPM noise network on two moons, then sample with
the fused op and with the plain reference loop, and check that they agree.

    python examples/quickstart.py            # CPU, or CUDA when available
    python examples/quickstart.py --device cpu

Runs in a few seconds on a laptop CPU. Saves quickstart.png beside this file
when matplotlib is installed.
"""
import argparse
import math
import pathlib
import statistics
import time

import torch
from torch import nn

import ddpm_ops


def two_moons(n: int, generator: torch.Generator) -> torch.Tensor:
    """Points on two interleaved half circles with a little noise, standardised."""
    angle = torch.rand(n, generator=generator) * math.pi
    upper = torch.rand(n, generator=generator) < 0.5
    x = torch.where(upper, torch.cos(angle), 1 - torch.cos(angle))
    y = torch.where(upper, torch.sin(angle), 0.5 - torch.sin(angle))
    points = torch.stack([x, y], dim=1) + 0.05 * torch.randn(n, 2, generator=generator)
    return (points - points.mean(0)) / points.std(0)


def train(eps_net: nn.Module, data: torch.Tensor, total_timesteps: int, steps: int,
          generator: torch.Generator) -> None:
    """The DDPM noise-prediction loss (Ho et al. 2020), on the network's device."""
    device = next(eps_net.parameters()).device
    alphas_cumprod = torch.cumprod(1 - ddpm_ops.linear_betas(total_timesteps), 0).float().to(device)
    optimizer = torch.optim.Adam(eps_net.parameters(), lr=2e-3)
    for _ in range(steps):
        x0 = data[torch.randint(len(data), (512,), generator=generator)].to(device)
        t = torch.randint(total_timesteps, (512,), generator=generator).to(device)
        noise = torch.randn(x0.shape, generator=generator).to(device)
        a = alphas_cumprod[t][:, None]
        x_t = a.sqrt() * x0 + (1 - a).sqrt() * noise
        pred = eps_net(torch.cat([x_t, (t.float() / total_timesteps)[:, None]], dim=1))
        loss = (pred - noise).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def median_ms(fn, device: torch.device, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--train-steps", type=int, default=1500)
    args = parser.parse_args()
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)

    total_timesteps, dim, hidden = 50, 2, 128
    eps_net = nn.Sequential(nn.Linear(dim + 1, hidden), nn.SiLU(), nn.Linear(hidden, hidden),
                            nn.SiLU(), nn.Linear(hidden, dim)).to(device)
    start = time.perf_counter()
    train(eps_net, two_moons(20000, generator), total_timesteps, args.train_steps, generator)
    print(f"trained the noise network in {time.perf_counter() - start:.1f} s on {device}")

    sqrt_recip_alphas, coef_eps = (t.to(device) for t in ddpm_ops.coefficient_tables(
        ddpm_ops.linear_betas(total_timesteps)))
    weights, biases = ddpm_ops.mlp_parameters(eps_net)
    x_T = torch.randn(args.samples, dim, generator=generator).to(device)
    t_start = torch.full((args.samples,), total_timesteps - 1, device=device)
    sample_args = (x_T, t_start, weights, biases, sqrt_recip_alphas, coef_eps,
                   total_timesteps, total_timesteps)

    with torch.inference_mode():
        fused = ddpm_ops.fused_sample(*sample_args)
        looped = ddpm_ops.reference(*sample_args)
        rel = ((fused - looped).norm() / looped.norm()).item()
        print(f"{args.samples} samples, {total_timesteps} steps: fused op vs reference loop, "
              f"relative difference {rel:.2e}")
        if not rel < 1e-5:
            raise SystemExit("the fused op disagrees with the reference loop")
        fused_ms = median_ms(lambda: ddpm_ops.fused_sample(*sample_args), device)
        loop_ms = median_ms(lambda: ddpm_ops.reference(*sample_args), device)
    print(f"reference loop {loop_ms:8.2f} ms\nfused op       {fused_ms:8.2f} ms "
          f"({loop_ms / fused_ms:.1f}x faster)")

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no picture")
        return
    data = two_moons(args.samples, generator)
    fig, axes = plt.subplots(1, 2, figsize=(8, 4), sharex=True, sharey=True)
    for ax, points, title in ((axes[0], data, "data"), (axes[1], fused.cpu(), "fused_sample")):
        ax.scatter(points[:, 0], points[:, 1], s=1)
        ax.set_title(title)
    path = pathlib.Path(__file__).with_name("quickstart.png")
    fig.savefig(path, dpi=100)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
