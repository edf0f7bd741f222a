"""Exported models: ddpm_ops.fuse_exported_program, save/load, AOTInductor (Python and C++)."""
import pathlib
import shutil
import subprocess

import pytest
import torch
from torch.export import Dim

import ddpm_ops
from test_rewrite_models import HelperSampler, MismatchedTimestepSampler, Sampler, make_inputs, relative_error

CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])
DEVICES = ["cpu", CUDA]
MATMULS = {"linear", "addmm", "mm", "bmm", "matmul"}


def targets(ep):
    return [getattr(n.target, "__name__", str(n.target)).split(".")[0]
            for n in ep.graph.nodes if n.op == "call_function"]


def ops_called(ep):
    return [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]


def check(model, out, x, t):
    with torch.no_grad():
        ref = model(x, t)
        ref64 = model.double()(x.double(), t)
        model.float()
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert relative_error(out, ref) < 1e-5
    assert relative_error(out, ref64) < 1e-4


def batch_dynamic():
    batch = Dim("batch", min=1, max=1024)
    return {"x": {0: batch}, "t_start": {0: batch}}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("decompose", [False, True], ids=["training_ir", "decomposed"])
def test_fused_program_calls_op_once(device, decompose):
    model = Sampler(dim=4, hidden=(16, 8), num_steps=5).to(device)
    x, t = make_inputs(model, batch=6, device=device)
    ep = torch.export.export(model, (x, t))
    if decompose:
        ep = ep.run_decompositions()
    before = ep.graph_module.code
    fused = ddpm_ops.fuse_exported_program(ep)
    assert ep.graph_module.code == before  # the input program is not modified
    calls = ops_called(fused)
    assert calls.count("ddpm.fused_sample.rule") == 1, calls
    assert not MATMULS & set(targets(fused)), calls
    # the same signature: inputs, outputs, parameters and buffers
    assert fused.graph_signature.input_specs == ep.graph_signature.input_specs
    assert [s.kind for s in fused.graph_signature.output_specs] == \
        [s.kind for s in ep.graph_signature.output_specs]
    assert fused.call_spec == ep.call_spec
    assert set(fused.state_dict) == set(ep.state_dict)
    out = fused.module()(x, t)  # grad mode on: the copy's parameters do not require grad
    check(model, out, x, t)
    assert all(p.requires_grad for p in ep.parameters())


def test_helper_spelling_and_dynamic_batch():
    model = HelperSampler(dim=3, width=8, depth=3, steps=4, T=500)
    x, t = make_inputs(model, batch=5)
    ep = torch.export.export(model, (x, t), dynamic_shapes={"sample": {0: Dim("b")},
                                                            "t": {0: Dim("b")}})
    fused = ddpm_ops.fuse_exported_program(ep)
    assert ops_called(fused).count("ddpm.fused_sample.rule") == 1
    for batch in (1, 9):
        x, t = make_inputs(model, batch=batch)
        with torch.no_grad():
            check(model, fused.module()(x, t), x, t)


def test_near_miss_program_unchanged():
    model = MismatchedTimestepSampler(dim=3, hidden=(8,), num_steps=2)
    x, t = make_inputs(model)
    ep = torch.export.export(model, (x, t))
    fused = ddpm_ops.fuse_exported_program(ep)
    assert fused.graph_module.code == ep.graph_module.code


def test_rejects_other_types():
    with pytest.raises(TypeError, match="ExportedProgram"):
        ddpm_ops.fuse_exported_program(torch.nn.Linear(2, 2))


def test_save_and_load(tmp_path):
    model = Sampler(dim=4, hidden=(8,), num_steps=3)
    x, t = make_inputs(model)
    fused = ddpm_ops.fuse_exported_program(torch.export.export(model, (x, t)))
    path = tmp_path / "sampler.pt2"
    torch.export.save(fused, str(path))
    loaded = torch.export.load(str(path))
    assert ops_called(loaded).count("ddpm.fused_sample.rule") == 1
    x, t = make_inputs(model)
    with torch.no_grad():
        check(model, loaded.module()(x, t), x, t)


