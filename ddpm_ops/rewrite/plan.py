"""Reading the step: every step of a loop proved to be one affine update of its sample.

Each step of a loop (:mod:`.chain`) is proved to be

    h = first Linear of [x, step-only pieces, loop-invariant pieces]
    e = the rest of the network (one activation per layer)
    x_{k+1} = clamp(C*clamp(A*x - B*e) + D*x + E*e + S*z)   (:mod:`.affine`)

(plus, where every step adds it, one term ``c = v * 0`` of a ``v`` the steps
share, or none where each such ``v`` is finite at compile time: :func:`_zero_term`)
with coefficients and pieces that depend on the step only, or on nothing
that changes over the loop, every step with one clamp of x0 and one of its
result. Where the network reads the sample scaled by a number per step
(``c_k * x_k``), the updates are rewritten for the op's state ``c_k * x_k``
(:func:`_rescale_all`). The network computes in float32; the sample between
the networks is float32 or float64 (each network then reads it cast to
float32, and every step's update computes in float64: :func:`_sample_dtype`).
:func:`_plan` returns the proved :class:`_Plan` or raises
``_NoMatch`` with the first fact not proved (:class:`.chain._StepNoMatch`
where one step alone cannot be fused, so that its loop may be cut there).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from .._library import has_fused_rule_kernel
from .affine import _read_update, _rescaled, _scale, _Update, _x0_clamped
from .chain import _ancestors_within, _descendants, _in_sample_order, _latest_step, _Loop, _loops, _step_region
from .chain import _split_sums, _StepNoMatch
from .coefficients import ONE
from .constants import evaluate, real_buffers
from .network import _find_nets
from .nodes import _ASSERT_METADATA, _is, _NoMatch, _val
from .tables import _coefs, _shape_of
from .timesteps import _recomputed


@dataclass
class _Plan:
    loop: _Loop
    updates: list
    end: Node
    clip: tuple | None
    post_clip: tuple | None
    dtype: torch.dtype  # the sample's between the steps: the op's x, tables and result
    zero: Node | None = None  # step 0's term v * 0, which every step adds (emitted once, around the op)
    # the ops that lay the network's output out in the sample's order, where the network reads the
    # sample in another (a transposed chunk): the op's result is laid out by them again
    out_layout: list | None = None
    scaled: bool = False  # the network reads the sample scaled (the op's state is what it reads)
    eps_read_clip: tuple | None = None  # the clamp of the eps every step reads back from its x0


def _loops_in(graph: Graph) -> tuple[list[_Loop], dict, list[str]]:
    nets = _find_nets(graph)
    groups: dict[tuple, list] = {}
    for net in nets:
        groups.setdefault(net.key, []).append(net)
    order = {n: i for i, n in enumerate(graph.nodes)}
    nets.sort(key=lambda n: order[n.out])
    latest_any = _latest_step(graph, nets)  # of any network: another network between two steps
    index = {net.out: i for i, net in enumerate(nets)}

    def direct(piece, net):
        # A network whose output is not shaped like the sample is only part of a step's network
        # (split by an op the reader does not know): its loop is named and refused by _plan.
        out, sample = _val(net.out), _val(piece)
        if out is None or sample is None or tuple(out.shape) != tuple(sample.shape):
            return True
        return latest_any.get(piece, -1) == index[net.out]

    found, reasons, latest_of = [], [], {}
    for group in groups.values():
        group.sort(key=lambda n: order[n.out])
        latest = _latest_step(graph, group)
        loops, why = _loops(group, latest, direct)
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
        raise _NoMatch(f"the network reads a {x0v.dtype} input; the op's network computes in float32 only "
                       "(a float64 sample the network reads cast to float32 is fused)")
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
    for p in (*loop.nets[0].weights, *(b for b in loop.nets[0].biases if b is not None)):
        pv = _val(p)
        if pv is None or pv.dtype != torch.float32 or pv.device != x0v.device:
            raise _NoMatch(f"{p.name} is not a float32 tensor on the sample's device")

    # A piece every step recomputes alike from the same inputs (TabDDPM adds its label's
    # embedding in each call of the network) is one loop-invariant value: step 0's.
    for p, first in enumerate(loop.pieces[0]):
        if p != loop.x_pos and all(_recomputed(step[p], first) for step in loop.pieces):
            for step in loop.pieces:
                step[p] = first
    _split_sums(loop)

    def step_only(n):
        return latest.get(n, -1) == -1

    updates, end = [], None
    K = len(loop.nets)
    carries, insides = [], []  # per step read so far: the value the next step may read, the update

    def read(k, end, inside):
        prev = carries[k - 1] if k else None
        carried = _carried_into(loop, k, prev, insides[k - 1], inside, end) if prev is not None else frozenset()
        sample = loop.sample(k)  # a chunk's update reads it as it is, the network its rows flattened
        e = _output(k)[-1] if loop.feed(k).order is not None else loop.nets[k].out
        return _read_update(sample, e, end, inside, tuple(_val(sample).shape), step_only,
                            prev=prev, carried=carried, x0_node=carries[k] if k < len(carries) else None,
                            net_out=loop.nets[k].out)

    def _output(k):
        # The network reads the sample's elements in another order (a transposed chunk): its
        # output must be laid out back in the sample's order, by layout ops alone.
        feed, out = loop.feed(k), loop.nets[k].out
        path = _in_sample_order(out, feed.order, _val(feed.sample).shape)
        if path is None:
            raise _NoMatch(f"the network reads the sample {feed.sample.name} in another order of its elements "
                           f"({loop.x(k).name}), and its output {out.name} is not laid out back in the "
                           "sample's order and shape by layout ops alone (views, reshapes, permutes)")
        return path

    def choose(ends, region):
        # The last step ends at its last node that reads like the step before it: the same
        # coefficients and clamps, else the same clamps (a last step without noise), so that what
        # follows the loop (a clip of the result) stays outside; a loop of one step ends at its
        # last node that reads as an update.
        read_ends = []
        for candidate in ends:
            inside = _ancestors_within(candidate, region) | {candidate}
            try:
                read_ends.append((candidate, read(K - 1, candidate, inside)))
            except _NoMatch:
                continue
        if updates:
            for _, u in read_ends:
                _unify_bounds([*updates, u])  # a bound computed again is the earlier steps'
            for same in (lambda u: _form(u) == _form(updates[-1]),
                         lambda u: (u.clip, u.post_clip) == (updates[-1].clip, updates[-1].post_clip)):
                matching = [candidate for candidate, u in read_ends if same(u)]
                if matching:
                    return matching[-1]
        return read_ends[-1][0] if read_ends else ends[0]

    for k in range(K):
        try:
            end, inside, carry = _step_region(loop, k, position, choose)
            carries.append(carry)
            updates.append(read(k, end, inside))
            insides.append(inside)
        except _StepNoMatch as e:
            raise _StepNoMatch(f"step {k}: {e}", e.step, e.sample_kept) from None
        except _NoMatch as e:
            raise _NoMatch(f"step {k}: {e}") from None
    _unify_bounds(updates)
    posts = {u.post_clip for u in updates}
    if len(posts) > 1:
        # x = clamp(a*x + b*e) is a clamp of the result, or an x0 clamp with x = x0 (a solver's last
        # step returning its clipped x0 prediction): the latter where the other steps say so.
        other = [_x0_clamped(u) if _x0_clamped(u) is not None else u for u in updates]
        if len({u.post_clip for u in other}) == 1:
            updates, posts = other, {u.post_clip for u in other}
    clips = {u.clip for u in updates if u.pre is not None}
    if len(clips) > 1 or (clips and any(u.pre is None and u.post.get("x0") for u in updates)):
        raise _NoMatch(f"the steps clamp x0 to different bounds {sorted(map(str, clips))}")
    if len(posts) > 1:
        raise _NoMatch(f"the steps clamp their result to different bounds {sorted(map(str, posts))}")
    if "p" in updates[0].post:  # its reader had no step before to take one from: never so
        raise _NoMatch("the first step reads a previous x0, which the op's is zero at a call's first step")
    read_back = {u.eps_read_clip for u in updates if u.eps_read is not None}
    if read_back and any(u.eps_read is None for u in updates):
        k = next(k for k, u in enumerate(updates) if u.eps_read is None)
        raise _NoMatch(f"step {k} reads no eps back from its clamped x0 where other steps do (the op's E term "
                       "reads one of them in every step)")
    if len(read_back) > 1:
        raise _NoMatch(f"the steps clamp the eps read back from x0 to different bounds {sorted(map(str, read_back))}")
    plan = _Plan(loop, updates, end, next(iter(clips), None), next(iter(posts)), _sample_dtype(loop, end),
                 _zero_term(loop, updates),
                 _output(K - 1) if loop.feed(K - 1).order is not None else None,
                 eps_read_clip=next(iter(read_back), None))
    _rescale_all(plan, step_only)
    return plan


def _rescale_all(plan: _Plan, step_only) -> None:
    """Where the network reads the sample scaled (``c_k * x_k``: EDM's and k-diffusion's ``c_in``,
    diffusers' ``scale_model_input``), every update rewritten for the op's state ``y_k = c_k *
    x_k`` (:func:`.affine._rescaled`; after the last step, ``c = 1``: the op's result is the
    sample). The op's input is then the first network's input as the loop computes it."""
    loop, updates = plan.loop, plan.updates
    factors = [loop.feed(k).factors for k in range(len(updates))]
    if not any(factors):
        return
    name = next(loop.x(k).name for k, f in enumerate(factors) if f)
    if plan.dtype != torch.float32:
        raise _NoMatch(f"the network reads the {plan.dtype} sample scaled ({name}): the op's state would be "
                       "the scaled sample, which it takes in float32 only")
    if plan.post_clip is not None:
        raise _NoMatch(f"the network reads the sample scaled ({name}) and the steps clamp their result: the op "
                       "would clamp the scaled sample, whose bounds change with the step")
    scales = []
    for k, u in enumerate(updates):
        scales.append(_scale(factors[k], step_only, u.leaves))
    for k, u in enumerate(updates):
        _rescaled(u, scales[k], scales[k + 1] if k + 1 < len(updates) else ONE)
    plan.scaled = True


def _sample_dtype(loop: _Loop, end: Node) -> torch.dtype:
    """The dtype of every step's result (the samples the later steps read, and ``end``), float32
    or float64; the loop's first sample is of it too, or float32 (TabDDPM draws its first sample
    in float32 and makes the next one float64 with its float64 model variance). Raise
    ``_NoMatch`` otherwise: the op computes every step in one dtype."""
    results = [loop.sample(k) for k in range(1, len(loop.nets))] + [end]
    unknown = [n.name for n in results if _val(n) is None]
    if unknown:
        raise _NoMatch(f"the dtype of the steps' results {unknown} is unknown")
    dtypes = {_val(n).dtype for n in results}
    if len(dtypes) > 1:
        raise _NoMatch(f"the steps' results are of different dtypes {sorted(map(str, dtypes))} (the op computes "
                       "every step in one)")
    dtype = dtypes.pop()
    if dtype not in (torch.float32, torch.float64):
        raise _NoMatch(f"the steps' results are {dtype}; the op's step computes in float32 or float64")
    first = _val(loop.sample(0)).dtype
    if first not in (dtype, torch.float32):
        raise _NoMatch(f"the loop's first sample is {first} and its steps' results {dtype}")
    return dtype


def _zero_term(loop: _Loop, updates: list) -> Node | None:
    """Step 0's term ``c = v * 0`` where every step adds one of the same ``v`` (the same node, or
    computed again alike from the same inputs), else ``None`` where no step adds one; raise
    ``_NoMatch`` otherwise.

    ``c`` is +-0 where ``v`` is finite and NaN where it is not, so ``x_{k+1} = F(x_k) + c`` for
    K >= 2 steps is ``op(x_0 + c) + c`` up to the sign of zero: a row of ``v`` with a non-finite
    entry gives a NaN entry of ``x_1``, which every later step's network spreads over the row, as
    feeding ``x_0 + c`` to the op does from its first step (one step: ``op(x_0) + c``)."""
    terms = [u.zero for u in updates]
    if all(t is None for t in terms):
        return None
    if _finite_at_compile_time([u.zero_of for u in updates if u.zero is not None]):
        # Each term is then +-0: it changes no number, so no step needs to add it (a DDPM loop's
        # last step spelt ``std * (noise if t > 0 else 0.)``, where the others add noise).
        return None
    first = next(t for t in terms if t is not None)
    if any(t is None for t in terms):
        raise _NoMatch(f"some steps add {first.name}, a term v * 0, and others add none (the op adds one "
                       "term to every step)")
    if loop.feed(0).path:
        raise _NoMatch(f"the steps add {first.name}, a term v * 0, to a sample the network reads as "
                       f"{loop.x(0).name} (an action chunk flattened, the sample scaled or cast): the term is added "
                       "only to a (batch, dim) sample the network reads as it is")
    v0 = updates[0].zero_of
    for k, u in enumerate(updates[1:], 1):
        if not _recomputed(u.zero_of, v0):
            raise _NoMatch(f"step {k} adds {u.zero.name} = {u.zero_of.name} * 0, not step 0's "
                           f"{v0.name} * 0 (the op adds one term v * 0 to every step)")
    return updates[0].zero


def _unify_bounds(updates: list) -> None:
    """Give every clamp bound that a step computes again alike from the same inputs (``-x_max``
    of a per-column ``x_max``, negated in each step) the node of the first step that computes
    it, so that steps clamping to one bound compare equal."""
    seen: list[Node] = []

    def first(b):
        if not isinstance(b, Node):
            return b
        same = next((s for s in seen if _recomputed(b, s)), None)
        if same is None:
            seen.append(b)
        return b if same is None else same

    for u in updates:
        u.clip = None if u.clip is None else tuple(map(first, u.clip))
        u.post_clip = None if u.post_clip is None else tuple(map(first, u.post_clip))


def _finite_at_compile_time(values: list) -> bool:
    """Whether every node of ``values`` is computed from constants and module buffers alone and
    is finite everywhere, on the values it has at compile time (:mod:`.constants`)."""
    graph = values[0].graph
    buffers = real_buffers(graph)
    for v in values:
        value = evaluate(graph, v, buffers or {})
        if value is None or not bool(value.isfinite().all()):
            return False
    return True


def _carried_into(loop: _Loop, k: int, prev: Node, prev_inside: set, inside: set, end: Node) -> frozenset:
    """The nodes of step ``k``'s update computed from ``prev`` (step ``k - 1``'s carry, its x0
    as the next step reads it) and from no sample of step ``k``: ``(1/2r) * x0_prev``. Raise
    :class:`_StepNoMatch` naming step ``k - 1`` unless every reader of ``prev`` outside that
    step is step ``k``'s update or such a node, and each such node is read on the way to
    ``end``: the op gives the previous x0 to the next step only."""
    net = loop.nets[k]
    excluded = prev_inside | inside | net.nodes | {net.inp}
    derived = set(_descendants([prev], end, excluded))
    feeding = _ancestors_within(end, derived | inside) & derived
    readers = [u for u in prev.users if u not in prev_inside and u not in loop.nets[k - 1].nodes
               and not _is(u, _ASSERT_METADATA)]
    # Named: the first nodes off the way to step k's result (not all that follow them).
    stray = [u for u in readers if u not in inside and u not in feeding]
    stray += [n for n in derived - feeding if n not in stray and any(a in feeding for a in n.all_input_nodes)]
    if stray:
        raise _StepNoMatch(f"{prev.name} of step {k - 1} is used outside the step (by "
                           f"{[n.name for n in stray]}): the op gives a step's x0 to the next step only",
                           k - 1)
    return frozenset(feeding)


def _form(u: _Update) -> tuple:
    """What two steps must share to be one step function: coefficient forms and clamps."""
    return (tuple(_shape_of(c) for c in _coefs(u)), u.clip, u.post_clip, u.zero is not None, u.eps_read_clip)


