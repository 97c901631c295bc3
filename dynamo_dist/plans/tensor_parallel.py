"""``TensorParallelPlanner``: Megatron-style tensor parallelism (Shoeybi et al., 2019) from the
program's own dataflow (``dataflow.trace_projections``), with a structural fallback."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch.nn as nn
from torch.distributed.tensor.placement_types import Replicate, Shard

from inductor_passes.core.placements import is_split, split_factor, strided

from .apply import parameter_groups
from .dataflow import Dataflow, Projection, example_inputs, trace_projections
from .spec import ParamDecision, ShardingPlan

log = logging.getLogger("dynamo_dist")

_COLWISE = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query", "key", "value", "gate_proj",
            "up_proj", "fc1", "c_fc", "w1", "w3", "in_proj", "wq", "wk", "wv")
_ROWWISE = ("o_proj", "out_proj", "down_proj", "fc2", "c_proj", "w2", "wo", "dense")


class ShardingPlanner:
    """Builds a ShardingPlan from a module; ``base`` is a plan to extend (planners compose: a
    later planner sees which tensor dims earlier ones already shard)."""

    def build_plan(self, module: nn.Module, base: ShardingPlan | None = None, *,
                   example_inputs: Any = None) -> ShardingPlan:
        raise NotImplementedError

    def __post_init__(self) -> None:
        axis = getattr(self, "axis", "")
        if not isinstance(axis, str):  # TensorParallelPlanner(mesh) reads as the axis name
            raise TypeError(f"{type(self).__name__}: axis must be a mesh axis name, got "
                            f"{type(axis).__name__} ({axis!r:.80}); fix: "
                            f"{type(self).__name__}(axis=\"tp\"), and pass the mesh to "
                            f"shard_module")


@dataclasses.dataclass(frozen=True)
class TensorParallelPlanner(ShardingPlanner):
    """Megatron tensor parallelism on mesh axis ``axis``.

    Column/row pairs come from one forward run of the module on small example inputs
    (``build_plan(..., example_inputs=(args, kwargs))``; transformers models bring their own):
    a projection whose output features, possibly through activations, gating and per-head
    attention, reach another projection's input is column-parallel (weight split on its output
    features: ``Shard(0)`` for ``nn.Linear``, ``Shard(1)`` for transformers' ``Conv1D``, the
    middle dim of a 3-D expert tensor), and that reader is row-parallel (split on its input
    features); a column bias is split with its output, a row bias stays whole. A fused column
    projection whose output the program splits into k equal parts (GPT-2's ``c_attn`` q|k|v,
    gate|up) is split block-strided, ``_StridedShard(out_dim, split_factor=k)``: every rank
    holds its slice of each part, as in Megatron-LM (with ``mesh_axis_size`` n given, only where
    k x n divides its width; otherwise, and for unequal parts, contiguously, which regathers).
    Projections that pair with nothing (the output head, a MoE router, a pooler) stay
    replicated, except the output head with ``shard_output_head`` (vocabulary-parallel logits).
    Embedding tables stay replicated, or with ``shard_embedding`` are split over the vocabulary
    (``Shard(0)``: Megatron-LM's VocabParallelEmbedding; each rank looks up the rows it holds,
    and one all_reduce of the looked-up rows per forward sums them; the table's memory and its
    optimizer state are divided by the axis size; not for ``max_norm`` tables, which renormalise
    the rows they look up in place, or sparse ones).
    Given ``mesh_axis_size``, a column projection whose output is viewed as a number of heads
    that size does not divide (multi-query attention's single key/value head) stays replicated:
    a split would cut a head. Without example inputs
    for a module that is not a transformers model, pairs are read from the module structure:
    well-known projection names, else Linear children of one parent that widen and narrow
    back. Every parameter gets a ``ParamDecision`` saying what it was taken for and why
    (``plan.summary()``); the count is logged.
    """

    axis: str = "tp"
    shard_output_head: bool = False
    shard_embedding: bool = False
    mesh_axis_size: int | None = None

    def build_plan(self, module: nn.Module, base: ShardingPlan | None = None, *,
                   example_inputs: Any = None) -> ShardingPlan:
        flow, how = self._dataflow(module, example_inputs)
        projections = flow.projections
        head = _output_head(module)
        plan: dict[str, Any] = {}
        decisions: list[ParamDecision] = []
        decided: set[int] = set()
        groups = parameter_groups(module)
        names_of = {id(p): tuple(names) for p, names in groups}
        for p, names in groups:
            proj = projections.get(id(p))
            if proj is None or id(p) in decided:
                continue
            decided.add(id(p))
            placement, role, reason = self._decide(proj, projections, head is not None and
                                                   id(head) == id(p), how)
            decisions.append(ParamDecision(tuple(names), tuple(p.shape), self.axis, placement,
                                           role, reason))
            if is_split(placement):
                for n in names:
                    plan[n] = {self.axis: placement}
            if proj.bias is not None and id(proj.bias) not in decided:
                decided.add(id(proj.bias))
                bias_names = names_of[id(proj.bias)]
                if is_split(placement) and role.startswith("column"):
                    bias_pl = strided(proj.bias.ndim - 1, split_factor(placement))
                    for n in bias_names:
                        plan[n] = {self.axis: bias_pl}
                    decisions.append(ParamDecision(bias_names, tuple(proj.bias.shape), self.axis,
                                                   bias_pl, "column bias",
                                                   "split with its projection's outputs"))
                else:
                    decisions.append(ParamDecision(
                        bias_names, tuple(proj.bias.shape), self.axis, Replicate(),
                        "row bias" if role == "row" else "replicated",
                        "added once, after the row-parallel all_reduce" if role == "row" else
                        "its projection is replicated"))
        for p, names in groups:
            heads = flow.head_tables.get(id(p))
            if id(p) in decided or heads is None:
                continue
            decided.add(id(p))
            if self.mesh_axis_size and heads % self.mesh_axis_size:
                decisions.append(ParamDecision(tuple(names), tuple(p.shape), self.axis,
                                               Replicate(), "replicated",
                                               f"its columns are {heads} attention heads, which "
                                               f"{self.axis} size {self.mesh_axis_size} does "
                                               f"not divide"))
                continue
            for n in names:
                plan[n] = {self.axis: Shard(p.ndim - 1)}
            decisions.append(ParamDecision(tuple(names), tuple(p.shape), self.axis,
                                           Shard(p.ndim - 1), "head table",
                                           "its columns are attention heads (a relative position "
                                           "bias added to each head's scores): split with them"))
        for p, names in groups:
            if id(p) in decided or not self.shard_embedding or \
                    not _splittable_table(_owner(module, names[0])):
                continue
            decided.add(id(p))
            for n in names:
                plan[n] = {self.axis: Shard(0)}
            decisions.append(ParamDecision(tuple(names), tuple(p.shape), self.axis, Shard(0),
                                           VOCAB_PARALLEL,
                                           "each rank looks up the rows it holds; one all_reduce "
                                           "of the looked-up rows (shard_embedding=True)"))
        for p, names in groups:
            if id(p) not in decided:
                decisions.append(ParamDecision(tuple(names), tuple(p.shape), self.axis,
                                               Replicate(), "replicated",
                                               _why_not_projection(module, names[0], p)))
        result = ShardingPlan(plan=plan, decisions=tuple(decisions))
        _log_summary(type(self).__name__, self.axis, decisions, how)
        return base.merged(result) if base is not None else result

    def _dataflow(self, module: nn.Module, inputs: Any) -> tuple[Dataflow, str]:
        """The projections with their roles (and head tables), and how they were found."""
        if inputs is None:
            inputs = example_inputs(module)
        if inputs is not None:
            args, kwargs = _as_call(inputs)
            try:
                return trace_projections(module, args, kwargs), "dataflow"
            except Exception as exc:  # noqa: BLE001 -- any forward failure: use the structure
                log.warning("dynamo_dist: TensorParallelPlanner could not run %s on its example "
                            "inputs (%s: %s); pairing projections by module structure instead",
                            type(module).__name__, type(exc).__name__, exc)
        return Dataflow(_structural_projections(module), {}), "structure"

    def _decide(self, proj: Projection, projections: dict[int, Projection], is_head: bool,
                how: str):
        """(placement, role, reason) for one projection weight."""
        if proj.conflict:
            return Replicate(), "replicated", proj.conflict
        if proj.role == "row":
            feeders = [projections[c] for c in proj.fed_by]
            if all(not f.conflict for f in feeders):
                return Shard(proj.in_dim), "row", \
                    f"reads the split outputs of {len(feeders)} column-parallel projection(s) " \
                    f"({how}); one all_reduce after it"
            return Replicate(), "replicated", "a projection feeding it is replicated"
        if proj.feeds and self.mesh_axis_size and proj.heads and \
                proj.heads % self.mesh_axis_size:
            return Replicate(), "whole heads", \
                f"its output holds {proj.heads} attention head(s), which {self.axis} size " \
                f"{self.mesh_axis_size} does not divide: a split would cut a head (attention " \
                f"reads it whole beside the split query)"
        if proj.feeds:
            if proj.parts and (self.mesh_axis_size is None or
                               proj.width % (proj.parts * self.mesh_axis_size) == 0):
                return strided(proj.out_dim, proj.parts), "column", \
                    f"fused projection: its output is split in {proj.parts} equal parts, so " \
                    f"every rank holds its slice of each part (_StridedShard, Megatron's " \
                    f"layout) and the parts split on local shards without a gather; they " \
                    f"reach {len(proj.feeds)} row-parallel projection(s) ({how})"
            if proj.parts is not None:
                why = "unequal parts" if not proj.parts else \
                    f"{proj.width} is not {proj.parts} parts x {self.mesh_axis_size} ranks"
                return Shard(proj.out_dim), "column", \
                    f"fused projection ({why}): a contiguous shard does not hold whole parts, " \
                    f"so the compiler regathers its output before the split"
            return Shard(proj.out_dim), "column", \
                f"its split outputs reach {len(proj.feeds)} row-parallel projection(s) ({how})"
        if is_head and self.shard_output_head:
            return Shard(proj.out_dim), "column", "output head: vocabulary-parallel logits " \
                                                  "(shard_output_head=True)"
        if is_head:
            return Replicate(), "replicated", "output head (set shard_output_head=True for " \
                                              "vocabulary-parallel logits)"
        return Replicate(), "replicated", "no row-parallel projection reads its outputs (a " \
                                          "router, pooler or classifier): splitting it would " \
                                          "gather its output"


def _as_call(inputs: Any) -> tuple[tuple, dict]:
    """``example_inputs`` as (args, kwargs): a (tuple, dict) pair, a dict of kwargs, a tuple
    of args or one tensor."""
    if isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[0], (tuple, list)) \
            and isinstance(inputs[1], dict):
        return tuple(inputs[0]), dict(inputs[1])
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def _output_head(module: nn.Module) -> nn.Parameter | None:
    """The output head's weight: transformers' ``get_output_embeddings()``, else a Linear named
    ``lm_head`` or ``output``."""
    get = getattr(module, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        for name, m in module.named_modules():
            if name.endswith(("lm_head", "output")) and isinstance(m, nn.Linear):
                head = m
    return getattr(head, "weight", None)


VOCAB_PARALLEL = "vocabulary-parallel embedding"


def _owner(module: nn.Module, name: str) -> nn.Module:
    owner_name = name.rpartition(".")[0]
    return module.get_submodule(owner_name) if owner_name else module


def _splittable_table(owner: nn.Module) -> bool:
    """An ``nn.Embedding`` a vocabulary split computes right: no in-place renormalisation of
    the rows it reads (``max_norm``), a dense gradient."""
    return isinstance(owner, nn.Embedding) and owner.max_norm is None and not owner.sparse


def _why_not_projection(module: nn.Module, name: str, p) -> str:
    leaf = name.rpartition(".")[2]
    owner = _owner(module, name)
    kind = type(owner).__name__
    if isinstance(owner, nn.Embedding):
        return "embedding table (set shard_embedding=True to split it over the vocabulary: " \
               "one all_reduce of the looked-up rows per forward)" if _splittable_table(owner) \
            else "embedding table with max_norm or a sparse gradient: kept whole"
    if isinstance(owner, nn.modules.conv._ConvNd):
        return f"convolution {kind}.{leaf}: tensor parallelism plans projections only (use " \
               f"DataParallelPlanner for ConvNets)"
    if "Norm" in kind:
        return f"{kind}.{leaf}: normalisation scale/shift on whole activations (small)"
    return f"{kind}.{leaf}: not read as a projection weight by the forward (added to or " \
           f"scaling whole activations)"


def _log_summary(planner: str, axis: str, decisions: list[ParamDecision], how: str) -> None:
    sharded = [d for d in decisions if d.sharded]
    roles: dict[str, int] = {}
    for d in decisions:
        roles[d.role] = roles.get(d.role, 0) + 1
    log.info("dynamo_dist: %s(%s) from %s: %d of %d parameters sharded (%s); "
             "plan.summary() lists each with its reason", planner, axis, how, len(sharded),
             len(decisions), ", ".join(f"{n} {r}" for r, n in sorted(roles.items())))


# -- structural fallback (no example inputs) ---------------------------------------------------
def _structural_projections(module: nn.Module) -> dict[int, Projection]:
    """Column/row pairs from the module tree: well-known projection names, else Linear children
    of one parent that read the parent's width, widen it and map back."""
    out: dict[int, Projection] = {}
    for _, parent in module.named_modules():
        linears = [(n, m) for n, m in parent.named_children() if isinstance(m, nn.Linear)]
        if len(linears) < 2:
            continue
        roles = _structural_roles(linears)
        cols = [m for (_, m), r in zip(linears, roles) if r == "col"]
        rows = [m for (_, m), r in zip(linears, roles) if r == "row"]
        if not cols or not rows:
            continue
        for m in cols:
            out[id(m.weight)] = Projection(m.weight, 0, 1, m.out_features, m.bias, "column",
                                           feeds=[id(r.weight) for r in rows])
        for m in rows:
            out[id(m.weight)] = Projection(m.weight, 0, 1, m.out_features, m.bias, "row",
                                           fed_by=[id(c.weight) for c in cols])
    for _, m in module.named_modules():  # the output head, for shard_output_head
        if isinstance(m, nn.Linear) and id(m.weight) not in out:
            out[id(m.weight)] = Projection(m.weight, 0, 1, m.out_features, m.bias, "column")
    return out


def _structural_roles(linears) -> list[str | None]:
    names = [n for n, _ in linears]
    if any(n in _COLWISE for n in names) and any(n in _ROWWISE for n in names):
        return ["col" if n in _COLWISE else "row" if n in _ROWWISE else None for n in names]
    first, last = linears[0][1], linears[-1][1]
    width = first.in_features
    if last.out_features == width and all(m.in_features == width for _, m in linears[:-1]):
        return ["col"] * (len(linears) - 1) + ["row"]
    return [None] * len(linears)
