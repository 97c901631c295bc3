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
