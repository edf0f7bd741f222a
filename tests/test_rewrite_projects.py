"""Sampling loops written the way diffusion projects write them (tests/loops/), compiled.

Each fused loop becomes one ``ddpm::fused_sample.rule`` call with the
numbers of eager (noise given as tensors: 1e-5); drawn noise keeps its
distribution. Near misses are left alone with a DEBUG line naming the
fact not proved. About two minutes on two CPU cores.
"""
import logging
import re

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code
from torch.utils._python_dispatch import TorchDispatchMode

import ddpm_ops  # (installs the rewrite)
from ddpm_ops import graph_pass
from loops import dpm_solver, dppo, k_diffusion, tabddpm, v1_variants
from test_rewrite import compile_run, fresh_compile  # noqa: F401  (autouse: each test compiles afresh)
from test_rewrite_models import relative_error
from loops.cases import CASES, LEFT_ALONE, _tabddpm_ddim

_tabddpm_regression = _tabddpm_ddim(num_classes=0)

RULE_CALL = re.compile(r"torch\.ops\.ddpm\.fused_sample\.(rule|default)\(")
MATMUL = re.compile(r"extern_kernels\.(mm|addmm|bmm)\b|cpp_gemm|_mkl_linear|mkldnn")



def built(name, device):
    """The loop ``name`` of tests/loops/cases.py on ``device``: on a GPU as a project built with
    ``device="cuda"`` builds it (its tensors made there; a module it builds on the CPU, as
    Diffusion-QL and diffusers' schedulers do, moved), then run with no default device, as
    users run it (under one, Dynamo traces numpy calls and ``torch.tensor`` unlike eager)."""
    if device == "cpu":
        return CASES[name]()
    with torch.device(device):
        model, args, noise_shape = CASES[name]()
    if isinstance(model, nn.Module):
        model.to(device)
    return model, args, noise_shape


def assert_fuses_with_eager_numbers(name, device="cpu"):
    """The loop ``name`` of tests/loops/cases.py compiles to one fused call, with no matmul left
    (the time MLP, the time columns and the condition's run inside the op), and eager's numbers
    (the noise given as tensors). Returns the output."""
    model, args, noise_shape = built(name, device)
    args = (*args, torch.randn(noise_shape, device=device)) if noise_shape else args
    out, code = compile_run(model, *args)
    with torch.no_grad():
        ref = model(*args)
    assert relative_error(out, ref) < 1e-5
    assert len(RULE_CALL.findall(code)) == 1, code
    assert not MATMUL.findall(code), code
    return out


def assert_fused_as_eager(code, out, ref, without):
    """One fused call and no matmul left in ``code``, eager's numbers (``ref``), which the
    numbers ``without`` the feature under test do not match (so the test sees the feature)."""
    assert relative_error(out, ref) < 1e-5
    assert relative_error(without, ref) > 1e-2
    assert len(RULE_CALL.findall(code)) == 1, code
    assert not MATMUL.findall(code), code


@pytest.mark.parametrize("name", sorted(CASES))
def test_loop_fuses_with_eager_numbers(name):
    assert_fuses_with_eager_numbers(name)


@pytest.mark.parametrize("denoised_clip", [1.0, None], ids=["x0_clamped", "x0_unclamped"])
def test_dppo_ddim_eps_clip_binds_in_the_fused_loop(denoised_clip):
    """DPPO's DDIM ``eps_clip_value`` (0.02: most eps leave the range) fused with eager's numbers:
    the eps read back from the clamped x0 and clamped (the op's rows Q and R and its eps_clip), or,
    without ``denoised_clip_value``, the network's eps clamped. Without it the numbers differ, so
    the clamp is what is checked."""
    torch.manual_seed(0)
    model = dppo.DPPOEval(use_ddim=True, eps_clip_value=0.02, denoised_clip_value=denoised_clip,
                          final_action_clip_value=None)
    cond = {"state": torch.randn(16, 2, 11)}
    noise = torch.randn(model.ddim_steps + 1, 16, model.horizon_steps, model.action_dim)
    out, code = compile_run(model, cond, noise)
    with torch.no_grad():
        ref = model(cond, noise)
        model.eps_clip_value = None
        without = model(cond, noise)
    assert_fused_as_eager(code, out, ref, without)


@pytest.fixture
def pad_mm_on_cpu():
    """Inductor's pad_mm, as it pads a GPU's misaligned matmuls (rows too: Diffusion-QL's batch of
    50 becomes 52), made to apply on the CPU."""
    from torch._inductor import config as inductor_config
    from torch._inductor.fx_passes import pad_mm
    original = pad_mm.check_device, pad_mm.has_triton
    pad_mm.check_device, pad_mm.has_triton = (lambda a, b: True), (lambda: True)
    try:
        with inductor_config.patch(force_shape_pad=True):
            yield
    finally:
        pad_mm.check_device, pad_mm.has_triton = original


@pytest.mark.parametrize("name", ["diffusion_ql", "cleandiffuser_dql_ddpm", "diffusers_ddim_clip", "tabddpm",
                                  "v1_obs", "v1_posterior", "diffusers_dpmsolver++_2M_eps_clip"])
def test_padded_matmuls_fuse_with_eager_numbers(name, pad_mm_on_cpu):
    assert_fuses_with_eager_numbers(name)


@pytest.mark.parametrize("name", ["diffusion_ql", "v1_full_noise_clamps", "v1_posterior", "cleandiffuser_dql_ddim",
                                  "tabddpm", "tabddpm_gaussian_multinomial_float64_variance",
                                  "cleandiffuser_dpmsolver++_2M_eps_clip",
                                  "flow_policy_euler_linspace_expand_fourier", "cleandiffuser_sample_ddpm_at_least_ndim",
                                  "diffusion_ql_t_arg"])
