"""The automatic torch.compile rewrite of DDPM sampling loops (ddpm_ops/graph_pass.py).

Every test compares the compiled model with eager float32 (1e-5 relative) and,
for the rewritten loops, with the float64 loop, on fresh random inputs. On
CUDA the post-grad graph differs from the CPU's; the "cuda" cases run there.
"""
import logging
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code

import ddpm_ops
from ddpm_ops import graph_pass
from test_rewrite_models import (
    DecayingWeightSampler,
    HelperSampler,
    LeakyEpsSampler,
    MismatchedTimestepSampler,
    NoisySampler,
    OneLayerSampler,
    ReluSampler,
    Sampler,
    ScaledEpsSampler,
    TrajectorySampler,
    WarmStartSampler,
    WrongTimeSampler,
    make_inputs,
    relative_error,
)

CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])
DEVICES = ["cpu", CUDA]

FUSED_CALL = re.compile(r"torch\.ops\.ddpm\.fused_sample\.(default|rule)\(")
MATMUL = re.compile(r"extern_kernels\.(mm|addmm|bmm|baddbmm)\b|aten\.(mm|addmm|bmm|linear)\b"
                    r"|_mkl_linear|mkldnn|tl\.dot|cpp_gemm|cublas")


@pytest.fixture(autouse=True)
def fresh_compile():
    """Every test compiles from scratch (the pass runs, logs, and is counted)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with inductor_config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()


def compile_run(model, *args, dynamic=None):
    """(compiled output, generated code) of ``torch.compile(model)(*args)`` without grad."""
    with torch.no_grad():
        out, code = run_and_get_code(torch.compile(model, dynamic=dynamic), *args)
    return out, "\n".join(code)


def fused_calls(code):
    return len(FUSED_CALL.findall(code))


def assert_fused_once(code):
    assert fused_calls(code) == 1, code
    assert not MATMUL.search(code), MATMUL.search(code)


def check_numbers(model, out, *args):
    """Compiled ``out`` equals eager float32 (1e-5) and the float64 loop (1e-4)."""
    with torch.no_grad():
        ref = model(*args)
        m64 = model.to(torch.float64)
        ref64 = m64(*[a.double() if a.is_floating_point() else a for a in args])
        model.to(torch.float32)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    refs64 = ref64 if isinstance(ref64, (tuple, list)) else (ref64,)
    for o, r, r64 in zip(outs, refs, refs64):
        assert o.dtype == r.dtype and o.shape == r.shape
        assert relative_error(o, r) < 1e-5
        assert relative_error(o, r64) < 1e-4
        assert relative_error(o, r) < 1e-5


# ----------------------------------------------------------------------------- 1. installed on import

def test_installed_on_import():
    current = inductor_config.post_grad_custom_pre_pass
    assert isinstance(current, ddpm_ops.DDPMSamplingRewrite)
    assert isinstance(current, torch._inductor.custom_graph_pass.CustomGraphPass)
    assert ddpm_ops.auto_rewrite_enabled()


def test_uuid_is_stable_and_covers_source(tmp_path, monkeypatch):
    a, b = graph_pass.DDPMSamplingRewrite(), graph_pass.DDPMSamplingRewrite()
    before = a.uuid()
    assert before == b.uuid() and before is not None
    hash(before)
    copy = tmp_path / "graph_pass.py"
    copy.write_bytes(graph_pass._SOURCE_FILES[0].read_bytes() + b"\n# edited\n")
    monkeypatch.setattr(graph_pass, "_SOURCE_FILES", (copy,))
    assert graph_pass.DDPMSamplingRewrite().uuid() != before


class UserPass(torch._inductor.custom_graph_pass.CustomGraphPass):
    def __init__(self):
        self.calls = 0

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return "user-pass-v1"


def test_chains_a_user_pass_and_disable_restores_it():
    user = UserPass()
    with inductor_config.patch(post_grad_custom_pre_pass=user):
        graph_pass.install()
        ours = inductor_config.post_grad_custom_pre_pass
        assert isinstance(ours, ddpm_ops.DDPMSamplingRewrite) and ours.chained is user
        assert "user-pass-v1" in str(ours.uuid())
        graph_pass.install()  # idempotent
        assert inductor_config.post_grad_custom_pre_pass is ours
        model = Sampler(num_steps=2)
        x, t = make_inputs(model)
        out, code = compile_run(model, x, t)
        assert user.calls >= 1
        assert_fused_once(code)
        check_numbers(model, out, x, t)
        ddpm_ops.disable_auto_rewrite()
        try:
            assert inductor_config.post_grad_custom_pre_pass is user
            assert not ddpm_ops.auto_rewrite_enabled()
        finally:
            ddpm_ops.enable_auto_rewrite()
        assert inductor_config.post_grad_custom_pre_pass.chained is user


def test_chained_pass_without_uuid_disables_caching():
    ours = graph_pass.DDPMSamplingRewrite(chained=lambda graph: None)
    assert ours.uuid() is None


@pytest.mark.parametrize("device", DEVICES)
def test_disable_auto_rewrite(device):
    model = Sampler(num_steps=2).to(device)
    x, t = make_inputs(model, device=device)
    ddpm_ops.disable_auto_rewrite()
    try:
        assert not ddpm_ops.auto_rewrite_enabled()
        out, code = compile_run(model, x, t)
    finally:
        ddpm_ops.enable_auto_rewrite()
    assert fused_calls(code) == 0
    check_numbers(model, out, x, t)


def test_rewrite_applies_in_other_threads():
    """torch keeps values assigned to inductor's config per thread; a worker
    thread (a server's) must compile with the rewrite as well."""
    import threading
    model = Sampler(dim=4, hidden=(16,), num_steps=3)
    x, t = make_inputs(model, batch=5)
    result = {}

    def worker():
        try:
            result["enabled"] = ddpm_ops.auto_rewrite_enabled()
            result["out"], result["code"] = compile_run(model, x, t)
        except BaseException as e:  # reported by the assertions below
            result["error"] = e

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert "error" not in result, result.get("error")
    assert result["enabled"]
    assert_fused_once(result["code"])
    check_numbers(model, result["out"], x, t)


def test_reload_does_not_install_twice():
    """importlib.reload of the package or of graph_pass keeps one rewrite,
    chained once in front of the user's pass, and it stays recognised."""
    script = textwrap.dedent("""
        import importlib
        from torch._inductor import config
        from torch._inductor.custom_graph_pass import CustomGraphPass
        class UserPass(CustomGraphPass):
            def __call__(self, graph): pass
            def uuid(self): return "user"
        config.post_grad_custom_pre_pass = UserPass()
        import ddpm_ops
        importlib.reload(ddpm_ops.graph_pass)
        importlib.reload(ddpm_ops)
        p = config.post_grad_custom_pre_pass
        print(type(p).__name__, type(p.chained).__name__, ddpm_ops.auto_rewrite_enabled())
        ddpm_ops.disable_auto_rewrite()
        print(type(config.post_grad_custom_pre_pass).__name__)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["DDPMSamplingRewrite", "UserPass", "True", "UserPass"]


def test_environment_variable_disables():
    script = "import ddpm_ops; print(ddpm_ops.auto_rewrite_enabled())"
    env = dict(os.environ, DDPM_OPS_DISABLE_AUTO_REWRITE="1")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


# ----------------------------------------------------------------------------- 2./3. real code, one op

REWRITTEN = {
    "reference": lambda: Sampler(dim=4, hidden=(16, 16), num_steps=3),
    "one_step": lambda: Sampler(dim=2, hidden=(8,), num_steps=1),
    "one_layer": lambda: OneLayerSampler(dim=3, num_steps=2),
    "deep_narrow": lambda: Sampler(dim=5, hidden=(7, 9, 3, 6), num_steps=2),
    "unsqueeze_to": lambda: Sampler(dim=4, hidden=(8,), num_steps=3, bcast="unsqueeze",
                                    tcast="to", cat_dim=-1),
    "view_plain_first": lambda: Sampler(dim=4, hidden=(8,), num_steps=2, bcast="view",
                                        first_plain=True, total_timesteps=200),
    "helpers": lambda: HelperSampler(dim=3, width=8, depth=3, steps=4, T=500),
    "int_true_div": lambda: Sampler(dim=4, hidden=(8,), num_steps=3, tcast="none"),
    "column_first_gather": lambda: Sampler(dim=4, hidden=(8,), num_steps=3, bcast="unsqueeze",
                                           tcast="column_first", lookup="gather"),
    # Not the README's network or step, but MLPs and affine updates all the same.
    "relu": lambda: ReluSampler(dim=3, hidden=(8,), num_steps=2),
    "eps_rescaled": lambda: ScaledEpsSampler(dim=3, hidden=(8,), num_steps=2),
    "time_divisor": lambda: WrongTimeSampler(dim=3, hidden=(8,), num_steps=2),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(REWRITTEN))
def test_loop_becomes_one_op(case, device):
    model = REWRITTEN[case]().to(device)
    x, t = make_inputs(model, batch=6, device=device)
    out, code = compile_run(model, x, t)
    assert_fused_once(code)
    check_numbers(model, out, x, t)


@pytest.fixture
def pad_mm_always(device):
    """Inductor's pad_mm pads every misaligned addmm (on CUDA it does so only
    when its benchmark says padding is faster, so the graph varies from run
    to run). On the CPU the pass is made to apply as it would on a GPU."""
    from torch._inductor.fx_passes import pad_mm
    with inductor_config.patch(force_shape_pad=True):
        if device == "cuda":
            yield
            return
        original = pad_mm.check_device, pad_mm.has_triton
        pad_mm.check_device, pad_mm.has_triton = (lambda a, b: True), (lambda: True)
        try:
            yield
        finally:
            pad_mm.check_device, pad_mm.has_triton = original


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["reference", "helpers", "deep_narrow"])
def test_padded_matmuls_still_one_op(case, device, pad_mm_always):
    model = REWRITTEN[case]().to(device)
    x, t = make_inputs(model, batch=6, device=device)
    out, code = compile_run(model, x, t)
    assert_fused_once(code)
    check_numbers(model, out, x, t)


@pytest.mark.parametrize("device", DEVICES)
def test_many_steps(device):
    model = Sampler(dim=3, hidden=(8,), num_steps=120).to(device)
    x, t = make_inputs(model, batch=4, device=device)
    steps_before = ddpm_ops.rewrite_stats()["steps_fused"]
    out, code = compile_run(model, x, t)
    assert_fused_once(code)
    assert ddpm_ops.rewrite_stats()["steps_fused"] - steps_before == 120
    check_numbers(model, out, x, t)


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_batch(device):
    model = Sampler(dim=4, hidden=(16,), num_steps=3).to(device)
    compiled = torch.compile(model, dynamic=True)
    for batch in (3, 7, 1):
        x, t = make_inputs(model, batch=batch, device=device)
        with torch.no_grad():
            out, code = run_and_get_code(compiled, x, t)
        if code:
            assert_fused_once("\n".join(code))
        check_numbers(model, out, x, t)


@pytest.mark.parametrize("device", DEVICES)
def test_int32_timesteps(device):
    model = Sampler(dim=4, hidden=(8,), num_steps=3).to(device)
    x, t = make_inputs(model, device=device, t_dtype=torch.int32)
    out, code = compile_run(model, x, t)
    assert_fused_once(code)
    check_numbers(model, out, x, t)


# ----------------------------------------------------------------------------- 3. near misses

NOT_REWRITTEN = {
    "timestep_mismatch": MismatchedTimestepSampler,
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(NOT_REWRITTEN))
def test_near_miss_left_alone(case, device):
    model = NOT_REWRITTEN[case](dim=3, hidden=(8,), num_steps=2).to(device)
    x, t = make_inputs(model, device=device)
    out, code = compile_run(model, x, t)
    assert fused_calls(code) == 0
    with torch.no_grad():
        assert relative_error(out, model(x, t)) < 1e-5


def test_float64_left_alone():
    model = Sampler(dim=3, hidden=(8,), num_steps=2).double()
    x, t = make_inputs(model, dtype=torch.float64)
    out, code = compile_run(model, x, t)
    assert fused_calls(code) == 0
    with torch.no_grad():
        assert relative_error(out, model(x, t)) < 1e-10


PARTIAL = {
    # model, expected number of fused ops
    "noise_between_steps": (NoisySampler, 1),  # the noise is the step's: one loop
    "trajectory": (TrajectorySampler, 3),  # every sample kept: each step a loop of its own
    "weights_change": (DecayingWeightSampler, 3),  # three networks, each applied once
    "intermediate_used": (LeakyEpsSampler, 2),   # steps {0} and {2}; step 1 stays
    "warm_start": (WarmStartSampler, 2),  # step 0 alone (1 layer), steps 1..2 from t_start - 1
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(PARTIAL))
def test_partial_rewrites_keep_meaning(case, device):
    cls, expected = PARTIAL[case]
    model = cls(dim=3, hidden=(8,), num_steps=3).to(device)
    x, t = make_inputs(model, device=device)
    args = (x, t)
    if cls is NoisySampler:
        args = (x, t, torch.randn(3, *x.shape, device=device))
    out, code = compile_run(model, *args)
    assert fused_calls(code) == expected, code
    check_numbers(model, out, *args)


# ----------------------------------------------------------------------------- 4. inference only

@pytest.mark.parametrize("device", DEVICES)
def test_training_graph_not_rewritten(device):
    model = Sampler(dim=3, hidden=(8,), num_steps=2).to(device)
    x, t = make_inputs(model, device=device)
    x.requires_grad_(True)
    out, code = run_and_get_code(torch.compile(model), x, t)
    code = "\n".join(code)
    assert fused_calls(code) == 0
    ref = model(x, t)
    assert relative_error(out, ref) < 1e-5
    grads = torch.autograd.grad(out.square().sum(), [x, *model.parameters()])
    grads_ref = torch.autograd.grad(ref.square().sum(), [x, *model.parameters()])
    for g, gr in zip(grads, grads_ref):
        assert relative_error(g, gr) < 1e-5


class NoInferenceFlag(torch._inductor.custom_graph_pass.CustomGraphPass):
    """The rewrite as torch versions without ``is_inference`` call it."""

    def __call__(self, graph):
        graph_pass.DDPMSamplingRewrite()(graph)

    def uuid(self):
        return None


def test_training_graph_not_rewritten_without_inference_flag():
    model = Sampler(dim=3, hidden=(8,), num_steps=2)
    x, t = make_inputs(model)
    with inductor_config.patch(post_grad_custom_pre_pass=NoInferenceFlag()):
        out, code = run_and_get_code(torch.compile(model), x, t)
        code = "\n".join(code)
        assert fused_calls(code) == 0
        grads = torch.autograd.grad(out.sum(), list(model.parameters()))
        ref = model(x, t)
        grads_ref = torch.autograd.grad(ref.sum(), list(model.parameters()))
        for g, gr in zip(grads, grads_ref):
            assert relative_error(g, gr) < 1e-5
        torch._dynamo.reset()
        out, code = compile_run(model, x, t)  # an inference graph is still rewritten
        assert_fused_once(code)


# ----------------------------------------------------------------------------- 8. visible

def test_logs_rewrite_and_near_miss(caplog):
    caplog.set_level(logging.DEBUG, logger="ddpm_ops")
    model = Sampler(dim=4, hidden=(16,), num_steps=3)
    x, t = make_inputs(model, batch=5)
    before = ddpm_ops.rewrite_stats()
    compile_run(model, x, t)
    infos = [r.getMessage() for r in caplog.records
             if r.name == "ddpm_ops.rewrite" and r.levelno == logging.INFO]
    assert len(infos) == 1
    assert "fused 3 steps into one ddpm::fused_sample.rule" in infos[0] and "(5, 4)" in infos[0] \
        and "2 layers" in infos[0]
    after = ddpm_ops.rewrite_stats()
    assert after["loops_fused"] - before["loops_fused"] == 1
    assert after["steps_fused"] - before["steps_fused"] == 3
    caplog.clear()
    torch._dynamo.reset()
    model = MismatchedTimestepSampler(dim=3, hidden=(8,), num_steps=2)
    compile_run(model, *make_inputs(model))
    debug = [r.getMessage() for r in caplog.records
             if r.name == "ddpm_ops.rewrite" and r.levelno == logging.DEBUG]
    left = [m for m in debug if m.startswith("ddpm_ops: rewrite: loop of 2 steps ending near ")
            and " left alone: " in m]
    assert len(left) == 1 and "offset" in left[0], debug
    assert not any(r.levelno == logging.INFO for r in caplog.records if r.name == "ddpm_ops.rewrite")


# ----------------------------------------------------------------------------- 5. cache-correct

CACHE_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    import ddpm_ops
    from torch._dynamo.utils import counters
    sys.path.insert(0, {tests!r})
    from test_rewrite_models import Sampler, make_inputs
    if sys.argv[1] == "off":
        ddpm_ops.disable_auto_rewrite()
    torch.manual_seed(0)
    model = Sampler(dim=4, hidden=(8,), num_steps=3)
    x, t = make_inputs(model, seed=1)
    compiled = torch.compile(model)
    with torch.no_grad():
        compiled(x, t)
    with torch.no_grad(), torch.profiler.profile() as prof:
        out = compiled(x, t)
    events = prof.events()
    names = [e.name for e in events]
    # The op runs its time network itself (matmuls inside its span): count the ones outside.
    spans = [e.time_range for e in events if e.name == "ddpm::fused_sample"]
    outside = [e for e in events if not any(s.start <= e.time_range.start and e.time_range.end <= s.end
                                            for s in spans)]
    with torch.no_grad():
        err = ((out - model(x, t)).norm() / model(x, t).norm()).item()
    print(json.dumps(dict(
        hit=counters["inductor"]["fxgraph_cache_hit"],
        miss=counters["inductor"]["fxgraph_cache_miss"],
        fused=names.count("ddpm::fused_sample"),
        mm=sum(e.name in ("aten::mm", "aten::addmm", "aten::linear") for e in outside),
        err=err)))
""")


