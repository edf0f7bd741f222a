"""The automatic rewrite: a user's DDPM sampling loop becomes one ``ddpm::fused_sample``.

After ``import ddpm_ops`` a plain ``torch.compile(model)`` runs the loop of
:func:`ddpm_ops.reference` (any number of steps, any MLP depth and widths, any spelling that
lowers to the same ATen graph) as ONE call of the fused op. The same matcher
rewrites exported programs (:func:`ddpm_ops.fuse_exported_program`).

Where the pass hooks in, and why
--------------------------------
It is installed as inductor's ``post_grad_custom_pre_pass``:

* The post-grad graph is ATen, functionalized and normalized, so the many
  Python spellings of the loop (``[:, None]`` / ``.unsqueeze(1)`` /
  ``.view(-1, 1)``, ``t.float()`` / ``t.to(torch.float32)``, ``nn.Sequential``
  or hand-written helpers with ``F.silu``, ``cat`` on dim 1 or -1) collapse to
  a handful of ATen forms. The pre-grad (Dynamo) graph would show every Python
  spelling separately.
* It is the same vocabulary as a ``torch.export`` graph, so one matcher serves
  both ``torch.compile`` and exported models.
* It runs *before* inductor's own post-grad pattern passes. On CUDA one of them
  splits ``addmm`` into ``mm`` + ``add`` (``unfuse_bias_add_to_pointwise``),
  and another may fuse or reorder; ``post_grad_custom_post_pass`` would see
  the loop differently on CPU and CUDA. The pre-pass sees ``permute`` +
  ``addmm`` on both (the matcher accepts ``mm`` + ``add`` and ``aten.linear``
  as well).
* Post-grad we know whether the graph is an inference graph: the op has no
  backward, so training graphs (grad enabled, parameters that require grad)
  are never rewritten. Where inductor passes ``is_inference`` (torch versions
  with ``CustomInferenceAwareGraphPass``) a training graph is skipped outright;
  on older versions the structural check does it: in a training forward graph
  every step's activations are saved for backward, i.e. used outside the step,
  and a step whose intermediates are used elsewhere is never fused.
  An inference graph that still holds tensors requiring grad while grad mode
  is on (AOTInductor compiling an unfused exported program) is not rewritten
  either: inductor would run the op through its autograd kernel, which refuses.

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
from __future__ import annotations

import hashlib
import logging
import os
import pathlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph, Node

from . import _library  # noqa: F401  (registers ddpm::fused_sample)

try:  # torch >= 2.12 tells inference-aware passes whether the graph is inference
    from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass as _PassBase
    _HAS_INFERENCE_FLAG = True
except ImportError:  # pragma: no cover - older torch
    _PassBase = CustomGraphPass
    _HAS_INFERENCE_FLAG = False

log = logging.getLogger("ddpm_ops.rewrite")

#: Set this environment variable to ``1`` before ``import ddpm_ops`` to keep the
#: pass out of inductor's config.
DISABLE_ENV_VAR = "DDPM_OPS_DISABLE_AUTO_REWRITE"

aten = torch.ops.aten
prims = torch.ops.prims
FUSED_SAMPLE = torch.ops.ddpm.fused_sample.default


class _NoMatch(Exception):
    """Raised inside the matcher with the reason a candidate was left alone."""


# ----------------------------------------------------------------------------- helpers

def get_custom_graph_passes(custom_pass) -> tuple:
    """The passes in a config value: ``None``, one pass, or a list/tuple of them."""
    if custom_pass is None:
        return ()
    if isinstance(custom_pass, (list, tuple)):
        return tuple(custom_pass)
    return (custom_pass,)


def _is(node: Any, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _val(node: Any):
    if not isinstance(node, Node):
        return None
    v = node.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def _known_eq(a, b) -> bool:
    """``a == b`` for ints or SymInts, without adding a guard."""
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true
        return bool(statically_known_true(a == b))
    except Exception:  # pragma: no cover
        return isinstance(a, int) and isinstance(b, int) and a == b


def _shape_eq(shape, expected) -> bool:
    return len(shape) == len(expected) and all(_known_eq(a, b) for a, b in zip(shape, expected))


def _no_kwargs(node: Node, allowed: dict | None = None) -> bool:
    """True when ``node``'s kwargs hold nothing but the given default values."""
    allowed = allowed or {}
    return all(k in allowed and v == allowed[k] for k, v in node.kwargs.items())


def _int_const(a) -> int | None:
    if isinstance(a, bool):
        return None
    if isinstance(a, int):
        return a
    return None


