"""One zoo cell: one architecture on one mesh, trained a few AdamW steps with ``backend="dist"``
and compared with the same model in one process.

Runtimes: ``sim`` (every rank simulated in this process: a ``fake`` process group,
``LocalTensorMode`` for the eager parts, ``options={"simulate": True}`` for the compiled ones;
FX local graphs, no Inductor), ``gloo`` (this process is one real rank under torchrun;
Inductor by default) and ``cuda`` (a real rank on its own GPU: NCCL, Inductor's Triton
kernels; the reference runs on the same GPU, TF32 off on both sides). Random draws (dropout)
are made identical to the reference's: the same seed before each step on both sides, and
Inductor's ``fallback_random`` (its kernels then draw as eager does; torch's own accuracy
checks do the same).

A cell's status: ``parity`` (losses within ``LOSS_TOL`` relative, first-step gradients within
``GRAD_TOL``), ``WRONG`` (it ran and the numbers differ: the worst outcome), ``error`` (a
user-facing ``DistCompileError``), ``crash`` (any other exception, an internal error included).
A ``WRONG`` cell compiled by Inductor is run once more with plain ``torch.compile`` on one
device (``row["baseline"]``): when that differs from eager by as much, the difference is
Inductor's against eager (its random draws, say), not the sharding's.

Mixed precision (``autocast=True``): the forward runs under ``torch.autocast(bfloat16)``, as
users write it, around the compiled call; the reference is DDP emulated on one device (each
data rank's share of the batch under autocast, gradients summed in fp32), in eval mode on both
sides (dropout draws and batch-norm statistics would differ between the reference's pieces).
Each rank's bf16 rounding is the reference's on a data axis, but not on a tensor-parallel one:
there Megatron's partial sums of row-parallel projections are rounded to bf16 and summed,
noise one device never makes. So a cell is at parity when it matches DDP within the larger
of the tolerances and ``FLOOR_FACTOR`` x torch's own compile floor (the cell's compiler on
one device, DDP-emulated, against eager: Inductor's fused kernels and the decompositions
round differently), or, on a mesh with ``tp``, when it is no further from the reference than
``BF16_FACTOR`` x the reference's own distance from the fp32 model (no autocast), in losses
and first-step gradients (``row["bf16"]``): two bf16 runs apart by bf16's error.

Activation checkpointing (``checkpointing=True``): transformers' ``gradient_checkpointing_enable``
(``use_reentrant=False``, the form that traces) on the model before it is copied, so the
reference recomputes its layers too, with dropout on as shipped; held to the plain tolerances.
Only architectures that offer it (``checkpointable``).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import logging
import math
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dynamo_dist.backend import clear_compile_records, compile_records
from dynamo_dist.blocks import compile_blocks, repeated_blocks
from dynamo_dist.plans import (DataParallelPlanner, TensorParallelPlanner, parameter_groups,
                               shard_module)
from dynamo_dist.plans.dataflow import example_inputs, trace_projections
from inductor_passes.core import compat
from inductor_passes.core.errors import DistCompileError

from .expect import compare, textbook
from .models import ZooModel, loss_of

LOSS_TOL = 1e-5
GRAD_TOL = 1e-4
LR = 1e-3
# autocast cells (see the module docstring): a deviation from DDP within this many times
# torch's own compile floor is that floor's; with tp, one within this many times the bf16
# reference's own distance from the fp32 model is bf16's error (measured on the 20 zoo
# architectures on tp=2 and dp=2 x tp=2: gradients 0.5x to 1.2x, losses up to 2.3x)
FLOOR_FACTOR = 2.0
BF16_FACTOR = 3.0


class ReplicaMismatch(AssertionError):
    """Simulated ranks that must hold one value hold different ones."""


def parse_mesh(text: str) -> dict[str, int]:
    """``"dp=2,tp=2"`` -> {"dp": 2, "tp": 2}."""
    axes = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        axes[name.strip()] = int(size)
    return axes


class Runtime:
    """Where the ranks live: ``eager()`` is the context eager DTensor code runs in; ``device``
    the device type of the mesh, the models and the batches."""

    name = "gloo"
    device = "cpu"

    def __init__(self, inductor: bool = True) -> None:
        self.inductor = inductor

    def options(self) -> dict:
        return {"inductor": self.inductor}

    def eager(self):
        return contextlib.nullcontext()

    def localize(self, model: torch.nn.Module) -> None:
        """Nothing to do: this process is one rank."""

    def setup(self, axes: dict[str, int]):
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device, tuple(axes.values()), mesh_dim_names=tuple(axes))


class CudaRuntime(Runtime):
    """This process is one real rank on a GPU (``LOCAL_RANK`` modulo the GPUs there are)."""

    name = "cuda"
    device = "cuda"

    @staticmethod
    def backend(world: int) -> str:
        """NCCL, which needs a GPU per rank. Ranks sharing a GPU through gloo are refused:
        on torch 2.11 gloo's functional all_gather of CUDA tensors killed the rank (SIGSEGV)
        on an H100, while its plain all_gather_into_tensor, reduce_scatter_tensor,
        all_reduce and all_to_all_single ran."""
        gpus = torch.cuda.device_count()
        if world > gpus:
            raise RuntimeError(f"the cuda runtime needs a GPU per rank (NCCL): {world} ranks, "
                               f"{gpus} GPU(s); use a mesh of at most {gpus} ranks")
        return "nccl"

    def setup(self, axes: dict[str, int]):
        import os

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        # the reference is eager fp32: TF32 in either side's matmuls or convolutions would be
        # an error of 1e-3 that no sharding made
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return super().setup(axes)


class SimRuntime(Runtime):
    name = "sim"

    def __init__(self) -> None:
        super().__init__(inductor=False)
        self.mode = None

    def options(self) -> dict:
        return {"simulate": True}

    def eager(self):
        return self.mode

    def setup(self, axes: dict[str, int]):
        from torch.distributed._local_tensor import LocalTensorMode
        from torch.testing._internal.distributed.fake_pg import FakeStore

        world = math.prod(axes.values())
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        self.mode = LocalTensorMode(world)
        self.world = world
        return super().setup(axes)

    def localize(self, model: torch.nn.Module) -> None:
        """Give every rank its own copy of what ``shard_module`` left as one plain tensor
        (replicated parameters' local tensors, buffers): updates (the optimizer's, batch-norm
        statistics) then apply per rank, as on real ranks."""
        from torch.distributed._local_tensor import LocalTensor

        def per_rank(t: torch.Tensor) -> torch.Tensor:
            return t if isinstance(t, LocalTensor) else \
                LocalTensor({r: t.detach().clone() for r in range(self.world)})

        for p in model.parameters():
            if isinstance(p, DTensor):
                p._local_tensor = per_rank(p._local_tensor)
        for name, b in list(model.named_buffers()):
            owner_name, _, leaf = name.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            owner._buffers[leaf] = per_rank(b)


def global_value(t: Any, rt: Runtime) -> torch.Tensor:
    """The GLOBAL value of a DTensor (its full tensor) or plain tensor; on simulated ranks the
    replicas must agree (ReplicaMismatch otherwise)."""
    from torch.distributed._local_tensor import LocalTensor

    with rt.eager():
        if isinstance(t, DTensor):
            t = t.full_tensor()
    if isinstance(t, LocalTensor):
        vals = list(t._local_tensors.values())
        for v in vals[1:]:
            if not torch.allclose(v, vals[0], rtol=1e-5, atol=1e-6, equal_nan=True):
                raise ReplicaMismatch("replicated value differs between simulated ranks")
        t = vals[0]
    return t.detach()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def plan_model(model: torch.nn.Module, axes: dict[str, int], tp_options: dict | None = None):
    """The stock planners, as a user composes them: Megatron on ``tp`` (``tp_options``: more
    ``TensorParallelPlanner`` knobs, such as ``shard_embedding``), FSDP on ``dp``."""
    plan = TensorParallelPlanner(axis="tp", mesh_axis_size=axes["tp"], **(tp_options or {})
                                 ).build_plan(model) if "tp" in axes else None
    if "dp" in axes:
        plan = DataParallelPlanner(axis="dp", mesh_axis_size=axes["dp"]).build_plan(model, plan)
    return plan


def _without_eager_dropout(model: torch.nn.Module) -> None:
    """Every ``nn.Dropout`` outside ``repeated_blocks(model)`` replaced by ``nn.Identity``. Run
    eagerly on DTensors, dropout draws what DTensor's own RNG gives a CPU mesh (each rank its
    generator's numbers for its own piece), not what one device draws; a per-block cell
    compares what the compiled blocks and the hooks between them do, so the eager parts
    draw nothing (the compiled blocks' dropout still draws, as one device does)."""
    inside = {id(m) for b in repeated_blocks(model) for m in b.modules()}
    for name, mod in list(model.named_modules()):
        if isinstance(mod, torch.nn.Dropout) and id(mod) not in inside:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, torch.nn.Identity())


