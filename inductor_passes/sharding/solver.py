"""Whole-graph sharding as an integer linear program (the AutoParallel / Alpa formulation).

``ShardingILP.solve`` builds it in four blocks (each marked by a comment there):

* choose one: ``x[v,s]`` in {0,1}, node v uses OpSpec s of its OpStrategy; ``sum_s x[v,s] = 1``.
  Placeholders of parameters and inputs, and sharding constraints, have a single OpSpec, so
  user placements are never overwritten. ``X[u,o] = sum of x[u,s] with output(s) = o`` is a
  linear expression, not a variable.
* ties: getitem nodes and cotangents are tied to their source, ``x[g,j] = X[u,o_j]``; a
  cotangent takes the placement its forward output lands in (JAX's rule; the runtime hands the
  gradient over there).
* edges: per consumer slot (v,k) of a value u, a transportation flow ``e[o,r] >= 0`` with
  ``sum_r e[o,r] = X[u,o]`` and ``sum_o e[o,r] = (v requires r)``, which is tight where the
  textbook ``y >= X + Z - 1`` is not; then ``y[u,o,r] >= e[o,r]``, one y per (value, from, to)
  shared by all consumers, because lowering redistributes a value once per target placement.
  A value read through one slot needs no y (y = e at the optimum): its cost goes on e, which
  drops about half the variables and rows. A slot with one choice on each side is a constant,
  with no variable.
* objective: redistribute cost * y (``EdgePricer``: ``cost.redistribute_cost``, parameters'
  gathers priced with ``PlannerConfig.param_gather_factor``) + what each OpSpec costs itself
  (``rules.node_cost``: matmul, fused-attention and convolution compute per rank, collectives
  inside an op) + the cost of bringing each graph output to its required placement (forward
  outputs: ``returnable``, never Partial nor unevenly split; gradients in their parameter's
  placement) + the memory each rank keeps for the backward under each OpSpec
  (``cost.held_bytes`` of each ``cost.saved_values`` member x
  ``PlannerConfig.saved_memory_weight``).

Repeated layers: nodes of one ``repeats.repeat_classes`` class with equal option lists share
the first member's x (``owner``); flow blocks are keyed by owners, and values whose consumer
blocks are one set share one y paying the sum of their costs (AutoParallel's clustering of
repeated layers, made exact for the restricted program).

Solved with HiGHS through scipy.optimize.milp: the LP relaxation first, taken where its choice
variables come out 0/1 (``_solve``; on every program seen they do), else the MIP. A program over
``max_vars`` variables is abandoned while enumerating (``_TooLarge``, a lower bound) or, counted
exactly, before any cost is priced or row built (``_over_cap``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Callable, Sequence

import numpy as np
import torch.fx as fx

from ..core import roles
from ..core.annotation_ops import CONSTRAINT_OP
from ..core.fresh_stack import on_fresh_stack
from ..core.placements import (Placements, is_placements, is_split, replicate, returnable,
                               strided_factors)
from .config import DEFAULT, PlannerConfig
from .cost import held_bytes, saved_values
from .rules import (GETITEM, OpSpec, RuleKind, Strided, has_node_cost, node_cost, op_strategy,
                    replicated_spec, tensor_args)
from .rules.strided import NONE as NO_STRIDED

log = logging.getLogger("dynamo_dist.sharding")


def _agrees(spec: OpSpec, base: OpSpec, free_axis: int | None) -> bool:
    """Same placements as ``base`` on every mesh axis except ``free_axis``."""
    def same(a, b) -> bool:
        if a is None or b is None:
            return a is b
        if is_placements(a):
            return is_placements(b) and len(a) == len(b) and all(
                x == y for i, (x, y) in enumerate(zip(a, b)) if i != free_axis)
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))

    return same(spec.output, base.output) and len(spec.inputs) == len(base.inputs) and \
        all(same(x, y) for x, y in zip(spec.inputs, base.inputs))


def program_factors(gm: fx.GraphModule, pinned, constraint_of) -> frozenset[int]:
    """Split factors of the _StridedShard placements a program pins: ``pinned`` (its inputs'
    placements) and its sharding constraints. Empty for almost every program: then no rule
    offers a strided option and planning is what it was before strided sharding."""
    found = strided_factors(pinned)
    for node in gm.graph.find_nodes(op="call_function", target=CONSTRAINT_OP):
        found |= strided_factors(constraint_of(node))
    return found


class _TooLarge(Exception):
    """The program would exceed ``max_vars``; raised while enumerating, caught in __init__."""


@dataclasses.dataclass
class Solution:
    chosen: dict[fx.Node, OpSpec]
    counts: dict[fx.Node, int]
    objective: float
    seconds: float
    status: str


# a relaxed choice variable this close to 0 or 1 is taken as integral (HiGHS's own MIP
# feasibility tolerance is 1e-6)
_INTEGRAL_TOL = 1e-7


def _solve(cost: np.ndarray, rows, integrality: np.ndarray, time_limit: float):
    """scipy's ``milp`` result for min ``cost @ x`` under ``rows``, 0 <= x <= 1, the variables
    marked in ``integrality`` binary. The LP relaxation first: the flow rows make it integral
    on the programs seen (every ILP of the 2-D demo Llama), and HiGHS's MIP spends as long
    again on heuristics before that same root LP. Its answer is taken when every binary
    variable is 0 or 1 (then it is the MIP's optimum: same objective, possibly another of
    equal cost); an infeasible LP as it is (the MIP is infeasible too); otherwise the MIP, in
    the time left of ``time_limit`` (seconds)."""
    from scipy.optimize import Bounds, milp

    start = time.perf_counter()
    lp = milp(cost, constraints=rows, integrality=np.zeros_like(integrality),
              bounds=Bounds(0, 1), options={"time_limit": time_limit, "presolve": True})
    if lp.status == 2:  # the relaxation is infeasible: so is the MIP
        return lp
    if lp.status == 0 and lp.x is not None:
        x = lp.x[integrality == 1]
        if np.all(np.minimum(np.abs(x), np.abs(1.0 - x)) <= _INTEGRAL_TOL):
            return lp
    left = max(time_limit - (time.perf_counter() - start), 1.0)
    return milp(cost, constraints=rows, integrality=integrality, bounds=Bounds(0, 1),
                options={"time_limit": left, "presolve": True})


class ShardingILP:
    def __init__(self, gm: fx.GraphModule, mesh, primal_placements: Sequence[Placements],
                 num_fwd_outputs: int, diff_outputs: Sequence[int],
                 grad_placements: Sequence[Placements | None],
                 constraint_of: Callable[[fx.Node], Placements | None],
                 edge_cost: Callable[[fx.Node, Placements, Placements], float],
                 max_vars: int = DEFAULT.joint_max_vars,
                 base: dict[str, OpSpec] | None = None,
                 free_axis: int | None = None,
                 valid_base: bool = True,
                 keep: Callable[[fx.Node, OpSpec], bool] | None = None,
                 strategy_cache: dict | None = None,
                 config: PlannerConfig = DEFAULT,
                 keys: Callable[[fx.Node], object] | None = None,
                 classes: dict[fx.Node, int] | None = None,
                 price_key: Callable[[fx.Node], object] | None = None,
                 budget: float = 0.0) -> None:
        self.keep, self.config = keep, config
        # ``budget``: at most this many bytes kept for the backward per rank (0: none), a row
        self.budget = budget
        self._saved = saved_values(gm.graph) if config.saved_memory_weight or budget \
            else frozenset()
        # OpStrategies depend only on the node's local key (``repeats.LocalKeys``: layer 17's
        # mm has layer 3's key), its inputs' placements, the mesh, constraints and ``keep``: the
        # caller shares this cache between ILPs that agree on those (the descent re-solves one
        # graph up to 6 times; enumerating was half the planning time)
        self._strategies = {} if strategy_cache is None else strategy_cache
        self._key = keys if keys is not None else (lambda n: n)
        # values with equal price keys cost the same to redistribute (``EdgePricer.key``)
        self._price_key = price_key if price_key is not None else (lambda n: n)
        # nodes of one repeat class (``repeats.repeat_classes``) with equal option lists share
        # one set of choice variables: ``owner[n]`` holds them (the class's first node)
        self._classes = classes or {}
        self._first_of_class: dict[int, fx.Node] = {}
        self.owner: dict[fx.Node, fx.Node] = {}
        self._options_memo: dict[tuple, list[OpSpec]] = {}
        self._outs: dict[fx.Node, list] = {}  # output placements a node may take, in order
        self._blocks_counted: set[tuple] = set()
        self.max_vars = max_vars
        # with ``base`` (an OpSpec per node name), only OpSpecs that agree with it on every mesh
        # axis but ``free_axis`` are offered: one block of a coordinate descent over mesh axes
        # ``valid_base``: every base OpSpec is a valid OpSpec of its node (a plan this planner
        # made), not a combination of per-axis choices that may clash
        self.base, self.free_axis, self.valid_base = base, free_axis, valid_base
        self.gm, self.mesh = gm, mesh
        self.mesh_shape = tuple(mesh.shape)
        self.edge_cost = edge_cost
        self.options: dict[fx.Node, list[OpSpec]] = {}
        self.ties: list[tuple[fx.Node, int, fx.Node, object]] = []  # x[g,j] == X[u,o]
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        self.primals = [n for n in placeholders if roles.is_primal(n)]
        self.tangents = [n for n in placeholders if roles.is_tangent(n)]
        self.output = next(iter(gm.graph.find_nodes(op="output")))
        self.outs = list(self.output.args[0])
        self.num_fwd_outputs = num_fwd_outputs
        self.diff_outputs = list(diff_outputs)
        self.grad_placements = list(grad_placements)
        self.constraint_of = constraint_of
        for node, pl in zip(self.primals, primal_placements):
            self.options[node] = [OpSpec((), pl, RuleKind.INPUT)]
            self.owner[node] = node
        # a lower bound of the variable count, kept while enumerating: a program over the cap
        # is abandoned as soon as that is known (a 2-D Llama enumerated 3x the cap, then built
        # every row, only to be rejected: 65% of the planning time at 32 layers)
        self.min_vars = len(self.primals)
        self.too_large = False
        try:
            self._enumerate()
        except _TooLarge:
            self.too_large = True
            log.info("dynamo_dist: sharding ILP too large (over %d variables after %d of %d "
                     "nodes); not solved", max_vars, len(self.options), len(gm.graph.nodes))

    # -- OpStrategies ----------------------------------------------------------------------------
    def strategy(self, node: fx.Node, current, strided_in: Strided = NO_STRIDED) -> list[OpSpec]:
        key = (self._key(node), tuple(current), strided_in)
        specs = self._strategies.get(key)
        if specs is None:
            specs = op_strategy(node, current, self.mesh, self.mesh_shape, self.constraint_of,
                                strided_in)
            specs = [sp for sp in specs if self.keep is None or self.keep(node, sp)]
            self._strategies[key] = specs
        return list(specs)

    def outputs_of(self, node: fx.Node) -> list:
        outs = self._outs.get(node)
        if outs is None:
            outs = self._outs[node] = list(dict.fromkeys(s.output for s in self.options[node]))
        return outs

    def _enumerate(self) -> None:
        tangent_src = dict(zip(self.tangents, (self.outs[j] for j in self.diff_outputs)))
        tangent_of = dict(zip(self.tangents, self.diff_outputs))
        # forward part first: a cotangent's options come from its forward output's
        bwd = roles.tangent_dependent(self.gm.graph)
        order = [n for n in self.gm.graph.nodes if n not in bwd] + self.tangents + \
            [n for n in self.gm.graph.nodes if n in bwd and n not in tangent_src]
        program = program_factors(self.gm, [s.output for o in self.options.values() for s in o],
                                  self.constraint_of)
        for node in order:
            if node in self.options or node.op == "output":
                continue
            if node in tangent_src:
                src = tangent_src[node]
                outs = self.outputs_of(src)
                # the runtime hands it over where the output landed (DTensor.from_local's
                # backward redistributes the incoming gradient to the output's placement)
                self.options[node] = [OpSpec((), self.want(tangent_of[node], o), RuleKind.COTANGENT)
                                      for o in outs]
                for j, o in enumerate(outs):
                    self.ties.append((node, j, src, o))
                self._share(node)
                continue
            if node.op not in ("call_function", "get_attr"):
                continue
            if node.target is GETITEM:
                src, idx = node.args[0], node.args[1]
                outs = self.outputs_of(src)
                self.options[node] = [
                    OpSpec((), o[idx] if not is_placements(o) else o, RuleKind.GETITEM)
                    for o in outs]
                for j, o in enumerate(outs):
                    self.ties.append((node, j, src, o))
                self._share(node)
                continue
            targs = tensor_args(node)
            choices = [self.outputs_of(a) for a in targs]
            base = self.base.get(node.name) if self.base is not None else None
            # a repeated layer's node asks what its twin in another layer asked: answered once
            key = (self._key(node), tuple(map(tuple, choices)), base)
            specs = self._options_memo.get(key)
            if specs is None:
                specs = self._options_memo[key] = self._offer(node, choices, base, program)
            self.options[node] = specs
            self._count(node, specs, targs, own=self._share(node))

    def _offer(self, node: fx.Node, choices: list[list], base: OpSpec | None,
               program: frozenset[int]) -> list[OpSpec]:
        """The OpSpecs ``node`` is offered, given the output placements each input may take."""
        ndim = len(self.mesh_shape)
        first = [c[0] for c in choices]
        # block-strided options only for the split factors the inputs may hold (and, for
        # ops that build them from pieces, the program's own): ``rules.strided``
        local = strided_factors(choices)
        strided_in = Strided(local, program) if local or program else NO_STRIDED
        specs = self.strategy(node, first, strided_in)
        if specs and specs[0].kind is RuleKind.DTENSOR:
            # DTensor's rules enumerate from the inputs' current placements: ask once per
            # placement each input can take (others at their first), and take the union
            for k, opts in enumerate(choices):
                for o in opts[1:]:
                    cur = list(first)
                    cur[k] = o
                    specs += self.strategy(node, cur, strided_in)
        specs = list(dict.fromkeys(specs))
        if len(specs) > self.config.max_options:
            # the cap keeps first what the producers' options can feed without a redistribute,
            # and among those the ones that divide the work over more ranks: in the rules'
            # order, the nested OpSpecs of a bmm (``rules.strided.nest``, listed last) fell
            # past it, and a [B*H] attention gathered on tp for no reason
            held = [set(c) for c in choices]

            def rank(sp: OpSpec) -> tuple[int, int]:
                split = [any(is_split(p[axis]) for p in sp.inputs) for axis in range(ndim)]
                return (sum(p not in h for p, h in zip(sp.inputs, held)),
                        -math.prod(n for n, s in zip(self.mesh_shape, split) if s))

            specs.sort(key=rank)
        if base is not None:
            every = specs
            specs = [sp for sp in specs if _agrees(sp, base, self.free_axis)]
            if self.valid_base and all((sp.inputs, sp.output) != (base.inputs, base.output)
                                       for sp in specs):
                # DTensor's rules, asked one input at a time, may not offer the base's own
                # OpSpec: without it the base is infeasible and a descent step can end worse
                specs.insert(0, base)
            # a base OpSpec this node cannot take (two axes' choices clash): the node is free
            specs = specs or every
        if not specs:
            specs = [replicated_spec(node, ndim, RuleKind.FALLBACK)]
        return specs[:self.config.max_options]

    def _share(self, node: fx.Node) -> bool:
        """Record who holds ``node``'s choice variables; True when it holds its own."""
        cls = self._classes.get(node)
        first = node if cls is None else self._first_of_class.setdefault(cls, node)
        # with a base plan, only members that chose alike there: the base stays feasible, so a
        # descent step never ends worse than where it started
        same_base = self.base is None or \
            self.base.get(first.name) == self.base.get(node.name)
        if first is not node and same_base and self.options[first] == self.options[node]:
            self.owner[node] = first
            return False
        self.owner[node] = node
        return True

    def _count(self, node: fx.Node, specs: list[OpSpec], targs: list[fx.Node],
               own: bool) -> None:
        """Add ``node``'s choice variables (if it holds its own) and the flow variables of its
        input slots that ``solve`` has not made for another member of its class to the bound."""
        if own:
            self.min_vars += len(specs)
        if node.op == "call_function":
            for k, u in enumerate(targs):
                block = (self.owner[node], k, self.owner.get(u, u))
                if block in self._blocks_counted:
                    continue
                self._blocks_counted.add(block)
                outs, reqs = len(self.outputs_of(u)), len({sp.inputs[k] for sp in specs})
                if outs > 1 or reqs > 1:
                    self.min_vars += outs * reqs
        if self.min_vars > self.max_vars:
            raise _TooLarge

    # -- the program -----------------------------------------------------------------------------
    def solve(self, time_limit: float = 60.0) -> Solution | None:
        """The optimum (``Solution``), or None: too large, not solved to optimality in
        ``time_limit`` seconds, or (with a budget) infeasible. Built and solved on a fresh
        thread's frame stack (``core.fresh_stack``): called deep inside ``torch.compile``, the
        build's comprehensions could land on a frame-chunk boundary and run 10x slower."""
        if self.too_large:
            return None
        return on_fresh_stack(self._build_and_solve, time_limit)

    def _build_and_solve(self, time_limit: float) -> Solution | None:
        from scipy.optimize import LinearConstraint
        from scipy.sparse import coo_matrix

        t0 = time.perf_counter()
        own = self.owner
        nodes = [n for n in self.gm.graph.nodes if n in self.options]
        xi: dict[tuple[fx.Node, int], int] = {}
        for n in nodes:
            if own[n] is n:
                for s in range(len(self.options[n])):
                    xi[(n, s)] = len(xi)
        cost: list[float] = [0.0] * len(xi)
        rows, cols, vals, lo, hi = [], [], [], [], []

        def add_row(entries, low, high):
            r = len(lo)
            for c, v in entries:
                rows.append(r)
                cols.append(c)
                vals.append(v)
            lo.append(low)
            hi.append(high)

        by_output: dict[fx.Node, dict] = {}  # owner -> output placement -> its x columns

        def X(u, o):
            cols = by_output.get(own[u])
            if cols is None:
                cols = by_output[own[u]] = {}
                for s, spec in enumerate(self.options[u]):
                    cols.setdefault(spec.output, []).append(xi[(own[u], s)])
            return cols.get(o, [])

        # choose one (per owner of choice variables)
        for n in nodes:
            if own[n] is n:
                add_row([(xi[(n, s)], 1.0) for s in range(len(self.options[n]))], 1.0, 1.0)
        # ties (repeated layers give the same row again: added once)
        for g, j, u, o in dict.fromkeys((own[g], j, own[u], o) for g, j, u, o in self.ties):
            add_row([(xi[(g, j)], 1.0)] + [(c, -1.0) for c in X(u, o)], 0.0, 0.0)
        # edges: per consumer slot a transportation flow e[o,r] between the producer's output
        # choice and the consumer's input requirement (tight, unlike y >= X + Z - 1); one
        # y[u,o,r] >= e[o,r] per (value, from, to) is what the objective pays, shared by all
        # consumers because lowering redistributes a value once per target placement.
        # Repeated layers: a slot is a block (owner of v, k, owner of u); values whose consumer
        # blocks are the same set share one y, which pays the sum of their costs -- the same
        # objective as one y per value once the class members choose alike.
        slots = [(v, k, u) for v in nodes if v.op == "call_function" and v.target is not GETITEM
                 for k, u in enumerate(tensor_args(v))]
        blocks_of: dict[fx.Node, set] = {}
        for v, k, u in slots:
            blocks_of.setdefault(u, set()).add((own[v], k, own[u]))
        ids: dict[tuple, int] = {}  # a group (owner, its consumer blocks) as a small int
        group: dict[fx.Node, int] = {u: ids.setdefault((own[u], frozenset(b)), len(ids))
                                     for u, b in blocks_of.items()}
        # a group read through one block needs no y: its flow e is what it pays (y = e at the
        # optimum), so its cost goes on e -- most values have one consumer, and this drops
        # about half the variables and rows
        single = {g for (_, b), g in ids.items() if len(b) == 1}
        if self._over_cap(len(xi), slots, group):
            return None
        # per group: one value per price key, with how many members share it
        members: dict[int, dict[object, list]] = {}
        for u, g in group.items():
            by_price = members.setdefault(g, {})
            by_price.setdefault(self._price_key(u), [u, 0])[1] += 1
        yi: dict[tuple, int] = {}
        n_edge = 0
        extra_cost: list[float] = []

        def new_var(c: float) -> int:
            extra_cost.append(c)
            return len(xi) + len(extra_cost) - 1

        def price(u, o, r) -> float:
            """What moving value u's group from o to r costs (all its members)."""
            return sum(n * self.edge_cost(m, o, r) for m, n in members[group[u]].values())

        def y_of(u, o, r) -> int | None:
            """The y variable of value u's group from o to r (None: free for all of them)."""
            key = (group[u], o, r)
            if key not in yi:
                c = price(u, o, r)
                yi[key] = new_var(c) if c > 0 else None
            return yi[key]

        flows: dict[tuple, dict] = {}
        linked: set[tuple] = set()
        for v, k, u in slots:
            block = (own[v], k, own[u])
            if (block, group[u]) in linked:
                continue
            linked.add((block, group[u]))
            by_req: dict[object, list[int]] = {}
            for s, spec in enumerate(self.options[v]):
                by_req.setdefault(spec.inputs[k], []).append(xi[(own[v], s)])
            outs = self.outputs_of(u)
            if len(outs) == 1 and len(by_req) == 1:
                y = y_of(u, outs[0], next(iter(by_req)))
                if y is not None:  # forced: pays whatever happens
                    add_row([(y, 1.0)], 1.0, 1.0)
                continue
            e = flows.get(block)
            if e is None:
                e = flows[block] = {(o, r): new_var(0.0) for o in outs for r in by_req}
                n_edge += len(e)
                for o in outs:
                    add_row([(e[(o, r)], 1.0) for r in by_req] + [(x, -1.0) for x in X(u, o)],
                            0.0, 0.0)
                for r, zs in by_req.items():
                    add_row([(e[(o, r)], 1.0) for o in outs] + [(z, -1.0) for z in zs],
                            0.0, 0.0)
            for (o, r), ev in e.items():
                if o == r:  # staying put is free
                    continue
                if group[u] in single:
                    extra_cost[ev - len(xi)] += price(u, o, r)
                    continue
                y = y_of(u, o, r)
                if y is not None:
                    add_row([(y, 1.0), (ev, -1.0)], 0.0, np.inf)
        yi = {k: y for k, y in yi.items() if y is not None}
        cost.extend(extra_cost)
        # objective: compute, and outputs to their required placements (each member's, on its
        # owner's variables)
        for n in nodes:
            if n.op == "call_function" and has_node_cost(n):
                for s, spec in enumerate(self.options[n]):
                    cost[xi[(own[n], s)]] += node_cost(n, spec, self.mesh_shape, self.config)
        # memory: the bytes each rank keeps for the backward (``cost.saved_values``), priced
        # and/or bounded, added in graph order (a float sum per owner: the same on every rank
        # and every run)
        held: dict[int, float] = {}  # per choice column: bytes kept (the budget's row)
        for n in nodes:
            if n in self._saved:
                for s, spec in enumerate(self.options[n]):
                    col, b = xi[(own[n], s)], held_bytes(n, spec.output, self.mesh_shape)
                    cost[col] += self.config.saved_memory_weight * b
                    held[col] = held.get(col, 0.0) + b
        if self.budget:
            add_row([(c, b) for c, b in held.items() if b], -np.inf, self.budget)
        for i, o in enumerate(self.outs):
            if not isinstance(o, fx.Node) or o not in self.options:
                continue
            for s, spec in enumerate(self.options[o]):
                want = self.want(i, spec.output)
                cost[xi[(own[o], s)]] += self.edge_cost(o, spec.output, want)
        n_var = len(cost)  # at most what ``_over_cap`` counted
        a = coo_matrix((vals, (rows, cols)), shape=(len(lo), n_var)).tocsr()
        integrality = np.zeros(n_var)
        integrality[:len(xi)] = 1
        res = _solve(np.asarray(cost), LinearConstraint(a, lo, hi), integrality, time_limit)
        seconds = time.perf_counter() - t0
        if res.status == 2 and self.budget:
            log.info("dynamo_dist: no plan of this ILP keeps at most %d bytes for the backward "
                     "per rank (%.1fs)", self.budget, seconds)
            return None
        if res.status != 0 or res.x is None:  # only a proven optimum is worth more than greedy
            log.warning("dynamo_dist: sharding ILP not solved to optimality (%s) in %.1fs "
                        "(%d variables)", res.message, seconds, n_var)
            return None
        chosen = {}
        for n in nodes:
            best = max(range(len(self.options[n])), key=lambda s: res.x[xi[(own[n], s)]])
            chosen[n] = self.options[n][best]
        log.info("dynamo_dist: sharding ILP: %d choice vars, %d flow vars, %d cost vars, "
                 "%d rows, objective %.3g, %.1fs (%s)", len(xi), n_edge, len(yi), len(lo),
                 res.fun, seconds, res.message)
        return Solution(chosen, {n: len(self.options[n]) for n in nodes}, float(res.fun),
                        seconds, str(res.message))

    def _over_cap(self, n_choice: int, slots: list, group: dict) -> bool:
        """Whether the program exceeds ``max_vars``, counted before any cost is priced or row
        built (building the whole-program joint ILP of a deep model on an N-D mesh, only to
        reject it, took 3 of 14 s at 32 layers): choice and flow variables, and one
        redistribute variable per move of every group, priced or not. That is the textbook
        formulation's size, which the cap was calibrated on; ``solve`` builds fewer (a group
        read through one block pays on its flow), but HiGHS's time follows the problem, not
        our count: the 32-layer Llama's joint ILP, 240k counted this way and 166k built, did
        not solve in 30 s."""
        own = self.owner
        n_flow, linked, flows = 0, set(), set()
        reqs_of: dict[int, tuple[list, set]] = {}  # group -> (its outputs, requirements)
        for v, k, u in slots:
            block = (own[v], k, own[u])
            if (block, group[u]) in linked:
                continue
            linked.add((block, group[u]))
            outs = self.outputs_of(u)
            reqs = {spec.inputs[k] for spec in self.options[v]}
            forced = len(outs) == 1 and len(reqs) == 1
            if not forced and block not in flows:
                flows.add(block)
                n_flow += len(outs) * len(reqs)
            reqs_of.setdefault(group[u], (outs, set()))[1].update(reqs)
        # a group's members share the owner's outputs: its moves are outputs x requirements
        n_y = sum(len(outs) * len(reqs) - len(reqs.intersection(outs))
                  for outs, reqs in reqs_of.values())
        total = n_choice + n_flow + n_y
        if total > self.max_vars:
            log.info("dynamo_dist: sharding ILP too large (about %d variables > %d); not built",
                     total, self.max_vars)
            return True
        return False

    def want(self, i: int, produced) -> Placements:
        """Required placement of graph output i, given what its producer produced."""
        ndim = len(self.mesh_shape)
        if i < self.num_fwd_outputs:
            val = self.outs[i].meta.get("val") if isinstance(self.outs[i], fx.Node) else None
            if not is_placements(produced) or val is None:
                return replicate(ndim)
            return returnable(tuple(val.shape), produced, self.mesh_shape)
        g = self.grad_placements[i - self.num_fwd_outputs]
        return g if g is not None else replicate(ndim)