_VIEW_LIKE = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _column_of(node: Any) -> Node:
    """The 1-D ``(B,)`` node that ``node`` reshapes to ``(B, 1)``; else raise."""
    out = _val(node)
    if out is None or out.dim() != 2:
        raise _NoMatch(f"{getattr(node, 'name', node)} is not a (B, 1) column")
    if _is(node, aten.unsqueeze.default):
        src, dim = node.args[0], node.args[1]
        if dim not in (1, -1):
            raise _NoMatch(f"{node.name} unsqueezes dim {dim}, not 1")
    elif _is(node, *_VIEW_LIKE):
        src = node.args[0]
    else:
        raise _NoMatch(f"{getattr(node, 'name', node)} ({getattr(node, 'target', node)}) "
                       "is not a reshape of a 1-D tensor to (B, 1)")
    src = _strip_identity_slices(src)
    sv = _val(src)
    if sv is None or sv.dim() != 1 or not _shape_eq(out.shape, (sv.shape[0], 1)):
        raise _NoMatch(f"{node.name} does not reshape a (B,) tensor to (B, 1)")
    return src


def _strip_identity_slices(node: Any) -> Any:
    """Skip ``x[:]`` (``aten.slice`` over a whole dim), as written by ``t[:, None]``."""
    while _is(node, aten.slice.Tensor):
        src = node.args[0]
        sv, ov = _val(src), _val(node)
        step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
        start = node.args[2] if len(node.args) > 2 else node.kwargs.get("start", None)
        if sv is None or ov is None or step != 1 or start not in (None, 0):
            break
        if not _shape_eq(ov.shape, sv.shape):
            break
        node = src
    return node


def _resolve_t(node: Any) -> tuple[Node, int]:
    """``node`` as ``root - offset`` with an integer constant offset."""
    offset = 0
    while True:
        if _is(node, aten.sub.Tensor) and _no_kwargs(node, {"alpha": 1}):
            c = _int_const(node.args[1])
            if c is None:
                break
            offset += c
            node = node.args[0]
        elif _is(node, aten.add.Tensor) and _no_kwargs(node, {"alpha": 1}):
            c = _int_const(node.args[1])
            if c is None:
                break
            offset -= c
            node = node.args[0]
        else:
            break
    if not isinstance(node, Node):
        raise _NoMatch("the timestep is not a tensor")
    return node, offset


def _table_lookup(col: Node) -> tuple[Node, Node]:
    """``(table, t)`` for ``table[t]``."""
    if _is(col, aten.index.Tensor):
        table, indices = col.args[0], col.args[1]
        if not isinstance(indices, (list, tuple)) or len(indices) != 1:
            raise _NoMatch(f"{col.name} indexes with {indices}, not one timestep tensor")
        return table, indices[0]
    if _is(col, aten.index_select.default) and col.args[1] in (0, -1):
        return col.args[0], col.args[2]
    # table.gather(-1, t), as in the DDPM reference code's extract(); equal to
    # table[t] for a 1-D table and 1-D t
    if _is(col, aten.gather.default) and col.args[1] in (0, -1) and not col.kwargs.get("sparse_grad"):
        tv, iv = _val(col.args[0]), _val(col.args[2])
        if tv is not None and iv is not None and tv.dim() == 1 and iv.dim() == 1:
            return col.args[0], col.args[2]
    raise _NoMatch(f"{col.name} ({col.target}) is not a table lookup table[t]")


def _coefficient(node: Any) -> tuple[Node, Node]:
    """``(table, t)`` for ``table[t]`` reshaped to ``(B, 1)``."""
    return _table_lookup(_column_of(node))


def _linear(node: Any) -> tuple[Node, Node, Node, list[Node]]:
    """``(input, weight, bias, nodes)`` for ``F.linear(input, weight, bias)``.

    Also through inductor's ``pad_mm`` (a joint-graph pass that, on CUDA and
    when it benchmarks faster, zero-pads an ``addmm``'s operands to aligned
    sizes and slices the real block back out): zero rows and columns add
    exact zeros, so the block equals the unpadded Linear.
    """
    slices = []
    while _is(node, aten.slice.Tensor) and _from_start(node):
        slices.append(node)
        node = node.args[0]
    inp, weight, bias, nodes = _unpadded_linear(node)
    # Whatever was peeled off (padding, slices), the result must be exactly
    # input @ weight.T: (rows of input, rows of weight), inner sizes equal.
    out = slices[0] if slices else node
    ov, iv, wv = _val(out), _val(inp), _val(weight)
    if ov is None or iv is None or wv is None or iv.dim() != 2 or wv.dim() != 2 \
            or not _known_eq(iv.shape[1], wv.shape[1]) \
            or not _shape_eq(ov.shape, (iv.shape[0], wv.shape[0])):
        raise _NoMatch(f"{out.name} is not input @ weight.T of the Linear it wraps")
    return inp, weight, bias, slices + nodes


