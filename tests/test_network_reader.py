"""One reader of networks, two paths: the noise networks of Diffusion-QL, IDQL (its MLP and its
LN-ResNet), DPPO, CleanDiffuser (its DQL and IDQL MLPs) and ReinFlow, each written as its project
writes it (tests/project_networks.py, tests/loops/), given to ``DiffusionSampler`` (which traces
the network and reads the graph with the rewrite's reader) and called in a sampling loop that
torch.compile fuses (the rewrite reads the same network off the loop's graph). Both give eager's
numbers, and both hand the op the same network: its activations or its program."""
import copy
import logging
import re
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code
from torch.utils._python_dispatch import TorchDispatchMode

import ddpm_ops
from ddpm_ops.calls import RULE, arg_slots
from loops.cleandiffuser import DQLMlpAsIs, IDQLMlpAsIs
from loops.diffusion_ql import MLP as DiffusionQLMLP
from network_problems import idql_rule
from problems import relative_error
from project_networks import IDQLMLP, DiffusionMLP, FlowMLP, MLPResNet, idql_time_encoder
from test_rewrite import fresh_compile  # noqa: F401  (autouse: each test compiles afresh)
from test_rewrite_projects import MATMUL, RULE_CALL

_, SLOT = arg_slots(RULE)


@dataclass
class Project:
    """A project's noise network: ``modules`` as the project builds them, ``call(modules, x, t,
    cond)`` the network's output as the project's sampler calls it at the time ``t`` (a number),
    and the sampler of the same network (its layers ``network(modules)``, read on the columns
    ``layout``; the time embedding ``time_embedding(modules)``)."""

    modules: nn.ModuleDict
    call: Callable
    network: Callable
    layout: tuple
    time_embedding: Callable
    rule: ddpm_ops.StepRule
    timesteps: torch.Tensor
    x_shape: tuple

    def sampler(self) -> ddpm_ops.DiffusionSampler:
        return ddpm_ops.DiffusionSampler(self.network(self.modules), self.rule, self.timesteps, layout=self.layout,
                                         time_embedding=self.time_embedding(self.modules))


def full(x, t, *shape, **kw):
    """The timestep ``t`` for every row of ``x``, in ``x``'s dtype unless given."""
    return torch.full((x.shape[0], *shape), t, **{"dtype": x.dtype, **kw})


def ddpm_rule(steps=5):
    return ddpm_ops.step_rules.ddpm(ddpm_ops.cosine_betas(steps), clip=1.0)


def diffusion_ql():
    model = DiffusionQLMLP(state_dim=11, action_dim=3, hidden=64)
    return Project(nn.ModuleDict({"model": model}),
                   lambda m, x, t, cond: m["model"](x, full(x, t, dtype=torch.long), cond),
                   lambda m: nn.Sequential(m["model"].mid_layer, m["model"].final_layer),
                   (("x", 3), ("time", 16), ("cond", 11)), lambda m: m["model"].time_mlp,
                   ddpm_rule(), torch.arange(5), (3,))


def idql(reverse):
    """IDQL's actor: ``reverse(cat[a, s, cond_encoder(t)])``, the time a ``(B, 1)`` float column
    (jaxrl5's ddpm_sampler), Mish written as IDQL writes it."""
    return Project(nn.ModuleDict({"reverse": reverse, "time": idql_time_encoder(16, 32)}),
                   lambda m, x, t, cond: m["reverse"](torch.cat([x, cond, m["time"](full(x, t, 1))], -1)),
                   lambda m: m["reverse"], (("x", 3), ("cond", 11), ("time", 32)), lambda m: m["time"],
                   idql_rule(), torch.arange(5.0), (3,))


