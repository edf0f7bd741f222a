"""Step rules and reference_sample: validation, textbook formulas, and diffusers itself."""
import math

import diffusers
import pytest
import torch
from diffusers.schedulers import scheduling_ddim, scheduling_ddpm
from torch import nn

import ddpm_ops
from ddpm_ops.reference import ACTIVATIONS, reference, reference_sample
from ddpm_ops.step_rules import StepRule, ddim, ddpm, dpm_solver_pp, flow_euler, from_diffusers

F64 = torch.float64


def rel(actual, expected):
    return float((actual - expected).norm() / expected.norm())


def gen(seed):
    return torch.Generator().manual_seed(seed)


def random_tables(g, n, dtype=torch.float32):
    return [torch.randn(n, generator=g, dtype=dtype) for _ in range(6)]


def random_mlp(g, sizes, dtype=F64, scale=1.0):
    """Linear layers ``sizes[0] -> sizes[1] -> ...`` with nn.Linear-like init."""
    weights, biases = [], []
    for n_in, n_out in zip(sizes[:-1], sizes[1:]):
        weights.append(torch.randn(n_out, n_in, generator=g, dtype=dtype) * (scale / math.sqrt(n_in)))
        biases.append(torch.randn(n_out, generator=g, dtype=dtype) * 0.1)
    return weights, biases


def mlp(h, weights, biases, act=torch.nn.functional.silu):
    for i, (w, b) in enumerate(zip(weights, biases)):
        h = h @ w.T + b
        if i + 1 < len(weights):
            h = act(h)
    return h


# --- StepRule ---------------------------------------------------------------------------


def test_step_rule_basics():
    g = gen(0)
    tables = random_tables(g, 7, F64)
    tables[5] = torch.rand(7, generator=g, dtype=F64) + 0.5
    rule = StepRule(*tables, clip=2.0, post_clip=(-3, 4))
    assert len(rule) == 7
    assert rule.tables().shape == (6, 7) and rule.tables().dtype == torch.float32
    assert rule.tables().is_contiguous()
    for name, table, row in zip("ABCDES", tables, rule.tables()):
        stored = getattr(rule, name)
        assert stored.dtype == torch.float32 and stored.is_contiguous()
        assert rel(stored.double(), table) < 1e-7
        assert torch.equal(stored, row)
    assert rule.clip == (-2.0, 2.0) and rule.post_clip == (-3.0, 4.0)
    assert all(type(v) is float for v in rule.clip + rule.post_clip)
    assert rule.adds_noise
    moved = rule.to("cpu")
    assert moved is not rule and torch.equal(moved.tables(), rule.tables()) and moved.clip == rule.clip
    assert "len=7" in repr(rule) and "adds_noise=True" in repr(rule)
    with pytest.raises(AttributeError):
        rule.A = tables[0]

    tables[5] = torch.zeros(7)
    assert not StepRule(*tables).adds_noise


@pytest.mark.parametrize(
    "change, name, words",
    [
        (lambda t: t.__setitem__(2, t[2].half()), "C", "float16"),
        (lambda t: t.__setitem__(1, torch.arange(7)), "B", "int64"),
        (lambda t: t.__setitem__(3, t[3].view(7, 1)), "D", "(7, 1)"),
        (lambda t: t.__setitem__(0, t[0][:0]), "A", "(0,)"),
        (lambda t: t.__setitem__(4, t[4][:5]), "E", "5"),
        (lambda t: t.__setitem__(5, t[5].to("meta")), "S", "meta"),
        (lambda t: t.__setitem__(1, t[1].clone().fill_(float("nan"))), "B", "nan"),
    ],
)
def test_step_rule_table_errors(change, name, words):
    tables = random_tables(gen(1), 7)
    change(tables)
    with pytest.raises(ValueError, match=name) as info:
        StepRule(*tables)
    assert str(info.value).startswith(name + ":") and words in str(info.value)


def test_step_rule_not_a_tensor():
    tables = random_tables(gen(2), 3)
    tables[2] = [1.0, 2.0, 3.0]
    with pytest.raises(TypeError, match="^C:.*list"):
        StepRule(*tables)


@pytest.mark.parametrize(
    "value, words",
    [((2.0, 1.0), "lo <= hi"), ((0.0, float("inf")), "finite"), (float("nan"), "finite"), (True, "True"),
     ("ab", "'ab'"), ((1.0, 2.0, 3.0), "(1.0, 2.0, 3.0)"), (-1.0, "lo <= hi")],
)
@pytest.mark.parametrize("which", ["clip", "post_clip"])
def test_step_rule_range_errors(which, value, words):
    with pytest.raises(ValueError, match=f"^{which}:") as info:
        StepRule(*random_tables(gen(3), 4), **{which: value})
    assert words in str(info.value)


def test_step_rule_previous_x0_table():
    g = gen(20)
    tables = random_tables(g, 9, F64)
    previous = torch.randn(9, generator=g, dtype=F64)
    rule = StepRule(*tables, previous, clip=1.0)
    assert rule.tables().shape == (7, 9) and rule.tables().is_contiguous()
    assert torch.equal(rule.P, rule.tables()[6]) and rel(rule.P.double(), previous) < 1e-7
    moved = rule.to("cpu")
    assert torch.equal(moved.tables(), rule.tables()) and moved.P is not None
    assert "previous_x0=True" in repr(rule) and "previous_x0=False" in repr(StepRule(*tables))
    assert StepRule(*tables).P is None and StepRule(*tables).tables().shape == (6, 9)
    with pytest.raises(ValueError, match=r"^P: expected the length of A \(9\), got 8"):
        StepRule(*tables, previous[:8])
    with pytest.raises(ValueError, match=r"^P: expected finite"):
        StepRule(*tables, previous.clone().fill_(float("inf")))