def _from_start(node: Node) -> bool:
    """``x[..., :end]``: an ``aten.slice`` from index 0 with step 1."""
    start = node.args[2] if len(node.args) > 2 else node.kwargs.get("start", 0)
    step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
    return start in (None, 0) and step == 1


def _zero_padded(node: Any, pads: list[Node]) -> Any:
    """``x`` for ``constant_pad_nd(x, pad, 0)`` padding only after each dim (pad_mm's padding).

    Only zero padding: a negative pad crops (``F.pad(h, (0, -1))``), which is
    not the identity on the product."""
    if _is(node, aten.constant_pad_nd.default):
        pad = list(node.args[1])
        value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
        amounts = [_int_const(p) for p in pad]
        if value == 0 and all(a is not None and a >= 0 for a in amounts) \
                and all(a == 0 for a in amounts[0::2]):
            pads.append(node)
            return node.args[0]
    return node


def _zero_extended_bias(node: Any, pads: list[Node]) -> Any:
    """``b`` for ``cat([b, zeros])`` (pad_mm's padding of a 1-D bias)."""
    if _is(node, aten.cat.default) and len(node.args[0]) == 2 \
            and (node.args[1] if len(node.args) > 1 else 0) in (0, -1):
        bias, zeros = node.args[0]
        if _is(zeros, aten.full.default) and zeros.args[1] == 0 and _val(bias) is not None \
                and _val(bias).dim() == 1:
            pads.extend([node, zeros])
            return bias
    return node


def _unpadded_linear(node: Any) -> tuple[Node, Node, Node, list[Node]]:
    if _is(node, aten.linear.default):
        if len(node.args) < 3 or node.args[2] is None:
            raise _NoMatch(f"{node.name} is a Linear without bias")
        return node.args[0], node.args[1], node.args[2], [node]
    if _is(node, aten.addmm.default) and _no_kwargs(node, {"beta": 1, "alpha": 1}):
        pads: list[Node] = []
        bias = _zero_extended_bias(node.args[0], pads)
        inp = _zero_padded(node.args[1], pads)
        wt = _zero_padded(node.args[2], pads)
        return inp, _transposed(wt), bias, [node, *pads]
    if _is(node, aten.add.Tensor) and _no_kwargs(node, {"alpha": 1}):
        for mm, bias in (node.args[:2], node.args[1::-1]):
            if _is(mm, aten.mm.default) and isinstance(bias, Node):
                bv = _val(bias)
                if bv is not None and bv.dim() == 1:
                    return mm.args[0], _transposed(mm.args[1]), bias, [node, mm]
        # inductor's CPU decomposition of a one-row addmm with small weights
        # (batch 1): 1 * (input.T * weight.T).sum(0, keepdim=True) + 1 * bias
        for prod, bias in (node.args[:2], node.args[1::-1]):
            prod, bias = _times_one(prod), _times_one(bias)
            if _is(prod, aten.sum.dim_IntList) and list(prod.args[1]) == [0] \
                    and (prod.args[2] if len(prod.args) > 2 else prod.kwargs.get("keepdim")) is True \
                    and _is(prod.args[0], aten.mul.Tensor) and isinstance(bias, Node):
                bv = _val(bias)
                if bv is None or bv.dim() != 1:
                    continue
                mul = prod.args[0]
                for it, wt in (mul.args[:2], mul.args[1::-1]):
                    try:
                        inp, weight = _transposed(it), _transposed(wt)
                    except _NoMatch:
                        continue
                    iv, wv = _val(inp), _val(weight)
                    # One row only: with more, `*` would multiply elementwise, not as a product.
                    if iv is None or wv is None or iv.dim() != 2 or wv.dim() != 2 \
                            or not _known_eq(iv.shape[0], 1) \
                            or not _known_eq(wv.shape[0], bv.shape[0]) \
                            or not _known_eq(iv.shape[1], wv.shape[1]):
                        continue
                    ones = [n for n in node.args[:2] if n is not prod and n is not bias]
                    return inp, weight, bias, [node, prod, mul, it, *ones]
    raise _NoMatch(f"{getattr(node, 'name', node)} ({getattr(node, 'target', node)}) is not a Linear")


