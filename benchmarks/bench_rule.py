"""Benchmark: step-rule samplers as users write them against ddpm_ops.sample.

Shapes:
  dql    a Diffusion-QL policy: action dim 6, state dim 17 (concatenated into
         the input), a 16-wide sinusoidal time MLP, 3 Mish layers of 256 and
         the output layer; 5 DDPM steps with x0 clipped to [-1, 1], noise at
         every step but the last, the final clamp.
  seed   the time-column seed net (dim 64, hidden 256, 3 layers, 16 steps)
         with Mish, an x0 clip and noise: the general step's cost against the
         time-column op on the same net (its row: "time-column op").
  policy the same contenders on the policy net (dim 12, hidden 1024, 3
         layers, 5 steps).
On CUDA the seed and policy contenders are replayed from a CUDA graph each,
so that the rows are the kernels' time, not Python's. --capability 8.0 plans
every call of the op as for a GPU of that compute capability (the portable
path, measured on this GPU).

Contenders (one process, the same inputs):
  eager       the loop as the project writes it (noise drawn per step)
  graph       (CUDA) that loop captured in one CUDA graph, replayed
  compile-ro  (CUDA) torch.compile(mode="reduce-overhead") of the loop
  rewritten   (CUDA) the same with the rewrite on, as after `import ddpm_ops`:
              the loop compiled into one ddpm::fused_sample.rule (noise drawn
              by randn in the graph)
  fused       ddpm_ops.sample (the condition's bias row and the noise drawn
              in the call: what a policy pays per action)
  sampler     ddpm_ops.DiffusionSampler on the policy's own modules, called
              as a user would (its time MLP and condition columns run inside
              the op as bias networks)
  sampler-graph (CUDA) that call captured in one CUDA graph, replayed
  op-graph    (CUDA) the sampler's call alone (x given: no randn, no final
              clamp) in one CUDA graph: the op's kernel time
  (CPU) compile    torch.compile of the policy's loop, default mode, the rewrite off
  (CPU) rewritten  the same with the rewrite on (one ddpm::fused_sample.rule per call)
  (CPU) sampler-loop the sampler doing what the loop does: the first randn, the
                   call, the final clamp (the rewritten loop's direct counterpart)
  (CPU) op         torch.ops.ddpm.fused_sample.rule with the arguments the sampler
                   passes, built once: the op's own time, the floor of the others
  (CPU) onnxruntime the loop written as Diffusion-QL writes it (noise given as an
                   input), exported with torch.onnx.export and run by ONNX Runtime
                   on the CPU with as many intra-op threads as torch has (skipped
                   where onnxruntime or onnx is not installed)
On the CPU `sampler` is the bare call (x and the state made once; the noise
drawn in the op), so that it and `op` differ by the sampler's own work only.
On the CPU the contenders alternate, round after round, and each reports its
median: of wall time by default, or with --clock process of the process's CPU
time (on one thread, so that it is the call's time; a shared machine inflates
wall time far more than CPU time). On CUDA the GPU time per call is CUDA
events over back-to-back calls after warm-up, median of rounds.

    python benchmarks/bench_rule.py --device cpu
    python benchmarks/bench_rule.py --device cuda
"""
import argparse
import math
import os
import statistics
import time

import torch
from torch import nn

import ddpm_ops
import machine  # this folder is on sys.path


class SinusoidalPosEmb(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, t):
        half = self.dim // 2
        freqs = torch.exp(torch.arange(half, device=t.device) * -(math.log(10000) / (half - 1)))
        angles = t[:, None].float() * freqs[None]
        return torch.cat([angles.sin(), angles.cos()], dim=-1)


