"""Simulated scale: a Llama-3-8B-shaped model on a 64-rank (dp=8, tp=8) mesh, one process.

    python benchmarks/scale.py [--layers N] [--seq S] [--batch B]

Everything runs in ONE process on torch's ``fake`` process group (world 64, rank 0): collectives
are recorded in graphs but never move data. The model is transformers' LlamaForCausalLM built on
the ``meta`` device (real Llama-3-8B shapes, no memory), sharded with our planners
(TensorParallelPlanner on "tp" + DataParallelPlanner on "dp", FSDP-style), and one training step
(forward + backward) is compiled with ``backend="dist"``. Local graphs are run as FX graphs on
meta tensors (``options={"inductor": False}``), so no kernel is generated or executed; ``--inductor`` also
times Inductor code generation for this rank's local graphs (moved to CPU fake tensors: Inductor
has no meta device), reported apart.

Reported for our backend: Dynamo trace time, the backend's stages (capture, plan, lower,
partition/Inductor) from ``compile_records()[-1].seconds`` plus their CPU seconds (the machine is
shared), every ILP / greedy walk of the planner, joint-graph size, the collective ledger of one
step (count, bytes by kind, mesh axis, phase), the collectives actually in the partitioned local
forward/backward graphs, and peak RSS. On meta tensors PyTorch's SDPA takes its math path; the
script routes it to the fused CPU op a real CPU run captures (``route_meta_sdpa_to_cpu_kernel``),
for both contestants.

The hand-written DTensor plan (``--baseline`` runs it in a child process: our shard_module turns on
DTensor's implicit replication for the whole process, which would change the stock path):
torch's ``parallelize_module`` Megatron plan on the tp axis (ColwiseParallel q/k/v/gate/up,
RowwiseParallel o/down; embeddings, norms and lm_head replicated, as our TensorParallelPlanner
leaves them; no sequence parallelism) compiled with ``aot_autograd`` compilers that count the
``_c10d_functional`` ops of the forward and backward graphs (no kernels). FSDP2 ``fully_shard``
on dp refuses meta parameters (and would all-gather into real CPU buffers), so its collectives
are computed from FSDP2's schedule (per ``fully_shard`` unit: one all_gather in the forward, one
in the backward (reshard_after_forward=True; not for the root unit), one reduce_scatter of the
gradients), and that formula is checked against a real eager FSDP2 + TP step of a small Llama on
the same fake 8 x 8 mesh (``fsdp2_check`` in the JSON).

Bytes: like our ledger, the LOCAL INPUT buffer of one rank per collective ("buffer bytes"); the
tables also give ring-algorithm bytes sent per rank ("wire bytes": all_gather in*(n-1),
reduce_scatter and all_to_all in*(n-1)/n, all_reduce 2*in*(n-1)/n).

Results: benchmarks/results/scale-<layers>L.json, and benchmarks/results/scale.md rebuilt from
every scale-*L.json present.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import logging
import math
import os
import re
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
sys.path.insert(0, ROOT)

# Llama-3-8B (meta-llama/Meta-Llama-3-8B config.json)
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                 max_position_embeddings=8192, rms_norm_eps=1e-5)
# a small Llama that fits an 8 x 8 mesh (every head count divisible by 8): smoke runs and the
# FSDP2 formula check
TINY = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=8,
            vocab_size=1024, rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5)

# --------------------------------------------------------------------------------------------
# common


def rss_gib() -> float:
    """Peak RSS of this process so far (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def current_rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def library_version() -> dict:
    """The commit this ran on, and a hash of any uncommitted change to the library (the tree is
    shared with other work in progress)."""
    import hashlib

    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,
                                  timeout=30).stdout
        except Exception:  # no git
            return ""

    diff = git("diff", "HEAD", "--", "dynamo_dist", "inductor_passes")
    return {"commit": git("rev-parse", "--short", "HEAD").strip(),
            "uncommitted_library_diff_sha1": hashlib.sha1(diff.encode()).hexdigest()[:12]
            if diff else None,
            "uncommitted_files": git("diff", "--name-only", "HEAD", "--", "dynamo_dist",
                                     "inductor_passes").split()}


def fake_mesh(dp: int, tp: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp * tp)
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def llama_config(args, shapes=LLAMA3_8B):
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=args.layers, tie_word_embeddings=False, use_cache=False,
                      **shapes)
    cfg._attn_implementation = "sdpa"  # transformers' default: F.scaled_dot_product_attention
    return cfg


