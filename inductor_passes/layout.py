"""Memory layout (strides) at the compiled program's boundary, global and local.

Inductor compiles a graph for the strides of its example inputs and checks them on every call,
and it returns outputs in the strides the graph traced. So capture, lowering and the runtime
must agree on one layout per input and output (``dynamo_dist.runtime`` restrides a tensor that
arrives otherwise):

- an input is compiled for the strides it arrives with, whatever they are (a transposed view,
  a slice, channels-last): no copy. That is the tensor's own strides for a plain tensor (it
  arrives whole), and the local tensor's for a DTensor the plan takes in its own placement;
- a piece made at the boundary (a DTensor redistributed to the plan's placement, a plain tensor
  annotated with mark_sharding) is compiled for dense strides in the GLOBAL value's dim order
  (``input_local_strides``): a channels-last global value has channels-last pieces;
- an output's local value is dense in the dim order of the global value the program traced,
  and its DTensor declares the dense global strides of that order (``dense_strides``).

A layout that is not dense and non-overlapping (a slice with step, a broadcast) has no dim order
that a piece can keep; its pieces and outputs are contiguous.
"""

from __future__ import annotations

from typing import Sequence

from .core.placements import Placements, local_shape


def dim_order(shape: Sequence[int], stride: Sequence[int]) -> tuple[int, ...]:
    """Dims from outermost to innermost if ``(shape, stride)`` is dense and non-overlapping (as
    a permutation of a contiguous tensor is), else the contiguous order. Ties (dims of size 1,
    whose strides address nothing) keep the contiguous order."""
    n = len(shape)
    order = tuple(sorted(range(n), key=lambda d: (-stride[d], d)))
    expected = 1
    for d in reversed(order):
        if shape[d] > 1:
            if stride[d] != expected:
                return tuple(range(n))
            expected *= shape[d]
    return order


def dense_strides(shape: Sequence[int], order: Sequence[int]) -> tuple[int, ...]:
    """Strides of a dense tensor of ``shape`` laid out in ``order`` (outermost dim first)."""
    strides = [0] * len(shape)
    acc = 1
    for d in reversed(order):
        strides[d] = acc
        acc *= max(shape[d], 1)
    return tuple(strides)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    return dense_strides(shape, range(len(shape)))


def input_local_strides(shape: Sequence[int], stride: Sequence[int], placements: Placements,
                        mesh_shape: Sequence[int], coordinate: Sequence[int] | None,
                        arrived: Sequence[int] | None = None) -> tuple[int, ...]:
    """The strides a compiled program expects for this rank's local piece of an input of
    GLOBAL ``shape`` and ``stride``: ``arrived`` (the strides of the local tensor as it comes,
    when it is passed as it is), the global strides for a value passed whole, else dense in the
    global dim order (see the module notes)."""
    if arrived is not None:
        return tuple(arrived)
    local = local_shape(shape, placements, mesh_shape, coordinate)
    if tuple(local) == tuple(shape):
        return tuple(stride)
    return dense_strides(local, dim_order(shape, stride))


def output_strides(shape: Sequence[int], traced_stride: Sequence[int], placements: Placements,
                   mesh_shape: Sequence[int],
                   coordinate: Sequence[int] | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local strides of this rank's piece, GLOBAL strides its DTensor declares) for an output
    of GLOBAL ``shape`` whose global value traced ``traced_stride``: both dense in its order."""
    order = dim_order(shape, traced_stride)
    local = local_shape(shape, placements, mesh_shape, coordinate)
    return dense_strides(local, order), dense_strides(shape, order)


def same_layout(shape: Sequence[int], a: Sequence[int], b: Sequence[int]) -> bool:
    """Strides ``a`` and ``b`` address a tensor of ``shape`` alike (Inductor's input check
    ignores dims of size 1, and an empty tensor has no layout)."""
    if any(s == 0 for s in shape):
        return True
    return all(x == y for s, x, y in zip(shape, a, b) if s > 1)
