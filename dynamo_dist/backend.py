"""The ``dist`` torch.compile backend: the orchestrator of one compilation.

Order of steps (each a small module):
  1. capture    Dynamo graph -> joint forward+backward ATen graph, global semantics
  2. propagate  every node gets an OpSpec (rules + whole-graph propagation + cost) -> Plan
  3. lower      Plan -> local joint graph of this rank + collective ledger
  4. compile    partition forward/backward, Inductor for each
  5. runtime    DistStep: DTensor in, DTensor out, autograd through the compiled halves
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from typing import Any, Sequence

import torch
import torch.fx as fx

from inductor_passes import cpu_probe, early_kernels, layout
from inductor_passes.compile import compile_joint
from inductor_passes.core import compat, roles
from inductor_passes.core.mesh_facts import data_axes
from inductor_passes.core.annotation_ops import (CONSTRAINT_OP, PIN_ERROR, encode_spec,
                                                 mesh_from_key)
from inductor_passes.core.errors import DistCompileError, user_source
from inductor_passes.core.ledger import CollectiveLedger
from inductor_passes.core.placements import Placements, fmt, nbytes, parse
from inductor_passes.lowering import lower
from inductor_passes.redistribute import local_coordinate
from inductor_passes.sharding.config import PlannerConfig
from inductor_passes.sharding.propagate import PARAMETER_VIEWS, Plan, propagate
from inductor_passes.sharding.rules import RuleKind

from . import agreement, compiled_autograd, gc_pause, patches, plan_cache, regions
from . import symbolic as symbolic_shapes
from .agreement import plan_once
from .annotations import checked_placements
from .capture import (ArgKind, JointProgram, lift_tensor_attributes, planned_input_placements,
                      trace_joint)
from .divergence import check_same_schedule
from .runtime import DistStep
from .simulate import simulated_joint

log = logging.getLogger("dynamo_dist")


@dataclasses.dataclass
class CompileRecord:
    """What one compilation produced, for tests, the demo and ``explain``."""

    plan: Plan
    ledger: CollectiveLedger
    seconds: dict[str, float]  # wall-clock seconds per stage (capture, plan, lower, inductor)
    program: JointProgram
    step: DistStep | None
    cpu_seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # same, CPU time

    def saved_for_backward_bytes(self) -> int:
        """Bytes this rank's compiled forward hands to its backward (local tensors: activations
        and whatever the partitioner chose to save; graph inputs such as parameters left out,
        they are held anyway). 0 for a forward-only program."""
        joint = self.step.joint if self.step is not None else None
        fw = getattr(joint, "fw_graph", None)
        if fw is None:
            return 0
        out = next(iter(fw.graph.find_nodes(op="output"))).args[0]
        # a checkpointed region's saved RNG state has a symbolic length: its hint is counted
        return sum(compat.size_hint(n.meta["val"].numel()) * n.meta["val"].element_size()
                   for n in out[joint.num_fwd_outputs:]
                   if isinstance(n, fx.Node) and n.op != "placeholder" and
                   isinstance(n.meta.get("val"), torch.Tensor))

    def predicted_peak(self):
        """This rank's predicted peak bytes of one call (forward, then backward), read off the
        local graphs before Inductor (``inductor_passes.memory.PeakEstimate``; None for a
        program that was not planned)."""
        joint = self.step.joint if self.step is not None else None
        return getattr(joint, "predicted_peak", None)

    def activation_gathers(self, mesh_axis: str) -> list:
        """Ledger entries that all_gather on ``mesh_axis`` anything but a parameter (a DTensor
        input that is an ``nn.Parameter`` or a leaf requiring grad) or a view or cast of one
        (``PARAMETER_VIEWS``). On a data axis this should be empty: data parallelism gathers
        parameters (FSDP) and never the batch. Not counted: the inputs of an embedding
        backward planned vocabulary-split (``rules.embedding``), whose ranks each accumulate
        other rows of the gradient rather than repeat a computation (the gathered token
        gradients replace the reduce_scatter of a whole [V, H] gradient)."""
        gm = self.program.graph_module
        nodes = {n.name: n for n in gm.graph.nodes}
        params = {roles.primal_name(k) for k, i in enumerate(self.program.primal_inputs)
                  if i.kind is ArgKind.DTENSOR and i.origin().parameter}

        def is_param(name: str) -> bool:
            node = nodes.get(name)
            while node is not None and node.name not in params and \
                    node.op == "call_function" and str(node.target) in PARAMETER_VIEWS:
                node = node.args[0]
            return node is not None and node.name in params

        def vocab_split(name: str) -> bool:
            np_ = self.plan.nodes.get(name)
            return np_ is not None and np_.kind is RuleKind.VOCAB_EMBEDDING

        return [e for e in self.ledger.entries if e.kind == "all_gather" and
                e.mesh_axis == mesh_axis and not is_param(e.value) and not vocab_split(e.node)]


_RECORDS: list[CompileRecord] = []


def compile_records() -> list[CompileRecord]:
    """Every graph compiled by the ``dist`` backend in this process, oldest first."""
    return list(_RECORDS)


def clear_compile_records() -> None:
    _RECORDS.clear()


def dist_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict | None = None):
    """torch.compile backend entry point (registered as ``dist``).

    options: ``inductor`` (bool, default True): compile the local graphs with Inductor; False runs
    them as FX graphs (for debugging). ``simulate`` (bool, default False): under
    ``LocalTensorMode(N)`` on a ``fake`` process group, lower the plan for every rank and run the
    N local graphs side by side on the LocalTensor shards (``dynamo_dist.simulate``; FX, no
    Inductor): a training loop on N simulated ranks in one process. ``planner``
    (``PlannerConfig``, default ``PlannerConfig.from_env()``): the sharding planner's settings.
    Raises ValueError on an unknown option, or a ``planner`` that is not a PlannerConfig.
    """
    opts = dict(options or {})
    inductor = bool(opts.pop("inductor", True))
    simulate = bool(opts.pop("simulate", False))
    config = opts.pop("planner", None)
    config = PlannerConfig.from_env() if config is None else config
    if not isinstance(config, PlannerConfig):
        raise ValueError(f"dist backend: options['planner'] must be a dynamo_dist.PlannerConfig, "
                         f"got {type(config).__name__}")
    if opts:
        raise ValueError(f"dist backend: unknown option(s) {sorted(opts)}; the options are "
                         f"inductor, simulate and planner")
    agreement.begin_graph()
    if patches.will_compile_cpu_kernels({"inductor": inductor, "simulate": simulate},
                                        _devices(example_inputs)):
        cpu_probe.start()  # g++ on a thread while we capture, plan and lower (once a process)
    if (compat.dynamo_frame_file() or "").startswith(patches.DTENSOR_DIR):
        # DTensor's own code, entered while a step Dynamo split runs eagerly (autograd calling
        # from_local's backward, DTensor's dispatch): local bookkeeping, not a global program
        # to plan; run as DTensor runs it
        return gm.forward
    try:
        # compiled-autograd backward graphs (and forwards carrying module backward hooks) are
        # local code already: compiled as they are, user collectives kept
        compiled = compiled_autograd.compile_local(gm, example_inputs, inductor)
        if compiled is None:
            # the user's autocast applies to capture alone: from there on the program's casts
            # are explicit ops, and planning, lowering and Inductor (as AOTAutograd's
            # partitioner and compilers) run with autocast off, or a region the user ran with
            # autocast disabled would be cast again
            amp = compat.autocast_state()
            with compat.disable_local_tensor_mode(), compiled_autograd.disabled(), \
                    compat.autocast_as(()), gc_pause.full_collections_paused():
                compiled = _compile(gm, list(example_inputs), inductor, config, simulate,
                                    amp=amp)
        if not isinstance(compiled, DistStep):  # planned programs were compared before Inductor
            check_same_schedule([gm], f"graph of {_code_name(gm)}")
    except BaseException as exc:  # peers waiting on this rank learn of it at once
        agreement.publish_failure(exc)
        raise
    return compiled



def _devices(example_inputs: Sequence[Any]) -> set[str]:
    return {x.device.type for x in example_inputs if isinstance(x, torch.Tensor)}


def _code_name(gm: fx.GraphModule) -> str:
    """The user function Dynamo compiled, as 'file:line fn' where Dynamo recorded it."""
    for node in gm.graph.nodes:
        src = user_source(node)
        if src:
            return src.split(": ")[0]
    return "a graph with no user source"


def _dump_base(index: int) -> str | None:
    """Path prefix for DYNAMO_DIST_DUMP files of graph ``index`` on this rank (None: no dump)."""
    out = os.environ.get("DYNAMO_DIST_DUMP")
    if not out:
        return None
    os.makedirs(out, exist_ok=True)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return os.path.join(out, f"graph{index}_rank{rank}")


def _dump(index: int, mesh, program: JointProgram, plan: Plan, joint) -> None:
    """With DYNAMO_DIST_DUMP=DIR, write the global graph, plan and local graphs of each rank."""
    base = _dump_base(index)
    if not base:
        return
    with open(base + "_global.py", "w") as f:
        f.write(program.graph_module.print_readable(print_output=False))
    with open(base + "_plan.txt", "w") as f:
        f.write(plan.to_text())
    with open(base + "_ledger.txt", "w") as f:
        f.write("\n".join(f"{e.phase:<8} {e.kind:<14} {e.mesh_axis:<4} {e.bytes:>10} {e.node:<24} "
                          f"{e.cause} @ {e.source}" for e in _RECORDS[index - 1].ledger.entries))
    with open(base + "_local_fw.py", "w") as f:
        f.write(joint.fw_graph.print_readable(print_output=False))
    if joint.bw_graph is not None:
        with open(base + "_local_bw.py", "w") as f:
            f.write(joint.bw_graph.print_readable(print_output=False))


def _constraints(gm: fx.GraphModule):
    """Sharding-constraint node -> (mesh key, placements), each validated here as the user wrote
    it inside the program (``annotations.checked_placements``; Dynamo cannot trace our raise)
    and rewritten normalised. Raises DistCompileError naming the user's line."""
    found = {}
    for node in gm.graph.find_nodes(op="call_function", target=CONSTRAINT_OP):
        key, _, text = node.args[1].partition("|")
        mesh, source = mesh_from_key(key), user_source(node)
        shape = tuple(node.args[0].meta["val"].shape)
        if text.startswith(PIN_ERROR):  # a bad partition spec, found while Dynamo traced it
            what, _, why = text[len(PIN_ERROR):].partition(": ")
            why, _, fix = why.partition("; fix: ")
            raise DistCompileError(f"{what}: {why}", source=source, shapes=[shape], mesh=mesh,
                                   fix=fix or None)
        try:
            pls = parse(text)
        except ValueError:
            raise DistCompileError(
                f"with_sharding_constraint: placements {text} are not placements", source=source,
                shapes=[shape], mesh=mesh, fix="give one Shard(d), Replicate() or Partial() per "
                "mesh axis, or a partition spec (mark_sharding)") from None
        pls = checked_placements("with_sharding_constraint", shape, mesh, pls, source)
        node.args = (node.args[0], encode_spec(mesh, pls), *node.args[2:])
        found[node] = (key, pls)
    return found


