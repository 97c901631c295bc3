"""The bad-input battery: unusual or wrong uses, each as a new user would write it, with what
the product must do: raise a given exception whose message names the op or argument, the shapes,
the mesh and a fix; or work and compute what one device computes. Each case runs in its own
process under a time bound (``tests/test_bad_input_battery.py``), so a hang is a failure, not a
stuck suite. Add a case for every bug found.

A case is a function decorated with ``@case(raises=..., mentions=(...))`` (``raises=None``:
it must work; the function asserts the numbers itself). Cases run on a ``fake`` process group
(rank 0 unless the case picks another), numerics on simulated ranks (``run_spmd``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

import dynamo_dist
from dynamo_dist import (DistCompileError, compile_records, disable_manual_sharding,
                         enable_manual_sharding, local_map, mark_sharding, with_sharding_constraint)
from dynamo_dist.testing.conformance.simulate import run_spmd
from dynamo_dist.plans import PartitionSpec, ShardingPlan, shard_module
from inductor_passes.core.compat import StridedShard

R, S0, S1 = Replicate(), Shard(0), Shard(1)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[[], None]
    raises: type | None        # None: must work
    mentions: tuple[str, ...]  # what the message must name (besides a fix)
    fix: bool                  # whether the message must name a fix (False: torch's own error
                               # for a bug in the single-device program, passed through)


CASES: dict[str, Case] = {}


def case(raises: type | None = None, mentions: tuple[str, ...] = (), fix: bool = True):
    def add(fn):
        CASES[fn.__name__] = Case(fn.__name__, fn, raises, mentions, fix and raises is not None)
        return fn
    return add


def mesh(shape=(2, 2), names=("dp", "tp"), rank: int = 0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank,
                            world_size=math.prod(shape))
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))


def compile_(fn):
    return torch.compile(fn, backend="dist", fullgraph=True, options={"inductor": False})


def check_on_ranks(m, fn, *globals_, dtensors=None, grads=False, ref=None):
    """Compile ``fn`` with DTensor arguments (``dtensors``: placements per argument, default
    Replicate), run the record on every simulated rank, compare with one device (``ref``: the
    program without annotations, for those that return a DTensor eagerly)."""
    ref = ref or fn
    pls = dtensors or [[R] * m.ndim for _ in globals_]
    args = [distribute_tensor(g, m, p).requires_grad_(grads and g.is_floating_point())
            for g, p in zip(globals_, pls)]
    compile_(fn)(*args)
    record = compile_records()[-1]
    by_name = {f"L_{n}_": g for n, g in zip(fn.__code__.co_varnames, globals_)}
    order = [by_name[i.name] for i in record.program.primal_inputs]
    if not grads:
        got, _ = run_spmd(record, order, None, m)
        torch.testing.assert_close(got[0], ref(*globals_))
        return
    refs = [g.clone().requires_grad_() for g in globals_]
    want = ref(*refs)
    cot = torch.randn(want.shape, dtype=want.dtype)
    want.backward(cot)
    got, gr = run_spmd(record, order, [cot], m)
    torch.testing.assert_close(got[0], want.detach())
    want_g = {f"L_{n}_": r.grad for n, r in zip(fn.__code__.co_varnames, refs)}
    for info, g in zip(record.program.primal_inputs, gr):
        torch.testing.assert_close(g, want_g[info.name])


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 8)
        self.out = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.out(self.fc(x).relu()).sum()


# ---------------------------------------------------------------------------------------------
# annotations, called eagerly: wrong types and placements
# ---------------------------------------------------------------------------------------------
@case(TypeError, ("mark_sharding", "torch.Tensor", "list"))
def mark_sharding_a_list():
    mark_sharding([1.0, 2.0], mesh(), ("dp", None))


@case(TypeError, ("mark_sharding", "torch.Tensor", "float"))
def mark_sharding_a_number():
    mark_sharding(1.5, mesh(), ("dp",))


@case(TypeError, ("with_sharding_constraint", "torch.Tensor", "dict"))
def constraint_on_a_dict():
    with_sharding_constraint({"x": torch.ones(2)}, mesh(), [S0, R])


@case(TypeError, ("enable_manual_sharding", "torch.Tensor"))
def manual_region_on_a_tuple():
    enable_manual_sharding((torch.ones(4),), ("dp",), mesh=mesh())


@case(ValueError, ("partition spec", "'pp'", "['dp', 'tp']", "(4, 6)"))
def partition_spec_unknown_axis():
    mark_sharding(torch.randn(4, 6), mesh(), ("pp", None))


@case(ValueError, ("partition spec", "3 entries", "2-D", "(4, 6)"))
def partition_spec_too_long():
    mark_sharding(torch.randn(4, 6), mesh(), ("dp", None, None))


@case(ValueError, ("partition spec", "used twice", "(4, 6)"))
def partition_spec_axis_twice():
    mark_sharding(torch.randn(4, 6), mesh(), ("tp", "tp"))


@case(ValueError, ("partition spec", "out of mesh order", "(8, 6)"))
def partition_spec_axes_out_of_order():
    mark_sharding(torch.randn(8, 6), mesh(), (("tp", "dp"), None))


@case(DistCompileError, ("with_sharding_constraint", "Shard(2)", "(4, 6)", "dp=2, tp=2"))
def constraint_dim_out_of_range():
    with_sharding_constraint(torch.randn(4, 6), mesh(), [Shard(2), R])


@case(DistCompileError, ("with_sharding_constraint", "Shard(-3)", "(4, 6)", "dp=2, tp=2"))
def constraint_negative_dim_out_of_range():
    with_sharding_constraint(torch.randn(4, 6), mesh(), [Shard(-3), R])


@case(DistCompileError, ("with_sharding_constraint", "Partial('prod')", "(4, 6)", "dp=2, tp=2"))
def constraint_partial_prod():
    with_sharding_constraint(torch.randn(4, 6), mesh(), [Partial("prod"), R])


@case(DistCompileError, ("with_sharding_constraint", "1 placement", "(4, 6)", "dp=2, tp=2"))
def constraint_too_few_placements():
    with_sharding_constraint(torch.randn(4, 6), mesh(), [S0])


@case(ValueError, ("partition spec", "'S0'", "2-D", "['dp', 'tp']"))
def constraint_placement_as_a_string():
    with_sharding_constraint(torch.randn(4, 6), mesh(), ["S0", R])


@case(DistCompileError, ("with_sharding_constraint", "block-strided", "(8, 6)", "dp=2, tp=2"))
def constraint_strided_nested_with_shard():
    with_sharding_constraint(torch.randn(8, 6), mesh(), [StridedShard(0, split_factor=2), S0])


@case(DistCompileError, ("with_sharding_constraint", "split_factor", "(6, 6)", "dp=2, tp=2"))
def constraint_strided_uneven_blocks():
    with_sharding_constraint(torch.randn(6, 6), mesh(), [StridedShard(0, split_factor=2), R])


@case(DistCompileError, ("with_sharding_constraint", "Shard(0)", "()", "dp=2, tp=2"))
def constraint_shard_of_a_scalar():
    with_sharding_constraint(torch.tensor(3.0), mesh(), [S0, R])


@case(DistCompileError, ("disable_manual_sharding", "full_shape", "(2, 6)", "(6, 6)"))
def manual_region_wrong_full_shape():
    m = mesh((2,), ("tp",))
    local = enable_manual_sharding(torch.randn(4, 6), ("tp", None), mesh=m)
    disable_manual_sharding(local * 2, ("tp", None), (6, 6), mesh=m)


@case(ValueError, ("Partial", "mesh axis 0"))
def partial_to_partition_spec():
    dynamo_dist.placements_to_partition_spec(mesh(), [Partial(), R], 2)


@case(ValueError, ("Mesh", "repeat", "[0, 0, 1, 2]"))
def mesh_with_repeated_ids():
    mesh()
    dynamo_dist.Mesh([0, 0, 1, 2], (2, 2))


@case(ValueError, ("Mesh", "3 device ids", "(2, 2)"))
def mesh_with_too_few_ids():
    mesh()
    dynamo_dist.Mesh([0, 1, 2], (2, 2))


@case(ValueError, ("Mesh", "unique names", "('x', 'x')"))
def mesh_with_repeated_axis_names():
    mesh()
    dynamo_dist.Mesh([0, 1, 2, 3], (2, 2), ("x", "x"))


# ---------------------------------------------------------------------------------------------
# shard_module and plans
# ---------------------------------------------------------------------------------------------
@case(DistCompileError, ("fc.weight", "Shard(5)", "(8, 4)", "tp=2"))
def plan_shard_dim_out_of_range():
    shard_module(Tiny(), mesh((2,), ("tp",)), ShardingPlan(plan={"fc.weight": {"tp": Shard(5)}}))


@case(DistCompileError, ("unknown mesh axis 'dp'", "['tp']"))
def plan_unknown_mesh_axis():
    shard_module(Tiny(), mesh((2,), ("tp",)), ShardingPlan(plan={"fc.weight": {"dp": S0}}))


@case(DistCompileError, ("'sp'", "tp"))
def plan_partition_spec_unknown_axis():
    shard_module(Tiny(), mesh((2,), ("tp",)),
                 ShardingPlan(plan={"fc.weight": PartitionSpec("sp", None)}))


@case(DistCompileError, ("fc.wieght", "fc.weight"))
def plan_key_with_a_typo():
    shard_module(Tiny(), mesh((2,), ("tp",)), ShardingPlan(plan={"fc.wieght": {"tp": S0}}))


@case(DistCompileError, ("input_plan", "'y'"))
def input_plan_unknown_argument():
    shard_module(Tiny(), mesh((2,), ("tp",)), ShardingPlan(input_plan={"y": {"tp": S0}}))


@case(DistCompileError, ("fc.weight", "Partial", "tp=2"))
def plan_partial_parameter():
    shard_module(Tiny(), mesh((2,), ("tp",)), ShardingPlan(plan={"fc.weight": {"tp": Partial()}}))


@case(TypeError, ("shard_module", "nn.Module"))
def shard_module_of_a_function():
    shard_module(lambda x: x, mesh((2,), ("tp",)), ShardingPlan())


@case(DistCompileError, ("tied", "a.weight", "b.weight", "S(0)", "S(1)", "tp=2"))
def tied_parameters_with_conflicting_placements():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4, bias=False)
            self.b = torch.nn.Linear(4, 4, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x)).sum()

    shard_module(Tied(), mesh((2,), ("tp",)),
                 ShardingPlan(plan={"a.weight": {"tp": S0}, "b.weight": {"tp": S1}}))


@case(None)
def uneven_parameter_split_trains():
    m = mesh((3,), ("tp",))
    model = shard_module(Tiny(), m, ShardingPlan(plan={"fc.weight": {"tp": S0},
                                                       "fc.bias": {"tp": S0}}))
    compile_(model)(torch.randn(2, 4))
    assert not compile_records()[-1].plan.fallbacks


# ---------------------------------------------------------------------------------------------
# compiled programs: bad pins name the user's line
# ---------------------------------------------------------------------------------------------
def _compiled_error(fn, *args):
    compile_(fn)(*args)  # Dynamo wraps a backend's error; the runner looks inside


@case(DistCompileError, ("with_sharding_constraint", "Shard(-3)", "cases.py", "dp=2, tp=2"))
def compiled_constraint_negative_dim():
    m = mesh()
    _compiled_error(lambda x: with_sharding_constraint(x * 2, m, [Shard(-3), R]) + 1,
                    torch.randn(4, 6))


@case(DistCompileError, ("with_sharding_constraint", "Partial('prod')", "dp=2, tp=2"))
def compiled_constraint_partial_prod():
    m = mesh()
    _compiled_error(lambda x: with_sharding_constraint(x * 2, m, [Partial("prod"), R]) + 1,
                    torch.randn(4, 6))


@case(DistCompileError, ("different device meshes", "L_a_", "dp=2", "tp=2"))
def dtensors_on_two_meshes():
    m = mesh()
    a = distribute_tensor(torch.randn(4, 4), m["dp"], [S0])
    b = distribute_tensor(torch.randn(4, 4), m["tp"], [S0])
    _compiled_error(lambda a, b: a + b, a, b)


@case(DistCompileError, ("data-dependent", "cases.py", "x[x > 0]", "fix:"))
def data_dependent_shape_on_a_sharded_value():
    m = mesh((2,), ("tp",))

    def f(x):
        x = with_sharding_constraint(x * 2, m, [S0])
        return x[x > 0].sum()

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        _compiled_error(f, torch.randn(8))


@case(DistCompileError, ("_local_scalar_dense", "cases.py", "int(y.sum())", "keep the value a"))
def a_number_read_from_a_tensor_in_the_program():
    """``int(t)`` with Dynamo's capture_scalar_outputs puts the read in the graph (transformers'
    MoE on a GPU did); the error names the user's line."""
    m = mesh((2,), ("tp",))

    def f(x):
        y = with_sharding_constraint(x * 2, m, [S0])
        return y * int(y.sum())

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        _compiled_error(f, torch.randn(8))


