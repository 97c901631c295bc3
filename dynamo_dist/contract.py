"""The input contract, checked on request: a plain tensor passed to a ``dist``-compiled program
is a GLOBAL value, the same on every rank (so is the local tensor of a fully replicated
DTensor). A rank passing other values computes on them without any error: every rank then
holds a different "global" result. ``DYNAMO_DIST_CHECK_INPUTS=1`` makes every call of a compiled
program compare a digest (SHA-256 of shape, dtype and bytes) of each such input across the
mesh's ranks through the process group's store, and raise on every rank, naming the input and
which ranks disagree. Off by default: it reads every replicated input each call.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Sequence

import torch
import torch.distributed as dist

from inductor_passes.core import compat
from inductor_passes.core.errors import DistCompileError

from . import agreement

ENV = "DYNAMO_DIST_CHECK_INPUTS"
TIMEOUT_S = 120.0
_CALLS = {"n": 0}


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def digest(t: torch.Tensor) -> str:
    """SHA-256 (16 hex digits) of ``t``'s shape, dtype and values (not its strides)."""
    data = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{tuple(data.shape)} {data.dtype}".encode())
    h.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return h.hexdigest()[:16]


def check_same_values(named: Sequence[tuple[str, torch.Tensor]], mesh) -> None:
    """Raise DistCompileError on every rank of ``mesh`` when one of the ``(name, tensor)``
    values differs between ranks. Each rank must call this as often as the others (every rank
    runs the same compiled program). No-op without peers."""
    if not named or not agreement.has_peers():
        return
    _CALLS["n"] += 1
    store = compat.default_store()
    ranks = agreement.mesh_ranks(mesh)
    prefix = f"dynamo_dist/inputs/{_CALLS['n']}"
    store.set(f"{prefix}/{dist.get_rank()}", json.dumps([digest(t) for _, t in named]))
    keys = [f"{prefix}/{r}" for r in ranks]
    agreement.wait_for(keys, ranks, "the input check", TIMEOUT_S,
                       fix="every rank must call the compiled program the same number of times")
    seen = {r: json.loads(store.get(k)) for r, k in zip(ranks, keys)}
    for i, (name, t) in enumerate(named):
        groups: dict[str, list[int]] = {}
        for r in ranks:
            groups.setdefault(seen[r][i], []).append(r)
        if len(groups) > 1:
            parts = "; ".join(f"ranks {g}" for g in sorted(groups.values()))
            raise DistCompileError(
                f"input contract: {name} {tuple(t.shape)} {t.dtype} differs across ranks "
                f"(groups holding the same value: {parts}); a plain tensor (or a replicated "
                f"DTensor's local tensor) passed to a dist-compiled program is a GLOBAL value, "
                f"the same on every rank, and each rank computes on its own copy",
                mesh=mesh,
                fix="pass the same value on every rank (seed the generator alike, or "
                    "dist.broadcast it), or pass this rank's piece as a DTensor "
                    "(DTensor.from_local(x, mesh, [Shard(0)]))")