def test_step_rule_per_column_bounds():
    g = gen(21)
    tables = random_tables(g, 5)
    lo, hi = -1 - torch.rand(4, generator=g, dtype=F64), 1 + torch.rand(4, generator=g, dtype=F64)
    rule = StepRule(*tables, clip=(lo, hi), post_clip=(-2.0, hi.float()))
    assert rule.clip.shape == (2, 4) and rule.clip.dtype == torch.float32 and rule.clip.is_contiguous()
    assert rel(rule.clip.double(), torch.stack([lo, hi])) < 1e-7
    assert torch.equal(rule.post_clip[0], torch.full((4,), -2.0)) and torch.equal(rule.post_clip[1], hi.float())
    low, high = rule.clip  # unpacks like a pair of floats
    assert torch.equal(low, rule.clip[0]) and torch.equal(high, rule.clip[1])
    assert torch.equal(rule.to("cpu").clip, rule.clip)
    assert "per-column bounds of 4 columns" in repr(rule)
    # A 0-d tensor is a number.
    assert StepRule(*tables, clip=(torch.tensor(-1.5), 2)).clip == (-1.5, 2.0)


@pytest.mark.parametrize(
    "value, words",
    [((torch.zeros(3), torch.ones(4)), "lo and hi of one length, got 3 and 4"),
     ((torch.tensor([0.0, 2.0]), torch.tensor([1.0, 1.0])), "lo = 2.0 > hi = 1.0 in column 1"),
     ((torch.tensor([0.0, float("nan")]), 1.0), "finite"),
     ((torch.zeros(2, 3), 1.0), "(2, 3)"),
     ((torch.zeros(0), 1.0), "(0,)"),
     ((-1.0, torch.tensor([True, False])), "torch.bool"),
     ((-1.0, "x"), "(-1.0, 'x')")],
)
@pytest.mark.parametrize("which", ["clip", "post_clip"])
def test_step_rule_per_column_bound_errors(which, value, words):
    with pytest.raises(ValueError, match=f"^{which}:") as info:
        StepRule(*random_tables(gen(22), 4), **{which: value})
    assert words in str(info.value)


def test_reference_sample_previous_x0_and_per_column_bounds():
    """Two steps by hand: the P term is absent at the first step and uses the
    first step's clamped x0 at the second; bounds apply per column."""
    g = gen(23)
    T, dim, batch, H = 12, 3, 5, 8
    tables = [t * 0.5 for t in random_tables(g, T, F64)]
    previous = torch.randn(T, generator=g, dtype=F64)
    lo = torch.tensor([-0.2, -1.0, -0.5], dtype=F64)
    hi = torch.tensor([0.3, 0.4, 2.0], dtype=F64)
    post = (-torch.tensor([1.0, 0.6, 0.8], dtype=F64), 0.7)
    rule = StepRule(*tables, previous, clip=(lo, hi), post_clip=post)
    weights, biases = random_mlp(g, [dim, H, dim])
    x = torch.randn(batch, dim, generator=g, dtype=F64) * 2
    z = torch.randn(2, batch, dim, generator=g, dtype=F64)
    t_start = torch.randint(1, T, (batch,), generator=g)
    chain = reference_sample(x, t_start, weights, biases, rule, 2, noise=z, return_chain=True)

    # A float64 sample's tables and bounds: as the rule was given them, in float64.
    (lo64, hi64), (post_lo64, post_hi64) = rule.clamps(F64)
    assert torch.equal(post_hi64, torch.full((dim,), 0.7, dtype=F64))
    expected, x0_prev = x, None
    for k in range(2):
        A, B, C, D, E, S, P = (t[t_start - k][:, None] for t in rule.tables(F64))
        e = mlp(expected, weights, biases)
        x0 = torch.maximum(torch.minimum(A * expected - B * e, hi64), lo64)
        step = C * x0 + D * expected + E * e + S * z[k] + (0 if x0_prev is None else P * x0_prev)
        expected = torch.maximum(torch.minimum(step, post_hi64), post_lo64)
        x0_prev = x0
        assert rel(chain[k + 1], expected) < 1e-12
        assert bool((chain[k + 1] >= post_lo64).all()) and bool((chain[k + 1] <= post_hi64).all())
    without_p = reference_sample(x, t_start, weights, biases, StepRule(*tables, clip=(lo, hi), post_clip=post), 2,
                                 noise=z)
    assert rel(without_p, chain[-1]) > 1e-3
    assert torch.equal(reference_sample(x, t_start, weights, biases, StepRule(*tables, previous, clip=(lo, hi),
                                                                              post_clip=post), 1, noise=z[:1]),
                       reference_sample(x, t_start, weights, biases, StepRule(*tables, clip=(lo, hi), post_clip=post),
                                        1, noise=z[:1]))


def test_from_coefficients_matches_reference():
    g = gen(4)
    T, dim, batch, K = 60, 5, 9, 40
    sra32, ce32 = ddpm_ops.coefficient_tables(ddpm_ops.linear_betas(T))
    rule = StepRule.from_coefficients(sra32, ce32)
    assert not rule.adds_noise and rule.clip is None
    weights, biases = random_mlp(g, [dim + 1, 32, 32, dim])
    x = torch.randn(batch, dim, generator=g, dtype=F64)
    t_start = torch.randint(K - 1, T, (batch,), generator=g)
    expected = reference(x, t_start, weights, biases, sra32.double(), ce32.double(), K, T)

    w0 = weights[0]
    time_bias = (torch.arange(T, dtype=F64) / T)[:, None] * w0[:, dim]
    actual = reference_sample(x, t_start, [w0[:, :dim]] + weights[1:], biases, rule, K, time_bias=time_bias)
    assert actual.dtype == F64
    assert rel(actual, expected) < 1e-10


def test_from_coefficients_errors():
    sra, ce = ddpm_ops.coefficient_tables(ddpm_ops.linear_betas(10))
    with pytest.raises(ValueError, match="^sqrt_recip_alphas:"):
        StepRule.from_coefficients(sra[:5], ce)
    with pytest.raises(ValueError, match="^coef_eps:.*int64"):
        StepRule.from_coefficients(sra, torch.arange(10))


# --- ddpm() and ddim() against the papers' formulas -------------------------------------


