"""Run a Python-heavy loop at the bottom of a thread's own frame stack.

CPython 3.11+ keeps the frames of Python calls in a per-thread stack of 16 KiB chunks. When a
call needs a new chunk it is mmap'ed, and it is munmap'ed again as soon as that call returns
(``_PyThreadState_PopFrame``): there is no hysteresis. A loop whose small calls (a
comprehension, a closure) land exactly on a chunk boundary pays two system calls and a page
fault per call. Inside ``torch.compile`` the planner runs under a hundred or more frames of
Dynamo and AOTAutograd, so where that boundary falls depends on the caller's depth and on the
frame sizes of every function above: the sharding ILP's build of one Llama block took 1.6 s or
15 s depending on unrelated code (py-spy: the time was mmap and munmap under the build's
comprehensions; ``benchmarks/stack_depth.py`` measures it). A fresh thread's first chunk is
never freed, and a loop run at its bottom stays inside it.
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")


def on_fresh_stack(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` run in a new thread, the caller waiting for it: its result, or its
    exception re-raised here (same object, its traceback kept).

    Only for work that reads no thread-local state (torch's dispatch modes, grad mode, Dynamo's
    tracing context are per thread): the sharding ILP's build and solve, which read FX nodes,
    their ``meta`` and placements. Costs a thread start (about 0.1 ms)."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 -- handed to the caller, raised there
            box["error"] = err

    # daemon: an interrupted caller (Ctrl-C during join) does not keep the process alive
    worker = threading.Thread(target=run, name="dynamo_dist-fresh-stack", daemon=True)
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]
