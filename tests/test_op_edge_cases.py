"""Edge cases of ddpm::fused_sample on the CPU against the float64 reference loop.

Shapes at the kernels' vector and tile boundaries, degenerate tables and
steps, strided / expanded / offset inputs, grad and inference modes, threads,
non-finite values, timestep range checks that must not overflow, and the
Python helpers (FusedDDPMSampler, schedules, mlp_parameters).
"""
import math
import subprocess
import textwrap

import pytest
import torch
from torch import nn

import ddpm_ops
from problems import make_problem, relative_error, run_python

TOLERANCE = 1e-5
INT64_MIN = -(2 ** 63)
INT64_MAX = 2 ** 63 - 1


def _check(problem):
    out = ddpm_ops.fused_sample(*problem.args())
    assert out.shape == problem.x.shape and out.dtype == torch.float32
    assert out.is_contiguous()
    err = relative_error(out, problem.reference64())
    assert err <= TOLERANCE, err
    return out


# ---- shapes at vector (8 / 16 lanes), register-block (6 rows) and tile
# (4 serial rows, 48 rows per tile) boundaries.

@pytest.mark.parametrize("width", [1, 2, 3, 5, 15, 17, 31, 33, 63, 65, 127, 129, 255, 257, 300])
@pytest.mark.parametrize("batch", [1, 5, 49])
def test_hidden_widths_at_vector_boundaries(width, batch):
    _check(make_problem(batch, 7, [width, width], 3))


@pytest.mark.parametrize("dim", [1, 2, 15, 16, 17, 31, 33, 65])
@pytest.mark.parametrize("batch", [1, 6, 13])
def test_dims_at_vector_boundaries(dim, batch):
    _check(make_problem(batch, dim, [33], 4))


@pytest.mark.parametrize("batch", [2, 4, 5, 6, 7, 47, 48, 49, 96, 97, 289])
def test_batches_at_tile_boundaries(batch):
    _check(make_problem(batch, 9, [40, 17], 3))


@pytest.mark.parametrize("batch", [1, 7])
def test_wide_and_deep_net(batch):
    # 5 Linear layers, hidden width 1024.
    _check(make_problem(batch, 16, [1024, 1024, 1024, 1024], 2))


def test_single_linear_dim_one():
    _check(make_problem(5, 1, [], 6))


@pytest.mark.parametrize("num_steps", [0, 1, 100])
def test_num_steps_zero_one_hundred(num_steps):
    out = _check(make_problem(6, 5, [16], num_steps))
    if num_steps == 0:
        assert out.requires_grad is False


@pytest.mark.parametrize("threads", [1, None])
@pytest.mark.parametrize("batch", [5, 97, 289])
def test_thread_counts_give_same_answer(threads, batch):
    before = torch.get_num_threads()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        _check(make_problem(batch, 9, [40], 3))
    finally:
        torch.set_num_threads(before)


# ---- timesteps and tables

@pytest.mark.parametrize("t_dtype", [torch.int32, torch.int64])
def test_t_start_at_both_ends_of_the_valid_range(t_dtype):
    p = make_problem(6, 4, [8], 7, total_timesteps=50, t_dtype=t_dtype)
    p.t_start = torch.tensor([6, 49, 6, 49, 20, 6], dtype=t_dtype)  # K-1 and len-1
    _check(p)


def test_table_of_length_one_with_one_step():
    p = make_problem(5, 4, [8], 1, total_timesteps=1)
    assert p.sqrt_recip_alphas.numel() == 1 and (p.t_start == 0).all()
    _check(p)


@pytest.mark.parametrize("total_timesteps", [7, 1000, 10 ** 9])
def test_total_timesteps_other_than_table_length(total_timesteps):
    p = make_problem(6, 4, [8], 3, total_timesteps=50)
    p.total_timesteps = total_timesteps
    _check(p)


@pytest.mark.parametrize("t_dtype", [torch.int32, torch.int64])
def test_negative_t_start_is_refused_with_a_named_error(t_dtype):
    p = make_problem(4, 4, [8], 3, total_timesteps=50)
    p.t_start = torch.tensor([5, -1, 10, 3], dtype=t_dtype)
    with pytest.raises(RuntimeError, match=r"t_start out of range: .* = \[2, 49\] .* got t_start in \[-1, 10\]"):
        ddpm_ops.fused_sample(*p.args())


