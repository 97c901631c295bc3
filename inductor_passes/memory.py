"""Predicted peak memory of one rank's step (its compiled forward, then its backward), read off the
partitioned local graphs before Inductor.

The model is liveness over storages (views share their base's storage, as the fake tensors of
the graph do): a node's fresh storage is allocated when it runs and freed after its last user,
unless it is a graph input (parameters and the batch: resident throughout) or a graph output.
The forward's outputs live into the backward: the user's outputs (the loss, logits) to its end,
the saved activations until their last use there (the runtime lets the compiled backward free
them as it goes, ``runtime._DistFunction``); the backward's outputs (the gradients) to its end.
Bytes are local: this rank's pieces. It is the program as traced, before Inductor fuses ops
(a fused intermediate never exists) and reuses buffers, so it is an upper bound on what the
compiled step allocates, up to the allocator's rounding; the optimizer's state and gradients
held from an earlier step are not part of the program and not counted. The same liveness model
as Inductor's ``fx_passes.memory_estimator`` (which counts GPU storages only).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .core import compat


@dataclasses.dataclass(frozen=True)
class PeakEstimate:
    """Predicted per-rank bytes of one forward + backward; see the module doc."""

    peak_bytes: int     # the most live at once, inputs included
    inputs_bytes: int   # the program's inputs (parameters, batch): live throughout
    saved_bytes: int    # what the forward hands to the backward (activations)
    phase: str          # "forward" or "backward": where the peak is reached
    at: str             # the node whose result reaches it

    def __str__(self) -> str:
        mib = 2 ** 20
        return (f"predicted peak {self.peak_bytes / mib:.1f} MiB a rank ({self.phase}, at "
                f"{self.at}): inputs {self.inputs_bytes / mib:.1f} MiB, saved for backward "
                f"{self.saved_bytes / mib:.1f} MiB")


def _storages(value) -> list[tuple[int, int]]:
    """(storage key, bytes) of each tensor in a node's value."""
    out = []
    for t in pytree.tree_leaves(value):
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            out.append((s._cdata, compat.size_hint(s.nbytes())))
    return out


class _Live:
    """Live storages and their bytes, with the running peak."""

    def __init__(self) -> None:
        self.bytes: dict[int, int] = {}
        self.total = 0
        self.peak = 0
        self.at = ""

    def add(self, key: int, nbytes: int) -> bool:
        if key in self.bytes:
            return False
        self.bytes[key] = nbytes
        self.total += nbytes
        return True

    def drop(self, key: int) -> None:
        self.total -= self.bytes.pop(key, 0)

    def mark(self, where: str) -> None:
        if self.total > self.peak:
            self.peak, self.at = self.total, where


def _run(gm: fx.GraphModule, live: _Live, held: set[int]) -> None:
    """Walk ``gm`` in order: each node's fresh storages added, each dropped after its last use
    unless a graph output reads it. Storages in ``held`` (inputs, and what they alias) are
    counted elsewhere: never added nor dropped here."""
    nodes = list(gm.graph.nodes)
    last: dict[int, int] = {}
    for k, node in enumerate(nodes):
        for a in node.all_input_nodes:
            for key, _ in _storages(a.meta.get("val")):
                last[key] = k
    out = nodes[-1]
    outputs = {key for a in out.all_input_nodes for key, _ in _storages(a.meta.get("val"))}
    for k, node in enumerate(nodes):
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        for key, nbytes in _storages(node.meta.get("val")):
            if key not in held:
                live.add(key, nbytes)
        live.mark(node.name)
        for a in node.all_input_nodes:
            for key, _ in _storages(a.meta.get("val")):
                if last.get(key) == k and key not in outputs:
                    live.drop(key)


def predict_peak(fw: fx.GraphModule, bw: fx.GraphModule | None, num_fwd_outputs: int,
                 num_saved_sizes: int = 0) -> PeakEstimate:
    """The predicted per-rank peak of one step of a partitioned local program (``compile``'s
    convention: the forward returns its outputs, then the saved values; the backward takes the
    saved sizes, the saved tensors, then the tangents). Bytes are local; see the module doc."""
    inputs = _Live()
    for p in fw.graph.find_nodes(op="placeholder"):
        for key, nbytes in _storages(p.meta.get("val")):
            inputs.add(key, nbytes)
    fwd = _Live()
    _run(fw, fwd, set(inputs.bytes))
    fw_out = next(iter(fw.graph.find_nodes(op="output"))).args[0]
    user = {key: n for a in fw_out[:num_fwd_outputs] if isinstance(a, fx.Node)
            for key, n in _storages(a.meta.get("val")) if key not in inputs.bytes}
    saved_nodes = [a for a in fw_out[num_fwd_outputs:] if isinstance(a, fx.Node)
                   and isinstance(a.meta.get("val"), torch.Tensor)]
    saved = {key: n for a in saved_nodes for key, n in _storages(a.meta.get("val"))
             if key not in inputs.bytes and key not in user}
    fw_peak = inputs.total + fwd.peak
    estimate = PeakEstimate(fw_peak, inputs.total, sum(saved.values()), "forward", fwd.at)
    if bw is None:
        return estimate
    # the backward's placeholders: saved sizes, saved tensors (the forward's storages), tangents
    placeholders = list(bw.graph.find_nodes(op="placeholder"))[num_saved_sizes:]
    bwd = _Live()
    resident: set[int] = set()
    for node, fw_node in zip(placeholders, saved_nodes):
        for (key, nbytes), (fw_key, _) in zip(_storages(node.meta.get("val")),
                                              _storages(fw_node.meta.get("val"))):
            if fw_key in inputs.bytes or fw_key in user:  # a parameter or an output: held
                resident.add(key)
            else:
                bwd.add(key, nbytes)
    for node in placeholders[len(saved_nodes):]:  # tangents
        for key, nbytes in _storages(node.meta.get("val")):
            bwd.add(key, nbytes)
    bwd.mark("backward start")
    _run(bw, bwd, resident)
    bw_peak = inputs.total + sum(user.values()) + bwd.peak
    if bw_peak > fw_peak:
        return PeakEstimate(bw_peak, inputs.total, sum(saved.values()), "backward", bwd.at)
    return estimate
