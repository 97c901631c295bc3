"""Rank divergence: every rank must run the same collective schedule, or the job hangs.

A compiled graph can be specialised per rank (Dynamo folds ``dist.get_rank()`` into constants, and
our lowering specialises local shapes by mesh coordinate); that is fine as long as every rank
issues the same collectives, in the same order, on the same groups. After each ``dist``
compilation, every rank publishes its graph's collective schedule in the process group's store
and reads every other rank's. Any difference, or a rank that does not compile the same graph
within ``DYNAMO_DIST_SCHEDULE_TIMEOUT`` seconds (default 120), fails compilation on every rank
with the first difference named, instead of a hang at the first mismatched collective. The
wait goes through ``agreement.wait_for``: a rank whose compilation failed is named at once.
(XLA's SPMD partitioner has no such check: it cannot diverge, since it compiles one program for
all ranks; PyTorch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` checks collectives at run time.)
"""

from __future__ import annotations

import hashlib
import json
from typing import Iterable

import torch
import torch.distributed as dist
import torch.fx as fx

from inductor_passes.core import compat
from inductor_passes.core.collectives import functional_collective_name
from inductor_passes.core.errors import DistCompileError, user_source

from . import agreement


def collective_schedule(graphs: Iterable[fx.GraphModule]) -> list[dict]:
    """The collectives of ``graphs``, in order: kind, arguments that are not tensors (reduce op,
    group shape, ...), the LOCAL shape and dtype of the first tensor argument, and the ranks of
    the collective's group."""
    out = []
    for gm in graphs:
        for node in gm.graph.nodes:
            kind = functional_collective_name(node)
            if kind is None:
                continue
            args = [a for a in node.args[1:] if isinstance(a, (str, int, float))]
            ranks = {a: _group_ranks(a) for a in args if isinstance(a, str) and _is_group(a)}
            consts = [_group_shape(ranks[a]) if a in ranks else a for a in args]
            members = next(iter(ranks.values()), None)
            first = node.args[0] if node.args else None
            val = first.meta.get("val", first.meta.get("example_value")) \
                if isinstance(first, fx.Node) else None
            vals = val if isinstance(val, (list, tuple)) else [val]
            shapes = [[d if isinstance(d, int) else str(d) for d in v.shape]  # SymInt: by name
                      for v in vals if isinstance(v, torch.Tensor)]
            dtype = next((str(v.dtype) for v in vals if isinstance(v, torch.Tensor)), None)
            out.append({"kind": kind, "args": consts, "shapes": shapes, "dtype": dtype,
                        "group": members, "at": user_source(node) or ""})
    return out


def _is_group(name: str) -> bool:
    try:
        compat.resolve_process_group(name)
        return True
    except Exception:  # a reduce op ("sum"), not a group name
        return False


def _group_ranks(name: str) -> list[int]:
    return sorted(dist.get_process_group_ranks(compat.resolve_process_group(name)))


def _group_shape(ranks: list[int]) -> str:
    """A process group (its sorted ranks) as the same string on every rank of the same mesh
    axis: ranks (0, 2) and (1, 3) are one axis's two groups, with different names but the same
    shape (size, strides)."""
    return f"group(size={len(ranks)}, strides={[b - a for a, b in zip(ranks, ranks[1:])]})"


def _key(entry: dict) -> str:
    """What every rank must agree on: the collective, its group's shape, reduce op, dtype.
    Local shapes are compared within each group only (``_shape_clash``): a dim split unevenly
    on another mesh axis gives the groups of this one pieces of different sizes (tp=2 over 15
    columns: the dp group of ranks 0, 2 gathers [2, 8], that of ranks 1, 3 gathers [2, 7])."""
    return json.dumps({k: v for k, v in entry.items() if k not in ("at", "shapes", "group")},
                      sort_keys=True)


def _shape_clash(scheds: dict[int, list[dict]]) -> tuple[int, list[int]] | None:
    """The first collective (index) at which two ranks of one group hold tensors of different
    local shapes, and that group's ranks; None if there is none. Entries without a group
    (none recorded) are compared across all ranks."""
    for i in range(min(len(s) for s in scheds.values())):
        by_group: dict[str, set[str]] = {}
        for s in scheds.values():
            e = s[i]
            by_group.setdefault(json.dumps(e.get("group")), set()).add(json.dumps(e["shapes"]))
        for group, shapes in by_group.items():
            if len(shapes) > 1:
                ranks = json.loads(group)
                return i, ranks if ranks is not None else sorted(scheds)
    return None


