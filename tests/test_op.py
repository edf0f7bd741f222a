"""ddpm::fused_sample against the float64 reference loop, its errors, and capture."""
import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.library import opcheck

import ddpm_ops
from problems import DEVICES, make_problem, relative_error

TOLERANCE = 1e-5
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (batch, dim, hidden widths, num_steps): batch 1 to thousands, dim 1 to 131,
# depth 1 to 5, widths off multiples of 4 and 32 and up to 1024, K 0 to 100.
SHAPES = [
    (1, 64, [256, 256], 16),
    (8, 64, [256, 256], 16),
    (3, 1, [], 5),
    (5, 2, [1], 7),
    (17, 7, [33], 100),
    (9, 130, [300, 7, 33], 4),
    (6, 131, [33, 300, 1, 7], 3),
    (64, 12, [1024, 1024], 5),
    (2, 64, [256, 256], 0),
    (2500, 64, [256, 256], 16),
    (4096, 3, [300, 300], 2),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch,dim,hidden,num_steps", SHAPES)
def test_matches_float64_reference(device, batch, dim, hidden, num_steps):
    problem = make_problem(batch, dim, hidden, num_steps, device=device)
    out = ddpm_ops.fused_sample(*problem.args())
    assert out.shape == problem.x.shape and out.dtype == torch.float32
    assert out.device == problem.x.device
    assert relative_error(out, problem.reference64()) <= TOLERANCE


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_timestep_dtypes_and_schedules(device, t_dtype, schedule):
    problem = make_problem(33, 10, [40, 24], 12, device=device, t_dtype=t_dtype,
                           total_timesteps=200, schedule=schedule)
    out = ddpm_ops.fused_sample(*problem.args())
    assert relative_error(out, problem.reference64()) <= TOLERANCE


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_inputs(device):
    p = make_problem(20, 9, [31, 17], 6, device=device)
    # Same values, other strides: transposed storage and every-other-element views.
    p.x = p.x.t().contiguous().t()
    p.t_start = torch.stack([p.t_start, p.t_start], dim=1)[:, 0]
    p.weights = [w.t().contiguous().t() for w in p.weights]
    p.biases = [torch.stack([b, -b], dim=1)[:, 0] for b in p.biases]
    p.sqrt_recip_alphas = torch.stack([p.sqrt_recip_alphas] * 2, dim=1)[:, 0]
    p.coef_eps = torch.stack([p.coef_eps] * 2, dim=1)[:, 1]
    assert not p.x.is_contiguous() and not p.t_start.is_contiguous()
    assert not p.weights[0].is_contiguous() and not p.coef_eps.is_contiguous()
    out = ddpm_ops.fused_sample(*p.args())
    assert relative_error(out, p.reference64()) <= TOLERANCE


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_steps", [0, 3])
def test_never_mutates_or_aliases_inputs(device, num_steps):
    problem = make_problem(4, 5, [9], num_steps, device=device)
    inputs = [problem.x, problem.t_start, *problem.weights, *problem.biases,
              problem.sqrt_recip_alphas, problem.coef_eps]
    before = [t.clone() for t in inputs]
    out = ddpm_ops.fused_sample(*problem.args())
    assert all(torch.equal(b, t) for b, t in zip(before, inputs))
    assert out.data_ptr() != problem.x.data_ptr()
    if num_steps == 0:
        assert torch.equal(out, problem.x)


def _bad(problem, **changes):
    """Positional args of ``problem`` with some replaced by name."""
    names = ["x", "t_start", "weights", "biases", "sqrt_recip_alphas", "coef_eps",
             "num_steps", "total_timesteps"]
    values = dict(zip(names, problem.args()))
    values.update(changes)
    return [values[n] for n in names]


BAD_INPUTS = {
    "x rank": (lambda p: _bad(p, x=p.x[0]), r"x must be 2-D \(batch, dim\), got shape \[6\]"),
    "x dtype": (lambda p: _bad(p, x=p.x.double()), r"x must be float32 \(fused_sample.rule takes a float64 sample\), got Double"),
    "t_start shape": (lambda p: _bad(p, t_start=p.t_start[:2]),
                      r"t_start must have shape \(batch,\) = \(4,\) to match x, got shape \[2\]"),
    "t_start float": (lambda p: _bad(p, t_start=p.t_start.float()),
                      r"t_start must be int64 or int32, got Float"),
    "empty weights": (lambda p: _bad(p, weights=[], biases=[]),
                      r"weights must hold at least one Linear weight, got an empty list"),
    "count mismatch": (lambda p: _bad(p, biases=p.biases[:1]),
                       r"biases must hold one bias per weight \(2\), got 1"),
    "first layer width": (lambda p: _bad(p, weights=[p.weights[0][:, :-1], p.weights[1]]),
                          r"weights\[0\] must have the nn.Linear layout \(out_features, 7\) "
                          r"where in_features = dim \+ 1 \(the time column\), got shape \[9, 6\]"),
    "broken chain": (lambda p: _bad(p, weights=[p.weights[0], p.weights[1][:, :4]]),
                     r"weights\[1\] must have the nn.Linear layout \(out_features, 9\), got shape \[6, 4\]"),
    "last layer width": (lambda p: _bad(p, weights=[p.weights[0], p.weights[1][:5]], biases=[p.biases[0], p.biases[1][:5]]),
                         r"weights\[1\] is the last layer and must output dim = 6 features, got shape \[5, 9\]"),
    "bias shape": (lambda p: _bad(p, biases=[p.biases[0][:3], p.biases[1]]),
                   r"biases\[0\] must have shape \(9,\) to match weights\[0\], got shape \[3\]"),
    "weight dtype": (lambda p: _bad(p, weights=[p.weights[0].double(), p.weights[1]]),
                     r"weights\[0\] must be float32, got Double"),
    "table rank": (lambda p: _bad(p, sqrt_recip_alphas=p.sqrt_recip_alphas[:, None]),
                   r"sqrt_recip_alphas must be a non-empty 1-D table, got shape \[50, 1\]"),
    "table lengths": (lambda p: _bad(p, coef_eps=p.coef_eps[:40]),
                      r"coef_eps must be 1-D with the length of sqrt_recip_alphas \(50\), got shape \[40\]"),
    "table dtype": (lambda p: _bad(p, coef_eps=p.coef_eps.double()), r"coef_eps must be float32, got Double"),
    "negative steps": (lambda p: _bad(p, num_steps=-1), r"num_steps must be >= 0, got -1"),
    "zero total": (lambda p: _bad(p, total_timesteps=0), r"total_timesteps must be >= 1 \(it divides t\), got 0"),
    "t too large": (lambda p: _bad(p, t_start=torch.tensor([3, 49, 50, 7], device=p.x.device)),
                    r"t_start out of range: .* must lie in .* = \[2, 49\] .* got t_start in \[3, 50\]"),
    "t too small": (lambda p: _bad(p, t_start=torch.tensor([3, 1, 20, 7], device=p.x.device)),
                    r"t_start out of range: .* must lie in .* = \[2, 49\] .* got t_start in \[1, 20\]"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_names_argument_expectation_and_value(case):
    problem = make_problem(4, 6, [9], 3, total_timesteps=50)
    make_args, message = BAD_INPUTS[case]
    with pytest.raises(RuntimeError, match=message):
        ddpm_ops.fused_sample(*make_args(problem))


def test_bad_precision_is_named():
    problem = make_problem(2, 3, [4], 2)
    with pytest.raises(RuntimeError, match=r'precision must be one of "fp32", "tf32", "bf16", got "fp64"'):
        ddpm_ops.fused_sample(*problem.args(), precision="fp64")


@requires_cuda
def test_device_mismatch_is_named():
    problem = make_problem(4, 6, [9], 3, device="cuda")
    args = _bad(problem, weights=[problem.weights[0].cpu(), problem.weights[1]])
    with pytest.raises(RuntimeError, match=r"weights\[0\] must be on x's device cuda:0, got cpu"):
        ddpm_ops.fused_sample(*args)
    args = _bad(problem, t_start=problem.t_start.cpu())
    with pytest.raises(RuntimeError, match=r"t_start must be on x's device cuda:0, got cpu"):
        ddpm_ops.fused_sample(*args)


@requires_cuda
def test_cuda_out_of_range_rows_are_nan_and_validate_raises():
    problem = make_problem(6, 8, [16], 4, device="cuda", total_timesteps=100)
    problem.t_start[1] = 2      # step 3 would use timestep -1
    problem.t_start[4] = 100    # beyond the tables
    out = ddpm_ops.fused_sample(*problem.args())
    bad = torch.tensor([1, 4])
    good = torch.tensor([0, 2, 3, 5])
    assert torch.isnan(out[bad]).all()
    ref = make_ref_rows(problem, good)
    assert relative_error(out[good.cuda()], ref) <= TOLERANCE
    with pytest.raises(RuntimeError, match=r"t_start out of range"):
        ddpm_ops.fused_sample(*problem.args(), validate=True)


def make_ref_rows(problem, rows):
    """The float64 reference for the samples ``rows`` of ``problem`` alone."""
    rows = rows.to(problem.x.device)
    sub = dataclasses.replace(problem, x=problem.x[rows], t_start=problem.t_start[rows])
    return sub.reference64()


@pytest.mark.parametrize("device", DEVICES)
def test_refuses_inputs_that_require_grad(device):
    problem = make_problem(3, 4, [8], 2, device=device)
    problem.weights[0].requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"inference-only .* weights\[0\] requires grad"):
        ddpm_ops.fused_sample(*problem.args())
    with torch.no_grad():
        out = ddpm_ops.fused_sample(*problem.args())
    assert not out.requires_grad
    assert relative_error(out, problem.reference64()) <= TOLERANCE


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch,dim,hidden,num_steps", [(5, 6, [11, 13], 3), (2, 1, [], 0), (33, 64, [256, 256], 16)])
def test_opcheck(device, batch, dim, hidden, num_steps):
    problem = make_problem(batch, dim, hidden, num_steps, device=device, t_dtype=torch.int32)
    opcheck(torch.ops.ddpm.fused_sample.default, problem.args())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph(device, dynamic):
    torch._dynamo.reset()
    problem = make_problem(7, 5, [12, 10], 4, device=device)
    _, t_start, weights, biases, c1, c2, num_steps, total = problem.args()

    def sample(x, t):
        return ddpm_ops.fused_sample(x, t, weights, biases, c1, c2, num_steps, total)

    compiled = torch.compile(sample, fullgraph=True, dynamic=dynamic)
    for batch in (7, 11):
        x = torch.randn(batch, 5, device=device)
        t = torch.randint(num_steps - 1, total, (batch,), device=device)
        torch.testing.assert_close(compiled(x, t), sample(x, t), rtol=0, atol=0)


EXPORT_SCRIPT = textwrap.dedent("""
    import sys, torch
    import ddpm_ops  # resolves torch.ops.ddpm.fused_sample for the loader
    program = torch.export.load(sys.argv[1])
    x, t = torch.load(sys.argv[2])
    torch.save(program.module()(x, t), sys.argv[3])
""")


@pytest.mark.parametrize("device", DEVICES)
def test_export_save_load_in_fresh_process(tmp_path, device):
    problem = make_problem(6, 4, [10, 9], 5, device=device)
    sampler = ddpm_ops.FusedDDPMSampler(
        torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.SiLU(), torch.nn.Linear(10, 9),
                            torch.nn.SiLU(), torch.nn.Linear(9, 4)),
        problem.sqrt_recip_alphas, problem.coef_eps, problem.num_steps, problem.total_timesteps,
    ).to(device).requires_grad_(False)
    exported = torch.export.export(sampler, (problem.x, problem.t_start))
    assert any(node.target is torch.ops.ddpm.fused_sample.rule for node in exported.graph.nodes)
    torch.export.save(exported, tmp_path / "sampler.pt2")
    torch.save((problem.x, problem.t_start), tmp_path / "inputs.pt")
    subprocess.run([sys.executable, "-c", EXPORT_SCRIPT, str(tmp_path / "sampler.pt2"),
                    str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")], check=True)
    with torch.no_grad():
        expected = sampler(problem.x, problem.t_start)
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), expected, rtol=0, atol=0)
