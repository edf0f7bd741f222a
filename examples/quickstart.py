"""Quickstart: train a tiny DDPM noise network on two moons, then sample with
the fused op and with the plain loop, check that they agree and time both.

    python examples/quickstart.py            # CPU, or CUDA when available
    python examples/quickstart.py --device cpu

Takes under 15 seconds on a 2-core CPU. Saves quickstart.png beside
this file (the data, the plain loop's samples, the fused op's samples) when
matplotlib is installed (``pip install -e .[examples]``).
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


def time_features(t: torch.Tensor, total_timesteps: int) -> torch.Tensor:
    """A small sinusoidal embedding of the timestep: (len(t), 8)."""
    angles = (t.float() / total_timesteps)[:, None] * torch.tensor([1.0, 4.0, 16.0, 64.0], device=t.device)
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def train(eps_net: nn.Module, data: torch.Tensor, total_timesteps: int, steps: int,
          generator: torch.Generator) -> None:
    """The DDPM noise-prediction loss (Ho et al. 2020), on the network's device."""
    device = next(eps_net.parameters()).device
    alphas_cumprod = torch.cumprod(1 - ddpm_ops.cosine_betas(total_timesteps), 0).float().to(device)
    optimizer = torch.optim.Adam(eps_net.parameters(), lr=1e-2)
    # Annealing to zero settles the network in few steps.
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=steps)
    for _ in range(steps):
        x0 = data[torch.randint(len(data), (256,), generator=generator)].to(device)
        t = torch.randint(total_timesteps, (256,), generator=generator).to(device)
        noise = torch.randn(x0.shape, generator=generator).to(device)
        a = alphas_cumprod[t][:, None]
        x_t = a.sqrt() * x0 + (1 - a).sqrt() * noise
        pred = eps_net(torch.cat([x_t, time_features(t, total_timesteps)], dim=1))
        loss = (pred - noise).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()


def alternating_medians_ms(contenders: dict, device: torch.device, rounds: int) -> dict:
    """Median wall time (ms) of each contender, run in turn ``rounds`` times, so
    that a slow moment of the machine falls on all of them alike."""
    times = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(ms) for name, ms in times.items()}


def save_picture(panels: dict, path: pathlib.Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed, so no picture: pip install -e .[examples] adds it")
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4), sharex=True, sharey=True)
    for ax, (title, points) in zip(axes, panels.items()):
        ax.scatter(points[:, 0], points[:, 1], s=1)
        ax.set_title(title)
        ax.set_xlabel("x1")
        ax.set_aspect("equal")
    axes[0].set_ylabel("x2")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"saved {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--train-steps", type=int, default=2000)
    parser.add_argument("--timing-rounds", type=int, default=7)
    args = parser.parse_args()
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)

    total_timesteps, dim, hidden = 50, 2, 128
    eps_net = nn.Sequential(nn.Linear(dim + 8, hidden), nn.SiLU(), nn.Linear(hidden, hidden),
                            nn.SiLU(), nn.Linear(hidden, dim)).to(device)
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # batches of 256 x 128 train faster on one thread than on several
    train(eps_net, two_moons(20000, generator), total_timesteps, args.train_steps, generator)
    torch.set_num_threads(threads)  # sampling and timing at the machine's default
    print(f"trained the noise network in {time.perf_counter() - start:.1f} s on {device}")

    # The DDPM sampler with noise; the network reads cat([x, time_features(t)]),
    # whose time columns become the op's time bias rows.
    rule = ddpm_ops.step_rules.ddpm(ddpm_ops.cosine_betas(total_timesteps)).to(device)
    weights, biases, activations = ddpm_ops.mlp_layers(eps_net)
    w_x, (w_t,) = ddpm_ops.split_first_linear(eps_net[0], (dim, 8))
    steps = torch.arange(total_timesteps, device=device)
    time_bias = ddpm_ops.time_bias(w_t, time_features(steps, total_timesteps))
    x_T = torch.randn(args.samples, dim, generator=generator).to(device)
    noise = torch.randn(total_timesteps, args.samples, dim, generator=generator).to(device)

    def fused():
        return ddpm_ops.sample(x_T, total_timesteps - 1, [w_x] + weights[1:], biases, rule,
                               total_timesteps, activations=activations, time_bias=time_bias, noise=noise)

    def plain_loop():
        x = x_T
        for k, t in enumerate(reversed(range(total_timesteps))):
            t_emb = time_features(torch.full((args.samples,), t, device=device), total_timesteps)
            e = eps_net(torch.cat([x, t_emb], dim=1))
            x0 = rule.A[t] * x - rule.B[t] * e
            x = rule.C[t] * x0 + rule.D[t] * x + rule.S[t] * noise[k]
        return x

    with torch.inference_mode():
        fused_samples, looped = fused(), plain_loop()
        rel = ((fused_samples - looped).norm() / looped.norm()).item()
        print(f"{args.samples} samples, {total_timesteps} steps: fused op vs plain loop, "
              f"relative difference {rel:.2e}")
        if not rel < 1e-5:
            raise SystemExit("the fused op disagrees with the plain loop")
        ms = alternating_medians_ms({"plain loop": plain_loop, "fused op": fused}, device, args.timing_rounds)
    print(f"median of {args.timing_rounds} alternating runs on {device}: "
          f"plain loop {ms['plain loop']:.2f} ms, fused op {ms['fused op']:.2f} ms")
    ratio = ms["plain loop"] / ms["fused op"]
    if ratio >= 1:
        print(f"the fused op is {ratio:.1f}x faster than the plain loop")
    else:
        print(f"the fused op is {1 / ratio:.1f}x slower than the plain loop here")

    save_picture({"data (two moons)": two_moons(args.samples, generator),
                  "plain loop": looped.cpu(), "ddpm_ops.sample (fused)": fused_samples.cpu()},
                 pathlib.Path(__file__).with_name("quickstart.png"))


if __name__ == "__main__":
    main()
