"""What a rewritten loop computes at every call: the op, and nothing that could have been
computed once.

Under torch.compile a fused loop's step tables, shared timesteps and time features depend
only on the module's buffers and constants: they become graph constants when the graph is
compiled. What depends on parameters (the time MLP, the first Linear's columns) goes to the
op as its bias networks, the noise as one seed the op draws from. Checked on the graph, not
by timing (benchmarks/bench_rule.py times it).
"""
import pytest
import torch
from torch import nn
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import ddpm_ops
from ddpm_ops import graph_pass
from ddpm_ops.calls import RULE, arg_slots
from loops import diffusion_ql
from test_rewrite import compile_run, fresh_compile  # noqa: F401  (autouse: each test compiles afresh)
from test_rewrite_models import relative_error

aten = torch.ops.aten
# Nodes that only view their input: no work at a call.
VIEWS = {aten.select.int, aten.slice.Tensor, aten.view.default, aten.reshape.default, aten.expand.default,
         aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.alias.default}


class Capture(CustomGraphPass):
    """The rewrite as inductor runs it, then the graph kept for the test."""

    def __init__(self):
        self.graph = None

    def __call__(self, graph, is_inference=None):
        graph_pass.DDPMSamplingRewrite()(graph, is_inference=True)
        self.graph = graph

    def uuid(self):
        return None


class StepsOnly(nn.Module):
    """Diffusion-QL's p_sample steps from a given x (no initial draw, no final clamp)."""

    def __init__(self, diffusion):
        super().__init__()
        self.diffusion = diffusion

    def forward(self, x, state):
        d = self.diffusion
        for i in reversed(range(d.n_timesteps)):
            x = d.p_sample(x, d.make_timesteps(x.shape[0], i, x.device), state)
        return x


