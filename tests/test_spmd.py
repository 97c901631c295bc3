"""The torch_xla-style front end: Mesh / HybridMesh helpers, partition spec <-> placements,
mark_sharding as one annotation node inside a compiled graph, manual regions' plan and errors,
and the slow-axis price of a HybridMesh. Numerics on real ranks: tests/mp/spmd_api.py."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import dynamo_dist
from dynamo_dist import (DistCompileError, HybridMesh, Mesh, enable_manual_sharding, get_1d_mesh,
                         get_global_mesh, mark_sharding, partition_spec_to_placements,
                         placements_to_partition_spec, set_global_mesh)
from inductor_passes.core.annotation_ops import CONSTRAINT_OP, ENTER_OP, EXIT_OP, gradient_spec
from inductor_passes.sharding.cost import redistribute_cost
from inductor_passes.sharding.rules import RuleKind


def test_mesh_helpers(fake_mesh):
    fake_mesh((4,), ("all",))
    mesh = Mesh([3, 1, 0, 2], (2, 2), ("dp", "tp"))
    assert mesh.size() == 4
    assert list(mesh.shape().items()) == [("dp", 2), ("tp", 2)]
    assert mesh.get_logical_mesh().tolist() == [[3, 1], [0, 2]]
    assert mesh.get_axis_name_idx("tp") == 1 and mesh.get_axis_name_idx("pp") is None
    dm = mesh.to_device_mesh()
    assert dm.mesh.tolist() == [[3, 1], [0, 2]] and dm.mesh_dim_names == ("dp", "tp")
    assert Mesh.from_device_mesh(dm) == mesh
    one = get_1d_mesh("data")
    assert one.mesh_shape == (4,) and one.axis_names == ("data",)
    set_global_mesh(mesh)
    assert get_global_mesh() is mesh
    with pytest.raises(ValueError, match="3 device ids for mesh shape"):
        Mesh([0, 1, 2], (2, 2))
    with pytest.raises(ValueError, match="unique names"):
        Mesh([0, 1, 2, 3], (2, 2), ("x", "x"))


def test_hybrid_mesh_layout_and_slow_axes(fake_mesh):
    fake_mesh((8,), ("all",))
    mesh = HybridMesh(ici_mesh_shape=(1, 4), dcn_mesh_shape=(2, 1), axis_names=("dp", "tp"))
    # two slices of 4 consecutive ranks; dp crosses slices (DCN), tp stays inside one (ICI)
    assert mesh.get_logical_mesh().tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh.axis_slowdown[0] > 1.0 and mesh.axis_slowdown[1] == 1.0
    dm = mesh.to_device_mesh()
    assert dynamo_dist.mesh.axis_slowdown(dm) == mesh.axis_slowdown
    both = HybridMesh(ici_mesh_shape=(2, 2), dcn_mesh_shape=(2, 1))
    # axis 0 = (slice, in-slice row): ranks of one slice are consecutive
    assert both.get_logical_mesh().tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # the cost model prices the same all_reduce higher on the slow axis
    shape, pls = (1024, 1024), (Partial(), Replicate())
    fast = redistribute_cost(shape, torch.float32, (Replicate(), Partial()),
                             (Replicate(), Replicate()), (2, 4), weights=mesh.axis_slowdown)
    slow = redistribute_cost(shape, torch.float32, pls, (Replicate(), Replicate()), (2, 4),
                             weights=mesh.axis_slowdown)
    assert slow > 3 * fast


def _mlp_ledger(mesh):
    dm = mesh.to_device_mesh()
    rep = [Replicate(), Replicate()]
    x, w1, w2 = (distribute_tensor(torch.randn(*s), dm, rep)
                 for s in ((256, 1024), (1024, 4096), (4096, 1024)))
    torch._dynamo.reset()
    torch.compile(lambda x, w1, w2: mark_sharding(torch.relu(x @ w1) @ w2, mesh, (None, None)),
                  backend="dist")(x, w1, w2)
    return {(e.kind, e.mesh_axis) for e in dynamo_dist.compile_records()[-1].ledger.entries}


def test_hybrid_mesh_keeps_collectives_off_the_slow_axis(fake_mesh):
    """Two matmuls on replicated weights: the flop price makes the planner split the work on
    both axes of a flat 2x2 mesh (and reduce on both); when axis b crosses slices (DCN), it
    splits on the fast axis only."""
    fake_mesh((4,), ("all",))
    flat = _mlp_ledger(Mesh([0, 1, 2, 3], (2, 2), ("a", "b")))
    assert {axis for _, axis in flat} == {"a", "b"}, flat
    hybrid = _mlp_ledger(HybridMesh(ici_mesh_shape=(2, 1), dcn_mesh_shape=(1, 2),
                                    axis_names=("a", "c")))
    assert hybrid and {axis for _, axis in hybrid} == {"a"}, hybrid


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([None, "dp", "tp", ("dp", "tp")]), min_size=1, max_size=3))
def test_partition_spec_round_trip(spec):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    dm = _mesh_2x2(DeviceMesh)
    used = [a for e in spec for a in (e if isinstance(e, tuple) else (e,)) if a]
    if len(used) != len(set(used)):
        with pytest.raises(ValueError, match="used twice"):
            partition_spec_to_placements(dm, spec, len(spec))
        return
    pls = partition_spec_to_placements(dm, spec, len(spec))
    assert tuple(placements_to_partition_spec(dm, pls, len(spec))) == tuple(spec)
    for axis, name in enumerate(("dp", "tp")):
        dims = [d for d, e in enumerate(spec) if name == e or (isinstance(e, tuple) and name in e)]
        assert pls[axis] == (Shard(dims[0]) if dims else Replicate())


_MESH = {}


def _mesh_2x2(DeviceMesh):
    if "m" not in _MESH:
        _MESH["m"] = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("dp", "tp"))
    return _MESH["m"]


def test_partition_spec_errors(fake_mesh):
    dm = fake_mesh((2, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match="out of mesh order"):
        partition_spec_to_placements(dm, (("tp", "dp"), None), 2)
    with pytest.raises(ValueError, match="unknown mesh axis 'sp'"):
        partition_spec_to_placements(dm, ("sp", None), 2)
    with pytest.raises(ValueError, match=r"for a 3-D tensor on mesh axes \['dp', 'tp'\]: 2 entries; "
                                         r"fix: give one entry per tensor dim"):
        partition_spec_to_placements(dm, ("dp", None), 3)
    with pytest.raises(ValueError, match="Partial on mesh axis 0"):
        placements_to_partition_spec(dm, (Partial(), Replicate()), 2)


class _Graphs:
    """A backend that records Dynamo's graphs, then compiles them with dist."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return dynamo_dist.dist_backend(gm, example_inputs)


