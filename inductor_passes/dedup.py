"""Merge repeated pure computations of a local joint graph; never a collective.

AOTAutograd runs common-subexpression elimination over every joint graph it partitions
(``functorch.config.cse``). We turn that off in the min-cut partitioner (``compile._min_cut``):
it merged a ZeRO-3 backward re-gather with the forward gather of the same shard, keeping every
gathered parameter alive from the forward to the backward, and whether to re-gather is the
plan's choice. Without any CSE, though, what each layer recomputes from the same inputs stays
repeated: a Llama's attention mask converted to an additive float mask once per layer
(``where`` of the boolean mask, 256 KiB each on the demo Llama, every copy saved for the
backward), its rotary tables, zero fills. ``dedup_pure`` merges those and leaves every
functional collective and its wait alone.

A node is merged into an earlier one when both are the same functional ATen op (no mutation, no
random draw, not an ``empty``: its contents are undefined), no reader of it writes in place and
no op writes in place into its inputs, on the same arguments, compared exactly
(Python scalars by type and repr: ``0.0`` is not ``-0.0``, ``1`` is not ``1.0``), its result is
one tensor, and it does not share storage with a graph output (two outputs computed alike are
still two tensors, as in eager mode). A merged node read by several layers loses its module
stack (and so do its inputs made only for it): it belongs to none of them, so ``outline`` keeps
it outside the shared layer bodies instead of pulling it into the first layer, which would then
differ from the rest.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from inductor_passes.core.collectives import functional_collective_name
from inductor_passes.core.layers import layer_of

from .schedule import movable

_WAIT = torch.ops._c10d_functional.wait_tensor.default
_aten = torch.ops.aten
_UNDEFINED = {_aten.empty.memory_format, _aten.empty_like.default, _aten.empty_strided.default,
              _aten.new_empty.default, _aten.new_empty_strided.default}  # contents undefined
_SCALARS = (int, float, bool, complex, str, type(None))


class _Unkeyable(Exception):
    """An argument with no exact, hashable form."""


def _key(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return a  # by identity: earlier merges already point readers at the representative
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_key(x) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple((k, _key(v)) for k, v in a.items()))
    if isinstance(a, _SCALARS):
        return (type(a).__name__, repr(a))
    if isinstance(a, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return (type(a).__name__, str(a))
    raise _Unkeyable(type(a).__name__)


def _storage(node: fx.Node) -> int | None:
    """The identity of the storage under a node's tensor (views share it; the same key as
    ``memory``), or None."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return val.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):
        return None


def _mergeable(node: fx.Node, written: set) -> bool:
    # a user that writes in place (a dropout's ``bernoulli_`` into an ``empty_like``) would
    # write into the other reader's tensor too; an input some op writes in place may hold
    # other values at the two places
    return (movable(node) and node.target is not _WAIT and node.target not in _UNDEFINED
            and functional_collective_name(node) is None
            and isinstance(node.meta.get("val"), torch.Tensor)
            and all(movable(u) for u in node.users)
            and not any(_storage(a) in written for a in node.all_input_nodes))


def dedup_pure(gm: fx.GraphModule) -> int:
    """Merge repeated pure computations of ``gm`` (a local joint graph) in place; returns how
    many nodes were removed. Shapes are local; raises nothing (a node it cannot key stays)."""
    out = next(iter(gm.graph.find_nodes(op="output")))
    returned = {s for s in map(_storage, out.all_input_nodes) if s is not None}
    # storages an in-place or otherwise effectful op touches (any of its inputs, views alike)
    written = {_storage(a) for n in gm.graph.nodes if n.op == "call_function" and not movable(n)
               for a in n.all_input_nodes} - {None}
    seen: dict[Any, fx.Node] = {}
    merged: set[fx.Node] = set()
    removed = 0
    for node in list(gm.graph.nodes):
        if not _mergeable(node, written) or _storage(node) in returned:
            continue
        try:
            key = (node.target, _key(node.args), _key(node.kwargs))
        except _Unkeyable:
            continue
        first = seen.setdefault(key, node)
        if first is node:
            continue
        node.replace_all_uses_with(first)
        gm.graph.erase_node(node)
        merged.add(first)
        removed += 1
    if removed:
        _unlayer(n for n in merged if len({layer_of(u) for u in n.users} - {None}) > 1)
        gm.graph.lint()
        gm.recompile()
    return removed


def _unlayer(nodes) -> None:
    """Drop the module stack of ``nodes`` and of their ancestors that feed nothing else of
    their own layer (the rest of a merged mask's computation: its ``-inf`` scalar)."""
    todo = list(nodes)
    while todo:
        node = todo.pop()
        node.meta.pop("nn_module_stack", None)
        for a in node.all_input_nodes:
            layer = layer_of(a)
            if layer is not None and all(layer_of(u) != layer for u in a.users):
                todo.append(a)
