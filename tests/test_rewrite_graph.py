"""Expecttests of what the rewrite emits (2 steps, 2 layers): any change shows in review.

Update after an intended change with ``EXPECTTEST_ACCEPT=1 pytest tests/test_rewrite_graph.py``.
"""
import torch
from expecttest import TestCase
from torch._inductor import config as inductor_config

import ddpm_ops
from ddpm_ops import graph_pass
from test_rewrite_models import Sampler, make_inputs, relative_error


def graph_text(graph: torch.fx.Graph) -> str:
    """The graph, one node a line, placeholders named by position (stable across versions)."""
    names = {}
    lines = []
    for node in graph.nodes:
        if node.op == "placeholder":
            names[node] = f"in{len(names)}"
            v = node.meta.get("val")
            lines.append(f"{names[node]}: {tuple(v.shape) if v is not None else '?'} "
                         f"{str(v.dtype).replace('torch.', '') if v is not None else ''}")
            continue
        if node.op == "get_attr":  # a graph constant (the rewrite's tables): named by its shape
            names[node] = f"constant{sum(n.op == 'get_attr' for n in names)}"
            v = node.meta.get("val")
            lines.append(f"{names[node]} = constant {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}")
            continue
        if node.op != "call_function":
            if node.op == "output":
                outs = node.args[0] if isinstance(node.args[0], (tuple, list)) else [node.args[0]]
                lines.append("return " + ", ".join(names[n] for n in outs))
            continue
        names[node] = node.name
        args = torch.fx.node.map_arg(node.args, lambda n: names[n])
        lines.append(f"{node.name} = {node.target}{tuple(args)}".replace("'", ""))
    return "\n".join(lines)


class Capture(torch._inductor.custom_graph_pass.CustomGraphPass):
    """Runs the rewrite as inductor does, then records the graph."""

    def __init__(self):
        self.text = None

    def __call__(self, graph, is_inference=None):
        graph_pass.DDPMSamplingRewrite()(graph, is_inference=True)
        self.text = graph_text(graph)

    def uuid(self):
        return None


