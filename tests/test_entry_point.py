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


def test_full_collections_paused_while_a_graph_compiles_only(monkeypatch):
    """While the backend compiles a graph, Python's full garbage collections are paused (the
    young generations' thresholds kept); afterwards the process's thresholds are as they were.
    ``DYNAMO_DIST_FULL_GC=1`` keeps Python's schedule; another value is an error naming it."""
    import gc

    import pytest
    import torch

    import dynamo_dist.backend as backend

    seen = []
    real = backend._compile

    def spy(*args, **kwargs):
        seen.append(gc.get_threshold())
        return real(*args, **kwargs)

    monkeypatch.setattr(backend, "_compile", spy)
    before = gc.get_threshold()
    x = torch.randn(8)

    def compile_once():
        torch._dynamo.reset()
        f = torch.compile(lambda t: torch.sin(t) * 2, backend=backend.dist_backend)
        torch.testing.assert_close(f(x), torch.sin(x) * 2)

    compile_once()
    assert seen[-1][:2] == before[:2] and seen[-1][2] >= 1 << 30, (seen, before)
    assert gc.get_threshold() == before
    monkeypatch.setenv("DYNAMO_DIST_FULL_GC", "1")
    compile_once()
    assert seen[-1] == before and gc.get_threshold() == before
    monkeypatch.setenv("DYNAMO_DIST_FULL_GC", "yes")
    with pytest.raises(Exception, match="DYNAMO_DIST_FULL_GC"):
        compile_once()
    assert gc.get_threshold() == before
