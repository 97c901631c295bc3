"""Compiled autograd graphs reaching the ``dist`` backend.

With compiled autograd on (``torch._dynamo.config.compiled_autograd = True`` around a compiled
step that calls ``loss.backward()``, or ``torch._dynamo.compiled_autograd._enable(
torch.compile(backend="dist"))`` around ``loss.backward()``), autograd traces the whole backward
-- the AOT backward of every compiled forward, module full-backward hooks, tensor hooks,
gradient accumulation and post-accumulate-grad hooks -- into one FX graph and hands it to
Dynamo, which traces it for the same backend. That graph takes ONE input, a list of plain local
tensors (activations, parameters, the root gradient), and its outputs are the hook results
Dynamo writes back. A user's DDP-style hook (``funcol.all_reduce(p.grad, "sum", group)``) is in
it as ``torch.ops._c10d_functional.all_reduce`` + ``wait_tensor``.

Such a graph is already local code (one rank's values; the user wrote the collectives), so the
backend does not plan it: it is compiled "as one device" with Inductor, which keeps the
functional collectives in the compiled code (as ``_c10d_functional.all_reduce_`` on its own
buffer + ``wait_tensor``). What the backend found is recorded here (``backward_records()``):
every collective of the graph with kind, process group, bytes and the user's source line, the
input of a later bucketing pass.

A forward graph compiled while compiled autograd is on may take a ``BackwardState`` input: Dynamo
routes module full-backward hooks (and hooks registered on intermediate tensors inside the
compiled region) through it, to be called from the compiled-autograd graph. AOTAutograd knows
that protocol and the backend's joint capture does not, so such a forward graph -- plain
tensors only -- is compiled as one device too (``compile_local``), as every graph without a
DTensor, mesh or sharding constraint already is.

The backend hooks (in ``backend.dist_backend``; the rank-divergence check that follows there
then compares the user's collectives across ranks too)::

    compiled = compiled_autograd.compile_local(gm, example_inputs, inductor)
    if compiled is None:
        with compat.disable_local_tensor_mode(), compiled_autograd.disabled():
            compiled = _compile(gm, list(example_inputs), inductor, config)

``disabled()``: capture traces the joint graph with ``torch.autograd.grad``, which compiled
autograd, when on, would capture as a backward graph of fakes (AOTAutograd turns it off in the
same place).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from inductor_passes import cpu_probe, early_kernels
from inductor_passes.core import compat
from inductor_passes.core.collectives import KINDS, collective_op
from inductor_passes.core.errors import DistCompileError
from inductor_passes.core.ledger import CollectiveEntry, CollectiveLedger

log = logging.getLogger("dynamo_dist")


@dataclasses.dataclass(frozen=True)
class GraphCollective:
    """One functional collective found in a graph the backend received.

    ``bytes``: the input buffer of this rank (all tensors of a coalesced call together);
    ``group``: the process group name the op runs on (``ProcessGroup.group_name``);
    ``op``: the ``_c10d_functional`` op name (``all_reduce``, ``all_gather_into_tensor``, ...).
    """

    kind: str
    op: str
    group: str
    bytes: int
    node: str
    source: str | None


@dataclasses.dataclass
class BackwardRecord:
    """One graph the ``dist`` backend compiled for compiled autograd.

    ``phase``: "backward" (a compiled-autograd graph) or "forward" (a forward graph holding a
    ``BackwardState``: module backward hooks under compiled autograd).
    """

    phase: str
    graph_module: fx.GraphModule       # as the backend received it from Dynamo
    compiled_autograd_id: int | None   # autograd's id of the backward graph (None: a forward)
    collectives: list[GraphCollective]
    seconds: float
    inductor: bool

    def ledger(self, mesh=None) -> CollectiveLedger:
        """The collectives as a ``CollectiveLedger`` (phase ``self.phase``, cause "user hook").

        ``mesh_axis`` is the mesh dimension name whose process group the collective runs on
        when ``mesh`` (a DeviceMesh with dim names) is given and has that group, otherwise
        ``group:<name>``. Returns a new ledger; raises nothing.
        """
        axes = group_axes(mesh) if mesh is not None else {}
        return CollectiveLedger([
            CollectiveEntry(c.kind, axes.get(c.group, f"group:{c.group}"), c.bytes, c.node,
                            f"user code ({c.op})", self.phase, c.source)
            for c in self.collectives])


_RECORDS: list[BackwardRecord] = []


def backward_records() -> list[BackwardRecord]:
    """Every graph the ``dist`` backend compiled for compiled autograd in this process, oldest
    first (a copy of the list)."""
    return list(_RECORDS)


def clear_backward_records() -> None:
    """Forget the recorded graphs (tests). Returns None."""
    _RECORDS.clear()


def compiled_autograd_id() -> int | None:
    """The compiled-autograd graph id of the compile in progress, or None when Dynamo is not
    compiling a compiled-autograd graph (or a frame it calls) now. Raises nothing."""
    return compat.compiled_autograd_id()


def collectives(gm: fx.GraphModule) -> list[GraphCollective]:
    """The ``_c10d_functional`` collectives of ``gm`` in graph order (waits not counted).

    Bytes come from the nodes' example values (Dynamo's ``example_value`` or ``val``); a node
    without one counts 0 bytes. Raises nothing.
    """
    found = []
    for node in gm.graph.nodes:
        name = collective_op(node)
        if name is None:
            continue
        inp = node.args[0] if node.args else None  # the group name is each op's last argument
        group = node.args[-1] if node.args else node.kwargs.get("group_name")
        found.append(GraphCollective(KINDS[name], name, str(group), _input_bytes(inp),
                                     node.name, _user_frame(node)))
    return found


def group_axes(mesh) -> dict[str, str]:
    """Process group name -> mesh dimension name for each named dimension of ``mesh``.
    Raises nothing (a mesh without dim names gives an empty dict)."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return {mesh.get_group(n).group_name: n for n in names}