def test_dynamic_batch_fuses_with_eager_numbers(name):
    """A batch dimension compiled as a symbol: the op's sizes (its timesteps, the noise drawn)
    are read from the sample by ``sym_size`` nodes."""
    model, args, noise_shape = CASES[name]()
    compiled = torch.compile(model, dynamic=True)
    for batch in (8, 13):
        batched = tuple(a[:1].repeat(batch, *([1] * (a.dim() - 1))) + 0.1 * torch.randn(batch, *a.shape[1:])
                        if isinstance(a, torch.Tensor) and a.is_floating_point() else
                        a[:1].repeat(batch) if isinstance(a, torch.Tensor) else a for a in args)
        if noise_shape:
            batched = (*batched, torch.randn(noise_shape[0], batch, *noise_shape[2:]))
        with torch.no_grad():
            out, code = run_and_get_code(compiled, *batched)
            ref = model(*batched)
        assert relative_error(out, ref) < 1e-5
    code = "\n".join(code)
    assert len(RULE_CALL.findall(code)) == 1, code
    assert not MATMUL.findall(code), code


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(CASES))
def test_loop_fuses_on_cuda_with_eager_numbers(name):
    assert assert_fuses_with_eager_numbers(name, "cuda").is_cuda


class _OnTheCPU(torch.fx.Interpreter):
    """Runs a graph traced with its sample on the meta device on the CPU: every tensor made on
    the meta device is made on the CPU, and a move to it (``prims.device_put``) is none."""

    def call_function(self, target, args, kwargs):
        if target is torch.ops.prims.device_put.default:
            return args[0]
        kwargs = {k: torch.device("cpu") if isinstance(v, torch.device) and v.type == "meta" else v
                  for k, v in kwargs.items()}
        return super().call_function(target, args, kwargs)


def test_idql_timestep_moved_to_the_samples_device_fuses_with_eager_numbers(monkeypatch):
    """IDQL's timestep made on the CPU at every step, ``torch.tensor([t]).repeat(B)``, and moved to
    the sample's device (the GPU's ``prims.device_put`` in inductor's graph). Traced with the sample
    on the meta device, which stands for the GPU here, with inductor's decompositions: one fused
    call, the time features computed over the steps and moved once, no matmul left. The
    rewritten graph run on the CPU (its moves none) has eager's numbers (the loop's ``.float()`` of
    the timestep keeps a float64 run of it from being one)."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx
    from ddpm_ops.rewrite import plan, rewrite_graph

    monkeypatch.setattr(plan, "has_fused_rule_kernel", lambda device: True)
    model, (obs,), noise_shape = CASES["idql_repeat_time"]()
    noise = torch.randn(noise_shape)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}

    def sample(state, obs, noise):
        return torch.func.functional_call(model, state, (obs, noise))

    with torch.no_grad():
        gm = make_fx(sample, decomposition_table=select_decomp_table(), tracing_mode="fake")(
            *torch.utils._pytree.tree_map(lambda t: t.detach().to("meta"), (state, obs, noise)))
        moves = [n for n in gm.graph.nodes if n.target is torch.ops.prims.device_put.default]
        assert len(moves) == model.T, gm.graph
        assert rewrite_graph(gm.graph) == 1
        gm.recompile()
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert targets.count(torch.ops.ddpm.fused_sample.rule) == 1
        assert not {torch.ops.aten.mm.default, torch.ops.aten.addmm.default} & set(targets), gm.graph
        assert targets.count(torch.ops.prims.device_put.default) == 1  # the time features' rows, moved once
        out = _OnTheCPU(gm).run(*torch.utils._pytree.tree_leaves((state, obs, noise)))
        ref = model(obs, noise)
    assert relative_error(out, ref) < 1e-5


@pytest.mark.parametrize("name", ["diffusion_ql", "tabddpm", "tabddpm_gaussian_multinomial_float64_variance",
                                  "tiny_diffusion", "v1_full_noise_clamps",
                                  "cleandiffuser_sde_dpmsolver++_2M_eps_clip", "diffusion_ql_t_arg_where_mask"])
def test_drawn_noise_keeps_its_distribution(name):
    model, args, _ = CASES[name]()
    if name == "tiny_diffusion":
        args = (4000,)
    else:
        args = tuple(a.repeat(500 // a.shape[0] + 1, *([1] * (a.dim() - 1)))[:500]
                     if isinstance(a, torch.Tensor) and a.dim() >= 1 else a for a in args)
    torch.manual_seed(1)
    out, code = compile_run(model, *args)
    assert len(RULE_CALL.findall(code)) == 1
    torch.manual_seed(2)
    with torch.no_grad():
        ref = model(*args)
    # Means within 0.15 of each other, in units of the spread where it is wider than one (an
    # untrained TabDDPM net's last cosine step scales its output by 1/sqrt(alpha_bar) ~ 160).
    assert ((out.mean(0) - ref.mean(0)).abs() / ref.std(0).clamp(min=1)).max() < 0.15
    assert (out.std(0) / ref.std(0) - 1).abs().max() < 0.15


class SquaredUpdate(v1_variants.PosteriorSampler):
    def forward(self, x, t_start, obs=None, noise=None):
        for k in range(self.num_steps):
            i = int(t_start) - k
            eps = self.eps_net(torch.cat([x, torch.full((x.shape[0], 1), i / self.T)], 1))
            x = self.sqrt_recip_alphas_cumprod[i] * x - self.sqrt_recipm1_alphas_cumprod[i] * eps * x
        return x


class LayerNormNet(v1_variants.PosteriorSampler):
    """``norm`` between the Linears: a LayerNorm is a layer of the op's network programs; an
    RMSNorm is not. ``bias``: the Linears'."""

    def __init__(self, norm=nn.LayerNorm, bias=True, **kw):
        super().__init__(timesteps="int", **kw)
        self.eps_net = nn.Sequential(nn.Linear(self.dim + 1, 32, bias=bias), norm(32), nn.SiLU(),
                                     nn.Linear(32, self.dim, bias=bias))


class Trajectory(v1_variants.PosteriorSampler):
    def forward(self, x, t_start, obs=None, noise=None):
        chain = [x]
        for k in range(self.num_steps):
            i = int(t_start) - k
            eps = self.eps_net(torch.cat([x, torch.full((x.shape[0], 1), i / self.T)], 1))
            x = self.posterior_mean_coef1[i] * (self.sqrt_recip_alphas_cumprod[i] * x
                                                - self.sqrt_recipm1_alphas_cumprod[i] * eps) \
                + self.posterior_mean_coef2[i] * x
            chain.append(x)
        return torch.stack(chain)


