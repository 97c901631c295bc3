"""Lowering each distinct repeated layer once: the other layers' local nodes are copies of it.

Lowering re-runs the global joint graph node by node under ``make_fx`` (about a millisecond a
node: the op on local fakes, the redistributes, make_fx's own bookkeeping), so its time grew
with the layer count (7.9 s of a 32-layer Llama's compile against 0.6 s at 2 layers). Layers
that are the same program under the same plan lower to the same local nodes: here the first of
them (the representative) is lowered as before and recorded, and each other one is stamped: the
representative's local nodes are copied into the trace with this layer's inputs, fresh fake
values (aliasing as the representative's do) and this layer's own node metadata (module stack,
stack trace, recompute tags: what outlining, the partitioner and error messages read).

Two segments (one layer's forward nodes, or its backward nodes) match when outlining's
``_signature`` says they compute the same function of inputs with the same global layouts
(``outline.instances``) AND the plan gives every node and every input the same placements and
rule. The stamp is exact only if the flat lowering would have made the same nodes, which the
redistribute cache can break: a value both layers read (rotary tables) is moved once, by the
first; a copy reuses that node, as the flat lowering hits the cache. So a segment is stamped
only when, for every (value, placement) its representative asked the cache for, the cache
holds the layer's own key exactly where the representative's held it; otherwise, or when the
segment is not contiguous in the graph, reads a value outside its inputs, or its local layout
differs, it is lowered node by node as before. ``DYNAMO_DIST_STAMP=0`` turns copying off
(``tests/test_stamp.py`` compares both local graphs node for node).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .core import compat
from .core.ledger import CollectiveEntry
from .core.errors import user_source
from .core.switches import switch
from .outline import _Instance, instances

log = logging.getLogger("dynamo_dist.stamp")

_META_FIELDS = (*compat.TRACED_META_FIELDS, "stack_trace", "seq_nr", "is_gradient_acc",
                "autograd_backward")


def enabled() -> bool:
    """``DYNAMO_DIST_STAMP`` (default on; 0: lower every layer node by node). ValueError for
    another value."""
    return switch("DYNAMO_DIST_STAMP", "copy repeated layers",
                  "lower every layer node by node")


def segments(gm: fx.GraphModule, plan, backward: set[fx.Node]
             ) -> dict[fx.Node, tuple[_Instance, _Instance]]:
    """First node of each segment that may be stamped -> (segment, its representative): the
    first segment in graph order of the same program, plan and input placements. Forward and
    backward nodes of a layer (before and after the first node that reads a tangent) are
    separate segments. Contiguous segments only (nothing else is lowered between their first
    and last node)."""
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    lowered = [n for n in gm.graph.nodes if n.op == "call_function"]
    position = {n: k for k, n in enumerate(lowered)}
    # the backward region starts at the first node that reads a tangent: a layer's weight
    # transposes for its backward matmuls read no tangent but lie there, next to their users
    start = min((order[n] for n in backward if n.op == "call_function"), default=len(order))
    out: dict[fx.Node, tuple[_Instance, _Instance]] = {}
    for part in (lambda n: order[n] < start, lambda n: order[n] >= start):
        for group in instances(gm, part).values():
            reps: dict[Any, _Instance] = {}
            for inst in sorted(group, key=lambda i: order[i.nodes[0]]):
                if position[inst.nodes[-1]] - position[inst.nodes[0]] + 1 != len(inst.nodes):
                    continue
                try:
                    key = _plan_key(plan, inst)
                except KeyError:  # a node the plan does not cover (a size)
                    continue
                rep = reps.setdefault(key, inst)
                out[inst.nodes[0]] = (inst, rep)
    return out


def _plan_key(plan, inst: _Instance) -> tuple:
    nodes = tuple((plan.nodes[n.name].inputs, plan.nodes[n.name].output,
                   repr(plan.nodes[n.name].source)) for n in inst.nodes)
    return nodes, tuple(plan.placement(x.name) for x in inst.inputs)


@dataclasses.dataclass
class _Recording:
    """What lowering the representative made: its local nodes in order, the global node each
    was made for, the cache keys it read first (and whether they were there), the cache keys
    it added and the local nodes of each, and its ledger entries with the (moved value,
    consumer) of each. ``usable`` is False where a copy could not be exact (``_finish``)."""

    inst: _Instance
    cache_keys: set  # the cache's keys when it began (emptied at its end)
    made_for: dict[fx.Node, fx.Node] = dataclasses.field(default_factory=dict)
    first_reads: dict[tuple, bool] = dataclasses.field(default_factory=dict)
    local: list[fx.Node] = dataclasses.field(default_factory=list)
    added: list[tuple] = dataclasses.field(default_factory=list)
    moves: dict[tuple, list[fx.Node]] = dataclasses.field(default_factory=dict)
    entries: list[tuple[CollectiveEntry, fx.Node | None, fx.Node]] = dataclasses.field(
        default_factory=list)
    usable: bool = True


class NotStamped(Exception):
    """This segment is lowered node by node (the reason is the message)."""


class LayerStamper:
    """Drives stamping from lowering's loop: ``before(node)`` returns True when ``node`` was
    lowered by a stamp (skip it), ``after(node)`` follows each node lowered normally, and
    ``read(key, hit)`` / ``entry(...)`` are told of each cache read and ledger entry."""

    def __init__(self, segs: dict[fx.Node, tuple[_Instance, _Instance]], env: dict,
                 cache: dict, ledger, fake_mode, direct: Callable[[fx.Node, Any], bool]):
        self.segs, self.env, self.cache, self.ledger = segs, env, cache, ledger
        self.direct = direct  # lowering moves the value itself (not a re-indexed source)
        self.fake_mode = fake_mode
        self.tracer = compat.proxy_tracer()
        self.recordings: dict[int, _Recording] = {}
        self.recording: _Recording | None = None
        self.done: set[fx.Node] = set()
        self.mark: fx.Node | None = None
        self.stamped = self.lowered = 0

    # --- recording the representative -------------------------------------------------------
    def _last(self) -> fx.Node:
        return _last(self.tracer)

    def before(self, node: fx.Node) -> bool:
        if node in self.done:
            return True
        seg = self.segs.get(node)
        if seg is not None and self.recording is None:
            inst, rep = seg
            if inst is rep:
                self.recording = _Recording(inst, set(self.cache))
            else:
                rec = self.recordings.get(id(rep))
                if rec is not None and rec.usable:
                    try:
                        with compat.untraced():  # our own tensor code: not the program's
                            self._stamp(rec, inst)
                        self.done.update(inst.nodes)
                        self.stamped += 1
                        return True
                    except NotStamped as why:
                        log.debug("dynamo_dist: %s lowered node by node: %s",
                                  inst.nodes[0].name, why)
                self.lowered += 1
        self.mark = self._last() if self.recording is not None else None
        return False

    def after(self, node: fx.Node) -> None:
        rec = self.recording
        if rec is None:
            return
        n = self.mark.next
        while n is not self.mark and n.op != "root":
            rec.made_for[n] = node
            n = n.next
        if node is rec.inst.nodes[-1]:
            self._finish(rec)
            self.recording = None

    def mark_move(self) -> fx.Node | None:
        """Call before making the redistribute of a cache key; hand the result to made_move."""
        return self._last() if self.recording is not None else None

    def made_move(self, key: tuple, mark: fx.Node | None) -> None:
        """The local nodes made since ``mark`` compute the cache entry ``key``."""
        if self.recording is None or mark is None:
            return
        self.recording.moves.setdefault(key, []).extend(_made_after(mark))

    def read(self, key: tuple, hit: bool) -> None:
        if self.recording is not None:
            self.recording.first_reads.setdefault(key, hit)

    def entry(self, e: CollectiveEntry, value: fx.Node | None, consumer: fx.Node) -> None:
        self.ledger.add(e)
        if self.recording is not None:
            self.recording.entries.append((e, value, consumer))

    def _finish(self, rec: _Recording) -> None:
        rec.local = [n for n in rec.made_for]
        rec.added = [k for k in self.cache if k not in rec.cache_keys]
        rec.cache_keys = set()
        domain = set(rec.inst.nodes) | set(rec.inst.inputs)
        for n in rec.local:
            if not _plain_value(n.meta.get("val")):
                rec.usable = False
        if any(k[0] not in domain for k in rec.first_reads):
            rec.usable = False  # a value moved upstream of the inputs (through a re-indexing)
        self.recordings[id(rec.inst)] = rec

    # --- stamping another segment -----------------------------------------------------------
    def _stamp(self, rec: _Recording, inst: _Instance) -> None:
        """Copy ``rec``'s local nodes for ``inst``; raises NotStamped (before touching the
        trace) where the copy could differ from lowering ``inst`` node by node."""
        R = rec.inst
        gmap: dict[fx.Node, fx.Node] = dict(zip(R.nodes, inst.nodes))
        gmap.update(zip(R.inputs, inst.inputs))
        lmap: dict[fx.Node, fx.Node] = {}   # the representative's local node -> this layer's
        shared: set[fx.Node] = set()         # local nodes both read (the copy reuses them)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (representative's, this layer's)
        objs: dict[fx.Node, Any] = {}  # this layer's local node -> the value make_fx tracks
        for x, y in zip(R.inputs, inst.inputs):
            vx, vy = self.env.get(x), self.env.get(y)
            if x is y:
                if isinstance(vx, torch.Tensor):
                    shared.add(self._node(vx))
                    pairs.append((vx, vx))
                continue
            if not (_fake(vx) and _fake(vy)):  # a constant: its values are not in the signature
                raise NotStamped(f"input {y.name} is not one traced (fake) tensor")
            if _layout(vx) != _layout(vy):
                raise NotStamped(f"input {y.name} has another local layout")
            lmap[self._node(vx)] = self._node(vy)
            pairs.append((vx, vy))
            objs[lmap[self._node(vx)]] = vy
        reused: set[fx.Node] = set()
        for (a, req), hit in rec.first_reads.items():
            b = gmap[a]
            if b is a:
                # a value both read: the flat lowering finds its move in the cache, made before
                # or by the representative (whose nodes for it are then reused, not copied)
                reused.update(rec.moves.get((a, req), ()))
                shared.add(self._node(self.cache[(a, req)]))
                pairs.append((self.cache[(a, req)], self.cache[(a, req)]))
                continue
            if ((b, req) in self.cache) != hit:
                raise NotStamped(f"the move of {b.name} to {req} is cached differently")
            if self.direct(a, req) != self.direct(b, req):  # e.g. an input that is a view
                raise NotStamped(f"{b.name} would be moved otherwise (through what it "
                                  f"re-indexes, or not)")
            if hit:
                ra, rb = self.cache[(a, req)], self.cache[(b, req)]
                lmap[self._node(ra)] = self._node(rb)
                objs[lmap[self._node(ra)]] = rb
                pairs.append((ra, rb))
        inside = set(rec.local)
        fakes = FakeCopier(self.fake_mode, pairs)
        vals: dict[fx.Node, Any] = {}
        with fakes.batch():
            for n in rec.local:  # dry run: nothing is added to the trace before every check
                ins = n.all_input_nodes  # passed
                for a in ins:
                    if a not in inside and a not in lmap and a not in shared:
                        raise NotStamped(f"{n.name} reads {a.name}, made outside the segment")
                if n.op == "get_attr" or n in reused:  # a constant, a move of a shared value
                    reused.add(n)
                    fakes.keep(n.meta.get("val"))
                    continue
                vals[n] = fakes.copy(n.meta.get("val"))
        self._emit(rec, gmap, lmap, reused, vals, objs, self._exported(rec, inst))

    def _exported(self, rec: _Recording, inst: _Instance) -> set[fx.Node]:
        """The representative's local nodes whose copies lowering may read after the stamp:
        the values of the global nodes ``inst`` hands to a node outside it, and every move
        the representative cached. Only these are tracked by make_fx (a tracked value is
        snapshot and registered: about 20 us a node); the others are read by copies only,
        through the node map."""
        members = set(inst.nodes)
        values = [self.env[a] for a, b in zip(rec.inst.nodes, inst.nodes)
                  if any(u not in members for u in b.users)]
        values += [self.cache[k] for k in rec.added]
        return {self._node(t) for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor)}

    def _emit(self, rec: _Recording, gmap: dict, lmap: dict, reused: set, vals: dict,
              objs: dict, exported: set[fx.Node]) -> None:
        tracer = self.tracer
        for n in rec.local:
            if n in reused:
                lmap[n] = n
                continue
            args, kwargs = fx.map_arg((n.args, n.kwargs), lambda a: lmap.get(a, a))
            src = gmap[rec.made_for[n]]  # this layer's global node the copy stands for
            meta = {k: v for k, v in n.meta.items()
                    if k not in _META_FIELDS and k not in ("val", "tensor_meta")}
            for k in _META_FIELDS:
                if k in src.meta and k != "seq_nr":
                    meta[k] = src.meta[k] if k == "stack_trace" else copy.copy(src.meta[k])
            lmap[n] = new = place(tracer, n, args, kwargs, vals[n], meta,
                                  track=n in exported)
            objs[new] = vals[n]

        def mapped(t: torch.Tensor) -> torch.Tensor:
            # by node: make_fx keeps a detached snapshot in meta["val"], not the tracked value
            node = self._node(t)
            if node not in lmap or lmap[node] is node:
                return t
            return objs[lmap[node]]

        for a in rec.inst.nodes:
            self.env[gmap[a]] = pytree.tree_map_only(torch.Tensor, mapped, self.env[a])
        for a, req in rec.added:  # every key read is in the segment or an input (_finish)
            if gmap[a] is not a:
                self.cache[(gmap[a], req)] = mapped(self.cache[(a, req)])
        for e, value, consumer in rec.entries:
            if value is not None and gmap[value] is value:
                continue  # the flat lowering reads this move from the cache
            c = gmap[consumer]
            cause = e.cause if value is None else \
                e.cause.replace(f": {value.name} ", f": {gmap[value].name} ", 1)
            self.ledger.add(dataclasses.replace(
                e, node=c.name, cause=cause, source=user_source(c),
                value=gmap[value].name if value is not None else e.value))

    def _node(self, t: torch.Tensor) -> fx.Node:
        node = compat.proxy_node(t, self.tracer)
        if node is None:
            raise NotStamped("a value the trace does not track")
        return node


def _last(tracer) -> fx.Node:
    """The last node of ``tracer``'s graph (a mark: what is made after it is a step's)."""
    return next(iter(reversed(tracer.graph.nodes)))


def _made_after(mark: fx.Node) -> list[fx.Node]:
    """The nodes after ``mark`` in its graph, in order."""
    made, n = [], mark.next
    while n.op != "root":
        made.append(n)
        n = n.next
    return made


def check_no_fake_constants(gm: fx.GraphModule) -> None:
    """Raise AssertionError where ``gm`` holds a fake tensor as a constant: make_fx makes a
    constant of a value it does not track, so a copy read outside its segment without being
    tracked (``LayerStamper._exported`` missing it) would become one."""
    for node in gm.graph.find_nodes(op="get_attr"):
        if _fake(getattr(gm, str(node.target), None)):
            raise AssertionError(f"dynamo_dist: a trace made a fake tensor a constant "
                                 f"({node.name}, read by {list(node.users)}): a copied value "
                                 f"was read without being tracked (LayerStamper._exported in "
                                 f"lowering, _Emitter.exported in capture)")


def place(tracer, n: fx.Node, args, kwargs, val: Any, meta: dict,
          name: str | None = None, track: bool = True) -> fx.Node:
    """A copy of node ``n`` added to the trace: ``args``/``kwargs`` its arguments in the copy,
    ``val`` its fresh value (tracked as make_fx tracks an op's result, unless ``track`` is
    False: a value only other copies read, through the caller's node map, is the node's
    ``val`` itself), ``meta`` its metadata but for the value, ``name`` its name (default: the
    graph's name for the target)."""
    new = tracer.graph.create_node(n.op, n.target, args, kwargs, name, n.type)
    new.meta.update(meta)
    if isinstance(val, torch.Tensor) and track:
        compat.track_value(val, new, tracer, n.meta.get("tensor_meta"))
    else:
        new.meta["val"] = val
        if "tensor_meta" in n.meta:
            new.meta["tensor_meta"] = n.meta["tensor_meta"]
    return new


@dataclasses.dataclass
class _Move:
    """One redistribute as lowering traced it: its input (the tracked value and its node), the
    local nodes it made in order, its result, and what it sent (kind, axis, bytes) per
    collective, in order."""

    value: torch.Tensor
    node: fx.Node
    made: list[fx.Node]
    result: torch.Tensor
    sent: list[tuple]


class MoveCopies:
    """Redistributes of values outside the layer segments, made once per (local layout,
    placements, global shape) and copied after: each parameter's gradient moved to its
    parameter's placement at the joint graph's output (a reduce_scatter per parameter, about
    1.2 s of a 32-layer Llama's lowering on dp x tp, all alike but for their input). A copy is
    the first move's nodes with this input, fresh fakes (aliasing as the first's do) and the
    first's metadata (all are made at the output, by the same code); where a move's nodes read
    anything but its input, it is never copied."""

    def __init__(self, fake_mode) -> None:
        self.fake_mode = fake_mode
        self.tracer = compat.proxy_tracer()
        self.moves: dict[tuple, _Move | None] = {}
        self.copied = 0

    @staticmethod
    def key(x: Any, src, dst, shape: tuple) -> tuple | None:
        """What decides a move's nodes; None for a value that cannot be copied."""
        if not _fake(x) or not _plain_value(x) or not all(type(s) is int for s in shape):
            return None
        return _layout(x), src, dst, shape

    def mark(self) -> fx.Node:
        return _last(self.tracer)

    def made(self, key: tuple, value: torch.Tensor, mark: fx.Node, result: Any,
             sent: list[tuple]) -> None:
        """The move of ``value`` under ``key`` made the nodes after ``mark`` and ``result``."""
        if key in self.moves:
            return
        node = compat.proxy_node(value, self.tracer)
        made = _made_after(mark)
        inside = {node, *made}
        usable = node is not None and isinstance(result, torch.Tensor) and \
            all(a in inside for m in made for a in m.all_input_nodes) and \
            all(_plain_value(m.meta.get("val")) for m in made) and \
            compat.proxy_node(result, self.tracer) in inside
        self.moves[key] = _Move(value, node, made, result, sent) if usable else None

    def copy(self, key: tuple, value: torch.Tensor) -> tuple[torch.Tensor, list[tuple]] | None:
        """(the moved value, what it sent) for ``value`` as a copy of the move recorded under
        ``key``; None where there is none (the caller moves ``value`` itself)."""
        move = self.moves.get(key)
        node = compat.proxy_node(value, self.tracer)
        if move is None or node is None:
            return None
        with compat.untraced():
            fakes = FakeCopier(self.fake_mode, [(move.value, value)])
            try:
                vals = [fakes.copy(n.meta.get("val")) for n in move.made]
            except NotStamped:
                return None
            lmap, objs = {move.node: node}, {node: value}
            for n, val in zip(move.made, vals):
                args, kwargs = fx.map_arg((n.args, n.kwargs), lambda a: lmap[a])
                meta = {k: v for k, v in n.meta.items() if k not in ("val", "tensor_meta")}
                lmap[n] = new = place(self.tracer, n, args, kwargs, val, meta)
                objs[new] = val
        self.copied += 1
        return objs[lmap[compat.proxy_node(move.result, self.tracer)]], move.sent


def _plain_value(val: Any) -> bool:
    """A tensor, or a tuple/list of tensors (and Nones): what a copy can make fakes for."""
    if isinstance(val, torch.Tensor):
        return not compat.has_symbolic_shape(val)
    if isinstance(val, (tuple, list)):
        return all(v is None or _plain_value(v) for v in val)
    return False


def _fake(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and getattr(v, "fake_mode", None) is not None


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device


def _extent(t: torch.Tensor) -> int:
    """Elements from a tensor's first to one past its last (its storage span, offset 0)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class FakeCopier:
    """Fresh fake values for copied nodes, aliasing as the representative's do: a value in the
    storage of a mapped one (an input, a cached move) becomes a view of its counterpart, one in
    a storage first made inside the segment a view of a new storage of the same size. Raises
    NotStamped for a storage viewed with another dtype."""

    def __init__(self, fake_mode, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        self.fake_mode = fake_mode
        self.memo: dict[int, torch.Tensor] = {}
        self.storage: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.meta: dict[int, torch.Tensor] = {}  # a new fake -> the meta tensor under it
        self._batched = 0
        for r, m in pairs:
            self.pair(r, m)

    def pair(self, rep: torch.Tensor, new: torch.Tensor) -> None:
        """``new`` stands for ``rep``, and a view of ``rep``'s storage becomes one of
        ``new``'s."""
        self.memo[id(rep)] = new
        self.storage.setdefault(_key(rep), (rep, new))

    def keep(self, val: Any) -> None:
        """``val`` (a reused node's) stands for itself."""
        for t in pytree.tree_leaves(val):
            if isinstance(t, torch.Tensor):
                self.memo[id(t)] = t
                self.storage.setdefault(_key(t), (t, t))

    @contextlib.contextmanager
    def batch(self):
        """Copies made inside share one exit from the dispatch modes (entering them per copy
        was a fifth of a copy's cost)."""
        with compat.no_dispatch_modes():
            self._batched += 1
            try:
                yield self
            finally:
                self._batched -= 1

    def copy(self, val: Any) -> Any:
        if self._batched:
            return self._copy(val)
        with compat.no_dispatch_modes():
            return self._copy(val)

    def _copy(self, val: Any) -> Any:
        if isinstance(val, (tuple, list)):
            return type(val)(None if v is None else self._copy(v) for v in val)
        if id(val) in self.memo:
            return self.memo[id(val)]
        t = val
        # fakes are made over meta tensors directly (a trip through the fake mode per value
        # was most of a copy's cost), views of a value from outside the segment too
        key = _key(t)
        if key in self.storage:
            r0, m0 = self.storage[key]
            if m0.dtype != t.dtype:
                raise NotStamped("a storage viewed with another dtype")
            offset = t.storage_offset() - r0.storage_offset() + m0.storage_offset()
            base = self.meta.get(id(m0))
            if base is not None:
                meta = base.as_strided(t.shape, t.stride(),
                                       offset - m0.storage_offset() + base.storage_offset())
            else:  # a fake made elsewhere: a meta tensor over its (meta) storage
                meta = torch.empty((0,), dtype=t.dtype, device="meta").set_(
                    m0.untyped_storage(), offset, t.shape, t.stride())
            new = compat.fake_tensor(self.fake_mode, meta, t.device)
        else:
            nbytes, size = t.untyped_storage().nbytes(), t.element_size()
            if nbytes % size:
                raise NotStamped("a storage of odd size")
            if t.storage_offset() == 0 and nbytes == _extent(t) * size:
                meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            else:
                meta = torch.empty((nbytes // size,), dtype=t.dtype, device="meta"
                                   ).as_strided(t.shape, t.stride(), t.storage_offset())
            new = compat.fake_tensor(self.fake_mode, meta, t.device)
            self.meta[id(new)] = meta
            self.storage[key] = (t, new)
        self.memo[id(t)] = new
        return new