def _times_one(node: Any) -> Any:
    """``a`` for ``a * 1`` (the ``alpha``/``beta`` factors of a decomposed addmm)."""
    if _is(node, aten.mul.Tensor) and len(node.args) == 2 and node.args[1] == 1 \
            and not isinstance(node.args[1], bool):
        return node.args[0]
    return node


def _transposed(node: Any) -> Node:
    if _is(node, aten.permute.default) and list(node.args[1]) in ([1, 0], [-1, -2], [-1, 0], [1, -2]):
        return node.args[0]
    if _is(node, aten.t.default):
        return node.args[0]
    if _is(node, aten.transpose.int) and sorted(int(d) % 2 for d in node.args[1:3]) == [0, 1]:
        return node.args[0]
    raise _NoMatch(f"{getattr(node, 'name', node)} is not the transpose of a Linear weight")


def _silu(node: Any) -> tuple[Node, list[Node]]:
    """``(z, nodes)`` for ``SiLU(z)`` in any of its ATen spellings; else raise."""
    if _is(node, aten.silu.default):
        return node.args[0], [node]
    if _is(node, aten.mul.Tensor):
        a, b = node.args[:2]
        for z, s in ((a, b), (b, a)):
            if _is(s, aten.sigmoid.default) and s.args[0] is z:
                return z, [node, s]
    if _is(node, aten.div.Tensor):
        z, den = node.args[:2]
        if _is(den, aten.add.Tensor) and _no_kwargs(den, {"alpha": 1}):
            for e, one in (den.args[:2], den.args[1::-1]):
                if one == 1 and _is(e, aten.exp.default) and _is(e.args[0], aten.neg.default) \
                        and e.args[0].args[0] is z:
                    return z, [node, den, e, e.args[0]]
    name = getattr(node, "target", node)
    raise _NoMatch(f"activation {getattr(node, 'name', node)} ({name}) is not SiLU")


def _float32_cast_source(node: Any) -> Any:
    """``t`` for ``t.float()`` / ``t.to(torch.float32)`` (any ATen spelling), else None."""
    if _is(node, prims.convert_element_type.default):
        ok = node.args[1] == torch.float32
    elif _is(node, aten._to_copy.default):
        ok = node.kwargs.get("dtype") == torch.float32 and set(node.kwargs) <= {"dtype", "device", "layout"}
        ok = ok and len(node.args) == 1
    elif _is(node, aten.to.dtype):
        ok = len(node.args) >= 2 and node.args[1] == torch.float32 and not any(node.args[2:]) \
            and not any(node.kwargs.values())
    else:
        ok = False
    return node.args[0] if ok else None


def _time_column(node: Any) -> tuple[Node, int]:
    """``(t, T)`` for the ``(B, 1)`` time column ``t.float() / T``: reshaped
    after the division or before it (``t[:, None].float() / T``,
    ``t.float()[:, None] / T``); ``t / T`` (true division of the int
    timesteps, which promotes to float32 first) in either place as well."""
    nv = _val(node)
    reshaped_first = _is(node, aten.div.Tensor, aten.div.Scalar) and nv is not None and nv.dim() == 2
    q = node if reshaped_first else _column_of(node)
    if not (_is(q, aten.div.Tensor, aten.div.Scalar) and len(q.args) == 2 and not q.kwargs):
        raise _NoMatch(f"the time column {q.name} is not t.float() / T")
    f, T = q.args
    if isinstance(T, bool) or not isinstance(T, (int, float)) or T <= 0 or int(T) != T:
        raise _NoMatch(f"the time column divides by {T!r}, not a positive integer T")
    t = _float32_cast_source(f)
    cast = t is not None
    if not cast:
        t = f
    if reshaped_first:
        t = _column_of(t)
        if not cast:
            inner = _float32_cast_source(t)
            cast = inner is not None
            t = inner if cast else t
    tv, qv = _val(t), _val(q)
    if not cast and (qv is None or qv.dtype != torch.float32):
        raise _NoMatch(f"the time column {q.name} is not t.float() / T")
    if tv is None or tv.dim() != 1 or tv.dtype not in (torch.int32, torch.int64):
        raise _NoMatch("the timestep is not a 1-D int32/int64 tensor")
    return t, int(T)


# ----------------------------------------------------------------------------- one step