@case(None)
def a_second_shape_recompiles_with_static_shapes():
    """Dynamo makes a size symbolic at the second shape; dist specialises it instead (it was
    a DistCompileError asking for dynamic=False): one static compile per shape, both right."""
    m = mesh((2,), ("tp",))

    def f(x):
        return (x * 2).sum(0)

    check_on_ranks(m, f, torch.randn(4, 3), dtensors=[[S0]])
    check_on_ranks(m, f, torch.randn(6, 3), dtensors=[[S0]])
    shapes = [tuple(r.program.primal_inputs[0].shape) for r in compile_records()]
    assert shapes == [(4, 3), (6, 3)], shapes


@case(DistCompileError, ("in place", "input mutation", "fc"))
def parameter_updated_in_place():
    m = mesh((2,), ("tp",))
    model = shard_module(Tiny(), m, ShardingPlan(plan={"fc.weight": {"tp": S0}}))

    def step(x):
        with torch.no_grad():
            model.fc.bias.mul_(0.5)
        return model(x)

    torch.compile(step, backend="dist", options={"inductor": False})(torch.randn(2, 4))


@case(DistCompileError, ("aten.mm", "as it would on one device", "[4, 6] X [5, 3]",
                         "(4, 6)", "dp=2, tp=2"))
def matmul_shapes_that_do_not_match():
    m = mesh()
    compile_(lambda a, b: a @ b)(distribute_tensor(torch.randn(4, 6), m, [S0, R]),
                                 distribute_tensor(torch.randn(5, 3), m, [R, R]))


