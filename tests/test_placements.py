import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from inductor_passes.core.compat import StridedShard
from inductor_passes.core.placements import fmt, local_shape, parse, shard_range, valid_for
from inductor_passes.sharding.cost import redistribute_cost

placement = st.one_of(st.just(Replicate()), st.integers(0, 3).map(Shard),
                      st.sampled_from(["sum", "avg", "max", "min"]).map(Partial))


@given(st.lists(placement, min_size=1, max_size=3))
def test_fmt_parse_roundtrip(pls):
    assert parse(fmt(tuple(pls))) == tuple(pls)


def test_fmt_of_placements_made_while_dynamo_traces():
    """``pin_placements`` encodes the user's placements while Dynamo traces: placements made in
    the traced code keep their short form (torch 2.11's Dynamo answered False to
    ``type(p) is Replicate`` there, and the backend refused '[S(0),Replicate()]')."""
    def encode(x):
        return x + 1, fmt((Shard(0), Replicate(), Partial("max")))

    assert torch.compile(encode, backend="eager", fullgraph=True)(torch.ones(2))[1] == \
        "[S(0),R,P(max)]"


def test_valid_for_rejects_nested_and_out_of_range():
    assert valid_for((8, 6), (Shard(0), Shard(1)), (2, 3))
    assert valid_for((8, 6), (Shard(1),), (4,))                # uneven: pieces 2, 2, 2, 0
    assert not valid_for((8, 6), (Shard(0), Shard(0)), (2, 2))  # nested: not for op rules
    assert valid_for((8, 6), (Shard(0), Shard(0)), (2, 2), nested=True)  # a pin may nest
    assert not valid_for((8, 6), (StridedShard(0, split_factor=2), Shard(0)), (2, 2),
                         nested=True)                           # never with _StridedShard
    assert not valid_for((8, 6), (Shard(2),), (2,))             # no dim 2


@given(st.integers(0, 40), st.integers(1, 8))
def test_shard_range_is_torch_chunk(size, n):
    x = torch.arange(size)
    pieces = list(x.chunk(n)) if size else []
    for k in range(n):
        offset, length = shard_range(size, n, k)
        want = pieces[k] if k < len(pieces) else x[:0]
        assert torch.equal(x[offset:offset + length], want)


def test_local_shape():
    assert local_shape((8, 6, 4), (Shard(0), Shard(2)), (2, 2)) == (4, 6, 2)
    assert local_shape((8, 6), (Partial(), Replicate()), (2, 2)) == (8, 6)
    # uneven: the largest piece without a coordinate, the rank's own piece with one
    assert local_shape((5, 6), (Shard(0),), (4,)) == (2, 6)
    assert [local_shape((5, 6), (Shard(0),), (4,), (k,))[0] for k in range(4)] == [2, 2, 1, 0]


def test_cost_orders_collectives():
    shape, mesh = (1024, 1024), (4,)
    ag = redistribute_cost(shape, torch.float32, (Shard(0),), (Replicate(),), mesh)
    ar = redistribute_cost(shape, torch.float32, (Partial(),), (Replicate(),), mesh)
    a2a = redistribute_cost(shape, torch.float32, (Shard(0),), (Shard(1),), mesh)
    free = redistribute_cost(shape, torch.float32, (Replicate(),), (Shard(1),), mesh)
    assert redistribute_cost(shape, torch.float32, (Shard(0),), (Shard(0),), mesh) == 0
    assert free < a2a < ag < ar