def checkpointable(zm: ZooModel) -> bool:
    """Whether ``zm``'s model offers transformers' gradient checkpointing (its
    ``supports_gradient_checkpointing``; HF's ResNet and ConvNeXt, and the zoo's own ConvNet,
    do not)."""
    return bool(getattr(zm.build(), "supports_gradient_checkpointing", False))


def _enable_checkpointing(model: torch.nn.Module) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def run_cell(zm: ZooModel, mesh_text: str, rt: Runtime, steps: int = 3,
             tp_options: dict | None = None, per_block: bool = False,
             autocast: bool = False, checkpointing: bool = False) -> dict:
    """Train ``zm`` on the mesh ``mesh_text`` for ``steps`` AdamW steps; the result row.
    ``tp_options``: knobs of the tensor-parallel planner (``plan_model``). ``per_block``:
    compile each of ``repeated_blocks(model)`` on its own (``compile_blocks``, torchtitan's
    way), the rest eager on DTensors; the row has no textbook comparison then (the eager
    parts' collectives are DTensor's, not in any ledger), and a model without repeated blocks
    is an error row. ``autocast``: the forward under bf16 autocast, held to DDP and to the
    one-device bf16 run's precision (module docstring); not with ``per_block``.
    ``checkpointing``: transformers' gradient checkpointing on both sides (module docstring).
    Raises ValueError for ``per_block`` with ``autocast``, and for ``checkpointing`` with
    either (an autocast cell runs in eval mode, where transformers does not checkpoint)."""
    if per_block and autocast:
        raise ValueError("a per-block cell under autocast is not offered: its eager parts run "
                         "DTensor's own ops, which the bf16 criteria here do not describe")
    if checkpointing and (per_block or autocast):
        raise ValueError("a checkpointing cell is whole-model and in training mode: not with "
                         "per_block or autocast")
    axes = parse_mesh(mesh_text)
    row: dict[str, Any] = {"model": zm.name, "family": zm.family, "mesh": mesh_text,
                           "runtime": rt.name, "inductor": rt.inductor, "status": "crash",
                           "per_block": per_block, "autocast": autocast,
                           "checkpointing": checkpointing}
    row["torch"] = torch.__version__
    # the architectures' code: their traced paths differ between versions
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        row["transformers"] = importlib.metadata.version("transformers")
    if rt.device == "cuda":
        row["gpu"] = torch.cuda.get_device_name()
    t0 = time.perf_counter()
    torch._dynamo.reset()
    clear_compile_records()
    logs = _CapturedLog()
    try:
        with logs, _inductor_random_as_eager(), _quiet_transformers_warn_once():
            _train(zm, axes, rt, steps, row, tp_options, per_block, autocast, checkpointing)
    except ReplicaMismatch as exc:
        row.update(status="WRONG", error=str(exc))
    except Exception as exc:  # noqa: BLE001 -- a zoo cell reports every failure
        # Dynamo wraps what the backend raised (BackendCompilerFailed)
        user = next((e for e in (exc, exc.__cause__, getattr(exc, "inner_exception", None))
                     if isinstance(e, DistCompileError)), None)
        if user is not None and not str(user).startswith("internal"):
            row.update(status="error", error=_short(user))
        else:
            row.update(status="crash", error=_short(exc), trace=traceback.format_exc()[-3000:])
    row["seconds"] = round(time.perf_counter() - t0, 1)
    row["warnings"] = logs.messages[:20]
    _describe_compiles(row)
    # an autocast cell's floor is measured in the cell (``row["bf16"]``)
    if row["status"] == "WRONG" and rt.inductor and rt.name != "sim" and not autocast:
        try:
            with _inductor_random_as_eager(), _quiet_transformers_warn_once():
                row["baseline"] = _plain_inductor(zm, rt.device, steps)
        except Exception as exc:  # noqa: BLE001 -- the baseline is extra information
            row["baseline"] = {"error": _short(exc)}
    return row


