"""The step-rule overload ``ddpm::fused_sample.rule`` and ``ddpm_ops.sample``:
every feature and their combinations against the float64 reference, noise,
bad input, opcheck, torch.compile, export and AOTInductor."""
import copy
import dataclasses
import itertools
import pathlib

import pytest
import torch
from torch.library import opcheck

import ddpm_ops
from problems import DEVICES, RULES, make_rule, make_rule_problem, relative_error

TOLERANCE = 1e-5
FEATURES = ("time", "cond", "clip", "post_clip", "noise", "chain")
# The bias networks the op runs once a call, kept out of FEATURES' subsets (each
# would double them) and given with every feature instead.
ALL_FEATURES = (*FEATURES, "time_net", "cond_net")
# A program saved by the first release (export of a time-column sampler) and
# its inputs and output: every later version must load it and match.
FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"


def poisoned_call(problem):
    """Calls the op right after freeing a NaN block of the output's size, so an
    output element the kernel never writes shows up as NaN."""
    size = (problem.num_steps + 1 if problem.return_chain else 1) * problem.x.numel()
    poison = torch.full((max(size, 1),), float("nan"), device=problem.x.device)
    del poison
    return torch.ops.ddpm.fused_sample.rule(*problem.args())


# Every subset of the features, each rule and activation somewhere, and the
# shapes at the kernels' vector and register-block edges.
CASES = [
    (features, RULES[i % len(RULES)], ["mixed", "mish", "relu", "gelu", "silu"][i % 5], shape)
    for i, (features, shape) in enumerate(itertools.product(
        [subset for r in range(len(FEATURES) + 1) for subset in itertools.combinations(FEATURES, r)][::3],
        [(1, 6, [32, 32], 5), (7, 17, [33], 3), (50, 6, [256, 256, 256], 5)]))
] + [
    (FEATURES, "ddpm_epsilon", "tanh", (3, 1, [], 4)),            # a single Linear
    (ALL_FEATURES, "ddpm_epsilon", "silu", (2, 5, [], 3)),
    (FEATURES, "ddim_strided", "gelu_tanh", (13, 7, [5, 65, 9], 9)),
    (ALL_FEATURES, "ddim_strided", "mish", (50, 6, [256, 256, 256], 5)),
    (FEATURES, "ddpm_v", "identity", (129, 12, [64, 64], 2)),
    (("time_net", "clip", "noise"), "ddpm_epsilon", "mish", (33, 4, [40], 5)),
    (("cond_net", "chain"), "ddim", "relu", (8, 3, [16], 4)),
    (FEATURES, "ddpm_sample", "mixed", (300, 3, [48, 48], 6)),
    # The previous x0's term (a 7-row table) and per-column clamp bounds, on
    # every tile kernel (one row, register blocks, several tiles).
    (("previous", "clip", "noise"), "ddim_strided", "mish", (1, 6, [32, 32], 5)),
    (("previous", "clip_bounds", "post_clip_bounds", "time", "cond", "noise", "chain"), "ddpm_epsilon", "silu",
     (7, 17, [33], 4)),
    (("clip_bounds", "post_clip", "seeded"), "ddpm_v", "relu", (50, 6, [256, 256, 256], 5)),
    (("previous", "post_clip_bounds", "time_net", "cond_net"), "ddim", "gelu", (129, 12, [64, 64], 3)),
    (("previous", "clip_bounds", "chain"), "ddpm_sample", "mixed", (300, 3, [48, 48], 6)),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("features, rule, activation, shape", CASES,
                         ids=[f"{'+'.join(f) or 'plain'}-{r}-{a}-{s[0]}x{s[1]}" for f, r, a, s in CASES])
def test_matches_float64_reference(device, features, rule, activation, shape):
    batch, dim, hidden, steps = shape
    problem = make_rule_problem(batch, dim, hidden, steps, features=features, activation=activation,
                                rule=rule, device=device)
    out = poisoned_call(problem)
    expected = problem.reference64()
    assert out.shape == expected.shape
    assert relative_error(out, expected) <= TOLERANCE, (features, rule, problem.activations)


@pytest.mark.parametrize("t_dtype", [torch.int32, torch.int64])
def test_clamps_bind(t_dtype):
    """The clip ranges are narrow enough to change the result: the comparison
    above would not notice a kernel that skipped them otherwise."""
    problem = make_rule_problem(20, 5, [16], 4, features=("clip", "post_clip", "noise"), t_dtype=t_dtype)
    clamped = torch.ops.ddpm.fused_sample.rule(*problem.args())
    assert relative_error(clamped, problem.reference64()) <= TOLERANCE
    problem.rule = ddpm_ops.StepRule(*[getattr(problem.rule, n) for n in "ABCDES"])
    assert relative_error(clamped, problem.reference64()) > 1e-3
    assert clamped.min() >= -1.5 and clamped.max() <= 1.2


@pytest.mark.parametrize("batch", [1, 20])
def test_per_column_bounds_bind_per_column(batch):
    """Each column is clamped to its own bounds: bounds shared by all columns
    (the first column's, or the widest) give other numbers."""
    problem = make_rule_problem(batch, 5, [16], 4, features=("noise",))
    tables = [getattr(problem.rule, n) for n in "ABCDES"]
    g = torch.Generator().manual_seed(batch)
    problem.rule = ddpm_ops.StepRule(
        *tables, clip=(-0.2 - 0.4 * torch.rand(5, generator=g), 0.2 + 0.4 * torch.rand(5, generator=g)),
        post_clip=(-0.1 - 0.4 * torch.rand(5, generator=g), 0.1 + 0.4 * torch.rand(5, generator=g)))
    clamped = torch.ops.ddpm.fused_sample.rule(*problem.args())
    assert relative_error(clamped, problem.reference64()) <= TOLERANCE
    lo, hi = problem.rule.post_clip
    assert bool((clamped >= lo).all()) and bool((clamped <= hi).all())
    if batch == 1:
        # One row of 5 columns may bind no bound that a shared one would move: the
        # checks below need rows enough to make that certain in practice.
        return
    assert bool((clamped == lo).any() or (clamped == hi).any())  # some column sits on its bound
    for clip, post_clip in (((float(problem.rule.clip[0, 0]), float(problem.rule.clip[1, 0])), problem.rule.post_clip),
                            (problem.rule.clip, (float(lo.min()), float(hi.max())))):
        problem.rule = ddpm_ops.StepRule(*tables, clip=clip, post_clip=post_clip)
        assert relative_error(clamped, problem.reference64()) > 1e-4


def test_previous_x0_term():
    """A 7-row table whose P row is 0 gives the 6-row numbers exactly; a nonzero
    P row changes them, from the call's second step on only."""
    problem = make_rule_problem(9, 5, [16], 4, features=("previous", "clip", "noise"), rule="ddim_strided")
    with_p = torch.ops.ddpm.fused_sample.rule(*problem.args())
    assert relative_error(with_p, problem.reference64()) <= TOLERANCE
    rule, tables = problem.rule, [getattr(problem.rule, n) for n in "ABCDES"]

    def run(step_rule, num_steps=4):
        problem.rule, problem.num_steps, problem.noise = step_rule, num_steps, problem.noise[:num_steps]
        return torch.ops.ddpm.fused_sample.rule(*problem.args())

    six = run(ddpm_ops.StepRule(*tables, clip=rule.clip))
    assert torch.equal(run(ddpm_ops.StepRule(*tables, torch.zeros(len(rule)), clip=rule.clip)), six)
    assert relative_error(with_p, six.double()) > 1e-3
    assert torch.equal(run(rule, 1), run(ddpm_ops.StepRule(*tables, clip=rule.clip), 1))


def test_sample_broadcasts_bounds_over_event_dims():
    """Bounds of an action chunk's last dimension apply at every horizon step."""
    batch, horizon, action = 5, 4, 3
    g = torch.Generator().manual_seed(1)
    lo, hi = -0.3 - torch.rand(action, generator=g), 0.2 + torch.rand(action, generator=g)
    tables = [getattr(make_rule("ddim_strided", 20), n) for n in "ABCDES"]
    rule = ddpm_ops.StepRule(*tables, clip=(lo, hi), post_clip=(lo * 2, hi * 2))
    weights = [torch.randn(32, 12, generator=g) * 0.3, torch.randn(12, 32, generator=g) * 0.5]
    biases = [torch.randn(32, generator=g) * 0.1, torch.randn(12, generator=g) * 0.1]
    x = torch.randn(batch, horizon, action, generator=g)
    out = ddpm_ops.sample(x, 19, weights, biases, rule, 6)
    flat_rule = ddpm_ops.StepRule(*tables, clip=(lo.repeat(horizon), hi.repeat(horizon)),
                                  post_clip=(2 * lo.repeat(horizon), 2 * hi.repeat(horizon)))
    expected = ddpm_ops.reference_sample(x.reshape(batch, -1).double(), torch.full((batch,), 19),
                                         [w.double() for w in weights], [b.double() for b in biases], flat_rule, 6)
    assert relative_error(out.reshape(batch, -1), expected) <= TOLERANCE
    assert bool((out <= 2 * hi).all()) and bool((out >= 2 * lo).all())
    assert torch.equal(ddpm_ops.sample(x, 19, weights, biases, flat_rule, 6), out)
    with pytest.raises(ValueError, match=r"^clip: expected per-column bounds of 12 values or of a shape that "
                                         r"broadcasts to x's event shape \(4, 3\), got 5 values"):
        ddpm_ops.sample(x, 19, weights, biases, ddpm_ops.StepRule(*tables, clip=(torch.zeros(5), 1.0)), 6)
    with pytest.raises(ValueError, match=r"^post_clip: expected per-column bounds of 12 values .* \(12,\), got 5"):
        ddpm_ops.sample(x.reshape(batch, -1), 19, weights, biases,
                        ddpm_ops.StepRule(*tables, post_clip=(torch.zeros(5), 1.0)), 6)


def test_first_signature_equals_its_rule_form():
    """The time-column overload is the rule overload with A = 1, B = coef_eps,
    C = sqrt_recip_alphas and the t / T column as a time bias."""
    from problems import make_problem
    p = make_problem(9, 5, [16, 16], 6, total_timesteps=60)
    rule = ddpm_ops.StepRule.from_coefficients(p.sqrt_recip_alphas, p.coef_eps)
    w0 = p.weights[0]
    time_bias = (torch.arange(60, dtype=torch.float64)[:, None] / 60) * w0[:, 5].double()[None]
    out = ddpm_ops.sample(p.x, p.t_start, [w0[:, :5]] + p.weights[1:], p.biases, rule, 6,
                          time_bias=time_bias.float())
    assert relative_error(out, p.reference64()) <= TOLERANCE
    assert relative_error(ddpm_ops.fused_sample(*p.args()), p.reference64()) <= TOLERANCE


def test_saved_first_version_program_keeps_its_numbers():
    program = torch.export.load(str(FIXTURES / "fused_sampler_v1.pt2"))
    io = torch.load(FIXTURES / "fused_sampler_v1_io.pt")
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert targets == ["ddpm.fused_sample.default"]
    out = program.module()(io["x"], io["t_start"])
    assert relative_error(out, io["out"].double()) <= 1e-6


def test_saved_second_version_program_keeps_its_numbers():
    """A program saved with the rule overload of the second release (before the
    clamps' per-column bounds): it loads under today's schema and matches."""
    program = torch.export.load(str(FIXTURES / "fused_sampler_v2.pt2"))
    io = torch.load(FIXTURES / "fused_sampler_v2_io.pt")
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert "ddpm.fused_sample.rule" in targets
    with torch.no_grad():
        out = program.module()(io["x"], io["t_start"], io["cond"], io["noise"])
    assert out.shape == io["out"].shape
    assert relative_error(out, io["out"].double()) <= 1e-6


# ---- noise


def test_generator_runs_are_reproducible_and_independent():
    problem = make_rule_problem(64, 4, [16], 5, rule="ddpm_epsilon", activation="silu")
    args = (problem.x, problem.t_start, problem.weights, problem.biases, problem.rule, 5)
    first = ddpm_ops.sample(*args, generator=torch.Generator().manual_seed(7))
    again = ddpm_ops.sample(*args, generator=torch.Generator().manual_seed(7))
    other = ddpm_ops.sample(*args, generator=torch.Generator().manual_seed(8))
    assert torch.equal(first, again)
    assert relative_error(first, other.double()) > 1e-3
    # The op drew its noise from one seed taken from the generator: the same
    # call with that seed, and (to the op's float32 accuracy) with the noise
    # the seed stands for.
    seed = torch.randint(0, ddpm_ops.ops.NOISE_SEED_BOUND, (1,), generator=torch.Generator().manual_seed(7))
    op_args = list(problem.args())
    op_args[[a.name for a in torch.ops.ddpm.fused_sample.rule._schema.arguments].index("noise_seed")] = seed
    assert torch.equal(first, torch.ops.ddpm.fused_sample.rule(*op_args))
    drawn = ddpm_ops.seeded_noise(int(seed), 5, 64, 4)
    assert relative_error(first, ddpm_ops.sample(*args, noise=drawn.float()).double()) <= TOLERANCE


def test_the_op_draws_its_seed_from_a_generator():
    """fused_sample.rule's generator argument: the seed torch.randint draws from it."""
    problem = make_rule_problem(9, 4, [16], 5, rule="ddpm_epsilon")
    names = [a.name for a in torch.ops.ddpm.fused_sample.rule._schema.arguments]
    op_args = list(problem.args())
    with_generator = torch.ops.ddpm.fused_sample.rule(*op_args, generator=torch.Generator().manual_seed(3))
    op_args[names.index("noise_seed")] = torch.randint(0, ddpm_ops.ops.NOISE_SEED_BOUND, (1,),
                                                      generator=torch.Generator().manual_seed(3))
    assert torch.equal(with_generator, torch.ops.ddpm.fused_sample.rule(*op_args))
    with pytest.raises(RuntimeError, match=r"generator: expected no noise and no noise_seed beside it"):
        torch.ops.ddpm.fused_sample.rule(*op_args, generator=torch.Generator())


@pytest.mark.parametrize("seed", [0, 1, -1, 2 ** 62 + 12345, -(2 ** 63)])
def test_seeded_noise_is_independent_standard_normal(seed):
    """The reference definition of the in-op noise: moments, and no correlation
    between steps, rows or neighbouring columns."""
    z = ddpm_ops.seeded_noise(seed, 4, 5000, 6)
    flat = z.reshape(-1)
    n = flat.numel()
    assert abs(flat.mean()) < 4 / n ** 0.5
    assert abs(flat.var() - 1) < 4 * (2 / n) ** 0.5
    assert abs((flat ** 4).mean() - 3) < 0.1
    assert abs(flat.abs().max()) < 5.5                                     # 24-bit uniforms
    for a, b in [(z[0], z[1]), (z[:, :-1], z[:, 1:]), (z[..., :-1], z[..., 1:])]:
        r = torch.corrcoef(torch.stack([a.reshape(-1), b.reshape(-1)]))[0, 1]
        assert abs(r) < 4 / a.numel() ** 0.5
    other = ddpm_ops.seeded_noise(seed + 1, 4, 5000, 6)
    assert abs(torch.corrcoef(torch.stack([flat, other.reshape(-1)]))[0, 1]) < 4 / n ** 0.5


def test_seed_per_row_draws_what_a_batch_of_one_draws():
    """A row's noise depends on its seed alone: any slice of the batch, a row
    alone with its seed as the call's one seed, give the rows' numbers."""
    problem = make_rule_problem(9, 5, [16], 4, features=("row_seeds", "cond", "chain"), rule="ddpm_sample")
    out = torch.ops.ddpm.fused_sample.rule(*problem.args())
    assert relative_error(out, problem.reference64()) <= TOLERANCE
    for rows in (slice(2, 7), slice(4, 5), slice(8, 9)):
        part = dataclasses.replace(problem, x=problem.x[rows], t_start=problem.t_start[rows],
                                   cond_bias=problem.cond_bias[rows], noise_seed=problem.noise_seed[rows])
        assert relative_error(torch.ops.ddpm.fused_sample.rule(*part.args()), out[:, rows].double()) <= TOLERANCE
    z = ddpm_ops.seeded_noise(problem.noise_seed, 4, 9, 5)
    assert torch.equal(z[:, 4:5], ddpm_ops.seeded_noise(int(problem.noise_seed[4]), 4, 1, 5))
    assert (z[:, :-1] - z[:, 1:]).abs().amin() > 0  # no two rows alike


def test_generator_noise_is_distributed_like_randn():
    """x = S z with every other table 0: the chain is the noise itself."""
    steps, batch, dim = 3, 20000, 4
    ones, zeros = torch.ones(steps), torch.zeros(steps)
    rule = ddpm_ops.StepRule(A=zeros, B=zeros, C=zeros, D=zeros, E=zeros, S=ones * 2)
    weights, biases = [torch.randn(dim, dim)], [torch.randn(dim)]
    chain = ddpm_ops.sample(torch.randn(batch, dim), steps - 1, weights, biases, rule, steps,
                            generator=torch.Generator().manual_seed(3), return_chain=True)
    z = chain[1:].reshape(steps, -1) / 2
    n = z.shape[1]
    assert (z.mean(1).abs() < 4 / n ** 0.5).all()
    assert ((z.var(1) - 1).abs() < 4 * (2 / n) ** 0.5).all()
    assert ((z ** 4).mean(1) - 3).abs().max() < 0.25                      # Gaussian kurtosis
    assert torch.corrcoef(z).sub(torch.eye(steps)).abs().max() < 4 / n ** 0.5  # steps independent


def test_rule_without_noise_draws_none():
    problem = make_rule_problem(8, 4, [16], 5, rule="ddim_strided")
    assert not problem.rule.adds_noise
    args = (problem.x, problem.t_start, problem.weights, problem.biases, problem.rule, 5)
    assert torch.equal(ddpm_ops.sample(*args, generator=torch.Generator().manual_seed(1)),
                       ddpm_ops.sample(*args, generator=torch.Generator().manual_seed(2)))


def test_sample_flattens_event_dims_and_shares_cond_and_t():
    batch, horizon, action = 6, 4, 3
    rule = make_rule("ddpm_epsilon", 30, clip=(-1.0, 1.0))
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(32, 12, generator=g) * 0.3, torch.randn(12, 32, generator=g) * 0.2]
    biases = [torch.randn(32, generator=g) * 0.1, torch.randn(12, generator=g) * 0.1]
    x, cond, noise = torch.randn(batch, horizon, action), torch.randn(32), torch.randn(5, batch, horizon, action)
    out = ddpm_ops.sample(x, 29, weights, biases, rule, 5, activations="mish", cond_bias=cond, noise=noise)
    expected = ddpm_ops.reference_sample(
        x.reshape(batch, -1).double(), torch.full((batch,), 29), [w.double() for w in weights],
        [b.double() for b in biases], rule, 5, activations="mish",
        cond_bias=cond.double().expand(batch, -1), noise=noise.reshape(5, batch, -1).double())
    assert out.shape == x.shape
    assert relative_error(out.reshape(batch, -1), expected) <= TOLERANCE


