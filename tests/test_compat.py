"""The private torch APIs we route through dynamo_dist._compat exist and behave as we rely on."""

import contextlib

import pytest
import torch

from dynamo_dist import patches
from inductor_passes.core import compat, inductor_fix


def test_checked_versions_cover_installed_torch():
    major_minor = ".".join(torch.__version__.split(".")[:2])
    assert major_minor in compat.TORCH_CHECKED


def test_dtensor_strategy_registry_enumerates(fake_mesh):
    from torch.distributed.tensor.placement_types import Shard

    mesh = fake_mesh((2,), ("tp",))
    meta = compat.TensorMeta(torch.Size([4, 6]), (6, 1), torch.float32)
    spec = compat.DTensorSpec(mesh, (Shard(0),), tensor_meta=meta)
    schema = compat.OpSchema(torch.ops.aten.permute.default, (spec, [1, 0]), {})
    out = compat.TensorMeta(torch.Size([6, 4]), (1, 6), torch.float32)
    strategy = compat.dtensor_op_strategy(schema, out)
    assert isinstance(strategy, compat.OpStrategy) and len(strategy.strategies) >= 1


def test_dtensor_expansion_is_asked_unpriced_and_gives_the_same_strategies(fake_mesh):
    """``dtensor_op_strategy`` skips DTensor's own pricing of a single-dim rule's expansion
    (``_unpriced_expansion``): the same OpSpecs as DTensor's priced expansion, zero costs, and
    DTensor's function back in place afterwards."""
    from torch.distributed.tensor._ops import utils
    from torch.distributed.tensor._ops.single_dim_strategy import \
        _expand_single_dim_strategy_to_mesh
    from torch.distributed.tensor.placement_types import Replicate, Shard

    op = torch.ops.aten.mul.Tensor
    prop = compat.sharding_propagator()
    assert op in prop.op_single_dim_strategy_funcs  # the path this skips the pricing on
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    meta = compat.TensorMeta(torch.Size([4, 6]), (6, 1), torch.float32)
    args = (compat.DTensorSpec(mesh, (Shard(0), Shard(1)), tensor_meta=meta),
            compat.DTensorSpec(mesh, (Replicate(), Shard(1)), tensor_meta=meta))
    real = utils.generate_redistribute_costs
    ours = compat.dtensor_op_strategy(compat.OpSchema(op, args, {}), meta)
    assert utils.generate_redistribute_costs is real

    schema = compat.OpSchema(op, args, {})
    schema.schema_info = prop.op_to_schema_info_for_single_dim_strategy.get(op)
    wrapped = prop._wrap_with_op_strategy(schema)
    priced = _expand_single_dim_strategy_to_mesh(
        mesh, wrapped, prop.op_single_dim_strategy_funcs[op], meta)(
        op, wrapped.args_meta, wrapped.kwargs_meta)

    def specs(strategy):
        return [(s.output_spec.placements, tuple(i.placements for i in s.input_specs))
                for s in strategy.strategies]

    assert specs(ours) == specs(priced) and len(specs(ours)) > 4
    assert all(c == 0.0 for s in ours.strategies for row in s.redistribute_cost for c in row)
    assert any(c > 0 for s in priced.strategies for row in s.redistribute_cost for c in row)


def test_dynamo_and_dtensor_hooks_we_patch_exist():
    from torch._dynamo.callback import callback_handler

    assert isinstance(callback_handler.end_callbacks, list)
    from dynamo_dist import eager_conv

    handlers = compat.dtensor_custom_op_handlers()
    conv = torch.ops.aten.convolution.default
    assert conv in handlers and torch.ops.aten.convolution_backward.default in handlers
    patches._clear_dtensor_sharding_caches()  # callable on this torch
    patches.install_dynamo_tracing_fallback()
    eager_conv.install()
    wrapped = handlers[conv]
    chain = eager_conv.handler_chain(wrapped)
    # the tracing fallback's wrapper and eager_conv's, in either order, over DTensor's own
    assert len(chain) == 3 and chain[-1].__module__.endswith("_tp_conv"), chain
    patches.install_dynamo_tracing_fallback()  # installed once, not stacked
    eager_conv.install()
    assert handlers[conv] is wrapped


