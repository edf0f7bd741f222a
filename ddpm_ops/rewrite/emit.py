"""Emitting the call: the arguments of ``ddpm::fused_sample.rule`` for a proved loop.

From a :class:`.plan._Plan`: the step tables (:mod:`.tables`, over the step
indices of per-sample timesteps by :mod:`.timesteps`), the first Linear's
columns of the sample as the op's first weight, its step-only columns as
``time_bias`` and its loop-invariant columns as ``cond_bias`` (or, for one
piece each, the op's time and condition bias networks: the MLP that makes
the piece and its columns, so that the op runs them), the noise draws as one
``(K, B, dim)`` tensor. The call is built by keyword
(:func:`ddpm_ops.calls.op_args`) and vetted by the op's own Meta checks.
"""
from __future__ import annotations

import contextlib
import logging
import math

import torch
from torch.fx import Graph, Node

from ..calls import RULE, arg_slots, bias_net_args, op_args
from ..ops import NOISE_SEED_BOUND
from .affine import _row_wise, _Update
from .chain import _Loop, _mixed_piece
from .coefficients import _Coef, cmul
from .constants import evaluate, fold, real_buffers
from .network import _net_ending_at
from .nodes import _NoMatch, _is, _val, aten, prims
from .plan import _Plan
from .tables import _check_uniform, _Emitter, _first_row, _indexed_tables, _shared_tables, _stack_rows, \
    _step_values
from .timesteps import _find_sites, _lookup_sites, _Reemit

log = logging.getLogger("ddpm_ops.rewrite")


def _emit(graph: Graph, plan: _Plan) -> tuple[Node, _Emitter]:
    loop, updates = plan.loop, plan.updates
    net0, x = loop.nets[0], loop.x(0)
    xv = _val(x)
    batch, dim = xv.shape
    K = len(loop.nets)
    em = _Emitter(graph, plan.end, xv, x)
    _peel_noise_scales(updates, xv.shape)
    try:
        leaves = {leaf for u in updates for leaf in u.leaves}
        step_pieces = [p for p in range(len(loop.pieces[0])) if p != loop.x_pos
                       and not all(step[p] is loop.pieces[0][p] for step in loop.pieces)]
        try:
            _check_uniform(leaves | {step[p] for step in loop.pieces for p in step_pieces}, batch)
        except _NoMatch as shared:
            if plan.scaled:
                # The op's state after step k is the sample scaled for step k + 1: that scale read at
                # t - 1, which no table lookup of the step reads.
                raise _NoMatch(f"{shared}; the network reads the sample scaled ({x.name}), which is read with "
                               "timesteps shared by the batch only") from None
            try:
                reemit = _per_sample(em, loop, updates, step_pieces, shared)
            except _NoMatch as e:  # a piece of the step and a condition, not a sum: say so
                raise _NoMatch(_mixed_piece(loop) or str(e)) from None
            tables = _indexed_tables(em, updates, reemit, batch, plan.dtype)
            t_start = _t_start(em, reemit.sites)
            columns = None  # every step index s the tables hold
        else:
            reemit = _shared_pieces(em, loop, step_pieces)
            tables = _shared_tables(em, updates, plan.dtype)
            t_start = em.full([batch], K - 1, dtype=torch.int64)
            columns = [K - 1 - k for k, u in enumerate(updates) if u.eps_clip is not None]
        _prove_eps_clip(graph, updates, tables, columns, plan.clip)
        if plan.scaled:
            _prove_scales(graph, loop)
        weights, biases, time_bias, cond_bias, time_net, cond_net = _first_layer(em, loop, batch, reemit)
        biases = _zeros_where_missing(em, weights, biases)
        for net in (time_net, cond_net):
            if net:
                net[2] = _zeros_where_missing(em, net[1], net[2])
        noise, noise_seed = _noise(em, updates, K, plan.dtype)
        if noise is not None and plan.out_layout is not None:  # the draws in the order the network reads x
            noise = _relayout(em, em(aten.reshape.default, noise, [-1, *_val(noise).shape[2:]]), loop.feed(0).path)
        if noise is not None and _val(noise).dim() != 3:  # a chunk's draws: rows flattened as x's
            noise = em(aten.reshape.default, noise, [K, batch, dim])
        clip, clip_bounds = _clamp_arg(em, plan.clip, dim, plan.dtype)
        post, post_bounds = _clamp_arg(em, plan.post_clip, dim, plan.dtype)
        clamps = {k: v for k, v in (("clip_bounds", clip_bounds), ("post_clip_bounds", post_bounds)) if v is not None}
        if plan.eps_read_clip is not None:
            clamps["eps_clip"] = list(plan.eps_read_clip)
        zero, x_in = None, x if xv.dtype == plan.dtype else _wide_sample(em, loop, plan.dtype)
        if plan.zero is not None and K > 1:
            zero = em(aten.mul.Tensor, *plan.zero.args)
            x_in = em(aten.add.Tensor, x_in, zero)
        # A network of LayerNorms or residual blocks goes as the op's program (only then: the
        # trailing arguments stay unwritten for the others).
        program = {} if net0.program is None else dict(
            network=list(net0.program), norm_weights=list(net0.norm_weights),
            norm_biases=_zeros_where_missing(em, net0.norm_weights, net0.norm_biases))
        args = op_args(RULE, x=x_in, t_start=t_start, weights=weights, biases=biases, step_tables=tables,
                       num_steps=K, activations=list(net0.activations), time_bias=time_bias,
                       cond_bias=cond_bias, clip=clip, post_clip=post, noise=noise, noise_seed=noise_seed,
                       **bias_net_args("time", time_net or None), **bias_net_args("cond", cond_net or None),
                       **program, **clamps)
        try:
            with _meta_refusals_unlogged():
                fused = em(RULE, *args)
        except RuntimeError as e:  # the op's Meta checks, on the arguments read
            raise _NoMatch(f"the op refuses the arguments read: {e}") from None
        _fold_constants(graph, em, fused)
        end = _val(plan.end)
        if plan.out_layout is not None:  # the op's rows in the sample's order, as the loop lays out e
            fused = _relayout(em, fused, plan.out_layout)
        elif end is not None and end.dim() != 2:  # an action chunk: the op's rows, unflattened
            fused = em(aten.reshape.default, fused, list(end.shape))
        if plan.zero is not None:  # (made here for one step: folding erases what the op does not read)
            fused = em(aten.add.Tensor, fused, zero if zero is not None else em(aten.mul.Tensor, *plan.zero.args))
    except Exception:
        em.rollback()
        raise
    return fused, em