@dataclass
class _Step:
    out: Node
    x_in: Node
    t_node: Node
    t_root: Node
    t_offset: int
    weights: tuple
    biases: tuple
    sqrt_recip_alphas: Node
    coef_eps: Node
    total_timesteps: int
    nodes: set = field(default_factory=set)   # x-dependent nodes of the step, out included
    entry: set = field(default_factory=set)   # the step's nodes that read x_in

    def same_params(self, other: _Step) -> bool:
        return (self.weights == other.weights and self.biases == other.biases
                and self.sqrt_recip_alphas is other.sqrt_recip_alphas
                and self.coef_eps is other.coef_eps
                and self.total_timesteps == other.total_timesteps
                and self.t_root is other.t_root)


def _match_step(out: Node) -> _Step:
    """Prove that ``out`` is one DDPM step of the reference loop, or raise ``_NoMatch``."""
    if not _is(out, aten.mul.Tensor) or len(out.args) != 2:
        raise _NoMatch("not a mul")
    # x_out = c1 * (x - c2 * eps), either operand order
    for c1, diff in (out.args, out.args[::-1]):
        if _is(diff, aten.sub.Tensor) and _no_kwargs(diff, {"alpha": 1}):
            break
    else:
        raise _NoMatch("not c1 * (x - ...)")
    x_in, scaled = diff.args[:2]
    if not _is(scaled, aten.mul.Tensor):
        raise _NoMatch("not c1 * (x - c2 * eps)")
    errors = []
    for c2, eps in (scaled.args[:2], scaled.args[1::-1]):
        try:
            table_b, t_b = _coefficient(c2)
            break
        except _NoMatch as e:
            errors.append(str(e))
    else:
        raise _NoMatch(f"c2 is not a table lookup: {errors[0]}")
    try:
        table_a, t_a = _coefficient(c1)
    except _NoMatch as e:
        raise _NoMatch(f"c1 is not a table lookup: {e}") from None

    # the looks of a DDPM step are established; from here on reasons are worth logging
    nodes = {out, diff, scaled}
    weights, biases = [], []
    cur = eps
    while True:
        inp, w, b, lin_nodes = _linear(cur)
        nodes.update(lin_nodes)
        weights.insert(0, w)
        biases.insert(0, b)
        if _is(inp, aten.cat.default):
            cat = inp
            break
        z, act_nodes = _silu(inp)
        nodes.update(act_nodes)
        cur = z
    nodes.add(cat)
    tensors = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if dim not in (1, -1) or len(tensors) != 2:
        raise _NoMatch(f"{cat.name} is not cat([x, t_col], dim=1)")
    if tensors[0] is not x_in:
        raise _NoMatch(f"{cat.name} does not put the x of the update first")
    t_c, T = _time_column(tensors[1])

    # one timestep for the column and both lookups
    ra, rb, rc = _resolve_t(t_a), _resolve_t(t_b), _resolve_t(t_c)
    if not (ra[0] is rb[0] is rc[0] and ra[1] == rb[1] == rc[1]):
        raise _NoMatch("the time column and the two table lookups use different timesteps")

    # dtypes, shapes, one device
    xv, ov, tv = _val(x_in), _val(out), _val(t_a)
    if xv is None or ov is None or tv is None:
        raise _NoMatch("missing tensor metadata")
    if xv.dtype != torch.float32 or ov.dtype != torch.float32:
        raise _NoMatch(f"x is {xv.dtype}, the op computes float32 only")
    if xv.dim() != 2 or tv.dim() != 1 or not _known_eq(tv.shape[0], xv.shape[0]):
        raise _NoMatch("x is not (B, dim) or t is not (B,)")
    if not _shape_eq(ov.shape, xv.shape):
        raise _NoMatch("the update broadcasts x to another shape")
    if tv.dtype not in (torch.int32, torch.int64):
        raise _NoMatch(f"the timestep is {tv.dtype}, not int32/int64")
    dev = xv.device
    params = [*weights, *biases, table_a, table_b]
    for p in params:
        pv = _val(p)
        if pv is None or pv.dtype != torch.float32 or pv.device != dev:
            raise _NoMatch(f"{getattr(p, 'name', p)} is not a float32 tensor on {dev}")
    if tv.device != dev:
        raise _NoMatch(f"the timestep is on {tv.device}, x on {dev}")
    ta, tb = _val(table_a), _val(table_b)
    if ta.dim() != 1 or tb.dim() != 1 or not _known_eq(ta.shape[0], tb.shape[0]):
        raise _NoMatch("the coefficient tables are not 1-D of equal length")
    features = _val(x_in).shape[1]
    fan_in = features + 1
    for layer, (w, b) in enumerate(zip(weights, biases)):
        wv, bv = _val(w), _val(b)
        if wv.dim() != 2 or bv.dim() != 1 or not _known_eq(wv.shape[1], fan_in) \
                or not _known_eq(bv.shape[0], wv.shape[0]):
            raise _NoMatch(f"layer {layer}: weight {tuple(wv.shape)} / bias {tuple(bv.shape)} "
                           "do not chain")
        fan_in = wv.shape[0]
    if not _known_eq(fan_in, features):
        raise _NoMatch("the MLP does not output dim features")

    # nothing inside the step may be used outside it
    for n in nodes:
        if n is out:
            continue
        outside = [u.name for u in n.users if u not in nodes]
        if outside:
            raise _NoMatch(f"intermediate {n.name} is also used by {outside}")

    return _Step(out=out, x_in=x_in, t_node=t_a, t_root=ra[0], t_offset=ra[1],
                 weights=tuple(weights), biases=tuple(biases), sqrt_recip_alphas=table_a,
                 coef_eps=table_b, total_timesteps=T, nodes=nodes, entry={cat, diff})