def dppo():
    """DPPO's DiffusionMLP (residual style) on an action chunk of 4 x 3."""
    model = DiffusionMLP(3, 4, 11, mlp_dims=(64, 64, 64))
    return Project(nn.ModuleDict({"model": model}), lambda m, x, t, cond: m["model"](x, full(x, t), cond),
                   lambda m: m["model"].mlp_mean, (("x", 12), ("time", 16), ("cond", 11)),
                   lambda m: m["model"].time_embedding, ddpm_rule(8), torch.arange(8), (4, 3))


def cleandiffuser(model, network):
    """CleanDiffuser's ``model(x, t, condition)``, its time MLP of its positional embedding."""
    return Project(nn.ModuleDict({"model": model}), lambda m, x, t, cond: m["model"](x, full(x, t), cond),
                   lambda m: network(m["model"]), (("x", 3), ("time", 16), ("cond", 11)),
                   lambda m: nn.Sequential(m["model"].map_noise, *m["model"].time_mlp), ddpm_rule(), torch.arange(5.0),
                   (3,))


def reinflow(steps=4):
    """ReinFlow's FlowMLP (DPPO's MLP, its layers looped over in a ModuleList) under its Euler
    sampler: ``t = linspace(0, 1, steps)[i]``, ``x += v / steps``, clamped every step."""
    model = FlowMLP(4, 3, 11, mlp_dims=(64, 64))
    rule = ddpm_ops.StepRule(A=torch.zeros(steps), B=torch.zeros(steps), C=torch.zeros(steps), D=torch.ones(steps),
                             E=torch.full((steps,), 1 / steps), S=torch.zeros(steps), post_clip=1.0)
    return Project(nn.ModuleDict({"model": model}),
                   lambda m, x, t, cond: m["model"](x, full(x, t), {"state": cond}),
                   lambda m: m["model"].mlp_mean, (("x", 12), ("time", 16), ("cond", 11)),
                   lambda m: m["model"].time_embedding, rule, torch.linspace(0, 1, steps).flip(0), (4, 3))


PROJECTS = {
    "diffusion_ql": diffusion_ql,
    "idql_mlp": lambda: idql(IDQLMLP(3 + 11 + 32, (64, 64, 3))),
    "idql_ln_resnet": lambda: idql(MLPResNet(2, 3 + 11 + 32, 3, dropout_rate=0.1, use_layer_norm=True, hidden_dim=32)),
    "dppo": dppo,
    "cleandiffuser_dql": lambda: cleandiffuser(DQLMlpAsIs(11, 3, hidden=64),
                                               lambda m: nn.Sequential(m.mid_layer, m.final_layer)),
    "cleandiffuser_idql": lambda: cleandiffuser(IDQLMlpAsIs(11, 3), lambda m: nn.Sequential(m.affine_in, m.ln_resnet,
                                                                                             m.affine_out)),
    "reinflow": reinflow,
}


class RuleLoop(nn.Module):
    """The project's network in the sampling loop of ``rule``: ``x0 = A x - B e`` (clamped to the
    rule's clip), ``x = C x0 + D x + E e + S z`` (clamped to its post_clip), the coefficients
    read at each step's Python int index, the network called as its project calls it."""

    def __init__(self, project: Project):
        super().__init__()
        self.modules_, self.call = project.modules, project.call
        self.register_buffer("tables", project.rule.tables().clone())
        self.timesteps = project.timesteps.tolist()
        self.clip, self.post_clip = project.rule.clip, project.rule.post_clip

    def forward(self, x, cond, noise):
        for k, s in enumerate(reversed(range(len(self.timesteps)))):
            A, B, C, D, E, S = self.tables[:, s]
            e = self.call(self.modules_, x, self.timesteps[s], cond)
            x0 = A * x - B * e
            if self.clip is not None:
                x0 = x0.clamp(*self.clip)
            x = C * x0 + D * x + E * e + S * noise[k]
            if self.post_clip is not None:
                x = x.clamp(*self.post_clip)
        return x


