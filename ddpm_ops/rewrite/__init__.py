"""The rewrite of sampling loops on ATen FX graphs into one ``ddpm::fused_sample.rule``.

One pass for both callers: the ``torch.compile`` pass
(:mod:`ddpm_ops.graph_pass`, which installs it into inductor) and
:func:`ddpm_ops.fuse_exported_program`. Its entry point is
:func:`rewrite_graph`; :func:`looks_like_loop` is the cheap filter the pass
uses to say that it skipped a training graph. The modules follow the
pipeline, one concern each:

1. read the network: :mod:`.linear` (a Linear in each ATen form),
   :mod:`.activations` (the activations between them), :mod:`.network` (every
   MLP application), :mod:`.chain` (applications of one network, each reading
   the sample the previous one made: a loop);
2. read the step: :mod:`.affine` (one step's update as an affine function of
   the sample, the network's output, a noise draw and the previous step's
   x0), with :mod:`.coefficients` (its coefficients and the algebra that
   proves them equal), :mod:`.plan` (every step of a loop proved, with one
   clamp of x0 and one of the result);
3. build the tables: :mod:`.timesteps` (step-only values as step 0's function
   of its timestep), :mod:`.tables` (the ``(6, S)`` step tables, ``(7, S)``
   with the previous x0's), :mod:`.constants` (under ``torch.compile``, those
   of the module's buffers and constants alone evaluated once, when the graph
   is compiled);
4. emit the call: :mod:`.emit` (the op's arguments, by keyword through
   :mod:`ddpm_ops.calls`), :mod:`.pipeline` (the driver: guards, replacement,
   dead code);
5. report: :mod:`.report` (one INFO line per fused loop, the counts of
   ``ddpm_ops.rewrite_stats()``, graphs served from the FX graph cache too).

:mod:`.nodes` holds the node predicates they share. Every fact is proved on
the graph, or the loop is left exactly as it was with one DEBUG line on
``ddpm_ops.rewrite`` naming the first fact not proved. A step that alone
cannot be fused (its sample kept in a trajectory, an intermediate used
elsewhere) cuts its loop there, and each part is read as a loop of its own;
a network applied once is a loop of one step when it reads a time input
beside the sample.

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
from .pipeline import looks_like_loop, rewrite_graph

__all__ = ["looks_like_loop", "rewrite_graph"]
