"""Block-strided sharding (``_StridedShard(d, split_factor=k)``, "SS(d,k)"): redistribute to and
from it against its definition, its op rules on small graphs, and fused projections (GPT-2's
q|k|v, gate|up) on simulated ranks against one device with exactly Megatron's collectives."""

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from dynamo_dist import compile_records
from dynamo_dist.testing.conformance.simulate import run_spmd, shard_global, unshard
from dynamo_dist.simulate import Groups, coordinates, run_lockstep
from inductor_passes.core.compat import StridedShard
from inductor_passes.core.placements import (fmt, intersect_axes, local_shape, plannable,
                                             shard_twin, valid_for)
from inductor_passes.redistribute import mesh_axes, redistribute
from inductor_passes.sharding import rules
from inductor_passes.sharding.cost import redistribute_cost

R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial("sum")


def SS(d, k):
    return StridedShard(d, split_factor=k)


# ---------------------------------------------------------------------------------------------
# redistribute: every pair against the definition (the simulator's shard_global), on N ranks
# ---------------------------------------------------------------------------------------------
def _redistribute_on_ranks(mesh, full, src, dst):
    """Lower ``src -> dst`` for every rank (make_fx of the lowering), run the ranks side by
    side; returns ({coord: local result}, {coord: [collective kinds recorded]}, {coord: graph})."""
    ms = tuple(mesh.shape)
    graphs, inputs, records = {}, {}, {}
    for coord in coordinates(ms):
        axes = mesh_axes(mesh, coord)
        rec = records[coord] = []
        local = shard_global(full, src, coord, ms)
        graphs[coord] = make_fx(_lowered(src, dst, axes, rec, tuple(full.shape)),
                                tracing_mode="fake")(local)
        inputs[coord] = [local]
    names = [mesh.get_group(i).group_name for i in range(mesh.ndim)]
    outs = run_lockstep(graphs, inputs, Groups(names, ms))
    return {c: o[0] for c, o in outs.items()}, records, graphs


def _lowered(src, dst, axes, rec, shape):
    def run(x):
        return [redistribute(x, src, dst, axes, lambda kind, ax, t: rec.append(kind), shape)]
    return run


def _check_redistribute(mesh, full, src, dst):
    ms = tuple(mesh.shape)
    got, records, graphs = _redistribute_on_ranks(mesh, full, src, dst)
    for coord, x in got.items():
        assert tuple(x.shape) == local_shape(full.shape, dst, ms, coord), (fmt(src), fmt(dst))
        if not any(isinstance(p, Partial) for p in dst):
            want = shard_global(full, dst, coord, ms)
            assert torch.equal(x, want), f"{fmt(src)} -> {fmt(dst)} on rank {coord}"
    if any(isinstance(p, Partial) for p in dst):
        torch.testing.assert_close(unshard(got, dst, ms, "redistributed"), full)
    # every collective the lowering emits is in the ledger (one record each)
    for coord, g in graphs.items():
        issued = [n for n in g.graph.nodes if n.op == "call_function" and
                  str(n.target).startswith("_c10d_functional.") and "wait" not in str(n.target)]
        assert len(issued) == len(records[coord]), (fmt(src), fmt(dst), records[coord])


_ONE_AXIS = st.sampled_from([R, S0, S1, Shard(2), SS(0, 2), SS(0, 3), SS(1, 2), SS(1, 3),
                             SS(2, 2), P])


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(src=_ONE_AXIS, dst=_ONE_AXIS, last=st.sampled_from([5, 12]))
def test_redistribute_1d_strided_matches_definition(fake_mesh, src, dst, last):
    """Mesh of 2: SS <-> R / S / SS / P against the definition, forward values. The last dim
    is 5 (uneven Shard pieces beside an SS on another dim) or 12."""
    mesh = fake_mesh((2,), ("tp",))
    full = torch.randn(12, 6, last, dtype=torch.float64)
    assume(valid_for(full.shape, (src,), (2,)) and valid_for(full.shape, (dst,), (2,)))
    _check_redistribute(mesh, full, (src,), (dst,))


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(src=st.tuples(_ONE_AXIS, _ONE_AXIS), dst=st.tuples(_ONE_AXIS, _ONE_AXIS))
def test_redistribute_2d_strided_matches_definition(fake_mesh, src, dst):
    """2 x 2 mesh: SS on one mesh axis with Shard / SS / Partial on the other (the same check
    over all 1296 valid pairs of [R, S(0), S(1), SS(0,3), SS(1,2), SS(1,3), P] on a 12 x 12
    tensor passed once; too slow to keep)."""
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    full = torch.randn(12, 12, 4, dtype=torch.float64)
    assume(valid_for(full.shape, src, (2, 2)) and valid_for(full.shape, dst, (2, 2)))
    assume(any("SS" in fmt(p) for p in (src, dst)))
    _check_redistribute(mesh, full, src, dst)


def test_strided_collectives_are_the_shard_ones(fake_mesh):
    """Which collectives each move takes: SS is moved like Shard (plus local reorders)."""
    mesh = fake_mesh((2,), ("tp",))
    full = torch.randn(12, 12)

    def kinds(src, dst):
        _, records, _ = _redistribute_on_ranks(mesh, full, (src,), (dst,))
        return records[(0,)]

    assert kinds(SS(1, 3), R) == ["all_gather"]
    assert kinds(R, SS(1, 3)) == []                       # a local slice
    assert kinds(P, SS(1, 3)) == ["reduce_scatter"]
    assert kinds(SS(1, 3), S0) == ["all_to_all"]
    assert kinds(S0, SS(1, 3)) == ["all_to_all"]
    assert kinds(SS(1, 3), S1) == ["all_gather"]          # same dim, other layout: gather, slice
    assert kinds(SS(1, 3), SS(1, 2)) == ["all_gather"]


