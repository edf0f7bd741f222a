"""CUDA-specific checks of ddpm::fused_sample: every kernel variant, odd shapes,
the no-sync NaN contract, CUDA-graph capture and the opt-in fast precisions."""
import re

import pytest
import torch

import ddpm_ops
from ddpm_ops.cuda_plan import current_device, plan_for
from problems import make_problem, relative_error

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FP32_TOLERANCE = 1e-5
FAST_TOLERANCE = 5e-3
# DDPM_OPS_CUDA_KERNEL forces a variant; a tiled variant that cannot hold the
# shape falls back to the cluster kernel, the split and narrow kernels (sm_90 only) and
# the resident kernel to the rule, which are also checked here.
VARIANTS = ["cluster", "tiled16", "tiled32", "tiled64", "split", "narrow", "resident", "auto"]


@pytest.fixture(params=VARIANTS)
def variant(request, monkeypatch):
    if request.param == "auto":
        monkeypatch.delenv("DDPM_OPS_CUDA_KERNEL", raising=False)
    else:
        monkeypatch.setenv("DDPM_OPS_CUDA_KERNEL", request.param)
    return request.param


def reference64_cuda(problem):
    """The reference loop in float64 on the GPU (the CPU is slow at large batch)."""
    def f64(t):
        return t.double()
    return ddpm_ops.reference(
        f64(problem.x), problem.t_start, [f64(w) for w in problem.weights],
        [f64(b) for b in problem.biases], f64(problem.sqrt_recip_alphas),
        f64(problem.coef_eps), problem.num_steps, problem.total_timesteps).cpu()


@pytest.mark.parametrize("batch", [1, 8, 64, 513, 4096])
def test_seed_shape_every_variant(variant, batch):
    problem = make_problem(batch, 64, [256, 256], 16, device="cuda")
    out = ddpm_ops.fused_sample(*problem.args())
    assert relative_error(out, reference64_cuda(problem)) <= FP32_TOLERANCE


@pytest.mark.parametrize("batch, dim, hidden, num_steps", [
    # (2 rows: one output of one row can land near 0 by cancellation, and
    # its relative error then is the fp32 rounding of the terms over a tiny
    # result: 1.1e-5 measured once at batch 1.)
    (2, 1, [], 1),
    (3, 7, [1], 5),
    (5, 7, [33, 7], 3),
    (37, 33, [300, 1, 64], 4),
    (300, 130, [1024], 2),
    (70, 12, [1024, 1024], 5),
    (65, 3, [7, 33, 300, 5], 7),
    (2, 64, [256, 256], 100),
    (9, 5, [1023, 1023], 3),   # weight slices too big for shared memory, rows not float4-aligned
])
@pytest.mark.parametrize("t_dtype", [torch.int32, torch.int64])
def test_odd_shapes_every_variant(variant, batch, dim, hidden, num_steps, t_dtype):
    problem = make_problem(batch, dim, hidden, num_steps, device="cuda", t_dtype=t_dtype,
                           total_timesteps=max(num_steps, 200))
    out = ddpm_ops.fused_sample(*problem.args())
    assert out.shape == (batch, dim) and out.is_contiguous()
    assert relative_error(out, reference64_cuda(problem)) <= FP32_TOLERANCE


def launch_logs(capfd):
    """The plan lines DDPM_OPS_CUDA_LOG made the op print since the last call."""
    torch.cuda.synchronize()
    return [line for line in capfd.readouterr().err.splitlines() if line.startswith("ddpm_ops ")]


def logged_call(monkeypatch, capfd, problem, precision="fp32"):
    """Runs the op on problem with DDPM_OPS_CUDA_LOG set; returns the one plan
    line the launch printed and the output. The output most likely reuses a
    block of NaNs just freed (same size: the caching allocator's best fit), so
    an element the kernel fails to write reads as NaN, not as a stale result."""
    monkeypatch.setenv("DDPM_OPS_CUDA_LOG", "1")
    capfd.readouterr()
    torch.full(problem.x.shape, float("nan"), device="cuda")
    out = ddpm_ops.fused_sample(*problem.args(), precision=precision)
    (log,) = launch_logs(capfd)
    return log, out


def force_kernel(monkeypatch, kernel, cluster_size):
    """DDPM_OPS_CUDA_KERNEL=kernel, and DDPM_OPS_CUDA_CLUSTER_SIZE=cluster_size
    (None: the kernel's rule)."""
    monkeypatch.setenv("DDPM_OPS_CUDA_KERNEL", kernel)
    if cluster_size is None:
        monkeypatch.delenv("DDPM_OPS_CUDA_CLUSTER_SIZE", raising=False)
    else:
        monkeypatch.setenv("DDPM_OPS_CUDA_CLUSTER_SIZE", str(cluster_size))


def run_logged(monkeypatch, capfd, problem):
    """logged_call, checked against float64 at fp32 accuracy; returns the plan line."""
    log, out = logged_call(monkeypatch, capfd, problem)
    assert relative_error(out, reference64_cuda(problem)) <= FP32_TOLERANCE
    return log