def test_dynamo_bookkeeping_read_by_explain():
    torch._dynamo.reset()

    def f(x):
        print("break")  # one graph break
        return x + 1

    torch.compile(f, backend="eager")(torch.ones(2))
    reasons = compat.graph_break_reasons()
    assert reasons and hasattr(reasons[0], "reason") and hasattr(reasons[0], "user_stack")
    metrics = compat.compilation_metrics()
    assert metrics and hasattr(metrics[-1], "co_name") and hasattr(metrics[-1], "recompile_reason")
    compat.raise_compilation_metrics_limit()
    assert compat.current_compile_id() is None  # outside a compile


def test_metadata_patches_installed():
    assert patches.install_dead_mesh_lookup_removal()  # idempotent: True on 2.13
    from torch.distributed.distributed_c10d import _get_default_store

    assert compat.default_store.__doc__ and callable(_get_default_store)


def test_inductor_bucketing_and_partitioner_hooks():
    """Inductor's FX bucketing functions and its post-grad custom pass hook, the
    min-cut partitioner's signature and functorch's CSE switch: what inductor_passes.comm and
    compile_joint use."""
    import functools

    import torch.fx as fx

    cap = functools.partial(lambda mb, i: mb, 25.0)
    trusted = torch.torch_version.TorchVersion(torch.__version__) >= compat.BUCKETING_FROM
    assert compat.can_bucket() == trusted
    assert compat.find_buckets(fx.symbolic_trace(torch.nn.Linear(2, 2)), cap, lambda n: None) == {
        "all_gather": [], "reduce_scatter": [], "all_reduce": []}
    if trusted:  # the eager copy-in merge mode and its two custom ops, which comm feeds views
        from torch._inductor.fx_passes import bucketing

        assert compat.EAGER_COPY_IN_MODE in bucketing.BucketMode.__args__
        assert [op.name() for op in compat.eager_copy_in_ops()] == [
            "bucketing::_pre_bucket_reduce_scatter", "bucketing::_pre_bucket_all_gather"]
    seen = []
    entries = compat.post_grad_pass(seen.append, "u1")
    with compat.inductor_config_patch(entries):
        from torch._inductor import config

        ours = config.post_grad_custom_post_pass
        assert ours.uuid() == ("dynamo_dist", "u1", ())
        graph = fx.symbolic_trace(torch.nn.Linear(2, 2)).graph
        ours(graph)
        assert seen == [graph]
    with compat.functorch_config_patch(cse=False):
        from torch._functorch import config as fconfig

        assert fconfig.cse is False
    import inspect

    params = inspect.signature(compat.min_cut_rematerialization_partition).parameters
    assert "num_fwd_outputs" in params and params["num_fwd_outputs"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "static_lifetime_input_indices" in params  # compile_joint's resident parameters


def _norm_then_dropout_mask(x, w):
    """An RMSNorm, then a dropout mask drawn into a fresh buffer and sliced, as our lowering
    writes a replicated random draw that a batch-sharded value consumes."""
    aten = torch.ops.aten
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    mask = aten.bernoulli.p(aten.empty.memory_format([4, 16, 64], dtype=torch.float32), 0.9)
    keep = aten.slice.Tensor(mask, 0, 0, 2) / 0.9
    return keep, y * keep


def test_inductor_reads_an_in_place_draw_after_it_is_made():
    """Inductor's C++ fusion recomputes a node's loop body and, on torch 2.13, forgets that the
    node reads the buffer ``bernoulli_`` fills in place: the fused kernel read it first and the
    mask came out NaN (T5 trained to NaN on a dp x tp mesh). ``_compat`` re-applies the renames
    (pytorch/pytorch#185873); without it this test reads NaN (checked on 2.13.0)."""
    from torch._inductor.scheduler import SchedulerNode

    from inductor_passes.compile import compile_joint

    assert inductor_fix.install_inductor_mutation_order_fix()
    assert getattr(SchedulerNode.recompute_size_and_body, "_dynamo_dist_patch", False)
    x, w = torch.randn(2, 16, 64), torch.randn(64)
    gm = compat.make_fx(_norm_then_dropout_mask, tracing_mode="fake")(x, w)
    with torch._inductor.config.patch(force_disable_caches=True):  # compile, don't look it up
        compiled = compile_joint(gm, num_fwd_outputs=2, has_backward=False, inductor=True)
    torch.manual_seed(0)
    keep, out = compiled.forward([x, w])
    torch.manual_seed(0)
    want_keep, want_out = _norm_then_dropout_mask(x, w)
    assert not keep.isnan().any() and len(keep.unique()) == 2, keep.unique()  # 0 and 1/0.9
    assert not out.isnan().any()
    torch.testing.assert_close(keep, want_keep)  # on CPU Inductor draws with eager's kernel
    torch.testing.assert_close(out, want_out)


@pytest.mark.parametrize("dynamic", [True, False, None])
def test_dist_compile_leaves_dynamo_settings_as_they_were(fake_mesh, dynamic):
    """backend="dist" traces sizes as ``dynamic=`` says (symbolic under dynamic=True; under
    automatic dynamic shapes from the second size on) and Python numbers specialised
    (``dynamo_settings_for_dist``), and leaves Dynamo's settings as they were after each
    call, for the next compile of any backend."""
    from torch._dynamo import config
    from torch.distributed.tensor import Shard, distribute_tensor

    from dynamo_dist import compile_records
    from dynamo_dist.symbolic import is_symbolic

    mesh = fake_mesh((2,), ("tp",))
    names = ("assume_static_by_default", "automatic_dynamic_shapes", "specialize_int",
             "specialize_float")
    before = [getattr(config, k) for k in names]

    lin = torch.nn.Linear(8, 8, bias=False)  # a module's parameter: static sizes
    lin.weight = torch.nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(0)]))

    def f(x, scale):  # x: a plain tensor of changing size
        return lin(x) * scale

    fn = torch.compile(f, backend="dist", dynamic=dynamic, options={"inductor": False})
    for n, scale in ((5, 2.0), (7, 2.0), (7, 3.0)):
        fn(torch.randn(n, 8), scale)
        assert [getattr(config, k) for k in names] == before
    records = compile_records()
    # sizes: one program for both under dynamic=True; automatic dynamic recompiles once,
    # symbolic; a new float recompiles in every mode (it is never a tensor input)
    assert len(records) == {True: 2, False: 3, None: 3}[dynamic]
    assert [is_symbolic(r.program.graph_module) for r in records] == \
        {True: [True, True], False: [False] * 3, None: [False, True, True]}[dynamic]
    assert all(len(r.program.primal_inputs) == 2 for r in records)


