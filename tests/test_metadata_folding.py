"""Distributed metadata inside a region compiled with ``backend="dist"``: each query is folded to
a constant at trace time (the Dynamo graph the backend receives holds no call to it and no mesh
or process-group input), guarded so that another mesh / group / placement recompiles and the
same one does not, and ``fullgraph=True`` compiles. Values are rank-dependent, so several ranks
of a `fake` process group are used. DTensor calls (placements, device_mesh, to_local, from_local,
redistribute, full_tensor) on a DTensor made outside: values on a 1-rank world (exact), shapes
and placements on 2 ranks (a fake group's collectives return garbage values).

The three gaps torch 2.13 leaves are closed in ``dynamo_dist.patches`` (section "distributed
metadata folded with correct guards"): dead ``mesh[name]`` slices, ProcessGroup guards, and
placement / Mesh ints made dynamic graph inputs."""

from __future__ import annotations

import operator
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import dynamo_dist.backend as backend_mod
from dynamo_dist import patches
from dynamo_dist.mesh import HybridMesh, Mesh
from inductor_passes.core import compat

ARITH = {operator.add, operator.mul, operator.sub, operator.neg}


@pytest.fixture
def graphs(monkeypatch):
    """Every Dynamo graph the dist backend receives (one per compile), in order."""
    seen: list[torch.fx.GraphModule] = []
    original = backend_mod._compile

    def recording(gm, example_inputs, *args, **kwargs):
        seen.append(gm)
        return original(gm, example_inputs, *args, **kwargs)

    monkeypatch.setattr(backend_mod, "_compile", recording)
    return seen


def dist_compile(fn, **options):
    options.setdefault("inductor", False)  # planning and lowering run; Inductor is tested once
    return torch.compile(fn, backend="dist", fullgraph=True, options=options)