class PerSampleTwice(v1_variants.PosteriorSampler):
    """Per-sample timesteps that move by two a step: not ``t_start - k``."""

    def forward(self, x, t_start, obs=None, noise=None):
        for k in range(self.num_steps):
            t = t_start - 2 * k
            eps = self.eps_net(torch.cat([x, (t.float() / self.T)[:, None]], 1))
            x = self.coef(self.sqrt_recip_alphas_cumprod, t, x) * x - self.coef(self.posterior_variance, t, x) * eps
        return x


class PerSamplePrevious(v1_variants.PosteriorSampler):
    """A table read at ``t - 1``: the lookup's range is not the table's."""

    def forward(self, x, t_start, obs=None, noise=None):
        for k in range(self.num_steps):
            t = t_start - k
            eps = self.eps_net(torch.cat([x, (t.float() / self.T)[:, None]], 1))
            x = self.coef(self.sqrt_recip_alphas_cumprod, t, x) * x - self.coef(self.betas, t - 1, x) * eps
        return x


class PerSampleFirstStep(v1_variants.PosteriorSampler):
    """Every step reads the first step's coefficient: a per-sample value no table holds."""

    def forward(self, x, t_start, obs=None, noise=None):
        c = self.coef(self.posterior_variance, t_start, x)
        for k in range(self.num_steps):
            t = t_start - k
            eps = self.eps_net(torch.cat([x, (t.float() / self.T)[:, None]], 1))
            x = self.coef(self.sqrt_recip_alphas_cumprod, t, x) * x - c * eps
        return x


@pytest.mark.parametrize("make", [LayerNormNet, lambda: LayerNormNet(bias=False),
                                  lambda: LayerNormNet(norm=lambda width: nn.LayerNorm(width, bias=False)),
                                  v1_variants.ResidualSampler, lambda: v1_variants.ResidualSampler(use_layernorm=True)],
                         ids=["layer_norm", "layer_norm_linears_without_bias", "layer_norm_without_bias",
                              "dppo_residual", "dppo_residual_layer_norm"])
def test_network_program_fuses_with_the_float64_loops_numbers(make):
    """A noise network with a LayerNorm between its Linears (with a weight and no bias too: zeros
    for its bias), or DPPO's residual MLP (pre-activation blocks, with LayerNorms or not): read as
    the op's network program, one call, no matmul left, eager's numbers and the float64 loop's."""
    torch.manual_seed(0)
    model = make().eval()
    x = torch.randn(8, model.dim)
    out, code = compile_run(model, x, model.T - 1)
    assert len(RULE_CALL.findall(code)) == 1, code
    assert not MATMUL.findall(code), code
    with torch.no_grad():
        assert relative_error(out, model(x, model.T - 1)) < 1e-5
        assert relative_error(out, model.double()(x.double(), model.T - 1)) < 1e-5


def test_exported_idql_ln_resnet_fuses_with_eager_numbers():
    """IDQL's LN-ResNet sampler exported (decomposed IR): one call with the network program."""
    model, args, noise_shape = CASES["idql_ln_resnet"]()
    args = (*args, torch.randn(noise_shape))
    with torch.no_grad():
        ep = torch.export.export(model, args).run_decompositions()
        fused = ddpm_ops.fuse_exported_program(ep)
        calls = [n for n in fused.graph.nodes if n.op == "call_function" and n.target is torch.ops.ddpm.fused_sample.rule]
        assert len(calls) == 1
        program = calls[0].args[calls[0].target._schema.arguments.index(
            next(a for a in calls[0].target._schema.arguments if a.name == "network"))]
        assert program[:2] == ["linear", "save"] and program.count("add") == 2, program
        assert relative_error(fused.module()(*args), model(*args)) < 1e-5


class WhereSelect(v1_variants.PosteriorSampler):
    """The posterior step whose result is picked by ``torch.where`` between two updates that
    differ at every timestep: the noised posterior mean where ``t >= split``, the clamped x0
    elsewhere (``condition="sample"``: picked by the sample's sign, not one boolean per sample)."""

    def __init__(self, split=12, condition="timestep", **kw):
        super().__init__(clip=(-1.0, 1.0), **kw)  # tensor timesteps: extract's gather
        self.split, self.condition = split, condition

    def forward(self, x, t_start, noise):
        b = x.shape[0]
        for k in range(self.num_steps):
            if isinstance(t_start, int):  # shared timesteps
                t = torch.full((b,), t_start - k, dtype=torch.long)
            else:
                t = t_start - k
            eps = self.eps_net(torch.cat([x, (t.float() / self.T)[:, None]], dim=1))
            x0 = (self.coef(self.sqrt_recip_alphas_cumprod, t, x) * x
                  - self.coef(self.sqrt_recipm1_alphas_cumprod, t, x) * eps).clamp(*self.clip)
            mean = self.coef(self.posterior_mean_coef1, t, x) * x0 + self.coef(self.posterior_mean_coef2, t, x) * x
            noised = mean + self.coef(self.posterior_variance, t, x).sqrt() * noise[k]
            pick = (t >= self.split)[:, None] if self.condition == "timestep" else x > 0
            x = torch.where(pick, noised, x0)
        return x


@pytest.mark.parametrize("timesteps", ["tensor", "int"])
def test_where_between_two_updates_fuses_with_eager_numbers(timesteps):
    """``torch.where`` of a per-sample boolean between two affine updates is read as the
    per-variable selection of their coefficients: one fused call, eager's numbers. Per-sample
    timesteps straddle ``split`` inside the loop, so both branches are taken, row by row and step
    by step; shared ones cross it at one step of the loop."""
    torch.manual_seed(0)
    model = WhereSelect()
    x, noise = torch.randn(16, model.dim), torch.randn(model.num_steps, 16, model.dim)
    if timesteps == "int":
        t = model.split + model.num_steps // 2
    else:
        t = torch.randint(model.num_steps - 1, model.T, (16,))
        t[:2], t[2:4] = model.split - 1, model.T - 1  # below split from the first step; above it to the last
    out, code = compile_run(model, x, t, noise)
    with torch.no_grad():
        ref = model(x, t, noise)
        # Taking either branch everywhere gives other numbers: the selection is what is checked.
        model.split = -1
        all_noised = model(x, t, noise)
    assert_fused_as_eager(code, out, ref, all_noised)


