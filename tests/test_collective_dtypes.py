"""A bool value through the collectives lowering emits: it travels as uint8 (Inductor's C++
backend typed a gathered bool as int64 where a vectorized ``where`` read it, and failed to
compile a gathered ReLU mask), and arrives with its values on every rank."""

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dynamo_dist import compile_records, with_sharding_constraint
from dynamo_dist.testing.conformance.simulate import run_spmd
from inductor_passes.core.placements import valid_for
from tests.test_strided import SS, _check_redistribute, _redistribute_on_ranks


def _masked_sum(mesh, src, dst):
    def f(x, y):
        m = with_sharding_constraint(x > 0, mesh, [src])  # the mask made split ...
        m = with_sharding_constraint(m, mesh, [dst])      # ... and moved
        return torch.where(m, 0.0, y / 16).sum(dim=(0, 2, 3))
    return f


@pytest.mark.parametrize("src,dst,kind", [(Shard(1), Replicate(), "all_gather"),
                                          (Shard(1), Shard(0), "all_to_all")])
def test_a_bool_mask_is_moved_and_compiled(fake_mesh, src, dst, kind):
    mesh = fake_mesh((2,), ("tp",))
    f = _masked_sum(mesh, src, dst)
    x, y = torch.randn(4, 32, 4, 4), torch.randn(4, 32, 4, 4)
    args = [distribute_tensor(t, mesh, [Replicate()]) for t in (x, y)]
    torch.compile(f, backend="dist", fullgraph=True)(*args)  # Inductor: compiles
    record = compile_records()[-1]
    assert record.ledger.entries[0].kind == kind  # the mask's move (then the sum's, if any)
    torch._dynamo.reset()
    torch.compile(f, backend="dist", fullgraph=True, options={"inductor": False})(*args)
    record = compile_records()[-1]
    (got,), _ = run_spmd(record, [x, y], None, mesh)  # every rank's program, run
    torch.testing.assert_close(got, torch.where(x > 0, 0.0, y / 16).sum(dim=(0, 2, 3)))


_PLACEMENT = st.sampled_from([Replicate(), Shard(0), Shard(1), SS(0, 2), SS(1, 3)])


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(src=st.tuples(_PLACEMENT, _PLACEMENT), dst=st.tuples(_PLACEMENT, _PLACEMENT),
       last=st.sampled_from([5, 12]))
def test_bool_redistributes_match_the_definition(fake_mesh, src, dst, last):
    """Every move of a bool value between split/replicated placements on a 2 x 2 mesh, even and
    uneven pieces: each rank holds exactly its piece of the definition, one ledger record per
    collective (``test_strided``'s check, on bools), and every piece still a bool."""
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    full = torch.randn(12, 12, last) > 0
    assume(valid_for(full.shape, src, (2, 2)) and valid_for(full.shape, dst, (2, 2)))
    _check_redistribute(mesh, full, src, dst)
    got, _, _ = _redistribute_on_ranks(mesh, full, src, dst)
    assert all(x.dtype == torch.bool for x in got.values())
