"""Indexing, scatter and grouped-GEMM rules (rules/indexing.py, rules/grouped_mm.py).

Two kinds of checks: what a rule offers (and refuses) on small traced graphs, and a property
test that EVERY OpSpec a rule offers computes the global result: each simulated rank runs the op
on its local pieces (Shard pieces, Partial shares), and the pieces put back together under the
OpSpec's output placements must equal the op on the global values.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from dynamo_dist.testing.conformance.simulate import shard_global, unshard
from inductor_passes.core.placements import is_placements
from inductor_passes.sharding import rules

aten = torch.ops.aten
P, R = Partial("sum"), Replicate()


def _graph(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def _node(gm, target):
    return next(n for n in gm.graph.nodes if n.target == target)


def _specs(node, mesh_shape=(2,), mesh=None):
    rep = [(R,) * len(mesh_shape) for _ in rules.tensor_args(node)]
    return rules.op_strategy(node, rep, mesh, mesh_shape, lambda n: None)


def _pairs(node, mesh_shape=(2,)):
    return {(s.inputs, s.output) for s in _specs(node, mesh_shape)}


# ---------------------------------------------------------------------------------------------
# What the rules offer
# ---------------------------------------------------------------------------------------------
def test_index_put_accumulate_splits_the_updates_and_overwrite_does_not():
    """x.index_put([i], v, accumulate) with i: [5], v: [5, 6] into x: [8, 6]. Adding: each rank
    adds its share of the rows (Partial destination); overwriting: no split of the index."""
    x, i, v = torch.randn(8, 6), torch.randint(0, 8, (5,)), torch.randn(5, 6)
    for acc in (True, False):
        node = _node(_graph(lambda x, i, v: aten.index_put(x, [i], v, acc), x, i, v),
                     aten.index_put.default)
        pairs = _pairs(node)
        split_updates = (((P,), (Shard(0),), (Shard(0),)), (P,))
        assert (split_updates in pairs) == acc
        assert (((Shard(1),), (R,), (Shard(1),)), (Shard(1),)) in pairs  # columns
        assert (((P,), (R,), (P,)), (P,)) in pairs                          # linear
        assert not any(ins[0] == (Shard(0),) for ins, _ in pairs)         # the indexed dim


def test_gather_and_scatter_add_split_only_dims_of_one_size():
    """gather(x [6, 8], 0, idx [6, 3]): dim 1 has 8 columns in x, 3 in idx: splitting both on
    it would pair columns 0..3 of x with 0..1 of idx (DTensor's rule offers it). idx alone may
    split on the gathered dim 0 (its values say which row), not on dim 1 (an element reads its
    own column, which a local piece would shift)."""
    x, idx = torch.randn(6, 8), torch.randint(0, 6, (6, 3))
    pairs = _pairs(_node(_graph(lambda x, i: torch.gather(x, 0, i), x, idx), aten.gather.default))
    assert (((Shard(1),), (Shard(1),)), (Shard(1),)) not in pairs
    assert (((R,), (Shard(0),)), (Shard(0),)) in pairs  # along dim: index values say where
    assert (((R,), (Shard(1),)), (Shard(1),)) not in pairs  # off dim: position is implicit
    src = torch.randn(6, 8)  # scatter_add reads src[:, :3] only: src's columns do not line up
    node = _node(_graph(lambda x, i, s: x.scatter_add(0, i, s), torch.randn(6, 3), idx, src),
                 aten.scatter_add.default)
    pairs = _pairs(node)
    assert not any(ins[2] == (Shard(1),) for ins, _ in pairs)
    assert (((P,), (Shard(0),), (Shard(0),)), (P,)) in pairs  # each rank adds its rows


def test_histc_counts_are_partial_only_for_a_fixed_range():
    x = torch.randn(8, 4)
    fixed = _node(_graph(lambda x: torch.histc(x, 5, -1.0, 1.0), x), aten.histc.default)
    assert (((Shard(0),),), (P,)) in _pairs(fixed)
    data_range = _node(_graph(lambda x: torch.histc(x, 5), x), aten.histc.default)
    assert all(out == (R,) for _, out in _pairs(data_range))


def test_grouped_mm_splits_columns_and_contraction_never_grouped_rows():
    """Transformers' grouped_mm_fallback(x [M, K], w [G, K, N], offs): N (column parallel) and K
    (a pending sum) split; M does not (offs names global rows), nor G."""
    pytest.importorskip("transformers.integrations.moe")
    op = torch.ops.transformers.grouped_mm_fallback.default
    x, w = torch.randn(10, 8), torch.randn(3, 8, 6)
    offs = torch.tensor([3, 3, 10], dtype=torch.int32)
    pairs = _pairs(_node(_graph(lambda x, w, o: op(x, w, o), x, w, offs), op))
    assert (((R,), (Shard(2),), (R,)), (Shard(1),)) in pairs
    assert (((Shard(1),), (Shard(1),), (R,)), (P,)) in pairs
    assert not any(ins[0] == (Shard(0),) or ins[1] == (Shard(0),) for ins, _ in pairs)


# ---------------------------------------------------------------------------------------------
# Property: every OpSpec offered computes the global result
# ---------------------------------------------------------------------------------------------
def _cases(n: int = 6, m: int = 4, k: int = 5, seed: int = 0):
    """(name, fn, example args) of the ops these rules plan, with sizes n, m, k (uneven over
    some meshes on purpose); indices in range, some repeated."""
    g = torch.Generator().manual_seed(seed)

    def ri(hi, *shape):
        return torch.randint(0, hi, shape, generator=g)

    def rn(*shape):
        return torch.randn(*shape, generator=g)

    def rb(*shape):
        return torch.rand(*shape, generator=g) > 0.3

    def perm_rows(rows, cols, hi):  # distinct indices per row (an overwrite order is undefined)
        return torch.stack([torch.randperm(hi, generator=g)[:cols] for _ in range(rows)])

    k1 = min(k, n)
    cases = [
        ("index_put_acc", lambda x, i, v: aten.index_put(x, [i], v, True), (rn(n, m), ri(n, k), rn(k, m))),
        ("index_put_acc2", lambda x, i, j, v: aten.index_put(x, [i, j], v, True),
         (rn(n, m, 3), ri(n, k, 1), ri(m, 2), rn(k, 2, 3))),
        ("index_put_none", lambda x, i, v: aten.index_put(x, [None, i], v, True),
         (rn(m, n, 3), ri(n, k), rn(m, k, 3))),
        ("index_put", lambda x, i, v: aten.index_put(x, [i], v),
         (rn(n, m), torch.randperm(n, generator=g)[:k1], rn(k1, m))),
        ("index_put_bcast", lambda x, i, v: aten.index_put(x, [i], v, True), (rn(n, m), ri(n, k), rn(m))),
        ("scatter_add", lambda x, i, s: x.scatter_add(0, i, s), (rn(n, m), ri(n, k, m), rn(k, m))),
        ("scatter_add_short", lambda x, i, s: x.scatter_add(1, i, s), (rn(k, n), ri(n, k, 3), rn(k, 4))),
        ("scatter_src", lambda x, i, s: x.scatter(1, i, s), (rn(k, n), perm_rows(k, min(3, n), n), rn(k, 4))),
        ("scatter_value", lambda x, i: x.scatter(0, i, 2.5), (rn(n, m), ri(n, 3, m))),
        ("scatter_sum", lambda x, i, s: x.scatter_reduce(0, i, s, "sum"), (rn(n, m), ri(n, k, m), rn(k, m))),
        ("scatter_sum_excl", lambda x, i, s: x.scatter_reduce(0, i, s, "sum", include_self=False),
         (rn(n, m), ri(n, k, m), rn(k, m))),
        ("scatter_mean", lambda x, i, s: x.scatter_reduce(0, i, s, "mean"), (rn(n, m), ri(n, k, m), rn(k, m))),
        ("scatter_amax", lambda x, i, s: x.scatter_reduce(0, i, s, "amax"), (rn(n, m), ri(n, k, m), rn(k, m))),
        ("gather", lambda x, i: torch.gather(x, 1, i), (rn(k, n), ri(n, k, 3))),
        ("gather_same", lambda x, i: torch.gather(x, 0, i), (rn(n, m), ri(n, k, m))),
        ("histc", lambda x: torch.histc(x, 7, -1.5, 1.5), (rn(k, n),)),
        ("histc_data", lambda x: torch.histc(x, 7), (rn(k, n),)),
        ("cumsum", lambda x: torch.cumsum(x, 1), (rn(k, n),)),
        ("cumsum_int", lambda x: torch.cumsum(x, 0, dtype=torch.int32), (rn(n, 3).round(),)),
        ("masked_index", lambda x, b, i, j: aten._unsafe_masked_index(x, b, [i, j], 0.0),
         (rn(n, m), rb(k, 3), ri(n, k, 1), ri(m, 3))),
        ("masked_index_fill", lambda x, b, i: aten._unsafe_masked_index(x, b, [None, i], 1.5),
         (rn(k, n), rb(k, 4), ri(n, 4))),
        ("masked_put", lambda x, b, i, v: aten._unsafe_masked_index_put_accumulate(x, b, [i], v),
         (rn(n, m), rb(k, 1), ri(n, k), rn(k, m))),  # the embedding backward's form
        ("masked_put2", lambda x, b, i, j, v: aten._unsafe_masked_index_put_accumulate(x, b, [i, j], v),
         (rn(n, m), rb(k, 3), ri(n, k, 1), ri(m, 3), rn(k, 3))),
        # DTensor's rules (kept: right), checked the same way
        ("index", lambda x, i: aten.index(x, [None, i]), (rn(m, n), ri(n, k, 2))),
        ("sort", lambda x: torch.sort(x, 1), (rn(k, n),)),
        ("topk", lambda x: torch.topk(x, min(2, n), 0), (rn(n, m),)),
    ]
    # aten._grouped_mm: bf16 only (its meta function), 16-byte aligned strides: fixed sizes
    bf = dict(dtype=torch.bfloat16)
    offs16 = torch.tensor([5, 5, 16], dtype=torch.int32)
    cases += [
        ("grouped_mm_2d3d", lambda a, b, o: torch._grouped_mm(a, b, o),
         (rn(16, 16).to(**bf), rn(3, 16, 32).to(**bf), offs16)),
        ("grouped_mm_2d2d", lambda a, b, o: torch._grouped_mm(a, b, o),  # a weight gradient
         (rn(32, 16).to(**bf).t(), rn(32, 16).to(**bf), torch.tensor([8, 8, 32], dtype=torch.int32))),
        ("grouped_mm_3d3d", lambda a, b: torch._grouped_mm(a, b),
         (rn(4, 16, 16).to(**bf), rn(4, 16, 32).to(**bf))),
    ]
    try:
        import transformers.integrations.moe  # noqa: F401  (registers transformers' ops)
    except ImportError:
        return cases
    mm, bwd = torch.ops.transformers.grouped_mm_fallback, torch.ops.transformers.grouped_mm_fallback_backward
    offs = torch.tensor([min(2, n), min(2, n), n], dtype=torch.int32)
    cases += [
        ("grouped_mm_fallback", lambda x, w, o: mm(x, w, o), (rn(n, m), rn(3, m, k), offs)),
        ("grouped_mm_fallback_backward", lambda x, w, o, gr: bwd(x, w, o, gr),
         (rn(n, m), rn(3, m, k), offs, rn(n, k))),
    ]
    return cases


NAMES = [c[0] for c in _cases()]
DTENSOR = ("index", "sort", "topk")  # planned by DTensor's rules: need a DeviceMesh


def _run(node, args):
    """Run ``node`` with its tensor arguments replaced by ``args`` (in tensor_args order)."""
    targs = rules.tensor_args(node)
    sub = dict(zip(targs, args))
    call = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: sub[n])
    return node.target(*call[0], **call[1])


def _tol(want):
    """bf16 (aten._grouped_mm): a sum of two rounded partial products is not the one rounded
    product; a wrong split is off by whole terms (O(1)), far beyond this."""
    return dict(atol=0.1, rtol=0.05) if want.dtype == torch.bfloat16 else {}


def _check_every_spec(name, mesh_shape, sizes=(6, 4, 5), seed=0, mesh=None):
    _, fn, args = next(c for c in _cases(*sizes, seed) if c[0] == name)
    gm = _graph(fn, *args)
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    want = _run(node, args)
    specs = _specs(node, mesh_shape, mesh)
    assert specs, name
    coords = list(itertools.product(*(range(n) for n in mesh_shape)))
    for spec in specs:
        outs = {c: _run(node, [shard_global(a, p, c, mesh_shape) for a, p in zip(args, spec.inputs)])
                for c in coords}
        if is_placements(spec.output):
            got = unshard(outs, spec.output, mesh_shape, name, atol=5e-2, rtol=5e-2)
            torch.testing.assert_close(got, want, msg=lambda m: f"{name} {spec}: {m}", **_tol(want))
        else:
            for k, p in enumerate(spec.output):
                got = unshard({c: o[k] for c, o in outs.items()}, p, mesh_shape, name)
                torch.testing.assert_close(got, want[k], msg=lambda m: f"{name} {spec} out {k}: {m}")
    return specs


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from([n for n in NAMES if n not in DTENSOR]), mesh_shape=st.sampled_from([(2,), (3,), (4,), (2, 2)]),
       sizes=st.tuples(*[st.integers(1, 7)] * 3), seed=st.integers(0, 2**16))
def test_every_offered_spec_computes_the_global_result(case, mesh_shape, sizes, seed):
    """Random sizes (uneven and empty pieces included), index values and op; every OpSpec the
    rule offers on a random mesh is run on its local pieces and compared with the global op."""
    _check_every_spec(case, mesh_shape, sizes, seed)


@pytest.mark.parametrize("case", [n for n in NAMES if n not in DTENSOR])
def test_every_case_on_a_mesh_of_two_and_of_three(case):
    _check_every_spec(case, (2,))
    _check_every_spec(case, (3,), (7, 5, 4))


@pytest.mark.parametrize("case", DTENSOR)
def test_dtensor_rules_kept_for_index_sort_topk(case, fake_mesh):
    _check_every_spec(case, (2,), mesh=fake_mesh((2,), ("x",)))
    _check_every_spec(case, (3,), (7, 5, 4), mesh=fake_mesh((3,), ("x",)))


def test_property_covers_the_split_and_partial_schemes():
    """The property above is not vacuous: the schemes it checks are offered on these cases."""
    acc = {(s.inputs, s.output) for s in _check_every_spec("index_put_acc", (2,))}
    assert (((P,), (Shard(0),), (Shard(0),)), (P,)) in acc
    hist = {s.output for s in _check_every_spec("histc", (3,))}
    assert (P,) in hist
    assert all(s.output == (R,) for s in _check_every_spec("histc_data", (2,)))


def test_gather_and_scatter_add_on_misaligned_splits_match_one_device(fake_mesh):
    """x [6, 8] and idx [6, 4], both Shard(1) on a mesh of 2: DTensor's rules offer to gather
    and scatter_add locally (pieces of 4 and 2 columns: wrong numbers); the plan must move one
    of them. Forward and gradients against one device."""
    from torch.distributed.tensor import distribute_tensor

    from dynamo_dist import compile_records
    from dynamo_dist.testing.conformance.simulate import run_spmd

    mesh = fake_mesh((2,), ("x",))
    x, src = torch.randn(6, 8), torch.randn(6, 8)
    idx = torch.randint(0, 6, (6, 4))

    def f(x, idx, src):
        return torch.gather(x, 0, idx) * 2 + torch.zeros(6, 4).scatter_add(0, idx, src[:, :4])

    dist_args = [distribute_tensor(t, mesh, [Shard(1)]) for t in (x, idx, src)]
    for t in (dist_args[0], dist_args[2]):
        t.requires_grad_()
    torch.compile(f, backend="dist", fullgraph=True, options={"inductor": False})(*dist_args)
    record = compile_records()[-1]
    xr, sr = x.clone().requires_grad_(), src.clone().requires_grad_()
    want = f(xr, idx, sr)
    tangent = torch.randn(6, 4)
    want.backward(tangent)
    (got,), grads = run_spmd(record, [x, idx, src], [tangent], mesh)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grads[0], xr.grad)
    torch.testing.assert_close(grads[2], sr.grad)
