"""Inductor's probe of the CPU's vector instructions, run on a thread of its own while the
compile's Python runs (issue 17: cold compile time).

The first C++ kernel Inductor generates in a process asks which vector ISA the compiler and the
CPU support (``torch._inductor.cpu_vec_isa.pick_vec_isa``): about ten small g++ builds, each
loaded by a new Python process, one after another in the thread that compiles. On this
project's 2-core CPU machine that is about 8 s of g++ with an empty Inductor cache (every cold
compile: a new machine, a new cache directory), on the critical path, after the backend's own
single-threaded stages (Dynamo's trace, capture, planning, lowering) have left the other core
idle. ``start`` runs the probe on a daemon thread as soon as a ``dist`` compile for the CPU
begins: its time goes to g++ child processes, which do not hold the GIL, so the stages go on
at full speed, and Inductor finds the answer in its caches. ``wait`` joins the thread before
Inductor runs (the probe's caches are ``functools.cache``: two threads probing at once would
each build). Once per process; the answer is the one Inductor would compute (same code, same
configuration). ``DYNAMO_DIST_CPU_PROBE=0`` leaves the probe to Inductor.
"""

from __future__ import annotations

import logging
import threading

from inductor_passes.core import compat
from inductor_passes.core.switches import switch

log = logging.getLogger("dynamo_dist")
_lock = threading.Lock()
_thread: threading.Thread | None = None


def enabled() -> bool:
    """``DYNAMO_DIST_CPU_PROBE`` is 1 (default: probe early, on a thread) or 0 (Inductor probes
    when its first C++ kernel needs it). Raises ValueError for another value."""
    return switch("DYNAMO_DIST_CPU_PROBE", "probe the CPU on a thread while compiling",
                  "Inductor probes when its first kernel needs it")


def start() -> bool:
    """Start the probe on a daemon thread, once per process; True if this call started it.
    Raises ValueError for a bad ``DYNAMO_DIST_CPU_PROBE``."""
    global _thread
    if not enabled():
        return False
    with _lock:
        if _thread is not None:
            return False
        _thread = threading.Thread(target=_probe, name="dynamo_dist-cpu-probe", daemon=True)
        _thread.start()
    return True


def _probe() -> None:
    try:
        compat.pick_cpu_vec_isa()
    except Exception as exc:  # noqa: BLE001 (Inductor probes again itself and reports)
        log.debug("dynamo_dist: CPU vector-ISA probe failed on its thread: %s", exc)


def wait() -> None:
    """Return once a started probe has finished (at once if none was started)."""
    thread = _thread
    if thread is not None and thread is not threading.current_thread():
        thread.join()


def started() -> bool:
    """Whether this process has started the probe."""
    return _thread is not None
