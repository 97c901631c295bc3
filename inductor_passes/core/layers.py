"""Which numbered layer of the model made a graph node, read off its ``nn_module_stack``.

Outlining, bucketing and prefetching group a graph's nodes by layer (``outline``), and the planner
re-plans jointly only the code outside every layer (``sharding.propagate``); all read it here.
"""

from __future__ import annotations

import re

import torch.fx as fx

# the first numbered entry of a module path: ".3", "[3]" or "['3']" (ModuleList, Sequential)
_INDEX = re.compile(r"\.(\d+)(?=\.|\[|$)|\[(\d+)\]|\['(\d+)'\]")
# the compiled frame's own source that a path starts with (``L['args'][0]``, ``G['model']``):
# its subscripts are Python arguments, not module lists
_ROOT = re.compile(r"^[LG]\[[^\]]*\](?:\[[^\]]*\])*")


def layer_of(node: fx.Node) -> tuple[str, int] | None:
    """(family, index) of the numbered module that made ``node``, from its ``nn_module_stack``
    (the innermost entry's path, first numbered component); None for code outside any."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1]
    path = str(path[0] if isinstance(path, tuple) else path)
    root = _ROOT.match(path)
    for m in _INDEX.finditer(path, root.end() if root else 0):
        if path[:m.start()].endswith("__"):
            continue  # a Python attribute's item (``forward.__closure__[2]``), not a module list
        return path[:m.start()], int(next(g for g in m.groups() if g is not None))
    return None
