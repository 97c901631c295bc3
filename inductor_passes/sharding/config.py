"""The planner's knobs, in one frozen, validated object.

``propagate`` and the cost model read every setting from a ``PlannerConfig``; the backend takes
one from ``torch.compile(..., backend="dist", options={"planner": PlannerConfig(...)})`` or,
when none is given, from the environment (``PlannerConfig.from_env``: the one place the
planner's environment variable is read). The config is part of the plan-cache key, so a plan
made under other settings is never reused.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Mapping


class PlanMethod(enum.Enum):
    ILP = "ilp"  # integer program over every node's OpSpecs (HiGHS); greedy walk where too large
    GREEDY = "greedy"  # the repeated greedy walk only (GSPMD-style sweeps)


# the fields that may be 0 (every other number must be >= 1; the time limit > 0)
_MAY_BE_ZERO = ("descent_rounds", "repeat_rounds", "latency_bytes", "reslice_cost", "bytes_per_flop",
                "saved_memory_weight", "saved_memory_budget_bytes", "widening_reduction_factor")


@dataclasses.dataclass(frozen=True)
class PlannerConfig:
    """Settings of the whole-graph sharding planner. Units: bytes-equivalent for costs (one byte
    on the wire), seconds for time, counts for sizes. Raises ValueError on construction when a
    field is out of range.

    ``method``: ILP (default) or the greedy walk alone.
    ``greedy_rounds``: greedy walks, each treating the redistributes the best plan so far paid
    for as already available (a small local search).
    ``ilp_time_limit_s``: HiGHS time limit of each ILP (seconds; its LP relaxation and, where that
    is not integral, the MIP share it: ``solver._solve``).
    ``joint_max_vars``: the joint N-D ILP is tried only below this many variables (it is the exact
    optimum but grows fast: 238k variables for Llama-3-8B shapes on 8 x 8 even with repeated
    layers sharing variables, not solved in 30 s; at 100k it is abandoned while enumerating,
    2.7 s sooner at 32 layers); also the cap of the joint ILP over the parts outside the
    repeated layers (68k there, 4.5 s).
    ``axis_max_vars``: cap of the per-axis ILPs (separable start and descent): 330k variables at
    32 layers of Llama-3-8B on 8 x 8 solve in a few seconds each; below this cap the planner
    fell back to its greedy walk there (31.1 GiB on the wire per step against 24.6 GiB).
    ``descent_rounds``: rounds of per-axis block coordinate descent on an N-D mesh (an axis
    whose fixed axes did not change since it was last solved is skipped: it cannot improve).
    ``max_options``: OpSpecs kept per node in an ILP: those whose every input placement some
    option of its producer holds first (no redistribute needed), then in the rules' order.
    ``repeat_rounds``: rounds of colour refinement that find the nodes of repeated layers
    (``repeats.repeat_classes``); each class shares one set of ILP choice variables, so the
    ILPs stay one layer's size in depth. More rounds tell more nodes near a model's first and
    last layer apart (left free); 0 turns the sharing off.
    ``min_repeats``: only classes with at least this many members share variables. Sharing is
    a restriction (members choose alike, and a class only sees ``repeat_rounds`` hops): with
    classes of 2, a 2-layer Llama planned 13% dearer and a 2-layer MLP stack 2x; so models with
    few repeats are planned free (the saving is in depth, not there).
    ``param_gather_factor``: a parameter gathered on a non-data axis stays resident on every
    rank, so its gather is priced at this multiple of its bytes (without a memory term the
    cheapest plan by bytes replicates parameters, as AutoParallel reports).
    ``data_axis_activation_factor``: moving any value but a parameter off a Shard on a data axis
    (gathering the batch) is priced at this multiple: in effect forbidden, as a soft constraint
    that keeps the ILP feasible.
    ``latency_bytes``: per-collective latency, in bytes so that it adds to the bandwidth term
    (the alpha of the alpha-beta model).
    ``reslice_cost``: a local re-slice (Replicate -> Shard: no communication).
    ``bytes_per_flop``: the exchange rate of compute to bytes on the wire: one byte ~ 1000 flops,
    a GPU machine's balance (H100: ~1e15 flop/s against ~4.5e11 B/s of NVLink per direction is
    ~2000). The term keeps the solver from gathering a weight and repeating the whole matmul on
    every rank; at this weight it no longer buys a small compute split with extra collectives
    (splitting the lm_head over the batch on a tensor-parallel axis saved flops but cost four
    collectives a step at 1/100).
    ``saved_memory_weight``: the price of one byte a rank keeps from the forward for the
    backward (``cost.saved_values``: the activations), in bytes on the wire. A plan that
    replicates a saved activation to save a collective pays it on every rank until the backward
    reads it; priced, the planner splits it where a collective costs less than that memory
    (sequence parallelism, Korthikanti et al. 2022, is the textbook trade). 0 turns it off.
    ``saved_memory_budget_bytes``: at most this many bytes kept for the backward per rank
    (``cost.saved_bytes`` of the plan; 0: no budget). A row of the whole-program ILP, whose
    answer is then the constrained optimum. A plan still over it (an N-D program too large for
    one ILP, or no plan fits the row) is planned again with ``saved_memory_weight`` raised
    tenfold (from 0.01) until one fits, then bisected twice towards the least weight that
    fits: a Lagrangian relaxation, each plan optimal for its own price (the trade is monotone
    in the weight), each try a whole planning. ``propagate`` raises DistCompileError when even
    weight 1e4 does not fit.
    ``widening_reduction_factor``: a pending sum in a narrow float dtype whose every use casts
    it wider (under autocast, the bf16 gradient of an fp32 parameter) is reduced after the
    cast, as DDP and FSDP reduce the fp32 gradient: its reduction before the cast is priced at
    this multiple of the widened value's (``rules.pointwise.widened_dtypes``). Summed in bf16,
    each gradient is rounded once more (an autocast head on dp=2: 2.7e-3 off one device,
    against 2.2e-3 summed in fp32). 0 prices it by its own bytes (half the traffic: the bf16
    sum, FSDP's ``reduce_dtype=bfloat16``).
    """

    method: PlanMethod = PlanMethod.ILP
    greedy_rounds: int = 3
    ilp_time_limit_s: float = 30.0
    joint_max_vars: int = 200_000
    axis_max_vars: int = 1_000_000
    descent_rounds: int = 2
    max_options: int = 64
    repeat_rounds: int = 3
    min_repeats: int = 8
    param_gather_factor: float = 3.0
    data_axis_activation_factor: float = 1e4
    latency_bytes: float = 64 * 1024
    reslice_cost: float = 1.0
    bytes_per_flop: float = 1.0 / 1000
    saved_memory_weight: float = 0.0
    saved_memory_budget_bytes: float = 0.0
    widening_reduction_factor: float = 1.05

    def __post_init__(self) -> None:
        if not isinstance(self.method, PlanMethod):
            try:
                object.__setattr__(self, "method", PlanMethod(self.method))
            except ValueError:
                raise ValueError(f"PlannerConfig.method: {self.method!r} is not one of "
                                 f"{[m.value for m in PlanMethod]}") from None
        for field in dataclasses.fields(self)[1:]:  # the numbers after ``method``
            value, integral = getattr(self, field.name), field.type == "int"
            if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)):
                raise ValueError(f"PlannerConfig.{field.name}: {value!r} is not "
                                 f"{'an int' if integral else 'a number'}")
            if field.name == "ilp_time_limit_s" and value <= 0:
                raise ValueError(f"PlannerConfig.{field.name}: {value!r} must be > 0")
            least = 0 if field.name in _MAY_BE_ZERO else 1
            if value < least:
                raise ValueError(f"PlannerConfig.{field.name}: {value!r} must be >= {least}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "PlannerConfig":
        """The defaults, overridden by ``DYNAMO_DIST_PLANNER`` (``field=value`` pairs separated
        by commas, e.g. ``"method=greedy,ilp_time_limit_s=5"``). Raises ValueError naming an
        unknown field or a bad value."""
        text = (os.environ if environ is None else environ).get(ENV, "").strip()
        if not text:
            return cls()
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        values: dict = {}
        for item in text.split(","):
            name, eq, raw = (s.strip() for s in item.partition("="))
            if not eq or name not in types:
                raise ValueError(f"{ENV}: {item!r} is not field=value with a field of "
                                 f"PlannerConfig ({', '.join(types)})")
            try:
                values[name] = raw if name == "method" else \
                    int(raw) if types[name] == "int" else float(raw)
            except ValueError:
                raise ValueError(f"{ENV}: {name}={raw!r} is not a {types[name]}") from None
        return cls(**values)


ENV = "DYNAMO_DIST_PLANNER"
DEFAULT = PlannerConfig()