def test_t_start_out_of_range_is_ignored_only_when_no_step_runs():
    p = make_problem(3, 4, [8], 0, total_timesteps=50)
    p.t_start = torch.tensor([-4, 60, 7])
    out = ddpm_ops.fused_sample(*p.args())
    assert torch.equal(out, p.x) and out.data_ptr() != p.x.data_ptr()


def test_t_start_near_int64_min_is_refused():
    """The range check must not overflow (``t_start - (num_steps - 1)`` would)."""
    p = make_problem(2, 4, [8], 2, total_timesteps=50)
    p.t_start = torch.tensor([INT64_MIN, 5])
    with pytest.raises(RuntimeError, match=r"t_start out of range"):
        ddpm_ops.fused_sample(*p.args())


CRASH_SCRIPT = textwrap.dedent("""
    import torch
    from problems import make_problem
    import ddpm_ops
    p = make_problem(1, 4, [8], 1, total_timesteps=50)
    p.t_start = torch.tensor([-3])
    p.num_steps = 2 ** 63 - 1   # -3 - (num_steps - 1) overflows to a positive number
    try:
        ddpm_ops.fused_sample(*p.args())
    except RuntimeError as e:
        print("raised:", e)
""")


def test_huge_num_steps_with_negative_t_start_raises_not_crashes():
    """Same overflow with num_steps = 2**63 - 1: must raise, never walk out of
    the tables. In a subprocess, so a crash cannot take pytest down."""
    try:
        result = run_python(CRASH_SCRIPT, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("fused_sample ran past 60 s instead of refusing t_start = -3")
    assert result.returncode == 0, f"crashed with return code {result.returncode}: {result.stderr[-500:]}"
    assert "raised:" in result.stdout and "num_steps must be at most the length" in result.stdout


@pytest.mark.parametrize("num_steps", [51, 200])
def test_more_steps_than_table_rows_names_num_steps(num_steps):
    p = make_problem(2, 4, [8], 3, total_timesteps=50)
    p.num_steps = num_steps
    with pytest.raises(RuntimeError, match=rf"num_steps must be at most the length of the "
                       rf"coefficient tables \(50\), got {num_steps}"):
        ddpm_ops.fused_sample(*p.args())


@pytest.mark.parametrize("t_dtype", [torch.int32, torch.int64])
def test_batch_zero(t_dtype):
    p = make_problem(0, 5, [9], 3, t_dtype=t_dtype)
    out = ddpm_ops.fused_sample(*p.args())
    assert out.shape == (0, 5) and out.dtype == torch.float32


# ---- strides, expansion, storage offsets, aliasing

def test_stride_zero_expanded_inputs():
    p = make_problem(4, 5, [9], 3)
    p.x = torch.randn(1, 5).expand(4, 5)
    p.t_start = torch.randint(2, 1000, (1,)).expand(4)
    p.weights = [w[:1].expand_as(w).clone() + torch.randn_like(w) for w in p.weights]
    p.weights[0] = p.weights[0][:1].expand_as(p.weights[0])
    p.biases = [b[:1].expand_as(b) for b in p.biases]
    p.coef_eps = p.coef_eps[:1].expand_as(p.coef_eps)
    before = [t.clone() for t in (p.x, p.t_start, *p.weights, *p.biases, p.coef_eps)]
    out = _check(p)
    after = [p.x, p.t_start, *p.weights, *p.biases, p.coef_eps]
    assert all(torch.equal(b, a) for b, a in zip(before, after))
    assert out.stride() == (5, 1)
    # All rows of an expanded x with one timestep give identical rows.
    assert torch.equal(out, out[:1].expand_as(out))


def test_views_with_storage_offsets():
    p = make_problem(7, 5, [9, 11], 3)
    p.x = torch.randn(p.x.numel() + 11)[11:].view_as(p.x).copy_(p.x)
    p.weights = [torch.randn(w.numel() + 37)[37:].view_as(w).copy_(w) for w in p.weights]
    p.biases = [torch.randn(b.numel() + 3)[3:].copy_(b) for b in p.biases]
    table = torch.randn(2 * p.coef_eps.numel())
    table[p.coef_eps.numel():].copy_(p.coef_eps)
    p.coef_eps = table[p.coef_eps.numel():]
    assert p.x.storage_offset() == 11 and p.coef_eps.storage_offset() > 0
    _check(p)


@pytest.mark.parametrize("num_steps", [0, 2])
def test_output_is_new_memory_for_expanded_x(num_steps):
    p = make_problem(3, 4, [6], num_steps)
    base = torch.randn(1, 4)
    p.x = base.expand(3, 4)
    out = ddpm_ops.fused_sample(*p.args())
    assert out.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    out.add_(1.0)  # writable and independent of x
    assert torch.equal(p.x, base.expand(3, 4))


# ---- grad and inference modes

def test_requires_grad_inputs_under_no_grad():
    p = make_problem(50, 5, [9], 3)
    p.x.requires_grad_(True)
    for t in (*p.weights, *p.biases, p.coef_eps):
        t.requires_grad_(True)
    with torch.no_grad():
        out = _check(p)
    assert not out.requires_grad and out.grad_fn is None
    with pytest.raises(RuntimeError, match=r"inference-only .* x requires grad"):
        ddpm_ops.fused_sample(*p.args())


def test_inference_mode_tensors_inside_and_outside():
    with torch.inference_mode():
        p = make_problem(9, 5, [9], 3)
        out = _check(p)
        assert out.is_inference()
    out2 = _check(p)  # inference tensors passed outside inference mode
    assert torch.equal(out, out2)


# ---- non-finite values

def test_huge_values_stay_accurate_while_float32_is_finite():
    p = make_problem(13, 8, [32, 32], 3)
    p.x = p.x * 1e30
    _check(p)


@pytest.mark.parametrize("batch", [1, 5, 49])
def test_overflow_gives_the_references_inf_and_nan(batch):
    """At the edge of float32's range the float32 loop overflows in some rows.
    Where the op and the loop both stay finite they agree; where only one of
    them overflows (summation order decides, on either side), the other's
    finite row sits at that edge."""
    p = make_problem(batch, 8, [32, 32], 3)
    p.x = torch.randn(batch, 8).sign() * 3e38
    out = ddpm_ops.fused_sample(*p.args())
    ref32 = ddpm_ops.reference(*p.args())
    ref_finite = torch.isfinite(ref32).all(1)
    out_finite = torch.isfinite(out).all(1)
    both = out_finite & ref_finite
    if both.any():
        assert relative_error(out[both], ref32[both].double()) <= TOLERANCE
    assert (out[out_finite & ~ref_finite].abs().amax(1) > 1e38).all()
    assert (ref32[ref_finite & ~out_finite].abs().amax(1) > 1e38).all()


@pytest.mark.parametrize("batch", [1, 5, 49])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_x_stays_in_its_row(batch, value):
    p = make_problem(batch, 8, [32], 3)
    p.x[0, 3] = value
    out = ddpm_ops.fused_sample(*p.args())
    ref32 = ddpm_ops.reference(*p.args())
    assert torch.equal(torch.isnan(out), torch.isnan(ref32))
    assert torch.equal(torch.isinf(out), torch.isinf(ref32))
    assert not torch.isfinite(out[0]).all()
    if batch > 1:
        assert relative_error(out[1:], p.reference64()[1:]) <= TOLERANCE


# ---- Python helpers

class DesignSampler(nn.Module):
    """The plain sampling loop as a user writes it, in an nn.Module."""

    def __init__(self, dim=64, num_fused_steps=16, total_timesteps=1000):
        super().__init__()
        h = 4 * dim
        self.K, self.T = num_fused_steps, total_timesteps
        self.eps_net = nn.Sequential(nn.Linear(dim + 1, h), nn.SiLU(),
                                     nn.Linear(h, h), nn.SiLU(), nn.Linear(h, dim))
        betas = torch.linspace(1e-4, 0.02, total_timesteps)
        alphas = 1.0 - betas
        alphas_cumprod = torch.cumprod(alphas, 0)
        self.register_buffer("sqrt_recip_alphas", 1.0 / torch.sqrt(alphas))
        self.register_buffer("coef_eps", betas / torch.sqrt(1.0 - alphas_cumprod))

    def forward(self, x, t_start):
        x_cur = x
        for k in range(self.K):
            t_idx = t_start - k
            t_norm = t_idx.float() / self.T
            eps = self.eps_net(torch.cat([x_cur, t_norm[:, None]], dim=1))
            c1 = self.sqrt_recip_alphas[t_idx].view(-1, 1)
            c2 = self.coef_eps[t_idx].view(-1, 1)
            x_cur = c1 * (x_cur - c2 * eps)
        return x_cur


def test_fused_sampler_module_equals_design_sampler_in_float64():
    design = DesignSampler(dim=8, num_fused_steps=5, total_timesteps=100)
    fused = ddpm_ops.FusedDDPMSampler(design.eps_net, design.sqrt_recip_alphas, design.coef_eps,
                                      5, 100)
    x = torch.randn(7, 8)
    t = torch.randint(4, 100, (7,))
    with torch.no_grad():
        out = fused(x, t)
        ref = DesignSampler(dim=8, num_fused_steps=5, total_timesteps=100).double()
        ref.load_state_dict(design.state_dict())
        expected = ref(x.double(), t)
    assert relative_error(out, expected) <= TOLERANCE
    # Shares (does not copy) the parameters; the tables are its rule's.
    assert fused.eps_net[0].weight is design.eps_net[0].weight
    assert torch.equal(fused.rule.C, design.sqrt_recip_alphas) and torch.equal(fused.rule.B, design.coef_eps)
    with pytest.raises(RuntimeError, match=r"inference-only .* weights\[\d\] requires grad"):
        fused(x, t)


def test_coefficient_tables_match_design_formulas():
    total = 1000
    betas = torch.linspace(1e-4, 0.02, total, dtype=torch.float64)
    c1, c2 = ddpm_ops.coefficient_tables(ddpm_ops.linear_betas(total))
    assert c1.dtype == torch.float32 and c2.dtype == torch.float32
    alphas = 1 - betas
    want1 = 1 / alphas.sqrt()
    want2 = betas / (1 - torch.cumprod(alphas, 0)).sqrt()
    assert ((c1.double() - want1).abs() / want1).max() <= 1e-7
    assert ((c2.double() - want2).abs() / want2).max() <= 1e-7
    c1_64, _ = ddpm_ops.coefficient_tables(betas, dtype=torch.float64)
    torch.testing.assert_close(c1_64, want1, rtol=1e-15, atol=0)


def test_cosine_betas_match_nichol_dhariwal():
    total, s = 300, 0.008

    def alpha_bar(t):
        return math.cos((t / total + s) / (1 + s) * math.pi / 2) ** 2

    want = torch.tensor([min(1 - alpha_bar(t + 1) / alpha_bar(t), 0.999) for t in range(total)],
                        dtype=torch.float64)
    got = ddpm_ops.cosine_betas(total)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    assert got[-1] == 0.999 and (got > 0).all()


@pytest.mark.parametrize("betas,message", [
    (torch.tensor([0.5, 1.0]), r"betas: expected every beta in the open interval \(0, 1\)"),
    (torch.tensor([0.5, float("nan")]), r"betas: expected every beta in the open interval \(0, 1\)"),
    (torch.tensor([]), r"betas: expected a non-empty 1-D tensor, got shape \(0,\)"),
    (torch.tensor([[0.1]]), r"betas: expected a non-empty 1-D tensor, got shape \(1, 1\)"),
])
def test_coefficient_tables_bad_betas(betas, message):
    with pytest.raises(ValueError, match=message):
        ddpm_ops.coefficient_tables(betas)


@pytest.mark.parametrize("net,message", [
    (nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)), r"layer 1 should be nn.SiLU, got ReLU"),
    (nn.Sequential(nn.Linear(3, 4), nn.SiLU()), r"the last layer should be nn.Linear, got SiLU"),
    (nn.Sequential(nn.Linear(3, 4, bias=False)), r"layer 0 should be nn.Linear with bias, got Linear"),
    (nn.ReLU(), r"layer 0 should be nn.Linear with bias, got ReLU"),
])
def test_mlp_parameters_errors_name_the_layer(net, message):
    with pytest.raises(ValueError, match=message):
        ddpm_ops.mlp_parameters(net)