def calls(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def assert_folded(gm: torch.fx.GraphModule, allowed=ARITH) -> None:
    """Only tensor arithmetic is left (the query is a constant in it), and every graph input is a
    tensor: no DeviceMesh / ProcessGroup / placement / int input."""
    assert set(calls(gm)) <= set(allowed), gm.code
    for n in gm.graph.find_nodes(op="placeholder"):
        assert isinstance(n.meta.get("example_value"), torch.Tensor), gm.code


def same(out, ref) -> None:
    assert type(out) is type(ref), (type(out), type(ref))
    torch.testing.assert_close(out, ref)


def check(fn, *args, graphs, allowed=ARITH):
    """Compile ``fn`` (fullgraph), compare with eager, check folding; returns the output."""
    out = dist_compile(fn)(*args)
    same(out, fn(*args))
    assert len(graphs) == 1
    assert_folded(graphs[-1], allowed)
    return out


X = torch.arange(4.0)


# ---------------------------------------------------------------- DeviceMesh (torch 2.13 folds)

@pytest.mark.parametrize("rank", [1, 2])
def test_mesh_size(fake_mesh, graphs, rank):
    mesh = fake_mesh((2, 2), ("dp", "tp"), rank=rank)

    def f(x):
        y = x * mesh.size() + mesh.size(1) * 10 + mesh.ndim * 100 + mesh.shape[0] * 1000
        return y if mesh.size() == 4 else -y

    out = check(f, X, graphs=graphs)
    assert out[0].item() == 2 * 10 + 2 * 100 + 2 * 1000


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_mesh_get_rank(fake_mesh, graphs, rank):
    mesh = fake_mesh((2, 2), ("dp", "tp"), rank=rank)

    def f(x):
        return x + mesh.get_rank() if mesh.get_rank() > 1 else x - mesh.get_rank()

    out = check(f, X, graphs=graphs)
    assert out[0].item() == (rank if rank > 1 else -rank)


@pytest.mark.parametrize("rank", [1, 2])
def test_mesh_get_local_rank(fake_mesh, graphs, rank):
    mesh = fake_mesh((2, 2), ("dp", "tp"), rank=rank)

    def f(x):
        y = x * 100 + mesh.get_local_rank("tp") * 10 + mesh.get_local_rank(0)
        return y if mesh.get_local_rank(mesh_dim="dp") == 0 else -y

    out = check(f, X, graphs=graphs)
    dp, tp = divmod(rank, 2)  # rank 1: (0, 1); rank 2: (1, 0)
    assert out[0].item() == (1 if dp == 0 else -1) * (tp * 10 + dp)


@pytest.mark.parametrize("rank", [1, 2])
def test_mesh_get_coordinate(fake_mesh, graphs, rank):
    mesh = fake_mesh((2, 2), ("dp", "tp"), rank=rank)

    def f(x):
        dp, tp = mesh.get_coordinate()
        return x + dp * 10 + tp if tp == 1 else x - dp * 10

    out = check(f, X, graphs=graphs)
    assert out[0].item() == {1: 1, 2: -10}[rank]


@pytest.mark.parametrize("rank", [1, 2])
def test_mesh_slicing_by_axis_name(fake_mesh, graphs, rank):
    """``mesh["tp"]`` is recorded as a call by torch 2.13; the dead call (and the mesh input it
    kept) is removed for dist, so the program stays a plain-tensor one (same output type as
    eager)."""
    mesh = fake_mesh((2, 2), ("dp", "tp"), rank=rank)

    def f(x):
        tp = mesh["tp"]
        y = x * tp.size() + tp.get_local_rank() * 10 + mesh["dp"].get_local_rank() * 100
        return y + 1000 if mesh["dp", "tp"].ndim == 2 else y

    out = check(f, X, graphs=graphs)
    dp, tp = divmod(rank, 2)
    assert out[0].item() == tp * 10 + dp * 100 + 1000


def test_mesh_slice_with_a_dtensor_on_another_slice(fake_mesh, graphs):
    """Before the fix: "inputs live on different device meshes" (the dead ``mesh["dp"]`` node
    kept the 2-D mesh as an input next to a DTensor on ``mesh["tp"]``)."""
    mesh = fake_mesh((2, 2), ("dp", "tp"), rank=3)
    x = distribute_tensor(torch.ones(4, 2), mesh["tp"], [Shard(0)])

    def f(x):
        return x * mesh["dp"].size() + mesh["tp"].get_group().size()

    out = dist_compile(f)(x)
    assert isinstance(out, DTensor) and out.placements == (Shard(0),) and out.shape == (4, 2)
    assert out.device_mesh == mesh["tp"]
    assert_folded(graphs[-1])


def test_mesh_dim_names(fake_mesh, graphs):
    mesh = fake_mesh((2, 2), ("dp", "tp"), rank=1)

    def f(x):
        names = mesh.mesh_dim_names
        y = x + names.index("tp") * 10 + len(names)
        return y if names[0] == "dp" and "tp" in names else -y

    out = check(f, X, graphs=graphs)
    assert out[0].item() == 12


@pytest.mark.parametrize("rank", [1, 2])
def test_mesh_get_group(fake_mesh, graphs, rank):
    mesh = fake_mesh((2, 2), ("dp", "tp"), rank=rank)

    def f(x):
        tp, dp = mesh.get_group("tp"), mesh.get_group(0)
        y = x + tp.size() * 100 + tp.rank() * 10 + dp.rank()
        return y + dist.get_rank(tp) * 1000 + dist.get_world_size(dp) * 10000

    out = check(f, X, graphs=graphs)
    dp, tp = divmod(rank, 2)
    assert out[0].item() == 200 + tp * 10 + dp + tp * 1000 + 20000


# ---------------------------------------------------------------- ProcessGroup

@pytest.mark.parametrize("rank", [1, 2])
def test_process_group_rank(fake_mesh, graphs, rank):
    mesh = fake_mesh((2, 2), ("dp", "tp"), rank=rank)
    world, dp = dist.group.WORLD, mesh.get_group("dp")

    def f(x):
        return x + world.rank() * 10 + dp.rank() if dp.rank() == 1 else x - world.rank()

    out = check(f, X, graphs=graphs)
    assert out[0].item() == {1: -1, 2: 21}[rank]


def test_process_group_size(fake_mesh, graphs):
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    world, tp = dist.group.WORLD, mesh.get_group("tp")

    def f(x):
        return x * world.size() + tp.size() if tp.size() < world.size() else x

    out = check(f, X, graphs=graphs)
    assert out[1].item() == 4 + 2


def test_process_group_group_name(fake_mesh, graphs):
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    tp = mesh.get_group("tp")
    name = tp.group_name

    def f(x):
        return x + len(tp.group_name) if tp.group_name == name else x - 1

    out = check(f, X, graphs=graphs)
    assert out[0].item() == len(name)


# ---------------------------------------------------------------- placements

@pytest.mark.parametrize("placement,expected", [(Shard(0), 3), (Shard(1), 2), (Replicate(), 3),
                                                (Partial(), 4)])
def test_placement_is_shard(fake_mesh, graphs, placement, expected):
    fake_mesh((2,), ("tp",))

    def f(x):
        if placement.is_shard():
            return x + 1 if placement.is_shard(dim=1) else x + 2
        return x * 3 if placement.is_replicate() else x * 4

    out = check(f, X, graphs=graphs)
    assert out[1].item() == expected


@pytest.mark.parametrize("placement,expected", [(Shard(0), 10), (Shard(1), 2), (Replicate(), 0)])
def test_placement_equality(fake_mesh, graphs, placement, expected):
    fake_mesh((2,), ("tp",))
    placements = (placement, Replicate())

    def f(x):
        y = x + 1 if placement == Shard(1) else x
        y = y * 2 if placement != Replicate() else y
        return y + 10 if placements == (Shard(0), Replicate()) else y

    out = check(f, X, graphs=graphs)
    assert out[0].item() == expected


@pytest.mark.parametrize("dim", [0, 1])
def test_placement_dim(fake_mesh, graphs, dim):
    fake_mesh((2,), ("tp",))
    placement = Shard(dim)

    def f(x):
        return x + placement.dim * 10 if placement.dim > 0 else x - 1

    out = check(f, X, graphs=graphs)
    assert out[0].item() == (10 if dim else -1)


# ---------------------------------------------------------------- torch.distributed

@pytest.mark.parametrize("rank", [0, 3])
def test_dist_get_rank(fake_mesh, graphs, rank):
    mesh = fake_mesh((2, 2), ("dp", "tp"), rank=rank)
    tp = mesh.get_group("tp")

    def f(x):
        y = x + dist.get_rank() * 10 + dist.get_rank(tp)
        return y if dist.get_rank() == rank else -y

    out = check(f, X, graphs=graphs)
    assert out[0].item() == rank * 10 + rank % 2


def test_dist_get_world_size(fake_mesh, graphs):
    mesh = fake_mesh((2, 2), ("dp", "tp"), rank=2)
    dp = mesh.get_group("dp")

    def f(x):
        y = x * dist.get_world_size() + dist.get_world_size(group=dp)
        return y if dist.get_world_size() > 1 else -y

    out = check(f, X, graphs=graphs)
    assert out[1].item() == 4 + 2


# ---------------------------------------------------------------- dynamo_dist Mesh

def _mesh(shape=(2, 2), names=("dp", "tp")):
    return Mesh(list(range(4)), shape, names)


def test_our_mesh_size(fake_mesh, graphs):
    fake_mesh((2, 2), ("dp", "tp"))
    m = _mesh()

    def f(x):
        return x * m.size() if m.size() == 4 else x

    out = check(f, X, graphs=graphs)
    assert out[1].item() == 4


def test_our_mesh_shape(fake_mesh, graphs):
    fake_mesh((2, 2), ("dp", "tp"))
    m = _mesh((4, 1))

    def f(x):
        shape = m.shape()
        y = x
        for k, (name, size) in enumerate(shape.items()):
            y = y + size * 10 ** k
        return y * 2 if shape["dp"] == 4 else y

    out = check(f, X, graphs=graphs)
    assert m.shape() == OrderedDict(dp=4, tp=1) and out[0].item() == 2 * (4 + 10)


def test_our_mesh_get_axis_name_idx(fake_mesh, graphs):
    fake_mesh((2, 2), ("dp", "tp"))
    m = _mesh()

    def f(x):
        y = x + m.get_axis_name_idx("tp") * 10
        return y if m.get_axis_name_idx("ep") is None else -y

    out = check(f, X, graphs=graphs)
    assert out[0].item() == 10


def test_our_mesh_axis_names(fake_mesh, graphs):
    fake_mesh((2, 2), ("dp", "tp"))
    m = _mesh()

    def f(x):
        return x + len(m.axis_names) if m.axis_names[1] == "tp" else x

    out = check(f, X, graphs=graphs)
    assert out[0].item() == 2


def test_our_mesh_mesh_shape(fake_mesh, graphs):
    fake_mesh((2, 2), ("dp", "tp"))
    m = HybridMesh(ici_mesh_shape=(1, 2), dcn_mesh_shape=(2, 1), axis_names=("dp", "tp"))

    def f(x):
        dp, tp = m.mesh_shape
        return x * dp + tp * 10 if m.mesh_shape == (2, 2) else x

    out = check(f, X, graphs=graphs)
    assert out[1].item() == 2 + 20


# ---------------------------------------------------------------- guards and recompiles

def test_device_mesh_argument_recompiles_only_for_another_mesh(fake_mesh, graphs):
    mesh = fake_mesh((2, 2), ("dp", "tp"), rank=2)
    same_layout = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    other_shape = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))
    other_names = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))

    def f(x, m):
        return x * m.size(1) + m.get_local_rank(0) * 10 + len(m.mesh_dim_names[0]) * 100

    c = dist_compile(f)
    expected_compiles = [1, 1, 2, 3, 3]
    for m, n in zip([mesh, same_layout, other_shape, other_names, mesh], expected_compiles):
        same(c(X, m), f(X, m))
        assert len(graphs) == n, (m, len(graphs))
    for gm in graphs:
        assert_folded(gm)