# ---- bad input


def _bad(**changes):
    problem = make_rule_problem(4, 5, [8], 3, features=("time", "cond", "noise", "time_net", "cond_net"))
    args = dict(zip(["x", "t_start", "weights", "biases", "step_tables", "num_steps", "activations",
                     "time_bias", "cond_bias", "clip", "post_clip", "noise", "return_chain", "validate",
                     "precision", "noise_seed", "time_input", "time_weights", "time_biases",
                     "time_activations", "cond_input", "cond_weights", "cond_biases", "cond_activations",
                     "clip_bounds", "post_clip_bounds"],
                    problem.args()))
    args.update(changes)
    return args


def _time_weights(*shapes):
    return [torch.randn(*s) for s in shapes]


BAD = {
    "tables rows": (dict(step_tables=torch.randn(5, 50)), r"step_tables must have shape \(6, steps\).*got shape \[5, 50\]"),
    "tables dtype": (dict(step_tables=torch.randn(6, 50, dtype=torch.float64)), r"step_tables must be float32 \(x's dtype, in which the step computes\), got Double"),
    "steps beyond tables": (dict(num_steps=51, noise=None), r"num_steps must be at most the length of the step tables \(50\), got 51"),
    "time_bias width": (dict(time_bias=torch.randn(50, 7)), r"time_bias must have shape .* = \(50, 8\), got shape \[50, 7\]"),
    "time_bias rows": (dict(time_bias=torch.randn(49, 8)), r"time_bias must have shape .* = \(50, 8\), got shape \[49, 8\]"),
    "cond_bias rows": (dict(cond_bias=torch.randn(3, 8)), r"cond_bias must have shape .* = \(4, 8\), got shape \[3, 8\]"),
    "noise shape": (dict(noise=torch.randn(2, 4, 5)), r"noise must have shape \(num_steps, batch, dim\) = \(3, 4, 5\), got shape \[2, 4, 5\]"),
    "clip order": (dict(clip=[1.0, -1.0]), r"clip must have lo <= hi, got \(1, -1\)"),
    "clip nan": (dict(post_clip=[float("nan"), 1.0]), r"post_clip must have lo <= hi"),
    "clip length": (dict(clip=[1.0]), r"clip must be a \(lo, hi\) pair, got 1 values"),
    "tables of 8 rows": (dict(step_tables=torch.randn(8, 50)), r"step_tables must have shape \(6, steps\) .*, \(7, steps\) \(and P, the previous step's x0 coefficient\) or \(9, steps\) \(and Q, R: the eps read back from x0\), got shape \[8, 50\]"),
    "clip and clip_bounds": (dict(clip=[-1.0, 1.0], clip_bounds=torch.tensor([[-1.0] * 5, [1.0] * 5])), r"clip and clip_bounds: expected at most one of them .*, got both"),
    "clip_bounds shape": (dict(clip_bounds=torch.randn(2, 4)), r"clip_bounds must have shape \(2, dim\) = \(2, 5\) \(row 0 the lower bounds, row 1 the upper\), got shape \[2, 4\]"),
    "clip_bounds rows": (dict(post_clip_bounds=torch.randn(5)), r"post_clip_bounds must have shape \(2, dim\) = \(2, 5\) .* got shape \[5\]"),
    "clip_bounds dtype": (dict(post_clip_bounds=torch.ones(2, 5, dtype=torch.float64)), r"post_clip_bounds must be float32 \(x's dtype, in which the step computes\), got Double"),
    "clip_bounds order": (dict(clip_bounds=torch.tensor([[-1.0, -1.0, 1.5, -1.0, -1.0], [1.0, 1.0, -0.5, 1.0, 1.0]])), r"clip_bounds must have lo <= hi in every column, got lo = 1.5 and hi = -0.5 in column 2"),
    "clip_bounds nan": (dict(post_clip_bounds=torch.tensor([[-1.0] * 5, [1.0] * 4 + [float("nan")]])), r"post_clip_bounds must have lo <= hi in every column, got lo = -1 and hi = nan in column 4"),
    "unknown activation": (dict(activations=["swish"]), r"activations\[0\] must be one of silu, mish, .* got \"swish\""),
    "activation count": (dict(activations=["silu", "silu"]), r"activations must name one activation per hidden layer \(1 for 2 weights\), got 2"),
    "first layer width": (dict(weights=[torch.randn(8, 6), torch.randn(5, 8)]), r"weights\[0\] must have the nn.Linear layout \(out_features, 5\) where in_features = dim \(x alone\), got shape \[8, 6\]"),
    "t_start range": (dict(t_start=torch.tensor([1, 60, 3, 4])), r"t_start out of range: .* \[2, 49\] .* got t_start in \[1, 60\]"),
    "noise and seed": (dict(noise_seed=torch.tensor([3])), r"noise and noise_seed: expected at most one of them .* got both"),
    "seed dtype": (dict(noise=None, noise_seed=torch.tensor([3.0])), r"noise_seed must be int64, got Float"),
    "seed size": (dict(noise=None, noise_seed=torch.tensor([3, 4])), r"noise_seed must be one element \(a seed for the batch\) or have shape \(batch,\) = \(4,\) \(a seed per row\), got shape \[2\]"),
    "seed rows 2-D": (dict(noise=None, noise_seed=torch.tensor([[3, 4, 5, 6]])), r"noise_seed must be one element .* got shape \[1, 4\]"),
    # The time network (6 features -> 10 -> 5 -> layer 0's 8) and the condition's (3 -> 8).
    "time_input rows": (dict(time_input=torch.randn(49, 6)), r"time_input must have shape \(steps, features\) = \(50, features\), got shape \[49, 6\]"),
    "time_input dtype": (dict(time_input=torch.randn(50, 6, dtype=torch.float64)), r"time_input must be float32, got Double"),
    "time_weights chain": (dict(time_weights=_time_weights((10, 6), (5, 9), (8, 5))), r"time_weights\[1\] must have the nn.Linear layout \(out_features, 10\), got shape \[5, 9\]"),
    "time_weights first": (dict(time_weights=_time_weights((10, 7), (5, 10), (8, 5))), r"time_weights\[0\] must have the nn.Linear layout \(out_features, 6\) where in_features = time_input's columns, got shape \[10, 7\]"),
    "time_weights last": (dict(time_weights=_time_weights((10, 6), (5, 10), (9, 5))), r"time_weights\[2\] is the last layer and must output the out_features of weights\[0\] = 8 features, got shape \[9, 5\]"),
    "time_weights empty": (dict(time_weights=[], time_biases=[], time_activations=[]), r"time_weights must hold at least one Linear weight, got an empty list"),
    "time_biases count": (dict(time_biases=[torch.randn(10)] * 3), r"time_biases must hold one bias per weight but the last \(2\), got 3"),
    "time_biases shape": (dict(time_biases=[torch.randn(10), torch.randn(4)]), r"time_biases\[1\] must have shape \(5,\) to match time_weights\[1\], got shape \[4\]"),
    "time_activations": (dict(time_activations=["mish", "swish"]), r"time_activations\[1\] must be one of silu, .* got \"swish\""),
    "time net without input": (dict(time_input=None), r"time_weights, time_biases and time_activations describe the network of time_input: expected none of them without time_input, got weights"),
    "time input without net": (dict(time_weights=None, time_biases=None, time_activations=None), r"time_input needs time_weights \(at least layer 0's columns for it\), got none"),
    "cond_input rows": (dict(cond_input=torch.randn(3, 3)), r"cond_input must have shape \(batch, features\) = \(4, features\), got shape \[3, 3\]"),
    "cond_weights last": (dict(cond_weights=[torch.randn(7, 3)]), r"cond_weights\[0\] is the last layer and must output the out_features of weights\[0\] = 8 features, got shape \[7, 3\]"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_names_argument(case):
    changes, message = BAD[case]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.ddpm.fused_sample.rule(**_bad(**changes))


@pytest.mark.parametrize("device", DEVICES)
def test_bias_nets_equal_their_rows_given_as_biases(device):
    problem = make_rule_problem(9, 4, [16], 4, features=("time_net", "cond_net", "noise", "clip"),
                                device=device)
    args = (problem.x, problem.t_start, problem.weights, problem.biases, problem.rule, 4)
    common = dict(activations=problem.activations, noise=problem.noise)
    fused = ddpm_ops.sample(*args, time_net=problem.time_net, cond_net=problem.cond_net, **common)
    with torch.no_grad():
        as_rows = ddpm_ops.sample(*args, time_bias=problem.time_net.rows(), cond_bias=problem.cond_net.rows(),
                                  **common)
        without = ddpm_ops.sample(*args, **common)
    assert relative_error(fused, problem.reference64()) <= TOLERANCE
    assert relative_error(fused, as_rows.cpu()) <= TOLERANCE
    assert relative_error(fused, without.cpu()) > 1e-3  # the nets do change the samples


def test_python_api_errors_name_the_argument():
    problem = make_rule_problem(4, 5, [8], 3)
    args = (problem.x, problem.t_start, problem.weights, problem.biases)
    with pytest.raises(TypeError, match=r"rule: expected a ddpm_ops.StepRule, got Tensor"):
        ddpm_ops.sample(*args, problem.rule.tables(), 3)
    with pytest.raises(ValueError, match=r"noise: expected shape \(3, 4, 5\)"):
        ddpm_ops.sample(*args, problem.rule, 3, noise=torch.randn(3, 4, 6))
    with pytest.raises(ValueError, match=r"activations: expected one name or 1"):
        ddpm_ops.sample(*args, problem.rule, 3, activations=["mish", "mish"])
    with pytest.raises(RuntimeError, match=r"inference-only .* time_bias requires grad"):
        ddpm_ops.sample(*args, problem.rule, 3, time_bias=torch.randn(50, 8, requires_grad=True))
    with pytest.raises(RuntimeError, match=r"inference-only .* time_weights\[0\] requires grad"):
        ddpm_ops.sample(*args, problem.rule, 3, time_net=ddpm_ops.BiasNet(
            torch.randn(50, 2), [torch.randn(8, 2, requires_grad=True)]))
    with pytest.raises(ValueError, match=r"biases: expected one per weight but the last \(1\), got 2"):
        ddpm_ops.sample(*args, problem.rule, 3, cond_net=ddpm_ops.BiasNet(
            torch.randn(4, 2), [torch.randn(3, 2), torch.randn(8, 3)], [torch.randn(3)] * 2))


# ---- torch.library, torch.compile, export


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("features", [(), FEATURES, ("time", "clip"), ("cond", "noise", "chain"),
                                      ("seeded", "clip", "chain"), ALL_FEATURES, ("time_net",),
                                      ("cond_net", "seeded"), ("row_seeds", "chain"), ("previous", "clip", "chain"),
                                      ("previous", "clip_bounds", "post_clip_bounds", "noise", "time"),
                                      ("clip_bounds", "post_clip", "seeded", "cond_net")])
def test_opcheck(device, features):
    problem = make_rule_problem(5, 6, [16, 16], 3, features=features, activation="mixed", device=device)
    opcheck(torch.ops.ddpm.fused_sample.rule, problem.args())


class RuleSampler(torch.nn.Module):
    """A policy: a fixed rule, a time-bias table and a state-conditioned MLP;
    ``multistep_bounds``: the rule has a P table and clamps x0 to per-column
    bounds."""

    def __init__(self, rule_kind="ddim_strided", steps=5, dim=4, hidden=16, multistep_bounds=False):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.Mish(),
                                       torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, dim))
        clip = (-1.0 - torch.rand(dim), 0.5 + torch.rand(dim)) if multistep_bounds else (-1.0, 1.0)
        self.rule = make_rule(rule_kind, steps, clip=clip,
                              previous=torch.rand(steps) * 0.4 - 0.2 if multistep_bounds else None)
        self.register_buffer("tables", self.rule.tables())
        self.register_buffer("clip_bounds", self.rule.clip if multistep_bounds else None)
        self.register_buffer("time_bias", torch.randn(steps, hidden) * 0.3)
        self.state_proj = torch.nn.Linear(3, hidden, bias=False)
        self.steps = steps

    def forward(self, x, state):
        weights, biases, acts = ddpm_ops.mlp_layers(self.net)
        return torch.ops.ddpm.fused_sample.rule(
            x, torch.full((x.shape[0],), self.steps - 1, device=x.device), weights, biases,
            self.tables, self.steps, acts, self.time_bias, self.state_proj(state),
            None if self.clip_bounds is not None else [-1.0, 1.0], clip_bounds=self.clip_bounds)

    def reference(self, x, state):
        weights, biases, acts = ddpm_ops.mlp_layers(self.net)
        return ddpm_ops.reference_sample(
            x.double(), torch.full((x.shape[0],), self.steps - 1), [w.double() for w in weights],
            [b.double() for b in biases], self.rule, self.steps, activations=acts,
            time_bias=self.time_bias.double(), cond_bias=self.state_proj(state).double())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("multistep_bounds", [False, True])
