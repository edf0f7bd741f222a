"""The matcher and the rewrite of DDPM sampling loops on ATen FX graphs.

One matcher for both callers: the ``torch.compile`` pass
(:mod:`ddpm_ops.graph_pass`, which installs it into inductor) and
:func:`ddpm_ops.fuse_exported_program`. Its entry point is
:func:`rewrite_graph`; :func:`looks_like_update` is the cheap filter the pass
also uses to say that it skipped a training graph. The modules, each one
concern:

* :mod:`.patterns`: node predicates and the small structural readers (a
  ``(B, 1)`` column, a table lookup, the time column, SiLU, a transpose);
* :mod:`.linear`: a Linear with bias in each ATen form it lowers to;
* :mod:`.steps`: one sampling step (its structure, its types, its isolation)
  and the chaining of steps into runs;
* :mod:`.replace`: whether a run may be replaced, the insertion of the op and
  the removal of what only the run needed;
* :mod:`.report`: the INFO line of each fused loop and the counts of
  ``ddpm_ops.rewrite_stats()``, also for graphs served from the FX graph cache.

What is matched (every fact is proved on the graph, or nothing is rewritten)
---------------------------------------------------------------------------
One step is ``x_out = c1 * (x - c2 * eps)`` (either operand order of each
``mul``) where

* ``eps = Linear_L(SiLU(... SiLU(Linear_1(cat([x, tcol], dim=1 or -1)))))``,
  each Linear with a bias (``aten.linear``, ``permute``/``t`` + ``addmm`` or
  ``mm`` + ``add``), SiLU exactly (``aten.silu``, ``z * sigmoid(z)`` or
  ``z / (1 + exp(-z))``) between layers and nothing after the last;
* ``tcol`` is ``(t.float() / T)`` reshaped to ``(B, 1)``, ``T`` a positive
  integer constant;
* ``c1 = table_a[t]`` and ``c2 = table_b[t]`` reshaped to ``(B, 1)``, with
  ``t = root - k`` for an integer constant ``k`` (``root - 0``, plain
  ``root`` and repeated ``t = t - 1`` all resolve to an offset from a root);
* everything float32, ``t`` int32/int64 of shape ``(B,)``, one device;
* no intermediate of the step (the MLP activations, ``eps``, ``c2 * eps``,
  ``x - c2 * eps``) is used outside the step.

A Linear may also appear as inductor's ``pad_mm`` leaves it on CUDA (operands
zero-padded to aligned sizes, the result sliced back). A run inside which an
in-place op executes (possible in ``torch.export``'s default, non-functional
IR) is left alone: the op would read its inputs after that mutation.

Consecutive steps form a run when step ``i+1`` reads exactly step ``i``'s
output (and nothing else reads it), uses the same weight, bias and table
nodes, the same ``T`` and the same root with offset one larger. Each run
becomes ``ddpm::fused_sample(x_first, t_first, W, b, table_a, table_b, K, T)``;
a run may be a part of a loop (e.g. when the first step differs, or when the
user keeps a trajectory, every kept ``x`` ends a run). Anything else is left
exactly as it was, and the reason is logged at DEBUG on ``ddpm_ops.rewrite``.

Behaviour change, deliberately accepted
---------------------------------------
The loop indexes the tables with Python semantics: a negative timestep
(``t_start - k < 0``) silently wraps to the end of the table, and one past the
end raises an indexing error. The fused op refuses every timestep outside the
table (CPU: raises; CUDA without ``validate``: the sample's row is NaN). So
the rewrite changes behaviour only for inputs on which the loop was already
wrong (silently wrapping), and then turns a silent wrong answer into a loud
one; for all in-range inputs the result is the same numbers.
"""
from .replace import rewrite_graph
from .steps import looks_like_update

__all__ = ["looks_like_update", "rewrite_graph"]