def check_same_schedule(graphs: Iterable[fx.GraphModule], what: str) -> None:
    """Compare this graph's collective schedule with every other rank's (see module doc).
    No-op without an initialised process group of more than one rank, and on the ``fake``
    backend (no peers to talk to). Raises DistCompileError on every rank when the schedules
    differ or a rank does not report in time, PeerFailed when another rank's compilation of
    this graph failed (``agreement.wait_for``)."""
    if not agreement.has_peers():
        return
    schedule = collective_schedule(graphs)
    rank, world = dist.get_rank(), dist.get_world_size()
    digest = hashlib.sha256("\n".join(map(_key, schedule)).encode()).hexdigest()[:16]
    store = compat.default_store()
    graph = agreement.current_graph()
    prefix = f"dynamo_dist/schedule/{graph}"
    store.set(f"{prefix}/{rank}", json.dumps({"digest": digest, "schedule": schedule,
                                              "what": what}))
    timeout = agreement.timeout_seconds("DYNAMO_DIST_SCHEDULE_TIMEOUT", 120.0)
    keys = [f"{prefix}/{r}" for r in range(world)]
    try:
        agreement.wait_for(keys, list(range(world)), f"the schedule check ({what})", timeout,
                           fix="")
    except agreement.PeerFailed:
        raise
    except DistCompileError as exc:  # a rank never compiled this graph (it broke elsewhere)
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise DistCompileError(
            f"rank divergence: ranks {missing} did not compile graph #{graph} "
            f"({what}) within {timeout:.0f} s; ranks that compile different graphs would hang "
            f"at their first collective", source=schedule[0]["at"] if schedule else None,
            fix="make the compiled code the same on every rank: no Python branches on "
                "dist.get_rank() or mesh coordinates around collectives or graph breaks "
                "(compute rank-dependent values as tensors instead); "
                "DYNAMO_DIST_SCHEDULE_TIMEOUT sets the wait") from exc
    others = {r: json.loads(store.get(k)) for r, k in enumerate(keys)}
    if len({o["digest"] for o in others.values()}) == 1:
        clash = _shape_clash({r: o["schedule"] for r, o in others.items()})
        if clash is None:
            return
        index, ranks = clash
        raise DistCompileError(_describe({r: others[r] for r in ranks}, index),
                               source=_first_source(others),
                               fix="a collective's ranks must hold pieces of one size: report "
                                   "this (the lowering pads uneven pieces of the dims it "
                                   "splits)")
    raise DistCompileError(_describe(others), source=_first_source(others),
                           fix="issue the same collectives on every rank: move "
                               "rank-dependent Python control flow (if dist.get_rank() == 0: "
                               "...) off collectives, or make the branch a tensor computation")


def _describe(reports: dict[int, dict], index: int | None = None) -> str:
    """The first difference between ``reports``' schedules (or the one at ``index``)."""
    scheds = {r: o["schedule"] for r, o in reports.items()}
    longest = max(len(s) for s in scheds.values())

    def differs(i: int) -> bool:
        return len({_key(s[i]) if i < len(s) else None for s in scheds.values()}) > 1

    i = index if index is not None else \
        next((k for k in range(longest) if differs(k)), longest - 1)
    what = next(iter(reports.values()))["what"]
    lines = [f"rank divergence: ranks would run different collective schedules for graph "
             f"#{agreement.current_graph()} ({what}); first difference at "
             f"collective #{i}:"]
    for r, s in sorted(scheds.items()):
        entry = s[i] if i < len(s) else None
        desc = "no collective" if entry is None else \
            f"{entry['kind']}{tuple(entry['args'])} {entry['shapes']} {entry['dtype']} at {entry['at']}"
        lines.append(f"    rank {r}: {desc} ({len(s)} collectives in all)")
    return "\n".join(lines)


def _first_source(reports: dict[int, dict]) -> str | None:
    for o in reports.values():
        for e in o["schedule"]:
            if e["at"]:
                return e["at"]
    return None
