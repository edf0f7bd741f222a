"""The torch.compile pass: installs the rewrite of DDPM sampling loops into inductor.

After ``import ddpm_ops`` a plain ``torch.compile(model)`` runs a sampling loop
(an MLP applied step after step, an affine update: :func:`ddpm_ops.reference`'s
loop and the projects' in ``tests/loops``, any spelling that lowers to the same
ATen graph) as ONE call of the fused op. This module is the installation:
:class:`DDPMSamplingRewrite`, the inductor pass (its ``uuid()`` for the FX
graph cache, the passes it chains), and putting it into and taking it out of
inductor's config. What is read and how a loop is replaced is
:mod:`ddpm_ops.rewrite`, the loop reader that also rewrites exported programs
(:func:`ddpm_ops.fuse_exported_program`).

Where the pass hooks in, and why
--------------------------------
It is installed as inductor's ``post_grad_custom_pre_pass``:

* The post-grad graph is ATen, functionalized and normalized, so the many
  Python spellings of the loop (``[:, None]`` / ``.unsqueeze(1)`` /
  ``.view(-1, 1)``, ``t.float()`` / ``t.to(torch.float32)``, ``nn.Sequential``
  or hand-written helpers with ``F.silu``, ``cat`` on dim 1 or -1) collapse to
  a handful of ATen forms. The pre-grad (Dynamo) graph would show every Python
  spelling separately.
* It is the same vocabulary as a ``torch.export`` graph, so one reader serves
  both ``torch.compile`` and exported models.
* It runs *before* inductor's own post-grad pattern passes. On CUDA one of them
  splits ``addmm`` into ``mm`` + ``add`` (``unfuse_bias_add_to_pointwise``),
  and another may fuse or reorder; ``post_grad_custom_post_pass`` would see
  the loop differently on CPU and CUDA. The pre-pass sees ``permute`` +
  ``addmm`` on both (the reader accepts ``mm`` + ``add`` and ``aten.linear``
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
"""
from __future__ import annotations

import hashlib
import logging
import os
import pathlib
from typing import Any

from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph

from . import rewrite as _rewrite
from .rewrite import looks_like_loop, report, rewrite_graph

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


def get_custom_graph_passes(custom_pass) -> tuple:
    """The passes in a config value: ``None``, one pass, or a list/tuple of them."""
    if custom_pass is None:
        return ()
    if isinstance(custom_pass, (list, tuple)):
        return tuple(custom_pass)
    return (custom_pass,)


# ----------------------------------------------------------------------------- the inductor pass

# The uuid keys inductor's FX graph cache: any edit to this module or to the
# reader must miss the cache, so every module of the rewrite package is hashed
# (a glob, so that a module added later is not forgotten).
_SOURCE_FILES = (pathlib.Path(__file__),
                 *sorted(pathlib.Path(_rewrite.__file__).parent.glob("*.py")))
_enabled = os.environ.get(DISABLE_ENV_VAR, "0") in ("", "0")


def _source_hash() -> str:
    h = hashlib.sha256()
    for p in _SOURCE_FILES:
        h.update(p.read_bytes())
    return h.hexdigest()


class DDPMSamplingRewrite(_PassBase):
    """Inductor ``post_grad_custom_pre_pass`` that fuses DDPM sampling loops.

    ``chained`` holds the custom pass(es) that were configured before this one
    was installed; they run first, then this rewrite. ``uuid()`` covers the
    source of this module and of the :mod:`ddpm_ops.rewrite` package, the
    on/off switch and the chained passes' uuids (``None``, i.e. no caching, if
    one of them has none: the safe answer).
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
            if looks_like_loop(graph):
                log.debug("ddpm_ops: training graph left alone (the op has no backward)")
            return
        # An inference graph can still hold tensors that require grad (AOTInductor
        # compiling an exported program under grad mode); inductor would then call
        # the op through its autograd kernel, which refuses.
        rewrite_graph(graph, grad_inputs_ok=False)

    def uuid(self) -> Any:
        # Inductor asks for the uuid on every compilation it may serve from its FX graph
        # cache, before the lookup, and torch._dynamo.reset() drops compile callbacks:
        # so this is where the reporting of cache hits is (re)installed.
        report.watch_cache_hits()
        chained = []
        for p in get_custom_graph_passes(self.chained):
            u = p.uuid() if isinstance(p, CustomGraphPass) else None
            if not u:  # inductor's own test: no (or an empty) uuid means no caching
                return None
            chained.append(u)
        # The buffers a fused loop reads as constants (ddpm_ops.rewrite.constants) key the
        # cache too: a graph compiled for one schedule is not served to another.
        from .rewrite.constants import buffer_digest
        return ("ddpm_ops.DDPMSamplingRewrite", _source_hash(), _enabled, tuple(chained), buffer_digest())


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