def _program_signature(gm: fx.GraphModule) -> list[str]:
    """The global program's ops and shapes in order: what the planning rank's plan was made for
    (node names are the plan's keys)."""
    out = []
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        out.append(f"{n.name} {n.op} {n.target} {shape}")
    return out


def _refuse_other_program(gm: fx.GraphModule, mine: list[str], theirs: list[str], mesh) -> None:
    """This rank traced another program than the planning rank (a Python branch on the rank):
    its plan does not fit. Raise naming the first op that differs (it was a KeyError)."""
    i = next((k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b),
             min(len(mine), len(theirs)))
    nodes = list(gm.graph.nodes)
    here = nodes[i] if i < len(nodes) else None
    raise DistCompileError(
        f"rank divergence: this rank traced another program than the mesh's planning rank; "
        f"first difference at op #{i}: here {mine[i] if i < len(mine) else 'nothing'}, there "
        f"{theirs[i] if i < len(theirs) else 'nothing'}", source=user_source(here), mesh=mesh,
        fix="make the compiled code the same on every rank: no Python branches on "
            "dist.get_rank() or mesh coordinates (compute rank-dependent values as tensors, "
            "e.g. torch.where on a rank tensor)")


def _input_placements(info, mesh) -> tuple[Placements, str | None]:
    """``capture.planned_input_placements``, logged where it differs from the input's own: DTensor
    redistributes such an input exactly at the boundary (and its gradient back). Returns
    (placements, the logged message or None)."""
    pls, why = planned_input_placements(info, tuple(mesh.shape))
    if not why:
        return pls, None
    msg = (f"input {info.name} {tuple(info.shape)} {fmt(info.placements)}: {'; '.join(why)}; it "
           f"is gathered on those axes at the compiled program's boundary (up to "
           f"{nbytes(info.shape, info.dtype)} bytes per rank per call)")
    log.warning("dynamo_dist: %s", msg)
    return pls, msg