def textbook_ddpm(betas, t, prediction, variance):
    """Ho et al. (2020): x0 from the prediction, the posterior mean (7) and its variance."""
    abar = math.prod(1 - b for b in betas[: t + 1])
    abar_prev = abar / (1 - betas[t])
    beta = betas[t]
    a, b = {
        "epsilon": (1 / math.sqrt(abar), math.sqrt(1 - abar) / math.sqrt(abar)),
        "sample": (0.0, -1.0),
        "v_prediction": (math.sqrt(abar), math.sqrt(1 - abar)),
    }[prediction]
    c = math.sqrt(abar_prev) * beta / (1 - abar)
    d = math.sqrt(1 - beta) * (1 - abar_prev) / (1 - abar)
    var = beta * (1 - abar_prev) / (1 - abar) if variance == "fixed_small" else beta
    s = math.sqrt(max(var, 1e-20)) if t > 0 else 0.0
    return a, b, c, d, 0.0, s


@pytest.mark.parametrize("prediction", ["epsilon", "sample", "v_prediction"])
@pytest.mark.parametrize("variance", ["fixed_small", "fixed_large"])
def test_ddpm_tables_textbook(prediction, variance):
    T = 200
    betas = ddpm_ops.cosine_betas(T)
    rule = ddpm(betas, prediction=prediction, variance=variance, clip=1.5)
    assert len(rule) == T and rule.clip == (-1.5, 1.5) and rule.adds_noise
    expected = torch.tensor([textbook_ddpm(betas.tolist(), t, prediction, variance) for t in range(T)], dtype=F64).T
    for name, got, want in zip("ABCDES", rule.tables().double(), expected):
        if bool((want == 0).all()):  # E everywhere, A for "sample"
            assert bool((got == 0).all()), name
        else:
            assert rel(got, want) < 1e-6, name
    assert rule.S[0] == 0
    assert not ddpm(betas, prediction=prediction, variance=variance, noise=False).adds_noise


def test_ddpm_epsilon_loop_is_ho_algorithm_2():
    """x_{t-1} = (x_t - beta_t / sqrt(1 - abar_t) eps) / sqrt(alpha_t) + sigma_t z, Ho et al. Alg. 2."""
    g = gen(5)
    T, dim, batch = 300, 4, 16
    betas = ddpm_ops.linear_betas(T)
    abar = torch.cumprod(1 - betas, 0)
    weights, biases = random_mlp(g, [dim, 64, 64, dim])
    x = torch.randn(batch, dim, generator=g, dtype=F64)
    z = torch.randn(T, batch, dim, generator=g, dtype=F64)

    expected = x
    for k, t in enumerate(range(T - 1, -1, -1)):
        eps = mlp(expected, weights, biases)
        sigma = math.sqrt(betas[t] * (1 - abar[t - 1]) / (1 - abar[t])) if t > 0 else 0.0
        expected = (expected - betas[t] / torch.sqrt(1 - abar[t]) * eps) / torch.sqrt(1 - betas[t]) + sigma * z[k]

    t_start = torch.full((batch,), T - 1)
    actual = reference_sample(x, t_start, weights, biases, ddpm(betas), T, noise=z)
    assert rel(actual, expected) < 1e-5


def textbook_ddim_step(x, e, abar, abar_prev, eta, prediction, clip, z):
    """Song et al. (2021) eq. (12) with sigma of eq. (16); eps implied by the prediction."""
    if prediction == "epsilon":
        eps = e
        x0 = (x - math.sqrt(1 - abar) * eps) / math.sqrt(abar)
    elif prediction == "sample":
        x0 = e
        eps = (x - math.sqrt(abar) * x0) / math.sqrt(1 - abar)
    else:
        x0 = math.sqrt(abar) * x - math.sqrt(1 - abar) * e
        eps = math.sqrt(abar) * e + math.sqrt(1 - abar) * x
    if clip is not None:
        x0 = x0.clamp(-clip, clip)
    sigma = eta * math.sqrt((1 - abar_prev) / (1 - abar) * (1 - abar / abar_prev))
    return math.sqrt(abar_prev) * x0 + math.sqrt(1 - abar_prev - sigma**2) * eps + sigma * z


@pytest.mark.parametrize(
    "prediction, eta, clip",
    [("epsilon", 0.0, None), ("epsilon", 1.0, 1.0), ("sample", 0.5, 2.0), ("v_prediction", 0.5, None),
     ("v_prediction", 1.0, 0.5)],
)
def test_ddim_loop_textbook(prediction, eta, clip):
    g = gen(6)
    T, dim, batch = 500, 3, 12
    abar = torch.cumprod(1 - ddpm_ops.linear_betas(T), 0)
    timesteps = torch.tensor([0, 7, 30, 61, 100, 180, 260, 333, 410, 499])
    rule = ddim(abar, timesteps.tolist(), eta=eta, prediction=prediction, clip=clip)
    assert len(rule) == len(timesteps) and rule.adds_noise == (eta > 0)
    K = len(timesteps)
    weights, biases = random_mlp(g, [dim, 32, dim])
    x = torch.randn(batch, dim, generator=g, dtype=F64)
    z = torch.randn(K, batch, dim, generator=g, dtype=F64)

    expected = x
    for k, s in enumerate(range(K - 1, -1, -1)):
        e = mlp(expected, weights, biases)
        a_prev = float(abar[timesteps[s - 1]]) if s > 0 else 1.0
        expected = textbook_ddim_step(expected, e, float(abar[timesteps[s]]), a_prev, eta, prediction, clip, z[k])

    actual = reference_sample(x, torch.full((batch,), K - 1), weights, biases, rule, K, noise=z)
    assert rel(actual, expected) < 1e-5


