"""ddpm_ops.calls: every call of the op built by keyword, in the schema's order."""
import pytest
import torch

import ddpm_ops
from ddpm_ops.calls import RULE, TIME_COLUMN, call, op_args
from problems import make_problem, relative_error


def test_arguments_go_where_the_schema_puts_them():
    names = [a.name for a in RULE._schema.arguments]
    given = {"x": "X", "t_start": "T", "weights": "W", "biases": "B", "step_tables": "S", "num_steps": 3,
             "activations": ["silu"], "noise": "Z"}
    args = op_args(RULE, **given)
    assert len(args) == names.index("noise") + 1  # nothing after the last argument given
    for name, value in given.items():
        assert args[names.index(name)] == value
    assert args[names.index("time_bias")] is None  # a default before the last argument given


def test_unknown_and_missing_arguments_are_refused():
    with pytest.raises(TypeError, match=r"unknown arguments \['num_stpes'\]"):
        op_args(TIME_COLUMN, num_stpes=3)
    with pytest.raises(TypeError, match=r"missing argument t_start"):
        op_args(TIME_COLUMN, x=torch.zeros(1, 1))


def test_a_call_by_keyword_is_the_positional_call():
    p = make_problem(5, 4, [8], 3)
    by_name = call(TIME_COLUMN, x=p.x, t_start=p.t_start, weights=p.weights, biases=p.biases,
                   sqrt_recip_alphas=p.sqrt_recip_alphas, coef_eps=p.coef_eps, num_steps=p.num_steps,
                   total_timesteps=p.total_timesteps)
    assert torch.equal(by_name, torch.ops.ddpm.fused_sample(*p.args()))
    assert relative_error(ddpm_ops.fused_sample(*p.args()), p.reference64()) < 1e-5
