"""The CUDA kernel rule (csrc/plan: choose_plan), checked on the CPU through the
debug op ddpm::cuda_plan with the H200's description: the kernels and shapes
measured fastest there (BENCHMARKS.md, docs/kernels.md). test_cuda_kernel.py
checks on a GPU that the planned kernel is the one that runs."""
import dataclasses
import random

import pytest
import torch

from ddpm_ops.cuda_plan import A100, H200, JETSON_AGX_ORIN, L4, MAX_CLUSTER_SIZE, RTX_4090, Device, plan_for
from problems import run_python

SEED = (64, [256, 256])


def plan(batch, dim=64, hidden=(256, 256), num_steps=3, precision="fp32", **kwargs):
    return plan_for(batch, dim, list(hidden), num_steps, precision, **kwargs)


def forced(kernel, cluster_size=None, **more):
    """DDPM_OPS_CUDA_KERNEL=kernel (None: unset), DDPM_OPS_CUDA_CLUSTER_SIZE=cluster_size."""
    overrides = {} if kernel is None else {"DDPM_OPS_CUDA_KERNEL": kernel}
    if cluster_size is not None:
        overrides["DDPM_OPS_CUDA_CLUSTER_SIZE"] = str(cluster_size)
    overrides.update(more)
    return overrides


# (cluster size, rows) of bf16x3_wgmma_swapab on the H200 (30 co-resident
# clusters of 4, 66 of 2); None: another kernel.
@pytest.mark.parametrize("batch, expected", [
    (120, None), (121, (4, 8)), (240, (4, 8)), (241, (2, 8)), (528, (2, 8)), (529, (4, 24)), (720, (4, 24)),
    (721, (4, 32)), (960, (4, 32)), (961, None)])
def test_swapab_rule(batch, expected):
    """bf16x3_wgmma_swapab runs from batch 121 (fp32_resident's below) while one
    wave of its clusters holds the batch, in the shape of least modelled step
    time: clusters of 4 with 8-row tiles while they fit, then clusters of 2
    with 8 rows, then clusters of 4 with 24 and 32 rows."""
    p = plan(batch)
    if expected is None:
        assert p["kernel"] != "bf16x3_wgmma_swapab", p
        return
    assert p["kernel"] == "bf16x3_wgmma_swapab", p
    assert (p["cluster_size"], p["rows"]) == expected, p
    assert p["tiles"] <= p["grid"], p  # one wave


@pytest.mark.parametrize("precision, batch, expected, cluster_size", [
    ("fp32", 961, "bf16x3_wgmma_m64", 4), ("fp32", 1920, "bf16x3_wgmma_m64", 4),
    ("fp32", 1921, "bf16x3_wgmma_m64", 2), ("fp32", 32768, "bf16x3_wgmma_m64", 2),
    ("tf32", 5000, "bf16x3_wgmma_m64", 2), ("bf16", 5000, "bf16_wgmma", None)])
def test_m64_rule(precision, batch, expected, cluster_size):
    """bf16x3_wgmma_m64 runs from batch 265 where bf16x3_wgmma_swapab does not,
    in every precision but "bf16" (bf16_wgmma; test_bf16_rule), in clusters of
    4 while the tiles fit in one wave of them (30 on the H200), else of 2."""
    p = plan(batch, precision=precision)
    assert p["kernel"] == expected, p
    if cluster_size is not None:
        assert p["cluster_size"] == cluster_size, p


@pytest.mark.parametrize("batch, expected", [
    (1, "fp32_resident"), (120, "fp32_resident"), (121, "bf16x3_wgmma_swapab"), (960, "bf16x3_wgmma_swapab"),
    (1024, "bf16x3_wgmma_m64"), (2500, "bf16_wgmma"), (5000, "bf16_wgmma")])
def test_bf16_rule(batch, expected):
    """"bf16" takes bf16_wgmma from batch 265 and the exact fp32_resident and
    bf16x3_wgmma_swapab below, but the exact swapab or m64 kernel where m64
    runs in clusters of 4 (faster: up to 30 tiles on the H200)."""
    assert plan(batch, precision="bf16")["kernel"] == expected


# (cluster size, rows) of fp32_resident at the seed shape, for calls of fewer
# than 8 steps and of 8 or more (15 co-resident clusters of 8, 66 of 2).
RESIDENT_RULE_H200 = {
    4: {1: (8, 1), 2: (8, 1), 7: (8, 1), 8: (8, 1), 28: (8, 2), 29: (8, 2), 30: (8, 2), 31: (8, 4), 60: (8, 4),
        61: (2, 1), 120: (8, 8)},
    16: {1: (8, 1), 2: (8, 1), 7: (8, 1), 8: (8, 1), 28: (8, 2), 29: (8, 2), 30: (8, 2), 31: (2, 1), 60: (2, 1),
         61: (2, 1), 120: (8, 8)},
}


