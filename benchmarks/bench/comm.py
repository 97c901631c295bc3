"""Collectives per step, counted at run time the same way for every contestant.

``CollectiveRecorder`` is a TorchDispatchMode: every op of the ``_c10d_functional`` namespace
(functional collectives: DTensor eager, Inductor's generated code, ours) and the ``c10d``
namespace (``torch.distributed`` calls: FSDP2's all-gather / reduce-scatter) that reaches the
dispatcher while the mode is on is recorded with its kind and the bytes of its INPUT tensor(s)
on this rank (the same convention as dynamo_dist's ledger). Non-communicating helpers
(``wait_tensor``, ``_wrap_tensor_autograd``) are not counted.

Two details make the mode see everything:
  * ``ignore_compile_internals() -> True``: otherwise Dynamo skips compiled code under a
    non-infra dispatch mode and runs the frame eagerly; with it, the compiled code runs and its
    collectives (called through ``torch.ops``) pass through the mode.
  * tensor subclasses (DTensor) get ``NotImplemented``: the subclass then runs its own dispatch
    with the mode still on, so the collectives DTensor issues on local tensors are seen (a mode
    that ran ``func`` itself would be popped while DTensor works, and miss them).
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

NAMESPACES = ("_c10d_functional", "c10d")
NOT_COMMUNICATION = {"wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier_"}

_KIND = {  # op name without the namespace and overload -> kind
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "allreduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce", "all_reduce_coalesced_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "allgather_": "all_gather",
    "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "all_to_all_single": "all_to_all", "alltoall_base_": "all_to_all", "alltoall_": "all_to_all",
    "broadcast": "broadcast", "broadcast_": "broadcast",
}


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def input_bytes(func, args: tuple, kwargs: dict) -> int:
    """Bytes of the op's input tensor(s): the argument whose schema name starts with "input"
    (c10d's ``_allgather_base_(output, input, ...)``), else the first tensor argument."""
    names = [a.name for a in func._schema.arguments]
    values = dict(zip(names, args)) | dict(kwargs)
    for name in names:
        if name.startswith("input") and name in values:
            return _tensor_bytes(values[name])
    for name in names:
        b = _tensor_bytes(values.get(name))
        if b:
            return b
    return 0


class CollectiveRecorder(TorchDispatchMode):
    """``with CollectiveRecorder() as rec: step()``; then ``rec.summary()``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str, int]] = []   # (kind, op name, input bytes)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t is not torch.Tensor and issubclass(t, torch.Tensor) and t is not FakeTensor
               for t in types):
            # let DTensor desugar; its inner ops come back here (fake tensors are DTensor's own
            # sharding propagation, run eagerly: they pass)
            return NotImplemented
        if func.namespace in NAMESPACES:
            op = func._schema.name.split("::")[-1]
            if op not in NOT_COMMUNICATION:
                self.calls.append((_KIND.get(op, op), f"{func.namespace}.{op}",
                                   input_bytes(func, args, kwargs)))
        return func(*args, **kwargs)

    def summary(self) -> dict:
        """{"count", "bytes", "by_kind": {kind: {"count", "bytes"}}, "ops": {op: count}};
        bytes are per rank (each call's local input)."""
        by_kind: dict[str, dict[str, int]] = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
        for kind, _, b in self.calls:
            by_kind[kind]["count"] += 1
            by_kind[kind]["bytes"] += b
        return {"count": len(self.calls), "bytes": sum(b for _, _, b in self.calls),
                "by_kind": dict(sorted(by_kind.items())),
                "ops": dict(collections.Counter(op for _, op, _ in self.calls))}


def ledger_summary(records) -> dict:
    """dynamo_dist's compile-time ledger of the graphs of one step (``CompileRecord``s), in the
    same shape as ``CollectiveRecorder.summary`` plus a per-phase split."""
    by_kind: dict[str, dict[str, int]] = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
    by_phase: dict[str, dict[str, int]] = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
    count = total = 0
    for rec in records:
        for e in rec.ledger.entries:
            for table, key in ((by_kind, e.kind), (by_phase, e.phase)):
                table[key]["count"] += 1
                table[key]["bytes"] += e.bytes
            count += 1
            total += e.bytes
    return {"count": count, "bytes": total, "by_kind": dict(sorted(by_kind.items())),
            "by_phase": dict(sorted(by_phase.items())), "graphs": len(records)}
