"""``docs/model_coverage.md``: the zoo's matrix (architecture x mesh x runtime) and, per cell,
what a user would ask: did it train like one process, in how many graphs, with which
collectives against the textbook plan, what was left replicated and why."""

from __future__ import annotations

import collections
import datetime

import torch

from .cell import BF16_FACTOR, FLOOR_FACTOR, GRAD_TOL, LOSS_TOL
from .expect import data_parallel_shortfall

_MARK = {"parity": "parity", "WRONG": "**WRONG**", "error": "error", "crash": "crash",
         "hang": "**hang**"}


def _cell_text(row: dict) -> str:
    text = _MARK.get(row["status"], row["status"])
    if row["status"] in ("parity", "WRONG") and "loss_rel" in row:
        text += f" {row['loss_rel']:.0e}/{row['grad_rel']:.0e}"
    bf16 = row.get("bf16") or {}
    if bf16.get("within_bf16_error") and not bf16.get("matches_ddp"):
        text += f" (bf16 error {bf16['loss_reference_vs_fp32']:.0e}/" \
                f"{bf16['grad_reference_vs_fp32']:.0e})"
    base = row.get("baseline") or {}
    if "grad_rel" in base:  # a WRONG cell's plain Inductor run against eager
        text += f" (plain Inductor: {base['loss_rel']:.0e}/{base['grad_rel']:.0e})"
    more = [r for r in row.get("textbook", []) if r["verdict"] == "MORE"]
    if more:
        text += f", +{sum(r['ours'] - r['textbook'] for r in more)} coll."
    short = data_parallel_shortfall(row.get("textbook", []))
    if short:
        text += f", dp grads reduced {short[0]}/{short[1]}"
    if row.get("graphs", 1) > 1:
        text += f", {row['graphs']} graphs"
    return text


def _autocast_text(rows: list[dict]) -> list[str]:
    """The criteria of autocast cells (``cell`` module docstring), when there are any."""
    if not any(r.get("autocast") for r in rows):
        return []
    return ["", "Cells run under `torch.autocast(bfloat16)` (eval mode on both sides) are "
            "compared with DDP emulated on one device (each data rank's piece of the batch, "
            "gradients summed in fp32); each gradient may be DDP's or one device's (a sum taken "
            "before a narrowing cast is one device's). Tolerances are the larger of the above "
            f"and {FLOOR_FACTOR:g}x torch's own compile floor (on one device, `aot_eager` with "
            "decompositions for `sim`, Inductor for real ranks, against eager). With `tp`, a "
            f"cell is also at parity when it is within {BF16_FACTOR:g}x the reference's own "
            "distance from the fp32 model "
            "(`bf16 error L/G`): Megatron rounds the row-parallel partial sums to bf16, which "
            "one device never does."]


def _checkpointing_text(rows: list[dict]) -> list[str]:
    """What checkpointing cells ran (``cell`` module docstring), when there are any."""
    if not any(r.get("checkpointing") for r in rows):
        return []
    return ["", "Cells marked checkpointing ran with transformers' `gradient_checkpointing_enable"
            "(use_reentrant=False)` on both sides, dropout on as shipped; same tolerances."]


