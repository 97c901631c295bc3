"""Convolutions, forward and backward: split over samples, output channels or input channels.

``aten.convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups)``
x: [N, C_in, *S], w: [C_out, C_in/groups, *K] ([C_in, C_out/groups, *K] when transposed),
b: [C_out] or None, out: [N, C_out, *S']. Per mesh axis:

- samples: x and out Shard(0), w and b Replicate (data parallelism);
- output channels (groups == 1): w split on its output-channel dim, b Shard(0), out Shard(1);
- input channels (groups == 1): x Shard(1), w split on its input-channel dim: a contraction,
  out Partial(sum) (b Partial too, so that it is counted once);
- linear in x (w Replicate) or in w (x Replicate): Partial in, Partial out (b Partial).

Spatial dims are never split: a window crosses the cut (a halo exchange we do not lower). With
groups > 1 a channel split would also change the local ``groups`` argument; only samples split.
``convolution_backward`` follows the same cases (``_backward_options``).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from .base import (AxisOption, OpSpec, RuleKind, expand_multi_output, expand_to_mesh, tensor_args,
                   val_shape)

aten = torch.ops.aten
CONV = {aten.convolution.default, aten.convolution_backward.default}


def conv_strategy(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    if node.target is aten.convolution.default:
        return _forward(node, mesh_shape)
    return _backward(node, mesh_shape)


def _weight_dims(transposed: bool) -> tuple[int, int]:
    """(output-channel dim, input-channel dim) of the weight."""
    return (1, 0) if transposed else (0, 1)


def _forward(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    x, w, b = node.args[:3]
    transposed, groups = bool(node.args[6]), int(node.args[8])
    targs = tensor_args(node)
    shapes = [val_shape(a) for a in targs]
    has_bias = isinstance(b, fx.Node)
    R, P = Replicate(), Partial("sum")

    def opt(xp: Placement, wp: Placement, bp: Placement, out: Placement) -> AxisOption:
        return ((xp, wp, bp) if has_bias else (xp, wp)), out

    options = [opt(R, R, R, R)]
    if len(shapes[0]) == len(shapes[1]):  # batched input: dim 0 holds samples
        options.append(opt(Shard(0), R, R, Shard(0)))
    options += [opt(P, R, P, P), opt(R, P, P, P)]
    if groups == 1:
        w_out, w_in = _weight_dims(transposed)
        options.append(opt(R, Shard(w_out), Shard(0), Shard(1)))
        options.append(opt(Shard(1), Shard(w_in), P, P))
    return expand_to_mesh(options, mesh_shape, shapes, val_shape(node), RuleKind.CONV)


def _backward(node: fx.Node, mesh_shape: Sequence[int]) -> list[OpSpec]:
    """(grad_output, x, w) -> (grad_input, grad_weight, grad_bias); outputs the op's
    ``output_mask`` leaves out are None."""
    transposed, groups = bool(node.args[7]), int(node.args[9])
    targs = tensor_args(node)
    if len(targs) != 3:
        return []
    shapes = [val_shape(a) for a in targs]
    out_shapes = [tuple(v.shape) if isinstance(v, torch.Tensor) else None
                  for v in node.meta["val"]]
    R, P = Replicate(), Partial("sum")
    options = [((R, R, R), (R, R, R)),
               ((P, R, R), (P, P, P)),      # linear in grad_output
               ((R, P, R), (R, P, R)),      # grad_weight linear in x; the others do not read x
               ((R, R, P), (P, R, R))]      # grad_input linear in w
    if len(shapes[1]) == len(shapes[2]):
        options.append(((Shard(0), Shard(0), R), (Shard(0), P, P)))  # samples
    if groups == 1:
        w_out, w_in = _weight_dims(transposed)
        options.append(((Shard(1), R, Shard(w_out)), (P, Shard(w_out), Shard(0))))
        options.append(((R, Shard(1), Shard(w_in)), (Shard(1), Shard(w_in), R)))
    return expand_multi_output(options, mesh_shape, shapes, out_shapes, RuleKind.CONV)


def conv_flops(node: fx.Node) -> float:
    """2 x multiply-adds of one convolution, or of the gradients a backward computes (each
    about one forward's), on the GLOBAL shapes. Each output element of a convolution reads
    C_in/groups channels x the kernel (w[1:]); each input element of a transposed one writes
    C_out/groups x the kernel (w[1:] again, its layout being [C_in, C_out/groups, *K])."""
    if node.target is aten.convolution.default:
        x, w = node.args[:2]
        per = math.prod(val_shape(w)[1:])
        return 2.0 * per * math.prod(val_shape(x) if node.args[6] else val_shape(node))
    go, x, w = node.args[:3]
    per = math.prod(val_shape(w)[1:])
    forward = 2.0 * per * math.prod(val_shape(x) if node.args[7] else val_shape(go))
    return forward * sum(isinstance(v, torch.Tensor) for v in node.meta["val"][:2])
