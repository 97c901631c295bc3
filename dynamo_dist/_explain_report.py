"""The ExplainReport of ``dynamo_dist.explain``: its records, the graph rows (from Dynamo's graph
and the dist CompileRecord) and its rich rendering. No torch private API here."""

from __future__ import annotations

import dataclasses
import io
import os
import re
from typing import Any

from inductor_passes.core import roles
from inductor_passes.core.placements import fmt


@dataclasses.dataclass
class Finding:
    """A graph break (or the error the run raised) at the user's ``file:line``."""

    file: str | None
    line: int | None
    reason: str            # Dynamo's one-line reason (or the exception's first line)
    hint: str | None       # what to do, distributed-specific where one applies
    code: str = ""         # the user's source line
    detail: str = ""       # Dynamo's whole explanation
    count: int = 1         # times hit (recompiles re-trace the same break)

    @property
    def where(self) -> str:
        return f"{_short(self.file)}:{self.line}" if self.file else "?"


@dataclasses.dataclass
class InputPlacement:
    name: str
    shape: tuple[int, ...] | None
    placements: str        # the DTensor's own placements ("-" for a plain tensor: a global value)
    planned: str           # what the plan uses at the boundary


@dataclasses.dataclass
class GraphInfo:
    """One graph Dynamo handed to the ``dist`` backend."""

    index: int
    frame: str             # the Python function (resumed after a break: "f (resumed at line N)")
    where: str
    ops: int | None        # call_function/call_method/call_module nodes of Dynamo's graph
    compiled_as: str       # "dist, mesh tp=2" | "one device (no DTensor input)" | "failed"
    inputs: list[InputPlacement] = dataclasses.field(default_factory=list)
    collectives: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # kind->[n,bytes]
    ledger: list[dict] = dataclasses.field(default_factory=list)
    fallbacks: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Recompile:
    function: str
    where: str
    reason: str            # the guard that failed, as Dynamo words it
    hint: str | None


@dataclasses.dataclass
class ExplainReport:
    """What ``explain`` found. ``to_text()`` renders it without colour; ``to_dict()`` for JSON."""

    graphs: list[GraphInfo] = dataclasses.field(default_factory=list)
    breaks: list[Finding] = dataclasses.field(default_factory=list)
    recompiles: list[Recompile] = dataclasses.field(default_factory=list)
    specializations: list[Finding] = dataclasses.field(default_factory=list)  # rank-dependent code
    error: Finding | None = None
    output: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def graph_count(self) -> int:
        return len(self.graphs)

    @property
    def break_count(self) -> int:
        return len(self.breaks)

    def to_dict(self) -> dict:
        """The report as plain data (JSON-able with ``default=str``), without ``output``."""
        d = dataclasses.asdict(dataclasses.replace(self, output=None))
        d.pop("output")
        return {"graph_count": self.graph_count, "break_count": self.break_count, **d}

    def renderable(self):
        return render(self)

    def print(self, console=None) -> None:
        """Print with rich (colour on a terminal) to ``console`` or a new Console."""
        from rich.console import Console
        (console or Console()).print(self.renderable())

    def to_text(self, width: int = 160) -> str:
        from rich.console import Console
        buf = io.StringIO()
        Console(file=buf, width=width, no_color=True, color_system=None,
                force_terminal=False).print(self.renderable())
        return buf.getvalue()

    __str__ = to_text


def _short(path: str | None) -> str:
    """``path`` relative to the working directory when under it; an installed package's file
    from its package directory on."""
    if not path:
        return "?"
    rel = os.path.relpath(path) if os.path.isabs(path) else path
    if not rel.startswith(".."):
        return rel
    parts = re.split(r"[/\\](?:site|dist)-packages[/\\]", path, maxsplit=1)
    return parts[1] if len(parts) == 2 else path


def _frame_name(co_name: str | None) -> str:
    m = re.match(r"torch_dynamo_resume_in_(.+)_at_(\d+)$", co_name or "")
    return f"{m.group(1)} (resumed at line {m.group(2)})" if m else (co_name or "?")





def graph_info(index: int, gm, metric, record: Any) -> GraphInfo:
    """GraphInfo of Dynamo graph ``gm``; ``metric``: its frame's CompilationMetrics (or None);
    ``record``: its CompileRecord, "one device" (no mesh: compiled as one device) or None (the
    backend raised)."""
    ops = sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module"))
    frame = _frame_name(getattr(metric, "co_name", None)) if metric else "?"
    where = f"{_short(metric.co_filename)}:{metric.co_firstlineno}" if metric else "?"
    if record is None:
        return GraphInfo(index, frame, where, ops, "failed (the backend raised)")
    if isinstance(record, str):
        return GraphInfo(index, frame, where, ops, "one device (no DTensor input)")
    plan, ledger, step = record.plan, record.ledger, record.step
    mesh = " x ".join(f"{a}={s}" for a, s in zip(plan.axis_names, plan.mesh_shape))
    planned = list(step.input_placements) if step is not None else []
    inputs = []
    for k, info in enumerate(record.program.primal_inputs):
        want = planned[k] if k < len(planned) else \
            getattr(plan.nodes.get(roles.primal_name(k)), "output", None)
        inputs.append(InputPlacement(_input_name(str(info.name)), info.shape, fmt(info.placements),
                                     fmt(want)))
    coll: dict[str, list[int]] = {}
    for e in ledger.entries:
        row = coll.setdefault(e.kind, [0, 0])
        row[0] += 1
        row[1] += e.bytes
    return GraphInfo(index, frame, where, ops, f"dist, mesh {mesh}", inputs, coll,
                     [dataclasses.asdict(e) for e in ledger.entries], list(plan.fallbacks))


