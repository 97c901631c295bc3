"""Symbolic sizes (``dynamic=True``, ``mark_dynamic``, Dynamo's automatic dynamic shapes).

A placement does not depend on a size, so a program whose batch or sequence length is
symbolic is planned once, on a copy of its global graph with every size at the value Dynamo
traced it with (its hint: ``hinted``), and lowered and compiled with the symbolic sizes kept:
one compile serves every size. A dim the plan splits must split into equal pieces whatever
its size: ``split_symbolic`` allows a static multiple of the axes splitting it (heads x
batch, ``4*s0`` over 2) and guards a plain symbolic size a multiple of them (a data-parallel
batch: an odd batch then fails the guard and recompiles). Where that cannot hold (the size
traced is not a multiple, or a block-strided ``_StridedShard`` whose split factor is a traced
size), every input size is guarded on its traced value (``specialise``) and the program is
compiled again as a static one, as with ``dynamic=False``.

The local program of a plan that splits a symbolic input dim takes pieces of size ``s / n``;
``LocalSizes`` rewrites the global graph in symbols of a ShapeEnv of its own where each such
piece is a symbol, and carries the guards the local trace and Inductor add back to Dynamo.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from inductor_passes.core import compat
from inductor_passes.core.placements import fmt, is_placements, is_split, is_strided
from inductor_passes.sharding.propagate import Plan


def is_symbolic(gm: fx.GraphModule) -> bool:
    """Some value of ``gm`` has a symbolic size."""
    return any(_symbolic_value(n.meta.get("val")) for n in gm.graph.nodes)


def _symbolic_value(val: Any) -> bool:
    return any(isinstance(v, torch.SymInt) or
               (isinstance(v, torch.Tensor) and compat.has_symbolic_shape(v))
               for v in pytree.tree_leaves(val))


def hinted(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with every size at its hint: tensors in ``meta["val"]`` become static
    fakes of the hinted shape and strides, and every use of a size node (``sym_size``, size
    arithmetic) becomes its hinted int, those nodes removed. Node names are kept, so a plan
    made on the copy is a plan of ``gm``. Reads hints only: no guard is added."""
    mode = compat.FakeTensorMode(allow_non_fake_inputs=True)
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):  # a size: its uses read the hint
            env[node] = compat.size_hint(val)
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
        return compat.size_hint(v)
    if not isinstance(v, torch.Tensor) or not compat.has_symbolic_shape(v) and \
            all(isinstance(s, int) for s in v.stride()):
        return v
    shape = [compat.size_hint(s) for s in v.shape]
    stride = [compat.size_hint(s) for s in v.stride()]
    with mode:
        t = torch.empty_strided(shape, stride, dtype=v.dtype, device=v.device)
    return t.requires_grad_(v.requires_grad)


def split_symbolic(gm: fx.GraphModule, plan: Plan) -> list[tuple[str, torch.SymInt]]:
    """Where ``plan`` splits a dim whose size is symbolic in ``gm`` into pieces that may
    differ: per value (its output placement, or a placement an op asks of an input) a line
    saying so and that size; empty when it never does. A size that is a static multiple of
    the product of the mesh axis sizes splitting it passes; one that was traced at a multiple
    passes and is guarded a multiple from here on (a Dynamo guard: another size recompiles)."""
    found = []

    def check(node: fx.Node, val: Any, pls, what: str) -> None:
        if not isinstance(val, torch.Tensor) or not is_placements(pls):
            return
        for axis, p in enumerate(pls):
            size = val.shape[p.dim] if is_split(p) else None
            if size is None or compat.static_size(size) is not None:
                continue
            # A symbolic size with a static factor the axes splitting it divide (heads x
            # batch: 4*s0 over 2) splits exactly into 2*s0 pieces. Not as a _StridedShard:
            # its split factor was read off the traced sizes (heads split inside batch x
            # heads: the batch size).
            n = math.prod(plan.mesh_shape[a] for a, q in enumerate(pls)
                          if is_split(q) and q.dim == p.dim)
            if compat.static_size(size % n) == 0:
                continue
            # a batch split over data parallelism: even pieces of size // n while the size is
            # a multiple of n (guarded: another size recompiles); uneven ones are not planned
            # symbolically (their pieces differ per rank)
            if not is_strided(p) and compat.size_hint(size) % n == 0:
                compat.guard_divisible(size, n)
                continue
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