def test_where_on_the_sample_is_left_alone_and_says_why(caplog):
    torch.manual_seed(0)
    model = WhereSelect(condition="sample")
    x, noise = torch.randn(8, model.dim), torch.randn(model.num_steps, 8, model.dim)
    t = torch.randint(model.num_steps - 1, model.T, (8,))
    with caplog.at_level(logging.DEBUG, logger="ddpm_ops.rewrite"):
        out, code = compile_run(model, x, t, noise)
    assert not RULE_CALL.search(code)
    with torch.no_grad():
        assert relative_error(out, model(x, t, noise)) < 1e-5
    assert_general_reason(caplog, "selects with a condition that depends on the sample")


class ColumnsOneByOne(v1_variants.PosteriorSampler):
    """The network reads each coordinate of the sample as a column of its own (tiny-diffusion's
    per-coordinate input embedding), ``order``: "in order" (``x[:, 0:1], x[:, 1:2], ...``, the
    sample's columns as they are) or "swapped" (the first two exchanged: not the sample)."""

    def __init__(self, order="in order", spelling="select", **kw):
        super().__init__(timesteps="int", **kw)
        self.order, self.spelling = order, spelling

    def forward(self, x, t_start, noise=None):
        for k in range(self.num_steps):
            i = int(t_start) - k
            idx = list(range(self.dim))
            if self.order == "swapped":
                idx[0], idx[1] = 1, 0
            cols = [x[:, j].unsqueeze(-1) if self.spelling == "select" else x[:, j:j + 1] for j in idx]
            eps = self.eps_net(torch.cat([*cols, torch.full((x.shape[0], 1), i / self.T)], dim=1))
            x = self.sqrt_recip_alphas_cumprod[i] * x - self.sqrt_recipm1_alphas_cumprod[i] * eps
        return x


@pytest.mark.parametrize("spelling", ["select", "slice"])
def test_sample_read_column_by_column_fuses_with_eager_numbers(spelling):
    torch.manual_seed(0)
    model = ColumnsOneByOne(spelling=spelling)
    x = torch.randn(8, model.dim)
    out, code = compile_run(model, x, model.T - 1)
    with torch.no_grad():
        assert relative_error(out, model(x, model.T - 1)) < 1e-5
    assert len(RULE_CALL.findall(code)) == 1, code
    assert not MATMUL.findall(code), code


def test_sample_columns_out_of_order_are_left_alone(caplog):
    """Columns of the sample in another order are a permutation of it, not the sample: not
    joined, so the network reads the sample in several pieces and the loop is left alone."""
    torch.manual_seed(0)
    model = ColumnsOneByOne(order="swapped")
    x = torch.randn(8, model.dim)
    with caplog.at_level(logging.DEBUG, logger="ddpm_ops.rewrite"):
        out, code = compile_run(model, x, model.T - 1)
    assert not RULE_CALL.search(code)
    with torch.no_grad():
        assert relative_error(out, model(x, model.T - 1)) < 1e-5
    lines = [r.getMessage() for r in caplog.records if r.name == "ddpm_ops.rewrite"]
    assert any(m.startswith(REWRITE) and "reads the previous step's sample in more than one piece" in m
               for m in lines), lines


class TensorBounds(v1_variants.PosteriorSampler):
    """x0 clamped to per-column bounds held in buffers (CleanDiffuser's ``x_min`` / ``x_max``),
    ``bounds``: "both" (``x0.clip(lo, hi)``), "number_low" (``x0.clamp(min=-0.7).clamp(max=hi)``),
    "negated" (``x0.clamp(-hi, hi)``: each step negates ``hi`` again; "negated_final_clamp" then
    clamps the result to (-0.6, 0.6) after the loop, outside the op), "scalar" (a 0-d
    ``max_action`` buffer, ``x0.clamp(-max_action, max_action)``) or "per_row" (a ``(B, dim)``
    bound: not one value per column)."""

    def __init__(self, bounds="both", **kw):
        super().__init__(timesteps="int", **kw)
        self.bounds = bounds
        self.register_buffer("lo", -torch.linspace(0.3, 1.2, self.dim))
        self.register_buffer("hi", torch.linspace(1.1, 0.2, self.dim))
        self.register_buffer("max_action", torch.tensor(0.6))

    def forward(self, x, t_start, noise=None):
        for k in range(self.num_steps):
            i = int(t_start) - k
            eps = self.eps_net(torch.cat([x, torch.full((x.shape[0], 1), i / self.T)], dim=1))
            x0 = self.sqrt_recip_alphas_cumprod[i] * x - self.sqrt_recipm1_alphas_cumprod[i] * eps
            if self.bounds == "both":
                x0 = x0.clip(self.lo, self.hi)
            elif self.bounds == "number_low":
                x0 = x0.clamp(min=-0.7).clamp(max=self.hi)
            elif self.bounds.startswith("negated"):
                x0 = x0.clamp(-self.hi, self.hi)
            elif self.bounds == "scalar":
                x0 = x0.clamp(-self.max_action, self.max_action)
            else:
                x0 = x0.clip(self.lo.expand(x.shape), self.hi.expand(x.shape))
            x = self.posterior_mean_coef1[i] * x0 + self.posterior_mean_coef2[i] * x
        return x.clamp(-0.6, 0.6) if self.bounds == "negated_final_clamp" else x


@pytest.mark.parametrize("bounds", ["both", "number_low", "negated", "negated_final_clamp", "scalar"])
def test_x0_clamped_to_per_column_tensors_fuses_with_eager_numbers(bounds):
    """The bounds go to the op as its per-column ``clip_bounds``: one fused call, eager's numbers.
    The bounds are tight enough to clamp (without them the numbers differ), and differ by column
    (a bound read as one number for every column would give other numbers), but for the 0-d
    ``max_action``, which the op takes as that value in every column."""
    torch.manual_seed(0)
    model = TensorBounds(bounds=bounds)
    x = 3 * torch.randn(16, model.dim)
    out, code = compile_run(model, x, model.T - 1)
    with torch.no_grad():
        ref = model(x, model.T - 1)
        bounds = [b.clone() for b in (model.lo, model.hi, model.max_action)]
        for b in (model.lo, model.hi, model.max_action):
            b.copy_(torch.full_like(b, 1e9) * b.sign())
        unclamped = model(x, model.T - 1)
        for b, value in zip((model.lo, model.hi, model.max_action), bounds):
            b.copy_(value)
    assert_fused_as_eager(code, out, ref, unclamped)