def test_cost_prices_strided_like_shard():
    shape, mesh, f32 = (96, 96), (2,), torch.float32
    for a, b, c, d in [(SS(1, 3), R, S1, R), (P, SS(1, 3), P, S1), (SS(1, 3), S0, S1, S0),
                       (S0, SS(1, 3), S0, S1), (R, SS(1, 3), R, S1)]:
        assert redistribute_cost(shape, f32, (a,), (b,), mesh) == \
            redistribute_cost(shape, f32, (c,), (d,), mesh), (a, b)
    # one dim in two layouts is a gather (and a free slice), not an all_to_all
    assert redistribute_cost(shape, f32, (SS(1, 3),), (S1,), mesh) > \
        redistribute_cost(shape, f32, (S0,), (S1,), mesh)


def test_plannable_keeps_strided_and_refuses_what_it_cannot_hold():
    assert plannable((4, 12), (SS(1, 3),), (2,)) == ((SS(1, 3),), [])
    pls, why = plannable((4, 9), (SS(1, 3),), (2,))      # blocks of 3 do not split in 2
    assert pls == (R,) and "multiple of" in why[0]
    pls, why = plannable((4, 12), (SS(1, 3), S1), (2, 2))  # nested: DTensor's FSDP2 over TP use
    assert pls == (SS(1, 3), R) and "already split" in why[0]


# ---------------------------------------------------------------------------------------------
# rules on small graphs
# ---------------------------------------------------------------------------------------------
def _node(fn, *shapes, target):
    gm = make_fx(fn, tracing_mode="fake")(*[torch.randn(s) for s in shapes])
    return next(n for n in gm.graph.nodes if n.target == target)


def _specs(node, current, mesh=None, mesh_shape=(2,), strided_in=None):
    return {(s.inputs, s.output) for s in rules.op_strategy(
        node, current, mesh, mesh_shape, lambda n: None, strided_in)}


aten = torch.ops.aten


def test_pointwise_passes_strided_through_all_operands_alike():
    add = _node(lambda a, b: a + b, (4, 12), (4, 12), target=aten.add.Tensor)
    specs = _specs(add, [(SS(1, 3),), (R,)])
    assert (((SS(1, 3),), (SS(1, 3),)), (SS(1, 3),)) in specs
    assert not any(o == (SS(1, 3),) and ins != ((SS(1, 3),), (SS(1, 3),)) for ins, o in specs)
    # a broadcast operand stays replicated; a dim of another size is never lifted
    bias = _node(lambda a, b: a + b, (4, 12), (12,), target=aten.add.Tensor)
    assert (((SS(1, 3),), (SS(0, 3),)), (SS(1, 3),)) in _specs(bias, [(SS(1, 3),), (R,)])
    # no factor in play: no strided option at all
    assert not any("SS" in fmt(o) for _, o in _specs(add, [(R,), (R,)]))


def test_matmul_lifts_free_and_contraction_letters():
    mm = _node(torch.mm, (4, 12), (12, 6), target=aten.mm.default)
    specs = _specs(mm, [(R,), (SS(0, 3),)])
    assert (((SS(1, 3),), (SS(0, 3),)), (P,)) in specs   # contraction: a partial sum
    mm2 = _node(torch.mm, (4, 6), (6, 12), target=aten.mm.default)
    assert (((R,), (SS(1, 3),)), (SS(1, 3),)) in _specs(mm2, [(R,), (SS(1, 3),)])


def test_split_at_block_boundaries_gives_each_part_shard():
    split = _node(lambda x: x.split(4, dim=1), (2, 12), target=aten.split.Tensor)
    specs = _specs(split, [(SS(1, 3),)])
    assert (((SS(1, 3),),), ((S1,), (S1,), (S1,))) in specs
    # pieces of two blocks and one block: SS(1, 2) and Shard
    two = _node(lambda x: x.split([8, 4], dim=1), (2, 12), target=aten.split_with_sizes.default)
    assert (((SS(1, 3),),), ((SS(1, 2),), (S1,))) in _specs(two, [(SS(1, 3),)])
    # a cut inside a block: no strided option (the pieces are not per-rank)
    odd = _node(lambda x: x.split([6, 6], dim=1), (2, 12), target=aten.split_with_sizes.default)
    assert not any(ins == ((SS(1, 3),),) for ins, _ in _specs(odd, [(SS(1, 3),)]))


def test_cat_of_whole_blocks_is_strided_only_for_factors_in_play():
    cat = _node(lambda a, b, c: torch.cat([a, b, c], dim=1), (2, 4), (2, 4), (2, 4),
                target=aten.cat.default)
    want = (((S1,), (S1,), (S1,)), (SS(1, 3),))
    assert want in _specs(cat, [(R,)] * 3, strided_in=rules.Strided(program=frozenset({3})))
    assert want not in _specs(cat, [(R,)] * 3)


def test_slice_and_slice_scatter_of_whole_blocks():
    sl = _node(lambda x: x[:, 4:], (2, 12), target=aten.slice.Tensor)
    assert (((SS(1, 3),),), (SS(1, 2),)) in _specs(sl, [(SS(1, 3),)])
    inside = _node(lambda x: x[:, 3:], (2, 12), target=aten.slice.Tensor)
    assert not any(ins == ((SS(1, 3),),) and "SS" in fmt(o)
                   for ins, o in _specs(inside, [(SS(1, 3),)]))
    scatter = _node(lambda x, y: aten.slice_scatter(x, y, 1, 4, 8), (2, 12), (2, 4),
                    target=aten.slice_scatter.default)
    assert (((SS(1, 3),), (S1,)), (SS(1, 3),)) in _specs(
        scatter, [(R,), (R,)], strided_in=rules.Strided(program=frozenset({3})))