def write_report(rows: list[dict], path: str) -> None:
    models = list(dict.fromkeys(r["model"] for r in rows))
    cols = list(dict.fromkeys((r["mesh"], r["runtime"]) for r in rows))
    by = {(r["model"], r["mesh"], r["runtime"]): r for r in rows}
    counts = collections.Counter(r["status"] for r in rows)
    ran_on = ", ".join(dict.fromkeys(
        f"torch {r.get('torch', torch.__version__)}"
        + (f", transformers {r['transformers']}" if r.get("transformers") else "")
        + (f" on {r['gpu']}" if r.get("gpu") else "")
        for r in rows))
    lines = [
        "# Model coverage",
        "",
        f"Written by `python -m dynamo_dist.testing.zoo` on {datetime.date.today()} "
        f"({ran_on}). Each architecture is built from its library's default "
        "config, scaled down only in width, depth and vocabulary (caches, ties and dropout as "
        "shipped), planned by the stock planners (`TensorParallelPlanner` on `tp`, "
        "`DataParallelPlanner` FSDP on `dp`), trained 3 AdamW steps with `backend=\"dist\"` and "
        "compared with the same model in one process, with the same random draws. `sim`: every "
        "rank simulated in one process (local graphs as FX); `gloo`: real ranks, Inductor; "
        "`cuda`: real ranks on GPUs, Inductor's Triton kernels, the reference on the same GPU.",
        "",
        f"A cell reads `parity L/G` when losses agree within {LOSS_TOL:g} and first-step "
        f"gradients within {GRAD_TOL:g} (relative), with L and G the worst of each; `**WRONG**` "
        "when it ran and the numbers differ; `error` for a clear user-facing error; `crash` "
        "for any other failure; `+n coll.` when the plan moves n more collectives than the "
        "textbook plan (Megatron on tp, FSDP on dp); `dp grads reduced k/n` when the backward "
        "reduces fewer than half the textbook's gradients on dp (its ranks then computed much "
        "of the model on the whole batch: right numbers, no data parallelism there); "
        "`k graphs` when Dynamo split the program; "
        "`(plain Inductor: L/G)` after a WRONG cell: plain `torch.compile` on one device against "
        "eager (as far off: the difference is Inductor's, not the sharding's).",
        *_autocast_text(rows),
        *_checkpointing_text(rows),
        "",
        "Totals: " + ", ".join(f"{n} {s}" for s, n in counts.most_common()),
        "",
        "| model | " + " | ".join(f"{m} {rt}" for m, rt in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for model in models:
        cells = [_cell_text(by[(model, m, rt)]) if (model, m, rt) in by else "" for m, rt in cols]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    lines += ["", "## Architectures", ""]
    for model in models:
        row = next(r for r in rows if r["model"] == model)
        lines.append(f"- **{model}**: {row['family']}")
    lines += ["", "## Cells", ""]
    for r in rows:
        lines += _details(r)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _details(r: dict) -> list[str]:
    out = [f"### {r['model']} on {r['mesh']} ({r['runtime']}): {r['status']}", ""]
    if r.get("error"):
        out += ["```", str(r["error"]).strip()[:1500], "```", ""]
    if "losses" in r:
        out.append("- loss (ours / one process): " + ", ".join(
            f"{a:.6f}/{b:.6f}" for a, b in r["losses"]) +
            f"; worst first-step gradient {r['grad_rel']:.1e} ({r.get('grad_worst')}); final "
            f"parameters {r['param_rel']:.1e} ({r.get('param_worst')})")
    if r.get("bf16"):
        b = r["bf16"]
        match = "matches" if b["matches_ddp"] else "does not match"
        out.append(f"- under bf16 autocast: {match} DDP or one device within torch's compile "
                   f"floor ({b['floor_loss']:.1e}/{b['floor_grad']:.1e}); the bf16 reference's "
                   f"own error against fp32 {b['loss_reference_vs_fp32']:.1e}/"
                   f"{b['grad_reference_vs_fp32']:.1e}; gradients nearer one device's than "
                   f"DDP's: {len(b['one_device_nearer'])}")
    if "graphs" in r:
        breaks = "; ".join(r.get("graph_breaks", [])) or "none"
        out.append(f"- graphs compiled: {r['graphs']}; graph breaks: {breaks}")
    if "ties_kept" in r:
        out.append(f"- tied parameters kept tied: {r['ties_kept']}")
    if r.get("params"):
        p = r["params"]
        reasons = collections.Counter(f"{x['axis']}: {x['reason']}" for x in p["replicated"])
        out.append(f"- parameters: {p['total']}, sharded on some axis {p['sharded']}, "
                   f"replicated everywhere {p['replicated_everywhere']}")
        out += [f"  - replicated ({n}x) {why}" for why, n in reasons.most_common()]
    if r.get("textbook"):
        out += ["", "| axis | phase | kind | ours | textbook | verdict |", "|---|---|---|---|---|---|"]
        out += [f"| {t['axis']} | {t['phase']} | {t['kind']} | {t['ours']} | "
                f"{'' if t['exact'] else '<= '}{t['textbook']} | {t['verdict']} |"
                for t in r["textbook"]]
        out.append("")
    if r.get("fallbacks"):
        out += ["- replicated fallbacks:"] + [f"  - {f}" for f in r["fallbacks"]]
    if r.get("ledger_without_user_line"):
        out.append(f"- ledger entries without a user source line: "
                   f"{len(r['ledger_without_user_line'])}")
    out.append("")
    return out