def compile_local(gm: fx.GraphModule, example_inputs: Sequence[Any], inductor: bool = True):
    """Compile ``gm`` as one rank's local program when it belongs to compiled autograd.

    That is: a compiled-autograd backward graph, or a forward graph with a ``BackwardState``
    input (compiled while compiled autograd is on). Returns None for any other graph (the
    backend plans it as usual); else Inductor's compiled callable (``compile_fx``, which
    flattens a compiled-autograd graph's list input itself), or ``gm`` when ``inductor`` is
    False. Functional collectives in the graph stay in the compiled program. Records a
    ``BackwardRecord`` and logs the collectives found.

    Raises DistCompileError when such a graph holds a DTensor, a DeviceMesh or a sharding
    constraint (compiled autograd over a sharded program is not supported); Inductor's own
    errors propagate.
    """
    ca_id = compiled_autograd_id()
    leaves = pytree.tree_leaves(list(example_inputs))
    forward_hooks = any(isinstance(x, compat.BackwardState) for x in leaves)
    if ca_id is None and not forward_hooks:
        return None
    if _sharded(gm, leaves):
        raise DistCompileError(
            "compiled autograd reached the dist backend with a sharded program (a DTensor, "
            "DeviceMesh or sharding constraint in a " +
            ("compiled-autograd backward graph)" if ca_id is not None else
             "forward graph with module backward hooks)"),
            fix="use compiled autograd with plain-tensor programs (user hooks doing the "
                "collectives), or compile programs with DTensor parameters without compiled "
                "autograd: the dist backend already compiles their backward")
    t = time.perf_counter()
    found = collectives(gm)
    compiled: Any = gm
    if inductor:
        cpu_probe.wait()
        with early_kernels.submitting():
            compiled = compat.compile_fx(gm, list(example_inputs))
    seconds = time.perf_counter() - t
    phase = "backward" if ca_id is not None else "forward"
    _RECORDS.append(BackwardRecord(phase, gm, ca_id, found, seconds, inductor))
    log.info("dynamo_dist: compiled a compiled-autograd %s graph%s as one device (%.2fs, %s); "
             "%d collectives: %s", phase, f" (id {ca_id})" if ca_id is not None else "",
             seconds, "inductor" if inductor else "fx", len(found),
             ", ".join(f"{c.kind}@{c.group} {c.bytes}B" for c in found) or "none")
    return compiled


def disabled():
    """A context manager that turns compiled autograd off inside it (and restores it after).

    The backend's capture traces the joint graph with ``torch.autograd.grad``; with compiled
    autograd on (a forward compiled inside ``compiled_autograd._enable`` or a compiled step with
    ``torch._dynamo.config.compiled_autograd``), that call would be captured by compiled
    autograd and sent to the backend as a backward graph of fakes. AOTAutograd turns it off in
    the same place. Returns the context manager; raises nothing.
    """
    return compat.compiled_autograd_disabled()


def _sharded(gm: fx.GraphModule, leaves: Sequence[Any]) -> bool:
    from torch.distributed.tensor import DeviceMesh, DTensor

    if any(isinstance(x, (DTensor, DeviceMesh)) for x in leaves):
        return True
    return any(node.op == "call_function" and
               str(node.target).startswith("dynamo_dist.sharding_constraint")
               for node in gm.graph.nodes)


def _input_bytes(inp) -> int:
    total = 0
    for n in pytree.tree_leaves(inp):
        val = n.meta.get("example_value", n.meta.get("val")) if isinstance(n, fx.Node) else n
        if isinstance(val, torch.Tensor):
            total += _hint(val.numel()) * val.element_size()
    return total


def _hint(n) -> int:
    """An int, or a symbolic size's example value (compiled autograd traces dynamic sizes);
    0 where there is none. Reading the hint adds no guard."""
    if isinstance(n, int):
        return n
    hint = getattr(getattr(n, "node", None), "hint", None)
    return int(hint) if isinstance(hint, int) else 0


def _user_frame(node: fx.Node) -> str | None:
    """The last frame of the node's stack trace outside torch: the user's hook line."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    lines = [ln.strip() for ln in trace.strip().splitlines()]
    best = None
    for i, ln in enumerate(lines):
        if ln.startswith("File ") and "/torch/" not in ln:
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") \
                else ""
            best = f"{ln[5:]}: {code}".strip()
    return best