def meta_llama(cfg):
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def route_meta_sdpa_to_cpu_kernel() -> None:
    """On meta tensors PyTorch's SDPA takes its math path (views merging batch and heads, bmm,
    softmax); on CPU tensors it calls the fused ``_scaled_dot_product_flash_attention_for_cpu``,
    which is what a real run of this model captures (and what the planner's attention rule
    shards over batch or heads). Route SDPA on meta tensors to that fused op, so the simulated
    program is the CPU program. Applied to both contestants."""
    import torch
    import torch.nn.functional as F

    orig = F.scaled_dot_product_attention
    if getattr(orig, "_scale_shim", False):
        return

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        if query.device.type == "meta" and dropout_p == 0.0 and not enable_gqa:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
        return orig(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                    is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    sdpa._scale_shim = True
    F.scaled_dot_product_attention = sdpa


def wire_bytes(kind: str, buf: int, n: int) -> float:
    """Bytes one rank sends for a collective on a group of n ranks, ring algorithms."""
    if n <= 1:
        return 0.0
    if kind == "all_gather":
        return buf * (n - 1)
    if kind == "all_reduce":
        return 2 * buf * (n - 1) / n
    return buf * (n - 1) / n  # reduce_scatter, all_to_all


def table(rows: list[dict], mesh_sizes: dict[str, int]) -> dict:
    """rows: {phase, kind, axis, bytes} -> {"phase/kind/axis": [count, buffer bytes, wire}}."""
    out: dict[str, list] = collections.defaultdict(lambda: [0, 0, 0.0])
    for r in rows:
        key = f"{r['phase']}/{r['kind']}/{r['axis']}"
        out[key][0] += 1
        out[key][1] += r["bytes"]
        out[key][2] += wire_bytes(r["kind"], r["bytes"], mesh_sizes.get(r["axis"], 1))
    return {k: {"count": v[0], "bytes": v[1], "wire_bytes": int(v[2])}
            for k, v in sorted(out.items())}


# --------------------------------------------------------------------------------------------
# ours: backend="dist"


class _PlannerLog(logging.Handler):
    """Keeps the planner's INFO/WARNING lines (ILP sizes, solve times, status)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def inductor_seconds(joint) -> dict:
    """Inductor code generation for this rank's local forward and backward graphs, timed apart
    from the rest (our backend compiled them without Inductor, since Inductor has no meta
    device): each graph is copied, its meta device arguments and example inputs are moved to CPU
    fake tensors (no memory), and ``compile_fx_inner`` runs on it as ``compile_joint`` would.
    Kernels are generated and compiled; nothing is executed."""
    import copy

    import torch
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from inductor_passes.core import compat

    meta, cpu = torch.device("meta"), torch.device("cpu")
    out = {}
    for phase, gm, is_bw in (("forward", joint.fw_graph, False), ("backward", joint.bw_graph, True)):
        if gm is None:
            continue
        gm = copy.deepcopy(gm)
        for n in gm.graph.nodes:
            if n.kwargs.get("device") in (meta, "meta"):
                n.kwargs = {**n.kwargs, "device": cpu}
        gm.recompile()
        mode = compat.FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            inputs = [torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype,
                                          device=cpu)
                      if isinstance(v := n.meta.get("val"), torch.Tensor) else v
                      for n in gm.graph.find_nodes(op="placeholder")]
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
        t = time.perf_counter()
        with compat.tracing(compat.TracingContext(mode)):
            compat.compile_fx_inner(gm, inputs, is_backward=is_bw)
        out[phase] = time.perf_counter() - t
    return out


def _planner_config(max_vars: int | None, time_limit: float | None):
    """The planner's settings for this run: the library's defaults (``PlannerConfig``: 200k
    variables for the joint N-D ILP, 1M for the others, 30 s per ILP) or ``DYNAMO_DIST_PLANNER``,
    with ``--ilp-max-vars`` capping every ILP and ``--ilp-time-limit`` setting HiGHS's limit of
    each."""
    from inductor_passes.sharding.config import PlannerConfig

    caps = {"joint_max_vars": max_vars, "axis_max_vars": max_vars} if max_vars else {}
    limit = {"ilp_time_limit_s": time_limit} if time_limit else {}
    return dataclasses.replace(PlannerConfig.from_env(), **caps, **limit)


_CAUSE = re.compile(r"of [^:]+: (\S+) (\[[^\]]*\]) -> (\[[^\]]*\])")


def _classify(entry, names: tuple[str, ...], param_values: set[str]) -> str:
    """param: a parameter (or a view of one) moved; partial: a pending sum reduced (on this axis
    the source is P); vocab: the token ids or output gradient gathered for the embedding
    backward's vocabulary split (instead of reduce-scattering its whole [V, H] gradient); other:
    any other value (activations, token ids, logits)."""
    m = _CAUSE.search(entry.cause)
    if not m:
        return "?"
    if "embedding_dense_backward" in entry.cause and entry.kind == "all_gather":
        return "vocab"
    value, src = m.group(1), m.group(2).strip("[]").split(",")
    if value in param_values:
        return "param"
    axis = names.index(entry.mesh_axis) if entry.mesh_axis in names else -1
    if 0 <= axis < len(src) and src[axis].startswith("P"):
        return "partial"
    return "other"


def run_ours(args) -> dict:
    import torch

    from dynamo_dist import compile_records
    from dynamo_dist.plans import DataParallelPlanner, TensorParallelPlanner, shard_module
    from inductor_passes.sharding.propagate import parameter_views

    handler = _PlannerLog()
    logging.getLogger("dynamo_dist").addHandler(handler)  # dynamo_dist.sharding propagates
    for name in ("dynamo_dist", "dynamo_dist.sharding"):
        logging.getLogger(name).setLevel(logging.INFO)
    planner = _planner_config(args.ilp_max_vars, args.ilp_time_limit)

    out: dict = {}
    route_meta_sdpa_to_cpu_kernel()
    mesh = fake_mesh(args.dp, args.tp)
    cfg = llama_config(args, TINY if args.tiny else LLAMA3_8B)
    t = time.perf_counter()
    model = meta_llama(cfg)
    out["build_seconds"] = time.perf_counter() - t
    out["params"] = sum(p.numel() for p in model.parameters())

    t = time.perf_counter()
    plan = TensorParallelPlanner(axis="tp").build_plan(model)
    plan = DataParallelPlanner(axis="dp", mesh_axis_size=args.dp).build_plan(model, plan)
    shard_module(model, mesh, plan)
    out["shard_module_seconds"] = time.perf_counter() - t
    out["rss_before_compile_gib"] = current_rss_gib()

    ids = torch.empty((args.batch, args.seq), dtype=torch.long, device="meta")
    compiled = torch.compile(model, backend="dist",
                             options={"inductor": False, "planner": planner})
    t = time.perf_counter()
    loss = compiled(input_ids=ids, labels=ids).loss
    first_call = time.perf_counter() - t
    t = time.perf_counter()
    loss.backward()
    out["backward_run_seconds"] = time.perf_counter() - t
    records = compile_records()
    out["graphs"] = len(records)
    rec = records[-1]
    backend_total = sum(rec.seconds.values())
    out["seconds"] = {"dynamo_trace_and_meta_forward": first_call - backend_total,
                      **{k: v for k, v in rec.seconds.items()}}
    # compile_joint without Inductor: the partition only
    out["seconds"]["partition"] = out["seconds"].pop("inductor")
    # CPU seconds beside wall-clock: the machine is shared, and CPU time is far less sensitive
    # to other load
    out["cpu_seconds"] = {("partition" if k == "inductor" else k): v
                          for k, v in rec.cpu_seconds.items()}
    if args.inductor:
        ind = inductor_seconds(rec.step.joint)
        out["seconds"]["inductor"] = sum(ind.values())
        out["inductor_seconds"] = ind
    out["planner_stages"] = [dataclasses.asdict(st) for st in rec.plan.stages]
    out["planner_log"] = handler.lines
    gm = rec.program.graph_module
    out["joint_graph_nodes"] = len(gm.graph.nodes)
    out["joint_graph_ops"] = sum(n.op == "call_function" for n in gm.graph.nodes)
    joint = rec.step.joint
    out["local_fw_nodes"] = len(joint.fw_graph.graph.nodes)
    out["local_bw_nodes"] = len(joint.bw_graph.graph.nodes) if joint.bw_graph is not None else 0
    # what the compiled step runs: collectives in the partitioned local graphs (the ledger is
    # what lowering inserted; a partitioner that recomputes forward nodes in the backward would
    # run more)
    axes = _group_axes(mesh)
    executed = _graph_collectives(joint.fw_graph, "forward", axes)
    if joint.bw_graph is not None:
        executed += _graph_collectives(joint.bw_graph, "backward", axes)
    out["executed_collectives"] = table(executed, dict(zip(mesh.mesh_dim_names, tuple(mesh.shape))))
    out["plan_fallbacks"] = list(rec.plan.fallbacks)
    out["plan_cost"] = rec.plan.total_cost

    names = tuple(mesh.mesh_dim_names)
    origins = [i.origin() for i in rec.program.primal_inputs]
    param_values = {n.name for n in parameter_views(gm, origins, tuple(range(len(names))))}
    rows = []
    for e in rec.ledger.entries:
        rows.append({"phase": e.phase, "kind": e.kind, "axis": e.mesh_axis, "bytes": e.bytes,
                     "class": _classify(e, names, param_values), "node": e.node,
                     "cause": e.cause, "source": (e.source or "")[-160:]})
    sizes = dict(zip(names, tuple(mesh.shape)))
    out["collectives"] = table(rows, sizes)
    by_class = collections.defaultdict(lambda: [0, 0])
    for r in rows:
        k = f"{r['phase']}/{r['kind']}/{r['axis']}/{r['class']}"
        by_class[k][0] += 1
        by_class[k][1] += r["bytes"]
    out["collectives_by_class"] = {k: {"count": v[0], "bytes": v[1]}
                                   for k, v in sorted(by_class.items())}
    out["ledger"] = rows
    out["predicted_peak"] = dataclasses.asdict(rec.predicted_peak())
    out["replicated_values"] = replicated_values(rec)
    out["peak_rss_gib"] = rss_gib()
    return out


def replicated_values(rec, top: int = 8) -> list[dict]:
    """The largest values of the global program the plan holds whole on every rank (Replicate
    on every mesh axis), by bytes: what a memory-blind plan would replicate to save a
    collective."""
    import torch

    from torch.distributed.tensor.placement_types import Replicate

    found = []
    for node in rec.program.graph_module.graph.nodes:
        np_ = rec.plan.nodes.get(node.name)
        val = node.meta.get("val")
        if np_ is None or not isinstance(val, torch.Tensor) or node.op == "output":
            continue
        if all(isinstance(p, Replicate) for p in np_.output):
            found.append({"node": node.name, "op": str(node.target), "shape": list(val.shape),
                          "bytes": val.numel() * val.element_size()})
    return sorted(found, key=lambda r: -r["bytes"])[:top]


# --------------------------------------------------------------------------------------------
# the hand-written DTensor plan (child process)

_MEGATRON = None


def megatron_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}


def _group_axes(mesh) -> dict[str, str]:
    return {mesh.get_group(i).group_name: name for i, name in enumerate(mesh.mesh_dim_names)}


def _graph_collectives(gm, phase: str, axes: dict[str, str]) -> list[dict]:
    rows = []
    for n in gm.graph.nodes:
        name = str(n.target)
        if n.op != "call_function" or "_c10d_functional" not in name or "wait_tensor" in name:
            continue
        kind = name.split(".")[1].replace("_into_tensor", "").replace("_tensor", "") \
            .replace("_single", "")
        first = n.args[0]
        vals = first.meta.get("val") if hasattr(first, "meta") else None
        vals = vals if isinstance(vals, (list, tuple)) else [vals]
        nbytes = sum(v.numel() * v.element_size() for v in vals if hasattr(v, "numel"))
        group = next((a for a in n.args[1:] if isinstance(a, str) and a in axes), None)
        rows.append({"phase": phase, "kind": kind, "axis": axes.get(group, str(group)),
                     "bytes": nbytes, "node": n.name})
    return rows


def fsdp2_schedule(model, dp: int, dtype_bytes: int = 4, units=None) -> list[dict]:
    """FSDP2's collectives for ``fully_shard`` on every decoder layer and then the root, with
    defaults (reshard_after_forward=True; the root unit is not resharded after its forward).
    Per unit: all_gather of the concatenated dp shards (forward; again in the backward unless
    root), reduce_scatter of the concatenated gradients (backward). Each parameter's dp shard is
    dim 0 of its tp-local tensor, padded to a multiple of dp (FSDP2's chunking)."""
    from torch.distributed.tensor import DTensor

    def local_numel(p):
        shape = tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape)
        rows = math.ceil(shape[0] / dp) if shape else 1
        return rows * math.prod(shape[1:])

    layers = list(model.model.layers)
    layer_params = {id(p) for layer in layers for p in layer.parameters()}
    units = [("layer", list(layer.parameters())) for layer in layers]
    units.append(("root", [p for p in model.parameters() if id(p) not in layer_params]))
    rows = []
    for kind, params in units:
        shard = sum(local_numel(p) for p in params) * dtype_bytes
        rows.append({"phase": "forward", "kind": "all_gather", "axis": "dp", "bytes": shard,
                     "unit": kind})
        if kind != "root":
            rows.append({"phase": "backward", "kind": "all_gather", "axis": "dp",
                         "bytes": shard, "unit": kind})
        rows.append({"phase": "backward", "kind": "reduce_scatter", "axis": "dp",
                     "bytes": shard * dp, "unit": kind})
    return rows


def fsdp2_check(args) -> dict:
    """A real eager FSDP2 + TP step of a small Llama (real CPU tensors) on the same fake mesh:
    the collectives FSDP2 issues, against ``fsdp2_schedule`` for that model."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import LlamaForCausalLM

    mesh = fake_mesh(args.dp, args.tp)
    small = argparse.Namespace(**{**vars(args), "layers": 2})
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(small, TINY))
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], megatron_plan())
    seen: list[dict] = []
    originals = {}
    axes = _group_axes(mesh)
    for fn, kind in (("all_gather_single", "all_gather"),
                     ("reduce_scatter_single", "reduce_scatter")):
        originals[fn] = getattr(dist, fn)

        def wrapped(output, input, *a, _orig=originals[fn], _kind=kind, **k):
            group = k.get("group")
            seen.append({"kind": _kind, "axis": axes.get(getattr(group, "group_name", ""), "?"),
                         "bytes": input.numel() * input.element_size()})
            return _orig(output, input, *a, **k)

        setattr(dist, fn, wrapped)
    predicted = fsdp2_schedule(model, args.dp)  # before fully_shard: tp-local parameters
    try:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        ids = torch.zeros((max(1, 8 // args.dp), 64), dtype=torch.long)
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        for fn, f in originals.items():
            setattr(dist, fn, f)
    key = lambda r: (r["kind"], r["axis"], r["bytes"])  # noqa: E731
    got = collections.Counter(map(key, seen))
    want = collections.Counter(map(key, predicted))
    return {"model": "2-layer Llama " + json.dumps(TINY), "eager_fsdp2": sorted(
        [list(k) + [v] for k, v in got.items()]), "formula": sorted(
        [list(k) + [v] for k, v in want.items()]), "match": got == want}


def run_baseline(args) -> dict:
    import torch
    from torch._dynamo.backends.common import aot_autograd
    from torch.distributed.tensor.parallel import parallelize_module

    out: dict = {}
    out["fsdp2_check"] = fsdp2_check(args)
    route_meta_sdpa_to_cpu_kernel()
    mesh = fake_mesh(args.dp, args.tp)
    model = meta_llama(llama_config(args, TINY if args.tiny else LLAMA3_8B))
    t = time.perf_counter()
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], megatron_plan())
    out["parallelize_seconds"] = time.perf_counter() - t
    axes = _group_axes(mesh)
    graphs: dict[str, list] = {"forward": [], "backward": []}
    node_counts = {"forward": 0, "backward": 0}

    def recorder(phase):
        def compiler(gm, example_inputs):
            graphs[phase].extend(_graph_collectives(gm, phase, axes))
            node_counts[phase] += len(gm.graph.nodes)
            return gm  # run as an FX graph: on meta tensors nothing executes
        return compiler

    kept: dict[str, object] = {}

    def keep(phase, compiler):
        def compile_and_keep(gm, example_inputs):
            kept[phase] = gm
            return compiler(gm, example_inputs)
        return compile_and_keep

    backend = aot_autograd(fw_compiler=keep("forward", recorder("forward")),
                           bw_compiler=keep("backward", recorder("backward")))
    compiled = torch.compile(model, backend=backend)
    # TP sees one dp rank's share of the batch (dp splits the batch; FSDP does not change it)
    local_batch = math.ceil(args.batch / args.dp)
    ids = torch.empty((local_batch, args.seq), dtype=torch.long, device="meta")
    t = time.perf_counter()
    loss = compiled(input_ids=ids, labels=ids).loss
    out["compile_forward_seconds"] = time.perf_counter() - t
    t = time.perf_counter()
    loss.backward()
    out["compile_backward_seconds"] = time.perf_counter() - t
    tp_rows = graphs["forward"] + graphs["backward"]
    fsdp_rows = fsdp2_schedule(model, args.dp)
    out["local_batch"] = local_batch
    out["graph_nodes"] = node_counts
    sizes = dict(zip(mesh.mesh_dim_names, tuple(mesh.shape)))
    out["tp_graph_collectives"] = table(tp_rows, sizes)
    out["fsdp2_collectives"] = table(fsdp_rows, sizes)
    out["collectives"] = table(tp_rows + fsdp_rows, sizes)
    out["tp_graph_rows"] = tp_rows
    out["predicted_peak"] = dtensor_predicted_peak(kept["forward"], kept["backward"], model,
                                                   args.dp)
    out["peak_rss_gib"] = rss_gib()
    return out


def dtensor_predicted_peak(fw, bw, model, dp: int) -> dict:
    """The DTensor plan's per-rank peak, estimated the same way as ours
    (``inductor_passes.memory.predict_peak`` on AOTAutograd's partitioned TP graphs), then with
    FSDP2's schedule on dp applied by arithmetic: each decoder layer's parameters are held as
    1/dp shards with two layers unsharded at a time (the one computing, the one prefetched), and
    its gradients are reduce-scattered to 1/dp shards after its backward; the root unit
    (embeddings, final norm, lm_head) keeps its parameters unsharded through the step and its
    gradients whole until the end of the backward (FSDP2's default for the root:
    reshard_after_forward=False), as the TP graphs hold them. Not a trace of FSDP2."""
    from inductor_passes.memory import predict_peak

    saved = [p for p in bw.graph.find_nodes(op="placeholder")
             if not p.name.startswith("tangents")]
    fw_out = next(iter(fw.graph.find_nodes(op="output"))).args[0]
    tp = predict_peak(fw, bw, len(fw_out) - len(saved))
    tp_local = {}  # parameter -> bytes of its tp-local piece (what FSDP2 shards further)
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        tp_local[name] = local.numel() * local.element_size()
    per_layer = [sum(b for n, b in tp_local.items() if n.startswith(f"model.layers.{i}."))
                 for i in range(len(model.model.layers))]
    layers = sum(per_layer)
    shed = layers * (1 - 1 / dp)  # what sharding the layers' parameters saves
    grads = shed if tp.phase == "backward" else 0  # and their gradients, in the backward
    fsdp = tp.peak_bytes - shed - grads + 2 * max(per_layer)
    return {"tp_graphs": dataclasses.asdict(tp), "parameter_bytes_tp_local": sum(tp_local.values()),
            "layer_parameter_bytes_tp_local": layers, "largest_layer_bytes": max(per_layer),
            "fsdp2_tp_peak_bytes": int(fsdp)}


# --------------------------------------------------------------------------------------------
# report


def _fmt_bytes(b: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= div:
            return f"{b / div:,.2f} {unit}"
    return f"{b:,.0f} B"


def _totals(coll: dict, axis: str | None = None, phase: str | None = None):
    n = b = w = 0
    for key, v in coll.items():
        ph, _, ax = key.split("/")
        if (axis is None or ax == axis) and (phase is None or ph == phase):
            n, b, w = n + v["count"], b + v["bytes"], w + v["wire_bytes"]
    return n, b, w


def comparison_rows(ours: dict, base: dict) -> list[str]:
    keys = sorted(set(ours) | set(base), key=lambda k: (k.split("/")[2], k.split("/")[0] != "forward",
                                                          k.split("/")[1]))
    lines = ["| phase | kind | axis | ours: count | ours: buffer bytes | ours: wire bytes | "
             "DTensor plan: count | DTensor: buffer bytes | DTensor: wire bytes |",
             "|---|---|---|--:|--:|--:|--:|--:|--:|"]
    for k in keys:
        ph, kind, ax = k.split("/")
        o, d = ours.get(k), base.get(k)
        cell = lambda v: (f"{v['count']} | {_fmt_bytes(v['bytes'])} | {_fmt_bytes(v['wire_bytes'])}"  # noqa: E731
                          if v else "0 | - | -")
        lines.append(f"| {ph} | {kind} | {ax} | {cell(o)} | {cell(d)} |")
    for ax in ("tp", "dp", None):
        on, ob, ow = _totals(ours, ax)
        dn, db, dw = _totals(base, ax)
        lines.append(f"| **total** | | {ax or 'all'} | **{on}** | **{_fmt_bytes(ob)}** | "
                     f"**{_fmt_bytes(ow)}** | **{dn}** | **{_fmt_bytes(db)}** | **{_fmt_bytes(dw)}** |")
    return lines


def write_markdown() -> str:
    runs = []
    for path in glob.glob(os.path.join(RESULTS, "scale-*L.json")):
        with open(path) as f:
            runs.append(json.load(f))
    runs.sort(key=lambda r: r["config"]["layers"])
    md = ["# Simulated scale: Llama-3-8B shapes on a 64-rank fake mesh (dp=8 x tp=8)", "",
          "Generated by `python benchmarks/scale.py` (see its docstring); one process, torch's "
          "`fake` process group, model on the `meta` device, local graphs run as FX graphs on "
          "meta tensors (no kernels). Bytes per step per rank: buffer = the local input buffer of "
          "each collective (our ledger's convention); wire = ring-algorithm bytes sent per rank. "
          "DTensor plan = torch `parallelize_module` Megatron TP (graph-counted) + FSDP2 on dp "
          "(computed from FSDP2's schedule, checked against an eager FSDP2 step of a small "
          "Llama; see `fsdp2_check`). On meta tensors SDPA is routed to the fused CPU attention "
          "op a real CPU run captures (`route_meta_sdpa_to_cpu_kernel`; PyTorch's meta path is "
          "the math decomposition, which merges batch and heads). Timings: wall-clock seconds on "
          "a shared 2-core machine (other jobs ran; see the load column), with the planner's "
          "CPU seconds in parentheses.", ""]
    md += ["## Compile stages (seconds) per layer count", "",
           "| layers | seq | global batch | Dynamo trace (+meta fwd) | capture | plan | lower | "
           "partition | Inductor | joint nodes | collectives: ledger / in compiled fw+bw graphs | peak RSS | ILPs solved / built | "
           "DTensor plan compile (fw+bw) | load avg (1 min) start / end |",
           "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in runs:
        o, c = r["ours"], r["config"]
        s = o["seconds"]
        ilps = [e for e in o["planner_stages"] if "ILP" in e["stage"] or "price" in e["stage"]]
        base = r.get("dtensor_plan") or {}
        bsec = (base.get("compile_forward_seconds", 0) + base.get("compile_backward_seconds", 0)) \
            if base else None
        ind = f"{s['inductor']:.1f}" if "inductor" in s else "-"
        cpu_s = o.get("cpu_seconds", {})
        cpu_note = f" ({cpu_s['plan']:.1f} CPU)" if "plan" in cpu_s else ""
        md.append(f"| {c['layers']} | {c['seq']} | {c['batch']} | "
                  f"{s['dynamo_trace_and_meta_forward']:.1f} | {s['capture']:.1f} | "
                  f"{s['plan']:.1f}{cpu_note} | {s['lower']:.1f} | {s.get('partition', 0):.1f} | {ind} | ")
        ex = o.get("executed_collectives")
        ex_n = "-" if ex is None else str(sum(v["count"] for v in ex.values()))
        md[-1] += (f"{o['joint_graph_nodes']} | {sum(v['count'] for v in o['collectives'].values())}"
                   f" / {ex_n}"
                   f" | {o['peak_rss_gib']:.2f} GiB | "
                   f"{sum(e['solved'] for e in ilps)} / {len(ilps)} | "
                   f"{'-' if bsec is None else f'{bsec:.1f}'} | "
                   + (f"{r['loadavg']['start'][0]:.1f} / {r['loadavg']['end'][0]:.1f} |"
                      if r.get("loadavg") else "- |"))
    md.append("")
    md += ["## Memory per rank, predicted (`inductor_passes.memory.predict_peak`, the local "
           "graphs before Inductor; MiB)", "",
           "Ours: the compiled step's peak (forward, then backward). DTensor plan: the same "
           "estimate on AOTAutograd's TP graphs (parameters and gradients whole on dp), then "
           "FSDP2's schedule applied by arithmetic (decoder layers' parameters and gradients as "
           "1/dp shards, two layers unsharded at a time; the root unit's embeddings and lm_head "
           "whole, as FSDP2 keeps them): `dtensor_predicted_peak`. Largest replicated: the "
           "biggest value the plan holds whole on every rank.", "",
           "| layers | ours: peak (phase) | inputs | saved for backward | DTensor TP graphs | "
           "FSDP2 + TP | ours / FSDP2 + TP | largest replicated value (share of our peak) |",
           "|--:|--:|--:|--:|--:|--:|--:|---|"]
    mib = 2 ** 20
    for r in runs:
        o = r["ours"]
        est = o.get("predicted_peak")
        if not est:
            continue
        base = (r.get("dtensor_plan") or {}).get("predicted_peak") or {}
        fsdp = base.get("fsdp2_tp_peak_bytes")
        tp = (base.get("tp_graphs") or {}).get("peak_bytes")
        rep = (o.get("replicated_values") or [None])[0]
        ratio = f"{est['peak_bytes'] / fsdp:.2f}" if fsdp else "-"
        rep_s = (f"{rep['op']} {rep['shape']} {rep['bytes'] / mib:.1f} MiB "
                 f"({rep['bytes'] / est['peak_bytes']:.1%})" if rep else "none")
        md.append(f"| {r['config']['layers']} | {est['peak_bytes'] / mib:.0f} ({est['phase']}) | "
                  f"{est['inputs_bytes'] / mib:.0f} | {est['saved_bytes'] / mib:.0f} | "
                  f"{'-' if tp is None else f'{tp / mib:.0f}'} | "
                  f"{'-' if fsdp is None else f'{fsdp / mib:.0f}'} | "
                  f"{ratio} | "
                  f"{rep_s} |")
    md.append("")
    md += ["Planner stages of each run (seconds; an ILP not 'solved' was too large (the joint "
           "programs over 200k variables; others "
           "over 1M; before 4cc8269 every ILP over 200k) or not optimal within its 30 s limit, "
           "and is skipped):", ""]
    for r in runs:
        stages = ", ".join(f"{e['stage']} {e['seconds']:.1f}s{'' if e['solved'] else ' (not solved)'}"
                           for e in r["ours"]["planner_stages"])
        md.append(f"- {r['config']['layers']} layers: {stages}")
    md.append("")
    for r in runs:
        c, o = r["config"], r["ours"]
        md += [f"## {c['layers']} layers, seq {c['seq']}, global batch {c['batch']} "
               f"(dp={c['dp']}, tp={c['tp']})", ""]
        base = (r.get("dtensor_plan") or {}).get("collectives", {})
        md += comparison_rows(o["collectives"], base)
        ex = o.get("executed_collectives")
        if ex:
            diff = [f"{k} {o['collectives'].get(k, {}).get('count', 0)} -> {v['count']} "
                    f"({_fmt_bytes(o['collectives'].get(k, {}).get('bytes', 0))} -> "
                    f"{_fmt_bytes(v['bytes'])})"
                    for k, v in ex.items() if v != o["collectives"].get(k)]
            en, eb, ew = _totals(ex)
            md += ["", f"What the compiled step runs (collectives in the partitioned forward and "
                   f"backward graphs, not the ledger): {en} collectives, {_fmt_bytes(eb)} buffer, "
                   f"{_fmt_bytes(ew)} wire per step per rank"
                   + (f"; differs from the ledger in: {'; '.join(diff)}." if diff else
                      "; the same as the ledger.")]
        md += ["", "Ours by what is moved (param: a parameter or a view of it; partial: a pending "
               "sum reduced on that axis; other: activations, token ids, logits):", "",
               "| phase/kind/axis/class | count | buffer bytes |", "|---|--:|--:|"]
        for k, v in o["collectives_by_class"].items():
            md.append(f"| {k} | {v['count']} | {_fmt_bytes(v['bytes'])} |")
        md += ["", "Sanity: " + " ".join(sanity(r))]
        md.append("")
    if len(runs) >= 2:
        md += extrapolation(runs)
    tagged = []
    for path in sorted(glob.glob(os.path.join(RESULTS, "scale-*L-*.json"))):
        if not path.endswith("-tiny.json"):
            with open(path) as f:
                tagged.append((os.path.basename(path), json.load(f)))
    if tagged:
        md += ["## Experiments (tagged runs, not the library's defaults where noted)", ""]
    for name, r in tagged:
        c, o = r["config"], r["ours"]
        knobs = {k: c.get(k) for k in ("ilp_max_vars", "ilp_time_limit", "inductor", "env")
                 if c.get(k)}
        s = o["seconds"]
        md += [f"### {name}: {c['layers']} layers, {json.dumps(knobs)}", "",
               "Stages: " + ", ".join(f"{k} {v:.1f}s" for k, v in s.items()) +
               (f" (Inductor per graph: {json.dumps({k: round(v, 1) for k, v in o['inductor_seconds'].items()})})"
                if o.get("inductor_seconds") else "") +
               f"; peak RSS {o['peak_rss_gib']:.2f} GiB.", "",
               "Planner: " + ", ".join(f"{e['stage']} {e['seconds']:.1f}s"
                                       f"{'' if e['solved'] else ' (not solved)'}"
                                       for e in o["planner_stages"]), ""]
        base = (r.get("dtensor_plan") or {}).get("collectives")
        if not base:  # the DTensor plan of the main run with the same shape, if any
            same = next((m for m in runs if all(m["config"][k] == c[k] for k in
                                                ("layers", "seq", "batch", "dp", "tp"))), None)
            base = ((same or {}).get("dtensor_plan") or {}).get("collectives", {})
            if base:
                md += [f"(DTensor plan columns: from the main {c['layers']}-layer run.)", ""]
        md += comparison_rows(o["collectives"], base)
        md += ["", "Sanity: " + " ".join(sanity(r))]
        md.append("")
    text = "\n".join(md) + "\n"
    with open(os.path.join(RESULTS, "scale.md"), "w") as f:
        f.write(text)
    return text


def _per_layer_ledger(a: dict, b: dict, sizes: dict[str, int]) -> dict:
    """Our collectives per decoder layer, from two runs' ledgers: a collective (phase, kind, axis,
    bytes) whose count grows by a whole multiple of the layer difference is per layer; anything
    else is the model's constant part (embedding, lm_head, loss). The constant part is not
    always the same plan from run to run (the lm_head gradient is reduced one of two equally
    priced ways), which a plain difference of totals would count as per-layer."""
    la, lb = a["config"]["layers"], b["config"]["layers"]
    key = lambda r: (r["phase"], r["kind"], r["axis"], r["bytes"])  # noqa: E731
    ca = collections.Counter(map(key, a["ours"]["ledger"]))
    cb = collections.Counter(map(key, b["ours"]["ledger"]))
    rows = []
    for k in set(ca) | set(cb):
        d = cb[k] - ca[k]
        if d > 0 and d % (lb - la) == 0:
            rows += [{"phase": k[0], "kind": k[1], "axis": k[2], "bytes": k[3]}] * (d // (lb - la))
    return table(rows, sizes)


def extrapolation(runs: list[dict]) -> list[str]:
    """Per-layer figures from the smallest and largest layer counts below 32 (same seq/batch),
    and the 32-layer value EXTRAPOLATED from them; a measured 32-layer run is shown beside it."""
    below = [r for r in runs if r["config"]["layers"] < 32]
    at32 = next((r for r in runs if r["config"]["layers"] == 32), None)
    if len(below) < 2:
        return []
    a, b = below[0], below[-1]
    if (a["config"]["seq"], a["config"]["batch"]) != (b["config"]["seq"], b["config"]["batch"]):
        return []
    la, lb = a["config"]["layers"], b["config"]["layers"]
    sizes = {"dp": b["config"]["dp"], "tp": b["config"]["tp"]}
    out = ["## Per layer, and 32 layers extrapolated (NOT measured) from them", "",
           f"Per-layer figures from the {la}- and {lb}-layer runs (ours: the collectives whose "
           f"count grows with the layers, see `_per_layer_ledger`; DTensor plan: the difference "
           f"of totals, its structure is fixed); value(32) = value({lb}) + (32 - {lb}) x per "
           f"layer. Times need not be linear: the planner skips an ILP above its variable cap, so "
           f"larger models can take other paths (see the planner stages above).", "",
           "| quantity | per layer | 32 layers, extrapolated | 32 layers, measured |",
           "|---|--:|--:|--:|"]

    def line(name, per, vb, v32, fmt):
        out.append(f"| {name} | {fmt(per)} | {fmt(vb + (32 - lb) * per)} | "
                   f"{'-' if v32 is None else fmt(v32)} |")

    count = lambda x: f"{x:,.1f}"  # noqa: E731
    per_ours = _per_layer_ledger(a, b, sizes)
    for who, key in (("ours", "ours"), ("DTensor plan", "dtensor_plan")):
        ca, cb = (a.get(key) or {}).get("collectives"), (b.get(key) or {}).get("collectives")
        c32 = (at32.get(key) or {}).get("collectives") if at32 else None
        if not ca or not cb:
            continue
        for ax in ("tp", "dp", None):
            tb = _totals(cb, ax)
            t32 = _totals(c32, ax) if c32 else (None, None, None)
            if key == "ours":
                per = _totals(per_ours, ax)
            else:
                ta = _totals(ca, ax)
                per = tuple((y - x) / (lb - la) for x, y in zip(ta, tb))
            line(f"{who}: collectives ({ax or 'all'})", per[0], tb[0], t32[0], count)
            line(f"{who}: buffer bytes ({ax or 'all'})", per[1], tb[1], t32[1], _fmt_bytes)
            line(f"{who}: wire bytes ({ax or 'all'})", per[2], tb[2], t32[2], _fmt_bytes)
    for k in ("capture", "plan", "lower"):
        for what, field in (("wall", "seconds"), ("CPU", "cpu_seconds")):
            va, vb = a["ours"].get(field, {}).get(k), b["ours"].get(field, {}).get(k)
            if va is None or vb is None:
                continue
            v32 = at32["ours"].get(field, {}).get(k) if at32 else None
            line(f"ours: {k} seconds ({what})", (vb - va) / (lb - la), vb, v32, count)
    out.append("")
    return out


def sanity(result: dict) -> list[str]:
    """Does our plan look like Megatron on tp and FSDP on dp? Plain statements, for the report."""
    o, c = result["ours"], result["config"]
    L = c["layers"]
    shapes = TINY if c.get("tiny") else LLAMA3_8B
    hidden = math.ceil(c["batch"] / c["dp"]) * c["seq"] * shapes["hidden_size"] * 4
    rows = o["ledger"]
    notes = []
    for phase in ("forward", "backward"):
        tp = [r for r in rows if r["axis"] == "tp" and r["phase"] == phase]
        ar = [r for r in tp if r["kind"] == "all_reduce" and r["bytes"] == hidden]
        rest = collections.Counter((r["kind"], _fmt_bytes(r["bytes"])) for r in tp if r not in ar)
        notes.append(f"tp {phase}: {len(ar)} all_reduce of the hidden states ({_fmt_bytes(hidden)}; "
                     f"Megatron: {2 * L}); other tp collectives: "
                     f"{', '.join(f'{n} x {k} {b}' for (k, b), n in sorted(rest.items())) or 'none'}.")
    dp = [r for r in rows if r["axis"] == "dp"]
    ag = [r for r in dp if r["kind"] == "all_gather" and r["class"] == "param"]
    rs = [r for r in dp if r["kind"] == "reduce_scatter" and r["phase"] == "backward"]
    vocab = [r for r in dp if r["class"] == "vocab"]
    odd = [r for r in dp if r not in ag and r not in rs and r not in vocab and r["bytes"] > 4]
    notes.append(f"dp: {sum(r['phase'] == 'forward' for r in ag)} forward + "
                 f"{sum(r['phase'] == 'backward' for r in ag)} backward parameter all_gathers, "
                 f"{len(rs)} gradient reduce_scatters, the 4-byte loss all_reduce, "
                 f"{len(vocab)} all_gathers for the embedding gradient's vocabulary split "
                 f"({_fmt_bytes(sum(r['bytes'] for r in vocab))}); anything else: "
                 + (", ".join(f"{r['phase']} {r['kind']} {_fmt_bytes(r['bytes'])} ({r['cause']})"
                              for r in odd) or "none") + ".")
    return notes


# --------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8,
                    help="GLOBAL batch (sequences per step); default 8 = 1 per dp rank")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--tiny", action="store_true", help="small dims (smoke test), same mesh")
    ap.add_argument("--inductor", action="store_true",
                    help="also time Inductor code generation for this rank's local forward and "
                         "backward graphs (moved to CPU fake tensors; nothing runs)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the DTensor plan")
    ap.add_argument("--ilp-max-vars", type=int, default=None,
                    help="experiment: skip ILPs above this many variables (library: 200000 joint, 1000000 others)")
    ap.add_argument("--ilp-time-limit", type=float, default=None,
                    help="experiment: HiGHS time limit per ILP in seconds (library: 30)")
    ap.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)  # child process
    ap.add_argument("--tag", default="", help="suffix of the result file name")
    ap.add_argument("--markdown-only", action="store_true",
                    help="rebuild results/scale.md from the JSON files present")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import warnings

    warnings.filterwarnings("ignore")
    if args.markdown_only:
        print(write_markdown())
        return
    if args.baseline:
        print("BASELINE_JSON " + json.dumps(run_baseline(args)))
        return

    config = {k: getattr(args, k) for k in ("layers", "seq", "batch", "dp", "tp", "tiny",
                                            "inductor", "ilp_max_vars", "ilp_time_limit")}
    config["model"] = "tiny" if args.tiny else "Llama-3-8B shapes " + json.dumps(LLAMA3_8B)
    config["env"] = {k: os.environ[k] for k in ("TORCHINDUCTOR_CACHE_DIR",
                                                "TORCHINDUCTOR_FX_GRAPH_CACHE", "OMP_NUM_THREADS")
                     if k in os.environ}
    result: dict = {"config": config, "torch": None, "library": library_version()}
    import torch

    result["torch"] = torch.__version__
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    result["ours"] = run_ours(args)
    result["ours"]["wall_seconds"] = time.perf_counter() - t0
    # the machine is shared: its load average (1, 5, 15 min) before and after our compile
    result["loadavg"] = {"start": load0, "end": os.getloadavg(), "cpus": os.cpu_count()}
    o = result["ours"]
    print(f"ours: {o['graphs']} graph(s); " + ", ".join(f"{k} {v:.1f}s" for k, v in o["seconds"].items())
          + f"; {o['joint_graph_nodes']} joint nodes; {len(o['ledger'])} collectives; "
          f"peak RSS {o['peak_rss_gib']:.2f} GiB", flush=True)
    if not args.no_baseline:
        cmd = [sys.executable, os.path.abspath(__file__), "--baseline",
               *(a for a in sys.argv[1:] if a not in ("--baseline",))]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=ROOT))
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("BASELINE_JSON ")),
                    None)
        if proc.returncode != 0 or line is None:
            result["dtensor_plan"] = None
            result["dtensor_plan_error"] = (proc.stderr or proc.stdout)[-4000:]
            print("DTensor plan failed:\n" + result["dtensor_plan_error"], flush=True)
        else:
            result["dtensor_plan"] = json.loads(line[len("BASELINE_JSON "):])
            result["dtensor_plan"]["wall_seconds"] = time.perf_counter() - t0
            b = result["dtensor_plan"]
            print(f"DTensor plan: compile fw {b['compile_forward_seconds']:.1f}s, bw "
                  f"{b['compile_backward_seconds']:.1f}s; FSDP2 formula check "
                  f"{'ok' if b['fsdp2_check']['match'] else 'MISMATCH'}", flush=True)
    result["sanity"] = sanity(result)
    os.makedirs(RESULTS, exist_ok=True)
    tag = args.tag or ("-tiny" if args.tiny else "")
    path = os.path.join(RESULTS, f"scale-{args.layers}L{tag}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print("\n".join(result["sanity"]))
    print(f"wrote {path}")
    if not tag:
        write_markdown()
        print(f"wrote {os.path.join(RESULTS, 'scale.md')}")
    else:
        print("\n".join(comparison_rows(o["collectives"],
                                        (result.get("dtensor_plan") or {}).get("collectives", {}))))


if __name__ == "__main__":
    main()