# ----------------------------------------------------------------------------- the rewrite

def _mutates(node: Node) -> bool:
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema is not None and schema.is_mutable


def _looks_like_update(node: Node) -> bool:
    """Cheap filter: ``a * (b - c * d)`` in either order."""
    if not _is(node, aten.mul.Tensor) or len(node.args) != 2:
        return False
    return any(_is(a, aten.sub.Tensor) and _is(a.args[1], aten.mul.Tensor) for a in node.args)


def _build_runs(steps: list[_Step]) -> list[list[_Step]]:
    by_input: dict[Node, list[_Step]] = {}
    for s in steps:
        by_input.setdefault(s.x_in, []).append(s)
    successor: dict[int, _Step] = {}
    has_pred: set[int] = set()
    for s in steps:
        for nxt in by_input.get(s.out, []):
            if not nxt.same_params(s):
                log.debug("ddpm_ops: step %s and step %s not merged: different weights, tables, "
                          "T or timestep root", s.out.name, nxt.out.name)
                continue
            if nxt.t_offset != s.t_offset + 1:
                log.debug("ddpm_ops: step %s and step %s not merged: timesteps t-%d then t-%d "
                          "are not consecutive", s.out.name, nxt.out.name, s.t_offset, nxt.t_offset)
                continue
            if set(s.out.users) != nxt.entry:
                log.debug("ddpm_ops: run ends at %s: its x is also used by %s", s.out.name,
                          [u.name for u in s.out.users if u not in nxt.entry])
                continue
            successor[id(s)] = nxt
            has_pred.add(id(nxt))
    runs = []
    for s in steps:
        if id(s) in has_pred:
            continue
        run = [s]
        while id(run[-1]) in successor:
            run.append(successor[id(run[-1])])
        runs.append(run)
    return runs


def _fake_value(target, args):
    vals = torch.fx.node.map_arg(args, lambda n: n.meta.get("val"))
    flat = [v for v in torch.utils._pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)]
    fake_mode = torch._guards.detect_fake_mode(flat)
    if fake_mode is None:
        return None
    with fake_mode, torch.no_grad():  # the op is inference-only; shapes are all we need
        return target(*vals)


def _op_or_none(packet: str, overload: str):
    try:
        return getattr(getattr(aten, packet), overload)
    except (AttributeError, RuntimeError):  # pragma: no cover - older torch
        return None


# torch.export's check of a tensor's dtype/device (only checks a node we drop)
_ASSERT_METADATA = _op_or_none("_assert_tensor_metadata", "default")


def _dead_after_replacing(out: Node, kept: set[Node]) -> set[Node]:
    """The nodes left unused once ``out``'s users read another node that reads
    ``kept``: ``out`` and what only it needed, with the ``torch.export``
    metadata checks on them."""
    dead: set[Node] = set()
    work = [out]
    while work:
        n = work.pop()
        if n in dead or n in kept or n.op != "call_function" or n.is_impure():
            continue
        live = [u for u in n.users if u not in dead and not _is(u, _ASSERT_METADATA)]
        if n is not out and live:
            continue
        dead.add(n)
        dead.update(u for u in n.users if _is(u, _ASSERT_METADATA))
        work.extend(n.all_input_nodes)
    return dead


def _remove_dead(graph: Graph, out: Node) -> None:
    """Erase ``out`` (its users moved away) and every node only it needed."""
    dead = _dead_after_replacing(out, set())
    for n in reversed(list(graph.nodes)):  # users before what they read
        if n in dead:
            graph.erase_node(n)


