"""Runtime boundary: DTensor in, local tensors through the compiled graphs, DTensor out.

Inputs: a DTensor is redistributed (eagerly, differentiably) to the plan's placement if it
differs, then ``to_local()``; a plain tensor is passed whole (a global value; the graph slices it
where the plan shards it). The compiled forward/backward run inside one autograd.Function.
Outputs become DTensors with the planned placements (``from_local``), so a parameter's ``.grad``
arrives as a DTensor in the parameter's own placement through ``to_local``'s backward.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.distributed.tensor import DTensor

from inductor_passes.compile import CompiledJoint
from inductor_passes.sharding.placements import Placements

from .capture import InputInfo


class _DistFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, step: "DistStep", *args):
        outs = step.joint.forward(list(args))
        n = step.joint.num_fwd_outputs
        saved = outs[n:]
        ctx.step = step
        ctx.save_for_backward(*saved)
        user = tuple(outs[:n])
        diff = set(step.diff_outputs)
        ctx.mark_non_differentiable(*[o for i, o in enumerate(user)
                                      if i not in diff and isinstance(o, torch.Tensor)])
        return user

    @staticmethod
    def backward(ctx, *grads):
        step: DistStep = ctx.step
        if step.joint.backward is None:
            raise RuntimeError("this program was compiled without a backward (no input required "
                               "grad when it was compiled)")
        # autograd materialises missing output grads as zeros, so every tangent is a tensor
        tangents = [grads[j].contiguous() for j in step.diff_outputs]
        res = step.joint.backward([*ctx.saved_tensors, *tangents])
        return (None, *res)


class DistStep:
    """The callable a backend returns to Dynamo for one graph on this rank."""

    def __init__(self, inputs: Sequence[InputInfo], joint: CompiledJoint, mesh,
                 input_placements: Sequence[Placements], output_placements: Sequence[Any],
                 output_shapes: Sequence[Any], diff_outputs: Sequence[int]) -> None:
        self.inputs = list(inputs)
        self.joint = joint
        self.mesh = mesh
        self.input_placements = list(input_placements)
        self.output_placements = list(output_placements)
        self.output_shapes = list(output_shapes)
        self.diff_outputs = list(diff_outputs)
        self.calls = 0

    def __call__(self, *args):
        local = []
        tensor_inputs = [i for i in self.inputs if i.kind != "constant"]
        for info, want in zip(tensor_inputs, self.input_placements):
            x = args[info.index]
            if isinstance(x, DTensor):
                if tuple(x.placements) != tuple(want):
                    x = x.redistribute(self.mesh, want)
                x = x.to_local()
            local.append(x)
        outs = _DistFunction.apply(self, *local)
        self.calls += 1
        wrapped = []
        for o, pl, shape in zip(outs, self.output_placements, self.output_shapes):
            if isinstance(o, torch.Tensor) and pl is not None:
                o = DTensor.from_local(o, self.mesh, pl, run_check=False, shape=torch.Size(shape),
                                       stride=_contiguous(shape))
            wrapped.append(o)
        return tuple(wrapped)


def _contiguous(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))
