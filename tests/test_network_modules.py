"""DiffusionSampler with the noise networks of IDQL, CleanDiffuser and DPPO as the projects write
them (tests/project_networks.py): read once at construction, parameters at every call, against
each project's own loop in float64; and networks it cannot read."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ddpm_ops
from network_problems import dppo_rule, idql_rule
from problems import relative_error
from project_networks import (DiffusionMLP, FourierFeatures, GaussianFourierProjection, IDQLMLP, IDQLMlp, MLPResNet,
                              ResidualBlock, ResidualMLP, idql_time_encoder)

TOLERANCE = 1e-5


def idql_loop(reverse, time_encoder, rule, state, x, noise):
    """IDQL's ddpm_sampler (jaxrl5) in float64: eps of cat[a, s, cond_encoder(t)], the v1 update,
    sqrt(beta) z for t > 0, clipped every step; the rule's A = 1, B, C, S are its coefficients."""
    reverse, time_encoder = copy.deepcopy(reverse).double(), copy.deepcopy(time_encoder).double()
    x = x.double()
    T = len(rule)
    with torch.no_grad():
        for k, t in enumerate(reversed(range(T))):
            time = torch.full((x.shape[0],), float(t), dtype=torch.float64)
            eps = reverse(torch.cat([x, state.double(), time_encoder(time).double()], -1))
            x = rule.C[t].double() * (x - rule.B[t].double() * eps) + rule.S[t].double() * noise[k].double()
            x = x.clamp(-1, 1)
    return x


@pytest.mark.parametrize("batch", [1, 16, 130])
def test_idql_ln_resnet(batch):
    torch.manual_seed(batch)
    reverse = MLPResNet(3, 6 + 17 + 128, 6, dropout_rate=0.1, use_layer_norm=True, hidden_dim=256).eval()
    time_encoder = idql_time_encoder()
    rule = idql_rule()
    sampler = ddpm_ops.DiffusionSampler(reverse, rule, torch.arange(5.0), layout=(("x", 6), ("cond", 17),
                                        ("time", 128)), time_embedding=time_encoder)
    state, x, noise = torch.randn(batch, 17), torch.randn(batch, 6), torch.randn(5, batch, 6)
    with torch.no_grad():
        out = sampler(x, cond=state, noise=noise)
    assert relative_error(out, idql_loop(reverse, time_encoder, rule, state, x, noise)) <= TOLERANCE


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_idql_mlp_with_a_layer_norm_over_the_whole_input(batch):
    torch.manual_seed(100 + batch)
    reverse = IDQLMLP(6 + 17 + 128, (256, 256, 256, 6), use_layer_norm=True, dropout_rate=0.1).eval()
    with torch.no_grad():  # trained-looking LayerNorm parameters
        reverse.norm.weight.normal_(1.0, 0.3)
        reverse.norm.bias.normal_(0.0, 0.3)
    time_encoder = idql_time_encoder()
    rule = idql_rule()
    sampler = ddpm_ops.DiffusionSampler(reverse, rule, torch.arange(5.0), layout=(("x", 6), ("cond", 17),
                                        ("time", 128)), time_embedding=time_encoder)
    assert sampler._program.instructions[0].startswith("layer_norm_affine")
    state, x, noise = torch.randn(batch, 17), torch.randn(batch, 6), torch.randn(5, batch, 6)
    with torch.no_grad():
        out = sampler(x, cond=state, noise=noise)
    assert relative_error(out, idql_loop(reverse, time_encoder, rule, state, x, noise)) <= TOLERANCE