def _requires_grad(node: Any) -> bool:
    """Whether the tensor ``node`` stands for requires grad (a graph input's
    example value, or a module attribute the graph reads)."""
    if not isinstance(node, Node):
        return False
    if node.op == "get_attr":  # its example value may be a detached fake copy
        value = node.graph.owning_module
        for part in str(node.target).split("."):
            value = getattr(value, part, None)
        return isinstance(value, torch.Tensor) and value.requires_grad
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.requires_grad


def rewrite_graph(graph: Graph, *, protected: frozenset[str] = frozenset(),
                  renamed: dict[str, str] | None = None, grad_inputs_ok: bool = True) -> int:
    """Replace every DDPM sampling run in ``graph`` by one ``ddpm::fused_sample``.

    Returns the number of fused ops emitted. Graphs with nothing it fully
    understands are left untouched. A run is also left alone when it would
    erase a node named in ``protected`` (other than its output, which is then
    reported in ``renamed`` as old name -> the fused op's name), or, with
    ``grad_inputs_ok=False`` and grad mode on, when one of the op's inputs
    requires grad (the op has no backward; inductor would call it that way).
    """
    steps = []
    for node in graph.nodes:
        if not _looks_like_update(node):
            continue
        try:
            steps.append(_match_step(node))
        except _NoMatch as e:
            log.debug("ddpm_ops: left %s alone: %s", node.name, e)
    if not steps:
        return 0
    emitted = 0
    replaced: dict[Node, Node] = {}  # the output of an earlier run -> its fused op
    position = {n: i for i, n in enumerate(graph.nodes)}
    mutations = [position[n] for n in graph.nodes if _mutates(n)]
    for run in _build_runs(steps):
        first, last = run[0], run[-1]
        # The op reads its inputs where it is inserted (at the run's end); an
        # in-place op inside the run (torch.export's default IR keeps them)
        # could change an input between the steps' reads and that point.
        start = min(position[n] for s in run for n in (*s.nodes, s.t_node) if n in position)
        if any(start < m < position[last.out] for m in mutations):
            log.debug("ddpm_ops: run ending at %s left alone: an in-place op runs inside it",
                      last.out.name)
            continue
        x_first = replaced.get(first.x_in, first.x_in)
        t_arg = first.t_root if first.t_offset == 0 else first.t_node
        args = (x_first, t_arg, list(first.weights), list(first.biases),
                first.sqrt_recip_alphas, first.coef_eps, len(run), first.total_timesteps)
        tensors = [x_first, *first.weights, *first.biases, first.sqrt_recip_alphas, first.coef_eps]
        if not grad_inputs_ok and torch.is_grad_enabled():
            needing = [n.name for n in tensors if _requires_grad(n)]
            if needing:
                log.debug("ddpm_ops: run ending at %s left alone: grad mode is on and %s "
                          "require grad (the op has no backward)", last.out.name, needing)
                continue
        if protected:
            erased = _dead_after_replacing(last.out, {t_arg, *tensors}) - {last.out}
            kept_names = sorted(n.name for n in erased if n.name in protected)
            if kept_names:
                log.debug("ddpm_ops: run ending at %s left alone: it would erase %s, which a "
                          "preserved module call signature names", last.out.name, kept_names)
                continue
        with graph.inserting_before(last.out):
            fused = graph.call_function(FUSED_SAMPLE, args)
        try:
            val = _fake_value(FUSED_SAMPLE, args)
        except Exception as e:  # the op's own checks refuse: leave the graph as it was
            graph.erase_node(fused)
            log.debug("ddpm_ops: run at %s left alone: the op refuses its arguments: %s",
                      last.out.name, e)
            continue
        if val is not None:
            fused.meta["val"] = val
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack", "seq_nr"):
            if key in last.out.meta:
                fused.meta[key] = last.out.meta[key]
        last.out.replace_all_uses_with(fused)
        replaced[last.out] = fused
        if renamed is not None:
            renamed[last.out.name] = fused.name
        _remove_dead(graph, last.out)
        emitted += 1
        xv = _val(x_first)
        widths = [tuple(_val(w).shape) for w in first.weights]
        log.info("ddpm_ops: fused %d DDPM steps into one ddpm::fused_sample "
                 "(batch shape %s, %d layers with weights %s, T=%d)", len(run),
                 tuple(xv.shape), len(widths), widths, first.total_timesteps)
    if emitted:
        graph.lint()
    return emitted


# ----------------------------------------------------------------------------- the inductor pass

_SOURCE_FILES = (pathlib.Path(__file__),)
_enabled = os.environ.get(DISABLE_ENV_VAR, "0") in ("", "0")


def _source_hash() -> str:
    h = hashlib.sha256()
    for p in _SOURCE_FILES:
        h.update(p.read_bytes())
    return h.hexdigest()


