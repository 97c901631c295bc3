"""On-disk cache of sharding plans: a recompile of the same program skips planning.

Inductor's FX graph cache makes a warm compile's code generation cheap, but planning (several
ILPs on a 2-D mesh) ran again every time: 22 s of a 41 s warm compile on the dp x tp benchmark.
The plan is a pure function of the joint graph (ops, arguments, shapes, dtypes, what is local
code), the input and gradient placements, pinned constraints, the mesh (shape, axis names,
axis costs), the data axes, and the planner's own code; the key hashes exactly those. Plans live
next to Inductor's caches (``<inductor cache dir>/dynamo_dist/plans``), so clearing Inductor's
cache directory clears them too. ``DYNAMO_DIST_PLAN_CACHE=0`` turns the cache off.

Only the rank that plans (see ``agreement.plan_once``) reads and writes the cache.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
from typing import Any, Callable

import torch
import torch.fx as fx

import inductor_passes
from inductor_passes.core import compat
from inductor_passes.core.mesh_facts import axis_weights

log = logging.getLogger("dynamo_dist")

_VERSION = 2  # bump when Plan's pickled layout changes


def enabled() -> bool:
    return os.environ.get("DYNAMO_DIST_PLAN_CACHE", "1") != "0"


@functools.cache
def _planner_fingerprint() -> str:
    """Hash of the planner's sources (rules, cost model, solver, propagation, and the bottom
    layer's custom ops they read) and torch's version: any change to them is another plan."""
    h = hashlib.sha256(f"{_VERSION} {torch.__version__}".encode())
    top = os.path.dirname(inductor_passes.__file__)
    # every subpackage too: the op rules live in sharding/rules/ (a flat listing missed them,
    # and an edited rule was answered with the stale cached plan)
    for folder in (os.path.join(top, "sharding"), os.path.join(top, "core")):
        for root, dirs, files in os.walk(folder):
            dirs.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(root, name)
                    with open(path, "rb") as f:
                        h.update(os.path.relpath(path, top).encode() + f.read())
    return h.hexdigest()


def _describe(value: Any) -> str:
    if isinstance(value, fx.Node):
        return "%" + value.name
    if isinstance(value, (list, tuple)):
        inner = ",".join(map(_describe, value))
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_describe(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _node_line(node: fx.Node) -> str:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    meta = ";".join(f"{tuple(v.shape)}:{v.dtype}" if isinstance(v, torch.Tensor) else repr(v)
                    for v in vals)
    local = {k: repr(v) for k, v in node.meta.items() if k.startswith("dynamo_dist")}
    return (f"{node.name}={node.op}:{node.target}({_describe(node.args)},"
            f"{_describe(node.kwargs)})[{meta}]{sorted(local.items())}")


def plan_key(gm: fx.GraphModule, mesh, **inputs: Any) -> str:
    """sha256 of the graph (one line per node), the mesh and ``inputs`` (placements, pinned
    constraints, origins, data axes, ...: anything else the planner reads, as ``repr``)."""
    h = hashlib.sha256(_planner_fingerprint().encode())
    for node in gm.graph.nodes:
        h.update(_node_line(node).encode())
    h.update(repr((tuple(mesh.shape), mesh.mesh_dim_names, tuple(axis_weights(mesh)))).encode())
    for name in sorted(inputs):
        h.update(f"{name}={inputs[name]!r}".encode())
    return h.hexdigest()


def _path(key: str) -> str:
    return os.path.join(compat.inductor_cache_dir(), "dynamo_dist", "plans", key[:2], key + ".pkl")


def cached_plan(key: str, compute: Callable[[], Any]) -> tuple[Any, bool]:
    """The plan stored under ``key``, else ``compute()`` (then stored). Returns (plan, hit).
    An unreadable entry is recomputed and overwritten (logged), never an error."""
    if not enabled():
        return compute(), False
    path = _path(key)
    try:
        with open(path, "rb") as f:
            return pickle.load(f), True
    except FileNotFoundError:
        pass
    except Exception as exc:  # a truncated or stale file: plan again
        log.warning("dynamo_dist: plan cache entry %s unreadable (%s); planning again", path, exc)
    plan = compute()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(plan, f)
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
    return plan, False
