"""The textbook collective plan of one architecture on one mesh, to hold the compiler's plan
against.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019), per step: one all_reduce in the forward
after every row-parallel projection and vocabulary-parallel embedding, and one in the backward
for every activation that column-parallel projections read (projections that read one activation, q/k/v or gate/up, have
their input gradients summed first), plus, for key/value projections kept whole because the
heads do not split (multi-query attention), one for each one's output gradient; nothing else
moves on the tensor-parallel axis.
Fully-sharded data parallelism (FSDP / ZeRO-3, Rajbhandari et al. 2020): every parameter sharded
on the data axis is all-gathered once in the forward, at most once more in the backward (the
re-gather of what the backward needs), and its gradient is reduce-scattered once; a parameter
replicated there (DDP) has its gradient all-reduced once; the loss (a mean over the batch) needs
its sum and its count of valid labels all-reduced, and synchronized batch norm all-reduces at most two statistics per layer in
each direction. Counts are per step, before bucketing (the ledger's entries).
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from dynamo_dist.plans import ShardingPlan
from dynamo_dist.plans.dataflow import Projection
from dynamo_dist.plans.tensor_parallel import VOCAB_PARALLEL


@dataclasses.dataclass(frozen=True)
class Expected:
    """``count`` collectives of ``kind`` on mesh axis ``axis`` in ``phase``; ``exact`` or an
    upper bound; ``why`` says which rule of the textbook plan it comes from."""

    axis: str
    phase: str
    kind: str
    count: int
    exact: bool
    why: str


def textbook(model: nn.Module, plan: ShardingPlan, axes: dict[str, int],
             projections: dict[int, Projection] | None) -> list[Expected]:
    """The textbook plan of ``model`` (before ``shard_module``: the planners' parameters) on a
    mesh with ``axes`` (name -> size), for every (axis, phase, kind) it moves anything on;
    every other combination is expected to move nothing."""
    out: list[Expected] = []
    params = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    if "tp" in axes and projections is not None:
        out += _megatron(plan, params, projections)
    if "dp" in axes:
        out += _fsdp(model, plan, params)
    return out


def _megatron(plan: ShardingPlan, params, projections) -> list[Expected]:
    rows, column_roots, whole = 0, set(), 0
    for d in plan.decisions:
        whole += d.axis == "tp" and d.role == "whole heads"
        rows += d.axis == "tp" and d.role == VOCAB_PARALLEL  # its rows are summed like a row's
        if d.axis != "tp" or not d.sharded:
            continue
        proj = projections.get(id(params[d.names[0]]))
        if proj is None:
            continue
        if d.role == "row":
            rows += 1
        elif d.role == "column":
            column_roots.update(proj.input_roots)
    return [Expected("tp", "forward", "all_reduce", rows, True,
                     "one after each row-parallel projection and vocabulary-parallel "
                     "embedding"),
            Expected("tp", "backward", "all_reduce", len(column_roots) + whole, True,
                     "one per activation read by column-parallel projections" +
                     (", one per whole-head key/value projection's output gradient (multi-query "
                      "attention: summed over the query-head ranks)" if whole else ""))]


def _fsdp(model: nn.Module, plan: ShardingPlan, params) -> list[Expected]:
    sharded = [d for d in plan.decisions if d.axis == "dp" and d.sharded]
    replicated = [d for d in plan.decisions if d.axis == "dp" and not d.sharded and
                  params[d.names[0]].requires_grad]
    norms = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    out = [Expected("dp", "forward", "all_reduce", 2 + 2 * norms, False,
                    "the loss (its sum and its count of valid labels)" +
                    (f", batch statistics of {norms} batch norms" if norms else ""))]
    if sharded:
        out += [Expected("dp", "forward", "all_gather", len(sharded), True,
                         "each FSDP parameter once"),
                Expected("dp", "backward", "all_gather", len(sharded), False,
                         "re-gather of FSDP parameters the backward reads"),
                Expected("dp", "backward", "reduce_scatter", len(sharded), True,
                         "each FSDP parameter's gradient once")]
    if replicated or norms:
        out.append(Expected("dp", "backward", "all_reduce", len(replicated) + 2 * norms,
                            not norms, "gradients of parameters replicated on dp" +
                            (", batch-norm statistics' gradients" if norms else "")))
    return out


def compare(expected: list[Expected], counts: dict[tuple[str, str, str], int]
            ) -> list[dict]:
    """Rows (axis, phase, kind, ours, textbook, verdict). A collective of another kind can stand
    in for the textbook's at the same cost (an all_reduce of a summed gradient for the
    reduce_scatter of a small table's, an all_to_all of an expanded parameter for its gather),
    so the verdict reads the totals of each (axis, phase): "MORE" when ours moves more
    collectives there than the textbook plan (the cell's plan is worse than it should be),
    "other kind" when a kind exceeds its count but the total does not, "fewer" when an exact
    count is not reached, else "="."""
    keys = {(e.axis, e.phase, e.kind): e for e in expected}
    totals: dict[tuple[str, str], list[int]] = {}
    for key in set(keys) | set(counts):
        t = totals.setdefault(key[:2], [0, 0])
        t[0] += counts.get(key, 0)
        t[1] += keys[key].count if key in keys else 0
    rows = []
    for key in sorted(set(keys) | set(counts)):
        e = keys.get(key)
        ours, want = counts.get(key, 0), (e.count if e else 0)
        more_total = totals[key[:2]][0] > totals[key[:2]][1]
        if ours > want:
            verdict = "MORE" if more_total else "other kind"
        elif ours < want and e is not None and e.exact:
            verdict = "fewer"
        else:
            verdict = "="
        rows.append({"axis": key[0], "phase": key[1], "kind": key[2], "ours": ours,
                     "textbook": want, "exact": bool(e and e.exact), "verdict": verdict,
                     "why": e.why if e else "nothing moves here in the textbook plan"})
    return rows


def data_parallel_shortfall(rows: list[dict]) -> tuple[int, int] | None:
    """(ours, textbook) gradient reductions on ``dp`` in the backward (reduce_scatters and
    all_reduces, from ``compare``'s rows) when ours are fewer than half the textbook's, else
    None. With right gradients (a cell at parity) that means the ranks of ``dp`` computed much
    of the model on the whole batch: each gradient was whole already and only sliced. The
    per-kind verdicts cannot show it (``"fewer"`` is also what a cheaper stand-in reads as)."""
    ours = want = 0
    for r in rows:
        if (r["axis"], r["phase"]) == ("dp", "backward") and \
                r["kind"] in ("reduce_scatter", "all_reduce"):
            ours, want = ours + r["ours"], want + r["textbook"]
    return (ours, want) if want and 2 * ours < want else None
