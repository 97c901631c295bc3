"""DTensor calls inside a compiled region, read in global semantics by capture: redistribute
is a sharding constraint, full_tensor pins Replicate, to_local/full_tensor at an output return a
plain tensor. Shapes and collectives on a `fake` process group (no values)."""

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dynamo_dist import compile_records, patches
from inductor_passes.core import compat


def _setup(fake_mesh):
    mesh = fake_mesh((2,), ("tp",))
    compat.allow_implicit_replication(True)
    patches.install_dynamo_tracing_fallback()
    w = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
    return mesh, w


def test_redistribute_to_local_full_tensor(fake_mesh):
    mesh, w = _setup(fake_mesh)

    def f(x):
        y = (x @ w.t()).relu()
        z = y.redistribute(mesh, [Shard(1)])
        return z.to_local(), y.full_tensor(), z.redistribute(placements=[Replicate()])

    local, whole, rep = torch.compile(f, backend="dist", fullgraph=True,
                                      options={"inductor": False})(torch.randn(3, 4))
    assert type(local) is torch.Tensor and local.shape == (3, 4)  # this rank's Shard(1) half
    assert type(whole) is torch.Tensor and whole.shape == (3, 8)
    assert isinstance(rep, DTensor) and rep.placements == (Replicate(),) and rep.shape == (3, 8)
    ledger = compile_records()[-1].ledger
    assert ledger.count(kind="all_gather") >= 1 and ledger.count(kind="all_reduce") == 0


def test_compiling_leaves_eager_dtensor_unchanged(fake_mesh):
    """Our replicate-while-tracing propagation must not stay in DTensor's sharding cache: after
    a dist compile, eager DTensor still rejects what it rejects (a view flattening an uneven
    split), instead of silently replicating."""
    mesh = fake_mesh((4,), ("x",))
    torch._dynamo.reset()  # also drops Dynamo's compile callbacks (the bug this guards)
    x = torch.randn(5, 5, 5)

    def uneven():
        return DTensor.from_local(x.chunk(4)[0], mesh, [Shard(0)], run_check=False,
                                  shape=x.shape, stride=x.stride())

    out = torch.compile(lambda a: a.view(25, 5), backend="dist",
                        options={"inductor": False})(uneven())
    assert out.shape == (25, 5)
    # merging an uneven dim: DTensor's rule for replicated inputs, the gather priced and logged
    assert compile_records()[-1].ledger.count(kind="all_gather") == 1
    with pytest.raises(RuntimeError, match="unevenly sharded"):
        uneven().view(25, 5)


def test_eager_dtensor_before_compiling_does_not_leak_into_tracing(fake_mesh):
    """The other direction: DTensor's cache entries from eager calls made before a compile must
    not be hits while Dynamo traces for dist (they bypassed our tracing propagation: eager
    tensor_split then read tensor data under Dynamo, an internal Dynamo error instead of ours)."""
    mesh = fake_mesh((4,), ("x",))
    patches.install_dynamo_tracing_fallback()
    x = distribute_tensor(torch.randn(8, 8), mesh, [Shard(1)])
    idx = distribute_tensor(torch.tensor([1, 3]), mesh, [Replicate()])
    try:
        torch.tensor_split(x, idx, 0)  # eager: fills DTensor's sharding cache
    except Exception:  # noqa: BLE001  (whether eager supports it does not matter here)
        pass
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(lambda a, i: torch.tensor_split(a, i, 0), backend="dist", fullgraph=True,
                      options={"inductor": False})(x, idx)
    text = str(info.value)  # ours, carried through DTensor's and Dynamo's wrappers
    assert "cannot be traced for the dist backend" in text and "depends on tensor data" in text


def test_eager_dtensor_op_between_compiled_graphs(fake_mesh):
    """``.item()`` breaks the graph; the eager DTensor call after it runs under Dynamo's frame
    hook, which must not try to compile our propagation fallback (it did: AttributeError on
    current_tx)."""
    mesh = fake_mesh((2,), ("tp",))
    w = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])

    def f(x):
        s = (x @ w).sum().item()
        return x * s

    x = torch.randn(2, 4)
    out = torch.compile(f, backend="dist", options={"inductor": False})(x)
    assert out.shape == (2, 4)