_GLOBAL_MESH = None


def test_global_mesh_slice_keeps_its_guard(fake_mesh, graphs):
    """The mesh input goes with the dead slice, its guard stays: rebinding the global recompiles."""
    global _GLOBAL_MESH
    _GLOBAL_MESH = fake_mesh((2, 2), ("dp", "tp"), rank=2)
    other = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "tp"))

    def f(x):
        return x * _GLOBAL_MESH["tp"].size() + _GLOBAL_MESH["tp"].get_local_rank()

    try:
        c = dist_compile(f)
        same(c(X), f(X))
        same(c(X), f(X))
        assert len(graphs) == 1
        _GLOBAL_MESH = other
        same(c(X), f(X))
        assert len(graphs) == 2 and c(X)[0].item() == 2  # tp size 4, local rank 2
    finally:
        _GLOBAL_MESH = None
    for gm in graphs:
        assert_folded(gm)


def test_placement_argument_recompiles_only_for_another_placement(fake_mesh, graphs):
    """Before the fix the second Shard made ``p.dim`` a dynamic int input, which dist rejects."""
    fake_mesh((2,), ("tp",))

    def f(x, p):
        return x + (p.dim + 1) * 10 if p.is_shard() else x - 1

    c = dist_compile(f)
    for p, n in zip([Shard(0), Shard(0), Shard(1), Replicate(), Shard(1), Shard(2)],
                    [1, 1, 2, 3, 3, 4]):
        same(c(X, p), f(X, p))
        assert len(graphs) == n, (p, len(graphs))
    for gm in graphs:
        assert_folded(gm)