# ---------------------------------------------------------------------------------------------
# unusual but valid: must compute what one device computes
# ---------------------------------------------------------------------------------------------
@case(None)
def nested_pin_softmax():
    m = mesh()
    check_on_ranks(m, lambda x: torch.softmax(with_sharding_constraint(x, m, [S0, S0]), 0),
                   torch.randn(5))


@case(None)
def nested_pin_matmul_backward():
    m = mesh()

    def f(a, b):
        return a @ with_sharding_constraint(b, m, [S1, S1])

    check_on_ranks(m, f, torch.randn(8, 8), torch.randn(8, 8), grads=True)


@case(None)
def nested_pin_cat_uneven():
    m = mesh()
    check_on_ranks(m, lambda x: torch.cat([with_sharding_constraint(x, m, [S0, S0]), 2 * x]),
                   torch.randn(10))


@case(None)
def partition_spec_tuple_inside_a_program():
    m = mesh()
    check_on_ranks(m, lambda x: mark_sharding(x * 2, m, (("dp", "tp"), None)).softmax(0),
                   torch.randn(10, 3), ref=lambda x: (x * 2).softmax(0))


@case(None)
def dtensor_input_split_by_both_axes():
    m = mesh()
    check_on_ranks(m, lambda x, w: (x @ w).relu(), torch.randn(10, 4), torch.randn(4, 6),
                   dtensors=[[S0, S0], [R, R]], grads=True)