def test_mlp_parameters_refuses_empty_sequential():
    with pytest.raises(ValueError, match=r"eps_net"):
        ddpm_ops.mlp_parameters(nn.Sequential())


def test_wrapper_refuses_float_num_steps():
    """2.7 steps is an error, not a silent 2."""
    p = make_problem(3, 4, [8], 3)
    with pytest.raises((TypeError, RuntimeError)):
        torch.ops.ddpm.fused_sample(*p.args()[:6], 2.7, p.total_timesteps)
    with pytest.raises(TypeError, match=r"num_steps: expected an int, got float 2.7"):
        ddpm_ops.fused_sample(*p.args()[:6], 2.7, p.total_timesteps)
    with pytest.raises(TypeError, match=r"num_steps: expected an int, got bool True"):
        ddpm_ops.fused_sample(*p.args()[:6], True, p.total_timesteps)
    with pytest.raises(TypeError, match=r"total_timesteps: expected an int, got float"):
        ddpm_ops.fused_sample(*p.args()[:6], 3, float(p.total_timesteps))


class ScaledLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class TanhSiLU(nn.SiLU):
    def forward(self, x):
        return torch.tanh(x)


def hooked(net, index):
    net[index].register_forward_hook(lambda module, inputs, output: output * 0)
    return net