def test_fx_graph_cache_hit_runs_fused_op(tmp_path):
    script = tmp_path / "compile_once.py"
    script.write_text(CACHE_SCRIPT.format(tests=os.path.dirname(__file__)))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"),
               TORCHINDUCTOR_FX_GRAPH_CACHE="1")
    env.pop("DDPM_OPS_DISABLE_AUTO_REWRITE", None)

    def run(mode):
        import json
        res = subprocess.run([sys.executable, str(script), mode], env=env, capture_output=True,
                             text=True)
        assert res.returncode == 0, res.stderr[-3000:]
        return json.loads(res.stdout.strip().splitlines()[-1])

    first = run("on")
    assert first["miss"] >= 1 and first["hit"] == 0 and first["fused"] == 1 and first["mm"] == 0
    second = run("on")
    assert second["hit"] >= 1 and second["miss"] == 0, second
    assert second["fused"] == 1 and second["mm"] == 0 and second["err"] < 1e-5
    off = run("off")  # another cache key: a miss, and the loop runs unfused
    assert off["miss"] >= 1 and off["hit"] == 0 and off["fused"] == 0, off
    assert off["err"] < 1e-5



def test_coefficients_expanded_to_the_sample_shape_fuse():
    """TabDDPM's DDIM step: ``extract`` expands each lookup to the sample's shape and the step
    square-roots it (``torch.sqrt(alpha_bar_prev)``): a coefficient of the sample's shape that is
    one number per row (affine._row_constant), read at row 0."""
    from loops.tabddpm import GaussianDDIMSampler
    torch.manual_seed(0)
    model = GaussianDDIMSampler(num_timesteps=5, d_in=3)
    args = (torch.randint(0, 3, (16,)), torch.randn(6, 16, 3))
    out, code = compile_run(model, *args)
    with torch.no_grad():
        assert relative_error(out, model(*args)) < 1e-5
    assert_fused_once(code)


