"""``matmul_sums.fold``: a sum of matmul outputs computed by ``addmm`` chains, on graphs traced
with fake values as Inductor's post-grad graphs are, and run on real values against the graph
before the rewrite."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from inductor_passes import matmul_sums

aten = torch.ops.aten


def _traced(f, *args):
    return make_fx(f, tracing_mode="fake")(*args)


def _count(gm, target):
    return len(gm.graph.find_nodes(op="call_function", target=target))


def _check(f, args, folds: int):
    gm = _traced(f, *args)
    adds = _count(gm, aten.add.Tensor)
    assert matmul_sums.fold(gm.graph) == folds
    gm.graph.lint()
    gm.recompile()
    assert _count(gm, aten.add.Tensor) == adds - folds
    assert _count(gm, aten.addmm.default) == folds
    torch.testing.assert_close(gm(*args), f(*args), rtol=1e-5, atol=1e-5)
    return gm


def test_the_gradient_sum_of_three_projections_is_two_addmms():
    """The input gradient of q, k and v projections: three matmuls, viewed to (batch, seq,
    hidden), summed. Both adds fold; no mm is left but the first."""
    def f(g1, g2, g3, w1, w2, w3):
        view = lambda t: t.view(2, 4, 8)  # noqa: E731
        return view(g1 @ w1) + view(g2 @ w2) + view(g3 @ w3)

    args = [torch.randn(8, 6), torch.randn(8, 3), torch.randn(8, 5),
            torch.randn(6, 8), torch.randn(3, 8), torch.randn(5, 8)]
    gm = _check(f, args, folds=2)
    assert _count(gm, aten.mm.default) == 1


def test_a_matmul_read_elsewhere_is_not_absorbed():
    """Absorbing a matmul read by another op would compute it twice: only the other one is
    absorbed, and none when both are read elsewhere."""
    def one(a, b, c, d):
        ab = a @ b
        return ab + c @ d, ab * 2

    def both(a, b, c, d):
        ab, cd = a @ b, c @ d
        return ab + cd, ab * 2, cd * 3

    args = [torch.randn(4, 3), torch.randn(3, 5), torch.randn(4, 2), torch.randn(2, 5)]
    gm = _check(one, args, folds=1)
    assert _count(gm, aten.mm.default) == 1  # ``ab``, still read by mul
    _check(both, args, folds=0)


@pytest.mark.parametrize("case", ["broadcast", "dtype", "not-a-matmul"])
def test_sums_that_are_not_two_same_shape_matmuls_are_left(case):
    def broadcast(a, b, c):
        return a @ b + c[0]  # a row broadcast over the matmul's rows

    def dtype(a, b, c):
        return (a @ b) + (a.double() @ b.double())  # type promotion

    def not_a_matmul(a, b, c):
        return a @ b + c

    f = {"broadcast": broadcast, "dtype": dtype, "not-a-matmul": not_a_matmul}[case]
    _check(f, [torch.randn(4, 3), torch.randn(3, 5), torch.randn(4, 5)], folds=0)


def test_symbolic_shapes_keep_their_add():
    """Comparing symbolic sizes this late would add guards: a sum of matmuls of a dynamic
    batch is left as it is."""
    def f(a, b, c, d):
        return a @ b + c @ d

    args = [torch.randn(4, 3), torch.randn(3, 5), torch.randn(4, 2), torch.randn(2, 5)]
    gm = make_fx(f, tracing_mode="symbolic")(*args)
    assert matmul_sums.fold(gm.graph) == 0
    assert _count(gm, aten.add.Tensor) == 1