def _plain_inductor(zm: ZooModel, device: str, steps: int) -> dict:
    """Plain ``torch.compile`` (Inductor, one device, no sharding) against eager: the same
    steps, seeds and comparison as a cell. Returns its loss_rel, grad_rel and grad_worst."""
    torch._dynamo.reset()
    ref = zm.build().to(device)
    model = copy.deepcopy(ref)
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    losses, grad_rel, worst = [], 0.0, None
    for step in range(steps):
        args, kwargs = _on(device, zm.batch(step))
        torch.manual_seed(100 + step)
        loss = loss_of(compiled(*args, **kwargs))
        loss.backward()
        torch.manual_seed(100 + step)
        ref_loss = loss_of(ref(*args, **kwargs))
        ref_loss.backward()
        if step == 0:
            grads = {n: None if p.grad is None else p.grad.detach()
                     for n, p in model.named_parameters()}
            grad_rel, worst, _ = _grad_errors(grads, ref)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        losses.append((loss.item(), ref_loss.item()))
    loss_rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in losses)
    return {"loss_rel": loss_rel, "grad_rel": grad_rel, "grad_worst": worst}


@contextlib.contextmanager
def _quiet_transformers_warn_once():
    """transformers' ``logger.warning_once`` (its loss_function property warns that
    ``loss_type=None`` is unrecognized, on every model's first loss) is a Logger method Dynamo
    cannot trace: it splits the step into a model graph and a loss graph, which no textbook plan
    has (the logits cross the break as a DTensor). The fix ``dynamo_dist.diagnose`` gives for
    such a break, applied: the call is ignored under Dynamo (it still warns eagerly)."""
    try:
        from transformers.utils.logging import warning_once
    except ImportError:
        yield
        return
    ignored = set(torch._dynamo.config.ignore_logging_functions) | {warning_once}
    with torch._dynamo.config.patch(ignore_logging_functions=ignored):
        yield