def test_user_code_reads_eager_placements_and_mesh_while_tracing(fake_mesh):
    """Python that reads ``.placements`` / ``.device_mesh`` of an intermediate DTensor (and
    asserts on them, branches on them, asks the mesh for a group) sees while Dynamo traces what
    it sees eagerly: a column- then row-parallel pair gives Shard(1), then Partial. Before,
    tracing for dist read every value as Replicate (torchtitan's asserts failed) and
    ``x.device_mesh`` failed in capture ("'FakeTensor' object has no attribute
    'device_mesh'"). Simulated ranks: the compiled program computes what eager does."""
    from torch.distributed.tensor import Partial

    from dynamo_dist.testing.zoo.cell import SimRuntime, global_value

    rt = SimRuntime()
    mesh = rt.setup({"tp": 2})
    with rt.eager():
        w1 = distribute_tensor(torch.randn(16, 8), mesh, [Shard(0)])
        w2 = distribute_tensor(torch.randn(8, 16), mesh, [Shard(1)])
        x = distribute_tensor(torch.randn(4, 8), mesh, [Replicate()])
    seen = []

    def f(x):
        h = torch.nn.functional.linear(x, w1)
        o = torch.nn.functional.linear(h.relu(), w2)
        group = o.device_mesh.get_group("tp")
        seen.append((h.placements, o.placements, group is not None))
        assert o.placements[0].is_partial()
        scale = 2.0 if isinstance(h.placements[0], Shard) else 3.0  # a branch on placements
        return (o.redistribute(o.device_mesh, [Replicate()]) * scale).to_local()

    with rt.eager():
        want = global_value(f(x), rt)
    got = torch.compile(f, backend="dist", options=rt.options())(x)
    assert seen == [((Shard(1),), (Partial(),), True)] * 2
    torch.testing.assert_close(global_value(got, rt), want)


def test_kv_cache_first_update_stays_split_over_heads(fake_mesh):
    """transformers' DynamicCache starts each layer's cache as ``torch.tensor([])`` and cats the
    new keys onto it (cat skips a legacy empty 1-D operand). Eager DTensor refuses the mixed
    call and 2.13's cat strategy asks to split the empty operand, so tracing read the cache as
    replicated: every decode step gathered it. Now it stays split over the heads, and the
    compiled program computes what one process does (simulated ranks)."""
    from dynamo_dist.testing.zoo.cell import SimRuntime, global_value

    rt = SimRuntime()
    mesh = rt.setup({"tp": 2})
    full = torch.randn(1, 4, 8, 16)
    with rt.eager():
        k = distribute_tensor(full, mesh, [Shard(1)])
    seen = []

    def f(k):
        cache = torch.cat([torch.tensor([]), k], dim=-2)
        seen.append(cache.placements)
        return torch.cat([cache, k * 2], dim=-2)

    out = torch.compile(f, backend="dist", options=rt.options())(k)
    assert seen == [(Shard(1),)]
    assert out.placements == (Shard(1),)
    torch.testing.assert_close(global_value(out, rt), torch.cat([full, full * 2], dim=-2))


@pytest.mark.parametrize("keepdim", [False, True])
def test_argmax_over_a_split_dim_with_a_negative_dim(fake_mesh, keepdim):
    """Greedy decoding's ``logits.argmax(-1)`` on logits split over the vocabulary: 2.13's
    DTensor argmax gathers with the negative dim and failed ("shape '[1, 2, 2, 1]' is invalid
    for input of size 2"), eager or after a compiled forward. ``patches`` hands it the dim
    counted from the front (simulated ranks, against one process)."""
    from dynamo_dist.testing.zoo.cell import SimRuntime, global_value

    rt = SimRuntime()
    mesh = rt.setup({"tp": 2})
    logits = torch.randn(1, 256)  # one sequence: the gather takes its view fast path
    patches.install_dynamo_tracing_fallback()  # the fix is installed with it (idempotent)
    with rt.eager():
        got = distribute_tensor(logits, mesh, [Shard(1)]).argmax(-1, keepdim=keepdim)
        got = global_value(got, rt)
    torch.testing.assert_close(got, logits.argmax(-1, keepdim=keepdim))


def test_replicated_fallback_reads_output_metadata_on_the_mesh_device(fake_mesh):
    """An op with no DTensor strategy is read on replicated fakes while tracing. Its fakes are
    made on the mesh's device type: DTensor's own metadata run makes CPU fakes, where ``histc``
    of int32 (transformers' MoE on a GPU) has no kernel. "meta" stands for a GPU here."""
    from torch.distributed.tensor.placement_types import Replicate as R

    mesh = fake_mesh((2,), ("x",))
    spec = compat.DTensorSpec(mesh, (R(),), tensor_meta=compat.TensorMeta(
        torch.Size([128]), (1,), torch.int32))
    schema = compat.OpSchema(torch.ops.aten.histc.default, (spec,), {"bins": 4, "min": 0,
                                                                      "max": 3})
    prop = compat.sharding_propagator()
    with pytest.raises(RuntimeError, match="histogram_cpu"):
        prop._propagate_tensor_meta_non_cached(schema)
    meta = patches._fake_output_meta(prop, schema, "meta")
    assert (tuple(meta.shape), meta.dtype) == ((4,), torch.int32)
