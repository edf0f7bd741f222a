"""A graph served from inductor's FX graph cache is reported like a compiled one.

The pass does not run on a cache hit; the INFO line of each fused loop and
``ddpm_ops.rewrite_stats()`` must still reflect the loops the cached graph holds.
"""
import logging

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config

import ddpm_ops
from loops.cases import CASES
from test_rewrite_models import Sampler, make_inputs


def _time_column():
    torch.manual_seed(0)
    model = Sampler(dim=4, hidden=(8,), num_steps=3)
    return model, make_inputs(model, seed=1)


def _general():
    model, args, _ = CASES["v1_int_t"]()
    return model, args


# (model maker, the INFO line's start, loops and steps counted)
LOOPS = {
    "time-column": (_time_column, "ddpm_ops: fused 3 steps into one ddpm::fused_sample.rule ", 1, 3),
    "general": (_general, "ddpm_ops: fused 6 steps into one ddpm::fused_sample.rule ", 1, 6),
}


@pytest.fixture(params=["fx graph cache", "fx graph and autograd caches"])
def fresh_fx_graph_cache(request, tmp_path, monkeypatch):
    """An empty cache dir; the AOTAutograd cache (which holds the FX graph) on or off."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor_cache"))
    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=True), \
            torch._functorch.config.patch(enable_autograd_cache="autograd" in request.param):
        yield
    torch._dynamo.reset()


def _compile_and_report(model, args, caplog):
    """(INFO lines, rewrite_stats() delta, FX graph cache hits) of one fresh compilation."""
    torch._dynamo.reset()
    caplog.clear()
    stats, hits = ddpm_ops.rewrite_stats(), counters["inductor"]["fxgraph_cache_hit"]
    with caplog.at_level(logging.INFO, logger="ddpm_ops"), torch.no_grad():
        out = torch.compile(model)(*args)
    lines = [r.getMessage() for r in caplog.records
             if r.name.startswith("ddpm_ops") and r.levelno == logging.INFO]
    delta = {k: v - stats[k] for k, v in ddpm_ops.rewrite_stats().items()}
    return out, lines, delta, counters["inductor"]["fxgraph_cache_hit"] - hits


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_cache_hit_logs_and_counts_the_fused_loop(name, fresh_fx_graph_cache, caplog):
    make, line, loops, steps = LOOPS[name]
    model, args = make()
    miss_out, miss_lines, miss_stats, miss_hits = _compile_and_report(model, args, caplog)
    assert miss_hits == 0
    hit_out, hit_lines, hit_stats, hit_hits = _compile_and_report(model, args, caplog)
    assert hit_hits >= 1
    assert torch.equal(hit_out, miss_out)
    for lines in (miss_lines, hit_lines):
        assert sum(m.startswith(line) for m in lines) == 1, lines
    assert all("FX graph cache" in m for m in hit_lines), hit_lines
    for stats in (miss_stats, hit_stats):
        assert stats["loops_fused"] == loops and stats["steps_fused"] == steps, stats


def test_cleared_counters_do_not_hide_a_hit(fresh_fx_graph_cache, caplog):
    model, args = _general()
    _compile_and_report(model, args, caplog)
    counters.clear()
    _, lines, stats, hits = _compile_and_report(model, args, caplog)
    assert hits >= 1
    assert len(lines) == 1 and stats["loops_fused"] == 1, (lines, stats)


def test_a_miss_is_reported_once(fresh_fx_graph_cache, caplog):
    model, args = _general()
    _, lines, stats, hits = _compile_and_report(model, args, caplog)
    assert hits == 0
    assert len(lines) == 1 and "FX graph cache" not in lines[0], lines
    assert stats["loops_fused"] == 1
