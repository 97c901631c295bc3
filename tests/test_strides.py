"""Inputs and outputs that are not contiguous, compiled with Inductor: a transposed or sliced plain
input, a DTensor whose local tensor is transposed, a channels-last input or parameter. Inductor
checks the strides it compiled for on every call; values and gradients must equal one device's,
and an output DTensor's declared strides must describe its local tensor."""

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dynamo_dist import compile_records
from dynamo_dist.plans import DataParallelPlanner, shard_module
from inductor_passes.core import compat
from inductor_passes.layout import dense_strides, dim_order


def compiled(fn):
    return torch.compile(fn, backend="dist", fullgraph=True, options={"inductor": True})


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


@pytest.fixture
def one_rank(fake_mesh):
    """A 1-rank mesh: every collective is the identity, so values are real under Inductor."""
    compat.allow_implicit_replication(True)
    return fake_mesh((1,), ("dp",))


PLAIN = {
    "transposed": lambda: torch.randn(8, 6).t(),
    "sliced": lambda: torch.randn(6, 16)[:, ::2],
    "offset view": lambda: torch.randn(7, 8)[1:],
}


@pytest.mark.parametrize("name", sorted(PLAIN))
def test_non_contiguous_plain_input(one_rank, name):
    torch.manual_seed(0)
    w_full = torch.randn(8, 5)
    w = torch.nn.Parameter(distribute_tensor(w_full, one_rank, [Shard(0)]))
    x = PLAIN[name]().requires_grad_()

    def f(x):
        return (x @ w).relu()

    out = compiled(f)(x)
    full(out).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    w_ref = w_full.clone().requires_grad_()
    want = (x_ref @ w_ref).relu()
    want.sum().backward()
    torch.testing.assert_close(full(out), want)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(full(w.grad), w_ref.grad)


def test_dtensor_with_a_transposed_local_tensor(one_rank):
    local = torch.randn(6, 8).t()  # [8, 6], strides (1, 8)
    x = DTensor.from_local(local, one_rank, [Shard(0)], run_check=False).requires_grad_()
    assert x.to_local().stride() == (1, 8)
    out = compiled(lambda x: torch.tanh(x) * 3)(x)
    full(out).sum().backward()
    ref = local.detach().clone().requires_grad_()
    (torch.tanh(ref) * 3).sum().backward()
    torch.testing.assert_close(full(out), torch.tanh(local) * 3)
    torch.testing.assert_close(full(x.grad), ref.grad)
    # the output keeps the input's layout (as one device's tanh does), and says so
    assert out.stride() == (1, 8) and out.to_local().stride() == (1, 8)


def test_output_strides_are_what_the_dtensor_declares(one_rank):
    x = distribute_tensor(torch.randn(4, 6), one_rank, [Replicate()])
    out = compiled(lambda x: x.t() * 2)(x)
    assert out.stride() == (x.t() * 2).stride() == (1, 6)
    assert out.to_local().stride() == out.stride()
    torch.testing.assert_close(full(out), x.full_tensor().t() * 2)


def test_channels_last_input_and_parameter_train_like_one_device(one_rank):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                              torch.nn.ReLU(), torch.nn.MaxPool2d(2))
    ref = ref.to(memory_format=torch.channels_last)  # channels-last parameters
    model = copy.deepcopy(ref)
    shard_module(model, one_rank, DataParallelPlanner(mesh_axis_size=1).build_plan(model))
    # distribute_tensor copies a piece contiguous (its DTensor still declares channels-last
    # strides: the runtime restrides that); make the local weight channels-last itself
    w = model[0].weight
    model[0].weight = torch.nn.Parameter(DTensor.from_local(
        w.to_local().contiguous(memory_format=torch.channels_last), one_rank, w.placements,
        run_check=False))
    assert model[0].weight.to_local().is_contiguous(memory_format=torch.channels_last)
    step = torch.compile(model, backend="dist", options={"inductor": True})
    for i in range(2):
        x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(i))
        x = x.to(memory_format=torch.channels_last).requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        out, want = step(x), ref(x_ref)
        c = torch.randn(want.shape, generator=torch.Generator().manual_seed(10 + i))
        (full(out) * c).sum().backward()
        (want * c).sum().backward()
        torch.testing.assert_close(full(out), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
        assert x.grad.is_contiguous(memory_format=torch.channels_last)
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(full(p.grad), q.grad, rtol=1e-4, atol=1e-5, msg=n)
            p.grad, q.grad = None, None
    for b, rb in zip(model.buffers(), ref.buffers()):
        torch.testing.assert_close(b, rb)
    # the output DTensor describes its channels-last local tensor
    order = dim_order(out.shape, out.stride())
    assert out.stride() == dense_strides(out.shape, order) and order == (0, 2, 3, 1)
    assert out.to_local().stride() == out.stride()


def test_split_dtensor_piece_laid_out_as_its_global_value(fake_mesh):
    """Rank 0 of 2 (no collective in the program, so its values are real on the fake group):
    the local piece of a transposed global value is compiled transposed; a piece that arrives
    contiguous is restrided at the boundary, not rejected by Inductor's stride check."""
    mesh = fake_mesh((2,), ("dp",))
    g = torch.randn(6, 8).t()                              # global [8, 6], strides (1, 8)
    x = distribute_tensor(g, mesh, [Shard(0)])             # rank 0: rows 0..3
    x = DTensor.from_local(x.to_local().t().contiguous().t(), mesh, [Shard(0)], run_check=False)
    assert x.stride() == (1, 8) and x.to_local().stride() == (1, 4)
    step = compiled(lambda x: x * 2 + 1)
    out = step(x)
    torch.testing.assert_close(out.to_local(), g[:4] * 2 + 1)
    assert out.to_local().stride() == (1, 4) and out.stride() == (1, 8)
    record = compile_records()[-1]
    assert record.step._input_strides == [(1, 4)]
    # the same global layout, this piece contiguous: copied into the compiled layout
    y = DTensor.from_local(x.to_local().contiguous(), mesh, [Shard(0)], run_check=False,
                           shape=x.shape, stride=x.stride())
    torch.testing.assert_close(step(y).to_local(), g[:4] * 2 + 1)
