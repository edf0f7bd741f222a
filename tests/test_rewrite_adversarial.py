"""Adversarial probes of the torch.compile / torch.export rewrite (ddpm_ops/graph_pass.py).

Each model is a near variant of the plain sampling loop (ddpm_ops.reference). The compiled (or fused
exported) result must equal eager (1e-5 relative) whether or not the pass
rewrote it; ``FUSED`` says how many ``ddpm::fused_sample`` calls are expected.

Two groups at the end are reproductions of wrong rewrites (they fail until
graph_pass.py is fixed):

* ``test_sum_form_linear_is_not_a_matmul``: ``(inp.T * W.T).sum(0, keepdim=True) + b``
  is accepted as a Linear (the batch-1 addmm decomposition) although for
  batch == out_features it is a per-row dot product of shape (1, out).
* ``test_export_training_ir_inplace_mutation``: in the non-functional default
  IR of ``torch.export`` the fused op is inserted at the last step's output,
  after in-place mutations of its operands (``t -= 1``, ``x0.mul_``).
"""
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code

import ddpm_ops
from test_rewrite_models import relative_error, tables

FUSED_CALL = re.compile(r"torch\.ops\.ddpm\.fused_sample\.(default|rule)\(")


@pytest.fixture(autouse=True)
def fresh_compile():
    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()


class Base(nn.Module):
    """Tiny MLP + tables; subclasses write the loop."""

    def __init__(self, dim=3, hidden=(8,), K=3, T=1000, bias=True):
        super().__init__()
        self.K, self.T, self.dim = K, T, dim
        self.eps_net = ddpm_ops.silu_mlp([dim + 1, *hidden, dim], bias=bias)
        sra, ce = tables(T)
        self.register_buffer("sra", sra)
        self.register_buffer("ce", ce)

    def tcol(self, t, T=None):
        return (t.float() / (self.T if T is None else T))[:, None]

    @staticmethod
    def col(table, t):
        return table[t].view(-1, 1)

    def step(self, x, ti, *, c1_tab=None, c2_tab=None):
        eps = self.eps_net(torch.cat([x, self.tcol(ti)], 1))
        c1 = self.col(self.sra if c1_tab is None else c1_tab, ti)
        c2 = self.col(self.ce if c2_tab is None else c2_tab, ti)
        return c1 * (x - c2 * eps)


# ----------------------------------------------------------------------------- variants

class Reference(Base):
    def forward(self, x, t):
        for k in range(self.K):
            x = self.step(x, t - k)
        return x


class FloatT(Base):
    """T written as 1000.0: same numbers, rewritten."""

    def forward(self, x, t):
        for k in range(self.K):
            ti = t - k
            eps = self.eps_net(torch.cat([x, (ti.float() / 1000.0)[:, None]], 1))
            x = self.col(self.sra, ti) * (x - self.col(self.ce, ti) * eps)
        return x


class OtherT(Base):
    """Time column divided by 500 while the tables have 1000 rows: T=500 is passed."""

    def forward(self, x, t):
        for k in range(self.K):
            ti = t - k
            eps = self.eps_net(torch.cat([x, self.tcol(ti, 500)], 1))
            x = self.col(self.sra, ti) * (x - self.col(self.ce, ti) * eps)
        return x


class NegativeT(Base):
    def forward(self, x, t):
        for k in range(self.K):
            ti = t - k
            eps = self.eps_net(torch.cat([x, self.tcol(ti, -1000)], 1))
            x = self.col(self.sra, ti) * (x - self.col(self.ce, ti) * eps)
        return x


class SwappedTables(Base):
    """coef_eps as c1 and sqrt_recip_alphas as c2: the op must get them by role."""

    def forward(self, x, t):
        for k in range(self.K):
            x = self.step(x, t - k, c1_tab=self.ce, c2_tab=self.sra)
        return x


class TablesAtTPlusOne(Base):
    """Tables indexed by t + 1, time column by t: two timesteps a step, left alone."""

    def forward(self, x, t):
        for k in range(self.K):
            ti = t - k
            eps = self.eps_net(torch.cat([x, self.tcol(ti)], 1))
            x = self.col(self.sra, ti + 1) * (x - self.col(self.ce, ti + 1) * eps)
        return x


