"""User-facing errors: each names what failed, where (the user's source line), the shapes, mesh
and placements involved, and a fix."""

from __future__ import annotations

import traceback
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
    """The innermost USER frame of an FX node's stack trace, as 'file:line in fn: code': frames
    inside torch (an inlined ``funcol.all_reduce``) or this package are skipped when a user
    frame exists."""
    trace = getattr(node, "meta", {}).get("stack_trace") if node is not None else None
    return user_frame(trace) if trace else None


def source_of_failure(exc: BaseException) -> str | None:
    """The user's line an exception was raised at: that of the FX node ``torch.fx.Interpreter``
    was running (it appends the node's stack trace to the message, "Original traceback:"),
    else the innermost frame of the exception's own traceback outside torch and this package
    (user Python that ran while tracing: a custom op's backward, say)."""
    _, found, trace = str(exc).partition("Original traceback:")
    if found and "File " in trace:
        return user_frame(trace)
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not any(p in f.filename for p in _LIBRARY_PATHS)]
    if not frames:
        return None
    f = frames[-1]
    return f'"{f.filename}", line {f.lineno}, in {f.name}: {f.line}'.strip()


def user_frame(trace: str) -> str | None:
    """The innermost user frame of a stack trace's text (see ``user_source``)."""
    frames = [ln.strip() for ln in trace.strip().splitlines()]
    found = []
    for i, line in enumerate(frames):
        if line.startswith("File "):
            code = frames[i + 1] if i + 1 < len(frames) and \
                not frames[i + 1].startswith("File ") else ""
            found.append((line[5:], code))
    if not found:
        return frames[-1]
    users = [f for f in found if not any(p in f[0] for p in _LIBRARY_PATHS)]
    where, code = (users or found)[-1]
    return f"{where}: {code}".strip()


_LIBRARY_PATHS = ("/site-packages/torch/", "/dynamo_dist/", "/inductor_passes/")