def test_flow_euler_loop_textbook():
    """x <- x + (sigma_next - sigma) v from sigma = 1 down to 0, and with a clamp
    of x0 = x - sigma v, the step to x0 + sigma_next (x - x0) / sigma."""
    g = gen(24)
    dim, batch, S = 4, 9, 7
    sigmas = torch.cat([torch.zeros(1, dtype=F64), torch.rand(S - 1, generator=g, dtype=F64).sort().values,
                        torch.ones(1, dtype=F64)])
    weights, biases = random_mlp(g, [dim, 32, dim], scale=2.0)
    x = torch.randn(batch, dim, generator=g, dtype=F64)
    t_start = torch.full((batch,), S - 1)
    rule = flow_euler(sigmas)
    assert len(rule) == S and not rule.adds_noise and rule.P is None and rule.clip is None
    expected = x
    for s in range(S - 1, -1, -1):
        expected = expected + (sigmas[s] - sigmas[s + 1]) * mlp(expected, weights, biases)
    assert rel(reference_sample(x, t_start, weights, biases, rule, S), expected) < 1e-6

    clipped = flow_euler(sigmas.tolist(), clip=0.5)
    assert clipped.clip == (-0.5, 0.5) and rel(clipped.tables().double(), rule.tables().double()) == 0
    expected = x
    for s in range(S - 1, -1, -1):
        x0 = (expected - sigmas[s + 1] * mlp(expected, weights, biases)).clamp(-0.5, 0.5)
        expected = x0 + sigmas[s] * (expected - x0) / sigmas[s + 1]
    actual = reference_sample(x, t_start, weights, biases, clipped, S)
    assert rel(actual, expected) < 1e-6
    assert actual.abs().max() <= 0.5 + 1e-6  # the last step lands on the clamped x0


def textbook_dpm_solver_pp(x, net, abar, abar_final, order, prediction, first_order_last):
    """Lu et al. (2022), DPM-Solver++(2M), Algorithm 2, over abar[K - 1] > ... > abar[0] > abar_final."""
    points = [float(a) for a in abar.flip(0)] + [abar_final]
    alpha = [math.sqrt(a) for a in points]
    sigma = [math.sqrt(1 - a) for a in points]
    lam = [math.log(al / si) if si > 0 else math.inf for al, si in zip(alpha, sigma)]
    x0_prev = None
    for i in range(len(points) - 1):
        e = net(x)
        x0 = {"epsilon": (x - sigma[i] * e) / alpha[i], "sample": e,
              "v_prediction": alpha[i] * x - sigma[i] * e}[prediction]
        h = lam[i + 1] - lam[i]
        last = i == len(points) - 2
        if order == 1 or x0_prev is None or (last and first_order_last):
            d = x0
        else:
            r = (lam[i] - lam[i - 1]) / h
            d = (1 + 1 / (2 * r)) * x0 - 1 / (2 * r) * x0_prev
        x = sigma[i + 1] / sigma[i] * x - alpha[i + 1] * math.expm1(-h) * d
        x0_prev = x0
    return x


@pytest.mark.parametrize(
    "order, prediction, final, lower_order_final, steps",
    [(2, "epsilon", "zero", True, 9), (2, "v_prediction", "sigma_min", False, 9), (2, "sample", "sigma_min", True, 9),
     (2, "epsilon", "sigma_min", True, 16), (1, "epsilon", "zero", True, 9), (1, "v_prediction", "sigma_min", True, 6),
     (2, "epsilon", "zero", True, 1), (2, "sample", "zero", False, 2)],
)
def test_dpm_solver_pp_loop_textbook(order, prediction, final, lower_order_final, steps):
    g = gen(25)
    T, dim, batch = 400, 3, 10
    abar_all = torch.cumprod(1 - ddpm_ops.cosine_betas(T), 0)
    timesteps = torch.randperm(T - 1, generator=g)[:steps].sort().values + 1
    rule = dpm_solver_pp(abar_all, timesteps, order=order, prediction=prediction, final_sigmas_type=final,
                         lower_order_final=lower_order_final)
    second_order_steps = 0 if order == 1 else steps - 1 - (final == "zero" or (lower_order_final and steps < 15))
    assert len(rule) == steps and not rule.adds_noise
    assert (rule.P is not None) == (second_order_steps > 0)
    if rule.P is not None:
        assert int((rule.P != 0).sum()) == second_order_steps
    weights, biases = random_mlp(g, [dim, 32, dim])
    x = torch.randn(batch, dim, generator=g, dtype=F64)
    abar_final = 1.0 if final == "zero" else float(abar_all[0])
    first_order_last = final == "zero" or (lower_order_final and steps < 15)
    expected = textbook_dpm_solver_pp(x, lambda v: mlp(v, weights, biases), abar_all[timesteps].double(),
                                      abar_final, order, prediction, first_order_last)
    actual = reference_sample(x, torch.full((batch,), steps - 1), weights, biases, rule, steps)
    assert rel(actual, expected) < 1e-6


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda s, a: flow_euler(s.flip(0)), "sigmas"),
        (lambda s, a: flow_euler(s - 0.5), "sigmas"),
        (lambda s, a: flow_euler(s[:1]), "sigmas"),
        (lambda s, a: flow_euler(s[None]), "sigmas"),
        (lambda s, a: flow_euler(torch.arange(5)), "sigmas"),
        (lambda s, a: flow_euler(s, clip=(1.0, -1.0)), "clip"),
        (lambda s, a: dpm_solver_pp(a, [0, 5], order=3), "order"),
        (lambda s, a: dpm_solver_pp(a, [0, 5], order=True), "order"),
        (lambda s, a: dpm_solver_pp(a, [0, 5], prediction="flow_prediction"), "prediction"),
        (lambda s, a: dpm_solver_pp(a, [0, 5], final_sigmas_type="sigma_max"), "final_sigmas_type"),
        (lambda s, a: dpm_solver_pp(a, [5, 0]), "timesteps"),
        (lambda s, a: dpm_solver_pp(a * 2, [0, 5]), "alphas_cumprod"),
    ],
)
def test_flow_euler_dpm_solver_pp_errors(call, name):
    abar = torch.cumprod(1 - ddpm_ops.linear_betas(50), 0)
    with pytest.raises(ValueError, match=f"^{name}:"):
        call(torch.linspace(0, 1, 6), abar)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda b, a: ddpm(b, prediction="x0"), "prediction"),
        (lambda b, a: ddpm(b, variance="learned"), "variance"),
        (lambda b, a: ddpm(b, clip=(1.0, -1.0)), "clip"),
        (lambda b, a: ddpm(b * 100), "betas"),
        (lambda b, a: ddpm(b[None]), "betas"),
        (lambda b, a: ddim(a, [0, 5], prediction="noise"), "prediction"),
        (lambda b, a: ddim(a, [5, 3]), "timesteps"),
        (lambda b, a: ddim(a, [0, 50]), "timesteps"),
        (lambda b, a: ddim(a, [0.0, 5.0]), "timesteps"),
        (lambda b, a: ddim(a, [0, 5], eta=-0.1), "eta"),
        (lambda b, a: ddim(a, [0, 5], eta=3.0), "eta"),
        (lambda b, a: ddim(a * 2, [0, 5]), "alphas_cumprod"),
    ],
)
def test_ddpm_ddim_errors(call, name):
    betas = ddpm_ops.linear_betas(50)
    abar = torch.cumprod(1 - betas, 0)
    with pytest.raises(ValueError, match=f"^{name}:"):
        call(betas, abar)


