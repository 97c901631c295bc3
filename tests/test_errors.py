"""Bad input gets a clear error naming the tensor, its shape, the mesh and the placements."""

import pytest
import torch
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.placement_types import Replicate, Shard

from dynamo_dist import DistCompileError, compile_records
from dynamo_dist.plans import PartitionSpec, ShardingPlan, shard_module


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 8)

    def forward(self, x):
        return self.fc(x).sum()


def test_shard_dim_out_of_range(fake_mesh):
    mesh = fake_mesh((2,), ("tp",))
    with pytest.raises(DistCompileError) as e:
        shard_module(Tiny(), mesh, ShardingPlan(plan={"fc.weight": {"tp": Shard(5)}}))
    msg = str(e.value)
    assert "fc.weight" in msg and "Shard(5)" in msg and "(8, 4)" in msg
    assert "tp=2" in msg and "fix:" in msg


def test_unknown_mesh_axis(fake_mesh):
    mesh = fake_mesh((2,), ("tp",))
    with pytest.raises(DistCompileError) as e:
        shard_module(Tiny(), mesh, ShardingPlan(plan={"fc.weight": {"dp": Shard(0)}}))
    assert "unknown mesh axis 'dp'" in str(e.value) and "['tp']" in str(e.value)
    with pytest.raises(DistCompileError):
        shard_module(Tiny(), mesh, ShardingPlan(plan={"fc.weight": PartitionSpec("sp", None)}))


def test_uneven_parameter_split_is_kept_and_planned(fake_mesh):
    """8 over 3 ranks: pieces 3, 3, 2 (torch.chunk's), planned as such, not replicated."""
    mesh = fake_mesh((3,), ("tp",))
    m = shard_module(Tiny(), mesh, ShardingPlan(plan={"fc.bias": {"tp": Shard(0)},
                                                      "fc.weight": {"tp": Shard(0)}}))
    assert tuple(m.fc.bias.placements) == (Shard(0),) and m.fc.bias.to_local().shape == (3,)
    torch.compile(m, backend="dist", options={"inductor": False})(torch.randn(2, 4))
    plan = compile_records()[-1].plan
    assert not plan.fallbacks, plan.fallbacks
    assert any(n.output == (Shard(1),) for n in plan.nodes.values())  # the 2 x 8 output


def test_partition_spec_converts_to_placements(fake_mesh):
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    m = shard_module(Tiny(), mesh, ShardingPlan(plan={"fc.weight": PartitionSpec("tp", "dp")}))
    assert tuple(m.fc.weight.placements) == (Shard(1), Shard(0))
    assert tuple(m.fc.bias.placements) == (Replicate(), Replicate())


def test_tensors_on_different_meshes(fake_mesh):
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    a = distribute_tensor(torch.randn(4, 4), mesh["dp"], [Shard(0)])
    b = distribute_tensor(torch.randn(4, 4), mesh["tp"], [Shard(0)])
    from dynamo_dist.capture import classify_inputs, find_mesh

    class G:  # a graph stand-in with two placeholders
        graph = torch.fx.Graph()
    G.graph.placeholder("a")
    G.graph.placeholder("b")
    with pytest.raises(DistCompileError) as e:
        find_mesh(classify_inputs(G, [a, b]), [a, b])
    assert "different device meshes" in str(e.value) and "'a'" in str(e.value)


def test_in_place_update_of_a_parameter_is_rejected(fake_mesh):
    """Buffers may be updated in place (tests/test_mutation.py); a tensor that requires grad may
    not: autograd through an input mutation is not supported."""
    mesh = fake_mesh((2,), ("tp",))
    m = shard_module(Tiny(), mesh, ShardingPlan(plan={"fc.weight": {"tp": Shard(0)}}))
    m.register_buffer("steps", torch.zeros(()))

    def step(x):
        m.steps.add_(1)  # fine: a buffer
        with torch.no_grad():
            m.fc.bias.mul_(0.5)  # a parameter (requires grad) updated inside the program
        return m(x)

    with pytest.raises(Exception) as e:
        torch.compile(step, backend="dist", options={"inductor": False})(torch.randn(2, 4))
    assert "in place" in str(e.value) and "input mutation" in str(e.value)
    assert "fc" in str(e.value) and "fix:" in str(e.value)