def test_x0_clamped_to_per_row_tensors_is_left_alone(caplog):
    torch.manual_seed(0)
    model = TensorBounds(bounds="per_row")
    x = 3 * torch.randn(8, model.dim)
    with caplog.at_level(logging.DEBUG, logger="ddpm_ops.rewrite"):
        out, code = compile_run(model, x, model.T - 1)
    assert not RULE_CALL.search(code)
    with torch.no_grad():
        assert relative_error(out, model(x, model.T - 1)) < 1e-5
    assert_general_reason(caplog, "that is not one float32 or float64 value, or one per column of a (batch, dim) "
                                  "sample")


NEAR_MISSES = {
    "not affine": (SquaredUpdate(timesteps="int"), "multiplies two sample-dependent values"),
    "unsupported op": (LayerNormNet(norm=nn.RMSNorm), "reading it is not an activation the reader knows"),
    "per-sample, two a step": (PerSampleTwice(), "at its own timestep"),
    "per-sample, t - 1": (PerSamplePrevious(), "reads the timestep at offset 1"),
    "per-sample, first step's value": (PerSampleFirstStep(), "may differ between samples"),
    # torch's clamp with min > max gives max everywhere; the op refuses such a range.
    "clamp with lo > hi": (v1_variants.PosteriorSampler(timesteps="int", clip=(1.0, -1.0)),
                           "the op refuses the arguments read: "),
}


REWRITE = "ddpm_ops: rewrite: "


def assert_general_reason(caplog, reason):
    """The rewrite's DEBUG line of a loop left alone gives ``reason``."""
    lines = [r.getMessage() for r in caplog.records
             if r.name == "ddpm_ops.rewrite" and r.levelno == logging.DEBUG]
    assert any(m.startswith(REWRITE + "loop of ") and " left alone: " in m and reason in m
               for m in lines), lines
    assert all(m.startswith(REWRITE) for m in lines), lines


@pytest.mark.parametrize("case", sorted(NEAR_MISSES))
def test_near_misses_are_left_alone_and_say_why(case, caplog):
    model, reason = NEAR_MISSES[case]
    x = torch.randn(8, model.dim)
    t = model.T - 1 if model.timesteps == "int" else torch.randint(2 * model.num_steps, model.T, (8,))
    # torch's loggers do not propagate: hear fake tensor mode's (it logs a Meta kernel that raises).
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    fake_log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.DEBUG, logger="ddpm_ops.rewrite"):
            out, code = compile_run(model, x, t)
    finally:
        fake_log.removeHandler(caplog.handler)
    assert not RULE_CALL.search(code)
    with torch.no_grad():
        assert relative_error(out, model(x, t)) < 1e-5
    assert_general_reason(caplog, reason)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_fused_loop_logs_no_reason(caplog):
    """A fused loop: its INFO line, and no line says it was left alone."""
    model, args, _ = CASES["v1_int_t"]()
    with caplog.at_level(logging.DEBUG, logger="ddpm_ops.rewrite"):
        compile_run(model, *args)
    lines = [r.getMessage() for r in caplog.records if r.name == "ddpm_ops.rewrite"]
    assert any(m.startswith(f"ddpm_ops: fused {model.num_steps} steps into one ddpm::fused_sample.rule")
               for m in lines), lines
    assert not any("left alone" in m for m in lines), lines


def test_kept_trajectory_fuses_step_by_step(caplog):
    """Every sample kept: the loop is cut before each step, and each step is a loop of its own."""
    torch.manual_seed(0)
    model = Trajectory(timesteps="int")
    x = torch.randn(8, model.dim)
    with caplog.at_level(logging.DEBUG, logger="ddpm_ops.rewrite"):
        out, code = compile_run(model, x, model.T - 1)
    with torch.no_grad():
        assert relative_error(out, model(x, model.T - 1)) < 1e-5
    assert len(RULE_CALL.findall(code)) == model.num_steps
    assert not MATMUL.findall(code), code
    lines = [r.getMessage() for r in caplog.records if r.name == "ddpm_ops.rewrite"]
    assert any("cut at its step 1" in m and "(a trajectory kept?)" in m for m in lines), lines


ODE_LOOPS = ["cleandiffuser_dpmsolver++_2M_eps_clip", "cleandiffuser_dpmsolver++_2M_x0",
             "diffusers_dpmsolver++_2M_eps", "diffusers_dpmsolver++_2M_v_sigma_min",
             "dpm_solver_2M_named_previous_clip", "flow_policy_euler_float_time",
             "flow_policy_euler_linspace_expand_fourier"]


@pytest.mark.parametrize("name", ODE_LOOPS)
def test_ode_loop_has_the_float64_loops_numbers(name):
    """A DPM-Solver++ 2M loop keeping the previous x0 in a Python variable, or a flow policy's
    Euler loop, fused into one call (test_loop_fuses_with_eager_numbers: against eager float32,
    no matmul left), against the same loop run in float64 on fresh inputs (ODE samplers: nothing
    drawn after x_T)."""
    model, args, _ = CASES[name]()
    args = tuple(torch.randn_like(a) for a in args)
    out, code = compile_run(model, *args)
    assert len(RULE_CALL.findall(code)) == 1, code
    with torch.no_grad():
        ref64 = model.double()(*[a.double() for a in args])
    assert relative_error(out, ref64) < 1e-5