@pytest.mark.parametrize("how", ["methods", "dist_functions"])
def test_process_group_argument_recompiles_for_another_group(fake_mesh, graphs, how):
    """torch 2.13 guards a ProcessGroup on its type only: the dp group (rank 1 here) reused the
    tp group's (rank 0) folded values. Our guard_fn (name, rank, size) recompiles."""
    mesh = fake_mesh((2, 2), ("dp", "tp"), rank=2)
    tp, dp = mesh.get_group("tp"), mesh.get_group("dp")

    if how == "methods":
        def f(x, g):
            return x + g.rank() * 10 + g.size()
    else:
        def f(x, g):
            return x + dist.get_rank(g) * 10 + dist.get_world_size(g)

    c = dist_compile(f)
    for g, n in zip([tp, tp, dp, dist.group.WORLD, dp], [1, 1, 2, 3, 3]):
        same(c(X, g), f(X, g))
        assert len(graphs) == n
    assert c(X, dp)[0].item() == 12 and c(X, tp)[0].item() == 2
    for gm in graphs:
        assert_folded(gm)


def test_our_mesh_argument_recompiles_only_for_another_mesh(fake_mesh, graphs):
    """Before the fix the second mesh shape made ``m.mesh_shape[0]`` a dynamic int input."""
    fake_mesh((2, 2), ("dp", "tp"))

    def f(x, m):
        return x * m.size() + m.mesh_shape[0] * 10 + m.get_axis_name_idx(m.axis_names[1]) * 100

    c = dist_compile(f)
    meshes = [_mesh(), _mesh(), _mesh((4, 1)), _mesh((2, 2), ("a", "b")), _mesh((4, 1))]
    for m, n in zip(meshes, [1, 1, 2, 3, 3]):
        same(c(X, m), f(X, m))
        assert len(graphs) == n, (m, len(graphs))
    for gm in graphs:
        assert_folded(gm)


