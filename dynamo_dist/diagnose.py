"""``dynamo_dist.explain`` (defined here, in dynamo_dist.diagnose): what Dynamo and the ``dist``
backend did with a program.

    report = dynamo_dist.explain(model, x)       # runs model(x) compiled with backend="dist"
    print(report.to_text())                      # graphs, graph breaks, recompiles, hints
    report.breaks[0].file, report.breaks[0].line, report.breaks[0].hint

``recording()`` records everything compiled with ``backend="dist"`` while it is active (it
patches ``torch.compile`` for its duration); ``python -m dynamo_dist explain script.py`` uses it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import linecache
import os
import re
import sysconfig
from typing import Any, Callable, Iterator

import torch

from inductor_passes.core.compat import compilation_metrics as _compilation_metrics
from inductor_passes.core.compat import current_compile_id as _current_compile_id
from inductor_passes.core.compat import graph_break_reasons as _graph_break_reasons
from inductor_passes.core.compat import \
    raise_compilation_metrics_limit as _raise_compilation_metrics_limit

from ._explain_report import (ExplainReport, Finding, GraphInfo, InputPlacement, Recompile,
                              _frame_name, _short, graph_info)
from .backend import compile_records, dist_backend

__all__ = ["ExplainReport", "Finding", "GraphInfo", "InputPlacement", "Recompile", "Recording",
           "explain", "recording"]



# --- where is user code, and what to tell the user -----------------------------------------------
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIRS = tuple(os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep + d + os.sep
                  for d in ("dynamo_dist", "inductor_passes"))
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


def _internal(path: str | None) -> bool:
    if not path or path.startswith("<"):
        return True
    path = os.path.abspath(path)
    if path.startswith(_STDLIB) and "-packages" not in path:
        return True
    return path.startswith(_TORCH_DIR) or path.startswith(_OWN_DIRS)


_RANK_CALL = r"\b(get_rank|get_local_rank|get_coordinate|get_group_rank|get_global_rank)\s*\("
_HINTS: list[tuple[Callable[[str, set, str], bool], str]] = [
    (lambda t, names, code: bool(names & {"distribute_tensor", "distribute_module",
                                          "init_device_mesh", "from_local"})
     or bool(re.search(r"\b(distribute_tensor|distribute_module|init_device_mesh|DeviceMesh|"
                       r"from_local)\s*\(", code)) or "device_mesh" in t,
     "distribute parameters/inputs before compiling, e.g. with shard_module or distribute_tensor "
     "outside torch.compile; inside the region change a placement with "
     "with_sharding_constraint(t, mesh, placements) or DTensor.redistribute"),
    (lambda t, names, code: "backward hook" in t or "backwards hook" in t
     or "compiled autograd" in t or "register_full_backward_hook" in code,
     "set torch._dynamo.config.compiled_autograd = True, or register a tensor hook "
     "(out.register_hook(...)) instead of a module backward hook"),
    (lambda t, names, code: bool(re.search(_RANK_CALL, code)),
     "rank-dependent Python control flow: every rank must trace the same program (the same "
     "collectives); compute it as a tensor (torch.where) or move it outside torch.compile"),
    (lambda t, names, code: any(s in t for s in ("item()", "tolist", "data-dependent",
                                                 "generic_jump", "capture_scalar_outputs",
                                                 "_local_scalar_dense"))
     or bool(re.search(r"\.(item|tolist)\(\)", code)),
     "keep the value as a tensor (torch.where / torch.clamp instead of Python control flow on "
     "it), or set torch._dynamo.config.capture_scalar_outputs=True; on a sharded tensor .item() "
     "also gathers the value from every rank each call"),
    (lambda t, names, code: "`print`" in t or "logging" in t or "logger" in t
     or bool(re.match(r"\s*(print|log\w*\.\w+|logging\.\w+)\(", code)),
     "print/logging in the compiled region splits the graph: log outside torch.compile, or add "
     "the function to torch._dynamo.config.reorderable_logging_functions (print) / "
     "ignore_logging_functions (logging)"),
    (lambda t, names, code: "builtin" in t or "marked as skipped" in t,
     "Dynamo cannot trace this Python builtin / C function: call it outside the compiled region "
     "and pass the result in, or wrap it with torch.compiler.allow_in_graph or a custom op"),
]


def hint_for(text: str, frame_names: set[str] = frozenset(), code: str = "") -> str | None:
    """The distributed-specific hint for a break/error text, else Dynamo's own 'Hint:' lines."""
    low = text.lower()
    for match, hint in _HINTS:
        if match(low, set(frame_names), code):
            return hint
    own = [ln.strip()[5:].strip() for ln in text.splitlines() if ln.strip().startswith("Hint:")]
    return " ".join(own) or None