class Small2M(torch.nn.Module):
    """DPM-Solver++ 2M in 3 steps of a 2-layer net, the previous x0 kept in a variable: step 0 is
    first order, step 1 also reads step 0's clipped x0 (the tables' 7th row, P), step 2 returns
    its clipped x0."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.SiLU(), torch.nn.Linear(3, 2))
        alpha = torch.tensor([0.3, 0.6, 0.9])
        sigma = (1 - alpha ** 2).sqrt()
        self.register_buffer("alpha", alpha)
        self.register_buffer("sigma", sigma)
        self.register_buffer("lam", (alpha / sigma).log())

    def forward(self, x):
        x0_prev = None
        for i in range(3):
            eps = self.net(torch.cat([x, torch.full((x.shape[0], 1), i / 3)], 1))
            x0 = ((x - self.sigma[i] * eps) / self.alpha[i]).clamp(-1.0, 1.0)
            if i == 2:
                return x0
            h = self.lam[i + 1] - self.lam[i]
            d = x0 if x0_prev is None else x0 + (x0 - x0_prev) * (h / (2 * (self.lam[i] - self.lam[i - 1])))
            x = self.sigma[i + 1] / self.sigma[i] * x - self.alpha[i + 1] * torch.expm1(-h) * d
            x0_prev = x0


def small_model():
    torch.manual_seed(0)
    return Sampler(dim=2, hidden=(3,), num_steps=2, total_timesteps=100)


class TestRewrittenGraph(TestCase):
    def compiled_text(self, model, *args):
        """The rewritten graph of ``torch.compile(model)(*args)``, which has eager's numbers."""
        capture = Capture()
        torch._dynamo.reset()
        with inductor_config.patch(post_grad_custom_pre_pass=capture, fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False), torch.no_grad():
            out = torch.compile(model)(*args)
            self.assertLess(relative_error(out, model(*args)), 1e-5)
        torch._dynamo.reset()
        return capture.text

    def test_compiled_graph(self):
        model = small_model()
        x, t = make_inputs(model, batch=4)
        self.assertExpectedInline(self.compiled_text(model, x, t), """\
in0: (4,) int64
in1: (4, 2) float32
in2: (3, 3) float32
in3: (3,) float32
in4: (2, 3) float32
in5: (2,) float32
in6: (100,) float32
in7: (100,) float32
constant0 = constant (1, 6, 100) float32
select_int = aten.select.int(constant0, 0, 0)
slice_tensor = aten.slice.Tensor(in2, 1, 0, 2)
slice_tensor_1 = aten.slice.Tensor(in2, 1, 2, 3)
constant1 = constant (1, 100, 1) float32
select_int_1 = aten.select.int(constant1, 0, 0)
fused_sample_rule = ddpm.fused_sample.rule(in1, in0, [slice_tensor, in4], [in3, in5], select_int, 2, [silu], None, None, None, None, None, False, False, fp32, None, select_int_1, [slice_tensor_1], [], [])
return fused_sample_rule""")

    def test_exported_graph(self):
        model = small_model()
        x, t = make_inputs(model, batch=4)
        ep = ddpm_ops.fuse_exported_program(torch.export.export(model, (x, t)))
        with torch.no_grad():
            self.assertLess(relative_error(ep.module()(x, t), model(x, t)), 1e-5)
        self.assertExpectedInline(ep.graph_module.code.strip(), """\
def forward(self, p_eps_net_0_weight, p_eps_net_0_bias, p_eps_net_2_weight, p_eps_net_2_bias, b_sqrt_recip_alphas, b_coef_eps, x, t_start):
    full_default = torch.ops.aten.full.default([100], 0.0, dtype = torch.float32, device = device(type='cpu'), pin_memory = False)
    iota_default = torch.ops.prims.iota.default(100, start = 0, step = 1, dtype = torch.int64, device = device(type='cpu'), requires_grad = False)
    index_tensor = torch.ops.aten.index.Tensor(b_sqrt_recip_alphas, [iota_default]);  b_sqrt_recip_alphas = None
    unsqueeze_default = torch.ops.aten.unsqueeze.default(index_tensor, 1);  index_tensor = None
    reshape_default = torch.ops.aten.reshape.default(unsqueeze_default, [100]);  unsqueeze_default = None
    index_tensor_1 = torch.ops.aten.index.Tensor(b_coef_eps, [iota_default]);  b_coef_eps = None
    unsqueeze_default_1 = torch.ops.aten.unsqueeze.default(index_tensor_1, 1);  index_tensor_1 = None
    reshape_default_1 = torch.ops.aten.reshape.default(unsqueeze_default_1, [100]);  unsqueeze_default_1 = None
    neg_default = torch.ops.aten.neg.default(reshape_default_1);  reshape_default_1 = None
    mul_tensor = torch.ops.aten.mul.Tensor(neg_default, reshape_default);  neg_default = None
    unsqueeze_default_2 = torch.ops.aten.unsqueeze.default(full_default, 0)
    unsqueeze_default_3 = torch.ops.aten.unsqueeze.default(full_default, 0)
    unsqueeze_default_4 = torch.ops.aten.unsqueeze.default(full_default, 0)
    unsqueeze_default_5 = torch.ops.aten.unsqueeze.default(reshape_default, 0);  reshape_default = None
    unsqueeze_default_6 = torch.ops.aten.unsqueeze.default(mul_tensor, 0);  mul_tensor = None
    unsqueeze_default_7 = torch.ops.aten.unsqueeze.default(full_default, 0);  full_default = None
    cat_default = torch.ops.aten.cat.default([unsqueeze_default_2, unsqueeze_default_3, unsqueeze_default_4, unsqueeze_default_5, unsqueeze_default_6, unsqueeze_default_7]);  unsqueeze_default_2 = unsqueeze_default_3 = unsqueeze_default_4 = unsqueeze_default_5 = unsqueeze_default_6 = unsqueeze_default_7 = None
    slice_tensor = torch.ops.aten.slice.Tensor(p_eps_net_0_weight, 1, 0, 2)
    slice_tensor_1 = torch.ops.aten.slice.Tensor(p_eps_net_0_weight, 1, 2, 3);  p_eps_net_0_weight = None
    to_dtype = torch.ops.aten.to.dtype(iota_default, torch.float32);  iota_default = None
    div_tensor = torch.ops.aten.div.Tensor(to_dtype, 100);  to_dtype = None
    unsqueeze_default_8 = torch.ops.aten.unsqueeze.default(div_tensor, 1);  div_tensor = None
    fused_sample_rule = torch.ops.ddpm.fused_sample.rule(x, t_start, [slice_tensor, p_eps_net_2_weight], [p_eps_net_0_bias, p_eps_net_2_bias], cat_default, 2, ['silu'], None, None, None, None, None, False, False, 'fp32', None, unsqueeze_default_8, [slice_tensor_1], [], []);  x = t_start = slice_tensor = p_eps_net_2_weight = p_eps_net_0_bias = p_eps_net_2_bias = cat_default = unsqueeze_default_8 = slice_tensor_1 = None
    return (fused_sample_rule,)""")

    def test_compiled_general_loop(self):
        from loops.v1_variants import PosteriorSampler
        torch.manual_seed(0)
        model = PosteriorSampler(dim=2, hidden=3, num_steps=2, T=10, timesteps="int", clip=(-1.0, 1.0))
        self.assertExpectedInline(self.compiled_text(model, torch.randn(4, 2), 9), """\
in0: (4, 2) float32
in1: (3, 3) float32
in2: (3,) float32
in3: (3, 3) float32
in4: (3,) float32
in5: (2, 3) float32
in6: (2,) float32
in7: (10,) float32
in8: (10,) float32
in9: (10,) float32
in10: (10,) float32
constant0 = constant (1, 6, 2) float32
select_int_1 = aten.select.int(constant0, 0, 0)
constant1 = constant (1, 4) int64
select_int = aten.select.int(constant1, 0, 0)
slice_tensor = aten.slice.Tensor(in1, 1, 0, 2)
slice_tensor_1 = aten.slice.Tensor(in1, 1, 2, 3)
constant2 = constant (1, 2, 1) float32
select_int_2 = aten.select.int(constant2, 0, 0)
fused_sample_rule = ddpm.fused_sample.rule(in0, select_int, [slice_tensor, in3, in5], [in2, in4, in6], select_int_1, 2, [silu, silu], None, None, [-1.0, 1.0], None, None, False, False, fp32, None, select_int_2, [slice_tensor_1], [], [])
return fused_sample_rule""")

    def test_compiled_scaled_sample_loop(self):
        """The network reads ``c_in[t] * x``: the op's input is the first step's scaled sample, its
        tables the rescaled coefficients (a constant)."""
        from loops.v1_variants import PosteriorSampler
        torch.manual_seed(0)
        model = PosteriorSampler(dim=2, hidden=3, num_steps=2, T=10, timesteps="int", c_in=True)
        self.assertExpectedInline(self.compiled_text(model, torch.randn(4, 2), 9), """\
in0: (4, 2) float32
in1: (10,) float32
in2: (3, 3) float32
in3: (3,) float32
in4: (3, 3) float32
in5: (3,) float32
in6: (2, 3) float32
in7: (2,) float32
in8: (10,) float32
in9: (10,) float32
in10: (10,) float32
in11: (10,) float32
select = aten.select.int(in1, 0, 9)
mul = aten.mul.Tensor(select, in0)
constant0 = constant (1, 6, 2) float32
select_int_1 = aten.select.int(constant0, 0, 0)
constant1 = constant (1, 4) int64
select_int = aten.select.int(constant1, 0, 0)
slice_tensor = aten.slice.Tensor(in2, 1, 0, 2)
slice_tensor_1 = aten.slice.Tensor(in2, 1, 2, 3)
constant2 = constant (1, 2, 1) float32
select_int_2 = aten.select.int(constant2, 0, 0)
fused_sample_rule = ddpm.fused_sample.rule(mul, select_int, [slice_tensor, in4, in6], [in3, in5, in7], select_int_1, 2, [silu, silu], None, None, None, None, None, False, False, fp32, None, select_int_2, [slice_tensor_1], [], [])
return fused_sample_rule""")

    def test_compiled_transposed_chunk_loop(self):
        """A chunk the network reads channels first, noise given: the op's input is the network's
        flattened transpose, the noise laid out likewise, its result laid out back."""
        from loops.v1_variants import PosteriorSampler
        torch.manual_seed(0)
        model = PosteriorSampler(hidden=3, num_steps=2, T=10, timesteps="int", chunk=(3, 2), noise=True)
        self.assertExpectedInline(self.compiled_text(model, torch.randn(4, 3, 2), 9, None,
                                                     torch.randn(2, 4, 3, 2)), """\
in0: (4, 3, 2) float32
in1: (3, 7) float32
in2: (3,) float32
in3: (3, 3) float32
in4: (3,) float32
in5: (6, 3) float32
in6: (6,) float32
in7: (10,) float32
in8: (10,) float32
in9: (10,) float32
in10: (10,) float32
in11: (2, 4, 3, 2) float32
in12: (10,) float32
permute = aten.permute.default(in0, [0, 2, 1])
clone = aten.clone.default(permute,)
view = aten.reshape.default(clone, [4, 6])
select_5 = aten.select.int(in12, 0, 9)
sqrt = aten.sqrt.default(select_5,)
select_4 = aten.select.int(in11, 0, 0)
mul_4 = aten.mul.Tensor(sqrt, select_4)
select_11 = aten.select.int(in12, 0, 8)
sqrt_1 = aten.sqrt.default(select_11,)
select_10 = aten.select.int(in11, 0, 1)
mul_9 = aten.mul.Tensor(sqrt_1, select_10)
constant0 = constant (1, 6, 2) float32
select_int_1 = aten.select.int(constant0, 0, 0)
constant1 = constant (1, 4) int64
select_int = aten.select.int(constant1, 0, 0)
slice_tensor = aten.slice.Tensor(in1, 1, 0, 6)
slice_tensor_1 = aten.slice.Tensor(in1, 1, 6, 7)
constant2 = constant (1, 2, 1) float32
select_int_2 = aten.select.int(constant2, 0, 0)
unsqueeze_default_20 = aten.unsqueeze.default(mul_4, 0)
unsqueeze_default_21 = aten.unsqueeze.default(mul_9, 0)
cat_default_8 = aten.cat.default([unsqueeze_default_20, unsqueeze_default_21],)
reshape_default = aten.reshape.default(cat_default_8, [-1, 3, 2])
permute_default = aten.permute.default(reshape_default, [0, 2, 1])
reshape_default_1 = aten.reshape.default(permute_default, [-1, 6])
reshape_default_2 = aten.reshape.default(reshape_default_1, [2, 4, 6])
fused_sample_rule = ddpm.fused_sample.rule(view, select_int, [slice_tensor, in3, in5], [in2, in4, in6], select_int_1, 2, [silu, silu], None, None, None, None, reshape_default_2, False, False, fp32, None, select_int_2, [slice_tensor_1], [], [])
reshape_default_3 = aten.reshape.default(fused_sample_rule, [-1, 2, 3])
permute_default_1 = aten.permute.default(reshape_default_3, [0, 2, 1])
return permute_default_1""")

    def test_compiled_multistep_loop(self):
        torch.manual_seed(0)
        model = Small2M()
        self.assertExpectedInline(self.compiled_text(model, torch.randn(4, 2)), """\
in0: (4, 2) float32
in1: (3, 3) float32
in2: (3,) float32
in3: (2, 3) float32
in4: (2,) float32
in5: (3,) float32
in6: (3,) float32
in7: (3,) float32
constant0 = constant (1, 7, 3) float32
select_int_1 = aten.select.int(constant0, 0, 0)
constant1 = constant (1, 4) int64
select_int = aten.select.int(constant1, 0, 0)
slice_tensor = aten.slice.Tensor(in1, 1, 0, 2)
slice_tensor_1 = aten.slice.Tensor(in1, 1, 2, 3)
constant2 = constant (1, 3, 1) float32
select_int_2 = aten.select.int(constant2, 0, 0)
fused_sample_rule = ddpm.fused_sample.rule(in0, select_int, [slice_tensor, in3], [in2, in4], select_int_1, 3, [silu], None, None, [-1.0, 1.0], None, None, False, False, fp32, None, select_int_2, [slice_tensor_1], [], [])
return fused_sample_rule""")