def test_dtensor_argument_recompiles_for_another_placement(fake_mesh, graphs):
    mesh = fake_mesh((2,), ("tp",))
    t = torch.ones(4, 4)

    def f(x):
        p = x.placements[0]
        return x * (p.dim + 1) if p.is_shard() else x * 10

    c = dist_compile(f)
    for pl, n in zip([Shard(0), Shard(0), Shard(1), Replicate(), Shard(1)], [1, 1, 2, 3, 3]):
        out = c(distribute_tensor(t, mesh, [pl]))
        assert out.placements == (pl,) and out.shape == (4, 4)
        assert len(graphs) == n
    for gm in graphs:
        assert_folded(gm)


def test_support_is_installed_once():
    """The three Dynamo additions are in place on this torch, and installing again stacks none."""
    from torch._dynamo.output_graph import OutputGraph
    from torch._dynamo.variables.user_defined import UserDefinedObjectVariable
    from torch._library.opaque_object import get_opaque_obj_info

    patched = (OutputGraph.remove_unused_graphargs, UserDefinedObjectVariable.var_getattr)
    assert patches.install_dead_mesh_lookup_removal()
    assert patches.install_process_group_guard()
    assert patches.install_metadata_attr_folding()
    assert (OutputGraph.remove_unused_graphargs, UserDefinedObjectVariable.var_getattr) == patched
    assert all(getattr(fn, "_dynamo_dist_patch", False) for fn in patched)
    info = get_opaque_obj_info(dist.ProcessGroup)
    assert info.guard_fn is patches.process_group_guard_values


# ---------------------------------------------------------------- DTensor calls

@pytest.fixture
def one_rank(fake_mesh):
    """1-rank world: DTensor values are exact (collectives are identities)."""
    mesh = fake_mesh((1,), ("tp",))
    compat.allow_implicit_replication(True)
    return mesh, torch.arange(8.0).reshape(4, 2)


@pytest.fixture
def two_ranks(fake_mesh):
    """2-rank world, this process rank 1: shapes and placements (values are garbage)."""
    mesh = fake_mesh((2,), ("tp",), rank=1)
    compat.allow_implicit_replication(True)
    return mesh, torch.arange(8.0).reshape(4, 2)


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def test_dtensor_placements(one_rank, graphs):
    mesh, t = one_rank

    def f(x):
        p = x.placements[0]
        return x * 2 + (p.dim + 1 if p.is_shard() and x.placements == (Shard(0),) else 100)

    x = distribute_tensor(t, mesh, [Shard(0)])
    out = dist_compile(f)(x)
    assert isinstance(out, DTensor) and out.placements == (Shard(0),)
    torch.testing.assert_close(out.full_tensor(), t * 2 + 1)
    assert_folded(graphs[-1])


def test_dtensor_placements_two_ranks(two_ranks, graphs):
    mesh, t = two_ranks

    def f(x):
        return x.redistribute(mesh, [Replicate()]) if x.placements[0].is_shard() else x * 2

    out = dist_compile(f)(distribute_tensor(t, mesh, [Shard(1)]))
    assert out.placements == (Replicate(),) and out.to_local().shape == (4, 2)
    assert "redistribute" in calls(graphs[-1])  # the branch taken: Shard(1) is a shard


def test_dtensor_device_mesh(one_rank, graphs):
    mesh, t = one_rank

    def f(x):
        m = x.device_mesh
        return x * (m.size() + 1) + m.get_local_rank() if m == mesh else x

    out = dist_compile(f)(distribute_tensor(t, mesh, [Shard(0)]))
    torch.testing.assert_close(out.full_tensor(), t * 2)
    assert_folded(graphs[-1])


def test_dtensor_device_mesh_two_ranks(two_ranks, graphs):
    mesh, t = two_ranks

    def f(x):
        return x * x.device_mesh.size() + x.device_mesh.get_local_rank()

    x = distribute_tensor(t, mesh, [Shard(0)])
    out = dist_compile(f)(x)
    assert out.placements == (Shard(0),) and out.to_local().shape == (2, 2)
    assert_folded(graphs[-1])
    assert [n.name for n in graphs[-1].graph.find_nodes(op="placeholder")] == ["l_x_"]
    add = next(n for n in graphs[-1].graph.nodes if n.target is operator.add)
    assert add.args[1] == 1  # this rank's local rank, folded


