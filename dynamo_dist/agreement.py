"""Every rank must run the same plan: plan on one rank, hand the plan to the others.

The planner is deterministic for a given graph, but its ILP solves run under a time limit, and
ranks that share CPUs reach that limit at different moments: one rank's solve can stop where
another's finishes, and two different plans mean two collective schedules that hang or, with
gloo, fail with a size mismatch (seen on the 4-rank demo). So the rank at coordinate (0, ..., 0)
of the mesh plans and sends the plan along each mesh axis in turn (a broadcast per axis group:
after axis a, every rank whose coordinates past a are all 0 has it), which also saves the other
ranks the planning time. A single process (or the ``fake`` process group) plans by itself.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def _simulated(mesh) -> bool:
    if not dist.is_initialized() or mesh.size() == 1:
        return True
    return dist.get_backend() == "fake"  # the default group: one process stands for all ranks


def plan_once(mesh, compute: Callable[[], T]) -> T:
    """``compute()`` on the mesh's first rank; its result (picklable) on every rank."""
    if _simulated(mesh):
        return compute()
    coord = mesh.get_coordinate()
    box = [compute() if all(c == 0 for c in coord) else None]
    for axis in range(mesh.ndim):
        # holders at this step: coordinates 0 on this axis and every later one
        if all(c == 0 for c in coord[axis + 1:]):
            dist.broadcast_object_list(box, group=mesh.get_group(axis), group_src=0)
    return box[0]
