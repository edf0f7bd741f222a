"""Exported project loops (tests/loops/): fuse_exported_program, then AOTInductor, with eager's numbers."""
import pytest
import torch

import ddpm_ops
from loops.cases import CASES
from test_rewrite_models import relative_error

MATMULS = {"linear", "addmm", "mm", "bmm", "matmul"}


def calls(ep):
    return [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("name", ["diffusion_ql", "cleandiffuser_dql_ddpm", "diffusers_ddim_clip",
                                  "tabddpm", "tabddpm_gaussian_multinomial_float64_variance", "v1_noise_clamps"])
def test_exported_loop_fuses_and_runs_under_aoti(name, tmp_path):
    model, args, noise_shape = CASES[name]()
    args = tuple(a for a in args if a is not None)
    kwargs = {"noise": torch.randn(noise_shape)}
    model.eval()
    with torch.no_grad():
        ref = model(*args, **kwargs)
        # the decomposed IR is functional (Diffusion-QL's clamp_ is in-place in the training IR)
        ep = torch.export.export(model, args, kwargs).run_decompositions()
        fused = ddpm_ops.fuse_exported_program(ep)
        ops = calls(fused)
        assert ops.count("ddpm.fused_sample.rule") == 1, ops
        if name == "v1_noise_clamps":
            assert not MATMULS & {o.split(".")[1] for o in ops if o.startswith("aten.")}, ops
        assert relative_error(fused.module()(*args, **kwargs), ref) < 1e-5
        path = torch._inductor.aoti_compile_and_package(fused, package_path=str(tmp_path / "loop.pt2"))
        out = torch._inductor.aoti_load_package(path)(*args, **kwargs)
    assert relative_error(out, ref) < 1e-5