def _compile(gm: fx.GraphModule, example_inputs: list, inductor: bool, config: PlannerConfig,
             simulate: bool = False, respecialised: bool = False, amp: tuple = ()):
    """Capture (under the user's autocast state ``amp``, ``compat.autocast_state()``), plan,
    lower and compile one Dynamo graph; called with autocast off."""
    clock = _StageClock()
    clock.start()
    dynamo_gm, dynamo_inputs = gm, example_inputs
    # a nested_compile_region's body is planned as the code it is (issue 17 keeps it whole),
    # once Dynamo is known to have handed each call its own layer's tensors
    regions.check_region_operands(gm)
    gm = compat.inline_nested_compile_regions(gm)
    # an optimizer's DTensor parameters and state reach us as graph attributes: inputs from here
    gm, attributes = lift_tensor_attributes(gm)
    example_inputs = [*example_inputs, *attributes]
    with compat.autocast_as(amp):
        program = trace_joint(gm, example_inputs, symbolic=not respecialised)
    symbolic_shapes.fix_guarded_sizes(program.graph_module)
    symbolic_sizes = symbolic_shapes.is_symbolic(program.graph_module)
    clock.stop("capture")

    constraints = _constraints(program.graph_module)
    mesh = program.mesh
    for key, _ in constraints.values():
        cmesh = mesh_from_key(key)
        if mesh is None:
            mesh = cmesh
        elif cmesh != mesh:
            raise DistCompileError("a sharding constraint names another mesh than the inputs",
                                   mesh=mesh, fix="use one DeviceMesh per compiled program")
    if mesh is None:
        log.info("dynamo_dist: no DTensor input and no annotation; compiling as one device")
        # simulated ranks: the graph runs as it is on the LocalTensor inputs (each op once per
        # rank); Inductor cannot take a LocalTensor (a graph break's piece without a DTensor
        # in it crashed there)
        if not inductor or simulate:
            return gm
        cpu_probe.wait()
        # torch's compile handles the user's autocast itself
        with compat.autocast_as(amp), early_kernels.submitting():
            return compat.compile_fx(gm, example_inputs)

    boundary = [_input_placements(i, mesh) for i in program.primal_inputs]
    primal_pl = [pl for pl, _ in boundary]
    origins = [i.origin() for i in program.primal_inputs]
    grad_pl = [p if i.requires_grad else None for p, i in zip(primal_pl, program.primal_inputs)]
    pinned = {node.name: pl for node, (_, pl) in constraints.items()}

    clock.start()
    axes = data_axes(mesh)

    # placements do not depend on sizes: a symbolic program is planned at the sizes Dynamo
    # traced it with, and lowered and compiled with its sizes symbolic
    planned_graph = symbolic_shapes.hinted(program.graph_module) if symbolic_sizes else \
        program.graph_module

    def make_plan():
        key = plan_cache.plan_key(
            planned_graph, mesh, primals=primal_pl, grads=grad_pl, origins=origins,
            pinned=pinned, data_axes=axes, planner=config,
            outputs=(program.num_fwd_outputs, tuple(program.diff_outputs)))
        plan, hit = plan_cache.cached_plan(key, lambda: propagate(
            planned_graph, mesh, primal_pl, program.num_fwd_outputs,
            program.diff_outputs, grad_pl, lambda n: pinned.get(n.name), origins,
            data_axes=axes, config=config))
        if hit:  # propagate() logs a plan's replicated fallbacks; a cached plan's are logged here
            log.info("dynamo_dist: plan read from the plan cache (%s)", key[:12])
            for msg in plan.fallbacks:
                log.warning("dynamo_dist: %s", msg)
        return plan

    mine = _program_signature(program.graph_module)
    theirs, plan = plan_once(mesh, lambda: (mine, make_plan()))
    if theirs != mine:
        _refuse_other_program(program.graph_module, mine, theirs, mesh)
    plan.fallbacks.extend(msg for _, msg in boundary if msg)
    clock.stop("plan")
    split = symbolic_shapes.split_symbolic(program.graph_module, plan) if symbolic_sizes else []
    if split:  # every rank has this plan, so every rank takes this branch
        log.info("dynamo_dist: the plan splits dims of symbolic size (%s%s); compiled for the "
                 "sizes traced (each new shape recompiles)", "; ".join(w for w, _ in split[:3]),
                 " ..." if len(split) > 3 else "")
        if respecialised:
            raise DistCompileError(f"internal: sizes still symbolic after being guarded: "
                                   f"{split[0][0]}", mesh=mesh)
        symbolic_shapes.specialise(program.graph_module)
        agreement.begin_graph()
        return _compile(dynamo_gm, dynamo_inputs, inductor, config, simulate, respecialised=True,
                        amp=amp)

    has_bwd = torch.is_grad_enabled() and bool(program.diff_outputs) and \
        any(i.requires_grad for i in program.primal_inputs)
    # a symbolic program is lowered on a copy sized in symbols of each rank's pieces; the
    # guards its trace and Inductor add are Dynamo's once compiled (add_guards)
    sizes = symbolic_shapes.LocalSizes(program.graph_module, plan) if symbolic_sizes else None
    lowered = sizes.graph if sizes is not None else program.graph_module
    if simulate:  # FX graphs on LocalTensors: no stride checks, inputs pass as they are
        clock.start()
        joint, ledger = simulated_joint(lowered, plan, mesh, program.num_fwd_outputs, has_bwd)
        if sizes is not None:
            sizes.add_guards()
        clock.stop("lower")
        return _finish(gm, program, plan, mesh, primal_pl, joint, ledger, clock, has_bwd,
                       attributes=attributes)

    # the strides each input's local tensor arrives with (inductor_passes.layout); symbolic
    # ones (Dynamo gives a DTensor's local tensor symbols of its own) are made dense
    coord, mesh_shape = local_coordinate(mesh), tuple(mesh.shape)
    in_strides = [layout.input_local_strides(
        i.shape, i.stride, pl, mesh_shape, coord,
        i.local_stride if i.kind is ArgKind.DTENSOR and tuple(i.placements) == tuple(pl) and
        all(compat.static_size(v) is not None for v in i.local_stride) else None)
        for i, pl in zip(program.primal_inputs, primal_pl)]

    clock.start()
    local_gm, ledger = lower(lowered, plan, mesh, program.num_fwd_outputs,
                             primal_strides=in_strides if sizes is None else
                             [tuple(map(sizes.size, st)) for st in in_strides])
    clock.stop("lower")

    clock.start()
    base = _dump_base(len(_RECORDS) + 1)
    if base:  # before Inductor, so a graph that fails to compile can be read
        with open(base + "_local_joint.py", "w") as f:
            f.write(local_gm.print_readable(print_output=False))
    # every rank must issue the same collectives: compare the partitioned graphs before
    # Inductor rewrites them (and before anything runs: no hang)
    def check(graphs):
        with clock.inner("schedule check"):
            check_same_schedule(graphs, f"graph of {_code_name(gm)}")

    joint = compile_joint(local_gm, program.num_fwd_outputs, has_bwd, inductor, check,
                          resident=[k for k, i in enumerate(program.primal_inputs) if i.parameter])
    if sizes is not None:
        sizes.add_guards()
    clock.stop("inductor")
    return _finish(gm, program, plan, mesh, primal_pl, joint, ledger, clock, has_bwd,
                   in_strides, attributes)


