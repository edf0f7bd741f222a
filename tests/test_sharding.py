"""A batch sharded over two CPU processes (gloo, DTensor) gives the numbers of
one process: noise given as a tensor, a noise seed per row, seeds that
ddpm_ops.sample draws for a DTensor, a single seed, and inputs of other
placements, which DTensor redistributes."""
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

import ddpm_ops
from problems import make_rule_problem, relative_error
from test_sample import TOLERANCE

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

WORLD = 2

# Every rank runs this (the environment torchrun would set names the rank);
# rank 0 saves what each sharded call gathered to $RESULTS.
WORKER = textwrap.dedent("""
    import os
    import sys

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import ddpm_ops
    from test_sharding import case_problem, BATCH_ROWS

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    names = [a.name for a in torch.ops.ddpm.fused_sample.rule._schema.arguments]

    def on_mesh(name, value, natural):
        # The placement a user with a sharded batch has, or an unusual one.
        if isinstance(value, list):
            return [on_mesh(name, v, natural) for v in value]
        if not isinstance(value, torch.Tensor):
            return value
        if not natural:
            placement = Shard(1) if name == "x" else Replicate()
        elif name == "noise":
            placement = Shard(1)
        else:
            placement = Shard(0) if name in BATCH_ROWS and value.numel() > 1 else Replicate()
        return distribute_tensor(value, mesh, [placement])

    results = {}

    def keep(name, out):
        results[name] = (out.full_tensor(), [f"Shard({p.dim})" if p.is_shard() else str(p)
                                             for p in out.placements])

    for name in ("noise", "noise, other placements", "chain", "row seeds", "one seed"):
        p = case_problem(name)
        args = [on_mesh(n, v, name != "noise, other placements") for n, v in zip(names, p.args())]
        keep(name, torch.ops.ddpm.fused_sample.rule(*args))

    p = case_problem("sample")
    torch.manual_seed(100 + dist.get_rank())  # the ranks' generators differ: rank 0's draw counts
    x = distribute_tensor(p.x, mesh, [Shard(0)])
    keep("sample", ddpm_ops.sample(x, p.num_steps - 1, p.weights, p.biases, p.rule, p.num_steps,
                                   activations=p.activations, cond_bias=p.cond_bias))

    p = case_problem("time column")
    keep("time column", ddpm_ops.fused_sample(distribute_tensor(p.x, mesh, [Shard(0)]), 9, p.weights,
                                              p.biases, p.rule.C, p.rule.B, p.num_steps, 10))
    if dist.get_rank() == 0:
        torch.save(results, os.environ["RESULTS"])
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: torch 2.14's gloo at times
    # aborts a process there ("terminate called without an active
    # exception"), after every result is in.
    sys.stdout.flush()
    os._exit(0)
""")

BATCH_ROWS = ("x", "t_start", "cond_bias", "cond_input", "noise_seed")

CASES = {
    # name: (batch, features, rule)
    "noise": (6, ("time", "cond", "noise", "time_net", "cond_net", "clip"), "ddpm_epsilon"),
    "noise, other placements": (6, ("time", "cond", "noise", "cond_net"), "ddim_eta"),
    "chain": (5, ("noise", "chain", "post_clip"), "ddpm_v"),
    "row seeds": (7, ("row_seeds", "cond", "clip"), "ddpm_sample"),
    "one seed": (6, ("seeded", "time"), "ddpm_epsilon"),
    "sample": (6, ("cond",), "ddpm_epsilon"),
    "time column": (5, (), "ddim_strided"),
}


def case_problem(name):
    """The problem of case ``name``, the same in every process."""
    batch, features, rule = CASES[name]
    generator = torch.Generator().manual_seed(sorted(CASES).index(name) + 11)
    problem = make_rule_problem(batch, 5, [16, 16], 4, features=features, rule=rule, activation="mish",
                                table_length=10, generator=generator)
    if name == "sample":
        # Rows 3..5 repeat rows 0..2 (all start at one step index): only the noise tells them apart.
        problem.x[3:] = problem.x[:3]
        problem.t_start = torch.full((batch,), problem.num_steps - 1)
    if name == "time column":
        problem.weights[0] = torch.cat([problem.weights[0], torch.randn(16, 1, generator=generator)], 1)
    return problem


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """What every case's sharded call gave, gathered; the two processes started as torchrun would."""
    path = tmp_path_factory.mktemp("sharded") / "results.pt"
    tests = os.path.dirname(__file__)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(WORLD), "RESULTS": str(path), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    ranks = [subprocess.Popen([sys.executable, "-c", WORKER], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(WORLD)]
    outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), "\n".join(outputs)
    return torch.load(path)


@pytest.mark.parametrize("name", ["noise", "noise, other placements", "chain", "row seeds", "one seed"])
def test_sharded_call_equals_one_process(sharded, name):
    out, placements = sharded[name]
    problem = case_problem(name)
    single = torch.ops.ddpm.fused_sample.rule(*problem.args())
    assert out.shape == single.shape
    assert relative_error(out, single.double()) <= TOLERANCE
    assert relative_error(out, problem.reference64()) <= TOLERANCE
    # Sharded along the batch, but for one seed shared by the batch: its noise
    # follows each row's place in the whole batch, so every process runs it all.
    expected = {"chain": "Shard(1)", "one seed": "R"}.get(name, "Shard(0)")
    assert placements == [expected]


def test_sample_draws_a_seed_per_row_on_the_first_process(sharded):
    out, placements = sharded["sample"]
    problem = case_problem("sample")
    torch.manual_seed(100)
    seeds = torch.randint(0, ddpm_ops.ops.NOISE_SEED_BOUND, (problem.x.shape[0],))
    problem.noise_seed = seeds
    assert placements == ["Shard(0)"]
    assert relative_error(out, problem.reference64()) <= TOLERANCE
    # Equal rows with equal step indices on the two processes: their noise differs.
    assert (out[3:] - out[:3]).abs().amin(1).min() > 1e-3


def test_time_column_overload(sharded):
    out, placements = sharded["time column"]
    p = case_problem("time column")
    t = torch.full((p.x.shape[0],), 9)
    reference = ddpm_ops.reference(p.x.double(), t, [w.double() for w in p.weights],
                                   [b.double() for b in p.biases], p.rule.C.double(), p.rule.B.double(),
                                   p.num_steps, 10)
    assert placements == ["Shard(0)"]
    assert relative_error(out, reference) <= TOLERANCE