class DDPMSamplingRewrite(_PassBase):
    """Inductor ``post_grad_custom_pre_pass`` that fuses DDPM sampling loops.

    ``chained`` holds the custom pass(es) that were configured before this one
    was installed; they run first, then this rewrite. ``uuid()`` covers this
    file's source, the on/off switch and the chained passes' uuids (``None``,
    i.e. no caching, if one of them has none: the safe answer).
    """

    _is_ddpm_ops_rewrite = True

    def __init__(self, chained=None):
        self.chained = chained

    def __call__(self, graph: Graph, is_inference: bool | None = None) -> None:
        for p in get_custom_graph_passes(self.chained):
            if _HAS_INFERENCE_FLAG and isinstance(p, _PassBase):
                p(graph, is_inference=is_inference)
            else:
                p(graph)
        if not _enabled:
            return
        if is_inference is False:
            if any(_looks_like_update(n) for n in graph.nodes):
                log.debug("ddpm_ops: training graph left alone (the op has no backward)")
            return
        # An inference graph can still hold tensors that require grad (AOTInductor
        # compiling an exported program under grad mode); inductor would then call
        # the op through its autograd kernel, which refuses.
        rewrite_graph(graph, grad_inputs_ok=False)

    def uuid(self) -> Any:
        chained = []
        for p in get_custom_graph_passes(self.chained):
            u = p.uuid() if isinstance(p, CustomGraphPass) else None
            if not u:  # inductor's own test: no (or an empty) uuid means no caching
                return None
            chained.append(u)
        return ("ddpm_ops.DDPMSamplingRewrite", _source_hash(), _enabled, tuple(chained))


def _config():
    from torch._inductor import config
    return config


_PASS_OPTION = "post_grad_custom_pre_pass"


def _is_ours(p: Any) -> bool:
    # A class attribute, not isinstance: after importlib.reload the installed
    # instance belongs to the old class object.
    return getattr(type(p), "_is_ddpm_ops_rewrite", False)


def _contains_ours(value: Any) -> bool:
    return _is_ours(value) or (isinstance(value, (list, tuple)) and any(_is_ours(p) for p in value))


def _with_ours(value: Any) -> Any:
    return value if _contains_ours(value) else DDPMSamplingRewrite(chained=value)


def _without_ours(value: Any) -> Any:
    if _is_ours(value):
        return value.chained
    if isinstance(value, (list, tuple)):
        kept = [p for p in value if not _is_ours(p)]
        return type(value)(kept) if kept else None
    return value


def _option_entry(config) -> Any:
    """The config module's record of the option, where it has one with a
    ``default`` (torch versions whose assigned values are per thread)."""
    entries = getattr(config, "_config", None)
    entry = entries.get(_PASS_OPTION) if isinstance(entries, dict) else None
    return entry if hasattr(entry, "default") else None


def install() -> None:
    """Put the rewrite into ``torch._inductor.config.post_grad_custom_pre_pass``.

    Idempotent; a pass the user already set is kept and chained (it runs first).
    torch keeps a value assigned to inductor's config per thread, so the
    rewrite also becomes the option's default: threads other than the
    importing one (a server's workers) compile with it too.
    """
    config = _config()
    entry = _option_entry(config)
    if entry is not None:
        entry.default = _with_ours(entry.default)
    setattr(config, _PASS_OPTION, _with_ours(getattr(config, _PASS_OPTION)))


def uninstall() -> None:
    """Take the rewrite out of inductor's config, restoring what it chained."""
    config = _config()
    entry = _option_entry(config)
    if entry is not None:
        entry.default = _without_ours(entry.default)
    setattr(config, _PASS_OPTION, _without_ours(getattr(config, _PASS_OPTION)))


def enable_auto_rewrite() -> None:
    """Turn the automatic rewrite under ``torch.compile`` on (the default after import)."""
    global _enabled
    _enabled = True
    install()


def disable_auto_rewrite() -> None:
    """Turn the automatic rewrite off for later compilations.

    Removes the pass from inductor's config (a pass it chained is put back), so
    the FX graph cache key changes and cached rewritten graphs are not reused.
    Also settable before import with ``DDPM_OPS_DISABLE_AUTO_REWRITE=1``.
    """
    global _enabled
    _enabled = False
    uninstall()


def auto_rewrite_enabled() -> bool:
    """Whether ``torch.compile`` (in this thread) will fuse DDPM sampling loops."""
    return _enabled and _contains_ours(getattr(_config(), _PASS_OPTION))