def test_bad_strings_list_the_allowed_values():
    betas = ddpm_ops.linear_betas(10)
    with pytest.raises(ValueError, match="epsilon, sample, v_prediction.*'x0'"):
        ddpm(betas, prediction="x0")
    with pytest.raises(ValueError, match="fixed_small, fixed_large.*'learned'"):
        ddpm(betas, variance="learned")


# --- reference_sample -------------------------------------------------------------------


def test_activations_match_torch_modules():
    x = torch.randn(64, generator=gen(7), dtype=F64) * 3
    modules = {"silu": nn.SiLU(), "mish": nn.Mish(), "relu": nn.ReLU(), "gelu": nn.GELU(),
               "gelu_tanh": nn.GELU(approximate="tanh"), "tanh": nn.Tanh(), "identity": nn.Identity()}
    assert set(ACTIVATIONS) == set(modules)
    for name, module in modules.items():
        assert rel(ACTIVATIONS[name](x), module(x)) < 1e-15, name
    assert rel(ACTIVATIONS["gelu_tanh"](x), ACTIVATIONS["gelu"](x)) > 1e-6


def test_reference_sample_chain_activations_biases_post_clip():
    g = gen(8)
    T, dim, batch, K, H = 40, 3, 6, 12, 16
    tables = random_tables(g, T, F64)
    rule = StepRule(*[t * 0.5 for t in tables], clip=(-1.0, 2.0), post_clip=(-1.5, 1.5))
    weights, biases = random_mlp(g, [dim, H, H, H, dim])
    acts = ["gelu_tanh", "mish", "tanh"]
    time_bias = torch.randn(T, H, generator=g, dtype=F64)
    cond_bias = torch.randn(batch, H, generator=g, dtype=F64)
    x = torch.randn(batch, dim, generator=g, dtype=F64)
    z = torch.randn(K, batch, dim, generator=g, dtype=F64)
    t_start = torch.randint(K - 1, T, (batch,), generator=g)

    def run(num_steps, **kw):
        return reference_sample(x, t_start, weights, biases, rule, num_steps, activations=acts,
                                time_bias=time_bias, cond_bias=cond_bias, noise=z[:num_steps], **kw)

    chain = run(K, return_chain=True)
    assert chain.shape == (K + 1, batch, dim) and torch.equal(chain[0], x)
    for j in (1, 5, K):
        assert torch.equal(chain[j], run(j))
    assert chain[1:].min() >= -1.5 and chain[1:].max() <= 1.5

    # One step by hand: every term of the update, in float64 (the tables as given).
    A, B, C, D, E, S = (t[t_start][:, None] for t in rule.tables(F64))
    h = x @ weights[0].T + biases[0] + time_bias[t_start] + cond_bias
    for w, b, name in zip(weights[1:], biases[1:], acts):
        h = ACTIVATIONS[name](h) @ w.T + b
    x0 = (A * x - B * h).clamp(-1.0, 2.0)
    expected = (C * x0 + D * x + E * h + S * z[0]).clamp(-1.5, 1.5)
    assert rel(chain[1], expected) < 1e-12

    # float32 x computes in float32.
    out32 = reference_sample(x.float(), t_start, weights, biases, rule, K, activations=acts,
                             time_bias=time_bias, cond_bias=cond_bias, noise=z)
    assert out32.dtype == torch.float32 and rel(out32.double(), chain[-1]) < 1e-4


def test_reference_sample_errors():
    g = gen(9)
    rule = ddpm(ddpm_ops.linear_betas(20))
    weights, biases = random_mlp(g, [2, 8, 8, 2])
    x = torch.randn(3, 2, generator=g, dtype=F64)
    t = torch.full((3,), 19)
    with pytest.raises(ValueError, match="^activations:.*silu, mish, relu, gelu, gelu_tanh, tanh, identity.*'swish'"):
        reference_sample(x, t, weights, biases, rule, 2, activations="swish")
    with pytest.raises(ValueError, match="^activations:.*2"):
        reference_sample(x, t, weights, biases, rule, 2, activations=["silu"])
    with pytest.raises(ValueError, match="^t_start:"):
        reference_sample(x, t, weights, biases, rule, 21)
    with pytest.raises(ValueError, match="^t_start:"):
        reference_sample(x, t + 1, weights, biases, rule, 1)
    with pytest.raises(ValueError, match="^noise:"):
        reference_sample(x, t, weights, biases, rule, 3, noise=torch.randn(2, 3, 2, dtype=F64))


# --- from_diffusers against diffusers itself --------------------------------------------

DDPM_CASES = [
    # num_train, steps (int or custom list), prediction, clip, clip_range, variance, spacing, extra config
    (1000, 1000, "epsilon", True, 1.0, "fixed_small", "leading", {}),
    (1000, 50, "epsilon", False, 1.0, "fixed_large", "leading", {}),
    (1000, 30, "v_prediction", True, 1.0, "fixed_small", "trailing", {"beta_schedule": "squaredcos_cap_v2"}),
    (100, 20, "sample", True, 2.5, "fixed_small", "trailing", {}),
    (100, 100, "v_prediction", False, 1.0, "fixed_small_log", "linspace", {}),
    (100, 15, "epsilon", True, 1.0, "fixed_large", "linspace", {}),
    (100, 10, "epsilon", True, 1.0, "fixed_small", "leading", {"steps_offset": 1}),
    (100, [90, 61, 40, 17, 6, 3], "sample", False, 1.0, "fixed_large", "leading", {}),
    (100, [99, 50, 20, 0], "v_prediction", True, 1.0, "fixed_large", "leading", {}),
    (100, 10, "v_prediction", False, 1.0, "fixed_small", "trailing", {"rescale_betas_zero_snr": True}),
]