def _on(device: str, batch: Any) -> Any:
    """``batch`` (args, kwargs, or any nest of tensors) with its tensors on ``device``."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)


def _train(zm: ZooModel, axes: dict[str, int], rt: Runtime, steps: int, row: dict,
           tp_options: dict | None = None, per_block: bool = False,
           autocast: bool = False, checkpointing: bool = False) -> None:
    mesh = rt.setup(axes)
    ref = zm.build().to(rt.device)
    if checkpointing:
        _enable_checkpointing(ref)
    if per_block:
        _without_eager_dropout(ref)
    if autocast:
        ref.eval()
    model = copy.deepcopy(ref)
    plan = plan_model(model, axes, tp_options)
    row["params"] = _param_summary(model, plan)
    projections = None
    if "tp" in axes:
        inputs = _on(rt.device, example_inputs(model) or zm.batch(0))
        projections = trace_projections(model, *inputs).projections
    expected = textbook(model, plan, axes, projections)
    ties = sorted(tuple(sorted(n)) for _, n in parameter_groups(model) if len(n) > 1)
    bf16 = _Bf16References(ref, axes.get("dp", 1), rt.device, rt.inductor) if autocast else None
    with rt.eager():
        shard_module(model, mesh, plan)
        rt.localize(model)
    row["ties_kept"] = ties == sorted(tuple(sorted(n)) for _, n in parameter_groups(model)
                                      if len(n) > 1)
    if per_block:
        row["blocks"] = len(compile_blocks(model, options=rt.options()))
        compiled = model
    else:
        compiled = torch.compile(model, backend="dist", options=rt.options())
    with rt.eager():
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    amp = (lambda: torch.autocast(rt.device, dtype=torch.bfloat16)) if autocast else \
        contextlib.nullcontext
    losses, grad_rel, worst, noise = [], 0.0, None, []
    for step in range(steps):
        calls = [(r, r.step.calls if r.step else 0) for r in compile_records()]
        args, kwargs = _on(rt.device, zm.batch(step))
        torch.manual_seed(100 + step)
        # per block, the code between the blocks runs eagerly on DTensors (simulated ranks:
        # under the runtime's eager mode)
        with rt.eager() if per_block else contextlib.nullcontext(), amp():
            loss = loss_of(compiled(*args, **kwargs)).float()
        with rt.eager():
            loss.backward()
        if step == 0:
            # copies: a replicated gradient's global value is its local tensor, which an
            # in-place change before the comparison (gradient clipping in the step) would edit
            grads = {n: (global_value(p.grad, rt).clone() if p.grad is not None else None)
                     for n, p in model.named_parameters()}
        with rt.eager():
            opt.step()
            opt.zero_grad()
        torch.manual_seed(100 + step)
        if bf16 is not None:
            ref_loss = bf16.step(step, args, kwargs)
        else:
            ref_loss = loss_of(ref(*args, **kwargs))
            ref_loss.backward()
        if step == 0:
            grad_rel, worst, noise = _grad_errors(grads, ref)
            if bf16 is not None:
                grad_rel, worst = bf16.first_gradients(grads)
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((global_value(loss, rt).item(), ref_loss.item()))
    # a parameter whose gradient is zero in exact arithmetic moves by AdamW's lr * sign(noise):
    # its final value is noise on both sides (listed, not compared)
    param_rels = {n: _rel(global_value(p, rt), q.detach())
                  for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())
                  if n not in noise}
    param_worst = max(param_rels, key=param_rels.get)
    param_rel = param_rels[param_worst]
    row["param_worst"] = param_worst
    loss_rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in losses)
    row.update(losses=losses, loss_rel=loss_rel, grad_rel=grad_rel, grad_worst=worst,
               param_rel=param_rel, zero_gradient=noise)
    row["status"] = "parity" if loss_rel <= LOSS_TOL and grad_rel <= GRAD_TOL else "WRONG"
    if bf16 is not None:
        row["bf16"] = bf16.verdict([a for a, _ in losses], grad_rel, "tp" in axes)
        row["status"] = "parity" if row["bf16"]["ok"] else "WRONG"
    row["textbook"] = [] if per_block else compare(expected, _step_counts(calls))


class _Bf16References:
    """The references of an autocast cell, made from the model before sharding (eval mode):
    ``ref`` itself steps as DDP emulated on one device (``dp`` pieces of the batch under bf16
    autocast, each loss / dp, gradients accumulated in fp32); ``exact``, a copy, steps on the
    whole batch in fp32 (no autocast); ``floor``, a copy compiled by torch on one device as
    the cell compiles (``inductor``: Inductor, whose fused kernels keep bf16 intermediates in
    fp32; else ``aot_eager`` with decompositions), steps as DDP does: torch's own compile
    rounds unlike eager. Each keeps its own AdamW. ``one``, a copy, gives one device's
    first-step gradients under autocast (the whole batch): a plan may sum a data axis's terms
    before a narrowing cast where DDP sums after it (it must: ``rules.pointwise._narrows``),
    and that gradient is then one device's, not DDP's (Mixtral's router). Losses are scalars
    (fp32); gradients by parameter name."""

    def __init__(self, ref: torch.nn.Module, dp: int, device: str, inductor: bool) -> None:
        self.ref, self.dp, self.device = ref, dp, device
        self.exact = copy.deepcopy(ref)
        self.floor_model = copy.deepcopy(ref)
        self.one = copy.deepcopy(ref)
        self.floor = torch.compile(self.floor_model, backend="inductor" if inductor else
                                   "aot_eager_decomp_partition")
        self.opts = [torch.optim.AdamW(m.parameters(), lr=LR)
                     for m in (self.exact, self.floor_model)]
        self.losses: list[tuple[float, float, float]] = []  # (reference, exact, floor) per step
        self.first: dict[str, Any] = {}

    def _ddp(self, model, args, kwargs) -> torch.Tensor:
        """DDP's step on one device: forward and backward of each data rank's piece (the batch
        split on dim 0, as the planner splits it), each loss / dp; returns the mean loss."""
        from torch.utils._pytree import tree_map

        rows = next(t.shape[0] for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
        total = torch.zeros(())
        for i in range(self.dp):
            piece = slice(i * rows // self.dp, (i + 1) * rows // self.dp)
            a, kw = tree_map(lambda t: t[piece] if isinstance(t, torch.Tensor) else t,
                             (args, kwargs))
            with torch.autocast(self.device, dtype=torch.bfloat16):
                loss = loss_of(model(*a, **kw)).float() / self.dp
            loss.backward()
            total += loss.detach().cpu()
        return total

    def step(self, step: int, args: tuple, kwargs: dict) -> torch.Tensor:
        """The bf16 reference's loss and gradients (on ``ref``; the caller steps its
        optimizer); the exact model's and the floor's steps (first-step gradients kept)."""
        loss = self._ddp(self.ref, args, kwargs)
        exact_loss = loss_of(self.exact(*args, **kwargs)).float()
        exact_loss.backward()
        floor_loss = self._ddp(self.floor, args, kwargs)
        if step == 0:
            self.exact_grads = _grads_of(self.exact)
            self.floor_grads = _grads_of(self.floor_model)
            with torch.autocast(self.device, dtype=torch.bfloat16):
                loss_of(self.one(*args, **kwargs)).float().backward()
            self.one_grads = _grads_of(self.one)
            del self.one
        for opt in self.opts:
            opt.step()
            opt.zero_grad()
        self.losses.append((loss.item(), exact_loss.item(), floor_loss.item()))
        return loss

    def first_gradients(self, ours: dict) -> tuple[float, str | None]:
        """The worst first-step gradient error of ``ours`` (by parameter name) and its
        parameter, each parameter's against DDP's gradient or one device's, the nearer;
        records the reference's error against the exact model's and the floor's against the
        reference's."""
        ref = _grads_of(self.ref)
        to_ddp, _ = _relative_errors(ours, ref)
        to_one, _ = _relative_errors(ours, self.one_grads)
        errors = {n: min(e, to_one[n]) for n, e in to_ddp.items()}
        self.first = {"reference_vs_fp32": _grad_errors_between(ref, self.exact_grads)[0],
                      "floor": _grad_errors_between(self.floor_grads, ref)[0],
                      "one_device_nearer": sorted(n for n, e in to_ddp.items() if to_one[n] < e)}
        worst = max(errors, key=errors.get, default=None)
        return (errors[worst] if worst else 0.0), worst

    def verdict(self, ours: list[float], grad_rel: float, tensor_parallel: bool) -> dict:
        """Whether the cell is at parity (``ok``) under the module docstring's criteria, given
        our losses per step and first-step gradient error against the reference, with the
        figures they read (relative errors: the worst step's loss, the worst parameter's
        gradient)."""
        def worst(pairs) -> float:
            return max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs)

        loss_rel = worst((a, r) for a, (r, _, _) in zip(ours, self.losses))
        floor_loss = worst((f, r) for r, _, f in self.losses)
        ref_loss = worst((r, e) for r, e, _ in self.losses)
        f = self.first
        matches_ddp = loss_rel <= max(LOSS_TOL, FLOOR_FACTOR * floor_loss) and \
            grad_rel <= max(GRAD_TOL, FLOOR_FACTOR * f["floor"])
        # bf16's own error scale: how far the reference is from the fp32 model
        within_bf16 = tensor_parallel and loss_rel <= BF16_FACTOR * ref_loss + LOSS_TOL and \
            grad_rel <= BF16_FACTOR * f["reference_vs_fp32"]
        return {"ok": matches_ddp or within_bf16, "matches_ddp": matches_ddp,
                "within_bf16_error": within_bf16, "floor_loss": floor_loss,
                "floor_grad": f["floor"], "loss_reference_vs_fp32": ref_loss,
                "grad_reference_vs_fp32": f["reference_vs_fp32"],
                "one_device_nearer": f["one_device_nearer"]}


