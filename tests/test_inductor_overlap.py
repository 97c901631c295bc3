"""Inductor's CPU work started early while ``dist`` compiles: its probe of the CPU's vector
instructions on a thread from the frame's start (``inductor_passes.cpu_probe``: finished before
Inductor's first kernel, never for another backend or without Inductor), and each C++ kernel's
g++ build submitted as Inductor generates it (``inductor_passes.early_kernels``: before the
wrapper module loads, each built once)."""

import threading

import pytest
import torch

import dynamo_dist.backend as backend
from dynamo_dist.plans import TensorParallelPlanner, shard_module
from inductor_passes import compile as compile_mod
from inductor_passes import cpu_probe, early_kernels
from inductor_passes.core import compat

from conftest import SmallMLP


@pytest.fixture
def events(monkeypatch):
    """A fresh probe state; the probe, our capture and Inductor's entry write what happened, in
    order, to the returned list (the probe's own work: a sleep, so it is seen to overlap)."""
    seen: list[tuple] = []
    inductor_called = threading.Event()
    monkeypatch.setattr(cpu_probe, "_thread", None)
    real_start, real_capture, real_inner = cpu_probe.start, backend.trace_joint, \
        compat.compile_fx_inner

    def probe():
        seen.append(("probe", threading.current_thread().name))
        # busy until Inductor is called (a missing wait) or 2 s have passed
        inductor_called.wait(timeout=2.0)
        seen.append(("probed",))

    def start():
        started = real_start()
        seen.append(("start", started))
        return started

    def capture(*args, **kwargs):
        seen.append(("capture",))
        return real_capture(*args, **kwargs)

    def inner(*args, **kwargs):
        seen.append(("inductor",))
        inductor_called.set()
        return real_inner(*args, **kwargs)

    monkeypatch.setattr(compat, "pick_cpu_vec_isa", probe)
    monkeypatch.setattr(cpu_probe, "start", start)
    monkeypatch.setattr(backend, "trace_joint", capture)
    monkeypatch.setattr(compat, "compile_fx_inner", inner)
    yield seen
    cpu_probe.wait()
    torch._dynamo.reset()


def _names(seen):
    return [e[0] for e in seen]


def _step(mesh, options=None):
    torch.manual_seed(0)
    model, ref = SmallMLP(), SmallMLP()
    ref.load_state_dict(model.state_dict())
    shard_module(model, mesh, TensorParallelPlanner(axis="tp").build_plan(model))
    compiled = torch.compile(model, backend="dist", options=options)
    x = torch.randn(4, 16)
    loss = compiled(x)
    loss.backward()
    ref_loss = ref(x)
    ref_loss.backward()
    torch.testing.assert_close(loss.full_tensor() if hasattr(loss, "full_tensor") else loss,
                               ref_loss)
    grad = model.fc1.weight.grad
    torch.testing.assert_close(grad.full_tensor() if hasattr(grad, "full_tensor") else grad,
                               ref.fc1.weight.grad)


def test_probe_starts_with_the_frame_and_ends_before_inductor(events, mesh_of_one):
    _step(mesh_of_one(("tp",)))
    names = _names(events)
    # started by the frame's compile (before our capture), once: the backend's start finds it
    assert events[names.index("start")] == ("start", True), events
    assert names.index("start") < names.index("capture"), events
    assert [e for e in events if e[0] == "start"][1:] == [("start", False)], events
    # on its own thread, and over before Inductor's first compile
    assert ("probe", "dynamo_dist-cpu-probe") in events, events
    assert names.index("probed") < names.index("inductor"), events
    assert names.count("probe") == 1


def test_no_probe_for_another_backend_or_without_inductor(events, mesh_of_one):
    f = torch.compile(lambda t: torch.sin(t) * 2, backend="eager")
    x = torch.randn(8)
    torch.testing.assert_close(f(x), torch.sin(x) * 2)
    assert not cpu_probe.started() and "start" not in _names(events), events
    _step(mesh_of_one(("tp",)), options={"inductor": False})
    assert not cpu_probe.started() and "probe" not in _names(events), events


def test_a_failed_probe_leaves_it_to_inductor(events, mesh_of_one, monkeypatch):
    def broken():
        events.append(("probe", threading.current_thread().name))
        raise RuntimeError("no compiler")

    monkeypatch.setattr(compat, "pick_cpu_vec_isa", broken)
    _step(mesh_of_one(("tp",)))  # Inductor's own probe answers: numbers at parity
    assert "probe" in _names(events) and "inductor" in _names(events), events


def test_the_switch(monkeypatch):
    monkeypatch.setattr(cpu_probe, "_thread", None)
    monkeypatch.setenv("DYNAMO_DIST_CPU_PROBE", "0")
    assert not cpu_probe.start() and not cpu_probe.started()
    monkeypatch.setenv("DYNAMO_DIST_CPU_PROBE", "yes")
    with pytest.raises(ValueError, match="DYNAMO_DIST_CPU_PROBE"):
        cpu_probe.start()


def test_the_probe_is_inductors_own():
    from torch._inductor import cpu_vec_isa

    assert compat.pick_cpu_vec_isa() == cpu_vec_isa.pick_vec_isa()
    assert compile_mod.cpu_probe is cpu_probe  # the module Inductor's entry waits on