@pytest.mark.parametrize("device", DEVICES)
def test_aoti_package(tmp_path, device):
    """The deployment path of examples/export_deploy.py: AOTInductor compiles the op call."""
    model = Sampler(dim=4, hidden=(16,), num_steps=4).to(device)
    x, t = make_inputs(model, batch=3, device=device)
    ep = torch.export.export(model, (x, t), dynamic_shapes=batch_dynamic())
    fused = ddpm_ops.fuse_exported_program(ep)
    path = torch._inductor.aoti_compile_and_package(fused, package_path=str(tmp_path / "s.pt2"))
    runner = torch._inductor.aoti_load_package(path)
    for batch in (3, 17):
        x, t = make_inputs(model, batch=batch, device=device)
        check(model, runner(x, t), x, t)


def test_aoti_of_the_unfused_program_under_grad_mode(tmp_path):
    """AOTInductor compiling the plain export (parameters require grad, grad
    mode on): the automatic rewrite must not hand inductor an op call it would
    run through the op's autograd kernel, which refuses. The loop stays as it
    was and the numbers are the loop's."""
    model = Sampler(dim=4, hidden=(16,), num_steps=4)
    assert all(p.requires_grad for p in model.parameters())
    x, t = make_inputs(model, batch=3)
    ep = torch.export.export(model, (x, t))
    with torch.enable_grad():
        path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "s.pt2"))
    check(model, torch._inductor.aoti_load_package(path)(x, t), x, t)


class Pipeline(torch.nn.Module):
    """A sampler inside a bigger model."""

    def __init__(self):
        super().__init__()
        self.sampler = Sampler(dim=4, hidden=(16, 16), num_steps=4)

    def forward(self, x, t_start):
        return self.sampler(x, t_start) * 2


@pytest.mark.parametrize("preserved", ["sampler", "sampler.eps_net"])
def test_preserved_module_call_signature(preserved):
    """With preserve_module_call_signature the signature of the kept submodule
    names graph nodes: the loop is fused only where none of them disappears
    (the sampler's output is renamed to the op's), and unflatten still works."""
    model = Pipeline()
    x, t = make_inputs(model.sampler, batch=5)
    ep = torch.export.export(model, (x, t), preserve_module_call_signature=(preserved,))
    fused = ddpm_ops.fuse_exported_program(ep)
    expected = 1 if preserved == "sampler" else 0
    assert ops_called(fused).count("ddpm.fused_sample.rule") == expected
    with torch.no_grad():
        ref = model(x, t)
        assert relative_error(fused.module()(x, t), ref) < 1e-5
        assert relative_error(torch.export.unflatten(fused)(x, t), ref) < 1e-5


def run_or_show(command):
    """Runs ``command``; on failure the test fails with its whole output, which
    says why (cmake's configuration messages, a compiler error)."""
    res = subprocess.run(command, capture_output=True, text=True)
    if res.returncode != 0:
        pytest.fail(f"{' '.join(command)} exited with {res.returncode}:\n{res.stdout}\n{res.stderr}")
    return res


class RuleModel(torch.nn.Module):
    """A step-rule sampler (strided DDIM, Mish, a time-bias table, clip) with
    the C++ example's inputs (x, t_start)."""

    def __init__(self, dim=2, steps=100):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, 16), torch.nn.Mish(), torch.nn.Linear(16, dim))
        alphas_cumprod = torch.cumprod(1 - ddpm_ops.linear_betas(10 * steps), 0)
        rule = ddpm_ops.step_rules.ddim(alphas_cumprod, torch.arange(steps) * 10 + 9, clip=1.0)
        self.rule = rule
        self.register_buffer("time_bias", torch.randn(steps, 16) * 0.3)
        self.steps = steps

    def forward(self, x, t_start):
        weights, biases, activations = ddpm_ops.mlp_layers(self.net)
        return ddpm_ops.sample(x, t_start, weights, biases, self.rule, self.steps,
                               activations=activations, time_bias=self.time_bias)