def _input_name(name: str) -> str:
    """Dynamo's placeholder name as the user wrote it: L_self_modules_fc_parameters_weight_ ->
    self.fc.weight (best effort: a module name with '_' reads the same)."""
    name = re.sub(r"^[LG]_", "", name).rstrip("_")
    return re.sub(r"_(modules|parameters|buffers)_", ".", name)


def _table(title: str, *cols: str):
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_lines=False)
    for c in cols:
        fixed = c in ("at", "#", "ops", "bytes")  # never folded (a file:line stays greppable)
        table.add_column(c, overflow="fold", no_wrap=fixed, min_width=None if fixed else 8,
                         justify="right" if c in ("ops", "bytes") else "left")
    return table


def _source(src: str | None) -> str:
    """'"path", line N, in fn: code' (errors.user_source) -> 'path:N: code'."""
    m = re.match(r'"?([^",]+)"?, line (\d+)(?:, in [^:]*)?:?\s*(.*)', src or "")
    return f"{_short(m.group(1))}:{m.group(2)}: {m.group(3)}" if m else (src or "-")


def _row(table, *cells) -> None:
    from rich.text import Text

    table.add_row(*(Text(str(c)) for c in cells))  # plain text: no rich markup in user strings


def _coll_text(g: GraphInfo) -> str:
    if not g.collectives:
        return "none" if g.compiled_as.startswith("dist") else "-"
    return ", ".join(f"{n} {k} ({b:,} B)" for k, (n, b) in sorted(g.collectives.items()))


def render(report: ExplainReport):
    """A rich renderable of the whole report."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.text import Text

    parts: list[Any] = [Panel(
        f"{report.graph_count} graph(s) compiled by dist, {report.break_count} graph break(s), "
        f"{len(report.recompiles)} recompile(s)"
        + (f", {len(report.specializations)} rank-dependent branch(es)"
           if report.specializations else "")
        + (", the run raised an error" if report.error else ""), title="dynamo_dist explain")]
    if report.graphs:
        t = _table("Graphs", "#", "function", "at", "ops", "compiled as", "collectives (per rank)")
        for g in report.graphs:
            _row(t, str(g.index), g.frame, g.where, str(g.ops), g.compiled_as, _coll_text(g))
        parts.append(t)
    for g in report.graphs:
        if any(i.placements != "-" for i in g.inputs) or g.ledger:
            t = _table(f"Graph {g.index}: inputs", "input", "shape", "placements", "planned")
            for i in g.inputs:
                _row(t, i.name, str(tuple(i.shape or ())), i.placements, i.planned)
            parts.append(t)
        if g.ledger:
            t = _table(f"Graph {g.index}: collective ledger", "phase", "kind", "axis", "bytes",
                       "cause", "source")
            for e in g.ledger:
                _row(t, e["phase"], e["kind"], e["mesh_axis"], f"{e['bytes']:,}", e["cause"],
                          _source(e["source"]))
            parts.append(t)
        for msg in g.fallbacks:
            parts.append(Text(f"graph {g.index}: {msg}", style="yellow"))
    if report.breaks:
        t = _table("Graph breaks", "#", "at", "reason / code / hint")
        t.show_lines = True
        for k, b in enumerate(report.breaks, 1):
            what = Text(b.reason, style="bold")
            what.append(f"\n{b.code}", style="dim")
            what.append(f"\nhint: {b.hint or '-'}", style="green")
            t.add_row(Text(str(k) + (f" (x{b.count})" if b.count > 1 else "")), Text(b.where), what)
        parts.append(t)
    if report.recompiles:
        t = _table("Recompilations", "function", "at", "failed guard", "hint")
        for r in report.recompiles:
            _row(t, r.function, r.where, r.reason.strip()[:400], r.hint or "-")
        parts.append(t)
    if report.specializations:
        t = _table("Rank-dependent control flow (no break: specialised per rank)", "at", "code",
                   "hint")
        for s in report.specializations:
            _row(t, s.where, s.code, s.hint or "-")
        parts.append(t)
    if report.error:
        e = report.error
        parts.append(Panel(Text(f"{e.detail[:2000]}\n\nat {e.where}: {e.code}\n"
                                f"hint: {e.hint or '-'}"), title="error", border_style="red"))
    return Group(*parts)