class DistributedC1(Base):
    """c1 * x - c2 * eps (other math, affine all the same): one op."""

    def forward(self, x, t):
        for k in range(self.K):
            ti = t - k
            eps = self.eps_net(torch.cat([x, self.tcol(ti)], 1))
            x = self.col(self.sra, ti) * x - self.col(self.ce, ti) * eps
        return x


class ReversedDifference(Base):
    """c1 * (c2 * eps - x): affine, one op."""

    def forward(self, x, t):
        for k in range(self.K):
            ti = t - k
            eps = self.eps_net(torch.cat([x, self.tcol(ti)], 1))
            x = self.col(self.sra, ti) * (self.col(self.ce, ti) * eps - x)
        return x


class TimeFirstCat(Base):
    """cat([t_col, x]): the sample in another piece, one op."""

    def forward(self, x, t):
        for k in range(self.K):
            ti = t - k
            eps = self.eps_net(torch.cat([self.tcol(ti), x], 1))
            x = self.col(self.sra, ti) * (x - self.col(self.ce, ti) * eps)
        return x


class NoBias(Reference):
    """Every Linear built with bias=False: the op gets zeros for its biases, one op."""

    def __init__(self):
        super().__init__(bias=False)


class Gelu(Reference):
    def __init__(self):
        super().__init__()
        self.eps_net[1] = nn.GELU()


class SiluAfterLast(Base):
    def forward(self, x, t):
        for k in range(self.K):
            ti = t - k
            eps = F.silu(self.eps_net(torch.cat([x, self.tcol(ti)], 1)))
            x = self.col(self.sra, ti) * (x - self.col(self.ce, ti) * eps)
        return x


class TwoStepsBack(Base):
    """The update subtracts from the x of two steps back: no loop of one sample; each network
    applied with its own update, the older sample added as a given term (two ops)."""

    def forward(self, x, t):
        prev = x
        for k in range(self.K):
            ti = t - k
            eps = self.eps_net(torch.cat([x, self.tcol(ti)], 1))
            new = self.col(self.sra, ti) * (prev - self.col(self.ce, ti) * eps)
            prev, x = x, new
        return x


class StepsUp(Base):
    """t + k: the timesteps rise, not one function of t_start - k: left alone."""

    def forward(self, x, t):
        for k in range(self.K):
            x = self.step(x, t + k)
        return x


class Alternating(Base):
    """Two networks alternating: each step fused alone with its own weights."""

    def __init__(self):
        super().__init__()
        self.other = Base().eps_net

    def forward(self, x, t):
        for k in range(self.K):
            ti = t - k
            net = self.eps_net if k % 2 == 0 else self.other
            eps = net(torch.cat([x, self.tcol(ti)], 1))
            x = self.col(self.sra, ti) * (x - self.col(self.ce, ti) * eps)
        return x


class InplaceUpdates(Base):
    """x.sub_(...).mul_(...) on a clone and t -= 1: functionalized, one op."""

    def forward(self, x, t):
        x, t = x.clone(), t.clone()
        for _ in range(self.K):
            eps = self.eps_net(torch.cat([x, self.tcol(t)], 1))
            c1, c2 = self.col(self.sra, t), self.col(self.ce, t)
            t -= 1
            x.sub_(c2 * eps).mul_(c1)
        return x


class Int32Time(Base):
    def forward(self, x, t):
        t = t.int()
        for k in range(self.K):
            x = self.step(x, t - k)
        return x


# name -> (model factory, expected number of fused calls)
CASES = {
    "reference": (Reference, 1),
    "float_T": (FloatT, 1),
    "other_T": (OtherT, 1),
    "negative_T": (NegativeT, 1),
    "swapped_tables": (SwappedTables, 1),
    "tables_at_t_plus_1": (TablesAtTPlusOne, 0),
    "c1x_minus_c2eps": (DistributedC1, 1),
    "c2eps_minus_x": (ReversedDifference, 1),
    "time_first_cat": (TimeFirstCat, 1),
    "no_bias": (NoBias, 1),
    "gelu": (Gelu, 1),
    "silu_after_last": (SiluAfterLast, 0),
    "two_steps_back": (TwoStepsBack, 2),
    "steps_up": (StepsUp, 0),
    "alternating_nets": (Alternating, 3),
    "inplace_updates": (InplaceUpdates, 1),
    "int32_t": (Int32Time, 1),
}


