"""The five contestants: five ways to run the same training step of a workload.

Every contestant starts from the same weights (``workload.build_model()``), sees the same global
batch at step ``i``, uses the same loss and optimizer, and does forward + backward + optimizer step
+ ``zero_grad`` per step:

  eager_1p          one process, eager (rank 0 only; the other ranks wait at a barrier)
  inductor_1p       one process, ``torch.compile`` (Inductor)
  dtensor_eager     torch's ``parallelize_module`` with the workload's tp plan on the ``tp`` axis,
                    plus FSDP2 ``fully_shard`` on the ``dp`` axis when the mesh has one; eager
  dtensor_inductor  the same model and plan under ``torch.compile`` (Inductor), whole model
  ours              ``shard_module`` with TensorParallelPlanner (+ DataParallelPlanner on ``dp``)
                    and ``torch.compile(backend="dist")``: the whole model, or
                    (``--ours-compile blocks``) each of the workload's FSDP units on its own,
                    the rest eager (torchtitan's per-block compile)

DTensor contestants feed each dp rank its piece of the global batch (as FSDP expects); ours is fed
the global batch (its planner shards it). DTensor contestants run with torch's default DTensor
settings: the implicit-replication switch that dynamo_dist turns on process-wide is turned off
around their calls and back on around ours.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from .memory import local_bytes, resident_tensors
from .workload import Batch, Workload

NAMES = ("eager_1p", "inductor_1p", "dtensor_eager", "dtensor_inductor", "ours")
COMPILED = {"inductor_1p", "dtensor_inductor", "ours"}
ONE_PROCESS = {"eager_1p", "inductor_1p"}


@dataclasses.dataclass
class Contestant:
    """One contestant on this rank. ``active`` is False on ranks that do not run it (ranks > 0
    for one-process contestants); an inactive contestant has no model."""

    name: str
    workload: Workload
    device: torch.device
    active: bool
    model: nn.Module | None = None          # the trained module (not the compiled wrapper)
    fn: Callable | None = None              # what a step calls
    opt: torch.optim.Optimizer | None = None
    dp: tuple[int, int] | None = None       # (dp index, dp size): feed this piece of the batch
    dp_group: Any = None                    # where the loss is averaged (DTensor + dp)
    implicit_replication: bool = False
    cache_dir: str | None = None            # this contestant's TORCHINDUCTOR_CACHE_DIR
    status: str = "ok"
    records: list = dataclasses.field(default_factory=list)   # ours: graphs of its last compile

    @property
    def compiled(self) -> bool:
        return self.name in COMPILED

    @property
    def spmd(self) -> bool:
        """Runs on every rank (collectives), as opposed to rank 0 alone."""
        return self.name not in ONE_PROCESS

    @contextlib.contextmanager
    def env(self):
        """DTensor implicit replication as this contestant needs it, and its Inductor cache."""
        from inductor_passes.core import compat

        old_flag = compat.implicit_replication_enabled()
        old_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        compat.allow_implicit_replication(self.implicit_replication)
        if self.cache_dir:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = self.cache_dir
        try:
            yield
        finally:
            compat.allow_implicit_replication(old_flag)
            if old_dir is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = old_dir

    def prepare(self, batch: Batch) -> Batch:
        batch = batch.to(self.device)
        return batch.shard(*self.dp) if self.dp else batch

    def forward(self, batch: Batch) -> torch.Tensor:
        b = self.prepare(batch)
        return self.workload.loss(self.fn(*b.args, **b.kwargs))

    def step(self, batch: Batch) -> torch.Tensor:
        """One training step; returns the (detached) loss as the contestant produced it."""
        from dynamo_dist import compile_records

        n0 = len(compile_records())
        with self.env():
            loss = self.forward(batch)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        new = compile_records()[n0:]
        if new and self.name == "ours":
            self.records = new
        return loss.detach()

    def loss_value(self, loss: torch.Tensor) -> float:
        """The GLOBAL loss as a float (collective for DTensor + dp: the mean over dp ranks)."""
        from torch.distributed.tensor import DTensor

        with self.env():
            if isinstance(loss, DTensor):
                loss = loss.full_tensor()
            if self.dp_group is not None:
                loss = loss.detach().clone()
                dist.all_reduce(loss, group=self.dp_group)
                loss = loss / self.dp[1]
            return float(loss)

    def eval_loss(self, batch: Batch) -> float:
        """Forward only (grad mode on, so compiled code is reused), the global loss."""
        with self.env():
            loss = self.forward(batch).detach()
        return self.loss_value(loss)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """name -> full (global) parameter on CPU; collective on SPMD contestants."""
        from torch.distributed.tensor import DTensor

        out = {}
        with self.env(), torch.no_grad():
            for name, p in self.model.named_parameters():
                full = p.full_tensor() if isinstance(p, DTensor) else p
                out[name] = full.detach().cpu().clone()
        return out

    def resident_bytes(self) -> int:
        return local_bytes(resident_tensors(self.model, self.opt))


def build(name: str, workload: Workload, mesh, device: torch.device,
          ours_compile: str = "model") -> Contestant:
    """Build contestant ``name`` on this rank (a collective for SPMD contestants).
    ``ours_compile``: "model" compiles ours whole, "blocks" each FSDP unit on its own."""
    rank = dist.get_rank()
    c = Contestant(name, workload, device, active=(name not in ONE_PROCESS or rank == 0))
    if not c.active:
        return c
    if name not in NAMES:
        raise ValueError(f"unknown contestant {name!r}; known: {', '.join(NAMES)}")
    c.implicit_replication = name == "ours"
    with c.env():
        model = workload.build_model().to(device)
        if name in ONE_PROCESS:
            c.fn = torch.compile(model) if name == "inductor_1p" else model
        elif name in ("dtensor_eager", "dtensor_inductor"):
            _parallelize_torch(model, workload, mesh)
            if "dp" in workload.mesh:
                c.dp = (mesh["dp"].get_local_rank(), workload.mesh["dp"])
                c.dp_group = mesh["dp"].get_group()
            c.fn = torch.compile(model) if name == "dtensor_inductor" else model
        else:
            _shard_ours(model, workload, mesh)
            if ours_compile == "blocks":
                from dynamo_dist import compile_blocks

                compile_blocks(model, workload.fsdp_units(model))
                c.fn = model
            else:
                c.fn = torch.compile(model, backend="dist")
    c.model = model
    c.opt = workload.make_optimizer(model.parameters())
    return c


def _parallelize_torch(model: nn.Module, workload: Workload, mesh) -> None:
    """torch's own recipe: parallelize_module on tp, then FSDP2 on dp (units, then the root)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if "tp" in workload.mesh:
        parallelize_module(model, mesh["tp"], workload.torch_tp_plan(model))
    if "dp" in workload.mesh:
        from torch.distributed.fsdp import fully_shard

        for unit in workload.fsdp_units(model):
            fully_shard(unit, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])


def disable_schedule_check() -> None:
    """Turn off dynamo_dist's compile-time rank-divergence check (``--skip-schedule-check``).

    Before commit 94d2e33 the check compared process-group names, which differ between ranks of
    different sub-mesh groups on a 2-D mesh (rank 0's dp group is '1', rank 1's is '2'), so it
    rejected every dp x tp program although all ranks issue the same collectives. The flag lets
    ours be measured on dp x tp at such commits; the results record that it was used."""
    import dynamo_dist.backend as backend

    backend.check_same_schedule = lambda graphs, what: None


def _shard_ours(model: nn.Module, workload: Workload, mesh) -> None:
    from dynamo_dist.plans import DataParallelPlanner, TensorParallelPlanner, shard_module

    plan = None
    if "tp" in workload.mesh:
        plan = TensorParallelPlanner(axis="tp").build_plan(model)
    if "dp" in workload.mesh:
        plan = DataParallelPlanner(axis="dp", shard_params=True,
                                   mesh_axis_size=workload.mesh["dp"]).build_plan(model, plan)
    shard_module(model, mesh, plan)
