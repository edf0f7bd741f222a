"""Benchmark: the plain DDPM sampling loop against ddpm::fused_sample.

One process, all contenders on the same inputs:
  eager           the reference loop (an nn.Module that writes the loop out)
  graph           that loop captured in one CUDA graph, replayed
  compile         torch.compile(default), dynamic batch (one compile per table)
  compile-ro      torch.compile(mode="reduce-overhead"), dynamic batch
  compile-ma      torch.compile(mode="max-autotune"), only with --max-autotune
                  (the package's automatic rewrite is switched off for these:
                  with it, torch.compile runs the fused op; --rewrite keeps it on)
  fused           ddpm_ops.fused_sample
  fused-graph     the fused op captured in a CUDA graph, replayed
  fused-tf32/bf16 the opt-in tensor-core precisions (extra rows, not contenders)
  x+1             a trivial op: the floor of both clocks

Two clocks per contender:
  latency  one call with the GPU idle before it (sync, event, call, event,
           sync), median of many: what a caller waiting for the result sees.
  gpu      many calls back to back (or graph replays) / count: the GPU time a
           call costs in a pipeline.
Also each contender's relative error against a float64 evaluation of the loop,
and TFLOP/s for large batches against the fp32 floor of
2*((dim+1)*h + h*h + h*dim) FLOP per sample-step (generalised to any widths).

    python benchmarks/bench.py                 # H200 tables (about 5 minutes)
    python benchmarks/bench.py --device cpu    # short CPU run
    python benchmarks/bench.py --json out.json
    python benchmarks/bench.py --probe         # fused op only: cost per step and per layer
"""
import argparse
import json
import os
import statistics
import time

import torch
from torch import nn

import ddpm_ops
import machine  # this folder is on sys.path

TABLES = {
    "seed": dict(dim=64, hidden=256, depth=3, steps=16, batches=[1, 8, 64, 512, 4096, 32768]),
    "policy": dict(dim=12, hidden=1024, depth=3, steps=5, batches=[1, 8, 64, 256]),
}
CPU_BATCHES = {"seed": [1, 8, 64, 512, 4096], "policy": [1, 8, 64, 256]}
TOTAL_TIMESTEPS = 1000


class Sampler(nn.Module):
    """The plain sampling loop with configurable width and depth (Linear layers)."""

    def __init__(self, dim, hidden, depth, steps, total_timesteps=TOTAL_TIMESTEPS):
        super().__init__()
        self.K, self.T = steps, total_timesteps
        self.eps_net = ddpm_ops.silu_mlp([dim + 1] + [hidden] * (depth - 1) + [dim])
        c1, c2 = ddpm_ops.coefficient_tables(ddpm_ops.linear_betas(total_timesteps))
        self.register_buffer("sqrt_recip_alphas", c1)
        self.register_buffer("coef_eps", c2)

    def forward(self, x, t_start):
        x_cur = x
        for k in range(self.K):
            t_idx = t_start - k
            t_norm = t_idx.to(x.dtype) / self.T
            eps = self.eps_net(torch.cat([x_cur, t_norm[:, None]], dim=1))
            c1 = self.sqrt_recip_alphas[t_idx].view(-1, 1)
            c2 = self.coef_eps[t_idx].view(-1, 1)
            x_cur = c1 * (x_cur - c2 * eps)
        return x_cur


def flops_per_sample_step(model):
    return sum(2 * m.in_features * m.out_features for m in model.eps_net if isinstance(m, nn.Linear))


class Clock:
    def __init__(self, device):
        self.cuda = device == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def elapsed_us(self, body):
        """Microseconds body() takes, from an idle GPU: CUDA events around it
        (the host's dispatch and launch cost included), or the host clock."""
        self.sync()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            body()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e3
        t0 = time.perf_counter()
        body()
        return (time.perf_counter() - t0) * 1e6

    def latency_us(self, fn, reps):
        """Median over reps of one call."""
        return statistics.median(self.elapsed_us(fn) for _ in range(reps))

    def gpu_us(self, fn, reps, rounds=5):
        """Median over rounds of (reps calls back to back) / reps."""
        def calls():
            for _ in range(reps):
                fn()
        return statistics.median(self.elapsed_us(calls) / reps for _ in range(rounds))