def test_torch_compile_fullgraph(device, multistep_bounds):
    model = RuleSampler(multistep_bounds=multistep_bounds)
    compiled = torch.compile(copy.deepcopy(model).to(device), fullgraph=True)
    with torch.no_grad():
        for batch in (3, 8):
            x, state = torch.randn(batch, 4), torch.randn(batch, 3)
            got = compiled(x.to(device), state.to(device))
            assert relative_error(got, model.reference(x, state)) <= TOLERANCE


def test_export_save_load_and_aoti(tmp_path):
    model = RuleSampler(rule_kind="ddpm_epsilon")
    x, state = torch.randn(6, 4), torch.randn(6, 3)
    batch = torch.export.Dim("batch", min=1, max=1024)
    with torch.no_grad():
        program = torch.export.export(model, (x, state), dynamic_shapes=({0: batch}, {0: batch}))
    assert "ddpm.fused_sample.rule" in [str(n.target) for n in program.graph.nodes]
    path = tmp_path / "rule.pt2"
    torch.export.save(program, str(path))
    loaded = torch.export.load(str(path))
    x2, s2 = torch.randn(9, 4), torch.randn(9, 3)
    with torch.no_grad():
        expected = model.reference(x2, s2)
        assert relative_error(loaded.module()(x2, s2), expected) <= TOLERANCE
        package = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "rule_aoti.pt2"))
        runner = torch._inductor.aoti_load_package(package)
        assert relative_error(runner(x2, s2), expected) <= TOLERANCE


