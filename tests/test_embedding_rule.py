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


def _fsdp_embedding_step(fake_mesh, vocab: int, batch: int, seq: int):
    """An embedding and a head, both FSDP-sharded (Shard(0) on the data axis 'dp' of 2 ranks),
    the token ids split over the batch there: (record, check) where check() runs the compiled
    step on every simulated rank and compares the loss and gradients with one device's."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from dynamo_dist import compile_records
    from dynamo_dist.testing.conformance.simulate import run_spmd
    from inductor_passes.core.mesh_facts import add_data_axes

    mesh = fake_mesh((2,), ("dp",))
    add_data_axes(mesh, ("dp",))
    g = torch.Generator().manual_seed(vocab)
    weight, head = torch.randn(vocab, 64, generator=g), torch.randn(64, 8, generator=g)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)

    def f(w, i, h):
        return (torch.nn.functional.embedding(i, w) @ h).square().mean()

    dw = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
    dh = distribute_tensor(head, mesh, [Shard(0)]).requires_grad_()
    # this rank's rows of the ids, as they are (``distribute_tensor`` over a fake process group
    # scatters uninitialised memory on torch 2.11: out-of-range ids for the compiling call)
    di = DTensor.from_local(ids.chunk(2)[0], mesh, [Shard(0)], run_check=False,
                            shape=ids.shape, stride=ids.stride())
    torch.compile(f, backend="dist", fullgraph=True, options={"inductor": False})(dw, di, dh)
    record = compile_records()[-1]

    def check():
        wr, hr = weight.clone().requires_grad_(), head.clone().requires_grad_()
        want = f(wr, ids, hr)
        want.backward()
        by_shape = {(vocab, 64): (weight, wr), (batch, seq): (ids, None), (64, 8): (head, hr)}
        primals = [n for n in record.program.graph_module.graph.find_nodes(op="placeholder")
                   if n.name.startswith("primals")]
        order = [by_shape[tuple(n.meta["val"].shape)] for n in primals]
        (got,), grads = run_spmd(record, [x for x, _ in order], [torch.ones(())], mesh)
        torch.testing.assert_close(got, want)
        for (_, ref), grad in zip(order, grads):
            if ref is not None:
                torch.testing.assert_close(grad, ref.grad)

    return record, check


def _embedding_backward(record):
    return next(p for p in record.plan.nodes.values()
                if p.op == str(aten.embedding_dense_backward.default))


def test_a_large_vocabulary_accumulates_its_gradient_split_on_the_data_axis(fake_mesh):
    """Vocabulary 1024 rows of 64, 2 x 4 tokens a step: gathering the tokens' gradients (8 x 64
    floats) and ids costs less than reduce-scattering a whole [1024, 64] gradient (latency
    included), so each data-parallel rank accumulates only the 512 rows it holds: the weight's
    gradient lands in its FSDP shard with no reduce_scatter, the batch gathers on dp are only
    the embedding backward's (not reported as batch gathers), and the numbers equal one
    device's."""
    record, check = _fsdp_embedding_step(fake_mesh, vocab=1024, batch=2, seq=4)
    assert _embedding_backward(record).kind is RuleKind.VOCAB_EMBEDDING
    entries = record.ledger.entries
    scattered = [e for e in entries if e.kind == "reduce_scatter"]
    assert [e.bytes for e in scattered] == [64 * 8 * 4], entries  # the head's gradient only
    gathers = [e for e in entries if e.kind == "all_gather" and e.phase == "backward" and
               e.node == _embedding_backward(record).name]
    assert sorted(e.bytes for e in gathers) == [4 * 8, 4 * 64 * 4], entries  # per rank
    assert not record.activation_gathers("dp")
    check()


def test_more_tokens_than_rows_reduce_scatter_the_embedding_gradient(fake_mesh):
    """Vocabulary 6 rows of 64, 4 x 16 tokens a step: the whole [6, 64] gradient is the smaller
    thing to move, so it is summed over the batch split and reduce-scattered (FSDP's plan); no batch
    gathered on dp."""
    record, check = _fsdp_embedding_step(fake_mesh, vocab=6, batch=4, seq=16)
    assert _embedding_backward(record).kind is RuleKind.EMBEDDING
    kinds = sorted((e.kind, e.bytes) for e in record.ledger.entries if e.phase == "backward"
                   and e.kind in ("reduce_scatter", "all_gather"))
    assert ("reduce_scatter", 6 * 64 * 4) in kinds, record.ledger.entries
    assert not [e for e in record.ledger.entries if e.kind == "all_gather" and
                e.node == _embedding_backward(record).name]
    check()