def capture(fn, warmup=3):
    """A CUDA graph of fn() and its (static) output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def forced(env, fn):
    """fn() with the environment variables in env set (the kernel overrides)."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        return fn()
    finally:
        for key, value in saved.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value


def rel_err(out, ref):
    out = out.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


def reps_for(clock, fn, budget_s):
    """How many calls fit in budget_s (at least 3, at most 200)."""
    clock.sync()
    t0 = time.perf_counter()
    fn()
    clock.sync()
    one = max(time.perf_counter() - t0, 1e-6)
    return int(min(200, max(3, budget_s / one)))


def run_table(name, cfg, args, clock, device):
    torch.manual_seed(0)
    model = Sampler(cfg["dim"], cfg["hidden"], cfg["depth"], cfg["steps"]).to(device).eval()
    model64 = Sampler(cfg["dim"], cfg["hidden"], cfg["depth"], cfg["steps"]).to(device).double().eval()
    model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    weights, biases = ddpm_ops.mlp_parameters(model.eps_net)
    flop = flops_per_sample_step(model) * cfg["steps"]

    compiled = {} if args.only_fused else {"compile": torch.compile(model, dynamic=True)}
    if device == "cuda" and not args.only_fused:
        compiled["compile-ro"] = torch.compile(model, mode="reduce-overhead", dynamic=True)
        if args.max_autotune:
            compiled["compile-ma"] = torch.compile(model, mode="max-autotune", dynamic=True)

    batches = args.batches or (cfg["batches"] if device == "cuda" else CPU_BATCHES[name])
    rows = []
    for batch in batches:
        x = torch.randn(batch, cfg["dim"], device=device)
        t = torch.randint(cfg["steps"] - 1, TOTAL_TIMESTEPS, (batch,), device=device)
        ref = model64(x.double(), t)

        def fused(precision="fp32"):
            return ddpm_ops.fused_sample(x, t, weights, biases, model.sqrt_recip_alphas,
                                         model.coef_eps, cfg["steps"], TOTAL_TIMESTEPS,
                                         precision=precision)

        contenders = {} if args.only_fused else {"eager": lambda: model(x, t)}
        for key, cmodel in compiled.items():
            if args.only_fused or args.no_compile or (args.skip_compile_above and batch > args.skip_compile_above):
                continue
            if key == "compile-ro":  # its outputs live in a CUDA graph pool: mark each call
                contenders[key] = (lambda m: lambda: (torch.compiler.cudagraph_mark_step_begin(), m(x, t))[1])(cmodel)
            else:
                contenders[key] = (lambda m: lambda: m(x, t))(cmodel)
        contenders["fused"] = fused
        extras = {}
        if device == "cuda":
            extras = {"fused-tf32": lambda: fused("tf32"), "fused-bf16": lambda: fused("bf16")}
            if args.variants:  # each kernel and cluster size forced, to tune the rule
                # (the cluster kernel takes powers of two, the tiled kernel any size)
                variants = {f"{kernel}-c{size}": ({"DDPM_OPS_CUDA_KERNEL": kernel,
                                                   "DDPM_OPS_CUDA_CLUSTER_SIZE": str(size)}, "fp32")
                            for kernel in ("tiled16", "tiled32", "tiled64", "cluster")
                            for size in (1, 2, 4, 8, 16) + (() if kernel == "cluster" else (3, 6))}
                # the tiled kernel's weight chunks all by cp.async (by default they
                # come by TMA wherever it can address the layer)
                variants["fused-cp.async"] = ({"DDPM_OPS_CUDA_TMA": "0"}, "fp32")
                # "bf16" on the wgmma kernel, and "fp32" on the split kernel, at
                # every batch (by default both only from batch 265), where the
                # net fits them
                variants["wgmma-bf16"] = ({"DDPM_OPS_CUDA_KERNEL": "wgmma"}, "bf16")
                for size in (1, 2, 4):  # (a size that cannot hold the net is ignored)
                    variants[f"split-c{size}"] = ({"DDPM_OPS_CUDA_KERNEL": "split",
                                                   "DDPM_OPS_CUDA_CLUSTER_SIZE": str(size)}, "fp32")
                for size in (1, 2, 4):  # the narrow kernel, its tile rows by its rule
                    variants[f"narrow-c{size}"] = ({"DDPM_OPS_CUDA_KERNEL": "narrow",
                                                    "DDPM_OPS_CUDA_CLUSTER_SIZE": str(size)}, "fp32")
                for size in (16, 8, 4, 2):  # the resident kernel's sizes (H / 16, H / 32, H / 128)
                    variants[f"resident-c{size}"] = ({"DDPM_OPS_CUDA_KERNEL": "resident",
                                                      "DDPM_OPS_CUDA_CLUSTER_SIZE": str(size)}, "fp32")
                for key, (env, precision) in variants.items():
                    extras[key] = (lambda e, p: lambda: forced(e, lambda: fused(p)))(env, precision)
        trivial = lambda: x + 1  # noqa: E731

        entries = {}
        with torch.inference_mode():
            for key, fn in {**contenders, **extras, "x+1": trivial}.items():
                t0 = time.perf_counter()
                out = fn().clone()
                if key.startswith("compile"):
                    out = fn().clone()  # reduce-overhead records its graph on the second call
                clock.sync()
                warm_s = time.perf_counter() - t0
                reps = reps_for(clock, fn, args.budget)
                entry = {"latency_us": clock.latency_us(fn, min(reps, 100)),
                         "gpu_us": clock.gpu_us(fn, reps),
                         "rel_err": None if key == "x+1" else rel_err(out, ref),
                         "first_call_s": warm_s}
                entries[key] = entry
            if device == "cuda":
                graphed = {"fused-graph": fused} if args.only_fused else {"graph": contenders["eager"], "fused-graph": fused}
                for key, fn in graphed.items():
                    graph, out = capture(fn)
                    graph.replay()
                    err = rel_err(out.clone(), ref)
                    reps = reps_for(clock, graph.replay, args.budget)
                    entries[key] = {"latency_us": clock.latency_us(graph.replay, min(reps, 100)),
                                    "gpu_us": clock.gpu_us(graph.replay, reps), "rel_err": err}
                    del graph
                graph, _ = capture(trivial)
                entries["x+1"]["graph_gpu_us"] = clock.gpu_us(graph.replay, 200)
                del graph
        for key, entry in entries.items():
            entry["tflops"] = None if key == "x+1" else batch * flop / (entry["gpu_us"] * 1e-6) / 1e12
            rows.append({"table": name, "batch": batch, "contender": key, **entry})
        print_batch(name, cfg, batch, entries, flop)
    return rows