def test_linears_without_bias_in_the_network_and_the_time_mlp():
    """nn.Linear(bias=False) as every layer of the network (the first and the last too) and in
    the time MLP: the op gets zeros for those biases, made once for the argument list the direct
    call keeps; the direct call and the general path give IDQL's loop's numbers in float64."""
    torch.manual_seed(3)
    reverse = nn.Sequential(nn.Linear(6 + 17 + 128, 256, bias=False), nn.Mish(), nn.Linear(256, 256, bias=False),
                            nn.Mish(), nn.Linear(256, 6, bias=False))
    time_encoder = nn.Sequential(FourierFeatures(64), nn.Linear(64, 128, bias=False), nn.Mish(), nn.Linear(128, 128))
    rule = idql_rule()
    sampler = ddpm_ops.DiffusionSampler(reverse, rule, torch.arange(5.0), layout=(("x", 6), ("cond", 17),
                                        ("time", 128)), time_embedding=time_encoder)
    assert sampler._time_net is not None  # the op runs the time MLP
    state, x, noise = torch.randn(7, 17), torch.randn(7, 6), torch.randn(5, 7, 6)
    with torch.no_grad():
        out = sampler(x, cond=state, noise=noise)
        plan = sampler._direct[1]
        assert plan, "the direct form"
        prepared = plan.ready
        again = sampler(x, cond=state, noise=noise)
        general = sampler._sample(x, state, None, noise, None, False, None)
    assert plan.ready is prepared  # the zeros too: nothing made again at the second call
    assert torch.equal(out, again) and torch.equal(out, general)
    assert relative_error(out, idql_loop(reverse, time_encoder, rule, state, x, noise)) <= TOLERANCE


def cleandiffuser_loop(model, rule, x, noise, condition=None):
    """A DDPM loop of CleanDiffuser's IDQLMlp in float64 with the rule's tables (x0 clipped)."""
    model = copy.deepcopy(model).double()
    x = x.double()
    with torch.no_grad():
        for k, t in enumerate(reversed(range(len(rule)))):
            e = model(x, torch.full((x.shape[0],), float(t), dtype=torch.float64),
                      None if condition is None else condition.double())
            c = {n: getattr(rule, n)[t].double() for n in "ABCDES"}
            x0 = (c["A"] * x - c["B"] * e).clamp(*rule.clip)
            x = c["C"] * x0 + c["D"] * x + c["E"] * e + c["S"] * noise[k].double()
    return x


@pytest.mark.parametrize("features", ["positional", "gaussian_fourier", "buffered_fourier"])
@pytest.mark.parametrize("batch", [1, 33])
def test_cleandiffuser_idql_mlp(batch, features):
    """CleanDiffuser's IDQLMlp: its layers as the sampler's network, its time MLP as the time embedding
    (read into the op's time network), no condition; its positional embedding, or random Fourier
    features held in a parameter (evaluated at every call)."""
    torch.manual_seed(200 + batch)
    model = IDQLMlp(6, emb_dim=64, hidden_dim=256, n_blocks=3).eval()
    if features != "positional":
        model.map_noise = GaussianFourierProjection(64, scale=0.05, buffer=features == "buffered_fourier")
    rule = ddpm_ops.step_rules.ddpm(ddpm_ops.cosine_betas(10), clip=1.0)
    sampler = ddpm_ops.DiffusionSampler(nn.Sequential(model.affine_in, model.ln_resnet, model.affine_out), rule,
                                        torch.arange(10), layout=(("x", 6), ("time", 64)),
                                        time_embedding=nn.Sequential(model.map_noise, *model.time_mlp))
    assert sampler._time_net is not None and sampler._time_net.program.weights  # the op runs the time MLP
    assert sampler._time_net.per_call == (features != "positional")
    x, noise = torch.randn(batch, 6), torch.randn(10, batch, 6)
    with torch.no_grad():
        out = sampler(x, noise=noise)
    assert relative_error(out, cleandiffuser_loop(model, rule, x, noise)) <= TOLERANCE
    if features != "positional":  # a checkpoint loaded after the sampler was built
        state = {k: v * 1.5 if k == "map_noise.W" else v for k, v in model.state_dict().items()}
        model.load_state_dict(state)
        with torch.no_grad():
            again = sampler(x, noise=noise)
        assert relative_error(again, out) > 1e-3
        assert relative_error(again, cleandiffuser_loop(model, rule, x, noise)) <= TOLERANCE