def test_mark_sharding_in_compiled_code_is_one_annotation_node(fake_mesh):
    fake_mesh((2,), ("tp",))
    mesh = Mesh([0, 1], (2,), ("tp",))
    rec = _Graphs()

    def f(x, spec):
        y = mark_sharding(x * 2, mesh, spec)
        return y.sin().sum()

    fn = torch.compile(f, backend=rec, fullgraph=True)
    fn(torch.randn(8, 4), ("tp", None))
    fn(torch.randn(8, 4), ("tp", None))
    assert len(rec.graphs) == 1  # same spec: no recompile
    nodes = [n for n in rec.graphs[0].graph.nodes if n.target is CONSTRAINT_OP]
    assert len(nodes) == 1 and nodes[0].args[1].endswith("|[S(0)]")
    plan = dynamo_dist.compile_records()[-1].plan
    constraint = next(n for n in plan.nodes.values() if n.kind is RuleKind.CONSTRAINT)
    assert constraint.output == (Shard(0),)
    fn(torch.randn(8, 4), (None, "tp"))
    assert len(rec.graphs) == 2  # a new spec: a new graph
    assert [n for n in rec.graphs[1].graph.nodes
            if n.target is CONSTRAINT_OP][0].args[1].endswith("|[S(1)]")


def test_manual_region_is_planned_local_and_replicated(fake_mesh):
    fake_mesh((2,), ("tp",))
    mesh = Mesh([0, 1], (2,), ("tp",))

    def f(x):
        local = enable_manual_sharding(x, ("tp", None), mesh=mesh)
        assert local.shape == (4, 6)  # Dynamo sees the local shape
        out = dynamo_dist.disable_manual_sharding(local.exp() + 1, ("tp", None), (8, 6),
                                                  mesh=mesh)
        return out.sum()

    torch.compile(f, backend="dist", fullgraph=True)(torch.randn(8, 6, requires_grad=True))
    record = dynamo_dist.compile_records()[-1]
    gm, plan = record.program.graph_module, record.plan
    enters = [n for n in gm.graph.nodes if n.target is ENTER_OP]
    exits = [n for n in gm.graph.nodes if n.target is EXIT_OP]
    assert len(enters) == 2 and len(exits) == 2  # forward and the gradient's way back
    inside = [n for n in gm.graph.nodes if n.meta.get("dynamo_dist_manual")]
    assert {n.target for n in inside} >= {torch.ops.aten.exp.default}
    for n in inside:
        assert plan.nodes[n.name].kind is RuleKind.MANUAL
        assert plan.placement(n.name) == (Replicate(),)
    assert plan.nodes[enters[0].name].inputs == ((Shard(0),),)
    assert not any(e.node in {n.name for n in inside} for e in record.ledger.entries)