def recompile_hint(reason: str) -> str | None:
    """The fix for a recompile, from Dynamo's guard-failure text (None if none is known)."""
    low = reason.lower()
    if "is_initialized" in low and "cache" in low:
        return ("a transformers cache (use_cache=True) is passed to every layer, and Dynamo "
                "guards on its per-layer state: a block compiled on its own is compiled again "
                "for each layer (and past the recompile limit runs uncompiled); train with "
                "use_cache=False (model.config.use_cache = False)")
    if "_local_tensor" in low and "requires_grad" in low:
        return ("a DTensor input's local tensor requires grad on one call and not on another "
                "(DTensor.from_local on a tensor in the autograd graph, against DTensor's own "
                "ops): build such inputs one way, e.g. from_local(x.detach()) where no gradient "
                "is wanted, or DTensor ops throughout")
    if "dtensor_spec" in low or "placements" in low or "device_mesh" in low:
        return ("a DTensor input came with another mesh or placements than the graph was compiled "
                "for (Dynamo guards each DTensor's spec): redistribute it to one layout before "
                "the call so one graph serves every call; each new layout compiles again")
    if "size mismatch" in low or "tensor_match" in low or "stride mismatch" in low:
        return "an input's shape/stride/dtype changed: mark varying dims dynamic (mark_dynamic)"
    if "___check_obj_id" in low or "id_match" in low:
        return "a Python object the graph depends on (module, mesh, function) is another object"
    return None


_CHECKPOINTED = ("a break inside an activation-checkpointed call (torch.utils.checkpoint, "
                 "transformers' gradient_checkpointing_enable) makes Dynamo run that whole call "
                 "outside the graph: its layers run as eager DTensor code (DTensor's own "
                 "collectives, not the plan, and an in-place op on a Partial value raises) or "
                 "are compiled frame by frame. Remove the break from the checkpointed code")


def _checkpointed(stack: list) -> bool:
    """Whether a frame of ``stack`` calls into activation checkpointing (the checkpoint call
    itself: Dynamo inlines torch's checkpoint frames, so only the caller's line shows it)."""
    return any(fs.name == "forward_with_checkpointing"
               or re.search(r"checkpoint\w*\(", getattr(fs, "line", None) or "")
               for fs in stack)


def _finding(reason_text: str, stack: list) -> Finding:
    user = [fs for fs in stack if not _internal(fs.filename)]
    fs = user[-1] if user else (stack[-1] if stack else None)
    code = (fs.line or "").strip() if fs else ""
    head = reason_text.strip().splitlines()[0] if reason_text.strip() else "graph break"
    names = {f.name for f in stack}
    hint = hint_for(reason_text, names, code)
    if _checkpointed(stack[:-1]):
        hint = _CHECKPOINTED + (f"; {hint}" if hint else "")
    return Finding(fs.filename if fs else None, fs.lineno if fs else None, head, hint, code,
                   reason_text.strip())


def _merge(findings: list[Finding]) -> list[Finding]:
    out: dict[tuple, Finding] = {}
    for f in findings:
        key = (f.file, f.line, f.reason)
        if key in out:
            out[key].count += 1
        else:
            out[key] = f
    return list(out.values())