def test_cleandiffuser_idql_mlp_with_a_condition_added_to_the_time_embedding():
    """IDQLMlp adds the condition to the time embedding: the embedding's columns of affine_in take both,
    as a time network and a condition network of the same columns (ddpm_ops.sample)."""
    torch.manual_seed(7)
    model = IDQLMlp(6, emb_dim=64, hidden_dim=256, n_blocks=3).eval()
    rule = ddpm_ops.step_rules.ddpm(ddpm_ops.cosine_betas(10), clip=1.0)
    program = ddpm_ops.layers.read_network(nn.Sequential(model.affine_in, model.ln_resnet, model.affine_out), 6 + 64)
    weights, biases, norm_weights, norm_biases = program.parameters()
    w_x, (w_emb,) = ddpm_ops.split_first_linear(model.affine_in, (6, 64))
    condition, x, noise = torch.randn(20, 64), torch.randn(20, 6), torch.randn(10, 20, 6)
    lin1, lin2 = model.time_mlp[0], model.time_mlp[2]
    with torch.no_grad():
        time_net = ddpm_ops.BiasNet(model.map_noise(torch.arange(10)), [lin1.weight, lin2.weight, w_emb],
                                    [lin1.bias, lin2.bias], ["mish", "identity"])
        out = ddpm_ops.sample(x, 9, [w_x, *weights[1:]], biases, rule, 10, network=program.instructions,
                              norm_weights=norm_weights, norm_biases=norm_biases, noise=noise, time_net=time_net,
                              cond_net=ddpm_ops.BiasNet(condition, [w_emb]))
    assert relative_error(out, cleandiffuser_loop(model, rule, x, noise, condition)) <= TOLERANCE


def dppo_loop(model, betas, state, x, noise, *, min_std, randn_clip, denoised_clip=1.0, return_chain=False):
    """DPPO's Diffusion.forward (DDPM) in float64, with its own coefficients."""
    model = copy.deepcopy(model).double()
    betas = betas.double()
    alphas = 1 - betas
    abar = torch.cumprod(alphas, 0)
    abar_prev = torch.cat([torch.ones(1, dtype=torch.float64), abar[:-1]])
    var = (betas * (1 - abar_prev) / (1 - abar)).clamp(min=1e-20)
    coef1, coef2 = betas * abar_prev.sqrt() / (1 - abar), (1 - abar_prev) * alphas.sqrt() / (1 - abar)
    x = x.double()
    chain = [x]
    with torch.no_grad():
        for i, t in enumerate(reversed(range(len(betas)))):
            eps = model(x, torch.full((x.shape[0],), float(t), dtype=torch.float64), state.double())
            x_recon = ((1 / abar[t]).sqrt() * x - (1 / abar[t] - 1).sqrt() * eps).clamp(-denoised_clip, denoised_clip)
            mean = coef1[t] * x_recon + coef2[t] * x
            std = torch.exp(0.5 * var[t].log())
            std = torch.zeros_like(std) if t == 0 else std.clamp(min=min_std)
            x = mean + std * noise[i].double().clamp(-randn_clip, randn_clip)
            chain.append(x)
    return torch.stack(chain) if return_chain else x


