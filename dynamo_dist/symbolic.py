"""Symbolic sizes (``dynamic=True``, ``mark_dynamic``, Dynamo's automatic dynamic shapes).

A placement does not depend on a size, so a program whose batch or sequence length is
symbolic is planned once, on a copy of its global graph with every size at the value Dynamo
traced it with (its hint: ``hinted``), and lowered and compiled with the symbolic sizes kept:
one compile serves every size. What that needs, and ``split_symbolic`` checks, is that the
plan never splits a symbolic dim (Megatron tensor parallelism splits hidden and head dims,
which are static). A plan that does (data parallelism splits the batch) would need ``s // n``
and a divisibility guard; instead its sizes are guarded on the values traced (``specialise``) and
the program is compiled again as a static one: one compile per distinct shape, as with
``dynamic=False``. A block-strided split (``_StridedShard``) of a symbolic
dim is one of those: its split factor is a traced size.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from inductor_passes.sharding.placements import fmt, is_placements, is_split, is_strided
from inductor_passes.sharding.propagate import Plan

from . import _compat


def is_symbolic(gm: fx.GraphModule) -> bool:
    """Some value of ``gm`` has a symbolic size."""
    return any(_symbolic_value(n.meta.get("val")) for n in gm.graph.nodes)


def _symbolic_value(val: Any) -> bool:
    return any(isinstance(v, torch.SymInt) or
               (isinstance(v, torch.Tensor) and _compat.has_symbolic_shape(v))
               for v in pytree.tree_leaves(val))


def hinted(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with every size at its hint: tensors in ``meta["val"]`` become static
    fakes of the hinted shape and strides, and every use of a size node (``sym_size``, size
    arithmetic) becomes its hinted int, those nodes removed. Node names are kept, so a plan
    made on the copy is a plan of ``gm``. Reads hints only: no guard is added."""
    mode = _compat.FakeTensorMode(allow_non_fake_inputs=True)
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):  # a size: its uses read the hint
            env[node] = _compat.size_hint(val)
            continue
        new = graph.node_copy(node, lambda a: env[a])
        new.meta = dict(node.meta)
        if "val" in node.meta:
            new.meta["val"] = pytree.tree_map(lambda v: _hinted_value(v, mode), val)
        env[node] = new
    out = fx.GraphModule(gm, graph)
    return out


def _hinted_value(v: Any, mode) -> Any:
    if isinstance(v, torch.SymInt):
        return _compat.size_hint(v)
    if not isinstance(v, torch.Tensor) or not _compat.has_symbolic_shape(v) and \
            all(isinstance(s, int) for s in v.stride()):
        return v
    shape = [_compat.size_hint(s) for s in v.shape]
    stride = [_compat.size_hint(s) for s in v.stride()]
    with mode:
        t = torch.empty_strided(shape, stride, dtype=v.dtype, device=v.device)
    return t.requires_grad_(v.requires_grad)


def split_symbolic(gm: fx.GraphModule, plan: Plan) -> list[tuple[str, torch.SymInt]]:
    """Where ``plan`` splits a dim whose size is symbolic in ``gm`` (and not a multiple of
    the product of the mesh axis sizes splitting it, whatever its symbols are): per value (its output placement, or a
    placement an op asks of an input) a line saying so and that size; empty when it never
    does."""
    found = []

    def check(node: fx.Node, val: Any, pls, what: str) -> None:
        if not isinstance(val, torch.Tensor) or not is_placements(pls):
            return
        for axis, p in enumerate(pls):
            size = val.shape[p.dim] if is_split(p) else None
            if size is None or _compat.static_size(size) is not None:
                continue
            # A symbolic size with a static factor the axes splitting it divide (heads x
            # batch: 4*s0 over 2) splits exactly into 2*s0 pieces. Not as a _StridedShard:
            # its split factor was read off the traced sizes (heads split inside batch x
            # heads: the batch size).
            n = math.prod(plan.mesh_shape[a] for a, q in enumerate(pls)
                          if is_split(q) and q.dim == p.dim)
            if is_strided(p) or _compat.static_size(size % n) != 0:
                found.append((f"{what} {node.name} {tuple(val.shape)} as {fmt(pls)}", size))
                return

    for node in gm.graph.nodes:
        np = plan.nodes.get(node.name)
        if np is None:
            continue
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)) and isinstance(np.output, (tuple, list)) and \
                not is_placements(np.output):
            for v, p in zip(val, np.output):
                check(node, v, p, "value")
        else:
            check(node, val, np.output, "value")
        targs = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        for a, req in zip(targs, np.inputs):
            check(a, a.meta["val"], req, f"input of {node.name}:")
    return found


def specialise(gm: fx.GraphModule) -> None:
    """Guard every symbolic size of ``gm``'s inputs on the value it was traced with: Dynamo
    recompiles when one changes, and the program is compiled again as a static one (the path
    every static shape takes). ``gm``: the global graph, whose inputs' sizes name every symbol.
    Fixing only the split sizes would keep the others symbolic, but leaves constant SymInts
    throughout the graph, which tracing trips over; it is not done yet."""
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        for d in (val.shape if isinstance(val, torch.Tensor) else ()):
            if isinstance(d, torch.SymInt) and _compat.static_size(d) is None:
                _compat.guard_equal(d, _compat.size_hint(d))


def fix_guarded_sizes(gm: fx.GraphModule) -> None:
    """Where a guard has fixed a symbolic size (one the lowering's trace added, say), write it
    as the number in every value of ``gm`` (``meta["val"]``): the later stages then see an int,
    as in a static program, and never trace arithmetic on a constant SymInt (make_fx has no
    proxy for one)."""
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["val"] = pytree.tree_map(_fixed_value, node.meta["val"])


def _fixed_value(v: Any) -> Any:
    if isinstance(v, torch.SymInt):
        n = _compat.static_size(v)
        return v if n is None else n
    if not isinstance(v, torch.Tensor) or getattr(v, "fake_mode", None) is None:
        return v
    shape = [_compat.static_size(s) if _compat.static_size(s) is not None else s
             for s in v.shape]
    stride = [_compat.static_size(s) if _compat.static_size(s) is not None else s
              for s in v.stride()]
    if all(a is b for a, b in zip(shape, v.shape)) and \
            all(a is b for a, b in zip(stride, v.stride())):
        return v
    with v.fake_mode:
        t = torch.empty_strided(shape, stride, dtype=v.dtype, device=v.device)
    return t.requires_grad_(v.requires_grad)