DDIM_CASES = [
    # num_train, steps, prediction, clip, clip_range, eta, spacing, extra config, use_clipped_model_output
    (1000, 50, "epsilon", False, 1.0, 0.0, "leading", {}, False),
    (1000, 1000, "epsilon", True, 1.0, 1.0, "leading", {}, False),
    (1000, 40, "v_prediction", True, 1.0, 0.5, "trailing", {"beta_schedule": "scaled_linear"}, False),
    (100, 20, "sample", True, 2.5, 0.5, "trailing", {}, False),
    (100, 25, "v_prediction", False, 1.0, 0.5, "linspace", {}, False),
    (100, 100, "sample", False, 1.0, 1.0, "linspace", {}, False),
    (100, 10, "v_prediction", True, 1.0, 1.0, "leading", {"steps_offset": 1, "set_alpha_to_one": False}, False),
    (100, 20, "sample", True, 1.0, 0.5, "leading", {}, True),
    (100, 20, "epsilon", True, 0.5, 0.0, "trailing", {}, True),
    (100, 10, "v_prediction", False, 1.0, 0.5, "trailing", {"rescale_betas_zero_snr": True}, False),
]


def run_diffusers(scheduler, steps, eta, use_clipped, ddim_kind, dim=3, batch=8, seed=10):
    """A full diffusers loop in float64 with a random time- and state-conditioned MLP.

    diffusers keeps its tables in float32; upcasting them (same values) makes its
    step compute in float64, so the comparison measures the semantics, not float32
    rounding. The noise it draws is recorded per step. Returns the rule, its
    timesteps, the chain of samples of reference_sample and that of diffusers, the
    largest |x0| diffusers saw, and the recorded noise.
    """
    if isinstance(steps, list):
        scheduler.set_timesteps(timesteps=steps)
    else:
        scheduler.set_timesteps(steps)
    rule, timesteps = from_diffusers(scheduler, eta=eta, use_clipped_model_output=use_clipped) if ddim_kind \
        else from_diffusers(scheduler)
    scheduler.alphas_cumprod = scheduler.alphas_cumprod.double()
    if ddim_kind:
        scheduler.final_alpha_cumprod = torch.as_tensor(scheduler.final_alpha_cumprod, dtype=F64)
    else:
        scheduler.one = scheduler.one.double()

    g = gen(seed)
    n_cond, T = 2, scheduler.config.num_train_timesteps
    weights, biases = random_mlp(g, [dim + 1 + n_cond, 48, 48, dim])
    # Outputs of a few units, so that clip_sample clamps x0 for every prediction
    # type, but only weakly dependent on x, so that no chain blows up.
    weights[0][:, :dim] *= 0.2
    weights[-1], biases[-1] = weights[-1] * 4, biases[-1] * 4
    cond = torch.randn(batch, n_cond, generator=g, dtype=F64)
    x_init = torch.randn(batch, dim, generator=g, dtype=F64)

    def net(x, t):
        t_col = torch.full((batch, 1), float(t) / T, dtype=F64)
        return mlp(torch.cat([x, t_col, cond], dim=1), weights, biases)

    module = scheduling_ddim if ddim_kind else scheduling_ddpm
    drawn, chain, x0_max = {}, [x_init], []
    original = module.randn_tensor

    def recording_randn(*args, **kwargs):
        out = original(*args, **kwargs)
        drawn[len(chain) - 1] = out
        return out

    module.randn_tensor = recording_randn
    try:
        step_kw = {"eta": eta, "use_clipped_model_output": use_clipped} if ddim_kind else {}
        step_gen = gen(seed + 1)
        for t in scheduler.timesteps:
            out = scheduler.step(net(chain[-1], t), t, chain[-1], generator=step_gen, **step_kw)
            chain.append(out.prev_sample)
            x0_max.append(float(out.pred_original_sample.abs().max()))
    finally:
        module.randn_tensor = original
    expected = torch.stack(chain)
    assert expected.dtype == F64

    K = len(timesteps)
    # Steps where diffusers draws nothing get fresh noise: the rule must have S = 0 there.
    fresh = torch.randn(K, batch, dim, generator=g, dtype=F64)
    z = torch.stack([drawn.get(k, fresh[k]) for k in range(K)])
    w0 = weights[0]
    time_bias = (timesteps.to(F64) / T)[:, None] * w0[:, dim]
    cond_bias = cond @ w0[:, dim + 1:].T
    actual = reference_sample(x_init, torch.full((batch,), K - 1), [w0[:, :dim]] + weights[1:], biases, rule, K,
                              time_bias=time_bias, cond_bias=cond_bias, noise=z, return_chain=True)
    return rule, timesteps, actual, expected, max(x0_max), drawn


def worst_step_error(actual, expected):
    return max(rel(a, e) for a, e in zip(actual[1:], expected[1:]))


def check_timesteps(scheduler, timesteps, rule):
    assert timesteps.dtype == torch.int64 and len(rule) == len(timesteps)
    assert torch.equal(timesteps, scheduler.timesteps.flip(0))
    assert bool((timesteps[1:] > timesteps[:-1]).all())


@pytest.mark.parametrize("T, steps, prediction, clip, clip_range, variance, spacing, extra", DDPM_CASES)
def test_from_diffusers_ddpm(T, steps, prediction, clip, clip_range, variance, spacing, extra):
    scheduler = diffusers.DDPMScheduler(
        num_train_timesteps=T, prediction_type=prediction, clip_sample=clip, clip_sample_range=clip_range,
        variance_type=variance, timestep_spacing=spacing, **extra,
    )
    rule, timesteps, actual, expected, x0_max, drawn = run_diffusers(scheduler, steps, 0.0, False, False)
    check_timesteps(scheduler, timesteps, rule)
    assert worst_step_error(actual, expected) < 1e-5
    assert rule.clip == ((-clip_range, clip_range) if clip else None)
    if clip:
        assert x0_max == clip_range  # the clamp was active at some step
    assert len(drawn) == int((timesteps > 0).sum()) and rule.adds_noise