class _StageClock:
    """Wall-clock and CPU seconds of the backend's stages (``start()`` ... ``stop(name)``); a stage
    timed ``inner`` while another runs is taken out of the outer one (the schedule check inside
    Inductor's stage)."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self._t = self._c = 0.0
        self._inner_wall = self._inner_cpu = 0.0

    def start(self) -> None:
        self._t, self._c = time.perf_counter(), time.process_time()
        self._inner_wall = self._inner_cpu = 0.0

    def stop(self, name: str) -> None:
        self.wall[name] = time.perf_counter() - self._t - self._inner_wall
        self.cpu[name] = time.process_time() - self._c - self._inner_cpu

    @contextlib.contextmanager
    def inner(self, name: str):
        t, c = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            wall, cpu = time.perf_counter() - t, time.process_time() - c
            self.wall[name], self.cpu[name] = wall, cpu
            self._inner_wall += wall
            self._inner_cpu += cpu


def _finish(gm, program: JointProgram, plan: Plan, mesh, primal_pl, joint,
            ledger: CollectiveLedger, clock: _StageClock, has_bwd: bool,
            in_strides: list | None = None, attributes: Sequence = ()) -> DistStep:
    """The runtime step around compiled (or simulated) local programs, recorded.
    ``in_strides``: the LOCAL strides the compiled graphs expect of each input (None: any);
    ``attributes``: lifted graph attributes, passed after Dynamo's arguments on every call."""
    ledger.buckets, ledger.issued_by_kind = joint.buckets, joint.issued
    coord, mesh_shape = local_coordinate(mesh), tuple(mesh.shape)

    out_node = next(iter(program.graph_module.graph.find_nodes(op="output")))
    out_pl = list(plan.nodes[out_node.name].inputs[:program.num_fwd_outputs])
    fwd_outs = out_node.args[0][:program.num_fwd_outputs]
    shapes, placements, strides, it = [], [], [], iter(out_pl)
    for o in fwd_outs:
        if isinstance(o, fx.Node) and isinstance(o.meta.get("val"), torch.Tensor):
            val, pl = o.meta["val"], next(it)
            shapes.append(tuple(val.shape))
            placements.append(pl)
            # lowering lays the local value out so (layout.output_strides)
            strides.append(layout.output_strides(tuple(val.shape), val.stride(), pl, mesh_shape,
                                                 coord)[1])
        else:
            shapes.append(None)
            placements.append(None)
            strides.append(None)
    for i in program.local_outputs:  # to_local()/full_tensor() outputs: plain local tensors
        placements[i] = None
    step = DistStep(program.inputs, joint, mesh, primal_pl, placements, shapes,
                    program.diff_outputs if has_bwd else [], program.mutated_inputs,
                    in_strides or (), strides, attributes)
    record = CompileRecord(plan, ledger, clock.wall, program, step, clock.cpu)
    _RECORDS.append(record)
    _warn_batch_gathers(record, data_axes(mesh))
    _dump(len(_RECORDS), mesh, program, plan, joint)
    log.info("dynamo_dist: compiled graph (%s); %d collectives", 
             ", ".join(f"{k} {v:.2f}s" for k, v in clock.wall.items()), len(ledger.entries))
    return step