TILED_LOG = re.compile(r"ddpm_ops tiled kernel: batch (\d+), (\d+) rows x \d+ tiles, cluster size (\d+),"
                       r".* weight chunks by:((?: \S+)+)$")
CLUSTER_LOG = re.compile(r"ddpm_ops cluster kernel: batch (\d+), cluster size (\d+) "
                         r"\((\d+) co-resident\), (\d+) rows x (\d+) clusters")


def expected_chunk_copies(weights, weight_copy):
    """TMA copies a layer's chunks when its rows are 16-byte aligned (and TMA is on)."""
    return ["tma" if weight_copy == "tma" and w.shape[1] % 4 == 0 and w.data_ptr() % 16 == 0
            else "cp.async" for w in weights]


@pytest.fixture(params=["tma", "cp.async"])
def weight_copy(request, monkeypatch):
    """The tiled kernel's weight chunks by the TMA unit wherever it can address
    the layer (the default), or all by cp.async."""
    if request.param == "tma":
        monkeypatch.delenv("DDPM_OPS_CUDA_TMA", raising=False)
    else:
        monkeypatch.setenv("DDPM_OPS_CUDA_TMA", "0")
    return request.param


# The cluster kernel takes powers of two; the tiled kernel any size up to 16.
@pytest.mark.parametrize("kernel, cluster_size",
                         [("cluster", size) for size in (1, 2, 4, 8, 16)]
                         + [(kernel, size) for kernel in ("tiled16", "tiled64")
                            for size in (1, 2, 3, 4, 5, 6, 7, 8, 16)])
@pytest.mark.parametrize("batch, dim, hidden, num_steps", [
    (1, 64, [256, 256], 16),
    (6, 7, [33, 7], 3),
    (37, 33, [300, 1, 64], 4),
    (65, 3, [7, 33, 300, 5], 7),
    (150, 12, [1024, 1024], 2),
    # the tiled kernel's last layer split over its inner dimension: after the
    # first layer (depth 2) and after a local layer (depth 4)
    (40, 12, [512], 3),
    (33, 5, [64, 96, 128], 3),
])
def test_every_cluster_size(monkeypatch, capfd, weight_copy, kernel, cluster_size, batch, dim, hidden,
                            num_steps):
    monkeypatch.setenv("DDPM_OPS_CUDA_KERNEL", kernel)
    monkeypatch.setenv("DDPM_OPS_CUDA_CLUSTER_SIZE", str(cluster_size))
    problem = make_problem(batch, dim, hidden, num_steps, device="cuda", total_timesteps=200)
    log = run_logged(monkeypatch, capfd, problem)
    # The forced variant ran: the tiled kernel with these rows, cluster size
    # and weight copies, or (only where a 64-row tile cannot fit in shared
    # memory) the cluster kernel.
    tiled = TILED_LOG.match(log)
    if tiled is None:
        assert kernel in ("cluster", "tiled64"), log
        logged_batch, logged_size = CLUSTER_LOG.match(log).groups()[:2]
        assert logged_batch == str(batch), log
        # The cluster kernel takes a forced size only if it is a power of two.
        assert cluster_size & (cluster_size - 1) != 0 or logged_size == str(cluster_size), log
        return
    assert kernel != "cluster", log
    assert tiled.groups()[:3] == (str(batch), kernel[len("tiled"):], str(cluster_size)), log
    assert tiled.group(4).split() == expected_chunk_copies(problem.weights, weight_copy), log