@pytest.mark.parametrize("T, steps, prediction, clip, clip_range, eta, spacing, extra, use_clipped", DDIM_CASES)
def test_from_diffusers_ddim(T, steps, prediction, clip, clip_range, eta, spacing, extra, use_clipped):
    scheduler = diffusers.DDIMScheduler(
        num_train_timesteps=T, prediction_type=prediction, clip_sample=clip, clip_sample_range=clip_range,
        timestep_spacing=spacing, **extra,
    )
    rule, timesteps, actual, expected, x0_max, drawn = run_diffusers(scheduler, steps, eta, use_clipped, True)
    check_timesteps(scheduler, timesteps, rule)
    assert worst_step_error(actual, expected) < 1e-5
    if clip:
        assert x0_max == clip_range
    assert rule.adds_noise == (eta > 0) and len(drawn) == (len(timesteps) if eta > 0 else 0)


def test_from_diffusers_ddim_matches_ddim_where_steps_are_contiguous():
    """With leading spacing the DDIM predecessor rule and ddim()'s agree."""
    scheduler = diffusers.DDIMScheduler(num_train_timesteps=1000, prediction_type="v_prediction", clip_sample=False)
    scheduler.set_timesteps(40)
    rule, timesteps = from_diffusers(scheduler, eta=0.3)
    direct = ddim(scheduler.alphas_cumprod, timesteps, eta=0.3, prediction="v_prediction")
    assert rel(rule.tables().double(), direct.tables().double()) < 1e-7


def test_from_diffusers_ddpm_full_matches_ddpm():
    scheduler = diffusers.DDPMScheduler(num_train_timesteps=200, variance_type="fixed_large", clip_sample=True)
    scheduler.set_timesteps(200)
    rule, timesteps = from_diffusers(scheduler)
    assert torch.equal(timesteps, torch.arange(200))
    direct = ddpm(scheduler.betas, variance="fixed_large", clip=1.0)
    assert rel(rule.tables().double(), direct.tables().double()) < 1e-5
    assert rule.clip == direct.clip


def run_diffusers_deterministic(scheduler, dim=3, batch=8, seed=30, rule=None):
    """diffusers' own loop of a noise-free scheduler with a random time- and
    state-conditioned MLP, in float64 (but for the float32 cast of the sample
    inside each step), against reference_sample (float64) and ddpm_ops.sample
    (float32) of the rule from_diffusers gives (or of ``rule``). Returns the
    rule, its timesteps, and the worst step error of each."""
    given, timesteps = from_diffusers(scheduler)
    rule = given if rule is None else rule
    scheduler.sigmas = scheduler.sigmas.double()  # the same values: the step computes in float64
    g = gen(seed)
    n_cond, T = 2, scheduler.config.num_train_timesteps
    weights, biases = random_mlp(g, [dim + 1 + n_cond, 48, 48, dim])
    cond = torch.randn(batch, n_cond, generator=g, dtype=F64)
    x_init = torch.randn(batch, dim, generator=g, dtype=F64)

    def net(x, t):
        t_col = torch.full((batch, 1), float(t) / T, dtype=F64)
        return mlp(torch.cat([x, t_col, cond], dim=1), weights, biases)

    chain = [x_init]
    for t in scheduler.timesteps:
        chain.append(scheduler.step(net(chain[-1], t), t, chain[-1]).prev_sample)
    expected = torch.stack(chain)
    assert expected.dtype == F64

    K = len(timesteps)
    w0 = weights[0]
    time_bias = (timesteps.to(F64) / T)[:, None] * w0[:, dim]
    cond_bias = cond @ w0[:, dim + 1:].T
    layers = ([w0[:, :dim]] + weights[1:], biases)
    actual = reference_sample(x_init, torch.full((batch,), K - 1), *layers, rule, K, time_bias=time_bias,
                              cond_bias=cond_bias, return_chain=True)
    fused = ddpm_ops.sample(x_init.float(), K - 1, *[[t.float() for t in ts] for ts in layers], rule, K,
                            time_bias=time_bias.float(), cond_bias=cond_bias.float(), return_chain=True)
    return rule, timesteps, worst_step_error(actual, expected), worst_step_error(fused.double(), expected)


FLOW_CASES = [
    # config, set_timesteps arguments
    ({}, {"num_inference_steps": 10}),
    ({"shift": 3.0}, {"num_inference_steps": 10}),
    ({"num_train_timesteps": 100, "shift": 0.5}, {"num_inference_steps": 4}),
    ({"use_dynamic_shifting": True}, {"num_inference_steps": 12, "mu": 0.8}),
    ({"use_dynamic_shifting": True, "time_shift_type": "linear"}, {"num_inference_steps": 6, "mu": 1.6}),
    ({"shift_terminal": 0.1}, {"num_inference_steps": 8}),
    ({"use_karras_sigmas": True}, {"num_inference_steps": 10}),
    ({}, {"sigmas": [1.0, 0.8, 0.55, 0.3, 0.05]}),
]


@pytest.mark.parametrize("config, set_timesteps", FLOW_CASES)
def test_from_diffusers_flow_match_euler(config, set_timesteps):
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(**config)
    scheduler.set_timesteps(**set_timesteps)
    sigmas = scheduler.sigmas.clone()
    rule, timesteps, reference_error, fused_error = run_diffusers_deterministic(scheduler)
    assert timesteps.dtype == torch.float32 and torch.equal(timesteps, scheduler.timesteps.flip(0))
    assert len(rule) == len(timesteps) == len(sigmas) - 1 and rule.P is None and not rule.adds_noise
    assert reference_error < 1e-6 and fused_error < 1e-5
    assert rel(rule.tables().double(), flow_euler(sigmas.flip(0)).tables().double()) == 0


