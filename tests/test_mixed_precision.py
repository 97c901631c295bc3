"""Casts and autocast on split programs, on simulated ranks against one device (or DDP emulated
on one device): a pending sum (Partial) is reduced in the dtype the program computed it in,
never after a cast that rounds or truncates each rank's term (``rules.pointwise._narrows``),
and a bf16 gradient of an fp32 weight is summed in fp32 (``widening_reduction_factor``); the
ops capture swaps in (``matmul_nd``, ``attention_math``) compute as eager autocast does."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Shard, distribute_tensor

from dynamo_dist import compile_records
from dynamo_dist.plans import shard_module
from dynamo_dist.testing.zoo.cell import (SimRuntime, global_value, parse_mesh, plan_model,
                                          run_cell)
from dynamo_dist.testing.zoo.models import ZooModel

V, B, T, H = 64, 4, 8, 32


@pytest.mark.parametrize("dtype", [torch.int16, torch.bfloat16, torch.float16])
def test_a_contraction_cast_down_is_reduced_before_the_cast(dtype):
    """x [8, 16] split on its contracted dim, w [16, 4] on its rows: x @ w is a pending sum on
    tp=2. Cast to int16 and scaled, it came out off by 2 in some entries (each rank truncated
    its term; the narrow sum is the cheaper reduction, so the planner moved it past the cast);
    cast to bf16 or fp16, off by an ulp. Now bit for bit as on one device."""
    rt = SimRuntime()
    mesh = rt.setup({"tp": 2})
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    xf, wf = torch.randn(8, 16, generator=gen) * 3, torch.randn(16, 4, generator=gen)

    def f(x, w):
        return (x @ w).to(dtype) * 2

    with rt.eager():
        x, w = distribute_tensor(xf, mesh, [Shard(1)]), distribute_tensor(wf, mesh, [Shard(0)])
    got = global_value(torch.compile(f, backend="dist", options=rt.options())(x, w), rt)
    assert got.dtype == dtype
    assert torch.equal(got, f(xf, wf))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(H), nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, h):
        return h + self.down(F.gelu(self.up(self.norm(h))))


class AutocastLM(nn.Module):
    """Embedding, two pre-norm GELU MLP blocks in fp32 (Megatron pairs on tp: the down
    projection's output is a pending sum), the head under bf16 autocast, cross-entropy with
    ignored labels."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, H)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, ids, labels):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = self.head(h)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


def _batch(step):
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, V, (B, T), generator=gen)
    labels = ids.roll(-1, 1).clone()
    labels[0], labels[1, 2:] = -100, -100
    return (ids, labels), {}


@pytest.mark.parametrize("mesh", ["tp=2", "dp=2,tp=2"])
def test_autocast_head_after_a_row_parallel_sum_trains_at_parity(mesh):
    """The head's input (the residual after a row-parallel projection, pending on tp) is cast
    to bf16 by autocast. The planner reduced it after the cast, in bf16: the loss moved by
    7e-5 (1e-4 on another such model), where one device's own rounding error is 1e-7. Now the
    loss matches to 1e-6 on both meshes. On tp=2 the gradients match as closely; with dp,
    each rank's bf16 head-weight gradient is rounded before the sum (as under DDP: the next
    test), so they match to bf16's precision."""
    zm = ZooModel("autocast_lm", "test", AutocastLM, _batch)
    row = run_cell(zm, mesh, SimRuntime(), steps=2)
    assert row["params"]["sharded"] >= 4, row["params"]  # the blocks' up and down on tp
    assert row["status"] in ("parity", "WRONG"), row.get("error")
    assert row["loss_rel"] <= 1e-6, row["losses"]
    assert row["grad_rel"] <= (1e-5 if mesh == "tp=2" else 5e-3), (row["grad_rel"],
                                                                     row["grad_worst"])


def _one_step(ref: nn.Module, axes: dict, *args, **kwargs):
    """A copy of ``ref`` under the stock planners on simulated ranks (``axes``: mesh axis name
    -> size), compiled, one forward and backward; returns (runtime, model, loss)."""
    rt = SimRuntime()
    device_mesh = rt.setup(axes)
    torch._dynamo.reset()
    model = copy.deepcopy(ref)
    plan = plan_model(model, axes)
    with rt.eager():
        shard_module(model, device_mesh, plan)
        rt.localize(model)
    loss = torch.compile(model, backend="dist", options=rt.options())(*args, **kwargs)
    with rt.eager():
        loss.backward()
    return rt, model, loss