class _RecordRule(TorchDispatchMode):
    """The arguments of every ``ddpm::fused_sample.rule`` call run under it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.ddpm.fused_sample.rule:
            self.calls.append(args)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("prediction,final,lower_order_final", [
    ("epsilon", "zero", True), ("sample", "sigma_min", True), ("v_prediction", "sigma_min", False)])
def test_multistep_loop_reads_dpm_solver_pps_tables(prediction, final, lower_order_final, caplog):
    """The diffusers-style 2M loop's fused call holds the tables ddpm_ops.step_rules.dpm_solver_pp
    builds for the same schedule: a 7th row P, the previous x0's coefficient, zero at the call's
    first step (s = K - 1, first order) and where diffusers steps first order at the end. A step
    whose x0 the next step reads has the rule's A, B and C too (that x0 is the one the op keeps);
    another step's x0 is folded into D and E."""
    torch.manual_seed(0)
    model = dpm_solver.DiffusersStyle2M(prediction_type=prediction, final_sigmas_type=final,
                                        lower_order_final=lower_order_final).eval()
    args = (torch.randn(8, 3), torch.randn(8, model.dim))
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="ddpm_ops.rewrite"):
        fused = ddpm_ops.fuse_exported_program(torch.export.export(model, args))
        record = _RecordRule()
        with record:
            out = fused.module()(*args)
        assert relative_error(out, model(*args)) < 1e-5
    assert len(record.calls) == 1
    infos = [r.getMessage() for r in caplog.records if r.name == "ddpm_ops.rewrite" and r.levelno == logging.INFO]
    assert len(infos) == 1 and infos[0].endswith(", noise no, previous x0 yes)"), infos
    tables = record.calls[0][4]
    K = len(model.timesteps)
    rule = ddpm_ops.step_rules.dpm_solver_pp(model.alphas_cumprod, sorted(model.timesteps), order=2,
                                             prediction=prediction, final_sigmas_type=final,
                                             lower_order_final=lower_order_final)
    expected = torch.stack([rule.A, rule.B, rule.C, rule.D, rule.E, rule.S, rule.P])
    assert tables.shape == (7, K)
    assert tables[6, K - 1] == 0 and rule.P[K - 1] == 0
    assert bool((rule.P[1:K - 1] != 0).all())  # the row matters: every middle step is second order
    torch.testing.assert_close(tables[6], expected[6], rtol=1e-4, atol=1e-6)
    kept = [s for s in range(1, K) if rule.P[s - 1] != 0]  # steps whose x0 the next one reads
    assert kept == list(range(2 if lower_order_final else 1, K))
    torch.testing.assert_close(tables[:, kept], expected[:, kept], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind,reasons", [
    # DPM-Solver++ 3M's data: the x0 of two steps back. Each step is cut where its x0 goes further
    # than the next step, and what is left reads an x0 from before its first step.
    ("ThirdOrder3M", ["the op gives a step's x0 to the next step only",
                      "a step before the loop's first: the op gives a call's first step no previous x0"]),
    ("PreviousBeforeClip", ["the next step reads div, an x0 of this step other than the one it clamps"]),
    ("PerSample2M", ["a step reads the previous step's x0 (a multistep solver), which is read with "
                     "timesteps shared by the batch only"]),
])
def test_multistep_loop_the_op_cannot_run_is_left_alone_and_says_why(kind, reasons, caplog):
    """Multistep loops whose previous-x0 term is not the op's (one x0, the clamped one, from the
    step before, with timesteps shared by the batch): left alone with eager's numbers, and the
    DEBUG line names why."""
    torch.manual_seed(0)
    model = getattr(dpm_solver, kind)()
    args = (torch.randn(16, 11), torch.randn(16, 3))
    if kind == "PerSample2M":
        args = (*args, torch.randint(model.num_steps - 1, model.T, (16,)))
    with caplog.at_level(logging.DEBUG, logger="ddpm_ops.rewrite"):
        out, code = compile_run(model, *args)
    with torch.no_grad():
        assert relative_error(out, model(*args)) < 1e-5
    assert not RULE_CALL.search(code)
    lines = [r.getMessage() for r in caplog.records if r.name == "ddpm_ops.rewrite"]
    for reason in reasons[:-1]:
        assert any(" cut at its step " in m and reason in m for m in lines), lines
    assert_general_reason(caplog, reasons[-1])


def test_x0_from_an_eps_clamped_with_other_coefficients_is_left_alone(caplog):
    """CleanDiffuser's DPM-Solver++ 2M with its eps clip, its x_theta computed with the next step's
    sigma: not the clamped x0 (its x terms do not cancel), so no previous x0 for the next step."""
    torch.manual_seed(0)
    model = dpm_solver.CleanDiffuser2M(eps_bounds=True, theta_sigma_offset=1)
    args = (torch.randn(16, 11), torch.randn(16, 3))
    with caplog.at_level(logging.DEBUG, logger="ddpm_ops.rewrite"):
        out, code = compile_run(model, *args)
    with torch.no_grad():
        assert relative_error(out, model(*args)) < 1e-5
    assert not RULE_CALL.search(code)
    assert_general_reason(caplog, "the next step reads a value of this step that is not A*x - B*e (its x0 "
                                  "prediction) but x + x0")


def test_float64_network_is_left_alone(caplog):
    """A loop whose network computes in float64 (the whole module made float64): the op's network
    computes in float32."""
    model = v1_variants.PosteriorSampler(timesteps="int").double()
    x = torch.randn(8, model.dim, dtype=torch.float64)
    with caplog.at_level(logging.DEBUG, logger="ddpm_ops.rewrite"):
        _, code = compile_run(model, x, model.T - 1)
    assert not RULE_CALL.search(code)
    assert_general_reason(caplog, "the network reads a torch.float64 input; the op's network computes in "
                                  "float32 only")


def test_tabddpm_float64_variance_fuses_with_eager_numbers():
    """TabDDPM's float64 posterior variance makes the sample float64 between the networks (each
    casts it back to float32), from the first step on (the first sample is float32): one fused
    call whose step computes in float64, with eager's float64 numbers."""
    torch.manual_seed(0)
    model = tabddpm.GaussianSampler(as_project=True)
    y, noise = torch.randint(0, 3, (64,)), torch.randn(9, 64, 6)
    out, code = compile_run(model, y, noise)
    with torch.no_grad():
        ref = model(y, noise)
    assert out.dtype == ref.dtype == torch.float64
    assert relative_error(out, ref) < 1e-5
    assert len(RULE_CALL.findall(code)) == 1, code
    assert not MATMUL.findall(code), code


class SampleAddedToFirstLayer(nn.Module):
    """``mlp(proj(a) + act(skip(b)))`` with the sample in ``b`` (``both``: in ``a`` too, a
    residual connection): an addend of the first layer the op cannot take as a bias."""

    def __init__(self, dim=4, hidden=32, num_steps=5, both=False):
        super().__init__()
        self.proj, self.skip = nn.Linear(dim + 1 if both else 1, hidden), nn.Linear(dim, hidden)
        self.mlp = nn.Sequential(nn.SiLU(), nn.Linear(hidden, dim))
        self.num_steps, self.both = num_steps, both

    def forward(self, x):
        for k in range(self.num_steps):
            t = torch.full((x.shape[0], 1), k / self.num_steps)
            a = torch.cat([x, t], 1) if self.both else t
            x = 0.9 * x - 0.1 * self.mlp(self.proj(a) + torch.tanh(self.skip(x)))
        return x