def _prove_eps_clip(graph: Graph, updates: list, tables: Node, columns: list | None, clip) -> None:
    """Where a step's clamp of e is read as its x0 clamp (``affine._UpdateReader._eps_clamp``),
    prove with the tables' values that ``r`` (``1/B``) is positive and ``A``, ``B`` finite at
    every step index ``columns`` (``None``: every index of per-sample tables), and with the
    bounds' values that ``x_min <= x_max``; raise ``_NoMatch`` where that is not so or cannot be
    computed at compile time. With ``r <= 0`` the clamp of e would not be the clamp of x0 to the
    same bounds; with ``x_min > x_max`` eager's clamp of e (its upper bound last) gives x0 =
    x_min where the op's clamp of x0 gives x_max."""
    clamp = next((u.eps_clip for u in updates if u.eps_clip is not None), None)
    if clamp is None:
        return
    what = f"{clamp.name} clamps e to bounds q*x - r*x_bound that depend on the sample (an x0 clamp written on e)"
    buffers = real_buffers(graph)
    value = evaluate(graph, tables, buffers or {})
    if value is None:
        raise _NoMatch(f"{what}, and r > 0, which makes it the clamp of x0, is not proved: its tables are "
                       "not computed from constants and module buffers at compile time")
    a, b = value[0].double(), value[1].double()
    index = torch.arange(a.shape[0]) if columns is None else torch.tensor(columns, dtype=torch.long)
    bad = [int(s) for s in index if not (math.isfinite(a[s]) and math.isfinite(b[s]) and b[s] > 0)]
    if bad:
        s = bad[0]
        raise _NoMatch(f"{what}, and r = 1/B is not positive and finite at step index s = {s} (A = "
                       f"{float(a[s]):.6g}, B = {float(b[s]):.6g}): a negative alpha/sigma turns the clamp of e "
                       "into no clamp of x0")
    lo, hi = (evaluate(graph, v, buffers or {}) if isinstance(v, Node) else torch.tensor(v, dtype=torch.float64)
              for v in clip)
    if lo is None or hi is None:
        raise _NoMatch(f"{what}, and x_min <= x_max is not proved: its bounds are not computed from constants "
                       "and module buffers at compile time")
    if bool(lo.isnan().any() or hi.isnan().any()):
        raise _NoMatch(f"{what} to bounds holding NaN")
    if bool((lo.double() > hi.double()).any()):
        raise _NoMatch(f"{what} to x_min {lo.tolist()} above x_max {hi.tolist()} (eager's clamp of e then "
                       "gives x0 = x_min, the op's clamp of x0 x_max)")


