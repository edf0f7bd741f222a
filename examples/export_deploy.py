"""From a trained module to a deployable package that runs the fused op.

    python examples/export_deploy.py                 # CPU, or CUDA when available
    python examples/export_deploy.py --device cpu --out /tmp/ddpm_deploy

1. train a small DDPM noise network on two moons (quickstart.py's training);
2. write the sampler the way you normally would: a plain Python loop;
3. ``torch.export.export`` it, and ``ddpm_ops.fuse_exported_program`` turns the
   exported loop into ONE ``ddpm::fused_sample`` call (same inputs and outputs);
4. ``torch.export.save`` it (load it back after ``import ddpm_ops``);
5. compile it with AOTInductor into a ``.pt2`` package, load and run it.

The package calls the op through the dispatcher, so the op library must be
loaded in the process that runs it: in Python ``import ddpm_ops``; in C++
``dlopen(ddpm_ops.LIBRARY_PATH)`` (printed at the end) before
``torch::inductor::AOTIModelPackageLoader`` loads the package; examples/cpp
is such a program (CMakeLists.txt says how to build and run it).
"""
import argparse
import pathlib
import tempfile
import time

import torch
from torch import nn
from torch.export import Dim

import ddpm_ops
from quickstart import train, two_moons  # the same tiny noise network training


class Sampler(nn.Module):
    """The user's own sampling loop: nothing ddpm_ops-specific in it."""

    def __init__(self, eps_net: nn.Module, total_timesteps: int, num_steps: int):
        super().__init__()
        self.eps_net, self.T, self.K = eps_net, total_timesteps, num_steps
        sqrt_recip_alphas, coef_eps = ddpm_ops.coefficient_tables(ddpm_ops.linear_betas(total_timesteps))
        self.register_buffer("sqrt_recip_alphas", sqrt_recip_alphas.float())
        self.register_buffer("coef_eps", coef_eps.float())

    def forward(self, x, t_start):
        for k in range(self.K):
            t = t_start - k
            eps = self.eps_net(torch.cat([x, (t.float() / self.T)[:, None]], dim=1))
            x = self.sqrt_recip_alphas[t][:, None] * (x - self.coef_eps[t][:, None] * eps)
        return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=str(pathlib.Path(tempfile.gettempdir()) / "ddpm_ops_deploy"),
                        help="where the .pt2 files go")
    parser.add_argument("--train-steps", type=int, default=300)
    args = parser.parse_args()
    device, out_dir = args.device, pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    T = 100

    # 1. a trained noise network
    eps_net = nn.Sequential(nn.Linear(3, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(),
                            nn.Linear(64, 2)).to(device)
    generator = torch.Generator().manual_seed(0)
    train(eps_net, two_moons(20000, generator), T, args.train_steps, generator)

    # 2. the sampler as users write it: all T steps, from t = T - 1 down to 0
    sampler = Sampler(eps_net, total_timesteps=T, num_steps=T).to(device).eval()
    x = torch.randn(64, 2, device=device)
    t_start = torch.full((64,), T - 1, dtype=torch.int64, device=device)

    # 3. export (batch size dynamic), then fuse the loop into one op
    batch = Dim("batch", min=1, max=65536)
    ep = torch.export.export(sampler, (x, t_start),
                             dynamic_shapes={"x": {0: batch}, "t_start": {0: batch}})
    fused = ddpm_ops.fuse_exported_program(ep)
    n_before = sum(n.op == "call_function" for n in ep.graph.nodes)
    print(f"exported loop: {n_before} ATen calls; after fuse_exported_program:")
    print(fused.graph_module.code.strip())

    with torch.no_grad():
        expected = sampler(x, t_start)
    got = fused.module()(x, t_start)
    print(f"ExportedProgram: max |fused - loop| = {(got - expected).abs().max().item():.2e}")

    # 4. save and load (loading needs `import ddpm_ops` first, done above)
    program_path = out_dir / "sampler_program.pt2"
    torch.export.save(fused, str(program_path))
    loaded = torch.export.load(str(program_path))
    got = loaded.module()(x, t_start)
    print(f"saved + loaded {program_path}: max |fused - loop| = {(got - expected).abs().max().item():.2e}")

    # 5. AOTInductor: compile to a package, load it, run it
    start = time.perf_counter()
    package = torch._inductor.aoti_compile_and_package(
        fused, package_path=str(out_dir / "sampler_aoti.pt2"))
    print(f"AOTInductor package {package} ({time.perf_counter() - start:.1f} s to compile)")
    runner = torch._inductor.aoti_load_package(package)
    for n in (1, 64, 1000):
        xn = torch.randn(n, 2, device=device)
        tn = torch.full((n,), T - 1, dtype=torch.int64, device=device)
        with torch.no_grad():
            ref = sampler(xn, tn)
        out = runner(xn, tn)
        rel = ((out - ref).norm() / ref.norm()).item()
        print(f"  batch {n:5d}: relative error vs the loop {rel:.1e}")
        assert rel < 1e-5
    print("C++ deployment: dlopen this library before loading the package:")
    print(f"  {ddpm_ops.LIBRARY_PATH}")


if __name__ == "__main__":
    main()