@case(None)
def three_axes_on_one_dim():
    m = mesh((2, 2, 2), ("a", "b", "c"))
    check_on_ranks(m, lambda x: (x * 3).cumsum(0), torch.randn(11, 3),
                   dtensors=[[S0, S0, S0]])


@case(None)
def uneven_split_five_over_four():
    m = mesh((4,), ("tp",))
    check_on_ranks(m, lambda x: (x.exp() * 2).sum(0), torch.randn(5, 3), dtensors=[[S0]])


@case(None)
def split_of_a_size_one_dim():
    m = mesh((4,), ("tp",))
    check_on_ranks(m, lambda x: x * 2 + 1, torch.randn(1, 3), dtensors=[[S0]])


@case(None)
def zero_size_dim():
    m = mesh((2,), ("tp",))
    check_on_ranks(m, lambda x: x * 2 + 1, torch.randn(0, 4), dtensors=[[S1]])


@case(None)
def float64_and_int_inputs():
    m = mesh((2,), ("tp",))
    check_on_ranks(m, lambda x, i: x * i, torch.randn(4, 3, dtype=torch.float64),
                   torch.arange(12).reshape(4, 3), dtensors=[[S0], [S0]])


@case(None)
def boolean_mask_sharded():
    m = mesh((2,), ("tp",))
    check_on_ranks(m, lambda x, keep: torch.where(keep, x, 0.0).sum(), torch.randn(6, 3),
                   torch.randn(6, 3) > 0, dtensors=[[S0], [S0]])


