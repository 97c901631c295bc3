"""ConvNets under data (and tensor) parallelism: convolution / pooling / batch-norm rules, and
whole training steps on simulated ranks against one device (forward, running statistics,
gradients), with the batch kept split: no activation is gathered on the data axis."""

import copy

import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from dynamo_dist import compile_records
from dynamo_dist.testing.conformance.simulate import run_spmd
from dynamo_dist.testing.models import ConvNet, image_batch
from dynamo_dist.plans import DataParallelPlanner, TensorParallelPlanner, shard_module
from inductor_passes.sharding import rules
from inductor_passes.sharding.rules.moments import in_op_cost

aten = torch.ops.aten
R, P, S0, S1 = (Replicate(),), (Partial("sum"),), (Shard(0),), (Shard(1),)


def _node(fn, *shapes, target):
    gm = make_fx(fn, tracing_mode="fake", decomposition_table={})(*[torch.randn(s) for s in shapes])
    return next(n for n in gm.graph.nodes if n.target == target)


def _specs(node, mesh_shape=(2,)):
    return {(s.inputs, s.output) for s in rules.op_strategy(node, [], None, mesh_shape,
                                                             lambda n: None)}


# ------------------------------------------------------------------------------------ rules

def test_convolution_splits_samples_and_channels_never_space():
    conv = _node(lambda x, w, b: torch.nn.functional.conv2d(x, w, b, padding=1),
                 (4, 3, 8, 8), (6, 3, 3, 3), (6,), target=aten.convolution.default)
    specs = _specs(conv)
    assert ((S0, R, R), S0) in specs                 # samples
    assert ((R, S0, S0), S1) in specs                # output channels
    assert ((S1, S1, P), P) in specs                 # input channels: a contraction
    assert ((P, R, P), P) in specs                   # linear in the input (bias counted once)
    assert not any(isinstance(p, Shard) and p.dim >= 2 for ins, out in specs
                   for p in (*ins[0], *out))         # a window would cross the cut


def test_grouped_convolution_splits_samples_only():
    conv = _node(lambda x, w: torch.nn.functional.conv2d(x, w, groups=3),
                 (4, 6, 8, 8), (6, 2, 3, 3), target=aten.convolution.default)
    shards = {out for ins, out in _specs(conv) if isinstance(out[0], Shard)}
    assert shards == {S0}


def test_convolution_backward_rules():
    conv_bwd = aten.convolution_backward.default
    gm = make_fx(lambda go, x, w: conv_bwd(go, x, w, [6], [1, 1], [1, 1], [1, 1], False, [0, 0],
                                           1, [True, True, True]),
                 tracing_mode="fake")(torch.randn(4, 6, 8, 8), torch.randn(4, 3, 8, 8),
                                      torch.randn(6, 3, 3, 3))
    node = next(n for n in gm.graph.nodes if n.target is conv_bwd)
    specs = _specs(node)
    assert ((S0, S0, R), (S0, P, P)) in specs        # samples: weight gradients pending sums
    assert ((S1, R, S0), (P, S0, S0)) in specs       # output channels
    assert ((R, S1, S1), (S1, S1, R)) in specs       # input channels
    assert ((P, R, R), (P, P, P)) in specs           # linear in grad_output


def test_pooling_splits_leading_dims_and_is_linear_only_where_it_should():
    maxpool = _node(lambda x: torch.nn.functional.max_pool2d(x, 2, return_indices=True),
                    (4, 3, 8, 8), target=aten.max_pool2d_with_indices.default)
    specs = _specs(maxpool)
    assert ((S0,), (S0, S0)) in specs and ((S1,), (S1, S1)) in specs
    assert not any(isinstance(o[0], (Partial, Shard)) and (isinstance(o[0], Partial) or
                                                            o[0].dim >= 2) for _, o in specs)
    avg = _node(lambda x: torch.nn.functional.avg_pool2d(x, 2), (4, 3, 8, 8),
                target=aten.avg_pool2d.default)
    assert ((P,), P) in _specs(avg) and ((S1,), S1) in _specs(avg)
    unbatched = _node(lambda x: torch.nn.functional.avg_pool2d(x, 2), (3, 8, 8),
                      target=aten.avg_pool2d.default)
    assert {o for _, o in _specs(unbatched) if isinstance(o[0], Shard)} == {S0}


def test_variance_over_a_split_dim_is_replicated_with_its_all_reduces_priced():
    vm = _node(lambda x: torch.var_mean(x, [0, 2, 3], correction=0, keepdim=True),
               (4, 3, 8, 8), target=aten.var_mean.correction)
    specs = {s.inputs: s for s in rules.op_strategy(vm, [], None, (2,), lambda n: None)}
    assert specs[(S0,)].output == (R, R)             # statistics over the global batch
    assert specs[(S1,)].output == (S1, S1)           # per channel: stays split
    assert (P,) not in specs                         # a variance is not linear
    assert in_op_cost(vm, specs[(S0,)], (2,)) > 0 == in_op_cost(vm, specs[(S1,)], (2,))


