"""Runtime boundary: DTensor in, local tensors through the compiled graphs, DTensor out.

Inputs: a DTensor is redistributed (eagerly, differentiably) to the plan's placement if it
differs; a plain tensor is passed whole (a global value; the graph slices it where the plan
shards it). Each local tensor must have the strides the program was compiled for
(``inductor_passes.layout``); one that arrives otherwise (a DTensor whose local tensor is laid
out unlike its global strides, a redistributed piece) is copied into that layout first. The
compiled forward/backward run inside one autograd.Function, which takes a DTensor in the planned
placement (a parameter) as it is: its local tensor runs, and its gradient goes back as a DTensor
in the parameter's own placement (``DistStep.grad_dtensor``, a spec made once per layout). A
``to_local()`` / ``from_local`` autograd pair per parameter cost about 0.2 ms a parameter a step
in Python (26 ms against plain Inductor's 8 ms a step on an H200 at 8 layers of the demo Llama,
world size 1). A Partial DTensor input still goes through ``to_local()`` (torch gives its
gradient another placement). Outputs become DTensors with the planned placements and the
strides the compiled graph gives them (``from_local``).
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any, Sequence

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard

from inductor_passes.compile import CompiledJoint
from inductor_passes.core import compat
from inductor_passes.core.errors import DistCompileError
from inductor_passes.core.placements import Placements
from inductor_passes.layout import same_layout

from . import contract
from .capture import ArgKind, InputInfo
from .spmd import input_annotation

log = logging.getLogger("dynamo_dist")


class _DistFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, step: "DistStep", strides: tuple, *args):
        # a DTensor argument is taken as it is (``DistStep._direct``): its local tensor runs,
        # laid out as compiled (``strides``), and its gradient goes back as a DTensor of its
        # placement, with no to_local/from_local autograd pair per parameter
        ctx.direct = [(k, a.shape) for k, a in enumerate(args) if isinstance(a, DTensor)]
        args = [_restrided(a._local_tensor, strides[k]) if isinstance(a, DTensor) else a
                for k, a in enumerate(args)]
        with compat.autocast_disabled():  # the program's casts are in it (compat)
            outs = step.joint.forward(list(args))
        n = step.joint.num_fwd_outputs
        saved = outs[n:]
        ctx.step = step
        # saved sizes (a program with symbolic shapes) are ints, kept beside the tensors
        ctx.save_for_backward(*[s for s in saved if isinstance(s, torch.Tensor)])
        ctx.sizes = [(i, s) for i, s in enumerate(saved) if not isinstance(s, torch.Tensor)]
        # an output the runtime hands on as a DTensor leaves as a view of what the program
        # made: ``from_local`` then gives its DTensor a local tensor outside the autograd graph,
        # as DTensor's own ops do, so a block fed by another compiled block and one fed by
        # eager DTensor code meet the same Dynamo guards (the local tensor's requires_grad):
        # one compile per distinct block, not two
        user = tuple(o.view_as(o) if k in step.dtensor_outputs else o
                     for k, o in enumerate(outs[:n]))
        diff = set(step.diff_outputs)
        ctx.mark_non_differentiable(*[o for i, o in enumerate(user)
                                      if i not in diff and isinstance(o, torch.Tensor)])
        return user

    @staticmethod
    @torch.compiler.disable
    def backward(ctx, *grads):
        # Autograd calls this outside the disabled call Dynamo wraps a compiled graph in; a
        # step Dynamo split at ``loss.backward()`` runs it under Dynamo's frame hook, which
        # compiled this frame and the compiled program's own code under dist again (and failed
        # on Inductor's in-place collectives). torch's own backward frames are skipped as
        # torch files; ours is not.
        step: DistStep = ctx.step
        if step.joint.backward is None:
            raise RuntimeError("this program was compiled without a backward (no input required "
                               "grad when it was compiled)")
        # autograd materialises missing output grads as zeros, so every tangent is a tensor
        tangents = [grads[j].contiguous() for j in step.diff_outputs]
        saved = list(ctx.saved_tensors)
        # as AOTAutograd: autograd's own references to the saved activations go now (unless
        # the graph is retained), so the compiled backward, which takes its argument list and
        # drops each input after its last use, frees each activation as it is consumed rather
        # than all of them at the end of the backward
        compat.release_saved_tensors(ctx)
        for i, size in ctx.sizes:
            saved.insert(i, size)
        args = [*saved, *tangents]
        del saved, tangents
        with compat.autocast_disabled():
            res = list(step.joint.backward(args))
        for k, shape in ctx.direct:
            if res[k] is not None:
                res[k] = step.grad_dtensor(k, res[k], shape)
        return (None, None, *res)


class DistStep:
    """The callable a backend returns to Dynamo for one graph on this rank."""

    def __init__(self, inputs: Sequence[InputInfo], joint: CompiledJoint, mesh,
                 input_placements: Sequence[Placements], output_placements: Sequence[Any],
                 output_shapes: Sequence[Any], diff_outputs: Sequence[int],
                 mutated_inputs: Sequence[int] = (), input_strides: Sequence[Any] = (),
                 output_strides: Sequence[Any] = (), attributes: Sequence[Any] = ()) -> None:
        """``input_strides``: per tensor input, the LOCAL strides the compiled graph expects;
        ``output_strides``: per forward output, the GLOBAL strides its DTensor declares (both
        from ``inductor_passes.layout``); ``attributes``: tensors the program reads that Dynamo
        kept as graph attributes (``capture.lift_tensor_attributes``), appended to each call's
        arguments."""
        self.inputs = list(inputs)
        self.joint = joint
        self.mesh = mesh
        self.input_placements = list(input_placements)
        self.output_placements = list(output_placements)
        # a symbolic size or stride (dynamic shapes) is read per call: _Symbolic
        self.output_shapes = [_Symbolic.of(s) if _Symbolic.wanted(s) else s
                              for s in output_shapes]
        self.output_shapes = [torch.Size(s) if isinstance(s, tuple) else s
                              for s in self.output_shapes]
        self.output_strides = [_Symbolic.of(s) if _Symbolic.wanted(s) else s
                               for s in output_strides] or [None] * len(self.output_shapes)
        self.diff_outputs = list(diff_outputs)
        # per call: which inputs are tensors, the placement the plan wants for each, and the
        # strides the compiled graph expects for its local tensor
        tensor_infos = [i for i in self.inputs if i.kind.is_tensor]
        strides = [_Symbolic.of(s) if _Symbolic.wanted(s) else s for s in input_strides] or \
            [None] * len(tensor_infos)
        self._tensor_inputs = list(zip(tensor_infos, self.input_placements))
        self._global_checks = [_global_shape_check(i) for i in tensor_infos]
        self._input_strides = strides
        # inputs the program updates in place: their new values are the last forward outputs
        self.mutated_inputs = list(mutated_inputs)
        self.num_user_outputs = len(self.output_placements) - len(self.mutated_inputs)
        self.dtensor_outputs = {k for k, pl in enumerate(self.output_placements[
            :self.num_user_outputs]) if pl is not None}
        self.calls = 0  # how often this graph ran (a recompiled program leaves old ones idle)
        self._grad_specs: dict = {}  # (input, global shape, local strides, dtype) -> DTensorSpec
        self._same_mesh: dict[int, tuple[Any, bool]] = {}  # id -> (mesh, equals self.mesh)
        # per tensor input: the spec key (``compat.dtensor_spec_key``) of the last DTensor that
        # went in as it is, checked (global shape, placements, mesh); None: none yet
        self._taken_as_is: list[Any] = [None] * len(tensor_infos)
        self.attributes = tuple(attributes)

    def __call__(self, *args):
        self.calls += 1
        args = (*args, *self.attributes)
        if contract.enabled():
            contract.check_same_values(self._global_inputs(args), self.mesh)
        local, strides = [], []
        for i, ((info, want), want_stride, check) in enumerate(zip(
                self._tensor_inputs, self._input_strides, self._global_checks)):
            x = args[info.index]
            if isinstance(want_stride, _Symbolic):
                want_stride = want_stride.dense_strides(
                    x._local_tensor.shape if isinstance(x, DTensor) else x.shape)
            strides.append(want_stride)
            if isinstance(x, DTensor):
                seen, last = compat.dtensor_spec_key(x), self._taken_as_is[i]
                if last is not None and seen[0] is last[0] and seen[1] == last[1]:
                    local.append(x)  # this spec passed the checks below on an earlier call
                    continue
                if check:
                    _check_global_shape(x, info, check, self.mesh)
                moved = tuple(x.placements) != tuple(want)
                if moved:
                    x = x.redistribute(self.mesh, want)
                if self._direct(x):
                    if not moved:
                        # a parameter keeps its spec from step to step: the checks above run
                        # once, not per call (147 parameters of a 16-layer Llama: 0.5 ms a
                        # step, as long as a small model's GPU step takes to launch)
                        self._taken_as_is[i] = seen
                    local.append(x)
                    continue
                x = x.to_local()
            elif info.placements is not None and self.mesh is not None:
                # a plain global value annotated with mark_sharding: this rank's piece (a slice,
                # differentiable: its gradient is gathered back)
                warn_if_annotation_changed(x, info)
                x = DTensor.from_local(x, self.mesh, [Replicate()] * self.mesh.ndim,
                                       run_check=False).redistribute(self.mesh, want).to_local()
            local.append(_restrided(x, want_stride))
        outs = _DistFunction.apply(self, tuple(strides), *local)
        self._write_back(args, outs[self.num_user_outputs:])
        outs = outs[:self.num_user_outputs]
        wrapped = []
        for o, pl, shape, stride in zip(outs, self.output_placements, self.output_shapes,
                                        self.output_strides):
            if isinstance(o, torch.Tensor) and pl is not None:
                if isinstance(shape, _Symbolic):
                    shape = shape.sizes(o.shape, pl, self.mesh.shape)
                if isinstance(stride, _Symbolic):
                    stride = stride.dense_strides(shape)
                o = DTensor.from_local(o, self.mesh, pl, run_check=False, shape=shape,
                                       stride=stride)
            wrapped.append(o)
        return tuple(wrapped)

    def _direct(self, x: DTensor) -> bool:
        """Whether ``x`` (in the planned placement) goes into the compiled function as it is:
        a DTensor on this program's mesh with no Partial placement (torch gives a Partial
        input's gradient another placement, so those keep ``to_local``)."""
        mesh = x.device_mesh
        known = self._same_mesh.get(id(mesh))
        if known is None or known[0] is not mesh:  # (DeviceMesh equality is slow: once a mesh)
            known = self._same_mesh[id(mesh)] = (mesh, mesh is self.mesh or mesh == self.mesh)
        return known[1] and not any(p.is_partial() for p in x.placements)

    def grad_dtensor(self, k: int, grad: torch.Tensor, shape: torch.Size) -> DTensor:
        """The gradient of tensor input ``k`` (a DTensor of GLOBAL ``shape``, taken directly)
        as a DTensor in that input's planned placement, as ``to_local``'s backward makes it;
        its spec is made once per shape, layout and dtype."""
        placements = tuple(self._tensor_inputs[k][1])
        key = (k, tuple(shape), tuple(grad.stride()), grad.dtype)
        spec = self._grad_specs.get(key)
        if spec is None:
            spec = compat.DTensorSpec(self.mesh, placements, tensor_meta=compat.TensorMeta(
                shape=torch.Size(shape), stride=compat.global_stride(grad, self.mesh, placements),
                dtype=grad.dtype))
            self._grad_specs[key] = spec
        # a fresh spec object per gradient, as torch's own backward gives (specs are not shared
        # between live DTensors)
        return compat.dtensor_of_local(grad, copy.copy(spec))

    def _global_inputs(self, args) -> list[tuple[str, torch.Tensor]]:
        """The inputs every rank must hold alike: plain tensors that no annotation splits, and
        the local tensors of DTensors replicated on every mesh axis."""
        out = []
        for info, _ in self._tensor_inputs:
            x = args[info.index]
            if isinstance(x, DTensor):
                if all(isinstance(p, Replicate) for p in x.placements):
                    out.append((f"replicated DTensor input {info.name}", x.to_local()))
            elif isinstance(x, torch.Tensor) and info.placements is None:
                out.append((f"plain tensor input {info.name}", x))
        return out

    def _write_back(self, args, new_values) -> None:
        """Input mutations: copy each new value (local, in the input's planned placement) into
        the caller's tensor; DTensor's copy_ moves it to the input's own placement if needed."""
        for k, new in zip(self.mutated_inputs, new_values):
            info, pl = self._tensor_inputs[k]
            x = args[info.index]
            with torch.no_grad():
                if isinstance(x, DTensor):
                    x.copy_(DTensor.from_local(new, self.mesh, pl, run_check=False,
                                               shape=x.shape, stride=x.stride()))
                elif info.placements is not None:
                    x.copy_(DTensor.from_local(new, self.mesh, pl, run_check=False,
                                               shape=x.shape, stride=x.stride()).full_tensor())
                else:
                    x.copy_(new)


