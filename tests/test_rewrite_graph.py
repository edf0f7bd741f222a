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


def small_model():
    torch.manual_seed(0)
    return Sampler(dim=2, hidden=(3,), num_steps=2, total_timesteps=100)


class TestRewrittenGraph(TestCase):
    def test_compiled_graph(self):
        model = small_model()
        x, t = make_inputs(model, batch=4)
        capture = Capture()
        torch._dynamo.reset()
        with inductor_config.patch(post_grad_custom_pre_pass=capture, fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False), torch.no_grad():
            out = torch.compile(model)(x, t)
            self.assertLess(relative_error(out, model(x, t)), 1e-5)
        torch._dynamo.reset()
        self.assertExpectedInline(capture.text, """\
in0: (4,) int64
in1: (4, 2) float32
in2: (3, 3) float32
in3: (3,) float32
in4: (2, 3) float32
in5: (2,) float32
in6: (100,) float32
in7: (100,) float32
fused_sample_default = ddpm.fused_sample.default(in1, in0, [in2, in4], [in3, in5], in6, in7, 2, 100)
return fused_sample_default""")

    def test_exported_graph(self):
        model = small_model()
        x, t = make_inputs(model, batch=4)
        ep = ddpm_ops.fuse_exported_program(torch.export.export(model, (x, t)))
        with torch.no_grad():
            self.assertLess(relative_error(ep.module()(x, t), model(x, t)), 1e-5)
        self.assertExpectedInline(ep.graph_module.code.strip(), """\
def forward(self, p_eps_net_0_weight, p_eps_net_0_bias, p_eps_net_2_weight, p_eps_net_2_bias, b_sqrt_recip_alphas, b_coef_eps, x, t_start):
    fused_sample_default = torch.ops.ddpm.fused_sample.default(x, t_start, [p_eps_net_0_weight, p_eps_net_2_weight], [p_eps_net_0_bias, p_eps_net_2_bias], b_sqrt_recip_alphas, b_coef_eps, 2, 100);  x = t_start = p_eps_net_0_weight = p_eps_net_2_weight = p_eps_net_0_bias = p_eps_net_2_bias = b_sqrt_recip_alphas = b_coef_eps = None
    return (fused_sample_default,)""")