# ------------------------------------------------------------------ simulated training steps

def dynamo_name(fqn: str, kind: str) -> str:
    """The graph input name Dynamo gives a parameter or buffer, without its prefix (``L_self_``
    or ``L_inner_self_``: shard_module wraps forward)."""
    *mods, leaf = fqn.split(".")
    return "".join(f"modules_{m}_" for m in mods) + f"{kind}_{leaf}_"


def _key(name: str) -> str:
    return name.split("self_", 1)[1] if "self_modules_" in name else name


def global_args(record, ref: torch.nn.Module, **inputs) -> list[torch.Tensor]:
    """GLOBAL values of the record's primals: ``ref``'s parameters and buffers (cloned), and
    ``inputs`` by Dynamo's input name (``L_args_0_``, ``L_kwargs_labels_``)."""
    values = {dynamo_name(n, "parameters"): p.detach() for n, p in ref.named_parameters()}
    values.update({dynamo_name(n, "buffers"): b.clone() for n, b in ref.named_buffers()})
    values.update(inputs)
    return [values[_key(i.name)] for i in record.program.primal_inputs]


def check_step(record, ref, mesh, batch, atol=1e-5):
    """One training step of ``ref`` (one device) against the record run on every rank of
    ``mesh``: loss, written-back buffers (running statistics) and every parameter's gradient."""
    x, y = batch
    args = global_args(record, ref, L_args_0_=x, L_x_=x, L_kwargs_labels_=y, L_labels_=y)
    outs, grads = run_spmd(record, args, [torch.ones(())], mesh)
    loss = ref(x, labels=y)
    loss.backward()
    torch.testing.assert_close(outs[0], loss, rtol=1e-5, atol=0)
    new = dict(zip(record.program.mutated_inputs, outs[len(outs) -
                                                         len(record.program.mutated_inputs):]))
    buffers = {dynamo_name(n, "buffers"): b for n, b in ref.named_buffers()}
    assert len(new) == (len(buffers) if ref.training else 0)
    for k, value in new.items():
        torch.testing.assert_close(value, buffers[_key(record.program.primal_inputs[k].name)],
                                   rtol=1e-5, atol=1e-6)
    named = {dynamo_name(n, "parameters"): p for n, p in ref.named_parameters()}
    for info, g in zip(record.program.primal_inputs, grads):
        if _key(info.name) in named:
            torch.testing.assert_close(g, named[_key(info.name)].grad, rtol=1e-4, atol=atol,
                                       msg=info.name)


def compile_once(model, mesh, plan, batch, train=True):
    shard_module(model, mesh, plan)
    model.train(train)
    compiled = torch.compile(model, backend="dist", options={"inductor": False})
    x, y = batch
    compiled(x, labels=y).backward()
    return compile_records()[-1]


@pytest.mark.parametrize("mesh_shape,names,fsdp,batch", [
    ((2,), ("dp",), True, 4),     # FSDP
    ((2,), ("dp",), False, 4),    # DDP
    ((2,), ("dp",), True, 3),     # an uneven batch (2 and 1 samples): statistics still global
    ((2, 2), ("dp", "tp"), True, 4),
    ((2,), ("tp",), False, 4)])
def test_convnet_step_matches_one_device(fake_mesh, mesh_shape, names, fsdp, batch):
    mesh = fake_mesh(mesh_shape, names)
    torch.manual_seed(0)
    ref = ConvNet()
    model = copy.deepcopy(ref)
    plan = TensorParallelPlanner().build_plan(model) if "tp" in names else None
    if "dp" in names:
        plan = DataParallelPlanner(shard_params=fsdp, mesh_axis_size=2).build_plan(model, plan)
    record = compile_once(model, mesh, plan, image_batch(0, batch))
    assert not record.plan.fallbacks, record.plan.fallbacks
    if "dp" in names:
        assert not record.activation_gathers("dp"), record.plan.to_text()
        # SyncBatchNorm's statistics: per-channel partial sums all_reduced, twice
        stats = [e for e in record.ledger.entries if e.node.startswith("var_mean")]
        assert [e.kind for e in stats] == ["all_reduce"] * 2 and stats[0].bytes == 8 * 4
    check_step(record, ref, mesh, image_batch(0, batch))


def test_batchnorm_eval_mode_uses_running_statistics(fake_mesh):
    mesh = fake_mesh((2,), ("dp",))
    torch.manual_seed(0)
    ref = ConvNet()
    with torch.no_grad():  # statistics a trained model would have
        ref.bn.running_mean.uniform_(-0.5, 0.5)
        ref.bn.running_var.uniform_(0.5, 2.0)
    model = copy.deepcopy(ref)
    record = compile_once(model, mesh, DataParallelPlanner(mesh_axis_size=2).build_plan(model),
                          image_batch(0), train=False)
    assert not record.program.mutated_inputs and not record.activation_gathers("dp")
    ref.eval()
    check_step(record, ref, mesh, image_batch(0))