def test_export_save_load_of_previous_x0_and_bounds(tmp_path):
    model = RuleSampler(rule_kind="ddpm_v", multistep_bounds=True)
    x, state = torch.randn(6, 4), torch.randn(6, 3)
    batch = torch.export.Dim("batch", min=1, max=1024)
    with torch.no_grad():
        program = torch.export.export(model, (x, state), dynamic_shapes=({0: batch}, {0: batch}))
    path = tmp_path / "rule.pt2"
    torch.export.save(program, str(path))
    loaded = torch.export.load(str(path))
    x2, s2 = torch.randn(9, 4), torch.randn(9, 3)
    with torch.no_grad():
        assert relative_error(loaded.module()(x2, s2), model.reference(x2, s2)) <= TOLERANCE


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_generator_noise_replays_in_a_cuda_graph():
    """Noise drawn from a registered generator inside a captured graph: every
    replay draws fresh noise (the generator's offset advances), and a replay
    from the same generator state repeats itself."""
    problem = make_rule_problem(32, 4, [16], 5, rule="ddpm_epsilon", device="cuda")
    args = (problem.x, problem.t_start, problem.weights, problem.biases, problem.rule, 5)
    generator = torch.Generator(device="cuda").manual_seed(11)
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(generator)
    ddpm_ops.sample(*args, generator=generator)  # warm-up outside the capture
    with torch.cuda.graph(graph):
        out = ddpm_ops.sample(*args, generator=generator)
    state = generator.get_state()
    graph.replay()
    first = out.clone()
    graph.replay()
    second = out.clone()
    generator.set_state(state)
    graph.replay()
    assert torch.isfinite(first).all() and not torch.equal(first, second)
    assert torch.equal(out, first)


@pytest.mark.parametrize("threads", [1, 2])
def test_rule_overload_follows_torch_threads(threads):
    problem = make_rule_problem(700, 16, [64, 64], 3, features=FEATURES)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = torch.ops.ddpm.fused_sample.rule(*problem.args())
    finally:
        torch.set_num_threads(before)
    assert relative_error(out, problem.reference64()) <= TOLERANCE
