"""Comm pass: bucket the collectives of each local graph.

A lowered graph issues one collective per redistribute: FSDP-style sharding gathers every
parameter on its own and reduce-scatters every gradient on its own, each paying the
collective's fixed latency (76 all_gather + 39 reduce_scatter per step on the small Llama at
dp=2 x tp=2, against FSDP2's 9 + 5). Bucketing merges independent collectives of one kind, group
and dtype into one collective over a flat buffer: one latency per bucket instead of one per tensor.

The merging is Inductor's FX bucketing pass (``torch._inductor.fx_passes.bucketing``, the pass
SimpleFSDP / torchtitan use), switched on through Inductor's config; we own the policy:
  * which kinds: all_gather, reduce_scatter and all_reduce;
  * bucket size: at most ``bucket_cap_mb()`` MiB per bucket (the larger of input and output),
    25 MiB by default, DDP's default bucket size. A cap bounds the memory a bucket of gathered
    parameters holds at once; ``DYNAMO_DIST_BUCKET_MB=0`` turns bucketing off.
Only collectives with no path between them are merged (the pass checks), and only runs of one
kind, group and dtype in graph order, so every rank merges the same ones.
"""

from __future__ import annotations

import functools
import os

import torch.fx as fx

from dynamo_dist import _compat

DEFAULT_BUCKET_MB = 25.0


def bucket_cap_mb() -> float:
    """Largest bucket, in MiB (``DYNAMO_DIST_BUCKET_MB``; 0 or less: no bucketing).

    Raises ValueError naming the variable when it is not a number."""
    text = os.environ.get("DYNAMO_DIST_BUCKET_MB", "")
    if not text:
        return DEFAULT_BUCKET_MB
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"DYNAMO_DIST_BUCKET_MB={text!r} is not a number of MiB; "
                         f"fix: set it to e.g. {DEFAULT_BUCKET_MB:g}, or 0 to turn bucketing off"
                         ) from None


def _cap(mb: float, bucket_index: int) -> float:
    return mb


def inductor_config() -> dict:
    """Inductor config entries that turn bucketing on with our cap (empty when it is off).

    The cap goes in as ``functools.partial(_cap, mb)``: Inductor's FX graph cache pickles its
    config into the key, so another cap is another cache entry, never a stale bucketing."""
    mb = bucket_cap_mb()
    if mb <= 0:
        return {}
    return _compat.bucketing_config(functools.partial(_cap, mb))


_KINDS = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
          "all_reduce": "all_reduce", "all_to_all_single": "all_to_all"}


def collective_kind(node: fx.Node) -> str | None:
    """The ledger's kind of a functional collective node (``_c10d_functional``), else None."""
    target = node.target
    if node.op != "call_function" or getattr(target, "namespace", None) != "_c10d_functional":
        return None
    return _KINDS.get(target._opname)


def predicted_buckets(gm: fx.GraphModule) -> dict[str, list[int]]:
    """Per collective kind, the sizes (number of collectives merged) of the buckets Inductor will
    form in ``gm``: what the ledger reports as issued. Reads the graph, changes nothing."""
    mb = bucket_cap_mb()
    if mb <= 0:
        return {}
    return _compat.predict_buckets(gm, functools.partial(_cap, mb))