@pytest.fixture
def builds(monkeypatch):
    """Each g++ build of a C++ kernel in a fresh Inductor cache, in order, with the loads of
    wrapper modules between them: ("build", target) and ("module",)."""
    from torch._inductor import codecache, cpp_builder
    from torch._inductor.utils import fresh_cache

    seen: list[tuple] = []
    real_build, real_load = cpp_builder.CppBuilder.build, codecache.PyCodeCache.load_by_key_path

    def build(self, *args, **kwargs):
        seen.append(("build", self.get_target_file_path()))
        return real_build(self, *args, **kwargs)

    def load(*args, **kwargs):
        seen.append(("module",))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(cpp_builder.CppBuilder, "build", build)
    monkeypatch.setattr(codecache.PyCodeCache, "load_by_key_path", load)
    with fresh_cache():
        yield seen
    torch._dynamo.reset()


def _kernel_builds(seen):
    # a kernel's library (the vector-ISA probe's and the header's builds are not kernels)
    return [e[1] for e in seen if e[0] == "build" and e[1].endswith(".main.so")]


def test_kernels_go_to_gpp_before_the_module_loads(builds, mesh_of_one, monkeypatch):
    from torch._inductor.codecache import CppPythonBindingsCodeCache as built

    submitted, recorded = [], []
    real = early_kernels._submit

    def submit(body):
        submitted.append(len(builds))
        before = len(built.cache)
        real(body)
        recorded.append(len(built.cache) - before)  # Inductor's cache holds the build now

    monkeypatch.setattr(early_kernels, "_submit", submit)
    _step(mesh_of_one(("tp",)))  # parity with one device
    assert submitted, "no C++ kernel was submitted while Inductor generated code"
    assert sum(recorded) >= 1, recorded
    targets = _kernel_builds(builds)
    # each kernel built once, from the source the module later names (a different text would
    # be a second build: more builds than kernels submitted)
    assert targets and len(targets) == len(set(targets)) <= len(submitted), (targets, submitted)
    # the first submission precedes the first wrapper module's load
    assert submitted[0] <= builds.index(("module",)), (submitted, builds)


def test_no_early_kernels_for_another_backend_or_when_off(builds, monkeypatch):
    submitted = []
    monkeypatch.setattr(early_kernels, "_submit", lambda body: submitted.append(body))
    f = torch.compile(lambda t: (torch.sin(t) * 2).sum(1), backend="inductor")
    x = torch.randn(8, 8)
    torch.testing.assert_close(f(x), (torch.sin(x) * 2).sum(1))
    assert not submitted
    monkeypatch.setenv("DYNAMO_DIST_EARLY_KERNELS", "0")
    with early_kernels.submitting():
        assert not getattr(early_kernels._state, "on", False)
    with early_kernels.loads_deferred():
        assert getattr(early_kernels._state, "deferred", None) is None
    monkeypatch.setenv("DYNAMO_DIST_EARLY_KERNELS", "1")
    monkeypatch.setenv("DYNAMO_DIST_DEFERRED_LOADS", "0")
    with early_kernels.loads_deferred():
        assert getattr(early_kernels._state, "deferred", None) is None
    monkeypatch.setenv("DYNAMO_DIST_EARLY_KERNELS", "later")
    with pytest.raises(ValueError, match="DYNAMO_DIST_EARLY_KERNELS"):
        with early_kernels.submitting():
            pass


def test_the_forwards_kernels_are_built_while_the_backward_is_generated(mesh_of_one,
                                                                        monkeypatch):
    """Under ``loads_deferred`` the forward's module is loaded without waiting for its builds;
    both halves are generated first, then each module's kernels are bound (and the step runs at
    parity with them)."""
    seen: list[tuple] = []
    real_inner, real_wait = compat.compile_fx_inner, compat.wait_for_kernels

    def inner(*args, **kwargs):
        seen.append(("inductor",))
        return real_inner(*args, **kwargs)

    def wait(waiter, scope):
        pending = sum(1 for v in scope.values() if hasattr(v, "result"))
        seen.append(("bound", pending))
        real_wait(waiter, scope)
        assert not any(hasattr(v, "result") for v in scope.values()), "a kernel left unbound"

    monkeypatch.setattr(compat, "compile_fx_inner", inner)
    monkeypatch.setattr(compat, "wait_for_kernels", wait)
    with torch._inductor.utils.fresh_cache():
        _step(mesh_of_one(("tp",)))
    names = _names(seen)
    assert names[:2] == ["inductor", "inductor"] and "bound" in names[2:], seen
    assert sum(e[1] for e in seen if e[0] == "bound") >= 1, seen  # something was still pending
    torch._dynamo.reset()


def test_which_compiles_probe():
    """Inductor on and not simulated, and a program on the CPU (before Dynamo has made the
    inputs: a machine with no CUDA device)."""
    from dynamo_dist.patches import will_compile_cpu_kernels as will

    assert will({}, {"cpu"}) and will({"inductor": True}, {"cpu"})
    assert not will({"inductor": False}, {"cpu"}) and not will({"simulate": True}, {"cpu"})
    assert not will({}, {"cuda"}) and not will({}, {"cpu", "cuda"}) and not will({}, set())
    assert will({}) == (not torch.cuda.is_available())