def exported_for_cpp(kind):
    x, t = torch.randn(4, 2), torch.full((4,), 99)
    if kind == "time column":
        model = Sampler(dim=2, hidden=(16,), num_steps=100, total_timesteps=100)
        return model, ddpm_ops.fuse_exported_program(
            torch.export.export(model, (x, t), dynamic_shapes=batch_dynamic()))
    model = RuleModel()
    with torch.no_grad():
        return model, torch.export.export(model, (x, t), dynamic_shapes=batch_dynamic())


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
@pytest.mark.parametrize("kind", ["time column", "step rule"])
def test_cpp_runs_aoti_package(tmp_path, kind):
    """examples/cpp: a C++ program dlopens the op library and runs the package."""
    model, program = exported_for_cpp(kind)
    with torch.no_grad():  # the parameters require grad; the op has no backward
        package = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "s.pt2"))
    source = pathlib.Path(__file__).parents[1] / "examples" / "cpp"
    build = tmp_path / "build"
    run_or_show([
        "cmake", "-S", str(source), "-B", str(build),
        f"-DTORCH_ROOT={pathlib.Path(torch.__file__).parent}"])
    run_or_show(["cmake", "--build", str(build)])
    batch = 3
    res = run_or_show([str(build / "run_sampler"), ddpm_ops.LIBRARY_PATH, package, str(batch)])
    values = torch.tensor([float(v) for v in res.stdout.strip().splitlines()[-1].split()])
    x = torch.arange(batch * 2, dtype=torch.float32).reshape(batch, 2) * (4.0 / (batch * 2)) - 2.0
    t = torch.full((batch,), 99, dtype=torch.int64)
    with torch.no_grad():
        ref = model(x, t)
    assert relative_error(values.reshape(batch, 2), ref) < 1e-5


class RuleInForward(torch.nn.Module):
    """A policy that keeps its rule as buffers and builds the StepRule in forward."""

    def __init__(self, kind, steps=5, dim=4, hidden=16):
        super().__init__()
        from problems import make_rule
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.Mish(),
                                       torch.nn.Linear(hidden, dim))
        rule = make_rule(kind, steps)
        for name in "ABCDES":
            self.register_buffer(name, getattr(rule, name).clone())
        self.steps = steps

    def rule(self):
        return ddpm_ops.StepRule(*(getattr(self, name) for name in "ABCDES"), clip=(-1.0, 1.0))

    def forward(self, x, noise=None):
        weights, biases, activations = ddpm_ops.mlp_layers(self.net)
        return ddpm_ops.sample(x, self.steps - 1, weights, biases, self.rule(), self.steps,
                               activations=activations, noise=noise)

    def reference(self, x, noise=None):
        weights, biases, activations = ddpm_ops.mlp_layers(self.net)
        return ddpm_ops.reference_sample(
            x.double(), torch.full((x.shape[0],), self.steps - 1), [w.double() for w in weights],
            [b.double() for b in biases], self.rule(), self.steps, activations=activations,
            noise=None if noise is None else noise.double())


@pytest.mark.parametrize("kind", ["ddpm_epsilon", "ddim_strided"], ids=["noise_given", "no_noise"])
def test_rule_built_in_forward_exports_saves_and_runs_under_aoti(tmp_path, kind):
    """The rule's checks that read the tables run eagerly only: traced, the
    tables are not known yet. Without noise given, the traced call draws a
    seed (it cannot read whether S is 0), which S = 0 drops."""
    model = RuleInForward(kind)
    noisy = kind == "ddpm_epsilon"

    def inputs(batch):
        x = torch.randn(batch, 4)
        return (x, torch.randn(model.steps, batch, 4)) if noisy else (x,)

    batch = Dim("batch", min=1, max=1024)
    dynamic = ({0: batch}, {1: batch}) if noisy else ({0: batch},)
    with torch.no_grad():  # the op is inference-only: traced under grad mode it refuses the parameters
        program = torch.export.export(model, inputs(6), dynamic_shapes=dynamic)
        package = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "rule_aoti.pt2"))
    assert "ddpm.fused_sample.rule" in ops_called(program)
    torch.export.save(program, str(tmp_path / "rule.pt2"))
    loaded = torch.export.load(str(tmp_path / "rule.pt2")).module()
    runner = torch._inductor.aoti_load_package(package)
    for size in (1, 9):
        args = inputs(size)
        expected = model.reference(*args)
        with torch.no_grad():  # the loaded program's parameters require grad
            assert relative_error(loaded(*args), expected) < 1e-5
        assert relative_error(runner(*args), expected) < 1e-5
    with pytest.raises(RuntimeError, match="inference-only|requires grad|require grad"):
        loaded(*inputs(2))


def test_rule_built_eagerly_still_checks_its_tables():
    model = RuleInForward("ddpm_epsilon")
    model.B[2] = float("nan")
    with pytest.raises(ValueError, match="B: expected finite values"):
        model(torch.randn(3, 4))