def test_timesteps_filled_from_a_0d_tensor_are_shared_by_the_batch():
    """``torch.full((B,), ts[i])`` with ``ts[i]`` a 0-d element of a long tensor (DPPO's DDIM
    iterates its ``ddim_t`` tensor) lowers to ``copy(empty, select)``: every row the same value
    (tables._uniform), so the loop's tables are shared."""
    from loops.dppo import DPPOEval
    torch.manual_seed(0)
    model = DPPOEval(use_ddim=True, ddim_steps=3, denoising_steps=6)
    args = ({"state": torch.randn(8, 2, 11)}, torch.randn(4, 8, 4, 2))
    out, code = compile_run(model, *args)
    with torch.no_grad():
        assert relative_error(out, model(*args)) < 1e-5
    assert_fused_once(code)


class TimeFeaturesPlusCondition(torch.nn.Module):
    """CleanDiffuser's MlpNNDiffusion: the condition combined with the timestep's sinusoidal
    features before the concatenation, ``mlp(cat([x, temb(t) + cond]))``. ``combine``: how
    (``"sum"``, ``"sum_reversed"`` (``cond + temb``), ``"product"``); ``per_sample``: the
    timesteps a ``(B,)`` tensor ``t - k``, else ``torch.full`` of the step's number."""

    def __init__(self, combine="sum", per_sample=False, dim=3, emb=8, steps=4, T=10):
        super().__init__()
        self.combine, self.per_sample, self.steps = combine, per_sample, steps
        self.net = torch.nn.Sequential(torch.nn.Linear(dim + emb, 32), torch.nn.SiLU(), torch.nn.Linear(32, dim))
        self.register_buffer("freqs", torch.exp(-torch.arange(emb // 2) * 0.7))
        betas = torch.linspace(1e-3, 0.2, T)
        abar = torch.cumprod(1 - betas, 0)
        self.register_buffer("a", 1 / torch.sqrt(1 - betas))
        self.register_buffer("b", betas / torch.sqrt(1 - abar) / torch.sqrt(1 - betas))
        self.register_buffer("s", torch.sqrt(betas))

    def temb(self, t):
        f = t.float()[:, None] * self.freqs
        return torch.cat([f.sin(), f.cos()], -1)

    def forward(self, x, cond, t0, noise):
        B = x.shape[0]
        for k in range(self.steps):
            t = t0 - k if self.per_sample else torch.full((B,), self.steps - 1 - k, dtype=torch.long)
            te = self.temb(t)
            h = {"sum": lambda: te + cond, "sum_reversed": lambda: cond + te,
                 "product": lambda: te * cond}[self.combine]()
            eps = self.net(torch.cat([x, h], -1))
            x = self.a[t][:, None] * x - self.b[t][:, None] * eps + self.s[t][:, None] * noise[k]
        return x


def _time_plus_condition_inputs(model, batch=6):
    torch.manual_seed(1)
    t0 = torch.randint(model.steps - 1, 10, (batch,))
    return torch.randn(batch, 3), torch.randn(batch, 8), t0, torch.randn(model.steps, batch, 3)


@pytest.mark.parametrize("per_sample", [False, True])
@pytest.mark.parametrize("combine", ["sum", "sum_reversed"])
def test_time_features_plus_condition_fuse(combine, per_sample):
    """``W (temb(t) + cond) = W temb(t) + W cond``: the sum's addends are read through the same
    columns of the first Linear, the time features as time rows, the condition as the condition
    network (chain._split_sums), in either order."""
    torch.manual_seed(0)
    model = TimeFeaturesPlusCondition(combine, per_sample)
    args = _time_plus_condition_inputs(model)
    out, code = compile_run(model, *args)
    with torch.no_grad():
        assert relative_error(out, model(*args)) < 1e-5
    assert_fused_once(code)


def test_time_features_times_condition_left_alone(caplog):
    """A product of the time features and the condition is no sum: the Linear's columns do not
    split it into time rows and a condition, and the DEBUG line says so."""
    caplog.set_level(logging.DEBUG, logger="ddpm_ops.rewrite")
    torch.manual_seed(0)
    model = TimeFeaturesPlusCondition("product")
    args = _time_plus_condition_inputs(model)
    out, code = compile_run(model, *args)
    with torch.no_grad():
        assert relative_error(out, model(*args)) < 1e-5
    assert fused_calls(code) == 0
    left = [r.getMessage() for r in caplog.records if " left alone: " in r.getMessage()]
    assert len(left) == 1 and "aten.mul.Tensor, not a sum," in left[0] \
        and "not read as time rows plus a condition through the same columns" in left[0], left