def misaligned_copy(t):
    """The same values in a view whose storage starts 4 bytes past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("batch, hidden", [(3, [256, 256]), (600, [256, 256]), (70, [1024, 1024])])
def test_misaligned_weights_every_variant(variant, batch, hidden):
    problem = make_problem(batch, 64, hidden, 4, device="cuda")
    problem.weights = [misaligned_copy(w) for w in problem.weights]
    problem.biases = [misaligned_copy(b) for b in problem.biases]
    assert all(w.data_ptr() % 16 == 4 for w in problem.weights)
    out = ddpm_ops.fused_sample(*problem.args())
    assert relative_error(out, reference64_cuda(problem)) <= FP32_TOLERANCE


@pytest.mark.parametrize("misaligned_layer", [None, 0, 1, 2])
def test_tma_and_cp_async_chunks_mixed(monkeypatch, capfd, misaligned_layer):
    """Layers whose rows TMA cannot address (odd widths, misaligned storage) take
    cp.async in the same weight stream as TMA layers, through the same ring."""
    monkeypatch.setenv("DDPM_OPS_CUDA_KERNEL", "tiled16")
    monkeypatch.setenv("DDPM_OPS_CUDA_CLUSTER_SIZE", "2")
    monkeypatch.delenv("DDPM_OPS_CUDA_TMA", raising=False)
    problem = make_problem(100, 12, [1024, 512], 3, device="cuda")
    if misaligned_layer is not None:
        problem.weights[misaligned_layer] = misaligned_copy(problem.weights[misaligned_layer])
    log = run_logged(monkeypatch, capfd, problem)
    copies = TILED_LOG.match(log).group(4).split()
    # Layer 0 reads dim + 1 = 13 columns: never TMA.
    assert copies == expected_chunk_copies(problem.weights, "tma"), log
    assert copies[0] == "cp.async" and "tma" in copies, log


@pytest.mark.parametrize("kernel", ["tiled16", "tiled32", "tiled64"])
def test_default_weight_copies(monkeypatch, capfd, kernel):
    """By default every tile height takes TMA chunks where TMA can address the layer."""
    monkeypatch.setenv("DDPM_OPS_CUDA_KERNEL", kernel)
    monkeypatch.delenv("DDPM_OPS_CUDA_TMA", raising=False)
    problem = make_problem(200, 64, [256, 256], 2, device="cuda")
    log = run_logged(monkeypatch, capfd, problem)
    assert TILED_LOG.match(log).group(4).split() == expected_chunk_copies(problem.weights, "tma"), log


@pytest.mark.parametrize("dim, hidden", [(64, [256, 256]), (12, [1024, 1024])])
@pytest.mark.parametrize("batch", [1, 2, 5, 8, 16, 33])
def test_small_batches_get_a_cluster_per_row(monkeypatch, capfd, batch, dim, hidden):
    """The cluster kernel's rule at small batch (measured fastest on the H200;
    by default the seed shape runs on the resident kernel there): every row in
    a cluster of its own, of at least 4 CTAs, while the co-resident clusters
    allow it; on GPUs with 100+ SMs they do up to batch 8."""
    monkeypatch.setenv("DDPM_OPS_CUDA_KERNEL", "cluster")
    monkeypatch.delenv("DDPM_OPS_CUDA_CLUSTER_SIZE", raising=False)
    problem = make_problem(batch, dim, hidden, 3, device="cuda")
    log = run_logged(monkeypatch, capfd, problem)
    _, size, resident, rows, clusters = (int(v) for v in CLUSTER_LOG.match(log).groups())
    assert clusters * rows >= batch > (clusters - 1) * rows, log
    if batch <= 8 and torch.cuda.get_device_properties(problem.x.device).multi_processor_count >= 100:
        assert size >= 4 and batch <= resident and rows == 1 and clusters == batch, log


def out_of_range_problem():
    problem = make_problem(200, 16, [40, 40], 6, device="cuda", total_timesteps=50)
    t = problem.t_start.clone()
    t[3] = 2             # t - 5 < 0
    t[77] = 50           # == table length
    t[150] = -(2 ** 40)  # far outside, int64
    t[180] = -(2 ** 63)  # INT64_MIN: t - (num_steps - 1) would overflow
    args = list(problem.args())
    args[1] = t
    return problem, args


def check_out_of_range_rows_are_nan(precision, tolerance):
    problem, args = out_of_range_problem()
    out = ddpm_ops.fused_sample(*args, precision=precision)
    bad = torch.zeros(200, dtype=torch.bool, device="cuda")
    bad[[3, 77, 150, 180]] = True
    assert torch.isnan(out[bad]).all()
    # The reference would index the tables out of bounds: run it on the good rows.
    good = ~bad
    problem.x, problem.t_start = problem.x[good], problem.t_start[good]
    assert relative_error(out[good], reference64_cuda(problem)) <= tolerance


def test_out_of_range_rows_are_nan_without_sync(variant):
    check_out_of_range_rows_are_nan("fp32", FP32_TOLERANCE)


def test_validate_raises_for_out_of_range():
    _, args = out_of_range_problem()
    with pytest.raises(RuntimeError, match="t_start out of range"):
        ddpm_ops.fused_sample(*args, validate=True)


def test_cuda_graph_replay_equals_eager():
    problem = make_problem(8, 64, [256, 256], 16, device="cuda")
    eager = ddpm_ops.fused_sample(*problem.args())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ddpm_ops.fused_sample(*problem.args())  # warm-up: first-call setup outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ddpm_ops.fused_sample(*problem.args())
    fresh = torch.randn_like(problem.x)
    problem.x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(captured, reference64_cuda(problem)) <= FP32_TOLERANCE
    assert not torch.equal(captured, eager)


def test_runs_on_the_current_stream():
    problem = make_problem(4096, 64, [256, 256], 4, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        # Produced on the side stream just before the call: only a launch on
        # that same stream is ordered after it.
        x = problem.x * 1.0
        problem.x = x
        out = ddpm_ops.fused_sample(*problem.args())
    stream.synchronize()
    assert relative_error(out, reference64_cuda(problem)) <= FP32_TOLERANCE


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
@pytest.mark.parametrize("batch, dim, hidden, num_steps", [
    (32768, 64, [256, 256], 16),  # the split kernel on sm_90 ("bf16": the wgmma kernel), else 64-row tiles
    (128, 12, [1024, 1024], 5),   # weights too big for the cluster kernel: 16-row tiles in clusters
    (256, 12, [1024, 1024], 5),
])
def test_fast_precisions_where_the_tiled_kernel_runs(precision, batch, dim, hidden, num_steps):
    problem = make_problem(batch, dim, hidden, num_steps, device="cuda")
    out = ddpm_ops.fused_sample(*problem.args(), precision=precision)
    assert relative_error(out, reference64_cuda(problem)) <= FAST_TOLERANCE


def test_large_batch_fp32_is_exact():
    problem = make_problem(32768, 64, [256, 256], 16, device="cuda")
    out = ddpm_ops.fused_sample(*problem.args())
    assert relative_error(out, reference64_cuda(problem)) <= FP32_TOLERANCE


def test_inputs_untouched_and_zero_steps_copy():
    problem = make_problem(33, 9, [17], 3, device="cuda")
    before = [t.clone() for t in (problem.x, problem.t_start, *problem.weights, *problem.biases)]
    ddpm_ops.fused_sample(*problem.args())
    after = (problem.x, problem.t_start, *problem.weights, *problem.biases)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    problem.num_steps = 0
    copy = ddpm_ops.fused_sample(*problem.args())
    assert torch.equal(copy, problem.x) and copy.data_ptr() != problem.x.data_ptr()


WGMMA_LOG = re.compile(r"ddpm_ops wgmma kernel: batch (\d+), 64 rows x (\d+) tiles on (\d+) CTAs "
                       r"of 2 warpgroups, hidden width (\d+)")


def has_wgmma_kernel(device="cuda"):
    """The bf16 wgmma kernel needs an sm_90 GPU (H100, H200)."""
    return torch.cuda.get_device_capability(device) == (9, 0)


def is_h200(device="cuda"):
    """An H200's 132 SMs: 15 co-resident clusters of 8, 66 of 2, whose shapes
    the rule tests expect (another GPU may hold other counts)."""
    return torch.cuda.get_device_properties(device).multi_processor_count == 132


@pytest.mark.parametrize("batch, dim, hidden, num_steps, padded_hidden", [
    (1, 64, [256, 256], 16, 256),       # the seed shape: one tile, 63 rows of padding
    (1000, 64, [256, 256], 16, 256),    # a partial last tile
    (32768, 64, [256, 256], 16, 256),   # two tiles per SM on 132 SMs
    (300, 12, [256], 5, 256),           # depth 2: the first layer feeds the output layer
    (77, 1, [64, 64], 3, 64),
    (130, 33, [100, 37], 4, 128),       # odd widths, padded with zero weights
    (65, 63, [128, 128, 128, 128], 3, 128),  # hidden layers between the first and the last
    (200, 40, [192, 150, 192], 6, 192),
    (9, 64, [256, 200], 100, 256),
])
@pytest.mark.parametrize("t_dtype", [torch.int64, torch.int32])
def test_bf16_wgmma_kernel(monkeypatch, capfd, batch, dim, hidden, num_steps, padded_hidden, t_dtype):
    """The wgmma kernel (forced: below batch 256 "bf16" takes the cluster
    kernel by default) computes every shape in its envelope within the fast
    paths' error bound against float64."""
    if not has_wgmma_kernel():
        pytest.skip("the wgmma kernel needs an sm_90 GPU")
    monkeypatch.setenv("DDPM_OPS_CUDA_KERNEL", "wgmma")
    problem = make_problem(batch, dim, hidden, num_steps, device="cuda", t_dtype=t_dtype,
                           total_timesteps=max(200, num_steps))
    log, out = logged_call(monkeypatch, capfd, problem, "bf16")
    match = WGMMA_LOG.match(log)
    assert match is not None, log
    tiles = (batch + 63) // 64
    assert match.groups() == (str(batch), str(tiles), str(min(tiles, torch.cuda.get_device_properties(0)
                                                                  .multi_processor_count)),
                              str(padded_hidden)), log
    assert out.shape == (batch, dim) and out.is_contiguous()
    error = relative_error(out, reference64_cuda(problem))
    assert error <= FAST_TOLERANCE
    # bf16 operands, not fp32 ones: the error is that of 8-bit mantissas.
    assert error > FP32_TOLERANCE / 100


