"""Comm pass: bucket the collectives of each local graph, one layer at a time.

A lowered graph issues one collective per redistribute: FSDP-style sharding gathers every
parameter on its own and reduce-scatters every gradient on its own, each paying the
collective's fixed latency (76 all_gather + 39 reduce_scatter per step on the small Llama at
dp=2 x tp=2, against FSDP2's 9 + 5). Bucketing merges independent collectives of one kind, group,
reduce op and dtype into one collective over a flat buffer: one latency per bucket instead of one
per tensor.

Buckets never cross a layer boundary (FSDP2's unit is one layer too): a layer's parameters are
gathered together when that layer runs, not every layer's at the start of the forward, so at
most one layer's gathered parameters are live at once. Each collective carries its layer
(``outline.assign_layers``, the same grouping that outlining uses) as part of the bucket key;
collectives inside a shared layer body (``outline``) bucket within the body. Collectives
outside every layer (embedding, head, loss) bucket among themselves.

The grouping and merging are Inductor's (``torch._inductor.fx_passes.bucketing``, the pass
SimpleFSDP / torchtitan use), run as Inductor's post-grad custom pass; we own the policy:
  * which kinds: all_gather, reduce_scatter and all_reduce;
  * the key: Inductor's (group, reduce op, dtype) plus the layer;
  * bucket size: at most ``bucket_cap_mb()`` MiB per bucket (the larger of input and output),
    ``DYNAMO_DIST_BUCKET_MB``, default 25 (DDP's bucket size); 0 turns bucketing off.

On by default since 2026-11-26, when the model zoo trained at parity with it on real gloo
ranks under Inductor. Its history: with torch 2.13's pass on, the zoo first trained four cells
to wrong numbers with no error (T5 dp=2 and dp=2 x tp=2: NaN loss; Mixtral dp=2 x tp=2:
gradients off by 120%; the ConvNet dp=2: a BatchNorm bias gradient 2x). Two Inductor defects,
both worked around: C++ fusion scheduling a read of an in-place filled buffer before the fill
(``inductor_fix.install_inductor_mutation_order_fix``, on for every compile: T5, Mixtral), and
an all_reduce bucket overwriting an input that is read again later
(``copy_shared_all_reduce_inputs`` below: the ConvNet). Only collectives with no path between
them are merged (the grouping checks), and only runs of one key in graph order, so every rank
merges the same ones.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from typing import Any, Callable

import torch
import torch.fx as fx

from inductor_passes.core import compat
from inductor_passes.core import inductor_fix  # noqa: F401  (installs the fix on import)
from inductor_passes.core.collectives import collective_op

from . import outline
from .schedule import INVOKE_SUBGRAPH

DEFAULT_BUCKET_MB = 25.0  # DDP's bucket size
# node meta key: the (family, index) of the layer a collective belongs to, or absent
LAYER_META = "dynamo_dist_layer"

log = logging.getLogger("dynamo_dist.comm")


def bucket_cap_mb() -> float:
    """Largest bucket, in MiB (``DYNAMO_DIST_BUCKET_MB``, default 25; 0 or less: no bucketing).
    0 as well on a torch older than ``compat.BUCKETING_FROM`` or lacking the bucketing
    functions (logged once).

    Raises ValueError naming the variable when it is not a number."""
    text = os.environ.get("DYNAMO_DIST_BUCKET_MB", "")
    try:
        mb = float(text) if text else DEFAULT_BUCKET_MB
    except ValueError:
        raise ValueError(f"DYNAMO_DIST_BUCKET_MB={text!r} is not a number of MiB; "
                         f"fix: set it to e.g. {DEFAULT_BUCKET_MB:g}, or 0 to turn bucketing "
                         f"off") from None
    if mb > 0 and not compat.can_bucket():
        _warn_no_bucketing_once()
        return 0.0
    return mb


@functools.lru_cache(maxsize=None)
def _warn_no_bucketing_once() -> None:
    log.warning("dynamo_dist: torch %s: collective bucketing is off (Inductor's bucketing "
                "functions are used from torch %s on); every collective is issued on its own "
                "(one latency each)", torch.__version__, compat.BUCKETING_FROM)


def _cap(mb: float, bucket_index: int) -> float:
    return mb


def _cap_fn():
    """Our cap as Inductor's grouping takes it (MiB by bucket index), or None when bucketing is
    off."""
    mb = bucket_cap_mb()
    return functools.partial(_cap, mb) if mb > 0 else None


def _layer(node: fx.Node) -> Any:
    return node.meta.get(LAYER_META)


def tag_layers(gm: fx.GraphModule) -> None:
    """Record on each collective of ``gm`` (a flat local graph, before outlining: bodies copy
    the tags) the layer it belongs to, the part of its bucket key that keeps buckets inside
    one layer."""
    for node, key in outline.assign_layers(gm).items():
        if collective_op(node) is not None:
            node.meta[LAYER_META] = key


def _bodies(gm: fx.GraphModule) -> dict[str, int]:
    """Each ``invoke_subgraph`` body of ``gm`` (attribute name) and how many times it is called."""
    calls: dict[str, int] = {}
    for node in gm.graph.find_nodes(op="call_function", target=INVOKE_SUBGRAPH) \
            if INVOKE_SUBGRAPH is not None else ():
        calls[node.args[0].target] = calls.get(node.args[0].target, 0) + 1
    return calls


def _fingerprint(gm: fx.GraphModule) -> str:
    """The layer of every collective, in order, over ``gm`` and its bodies: part of Inductor's
    cache key, since the graph's code does not show it and another tagging buckets otherwise."""
    graphs = [gm] + [getattr(gm, name) for name in _bodies(gm)]
    tags = [(n.name, _layer(n)) for g in graphs for n in g.graph.nodes if collective_op(n)]
    return hashlib.sha256(repr(tags).encode()).hexdigest()[:16]