def print_batch(name, cfg, batch, entries, flop):
    others = {k: v for k, v in entries.items() if k in ("eager", "graph") or k.startswith("compile")}
    print(f"\n[{name}] dim={cfg['dim']} hidden={cfg['hidden']} depth={cfg['depth']} "
          f"steps={cfg['steps']} batch={batch}  ({batch * flop / 1e9:.3f} GFLOP per call)")
    print(f"  {'contender':<12} {'latency us':>11} {'gpu us':>10} {'rel err':>9} {'TFLOP/s':>8}")
    for key, e in entries.items():
        err = "" if e["rel_err"] is None else f"{e['rel_err']:.1e}"
        tf = f"{e['tflops']:.2f}" if batch >= 4096 and e["tflops"] is not None else ""
        print(f"  {key:<12} {e['latency_us']:>11.1f} {e['gpu_us']:>10.1f} {err:>9} {tf:>8}")
    if "graph_gpu_us" in entries["x+1"]:
        print(f"  x+1 replayed from a CUDA graph: {entries['x+1']['graph_gpu_us']:.1f} us gpu")
    if not others:
        return
    best_lat = min(others.values(), key=lambda e: e["latency_us"])
    best_gpu = min(others.values(), key=lambda e: e["gpu_us"])
    fused_gpu = min(entries[k]["gpu_us"] for k in ("fused", "fused-graph") if k in entries)
    print(f"  fused speed-up over best other: latency {best_lat['latency_us'] / entries['fused']['latency_us']:.1f}x,"
          f" gpu time {best_gpu['gpu_us'] / fused_gpu:.1f}x")