class LocalSizes:
    """The global graph again, its sizes written in symbols of a ShapeEnv of its own, so that
    a dim the plan splits at an input is a symbol of its LOCAL size: a data-parallel batch
    ``s`` split over ``n`` ranks becomes ``n * b``, and each rank's piece has size ``b``.
    Lowering traces the local program on this copy (``graph``): its inputs then have sizes
    Inductor can bind (it binds a symbol from a size that is one, never from ``s // n``), and
    no op meets a tensor sized by a floor division (``constant_pad_nd``'s fake kernel then
    fixed the size). ``s`` is guarded a multiple of ``n`` (``split_symbolic``).

    Guards the local trace and Inductor add are on the local symbols; ``add_guards`` writes
    each into Dynamo's ShapeEnv with ``b = s // n`` (and the range a new symbol assumes,
    ``b >= 2``), so Dynamo re-checks them on every call as it would its own."""

    def __init__(self, gm: fx.GraphModule, plan: Plan) -> None:
        self.mode = compat.fresh_size_env()
        self._local: dict = {}  # Dynamo's symbol -> expression in local symbols
        self._back: dict = {}  # local symbol -> expression in Dynamo's symbols
        self._bounds: list = []  # Dynamo-side facts each local symbol assumes
        self._global: torch.SymInt | None = None  # any size of Dynamo's ShapeEnv
        self._seen = 0
        splits = _input_splits(gm, plan)
        self._taken = {sym for node in gm.graph.find_nodes(op="placeholder")
                       for v in _sizes_of(node.meta.get("val")) for sym in v.node.expr.free_symbols}
        for node in gm.graph.find_nodes(op="placeholder"):
            for size in _sizes_of(node.meta.get("val")):
                self._global = self._global or size
                for sym in size.node.expr.free_symbols:
                    if sym not in self._local:
                        self._add(sym, splits.get(sym))
        self.graph = self._copy(gm)

    def _add(self, sym, split: tuple[torch.SymInt, int] | None) -> None:
        if split is None:  # not split at an input: a local symbol for the same size
            hint = compat.size_hint(compat.symbol_size(self._global, sym))
            local = self._new(hint, str(sym))
            self._local[sym] = _expr(local)
            self._record(local, sym)
            return
        size, n = split
        local = self._new(compat.size_hint(size) // n, f"{sym}//{n}")
        self._local[sym] = n * _expr(local)
        self._record(local, (size // n).node.expr)

    def _new(self, hint: int, name: str):
        """A local symbol named unlike any of Dynamo's (a symbol's name comes from a hash of
        its source's, and sympy compares symbols by name)."""
        for k in range(16):
            local = compat.new_size(self.mode, hint, f"{name}#{k}")
            if isinstance(local, int) or _expr(local) not in self._taken:
                return local
        raise AssertionError(f"no local symbol for {name} unlike Dynamo's")

    def _record(self, local, global_expr) -> None:
        import sympy

        if isinstance(local, int):  # specialised (0 or 1): the global size is fixed with it
            compat.add_size_guard(self._global, sympy.Eq(global_expr, local))
        else:
            self._back[_expr(local)] = global_expr
            self._bounds.append(sympy.Ge(global_expr, 2))

    def size(self, v: Any) -> Any:
        """``v`` (a size of Dynamo's ShapeEnv) in local symbols; anything else as it is."""
        v = compat.fixed_size(v)
        if not isinstance(v, torch.SymInt):
            return v
        return compat.size_of_expr(self.mode, v.node.expr.xreplace(self._local),
                                    compat.size_hint(v))

    def _value(self, v: Any) -> Any:
        if isinstance(v, torch.SymInt):
            return self.size(v)
        if not isinstance(v, torch.Tensor) or getattr(v, "fake_mode", None) is None:
            return v
        with self.mode:
            t = torch.empty_strided([self.size(d) for d in v.shape],
                                    [self.size(d) for d in v.stride()],
                                    dtype=v.dtype, device=v.device)
        return t.requires_grad_(v.requires_grad)

    def _copy(self, gm: fx.GraphModule) -> fx.GraphModule:
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for node in gm.graph.nodes:
            new = graph.node_copy(node, lambda a: env[a])
            new.meta = dict(node.meta)
            if "val" in node.meta:
                new.meta["val"] = pytree.tree_map(self._value, node.meta["val"])
            env[node] = new
        return fx.GraphModule(gm, graph)

    def add_guards(self) -> None:
        """Write the guards the local symbols gathered since the last call into Dynamo's
        ShapeEnv (each holds at the traced sizes)."""
        if self._global is None:
            return
        new = compat.size_guards(self.mode)[self._seen:]
        self._seen += len(new)
        for expr in [*self._bounds, *new]:
            compat.add_size_guard(self._global, expr.xreplace(self._back))
        self._bounds = []


def _sizes_of(val: Any) -> list[torch.SymInt]:
    """The symbolic sizes and strides of a placeholder's value."""
    sizes = [*val.shape, *val.stride()] if isinstance(val, torch.Tensor) else [val]
    return [v for v in sizes if isinstance(v, torch.SymInt) and compat.static_size(v) is None]


def _expr(size: "torch.SymInt | int"):
    import sympy

    return sympy.Integer(size) if isinstance(size, int) else size.node.expr


def _input_splits(gm: fx.GraphModule, plan: Plan) -> dict:
    """Per symbol that is a whole input dim ``plan`` splits: (that size, the number of
    pieces), the first such dim's."""
    out: dict = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        val, pls = node.meta.get("val"), plan.placement(node.name)
        if not isinstance(val, torch.Tensor) or not is_placements(pls):
            continue
        for d, size in enumerate(val.shape):
            n = math.prod(plan.mesh_shape[a] for a, p in enumerate(pls)
                          if is_split(p) and p.dim == d)
            if n > 1 and isinstance(size, torch.SymInt) and size.node.expr.is_symbol:
                out.setdefault(size.node.expr, (size, n))
    return out


def specialise(gm: fx.GraphModule) -> None:
    """Guard every symbolic size of ``gm``'s inputs on the value it was traced with: Dynamo
    recompiles when one changes, and the program is compiled again as a static one (the path
    every static shape takes). ``gm``: the global graph, whose inputs' sizes name every symbol.
    Fixing only the split sizes would keep the others symbolic, but leaves constant SymInts
    throughout the graph, which tracing trips over; it is not done yet."""
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        for d in (val.shape if isinstance(val, torch.Tensor) else ()):
            if isinstance(d, torch.SymInt) and compat.static_size(d) is None:
                compat.guard_equal(d, compat.size_hint(d))


def fix_guarded_sizes(gm: fx.GraphModule) -> None:
    """Where a guard has fixed a symbolic size (one the lowering's trace added, say), write it
    as the number in every value of ``gm`` (``meta["val"]``): the later stages then see an int,
    as in a static program, and never trace arithmetic on a constant SymInt (make_fx has no
    proxy for one)."""
    for node in gm.graph.nodes:
        # a value with no SymInt is left as it is (a static program: every one; the tree_map
        # over 8k nodes was a second of a 32-layer capture)
        if "val" in node.meta and not _all_ints(node.meta["val"]):
            node.meta["val"] = pytree.tree_map(_fixed_value, node.meta["val"])


def _all_ints(val: Any) -> bool:
    """``val`` holds no SymInt: no symbolic number, no tensor with a symbolic size, stride or
    offset."""
    for v in pytree.tree_leaves(val):
        if isinstance(v, torch.Tensor):
            if v.layout is not torch.strided or not all(
                    type(s) is int for s in (*v.shape, *v.stride(), v.storage_offset())):
                return False  # (a sparse value has no strides: the general path)
        elif isinstance(v, torch.SymInt):
            return False
    return True


def _fixed_value(v: Any) -> Any:
    if not isinstance(v, torch.Tensor) or getattr(v, "fake_mode", None) is None:
        return compat.fixed_size(v)
    shape = [compat.fixed_size(s) for s in v.shape]
    stride = [compat.fixed_size(s) for s in v.stride()]
    if all(a is b for a, b in zip(shape, v.shape)) and \
            all(a is b for a, b in zip(stride, v.stride())):
        return v
    with v.fake_mode:
        t = torch.empty_strided(shape, stride, dtype=v.dtype, device=v.device)
    return t.requires_grad_(v.requires_grad)