def _rank_branches(frames: set[tuple[str, int]]) -> list[Finding]:
    """Lines branching on the rank or a mesh coordinate in the functions Dynamo traced: Dynamo
    specialises such a branch to this rank without a break or a guard."""
    found = []
    for path, first in sorted(frames):
        lines = linecache.getlines(path)
        try:
            block = inspect.getblock(lines[first - 1:])
        except Exception:  # not a def at that line (e.g. a lambda): nothing to scan
            continue
        for i, text in enumerate(block):
            if re.search(_RANK_CALL, text) and re.search(r"(^\s*(if|elif|while)\b)|\bif\b", text):
                found.append(Finding(path, first + i, "rank-dependent control flow (specialised, "
                                     "no graph break)", hint_for("", set(), text), text.strip()))
    return found


# --- recording -----------------------------------------------------------------------------------
class Recording:
    """Records graphs, breaks and recompiles while active; ``backend`` is a ``dist`` backend that
    remembers each graph. Use through ``recording()``; ``report()`` builds the ExplainReport."""

    def __init__(self, options: dict | None = None) -> None:
        self.options = dict(options or {})
        self.compiler_fn = dist_backend

        def backend(gm, example_inputs, options: dict | None = None, **_ignored):
            return self._record(gm, example_inputs, options)

        # marked as dist_backend is, so that Dynamo traces it as it traces ``dist`` (DTensor's
        # tracing fallback, static shapes); a bound method cannot carry these attributes
        backend._dynamo_dist_backend = True
        backend.backend_ctx_ctor = dist_backend.backend_ctx_ctor
        self.backend = backend
        self.graphs: list[list] = []  # [Dynamo's gm, compile id, CompileRecord|"one device"|None]
        self.error: BaseException | None = None
        self._old_breaks: list = []
        self._old_metrics: list = []

    def _record(self, gm, example_inputs, options: dict | None = None):
        """The ``dist`` backend, recording ``gm`` and its CompileRecord (if one was made)."""
        before = len(compile_records())
        entry = [gm, _current_compile_id(), None]  # None until the backend returns: "failed"
        self.graphs.append(entry)
        out = self.compiler_fn(gm, example_inputs, {**self.options, **(options or {})})
        records = compile_records()
        entry[2] = records[before] if len(records) > before else "one device"
        return out

    def start(self) -> "Recording":
        """Remember what existed before, so that ``report`` shows only what came after."""
        _raise_compilation_metrics_limit()
        self._old_breaks = _graph_break_reasons()
        self._old_metrics = _compilation_metrics()
        return self

    def report(self, output: Any = None) -> ExplainReport:
        """The ExplainReport of everything recorded so far."""
        old = {id(x) for x in self._old_breaks}
        reasons = [r for r in _graph_break_reasons() if id(r) not in old]
        for gm, *_ in self.graphs:  # also those a torch._dynamo.reset() inside the run dropped
            r = getattr(gm, "compile_subgraph_reason", None)
            if r is not None and r.graph_break and all(r is not x for x in reasons):
                reasons.append(r)
        old = {id(x) for x in self._old_metrics}
        metrics = [m for m in _compilation_metrics() if id(m) not in old]
        by_id = {m.compile_id: m for m in metrics}
        # a break with no user frame on its stack is in a torch frame that Dynamo caught while
        # the eager code between two graphs ran (not the user's program): left out
        breaks = [_finding(r.reason, list(r.user_stack)) for r in reasons
                  if any(not _internal(fs.filename) for fs in r.user_stack)]
        recompiles, frames = [], set()
        for m in metrics:
            if m.fail_reason and "Unsupported" in str(m.fail_type) and \
                    not _internal(m.fail_user_frame_filename):  # a frame Dynamo skipped
                fs = _FrameStub(m.fail_user_frame_filename, m.fail_user_frame_lineno, m.co_name)
                breaks.append(_finding(m.fail_reason, [fs]))
            if _internal(m.co_filename):
                continue
            where = f"{_short(m.co_filename)}:{m.co_firstlineno}"
            if m.recompile_reason:
                recompiles.append(Recompile(_frame_name(m.co_name), where, m.recompile_reason,
                                            recompile_hint(m.recompile_reason)))
            if m.co_name and not m.co_name.startswith("torch_dynamo_resume_in_"):
                frames.add((m.co_filename, m.co_firstlineno))
        graphs = [graph_info(i + 1, gm, by_id.get(cid), rec)
                  for i, (gm, cid, rec) in enumerate(self.graphs)]
        error = None
        if self.error is not None:
            error = _error_finding(self.error)
        return ExplainReport(graphs, _merge(breaks), recompiles, _rank_branches(frames), error,
                             output)


