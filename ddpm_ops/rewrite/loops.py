"""The general reading of sampling loops: any MLP, any affine update, as ``ddpm::fused_sample.rule``.

A loop is found as applications of one network, each reading the sample the
previous step made (:mod:`.chain`). Each step is proved to be

    h = first Linear of [x, step-only pieces, loop-invariant pieces]
    e = the rest of the network (one activation per layer)
    x_{k+1} = clamp(C*clamp(A*x - B*e) + D*x + E*e + S*z)   (:mod:`.affine`)

with coefficients and pieces that depend on the step only, or on nothing
that changes over the loop. The step-only values become tables
(:mod:`.tables`), the first Linear's step-only columns ``time_bias``, its
loop-invariant columns ``cond_bias`` (or, for one piece each, the op's time
and condition bias networks: the MLP that makes the piece and its columns,
so that the op runs them), the noise draws one ``(K, B, dim)`` tensor.
Anything not proved is left alone with one DEBUG line.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from .affine import _read_update, _Update
from .chain import _ancestors_within, _latest_step, _Loop, _loops, _step_region
from .network import _find_nets, _net_ending_at
from .._library import has_fused_rule_kernel
from .patterns import _float32_cast_source, _NoMatch, _is, _known_eq, _val, aten, prims
from .report import count as _count, fused as _report_fused
from .tables import (_check_uniform, _Emitter, _first_row, _indexed_tables, _shared_tables, _stack_rows,
                     _step_values)
from .timesteps import _find_sites, _recomputed, _Reemit

log = logging.getLogger("ddpm_ops.rewrite")

RULE = torch.ops.ddpm.fused_sample.rule


@dataclass
class _Plan:
    loop: _Loop
    updates: list
    end: Node
    clip: tuple | None
    post_clip: tuple | None


def _loops_in(graph: Graph) -> tuple[list[_Loop], dict, list[str]]:
    nets = _find_nets(graph)
    groups: dict[tuple, list] = {}
    for net in nets:
        groups.setdefault(net.key, []).append(net)
    order = {n: i for i, n in enumerate(graph.nodes)}
    found, reasons, latest_of = [], [], {}
    for group in groups.values():
        group.sort(key=lambda n: order[n.out])
        if len(group) < 2:
            continue
        latest = _latest_step(graph, group)
        loops, why = _loops(group, latest)
        reasons.extend(why)
        for loop in loops:
            latest_of[id(loop)] = latest
        found.extend(loops)
    return found, latest_of, reasons


def _plan(loop: _Loop, latest: dict, position: dict) -> _Plan:
    """Prove every step of ``loop``; raise ``_NoMatch`` with the first fact not proved."""
    x0v = _val(loop.x(0))
    if x0v is None or x0v.dim() != 2:
        raise _NoMatch("the sample is not (batch, dim)")
    if x0v.dtype != torch.float32:
        raise _NoMatch(f"the sample is {x0v.dtype}; the op computes float32 only")
    if not has_fused_rule_kernel(x0v.device):
        # Elsewhere the op runs its ATen loop, which is slower than inductor's code for the loop.
        raise _NoMatch(f"ddpm::fused_sample.rule has no fused kernel on {x0v.device.type}")
    out = loop.nets[0].out
    ev = _val(out)
    if ev is None or tuple(ev.shape) != tuple(x0v.shape):
        # A network ends at a Linear that no known activation leads on from to another Linear:
        # what reads it is then usually the op that broke the network in two.
        readers = sorted({str(u.target) for u in out.users})
        shape = "unknown" if ev is None else tuple(ev.shape)
        raise _NoMatch(f"the network's output {out.name} (shape {shape}) is not shaped like the "
                       f"sample {tuple(x0v.shape)}; the network ends there because {readers} "
                       "reading it is not an activation the reader knows followed by a Linear")
    for p in (*loop.nets[0].weights, *loop.nets[0].biases):
        pv = _val(p)
        if pv is None or pv.dtype != torch.float32 or pv.device != x0v.device:
            raise _NoMatch(f"{p.name} is not a float32 tensor on the sample's device")

    for k in range(1, len(loop.nets)):
        source = _float32_cast_source(loop.x(k))
        if source is not None and _val(source) is not None and _val(source).dtype != torch.float32:
            raise _NoMatch(f"the sample is {_val(source).dtype} between the networks (step {k} casts "
                           f"{source.name} to float32 for its network); the op computes float32 only")

    # A piece every step recomputes alike from the same inputs (TabDDPM adds its label's
    # embedding in each call of the network) is one loop-invariant value: step 0's.
    for p, first in enumerate(loop.pieces[0]):
        if p != loop.x_pos and all(step[p] is first or _recomputed(step[p], first) for step in loop.pieces):
            for step in loop.pieces:
                step[p] = first

    def step_only(n):
        return latest.get(n, -1) == -1

    updates, end = [], None
    K = len(loop.nets)

    def read(k, end, inside):
        return _read_update(loop.x(k), loop.nets[k].out, end, inside, tuple(x0v.shape), step_only)

    def choose(ends, region):  # the last step ends where it reads like the one before
        for candidate in ends:
            inside = _ancestors_within(candidate, region) | {candidate}
            try:
                if read(K - 1, candidate, inside).post_clip == updates[-1].post_clip:
                    return candidate
            except _NoMatch:
                continue
        return ends[0]

    for k in range(K):
        try:
            end, inside = _step_region(loop, k, position, choose)
            updates.append(read(k, end, inside))
        except _NoMatch as e:
            raise _NoMatch(f"step {k}: {e}") from None
    clips = {u.clip for u in updates if u.pre is not None}
    posts = {u.post_clip for u in updates}
    if len(clips) > 1 or (clips and any(u.pre is None and u.post.get("x0") for u in updates)):
        raise _NoMatch(f"the steps clamp x0 to different bounds {sorted(map(str, clips))}")
    if len(posts) > 1:
        raise _NoMatch(f"the steps clamp their result to different bounds {sorted(map(str, posts))}")
    return _Plan(loop, updates, end, next(iter(clips), None), next(iter(posts)))


def _emit(graph: Graph, plan: _Plan) -> tuple[Node, _Emitter]:
    loop, updates = plan.loop, plan.updates
    net0, x = loop.nets[0], loop.x(0)
    xv = _val(x)
    batch, dim = xv.shape
    K = len(loop.nets)
    em = _Emitter(graph, plan.end, xv, x)
    try:
        leaves = {leaf for u in updates for leaf in u.leaves}
        step_pieces = [p for p in range(len(loop.pieces[0])) if p != loop.x_pos
                       and not all(step[p] is loop.pieces[0][p] for step in loop.pieces)]
        try:
            _check_uniform(leaves | {step[p] for step in loop.pieces for p in step_pieces}, batch)
        except _NoMatch as shared:
            reemit = _per_sample(em, loop, updates, step_pieces, shared)
            tables = _indexed_tables(em, updates, reemit, batch)
            t_start = _t_start(em, reemit.sites)
        else:
            reemit = _shared_pieces(em, loop, step_pieces)
            tables = _shared_tables(em, updates)
            t_start = em.full([batch], K - 1, dtype=torch.int64)
        weights, biases, time_bias, cond_bias, time_net, cond_net = _first_layer(em, loop, batch, reemit)
        noise = _noise(em, updates, K)
        clip = None if plan.clip is None else list(plan.clip)
        post = None if plan.post_clip is None else list(plan.post_clip)
        nets = [None, *(time_net or [None] * 4), *cond_net]  # noise_seed, then the bias networks
        while nets and nets[-1] is None:
            nets.pop()
        try:
            with _meta_refusals_unlogged():
                fused = em(RULE, x, t_start, weights, biases, tables, K, list(net0.activations),
                           time_bias, cond_bias, clip, post, noise, False, False, "fp32", *nets)
        except RuntimeError as e:  # the op's Meta checks, on the arguments read
            raise _NoMatch(f"the op refuses the arguments read: {e}") from None
    except Exception:
        em.rollback()
        raise
    return fused, em


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
    """The reader of per-sample timesteps ``t_start - k``, or ``_NoMatch`` naming what is not proved."""
    try:
        values = _step_values(updates)
        for k, step in enumerate(loop.pieces):
            values[k] += [step[p] for p in step_pieces]
        sites = _find_sites(values, len(loop.nets))
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
        log.debug("ddpm_ops: general reader: the step-only inputs of %s are stacked step by step: %s",
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
    read = len(loop.pieces[0]) - len(net0.terms)  # pieces the first Linear reads; then its terms
    time_pieces, cond_pieces, start, cols = [], [], 0, None
    for p in range(len(loop.pieces[0])):
        piece = loop.pieces[0][p]
        if p < read:  # the piece's block of the first Linear's columns
            stop = start + _val(piece).shape[1]
            w_cols = em(aten.slice.Tensor, w0, 1, start, stop)
            start = stop
        else:  # a term: added as it is
            w_cols = None
        if p == loop.x_pos:
            cols = em(aten.clone.default, w_cols, memory_format=torch.contiguous_format)
        elif all(step[p] is piece for step in loop.pieces):
            cond_pieces.append((piece, w_cols))
        elif reemit is not None:
            time_pieces.append((piece, w_cols))
        else:
            time_pieces.append((_stack_rows(em, [_first_row(em, step[p]) for step in loop.pieces]), w_cols))
    if reemit is None:
        time_bias, time_net, time_b = _bias_net(em, time_pieces, lambda n: n, lambda n: False)
    else:
        time_bias, time_net, time_b = _bias_net(em, time_pieces, reemit.rows, reemit.depends)
    cond_bias, cond_net, cond_b = _bias_net(em, cond_pieces, lambda n: n, lambda n: False)
    b0 = _sum(em, [net0.biases[0], *time_b, *cond_b])
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


def _fixed_net(net, varies) -> bool:
    """Whether the op can take ``net`` as a bias network: float32 weights and 1-D biases that do
    not change with the step, and a 2-D input."""
    iv = _val(net.inp)
    if iv is None or iv.dim() != 2:
        return False
    for t, dims in [(w, 2) for w in net.weights] + [(b, 1) for b in net.biases]:
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


def _noise(em: _Emitter, updates: list[_Update], K: int) -> Node | None:
    """One ``(K, B, dim)`` draw where every step draws ``randn``; else the steps' noise stacked."""
    draws = [u.noise for u in updates]
    present = [d for d in draws if d is not None]
    if not present:
        return None
    shape = list(_val(present[0]).shape)
    first = present[0]
    if all(_is(d, prims.inductor_random.default) and d.args[2] == "randn" for d in present):
        return em(prims.inductor_random.default, [K, *shape], first.args[1], "randn")
    if all(_is(d, aten.randn.default) and d.kwargs == first.kwargs for d in present):
        return em(aten.randn.default, [K, *shape], **first.kwargs)
    zeros = None
    rows = []
    for d in draws:
        if d is None:
            zeros = zeros or em.full(shape, 0.0)
            d = zeros
        rows.append(d)
    return em.stack(rows)