def check_resident_shape(p, batch, hidden_width):
    """One wave of clusters with the fewest rows each (1, 2, 4 or 8), the
    cluster size matching the outputs per warp; returns (size, rows)."""
    assert p["kernel"] == "fp32_resident", p
    assert p["opw"] in (2, 4, 16) and p["cluster_size"] * 8 * p["opw"] == hidden_width, p
    assert p["tiles"] == -(-batch // p["rows"]) <= p["co_resident"], p
    assert p["rows"] == min(r for r in (1, 2, 4, 8) if -(-batch // r) <= p["co_resident"]), p
    return p["cluster_size"], p["rows"]


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("num_steps", [4, 16])
@pytest.mark.parametrize("batch", [1, 2, 7, 8, 28, 29, 30, 31, 60, 61, 120, 121])
def test_resident_rule(precision, num_steps, batch):
    """Every precision runs the seed shape's small batches on fp32_resident
    while one wave of clusters holds them at 8 rows each, in the shape with
    the fewest products per lane; where 4 rows in clusters of 8 tie with 1 row
    in clusters of 2, a call of 8 steps or more takes the latter."""
    p = plan(batch, num_steps=num_steps, precision=precision)
    if batch > 120:
        assert p["kernel"] != "fp32_resident", p
        return
    assert check_resident_shape(p, batch, 256) == RESIDENT_RULE_H200[num_steps][batch], p


# forced: DDPM_OPS_CUDA_CLUSTER_SIZE; H / 16, H / 32 and H / 128 are the sizes
# the kernel has (2, 4 or 16 outputs per warp).
@pytest.mark.parametrize("batch, dim, hidden, num_steps, cluster_size", [
    (1, 64, [256, 256], 16, None), (1, 64, [256, 256], 16, 8), (1, 64, [256, 256], 16, 2),
    (60, 64, [256, 256], 16, 2), (100, 12, [256], 5, 2), (7, 9, [128, 128], 3, 1), (8, 64, [256, 256], 16, None),
    (8, 64, [256, 256], 16, 16), (20, 64, [256, 256], 16, 16), (40, 64, [256, 256], 16, None),
    (100, 64, [256, 256], 16, None), (50, 64, [256, 256], 16, 16), (99, 61, [256, 256, 256], 4, None),
    (90, 5, [64], 6, None), (3, 64, [256], 5, None), (3, 64, [256], 5, 8), (5, 63, [256, 256, 256], 7, None),
    (5, 63, [256, 256, 256], 7, 8), (7, 1, [16, 16], 4, None), (9, 12, [128, 128], 5, 4),
    (2, 33, [96, 96, 96], 3, None), (6, 64, [48], 9, None), (4, 17, [160, 160], 30, 5),
    (3, 64, [256, 256], 100, None)])
def test_resident_shapes(batch, dim, hidden, num_steps, cluster_size):
    p = plan(batch, dim, hidden, num_steps, overrides=forced("resident", cluster_size))
    size, _ = check_resident_shape(p, batch, hidden[0])
    assert cluster_size is None or size == cluster_size, p


# forced: DDPM_OPS_CUDA_CLUSTER_SIZE (None: the shape's rule); expected:
# cluster size, columns per CTA, exchange buffers (two where they fit).
@pytest.mark.parametrize("batch, dim, hidden, cluster_size, expected", [
    (1, 64, [256, 256], None, (4, 64, 2)), (1, 64, [256, 256], 2, (2, 128, 1)),
    (1000, 64, [256, 256], None, (4, 64, 2)), (1000, 64, [256, 256], 2, (2, 128, 1)),
    (32768, 64, [256, 256], None, (2, 128, 1)), (32768, 64, [256, 256], 4, (4, 64, 2)),
    (9, 64, [256, 200], None, (4, 64, 2)), (300, 12, [256], None, (4, 64, 2)), (300, 12, [256], 2, (2, 128, 2)),
    (200, 40, [192, 150], None, (4, 64, 2)),
    (100, 64, [256, 256, 256], None, (4, 64, 1)),  # 209 KB a CTA: only in clusters of 4
    (100, 64, [256, 256, 256], 2, (4, 64, 1)),     # (so a forced 2 is ignored)
    (65, 63, [128, 128, 128, 128], None, (2, 64, 2)), (65, 63, [128, 128, 128, 128], 4, (2, 64, 2)),
    (70, 64, [128, 128, 128], None, (2, 64, 2)), (70, 64, [128, 128, 128], 1, (1, 128, 1)),
    (130, 33, [100, 37], None, (2, 64, 2)), (130, 33, [100, 37], 1, (1, 128, 1)), (77, 1, [64, 64], None, (1, 64, 1))])
def test_m64_shapes(batch, dim, hidden, cluster_size, expected):
    p = plan(batch, dim, hidden, overrides=forced("split", cluster_size))
    assert p["kernel"] == "bf16x3_wgmma_m64", p
    assert (p["cluster_size"], p["own"], p["buffers"]) == expected and p["hidden"] == expected[0] * expected[1], p
    assert 0 < p["grid"] <= p["tiles"] == -(-batch // 64), p


# Forced cluster size and tile rows, at every tile height whose shape fits;
# own: the columns per CTA of the cheapest shape of that cluster size.
SWAPAB_CASES = [
    (1, 64, [256, 256], 4, 64, [8, 16, 24, 32]), (512, 64, [256, 256], 4, 64, [8, 16, 24, 32]),
    (512, 64, [256, 256], 2, 128, [8]),  # 195 KB of weights a CTA: only 8-row tiles fit
    (1000, 64, [256, 256], 4, 64, [8, 32]), (1000, 64, [256, 256], 2, 128, [8]),
    (9, 64, [256, 200], 4, 64, [8, 16, 24, 32]), (300, 12, [256], 4, 64, [8, 16, 24, 32]),
    (300, 12, [256], 2, 128, [8, 16, 24, 32]), (200, 40, [192, 150], 2, 128, [8]),
    (100, 64, [256, 256, 256], 4, 64, [8, 16]), (65, 63, [128, 128, 128, 128], 2, 64, [8, 16, 24, 32]),
    (70, 64, [128, 128, 128], 1, 128, [8, 16]), (70, 64, [128, 128, 128], 4, 64, [8, 16]),
    (130, 33, [100, 37], 2, 64, [8, 16, 24, 32]), (130, 33, [100, 37], 1, 128, [8, 16, 24, 32]),
    (77, 1, [64, 64], 1, 64, [8, 16, 24, 32]),
]


@pytest.mark.parametrize("batch, dim, hidden, cluster_size, own, rows", [
    case[:-1] + (rows,) for case in SWAPAB_CASES for rows in case[-1]])
def test_swapab_shapes(batch, dim, hidden, cluster_size, own, rows):
    p = plan(batch, dim, hidden, overrides=forced("narrow", cluster_size, DDPM_OPS_CUDA_TILE_ROWS=str(rows)))
    assert p["kernel"] == "bf16x3_wgmma_swapab", p
    assert (p["rows"], p["cluster_size"], p["own"], p["hidden"]) == (rows, cluster_size, own, own * cluster_size), p
    assert 0 < p["grid"] <= p["tiles"] == -(-batch // rows), p


@pytest.mark.parametrize("batch, dim, hidden, padded_hidden", [
    (1, 64, [256, 256], 256), (1000, 64, [256, 256], 256), (32768, 64, [256, 256], 256), (300, 12, [256], 256),
    (77, 1, [64, 64], 64), (130, 33, [100, 37], 128), (65, 63, [128, 128, 128, 128], 128),
    (200, 40, [192, 150, 192], 192), (9, 64, [256, 200], 256)])
def test_bf16_wgmma_shapes(batch, dim, hidden, padded_hidden):
    p = plan(batch, dim, hidden, precision="bf16", overrides=forced("wgmma"))
    tiles = -(-batch // 64)
    assert (p["kernel"], p["tiles"], p["grid"], p["hidden"]) == ("bf16_wgmma", tiles, min(tiles, 132),
                                                                 padded_hidden), p
    assert p["cluster_size"] == 0, p  # a plain launch


@pytest.mark.parametrize("kernel, batch, dim, hidden, precision", [
    ("split", 300, 65, [256], "fp32"), ("split", 300, 12, [1024, 1024], "fp32"), ("split", 300, 64, [], "fp32"),
    ("split", 300, 64, [256] * 4, "fp32"),  # 272 KB of a cluster of 4's share: more than shared memory
    ("narrow", 300, 65, [256], "fp32"), ("narrow", 300, 12, [1024, 1024], "fp32"), ("narrow", 300, 64, [], "fp32"),
    ("narrow", 300, 64, [256] * 4, "fp32"),
    ("resident", 3, 65, [256], "fp32"), ("resident", 3, 12, [512, 512], "fp32"),
    ("resident", 3, 64, [256, 128], "fp32"), ("resident", 3, 64, [100, 100], "fp32"),
    ("resident", 3, 64, [], "fp32"), ("resident", 3, 64, [256] * 4, "fp32"),
    ("resident", 121, 64, [256, 256], "fp32"),  # more than 8 rows per cluster of 8
    ("wgmma", 300, 65, [256], "bf16"), ("wgmma", 300, 12, [1024, 1024], "bf16"), ("wgmma", 300, 64, [], "bf16"),
    ("wgmma", 300, 64, [256, 256, 256], "bf16"),  # 320 KB of bf16 weights
    ("wgmma", 300, 64, [256, 256], "fp32"),       # bf16_wgmma runs "bf16" only
])
def test_outside_a_kernels_envelope(kernel, batch, dim, hidden, precision):
    """Nets (and batches) a kernel cannot hold run on another, even where it is forced."""
    short = {"split": "bf16x3_wgmma_m64", "narrow": "bf16x3_wgmma_swapab", "resident": "fp32_resident",
             "wgmma": "bf16_wgmma"}[kernel]
    p = plan(batch, dim, hidden, precision=precision, overrides=forced(kernel))
    assert p["kernel"] != short, p
    # Nothing else named: the last-resort rule, not the other candidates.
    assert p["kernel"] in ("fp32_smem", "tf32x3_tiled"), p


@pytest.mark.parametrize("kernel, expected", [("cluster", "fp32_smem"), ("tiled16", "tf32x3_tiled"),
                                              ("fp32_smem", "fp32_smem"), ("tf32x3_tiled16", "tf32x3_tiled")])
def test_a_forced_kernel_overrides_the_wgmma_kernel(kernel, expected):
    assert plan(600, precision="bf16", overrides=forced(kernel))["kernel"] == expected


@pytest.mark.parametrize("new, old", [("fp32_resident", "resident"), ("bf16x3_wgmma_swapab", "narrow"),
                                      ("bf16x3_wgmma_m64", "split"), ("bf16_wgmma", "wgmma"),
                                      ("fp32_smem", "cluster"), ("tf32x3_tiled32", "tiled32")])
def test_kernel_names_and_short_names_force_the_same(new, old):
    precision = "bf16" if old == "wgmma" else "fp32"
    assert plan(300, precision=precision, overrides=forced(new)) == plan(300, precision=precision,
                                                                         overrides=forced(old))


def test_an_unknown_forced_name_leaves_only_the_last_resort():
    """Any DDPM_OPS_CUDA_KERNEL keeps the rule's candidates out unless it names one."""
    assert plan(300)["kernel"] == "bf16x3_wgmma_swapab"
    assert plan(300, overrides=forced("nonsense"))["kernel"] == "fp32_smem"


@pytest.mark.parametrize("batch, dim, hidden", [(1, 64, [256, 256]), (6, 7, [33, 7]), (37, 33, [300, 1, 64]),
                                                (65, 3, [7, 33, 300, 5]), (150, 12, [1024, 1024]), (40, 12, [512]),
                                                (33, 5, [64, 96, 128])])
@pytest.mark.parametrize("cluster_size", [1, 2, 3, 4, 5, 6, 7, 8, 16])
@pytest.mark.parametrize("tma", [True, False])
def test_every_cluster_size(batch, dim, hidden, cluster_size, tma):
    """A forced tf32x3_tiled cluster size is taken as it is, fp32_smem's only as a
    power of two; TMA copies the chunks of the layers whose rows are 16-byte
    aligned, unless DDPM_OPS_CUDA_TMA=0."""
    more = {} if tma else {"DDPM_OPS_CUDA_TMA": "0"}
    p = plan(batch, dim, hidden, overrides=forced("tiled16", cluster_size, **more))
    assert (p["kernel"], p["rows"], p["cluster_size"]) == ("tf32x3_tiled", 16, cluster_size), p
    widths = [dim + 1, *hidden]
    copies = ["tma" if tma and w % 4 == 0 else "cp.async" for w in widths]
    assert p["log"].endswith("weight chunks by: " + " ".join(copies)), p
    p = plan(batch, dim, hidden, overrides=forced("cluster", cluster_size))
    assert p["kernel"] == "fp32_smem", p
    assert cluster_size & (cluster_size - 1) != 0 or p["cluster_size"] == cluster_size, p


@pytest.mark.parametrize("misaligned", [None, 0, 1, 2])
def test_tma_and_cp_async_chunks_mixed(misaligned):
    aligned = [layer != misaligned for layer in range(3)]
    p = plan(100, 12, [1024, 512], aligned=aligned, overrides=forced("tiled16", 2))
    copies = p["log"].split("weight chunks by: ")[1].split()
    # Layer 0 reads dim + 1 = 13 columns: never TMA.
    assert copies == ["cp.async"] + ["tma" if aligned[layer] else "cp.async" for layer in (1, 2)], p


def test_no_tensor_map_encoder_means_cp_async():
    device = dataclasses.replace(H200, tma_encoder=False)
    p = plan(200, overrides=forced("tiled32"), device=device)
    assert p["log"].endswith("weight chunks by: cp.async cp.async cp.async"), p


@pytest.mark.parametrize("dim, hidden", [(64, [256, 256]), (12, [1024, 1024])])
@pytest.mark.parametrize("batch", [1, 2, 5, 8, 16, 33])
def test_small_batches_get_a_cluster_per_row(batch, dim, hidden):
    """fp32_smem at small batch: every row in a cluster of its own, of at least 4
    CTAs, while the co-resident clusters allow it (up to batch 8 on 100+ SMs)."""
    p = plan(batch, dim, hidden, overrides=forced("cluster"))
    assert p["tiles"] * p["rows"] >= batch > (p["tiles"] - 1) * p["rows"], p
    if batch <= 8:
        assert p["cluster_size"] >= 4 and batch <= p["co_resident"] and p["rows"] == 1 and p["tiles"] == batch, p


@pytest.mark.parametrize("layer", [1, 2])
def test_resident_needs_aligned_weights(layer):
    aligned = [l != layer for l in range(3)]
    p = plan(3, num_steps=4, aligned=aligned, overrides=forced("resident"))
    assert p["kernel"] != "fp32_resident", p
    assert plan(3, num_steps=4, aligned=[False, True, True], overrides=forced("resident"))["kernel"] == \
        "fp32_resident"


@pytest.mark.parametrize("batch, hidden, expected", [
    (767, [256, 256], ("fp32_smem", None, None)),
    (768, [256, 256], ("tf32x3_tiled", 16, 2)),      # from kTiledMinBatch: 48 tiles, 66 clusters of 2
    (127, [1024, 1024], ("fp32_smem", None, None)),
    (128, [1024, 1024], ("tf32x3_tiled", 16, 9)),    # weights off chip: 8 tiles, 13 clusters of 9
    (4096, [1024, 1024], ("tf32x3_tiled", 16, 1)),   # 64-row tiles do not fit; 256 tiles
    (8192, [256, 256], ("tf32x3_tiled", 64, 1)),     # 128 64-row tiles fill 7/8 of the SMs
])
def test_tiled_rule_of_the_last_resort(batch, hidden, expected):
    """With the candidates kept out (a DDPM_OPS_CUDA_KERNEL that names none) the
    rule is tf32x3_tiled's against fp32_smem's."""
    p = plan(batch, 12, hidden, overrides=forced("none"))
    kernel, rows, cluster_size = expected
    assert p["kernel"] == kernel, p
    assert rows is None or (p["rows"], p["cluster_size"]) == (rows, cluster_size), p


def test_log_lines():
    """What DDPM_OPS_CUDA_LOG prints, one kernel each."""
    assert plan(1, num_steps=16)["log"] == (
        "ddpm_ops resident kernel: batch 1, cluster size 8 (15 co-resident), 1 rows x 1 clusters, 4 outputs per warp")
    assert plan(512)["log"].startswith("ddpm_ops narrow kernel: batch 512, 8 rows x 64 tiles on 64 clusters of 2, "
                                       "hidden width 256, 128 columns per CTA, ")
    assert plan(32768)["log"].startswith("ddpm_ops split kernel: batch 32768, 64 rows x 512 tiles on 66 clusters "
                                         "of 2, hidden width 256, 128 columns per CTA, ")
    assert plan(32768, precision="bf16")["log"].startswith(
        "ddpm_ops wgmma kernel: batch 32768, 64 rows x 512 tiles on 132 CTAs of 2 warpgroups, hidden width 256, ")
    assert plan(16, overrides=forced("cluster"))["log"].startswith(
        "ddpm_ops cluster kernel: batch 16, cluster size 4 (30 co-resident), 1 rows x 16 clusters, last layer "
        "whole per CTA, ")
    assert plan(200, overrides=forced("tiled32"))["log"].startswith(
        "ddpm_ops tiled kernel: batch 200, 32 rows x 7 tiles, cluster size 1, last layer split over its columns, ")


def test_too_wide_for_shared_memory_raises():
    with pytest.raises(RuntimeError, match="need more shared memory per sample than the GPU has"):
        plan(1, 30000, [30000], overrides=forced("cluster"))


def test_op_checks_its_arguments():
    with pytest.raises(RuntimeError, match="device needs"):
        torch.ops.ddpm.cuda_plan(1, 64, [256], 1, "fp32", [132], [], "")
    with pytest.raises(RuntimeError, match="NAME=VALUE"):
        torch.ops.ddpm.cuda_plan(1, 64, [256], 1, "fp32", H200.as_list(), [], "DDPM_OPS_CUDA_KERNEL")


@pytest.mark.parametrize("batch", [1, 50, 120, 256, 4096])
def test_general_step_plans_only_engine_kernels(batch):
    """fused_sample.rule runs on fp32_resident where it fits, else tf32x3_tiled
    from batch 768, else fp32_rule; a kernel outside the engine, forced, leaves
    it to fp32_rule."""
    plan = plan_for(batch, 6, [256, 256, 256], 5, general_step=True)
    expected = "fp32_resident" if batch <= 120 else ("tf32x3_tiled" if batch >= 768 else "fp32_rule")
    assert plan["kernel"] == expected, plan
    for forced, expected in (("fp32_smem", "fp32_rule"), ("tiled16", "tf32x3_tiled"),
                             ("bf16x3_wgmma_m64", "fp32_rule"), ("rule", "fp32_rule")):
        p = plan_for(batch, 6, [256, 256], 5, general_step=True, overrides={"DDPM_OPS_CUDA_KERNEL": forced})
        assert p["kernel"] == expected, (forced, p)


IDQL_WIDTHS = [256, *[1024, 256] * 3]  # IDQL's LN-ResNet: Linear(6, 256), blocks of 256 -> 1024 -> 256


def ceil_div(n, d):
    return -(-n // d)


def rule_threads(rows):
    return 1024 if rows <= 2 else 512


def rule_columns(rows):
    return 8 if rows == 1 else (4 if rows <= 8 else 2)


def rule_smem(rows, dim, width, saved):
    """fp32_rule's shared memory (csrc/plan/shapes/fp32_rule.h: rule_smem_bytes) without bias
    networks: the row header, the warps' partial sums, the samples and the previous x0, two
    activation buffers and
    `saved` more."""
    header = -(-10 * rows // 4) * 4
    scratch = rule_threads(rows) // 32 * rows * rule_columns(rows)
    dim_ld = -(-dim // 4) * 4
    return 4 * (header + scratch + rows * (2 * dim_ld + (2 + saved) * width))


def kept_on_chip(plan):
    """The layers whose weights fp32_rule's plan keeps in shared memory (its log's flags)."""
    return [flag == "1" for flag in plan["log"].split("weights on chip:")[1].split()]


def rule_smem_with_weights(plan, dim, ins, outs, saved, width):
    """rule_smem, then each kept layer's share: the cluster's columns of it (whole groups of a
    warp's), rows of its inputs rounded up to four floats."""
    rows, cluster = plan["rows"], max(plan["cluster_size"], 1)
    group = rule_columns(rows)
    shares = [ceil_div(ceil_div(out, cluster), group) * group * ceil_div(n, 4) * 4 for n, out in zip(ins, outs)]
    base = rule_smem(rows, dim, width, saved)
    kept = [share for share, on_chip in zip(shares, kept_on_chip(plan)) if on_chip]
    return base + 4 * sum(kept)


IDQL_INS, IDQL_OUTS = [6, *IDQL_WIDTHS], [*IDQL_WIDTHS, 6]  # every Linear, the last (256 -> 6) too


@pytest.mark.parametrize("batch, rows", [(1, 1), (64, 1), (256, 2), (1024, 8), (4096, 16)])
@pytest.mark.parametrize("forced", [None, "fp32_resident", "tiled16", "fp32_smem"])
def test_a_network_program_plans_fp32_rule_alone(batch, rows, forced):
    """A program runs on fp32_rule whatever the batch or DDPM_OPS_CUDA_KERNEL says (the other
    kernels run a plain chain only), its residual stack's buffers and the weights it keeps on
    chip counted in the shared memory. Alone (clusters of 1), the rows double while the blocks
    outnumber the SMs."""
    overrides = {"DDPM_OPS_CUDA_CLUSTER_SIZE": "1", **({"DDPM_OPS_CUDA_KERNEL": forced} if forced else {})}
    p = plan_for(batch, 6, IDQL_WIDTHS, 5, program_saved=1, overrides=overrides)
    assert p["kernel"] == "fp32_rule" and p["rows"] == rows and p["cluster_size"] == 0, p
    assert p["smem"] == rule_smem_with_weights(p, 6, IDQL_INS, IDQL_OUTS, 1, 1024) <= H200.max_smem, p
    assert not any(kept_on_chip(p)[1:-1]), p  # a whole 1024 x 256 layer does not fit one block


@pytest.mark.parametrize("batch", [1, 8, 40, 64])
def test_small_batches_of_a_program_run_in_clusters_on_hopper(batch):
    """IDQL's LN-ResNet at small batches: its layers' columns split over a cluster (one wave of
    clusters holds the batch), the shares that fit kept on chip; no cluster without Hopper."""
    p = plan_for(batch, 6, IDQL_WIDTHS, 5, program_saved=1)
    assert p["kernel"] == "fp32_rule" and p["cluster_size"] >= 2, p
    assert -(-batch // p["rows"]) <= H200.max_clusters[p["cluster_size"]], p
    assert p["smem"] == rule_smem_with_weights(p, 6, IDQL_INS, IDQL_OUTS, 1, 1024) <= H200.max_smem, p
    assert any(kept_on_chip(p)), p
    portable = plan_for(batch, 6, IDQL_WIDTHS, 5, program_saved=1, device=A100)
    assert portable["kernel"] == "fp32_rule" and portable["cluster_size"] == 0, portable


@pytest.mark.parametrize("size", [2, 3, 4, 8, 16])
@pytest.mark.parametrize("general_step", [False, True])
def test_fp32_rule_in_a_forced_cluster_size(size, general_step):
    """DDPM_OPS_CUDA_CLUSTER_SIZE names fp32_rule's cluster (any size that launches), for a
    program and for the plain chain fp32_rule runs (DDPM_OPS_CUDA_KERNEL=rule)."""
    overrides = {"DDPM_OPS_CUDA_CLUSTER_SIZE": str(size)}
    if general_step:
        p = plan_for(50, 6, [256, 256, 256], 5, general_step=True, overrides={**overrides, "DDPM_OPS_CUDA_KERNEL": "rule"})
    else:
        p = plan_for(50, 6, IDQL_WIDTHS, 5, program_saved=1, overrides=overrides)
    assert p["kernel"] == "fp32_rule" and p["cluster_size"] == size, p
    assert f"cluster size {size} " in p["log"] and p["tiles"] == p["grid"] == -(-50 // p["rows"]), p


def test_a_program_input_wider_than_the_layers_widens_the_buffers():
    alone = {"DDPM_OPS_CUDA_CLUSTER_SIZE": "1"}
    p = plan_for(1, 6, [64, 64], 5, program_saved=2, program_input=300, overrides=alone)
    assert p["kernel"] == "fp32_rule", p
    assert p["smem"] == rule_smem_with_weights(p, 6, [300, 64, 64], [64, 64, 6], 2, 300), p
    p = plan_for(1, 6, [64, 64], 5, program_saved=0, program_input=40, overrides=alone)
    assert p["smem"] == rule_smem_with_weights(p, 6, [40, 64, 64], [64, 64, 6], 0, 64), p


def test_a_program_too_wide_for_fp32_rule_has_no_plan():
    """The plain chain's two buffers fit, the program's two more do not: no other kernel takes it
    (the op then runs the ATen loop)."""
    assert plan_for(1, 6, [16384, 16384], 5, general_step=True)["kernel"] == "fp32_rule"
    with pytest.raises(RuntimeError, match="a row of this network program does not fit fp32_rule's shared memory"):
        plan_for(1, 6, [16384, 16384], 5, program_saved=2)


@pytest.mark.parametrize("capability", ["8.0", "8.6", "8.7", "8.9"])
@pytest.mark.parametrize("general_step", [False, True])
@pytest.mark.parametrize("batch, expected", [(64, "fp32_rule"), (1024, "tf32x3_tiled")])
def test_a_capability_below_9_plans_the_portable_kernel(capability, general_step, batch, expected):
    plan = plan_for(batch, 64, [256, 256], 16, general_step=general_step,
                    overrides={"DDPM_OPS_CUDA_CAPABILITY": capability})
    assert plan["kernel"] == expected and plan["cluster_size"] == 0, plan
    if expected == "fp32_rule":
        return
    assert "cp.async" in plan["log"] and "tma" not in plan["log"].split("chunks by:")[1], plan


KERNELS = ("fp32_resident", "fp32_smem", "tf32x3_tiled", "bf16_wgmma", "bf16x3_wgmma_m64", "bf16x3_wgmma_swapab",
           "fp32_rule")
NO_CLUSTERS = (0,) * (MAX_CLUSTER_SIZE + 1)


@pytest.mark.parametrize("device, sm_count, max_smem, capability", [
    (A100, 108, 166912, (8, 0)), (RTX_4090, 128, 101376, (8, 9)), (L4, 58, 101376, (8, 9)),
    (JETSON_AGX_ORIN, 16, 166912, (8, 7))], ids=["A100", "RTX_4090", "L4", "JETSON_AGX_ORIN"])
def test_presets_of_gpus_without_clusters(device, sm_count, max_smem, capability):
    assert (device.sm_count, device.max_smem, device.capability) == (sm_count, max_smem, capability)
    assert device.max_clusters == NO_CLUSTERS and not device.sm90a_build


PORTABLE_GPUS = [A100, RTX_4090, L4, JETSON_AGX_ORIN]
PORTABLE_IDS = ["A100", "RTX_4090", "L4", "JETSON_AGX_ORIN"]


@pytest.mark.parametrize("device", PORTABLE_GPUS, ids=PORTABLE_IDS)
@pytest.mark.parametrize("general_step", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("kernel", [None, "resident", "cluster", "tiled16", "tiled64", "wgmma", "split", "narrow",
                                    "rule"])
@pytest.mark.parametrize("batch", [1, 120, 300, 8192])
def test_compute_capability_8_runs_the_portable_kernels(device, general_step, precision, kernel, batch):
    """The other kernels need 9.0 (clusters, wgmma): on 8.x both overloads run
    tf32x3_tiled in tiles of one CTA from batch 768 where a tile fits, or where
    DDPM_OPS_CUDA_KERNEL names it, else fp32_rule (which a named Hopper kernel
    leaves it to)."""
    p = plan(batch, precision=precision, device=device, overrides=forced(kernel), general_step=general_step)
    tiled_fits = plan(batch, device=device, general_step=general_step,
                      overrides=forced("tiled16"))["kernel"] == "tf32x3_tiled"
    asks_tiles = kernel in ("tiled16", "tiled64") or (kernel is None and batch >= 768)
    expected = "tf32x3_tiled" if tiled_fits and asks_tiles else "fp32_rule"
    if kernel == "tiled64" and expected == "tf32x3_tiled":
        expected = plan(batch, device=device, general_step=general_step, overrides=forced("tiled64"))["kernel"]
    assert (p["kernel"], p["cluster_size"]) == (expected, 0), p
    assert p["tiles"] == p["grid"] == -(-batch // p["rows"]) and 0 < p["smem"] <= device.max_smem, p
    if p["kernel"] == "tf32x3_tiled":
        assert "tma" not in p["log"].split("chunks by:")[1], p


@pytest.mark.parametrize("device, fits", [(A100, True), (JETSON_AGX_ORIN, True), (RTX_4090, False), (L4, False)],
                         ids=["A100", "JETSON_AGX_ORIN", "RTX_4090", "L4"])
def test_portable_tiles_of_the_seed_shape(device, fits):
    """A 16-row tile of the seed net needs about 100 KB: the 164 KB of an A100
    or an Orin hold it, the 99 KB of Ada GPUs do not (fp32_rule runs there)."""
    p = plan(1024, device=device, general_step=True)
    assert p["kernel"] == ("tf32x3_tiled" if fits else "fp32_rule"), p
    small = plan(1024, dim=12, hidden=(128, 128), device=device, general_step=True)
    assert small["kernel"] == "tf32x3_tiled", small


@pytest.mark.parametrize("device", PORTABLE_GPUS, ids=PORTABLE_IDS)
@pytest.mark.parametrize("batch", [1, 300, 8192])
def test_clusters_described_on_compute_capability_8_are_not_used(device, batch):
    """A description of an 8.x GPU that claims clusters and a 9.0 build (none
    reports that) still plans no Hopper kernel: their 8.x code is a trap."""
    claimed = dataclasses.replace(device, max_clusters=H200.max_clusters, sm90a_build=True)
    for precision in ("fp32", "bf16"):
        p = plan(batch, precision=precision, device=claimed)
        assert p["kernel"] in ("tf32x3_tiled", "fp32_rule") and p["cluster_size"] == 0, p


def test_a_build_without_9_0_on_an_h200():
    """An extension built without 9.0 runs compute_8x PTX on a 9.0 GPU, in which
    the Hopper kernels are traps: the portable path alone is planned (tiles of
    one CTA, plain launches, chunks by cp.async)."""
    device = dataclasses.replace(H200, sm90a_build=False)
    for batch in (1, 300, 8192):
        p = plan(batch, device=device)
        assert p["kernel"] == ("tf32x3_tiled" if batch >= 768 else "fp32_rule") and p["cluster_size"] == 0, p
        if p["kernel"] == "tf32x3_tiled":
            assert "tma" not in p["log"].split("chunks by:")[1], p


@pytest.mark.parametrize("batch", [1, 100, 300, 5000])
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_a_9_0_device_without_clusters(batch, precision):
    """No co-resident clusters of any size (what cudaOccupancyMaxActiveClusters
    reports where cluster launch is unavailable): bf16_wgmma, a plain launch,
    still runs "bf16" from batch 265, tf32x3_tiled in tiles of one CTA from
    batch 768, fp32_rule the rest."""
    device = dataclasses.replace(H200, max_clusters=NO_CLUSTERS)
    expected = "bf16_wgmma" if precision == "bf16" and batch >= 265 else \
        ("tf32x3_tiled" if batch >= 768 else "fp32_rule")
    p = plan(batch, precision=precision, device=device)
    assert (p["kernel"], p["cluster_size"]) == (expected, 0), p


@pytest.mark.parametrize("device, reason", [
    (A100, "the cluster kernels need compute capability 9.0 \\(H100, H200\\), this GPU has 8.0"),
    (dataclasses.replace(H200, sm90a_build=False), "the extension was built without 9.0 in TORCH_CUDA_ARCH_LIST"),
    (dataclasses.replace(H200, max_clusters=NO_CLUSTERS), "this GPU launches no thread-block clusters")])
def test_a_net_too_wide_for_fp32_rule_names_why_nothing_else_runs(device, reason):
    with pytest.raises(RuntimeError, match=rf"ddpm::fused_sample: {reason}, and no kernel that runs here holds a "
                                           r"row of this net in shared memory"):
        plan(1, 30000, [30000], device=device)


CRASH_SCRIPT = """
import dataclasses
from ddpm_ops.cuda_plan import H200, MAX_CLUSTER_SIZE, plan_for
no_clusters = dataclasses.replace(H200, max_clusters=(0,) * (MAX_CLUSTER_SIZE + 1))
print("kernel:", plan_for(100, 64, [256, 256], 4, device=no_clusters, overrides={"DDPM_OPS_CUDA_KERNEL": "cluster"})["kernel"])
"""


def test_no_clusters_does_not_crash():
    """A forced fp32_smem on a device without clusters divided by zero (SIGFPE);
    in a subprocess, so that a crash cannot take pytest down."""
    result = run_python(CRASH_SCRIPT, timeout=120)
    assert result.returncode == 0, f"crashed with return code {result.returncode}: {result.stderr[-500:]}"
    assert "kernel: fp32_rule" in result.stdout


def random_device(rng: random.Random) -> Device:
    """Any description, zeros and nonsense included: the fields a GPU could report and some none does."""
    shape = rng.choice(["none", "all", "some", "one"])
    counts = [0] * (MAX_CLUSTER_SIZE + 1)
    for size in range(1, MAX_CLUSTER_SIZE + 1):
        if shape == "all" or (shape == "some" and rng.random() < 0.5) or (shape == "one" and size == 1):
            counts[size] = rng.choice([1, 2, rng.randrange(0, 300)])
    if rng.random() < 0.1:
        counts[0] = rng.randrange(0, 300)  # size 0 is no cluster: ignored
    return Device(sm_count=rng.choice([1, 2, 16, 58, 108, 132, rng.randrange(1, 1000)]),
                  max_smem=rng.choice([0, 1, 1024, 48 * 1024, 99 * 1024, 163 * 1024, 227 * 1024,
                                       rng.randrange(0, 2 ** 31)]),
                  max_clusters=tuple(counts),
                  capability=rng.choice([(9, 0), (9, 0), (8, 0), (8, 6), (8, 7), (8, 9), (10, 0), (0, 0)]),
                  sm90a_build=rng.random() < 0.8, tma_encoder=rng.random() < 0.8)


def random_call(rng: random.Random) -> dict:
    width = lambda: rng.choice([1, 3, 8, 64, 100, 256, 1024, rng.randrange(1, 5000), rng.randrange(1, 2 ** 31)])
    overrides = {}
    if rng.random() < 0.3:
        overrides["DDPM_OPS_CUDA_KERNEL"] = rng.choice(
            ["resident", "cluster", "tiled16", "tiled32", "tiled64", "wgmma", "split", "narrow", "rule", "nonsense",
             ""])
    if rng.random() < 0.3:
        overrides["DDPM_OPS_CUDA_CLUSTER_SIZE"] = str(rng.randrange(-2, 20))
    if rng.random() < 0.2:
        overrides["DDPM_OPS_CUDA_TILE_ROWS"] = str(rng.choice([0, 8, 16, 24, 32, 7, -1]))
    if rng.random() < 0.2:
        overrides["DDPM_OPS_CUDA_TMA"] = "0"
    if rng.random() < 0.1:
        overrides["DDPM_OPS_CUDA_CAPABILITY"] = rng.choice(["8.0", "8.9", "9.0", "x", "0.0", "-1.5"])
    return dict(batch=rng.choice([1, 2, 7, 64, 121, 265, 1000, 8192, rng.randrange(1, 2 ** 31)]),
                dim=rng.choice([1, 2, 12, 64, 65, width()]),
                hidden=[width() for _ in range(rng.choice([0, 1, 2, 3, 4, rng.randrange(0, 32)]))],
                num_steps=rng.choice([1, 16, rng.randrange(1, 2 ** 31)]),
                precision=rng.choice(["fp32", "tf32", "bf16"]), general_step=rng.random() < 0.3,
                aligned_layers=rng.random() < 0.8, overrides=overrides)


def sweep(seed: int, count: int) -> None:
    """count random (device, call) pairs: each plan is either a kernel that can
    launch there or a RuntimeError from the op. A crash ends the process; the
    last line printed names its case."""
    rng = random.Random(seed)
    for i in range(count):
        device, call = random_device(rng), random_call(rng)
        print(i, device, call, flush=True)
        aligned = None if call["aligned_layers"] else [rng.random() < 0.5 for _ in range(len(call["hidden"]) + 1)]
        try:
            p = plan_for(call["batch"], call["dim"], call["hidden"], call["num_steps"], call["precision"],
                         device=device, aligned=aligned, overrides=call["overrides"],
                         general_step=call["general_step"])
        except RuntimeError as e:
            assert str(e).startswith("ddpm::"), e
            continue
        assert p["kernel"] in KERNELS, p
        capability = device.capability
        described = call["overrides"].get("DDPM_OPS_CUDA_CAPABILITY", "").split(".")
        if len(described) == 2 and all(f.isdigit() for f in described) and int(described[0]) > 0:
            capability = (int(described[0]), int(described[1]))  # planned as for that GPU
        portable = p["kernel"] == "fp32_rule" or (p["kernel"] == "tf32x3_tiled" and p["cluster_size"] == 0)
        assert portable or (capability == (9, 0) and device.sm90a_build), p
        assert p["cluster_size"] == 0 or device.max_clusters[p["cluster_size"]] > 0, p
        assert 1 <= p["grid"] and p["tiles"] * p["rows"] >= call["batch"], p
        assert 0 < p["smem"] <= device.max_smem, p


@pytest.mark.parametrize("seed", range(4))
def test_random_devices_and_calls_never_crash(seed):
    """Random devices (zeros included) and calls: the plan raises or plans a
    launch, never kills the process. In a subprocess, so that a crash is a
    failure naming its case."""
    result = run_python(f"import test_cuda_plan; test_cuda_plan.sweep({seed}, 1500)", timeout=600)
    last = result.stdout.strip().splitlines()[-1:] or ["(nothing)"]
    assert result.returncode == 0, f"return code {result.returncode} at case {last[0]}: {result.stderr[-2000:]}"
