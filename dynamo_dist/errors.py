"""User-facing errors: each names what failed, where (the user's source line), the shapes, mesh
and placements involved, and a fix."""

from __future__ import annotations

from typing import Any, Sequence


class DistCompileError(RuntimeError):
    """A program or annotation that dynamo_dist cannot compile as written.

    The message is built from parts so that every error carries the same facts: what happened,
    the op (if any), the user's source line, shapes (global), mesh, placements and a fix.
    """

    def __init__(self, what: str, *, op: Any = None, source: str | None = None,
                 shapes: Sequence[Any] | None = None, mesh: Any = None,
                 placements: Any = None, fix: str | None = None) -> None:
        lines = [what]
        if op is not None:
            lines.append(f"  op:         {op}")
        if source:
            lines.append(f"  at:         {source}")
        if shapes is not None:
            lines.append(f"  shapes:     {', '.join(str(tuple(s)) for s in shapes)} (global)")
        if mesh is not None:
            lines.append(f"  mesh:       {describe_mesh(mesh)}")
        if placements is not None:
            lines.append(f"  placements: {placements}")
        if fix:
            lines.append(f"  fix:        {fix}")
        super().__init__("\n".join(lines))


def describe_mesh(mesh: Any) -> str:
    if isinstance(mesh, str):
        return mesh
    names = getattr(mesh, "mesh_dim_names", None)
    shape = tuple(getattr(mesh, "shape", ()))
    if names:
        return "DeviceMesh(" + ", ".join(f"{n}={s}" for n, s in zip(names, shape)) + ")"
    return f"DeviceMesh(shape={shape})"


def user_source(node: Any) -> str | None:
    """The last user frame of an FX node's stack trace, as 'file:line in fn: code'."""
    trace = getattr(node, "meta", {}).get("stack_trace") if node is not None else None
    if not trace:
        return None
    frames = [ln.strip() for ln in trace.strip().splitlines()]
    for i in range(len(frames) - 1, -1, -1):
        if frames[i].startswith("File "):
            code = frames[i + 1] if i + 1 < len(frames) else ""
            return f"{frames[i][5:]}: {code}".strip()
    return frames[-1]