@case(None)
def pinned_to_a_pending_sum():
    m = mesh((2,), ("tp",))
    check_on_ranks(m, lambda x: with_sharding_constraint(x * 2, m, [Partial()]).exp(),
                   torch.randn(4, 3))


@case(None)
def pinned_to_a_pending_max():
    m = mesh((2,), ("tp",))
    check_on_ranks(m, lambda x: with_sharding_constraint(x * 2, m, [Partial("max")]) + 1,
                   torch.randn(4, 3))


@case(None)
def permuted_mesh_ranks():
    from torch.distributed.device_mesh import DeviceMesh

    mesh((4,), ("all",))
    m = DeviceMesh("cpu", [[3, 1], [0, 2]], mesh_dim_names=("dp", "tp"))
    check_on_ranks(m, lambda x, w: (x @ w).sum(1), torch.randn(4, 6), torch.randn(6, 8),
                   dtensors=[[S0, R], [R, S1]])


@case(None)
def non_zero_rank_compiles_the_same_program():
    m = mesh(rank=3)
    check_on_ranks(m, lambda x: torch.softmax(x, 1) * 2, torch.randn(6, 4),
                   dtensors=[[S0, S1]])


@case(None)
def torch_xla_style_mesh_object():
    mesh((4,), ("all",))
    m = dynamo_dist.Mesh([0, 1, 2, 3], (2, 2), ("dp", "tp"))
    x = torch.randn(8, 6)

    def f(x):
        return mark_sharding(x, m, ("dp", "tp")).sin().sum(0)

    compile_(f)(x)
    got, _ = run_spmd(compile_records()[-1], [x], None, m.to_device_mesh())
    torch.testing.assert_close(got[0], x.sin().sum(0))


