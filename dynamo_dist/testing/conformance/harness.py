"""OpInfo conformance: every op of torch's OpInfo database, compiled with ``backend="dist"``
under several input placements, run on simulated ranks, checked against one device.

For one (op, sample, placements) case:
  1. reference: the op on plain tensors (GLOBAL values), and its input gradients for a fixed
     random cotangent;
  2. ours: DTensor inputs with those placements on a ``fake`` process group mesh, compiled with
     ``torch.compile(backend="dist")`` (Dynamo, capture, plan, lowering); the compiled program is
     then run on every rank in lock step (``simulate.run_spmd``) with real values;
  3. DTensor eager, the peer: the same inputs and op under ``LocalTensorMode``.

Each case is classified (``Outcome``): pass, fallback (correct, but some node ran replicated),
error (a DistCompileError: a clear message), wrong (a value differs from the reference), crash
(any other exception), break (Dynamo did not hand the backend exactly one graph).
"""

from __future__ import annotations

import dataclasses
import re
import traceback
from typing import Any, Iterator, Sequence

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from dynamo_dist import clear_compile_records, compile_records
from dynamo_dist.backend import dist_backend
from inductor_passes.core import compat
from inductor_passes.core.errors import DistCompileError
from inductor_passes.core.placements import fmt, parse
from inductor_passes.redistribute import local_coordinate
from inductor_passes.sharding.rules import RuleKind

from .simulate import ReplicaMismatch, coordinates, run_spmd, shard_global

OUTCOMES = ("pass", "fallback", "error", "wrong", "crash", "break")
RTOL, ATOL = 1e-4, 1e-4


@dataclasses.dataclass
class Case:
    op: str
    sample: int
    mesh: tuple[int, ...]
    placements: tuple[tuple[Placement, ...], ...]   # one per tensor input
    shapes: tuple[tuple[int, ...], ...]             # GLOBAL
    ours: str = ""
    ours_grad: str = ""          # "" when the op has no differentiable output
    dtensor: str = ""
    detail: str = ""

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["placements"] = [fmt(p) for p in self.placements]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Case":
        d = dict(d)
        d["placements"] = tuple(parse(p) for p in d["placements"])
        d["mesh"], d["shapes"] = tuple(d["mesh"]), tuple(tuple(s) for s in d["shapes"])
        return cls(**d)

    @property
    def sharded(self) -> bool:
        return any(not isinstance(p, Replicate) for pls in self.placements for p in pls)


def _flat_tensors(sample) -> tuple[list[torch.Tensor], Any]:
    """The sample's tensors (input, args, kwargs) and a function rebuilding the call."""
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def rebuild(tensors):
        out = list(leaves)
        for i, t in zip(idx, tensors):
            out[i] = t
        return pytree.tree_unflatten(out, spec)

    return [leaves[i] for i in idx], rebuild


def placement_options(shapes: Sequence[tuple[int, ...]], dtypes, mesh_shape: Sequence[int],
                      max_cases: int = 12) -> list[tuple[tuple[Placement, ...], ...]]:
    """Input placement sets: one input at a time Shard(d) / Partial (others Replicate), on a 2-D
    mesh also [Shard(0), Shard(last)] and [Shard(0), Shard(0)] (dim 0 split by both mesh axes,
    nested), and every input on the same Shard(d) where all have dim d. Uneven splits are
    included on purpose."""
    nd = len(mesh_shape)
    rep = tuple(Replicate() for _ in range(nd))
    out: list[tuple[tuple[Placement, ...], ...]] = []

    def add(per_input):
        if per_input not in out:
            out.append(per_input)

    for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        for d in range(len(shape)):
            pl = (Shard(d),) + rep[1:] if nd == 1 else (Shard(d), Replicate())
            add(tuple(pl if k == i else rep for k in range(len(shapes))))
            if nd == 2:
                last = len(shape) - 1
                two = (Shard(0), Shard(last)) if last != 0 else (Shard(0), Replicate())
                add(tuple(two if k == i else rep for k in range(len(shapes))))
                if d == 0:  # both mesh axes on one dim, nested (issue 14)
                    add(tuple((Shard(0), Shard(0)) if k == i else rep
                              for k in range(len(shapes))))
        if dtype.is_floating_point:
            add(tuple((Partial(),) + rep[1:] if k == i else rep for k in range(len(shapes))))
    ndims = {len(s) for s in shapes}
    if len(shapes) > 1 and len(ndims) == 1 and 0 not in ndims:
        for d in range(ndims.pop()):
            add(tuple(((Shard(d),) + rep[1:]) for _ in shapes))
    return out[:max_cases]


