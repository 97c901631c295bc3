"""Each C++ kernel Inductor generates for us goes to g++ as soon as its source exists (issue 17:
cold compile time).

Inductor generates every kernel of a graph (its scheduler's codegen: single-threaded Python),
writes the graph's wrapper module and loads it; only then does each of the module's
``async_compile.cpp_pybinding(...)`` lines submit its g++ build to Inductor's compile threads,
and the loading thread waits for all of them. So g++ never runs while the codegen runs: on
this project's 2-core machine one core idles through every graph's codegen (2.5-4.5 s per
graph of the demo Llama). While ``dist`` compiles a graph (``submitting``), each C++ kernel
definition is evaluated the moment Inductor writes it into the wrapper: the same expression
the module will run (``async_compile.cpp_pybinding(argument types, source)``). Inductor's C++
cache keys a build by its source and flags and records it at submission
(``CppCodeCache.load_async``), so the module's line later finds the build under way or done:
nothing is built twice, and a build that fails raises where it did before (at the module's
load). Other backends' compiles are left as they are. ``DYNAMO_DIST_EARLY_KERNELS=0`` turns it
off.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Iterator

from inductor_passes.core import compat
from inductor_passes.core.switches import switch

log = logging.getLogger("dynamo_dist")
_CPP_KERNEL = "async_compile.cpp_pybinding("
_state = threading.local()


def enabled() -> bool:
    """``DYNAMO_DIST_EARLY_KERNELS`` is 1 (default) or 0. Raises ValueError for another value."""
    return switch("DYNAMO_DIST_EARLY_KERNELS", "C++ kernels go to g++ as they are generated",
                  "when the graph's module loads")


@contextlib.contextmanager
def submitting() -> Iterator[None]:
    """Inside, on this thread, C++ kernels are submitted as Inductor defines them (when the
    switch is on, Inductor compiles asynchronously and the patch is installed)."""
    on = enabled() and compat.inductor_compiles_async() and install()
    before = getattr(_state, "on", False)
    _state.on = on or before
    try:
        yield
    finally:
        _state.on = before


@contextlib.contextmanager
def loads_deferred() -> Iterator[None]:
    """Inside, a wrapper module Inductor loads on this thread (at the end of each graph's
    compile) does not wait there for its kernels' builds: the next graph's codegen (the
    backward's, after the forward's) runs while g++ finishes them. On leaving normally, each
    such module's builds are waited for, in load order, and its kernels bound in the module as
    Inductor binds them; a failed build raises there. Nothing may call a module compiled
    inside before then. Off with either switch (``DYNAMO_DIST_EARLY_KERNELS``,
    ``DYNAMO_DIST_DEFERRED_LOADS``) or where Inductor builds synchronously; ValueError for a
    bad switch value."""
    pending: list = []
    on = enabled() and switch("DYNAMO_DIST_DEFERRED_LOADS", "the next graph is generated while "
                              "g++ builds the last one's kernels", "each module waits for its "
                              "kernels when loaded") and \
        compat.inductor_compiles_async() and _install_wait()
    before = getattr(_state, "deferred", None)
    _state.deferred = pending if on else before
    try:
        yield
    finally:
        _state.deferred = before
    for waiter, scope in pending:
        compat.wait_for_kernels(waiter, scope)


def _install_wait() -> bool:
    """Wrap ``AsyncCompile.wait`` (idempotent): under ``loads_deferred``, it records the
    module's scope and runs with its futures left unresolved."""
    if not compat.can_leave_kernels_pending():
        return False
    cls = type(compat.async_compile())
    original = cls.wait
    if getattr(original, "_dynamo_dist_patch", False):
        return True

    @functools.wraps(original)
    def wait(self, scope, *args, **kwargs):
        pending = getattr(_state, "deferred", None)
        if pending is None:
            return original(self, scope, *args, **kwargs)
        pending.append((self, scope))
        with compat.kernels_left_pending(self):  # Inductor's own bookkeeping still runs
            return original(self, scope, *args, **kwargs)

    wait._dynamo_dist_patch = True
    cls.wait = wait
    return True


def install() -> bool:
    """Wrap Inductor's ``PythonWrapperCodegen.define_kernel`` (idempotent); False where torch
    has no such method."""
    cls = compat.python_wrapper_codegen()
    original = getattr(cls, "define_kernel", None)
    if original is None:
        return False
    if getattr(original, "_dynamo_dist_patch", False):
        return True

    @functools.wraps(original)
    def define_kernel(self, kernel_name, kernel_body, *args, **kwargs):
        out = original(self, kernel_name, kernel_body, *args, **kwargs)
        if getattr(_state, "on", False) and isinstance(kernel_body, str) and \
                kernel_body.startswith(_CPP_KERNEL):
            _submit(kernel_body)
        return out

    define_kernel._dynamo_dist_patch = True
    cls.define_kernel = define_kernel
    return True


def _submit(kernel_body: str) -> None:
    try:  # the module's own expression, with its own ``async_compile``
        eval(kernel_body, {"async_compile": compat.async_compile()})  # noqa: S307
    except Exception as exc:  # noqa: BLE001 (the module's load builds it, or reports)
        log.debug("dynamo_dist: early C++ kernel build not submitted: %s", exc)
