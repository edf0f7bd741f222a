"""What the rewrite reports: one INFO line per fused loop and the counts of
:func:`ddpm_ops.rewrite_stats`, for graphs served from inductor's FX graph cache too.

On a cache hit inductor runs no pass: it loads the compiled graph and adds to
``torch._dynamo.utils.counters["inductor"]`` what the compilation that made
the graph added there (the cached artifact's ``counter_deltas``, replayed by
``FxGraphCache.cache_hit_post_compile``). So every report is also counted
there, under a key that holds it (``ddpm_ops.info: <the INFO line>``,
``ddpm_ops.loops_fused``, ...), and :func:`_report_replayed`, run at the end
of each Dynamo compilation, logs and counts once more whatever those keys
gained that no pass reported: the loops of graphs served from the cache.

Threads may compile at once: every read-modify-write of these counts holds a
lock, so none is lost.
"""
from __future__ import annotations

import collections
import logging
import threading

import torch

log = logging.getLogger("ddpm_ops.rewrite")

#: What the rewrite did in this process: loops fused, steps fused, loops left alone.
STATS = {"loops_fused": 0, "steps_fused": 0, "loops_left_alone": 0}

_STAT_KEY = "ddpm_ops."
_INFO_KEY = "ddpm_ops.info: "
_FROM_CACHE = " [compiled graph served from the FX graph cache]"

# How much of each key's count in counters["inductor"] has been logged and counted.
_reported: collections.Counter = collections.Counter()
_lock = threading.Lock()
# Held for STATS alone, so that reading them never waits on the reports.
_stats_lock = threading.Lock()


def _inductor_counters() -> collections.Counter:
    return torch._dynamo.utils.counters["inductor"]


def _record(key: str, n: int) -> None:
    with _lock:
        counters = _inductor_counters()
        _reported[key] = min(_reported[key], counters[key]) + n
        counters[key] += n


def _add_stat(key: str, n: int) -> None:
    with _stats_lock:
        STATS[key] += n
        torch._dynamo.utils.counters["ddpm_ops"][key] += n


def stats() -> dict:
    """A copy of :data:`STATS`, read at once."""
    with _stats_lock:
        return dict(STATS)


def count(key: str, n: int = 1) -> None:
    """Add ``n`` to the :data:`STATS` entry ``key``."""
    _add_stat(key, n)
    _record(_STAT_KEY + key, n)


def fused(message: str) -> None:
    """Log ``message``, the INFO line of one fused loop."""
    log.info("%s", message)
    _record(_INFO_KEY + message, 1)


def _report_replayed(*_callback_args) -> None:
    with _lock:
        counters = _inductor_counters()
        gained = {}
        for key in [k for k in counters if k.startswith(_STAT_KEY)]:
            new = counters[key] - _reported[key]
            _reported[key] = counters[key]
            if new > 0:
                gained[key] = new
    for key, new in gained.items():
        if key.startswith(_INFO_KEY):
            for _ in range(new):
                log.info("%s%s", key[len(_INFO_KEY):], _FROM_CACHE)
        elif key[len(_STAT_KEY):] in STATS:
            _add_stat(key[len(_STAT_KEY):], new)


def watch_cache_hits() -> None:
    """Make the end of the current and later Dynamo compilations report what the FX graph
    cache replayed. Where torch has no compile-end callbacks, hits stay unreported."""
    handler = getattr(torch._dynamo, "callback_handler", None)
    callbacks = getattr(handler, "end_callbacks", None)
    register = getattr(handler, "register_end_callback", None)
    if not isinstance(callbacks, list) or register is None:
        log.debug("ddpm_ops: this torch has no Dynamo compile-end callbacks; loops fused in "
                  "graphs served from the FX graph cache are not logged or counted")
        return
    with _lock:
        # Counters cleared since the last report must not hide what a hit adds to them.
        counters = _inductor_counters()
        for key in list(_reported):
            _reported[key] = min(_reported[key], counters[key])
        # Checked and registered at once: two threads must not register it twice.
        if _report_replayed not in callbacks:
            register(_report_replayed)