def _as_dtensor(x: torch.Tensor, mesh, pls) -> torch.Tensor:
    coord = local_coordinate(mesh)  # DTensor's piece index (group rank), as lowering uses
    local = shard_global(x.detach(), pls, coord, tuple(mesh.shape))
    dt = DTensor.from_local(local, mesh, pls, run_check=False, shape=x.shape, stride=x.stride())
    return dt.detach().requires_grad_(x.requires_grad)


def _unwrap_error(exc: BaseException) -> BaseException:
    seen = exc
    while seen is not None:
        if isinstance(seen, DistCompileError):
            return seen
        seen = getattr(seen, "inner_exception", None) or seen.__cause__ or seen.__context__
    return exc


UNDEFINED_VALUES = ("empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided",
                    "empty_permuted")


def _close(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        return torch.allclose(a, b, rtol=RTOL, atol=ATOL, equal_nan=True)
    return a == b or (a is None and b is None)


def run_ours(op_fn, tensors: list[torch.Tensor], placements, mesh,
             op_name: str = "") -> tuple[str, str, str]:
    """(forward outcome, backward outcome or "", detail) for one case."""
    grad_inputs = [k for k, t in enumerate(tensors) if t.requires_grad]
    before = [t.detach().clone() for t in tensors]  # the reference may update inputs in place
    ref_out = op_fn(*tensors)
    ref_flat = [o for o in pytree.tree_leaves(ref_out)]
    diff = [i for i, o in enumerate(ref_flat) if isinstance(o, torch.Tensor) and o.requires_grad]
    gen = torch.Generator().manual_seed(0)
    cot = {i: torch.randn(ref_flat[i].shape, generator=gen, dtype=ref_flat[i].dtype) for i in diff}
    ref_grads = None
    if diff and grad_inputs:
        ref_grads = torch.autograd.grad([ref_flat[i] for i in diff],
                                        [tensors[k] for k in grad_inputs],
                                        [cot[i] for i in diff], allow_unused=True)

    torch._dynamo.reset()
    clear_compile_records()
    inputs = [_as_dtensor(b.requires_grad_(t.requires_grad), mesh, pls)
              for b, t, pls in zip(before, tensors, placements)]
    names = [f"a{k}" for k in range(len(inputs))]
    fn = _positional(getattr(op_fn, "traceable", op_fn), names)

    implicit = compat.implicit_replication_enabled()
    try:
        # plain tensors are global values in our semantics (shard_module turns this on; here,
        # for the compile only, so the DTensor peer below runs as stock DTensor)
        compat.allow_implicit_replication(True)
        torch.compile(fn, backend=_compile_only, fullgraph=True)(*inputs)
    except _Compiled:
        pass
    except Exception as exc:  # noqa: BLE001  (classified, not hidden)
        err = _unwrap_error(exc)
        if isinstance(err, DistCompileError):
            return "error", "", str(err).splitlines()[0][:200]
        stock = _stock_dynamo_fails(fn, before)
        if isinstance(err, torch._dynamo.exc.Unsupported) or "graph break" in str(exc).lower():
            return "break", "", ("stock Dynamo fails too: " if stock else "ours only: ") + \
                _short(exc)
        if stock:
            return "break", "", "stock Dynamo (backend='eager', plain tensors) fails too: " + \
                _short(exc)
        return "crash", "", _short(exc)
    finally:
        compat.allow_implicit_replication(implicit)
    records = compile_records()
    if len(records) != 1:
        return "break", "", f"{len(records)} graphs reached the backend"
    record = records[0]
    # graph input i <- our tensor k (Dynamo names inputs after the argument: L_a3_)
    order = []
    for info in record.program.primal_inputs:
        m = re.search(r"a(\d+)", info.name)
        order.append(int(m.group(1)) if m else -1)
    if -1 in order:
        return "crash", "", "cannot map graph inputs to arguments: " + \
            ", ".join(i.name for i in record.program.primal_inputs)
    if ref_grads is not None and set(record.program.diff_outputs) != set(diff):
        # Dynamo rebuilt an output outside the graph (a view of an input: x.T, x.mT): the
        # graph's outputs are not the op's, so there is nothing of ours to compare
        return "break", "", (f"graph outputs are not the op's (differentiable outputs "
                             f"{record.program.diff_outputs} vs {diff}): Dynamo rebuilt a view")
    tangents = [cot[j] for j in record.program.diff_outputs]
    try:
        torch.manual_seed(42)  # as wrapper_set_seed does for the seeded references
        outs, grads = run_spmd(record, [before[k].detach() for k in order],
                               tangents if ref_grads is not None else None, mesh)
    except ReplicaMismatch as exc:
        if op_name in UNDEFINED_VALUES:  # replicas of uninitialised memory differ, rightly
            return ("fallback" if record.plan.fallbacks else "pass"), "", "values undefined"
        return "wrong", "", str(exc)
    except Exception as exc:  # noqa: BLE001
        err = _unwrap_error(exc)
        if isinstance(err, DistCompileError):
            return "error", "", str(err).splitlines()[0][:200]
        return "crash", "", _short(exc)
    # inputs the program updated in place: their new values follow the user's outputs
    n_mut = len(record.program.mutated_inputs)
    outs, written = outs[:len(outs) - n_mut], outs[len(outs) - n_mut:]
    want_written = [tensors[order[k]].detach() for k in record.program.mutated_inputs]
    if any(n.kind is RuleKind.RANDOM for n in record.plan.nodes.values()):  # seeded draws
        # Random draws are decomposed (exponential_ -> uniform + log), so eager's numbers are not
        # the compiled program's. Reference: the same global program on one device, same seed.
        ref_flat, want_written, ref_grads = _one_device(
            record, [before[k].detach() for k in order], tangents, order, grad_inputs)
    mut_ok = all(_close(v, w) for v, w in zip(written, want_written))
    if op_name in UNDEFINED_VALUES:  # uninitialised memory: only metadata is defined
        outs = [o.new_zeros(o.shape) if isinstance(o, torch.Tensor) else o for o in outs]
        ref_flat = [r.detach().new_zeros(r.shape) if isinstance(r, torch.Tensor) else r
                    for r in ref_flat]
    fwd_ok = mut_ok and len(outs) == len(ref_flat) and all(_close(o, r.detach() if isinstance(r, torch.Tensor)
                                                       else r) for o, r in zip(outs, ref_flat))
    good = "fallback" if record.plan.fallbacks else "pass"
    fwd = good if fwd_ok else "wrong"
    bwd = ""
    if ref_grads is not None:
        got = {order[i]: g for i, g in enumerate(grads)}
        bwd_ok = all(_close(got.get(k), g) if g is not None else got.get(k) is None or
                     bool(torch.all(got[k] == 0)) for k, g in zip(grad_inputs, ref_grads))
        bwd = good if bwd_ok else "wrong"
    detail = "" if fwd_ok else _diff(outs, ref_flat)
    if record.plan.fallbacks:
        detail = detail or record.plan.fallbacks[0][:200]
    return fwd, bwd, detail


def _stock_dynamo_fails(fn, tensors) -> bool:
    """Dynamo itself cannot trace ``fn`` into one graph (data-dependent Python control flow such
    as gaussian_nll_loss's ``if torch.any(var < 0)``): not a failure of ours."""
    torch._dynamo.reset()
    try:
        torch.compile(fn, backend="eager", fullgraph=True)(*[t.detach().clone() for t in tensors])
    except Exception:  # noqa: BLE001
        return True
    finally:
        torch._dynamo.reset()
    return False


def _one_device(record, args, tangents, order, grad_inputs):
    """(user outputs, new values of updated inputs, input gradients) of the compiled global
    program run on one device, seeded as the simulated ranks were."""
    program = record.program
    # decomposed as lowering decomposes the local graphs (a fused random op and its
    # decomposition draw different numbers)
    with torch.no_grad():
        one = compat.make_fx(lambda *a: torch.fx.Interpreter(program.graph_module).run(*a),
                              decomposition_table=compat.select_decomp_table(),
                              tracing_mode="fake")(*args, *tangents)
        torch.manual_seed(42)
        res = one(*args, *tangents)
    n_user = program.num_fwd_outputs - len(program.mutated_inputs)
    grads_by_arg = {order[i]: g for i, g in enumerate(res[program.num_fwd_outputs:])}
    grads = [grads_by_arg.get(k) for k in grad_inputs] if tangents else None
    return list(res[:n_user]), list(res[n_user:program.num_fwd_outputs]), grads


class _Compiled(Exception):
    """Raised instead of running the compiled program: the fake process group moves no data,
    so its values would be garbage (simulate.run_spmd runs it for real)."""


def _compile_only(gm, example_inputs):
    dist_backend(gm, example_inputs, {"inductor": False})

    def stop(*args):
        raise _Compiled()

    return stop


_compile_only._dynamo_dist_backend = True  # Dynamo traces it as the dist backend (see compat)


def _positional(op_fn, names: Sequence[str]):
    """A function of named positional tensors (``a0, a1, ...``) calling ``op_fn``: Dynamo names
    graph inputs after them, which maps each graph input back to its tensor."""
    src = f"def f({', '.join(names)}):\n    return op_fn([{', '.join(names)}])\n"
    scope: dict[str, Any] = {"op_fn": lambda ts: op_fn(*ts)}
    exec(src, scope)  # noqa: S102  (a fixed template, no user input)
    return scope["f"]


def run_dtensor(op_fn, tensors: list[torch.Tensor], placements, mesh) -> str:
    """DTensor eager under LocalTensorMode: pass / wrong / crash (its errors count as crash)."""
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode

    n = mesh.size()
    ref_in = [t.detach().clone() for t in tensors]
    ref = [o.detach() if isinstance(o, torch.Tensor) else o
           for o in pytree.tree_leaves(op_fn(*ref_in))] + ref_in  # inputs: in-place updates
    try:
        with LocalTensorMode(n):
            inputs = []
            for t, pls in zip(tensors, placements):
                shards = {r: shard_global(t.detach(), pls, c, tuple(mesh.shape))
                          for r, c in enumerate(coordinates(tuple(mesh.shape)))}
                inputs.append(DTensor.from_local(LocalTensor(shards), mesh, pls, run_check=False,
                                                 shape=t.shape, stride=t.stride()))
            out = [o.full_tensor() if isinstance(o, DTensor) else o
                   for o in pytree.tree_leaves(op_fn(*inputs)) + inputs]
            out = [_rank0(o) for o in out]
    except Exception as exc:  # noqa: BLE001
        return "crash: " + _short(exc)
    ok = len(out) == len(ref) and all(_close(o, r) for o, r in zip(out, ref))
    return "pass" if ok else "wrong"


def _rank0(x):
    from torch.distributed._local_tensor import LocalTensor

    if isinstance(x, LocalTensor):
        return x._local_tensors[0]
    return x


def _diff(outs, refs) -> str:
    for k, (o, r) in enumerate(zip(outs, refs)):
        if isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor):
            if o.shape != r.shape:
                return f"output {k}: shape {tuple(o.shape)} vs {tuple(r.shape)}"
            return f"output {k}: max abs diff {(o.float() - r.float()).abs().max().item():.3g}"
    return "outputs differ"