def rewrite_loops(graph: Graph, refusal=None, replace=None) -> int:
    """Replace every proved loop by ``ddpm::fused_sample.rule``. ``refusal(plan, fused)``
    may veto one (it returns the reason); ``replace(plan, fused)`` makes the fused op
    the loop's result. Returns the number of loops fused."""
    done, tried = 0, set()
    while True:
        loops, latest_of, reasons = _loops_in(graph)
        position = {n: i for i, n in enumerate(graph.nodes)}
        todo = [lp for lp in loops if lp.nets[0].out.name not in tried]
        if not todo:
            for r in reasons:
                log.debug("ddpm_ops: general reader: %s", r)
            return done
        loop = todo[0]
        tried.add(loop.nets[0].out.name)
        latest = latest_of[id(loop)]
        try:
            plan = _plan(loop, latest, position)
            fused, em = _emit(graph, plan)
        except _NoMatch as e:
            log.debug("ddpm_ops: general reader: loop of %d steps ending near %s left alone: %s",
                      len(loop.nets), loop.nets[-1].out.name, e)
            _count("loops_left_alone")
            continue
        why = refusal(plan, fused) if refusal is not None else None
        if why is not None:
            log.debug("ddpm_ops: general reader: loop of %d steps at %s left alone: %s",
                      len(loop.nets), plan.end.name, why)
            em.rollback()
            _count("loops_left_alone")
            continue
        replace(plan, fused)
        done += 1
        _count("loops_fused")
        _count("steps_fused", len(loop.nets))
        _log(plan, fused)


def _log(plan: _Plan, fused: Node) -> None:
    net = plan.loop.nets[0]
    _report_fused(
        f"ddpm_ops: fused {len(plan.loop.nets)} steps into one ddpm::fused_sample.rule (batch shape "
        f"{tuple(_val(plan.loop.x(0)).shape)}, {len(net.weights)} layers {net.activations}, clip "
        f"{plan.clip}, post_clip {plan.post_clip}, noise {'yes' if fused.args[11] is not None else 'no'})")
