"""The collective ledger: every collective the lowering inserted, with why and where."""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable


@dataclasses.dataclass(frozen=True)
class CollectiveEntry:
    """One inserted collective. ``bytes`` is the local input buffer of one rank."""

    kind: str          # all_gather | all_reduce | reduce_scatter | all_to_all
    mesh_axis: str
    bytes: int
    node: str          # the joint-graph node whose input (or output) needed it
    cause: str         # e.g. "input 1 of aten.add.Tensor: [P(sum)] -> [R]"
    phase: str         # forward | backward
    source: str | None  # user file:line
    value: str = ""    # the joint-graph value moved ("" for collectives inside an op)


@dataclasses.dataclass
class CollectiveLedger:
    entries: list[CollectiveEntry] = dataclasses.field(default_factory=list)
    # per kind, how many collectives each bucket of the comm pass merges into one
    buckets: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    # per kind, collectives the compiled graphs issue per call (after bucketing; the partitioner
    # may recompute one in the backward); empty: not compiled yet, read the entries
    issued_by_kind: dict[str, int] = dataclasses.field(default_factory=dict)

    def add(self, entry: CollectiveEntry) -> None:
        self.entries.append(entry)

    def count(self, kind: str | None = None, phase: str | None = None,
              mesh_axis: str | None = None) -> int:
        return sum(1 for e in self._select(kind, phase, mesh_axis))

    def total_bytes(self, kind: str | None = None, phase: str | None = None,
                    mesh_axis: str | None = None) -> int:
        return sum(e.bytes for e in self._select(kind, phase, mesh_axis))

    def _select(self, kind, phase, mesh_axis) -> Iterable[CollectiveEntry]:
        for e in self.entries:
            if (kind is None or e.kind == kind) and (phase is None or e.phase == phase) and \
                    (mesh_axis is None or e.mesh_axis == mesh_axis):
                yield e

    def summary(self) -> dict[tuple[str, str, str], tuple[int, int]]:
        """(phase, kind, mesh axis) -> (count, bytes)."""
        out: dict[tuple[str, str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
        for e in self.entries:
            row = out[(e.phase, e.kind, e.mesh_axis)]
            row[0] += 1
            row[1] += e.bytes
        return {k: (v[0], v[1]) for k, v in sorted(out.items())}

    def issued(self, kind: str | None = None) -> int:
        """Collectives the compiled graphs issue per call, after bucketing."""
        if not self.issued_by_kind:
            return self.count(kind)
        return sum(n for k, n in self.issued_by_kind.items() if kind in (None, k))

    def merged(self, other: "CollectiveLedger") -> "CollectiveLedger":
        buckets = {k: self.buckets.get(k, []) + other.buckets.get(k, [])
                   for k in {*self.buckets, *other.buckets}}
        issued = {k: self.issued(k) + other.issued(k)
                  for k in {*self.issued_by_kind, *other.issued_by_kind}}
        return CollectiveLedger(self.entries + other.entries, buckets, issued)

    def to_table(self, title: str = "collective ledger (one step, per rank)"):
        """A rich Table: phase, kind, mesh axis, count, bytes."""
        from rich.table import Table

        table = Table(title=title)
        for col in ("phase", "kind", "mesh axis", "count", "bytes"):
            table.add_column(col, justify="right" if col in ("count", "bytes") else "left")
        for (phase, kind, axis), (n, b) in self.summary().items():
            table.add_row(phase, kind, axis, str(n), f"{b:,}")
        table.add_row("total", "", "", str(len(self.entries)), f"{sum(e.bytes for e in self.entries):,}")
        if self.issued_by_kind:
            table.caption = f"issued per call, after bucketing: {self.issued()} (" + ", ".join(
                f"{k} {n}" for k, n in sorted(self.issued_by_kind.items())) + ")"
        return table
