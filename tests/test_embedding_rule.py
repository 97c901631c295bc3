"""Embedding rules (rules/embedding.py): every OpSpec offered computes the global lookup and its
gradient on local pieces (the vocabulary split through its own masked computation, as the
lowering runs it), and a vocabulary-split embedding weight is planned as Megatron-LM's
VocabParallelEmbedding: one all_reduce of the looked-up rows, no collective for the weight or
its gradient (it was an all_to_all of the whole table and an all_gather of the rows)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from dynamo_dist.testing.conformance.simulate import shard_global, unshard
from inductor_passes.sharding import rules
from inductor_passes.sharding.rules import RuleKind

aten = torch.ops.aten
P, R = Partial("sum"), Replicate()


def _node(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    return next(n for n in gm.graph.nodes if n.op == "call_function")


def _specs(node, mesh_shape):
    rep = [(R,) * len(mesh_shape) for _ in rules.tensor_args(node)]
    return rules.op_strategy(node, rep, None, mesh_shape, lambda n: None)


def _cases(vocab, hidden, tokens, padding_idx, seed):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=g)
    ids = torch.randint(0, vocab, tokens, generator=g)
    grad = torch.randn(*tokens, hidden, generator=g)
    yield "forward", lambda w, i: aten.embedding(w, i, padding_idx), (weight, ids)
    for scale in (False, True):
        yield f"backward scale={scale}", \
            lambda g_, i: aten.embedding_dense_backward(g_, i, vocab, padding_idx, scale), \
            (grad, ids)


def _check_every_spec(mesh_shape, vocab=7, hidden=4, tokens=(3, 5), padding_idx=-1, seed=0):
    """Each OpSpec on every rank of ``mesh_shape``: its local result (the rule's own computation
    where it has one) put back together under its output placements equals the global op."""
    seen = []
    for name, fn, args in _cases(vocab, hidden, tokens, padding_idx, seed):
        node = _node(fn, *args)
        want = fn(*args)
        specs = _specs(node, mesh_shape)
        assert specs, name
        for spec in specs:
            own = rules.local_impl(node, spec)
            outs = {}
            for coord in itertools.product(*(range(n) for n in mesh_shape)):
                local = [shard_global(a, p, coord, mesh_shape) for a, p in zip(args, spec.inputs)]
                outs[coord] = own(local, {}, mesh_shape, coord) if own else fn(*local)
            got = unshard(outs, spec.output, mesh_shape, name)
            torch.testing.assert_close(got, want, msg=lambda m: f"{name} {spec}: {m}")
            seen.append((name, spec))
    return seen


@settings(max_examples=40, deadline=None)
@given(mesh_shape=st.sampled_from([(2,), (3,), (4,), (2, 2)]), vocab=st.integers(1, 9),
       hidden=st.integers(1, 5), tokens=st.tuples(st.integers(1, 4), st.integers(1, 5)),
       padding=st.booleans(), seed=st.integers(0, 2**16))
def test_every_offered_spec_computes_the_global_result(mesh_shape, vocab, hidden, tokens,
                                                        padding, seed):
    """Random vocabulary, hidden and token sizes (uneven and empty pieces included: a vocabulary
    of 1 on 4 ranks), a padding row or none, two splits at once on a 2x2 mesh."""
    _check_every_spec(mesh_shape, vocab, hidden, tokens, seed % vocab if padding else -1, seed)


def test_the_vocabulary_split_is_offered_and_checked():
    """Not vacuous: the vocabulary options are among those the property runs, beside other
    splits on a second mesh axis; the backward of a frequency-scaled embedding offers none (its counts need every
    token)."""
    seen = _check_every_spec((2, 2), vocab=9, padding_idx=4)
    vocab = {(name, s.inputs, s.output) for name, s in seen if s.kind is RuleKind.VOCAB_EMBEDDING}
    assert ("forward", ((Shard(0), R), (R, R)), (P, R)) in vocab
    assert ("forward", ((Shard(0), Shard(1)), (R, R)), (P, Shard(2))) in vocab
    assert ("backward scale=False", ((R, Shard(0)), (R, Shard(0))), (Shard(0), P)) in vocab
    assert ("backward scale=False", ((R, R), (R, R)), (Shard(0), R)) in vocab
    assert not any(name == "backward scale=True" for name, _, _ in vocab)


def test_a_vocabulary_split_weight_is_planned_as_megatron_s(fake_mesh):
    """An embedding whose weight arrives split over the vocabulary (a DTensor Shard(0), as HF's
    tp_plan and torchtitan shard it) and whose rows are then used replicated: one all_reduce of
    the rows in the forward, nothing in the backward; forward and weight gradient equal one
    device's on every simulated rank (padding row included)."""
    from torch.distributed.tensor import distribute_tensor

    from dynamo_dist import compile_records
    from dynamo_dist.testing.conformance.simulate import run_spmd

    mesh = fake_mesh((2,), ("tp",))
    weight, lin = torch.randn(11, 6), torch.randn(6, 6)
    ids = torch.randint(0, 11, (3, 5))
    ids[0, 0] = 2

    def f(w, i, lin):
        return torch.nn.functional.embedding(i, w, padding_idx=2) @ lin

    dw = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
    dl = distribute_tensor(lin, mesh, [Replicate()]).requires_grad_()
    di = distribute_tensor(ids, mesh, [Replicate()])
    torch.compile(f, backend="dist", fullgraph=True, options={"inductor": False})(dw, di, dl)
    record = compile_records()[-1]
    entries = record.ledger.entries
    assert [(e.kind, e.phase) for e in entries] == [("all_reduce", "forward")], entries
    assert entries[0].bytes == 3 * 5 * 6 * 4  # the looked-up rows, not the table
    wr, lr = weight.clone().requires_grad_(), lin.clone().requires_grad_()
    want = f(wr, ids, lr)
    tangent = torch.randn_like(want)
    want.backward(tangent)
    # the program's inputs in Dynamo's order (by first use), told apart by shape
    by_shape = {(11, 6): (weight, wr), (3, 5): (ids, None), (6, 6): (lin, lr)}
    primals = [n for n in record.program.graph_module.graph.find_nodes(op="placeholder")
               if n.name.startswith("primals")]
    order = [by_shape[tuple(n.meta["val"].shape)] for n in primals]
    (got,), grads = run_spmd(record, [x for x, _ in order], [tangent], mesh)
    torch.testing.assert_close(got, want)
    for (_, ref), grad in zip(order, grads):
        if ref is not None:
            torch.testing.assert_close(grad, ref.grad)
    assert wr.grad[2].abs().sum() == 0  # the padding row's gradient stayed zero


@pytest.mark.parametrize("mesh_shape", [(2,), (3,)])
def test_every_spec_on_fixed_sizes(mesh_shape):
    _check_every_spec(mesh_shape, vocab=10, padding_idx=3)