@pytest.mark.parametrize("activation", ["ReLU", "Mish"])
@pytest.mark.parametrize("batch", [1, 40, 256])
def test_dppo_residual_mlp(activation, batch):
    """DPPO's DiffusionMLP (residual style, widths 512, action 3 x chunk 4, obs 11), 20 cosine DDPM steps,
    x0 clipped, the std floored, the noise clipped to 3, the whole chain (fine-tuning)."""
    torch.manual_seed(300 + batch)
    model = DiffusionMLP(3, 4, 11, mlp_dims=(512, 512, 512), activation_type=activation).eval()
    betas = ddpm_ops.cosine_betas(20)
    rule = ddpm_ops.step_rules.ddpm(betas, clip=1.0, min_std=1e-3, noise_clip=3.0)
    sampler = ddpm_ops.DiffusionSampler(model.mlp_mean, rule, torch.arange(20), layout=(("x", 12), ("time", 16),
                                        ("cond", 11)), time_embedding=model.time_embedding)
    state, x, noise = torch.randn(batch, 11), torch.randn(batch, 4, 3), 1.5 * torch.randn(20, batch, 4, 3)
    with torch.no_grad():
        chain = sampler(x, cond=state, noise=noise, return_chain=True)
        assert sampler._direct[1], "an action chunk takes the direct call"
        assert torch.equal(chain, sampler._sample(x, state, None, noise, None, True, None))
    assert chain.shape == (21, batch, 4, 3)
    expected = dppo_loop(model, betas, state, x, noise, min_std=1e-3, randn_clip=3.0, return_chain=True)
    assert relative_error(chain, expected) <= TOLERANCE


def small_idql_sampler(seed):
    """``(reverse, time_encoder, rule, sampler)``: IDQL's LN-ResNet (2 blocks of 64) and time encoder."""
    torch.manual_seed(seed)
    reverse = MLPResNet(2, 6 + 17 + 128, 6, use_layer_norm=True, hidden_dim=64).eval()
    time_encoder = idql_time_encoder()
    rule = idql_rule()
    sampler = ddpm_ops.DiffusionSampler(reverse, rule, torch.arange(5.0), layout=(("x", 6), ("cond", 17),
                                        ("time", 128)), time_embedding=time_encoder)
    return reverse, time_encoder, rule, sampler


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("path", ["direct", "general"])
def test_a_policy_on_the_gpu_with_timesteps_on_the_cpu(path, monkeypatch):
    """A policy moved to the GPU, its sampler given ``torch.arange(T)`` on the CPU and not moved
    itself: the learned time features are computed where their kernel is, at construction and
    at every call."""
    torch.manual_seed(11)
    reverse = MLPResNet(2, 6 + 17 + 128, 6, use_layer_norm=True, hidden_dim=64).eval().cuda()
    time_encoder = idql_time_encoder().cuda()
    rule = idql_rule()
    sampler = ddpm_ops.DiffusionSampler(reverse, rule, torch.arange(5.0), layout=(("x", 6), ("cond", 17),
                                        ("time", 128)), time_embedding=time_encoder)
    if path == "general":
        monkeypatch.setattr(type(sampler), "_direct_call", lambda *a, **k: None)
    state, x, noise = torch.randn(9, 17), torch.randn(9, 6), torch.randn(5, 9, 6)
    with torch.no_grad():
        out = sampler(x.cuda(), cond=state.cuda(), noise=noise.cuda())
    assert out.is_cuda
    expected = idql_loop(reverse.cpu(), time_encoder.cpu(), rule, state, x, noise)
    assert relative_error(out.cpu(), expected) <= TOLERANCE


def test_parameters_are_read_at_every_call():
    reverse, time_encoder, rule, sampler = small_idql_sampler(5)
    state, x, noise = torch.randn(9, 17), torch.randn(9, 6), torch.randn(5, 9, 6)
    with torch.no_grad():
        before = sampler(x, cond=state, noise=noise)
        reverse.blocks[1].norm.weight.mul_(1.5)
        reverse.blocks[0].dense2.bias.add_(0.3)
        after = sampler(x, cond=state, noise=noise)
    assert relative_error(after, before) > 1e-3
    assert relative_error(after, idql_loop(reverse, time_encoder, rule, state, x, noise)) <= TOLERANCE