def assert_left_alone(model, args, reason, caplog):
    """Compiled, ``model(*args)`` keeps eager's numbers with no fused call, and the rewrite
    logs that it left the loop alone for ``reason``."""
    import logging

    with torch.no_grad():
        ref = model(*args)
    with caplog.at_level(logging.DEBUG, logger="ddpm_ops.rewrite"):
        out, code = compile_run(model, *args)
    assert not FUSED_CALL.findall(code)
    assert relative_error(out, ref) < 1e-5
    lines = [r.getMessage() for r in caplog.records if r.name == "ddpm_ops.rewrite"]
    assert any("left alone" in m and reason in m for m in lines), lines


def make_inputs(model, batch=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, model.dim, generator=g)
    t = torch.randint(model.K + 2, model.T - model.K - 2, (batch,), generator=g)
    return x, t


def compile_run(model, *args):
    with torch.no_grad():
        args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        out, code = run_and_get_code(torch.compile(model), *args)
    return out, "\n".join(code)


@pytest.mark.parametrize("case", sorted(CASES))
def test_variant_compiled_equals_eager(case):
    factory, expected = CASES[case]
    model = factory().eval()
    x, t = make_inputs(model)
    with torch.no_grad():
        ref = model(x.clone(), t.clone())
    out, code = compile_run(model, x, t)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert relative_error(out, ref) < 1e-5
    assert len(FUSED_CALL.findall(code)) == expected, code


@pytest.mark.parametrize("case", ["reference", "swapped_tables", "two_steps_back", "other_T", "no_bias"])
def test_variant_exported_equals_eager(case):
    model = CASES[case][0]().eval()
    x, t = make_inputs(model)
    with torch.no_grad():
        ref = model(x, t)
    ep = torch.export.export(model, (x, t))
    for prog in (ep, ep.run_decompositions()):
        fused = ddpm_ops.fuse_exported_program(prog)
        assert any(n.target is torch.ops.ddpm.fused_sample.rule for n in fused.graph.nodes)
        with torch.no_grad():
            assert relative_error(fused.module()(x, t), ref) < 1e-5


# ----------------------------------------------------------------------------- wrong rewrites (reproductions)

class SumFormLinear(Base):
    """One layer written as ``(inp.T * W.T).sum(0, keepdim=True) + b``.

    For batch 1 that is ``inp @ W.T + b`` (inductor's own decomposition of a
    one-row addmm), but for batch == out_features the ``*`` is elementwise:
    the result is (1, out) with ``eps[0, j] = inp[j] . W[j] + b[j]``, which the
    update then broadcasts over the batch. The fused op computes a real Linear.
    """

    def __init__(self):
        super().__init__(dim=4, hidden=())

    def forward(self, x, t):
        lin = self.eps_net[0]
        for k in range(self.K):
            ti = t - k
            inp = torch.cat([x, self.tcol(ti)], 1)
            eps = (inp.t() * lin.weight.t()).sum(0, keepdim=True) + lin.bias
            x = self.col(self.sra, ti) * (x - self.col(self.ce, ti) * eps)
        return x


def test_sum_form_linear_is_not_a_matmul():
    model = SumFormLinear().eval()
    x, t = make_inputs(model, batch=4)  # batch == dim == out_features of the only layer
    with torch.no_grad():
        ref = model(x, t)
    out, code = compile_run(model, x, t)
    assert relative_error(out, ref) < 1e-5, (
        f"fused calls: {len(FUSED_CALL.findall(code))}, error {relative_error(out, ref):.2e}")


class InplaceTimeBeforeUpdate(Base):
    """``t -= 1`` between the table lookups and the update (export keeps ``sub_``)."""

    def forward(self, x, t):
        t = t.clone()
        for _ in range(self.K):
            eps = self.eps_net(torch.cat([x, self.tcol(t)], 1))
            c1, c2 = self.col(self.sra, t), self.col(self.ce, t)
            t -= 1
            x = c1 * (x - c2 * eps)
        return x