class RecordRule(TorchDispatchMode):
    """The arguments of every ``ddpm::fused_sample.rule`` call run under it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is RULE:
            self.calls.append(args)
        return func(*args, **(kwargs or {}))


def network_given(record: RecordRule) -> str:
    """The network the one recorded call hands the op, as the rewrite's INFO line writes it:
    its activations, or ``program`` and its instructions."""
    assert len(record.calls) == 1
    args = record.calls[0]
    program = args[SLOT["network"]] if len(args) > SLOT["network"] else None
    return str(list(args[SLOT["activations"]])) if program is None else f"program {list(program)}"


def network_fused(caplog) -> str:
    """The network of the one loop the rewrite fused, from its INFO line."""
    infos = [r.getMessage() for r in caplog.records if r.name == "ddpm_ops.rewrite" and r.levelno == logging.INFO]
    assert len(infos) == 1, infos
    return re.search(r"\d+ layers (.*), clip ", infos[0]).group(1)


def float64_loop(loop, *args):
    """``loop`` in float64 (its embeddings' own tensors too: float64 is the default dtype while
    it runs), on a copy."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.no_grad():
            return copy.deepcopy(loop).double()(*(a.double() for a in args))
    finally:
        torch.set_default_dtype(default)


def inputs(project: Project, batch: int):
    steps = len(project.rule)
    return (torch.randn(batch, *project.x_shape), torch.randn(batch, 11), torch.randn(steps, batch, *project.x_shape))


@pytest.mark.parametrize("name", sorted(PROJECTS))
def test_project_network_through_both_paths(name, caplog):
    torch.manual_seed(sorted(PROJECTS).index(name))
    project = PROJECTS[name]()
    project.modules.eval()
    loop = RuleLoop(project).eval()
    x, cond, noise = inputs(project, 9)

    sampler, from_sampler = project.sampler(), RecordRule()
    with torch.no_grad(), from_sampler:
        sampled = sampler(x, cond=cond, noise=noise)
    assert relative_error(sampled, float64_loop(loop, x, cond, noise)) <= 1e-5

    with torch.no_grad(), caplog.at_level(logging.INFO, logger="ddpm_ops.rewrite"):
        fused, code = run_and_get_code(torch.compile(loop), x, cond, noise)
        eager = loop(x, cond, noise)
    code = "\n".join(code)
    assert len(RULE_CALL.findall(code)) == 1 and not MATMUL.findall(code), code
    assert relative_error(fused, eager) <= 1e-5
    assert network_given(from_sampler) == network_fused(caplog)


def test_a_parametrized_weight_is_read_where_its_parametrization_computes_it():
    """A Linear under weight_norm when the sampler is built: the program names the Linear's
    ``weight`` (which the parametrization computes from its originals, read at every call), so a
    change of an original is seen, on the direct call and the general path alike."""
    torch.manual_seed(40)
    mlp = nn.Sequential(nn.Linear(3 + 11, 32), nn.Mish(), nn.Linear(32, 3))
    nn.utils.parametrizations.weight_norm(mlp[2])
    project = Project(nn.ModuleDict({"mlp": mlp}), lambda m, x, t, cond: m["mlp"](torch.cat([x, cond], -1)),
                      lambda m: m["mlp"], (("x", 3), ("cond", 11)), lambda m: None, ddpm_rule(), torch.arange(5), (3,))
    sampler = project.sampler()
    weight = sampler._program.weights[1]
    assert (weight.owner, weight.name) == (mlp[2], "weight")
    x, cond, noise = inputs(project, 7)
    with torch.no_grad():
        before = sampler(x, cond=cond, noise=noise)
        mlp[2].parametrizations.weight.original0.mul_(1.5)  # the norms of the weight's rows
        direct = sampler(x, cond=cond, noise=noise)
        assert sampler._direct[1].owners is None  # the direct call reads it through the parametrization
        general = sampler._sample(x, cond, None, noise, None, False, None)
    assert torch.equal(direct, general)
    assert relative_error(direct, before) > 1e-3
    assert relative_error(direct, float64_loop(RuleLoop(project), x, cond, noise)) <= 1e-5