@pytest.mark.parametrize("net,message", [
    (nn.Sequential(ScaledLinear(3, 4), nn.SiLU(), nn.Linear(4, 2)),
     r"layer 0 should be nn.Linear with bias, got ScaledLinear with its own forward"),
    (nn.Sequential(nn.Linear(3, 4), TanhSiLU(), nn.Linear(4, 2)),
     r"layer 1 should be nn.SiLU, got TanhSiLU with its own forward"),
    (hooked(nn.Sequential(nn.Linear(3, 4), nn.SiLU(), nn.Linear(4, 2)), 2), r"Linear has forward hooks"),
])
def test_mlp_parameters_refuses_modules_computing_something_else(net, message):
    """A subclass that overrides forward, or a hook, computes another MLP:
    refused, never silently replaced by Linear/SiLU."""
    with pytest.raises(ValueError, match=message):
        ddpm_ops.mlp_parameters(net)


def test_parametrized_linear_is_accepted():
    """weight_norm keeps nn.Linear's forward and computes with the effective weight."""
    torch.manual_seed(0)
    first = torch.nn.utils.parametrizations.weight_norm(nn.Linear(4, 8))
    net = nn.Sequential(first, nn.SiLU(), nn.Linear(8, 3))
    weights, _ = ddpm_ops.mlp_parameters(net)
    with torch.no_grad():
        assert torch.equal(weights[0], first.weight)