def test_views_carry_strided_only_where_they_keep_the_dim(fake_mesh):
    mesh = fake_mesh((2,), ("tp",))
    perm = _node(lambda x: x.permute(1, 0), (4, 12), target=aten.permute.default)
    assert (((SS(1, 3),),), (SS(0, 3),)) in _specs(perm, [(SS(1, 3),)], mesh)
    keep = _node(lambda x: x.view(2, 2, 12), (4, 12), target=aten.view.default)
    assert (((SS(1, 3),),), (SS(2, 3),)) in _specs(keep, [(SS(1, 3),)], mesh)
    # splitting the strided dim into its blocks: [3 x 4] with SS(.,3) is Shard on the block
    # dim's inner part (DTensor's view rule reads SS)
    blocks = _node(lambda x: x.view(4, 3, 4), (4, 12), target=aten.view.default)
    assert (((SS(1, 3),),), (Shard(2),)) in _specs(blocks, [(SS(1, 3),)], mesh)


@pytest.mark.parametrize("fn,shape,src", [
    (lambda x: x.reshape(8, 5, 3), (2, 4, 5, 3), (S1,)),         # merge [B, H]: H split
    (lambda x: x.reshape(2, 4, 5, 3), (8, 5, 3), (SS(0, 2),)),   # and back
    (lambda x: x.reshape(4, 2, 5, 3), (8, 5, 3), (SS(0, 2),)),
    (lambda x: x.reshape(4, 36), (4, 6, 6), (SS(1, 3),)),
    (lambda x: x.reshape(4, 6, 6), (4, 36), (SS(1, 3),)),
    (lambda x: x.reshape(4, 3, 4), (4, 12), (SS(1, 3),)),
    (lambda x: x.reshape(48), (4, 12), (SS(1, 3),)),
])
def test_dtensor_view_rules_on_strided_match_the_definition(fake_mesh, fn, shape, src):
    """Every OpSpec the view rules give for a (strided) input is checked on real values: the
    local view of every rank's input piece is that rank's piece of the global view."""
    mesh = fake_mesh((2,), ("tp",))
    node = _node(fn, shape, target=aten.view.default)
    out_shape = tuple(node.meta["val"].shape)
    x = torch.randn(shape)
    y = fn(x)
    checked = 0
    for s in rules.op_strategy(node, [src], mesh, (2,), lambda n: None):
        ins, out = s.inputs[0], s.output
        if any(isinstance(p, Partial) for p in (*ins, *out)):
            continue
        for r in range(2):
            local = shard_global(x, ins, (r,), (2,))
            want = shard_global(y, out, (r,), (2,))
            assert torch.equal(local.reshape(local_shape(out_shape, out, (2,))), want), \
                (fmt(ins), fmt(out))
        checked += 1
    assert checked, "no nested OpSpec offered"


# ---------------------------------------------------------------------------------------------
# a _StridedShard nested inside a Shard of its dim: attention's [B*H] batch on dp x tp (BLOOM's
# ALiBi attention merges batch and heads; without the nest one of the two axes had to gather)
# ---------------------------------------------------------------------------------------------
def test_valid_for_holds_a_strided_split_nested_inside_a_shard():
    assert valid_for((16, 8), (S0, SS(0, 2)), (2, 2))     # dp's piece of 8: 2 blocks of 2 x 2
    assert valid_for((16, 8), (S0, SS(0, 4)), (2, 2))
    assert not valid_for((16, 8), (S0, SS(0, 3)), (2, 2))  # 8 is no multiple of 3 x 2
    assert valid_for((12, 8), (S0, SS(0, 3)), (2, 2))      # the piece's size counts, not D's
    assert not valid_for((16, 8), (SS(0, 2), S0), (2, 2), nested=True)  # SS outside: FSDP2/TP
    assert not valid_for((16, 8), (S0, SS(0, 2), S0), (2, 2, 2), nested=True)
    assert not valid_for((24, 8), (S0, S0, SS(0, 3)), (2, 2, 2), nested=True)
    assert not valid_for((16, 8), (S0, S0), (2, 2))         # a plain nest: pins only, as before
    # rules are asked without the inner split (their answers get it back from rules.strided)
    assert shard_twin((S0, SS(0, 2))) == (S0, R)
    assert shard_twin((R, SS(0, 2))) == (R, S0)
    assert shard_twin((S1, SS(0, 2))) == (S1, S0)


def test_axes_planned_apart_combine_to_the_intersection_of_their_pieces():
    """The per-axis start plans each mesh axis alone: tp's SS(0, 4) of [B*H] = [4*4] holds its
    heads of all 4 batches, dp's Shard(0) half the batches; the N-D placement is the rank's
    intersection of the two index sets, which under DTensor's nesting is [S(0), SS(0, 2)]."""
    x = torch.arange(48.0)
    for one_axis, ms in [((S0, SS(0, 4)), (2, 2)), ((S0, SS(0, 2)), (2, 2)),
                         ((S0, SS(0, 12)), (4, 2)), ((S0, SS(0, 6)), (2, 4))]:
        nd = intersect_axes(one_axis, ms)
        assert valid_for(x.shape, nd, ms, nested=True), (fmt(one_axis), fmt(nd))
        for c in coordinates(ms):
            alone = [set(shard_global(x, (p,), (r,), (n,)).tolist())
                     for p, r, n in zip(one_axis, c, ms)]
            got = shard_global(x, nd, c, ms).tolist()
            assert got == sorted(alone[0] & alone[1]), (fmt(one_axis), fmt(nd), c)
    assert intersect_axes((S0, SS(0, 4)), (2, 2)) == (S0, SS(0, 2))
    assert intersect_axes((S0, SS(0, 2)), (2, 2)) == (S0, S0)  # one block per dp piece
    assert intersect_axes((S0, SS(0, 3)), (2, 2)) == (S0, SS(0, 3))  # 2 does not divide 3
    assert intersect_axes((SS(0, 4), S0), (2, 2)) == (SS(0, 4), S0)
    assert intersect_axes((S1, SS(0, 4)), (2, 2)) == (S1, SS(0, 4))