DPM_CASES = [
    # solver_order, prediction, final_sigmas_type, lower_order_final, steps, extra config
    (2, "epsilon", "zero", True, 10, {}),
    (2, "epsilon", "sigma_min", True, 20, {}),
    (2, "v_prediction", "sigma_min", False, 8, {"timestep_spacing": "trailing", "beta_schedule": "scaled_linear"}),
    (2, "sample", "sigma_min", True, 8, {"timestep_spacing": "leading", "steps_offset": 1}),
    (2, "v_prediction", "zero", False, 25, {"beta_schedule": "squaredcos_cap_v2", "num_train_timesteps": 500}),
    (1, "epsilon", "zero", True, 12, {}),
    (1, "sample", "sigma_min", False, 5, {"num_train_timesteps": 100}),
    (2, "v_prediction", "zero", True, 10, {"rescale_betas_zero_snr": True, "timestep_spacing": "trailing"}),
    (2, "epsilon", "zero", True, [900, 700, 420, 250, 100, 30], {}),
]


@pytest.mark.parametrize("order, prediction, final, lower_order_final, steps, extra", DPM_CASES)
def test_from_diffusers_dpm_solver_pp(order, prediction, final, lower_order_final, steps, extra):
    scheduler = diffusers.DPMSolverMultistepScheduler(
        solver_order=order, prediction_type=prediction, final_sigmas_type=final,
        lower_order_final=lower_order_final, **extra)
    if isinstance(steps, list):
        scheduler.set_timesteps(timesteps=steps)
    else:
        scheduler.set_timesteps(steps)
    rule, timesteps, reference_error, fused_error = run_diffusers_deterministic(scheduler)
    check_timesteps(scheduler, timesteps, rule)
    assert reference_error < 1e-6 and fused_error < 1e-5
    assert (rule.P is not None) == (order == 2)
    if order == 2:
        # The previous x0's term matters: without it the rule is visibly off.
        scheduler.set_timesteps(**({"timesteps": steps} if isinstance(steps, list) else {"num_inference_steps": steps}))
        without = StepRule(*rule.tables()[:6])
        _, _, reference_error, fused_error = run_diffusers_deterministic(scheduler, rule=without)
        assert reference_error > 1e-4 and fused_error > 1e-4


@pytest.mark.parametrize(
    "make, kwargs, error, words",
    [
        (lambda: diffusers.DDPMScheduler(thresholding=True), {}, ValueError, "thresholding"),
        (lambda: diffusers.DDIMScheduler(thresholding=True), {}, ValueError, "thresholding"),
        (lambda: diffusers.DDPMScheduler(variance_type="learned_range"), {}, ValueError, "'learned_range'"),
        (lambda: diffusers.DDPMScheduler(variance_type="learned"), {}, ValueError, "'learned'"),
        (lambda: diffusers.DDPMScheduler(variance_type="fixed_large_log"), {}, ValueError, "'fixed_large_log'"),
        (lambda: diffusers.DDPMScheduler(), {"eta": 0.5}, ValueError, "eta=0.5"),
        # Zero terminal SNR: x0 = (x - e) / sqrt(0) for an epsilon network.
        (lambda: diffusers.DDIMScheduler(rescale_betas_zero_snr=True, timestep_spacing="trailing"), {}, ValueError,
         "non-finite"),
        (lambda: diffusers.PNDMScheduler(), {}, TypeError, "PNDMScheduler"),
        (lambda: diffusers.DDPMParallelScheduler(), {}, TypeError, "DDPMParallelScheduler"),
        (lambda: diffusers.EulerDiscreteScheduler(), {}, TypeError, "EulerDiscreteScheduler"),
        (lambda: diffusers.FlowMatchEulerDiscreteScheduler(stochastic_sampling=True), {}, ValueError,
         "stochastic_sampling=True"),
        (lambda: diffusers.FlowMatchEulerDiscreteScheduler(invert_sigmas=True), {}, ValueError, "invert_sigmas=True"),
        (lambda: diffusers.FlowMatchEulerDiscreteScheduler(), {"eta": 0.5}, ValueError, "eta=0.5"),
        (lambda: diffusers.DPMSolverMultistepScheduler(algorithm_type="sde-dpmsolver++"), {}, ValueError,
         "algorithm_type='sde-dpmsolver++'"),
        (lambda: diffusers.DPMSolverMultistepScheduler(algorithm_type="dpmsolver", final_sigmas_type="sigma_min"),
         {}, ValueError, "algorithm_type='dpmsolver'"),
        (lambda: diffusers.DPMSolverMultistepScheduler(solver_order=3), {}, ValueError, "solver_order=3"),
        (lambda: diffusers.DPMSolverMultistepScheduler(solver_type="heun"), {}, ValueError, "solver_type='heun'"),
        (lambda: diffusers.DPMSolverMultistepScheduler(euler_at_final=True), {}, ValueError, "euler_at_final=True"),
        (lambda: diffusers.DPMSolverMultistepScheduler(use_karras_sigmas=True), {}, ValueError,
         "use_karras_sigmas=True"),
        (lambda: diffusers.DPMSolverMultistepScheduler(use_lu_lambdas=True), {}, ValueError, "use_lu_lambdas=True"),
        (lambda: diffusers.DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction"), {},
         ValueError, "flow_prediction"),
        (lambda: diffusers.DPMSolverMultistepScheduler(variance_type="learned_range"), {}, ValueError,
         "variance_type='learned_range'"),
        (lambda: diffusers.DPMSolverMultistepScheduler(thresholding=True), {}, ValueError, "thresholding"),
    ],
)
def test_from_diffusers_unsupported(make, kwargs, error, words):
    scheduler = make()
    scheduler.set_timesteps(10)
    with pytest.raises(error, match="scheduler|eta|A:") as info:
        from_diffusers(scheduler, **kwargs)
    assert words in str(info.value)


@pytest.mark.parametrize("cls", [diffusers.DDPMScheduler, diffusers.DDIMScheduler,
                                 diffusers.FlowMatchEulerDiscreteScheduler, diffusers.DPMSolverMultistepScheduler])
def test_from_diffusers_needs_set_timesteps(cls):
    with pytest.raises(ValueError, match="set_timesteps"):
        from_diffusers(cls(num_train_timesteps=50))


def test_from_diffusers_not_a_scheduler():
    with pytest.raises(TypeError, match="^scheduler:.*object"):
        from_diffusers(object())