class InplaceFirstX(Base):
    """The first x is scaled in place after step 0 read it (export keeps ``mul_``)."""

    def forward(self, x, t):
        x = x.clone()
        x0 = x
        for k in range(self.K):
            x = self.step(x, t - k)
            if k == 0:
                x0.mul_(3.0)
        return x


@pytest.mark.parametrize("case", ["inplace_t", "inplace_first_x"])
def test_export_training_ir_inplace_mutation(case):
    model = {"inplace_t": InplaceTimeBeforeUpdate, "inplace_first_x": InplaceFirstX}[case]().eval()
    x, t = make_inputs(model)
    with torch.no_grad():
        ref = model(x.clone(), t.clone())
    ep = torch.export.export(model, (x.clone(), t.clone()))  # default IR: not functional
    fused = ddpm_ops.fuse_exported_program(ep)
    with torch.no_grad():
        out = fused.module()(x.clone(), t.clone())
    assert relative_error(out, ref) < 1e-5


@pytest.mark.parametrize("case", ["inplace_t", "inplace_first_x"])
def test_inplace_mutation_compiled_equals_eager(case):
    """The same models under torch.compile (functionalized graph): correct."""
    model = {"inplace_t": InplaceTimeBeforeUpdate, "inplace_first_x": InplaceFirstX}[case]().eval()
    x, t = make_inputs(model)
    with torch.no_grad():
        ref = model(x.clone(), t.clone())
    out, code = compile_run(model, x, t)
    assert relative_error(out, ref) < 1e-5
    assert len(FUSED_CALL.findall(code)) == 1, code


class CroppedHidden(Base):
    """The last Linear drops its last input unit: ``F.pad`` with a negative pad
    crops both operands of an addmm (the same ATen node pad_mm's zero padding
    uses, with the opposite meaning)."""

    def __init__(self):
        super().__init__(dim=4, hidden=(16,))

    def forward(self, x, t):
        first, last = self.eps_net[0], self.eps_net[2]
        for k in range(self.K):
            ti = t - k
            h = F.silu(first(torch.cat([x, self.tcol(ti)], 1)))
            eps = torch.addmm(last.bias, F.pad(h, (0, -1)), F.pad(last.weight.t(), (0, 0, 0, -1)))
            x = self.col(self.sra, ti) * (x - self.col(self.ce, ti) * eps)
        return x


class CroppedRows(Base):
    """The first Linear sees only the first row (``F.pad(inp, (0, 0, 0, -1))``
    at batch 2); its one-row output broadcasts over the batch."""

    def __init__(self):
        super().__init__(dim=16, hidden=(64,))

    def forward(self, x, t):
        first = self.eps_net[0]
        for k in range(self.K):
            ti = t - k
            inp = torch.cat([x, self.tcol(ti)], 1)
            h = torch.addmm(first.bias, F.pad(inp, (0, 0, 0, -1)), first.weight.t())
            eps = self.eps_net[2](F.silu(h))
            x = self.col(self.sra, ti) * (x - self.col(self.ce, ti) * eps)
        return x


@pytest.mark.parametrize("model_class", [CroppedHidden, CroppedRows])
def test_negative_padding_is_not_stripped(model_class):
    model = model_class().eval()
    x, t = make_inputs(model, batch=2)
    with torch.no_grad():
        ref = model(x, t)
    out, code = compile_run(model, x, t)
    assert relative_error(out, ref) < 1e-5, (
        f"fused calls: {len(FUSED_CALL.findall(code))}, error {relative_error(out, ref):.2e}")


# ----------------------------------------------------------------------------- a term v * 0

class ZeroTimesPrior(Base):
    """CleanDiffuser's ``fix_mask`` blend at its default: ``+ prior * factor`` after every step
    (``factor`` a literal of the graph). ``prior * 0.`` is +-0 where ``prior`` is finite and NaN
    where it is not."""

    def __init__(self, factor=0.0, K=3, activation="silu"):
        super().__init__(K=K)
        self.factor = factor
        if activation == "relu":
            self.eps_net = nn.Sequential(nn.Linear(self.dim + 1, 8), nn.ReLU(), nn.Linear(8, self.dim))

    def forward(self, x, t, prior):
        for k in range(self.K):
            x = self.step(x, t - k) + prior * self.factor
        return x