@dataclasses.dataclass
class _FrameStub:
    filename: str
    lineno: int | None
    name: str

    @property
    def line(self) -> str:
        return linecache.getline(self.filename, self.lineno or 0)


def _error_finding(exc: BaseException) -> Finding:
    import traceback

    # Dynamo's errors carry the user's stack (the traceback is Dynamo's own)
    stack = list(getattr(exc, "real_stack", None) or traceback.extract_tb(exc.__traceback__))
    text = f"{type(exc).__name__}: {exc}"
    f = _finding(text, stack)
    f.detail = text
    return f


@contextlib.contextmanager
def recording(options: dict | None = None, patch_compile: bool = True) -> Iterator[Recording]:
    """Record what Dynamo and the ``dist`` backend do inside the ``with`` block.

    With ``patch_compile`` (default), ``torch.compile(..., backend="dist")`` called inside the
    block compiles with the recording backend; ``options`` are default backend options (e.g.
    ``{"inductor": False}``). Yields the Recording; ``rec.report()`` returns the ExplainReport.
    Exceptions from the block propagate (``rec.error`` is not set by the context manager).
    """
    rec = Recording(options)
    original = torch.compile

    @functools.wraps(original)
    def compile_(model=None, *args, backend="inductor", **kwargs):
        if backend == "dist" or backend is dist_backend:
            backend = rec.backend
        return original(model, *args, backend=backend, **kwargs)

    if patch_compile:
        torch.compile = compile_
    try:
        yield rec.start()
    finally:
        if patch_compile:
            torch.compile = original


def explain(fn_or_module: Callable, *args, backend_options: dict | None = None,
            **kwargs) -> ExplainReport:
    """Run ``fn_or_module(*args, **kwargs)`` compiled with the ``dist`` backend and report the
    graphs Dynamo produced (ops, input placements, collective ledger), each graph break at the
    user's file:line with a hint, recompilations with the failed guard, and rank-dependent
    branches.

    Resets Dynamo first (``torch.compiler.reset()``) so that every frame is traced again; an
    already ``torch.compile``d callable is explained from its original. ``backend_options`` go to
    the backend (e.g. ``{"inductor": False}``); they are not passed to the function.
    Returns an ExplainReport (``.output`` holds the function's result). An exception raised by
    the run is not re-raised: it is in ``report.error``. Raises TypeError if not callable.
    """
    if not callable(fn_or_module):
        raise TypeError(f"explain() needs a function or module, got {type(fn_or_module).__name__}")
    fn = fn_or_module
    for attr in ("_orig_mod", "_torchdynamo_orig_callable"):  # already torch.compile'd
        if getattr(fn_or_module, attr, None) is not None:
            fn = getattr(fn_or_module, attr)
    torch.compiler.reset()
    out = None
    with recording(backend_options, patch_compile=False) as rec:
        try:
            out = torch.compile(fn, backend=rec.backend)(*args, **kwargs)
        except Exception as e:  # reported, not raised: explain is for diagnosing failures too
            rec.error = e
    return rec.report(out)
