"""``DataParallelPlanner``: the batch split over a data axis, parameters sharded (FSDP / ZeRO-3)
or replicated (DDP)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

import torch.nn as nn
from torch.distributed.tensor.placement_types import Replicate, Shard

from inductor_passes.core.placements import is_split

from .apply import parameter_groups
from .spec import ParamDecision, ShardingPlan
from .tensor_parallel import ShardingPlanner, _log_summary

log = logging.getLogger("dynamo_dist")


@dataclasses.dataclass(frozen=True)
class DataParallelPlanner(ShardingPlanner):
    """Data parallelism on mesh axis ``axis``: inputs split on the batch dim (``Shard(0)``).

    ``shard_params=True`` is fully-sharded data parallel (ZeRO-3 / FSDP, Rajbhandari et al. 2020):
    each parameter is sharded on the first tensor dim that no other mesh axis already splits
    (and, given ``mesh_axis_size``, that it divides evenly); the compiler all-gathers it where it
    is used and reduce-scatters its gradient. ``shard_params=False`` replicates parameters (DDP:
    gradients all-reduced). ``inputs``: the forward arguments that carry the batch (positions or
    names); the default ``("*",)`` splits every tensor argument on its dim 0.
    """

    axis: str = "dp"
    shard_params: bool = True
    inputs: tuple[int | str, ...] = ("*",)
    mesh_axis_size: int | None = None

    def build_plan(self, module: nn.Module, base: ShardingPlan | None = None, *,
                   example_inputs: Any = None) -> ShardingPlan:
        base = base or ShardingPlan()
        plan: dict[str, Any] = {}
        decisions: list[ParamDecision] = []
        for p, names in parameter_groups(module):
            taken = [base.placement_for(n) for n in names]
            used = {pl.dim for spec in taken if isinstance(spec, Mapping)
                    for pl in spec.values() if is_split(pl)}
            dim, why = self._dim(p, used)
            if dim is None:
                decisions.append(ParamDecision(tuple(names), tuple(p.shape), self.axis,
                                               Replicate(), "replicated", why))
                continue
            for n, spec in zip(names, taken):
                plan[n] = {**(spec if isinstance(spec, Mapping) else {}), self.axis: Shard(dim)}
            decisions.append(ParamDecision(tuple(names), tuple(p.shape), self.axis, Shard(dim),
                                           "fsdp", why))
        _log_summary(type(self).__name__, self.axis, decisions, "parameter shapes")
        input_plan = {k: {self.axis: Shard(0)} for k in self.inputs}
        return base.merged(ShardingPlan(plan=plan, input_plan=input_plan, data_axes=(self.axis,),
                                        decisions=tuple(decisions)))

    def _dim(self, p, used: set[int]) -> tuple[int | None, str]:
        if not self.shard_params:
            return None, "DDP (shard_params=False): replicated, its gradient all-reduced"
        for d in range(p.ndim):
            if d in used:
                continue
            if self.mesh_axis_size and p.shape[d] % self.mesh_axis_size:
                continue
            return d, f"FSDP: gathered where used, gradient reduce-scattered (tensor dim {d})"
        if p.ndim == 0:
            return None, "0-d: nothing to split; its gradient is all-reduced"
        return None, (f"no tensor dim free of other mesh axes divides by {self.mesh_axis_size}: "
                      f"replicated, its gradient all-reduced")