@pytest.mark.parametrize("widths, bias", [([5, 3], True), ([4, 16, 9, 4], True), ([3, 7, 3], False)])
def test_silu_mlp_builds_the_net_the_op_computes(widths, bias):
    net = ddpm_ops.silu_mlp(widths, bias=bias)
    kinds = [type(m) for m in net]
    assert kinds == [nn.Linear, nn.SiLU] * (len(widths) - 2) + [nn.Linear]
    linears = [m for m in net if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == list(zip(widths[:-1], widths[1:]))
    assert all((m.bias is not None) == bias for m in linears)
    if bias:
        weights, biases = ddpm_ops.mlp_parameters(net)
        assert all(w is m.weight and b is m.bias for w, b, m in zip(weights, biases, linears))


@pytest.mark.parametrize("widths", [[], [4]])
def test_silu_mlp_needs_two_widths(widths):
    with pytest.raises(ValueError, match=r"widths: expected at least an input and an output width"):
        ddpm_ops.silu_mlp(widths)


@pytest.mark.parametrize("mode", ["jvp", "dual"])
def test_forward_mode_ad_is_refused(mode):
    """The op has no forward derivative: a tangent is an error, not silently dropped."""
    p = make_problem(3, 4, [8], 2)
    args = list(p.args())
    call = lambda x: ddpm_ops.fused_sample(x, *args[1:])  # noqa: E731
    with pytest.raises(RuntimeError, match=r"forward-mode tangent"):
        if mode == "jvp":
            torch.func.jvp(call, (p.x,), (torch.ones_like(p.x),))
        else:
            with torch.autograd.forward_ad.dual_level():
                call(torch.autograd.forward_ad.make_dual(p.x, torch.ones_like(p.x)))


def test_python_int_t_start_is_one_timestep_for_the_batch():
    p = make_problem(5, 4, [8], 3, total_timesteps=50)
    out = ddpm_ops.fused_sample(p.x, 20, *p.args()[2:])
    p.t_start = torch.full((5,), 20)
    assert torch.equal(out, ddpm_ops.fused_sample(*p.args()))
    with pytest.raises(TypeError, match=r"t_start: expected an int, got float 2.5"):
        ddpm_ops.fused_sample(p.x, 2.5, *p.args()[2:])


def test_sampler_refuses_swapped_counts():
    net = ddpm_ops.silu_mlp([5, 8, 4])
    c1, c2 = ddpm_ops.coefficient_tables(ddpm_ops.linear_betas(1000))
    with pytest.raises(ValueError, match=r"num_steps: expected at most total_timesteps = 16, "
                                         r"got 1000.*swapped"):
        ddpm_ops.FusedDDPMSampler(net, c1, c2, 1000, 16)
    with pytest.raises(ValueError, match=r"num_steps: expected at most the tables' length 100, got 200"):
        ddpm_ops.FusedDDPMSampler(net, c1[:100], c2[:100], 200, 1000)
    ddpm_ops.FusedDDPMSampler(net, c1, c2, 16, 1000)