@pytest.mark.parametrize("dim, hidden", [
    (65, [256]),             # dim beyond 64
    (12, [1024, 1024]),      # hidden beyond 256
    (64, []),                # no hidden layer
    (64, [256, 256, 256]),   # 320 KB of bf16 weights: more than shared memory
])
def test_bf16_outside_the_wgmma_kernel_envelope(monkeypatch, capfd, dim, hidden):
    """Nets the wgmma kernel cannot hold run "bf16" on the other kernels, even
    where it is forced."""
    monkeypatch.setenv("DDPM_OPS_CUDA_KERNEL", "wgmma")
    problem = make_problem(300, dim, hidden, 3, device="cuda")
    log, out = logged_call(monkeypatch, capfd, problem, "bf16")
    assert not log.startswith("ddpm_ops wgmma kernel"), log
    assert relative_error(out, reference64_cuda(problem)) <= FAST_TOLERANCE


@pytest.mark.parametrize("forced", ["cluster", "tiled16"])
def test_a_forced_kernel_overrides_the_wgmma_kernel(monkeypatch, capfd, forced):
    monkeypatch.setenv("DDPM_OPS_CUDA_KERNEL", forced)
    problem = make_problem(600, 64, [256, 256], 3, device="cuda")
    log, out = logged_call(monkeypatch, capfd, problem, "bf16")
    assert log.startswith("ddpm_ops cluster kernel" if forced == "cluster" else "ddpm_ops tiled kernel"), log
    assert relative_error(out, reference64_cuda(problem)) <= FAST_TOLERANCE