def test_gradient_spec_at_region_boundaries(fake_mesh):
    dm = fake_mesh((2, 2), ("dp", "tp"))
    from inductor_passes.core.annotation_ops import decode_spec, encode_spec

    spec = encode_spec(dm, (Shard(1), Replicate()))
    assert decode_spec(gradient_spec(spec, entering=True))[1] == (Shard(1), Partial("sum"))
    assert decode_spec(gradient_spec(spec, entering=False))[1] == (Shard(1), Replicate())
    assert decode_spec(gradient_spec(encode_spec(dm, (Partial(), Shard(0))), True))[1] == \
        (Replicate(), Shard(0))


def test_manual_region_errors_are_clear(fake_mesh):
    dm = fake_mesh((2,), ("tp",))
    mesh = Mesh.from_device_mesh(dm)

    def uneven(x):
        return enable_manual_sharding(x, ("tp",), mesh=mesh).sum()

    with pytest.raises(Exception, match="splits a tensor of global shape \\(5,\\) unevenly"):
        torch.compile(uneven, backend="dist", fullgraph=True)(torch.randn(5))



def test_to_local_of_a_planned_value_reads_what_eager_sees(fake_mesh):
    """to_local() of a value the planner places (no redistribute before it) is read in the
    placement eager DTensor gives it, which is what the program observes while Dynamo traces
    and what branches on ``.placements`` in the user's code (parallelize_module's hooks,
    torchtitan's asserts) see: Shard(0) for a row-split weight times a replicated input (it
    read Replicate while tracing, and the local value was the whole product)."""
    dm = fake_mesh((2,), ("tp",))
    w = distribute_tensor(torch.randn(4, 4), dm, [Shard(0)])
    x = distribute_tensor(torch.randn(4, 4), dm, [Replicate()])

    def unplanned(w, x):
        y = w @ x
        assert y.placements == (Shard(0),)  # as eagerly, also while Dynamo traces
        return y.to_local() * 2

    want = unplanned(w, x)
    out = torch.compile(unplanned, backend="dist", fullgraph=True)(w, x)
    assert not isinstance(out, DTensor) and out.shape == want.shape == (2, 4)
    torch.testing.assert_close(out, want)
    plan = dynamodist_plan()
    enter = next(n for n in plan.nodes if n.startswith("enter_manual"))
    assert plan.nodes[enter].inputs == ((Shard(0),),)


def dynamodist_plan():
    return dynamo_dist.compile_records()[-1].plan


def test_eager_mark_sharding_returns_the_dtensor(fake_mesh):
    fake_mesh((2,), ("tp",))
    mesh = Mesh([0, 1], (2,), ("tp",))
    x = torch.arange(8.0).reshape(4, 2)
    d = mark_sharding(x, mesh, ("tp", None))
    assert isinstance(d, DTensor) and d.placements == (Shard(0),)
    assert torch.equal(d.to_local(), x[:2])  # rank 0's piece: a slice, no communication
    assert dynamo_dist.spmd.input_annotation(x)[1] == (Shard(0),)
    dynamo_dist.clear_sharding(x)
    assert dynamo_dist.spmd.input_annotation(x) is None
    with pytest.raises(DistCompileError, match="Shard\\(2\\)"):
        mark_sharding(x, mesh, [Shard(2)])
