"""One save/recompute choice for every copy of a repeated layer, so their backwards can share a
compiled body (``outline``).

The min-cut partitioner picks, per forward value, whether the backward reads it saved or
recomputes it. Its edge weights grow with a value's distance from the backward (1.1 ** distance),
so between two cuts of equal bytes the first layer of a stack can choose differently from the
others: on the demo Llama, layer 0 saved its attention's all-reduced output and recomputed the
residual sum from it, where layers 1-3 saved the sum (same bytes). Its backward then differs and
is compiled inline, a fourth of the backward's kernels.

``align_saves`` reads the first partition: per group of layers whose forward parts are the same
computation (``outline``'s signature), the save pattern most layers took; in a layer that
differs, each value that pattern saves is marked ``MUST_SAVE`` (the partitioner's own checkpoint
tag), and the caller partitions again. Only saves are forced, never recomputes (a collective
cannot be recomputed): a minority layer ends with the majority's saves, which make its own extra
saves unneeded, so the min-cut drops them.
"""

from __future__ import annotations

import collections
import logging

import torch.fx as fx

from . import outline
from .core import compat

log = logging.getLogger(__name__)


def align_saves(joint: fx.GraphModule, fw: fx.GraphModule, num_fwd_outputs: int) -> int:
    """Mark ``MUST_SAVE`` on the nodes of ``joint`` (the joint graph ``fw`` was partitioned
    from, names shared) that a minority layer did not save where the other copies of its layer
    did. Returns how many were marked: 0 when every group of layers already agrees (the caller
    then keeps its partition)."""
    out = next(iter(fw.graph.find_nodes(op="output"))).args[0]
    saved = {a.name for a in out[num_fwd_outputs:] if isinstance(a, fx.Node)}
    groups = outline.instances(joint, lambda n: n.meta.get("partitioner_tag") == "is_forward")
    marked = 0
    for group in groups.values():
        layers = [inst.nodes for inst in group]
        patterns = [tuple(n.name in saved for n in nodes) for nodes in layers]
        counts = collections.Counter(patterns)
        if len(counts) < 2:
            continue
        # the most common pattern; a tie goes to the later layers' (the first is the odd one)
        majority = max(counts, key=lambda p: (counts[p], -patterns[::-1].index(p)))
        for nodes, pattern in zip(layers, patterns):
            for node, want, have in zip(nodes, majority, pattern):
                if want and not have:
                    compat.mark_must_save(node)
                    marked += 1
    if marked:
        log.debug("dynamo_dist: %d values marked saved to give repeated layers one backward",
                  marked)
    return marked