@pytest.mark.parametrize("path", ["direct", "general"])
def test_learned_time_features_are_evaluated_at_every_call(path, monkeypatch):
    """IDQL's time embedding, learned Fourier features then its MLP module (functional Mish):
    the op runs the MLP as its time net, the features are evaluated on the current kernel at
    every call; on the direct call (kept argument list) and through ``sample`` alike."""
    reverse, time_encoder, rule, sampler = small_idql_sampler(6)
    time_net = sampler._time_net
    assert time_net.per_call and len(time_net.program.weights) == 2 and time_net.activations == ("mish", "identity")
    assert sampler.time_features is None  # nothing fixed is kept for learned features
    calls = []
    monkeypatch.setattr(ddpm_ops.modules, "time_bias_from_module", lambda *a, **k: calls.append(a))
    if path == "general":  # every call through sample()
        monkeypatch.setattr(type(sampler), "_direct_call", lambda *a, **k: None)
    state, x, noise = torch.randn(9, 17), torch.randn(9, 6), torch.randn(5, 9, 6)
    for change in (lambda: None, lambda: time_encoder[0].kernel.mul_(1.7),
                   lambda: time_encoder[1].denses[1].weight.mul_(-0.5)):
        with torch.no_grad():
            change()
            out = sampler(x, cond=state, noise=noise)
        assert relative_error(out, idql_loop(reverse, time_encoder, rule, state, x, noise)) <= TOLERANCE
    assert not calls  # never evaluated in Python as a whole


def test_direct_call_of_a_program_is_the_general_path():
    """An eager call of a program whose first layer is a Linear (DPPO's residual MLP on a flat
    sample) goes to the op with the argument list kept from the last call: the general path's
    numbers bit for bit, every change of a block's parameters seen, a hook inside a block
    refused."""
    torch.manual_seed(torch.seed())
    model = DiffusionMLP(3, 4, 11, mlp_dims=(64, 64, 64), activation_type="Mish").eval()
    betas = ddpm_ops.cosine_betas(20)
    rule = ddpm_ops.step_rules.ddpm(betas, clip=1.0, min_std=1e-3, noise_clip=3.0)
    sampler = ddpm_ops.DiffusionSampler(model.mlp_mean, rule, torch.arange(20), layout=(("x", 12), ("time", 16),
                                        ("cond", 11)), time_embedding=model.time_embedding)
    linears = [m for m in model.mlp_mean.modules() if isinstance(m, nn.Linear)]
    changes = [
        lambda: None,
        lambda: linears[2].weight.mul_(1.5),                                      # in place, inside a block
        lambda: setattr(linears[1], "bias", nn.Parameter(torch.randn(64) / 4)),  # a new parameter
        lambda: linears[0].weight[:, :12].mul_(-1),                               # the x columns
    ]
    for i, change in enumerate(changes):
        batch = 3 + i
        state, x, noise = torch.randn(batch, 11), torch.randn(batch, 12), 1.5 * torch.randn(20, batch, 12)
        with torch.no_grad():
            change()
            out = sampler(x, cond=state, noise=noise)
            assert sampler._direct[1], "the direct form"
            general = sampler._sample(x, state, None, noise, None, False, None)
        assert torch.equal(out, general), i
        expected = dppo_loop(model, betas, state, x.view(batch, 4, 3), noise.view(20, batch, 4, 3), min_std=1e-3,
                             randn_clip=3.0)
        assert relative_error(out, expected.reshape(batch, 12)) <= TOLERANCE, i
    linears[2].register_forward_hook(lambda *args: None)
    with torch.no_grad(), pytest.raises(ValueError, match="forward hooks"):
        sampler(x, cond=state)


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return x + 2 * self.linear(x)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:
            return self.linear(x)
        return x


class TwoPaths(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x) + self.b(x)


class ScaledWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8))

    def forward(self, x):
        return F.linear(x, 2 * self.weight, self.bias)