def _short(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    head = lines[0] if lines else type(exc).__name__
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" @ {frame.filename.split('/')[-1]}:{frame.lineno}" if frame else ""
    return f"{type(exc).__name__}: {head[:160]}{where}"


def _traceable_op(opinfo):
    """The torch function behind an OpInfo whose ``op`` is a lambda in torch.testing around
    ``wrapper_set_seed`` (dropout, SDPA, in-place random ops): Dynamo skips that file, so the
    harness compiles the function itself and seeds like the wrapper (42). None otherwise."""
    code = getattr(opinfo.op, "__code__", None)
    if code is None or "torch/testing" not in code.co_filename.replace("\\", "/") or \
            "wrapper_set_seed" not in code.co_names:
        return None
    if "in_place" in opinfo.variant_test_name or "inplace" in opinfo.variant_test_name:
        return getattr(torch.Tensor, opinfo.name + "_", None)
    for root in (torch, torch.Tensor):
        obj = root
        for part in opinfo.name.split("."):
            obj = getattr(obj, part, None)
        if callable(obj):
            return obj
    return getattr(torch.Tensor, opinfo.name + "_", None)


def cases_for(opinfo, mesh, max_samples: int, max_cases: int) -> Iterator[tuple[Case, Any, list]]:
    """(Case, op function, global input tensors) for the first samples of ``opinfo``."""
    samples = opinfo.sample_inputs("cpu", torch.float32, requires_grad=opinfo.supports_autograd)
    for s_idx, sample in enumerate(samples):
        if s_idx >= max_samples:
            break
        tensors, rebuild = _flat_tensors(sample)
        if not tensors or any(t.numel() == 0 for t in tensors):
            continue

        def op_fn(*ts, rebuild=rebuild):
            inp, args, kwargs = rebuild(list(ts))
            return opinfo.op(inp, *args, **kwargs)

        direct = _traceable_op(opinfo)
        if direct is not None:
            def traced(*ts, rebuild=rebuild, direct=direct):
                inp, args, kwargs = rebuild(list(ts))
                return direct(inp, *args, **kwargs)

            op_fn.traceable = traced  # compiled instead of the seeded wrapper (same seed: 42)

        shapes = tuple(tuple(t.shape) for t in tensors)
        for pls in placement_options(shapes, [t.dtype for t in tensors], tuple(mesh.shape),
                                     max_cases):
            yield Case(_name(opinfo), s_idx, tuple(mesh.shape), pls, shapes), op_fn, tensors


def _name(opinfo) -> str:
    return opinfo.name + (f".{opinfo.variant_test_name}" if opinfo.variant_test_name else "")


def inplace_cases_for(opinfo, mesh, max_samples: int,
                      max_cases: int) -> Iterator[tuple[Case, Any, list]]:
    """Cases of ``opinfo.inplace_variant`` (``x.add_(y)``), named ``<op>.inplace``: compiled
    through functionalisation, the updated input is written back and compared with the one
    device's. Inputs do not require grad (an in-place update of a leaf that does is an error)."""
    variant = opinfo.inplace_variant
    if variant is None or _traceable_op(opinfo) is not None:
        return
    samples = opinfo.sample_inputs("cpu", torch.float32, requires_grad=False)
    for s_idx, sample in enumerate(samples):
        if s_idx >= max_samples:
            break
        tensors, rebuild = _flat_tensors(sample)
        if not tensors or any(t.numel() == 0 for t in tensors) or \
                not isinstance(sample.input, torch.Tensor):
            continue

        def op_fn(*ts, rebuild=rebuild):
            inp, args, kwargs = rebuild(list(ts))
            variant(inp, *args, **kwargs)
            return ()  # the result is its input: compared as the updated input

        shapes = tuple(tuple(t.shape) for t in tensors)
        for pls in placement_options(shapes, [t.dtype for t in tensors], tuple(mesh.shape),
                                     max_cases):
            yield Case(_name(opinfo) + ".inplace", s_idx, tuple(mesh.shape), pls, shapes), \
                op_fn, tensors


def run_case(case: Case, op_fn, tensors, mesh, with_dtensor: bool = True) -> Case:
    def fresh():  # the reference may update its inputs in place
        return [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]

    ts = fresh()
    try:
        case.ours, case.ours_grad, case.detail = run_ours(op_fn, ts, case.placements, mesh,
                                                          case.op.split(".")[0])
    except Exception as exc:  # noqa: BLE001  (the reference itself failed: not our case)
        case.ours, case.detail = "skip", _short(exc)
    if with_dtensor and case.ours != "skip":
        case.dtensor = run_dtensor(op_fn, fresh(), case.placements, mesh)
    return case