def _prove_scales(graph: Graph, loop: _Loop) -> None:
    """Where the network reads the sample scaled (:func:`.plan._rescale_all`), prove on the
    values at compile time that every factor is finite and nonzero: the op's tables divide by
    them. Raise ``_NoMatch`` where one is not, or cannot be computed then."""
    buffers = real_buffers(graph)
    for k in range(len(loop.nets)):
        for factor, _, _ in loop.feed(k).factors:
            value = evaluate(graph, factor, buffers or {}) if isinstance(factor, Node) \
                else torch.tensor(float(factor))
            if value is None:
                raise _NoMatch(f"the network reads the sample scaled by {factor.name} at step {k}, which is not "
                               "proved finite and nonzero: it is not computed from constants and module buffers "
                               "at compile time")
            if not bool((value.isfinite() & (value != 0)).all()):
                raise _NoMatch(f"the network reads the sample scaled by {getattr(factor, 'name', factor)} at step "
                               f"{k}, which is zero or not finite (the op's state is the scaled sample)")


def _relayout(em: _Emitter, value: Node, path) -> Node:
    """``value`` through the layout ops of ``path`` (:class:`.chain._Feed`'s, or the network
    output's back to the sample's order), its first dimension whatever it is (rows of several
    steps too); scalings and copies are not repeated."""
    for n in path:
        if _is(n, aten.permute.default):
            value = em(aten.permute.default, value, list(n.args[1]))
        elif _is(n, aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            value = em(aten.reshape.default, value, [-1, *_val(n).shape[1:]])
    return value


def _wide_sample(em: _Emitter, loop: _Loop, dtype: torch.dtype) -> Node:
    """The op's ``x`` of a loop whose network reads its sample cast to float32: the sample itself
    (float64, or TabDDPM's first, float32 before its step makes it float64) in the steps'
    ``dtype``, laid out as the network reads it (an action chunk's rows flattened)."""
    return _relayout(em, em.cast(loop.sample(0), dtype), loop.feed(0).path)


def _clamp_arg(em: _Emitter, clip, dim, dtype: torch.dtype) -> tuple[list | None, Node | None]:
    """A clamp read as ``(clip, clip_bounds)``: two floats, or (where a bound is a tensor of one
    value per column, or of one value) the ``(2, dim)`` per-column bounds in ``dtype`` (the
    sample's), a number of the other side filled in."""
    if clip is None:
        return None, None
    if not any(isinstance(b, Node) for b in clip):
        return list(clip), None
    rows = [em.full([dim], b, dtype) if not isinstance(b, Node)
            else em(aten.expand.default, b, [dim]) if _val(b).dim() == 0 else em(aten.reshape.default, b, [dim])
            for b in clip]
    return None, em.cast(em.stack(rows), dtype)


def _zeros_where_missing(em: _Emitter, weights: list, biases: list) -> list:
    """``biases`` (one per Linear or LayerNorm of ``weights``, in order, ``None`` for a layer
    without bias) with zeros for each missing one: the op takes a bias per layer. Zeros of one
    width are one tensor, which ``_fold_constants`` makes a graph constant: no kernel fills it
    per call."""
    zeros: dict = {}
    for w, b in zip(weights, biases):
        if b is None and _val(w).shape[0] not in zeros:
            zeros[_val(w).shape[0]] = em.full([_val(w).shape[0]], 0.0)
    return [zeros[_val(w).shape[0]] if b is None else b for w, b in zip(weights, biases)]


#: The op's arguments that a loop computes from its constants and buffers alone, when it does:
#: the step tables, the shared timesteps, the time embedding's rows, per-column bounds.
_FOLDED = ("t_start", "step_tables", "time_bias", "time_input", "clip_bounds", "post_clip_bounds")
#: The op's lists of tensors that may hold such a value: zeros for a Linear without bias.
_FOLDED_LISTS = ("biases", "time_biases", "cond_biases")


def _fold_constants(graph: Graph, em: _Emitter, fused: Node) -> None:
    """Replace the arguments of ``fused`` that depend on no input that changes by graph
    constants (:mod:`.constants`), and erase the nodes that computed them."""
    buffers = real_buffers(graph)
    if buffers is None:
        return  # not under torch.compile: an exported program keeps its inputs and computes them
    _, slot = arg_slots(RULE)
    args = list(fused.args)
    constants, memo = [], {}

    def folded(value):
        if value not in memo:
            memo[value] = fold(graph, value, buffers, em.fake_mode) if isinstance(value, Node) else None
            constants.extend(memo[value] or ())
        return value if memo[value] is None else memo[value][1]

    for name in _FOLDED:
        if slot[name] < len(args):
            args[slot[name]] = folded(args[slot[name]])
    for name in _FOLDED_LISTS:
        if slot[name] < len(args) and args[slot[name]] is not None:
            args[slot[name]] = [folded(v) for v in args[slot[name]]]
    if not constants:
        return
    fused.args = tuple(args)
    for n in reversed(list(em.inserted)):  # users before what they read
        if n is not fused and not n.users:
            graph.erase_node(n)
            em.inserted.remove(n)
    # A rollback erases in reverse order of insertion: the constants last, after their user.
    em.inserted[:0] = constants


@contextlib.contextmanager
def _meta_refusals_unlogged():
    """Fake tensor mode logs an ERROR traceback when a Meta kernel raises; a refusal of the
    fused op only leaves the loop alone, which its DEBUG line says."""
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    prefix = f"failed while attempting to run meta for {RULE}"

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(prefix)

    fake_log.addFilter(keep)
    try:
        yield
    finally:
        fake_log.removeFilter(keep)


def _per_sample(em: _Emitter, loop: _Loop, updates: list, step_pieces: list, shared: _NoMatch) -> _Reemit:
    """The reader of per-sample timesteps ``t_start - k``, or ``_NoMatch`` naming what is not proved.
    A loop of one step has no second step to compare with: its timestep is the one its table
    lookups read."""
    try:
        values = _step_values(updates)
        for k, step in enumerate(loop.pieces):
            values[k] += [step[p] for p in step_pieces]
        sites = _find_sites(values, len(loop.nets)) if len(loop.nets) > 1 else _lookup_sites(values[0])
    except _NoMatch as e:
        raise _NoMatch(f"{shared}; read as per-sample timesteps: {e}") from None
    if sites.kind != "index":
        raise shared
    reemit = _Reemit(em, sites)
    for v in values[0]:
        reemit.prove(v)
    reemit.size()
    return reemit


def _shared_pieces(em: _Emitter, loop: _Loop, step_pieces: list) -> _Reemit | None:
    """The reader of the step-only pieces over the K step values, where every step computes
    them by one function of its own ``full`` timesteps (else ``None``: their rows are stacked)."""
    if not step_pieces:
        return None
    try:
        sites = _find_sites([[step[p] for p in step_pieces] for step in loop.pieces], len(loop.nets))
        if sites.kind != "full":
            return None
        reemit = _Reemit(em, sites)
        for p in step_pieces:
            reemit.prove(loop.pieces[0][p])
    except _NoMatch as e:
        log.debug("ddpm_ops: rewrite: the step-only inputs of %s are stacked step by step: %s",
                  loop.nets[0].inp.name, e)
        return None
    return reemit


def _t_start(em: _Emitter, sites) -> Node:
    t = sites.root
    if sites.offset:
        t = em(aten.sub.Tensor, t, sites.offset)
    if _val(t).dtype != torch.int64:
        t = em(prims.convert_element_type.default, t, torch.int64)
    return t


def _first_layer(em: _Emitter, loop: _Loop, batch, reemit) -> tuple[list, list, Node | None, Node | None,
                                                                     list, list]:
    """The op's weights (the first one: the columns of x), biases, ``time_bias``, ``cond_bias``
    and the arguments of its time and condition bias networks (four each, or none)."""
    net0 = loop.nets[0]
    w0 = net0.weights[0]
    if len(loop.pieces[0]) == 1:
        return list(net0.weights), list(net0.biases), None, None, [], []
    columns = loop.columns()  # each piece's block of the first Linear's columns; a term's None
    time_pieces, cond_pieces, cols, stacked_net = [], [], None, None
    for p in range(len(loop.pieces[0])):
        piece = loop.pieces[0][p]
        # a term is added as it is; a sum's addends split by chain._split_sums share one block
        w_cols = None if columns[p] is None else em(aten.slice.Tensor, w0, 1, *columns[p])
        if p == loop.x_pos:
            cols = w_cols  # the op reads a view of the first weight's columns as it is: no copy per call
        elif all(step[p] is piece for step in loop.pieces):
            cond_pieces.append((piece, w_cols))
        elif reemit is not None:
            time_pieces.append((piece, w_cols))
        elif w_cols is not None and (net := _same_net_every_step([step[p] for step in loop.pieces])):
            # Every step runs one MLP (a time MLP) on inputs of its own: the op runs the MLP,
            # over the steps' first input rows stacked (constants where the inputs are).
            stacked_net = (p, w_cols, [_stack_rows(em, [_first_row(em, step_net.inp) for step_net in net]),
                                       [*net[0].weights, w_cols], list(net[0].biases),
                                       [*net[0].activations, "identity"]])
        else:
            time_pieces.append((_stack_rows(em, [_first_row(em, step[p]) for step in loop.pieces]), w_cols))
    if stacked_net is not None and time_pieces:  # not alone: its rows like the others'
        p, w_cols, _ = stacked_net
        time_pieces.append((_stack_rows(em, [_first_row(em, step[p]) for step in loop.pieces]), w_cols))
        stacked_net = None
    if stacked_net is not None:
        time_bias, time_net, time_b = None, stacked_net[2], []
    elif reemit is None:
        time_bias, time_net, time_b = _bias_net(em, time_pieces, lambda n: n, lambda n: False)
    else:
        time_bias, time_net, time_b = _bias_net(em, time_pieces, reemit.rows, reemit.depends)
    cond_bias, cond_net, cond_b = _bias_net(em, cond_pieces, lambda n: n, lambda n: False)
    b0 = _sum(em, [b for b in (net0.biases[0], *time_b, *cond_b) if b is not None])
    return [cols, *net0.weights[1:]], [b0, *net0.biases[1:]], time_bias, cond_bias, time_net, cond_net


def _bias_net(em: _Emitter, pieces: list, rows_of, varies) -> tuple[Node | None, list, list]:
    """The op's bias network for ``pieces`` (each a first-layer input and its block of the first
    Linear's columns, or ``None`` for a term added as it is), the bias rows of what it does not
    take, computed in the graph, and the biases it leaves to the first layer's. The network is
    the MLP that makes one piece (its Linears, then the piece's columns; a term's MLP ends at its
    own last Linear, whose bias joins the first layer's) where one does, else the pieces read
    through columns, concatenated, and their columns. ``rows_of`` gives a node's rows (one per
    step index for the time pieces); ``varies`` says whether a node changes with the step."""
    if not pieces:
        return None, [], []
    args, taken, first_biases = [], [], []
    for value, w_cols in pieces:
        net = _net_ending_at(value)
        if net is not None and _fixed_net(net, varies):
            if w_cols is None:
                args = [rows_of(net.inp), list(net.weights), list(net.biases[:-1]), list(net.activations)]
                first_biases = [net.biases[-1]]
            else:
                args = [rows_of(net.inp), [*net.weights, w_cols], list(net.biases),
                        [*net.activations, "identity"]]
            taken = [value]
            break
    else:
        read = [(v, w) for v, w in pieces if w is not None]
        if read:
            args = [_cat(em, [rows_of(v) for v, _ in read]), [_cat(em, [w for _, w in read])], [], []]
            taken = [v for v, _ in read]
    parts = [rows_of(v) if w is None else em(aten.mm.default, rows_of(v), em(aten.permute.default, w, [1, 0]))
             for v, w in pieces if not any(v is t for t in taken)]
    return _sum(em, parts), args, first_biases


def _same_net_every_step(values: list) -> list | None:
    """The MLP application that makes each of ``values`` (one per step), where every step's is
    the same MLP (the same weights, biases and activations) on 2-D inputs; else ``None``."""
    nets = [_net_ending_at(v) for v in values]
    if any(n is None for n in nets) or any(n.key != nets[0].key for n in nets):
        return None
    if not _fixed_net(nets[0], lambda n: False) or any(_val(n.inp).dim() != 2 for n in nets):
        return None
    return nets


def _fixed_net(net, varies) -> bool:
    """Whether the op can take ``net`` as a bias network: float32 weights and 1-D biases (where
    its Linears have them) that do not change with the step, and a 2-D input."""
    iv = _val(net.inp)
    if iv is None or iv.dim() != 2:
        return False
    for t, dims in [(w, 2) for w in net.weights] + [(b, 1) for b in net.biases if b is not None]:
        tv = _val(t)
        if tv is None or tv.dim() != dims or tv.dtype != torch.float32 or tv.device != iv.device or varies(t):
            return False
    return True


def _cat(em: _Emitter, parts: list) -> Node:
    return parts[0] if len(parts) == 1 else em(aten.cat.default, parts, 1)


def _sum(em: _Emitter, parts: list) -> Node | None:
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out = em(aten.add.Tensor, out, p)
    return out


def _is_draw(node) -> bool:
    """A fresh standard normal draw (``randn``, ``randn_like``; inductor's form of either)."""
    return _is(node, prims.inductor_random.default) and node.args[2] == "randn" or \
        _is(node, aten.randn.default) and node.kwargs.get("generator") is None


def _peel_noise_scales(updates: list[_Update], shape) -> None:
    """Where a step adds ``scale * draw`` (Diffusion-QL's ``nonzero_mask * exp(0.5 * logvar)
    * randn_like(x)``), with ``scale`` one number per sample, the scale joins the step's
    ``S`` coefficient and the draw alone is its noise: the op can then draw it (see
    :func:`_noise`). A product that ends in noise given as a tensor stays whole."""
    for u in updates:
        d, scale, leaves = u.noise, [], []
        while d is not None and not _is_draw(d):
            if not (_is(d, aten.mul.Tensor) and len(d.args) == 2 and not d.kwargs):
                d = None
                break
            a, b = d.args
            for inner, factor in ((a, b), (b, a)):
                if isinstance(inner, Node) and tuple(_val(inner).shape) == tuple(shape) and (
                        isinstance(factor, (int, float)) and not isinstance(factor, bool)
                        or isinstance(factor, Node) and _row_wise(_val(factor), shape)):
                    break
            else:
                d = None
                break
            if isinstance(factor, Node):
                scale.append(_Coef("leaf", (factor,)))
                leaves.append(factor)
            else:
                scale.append(_Coef("num", (float(factor),)))
            d = inner
        if d is None or d is u.noise:
            continue
        z = u.post.get("z")
        for c in scale:
            z = cmul(z, c)
        u.post["z"], u.noise = z, d
        u.leaves.update(leaves)


def _noise(em: _Emitter, updates: list[_Update], K: int, dtype: torch.dtype) -> tuple[Node | None, Node | None]:
    """``(noise, noise_seed)``: where every step draws standard normal noise of its own, one
    seed for the call, the op drawing the noise from it (the same distribution; one small
    random op per call instead of a draw of every number); else the steps' noise stacked as
    the op's ``(K, B, dim)`` noise, in ``dtype`` (the sample's)."""
    draws = [u.noise for u in updates]
    present = [d for d in draws if d is not None]
    if not present:
        return None, None
    shape = list(_val(present[0]).shape)
    first = present[0]
    if all(_is_draw(d) for d in present) and len(set(present)) == len(present):
        seed = _inductor_seed(em, present[0])
        if seed is not None:
            return None, seed
        # aten.randint has no inductor lowering: one ATen call, one kernel on CUDA, drawn from
        # the default generator as the loop's own randn was.
        return None, em(aten.randint.low, 0, NOISE_SEED_BOUND, [1], dtype=torch.int64, device=em.device)
    zeros = None
    rows = []
    for d in draws:
        if d is None:
            zeros = zeros or em.full(shape, 0.0, dtype)
            d = zeros
        rows.append(d)
    return em.cast(em.stack(rows), dtype), None




def _inductor_seed(em: _Emitter, draw: Node) -> Node | None:
    """On the CPU, under inductor, the seed of the first replaced draw: inductor draws one seed
    per random op of the graph in one ``randint`` (from the default generator), and this one
    has no other user once the loop is fused. Cut to the op's seed range, it costs the call a
    fused pointwise kernel instead of a ``randint`` of its own (some 6 us at batch 1, with the
    checks inductor puts around a fallback's output). ``None`` where the draw is not inductor's
    (an exported program's ``randn``) or not on the CPU (CUDA keeps its one randint kernel)."""
    seed = draw.args[1] if _is(draw, prims.inductor_random.default) else None
    if em.device.type != "cpu" or not _is(seed, prims.inductor_lookup_seed.default):
        return None
    return em(aten.view.default, em(aten.bitwise_and.Scalar, seed, NOISE_SEED_BOUND - 1), [1])