def bucket_pass(gm: fx.GraphModule) -> tuple[Callable[[fx.Graph], None], tuple] | None:
    """The post-grad pass (and its cache key) that buckets ``gm``'s collectives (and its
    bodies') layer by layer with our cap, for ``compat.post_grad_pass``; None when bucketing
    is off."""
    cap = _cap_fn()
    if cap is None:
        return None

    def bucket(graph) -> None:
        compat.bucket_collectives(graph.owning_module, cap, _layer)
        drop_layout_copies_into_buckets(graph)

    return bucket, ("layer-buckets-3", cap.args[0], _fingerprint(gm))


def drop_layout_copies_into_buckets(graph: fx.Graph) -> int:
    """Feed each bucket's eager copy-in (``compat.eager_copy_in_ops``) the view a ``clone``
    made contiguous, not the clone; returns how many clones were dropped. Why: a collective
    over a tensor dim other than 0 is lowered as transpose, ``clone`` (contiguous), collective
    on dim 0; the copy-in reads the view's values in logical order whatever its strides, so the
    clone is a second copy, and one more generated kernel per shape. A clone read by anything
    else is kept."""
    ops = compat.eager_copy_in_ops()
    dropped: list[fx.Node] = []
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in ops]:
        inputs = list(node.args[0])
        for k, src in enumerate(inputs):
            if isinstance(src, fx.Node) and src.target is torch.ops.aten.clone.default \
                    and len(src.users) == 1 and isinstance(src.args[0], fx.Node):
                inputs[k] = src.args[0]
                dropped.append(src)
        if inputs != list(node.args[0]):
            node.args = (inputs, *node.args[1:])
            # the strides the merge traced (the clones'): Inductor would copy the views back
            # to them
            node.meta.pop("eager_input_vals", None)
    for clone in dict.fromkeys(dropped):  # (a clone fed twice to one bucket is dropped once)
        graph.erase_node(clone)
    return len(dropped)


def predicted_buckets(gm: fx.GraphModule) -> dict[str, list[int]]:
    """Per collective kind, the sizes (number of collectives merged) of the buckets Inductor
    will issue per call of ``gm``, the graph handed to it (a body's buckets once per call):
    what the ledger reports as issued. Reads the graph, changes nothing."""
    cap = _cap_fn()
    if cap is None:
        return {}
    out: dict[str, list[int]] = {}
    for graph, times in [(gm, 1), *((getattr(gm, b), n) for b, n in _bodies(gm).items())]:
        for kind, buckets in compat.find_buckets(graph, cap, _layer).items():
            out.setdefault(kind, []).extend(len(b) for b in buckets for _ in range(times))
    return out


def copy_shared_all_reduce_inputs(gm: fx.GraphModule) -> int:
    """With bucketing on, give every all_reduce whose input is also read elsewhere a private
    copy of it (``x * 1``); returns how many. Why: Inductor lowers an all_reduce bucket as
    ``cat`` then an in-place ``all_reduce_`` on the cat's buffer, and its cat lowering computes
    each input directly into its slot of that buffer. An input read elsewhere then aliases the
    bucket, and a reader scheduled after the collective sees the reduced sum (a SyncBN bias
    gradient reduce-scattered after its statistic was all-reduced came out 2x). The copy is the
    one living in the bucket; the original keeps its own buffer. ``clone`` would not do: Inductor
    removes it as a no-op before bucketing."""
    if _cap_fn() is None:
        return 0
    count = 0
    for node in list(gm.graph.nodes):
        if collective_op(node) != "all_reduce" or not isinstance(node.args[0], fx.Node):
            continue
        src = node.args[0]
        if len(src.users) < 2:
            continue
        with gm.graph.inserting_before(node):
            copy = gm.graph.call_function(torch.ops.aten.mul.Tensor, (src, 1))
        copy.meta = dict(src.meta)
        node.replace_input_with(src, copy)
        count += 1
    if count:
        gm.recompile()
    return count