def test_bf16_wgmma_out_of_range_rows_are_nan(monkeypatch):
    monkeypatch.setenv("DDPM_OPS_CUDA_KERNEL", "wgmma")
    check_out_of_range_rows_are_nan("bf16", FAST_TOLERANCE)


# The two wgmma kernels: the bf16 one ("bf16") and the split one (exact).
TENSOR_CORE_KERNELS = [("bf16", FAST_TOLERANCE), ("fp32", FP32_TOLERANCE)]


@pytest.mark.parametrize("precision, tolerance", TENSOR_CORE_KERNELS)
def test_wgmma_kernels_misaligned_weights_and_graph_capture(precision, tolerance):
    problem = make_problem(2500, 64, [256, 256], 8, device="cuda")  # "bf16": beyond the split kernel's clusters of 4
    problem.weights = [misaligned_copy(w) for w in problem.weights]
    problem.biases = [misaligned_copy(b) for b in problem.biases]
    eager = ddpm_ops.fused_sample(*problem.args(), precision=precision)
    assert relative_error(eager, reference64_cuda(problem)) <= tolerance
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ddpm_ops.fused_sample(*problem.args(), precision=precision)
    problem.x.copy_(torch.randn_like(problem.x))
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(captured, reference64_cuda(problem)) <= tolerance


@pytest.mark.parametrize("kernel, precision, batch", [("wgmma", "bf16", 100), ("split", "fp32", 100),
                                                     ("narrow", "fp32", 130), ("resident", "fp32", 5)])
def test_kernels_opcheck(monkeypatch, kernel, precision, batch):
    monkeypatch.setenv("DDPM_OPS_CUDA_KERNEL", kernel)
    problem = make_problem(batch, 64, [256, 256], 4, device="cuda", t_dtype=torch.int32)
    args = problem.args()
    torch.library.opcheck(torch.ops.ddpm.fused_sample.default, args, {"precision": precision})


SPLIT_LOG = re.compile(r"ddpm_ops split kernel: batch (\d+), 64 rows x (\d+) tiles on (\d+) clusters of (\d+), "
                       r"hidden width (\d+), (\d+) columns per CTA, \d+ bytes shared memory, (\d+) exchange buffers")


# forced: DDPM_OPS_CUDA_CLUSTER_SIZE (None: the shape's rule, least work per
# CTA); cluster_size, own, buffers: the shape expected (two exchange buffers
# where they fit in shared memory).
@pytest.mark.parametrize("batch, dim, hidden, num_steps, forced, cluster_size, own, buffers", [
    (1, 64, [256, 256], 16, None, 4, 64, 2),      # the seed shape: one tile, 63 rows of padding
    (1, 64, [256, 256], 16, 2, 2, 128, 1),
    (1000, 64, [256, 256], 16, None, 4, 64, 2),   # a partial last tile
    (1000, 64, [256, 256], 16, 2, 2, 128, 1),
    (32768, 64, [256, 256], 16, None, 2, 128, 1),  # several tiles per cluster: more clusters of 2
    (32768, 64, [256, 256], 4, 4, 4, 64, 2),
    (9, 64, [256, 200], 100, None, 4, 64, 2),
    (300, 12, [256], 5, None, 4, 64, 2),          # depth 2: only the partial eps is exchanged
    (300, 12, [256], 5, 2, 2, 128, 2),
    (200, 40, [192, 150], 6, None, 4, 64, 2),     # padded to 256
    (100, 64, [256, 256, 256], 5, None, 4, 64, 1),  # 209 KB a CTA: only in clusters of 4
    (100, 64, [256, 256, 256], 5, 2, 4, 64, 1),     # (so a forced 2 is ignored)
    (65, 63, [128, 128, 128, 128], 3, None, 2, 64, 2),  # three hidden layers exchanged per step
    (65, 63, [128, 128, 128, 128], 3, 4, 2, 64, 2),     # too big for clusters of 4: the size is ignored
    (70, 64, [128, 128, 128], 7, None, 2, 64, 2),
    (70, 64, [128, 128, 128], 7, 1, 1, 128, 1),   # the whole net on one CTA
    (130, 33, [100, 37], 4, None, 2, 64, 2),      # odd widths, padded with zero weights
    (130, 33, [100, 37], 4, 1, 1, 128, 1),
    (77, 1, [64, 64], 3, None, 1, 64, 1),
])
@pytest.mark.parametrize("t_dtype", [torch.int64, torch.int32])
def test_split_kernel(monkeypatch, capfd, batch, dim, hidden, num_steps, forced, cluster_size, own, buffers,
                      t_dtype):
    """The split kernel (forced: by default it starts at batch 265) holds every
    shape of its envelope, in every cluster size, to fp32 accuracy against
    float64."""
    if not has_wgmma_kernel():
        pytest.skip("the split kernel needs an sm_90 GPU")
    force_kernel(monkeypatch, "split", forced)
    problem = make_problem(batch, dim, hidden, num_steps, device="cuda", t_dtype=t_dtype,
                           total_timesteps=max(200, num_steps))
    log, out = logged_call(monkeypatch, capfd, problem)
    match = SPLIT_LOG.match(log)
    assert match is not None, log
    tiles = (batch + 63) // 64
    logged_batch, logged_tiles, clusters, size, width, columns, logged_buffers = (int(v) for v in match.groups())
    assert (logged_batch, logged_tiles, size, width, columns, logged_buffers) == (
        batch, tiles, cluster_size, own * cluster_size, own, buffers), log
    assert 0 < clusters <= tiles, log
    assert out.shape == (batch, dim) and out.is_contiguous()
    assert relative_error(out, reference64_cuda(problem)) <= FP32_TOLERANCE