def _global_shape_check(info: InputInfo) -> list[tuple[int, int | None]]:
    """What each call checks of a DTensor input's GLOBAL shape: per dim, the size the program
    was compiled for, or None for a symbolic size its placements split (the program assumes
    equal pieces there). Dynamo guards a DTensor's local sizes and placements but not its
    global shape (``check_dtensor_spec`` skips shapes; torch 2.13), so a batch of 5 split 3 + 2
    would run rank 0 on a program compiled for 6 and rank 1 on one for 4: wrong numbers, no
    error. Empty for other inputs."""
    if info.kind is not ArgKind.DTENSOR or info.shape is None:
        return []
    split = {p.dim for p in info.placements or () if isinstance(p, Shard)}
    return [(d, compat.static_size(size)) for d, size in enumerate(info.shape)
            if compat.static_size(size) is not None or d in split]


def _check_global_shape(x: DTensor, info: InputInfo, check, mesh) -> None:
    for d, want in check:
        pieces = math.prod(mesh.shape[a] for a, p in enumerate(x.placements)
                           if isinstance(p, Shard) and p.dim == d)
        if x.shape[d] == want or want is None and x.shape[d] == x.to_local().shape[d] * pieces:
            continue

        raise DistCompileError(
            f"DTensor input {info.name} has global shape {tuple(x.shape)}, but the program "
            f"that serves this call was compiled for "
            f"{tuple(compat.fixed_size(v) for v in info.shape)} (dim {d}: "
            f"{want if want is not None else f'{pieces} equal pieces'}): Dynamo matched it by "
            f"this rank's local piece {tuple(x.to_local().shape)} only, and running it would "
            f"compute on the wrong global size", shapes=[tuple(x.shape)], mesh=mesh,
            placements=list(x.placements),
            fix="make the global size a multiple of the mesh axes that split it, or pass the "
                "batch as a plain tensor (the program splits it, and Dynamo guards its size); "
                "torch._dynamo.reset() drops the compiled programs")


