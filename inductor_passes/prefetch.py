"""Prefetch: issue each layer's parameter all_gathers while the layer before it computes.

FSDP gathers a layer's parameters right before the layer runs, so without prefetch every
gather's latency sits on the critical path: the layer waits for its own parameters. FSDP2
issues layer i+1's all_gather during layer i (forward prefetch; in the backward the next layer
in backward order), so the collective runs while compute runs and at most two layers' gathered
parameters are live at once (Zhao et al., "PyTorch FSDP", VLDB 2023, section 3.3.2; FSDP2's
``set_modules_to_forward_prefetch``). This pass makes that order in a local graph:

* A layer's *prefetchable* gathers are its all_gathers that are pure functions of graph inputs
  (a parameter shard, or in the backward a saved value), found with the ops between the input
  and the gather (a transpose and contiguous copy lowering adds). Their waits stay where they
  are, right before the first use.
* Layers are taken in the order they run in this graph (forward: 0, 1, ...; backward: the
  reverse). Each layer's prefetchable gathers move to right before the first node of the layer
  before it (after that layer's own gathers when they stay in place); the first layer's stay in
  place.
* The moved nodes, their waits and the views of the gathered values are marked
  ``outline.OUTSIDE``: outlining leaves them in the calling graph, so a shared layer body takes
  the gathered parameters as inputs and the gather of the next layer can be issued before the
  body call of this one. The views come along because a forward that keeps a gathered weight
  for the backward (a transpose of it is a forward output) would otherwise make the body
  return a view of its input, which outlining refuses.

Only movable nodes (functional ops with no randomness or mutation, ``schedule.movable``) are
moved, and only to an earlier place, with their inputs (graph inputs, or moved before them):
the program computes the same values. Every rank rewrites its graph the same way (the choice
reads the graph's structure, never a size), so collectives keep one order on every rank.
Buckets stay per layer (``comm``): the moved gathers keep their layer's tag, so one layer's
bucket is issued before the layer before it, and its wait stays where the layer starts
(``compat.bucket_collectives``). Inductor's peak-memory reordering, which would sink the
gathers back to their waits, is off for a graph where gathers moved (``inductor_config``).
On by default for GPU graphs only (``enabled``: on CPU it costs compile time and was not
measured to win); ``DYNAMO_DIST_PREFETCH=1`` or ``0`` forces it on or off.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
import torch.fx as fx

from inductor_passes.core.collectives import collective_kind

from . import outline
from .schedule import movable

log = logging.getLogger("dynamo_dist.prefetch")


def enabled(gm: fx.GraphModule | None = None) -> bool:
    """``DYNAMO_DIST_PREFETCH``: 1 (on), 0 (off) or auto (the default): on for a graph whose
    inputs live on an accelerator (a GPU, where NCCL runs beside the compute and the gather is
    hidden), off on CPU, where it was measured to neither win nor lose step time (4 gloo ranks on 2
    cores: ``benchmarks/results/prefetch.md``) and to cost compile time (each layer's gathers
    and bucket copies compile in the calling graph: 32-layer cold compile 61 -> 80 s,
    ``benchmarks.depth --variants outline prefetched``). Raises ValueError for another value."""
    text = os.environ.get("DYNAMO_DIST_PREFETCH", "auto")
    if text not in ("0", "1", "auto"):
        raise ValueError(f"DYNAMO_DIST_PREFETCH={text!r}: fix: use 1 (prefetch the next layer's "
                         f"gathers), 0 (off) or auto (the default: on for GPU graphs)")
    if text != "auto":
        return text == "1"
    return gm is not None and any(
        isinstance(v := n.meta.get("val"), torch.Tensor) and v.device.type != "cpu"
        for n in gm.graph.find_nodes(op="placeholder"))


@dataclasses.dataclass
class Prefetched:
    """What ``prefetch_gathers`` moved: the layers whose gathers now run one layer early, in
    graph order, and how many all_gathers moved."""

    layers: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    gathers: int = 0


def _pure_of_inputs(gm: fx.GraphModule) -> set[fx.Node]:
    """Movable nodes computed from graph inputs alone (directly or through other such nodes)."""
    pure: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.all_input_nodes and movable(node) and all(
                a.op == "placeholder" or a in pure for a in node.all_input_nodes):
            pure.add(node)
    return pure


def prefetch_gathers(gm: fx.GraphModule) -> Prefetched:
    """Rewrite ``gm`` (a partitioned local forward or backward graph, flat) in place as the
    module doc says; returns what moved (nothing when the pass is off or fewer than two layers
    have prefetchable gathers). Local shapes; raises nothing for a graph it cannot improve."""
    done = Prefetched()
    if not enabled(gm):
        return done
    layer_of = outline.assign_layers(gm)
    pure = _pure_of_inputs(gm)
    gathers: dict[tuple[str, int], list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node in pure and collective_kind(node) == "all_gather" and node in layer_of:
            gathers.setdefault(layer_of[node], []).append(node)
    # what moves with each layer's gathers: the pure nodes they are computed from
    lifted: dict[tuple[str, int], list[fx.Node]] = {}
    for key, starts in gathers.items():
        chain: set[fx.Node] = set()
        todo = list(starts)
        while todo:
            node = todo.pop()
            if node not in chain:
                chain.add(node)
                todo.extend(a for a in node.all_input_nodes if a in pure)
        lifted[key] = [n for n in gm.graph.nodes if n in chain]  # graph order
    moving = {n for nodes in lifted.values() for n in nodes}
    # where each layer starts: its first node that does not move
    first: dict[tuple[str, int], fx.Node] = {}
    for node in gm.graph.nodes:
        key = layer_of.get(node)
        if key is not None and key not in first and node not in moving:
            first[key] = node
    start = _position(gm)
    runs = sorted(first, key=lambda k: start[first[k]])
    for prev, key in zip(runs, runs[1:]):
        if key not in lifted:
            continue
        order = _position(gm)
        anchor = first[prev]
        if prev in lifted and order[lifted[prev][-1]] > order[anchor]:
            # the layer before gathers in place (the first layer): issue after its gathers,
            # which it waits for first; never before a node that moves itself (a gather of
            # this layer may read another's wait: GPT-2's weights gather over dp, then tp)
            anchor = lifted[prev][-1].next
            while anchor in moving:
                anchor = anchor.next
        for node in lifted[key]:
            if order[node] > order[anchor]:
                anchor.prepend(node)
        done.layers.append(key)
        done.gathers += len(gathers[key])
    if not done.layers:
        return done  # nothing moved: the gathers stay in their layers' bodies
    for nodes in lifted.values():
        for node in nodes:
            node.meta[outline.OUTSIDE] = True
            for user in node.users:
                if user.target is outline.WAIT:
                    _mark_views(user)
    gm.graph.lint()
    gm.recompile()
    log.debug("dynamo_dist: %d gathers of %d layers issued a layer early", done.gathers,
              len(done.layers))
    return done


def inductor_config(gm: fx.GraphModule) -> dict:
    """Inductor config entries that keep the order this pass made in ``gm``: its peak-memory
    reordering (a topological sort that minimises the live bytes it estimates) is off when a
    gather was moved, since it would sink each gather back down to its wait (seen on the small
    Llama: every prefetched gather issued right before its layer again). torchtitan's
    SimpleFSDP and AutoParallel turn it off for their scheduled gathers too. Empty otherwise."""
    moved = any(n.meta.get(outline.OUTSIDE) and collective_kind(n) for n in gm.graph.nodes)
    return {"reorder_for_peak_memory": False} if moved else {}


def _mark_views(wait: fx.Node) -> None:
    """Mark ``wait`` and every view of its value (nodes sharing its storage, reached through
    users) ``outline.OUTSIDE``: they stay in the calling graph with the gather. A layer body
    that returned a view of the gathered value (a weight's transpose the forward keeps for the
    backward) would return a view of its input, which outlining refuses; views cost nothing
    where they are."""
    storage = outline.storage_of(wait)
    todo = [wait]
    while todo:
        node = todo.pop()
        if not node.meta.get(outline.OUTSIDE):
            node.meta[outline.OUTSIDE] = True
            todo.extend(u for u in node.users if u.op == "call_function" and movable(u)
                        and storage is not None and outline.storage_of(u) == storage)


def _position(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: k for k, n in enumerate(gm.graph.nodes)}