NARROW_LOG = re.compile(r"ddpm_ops narrow kernel: batch (\d+), (\d+) rows x (\d+) tiles on (\d+) clusters of "
                        r"(\d+), hidden width (\d+), (\d+) columns per CTA, \d+ bytes shared memory")


# cluster_size, rows: forced (DDPM_OPS_CUDA_CLUSTER_SIZE, DDPM_OPS_CUDA_TILE_ROWS),
# and so expected, at every tile height whose shape fits in shared memory;
# own: the columns per CTA of the cheapest shape of that cluster size.
NARROW_CASES = [
    (1, 64, [256, 256], 16, 4, 64, [8, 16, 24, 32]),    # the seed shape: one tile, mostly padding
    (512, 64, [256, 256], 16, 4, 64, [8, 16, 24, 32]),
    (512, 64, [256, 256], 16, 2, 128, [8]),             # 195 KB of weights a CTA: only 8-row tiles fit
    (1000, 64, [256, 256], 7, 4, 64, [8, 32]),          # partial last tiles, several tiles per cluster
    (1000, 64, [256, 256], 7, 2, 128, [8]),
    (9, 64, [256, 200], 20, 4, 64, [8, 16, 24, 32]),    # padded columns
    (300, 12, [256], 5, 4, 64, [8, 16, 24, 32]),        # depth 2: only the partial eps is exchanged
    (300, 12, [256], 5, 2, 128, [8, 16, 24, 32]),
    (200, 40, [192, 150], 6, 2, 128, [8]),              # padded to 256
    (100, 64, [256, 256, 256], 5, 4, 64, [8, 16]),      # two hidden layers exchanged per step
    (65, 63, [128, 128, 128, 128], 3, 2, 64, [8, 16, 24, 32]),  # three
    (70, 64, [128, 128, 128], 7, 1, 128, [8, 16]),      # the whole net on one CTA
    (70, 64, [128, 128, 128], 7, 4, 64, [8, 16]),       # padded to 256
    (130, 33, [100, 37], 4, 2, 64, [8, 16, 24, 32]),    # odd widths, padded with zero weights
    (130, 33, [100, 37], 4, 1, 128, [8, 16, 24, 32]),
    (77, 1, [64, 64], 3, 1, 64, [8, 16, 24, 32]),
]


@pytest.mark.parametrize("batch, dim, hidden, num_steps, cluster_size, own, rows", [
    case[:-1] + (rows,) for case in NARROW_CASES for rows in case[-1]])