@pytest.mark.parametrize("mesh", ["dp=2", "dp=2,tp=2"])
def test_autocast_gradients_are_summed_in_the_parameter_dtype_as_ddp_sums_them(mesh):
    """The head's weight is fp32, its gradient a bf16 matmul cast to fp32 (autocast's cast,
    backward). Each dp rank's bf16 term differs from one device's by bf16 rounding whatever
    the plan; DDP then sums the fp32 terms. The planner summed the bf16 terms (half the bytes)
    and rounded the sum once more: 2.7e-3 off one device against DDP's 2.2e-3. Now the
    reduce-scatter moves the fp32 gradient (``widening_reduction_factor``) and every gradient
    is DDP's, emulated on one device (each half of the batch, its loss weighted by its share of
    the valid labels, gradients accumulated in fp32), to fp32 rounding."""
    ref = AutocastLM()
    (ids, labels), _ = _batch(0)
    rt, model, _ = _one_step(ref, parse_mesh(mesh), ids, labels)
    valid = (labels != -100).sum()
    for half in (slice(0, B // 2), slice(B // 2, B)):
        share = (labels[half] != -100).sum() / valid
        (ref(ids[half], labels[half]) * share).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(global_value(p.grad, rt), q.grad, rtol=2e-5, atol=1e-6,
                                   msg=name)
    record = compile_records()[-1]
    # FSDP's gathers of autocast's bf16 copies are parameter gathers, not the batch's
    assert not record.activation_gathers("dp"), [e.cause for e in record.activation_gathers("dp")]
    moved = [e for e in record.ledger.entries
             if e.mesh_axis == "dp" and e.phase == "backward" and "head" in (e.source or "")]
    assert moved and all(e.bytes == V * H * 4 for e in moved), \
        [(e.kind, e.bytes) for e in moved]  # the fp32 gradient (bf16: half)


def _attention_scores(q, k, v):
    """HF's eager attention under autocast: 4-D matmuls (capture swaps them for ``matmul_nd``),
    softmax in fp32, cast back to the query's dtype."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores = torch.matmul(q, k.transpose(-1, -2))
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
        return torch.matmul(probs, v)


def _sdpa(q, k, v):
    """HF Llama's call under autocast: q and k fp32 (bf16 projections times fp32 rotary
    tables), v bf16 (a projection's output)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return F.scaled_dot_product_attention(q, k, v.to(torch.bfloat16), is_causal=True)


@pytest.mark.parametrize("fn", [_attention_scores, _sdpa], ids=["matmul", "sdpa"])
@pytest.mark.parametrize("mesh,layout", [("tp=2", [Shard(1)]), ("dp=2,tp=2", [Shard(0), Shard(1)])])
def test_autocast_attention_computes_what_eager_computes(fn, mesh, layout):
    """fp32 q, k, v [B, H, L, E] split over heads (and batch) under bf16 autocast. The 4-D
    matmuls capture swaps for ``matmul_nd`` were on no autocast list: they ran in fp32 (fp32
    scores where eager has bf16), or failed to compile where one operand was already bf16 (HF
    Llama's attention). SDPA's fused-or-math choice was asked about the dtypes it is called
    with (fp32 and bf16 mixed: math), where autocast hands it bf16 alone (fused): the math
    path's bf16 steps put HF Llama's gradients 4e-3 from eager's.
    Now forward and input gradients are eager's, bit for bit forward."""
    rt = SimRuntime()
    axes = parse_mesh(mesh)
    device_mesh = rt.setup(axes)
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(4, 4, 8, 16, generator=gen) for _ in range(3)]
    with rt.eager():
        dts = [distribute_tensor(t, device_mesh, layout).requires_grad_() for t in full]
    out = torch.compile(fn, backend="dist", options=rt.options())(*dts)
    refs = [t.clone().requires_grad_() for t in full]
    want = fn(*refs)
    got = global_value(out, rt)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want.detach())
    cot = torch.randn(want.shape, generator=gen).to(want.dtype)
    want.backward(cot)
    with rt.eager():
        out.backward(distribute_tensor(cot, device_mesh, out.placements))
    for d, r in zip(dts, refs):
        torch.testing.assert_close(global_value(d.grad, rt), r.grad, rtol=1e-5, atol=1e-5)