def _nested(pls) -> bool:
    return any(type(p) is StridedShard and any(type(q) is Shard and q.dim == p.dim
                                                for q in pls[:a])
               for a, p in enumerate(pls))


NEST = (S0, SS(0, 2))  # [B*H] = [4*4] on dp=2 x tp=2: B split on dp, H on tp


@pytest.mark.parametrize("fn,shapes,target,current", [
    (lambda x: x.reshape(16, 5, 3), [(4, 4, 5, 3)], aten.view.default, [(S0, S1)]),
    (lambda x: x.reshape(4, 4, 5, 3), [(16, 5, 3)], aten.view.default, [NEST]),
    (lambda x: x.reshape(16, 1, 5), [(4, 4, 5)], aten.view.default, [(S0, S1)]),
    (torch.bmm, [(16, 5, 3), (16, 3, 5)], aten.bmm.default, [NEST, NEST]),
    (lambda a, q, k: a.baddbmm(q, k, beta=1.0, alpha=0.5), [(16, 1, 5), (16, 5, 3), (16, 3, 5)],
     aten.baddbmm.default, [NEST] * 3),
    (lambda x: x.permute(0, 2, 1), [(16, 5, 3)], aten.permute.default, [NEST]),
    (lambda x: x * 0.5, [(16, 5, 3)], aten.mul.Tensor, [NEST]),
    (lambda x: x.softmax(-1), [(16, 5, 3)], aten._softmax.default, [NEST]),
], ids=["flatten", "unflatten", "alibi-flatten", "bmm", "baddbmm", "permute", "mul", "softmax"])
def test_rules_on_a_strided_split_nested_in_a_shard_match_the_definition(
        fake_mesh, fn, shapes, target, current):
    """Every OpSpec the rules give with such a nest anywhere, run on every rank's pieces (the
    definition's ``shard_global``, DTensor's left-to-right nesting), is that rank's piece of the
    global result; and each op is offered at least one (else dp or tp gathers there)."""
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    ms = (2, 2)
    node = _node(fn, *shapes, target=target)
    out_shape = tuple(node.meta["val"].shape)
    xs = [torch.randn(s, dtype=torch.float64) for s in shapes]
    y = fn(*xs)
    checked = 0
    for s in rules.op_strategy(node, current, mesh, ms, lambda n: None):
        if not any(_nested(p) for p in (*s.inputs, s.output)) or \
                any(isinstance(q, Partial) for pls in (*s.inputs, s.output) for q in pls):
            continue
        for c in coordinates(ms):
            pieces = [shard_global(x, p, c, ms) for x, p in zip(xs, s.inputs)]
            got = pieces[0].reshape(local_shape(out_shape, s.output, ms, c)) \
                if target is aten.view.default else fn(*pieces)
            torch.testing.assert_close(got, shard_global(y, s.output, c, ms), rtol=0, atol=1e-12,
                                       msg=f"{[fmt(i) for i in s.inputs]} -> {fmt(s.output)}")
        checked += 1
    assert checked, "no nested OpSpec offered"


def test_redistribute_to_and_from_a_nested_strided_split_matches_the_definition(fake_mesh):
    """Every pair among the nest and its neighbours on a [24, 6] value, dp=2 x tp=2: the
    lowering's collectives and slices give each rank the definition's piece."""
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    full = torch.randn(24, 6, dtype=torch.float64)
    nests = [(S0, SS(0, 2)), (S0, SS(0, 3)), (S0, SS(0, 6))]
    others = [(R, R), (S0, R), (R, SS(0, 6)), (S0, S1), (R, S0), (P, SS(0, 2)), (S1, SS(0, 3))]
    pairs = [(a, b) for a in nests for b in nests + others if a != b] + \
        [(b, a) for a in nests for b in others if not any(isinstance(p, Partial) for p in a)]
    for src, dst in pairs:
        assert valid_for(full.shape, src, (2, 2)) and valid_for(full.shape, dst, (2, 2))
        _check_redistribute(mesh, full, src, dst)


def _merged_batch_attention(q, k, v):
    """Attention by batched matmuls over a merged [B*H] batch (BLOOM's, SDPA's math path)."""
    b, h, l, e = q.shape
    s = torch.bmm(q.reshape(b * h, l, e), k.transpose(-1, -2).reshape(b * h, e, l)) * 0.5
    p = s.view(b, h, l, l).softmax(-1).view(b * h, l, l)
    return torch.bmm(p, v.reshape(b * h, l, e)).view(b, h, l, e).transpose(1, 2) \
        .reshape(b, l, h * e)