def test_resnet_block_with_residual_matches_one_device(fake_mesh):
    """transformers' ResNet (default config, small sizes, random weights): bottleneck blocks
    with residual adds and a strided shortcut convolution, a 3x3 stride-2 max pool (overlapping
    windows), adaptive average pooling; FSDP on dp=2."""
    import transformers

    mesh = fake_mesh((2,), ("dp",))
    torch.manual_seed(0)
    cfg = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                    num_labels=5)
    ref = transformers.ResNetForImageClassification(cfg).float()
    model = copy.deepcopy(ref)
    plan = DataParallelPlanner(mesh_axis_size=2, inputs=(0, "labels")).build_plan(model)
    shard_module(model, mesh, plan)
    compiled = torch.compile(model, backend="dist", options={"inductor": False})
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 5, (4,), generator=g)
    compiled(x, labels=y).loss.backward()
    record = compile_records()[-1]
    assert not record.plan.fallbacks and not record.activation_gathers("dp")
    args = global_args(record, ref, L_args_0_=x, L_kwargs_labels_=y)
    out = ref(x, labels=y)
    out.loss.backward()
    assert record.program.diff_outputs == [0, 1]  # loss, logits
    outs, grads = run_spmd(record, args, [torch.ones(()), torch.zeros_like(out.logits)], mesh)
    torch.testing.assert_close(outs[0], out.loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(outs[1], out.logits, rtol=1e-4, atol=1e-5)
    named = {dynamo_name(n, "parameters"): p for n, p in ref.named_parameters()}
    checked = 0
    for info, g in zip(record.program.primal_inputs, grads):
        if _key(info.name) in named:
            torch.testing.assert_close(g, named[_key(info.name)].grad, rtol=1e-4, atol=1e-5,
                                       msg=info.name)
            checked += 1
    assert checked == len(named)


class TwoConvs(torch.nn.Module):
    """Conv(4 -> 8) + BatchNorm + ReLU + Conv(8 -> 6): a Megatron-style pair for convolutions
    (output channels split, then input channels split: one all_reduce of the result)."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(4, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 6, 3, padding=1)

    def forward(self, x, labels):
        return (self.conv2(torch.relu(self.bn(self.conv1(x)))) * labels).mean()


def test_channel_parallel_convolutions_match_one_device(fake_mesh):
    from dynamo_dist.plans import ShardingPlan

    mesh = fake_mesh((2,), ("tp",))
    torch.manual_seed(0)
    ref = TwoConvs()
    model = copy.deepcopy(ref)
    plan = ShardingPlan(plan={"conv1.weight": {"tp": Shard(0)}, "conv1.bias": {"tp": Shard(0)},
                              "bn.weight": {"tp": Shard(0)}, "bn.bias": {"tp": Shard(0)},
                              "conv2.weight": {"tp": Shard(1)}})
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 6, 8, 8, generator=g))
    record = compile_once(model, mesh, plan, batch)
    convs = {n.name: n for n in record.plan.nodes.values() if n.op.startswith("aten.conv")}
    assert convs["convolution"].output == S1 and convs["convolution_1"].output == P, \
        record.plan.to_text()
    fwd = [e for e in record.ledger.entries if e.phase == "forward"]
    # one all_reduce of the pending sum: of convolution_1 itself or, at equal cost, of its
    # product with the replicated labels (a Partial times a Replicate stays Partial)
    reduces = [e for e in fwd if e.kind == "all_reduce"]
    assert len(reduces) == 1 and "[P(sum)] -> [R]" in reduces[0].cause, fwd
    check_step(record, ref, mesh, batch)


@pytest.mark.parametrize("fsdp", [True, False])
def test_convnet_trains_under_inductor_on_one_rank(fake_mesh, fsdp):
    """Inductor lays a convolution's output out channels-last on CPU; the backward must be
    compiled for the strides the compiled forward saves (it asserted contiguous ones and failed
    on the first backward). A 1-rank mesh: every collective is the identity, values are real."""
    mesh = fake_mesh((1,), ("dp",))
    torch.manual_seed(0)
    ref = ConvNet()
    model = copy.deepcopy(ref)
    shard_module(model, mesh, DataParallelPlanner(shard_params=fsdp).build_plan(model))
    step = torch.compile(model, backend="dist", options={"inductor": True})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for i in range(3):
        x, y = image_batch(i)
        loss, want = step(x, labels=y), ref(x, labels=y)
        loss.backward()
        want.backward()
        torch.testing.assert_close(loss.full_tensor(), want, rtol=1e-5, atol=0)
        if i == 0:
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-4, atol=1e-6,
                                           msg=n)
            for b, rb in zip(model.buffers(), ref.buffers()):
                torch.testing.assert_close(b, rb, rtol=1e-5, atol=1e-7)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