class DiffusionQLPolicy(nn.Module):
    """Diffusion-QL's MLP and its p_sample_loop, as that project writes them."""

    def __init__(self, action_dim=6, state_dim=17, t_dim=16, hidden=256, steps=5, max_action=1.0):
        super().__init__()
        self.time_mlp = nn.Sequential(SinusoidalPosEmb(t_dim), nn.Linear(t_dim, 2 * t_dim), nn.Mish(),
                                      nn.Linear(2 * t_dim, t_dim))
        self.mid = nn.Sequential(nn.Linear(action_dim + t_dim + state_dim, hidden), nn.Mish(),
                                 nn.Linear(hidden, hidden), nn.Mish(), nn.Linear(hidden, hidden), nn.Mish(),
                                 nn.Linear(hidden, action_dim))
        self.steps, self.action_dim, self.max_action = steps, action_dim, max_action
        betas = ddpm_ops.linear_betas(steps, 1e-4, 0.1)   # Diffusion-QL's vp/linear schedule at T = 5
        self.rule = ddpm_ops.step_rules.ddpm(betas, clip=max_action)
        alphas = 1 - betas
        abar = torch.cumprod(alphas, 0)
        abar_prev = torch.cat([torch.ones(1, dtype=abar.dtype), abar[:-1]])
        var = betas * (1 - abar_prev) / (1 - abar)
        for name, value in dict(
                sqrt_recip_abar=1 / abar.sqrt(), sqrt_recipm1_abar=(1 / abar - 1).sqrt(),
                coef1=betas * abar_prev.sqrt() / (1 - abar), coef2=(1 - abar_prev) * alphas.sqrt() / (1 - abar),
                log_var=var.clamp(min=1e-20).log()).items():
            self.register_buffer(name, value.float())

    def forward(self, state):
        """Eager sampling: for i in reversed(range(T)): p_sample, noise except at t = 0."""
        batch = state.shape[0]
        x = torch.randn(batch, self.action_dim, device=state.device)
        for i in reversed(range(self.steps)):
            t = torch.full((batch,), i, device=state.device, dtype=torch.long)
            eps = self.mid(torch.cat([x, self.time_mlp(t), state], dim=1))
            x0 = (self.sqrt_recip_abar[t][:, None] * x - self.sqrt_recipm1_abar[t][:, None] * eps)
            x0 = x0.clamp(-self.max_action, self.max_action)
            mean = self.coef1[t][:, None] * x0 + self.coef2[t][:, None] * x
            nonzero = (1 - (t == 0).float())[:, None]
            x = mean + nonzero * (0.5 * self.log_var[t][:, None]).exp() * torch.randn_like(x)
        return x.clamp(-self.max_action, self.max_action)

    def fused(self):
        """ddpm_ops.sample on the same network (time bias precomputed once per model)."""
        sampler = ddpm_ops.DiffusionSampler(
            self.mid, self.rule, torch.arange(self.steps), time_embedding=self.time_mlp,
            layout=(("x", self.action_dim), ("time", 16), ("cond", 17)))
        weights, biases, activations = ddpm_ops.mlp_layers(self.mid)
        w_x, w_t, w_s = weights[0].detach().split([self.action_dim, 16, 17], dim=1)
        time_bias = ddpm_ops.time_bias_from_module(self.time_mlp, w_t, torch.arange(self.steps).to(w_t.device))
        rest = [w.detach() for w in weights[1:]]
        biases = [b.detach() for b in biases]
        rule = self.rule.to(w_x.device)

        def run(state):
            x = torch.randn(state.shape[0], self.action_dim, device=state.device)
            out = ddpm_ops.sample(x, self.steps - 1, [w_x] + rest, biases, rule, self.steps,
                                  activations=activations, time_bias=time_bias, cond_bias=state @ w_s.T)
            return out.clamp(-self.max_action, self.max_action)
        return sampler, run


def time_column_contenders(batch, device, dim, hidden, steps):
    """A time-column net: the time-column op, and the general step with Mish, clip and noise."""
    total = 1000
    net = ddpm_ops.silu_mlp([dim + 1, hidden, hidden, dim]).to(device)
    weights, biases = [w.detach() for w in ddpm_ops.mlp_parameters(net)[0]], \
        [b.detach() for b in ddpm_ops.mlp_parameters(net)[1]]
    c1, c2 = (t.to(device) for t in ddpm_ops.coefficient_tables(ddpm_ops.linear_betas(total)))
    x = torch.randn(batch, dim, device=device)
    rule = ddpm_ops.step_rules.ddpm(ddpm_ops.linear_betas(total), clip=1.0).to(device)
    time_bias = (torch.arange(total, device=device)[:, None] / total) * weights[0][:, dim][None]
    w_x = weights[0][:, :dim]
    contenders = {
        "time-column op": lambda _: ddpm_ops.fused_sample(x, total - 1, weights, biases, c1, c2, steps, total),
        "rule, silu": lambda _: ddpm_ops.sample(x, total - 1, [w_x] + weights[1:], biases, rule, steps,
                                                time_bias=time_bias),
        "rule, mish+clip+noise": lambda _: ddpm_ops.sample(x, total - 1, [w_x] + weights[1:], biases, rule,
                                                           steps, activations="mish", time_bias=time_bias),
    }
    if device == "cuda":
        return {name: graphed(fn, None) for name, fn in contenders.items()}
    return {name: (lambda fn=fn: fn(None)) for name, fn in contenders.items()}