def _grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


# A gradient tensor whose reference norm is below this fraction of the largest one is zero in
# exact arithmetic (a key projection's bias: softmax ignores a shift of all scores; a convolution's
# bias before a BatchNorm, which subtracts the batch mean) and rounding noise in practice, on both
# sides: its error is measured against the largest gradient norm (it matches when ours is within
# the floor as well), not against its own noise.
ZERO_GRAD_FLOOR = 1e-4


def _grad_errors(grads: dict, ref: torch.nn.Module) -> tuple[float, str | None, list[str]]:
    """``_grad_errors_between`` ``grads`` and ``ref``'s parameters' gradients."""
    return _grad_errors_between(grads, {n: q.grad for n, q in ref.named_parameters()})


def _grad_errors_between(grads: dict, want: dict) -> tuple[float, str | None, list[str]]:
    """(worst relative Frobenius error of a gradient in ``grads`` against ``want``'s, both by
    parameter name, its parameter, the parameters whose gradient is rounding noise); a
    gradient present on one side only is a mismatch."""
    errors, noise = _relative_errors(grads, want)
    if not errors:
        return 0.0, None, []
    worst = max(errors, key=errors.get)
    return errors[worst], worst, noise


def _relative_errors(grads: dict, want: dict) -> tuple[dict[str, float], list[str]]:
    """({parameter: relative Frobenius error of its gradient in ``grads`` against ``want``'s},
    the parameters whose gradient is rounding noise: their errors are relative to the largest
    gradient's norm). Raises ReplicaMismatch for a gradient present on one side only."""
    pairs = {}
    for n, q in want.items():
        g = grads.get(n)
        if (g is None) != (q is None):
            raise ReplicaMismatch(f"parameter {n}: gradient "
                                  f"{'missing' if g is None else 'unexpected'}")
        if g is not None:
            pairs[n] = ((g.float() - q.float()).norm().item(), q.float().norm().item())
    if not pairs:
        return {}, []
    largest = max(r for _, r in pairs.values())
    floor = ZERO_GRAD_FLOOR * largest
    errors = {n: d / max(r if r >= floor else largest, 1e-30) for n, (d, r) in pairs.items()}
    return errors, sorted(n for n, (_, r) in pairs.items() if r < floor)