def _attention_on_ranks(fake_mesh, mesh_shape, shape, layouts, seed=0):
    """Compile ``_merged_batch_attention`` on DTensor q, k, v in ``layouts``, run every
    simulated rank forward and backward; returns (record, where) after checking output and
    input gradients against one device."""
    from torch.distributed.tensor import distribute_tensor

    names = ("dp", "tp", "cp")[:len(mesh_shape)]
    mesh = fake_mesh(mesh_shape, names)
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(shape, dtype=torch.float64, generator=gen) for _ in range(3)]
    dts = [distribute_tensor(t, mesh, p).requires_grad_() for t, p in zip(full, layouts)]
    out = torch.compile(_merged_batch_attention, backend="dist", fullgraph=True,
                        options={"inductor": False})(*dts)
    record = compile_records()[-1]
    refs = [t.clone().requires_grad_() for t in full]
    want = _merged_batch_attention(*refs)
    cot = torch.randn(want.shape, dtype=torch.float64, generator=gen)
    want.backward(cot)
    by_name = {"L_q_": full[0], "L_k_": full[1], "L_v_": full[2]}
    got, grads = run_spmd(record, [by_name[i.name] for i in record.program.primal_inputs],
                          [cot], mesh)
    where = f"mesh {mesh_shape}, shape {shape}, q/k/v {[fmt(p) for p in layouts]}"
    assert tuple(out.shape) == tuple(want.shape), where
    torch.testing.assert_close(got[0], want.detach(), msg=lambda m: f"{where}: {m}")
    want_grads = dict(zip(("L_q_", "L_k_", "L_v_"), (r.grad for r in refs)))
    for info, g in zip(record.program.primal_inputs, grads):
        torch.testing.assert_close(g, want_grads[info.name], msg=lambda m: f"{where} grad: {m}")
    return record, where


def test_merged_batch_attention_keeps_batch_and_heads_split(fake_mesh):
    """q, k, v [B, H, L, E] with B on dp and H on tp: every [B*H] value is planned in the nest
    [S(0), SS(0, B/2)] and the step moves nothing (before it, one of the axes gathered)."""
    record, where = _attention_on_ranks(fake_mesh, (2, 2), (4, 4, 3, 2), [(S0, S1)] * 3)
    plan = record.plan
    nested = [n for n in plan.nodes.values() if n.op in ("aten.bmm.default",)
              and plan.placement(n.name) == (S0, SS(0, 2))]
    assert len(nested) == 6, plan.to_text()  # 2 forward, 4 backward
    assert not record.ledger.entries, [(e.kind, e.cause) for e in record.ledger.entries]


_LAYOUT = st.sampled_from([R, S0, S1, Shard(2)])