def _warn_batch_gathers(record: CompileRecord, axes: Sequence[str]) -> None:
    """Data parallelism gathers parameters and never the batch; a plan that gathers anything
    else on a data axis runs every rank of that axis on the whole of it from there (correct,
    but not data parallel): said once per compile, with the first few places and their bytes."""
    for axis in axes:
        found = record.activation_gathers(axis)
        if not found:
            continue
        where = "; ".join(f"{e.cause} ({e.bytes} B per rank) at {e.source or '?'}"
                          for e in found[:3])
        log.warning("dynamo_dist: %d value(s) that are not parameters are all_gathered on the "
                    "data axis '%s', so its ranks compute on whole values there: %s%s. The ops "
                    "after it have no placement that keeps the batch split (an op that mixes "
                    "samples: a sort or routing over all tokens, a batch-wide statistic); run "
                    "that region on each rank's own samples (dynamo_dist.local_map) or accept "
                    "the cost", len(found), axis, where, " ..." if len(found) > 3 else "")


# how compat.dist_backend_is_tracing recognises Dynamo tracing for us
dist_backend._dynamo_dist_backend = True


def _dynamo_settings():
    """Dynamo's ``backend_ctx_ctor`` around every call: Python numbers (a float attribute such
    as ``Embedding.norm_type``, an int argument) are specialised for ``dist`` -- a new value
    recompiles -- while tensor sizes may be symbolic. Unspecialised, Dynamo passes a changing
    float as a 0-d tensor read with ``.item()``, a value a plan cannot know. And
    ``loss.backward()`` / ``opt.step()`` in a compiled function are traced into the program, so
    a whole training step is planned and compiled as one (``patches.install_whole_step``)."""
    return compat.dynamo_settings_for_dist()


dist_backend.backend_ctx_ctor = _dynamo_settings
# Installed when the backend is first resolved (torch.compile looks it up before Dynamo traces),
# so programs that never call shard_module (DTensors made by hand) get them too; each acts only
# while Dynamo traces for this backend, unless its docstring says otherwise.
patches.install()
# Plain tensors in a dist program are global values, so DTensor must read them as Replicate when
# they meet DTensors (Dynamo runs DTensor's dispatch while tracing). A process-wide switch in
# torch 2.13; shard_module sets it too.
compat.allow_implicit_replication(True)