def test_dtensor_to_local(one_rank):
    mesh, t = one_rank
    x = distribute_tensor(t, mesh, [Shard(0)])

    out = dist_compile(lambda x: x.to_local())(x)
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, t)
    f = lambda x: (x * 2).redistribute(mesh, [Shard(1)]).to_local() + 1  # noqa: E731
    out = dist_compile(f)(x)
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, t * 2 + 1)


def test_dtensor_to_local_two_ranks(two_ranks):
    mesh, t = two_ranks
    x = distribute_tensor(t, mesh, [Shard(0)])
    assert dist_compile(lambda x: x.to_local())(x).shape == (2, 2)
    f = lambda x: (x * 2).redistribute(mesh, [Shard(1)]).to_local()  # noqa: E731
    out = dist_compile(f)(x)
    assert type(out) is torch.Tensor and out.shape == (4, 1)


def test_dtensor_from_local(one_rank):
    mesh, t = one_rank

    def f(local):
        return DTensor.from_local(local, mesh, [Shard(0)]) * 2

    out = dist_compile(f)(t.clone())
    ref = f(t.clone())
    assert isinstance(out, DTensor) and out.placements == ref.placements == (Shard(0),)
    torch.testing.assert_close(out.full_tensor(), ref.full_tensor())


def test_dtensor_from_local_two_ranks(two_ranks):
    mesh, t = two_ranks
    local = t[2:]  # rank 1's rows

    out = dist_compile(lambda loc: DTensor.from_local(loc, mesh, [Shard(0)]))(local)
    assert out.placements == (Shard(0),) and out.shape == (4, 2)
    assert out.to_local().shape == (2, 2)
    x = distribute_tensor(t, mesh, [Shard(0)])  # a manual region: to_local -> local code -> back
    f = lambda x: DTensor.from_local(x.to_local() * 2, mesh, [Shard(0)])  # noqa: E731
    out = dist_compile(f)(x)
    assert out.placements == (Shard(0),) and out.shape == (4, 2)


def test_dtensor_redistribute(one_rank):
    mesh, t = one_rank
    x = distribute_tensor(t, mesh, [Shard(0)])
    for pls in ([Replicate()], [Shard(1)]):
        out = dist_compile(lambda x: (x * 2).redistribute(mesh, pls))(x)
        assert out.placements == tuple(pls)
        torch.testing.assert_close(out.full_tensor(), t * 2)
        torch._dynamo.reset()


def test_dtensor_redistribute_two_ranks(two_ranks):
    mesh, t = two_ranks
    x = distribute_tensor(t, mesh, [Shard(0)])
    out = dist_compile(lambda x: (x * 2).redistribute(placements=[Shard(1)]))(x)
    assert out.placements == (Shard(1),) and out.shape == (4, 2) and out.to_local().shape == (4, 1)


def test_dtensor_full_tensor(one_rank):
    mesh, t = one_rank
    x = distribute_tensor(t, mesh, [Shard(0)])
    out = dist_compile(lambda x: (x + 1).full_tensor())(x)
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, t + 1)


def test_dtensor_full_tensor_two_ranks(two_ranks):
    mesh, t = two_ranks
    x = distribute_tensor(t, mesh, [Shard(1)])
    out = dist_compile(lambda x: (x + 1).full_tensor())(x)
    assert type(out) is torch.Tensor and out.shape == (4, 2)


# ---------------------------------------------------------------- end to end, with Inductor

def test_queries_together_with_inductor(fake_mesh, graphs):
    mesh = fake_mesh((2, 2), ("dp", "tp"), rank=1)
    m = Mesh.from_device_mesh(mesh)
    tp = mesh.get_group("tp")

    def f(x, p):
        y = x * mesh["tp"].size() + mesh.get_coordinate()[1] + dist.get_rank(tp) * 10
        y = y + m.shape()["dp"] * 100 + (1000 if p.is_shard() and p.dim == 0 else 0)
        return y + dist.get_world_size() * 10000 + len(mesh.mesh_dim_names) * 100000

    out = dist_compile(f, inductor=True)(X, Shard(0))
    same(out, f(X, Shard(0)))
    assert out[0].item() == 1 + 10 + 200 + 1000 + 40000 + 200000
    assert_folded(graphs[-1])