@case(None)
def new_shape_recompiles():
    m = mesh((2,), ("tp",))
    f = torch.compile(lambda x: (x * 2).mean(0), backend="dist", dynamic=False,
                      options={"inductor": False})
    for k, rows in enumerate((4, 6, 8)):
        x = torch.randn(rows, 3)
        f(distribute_tensor(x, m, [S0]))
        assert len(compile_records()) == k + 1, "each shape compiles its own program"
        got, _ = run_spmd(compile_records()[-1], [x], None, m)
        torch.testing.assert_close(got[0], (x * 2).mean(0))


@case(DistCompileError, ("DTensor input", "global shape (5, 3)", "compiled for (6, 3)",
                         "local piece (3, 3)"))
def uneven_dtensor_batch_matching_an_earlier_program():
    """Dynamo guards a DTensor's local piece, not its global shape: rows 5 split 3 + 2 would
    run rank 0 on the program for 6 rows and rank 1 on the one for 4 (each mean divided by
    another count). Refused, not computed."""
    m = mesh((2,), ("tp",))
    f = torch.compile(lambda x: (x * 2).mean(0), backend="dist", dynamic=False,
                      options={"inductor": False})
    for rows in (6, 5):
        f(distribute_tensor(torch.randn(rows, 3), m, [S0]))


@case(None)
def new_placement_recompiles():
    m = mesh((2,), ("tp",))
    f = compile_(lambda x: (x * 2).softmax(1))
    x = torch.randn(4, 6)
    for pls in ([S0], [S1], [R]):
        f(distribute_tensor(x, m, pls))
        got, _ = run_spmd(compile_records()[-1], [x], None, m)
        torch.testing.assert_close(got[0], (x * 2).softmax(1))


@case(None)
def graph_break_after_mark_sharding_on_rank_one():
    m = mesh((2,), ("tp",), rank=1)

    def f(x):
        y = mark_sharding(x * 2, m, ("tp", None))
        print("a graph break")
        return y.sum()

    x = torch.randn(4, 3)
    out = torch.compile(f, backend="dist", options={"inductor": False})(x)
    assert out.shape == ()


@case(None)
def local_map_region():
    m = mesh((2,), ("tp",))

    @local_map(out_specs=("tp", None), in_specs=[("tp", None)], mesh=m)
    def double(local):
        return local * 2

    check_on_ranks(m, lambda x: double(x) + 1, torch.randn(4, 3), ref=lambda x: x * 2 + 1)


@case(None)
def explain_a_program_with_a_graph_break():
    m = mesh((2,), ("tp",))

    def f(x):
        y = with_sharding_constraint(x * 2, m, [S0])
        print("break")
        return y.sum()

    report = dynamo_dist.explain(f, distribute_tensor(torch.randn(4, 3), m, [R]))
    assert "break" in str(report).lower()


# ---------------------------------------------------------------------------------------------
# more meshes, plans and regions
# ---------------------------------------------------------------------------------------------
@case(DistCompileError, ("already a DTensor on another mesh", "fc.weight"))
def shard_module_twice_on_two_meshes():
    m = mesh()
    model = shard_module(Tiny(), m["tp"], ShardingPlan(plan={"fc.weight": {"tp": S0}}))
    shard_module(model, m["dp"], ShardingPlan(plan={"fc.weight": {"dp": S0}}))


@case(DistCompileError, ("unknown mesh axis 'tp'", "['dp']"))
def tensor_parallel_planner_without_a_tp_axis():
    from dynamo_dist import TensorParallelPlanner

    model = Tiny()
    shard_module(model, mesh((2,), ("dp",)), TensorParallelPlanner().build_plan(model))


@case(TypeError, ("TensorParallelPlanner", "axis", "DeviceMesh"))
def tensor_parallel_planner_given_the_mesh():
    from dynamo_dist import TensorParallelPlanner

    TensorParallelPlanner(mesh((2,), ("tp",)))