def test_narrow_kernel(monkeypatch, capfd, batch, dim, hidden, num_steps, cluster_size, own, rows):
    """The narrow kernel holds every shape of its envelope, in every cluster
    size and tile height, to fp32 accuracy against float64 (int32 t_start
    where the tile height is 16, int64 elsewhere)."""
    if not has_wgmma_kernel():
        pytest.skip("the narrow kernel needs an sm_90 GPU")
    force_kernel(monkeypatch, "narrow", cluster_size)
    monkeypatch.setenv("DDPM_OPS_CUDA_TILE_ROWS", str(rows))
    problem = make_problem(batch, dim, hidden, num_steps, device="cuda",
                           t_dtype=torch.int32 if rows == 16 else torch.int64,
                           total_timesteps=max(200, num_steps))
    log, out = logged_call(monkeypatch, capfd, problem)
    match = NARROW_LOG.match(log)
    assert match is not None, log
    tiles = -(-batch // rows)
    logged_batch, logged_rows, logged_tiles, clusters, size, width, columns = (int(v) for v in match.groups())
    assert (logged_batch, logged_rows, logged_tiles, size, width, columns) == (
        batch, rows, tiles, cluster_size, own * cluster_size, own), log
    assert 0 < clusters <= tiles, log
    assert out.shape == (batch, dim) and out.is_contiguous()
    assert relative_error(out, reference64_cuda(problem)) <= FP32_TOLERANCE


@pytest.mark.parametrize("kernel, batch, dim, hidden", [
    ("split", 300, 65, [256]),            # dim beyond 64
    ("split", 300, 12, [1024, 1024]),     # hidden beyond 256
    ("split", 300, 64, []),               # no hidden layer
    ("split", 300, 64, [256] * 4),        # 272 KB of a cluster of 4's share: more than shared memory
    ("narrow", 300, 65, [256]),           # dim beyond 64
    ("narrow", 300, 12, [1024, 1024]),    # hidden beyond 256
    ("narrow", 300, 64, []),              # no hidden layer
    ("narrow", 300, 64, [256] * 4),       # more than shared memory in clusters of 4
    ("resident", 3, 65, [256]),           # dim beyond 64
    ("resident", 3, 12, [512, 512]),      # hidden beyond 256
    ("resident", 3, 64, [256, 128]),      # hidden widths differ
    ("resident", 3, 64, [100, 100]),      # not a multiple of 16
    ("resident", 3, 64, []),              # no hidden layer
    ("resident", 3, 64, [256] * 4),       # 5 layers
    ("resident", 121, 64, [256, 256]),    # more than 8 rows per cluster of 8 (15 resident on the H200)
])
def test_outside_a_kernels_envelope(monkeypatch, capfd, kernel, batch, dim, hidden):
    """Nets (and batches) the split, narrow and resident kernels cannot hold run on
    the other kernels, even where one is forced."""
    monkeypatch.setenv("DDPM_OPS_CUDA_KERNEL", kernel)
    problem = make_problem(batch, dim, hidden, 3, device="cuda")
    log, out = logged_call(monkeypatch, capfd, problem)
    assert relative_error(out, reference64_cuda(problem)) <= FP32_TOLERANCE
    if batch > 120 and not is_h200():
        return  # another GPU may hold more clusters
    assert not log.startswith(f"ddpm_ops {kernel} kernel"), log


RESIDENT_LOG = re.compile(r"ddpm_ops resident kernel: batch (\d+), cluster size (\d+) \((\d+) co-resident\), "
                          r"(\d+) rows x (\d+) clusters, (\d+) outputs per warp")


def check_resident_shape(log, batch, hidden_width):
    """The logged shape covers the batch in one wave of clusters with the fewest
    rows each (1, 2, 4 or 8), and its cluster size matches its outputs per warp."""
    match = RESIDENT_LOG.match(log)
    assert match is not None, log
    logged_batch, size, resident, rows, clusters, opw = (int(v) for v in match.groups())
    assert logged_batch == batch and opw in (2, 4, 16) and size * 8 * opw == hidden_width, log
    assert clusters == -(-batch // rows) <= resident, log
    assert rows == min(r for r in (1, 2, 4, 8) if -(-batch // r) <= resident), log
    return size, rows


# forced: DDPM_OPS_CUDA_CLUSTER_SIZE (None: the rule); H / 16, H / 32 and
# H / 128 are the sizes the kernel has (2, 4 or 16 outputs per warp).
@pytest.mark.parametrize("batch, dim, hidden, num_steps, forced", [
    (1, 64, [256, 256], 16, None),   # the seed shape
    (1, 64, [256, 256], 16, 8),
    (1, 64, [256, 256], 16, 2),      # 16 outputs per warp
    (60, 64, [256, 256], 16, 2),
    (100, 12, [256], 5, 2),          # 16 outputs per warp, 2 rows (only at depth 2: the registers)
    (7, 9, [128, 128], 3, 1),        # 16 outputs per warp on a cluster of 1
    (8, 64, [256, 256], 16, None),
    (8, 64, [256, 256], 16, 16),
    (20, 64, [256, 256], 16, 16),    # 4 rows per cluster
    (40, 64, [256, 256], 16, None),
    (100, 64, [256, 256], 16, None),  # 8 rows per cluster
    (50, 64, [256, 256], 16, 16),
    (99, 61, [256, 256, 256], 4, None),
    (90, 5, [64], 6, None),
    (3, 64, [256], 5, None),         # depth 2
    (3, 64, [256], 5, 8),
    (5, 63, [256, 256, 256], 7, None),  # depth 4
    (5, 63, [256, 256, 256], 7, 8),
    (7, 1, [16, 16], 4, None),       # a cluster of 1
    (9, 12, [128, 128], 5, 4),
    (2, 33, [96, 96, 96], 3, None),  # clusters of 6 (or 3)
    (6, 64, [48], 9, None),          # clusters of 3
    (4, 17, [160, 160], 30, 5),
    (3, 64, [256, 256], 100, None),  # long chains
])
@pytest.mark.parametrize("t_dtype", [torch.int64, torch.int32])
def test_resident_kernel(monkeypatch, capfd, batch, dim, hidden, num_steps, forced, t_dtype):
    """The resident kernel holds every shape of its envelope, in each of its
    cluster sizes, to fp32 accuracy against float64, and writes every output."""
    force_kernel(monkeypatch, "resident", forced)
    problem = make_problem(batch, dim, hidden, num_steps, device="cuda", t_dtype=t_dtype,
                           total_timesteps=max(200, num_steps))
    log, out = logged_call(monkeypatch, capfd, problem)
    size, _ = check_resident_shape(log, batch, hidden[0])
    assert forced is None or size == forced, log
    assert out.shape == (batch, dim) and out.is_contiguous()
    assert relative_error(out, reference64_cuda(problem)) <= FP32_TOLERANCE


@pytest.mark.parametrize("layer", [1, 2])
def test_resident_kernel_needs_aligned_weights(monkeypatch, capfd, layer):
    """The resident kernel reads the weights after layer 0 as float4: a weight
    that starts off a 16-byte boundary (a view into a larger buffer) runs on
    another kernel, even where the resident one is forced, and is right."""
    monkeypatch.setenv("DDPM_OPS_CUDA_KERNEL", "resident")
    problem = make_problem(3, 64, [256, 256], 4, device="cuda")
    w = problem.weights[layer]
    shifted = torch.randn(w.numel() + 1, device="cuda")[1:].view_as(w)
    shifted.copy_(w)
    assert shifted.data_ptr() % 16 != 0
    problem.weights[layer] = shifted
    log, out = logged_call(monkeypatch, capfd, problem)
    assert not log.startswith("ddpm_ops resident kernel"), log
    assert relative_error(out, reference64_cuda(problem)) <= FP32_TOLERANCE


def test_resident_kernel_out_of_range_rows_are_nan(monkeypatch):
    monkeypatch.setenv("DDPM_OPS_CUDA_KERNEL", "resident")
    problem = make_problem(6, 16, [64, 64], 6, device="cuda", total_timesteps=50)
    t = problem.t_start.clone()
    t[1] = 2             # t - 5 < 0
    t[4] = 50            # == table length
    t[5] = -(2 ** 63)    # INT64_MIN
    args = list(problem.args())
    args[1] = t
    out = ddpm_ops.fused_sample(*args)
    bad = torch.zeros(6, dtype=torch.bool, device="cuda")
    bad[[1, 4, 5]] = True
    assert torch.isnan(out[bad]).all()
    problem.x, problem.t_start = problem.x[~bad], problem.t_start[~bad]
    assert relative_error(out[~bad], reference64_cuda(problem)) <= FP32_TOLERANCE


@pytest.mark.parametrize("precision, batch, dim, hidden, num_steps", [
    ("fp32", 1, 64, [256, 256], 16),      # fp32_resident
    ("fp32", 512, 64, [256, 256], 3),     # bf16x3_wgmma_swapab (sm_90)
    ("fp32", 32768, 64, [256, 256], 3),   # bf16x3_wgmma_m64 (sm_90)
    ("bf16", 5000, 64, [256, 256], 3),    # bf16_wgmma (sm_90)
    ("fp32", 300, 12, [1024, 1024], 2),   # tf32x3_tiled
    ("fp32", 100, 12, [1024, 1024], 2),   # fp32_smem
    ("tf32", 768, 12, [300, 300], 2),
])
def test_the_planned_kernel_runs(monkeypatch, capfd, precision, batch, dim, hidden, num_steps):
    """The launch runs the plan ddpm_ops.cuda_plan computes for this GPU (the
    rule's own tests, tests/test_cuda_plan.py, run on the CPU)."""
    for name in ("DDPM_OPS_CUDA_KERNEL", "DDPM_OPS_CUDA_CLUSTER_SIZE", "DDPM_OPS_CUDA_TILE_ROWS", "DDPM_OPS_CUDA_TMA"):
        monkeypatch.delenv(name, raising=False)
    problem = make_problem(batch, dim, hidden, num_steps, device="cuda")
    plan = plan_for(batch, dim, hidden, num_steps, precision, device=current_device(problem.x.device.index))
    log, out = logged_call(monkeypatch, capfd, problem, precision)
    assert log == plan["log"], (log, plan)
    tolerance = FAST_TOLERANCE if precision == "bf16" and plan["kernel"] == "bf16_wgmma" else FP32_TOLERANCE
    if precision == "tf32" and plan["kernel"] == "tf32x3_tiled":
        tolerance = FAST_TOLERANCE
    assert relative_error(out, reference64_cuda(problem)) <= tolerance
