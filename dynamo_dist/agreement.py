"""Cross-rank steps of compilation, each bounded in time and told of a peer's failure.

Every ``dist`` backend call is graph #k on every rank (``begin_graph``; ranks compile the same
graphs in the same order, which the schedule check verifies). The steps where a rank waits for
another go through the default process group's key-value store under ``dynamo_dist/graph/k``:

* the plan (``plan_once``): the mesh's first rank plans and publishes the plan; the others read
  it. The planner is deterministic for a given graph, but its ILP solves run under a time limit,
  and ranks sharing CPUs reach it at different moments: two plans would be two collective
  schedules that hang or, with gloo, fail with a size mismatch (seen on the 4-rank demo);
* the collective-schedule comparison (``divergence.check_same_schedule``).

A rank whose compilation raises publishes its error (``publish_failure``); a rank waiting for a
peer (``wait_for``) then raises at once a ``DistCompileError`` naming that rank and its error,
instead of blocking for as long as the failed process lives. A peer that neither arrives nor
fails (it compiles another graph, or hangs) is named after the timeout. A single process, or the
``fake`` process group, has no peers: every step is local.
"""

from __future__ import annotations

import os
import pickle
import time
from typing import Callable, Sequence, TypeVar

import torch.distributed as dist

from inductor_passes.core import compat
from inductor_passes.core.errors import DistCompileError

T = TypeVar("T")

PLAN_TIMEOUT_S = 900.0  # a large model's plan may take minutes on the planning rank
_POLL_S = 0.05
_STATE = {"graph": 0}


def begin_graph() -> int:
    """Number the backend call that starts now (1, 2, ...: the same on every rank)."""
    _STATE["graph"] += 1
    return _STATE["graph"]


def current_graph() -> int:
    return _STATE["graph"]


def has_peers() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake"


def _prefix(graph: int) -> str:
    return f"dynamo_dist/graph/{graph}"


def timeout_seconds(var: str, default: float) -> float:
    """Seconds from environment variable ``var`` (unset: ``default``); ValueError naming it."""
    text = os.environ.get(var, "")
    try:
        return float(text) if text else default
    except ValueError:
        raise ValueError(f"{var}={text!r} is not a number of seconds; fix: set it to e.g. "
                         f"{default:g}") from None


class PeerFailed(DistCompileError):
    """Raised on a rank whose compilation stopped because another rank's failed (not
    re-published as a failure of its own)."""


def publish_failure(exc: BaseException) -> None:
    """Tell the other ranks that this rank's compilation of the current graph failed."""
    if not has_peers() or isinstance(exc, PeerFailed) or not _STATE["graph"]:
        return
    store, prefix = compat.default_store(), _prefix(_STATE["graph"])
    text = f"{type(exc).__name__}: {exc}"
    store.set(f"{prefix}/failed/{dist.get_rank()}", text[-4000:])
    store.add(f"{prefix}/failures", 1)


def wait_for(keys: Sequence[str], ranks: Sequence[int], what: str, timeout: float,
             fix: str) -> None:
    """Block until every store key in ``keys`` exists. Raises PeerFailed as soon as one of
    ``ranks`` publishes a failure of the current graph, DistCompileError naming the ranks still
    missing after ``timeout`` seconds (``keys[i]`` is rank ``ranks[i]``'s, or one key for all)."""
    store, prefix = compat.default_store(), _prefix(_STATE["graph"])
    deadline = time.monotonic() + timeout
    while True:
        if store.check(list(keys)):
            return
        if store.add(f"{prefix}/failures", 0):
            failed = {r: store.get(f"{prefix}/failed/{r}").decode() for r in ranks
                      if store.check([f"{prefix}/failed/{r}"])}
            if failed:
                first = min(failed)
                raise PeerFailed(
                    f"rank {first} failed while compiling graph #{_STATE['graph']}, so this "
                    f"rank stops waiting for {what}:\n    {failed[first]}",
                    fix=f"fix the error rank {first} reports (above, and in its own log)")
        if time.monotonic() > deadline:
            missing = [r for r, k in zip(ranks, keys) if not store.check([k])] \
                if len(keys) == len(ranks) else list(ranks)
            raise DistCompileError(
                f"ranks {missing} did not reach {what} of graph #{_STATE['graph']} within "
                f"{timeout:.0f} s", fix=fix)
        time.sleep(_POLL_S)


def mesh_ranks(mesh) -> list[int]:
    """The mesh's global ranks in mesh order (the first is coordinate (0, ..., 0))."""
    return [int(r) for r in mesh.mesh.flatten().tolist()]


def plan_once(mesh, compute: Callable[[], T]) -> T:
    """``compute()`` on the mesh's first rank (coordinate (0, ..., 0)); its result (picklable)
    on every rank of the mesh. Raises what ``compute`` raised on the planning rank, and
    PeerFailed / DistCompileError on the others (see ``wait_for``)."""
    if not has_peers() or mesh.size() == 1:
        return compute()
    ranks = mesh_ranks(mesh)
    store = compat.default_store()
    key = f"{_prefix(_STATE['graph'])}/plan/{'-'.join(map(str, ranks))}"
    if dist.get_rank() == ranks[0]:
        plan = compute()
        store.set(key, pickle.dumps(plan))
        return plan
    wait_for([key], [ranks[0]], "the plan", timeout_seconds("DYNAMO_DIST_PLAN_TIMEOUT", PLAN_TIMEOUT_S),
             fix="the planning rank is slow or stuck: DYNAMO_DIST_PLAN_TIMEOUT sets the wait "
                 "(seconds)")
    return pickle.loads(store.get(key))

