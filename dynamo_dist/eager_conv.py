"""Eager DTensor convolution for the layouts DTensor's own handler does not take.

DTensor runs ``aten.convolution`` and its backward through handlers of its own
(``torch.distributed.tensor._tp_conv``): they compute on the local tensors as they come and
label the result with the input's placements. That holds for a replicated weight and an input
split over the batch (dim 0) or, with a halo exchange, over its last dim. Anything else fails
(checked on torch 2.13, 1-D and 2-D meshes):
- a weight split over output channels (an FSDP plan's ``Shard(0)`` on the data axis): local
  shapes disagree with the labels (a bias of 4 against 2 channels);
- a weight split over input channels, or an input split over channels: the local convolution
  refuses the shapes.

That is what runs between the blocks when only the blocks are compiled (torchtitan's way): the
patch embedding of ViT, the stem of a ResNet, with the parameters ``shard_module`` split over
the data axis. Here such a call runs as FSDP runs it: the weight and bias are all_gathered, the
input is kept split over the batch (other splits and pending sums are all_gathered /
all_reduced to whole values), each rank convolves its piece of the batch, and the output stays
split over the batch. In the backward the weight's and bias's gradients are pending sums
(``Partial``) over the axes that split the batch; ``shard_module``'s gradient hook then
reduce_scatters them to the parameter's placement. Calls DTensor takes are left to it, and so
is everything while Dynamo traces for ``dist`` (the compiled program plans convolutions
itself).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from inductor_passes.core import compat
from inductor_passes.layout import contiguous_strides

aten = torch.ops.aten
_MARK = "_dynamo_dist_eager_conv"


def install() -> None:
    """Put this module's rule in front of DTensor's convolution handlers (idempotent). What the
    handler there did before (DTensor's own, or another patch's wrapper) still runs every call
    this rule leaves alone."""
    handlers = compat.dtensor_custom_op_handlers()
    for op, ours in ((aten.convolution.default, _forward),
                     (aten.convolution_backward.default, _backward)):
        inner = handlers.get(op)
        if inner is None or any(getattr(h, _MARK, False) for h in handler_chain(inner)):
            continue
        handlers[op] = _in_front_of(inner, ours)


def handler_chain(handler: Callable) -> list[Callable]:
    """``handler`` and every handler it wraps, outermost first (our wrappers and the tracing
    fallback's, ``patches._replicating_handler``, name what they wrap)."""
    chain = [handler]
    while True:
        inner = getattr(chain[-1], "_dynamo_dist_original", None)
        if inner is None:
            return chain
        chain.append(inner)


def _in_front_of(inner: Callable, ours: Callable) -> Callable:
    def run(op_call, args, kwargs):
        if compat.dist_tracing() or not _ours_to_run(op_call, args):
            return inner(op_call, args, kwargs)
        return ours(*args, **kwargs)

    run = torch.compiler.disable(run)
    setattr(run, _MARK, True)
    run._dynamo_dist_original = inner
    return run


def _ours_to_run(op_call, args: tuple) -> bool:
    """Whether DTensor's handler would fail on this call: for the forward (input, weight,
    bias, ...) and the backward (grad_output, input, weight, ...) alike, a weight or bias that
    is not replicated, an input that is a plain tensor, or one split other than over its batch
    or last dim, or over one dim on two mesh axes (DTensor's dim map holds one axis per
    dim)."""
    forward = op_call is aten.convolution.default
    x, w = (args[0], args[1]) if forward else (args[1], args[2])
    b = args[2] if forward else None
    if not isinstance(w, DTensor):
        return False
    if any(isinstance(t, DTensor) and not all(p.is_replicate() for p in t.placements)
           for t in (w, b)):
        return True
    if not isinstance(x, DTensor):
        return True  # a plain input: DTensor's backward handler asserts on it
    split = [p.dim for p in x.placements if isinstance(p, Shard)]
    return len(set(split)) < len(split) or not all(
        p.is_replicate() or (isinstance(p, Shard) and p.dim in (0, x.ndim - 1))
        for p in x.placements)


def _as_dtensor(t: torch.Tensor | DTensor, like: DTensor) -> DTensor:
    """A plain tensor (a global value: DTensor's implicit replication) as a replicated DTensor
    on ``like``'s mesh."""
    if isinstance(t, DTensor):
        return t
    mesh = like.device_mesh
    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _batch_split(x: torch.Tensor | DTensor, w: DTensor
                 ) -> tuple[DTensor, tuple[Placement, ...], torch.Tensor]:
    """(``x`` as a DTensor, the placements the convolution runs on, ``x``'s local tensor in
    them): split over the batch where ``x`` is, whole elsewhere (a channel or spatial split
    gathered, a pending sum reduced: a bias must be added once)."""
    x = _as_dtensor(x, w)
    placements = tuple(p if isinstance(p, Shard) and p.dim == 0 else Replicate()
                       for p in x.placements)
    return x, placements, x.redistribute(x.device_mesh, placements).to_local()


def _whole(t: DTensor) -> torch.Tensor:
    """``t``'s value on every rank (its local tensor after an all_gather / all_reduce)."""
    return t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim).to_local()


def _wrap(local: torch.Tensor, like: DTensor, placements: tuple[Placement, ...],
          shape: torch.Size) -> DTensor:
    return DTensor.from_local(local, like.device_mesh, placements, run_check=False,
                              shape=shape, stride=contiguous_strides(shape))


def _forward(x: torch.Tensor | DTensor, w: DTensor, b: DTensor | None, stride: list,
             padding: list, dilation: list, transposed: bool, output_padding: list,
             groups: int) -> DTensor:
    """``aten.convolution`` on DTensors, each rank on its piece of the batch: output (GLOBAL
    shape [N, C_out, *spatial]) split over the batch where the input is."""
    x, placements, x_local = _batch_split(x, w)
    out = aten.convolution(x_local, _whole(w), None if b is None else _whole(b), stride, padding,
                           dilation, transposed, output_padding, groups)
    return _wrap(out, x, placements, torch.Size([x.shape[0], *out.shape[1:]]))


def _backward(grad_out: torch.Tensor | DTensor, x: torch.Tensor | DTensor, w: DTensor,
              bias_sizes: list | None, stride: list, padding: list, dilation: list,
              transposed: bool, output_padding: list, groups: int,
              output_mask: list[bool]) -> tuple:
    """``aten.convolution_backward`` matching ``_forward``: the input's gradient split over
    the batch as the forward ran it; the weight's and bias's (GLOBAL shapes) pending sums over
    the mesh axes that split the batch, replicated on the others."""
    x, placements, x_local = _batch_split(x, w)
    g_local = _as_dtensor(grad_out, w).redistribute(x.device_mesh, placements).to_local()
    gx, gw, gb = aten.convolution_backward(g_local, x_local, _whole(w), bias_sizes, stride,
                                           padding, dilation, transposed, output_padding, groups,
                                           output_mask)
    summed = tuple(Partial() if isinstance(p, Shard) else Replicate() for p in placements)
    return (None if gx is None else _wrap(gx, x, placements, x.shape),
            None if gw is None else _wrap(gw, x, summed, w.shape),
            None if gb is None else _wrap(gb, x, summed, gb.shape))