def _source(node):
    """What a view reads through to (a placeholder, a get_attr, or a node that computes)."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in VIEWS:
        node = node.args[0]
    return node


@pytest.mark.parametrize("variant", [{}, dict(bias_free=("mid", "final", "time")), dict(time_spelling="repeat"),
                                     dict(time_spelling="expand")],
                         ids=["biases", "no_biases", "repeat_time", "expand_time"])
def test_rewritten_loop_computes_the_op_and_one_seed_per_call(variant):
    """``variant``: of Diffusion-QL's sampler (``DiffusionVariants``): the Linears of the network
    and of the time MLP built without bias, whose zeros the op gets as graph constants, or the
    timesteps made again at every step as ``tensor([i]).repeat(B)`` or ``.expand(B)``."""
    torch.manual_seed(0)
    model = StepsOnly(diffusion_ql.DiffusionVariants(state_dim=17, action_dim=6, n_timesteps=5, **variant)).eval()
    x, state = torch.randn(4, 6), torch.randn(4, 17)
    capture = Capture()
    with inductor_config.patch(post_grad_custom_pre_pass=capture):
        out, code = compile_run(model, x, state)
    graph = capture.graph
    fused = [n for n in graph.nodes if n.target is RULE]
    assert len(fused) == 1, code
    # Everything the graph computes per call (what its output needs; inductor drops the
    # rest): the op and the noise seed; the rest are views.
    live, todo = set(), [graph.output_node()]
    while todo:
        n = todo.pop()
        if n not in live:
            live.add(n)
            todo.extend(n.all_input_nodes)
    # The seed is one of the seeds inductor draws for the graph's random ops in one randint (that
    # of a replaced draw), cut to the op's range: one fused pointwise kernel, no call of its own.
    work = [n for n in graph.nodes if n in live and n.op == "call_function" and n.target not in VIEWS]
    assert sorted(str(n.target) for n in work) == sorted([
        str(RULE), "aten.bitwise_and.Scalar", "prims.inductor_lookup_seed.default", "prims.inductor_seeds.default"]), \
        [str(n.target) for n in work]
    _, slot = arg_slots(RULE)
    args = fused[0].args
    for name in ("t_start", "step_tables", "time_input"):
        assert _source(args[slot[name]]).op == "get_attr", name  # computed once, at compile time
    for name in ("x", "cond_input"):
        assert _source(args[slot[name]]).op == "placeholder", name
    weights = [_source(w) for w in args[slot["weights"]] + args[slot["time_weights"]]]
    assert all(w.op == "placeholder" for w in weights)  # parameters, read at the call
    biases = {_source(b).op for b in args[slot["biases"]] + args[slot["time_biases"]]}
    assert biases == {"get_attr" if "bias_free" in variant else "placeholder"}
    seed = _source(args[slot["noise_seed"]])
    assert seed.target is aten.bitwise_and.Scalar and seed.args[1] == ddpm_ops.ops.NOISE_SEED_BOUND - 1
    assert seed.args[0].target is torch.ops.prims.inductor_lookup_seed.default
    assert args[slot["noise"]] is None
    # The op draws the noise; its distribution is tested in test_rewrite_projects.py. Without
    # noise (its S table zeroed) the numbers are eager's.
    assert out.shape == x.shape and torch.isfinite(out).all()


def test_folded_tables_give_eager_numbers_and_follow_parameters():
    """Noise given as tensors: eager's numbers; a parameter changed after compiling is read
    at the next call (only buffers are read once)."""
    torch.manual_seed(torch.seed())
    model, args, noise_shape = diffusion_ql.Diffusion(), (torch.randn(8, 17),), (6, 8, 6)
    noise = torch.randn(noise_shape)
    compiled = torch.compile(model.eval())
    with torch.no_grad():
        out = compiled(*args, noise)
        assert relative_error(out, model(*args, noise)) < 1e-5
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight.mul_(1.5)
        out = compiled(*args, noise)
        assert relative_error(out, model(*args, noise)) < 1e-5
    assert ddpm_ops.rewrite_stats()["loops_fused"] >= 1


@pytest.fixture
def fx_graph_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor_cache"))
    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=True), torch._functorch.config.patch(enable_autograd_cache=True):
        yield
    torch._dynamo.reset()


def test_cached_graph_is_not_served_to_another_schedule(fx_graph_cache):
    """Two modules alike but for their schedules' buffers: the second compilation must not be
    served the first's graph, whose tables are constants of the first schedule."""
    torch.manual_seed(torch.seed())
    state, noise = torch.randn(8, 17), torch.randn(6, 8, 6)
    outs = []
    for beta_end in (2e-2, 0.3):
        torch.manual_seed(0)  # the same parameters: only the buffers differ
        model = diffusion_ql.Diffusion().eval()
        _rebuffer(model, beta_end)
        torch._dynamo.reset()
        with torch.no_grad():
            out = torch.compile(model)(state, noise)
            expected = model(state, noise)
        assert relative_error(out, expected) < 1e-5
        outs.append(out)
    assert not torch.allclose(outs[0], outs[1])


def _rebuffer(model, beta_end):
    """The module's schedule buffers made again for another linear schedule."""
    from loops.common import ddpm_buffers
    betas = diffusion_ql.linear_beta_schedule(5, beta_end=beta_end)
    for name, value in list(model.named_buffers(recurse=False)):
        delattr(model, name)
    ddpm_buffers(model, betas)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rewritten_loop_launches_at_most_two_cuda_kernels():
    """torch.compile's default mode: the Diffusion-QL steps rewritten run the noise seed's
    randint and the op; nothing else launches a kernel."""
    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = StepsOnly(diffusion_ql.Diffusion(state_dim=17, action_dim=6, n_timesteps=5)).eval()
        x, state = torch.randn(50, 6), torch.randn(50, 17)
    compiled = torch.compile(model)
    with torch.no_grad():
        for _ in range(3):
            compiled(x, state)
        torch.cuda.synchronize()
        calls = 10
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                compiled(x, state)
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.lower().startswith(("memcpy", "memset"))]
    assert len(kernels) <= 2 * calls, sorted({e.name for e in kernels})
    assert ddpm_ops.rewrite_stats()["loops_fused"] >= 1
