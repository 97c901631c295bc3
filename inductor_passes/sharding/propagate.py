"""Whole-graph sharding over the joint forward+backward graph: every node gets an OpSpec.

``propagate`` solves the whole program as an ILP (``solver.ShardingILP``) where it fits
``PlannerConfig.joint_max_vars``; nodes of repeated layers (``repeats.repeat_classes``) share
one set of variables in every ILP, so their size is about one layer's. On an N-D mesh too large
for the joint ILP, one ILP per mesh axis gives a start (``_separable_start``), made valid by a
pricing ILP, re-planned jointly outside the layers, and improved by per-axis block
coordinate descent. Where no ILP
fits (or with ``PlanMethod.GREEDY``), a greedy walk (``_Walk``) follows the graph in topological
order, forward part first, then backward, so that each cotangent takes the placement of its
forward output (as JAX does), and at each node picks the OpSpec whose input redistributes are
cheapest -- DTensor's per-op choice, made at compile time on the whole program, repeated a few
times. Pinned placements (user DTensor inputs, sharding constraints, parameter gradients that
must land in the parameter's placement) are never overwritten.

The result is a ``Plan``: plain data, printable, diffable, and the input to lowering.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Callable, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial

from ..core import roles
from ..core.errors import DistCompileError, user_source
from ..core.layers import layer_of
from ..core.mesh_facts import axis_weights
from ..core.nodes import frozen_graph
from ..core.placements import (Placements, fmt, intersect_axes, is_placements, is_split, nbytes,
                               nonpartial, replicate, returnable, strided_factors)
from .config import DEFAULT, PlanMethod, PlannerConfig
from .cost import held_bytes, redistribute_cost, saved_bytes, saved_values
from .repeats import LocalKeys, repeat_classes
from .rules import embedding
from .rules.pointwise import widened_dtypes
from .rules import (GETITEM, OpSpec, RuleKind, RuleSource, Strided, node_cost, op_strategy,
                    replicated_spec, tensor_args)
from .solver import ShardingILP, program_factors

log = logging.getLogger("dynamo_dist.sharding")


_INPUT, _OUTPUT = RuleSource(RuleKind.INPUT), RuleSource(RuleKind.OUTPUT)


@dataclasses.dataclass
class NodePlan:
    """The chosen OpSpec of one node and where it came from."""

    name: str
    op: str
    inputs: tuple[Placements, ...]      # required placement of each tensor arg
    output: object                      # Placements, or a tuple of them for multi-output ops
    source: RuleSource                  # rule that produced the OpSpec
    cost: float                         # redistribute cost paid on its inputs (bytes-equivalent)
    candidates: int                     # size of the OpStrategy it was chosen from
    origin: str = ""                    # why: annotation, propagated, fallback

    @property
    def kind(self) -> RuleKind:
        return self.source.kind


@dataclasses.dataclass(frozen=True)
class PlanStage:
    """One step of the planning that made a plan: which ran, its wall-clock seconds, whether it
    gave a plan (an ILP over its size cap does not) and the cost it reached (bytes-equivalent)."""

    stage: str
    seconds: float
    solved: bool
    objective: float | None


@dataclasses.dataclass
class Plan:
    """node name -> NodePlan for a joint graph, plus the mesh it refers to. ``stages``: how the
    planning went (a plan read from the plan cache keeps the record of the run that made it)."""

    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    nodes: dict[str, NodePlan]
    fallbacks: list[str]
    total_cost: float = 0.0   # sum of redistribute costs paid (bytes-equivalent)
    stages: list[PlanStage] = dataclasses.field(default_factory=list)
    saved_bytes: int | None = None  # kept for the backward per rank (``cost.saved_bytes``)
    saved_memory_weight: float = 0.0  # the price it was planned at (a budget may raise it)

    def placement(self, name: str):
        return self.nodes[name].output

    def to_text(self) -> str:
        lines = [f"# plan over mesh {dict(zip(self.axis_names, self.mesh_shape))}"]
        if self.saved_bytes is not None:
            lines.append(f"# kept for the backward: {self.saved_bytes} bytes per rank "
                         f"(before recomputation; saved_memory_weight "
                         f"{self.saved_memory_weight:g})")
        for p in self.nodes.values():
            ins = " ".join(fmt(i) for i in p.inputs)
            if p.output is None or is_placements(p.output):
                out = fmt(p.output)
            else:
                out = "(" + ", ".join(fmt(o) for o in p.output) + ")"
            lines.append(f"{p.name:<28} {p.op:<40} {ins:<30} -> {out:<14} "
                         f"[{p.source}; cost {p.cost:.0f}] {p.origin}")
        return "\n".join(lines)


def propagate(gm: fx.GraphModule, mesh, *args, config: PlannerConfig = DEFAULT,
              **kwargs) -> Plan:
    """See ``_propagate``; the plan records the bytes it keeps for the backward per rank
    (``Plan.saved_bytes``). Under ``config.saved_memory_budget_bytes`` the budget is a row of
    the whole-program ILP (the constrained optimum, as AutoParallel bounds parameter memory);
    a plan still over it (the program too large for one ILP, or none fits) is fitted by
    pricing (``_fit_budget``: raises DistCompileError where no plan found fits). Logs each
    replicated fallback of the final plan once."""
    mesh_shape = tuple(mesh.shape)

    def plan_at(weight: float, budget: float = 0.0) -> Plan:
        cfg = dataclasses.replace(config, saved_memory_weight=weight,
                                  saved_memory_budget_bytes=budget)
        with frozen_graph():  # planning reads the graph, never edits it
            plan = _propagate(gm, mesh, *args, config=cfg, **kwargs)
        plan.saved_bytes = saved_bytes(gm.graph, lambda n: _output(plan, n), mesh_shape)
        plan.saved_memory_weight = weight
        return plan

    budget = config.saved_memory_budget_bytes
    plan = plan_at(config.saved_memory_weight, budget)
    if budget and plan.saved_bytes > budget:  # priced again, with no row
        plan = _fit_budget(plan_at, plan, config.saved_memory_weight, budget, mesh)
    for msg in plan.fallbacks:
        log.warning("dynamo_dist: %s", msg)
    return plan


_MAX_WEIGHT = 1e4  # bytes on the wire per saved byte: past this, memory is all that counts


def _output(plan: Plan, node: fx.Node):
    found = plan.nodes.get(node.name)
    return None if found is None else found.output


def _fit_budget(plan_at: Callable[[float], Plan], over: Plan, weight: float, budget: float,
                mesh) -> Plan:
    """The plan at the least ``saved_memory_weight`` tried whose saved bytes fit ``budget``:
    tenfold steps from 0.01 (or from ``weight``) up to ``_MAX_WEIGHT``, then two bisections
    (geometric) between the last weight over and the first that fits. Raises
    DistCompileError naming the least bytes found when none fits."""
    low, step, unpriced = weight, max(weight * 10, 0.01), over.saved_bytes
    fit = None
    while step <= _MAX_WEIGHT:
        trial = plan_at(step)
        if trial.saved_bytes <= budget:
            fit = (step, trial)
            break
        low, over = step, trial
        step *= 10
    if fit is None:
        raise DistCompileError(
            f"no plan keeps at most {int(budget)} bytes per rank for the backward "
            f"(saved_memory_budget_bytes); the least found keeps {over.saved_bytes} "
            f"(saved_memory_weight {low:g}, counted before the partitioner's recomputation)",
            mesh=mesh, fix="raise the budget, split the model over more ranks, or checkpoint "
                           "layers (torch.utils.checkpoint) so that fewer values are saved")
    for _ in range(2):
        mid = (low * fit[0]) ** 0.5 if low > 0 else fit[0] / 10
        trial = plan_at(mid)
        if trial.saved_bytes <= budget:
            fit = (mid, trial)
        else:
            low = mid
    log.info("dynamo_dist: saved-memory budget %d bytes per rank: plan at saved_memory_weight "
             "%.3g keeps %d (at %g: %d)", budget, fit[0], fit[1].saved_bytes, weight,
             unpriced)
    return fit[1]


def _propagate(gm: fx.GraphModule, mesh, primal_placements: Sequence[Placements],
              num_fwd_outputs: int, diff_outputs: Sequence[int],
              grad_placements: Sequence[Placements | None],
              constraint_of: Callable[[fx.Node], Placements | None],
              origins: Sequence[roles.InputOrigin] = (), data_axes: Sequence[str] = (),
              config: PlannerConfig = DEFAULT) -> Plan:
    """Give every node of ``gm`` (a joint graph in global semantics) an OpSpec.

    ``primal_placements[i]``: the fixed placement of placeholder ``primals_{i+1}``;
    ``grad_placements[i]``: where the gradient of primal i must land (None: no gradient).
    Forward outputs land where ``placements.returnable`` says (never Partial nor unevenly
    split); each cotangent arrives in its output's placement.

    ``config`` holds every knob (``PlannerConfig``). The ILP over the whole program is solved
    where it fits ``config.joint_max_vars``; on an N-D mesh that is too large, one ILP per mesh
    axis gives a start, repaired where two axes' choices clash (the pricing ILP), re-planned on
    all axes outside the layers (an ILP with every node a numbered module made, or of a repeat
    class, fixed), then improved by
    ``config.descent_rounds`` rounds of per-axis descent.
    Where no ILP fits, or with ``PlanMethod.GREEDY``: a single greedy walk cannot see that a
    redistribute it avoids at one consumer will be paid at a later one, so the walk is repeated
    ``config.greedy_rounds`` times, each round treating the redistributes
    the best plan so far paid for as already available; the plan with the lowest total
    redistribute cost wins (a small local search, in the spirit of GSPMD's repeated sweeps).
    """
    args = (gm, mesh, primal_placements, num_fwd_outputs, diff_outputs, grad_placements,
            constraint_of, origins, tuple(data_axes), config)
    ilp = config.method is PlanMethod.ILP
    ndim = len(mesh.shape)
    stages: list[PlanStage] = []
    if ilp:
        # repeated layers: one colouring of the graph for every ILP below
        keys = LocalKeys(gm, constraint_of)  # the per-axis ILPs too: same partition
        colours = _timed(stages, "repeat classes", _classes, gm, primal_placements, origins,
                         num_fwd_outputs, grad_placements, keys, config)
        classes = _shared(colours, config.min_repeats)
        # shared by the ILPs on this mesh
        memo = _Memo(EdgePricer(gm, mesh, origins, data_axes, config=config), keys, classes)
        max_vars = config.joint_max_vars if ndim > 1 else config.axis_max_vars
        # a saved-memory budget is a row of this ILP only: where the whole program is one ILP
        # its optimum is the constrained one; elsewhere ``propagate`` meets it by pricing
        plan = _timed(stages, "joint N-D ILP" if ndim > 1 else "ILP", _solve_ilp, *args,
                      memo=memo, max_vars=max_vars, budget=config.saved_memory_budget_bytes)
        if plan is not None:
            plan.stages = stages
            return plan
    start = _timed(stages, "separable start (total)", _separable_start, *args, stages=stages,
                   classes=classes, keys=keys) if ilp and ndim > 1 else None
    plan = start if start is not None else _greedy(args, stages)
    if ilp and ndim > 1:
        # The whole 2-D problem is too large; improve the start plan one mesh axis at a time
        # (block coordinate descent: each ILP keeps the other axes as they are, so its optimum
        # is never worse than the plan it starts from).
        bases: list = [None, None]  # (plan, its base): the last plan asked, built once

        def as_base(p: Plan) -> dict[str, OpSpec]:
            # (an OpSpec per node, 8k nodes at 32 layers: 0.1 s a build, asked per ILP below;
            # the ILPs only read it)
            if bases[0] is not p:
                bases[:] = p, {name: OpSpec(n.inputs, n.output, n.source)
                               for name, n in p.nodes.items() if n.op != "output"}
            return bases[1]

        # The start plan priced by the ILP's cost model (no axis free: one option per node).
        # A node whose per-axis choices clash (Shard(0) on both axes of a view that splits
        # dim 0 into two: no N-D OpSpec has both) is free in that ILP, so its plan is the start
        # made valid. Without it (too large) the start may hold a clash: the greedy walk instead.
        priced = _timed(stages, "price the start plan (all axes fixed)", _solve_ilp, *args,
                        base=as_base(plan), free_axis=-1, memo=memo, valid_base=False)
        if priced is not None:
            plan = priced
        elif start is not None:
            plan = _greedy(args, stages)
        # (every class of 2 or more: fixing a node to its base restricts nothing, unlike
        # sharing variables)
        repeated = set(n.name for n in _shared(colours, 2))
        if priced is not None and repeated:
            # the code outside the layers (embedding, loss, lm_head, and what no module made
            # between them) re-planned jointly on all axes, every layer fixed (a node a numbered
            # module made, or of a repeat class): the moves the per-axis descent cannot make
            # there (both axes at once). Freeing only the classless nodes instead left nearly
            # a small model's whole program free, 2-3x the time, and the final plans cost the
            # same (14 zoo families, Llama-3-8B shapes at 2 and 32 layers)
            fixed = repeated | {n.name for n in gm.graph.nodes
                                if n.op == "call_function" and layer_of(n) is not None}
            trial = _timed(stages, "joint ILP outside the layers", _solve_ilp, *args,
                           base={k: v for k, v in as_base(plan).items() if k in fixed},
                           free_axis=-1, memo=memo, max_vars=config.joint_max_vars)
            if trial is not None and trial.total_cost < plan.total_cost - 1e-6:
                plan = trial
        # An axis's ILP fixes the other axes; solved again with none of them changed it is the
        # same program, so it cannot improve (only a strictly cheaper plan is taken): skipped.
        # In the zoo on dp=2 x tp=2 no such repeat ever improved; each cost 0.3-1.9 s.
        version, solved_at = 0, [-1] * ndim  # plan changes so far; per axis, when last solved
        for _ in range(config.descent_rounds):
            improved = False
            for axis in range(ndim):
                if solved_at[axis] == version:
                    continue
                trial = _timed(stages, f"descent ILP, free axis {axis}", _solve_ilp, *args,
                               base=as_base(plan), free_axis=axis, memo=memo)
                if trial is not None and trial.total_cost < plan.total_cost - 1e-6:
                    plan, improved, version = trial, True, version + 1
                solved_at[axis] = version
            if not improved:
                break
        log.info("dynamo_dist: per-axis ILP refinement: plan cost %.3g", plan.total_cost)
    plan.stages = stages
    return plan


def _shared(colours: dict[fx.Node, int], least: int) -> dict[fx.Node, int]:
    """The nodes of ``colours`` whose colour at least ``least`` nodes have."""
    size: dict[int, int] = {}
    for c in colours.values():
        size[c] = size.get(c, 0) + 1
    return {n: c for n, c in colours.items() if size[c] >= least}


def _greedy(args: tuple, stages: list[PlanStage]) -> Plan:
    """The best of ``config.greedy_rounds`` greedy walks (each timed into ``stages``)."""
    mesh, config = args[1], args[-1]
    walker = _Walk(*args)
    best = _timed(stages, "greedy walk", walker.run, {})
    for _ in range(config.greedy_rounds - 1):
        trial = _timed(stages, "greedy walk", walker.run, best.paid)
        if trial.total >= best.total:
            break
        best = trial
    ndim = len(mesh.shape)
    return Plan(tuple(mesh.shape), tuple(mesh.mesh_dim_names or [f"axis{i}" for i in range(ndim)]),
                best.nodes, best.fallbacks, best.total)


def _classes(gm, primal_placements, origins, num_fwd_outputs, grad_placements, keys: LocalKeys,
             config) -> dict[fx.Node, int]:
    """``repeats.repeat_classes`` of ``gm``, inputs told apart by their pinned placement and
    whether they are parameters, graph outputs by where they must land (a forward output, or
    its parameter's placement for a gradient: a row- and a column-parallel weight's gradients
    look alike in the graph), and views of an input by its pinned placement too (a chain of
    views is longer than the rounds see: under activation checkpointing every weight
    transpose is read back through two or three ``alias`` nodes, and a row- and a
    column-parallel weight's chains then shared variables, which paid an all_to_all of each
    weight where their placements differ); ``config.repeat_rounds`` rounds."""
    pinned = dict(zip(roles.primals(gm.graph), primal_placements))
    kind = dict(zip(roles.primals(gm.graph), (o.kind for o in origins)))
    viewed = _through_views(gm, pinned)  # inputs and their views -> the input's pin
    lands: dict[fx.Node, list] = {}
    output = next(iter(gm.graph.find_nodes(op="output")))
    for i, o in enumerate(output.args[0]):
        if isinstance(o, fx.Node):
            lands.setdefault(o, []).append(
                "forward" if i < num_fwd_outputs else grad_placements[i - num_fwd_outputs])
    return repeat_classes(gm, keys, config.repeat_rounds,
                          extra=lambda n: (viewed.get(n), kind.get(n),
                                           tuple(map(str, lands.get(n, ())))))


def _timed(record: list[PlanStage], stage: str, step: Callable, *args, **kwargs):
    """``step(*args, **kwargs)``, timed and appended to ``record``."""
    t = time.perf_counter()
    result = step(*args, **kwargs)
    cost = None if result is None else \
        getattr(result, "total_cost", getattr(result, "total", None))
    record.append(PlanStage(stage, time.perf_counter() - t, result is not None, cost))
    return result


def _separable_start(gm, mesh, primal_placements, num_fwd_outputs, diff_outputs, grad_placements,
                     constraint_of, origins, data_axes, config,
                     stages: list[PlanStage], classes: dict[fx.Node, int],
                     keys: LocalKeys) -> Plan | None:
    """A start for an N-D mesh: one 1-D ILP per mesh axis (each sees only its own axis of every
    pinned placement: FSDP on a data axis, Megatron on a tensor-parallel one), combined per node.

    The axes interact only where both split one tensor dim or a value's size, so the product of
    the per-axis optima is close to the joint optimum; the coordinate descent that follows
    repairs the nodes where the two choices clash. Returns None when the mesh has no axis names.
    Each per-axis ILP is recorded in ``stages``.
    """
    names = mesh.mesh_dim_names
    if not names:
        return None
    per_axis: list[Plan] = []
    for axis, name in enumerate(names):
        def project(pls, axis=axis):
            return None if pls is None else (pls[axis],)

        sub = _timed(stages, f"per-axis start ILP ({name})",
                     _solve_ilp, gm, mesh[name], [project(p) for p in primal_placements],
                     num_fwd_outputs, diff_outputs, [project(g) for g in grad_placements],
                     lambda n, c=constraint_of, pr=project: pr(c(n)), origins,
                     tuple(a for a in data_axes if a == name), config, classes=classes,
                     keys=keys)
        if sub is None:
            return None
        per_axis.append(sub)

    mesh_shape = tuple(mesh.shape)

    def combine(parts):
        if parts[0] is None:
            return None
        if is_placements(parts[0]):
            return intersect_axes(tuple(p[0] for p in parts), mesh_shape)
        return tuple(combine(list(elems)) for elems in zip(*parts))

    nodes = {}
    for name, first in per_axis[0].nodes.items():
        others = [p.nodes[name] for p in per_axis]
        ins = tuple(combine([o.inputs[i] for o in others]) for i in range(len(first.inputs)))
        nodes[name] = dataclasses.replace(first, inputs=ins,
                                          output=combine([o.output for o in others]),
                                          origin="solver (per-axis start)")
    return Plan(tuple(mesh.shape), tuple(names), nodes,
                sorted({f for p in per_axis for f in p.fallbacks}),
                sum(p.total_cost for p in per_axis))


@dataclasses.dataclass
class _Memo:
    """What the ILPs over one graph, mesh and constraints share: priced edges and OpStrategies
    (keyed by layer-invariant signatures: a repeated layer is priced once), the nodes' local
    keys and repeat classes."""

    price: "EdgePricer"
    keys: LocalKeys
    classes: dict
    strategies: dict = dataclasses.field(default_factory=dict)
    edges: dict = dataclasses.field(default_factory=dict)


def _solve_ilp(gm, mesh, primal_placements, num_fwd_outputs, diff_outputs, grad_placements,
               constraint_of, origins, data_axes, config, base=None,
               free_axis=None, memo: _Memo | None = None,
               max_vars: int | None = None, classes: dict | None = None,
               keys: LocalKeys | None = None, valid_base: bool = True,
               budget: float = 0.0) -> Plan | None:
    mesh_shape = tuple(mesh.shape)
    memo = memo or _Memo(EdgePricer(gm, mesh, origins, data_axes, config=config),
                         keys or LocalKeys(gm, constraint_of), classes or {})
    price, edges = memo.price, memo.edges

    def edge_cost(u, o, r) -> float:
        if o == r:
            return 0.0
        key = (price.key(u), o, r)
        cost = edges.get(key)
        if cost is None:
            cost = edges[key] = price(u, o, r)
        return cost

    bwd, data_idx = roles.tangent_dependent(gm.graph), _data_idx(mesh, data_axes)
    ilp = ShardingILP(gm, mesh, primal_placements, num_fwd_outputs, diff_outputs,
                      grad_placements, constraint_of, edge_cost, base=base, free_axis=free_axis,
                      valid_base=valid_base,
                      keep=lambda n, sp: data_parallel_ok(n, sp, bwd, data_idx),
                      strategy_cache=memo.strategies, config=config,
                      max_vars=config.axis_max_vars if max_vars is None else max_vars,
                      keys=memo.keys, classes=memo.classes, price_key=price.key,
                      budget=budget)
    sol = ilp.solve(config.ilp_time_limit_s)
    if sol is None:
        return None
    nodes: dict[str, NodePlan] = {}
    fallbacks: list[str] = []
    for k, node in enumerate(ilp.primals):
        spec = sol.chosen[node]
        nodes[node.name] = NodePlan(node.name, "input", (), spec.output, _INPUT, 0.0, 1,
                                    str(origins[k]) if k < len(origins) else "input")
    env = {n: spec.output for n, spec in sol.chosen.items()}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node in ilp.primals:
            continue
        if node.op == "output":
            continue
        spec = sol.chosen.get(node)
        if spec is None:
            continue
        targs = tensor_args(node) if node.op == "call_function" else []
        edge = sum(edge_cost(a, env[a], r) for a, r in zip(targs, spec.inputs))
        origin = f"solver (1 of {sol.counts[node]})"
        if spec.kind is RuleKind.FALLBACK:
            fallbacks.append(_fallback_message(node, targs, [env[a] for a in targs], edge))
            origin = "fallback: no rule"
        op = "tangent" if node.op == "placeholder" else str(node.target)
        nodes[node.name] = NodePlan(node.name, op, spec.inputs, spec.output, spec.source, edge,
                                    sol.counts[node], origin)
    out_inputs = []
    out_cost = 0.0
    for i, o in enumerate(ilp.outs):
        if not isinstance(o, fx.Node):
            continue
        want = ilp.want(i, env[o])
        out_inputs.append(want)
        out_cost += edge_cost(o, env[o], want)
    nodes[ilp.output.name] = NodePlan(
        ilp.output.name, "output", tuple(out_inputs), None, _OUTPUT, out_cost, 1,
        "forward outputs reduced and evenly split; gradients in their parameter's "
        "placement")
    ndim = len(mesh_shape)
    return Plan(mesh_shape, tuple(mesh.mesh_dim_names or [f"axis{i}" for i in range(ndim)]),
                nodes, fallbacks, sol.objective)


@dataclasses.dataclass
class _WalkResult:
    nodes: dict[str, NodePlan]
    fallbacks: list[str]
    paid: dict[fx.Node, set]   # value -> placements a consumer redistributed it to
    total: float                # total redistribute cost of the plan


class _Walk:
    def __init__(self, gm, mesh, primal_placements, num_fwd_outputs, diff_outputs,
                 grad_placements, constraint_of, origins, data_axes=(),
                 config: PlannerConfig = DEFAULT) -> None:
        self.gm, self.mesh, self.config = gm, mesh, config
        self.mesh_shape = tuple(mesh.shape)
        self.primal_placements = primal_placements
        self.num_fwd_outputs = num_fwd_outputs
        self.diff_outputs = diff_outputs
        self.grad_placements = grad_placements
        self.constraint_of = constraint_of
        self.origins = origins
        self.bwd = roles.tangent_dependent(gm.graph)
        self.saved = saved_values(gm.graph) if config.saved_memory_weight else frozenset()
        self.price = EdgePricer(gm, mesh, origins, data_axes, greedy=True, config=config)
        self.data_idx = _data_idx(mesh, data_axes)
        self.strategies: dict[tuple, list[OpSpec]] = {}
        self.program_factors = program_factors(gm, primal_placements, constraint_of)

    def _specs(self, node, current) -> list[OpSpec]:
        key = (node, tuple(current))
        if key not in self.strategies:
            strided_in = Strided(strided_factors(current), self.program_factors)
            self.strategies[key] = [
                sp for sp in op_strategy(node, current, self.mesh, self.mesh_shape,
                                         self.constraint_of, strided_in)
                if data_parallel_ok(node, sp, self.bwd, self.data_idx)]
        return self.strategies[key]

    def run(self, hints: dict[fx.Node, set]) -> _WalkResult:
        gm, mesh_shape = self.gm, self.mesh_shape
        ndim = len(mesh_shape)
        env: dict[fx.Node, object] = {}
        # placements each value already has somewhere in the program (its own, every
        # redistribute an earlier consumer paid for, and the hints): later consumers get them free
        available: dict[fx.Node, set] = {}
        paid: dict[fx.Node, set] = {}
        nodes: dict[str, NodePlan] = {}
        fallbacks: list[str] = []
        total = 0.0
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        primals = [n for n in placeholders if roles.is_primal(n)]
        tangents = [n for n in placeholders if roles.is_tangent(n)]
        output_node = next(iter(gm.graph.find_nodes(op="output")))
        outs = list(output_node.args[0])

        def pay(a: fx.Node, req) -> float:
            if req == env[a]:
                return 0.0
            a = replicate_source(a, req, env)
            if req == env[a] or req in paid.get(a, ()):
                return 0.0
            paid.setdefault(a, set()).add(req)
            return self.price(a, env[a], req)

        for k, (node, pl) in enumerate(zip(primals, self.primal_placements)):
            env[node] = pl
            origin = str(self.origins[k]) if k < len(self.origins) else "input"
            nodes[node.name] = NodePlan(node.name, "input", (), pl, _INPUT, 0.0, 1, origin)

        def visit(node: fx.Node) -> None:
            nonlocal total
            if node.op not in ("call_function", "get_attr"):
                return
            targs = tensor_args(node)
            current = [env[a] for a in targs]
            if node.target is GETITEM:
                src = env[node.args[0]]
                out = src[node.args[1]] if isinstance(src, tuple) and not is_placements(src) else src
                env[node] = out
                nodes[node.name] = NodePlan(node.name, "getitem", (), out,
                                            RuleSource(RuleKind.GETITEM), 0.0, 1)
                return
            specs = self._specs(node, current)
            origin = "propagated"
            if not specs:
                specs = [replicated_spec(node, ndim, RuleKind.FALLBACK)]
                origin = "fallback: no rule"
            best, best_key = specs[0], None
            for spec in specs:
                srcs = [replicate_source(a, r, env) for a, r in zip(targs, spec.inputs)]
                have = [r == env[a] or r in available.get(a, ()) or r in hints.get(a, ())
                        for a, r in zip(srcs, spec.inputs)]
                cost = sum(0.0 if h else self.price(a, env[a], r)
                           for a, r, h in zip(srcs, spec.inputs, have))
                # A Partial value is a debt: someone pays its reduction later. Charge the debt
                # an OpSpec creates and credit the debt it takes over from a Partial input
                # (only a sole consumer takes a debt over; with other consumers it stays
                # unpaid), so "keep Partial, gather the other operand" is weighed against
                # "reduce now".
                debt = functools.partial(_debt, mesh_shape=mesh_shape, config=self.config)
                cost += (node in self.bwd) * debt(node, spec.output) - sum(
                    debt(a, r) for a, c, r in zip(targs, current, spec.inputs)
                    if r == c and _has_partial(r) and len(a.users) == 1)
                cost += node_cost(node, spec, mesh_shape, self.config)
                if node in self.saved:
                    cost += self.config.saved_memory_weight * held_bytes(node, spec.output,
                                                                         mesh_shape)
                # ties: fewer new redistributes, then no pending reduction. (Preferring the more
                # sharded output here slices replicated activations for free and pays gathers
                # later; DTensor's eager choice, keep the inputs' placements, is the better bet.)
                key = (cost, have.count(False), _has_partial(spec.output))
                if best_key is None or key < best_key:
                    best, best_key = spec, key
            edge = sum(pay(a, r) for a, r in zip(targs, best.inputs))
            total += edge
            for a, r in zip(targs, best.inputs):
                available.setdefault(replicate_source(a, r, env), set()).add(r)
            if best.kind is RuleKind.FALLBACK:
                fallbacks.append(_fallback_message(node, targs, current, edge))
            env[node] = best.output
            available[node] = {best.output}
            nodes[node.name] = NodePlan(node.name, str(node.target), best.inputs, best.output,
                                        best.source, edge, len(specs), origin)

        for node in gm.graph.nodes:
            if node not in self.bwd:
                visit(node)

        final: list[Placements | None] = []
        for o in outs[:self.num_fwd_outputs]:
            if isinstance(o, fx.Node) and isinstance(o.meta.get("val"), torch.Tensor):
                final.append(returnable(tuple(o.meta["val"].shape), env[o], tuple(mesh_shape)))
            else:
                final.append(None)
        for node, j in zip(tangents, self.diff_outputs):
            env[node] = final[j]
            nodes[node.name] = NodePlan(node.name, "tangent", (), final[j],
                                        RuleSource(RuleKind.COTANGENT), 0.0, 1,
                                        f"follows forward output {j}")
        for node in gm.graph.nodes:
            if node in self.bwd:
                visit(node)

        out_inputs: list[Placements] = []
        out_cost = 0.0
        for i, o in enumerate(outs):
            if not isinstance(o, fx.Node):
                continue
            want = final[i] if i < self.num_fwd_outputs else \
                self.grad_placements[i - self.num_fwd_outputs]
            want = want if want is not None else replicate(ndim)
            out_inputs.append(want)
            out_cost += pay(o, want)
        total += out_cost
        nodes[output_node.name] = NodePlan(
            output_node.name, "output", tuple(out_inputs), None, _OUTPUT, out_cost, 1,
            "forward outputs reduced and evenly split; gradients in their parameter's "
            "placement")
        return _WalkResult(nodes, fallbacks, paid, total)


class EdgePricer:
    """Cost of one redistribute of a joint-graph value (bytes-equivalent): ``cost.redistribute_cost``
    x ``config.param_gather_factor`` when a parameter is gathered on a non-data axis (its
    memory), or x ``config.data_axis_activation_factor`` when any other value leaves a Shard on
    a data axis (a DTensor input that is no parameter, ``InputOrigin.parameter``, counts as
    such a value there: a block compiled on its own gets the previous block's activations,
    split over the batch, as a DTensor input, and optimizer state is no parameter either): a
    data axis is the user's statement that samples are split there (DataParallelPlanner), and
    in DDP/FSDP only parameters, gradients and the loss cross it; otherwise, at small batch,
    gathering the token ids and repeating the step on every data-parallel rank moves fewer
    bytes than reducing gradients but is not data parallelism. A reduction before a cast that
    widens the value is priced as the widened value's x ``config.widening_reduction_factor``
    (gradients summed in their parameter's dtype, as DDP and FSDP sum them)."""

    def __init__(self, gm: fx.GraphModule, mesh, origins, data_axes: Sequence[str],
                 greedy: bool = False, config: PlannerConfig = DEFAULT) -> None:
        self.mesh_shape, self.greedy, self.config = tuple(mesh.shape), greedy, config
        weights = axis_weights(mesh)
        self.weights = weights if any(w != 1.0 for w in weights) else None
        self.params = parameter_views(gm, origins, _priced_axes(mesh, data_axes))
        # DTensor inputs that are no parameters: priced as parameters off the data axes, as data
        # on them
        self.not_params = set(parameter_views(
            gm, origins, (), parameters=False)) if data_axes else set()
        self.data_idx = _data_idx(mesh, data_axes)
        self.vocab_inputs = embedding.vocab_gradient_inputs(gm)
        self.widened = widened_dtypes(gm) if config.widening_reduction_factor else {}
        self._keys: dict[fx.Node, tuple] = {}

    def key(self, node: fx.Node) -> tuple:
        """What the price of redistributing ``node`` depends on besides the two placements."""
        key = self._keys.get(node)
        if key is None:
            val = node.meta["val"]
            key = self._keys[node] = (tuple(val.shape), val.dtype, self.params.get(node),
                                      node in self.vocab_inputs, node in self.not_params,
                                      self.widened.get(node))
        return key

    def __call__(self, node: fx.Node, cur, req) -> float:
        val = node.meta["val"]
        wide = self.widened.get(node)
        if wide is not None and any(isinstance(c, Partial) and not isinstance(r, Partial)
                                    for c, r in zip(cur, req)):
            # a sum reduced before the cast that widens it: priced above the reduction after it
            cost = self.config.widening_reduction_factor * redistribute_cost(
                tuple(val.shape), wide, cur, req, self.mesh_shape, self.greedy, self.weights,
                self.config)
        else:
            cost = redistribute_cost(tuple(val.shape), val.dtype, cur, req, self.mesh_shape,
                                     self.greedy, self.weights, self.config)
        priced = self.params.get(node)
        off_data_split = node not in self.vocab_inputs and \
            any(is_split(cur[i]) and cur[i] != req[i] for i in self.data_idx)
        if priced is not None and not (off_data_split and node in self.not_params):
            if any(is_split(cur[i]) and not is_split(req[i]) for i in priced):
                cost *= self.config.param_gather_factor
        elif off_data_split:
            cost *= self.config.data_axis_activation_factor
        return cost


# Ops that only re-index their one tensor input. A Replicate copy of their output is the op
# re-applied, with its global arguments, to a Replicate copy of their input: so a consumer that
# needs the output replicated can share the input's all_reduce/all_gather with other consumers
# (and, through expand, gather the smaller tensor).
REINDEX_OPS = {"aten.permute.default", "aten.view.default", "aten.t.default",
               "aten.alias.default", "aten.unsqueeze.default", "aten.expand.default",
               "aten._unsafe_view.default", "aten.reshape.default", "aten.squeeze.dim",
               "aten.clone.default"}


def replicate_source(a: fx.Node, req, env) -> fx.Node:
    """The node to redistribute when ``a`` must become ``req``: ``a`` itself, or, when ``req`` is
    fully Replicate and ``a`` is a re-index of another value, the first value up that chain."""
    if not is_placements(req) or any(not p.is_replicate() for p in req):
        return a
    while a.op == "call_function" and str(a.target) in REINDEX_OPS and \
            isinstance(a.args[0], fx.Node) and is_placements(env.get(a.args[0])) and \
            all(not isinstance(x, fx.Node) for x in a.args[1:]):
        a = a.args[0]
    return a


# ops whose output still stands for the parameter they read (views, copies, casts: autocast's
# bf16 copy of an fp32 weight), in pricing and in the backend's data-axis report
PARAMETER_VIEWS = {"aten.permute.default", "aten.view.default", "aten.t.default",
                   "aten.alias.default", "aten.clone.default", "aten.expand.default",
                   "aten.unsqueeze.default", "aten._unsafe_view.default", "aten.reshape.default",
                   "prims.convert_element_type.default", "aten._to_copy.default"}


def parameter_views(gm: fx.GraphModule, origins, priced_axes: tuple[int, ...],
                    parameters: bool | None = None) -> dict[fx.Node, tuple[int, ...]]:
    """Parameter inputs (DTensor primals of a floating or complex dtype: integer DTensors are
    token ids or labels, batch data on a data axis) and views/casts of them -> the mesh axes on
    which gathering them is priced as memory. ``parameters``: None takes every such DTensor
    input, True only parameters (``InputOrigin.parameter``), False only the others."""
    return _through_views(gm, {n: priced_axes for n, o in zip(roles.primals(gm.graph), origins)
                              if o.kind is roles.InputKind.DTENSOR and
                              (parameters is None or o.parameter == parameters) and
                              (n.meta["val"].is_floating_point() or n.meta["val"].is_complex())})


def _through_views(gm: fx.GraphModule, seeds: dict[fx.Node, object]) -> dict[fx.Node, object]:
    """``seeds`` plus every chain of ``PARAMETER_VIEWS`` ops (first argument) from a seed, each
    view mapped to its seed's value."""
    found = dict(seeds)
    for node in gm.graph.nodes:
        if node.op == "call_function" and str(node.target) in PARAMETER_VIEWS and \
                node.args and isinstance(node.args[0], fx.Node) and node.args[0] in found:
            found[node] = found[node.args[0]]
    return found


def _debt(node: fx.Node, output, mesh_shape, config: PlannerConfig) -> float:
    """Cost of reducing every Partial axis of ``output`` to Replicate."""
    vals = node.meta["val"]
    pairs = [(vals, output)] if is_placements(output) else list(zip(vals, output))
    total = 0.0
    for v, pls in pairs:
        if pls is None or not isinstance(v, torch.Tensor) or not _has_partial(pls):
            continue
        dst = nonpartial(pls)
        total += redistribute_cost(tuple(v.shape), v.dtype, pls, dst, mesh_shape, config=config)
    return total


def _fallback_message(node: fx.Node, targs, current, edge: float) -> str:

    gathered = sum(nbytes(a.meta["val"].shape, a.meta["val"].dtype) for a in targs)
    where = user_source(node)
    return (f"no sharding rule for {node.target} ({node.name}{', ' + where if where else ''}); "
            f"it runs replicated: inputs {' '.join(fmt(c) for c in current)} are gathered "
            f"({gathered} bytes global), cost {edge:.0f}")


def _data_idx(mesh, data_axes: Sequence[str]) -> tuple[int, ...]:
    names = mesh.mesh_dim_names or ()
    return tuple(i for i, n in enumerate(names) if n in data_axes)


def data_parallel_ok(node: fx.Node, spec: OpSpec, bwd: set, data_idx: tuple[int, ...]) -> bool:
    """On a data axis the forward never holds a pending sum (but for a scalar: the loss): data
    parallelism splits samples, so forward values are split or replicated there, and Partial
    appears only for gradients (which the backward reduces). Without this the cost model, at small batch, may use the data
    axis as a second tensor-parallel axis (contractions split over it)."""
    if not data_idx or node in bwd or spec.kind in (RuleKind.MANUAL, RuleKind.CONSTRAINT):
        return True  # the user's own placements
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.numel() == 1:
        return True  # a scalar (the loss): one small all_reduce, as DDP reduces it
    outs = [spec.output] if is_placements(spec.output) else [o for o in spec.output if o]
    return not any(isinstance(pls[i], Partial) for pls in outs for i in data_idx)


def _priced_axes(mesh, data_axes: Sequence[str]) -> tuple[int, ...]:
    names = mesh.mesh_dim_names or ()
    return tuple(i for i in range(mesh.ndim) if i >= len(names) or names[i] not in data_axes)


def _has_partial(output) -> bool:
    outs = [output] if is_placements(output) else [o for o in output if o]
    return any(isinstance(p, Partial) for pls in outs for p in pls)