def test_nested_compile_regions_inlined_on_a_copy():
    """torch's inline pass (2.13) flattens every region, a region inside one too; Dynamo's own
    graph keeps its invoke_subgraph calls, and the flat graph computes the same values."""
    @torch.compiler.nested_compile_region
    def inner(x):
        return x.sin() * 2

    @torch.compiler.nested_compile_region
    def outer(x):
        return inner(x) + inner(x + 1)

    seen = []

    def backend(gm, example_inputs):
        seen.append(gm)
        return gm

    x = torch.randn(4)
    torch.compile(lambda x: outer(outer(x)), backend=backend, fullgraph=True)(x)
    torch._dynamo.reset()
    (gm,) = seen
    hop = torch.ops.higher_order.invoke_subgraph

    def calls(m):
        return sum(len(g.graph.find_nodes(op="call_function", target=hop))
                   for g in m.modules() if isinstance(g, torch.fx.GraphModule))

    before = calls(gm)
    assert before >= 2
    flat = compat.inline_nested_compile_regions(gm)
    assert calls(flat) == 0 and calls(gm) == before
    torch.testing.assert_close(flat(x)[0], outer(outer(x)))
    assert compat.inline_nested_compile_regions(flat) is flat  # nothing to do


def test_size_hint_reads_a_symbolic_size_without_guarding():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()  # a length as the partitioner's saved RNG state has one
    n = env.create_symintnode(env.create_symbol(5056, ConstantSource("n")), hint=5056)
    assert isinstance(n, torch.SymInt)
    assert compat.size_hint(n * 2) == 10112 and compat.size_hint(7) == 7
    assert not env.guards  # an estimate, not a specialisation


