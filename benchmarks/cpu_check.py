"""Quick correctness sweep of the CPU kernel of ddpm::fused_sample against a
float64 reference: random shapes (odd widths, depth 1..5, K 0..100, int32 and
int64 t, batch 1..thousands, non-contiguous inputs). Run it under every
ATEN_CPU_CAPABILITY (default, avx2, avx512) and thread count to cover every
kernel build. Usage: python benchmarks/cpu_check.py [--cases N] [--seed S]
"""
import argparse
import random

import torch

import ddpm_ops


def case(rng, dim, widths, K, batch, tdtype, noncontig):
    T = 1000
    betas = torch.linspace(1e-4, 0.02, T, dtype=torch.float64)
    alphas = 1 - betas
    sra = (1 / alphas.sqrt()).float()
    ce = (betas / (1 - alphas.cumprod(0)).sqrt()).float()
    feats = [dim + 1] + widths + [dim]
    ws, bs = [], []
    for i, o in zip(feats[:-1], feats[1:]):
        bound = 1 / i ** 0.5
        ws.append(torch.empty(o, i).uniform_(-bound, bound))
        bs.append(torch.empty(o).uniform_(-bound, bound))
    x = torch.randn(batch, dim)
    t = torch.randint(max(K - 1, 0), T, (batch,), dtype=tdtype)
    if noncontig:
        x = x.t().contiguous().t()
        ws = [w.t().contiguous().t() for w in ws]
        bs = [torch.stack([b, b], 1)[:, 0] for b in bs]
        t = torch.stack([t, t], 1)[:, 0]
    before = [a.clone() for a in [x, t, *ws, *bs]]
    got = ddpm_ops.fused_sample(x, t, ws, bs, sra, ce, K, T)
    for a, b in zip([x, t, *ws, *bs], before):
        assert torch.equal(a, b), "input mutated"
    assert got.is_contiguous() and got.shape == x.shape and got.dtype == torch.float32
    assert got.data_ptr() != x.data_ptr()
    ref = ddpm_ops.reference(x.double(), t, [w.double() for w in ws], [b.double() for b in bs],
                             sra.double(), ce.double(), K, T)
    err = ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    return err


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", type=int, default=150)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    widths_pool = [1, 2, 7, 8, 15, 16, 17, 33, 64, 65, 100, 256, 300, 1024]
    dims = [1, 2, 3, 7, 16, 33, 64, 100]
    batches = [1, 2, 3, 4, 5, 7, 8, 9, 13, 33, 64, 100, 257, 1000, 3000]
    worst = 0.0
    fixed = [(64, [256, 256], 16, 1), (64, [256, 256], 16, 8), (64, [256, 256], 16, 4096),
             (1, [1], 100, 1), (7, [1024, 1024], 3, 3), (33, [300, 7, 33, 1], 100, 13),
             (64, [], 5, 50), (2, [1024], 0, 5)]
    for n in range(args.cases + len(fixed)):
        if n < len(fixed):
            dim, widths, K, batch = fixed[n]
        else:
            depth = rng.randint(1, 5)
            widths = [rng.choice(widths_pool) for _ in range(depth - 1)]
            dim = rng.choice(dims)
            K = rng.choice([0, 1, 2, 3, 16, 50, 100])
            batch = rng.choice(batches)
            if batch * K * max([dim] + widths) ** 2 > 4e9:  # keep it quick
                batch = max(1, int(4e9 / (K * max([dim] + widths) ** 2)))
        tdtype = rng.choice([torch.int32, torch.int64])
        noncontig = rng.random() < 0.3
        err = case(rng, dim, widths, K, batch, tdtype, noncontig)
        worst = max(worst, err)
        status = "ok" if err <= 1e-5 else "FAIL"
        if status == "FAIL" or n < len(fixed):
            print(f"{status} dim={dim} widths={widths} K={K} batch={batch} t={tdtype} "
                  f"noncontig={noncontig} rel_err={err:.2e}")
        assert err <= 1e-5
    print(f"all {args.cases + len(fixed)} cases ok, worst relative error {worst:.2e} "
          f"(capability {torch.backends.cpu.get_cpu_capability()}, threads {torch.get_num_threads()})")


if __name__ == "__main__":
    main()