def test_annotations_validate_at_call_time(fake_mesh):
    """Bad annotations fail where they are written, naming the argument and a fix: a negative
    dim out of range is not normalised into range first (Shard(-3) of a 2-D tensor became
    Shard(-1), then a pad error); Partial('prod') is refused up front (it failed at the first
    call); a list or a number is a TypeError (it was "'list' object has no attribute 'ndim'")."""
    from torch.distributed.tensor import Partial

    from dynamo_dist import mark_sharding, with_sharding_constraint

    mesh = fake_mesh((2,), ("tp",))
    x = torch.randn(4, 6)
    with pytest.raises(DistCompileError, match=r"Shard\(-3\) on mesh axis 'tp' but the tensor "
                                               r"has 2 dims") as e:
        with_sharding_constraint(x, mesh, [Shard(-3)])
    assert "fix:" in str(e.value) and "(4, 6)" in str(e.value)

    def pinned(t):
        return with_sharding_constraint(t * 2, mesh, [Shard(-3)]) + 1

    # inside a program the backend checks the pin (Dynamo cannot trace our raise) and names
    # the user's line; Dynamo wraps a backend's error
    with pytest.raises(Exception, match=r"(?s)DistCompileError: .*Shard\(-3\).*"
                                        r"test_errors.py.*fix:"):
        torch.compile(pinned, backend="dist", fullgraph=True, options={"inductor": False})(x)
    with pytest.raises(DistCompileError,
                       match=r"(?s)Partial\('prod'\) on mesh axis 'tp'.*fix:"):
        with_sharding_constraint(x, mesh, [Partial("prod")])
    for bad in ([1.0, 2.0], 1.5):
        with pytest.raises(TypeError, match=r"(?s)mark_sharding: the value to annotate must be a "
                                            r"torch.Tensor.*fix:"):
            mark_sharding(bad, mesh, ("tp",))
        with pytest.raises(TypeError, match="with_sharding_constraint: .*torch.Tensor"):
            with_sharding_constraint(bad, mesh, [Shard(0)])


@pytest.mark.parametrize("compiled", [False, True])
def test_disable_manual_sharding_checks_full_shape(fake_mesh, compiled):
    """A full_shape the local pieces do not make up is an error on every rank (it returned an
    inconsistent DTensor); the right one round-trips."""
    from dynamo_dist import disable_manual_sharding, enable_manual_sharding

    mesh = fake_mesh((2,), ("tp",))
    x = torch.randn(4, 6)

    def f(h, full):
        local = enable_manual_sharding(h, ("tp", None), mesh=mesh)
        return disable_manual_sharding(local * 2, ("tp", None), full, mesh=mesh)

    run = torch.compile(f, backend="dist", options={"inductor": False}) if compiled else f
    assert tuple(run(x, (4, 6)).shape) == (4, 6)
    for wrong, piece in (((6, 6), "(3, 6)"), ((4, 5), "(2, 5)")):
        torch._dynamo.reset()
        with pytest.raises(DistCompileError, match=r"local tensor of shape \(2, 6\) is not a "
                                                   r"piece of full_shape") as e:
            run(x, wrong)
        assert piece in str(e.value) and "fix:" in str(e.value)


def test_partition_spec_in_a_plan_is_read_as_mark_sharding_reads_it(fake_mesh):
    """One partition-spec codec for plans and ``mark_sharding``: a mesh axis used twice (which a
    plan used to accept, the second entry silently overwriting the first) and a dim's axes out
    of mesh order are refused with the spec, the mesh axes and a fix; a short spec leaves the
    trailing dims whole."""
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    with pytest.raises(DistCompileError, match="'tp' is used twice") as e:
        shard_module(Tiny(), mesh, ShardingPlan(plan={"fc.weight": PartitionSpec("tp", "tp")}))
    assert "fc.weight" in str(e.value) and "fix:" in str(e.value)
    with pytest.raises(DistCompileError, match="out of mesh order"):
        shard_module(Tiny(), mesh, ShardingPlan(plan={"fc.weight": PartitionSpec(("tp", "dp"),
                                                                                 None)}))
    m = shard_module(Tiny(), mesh, ShardingPlan(plan={"fc.weight": PartitionSpec("tp")}))
    assert tuple(m.fc.weight.placements) == (Replicate(), Shard(0))


def test_source_of_failure_names_the_users_line():
    """A data-dependent read met while tracing names the user's line: the FX node's (the stack
    trace fx's Interpreter appends to the message) or, for Python run while tracing (a custom
    op's backward: transformers 5.17's MoE fallback calls ``offs.tolist()`` there), the
    innermost frame outside torch."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from inductor_passes.core.errors import source_of_failure

    def custom_backward(offs):
        return offs.tolist()

    with FakeTensorMode():
        offs = torch.empty(3, dtype=torch.int64)
        with pytest.raises(Exception) as e:
            custom_backward(offs)
    src = source_of_failure(e.value)
    assert "test_errors.py" in src and "custom_backward: return offs.tolist()" in src, src
    node = RuntimeError('aten.nonzero\n\nWhile executing %nz\nOriginal traceback:\n'
                        '  File "/home/u/train.py", line 7, in forward\n    i = x.nonzero()\n')
    assert source_of_failure(node) == '"/home/u/train.py", line 7, in forward: i = x.nonzero()'