class _Symbolic:
    """A shape or strides with symbolic entries (a program compiled with dynamic shapes),
    made concrete per call: a size from the local tensor (the plan splits no symbolic dim:
    ``dynamo_dist.symbolic``), strides dense in the order the traced ones had."""

    def __init__(self, values) -> None:
        self.static = [compat.static_size(v) for v in values]
        hints = [compat.size_hint(v) for v in values]
        self.order = sorted(range(len(hints)), key=lambda d: (-hints[d], d))  # outermost first

    @staticmethod
    def wanted(values) -> bool:
        return values is not None and any(isinstance(v, torch.SymInt) for v in values)

    @classmethod
    def of(cls, values) -> "_Symbolic | tuple[int, ...]":
        """Where every entry is fixed after all (a guarded size), the plain ints."""
        out = cls(values)
        return out if None in out.static else tuple(out.static)

    def sizes(self, local_shape, placements, mesh_shape) -> torch.Size:
        """The global shape of an output whose local piece has ``local_shape``: a symbolic
        size split by the plan is a multiple of the mesh axes splitting it (``symbolic``
        allows no other split), so its pieces are equal."""
        out = []
        for d, s in enumerate(self.static):
            if s is None:
                s = local_shape[d] * math.prod(
                    mesh_shape[a] for a, p in enumerate(placements)
                    if isinstance(p, Shard) and p.dim == d)
            out.append(s)
        return torch.Size(out)

    def dense_strides(self, shape) -> tuple[int, ...]:
        strides, acc = [0] * len(shape), 1
        for d in reversed(self.order):
            strides[d] = acc
            acc *= max(int(shape[d]), 1)
        return tuple(strides)


def _restrided(x: torch.Tensor, stride) -> torch.Tensor:
    """``x``, or a copy of it laid out with ``stride`` when its own strides differ (on a dim of
    size > 1): the compiled graph checks them. Differentiable (the copy's gradient is ``x``'s)."""
    if stride is None or same_layout(x.shape, x.stride(), stride):
        return x
    out = torch.empty_strided(x.shape, stride, dtype=x.dtype, device=x.device)
    return out.copy_(x)


_WARNED: set[str] = set()


def warn_if_annotation_changed(x: torch.Tensor, info: InputInfo) -> None:
    """A plain input's mark_sharding annotation is read when the program is compiled; a later
    change does not recompile (Dynamo does not guard on it). The compiled placement is still
    applied, so results stay right; say so once."""
    now = input_annotation(x)
    if now is not None and tuple(now[1]) != tuple(info.placements) and info.name not in _WARNED:
        _WARNED.add(info.name)
        log.warning("dynamo_dist: input %s was marked %s after its program was compiled with %s; "
                    "the compiled placement is used. To plan the new one, annotate inside the "
                    "compiled function (mark_sharding there is guarded) or call "
                    "torch._dynamo.reset()", info.name, list(now[1]), list(info.placements))
