"""Comm pass: bucket the collectives of each local graph.

A lowered graph issues one collective per redistribute: FSDP-style sharding gathers every
parameter on its own and reduce-scatters every gradient on its own, each paying the
collective's fixed latency (76 all_gather + 39 reduce_scatter per step on the small Llama at
dp=2 x tp=2, against FSDP2's 9 + 5). Bucketing merges independent collectives of one kind, group
and dtype into one collective over a flat buffer: one latency per bucket instead of one per tensor.

The merging is Inductor's FX bucketing pass (``torch._inductor.fx_passes.bucketing``, the pass
SimpleFSDP / torchtitan use), switched on through Inductor's config; we own the policy:
  * which kinds: all_gather, reduce_scatter and all_reduce;
  * bucket size: at most ``bucket_cap_mb()`` MiB per bucket (the larger of input and output);
    ``DYNAMO_DIST_BUCKET_MB=25`` (DDP's bucket size) turns it on. A cap bounds the memory a
    bucket of gathered parameters holds at once.

OFF by default. With torch 2.13's pass on, the model zoo on 2-4 real gloo ranks under Inductor
first trained four cells to wrong numbers with no error (T5 dp=2 and dp=2 x tp=2: NaN loss;
Mixtral dp=2 x tp=2: gradients off by 120%; the ConvNet dp=2: a BatchNorm bias gradient 2x).
Two Inductor defects, both worked around now: C++ fusion scheduling a read of an in-place
filled buffer before the fill (``inductor_fix.install_inductor_mutation_order_fix``, on for every
compile: T5, Mixtral), and an all_reduce bucket overwriting an input that is read again later
(``copy_shared_all_reduce_inputs`` below: the ConvNet). Those cells train at parity with
bucketing on; it stays an opt-in that warns until the whole zoo has been run with it.
Only collectives with no path between them are merged (the pass checks), and only runs of one
kind, group and dtype in graph order, so every rank merges the same ones.
"""

from __future__ import annotations

import functools
import logging
import os

import torch.fx as fx

from inductor_passes.core import compat
from inductor_passes.core import inductor_fix  # noqa: F401  (installs the fix on import)
from inductor_passes.core.collectives import collective_op

DEFAULT_BUCKET_MB = 0.0  # off: see the module doc
SUGGESTED_BUCKET_MB = 25.0

log = logging.getLogger("dynamo_dist.comm")


def bucket_cap_mb() -> float:
    """Largest bucket, in MiB (``DYNAMO_DIST_BUCKET_MB``; unset, 0 or less: no bucketing).

    Raises ValueError naming the variable when it is not a number."""
    text = os.environ.get("DYNAMO_DIST_BUCKET_MB", "")
    if not text:
        return DEFAULT_BUCKET_MB
    try:
        mb = float(text)
    except ValueError:
        raise ValueError(f"DYNAMO_DIST_BUCKET_MB={text!r} is not a number of MiB; "
                         f"fix: set it to e.g. {SUGGESTED_BUCKET_MB:g}, or 0 to turn bucketing "
                         f"off") from None
    if mb > 0:
        _warn_bucketing_once(mb)
    return mb


@functools.lru_cache(maxsize=None)
def _warn_bucketing_once(mb: float) -> None:
    log.warning("dynamo_dist: collective bucketing on (DYNAMO_DIST_BUCKET_MB=%g), an opt-in: "
                "Inductor's bucketing pass has trained models to wrong numbers before (the two "
                "causes found are worked around; see inductor_passes/comm.py); check your model "
                "against one process, or unset DYNAMO_DIST_BUCKET_MB", mb)


def _cap(mb: float, bucket_index: int) -> float:
    return mb


def _cap_fn():
    """Our cap as Inductor takes it (MiB by bucket index), or None when bucketing is off. A
    ``functools.partial``: Inductor's FX graph cache pickles its config into the key, so another
    cap is another cache entry, never a stale bucketing."""
    mb = bucket_cap_mb()
    return functools.partial(_cap, mb) if mb > 0 else None


def inductor_config() -> dict:
    """Inductor config entries that turn bucketing on with our cap (empty when it is off)."""
    cap = _cap_fn()
    return compat.bucketing_config(cap) if cap else {}


def predicted_buckets(gm: fx.GraphModule) -> dict[str, list[int]]:
    """Per collective kind, the sizes (number of collectives merged) of the buckets Inductor will
    form in ``gm``: what the ledger reports as issued. Reads the graph, changes nothing."""
    cap = _cap_fn()
    return compat.predict_buckets(gm, cap) if cap else {}


def copy_shared_all_reduce_inputs(gm: fx.GraphModule) -> int:
    """With bucketing on, give every all_reduce whose input is also read elsewhere a private
    copy of it (``x * 1``); returns how many. Why: Inductor lowers an all_reduce bucket as
    ``cat`` then an in-place ``all_reduce_`` on the cat's buffer, and its cat lowering computes
    each input directly into its slot of that buffer. An input read elsewhere then aliases the
    bucket, and a reader scheduled after the collective sees the reduced sum (a SyncBN bias
    gradient reduce-scattered after its statistic was all-reduced came out 2x). The copy is the
    one living in the bucket; the original keeps its own buffer. ``clone`` would not do: Inductor
    removes it as a no-op before bucketing."""
    import torch

    if _cap_fn() is None:
        return 0
    count = 0
    for node in list(gm.graph.nodes):
        if collective_op(node) != "all_reduce" or not isinstance(node.args[0], fx.Node):
            continue
        src = node.args[0]
        if len(src.users) < 2:
            continue
        with gm.graph.inserting_before(node):
            copy = gm.graph.call_function(torch.ops.aten.mul.Tensor, (src, 1))
        copy.meta = dict(src.meta)
        node.replace_input_with(src, copy)
        count += 1
    if count:
        gm.recompile()
    return count
