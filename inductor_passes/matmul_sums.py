"""Fold a sum of matmul outputs into ``addmm`` chains, in the graphs Inductor compiles.

A value read by several linear layers gets its gradient as a sum of matmuls: the input of q, k
and v (or gate and up) projections receives ``mm_q + mm_k + mm_v``. Under tensor parallelism
that sum is a partial sum reduced by one all_reduce, and the all_reduce needs it materialised:
Inductor then generates an add kernel (one more C++ or Triton kernel to compile, and one more
pass over the tensor each step) that DTensor, all-reducing each matmul on its own, does not
need. ``addmm(a, x, y)`` computes ``a + x @ y`` in the matmul's own epilogue (BLAS's
``beta = 1``), so ``add(mm_1, mm_2)`` becomes ``addmm(mm_1, x_2, y_2)`` and the add kernel
disappears. Only matmuls whose one use is the sum are absorbed (nothing is computed twice), and
only sums of operands of one dtype and the add's own shape (no broadcast, no type promotion),
of static shapes (a dynamic batch keeps its add).

Runs as part of Inductor's post-grad custom pass (``compile._inductor``), on every graph
Inductor compiles, shared layer bodies included.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from inductor_passes.core import compat

aten = torch.ops.aten
_MATMULS = (aten.mm.default, aten.addmm.default)
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
UUID = "matmul-sums-1"  # change whenever ``fold`` would rewrite a graph differently


def _val(node) -> torch.Tensor | None:
    """``node``'s fake value when it is a tensor of static shape (comparing symbolic sizes
    would add guards this late), else None."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor) or not all(isinstance(d, int) for d in val.shape):
        return None
    return val


def _matmul_2d(node: fx.Node) -> fx.Node | None:
    """The 2-D matmul (``mm``/``addmm``) ``node`` is, or is a view of; else None."""
    if node.target in _VIEWS and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node if node.op == "call_function" and node.target in _MATMULS else None


def _absorbable(node: fx.Node, add: fx.Node) -> fx.Node | None:
    """The ``mm`` behind ``node`` when its only use is ``add`` (through at most one view that
    has no other use either): it can become ``add``'s ``addmm``."""
    mm = _matmul_2d(node)
    if mm is None or mm.target is not aten.mm.default or len(mm.users) != 1:
        return None
    if node is not mm and len(node.users) != 1:
        return None
    return mm


def fold(graph: fx.Graph) -> int:
    """Rewrite each ``add(a, b)`` of two matmul outputs (either possibly viewed to the add's
    shape) as ``addmm(a, x, y)``, viewed back to the add's shape, where ``b = mm(x, y)`` has
    no other use; returns how many adds were folded. Chains fold in graph order:
    ``(mm_1 + mm_2) + mm_3`` becomes ``addmm(addmm(mm_1, x_2, y_2), x_3, y_3)``."""
    folded = 0
    for add in list(graph.nodes):
        if add.op != "call_function" or add.target is not aten.add.Tensor or add.kwargs \
                or len(add.args) != 2:
            continue
        out = _val(add)
        vals = [_val(a) for a in add.args]
        if out is None or any(v is None or v.shape != out.shape or v.dtype != out.dtype
                              for v in vals):
            continue
        for k in (1, 0):  # absorb the right operand when both could go
            mm, other = _absorbable(add.args[k], add), _matmul_2d(add.args[1 - k])
            if mm is None or other is None or other is mm:
                continue
            mm_val, other_val = _val(mm), _val(other)
            operands = [_val(a) for a in mm.args]
            if mm_val is None or other_val is None or any(v is None for v in operands) \
                    or other_val.shape != mm_val.shape or other_val.dtype != mm_val.dtype \
                    or not other_val.is_contiguous():
                continue
            fake = compat.detect_fake_mode([mm_val])
            if fake is None:  # Inductor's graphs carry fake values; anything else is left
                continue
            with graph.inserting_before(add):
                addmm = graph.call_function(aten.addmm.default, (other, *mm.args))
                result = addmm if tuple(out.shape) == tuple(mm_val.shape) else \
                    graph.call_function(aten.view.default, (addmm, list(out.shape)))
            with fake:
                addmm.meta["val"] = aten.addmm.default(other_val, *operands)
                if result is not addmm:
                    result.meta["val"] = addmm.meta["val"].view(out.shape)
            if "stack_trace" in add.meta:  # the user's line, for Inductor's comments
                for node in (addmm, result):
                    node.meta["stack_trace"] = add.meta["stack_trace"]
            add.replace_all_uses_with(result)
            dead = [add, add.args[k]] + ([mm] if add.args[k] is not mm else [])
            for node in dead:
                if not node.users:
                    graph.erase_node(node)
            folded += 1
            break
    return folded