@settings(max_examples=int(os.environ.get("DYNAMO_DIST_NEST_EXAMPLES", "16")),
          deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(mesh_shape=st.sampled_from([(2, 2), (2, 2), (2, 2, 2)]),
       b=st.sampled_from([2, 4, 6]), h=st.sampled_from([2, 4, 6]),
       shared=st.booleans(), data=st.data())
def test_merged_batch_attention_on_random_layouts_computes_what_one_device_computes(
        fake_mesh, mesh_shape, b, h, shared, data):
    """Random placements of q, k, v (one layout for all three, or one each), batch and head
    counts that a nest splits evenly or not: forward values and every input gradient as on one
    device."""
    def layout():
        return tuple(data.draw(_LAYOUT) for _ in mesh_shape)

    layouts = [layout()] * 3 if shared else [layout() for _ in range(3)]
    try:
        _attention_on_ranks(fake_mesh, mesh_shape, (b, h, 3, 2), layouts, seed=b * 10 + h)
    except AssertionError:
        raise
    except Exception:
        # eager DTensor is slow to dispatch new layouts: asked only when the compile failed
        assume(_eager_dtensor_runs(fake_mesh, mesh_shape, (b, h, 3, 2), layouts))
        raise


def _eager_dtensor_runs(fake_mesh, mesh_shape, shape, layouts):
    """Whether eager DTensor itself runs the attention on these layouts. Some it refuses in its
    own view rules, with the same error compiled or not (Dynamo traces through them): a batch
    of 2 over 4 ranks ("shape '[1, 3, 2]' is invalid"), or q, k in [S(1), S(1)] with 4 heads
    ("Cannot unflatten tensor with _StridedShard"). Those are not this test's subject; an
    assertion (a wrong number) is raised whatever eager DTensor does."""
    from torch.distributed.tensor import distribute_tensor

    mesh = fake_mesh(mesh_shape, ("dp", "tp", "cp")[:len(mesh_shape)])
    dts = [distribute_tensor(torch.zeros(shape, dtype=torch.float64), mesh, p).requires_grad_()
           for p in layouts]
    try:
        _merged_batch_attention(*dts).sum().backward()
    except RuntimeError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# fused projections end to end: simulated ranks vs one device
# ---------------------------------------------------------------------------------------------
class FusedLayer(nn.Module):
    """One transformer layer with fused projections: q|k|v in one Conv1D-style weight [H, 3H]
    (addmm, then ``split``), gate|up in one Linear [2I, H] (``chunk``), SwiGLU."""

    def __init__(self, hidden=16, heads=4, inter=24, slicing=False):
        super().__init__()
        self.h, self.nh, self.slicing = hidden, heads, slicing
        self.qkv_w = nn.Parameter(torch.randn(hidden, 3 * hidden) * 0.2)
        self.qkv_b = nn.Parameter(torch.randn(3 * hidden) * 0.2)
        self.o = nn.Linear(hidden, hidden)
        self.gate_up = nn.Linear(hidden, 2 * inter)
        self.down = nn.Linear(inter, hidden)

    def forward(self, x):
        b, t, h = x.shape
        qkv = torch.addmm(self.qkv_b, x.view(-1, h), self.qkv_w).view(b, t, 3 * h)
        if self.slicing:  # Phi-3 style
            q, k, v = qkv[..., :h], qkv[..., h:2 * h], qkv[..., 2 * h:]
        else:             # GPT-2 style
            q, k, v = qkv.split(h, dim=2)
        q, k, v = (z.view(b, t, self.nh, h // self.nh).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, h))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class FusedModel(nn.Module):
    def __init__(self, layers=2, **kw):
        super().__init__()
        self.layers = nn.ModuleList(FusedLayer(**kw) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _fused_plan(layers):
    plan = {}
    for i in range(layers):
        p = f"layers.{i}."
        plan.update({p + "qkv_w": {"tp": SS(1, 3)}, p + "qkv_b": {"tp": SS(0, 3)},
                     p + "o.weight": {"tp": S1},
                     p + "gate_up.weight": {"tp": SS(0, 2)}, p + "gate_up.bias": {"tp": SS(0, 2)},
                     p + "down.weight": {"tp": S1}})
    return plan


@pytest.mark.parametrize("slicing", [False, True], ids=["split", "slices"])
def test_fused_projections_megatron_on_two_ranks(fake_mesh, slicing):
    """Two fused layers on tp=2 (fake process group, every rank simulated): loss, input and
    parameter gradients match one device, and the collectives are exactly Megatron's, 2
    all_reduce per layer forward and 2 backward, no gather."""
    from dynamo_dist.plans import ShardingPlan, shard_module

    mesh = fake_mesh((2,), ("tp",))
    torch.manual_seed(0)
    ref = FusedModel(slicing=slicing)
    model = FusedModel(slicing=slicing)
    model.load_state_dict(ref.state_dict())
    shard_module(model, mesh, ShardingPlan(plan=_fused_plan(2)))
    x = torch.randn(2, 8, 16)
    cot = torch.randn(2, 8, 16)

    xr = x.clone().requires_grad_()
    want = ref(xr)
    want_grads = torch.autograd.grad(want, [xr, *ref.parameters()], cot)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="dist", fullgraph=True, options={"inductor": False})
    compiled(x.clone().requires_grad_()).sum().backward()
    for name, p in model.named_parameters():  # the runtime boundary: gradients in place
        assert p.grad is not None and p.grad.placements == p.placements, name
    rec = compile_records()[-1]
    assert not rec.plan.fallbacks, rec.plan.fallbacks
    kinds = [(e.phase, e.kind) for e in rec.ledger.entries]
    assert kinds.count(("forward", "all_reduce")) == 4, rec.ledger.entries
    assert kinds.count(("backward", "all_reduce")) == 4, rec.ledger.entries
    assert len(kinds) == 8, rec.ledger.entries
    # every gradient leaves in its parameter's own placement (the fused ones block-strided)
    grads_pl = rec.plan.nodes["output"].inputs[1:]
    primal_pl = [rec.plan.placement(n) for n in rec.plan.nodes if n.startswith("primals_")]
    assert grads_pl[1:] == tuple(primal_pl[1:])
    assert sum("SS(" in fmt(p) for p in grads_pl) == 8

    names = dict(ref.named_parameters())
    by_input = []
    for info in rec.program.primal_inputs:  # L_self_modules_layers_modules_0_parameters_qkv_b_
        flat = info.name.replace("modules_", "").replace("parameters_", "")
        by_input.append(next((n for n in names if flat.endswith(n.replace(".", "_") + "_")),
                             None))
    globals_ = [x if k is None else names[k].detach() for k in by_input]
    (got,), grads = run_spmd(rec, globals_, [cot], mesh)
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    want_of = dict(zip(["x", *names], want_grads))
    for k, g in zip(by_input, grads):
        torch.testing.assert_close(g, want_of[k or "x"], rtol=1e-4, atol=1e-5, msg=str(k))


class FusedLM(nn.Module):
    """FusedModel behind a replicated input projection and a norm (so every layer's input
    gradient is needed, and the projection pairs with nothing), returning a scalar loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 16)
        self.body = FusedModel()

    def forward(self, x):
        return self.body(F.layer_norm(self.inp(x), (16,))).pow(2).mean()


def test_planner_and_runtime_on_simulated_ranks(fake_mesh, monkeypatch):
    """TensorParallelPlanner gives the fused projections (found by the dataflow trace: split
    in 3, chunked in 2) _StridedShard, shard_module makes them DTensors in it, 3 AdamW steps
    on simulated tp=2 ranks (LocalTensorMode) match one process (loss, first-step gradients),
    with exactly Megatron's collectives."""
    from dynamo_dist.plans import TensorParallelPlanner
    from dynamo_dist.testing.zoo.cell import SimRuntime, run_cell
    from dynamo_dist.testing.zoo.models import ZooModel

    def batch(step):
        return (torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(step)),), {}

    plan = TensorParallelPlanner().build_plan(FusedLM(), example_inputs=batch(0))
    assert plan.placement_for("body.layers.0.qkv_w") == {"tp": SS(1, 3)}
    assert plan.placement_for("body.layers.1.qkv_b") == {"tp": SS(0, 3)}
    assert plan.placement_for("body.layers.0.gate_up.weight") == {"tp": SS(0, 2)}
    assert plan.placement_for("body.layers.0.gate_up.bias") == {"tp": SS(0, 2)}
    assert "SS(1,3)" in plan.summary() and "Megatron's layout" in plan.summary()

    # the zoo's stock planner reads example inputs from transformers models; this one's:
    import dynamo_dist.plans.tensor_parallel as tensor_parallel
    import dynamo_dist.testing.zoo.cell as cell

    def example_inputs(module, orig=cell.example_inputs):
        return batch(0) if isinstance(module, FusedLM) else orig(module)

    monkeypatch.setattr(tensor_parallel, "example_inputs", example_inputs)
    monkeypatch.setattr(cell, "example_inputs", example_inputs)
    row = run_cell(ZooModel("fused", "fused q|k|v and gate|up", FusedLM, batch), "tp=2",
                   SimRuntime())
    assert row["status"] == "parity", row.get("error") or row.get("trace")
    assert all(r["verdict"] == "=" for r in row["textbook"]), row["textbook"]
    assert {(r["phase"], r["kind"]) for r in row["textbook"]} == \
        {("forward", "all_reduce"), ("backward", "all_reduce")}


def test_dataflow_finds_fused_parts_cut_by_slices():
    """Phi-3 reads q, k, v of its fused output by slices (``qkv[..., :h]``...), not split: the
    trace collects the cut points; equal pieces are parts, unequal ones (grouped-query: q wider
    than k and v) are not (the projection stays contiguous, and its reason says why)."""
    from dynamo_dist.plans import TensorParallelPlanner

    x = torch.randn(2, 8, 16)
    plan = TensorParallelPlanner().build_plan(FusedModel(slicing=True), example_inputs=x)
    assert plan.placement_for("layers.0.qkv_w") == {"tp": SS(1, 3)}

    class Unequal(FusedLayer):
        def forward(self, x):
            qkv = torch.addmm(self.qkv_b, x.view(-1, self.h), self.qkv_w).view(*x.shape[:2], -1)
            q, kv = qkv[..., :2 * self.h], qkv[..., 2 * self.h:]
            return self.o(q[..., :self.h] * q[..., self.h:] * kv)

    d = {dd.names[0]: dd for dd in TensorParallelPlanner().build_plan(
        Unequal(), example_inputs=x).decisions}
    assert d["qkv_w"].placement == Shard(1) and "unequal parts" in d["qkv_w"].reason


def test_phi3_fused_qkv_and_gate_up_tp2_is_megatron(fake_mesh):
    """transformers' Phi-3 (qkv_proj read by slices, gate_up_proj chunked), planned by the stock
    planner and trained on simulated tp=2 ranks: parity with one process and exactly the
    textbook collectives."""
    from dynamo_dist.testing.zoo.cell import SimRuntime, run_cell
    from dynamo_dist.testing.zoo.models import (_LM, FFN, HEADS, HIDDEN, LAYERS, ZooModel, _hf,
                                                _lm_batch)

    zm = ZooModel("phi3", "fused qkv by slices, gate|up by chunk", _hf(
        "Phi3ForCausalLM", "Phi3Config", hidden_size=HIDDEN, intermediate_size=FFN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        pad_token_id=0, **_LM), _lm_batch)
    row = run_cell(zm, "tp=2", SimRuntime())
    assert row["status"] == "parity", row.get("error") or row.get("trace")
    assert all(r["verdict"] == "=" for r in row["textbook"]), row["textbook"]
    assert {r["kind"] for r in row["textbook"]} == {"all_reduce"}


def test_gpt2_zoo_cell_tp2_is_megatron(fake_mesh):
    """GPT-2 (fused c_attn, dropout: the attention runs SDPA's math path, whose [B*H] batched
    matmuls are split by heads through SS(0, B)) trained 3 steps on simulated tp=2 ranks: at
    parity with one process, and exactly the textbook collectives (no gather)."""
    from dynamo_dist.testing.zoo.cell import SimRuntime, run_cell
    from dynamo_dist.testing.zoo.models import MODELS

    row = run_cell(MODELS["gpt2"], "tp=2", SimRuntime())
    assert row["status"] == "parity", row.get("error") or row.get("trace")
    assert all(r["verdict"] == "=" for r in row["textbook"]), row["textbook"]
    assert not any(r["kind"] == "all_gather" for r in row["textbook"])


# ---------------------------------------------------------------------------------------------
# what is refused, and how
# ---------------------------------------------------------------------------------------------
def test_nested_strided_constraint_is_refused(fake_mesh):
    """Two mesh axes on one dim with a _StridedShard among them (DTensor's FSDP2-over-TP layout)
    is not lowered: pinning it inside a program is an error (it computed a wrong value)."""
    from dynamo_dist import with_sharding_constraint

    mesh = fake_mesh((2, 2), ("dp", "tp"))

    def f(x):
        return with_sharding_constraint(x * 2, mesh, [S0, SS(0, 2)]) + 1

    # checked by the backend (Dynamo cannot trace our raise), which names the user's line
    with pytest.raises(Exception, match="(?s)DistCompileError: .*block-strided") as err:
        torch.compile(f, backend="dist", options={"inductor": False})(torch.randn(16, 3))
    assert "fix" in str(err.value) and "'dp', 'tp'" in str(err.value)
    assert "test_strided.py" in str(err.value)


def test_shard_module_refuses_strided_blocks_that_do_not_split_evenly(fake_mesh):
    from dynamo_dist import DistCompileError
    from dynamo_dist.plans import ShardingPlan, shard_module

    mesh = fake_mesh((2,), ("tp",))
    model = nn.Linear(4, 9)  # 9 = 3 blocks of 3: a block does not split in 2
    with pytest.raises(DistCompileError, match="not 3 blocks each split evenly in 2") as err:
        shard_module(model, mesh, ShardingPlan(plan={"weight": {"tp": SS(0, 3)}}))
    assert "fix" in str(err.value)


class BmmAttention(nn.Module):
    """Attention written with ``bmm`` over heads merged into the batch ([B*H, T, d], as older
    models and hand-written kernels do): a head split of q/k/v is SS(0, B) on the merged dim."""

    def __init__(self, hidden=16, heads=4):
        super().__init__()
        self.nh = heads
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.o = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, t, h = x.shape
        d = h // self.nh

        def heads(z):
            return z.view(b, t, self.nh, d).transpose(1, 2).reshape(b * self.nh, t, d)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        att = torch.bmm(q, k.transpose(1, 2)).softmax(-1)
        y = torch.bmm(att, v).view(b, self.nh, t, d).transpose(1, 2).reshape(b, t, h)
        return self.o(y)


def test_heads_merged_into_the_batch_stay_split(fake_mesh):
    """DTensor's view rule makes [B, H] with H split into SS(0, B) on [B*H]; bmm passes it
    through and the view back gives Shard(1): Megatron's 1 all_reduce forward and 1 backward,
    values and gradients as one device."""
    from dynamo_dist.plans import ShardingPlan, shard_module

    mesh = fake_mesh((2,), ("tp",))
    torch.manual_seed(0)
    ref = BmmAttention()
    model = BmmAttention()
    model.load_state_dict(ref.state_dict())
    col = {"tp": S0}
    shard_module(model, mesh, ShardingPlan(plan={"q.*": col, "k.*": col, "v.*": col,
                                                 "o.weight": {"tp": S1}}))
    x, cot = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    xr = x.clone().requires_grad_()
    want = ref(xr)
    want_grads = torch.autograd.grad(want, [xr, *ref.parameters()], cot)
    torch._dynamo.reset()
    torch.compile(model, backend="dist", fullgraph=True, options={"inductor": False})(
        x.clone().requires_grad_())
    rec = compile_records()[-1]
    kinds = [(e.phase, e.kind) for e in rec.ledger.entries]
    assert kinds == [("forward", "all_reduce"), ("backward", "all_reduce")], rec.ledger.entries
    assert any("SS(0,2)" in fmt(n.output) for n in rec.plan.nodes.values()
               if n.op == "aten.bmm.default")
    names = dict(ref.named_parameters())
    by_input = []
    for info in rec.program.primal_inputs:
        flat = info.name.replace("modules_", "").replace("parameters_", "")
        by_input.append(next((n for n in names if flat.endswith(n.replace(".", "_") + "_")),
                             None))
    (got,), grads = run_spmd(rec, [x if k is None else names[k].detach() for k in by_input],
                             [cot], mesh)
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    want_of = dict(zip(["x", *names], want_grads))
    for k, g in zip(by_input, grads):
        torch.testing.assert_close(g, want_of[k or "x"], rtol=1e-4, atol=1e-5, msg=str(k))


def test_cost_walk_through_a_strided_state_lowering_never_holds():
    """[S(0), S(1)] -> [S(1), SS(0, 2)] on (4, 8): the cost walk passes [S(0), SS(0, 2)], which
    local_shape refuses (the 2-row piece does not split in 2 blocks of 2); pricing raised a
    ValueError from the planner (nn.functional.multi_head_attention_forward crashed on 2x2)."""
    cost = redistribute_cost((4, 8), torch.float32, (S0, S1), (S1, SS(0, 2)), (2, 2))
    assert cost > redistribute_cost((4, 8), torch.float32, (S0, S1), (S1, S0), (2, 2)) * 0.5


@pytest.mark.parametrize("rank", range(4))
@pytest.mark.parametrize("pls", [(R, SS(1, 3)), (SS(0, 2), R), (SS(1, 2), SS(0, 3))],
                         ids=["R,SS(1,3)", "SS(0,2),R", "SS(1,2),SS(0,3)"])
def test_a_strided_parameter_is_cut_as_dtensor_cuts_it(fake_mesh, rank, pls):
    """``shard_module`` cuts a ``_StridedShard`` parameter with lowering's own slicing (torch
    2.11's DTensor cannot redistribute to (Shard(0), _StridedShard(1, k))): each rank's piece is
    the definition's (the simulator's ``shard_global``) and the one DTensor's redistribute
    gives; the DTensor declares the global shape."""
    from torch.distributed.tensor import distribute_tensor

    import dynamo_dist.backend  # noqa: F401  (installs the patches)

    from dynamo_dist.plans.apply import _strided_parameter

    mesh = fake_mesh((2, 2), ("dp", "tp"), rank=rank)
    value = torch.arange(12 * 12, dtype=torch.float32).reshape(12, 12)
    got = _strided_parameter(value, mesh, pls)
    assert got.placements == pls and got.shape == value.shape
    assert got.to_local().is_contiguous()
    want = shard_global(value, pls, tuple(mesh.get_coordinate()), (2, 2))
    assert torch.equal(got.to_local(), want), (rank, fmt(pls))
    # (torch 2.11's own redistribute to these needs ``patches.install_strided_redistribute_
    # fallback``, installed with the backend)
    theirs = distribute_tensor(value, mesh, [R, R]).redistribute(mesh, pls)
    assert torch.equal(got.to_local(), theirs.to_local()), (rank, fmt(pls))


@pytest.mark.parametrize("dim,size", [(1, 12), (2, 4), (1, 11)])
def test_a_gather_on_a_later_dim_copies_once(fake_mesh, dim, size):
    """Shard(d) -> Replicate for d > 0: the local piece is gathered as it is (no transposed
    copy before the collective) and the ranks' stacked pieces are joined along d by one copy;
    the result is contiguous and equals the whole tensor on every rank (dim 1 of 11 over 2
    ranks: uneven, padded and cut)."""
    mesh = fake_mesh((2,), ("tp",))
    shape = [6, 12, 4]
    shape[dim] = size
    full = torch.randn(*shape, dtype=torch.float64)
    got, _, graphs = _redistribute_on_ranks(mesh, full, (Shard(dim),), (R,))
    for coord, x in got.items():
        assert torch.equal(x, full) and x.is_contiguous(), coord
    aten = torch.ops.aten
    for g in graphs.values():
        nodes = [n for n in g.graph.nodes if n.op == "call_function"]
        gather = next(k for k, n in enumerate(nodes) if "all_gather" in str(n.target))
        before = {n.target for n in nodes[:gather]}
        assert not before & {aten.permute.default, aten.clone.default}, before
        copies = [n for n in nodes[gather:] if n.target in (aten.clone.default,
                                                             aten.cat.default)]
        # uneven: the cut is made contiguous by a second copy (Inductor fuses the two)
        assert len(copies) == (2 if size % 2 else 1), [n.target for n in copies]
