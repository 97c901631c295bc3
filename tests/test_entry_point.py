"""`backend="dist"` resolves from the installed entry point, with no `import dynamo_dist`."""

import subprocess
import sys

SCRIPT = """
import torch
from torch._dynamo.backends.registry import lookup_backend
fn = lookup_backend("dist")
assert fn.__module__ == "dynamo_dist.backend", fn.__module__
f = torch.compile(lambda x: torch.sin(x) * 2, backend="dist", options={"inductor": False})
x = torch.randn(8)
torch.testing.assert_close(f(x), torch.sin(x) * 2)
print("resolved")
"""


def test_backend_resolves_without_import():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resolved" in proc.stdout


def test_full_collections_paused_while_dist_compiles_only(monkeypatch):
    """While Dynamo compiles a frame for ``dist`` (seen from its compile-start callback, inside
    the frame's compile) and while the backend compiles, Python's full garbage collections are
    paused (the young generations' thresholds kept); another backend's compile, and the
    compiled function's calls, keep the process's thresholds, restored afterwards.
    ``DYNAMO_DIST_FULL_GC=1`` keeps Python's schedule; another value is an error naming it."""
    import gc

    import pytest
    import torch

    import dynamo_dist.backend as backend

    seen: dict[str, list] = {"backend": [], "frame": [], "call": []}
    real = backend._compile

    def spy(*args, **kwargs):
        seen["backend"].append(gc.get_threshold())
        return real(*args, **kwargs)

    def started(*args):
        seen["frame"].append(gc.get_threshold())

    monkeypatch.setattr(backend, "_compile", spy)
    before = gc.get_threshold()
    x = torch.randn(8)

    def fn(t):
        return torch.sin(t) * 2

    def compile_once(compiler):
        torch._dynamo.reset()  # (which clears Dynamo's callbacks)
        callbacks = torch._dynamo.callback_handler
        callbacks.register_start_callback(started)
        try:
            f = torch.compile(fn, backend=compiler)
            torch.testing.assert_close(f(x), torch.sin(x) * 2)
            seen["call"].append(gc.get_threshold())
        finally:
            if started in callbacks.start_callbacks:
                callbacks.remove_start_callback(started)

    try:
        compile_once(backend.dist_backend)
        for where in ("backend", "frame"):
            assert seen[where][-1][:2] == before[:2] and seen[where][-1][2] >= 1 << 30, \
                (where, seen, before)
        assert seen["call"][-1] == before and gc.get_threshold() == before
        compile_once("eager")  # another backend: Python's schedule
        assert seen["frame"][-1] == before
        monkeypatch.setenv("DYNAMO_DIST_FULL_GC", "1")
        compile_once(backend.dist_backend)
        assert seen["backend"][-1] == before and seen["frame"][-1] == before
        monkeypatch.setenv("DYNAMO_DIST_FULL_GC", "yes")
        with pytest.raises(Exception, match="DYNAMO_DIST_FULL_GC"):
            compile_once(backend.dist_backend)
    finally:
        torch._dynamo.reset()
    assert gc.get_threshold() == before