def _prior_with_inf_and_nan(batch, dim, row=1):
    prior = torch.randn(batch, dim)
    prior[row, 0], prior[row, 1] = float("inf"), float("nan")
    return prior


@pytest.mark.parametrize("activation", ["silu", "relu"])
@pytest.mark.parametrize("K", [1, 3])
def test_zero_times_a_prior_fuses_with_eagers_nan_rows(K, activation):
    """``+ prior * 0.`` every step is fused as ``op(x + c) + c`` (``op(x) + c`` for one step),
    ``c = prior * 0.`` once a call: a prior holding inf and NaN in one row gives eager's NaN
    entries there (the whole row from the second step on), the other rows eager's numbers."""
    model = ZeroTimesPrior(K=K, activation=activation).eval()
    x, t = make_inputs(model, batch=4)
    prior = _prior_with_inf_and_nan(4, model.dim)
    with torch.no_grad():
        ref = model(x.clone(), t.clone(), prior)
    out, code = compile_run(model, x, t, prior)
    assert len(FUSED_CALL.findall(code)) == 1, code
    assert torch.equal(out.isnan(), ref.isnan())
    assert ref[1].isnan().all() if K > 1 else ref[1, :2].isnan().all() and not ref[1, 2:].isnan().any()
    finite = ~ref.isnan().any(1)
    assert finite.sum() == 3
    assert relative_error(out[finite], ref[finite]) < 1e-5
    # A finite prior: eager's numbers.
    with torch.no_grad():
        ref = model(x.clone(), t.clone(), torch.zeros(4, model.dim))
    out, _ = compile_run(model, x, t, torch.zeros(4, model.dim))
    assert relative_error(out, ref) < 1e-5


def test_zero_times_a_broadcast_prior_fuses_with_eagers_nan_columns():
    """A prior of one value per column (``(dim,)``): its NaN column is NaN in every row."""
    model = ZeroTimesPrior().eval()
    x, t = make_inputs(model, batch=4)
    prior = torch.tensor([0.5, float("nan"), -1.0])
    with torch.no_grad():
        ref = model(x.clone(), t.clone(), prior)
    out, code = compile_run(model, x, t, prior)
    assert len(FUSED_CALL.findall(code)) == 1, code
    assert out.isnan().all() and ref.isnan().all()
    with torch.no_grad():
        ref = model(x.clone(), t.clone(), prior.nan_to_num())
    out, _ = compile_run(model, x, t, prior.nan_to_num())
    assert relative_error(out, ref) < 1e-5


