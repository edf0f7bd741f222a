"""Exported models: turn an ``ExportedProgram`` of a sampling loop into one that calls the op."""
from __future__ import annotations

import copy
import dataclasses

import torch
from torch.export import ExportedProgram

from .rewrite import rewrite_graph


def fuse_exported_program(ep: ExportedProgram) -> ExportedProgram:
    """A copy of ``ep`` in which every DDPM sampling loop calls ``ddpm::fused_sample.rule``.

    ``ep`` is ``torch.export.export(model, (x, t_start))`` of a module whose
    forward runs the loop of :func:`ddpm_ops.reference` (any spelling the
    ``torch.compile`` rewrite accepts; the reader is the same, see
    :mod:`ddpm_ops.rewrite`). Both the default (training) IR and the output of
    ``ep.run_decompositions()`` are understood. The result has the same inputs,
    outputs, parameters and buffers (parameters the op takes over stay as
    inputs, unchanged); ``ep`` itself is not modified. What the reader does not
    fully understand is left as it was, so a program with no such loop comes
    back equal to ``ep``. In-place ops inside the loop in the default IR (for
    example ``nn.SiLU(inplace=True)``) keep it from matching there: fuse
    ``ep.run_decompositions()`` instead. With ``preserve_module_call_signature``
    the nodes a kept submodule's signature names stay: a loop whose fusion would
    erase one (a preserved ``eps_net``) is left as it was; a preserved sampler's
    output becomes the op's.

    The result is for inference: the op has no backward, so the copy's
    parameters no longer require grad (``ep``'s are untouched). Run it with
    ``result.module()(x, t_start)``, save it, or package it for deployment::

        ep = ddpm_ops.fuse_exported_program(torch.export.export(sampler, (x, t)))
        torch.export.save(ep, "sampler.pt2")            # load: import ddpm_ops first
        path = torch._inductor.aoti_compile_and_package(ep)
        runner = torch._inductor.aoti_load_package(path)  # in a process that imported ddpm_ops

    Rewrites are logged at INFO on the ``ddpm_ops.rewrite`` logger.
    """
    if not isinstance(ep, ExportedProgram):
        raise TypeError(f"ep: expected a torch.export.ExportedProgram, got {type(ep).__name__}")
    new = copy.deepcopy(ep)
    gm = new.graph_module
    renamed: dict[str, str] = {}
    if rewrite_graph(gm.graph, protected=_preserved_names(new), renamed=renamed) == 0:
        return new
    _rename_outputs(new, renamed)
    # The op is inference-only: parameters of the copy stop requiring grad, so
    # that running it (or compiling it with AOTInductor) under grad mode works.
    for value in new.state_dict.values():
        if isinstance(value, torch.Tensor) and value.requires_grad:
            value.requires_grad_(False)
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor) and val.requires_grad:
            node.meta["val"] = val.detach()
    gm.recompile()
    validate = getattr(new, "validate", None) or getattr(new, "_validate", None)
    if validate is not None:  # the verifier: signature and graph agree
        validate()
    return new


def _preserved_names(ep: ExportedProgram) -> frozenset[str]:
    """Nodes named by the call signatures of submodules kept with
    ``preserve_module_call_signature``: a rewrite must not erase them."""
    names = set()
    for entry in ep.module_call_graph:
        if entry.fqn and entry.signature is not None:
            for arg in (*entry.signature.inputs, *entry.signature.outputs):
                name = getattr(arg, "name", None)
                if name is not None:
                    names.add(name)
    return frozenset(names)


def _rename_outputs(ep: ExportedProgram, renamed: dict[str, str]) -> None:
    """Point the signatures at the nodes that now produce their outputs."""
    if not renamed:
        return

    def fix(arg):
        name = getattr(arg, "name", None)
        if name in renamed:
            return dataclasses.replace(arg, name=renamed[name])
        return arg

    for spec in ep.graph_signature.output_specs:
        spec.arg = fix(spec.arg)
    for entry in ep.module_call_graph:
        if entry.signature is not None:
            entry.signature.outputs = [fix(a) for a in entry.signature.outputs]