@pytest.mark.parametrize("both, reason", [
    (False, "added to the first Linear's output, reads the previous step's sample"),
    (True, "reads the previous step's sample in more than one piece")])
def test_sample_in_an_addend_of_the_first_layer_is_left_alone(both, reason, caplog):
    model = SampleAddedToFirstLayer(both=both)
    x = torch.randn(8, 4)
    with caplog.at_level(logging.DEBUG, logger="ddpm_ops.rewrite"):
        out, code = compile_run(model, x)
    assert not RULE_CALL.search(code)
    with torch.no_grad():
        assert relative_error(out, model(x)) < 1e-5
    lines = [r.getMessage() for r in caplog.records if r.name == "ddpm_ops.rewrite"]
    assert any(m.startswith(REWRITE) and reason in m for m in lines), lines


def test_loop_on_a_device_without_a_fused_kernel_is_left_alone(caplog, monkeypatch):
    """Where the general step has no fused kernel (a device but the CPU and CUDA) the op would
    run its ATen loop, slower than inductor's own code: the reader leaves the loop to inductor."""
    from ddpm_ops.rewrite import plan
    monkeypatch.setattr(plan, "has_fused_rule_kernel", lambda device: False)
    model, args, _ = CASES["diffusion_ql"]()
    with caplog.at_level(logging.DEBUG, logger="ddpm_ops.rewrite"):
        _, code = compile_run(model, *args)
    assert not RULE_CALL.search(code)
    assert_general_reason(caplog, "ddpm::fused_sample.rule has no fused kernel on cpu")


def test_training_graph_is_left_alone(caplog):
    model = v1_variants.PosteriorSampler(timesteps="int")
    x = torch.randn(8, model.dim)
    with caplog.at_level(logging.DEBUG, logger="ddpm_ops.rewrite"):
        out, code = run_and_get_code(torch.compile(model), x, model.T - 1)
    assert not RULE_CALL.search("\n".join(code))
    lines = [r.getMessage() for r in caplog.records if r.name == "ddpm_ops.rewrite"]
    if graph_pass._HAS_INFERENCE_FLAG:
        assert lines == ["ddpm_ops: training graph left alone (the op has no backward)"], lines
    else:  # torch < 2.12 does not tell a pass that it sees a training graph
        assert any(m.startswith(REWRITE) and "left alone" in m for m in lines), lines
    out.sum().backward()
    assert model.eps_net[0].weight.grad is not None


def test_rewrite_stats_count_fused_loops():
    before = ddpm_ops.rewrite_stats()
    model, args, noise_shape = CASES["v1_int_t"]()
    compile_run(model, *args)
    after = ddpm_ops.rewrite_stats()
    assert after["loops_fused"] == before["loops_fused"] + 1
    assert after["steps_fused"] == before["steps_fused"] + model.num_steps


@pytest.mark.parametrize("name", sorted(LEFT_ALONE))
def test_project_loop_the_op_cannot_run_is_left_alone_and_says_why(name, caplog):
    """A project's loop outside what the op computes (tests/loops/cases.py's LEFT_ALONE): no fused
    call, eager's numbers (the noise given as tensors), and the DEBUG line naming why."""
    make, reason = LEFT_ALONE[name]
    model, args, noise_shape = make()
    args = (*args, torch.randn(noise_shape)) if noise_shape else args
    with caplog.at_level(logging.DEBUG, logger="ddpm_ops.rewrite"):
        out, code = compile_run(model, *args)
    with torch.no_grad():
        ref = model(*args)
    assert not RULE_CALL.search(code)
    assert relative_error(out, ref) < 1e-5
    lines = [r.getMessage() for r in caplog.records
             if r.name == "ddpm_ops.rewrite" and r.levelno == logging.DEBUG]
    assert any(m.startswith(REWRITE) and reason in m for m in lines), lines


def test_tabddpm_regression_label_fuses_with_its_label_linear_once_a_call():
    """TabDDPM's regression target (num_classes 0): ``silu(Linear(1, dim_t)(y.resize(B, 1).float()))``
    added to the time embedding, a term of the first layer the op takes as rows computed once a
    call: one fused call, that Linear's one matmul left, eager's numbers."""
    model, args, noise_shape = _tabddpm_regression()
    args = (*args, torch.randn(noise_shape))
    out, code = compile_run(model, *args)
    with torch.no_grad():
        ref = model(*args)
    assert relative_error(out, ref) < 1e-5
    assert len(RULE_CALL.findall(code)) == 1, code
    assert len(MATMUL.findall(code)) == 1, code


@pytest.mark.parametrize("name", ["cleandiffuser_sde_sample_dql_ddpm_x0", "cleandiffuser_sde_sample_idql_ddim_x0",
                                  "cleandiffuser_sde_sample_mlp_ddpm_x0"])
def test_cleandiffuser_prior_blend_keeps_eagers_nan_rows(name):
    """CleanDiffuser's default ``fix_mask`` 0.: ``xt * 1. + prior * 0.`` before the loop and after every
    step, fused as ``op(x_T + c) + c`` with ``c = prior * 0.``. A prior holding inf and NaN in one row:
    that row NaN as in eager, the others eager's numbers."""
    model, (condition, prior), noise_shape = CASES[name]()
    prior = prior.clone()
    prior[3, 0], prior[3, 2] = float("inf"), float("nan")
    args = (condition, prior, torch.randn(noise_shape))
    out, code = compile_run(model, *args)
    with torch.no_grad():
        ref = model(*args)
    assert len(RULE_CALL.findall(code)) == 1, code
    assert not MATMUL.findall(code), code
    assert torch.equal(out.isnan(), ref.isnan()) and ref[3].isnan().all()
    rows = torch.arange(len(ref)) != 3
    assert relative_error(out[rows], ref[rows]) < 1e-5