def _step_counts(before: list) -> dict[tuple[str, str, str], int]:
    """Collectives of the last step, by (mesh axis, phase, kind): the ledger entries of each
    compiled graph times the times it ran in that step (a program recompiled after a guard
    failure, transformers setting ``config.problem_type`` on the first call, leaves the first
    graph idle)."""
    seen = dict((id(r), n) for r, n in before)
    counts: dict[tuple[str, str, str], int] = {}
    for rec in compile_records():
        ran = (rec.step.calls if rec.step else 0) - seen.get(id(rec), 0)
        for e in rec.ledger.entries:
            key = (e.mesh_axis, e.phase, e.kind)
            counts[key] = counts.get(key, 0) + ran
    return {k: n for k, n in counts.items() if n}


def _param_summary(model: torch.nn.Module, plan) -> dict:
    groups = parameter_groups(model)
    replicated = [{"names": list(d.names), "axis": d.axis, "reason": d.reason}
                  for d in plan.decisions if not d.sharded]
    sharded_any = {d.names[0] for d in plan.decisions if d.sharded}
    return {"total": len(groups), "sharded": len(sharded_any),
            "replicated_everywhere": sum(1 for _, n in groups if n[0] not in sharded_any),
            "replicated": replicated}


def _describe_compiles(row: dict) -> None:
    records = compile_records()
    row["graphs"] = len(records)
    row["graph_breaks"] = sorted({str(getattr(r, "reason", r)).splitlines()[0][:200]
                                  for r in compat.graph_break_reasons()})
    row["fallbacks"] = sorted({f for r in records for f in r.plan.fallbacks})
    coll: dict[str, list[int]] = {}
    no_source = []
    for r in records:
        for e in r.ledger.entries:
            k = f"{e.mesh_axis} {e.phase} {e.kind}"
            coll.setdefault(k, [0, 0])
            coll[k][0] += 1
            coll[k][1] += e.bytes
            if not e.source or "eval_with_key" in e.source:
                no_source.append(f"{e.kind} {e.node}: {e.cause}")
    row["collectives"] = coll
    row["issued"] = sum(r.ledger.issued() for r in records)
    row["ledger_without_user_line"] = no_source
    # layer calls of shared compiled bodies / bodies, per compiled half (Inductor only)
    row["outlined"] = [f"{o.calls}/{len(o.bodies)}" for r in records if r.step is not None
                       for o in r.step.joint.outlined]
    # per compiled graph: (layer runs captured as copies, runs traced op by op), or None
    row["captured_copies"] = [r.program.graph_module.meta.get("dynamo_dist_layer_capture")
                              for r in records if r.program is not None]
    # layers whose gathers were issued a layer early, per compiled half (forward, backward)
    row["prefetched"] = [len(p.layers) for r in records if r.step is not None
                         for p in getattr(r.step.joint, "prefetched", ())]


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 1500 else text[:1500] + " ..."


@contextlib.contextmanager
def _inductor_random_as_eager():
    import torch._inductor.config as inductor_config

    old = inductor_config.fallback_random
    inductor_config.fallback_random = True
    try:
        yield
    finally:
        inductor_config.fallback_random = old


class _CapturedLog(logging.Handler):
    """dynamo_dist's warnings during a cell (replicated fallbacks, boundary gathers)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg not in self.messages:
            self.messages.append(msg[:400])

    def __enter__(self):
        logging.getLogger("dynamo_dist").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("dynamo_dist").removeHandler(self)