def cpu_medians_us(contenders, rounds, budget_s, clock=time.perf_counter):
    """Alternating rounds; each round times a calibrated number of calls of each."""
    reps = {}
    for name, fn in contenders.items():
        fn()
        start = clock()
        fn()
        reps[name] = max(1, int(budget_s / max(clock() - start, 1e-6)))
    times = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            start = clock()
            for _ in range(reps[name]):
                fn()
            times[name].append((clock() - start) / reps[name] * 1e6)
    return {name: statistics.median(v) for name, v in times.items()}


def cuda_gpu_us(contenders, rounds=7, calls=50):
    out = {}
    for name, fn in contenders.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        per_round = []
        for _ in range(rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            per_round.append(start.elapsed_time(end) * 1e3 / calls)
        out[name] = statistics.median(per_round)
    return out


def graphed(fn, example):
    """fn captured in one CUDA graph; returns the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(example)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(example)
    return graph.replay


class NoiseGivenLoop(nn.Module):
    """The policy's loop as Diffusion-QL writes it, its draws given as inputs (ONNX has no
    random op that torch.onnx.export maps randn_like to with torch's numbers)."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy

    def forward(self, state, x, noise):
        p = self.policy
        for k, i in enumerate(reversed(range(p.steps))):
            t = torch.full((state.shape[0],), i, device=state.device, dtype=torch.long)
            eps = p.mid(torch.cat([x, p.time_mlp(t), state], dim=1))
            x0 = (p.sqrt_recip_abar[t][:, None] * x - p.sqrt_recipm1_abar[t][:, None] * eps)
            x0 = x0.clamp(-p.max_action, p.max_action)
            mean = p.coef1[t][:, None] * x0 + p.coef2[t][:, None] * x
            nonzero = (1 - (t == 0).float())[:, None]
            x = mean + nonzero * (0.5 * p.log_var[t][:, None]).exp() * noise[k]
        return x.clamp(-p.max_action, p.max_action)


def onnxruntime_contender(policy, state):
    """The noise-given loop exported to ONNX, run by ONNX Runtime; None without onnxruntime."""
    try:
        import io
        import onnx  # noqa: F401  (torch.onnx.export needs it)
        import onnxruntime
    except ImportError:
        return None
    batch = state.shape[0]
    loop = NoiseGivenLoop(policy).eval()
    inputs = (state, torch.randn(batch, policy.action_dim), torch.randn(policy.steps, batch, policy.action_dim))
    buffer = io.BytesIO()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(loop, inputs, buffer, dynamo=False, input_names=["state", "x", "noise"])
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(buffer.getvalue(), options, providers=["CPUExecutionProvider"])
    feed = {name: t.numpy() for name, t in zip(["state", "x", "noise"], inputs)}
    out = torch.from_numpy(session.run(None, feed)[0])
    err = (out.double() - loop(*inputs).double()).norm() / loop(*inputs).double().norm()
    assert err < 1e-5, f"onnxruntime's output differs from the loop's: relative error {float(err):.1e}"
    return lambda: session.run(None, feed)


def op_arguments(sampler, x, state):
    """The arguments ``sampler(x, cond=state)`` gives the op (taken from one call)."""
    import ddpm_ops.modules as modules
    sampler(x, cond=state)  # the sampler's structure read (with the op itself)
    taken, rule = [], modules.RULE
    modules.RULE = lambda *args: taken.append(args) or rule(*args)
    try:
        sampler(x, cond=state)
    finally:
        modules.RULE = rule
    return rule, taken[0]


def dql_contenders(batch, device):
    policy = DiffusionQLPolicy().to(device).eval()
    sampler, fused = policy.fused()
    sampler = sampler.to(device)
    state = torch.randn(batch, 17, device=device)
    if device == "cpu":
        x = torch.randn(batch, policy.action_dim)
        op, args = op_arguments(sampler, x, state)
        compiled = torch.compile(policy)
        compiled(state)  # compiled while the rewrite is off
        rewritten = torch.compile(policy, options={"post_grad_custom_pre_pass": ddpm_ops.DDPMSamplingRewrite()})
        ddpm_ops.enable_auto_rewrite()
        rewritten(state)
        ddpm_ops.disable_auto_rewrite()
        def sampler_loop():  # what the policy's loop does: the first draw, the call, the clamp
            start = torch.randn(batch, policy.action_dim)
            return sampler(start, cond=state).clamp(-policy.max_action, policy.max_action)
        contenders = {"eager": lambda: policy(state), "compile": lambda: compiled(state),
                      "rewritten": lambda: rewritten(state), "sampler-loop": sampler_loop,
                      "sampler": lambda: sampler(x, cond=state), "op": lambda: op(*args)}
        ort = onnxruntime_contender(policy, state)
        if ort is not None:
            contenders["onnxruntime"] = ort
        return contenders

    def through_sampler(s):
        x = torch.randn(s.shape[0], policy.action_dim, device=s.device)
        return sampler(x, cond=s).clamp(-policy.max_action, policy.max_action)
    contenders = {"eager": lambda: policy(state), "fused": lambda: fused(state),
                  "sampler": lambda: through_sampler(state)}
    if device == "cuda":
        contenders["graph"] = graphed(policy, state)
        contenders["sampler-graph"] = graphed(through_sampler, state)
        x = torch.randn(batch, policy.action_dim, device=device)
        contenders["op-graph"] = graphed(lambda s: sampler(x, cond=s), state)
        compiled = torch.compile(policy, mode="reduce-overhead")
        contenders["compile-ro"] = lambda: compiled(state)
        # Options unlike compile-ro's, so that the two do not share Dynamo's cached code.
        ddpm_ops.enable_auto_rewrite()
        rewritten = torch.compile(policy, options={"triton.cudagraphs": True,
                                                   "post_grad_custom_pre_pass": ddpm_ops.DDPMSamplingRewrite()})
        for _ in range(3):  # compiled and captured while the rewrite is on
            rewritten(state)
        ddpm_ops.disable_auto_rewrite()
        contenders["rewritten"] = lambda: rewritten(state)
    return contenders


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--shapes", nargs="+", default=["dql", "seed", "policy"], choices=["dql", "seed", "policy"])
    parser.add_argument("--capability", help="CUDA: plan the op as for this compute capability (e.g. 8.0)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--budget", type=float, default=0.05, help="CPU: seconds of calls per contender and round")
    parser.add_argument("--clock", choices=["wall", "process"], default="wall",
                        help="CPU: wall time, or the process's CPU time on one thread")
    args = parser.parse_args()
    if args.clock == "process":
        torch.set_num_threads(1)
    clock = time.process_time if args.clock == "process" else time.perf_counter
    ddpm_ops.disable_auto_rewrite()  # the contenders are the loops as written
    if args.capability:
        os.environ["DDPM_OPS_CUDA_CAPABILITY"] = args.capability
    path = f"; the op planned as for compute capability {args.capability} (the portable path)" if args.capability \
        else ""
    print(f"{machine.describe(args.device)}; {time.strftime('%Y-%m-%d')}{path}")
    batches = {"dql": [1, 50, 256], "seed": [1, 64, 4096] + ([32768] if args.device == "cuda" else []),
               "policy": [1, 64, 256]}
    shapes = {"seed": dict(dim=64, hidden=256, steps=16), "policy": dict(dim=12, hidden=1024, steps=5)}
    with torch.inference_mode():
        for shape in args.shapes:
            unit = "GPU" if args.device == "cuda" else ("CPU-time" if args.clock == "process" else "wall")
            print(f"\n[{shape}] {unit} us per call, median")
            for batch in batches[shape]:
                contenders = dql_contenders(batch, args.device) if shape == "dql" else \
                    time_column_contenders(batch, args.device, **shapes[shape])
                times = cuda_gpu_us(contenders) if args.device == "cuda" else \
                    cpu_medians_us(contenders, args.rounds, args.budget, clock)
                cells = "  ".join(f"{name} {us:9.1f}" for name, us in times.items())
                if shape == "dql" and args.device == "cpu":
                    op = times["op"]
                    cells += (f"  | sampler/op {times['sampler'] / op:.2f}, rewritten/sampler-loop "
                              f"{times['rewritten'] / times['sampler-loop']:.2f}, compile/rewritten "
                              f"{times['compile'] / times['rewritten']:.1f}x")
                    if "onnxruntime" in times:
                        cells += f", onnxruntime/sampler {times['onnxruntime'] / times['sampler']:.1f}x"
                elif shape == "dql":
                    ours = ("fused", "rewritten", "sampler", "sampler-graph", "op-graph")
                    best = min(us for name, us in times.items() if name not in ours)
                    cells += f"  | fused {best / times['fused']:.1f}x the best other"
                    cells += f", sampler {best / times['sampler']:.1f}x"
                    if "sampler-graph" in times:
                        cells += f", sampler-graph {best / times['sampler-graph']:.1f}x"
                    if "rewritten" in times:
                        cells += f", rewritten {best / times['rewritten']:.1f}x"
                else:
                    cells += f"  | general/time-column {times['rule, mish+clip+noise'] / times['time-column op']:.2f}"
                print(f"  batch {batch:>6}: {cells}", flush=True)


if __name__ == "__main__":
    main()