def probe(clock, args):
    """GPU time of the fused op over steps and depth (dim 64, hidden 256): the
    slopes give the cost of one step and of one layer."""
    print(f"  {'batch':>5} {'depth':>5} " + " ".join(f"{f'K={k}':>9}" for k in (1, 2, 4, 8, 16)) + "   (gpu us per call)")
    for batch in args.batches or [1, 64, 512]:
        for depth in (1, 2, 3):
            torch.manual_seed(0)
            times = []
            for steps in (1, 2, 4, 8, 16):
                model = Sampler(64, 256, depth, steps).to(args.device)
                weights, biases = ddpm_ops.mlp_parameters(model.eps_net)
                x = torch.randn(batch, 64, device=args.device)
                t = torch.randint(steps - 1, TOTAL_TIMESTEPS, (batch,), device=args.device)
                with torch.inference_mode():
                    fn = lambda: ddpm_ops.fused_sample(x, t, weights, biases, model.sqrt_recip_alphas,  # noqa: E731
                                                       model.coef_eps, steps, TOTAL_TIMESTEPS)
                    fn()
                    times.append(clock.gpu_us(fn, reps_for(clock, fn, args.budget)))
            print(f"  {batch:>5} {depth:>5} " + " ".join(f"{v:>9.1f}" for v in times))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tables", nargs="+", default=list(TABLES), choices=list(TABLES))
    parser.add_argument("--batches", type=int, nargs="+", help="override the batch sizes")
    parser.add_argument("--max-autotune", action="store_true", help="also torch.compile(mode='max-autotune')")
    parser.add_argument("--skip-compile-above", type=int, default=0,
                        help="leave torch.compile out for batches above this (0: never)")
    parser.add_argument("--only-fused", action="store_true", help="time the fused op alone")
    parser.add_argument("--no-compile", action="store_true",
                        help="leave torch.compile out (torch 2.13's inductor aborts with 'malloc(): unaligned "
                             "tcache chunk detected' compiling the seed loop with dynamic shapes on an "
                             "AVX-512 Xeon)")
    parser.add_argument("--variants", action="store_true",
                        help="also time each CUDA kernel variant forced (fp32, and the wgmma kernel in bf16)")
    parser.add_argument("--budget", type=float, default=0.15, help="seconds of calls per measurement")
    parser.add_argument("--probe", action="store_true", help="fused op only, over steps and depth")
    parser.add_argument("--json", help="write all numbers here")
    parser.add_argument("--rewrite", action="store_true",
                        help="keep ddpm_ops' torch.compile rewrite on (compile contenders then run the fused op)")
    args = parser.parse_args()
    if not args.rewrite:
        ddpm_ops.disable_auto_rewrite()
    if args.device == "cuda":
        assert torch.cuda.is_available(), "--device cuda needs a GPU (try --device cpu)"
    print(f"{machine.describe(args.device)}; {time.strftime('%Y-%m-%d')}")
    clock = Clock(args.device)
    if args.probe:
        probe(clock, args)
        return
    rows = []
    for name in args.tables:
        rows += run_table(name, TABLES[name], args, clock, args.device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