@pytest.mark.parametrize("name", ["cleandiffuser_sde_sample_dql_ddpm", "cleandiffuser_sample_ddpm_eps_clip_tensor_bounds"])
def test_cleandiffuser_eps_clip_with_most_samples_clamped_keeps_eagers_numbers(name):
    """CleanDiffuser's predict-noise clip, eps clamped to ``((xt - alpha * x_max) / sigma, (xt - alpha *
    x_min) / sigma)``, fused as the clamp of x0 to ``(x_min, x_max)``: with large noise most entries
    hit a bound at every step, and the fused loop still has eager's numbers (which the loop without
    the clip does not)."""
    model, args, noise_shape = CASES[name]()
    args = (*args, 10 * torch.randn(noise_shape))
    out, code = compile_run(model, *args)
    hits, total = [0], [0]

    def counting(pred, lo, hi):  # eager only: the compiled loop is traced already
        hits[0] += int(((pred < lo) | (pred > hi)).sum())
        total[0] += pred.numel()
        return torch.clamp(pred, lo, hi)

    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "clip", lambda self, lo=None, hi=None: counting(self, lo, hi)
                   if isinstance(lo, torch.Tensor) and lo.shape == self.shape else torch.clamp(self, lo, hi))
        ref = model(*args)
    assert hits[0] > 0.5 * total[0]
    with torch.no_grad():
        if hasattr(model, "clip"):
            model.clip = None
        else:
            model.x_max = model.x_min = None
        without = model(*args)
    assert_fused_as_eager(code, out, ref, without)


def _float64(model):
    """``model`` in float64, EDM's casts to float32 too."""
    model = model.double()
    for m in model.modules():
        if isinstance(m, k_diffusion.EDMPrecond):
            m.float = torch.float64
    return model


def _posterior(batch=8, **kw):
    """``v1_variants.PosteriorSampler(**kw)`` with its inputs: a sample, ``t_start``, no
    observation and a noise tensor."""
    torch.manual_seed(0)
    m = v1_variants.PosteriorSampler(**kw)
    t = torch.randint(m.num_steps - 1, m.T, (batch,)) if m.timesteps == "tensor" else m.T - 1
    return m, (torch.randn(m.shape(batch)), t, None, torch.randn(m.num_steps, *m.shape(batch)))


def _case(name):
    model, args, noise_shape = CASES[name]()
    return model, (*args, torch.randn(noise_shape))


SCALED_OR_REORDERED = {
    **{name: lambda name=name: _case(name) for name in (
        "edm_precond_euler", "beso_gc_denoiser_ddim", "diffusers_euler_discrete_scale_model_input")},
    "c_in, x0 clamped, noise": lambda: _posterior(timesteps="int", c_in=True, clip=(-1.0, 1.0), noise=True),
    "c_in, torch.full timesteps": lambda: _posterior(timesteps="full", c_in=True, noise=True),
    "chunk channels first, x0 clamped, noise": lambda: _posterior(timesteps="int", chunk=(4, 2), clip=(-1.0, 1.0),
                                                                  noise=True),
    "chunk channels first, per-sample timesteps": lambda: _posterior(timesteps="tensor", chunk=(4, 2), noise=True),
    "chunk channels first, c_in": lambda: _posterior(timesteps="int", chunk=(4, 2), c_in=True, noise=True),
}


@pytest.mark.parametrize("case", sorted(SCALED_OR_REORDERED))
def test_scaled_or_reordered_sample_fuses_with_the_float64_loops_numbers(case):
    """A network that reads the sample scaled by a number per step (``c_in * x``) or an action chunk
    in another order of its elements (channels first, its output laid out back): one fused call,
    no matmul left, the numbers of eager and of the float64 loop (the noise given as tensors)."""
    model, args = SCALED_OR_REORDERED[case]()
    out, code = compile_run(model, *args)
    with torch.no_grad():
        ref = model(*args)
        ref64 = _float64(model)(*[a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                                  for a in args])
    assert len(RULE_CALL.findall(code)) == 1, code
    assert not MATMUL.findall(code), code
    assert relative_error(out, ref) < 1e-5
    assert relative_error(out, ref64) < 1e-5


def _zero_c_in_at_the_third_step():
    model, args = _posterior(timesteps="int", c_in=True)
    model.c_in[model.T - 3] = 0.0
    return model, args


SCALED_OR_REORDERED_LEFT_ALONE = {
    # The op's state after a step is the sample scaled for the next step: c_in read at t - 1.
    "c_in, per-sample timesteps": (lambda: _posterior(timesteps="tensor", c_in=True),
                                   "which is read with timesteps shared by the batch only"),
    "c_in, the result clamped": (lambda: _posterior(timesteps="int", c_in=True, post_clip=(-2.0, 2.0)),
                                 "and the steps clamp their result"),
    # The op's tables divide by the scale.
    "c_in zero at a step": (_zero_c_in_at_the_third_step, "which is zero or not finite"),
    "chunk read channels first, written as it is": (
        lambda: _posterior(timesteps="int", chunk=(4, 2), write_back=False),
        "is not laid out back in the sample's order and shape"),
}


@pytest.mark.parametrize("case", sorted(SCALED_OR_REORDERED_LEFT_ALONE))
def test_scaled_or_reordered_sample_the_op_cannot_run_is_left_alone_and_says_why(case, caplog):
    make, reason = SCALED_OR_REORDERED_LEFT_ALONE[case]
    model, args = make()
    with caplog.at_level(logging.DEBUG, logger="ddpm_ops.rewrite"):
        out, code = compile_run(model, *args)
    assert not RULE_CALL.search(code)
    with torch.no_grad():
        assert relative_error(out, model(*args)) < 1e-5
    assert_general_reason(caplog, reason)


def test_exported_transposed_chunk_fuses_and_scaled_sample_is_left_alone(caplog):
    """``fuse_exported_program``: the chunk read channels first fuses as under torch.compile; the
    scaled sample is left alone, its factors not proved nonzero (an exported program's buffers
    are its inputs)."""
    for kw, fuses in ((dict(timesteps="tensor", chunk=(4, 2), noise=True), True), (dict(timesteps="int", c_in=True), False)):
        model, args = _posterior(**kw)
        with torch.no_grad(), caplog.at_level(logging.DEBUG, logger="ddpm_ops.rewrite"):
            fused = ddpm_ops.fuse_exported_program(torch.export.export(model, args).run_decompositions())
            calls = [n for n in fused.graph.nodes if n.target is torch.ops.ddpm.fused_sample.rule]
            assert len(calls) == fuses
            assert relative_error(fused.module()(*args), model(*args)) < 1e-5
    assert_general_reason(caplog, "which is not proved finite and nonzero: it is not computed from constants and "
                                  "module buffers at compile time")