@case(ValueError, ("partition spec", "'sp'", "(4, 6)"))
def manual_region_unknown_axis():
    enable_manual_sharding(torch.randn(4, 6), ("sp", None), mesh=mesh())


@case(None)
def nested_plan_for_a_parameter():
    """A parameter split over both mesh axes on one dim (ZeRO over dp x tp): held as such."""
    m = mesh()
    model = shard_module(Tiny(), m, ShardingPlan(plan={
        "fc.weight": PartitionSpec(("dp", "tp"), None)}))
    assert tuple(model.fc.weight.placements) == (S0, S0)
    compile_(model)(torch.randn(4, 4))
    record = compile_records()[-1]
    held = [record.plan.placement(f"primals_{k + 1}")
            for k, i in enumerate(record.program.primal_inputs) if "fc" in i.name
            and "weight" in i.name]
    assert held and tuple(held[0]) == (S0, S0), held


@case(None)
def pinned_to_a_pending_max_with_gradient():
    m = mesh((2,), ("tp",))
    check_on_ranks(m, lambda x: with_sharding_constraint(x * 2, m, [Partial("max")]).exp(),
                   torch.randn(4, 3), grads=True)


@case(None)
def negative_dim_in_range():
    m = mesh()
    check_on_ranks(m, lambda x: with_sharding_constraint(x, m, [Shard(-1), Shard(-2)]).cos(),
                   torch.randn(4, 6), grads=True)


@case(None)
def int_tensor_pinned_to_a_pending_sum():
    m = mesh((2,), ("tp",))
    check_on_ranks(m, lambda i: with_sharding_constraint(i * 3, m, [Partial()]) + 1,
                   torch.arange(12).reshape(4, 3))


@case(None)
def three_axis_mesh_mixed_placements():
    m = mesh((2, 2, 2), ("a", "b", "c"))
    check_on_ranks(m, lambda x, w: torch.softmax(x @ w, -1), torch.randn(6, 5),
                   torch.randn(5, 7), dtensors=[[S0, R, S1], [R, S1, R]], grads=True)


@case(None)
def eager_mark_sharding_then_compile():
    m = mesh()
    x = torch.randn(8, 6)
    mark_sharding(x, m, (("dp", "tp"), None))
    f = compile_(lambda x: (x * 2).sum(0))
    f(x)
    record = compile_records()[-1]
    assert tuple(record.plan.placement("primals_1")) == (S0, S0)
    got, _ = run_spmd(record, [x], None, m)
    torch.testing.assert_close(got[0], (x * 2).sum(0))


@case(DistCompileError, ("another mesh", "dp=2"))
def constraint_on_another_mesh_than_the_inputs():
    m = mesh()
    other = m["tp"]
    _compiled_error(lambda x: with_sharding_constraint(x * 2, other, [S0]) + 1,
                    distribute_tensor(torch.randn(4, 4), m, [S0, R]))


@case(None)
def hybrid_mesh_program():
    mesh((8,), ("all",))
    hm = dynamo_dist.HybridMesh(ici_mesh_shape=(1, 4), dcn_mesh_shape=(2, 1),
                                axis_names=("dp", "tp"))
    m = hm.to_device_mesh()
    check_on_ranks(m, lambda x, w: (x @ w).relu().sum(0), torch.randn(6, 8), torch.randn(8, 12),
                   dtensors=[[S0, R], [R, S1]], grads=True)


@case(None)
def manual_region_with_a_nested_spec():
    m = mesh()

    @local_map(out_specs=(("dp", "tp"), None), in_specs=[(("dp", "tp"), None)], mesh=m)
    def double(local):
        return local * 2

    check_on_ranks(m, lambda x: double(x).softmax(0), torch.randn(8, 3),
                   ref=lambda x: (x * 2).softmax(0))