@pytest.mark.parametrize("net, message", [
    (nn.Sequential(nn.Linear(8, 8), nn.LeakyReLU(), nn.Linear(8, 8)),
     r"mlp: 1 \(LeakyReLU\): leaky_relu \(aten.leaky_relu.default\) is not a layer the op computes; the op computes "
     r"Linears, the activations silu, mish"),
    (nn.Sequential(nn.Linear(8, 8), Scaled(), nn.Linear(8, 8)),
     r"mlp: 1 \(Scaled\), test_network_modules.py:\d+ `return x \+ 2 \* self.linear\(x\)`: mul \(aten.mul.Tensor\) is "
     r"not a layer the op computes"),
    (nn.Sequential(nn.Linear(8, 8), Branchy()), r"mlp: Sequential's forward cannot be traced on a \(batch, 8\) input"),
    (nn.Sequential(nn.Linear(8, 8), TwoPaths()),
     r"mlp: 1 \(TwoPaths\), test_network_modules.py:\d+ `return self.a\(x\) \+ self.b\(x\)`: add adds values the "
     r"op adds only as a residual block"),
    (nn.Sequential(nn.Linear(8, 8), nn.Unflatten(1, (2, 4)), nn.LayerNorm((2, 4)), nn.Flatten(), nn.Linear(8, 8)),
     r"mlp: 3 \(Flatten\): \w+ \(aten.\w+.\w+\) is not a layer the op computes"),
    (nn.Sequential(nn.Linear(8, 8), ScaledWeight()),
     r"mlp: 1 \(ScaledWeight\), .*: a layer's weight or bias is computed in the forward \(mul\), not a parameter"),
    (nn.Sequential(nn.Linear(8, 8), ResidualBlock(8), nn.GRU(8, 8)), r"mlp: expected a forward returning one tensor, "
                                                                    r"got 2 outputs"),
])
def test_networks_it_cannot_read_are_refused_naming_the_node(net, message):
    rule = ddpm_ops.step_rules.ddpm(ddpm_ops.cosine_betas(5))
    with pytest.raises(ValueError, match=message):
        ddpm_ops.DiffusionSampler(net, rule, layout=(("x", 8),))


def test_read_network_programs():
    """The programs the reader writes for each project's network."""
    read = ddpm_ops.layers.read_network
    ln_resnet = read(MLPResNet(3, 30, 6, dropout_rate=0.1, use_layer_norm=True, hidden_dim=16), 30)
    assert ln_resnet.instructions == ("linear", *("save", "layer_norm_affine:1e-06", "linear", "mish", "linear", "add")
                                      * 3, "mish", "linear")
    assert len(ln_resnet.weights) == 8 and len(ln_resnet.norm_weights) == 3
    mlp = read(IDQLMLP(30, (16, 16, 6), use_layer_norm=True, dropout_rate=0.1), 30)
    assert mlp.instructions == ("layer_norm_affine:1e-06", "linear", "mish", "linear", "mish", "linear")
    assert not mlp.first_is_linear
    dppo = read(ResidualMLP([30, 64, 64, 64, 64, 64, 12], activation_type="ReLU", use_layernorm=True), 30)
    block = ("save", "layer_norm_affine:1e-06", "relu", "linear", "layer_norm_affine:1e-06", "relu", "linear", "add")
    assert dppo.instructions == ("linear", *block * 2, "linear")
    model = IDQLMlp(6, emb_dim=16, hidden_dim=32, n_blocks=2)
    clean = read(nn.Sequential(model.affine_in, model.ln_resnet, model.affine_out), 6 + 16)
    assert clean.instructions == ("linear", *("save", "layer_norm_affine:1e-05", "linear", "mish", "linear", "add")
                                  * 2, "mish", "linear")
    plain_norm = read(nn.Sequential(nn.LayerNorm(4, elementwise_affine=False, eps=1e-3), nn.Linear(4, 4, bias=False),
                                    nn.GELU(approximate="tanh"), nn.Dropout(0.5), nn.LayerNorm(4, bias=False),
                                    nn.Linear(4, 4)), 4)
    assert plain_norm.instructions == ("layer_norm:0.001", "linear", "gelu_tanh", "layer_norm_affine:1e-05", "linear")
    weights, biases, norm_weights, norm_biases = plain_norm.parameters()
    assert torch.equal(biases[0], torch.zeros(4)) and torch.equal(norm_biases[0], torch.zeros(4))