def _symbolic_fakes(*shapes):
    """Fakes of ``shapes`` with every size symbolic (one ShapeEnv), as Dynamo makes them."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = compat.FakeTensorMode(shape_env=ShapeEnv())
    return mode, [mode.from_tensor(torch.randn(s), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC] * len(s))) for s in shapes]


def test_baddbmm_on_symbolic_sizes_needs_its_input_expanded():
    """torch 2.13's baddbmm meta expands a broadcast input through a concrete-size kernel and
    fails on symbolic sizes (Bloom's ALiBi scores); expanded first, it traces. When this starts
    passing without the workaround, the workaround can go."""
    mode, (x, q) = _symbolic_fakes((8, 1, 10), (8, 10, 16))
    with mode:
        k = torch.empty_strided((x.shape[0], 16, x.shape[2]), (16 * x.shape[2], 1, 16))
        with pytest.raises(RuntimeError, match="concrete integers"):
            torch.baddbmm(x, q, k, beta=1.0, alpha=0.25)
        args, kwargs = compat.baddbmm_self_expanded((x, q, k), {"beta": 1.0, "alpha": 0.25})
        out = torch.baddbmm(*args, **kwargs)
    assert tuple(out.shape) == (x.shape[0], x.shape[2], x.shape[2])


def test_a_guarded_size_reads_as_its_number():
    """``guard_equal`` records the guard in the ShapeEnv (Dynamo re-checks it per call) and from
    then on ``static_size`` reads the number; an unguarded symbolic size reads None."""
    _, (x,) = _symbolic_fakes((6, 4))
    s0, s1 = x.shape
    assert compat.static_size(s0) is None and compat.size_hint(s0) == 6
    assert compat.has_symbolic_shape(x)
    compat.guard_equal(s0, 6)
    assert compat.static_size(s0) == 6 and compat.static_size(s1) is None
    assert any("6" in str(g.expr) for g in s0.node.shape_env.guards)


def test_nary_size_arithmetic_rewritten_as_binary_nodes():
    """make_fx rebuilds a size it did not trace as ``operator.mul(2, a, b)``: interpreted it
    fails ("mul expected 2 arguments, got 3"), and FX's generated code silently drops the third
    factor (``2 * a``: a wrong size, or a wrong divisor). The rewrite chains two-argument
    nodes, with values."""
    import operator

    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    a.meta["val"], b.meta["val"] = 3, 4
    prod = graph.call_function(operator.mul, (2, a, b))
    prod.meta["val"] = 24
    total = graph.call_function(operator.add, (prod, a, 1))
    graph.output((prod, total))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    with pytest.raises(TypeError, match="2 arguments"):
        torch.fx.Interpreter(gm).run(3, 4)
    assert gm(3, 4) == (6, 9)  # generated code: 2 * a and prod + a
    compat.binary_size_arithmetic(gm)
    assert gm(3, 4) == (24, 28) and gm(5, 1) == (10, 16)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert all(len(n.args) == 2 and "val" in n.meta for n in calls[:-1]), calls


def test_python_dispatcher_keeps_a_padded_size_symbolic():
    """``constant_pad_nd``'s C++ kernel reads ``sizes()``, which fixes every symbolic size of
    its input (a guard per size); through the Python dispatcher it traces symbolically. Each
    local program of a symbolic plan is traced so (``lowering``)."""
    for dispatch in (False, True):
        mode = compat.fresh_size_env()
        b, s = compat.new_size(mode, 4, "b"), compat.new_size(mode, 16, "s")
        with mode:
            ids = torch.empty(b, s, dtype=torch.long)
        ctx = compat.python_dispatcher() if dispatch else contextlib.nullcontext()
        with ctx:
            compat.make_fx(lambda t: torch.ops.aten.constant_pad_nd(t, [0, 1], -100),
                            tracing_mode="fake")(ids)
        guards = compat.size_guards(mode)
        assert (guards == []) == dispatch, (dispatch, guards)


def test_foreign_fake_mode_is_the_values_own_when_the_context_names_another():
    mode, (x,) = _symbolic_fakes((6, 4))
    assert compat.foreign_fake_mode([x, 3]) is mode
    with compat.tracing(compat.TracingContext(mode)):
        assert compat.foreign_fake_mode([x]) is None  # the context's own: nothing to do
    assert compat.foreign_fake_mode([torch.ones(2)]) is None


def test_numbers_specialised_from_the_first_compile_with_options():
    """In a fresh process, the ``torch.compile(backend="dist", options=...)`` call that first
    resolves "dist" (importing the backend) gets the backend's context too: a float argument
    under dynamic=True is a specialised constant (it was a 0-d tensor read with ``.item()``,
    refused as data-dependent), and a new value recompiles."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "def f(x, s):\n"
        "    return x * s\n"
        "fn = torch.compile(f, backend='dist', options={'inductor': False}, dynamic=True)\n"
        "a, b = fn(torch.ones(4), 2.0), fn(torch.ones(5), 3.0)\n"
        "from dynamo_dist import compile_records\n"
        "print('OK', a.sum().item(), b.sum().item(), len(compile_records()))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert "OK 8.0 15.0" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]


def test_a_dtensor_spec_key_changes_when_its_spec_is_edited(fake_mesh):
    """``dtensor_spec_key`` (the runtime's once-per-spec check) relies on DTensorSpec caching its
    hash and dropping it when a hashed field is assigned: an edited spec gets a new key."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = fake_mesh((2,), ("tp",))
    x = distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)])
    spec, h = compat.dtensor_spec_key(x)
    assert compat.dtensor_spec_key(x) == (spec, h) and spec is x._spec
    meta = spec.tensor_meta
    spec.tensor_meta = compat.TensorMeta(shape=torch.Size((6, 6)), stride=meta.stride,
                                         dtype=meta.dtype)
    assert compat.dtensor_spec_key(x)[1] != h


def test_strided_redistribute_fallback_only_before_2_13(fake_mesh):
    """torch 2.11 reads every _StridedShard as a shard-order encoding and refused to plan a
    redistribute to (Shard(0), _StridedShard(1, 3)); the fallback (torch 2.13's own behaviour)
    is installed there and nowhere else, and the redistribute then runs."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dynamo_dist import patches

    installed = patches.install_strided_redistribute_fallback()
    assert installed == (torch.torch_version.TorchVersion(torch.__version__) < "2.13")
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    x = distribute_tensor(torch.randn(8, 12), mesh, [Replicate(), Replicate()])
    y = x.redistribute(mesh, (Shard(0), compat.StridedShard(1, split_factor=3)))
    assert tuple(y.to_local().shape) == (4, 6)


def test_an_in_place_op_that_would_move_its_input_is_read_on_replicated_fakes(fake_mesh):
    """``ids[..., 0] = start`` on a DTensor split on dp (T5's shift right): DTensor's
    propagation of the in-place fill moves the input to Replicate, which torch 2.11 refuses at
    dispatch and 2.13 would relabel without moving data; the tracing fallback reads it on
    replicated fakes instead (``_moves_self``). A Shard whose dim is only renumbered is left to
    DTensor."""
    from torch.distributed.tensor import Replicate, Shard

    from dynamo_dist.patches import _moves_self

    mesh = fake_mesh((2, 2), ("dp", "tp"))
    meta = compat.TensorMeta(torch.Size([4, 16]), (16, 1), torch.int64)
    split = compat.DTensorSpec(mesh, (Shard(0), Replicate()), tensor_meta=meta)
    schema = compat.OpSchema(torch.ops.aten.fill_.Scalar, (split, 0), {})

    def out(*pls):
        return compat.OutputSharding(compat.DTensorSpec(mesh, pls, tensor_meta=meta))

    assert _moves_self(out(Replicate(), Replicate()), schema)
    assert not _moves_self(out(Shard(0), Replicate()), schema)
    assert not _moves_self(out(Shard(1), Replicate()), schema)  # renumbered: DTensor's own


def test_make_fx_tracker_hooks_copy_a_node_into_a_trace():
    """What ``stamp`` uses of make_fx: inside a trace, a node copied into the tracer's graph
    and given a fresh fake (made over a meta tensor, no dispatch) is where later ops read that
    value from; the fake aliases another made over a view of the same meta storage."""
    def f(x):
        tracer = compat.proxy_tracer()
        y = x * 2
        node = compat.proxy_node(y, tracer)
        assert node is not None and node.target is torch.ops.aten.mul.Tensor
        with compat.untraced():
            assert compat.proxy_node(torch.ones(1), tracer) is None  # made untraced
        with compat.untraced(), compat.no_dispatch_modes():
            meta = torch.empty_strided((4,), (1,), device="meta")
            fake = compat.fake_tensor(x.fake_mode, meta, x.device)
            view = compat.fake_tensor(x.fake_mode, meta[1:], x.device)
        copy = tracer.graph.create_node("call_function", node.target, (node.args[0], 3.0))
        compat.track_value(fake, copy, tracer, node.meta.get("tensor_meta"))
        assert view.untyped_storage()._cdata == fake.untyped_storage()._cdata
        return fake + y

    fake_mode = compat.FakeTensorMode()
    gm = compat.make_fx(f, tracing_mode="fake")(fake_mode.from_tensor(torch.randn(4)))
    add = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor)
    assert add.args[0].args[1] == 3.0 and add.args[1].args[1] == 2
    assert add.args[0].meta["val"].shape == (4,)
    assert torch.equal(gm(torch.ones(4)), torch.full((4,), 5.0))
    assert "stack_trace" not in compat.TRACED_META_FIELDS and \
        "nn_module_stack" in compat.TRACED_META_FIELDS


def test_a_mesh_made_again_after_destroy_gets_its_own_dtensor_outputs(fake_mesh):
    """DTensor's sharding cache compares meshes by value: without the clear on
    ``destroy_process_group`` (``patches.install_sharding_cache_clear_on_destroy``) an op on a
    mesh built again after a teardown returned a DTensor on the destroyed mesh, and a later
    compile failed in Dynamo ("Group ... is not registered")."""
    from torch.distributed.tensor import Shard, distribute_tensor

    patches.install()
    outs = []
    for _ in range(2):
        mesh = fake_mesh((2, 2), ("dp", "tp"))
        a = distribute_tensor(torch.randn(8, 16, 64), mesh, [Shard(2), Shard(0)])
        b = distribute_tensor(torch.randn(8, 16, 64), mesh, [Shard(0), Shard(2)])
        outs.append((a + b).device_mesh is mesh)
    assert outs == [True, True]


def test_real_object_unwraps_dynamos_stand_in_for_an_opaque_mesh(fake_mesh):
    """Dynamo's FakeScriptObject for a DeviceMesh hides attributes we set on the mesh; the
    gate's ``real_object`` hands back the mesh behind it, and anything else unchanged."""
    from torch._library.fake_class_registry import FakeScriptObject

    from inductor_passes.core.mesh_facts import add_data_axes, data_axes

    mesh = fake_mesh((2,), ("dp",))
    add_data_axes(mesh, ("dp",))
    stand_in = FakeScriptObject(object(), "DeviceMesh", mesh)
    assert getattr(stand_in, "_dynamo_dist_mesh_facts", None) is None  # hidden through it
    assert compat.real_object(stand_in) is mesh
    assert compat.real_object(mesh) is mesh and compat.real_object(3) == 3
    assert data_axes(stand_in) == ("dp",)


def test_autocast_state_is_read_set_and_switched_off():
    """``autocast_state`` reads the devices autocast is on for; ``autocast_as`` sets exactly a
    state (and a ``torch.autocast`` entered inside it still applies: capture re-enters the
    user's state within a compile run with autocast off); ``autocast_disabled`` turns every
    device's off for the ops inside, whatever the flags say."""
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    assert compat.autocast_state() == ()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        state = compat.autocast_state()
        assert state == (("cpu", torch.bfloat16),)
        with compat.autocast_as(()):
            assert compat.autocast_state() == () and (a @ b).dtype == torch.float32
            with compat.autocast_as(state):
                assert (a @ b).dtype == torch.bfloat16
        with compat.autocast_disabled():
            assert (a @ b).dtype == torch.float32
        assert (a @ b).dtype == torch.bfloat16
    with compat.autocast_as((("cpu", torch.float16),)):
        assert (a @ b).dtype == torch.float16
    assert compat.autocast_state() == ()


def test_checkpoint_and_rng_internals_capture_and_the_simulator_use():
    """Selective checkpointing's cache mode takes ``allow_cache_entry_mutation`` (capture turns
    it on: ``checkpoint_cache_may_be_mutated``, and restores torch's own after), and the RNG
    functionalization's higher-order ops the simulator runs by hand keep their names."""
    import inspect

    from torch.utils import checkpoint

    cls = checkpoint._CachedTorchDispatchMode
    assert "allow_cache_entry_mutation" in inspect.signature(cls.__init__).parameters
    init = cls.__init__
    with compat.checkpoint_cache_may_be_mutated():
        assert cls(None, {}).allow_cache_entry_mutation
    assert cls.__init__ is init and not cls(None, {}).allow_cache_entry_mutation
    save, replay = compat.rng_state_ops()
    assert (save.name(), replay.name()) == ("run_and_save_rng_state", "run_with_rng_state")


class _FreshLeafBias(torch.nn.Module):
    """T5's cross-attention under gradient checkpointing: in a checkpointed layer, a zeros
    bias made a leaf that requires grad by attribute assignment."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def layer(self, x):
        bias = torch.zeros(x.shape, dtype=x.dtype)
        bias.requires_grad = True
        return self.proj(x) + bias

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=False)


def test_requires_grad_set_on_a_fresh_tensor_stays_in_the_graph_for_dist_only(fake_mesh):
    """``t.requires_grad = True`` on a tensor the code made is traced as ``requires_grad_()``
    while Dynamo traces for ``dist`` (``patches.install_requires_grad_setattr``): one graph,
    where another backend still breaks the graph there (torch 2.13's own handling)."""
    from torch._dynamo.utils import counters

    from dynamo_dist import compile_records
    from dynamo_dist.plans import TensorParallelPlanner, shard_module

    assert patches.install_requires_grad_setattr()  # idempotent; the hook exists on 2.13
    x = torch.randn(4, 8)
    counters.clear()
    torch.compile(_FreshLeafBias(), backend="eager")(x)
    assert sum(counters["graph_break"].values()) == 1, dict(counters["graph_break"])
    torch._dynamo.reset()
    mesh = fake_mesh((2,), ("tp",))
    model = _FreshLeafBias()
    shard_module(model, mesh, TensorParallelPlanner().build_plan(model, example_inputs=(x,)))
    counters.clear()
    before = len(compile_records())
    out = torch.compile(model, backend="dist", options={"inductor": False})(x)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(compile_records()) == before + 1 and out.requires_grad


def test_a_backend_reads_the_frames_locals_graph_input_values_and_module_paths():
    """Inside Dynamo's call of a backend: the compiled frame's locals, the real parameter
    behind a placeholder, and the module an ``nn_module_stack`` path names (2.13)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4)))
    seen = {}

    def backend(gm, example_inputs):
        frame = compat.dynamo_frame_locals()
        seen["values"] = [compat.graph_input_value(n) for n in gm.graph.find_nodes(op="placeholder")]
        paths = [list(n.meta["nn_module_stack"].values())[-1][0] for n in gm.graph.nodes
                 if n.op == "call_function" and n.meta.get("nn_module_stack")]
        seen["modules"] = [compat.module_at_path(p, frame) for p in paths]
        seen["missing"] = compat.module_at_path("L['nowhere'].x", frame)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(torch.randn(2, 4))
    assert compat.dynamo_frame_locals() is None  # outside a trace
    params = list(model.parameters())
    assert all(any(v is p for v in seen["values"]) for p in params)
    assert {id(m) for m in seen["modules"]} == {id(model[0]), id(model[1][0])}
    assert seen["missing"] is None


def test_module_at_path_follows_subscripts():
    """A wrapper frame's ``*args``/``**kwargs`` (transformers' deprecation wrapper): the
    path goes through a subscript before its attributes."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU()))
    frame = {"args": (model,), "kwargs": {"net": model}}
    assert compat.module_at_path("L['args'][0].1.0", frame) is model[1][0]
    assert compat.module_at_path("L['kwargs']['net'].0", frame) is model[0]
    assert compat.module_at_path("L['args'][0]", frame) is model
    for bad in ("L['args'][1].0", "L['args'][0].7", "L['args'][0]..0", "L['args'](0)",
                "L['kwargs']['other']", "args[0]"):
        assert compat.module_at_path(bad, frame) is None, bad


def test_inductor_cpu_accessors_and_the_options_torch_compile_hands_a_backend():
    """The accessors ``cpu_probe`` and ``early_kernels`` read: Inductor's vector-ISA choice, its
    wrapper generator's ``define_kernel``, a wrapper module's ``async_compile`` and whether it
    builds asynchronously; and the options ``torch.compile`` wraps around a backend."""
    import inspect

    from torch._inductor import cpu_vec_isa

    assert compat.pick_cpu_vec_isa() == cpu_vec_isa.pick_vec_isa()
    params = list(inspect.signature(compat.python_wrapper_codegen().define_kernel).parameters)
    assert params[:3] == ["self", "kernel_name", "kernel_body"], params
    assert callable(compat.async_compile().cpp_pybinding)
    assert isinstance(compat.inductor_compiles_async(), bool)
    # a module's wait left with its kernel pending, then bound
    from concurrent.futures import Future

    assert compat.can_leave_kernels_pending()
    done = Future()
    done.set_result("kernel")
    scope, waiter = {"cpp_fused_0": done}, compat.async_compile()
    with compat.kernels_left_pending(waiter):
        waiter.wait(scope)
    assert scope["cpp_fused_0"] is done
    if compat.inductor_compiles_async():  # (a synchronous Inductor's wait binds nothing)
        waiter.wait(scope)  # the instance's own wait again
        assert scope["cpp_fused_0"] == "kernel"
        scope["cpp_fused_0"] = done
    compat.wait_for_kernels(waiter, scope)
    assert scope["cpp_fused_0"] == "kernel"

    def backend(gm, inputs, options=None):
        return gm.forward

    backend._dynamo_dist_backend = True
    wrapper = torch._TorchCompileWrapper(backend, None, {"inductor": False}, None)
    assert compat.compile_options(wrapper) == {"inductor": False}
    assert compat.is_dist_compiler(wrapper)
    assert compat.compile_options(backend) == {} and compat.compile_options(None) == {}


def test_lazy_graph_modules_generate_code_when_read_or_run():
    """``graph_module`` inside ``lazy_graph_modules`` and ``as_lazy``: no code until the code is
    read or the module called; then the same results as a plain GraphModule; ``as_lazy`` keeps
    the graph, the attributes its nodes name and ``meta``."""
    import torch.fx as fx

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 3))

        def forward(self, x):
            return torch.relu(x @ self.w)

    plain = fx.symbolic_trace(M())
    plain.meta["mark"] = 7
    x = torch.randn(2, 3)
    with compat.lazy_graph_modules():
        lazy = compat.graph_module(plain, plain.graph)
    assert "_code" not in lazy.__dict__  # no code generated yet
    torch.testing.assert_close(lazy(x), plain(x))
    assert "relu" in lazy.code
    again = compat.as_lazy(plain)
    assert again is not plain and again.graph is plain.graph and again.meta == {"mark": 7}
    assert again.w is plain.w and "_code" not in again.__dict__
    torch.testing.assert_close(again(x), plain(x))
    assert compat.as_lazy(again) is again  # already lazy: marked, the same module


def test_holds_local_tensors_sees_simulated_values():
    """A module whose parameter is a DTensor over a LocalTensor (simulated ranks) holds local
    tensors; a plain one does not."""
    from torch.distributed._local_tensor import LocalTensor

    plain = torch.nn.Linear(2, 2)
    assert not compat.holds_local_tensors(plain)
    simulated = torch.nn.Linear(2, 2)
    simulated.weight = torch.nn.Parameter(LocalTensor({0: torch.ones(2, 2), 1: torch.ones(2, 2)}))
    assert compat.holds_local_tensors(simulated)