class LastStepZero(Base):
    """The last step alone adds ``v * 0.`` (``std * (noise if t > 0 else 0.)`` with a Python-int
    ``t``); ``v``: "table" (a buffer's value at the step: finite), "table_inf" (the same buffer
    holding inf there) or "prior" (an input)."""

    def __init__(self, v="table"):
        super().__init__(K=3)
        self.v = v
        std = torch.linspace(0.1, 0.3, self.T)
        if v == "table_inf":
            std[: self.T // 2] = float("inf")
        self.register_buffer("std", std)

    def forward(self, x, t_start: int, prior, noise):
        for k in range(self.K):
            t = torch.full((x.shape[0],), t_start - k)
            x = self.step(x, t)
            z = noise[k] if k < self.K - 1 else 0.0
            x = x + (prior if self.v == "prior" else self.col(self.std, t)) * z
        return x


def _last_step_zero_inputs(model, batch=4):
    x, _ = make_inputs(model, batch=batch)
    # The last step reads the table at T // 2 - 1: its inf where it holds one.
    return x, model.T // 2 + model.K - 2, torch.randn(batch, model.dim), torch.randn(model.K, batch, model.dim)


def test_a_zero_term_in_the_last_step_alone_fuses_where_it_is_finite():
    """``std * 0.`` where ``std`` is a buffer's finite value is +-0: dropped, one fused call with
    eager's numbers (the other steps add their noise)."""
    model = LastStepZero("table").eval()
    args = _last_step_zero_inputs(model)
    with torch.no_grad():
        ref = model(*args)
        without_noise = model(args[0], args[1], args[2], torch.zeros_like(args[3]))
    out, code = compile_run(model, *args)
    assert len(FUSED_CALL.findall(code)) == 1, code
    assert relative_error(out, ref) < 1e-5
    assert relative_error(without_noise, ref) > 1e-3


@pytest.mark.parametrize("v, reason", [
    ("table_inf", "a term v * 0, and others add none"),
    ("prior", "a term v * 0, and others add none"),
])
def test_a_zero_term_in_the_last_step_alone_not_proved_finite_is_left_alone(v, reason, caplog):
    """``v * 0.`` in the last step alone, where ``v`` holds inf (eager's row turns NaN) or is an
    input (its values are not known when the loop is compiled): left alone with eager's numbers."""
    import logging

    model = LastStepZero(v).eval()
    args = _last_step_zero_inputs(model)
    with torch.no_grad():
        ref = model(*args)
    with caplog.at_level(logging.DEBUG, logger="ddpm_ops.rewrite"):
        out, code = compile_run(model, *args)
    assert not FUSED_CALL.findall(code)
    assert torch.equal(out.isnan(), ref.isnan()) and ref.isnan().all() == (v == "table_inf")
    finite = ~ref.isnan().any(1)
    assert relative_error(out[finite], ref[finite]) < 1e-5
    lines = [r.getMessage() for r in caplog.records if r.name == "ddpm_ops.rewrite"]
    assert any("left alone" in m and reason in m for m in lines), lines


def test_half_a_prior_is_left_alone_and_says_why(caplog):
    """``+ prior * 0.5``: a term without x or e that is no noise draw (it is read as one only
    where nothing else is) next to the step's draw: left alone with its reason."""
    class HalfPriorWithNoise(ZeroTimesPrior):
        def forward(self, x, t, prior, noise):
            for k in range(self.K):
                x = self.step(x, t - k) + 0.1 * noise[k] + prior * self.factor
            return x

    model = HalfPriorWithNoise(factor=0.5).eval()
    x, t = make_inputs(model, batch=4)
    args = (x, t, torch.randn(4, model.dim), torch.randn(model.K, 4, model.dim))
    assert_left_alone(model, args, "a term without x or e that is not one noise draw of the sample's shape", caplog)


# ----------------------------------------------------------------------------- an x0 clamp written on eps

class EpsClip(Base):
    """CleanDiffuser's predict-noise clip: eps clamped to ``((x - alpha * x_max) / sigma,
    (x - alpha * x_min) / sigma)``, the clamp of x0 = (x - sigma * eps) / alpha to ``(x_min,
    x_max)`` written on eps, then a DDIM-like update with noise given as a tensor. ``bounds``:
    "columns" ((dim,) buffers), "scalars" (Python floats), "upper" (``x_min`` None: eps bounded
    below only, x0 above only), "rows" ((B, dim) inputs) or "unit" (bounds written without the
    unit factor: ``(x - alpha) / sigma`` and ``(x + alpha) / sigma``, x0 clamped to (-1, 1));
    ``x_coef`` scales x in the lower bound only; ``sigma_sign`` -1 makes the sigma table
    negative; ``x0_clip`` clamps the x0 computed from the clamped eps again."""

    def __init__(self, bounds="columns", x_coef=1.0, sigma_sign=1.0, x0_clip=False, K=3):
        super().__init__(K=K)
        self.bounds, self.x_coef, self.x0_clip = bounds, x_coef, x0_clip
        ac = torch.cumprod(1 - torch.linspace(1e-4, 0.02, self.T), 0)
        alpha, sigma = ac.sqrt(), sigma_sign * (1 - ac).sqrt()
        self.register_buffer("alpha", alpha)
        self.register_buffer("sigma", sigma)
        self.register_buffer("alpha_prev", torch.cat([torch.ones(1), alpha[:-1]]))
        self.register_buffer("sigma_prev", torch.cat([torch.zeros(1), sigma[:-1]]))
        if bounds in ("columns", "upper"):
            self.register_buffer("x_max", torch.tensor([1.0, 0.5, 2.0]))
            self.register_buffer("x_min", -torch.tensor([1.0, 2.0, 0.5]))
        else:
            self.x_max, self.x_min = 1.0, -1.0
        self.hits = 0

    def forward(self, x, t, noise, x_max=None, x_min=None):
        x_max = self.x_max if x_max is None else x_max
        x_min = self.x_min if x_min is None else x_min
        for k in range(self.K):
            ti = t - k
            a, s = self.col(self.alpha, ti), self.col(self.sigma, ti)
            a_prev, s_prev = self.col(self.alpha_prev, ti), self.col(self.sigma_prev, ti)
            eps = self.eps_net(torch.cat([x, self.tcol(ti)], 1))
            if self.bounds == "unit":
                lo, hi = (self.x_coef * x - a) / s, (x + a) / s
            else:
                lo = (self.x_coef * x - a * x_max) / s
                hi = None if self.bounds == "upper" else (x - a * x_min) / s
            if not torch.compiler.is_compiling():
                self.hits += int(((eps < lo) | (eps > (lo.abs() + eps.abs() + 1 if hi is None else hi))).sum())
            eps = eps.clip(lo, hi)
            x0 = (x - s * eps) / a
            if self.x0_clip:
                x0 = x0.clamp(-1.0, 1.0)
            x = a_prev * x0 + 0.5 * s_prev * eps + 0.1 * noise[k]
        return x


def _eps_clip_inputs(model, batch=16, scale=1.0):
    x, t = make_inputs(model, batch=batch)
    return x * scale, t, torch.randn(model.K, batch, model.dim, generator=torch.Generator().manual_seed(1)) * scale


@pytest.mark.parametrize("bounds", ["columns", "scalars", "upper", "unit"])
def test_eps_clamped_to_x0_bounds_fuses_with_eagers_numbers(bounds):
    """The clamp of eps between ``(x - alpha * x_max) / sigma`` and ``(x - alpha * x_min) / sigma``
    is the clamp of x0 to ``(x_min, x_max)``: one fused call, eager's numbers (noise given)."""
    model = EpsClip(bounds=bounds).eval()
    args = _eps_clip_inputs(model, scale=3.0)
    with torch.no_grad():
        ref = model(*args)
    assert model.hits > 0  # some entries are clamped
    out, code = compile_run(model, *args)
    assert len(FUSED_CALL.findall(code)) == 1, code
    assert relative_error(out, ref) < 1e-5


def test_eps_clamped_to_x0_bounds_with_most_samples_clamped_keeps_eagers_numbers():
    """Large noise: most entries hit a bound at every step; still eager's numbers."""
    model = EpsClip().eval()
    args = _eps_clip_inputs(model, batch=64, scale=30.0)
    with torch.no_grad():
        ref = model(*args)
    assert model.hits > 0.5 * model.K * 64 * model.dim
    out, code = compile_run(model, *args)
    assert len(FUSED_CALL.findall(code)) == 1, code
    assert relative_error(out, ref) < 1e-5


@pytest.mark.parametrize("variant, reason", [
    (dict(x_coef=2.0), "clamps e to bounds that read x with different coefficients"),
    (dict(bounds="unit", x_coef=2.0), "clamps e to bounds that read x with different coefficients"),
    (dict(sigma_sign=-1.0), "r = 1/B is not positive and finite at step index"),
    (dict(x0_clip=True), "already clamps its x0 (the op clamps x0 once)"),
    (dict(bounds="rows"), "is not a coefficient times a number or one float32 or float64 value per column"),
])
def test_eps_clamp_not_an_x0_clamp_is_left_alone_and_says_why(variant, reason, caplog):
    """An eps clamp whose bounds read x with another coefficient, a negative sigma table (the
    clamp of eps then is no clamp of x0), an x0 clamp besides, bounds with a batch dimension:
    eager's numbers, no fused call, the reason logged."""
    model = EpsClip(**variant).eval()
    args = _eps_clip_inputs(model)
    if variant.get("bounds") == "rows":
        args = (*args, torch.rand(16, model.dim) + 0.5, -torch.rand(16, model.dim) - 0.5)
    assert_left_alone(model, args, reason, caplog)