def test_program_sampler_compiles_and_exports():
    """A sampler of DPPO's residual MLP and one of IDQL's MLP (LayerNorm over the whole input) survive
    torch.compile and torch.export with eager's numbers (export: the same bits)."""
    torch.manual_seed(11)
    model = DiffusionMLP(3, 4, 11, mlp_dims=(64, 64, 64)).eval()
    dppo = ddpm_ops.DiffusionSampler(model.mlp_mean, dppo_rule("ddpm"), torch.arange(20),
                                     layout=(("x", 12), ("time", 16), ("cond", 11)), time_embedding=model.time_embedding)
    idql = ddpm_ops.DiffusionSampler(IDQLMLP(6 + 17 + 128, (32, 32, 6), use_layer_norm=True).eval(), idql_rule(),
                                     torch.arange(5.0), layout=(("x", 6), ("cond", 17), ("time", 128)),
                                     time_embedding=idql_time_encoder())

    class Policy(nn.Module):
        def __init__(self, sampler):
            super().__init__()
            self.sampler = sampler

        def forward(self, x, cond, noise):
            return self.sampler(x, cond=cond, noise=noise, return_chain=True)

    for sampler, x, cond, noise in ((dppo, torch.randn(3, 4, 3), torch.randn(3, 11), torch.randn(20, 3, 4, 3)),
                                    (idql, torch.randn(5, 6), torch.randn(5, 17), torch.randn(5, 5, 6))):
        with torch.no_grad():
            eager = sampler(x, cond=cond, noise=noise, return_chain=True)
            # Inductor computes the time embedding with its own kernels: float32 rounding apart.
            assert relative_error(torch.compile(Policy(sampler))(x, cond, noise), eager) <= 1e-6
            exported = torch.export.export(Policy(sampler), (x, cond, noise))
            assert torch.equal(exported.module()(x, cond, noise), eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_project_networks_on_cuda():
    """IDQL's LN-ResNet and DPPO's residual MLP through DiffusionSampler on CUDA against float64."""
    torch.manual_seed(21)
    reverse = MLPResNet(3, 6 + 17 + 128, 6, use_layer_norm=True, hidden_dim=256).eval()
    time_encoder = idql_time_encoder()
    rule = idql_rule()
    sampler = ddpm_ops.DiffusionSampler(reverse, rule, torch.arange(5.0), layout=(("x", 6), ("cond", 17),
                                        ("time", 128)), time_embedding=time_encoder)
    state, x, noise = torch.randn(64, 17), torch.randn(64, 6), torch.randn(5, 64, 6)
    expected = idql_loop(reverse, time_encoder, rule, state, x, noise)
    with torch.no_grad():
        out = sampler.cuda()(x.cuda(), cond=state.cuda(), noise=noise.cuda())
    assert relative_error(out, expected) <= TOLERANCE
    model = DiffusionMLP(3, 4, 11, mlp_dims=(512, 512, 512), activation_type="ReLU").eval()
    betas = ddpm_ops.cosine_betas(20)
    rule = ddpm_ops.step_rules.ddpm(betas, clip=1.0, min_std=1e-3, noise_clip=3.0)
    state, x, noise = torch.randn(40, 11), torch.randn(40, 4, 3), 1.5 * torch.randn(20, 40, 4, 3)
    expected = dppo_loop(model, betas, state, x, noise, min_std=1e-3, randn_clip=3.0, return_chain=True)
    sampler = ddpm_ops.DiffusionSampler(model.mlp_mean, rule, torch.arange(20), layout=(("x", 12), ("time", 16),
                                        ("cond", 11)), time_embedding=model.time_embedding).cuda()
    with torch.no_grad():
        chain = sampler(x.cuda(), cond=state.cuda(), noise=noise.cuda(), return_chain=True)
    assert relative_error(chain, expected) <= TOLERANCE