class _Autocast(nn.Module):
    """A zoo model's forward under bf16 autocast (dropout off), returning its fp32 loss."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner.eval()

    def forward(self, **batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(**batch).loss.float()


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_hf_models_under_autocast_train_as_ddp_on_two_data_ranks(name):
    """HF Llama (SDPA with q, k fp32 and v bf16; 4-D matmuls in its rotary path left in fp32 by
    ``autocast(enabled=False)``) and T5 (SDPA on the math path: a learned position bias) under
    bf16 autocast on dp=2: the loss is one device's and every gradient DDP's, emulated on one
    device (each half of the batch, gradients summed in fp32), to 1e-4. Llama failed to
    compile, then was 4e-3 off (math path for a fused call); T5 was 3e-2 off (the math path's
    steps in bf16)."""
    from dynamo_dist.testing.zoo.models import BATCH, MODELS

    zm = MODELS[name]
    ref = _Autocast(zm.build())
    _, batch = zm.batch(0)
    rt, model, loss = _one_step(ref, {"dp": 2}, **batch)
    assert global_value(loss, rt).item() == pytest.approx(ref(**batch).item(), rel=1e-6)
    for half in (slice(0, BATCH // 2), slice(BATCH // 2, BATCH)):  # every label counts
        (ref(**{k: v[half] for k, v in batch.items()}) / 2).backward()
    got = {n: global_value(p.grad, rt) for n, p in model.named_parameters()}
    num = sum((got[n] - q.grad).norm() ** 2 for n, q in ref.named_parameters())
    den = sum(q.grad.norm() ** 2 for q in ref.parameters())
    assert (num / den).sqrt() <= 1e-4, (num / den).sqrt()


def test_autocast_casts_follow_the_device_a_meta_plan_stands_for():
    """Capture's autocast casts on meta tensors (a plan made on the meta device, as
    ``benchmarks/scale.py`` makes Llama-3-8B's): read as the CPU's autocast state, as SDPA's
    probe reads them (autocast itself raises on "meta"); float64 and integers never cast."""
    from inductor_passes.core.ops import under_autocast

    a = torch.empty(2, 3, 4, 5, device="meta")
    d, i = a.double(), torch.empty(3, dtype=torch.int64, device="meta")
    assert [t.dtype for t in under_autocast((a, d, i), {})[0]] == [a.dtype, d.dtype, i.dtype]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (x, y, z), kw = under_autocast((a, d, i), {"mask": a})
    assert (x.dtype, y.dtype, z.dtype, kw["mask"].dtype) == (torch.bfloat16, torch.float64,
                                                             torch.int64, torch.bfloat16)


def _fp32_region(case: str):
    """A region the user runs in fp32 with ``autocast(enabled=False)`` inside a step run under
    bf16 autocast (HF's rotary tables, a numerically careful attention)."""
    def fn(q, k, v):
        with torch.autocast("cpu", enabled=False):
            if case == "matmul":
                return torch.matmul(torch.matmul(q, k.transpose(-1, -2)).softmax(-1), v)
            if case == "sdpa":
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return F.linear(q, k[0, 0]) + v
    return fn


@pytest.mark.parametrize("case", ["linear", "matmul", "sdpa"])
def test_an_autocast_disabled_region_stays_fp32_under_an_outer_autocast(case):
    """``with torch.autocast(bf16): compiled(...)`` where the compiled code turns autocast off
    for a region: the program captured that region in fp32, then planning, lowering and the
    run happened under the user's autocast, which cast the region's matmuls to bf16 again:
    bf16 outputs, 4e-2 off eager, where eager gives fp32 (linear and matmul failed before).
    Now autocast applies to capture alone (as AOTAutograd). The output is eager's, in fp32, to
    fp32 rounding. The backward is traced under the step's autocast, as AOTAutograd traces it
    (``backward_pass_autocast="same_as_forward"``): each input gradient is eager's to fp32
    rounding, or torch's own compile's to bf16 rounding (a weight gradient summed over a split
    batch rounds each rank's bf16 term)."""
    fn = _fp32_region(case)
    rt = SimRuntime()
    device_mesh = rt.setup({"tp": 2})
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(2, 4, 8, 8, generator=gen) for _ in range(3)]
    layout = [Shard(1)] if case != "linear" else [Shard(0)]
    with rt.eager():
        dts = [distribute_tensor(t, device_mesh, layout).requires_grad_() for t in full]
    eager = [t.clone().requires_grad_() for t in full]
    torch_compiled = [t.clone().requires_grad_() for t in full]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.compile(fn, backend="dist", options=rt.options())(*dts)
        want = fn(*eager)
        theirs = torch.compile(fn, backend="aot_eager_decomp_partition")(*torch_compiled)
    got = global_value(out, rt)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-6)
    cot = torch.randn(want.shape, generator=gen)
    want.backward(cot)
    theirs.backward(cot)
    with rt.eager():
        out.backward(distribute_tensor(cot, device_mesh, out.placements))
    for d, e, t in zip(dts, eager, torch_compiled):
        if e.grad is None:
            continue
        g = global_value(d.grad, rt)
        assert g.dtype == torch.float32
        assert (g - e.grad).abs().max() <= 1e-5 or \
            (g - t.grad).norm() <= 1e-2 * t.grad.norm(), (g - t.grad).norm() / t.grad.norm()
