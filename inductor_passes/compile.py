"""Partition a local joint graph into forward and backward and compile each with Inductor."""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
import os
from typing import Callable, Sequence

import torch
import torch.fx as fx

from inductor_passes.core import compat
from inductor_passes.core import inductor_fix  # noqa: F401  (installs the fix on import)
from inductor_passes.core.collectives import collective_kind

from . import (comm, cpu_probe, dedup, early_kernels, layer_partition, matmul_sums, memory,
               outline, prefetch, schedule)
from .align_saves import align_saves

# Part of Inductor's FX-graph cache key for our compiles: an artifact compiled before
# ``inductor_fix.install_inductor_mutation_order_fix`` (a read scheduled ahead of an in-place draw)
# must not be served again. Bump it when a torch patch of ours changes generated code.
_CACHE_KEY_TAG = "dynamo_dist:mutation-order-1"
log = logging.getLogger("dynamo_dist")


@dataclasses.dataclass
class CompiledJoint:
    """Forward and backward callables of one rank, boxed (they take one list of tensors).

    forward(primals) -> [*forward_outputs, *saved]   (saved: tensors, then sizes)
    backward([*saved, *tangents]) -> one gradient (or None) per primal
    """

    forward: Callable
    backward: Callable | None
    num_fwd_outputs: int
    num_saved: int
    fw_graph: fx.GraphModule
    bw_graph: fx.GraphModule | None
    # per collective kind, the size of each bucket the comm pass merges (forward and backward)
    buckets: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    # per collective kind, how many the compiled graphs issue per call, after bucketing (the
    # partitioner may recompute a collective in the backward, so this can exceed the ledger)
    issued: dict[str, int] = dataclasses.field(default_factory=dict)
    # of the saved values, how many are sizes (symbolic shapes): the last ones, after the tensors
    num_saved_sizes: int = 0
    # what ``outline.outline_repeats`` shared in the forward and the backward (Inductor only)
    outlined: list[outline.Outlined] = dataclasses.field(default_factory=list)
    # this rank's predicted peak bytes of one step, from the graphs before Inductor
    predicted_peak: memory.PeakEstimate | None = None
    # the gathers ``prefetch`` issues one layer early, in the forward and the backward
    prefetched: list[prefetch.Prefetched] = dataclasses.field(default_factory=list)


def _example_inputs(gm: fx.GraphModule) -> list:
    return [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]


def _compile(gm: fx.GraphModule, inductor: bool, is_backward: bool, visible: int,
             inputs: list | None = None, outlined: list | None = None
             ) -> tuple[Callable, list | None, dict[str, list[int]]]:
    """Compile one half; returns (boxed callable, strides of each output as compiled or None,
    the buckets the comm pass forms per call: ``comm.predicted_buckets``). With Inductor,
    repeated layers are first outlined into shared bodies (``outline``; what was shared is
    appended to ``outlined``) and collectives are bucketed layer by layer (``comm``).

    ``visible``: the first ``visible`` outputs keep the strides the graph traced (what the
    runtime declares for them); Inductor may lay out the others (saved activations) as it likes
    (a channels-last convolution output on CPU). ``inputs``: example inputs if not the
    placeholders' traced values (the backward's saved activations, restrided)."""
    if not inductor:
        gm.recompile()
        return (lambda args: gm(*args)), None, {}
    inputs = inputs if inputs is not None else _example_inputs(gm)
    comm.copy_shared_all_reduce_inputs(gm)
    comm.tag_layers(gm)  # before outlining: the bodies copy the tags
    shared = _copy(gm)  # outlined apart: ``gm`` stays flat, to fall back on
    done = outline.outline_repeats(shared)
    if outlined is not None:
        outlined.append(done)
    shared = shared if done.calls else None
    compiling = shared if shared is not None else gm
    buckets = comm.predicted_buckets(compiling)  # before Inductor rewrites the graph
    try:
        compiled, strides = _inductor(compiling, inputs, is_backward, visible)
    except Exception as exc:  # noqa: BLE001 (Inductor's own errors are of many types)
        if shared is None:
            raise
        # every rank compiles the same graph, so every rank falls back alike
        log.warning("dynamo_dist: Inductor failed on the graph with shared layer bodies "
                    "(%s: %s); compiling every layer in place", type(exc).__name__,
                    str(exc).splitlines()[0][:300] if str(exc) else "")
        if outlined:
            outlined[-1] = outline.Outlined()
        buckets = comm.predicted_buckets(gm)
        compiled, strides = _inductor(gm, inputs, is_backward, visible)

    def run(args):
        # a list is handed over as it is: the compiled graph empties it and drops each input
        # after its last use (the backward's saved activations are freed as they are consumed)
        return compiled(args if type(args) is list else list(args))

    return run, strides, buckets


def _inductor(gm: fx.GraphModule, inputs: list, is_backward: bool, visible: int
              ) -> tuple[Callable, list]:
    out = next(iter(gm.graph.find_nodes(op="output")))
    out.meta[compat.USER_VISIBLE_OUTPUTS_META] = [
        i for i, a in enumerate(out.args[0][:visible]) if isinstance(a, fx.Node)]
    fake_mode = compat.detect_fake_mode(inputs)
    cpu_probe.wait()  # its answer cached before Inductor's first C++ kernel asks
    with compat.tracing(compat.TracingContext(fake_mode)), \
            compat.inductor_config_patch({**_post_grad_config(gm),
                                          **prefetch.inductor_config(gm)}), \
            _cache_key_tagged(), early_kernels.submitting(), \
            compat.reported_output_strides() as strides:
        compiled = compat.compile_fx_inner(gm, inputs, is_backward=is_backward)
        return compiled, list(strides)


def _post_grad_config(gm: fx.GraphModule) -> dict:
    """Inductor config entries running our post-grad passes on ``gm`` and its bodies, in
    order: matmul sums folded into ``addmm`` (``matmul_sums``), then collectives bucketed
    (``comm``, when on)."""
    passes = [(matmul_sums.fold, matmul_sums.UUID), comm.bucket_pass(gm)]
    passes = [p for p in passes if p is not None]

    def run(graph: fx.Graph) -> None:
        for fn, _ in passes:
            fn(graph)

    return compat.post_grad_pass(run, tuple(key for _, key in passes))


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A new graph module over a copy of ``gm``'s graph (node metadata shared)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return compat.graph_module(gm, graph)


def _cache_key_tagged():
    import torch.compiler

    user = torch.compiler.config.cache_key_tag
    return torch.compiler.config.patch(cache_key_tag=f"{user}|{_CACHE_KEY_TAG}" if user
                                       else _CACHE_KEY_TAG)


def _restrided(inputs: list, strides: list | None) -> list:
    """The backward's example inputs with each saved activation laid out as the compiled forward
    really returns it (``strides``, one per saved value, None: as traced). Without this the
    backward asserts the traced strides and fails on a channels-last convolution output."""
    out = list(inputs)
    for i, stride in enumerate(strides or []):
        if i < len(out) and any(isinstance(s, torch.SymInt) for s in out[i].stride()):
            # symbolic strides (dynamic shapes): Inductor reports them at their hints; laying
            # the fake out with those ints would specialise its sizes to the traced ones
            continue
        if stride is not None and i < len(out) and tuple(out[i].stride()) != tuple(stride):
            out[i] = out[i].as_strided(out[i].shape, tuple(stride))  # a fake: no data moves
    return out


def compile_joint(local_gm: fx.GraphModule, num_fwd_outputs: int, has_backward: bool,
                  inductor: bool = True,
                  before_inductor: Callable[[list[fx.GraphModule]], None] | None = None,
                  resident: Sequence[int] = ()) -> CompiledJoint:
    """Partition ``local_gm`` (AOTAutograd joint convention) and compile both halves.

    ``resident``: indices k of the primals (``primals_{k+1}``) that live through the whole step
    (parameters): the partitioner saves them for free, as AOTAutograd's static-lifetime inputs,
    instead of saving something computed from them.

    ``before_inductor(graphs)`` sees the partitioned graphs before Inductor compiles them: a
    fresh compile rewrites them in place (reinplacing, bucketing) and a cache hit does not, so
    anything comparing graphs across ranks must look here, not at the records afterwards."""
    # a local program sized in a ShapeEnv of its own (dynamo_dist.symbolic.LocalSizes) is
    # partitioned and compiled in that fake mode, not in the one Dynamo's context names
    mode = compat.foreign_fake_mode(_example_inputs(local_gm))
    with compat.tracing_in(mode), compat.lazy_graph_modules():
        return _compile_joint(local_gm, num_fwd_outputs, has_backward, inductor,
                              before_inductor or (lambda graphs: None), resident)


def _compile_joint(local_gm: fx.GraphModule, num_fwd_outputs: int, has_backward: bool,
                   inductor: bool, check: Callable[[list[fx.GraphModule]], None],
                   resident: Sequence[int]) -> CompiledJoint:
    dedup.dedup_pure(local_gm)  # AOTAutograd's CSE, but for collectives (see dedup)
    if inductor and outline.enabled():  # one form for the planner's all_reduce/view tie,
        outline.reduce_before_views(local_gm)  # before layers are compared (align_saves)
    if not has_backward:
        if inductor:
            compat.joint_graph_passes(local_gm)
        fw = _strip_grads(local_gm, num_fwd_outputs)
        prefetched = [prefetch.prefetch_gathers(fw)]
        check([fw])
        counts = _counts([fw])
        peak = memory.predict_peak(fw, None, num_fwd_outputs)
        outlined: list = []
        forward, _, buckets = _compile(fw, inductor, False, num_fwd_outputs, None, outlined)
        return CompiledJoint(forward, None, num_fwd_outputs, 0, fw, None, buckets,
                             _issued(counts, buckets), outlined=outlined, predicted_peak=peak,
                             prefetched=prefetched)
    _tag_forward(local_gm, num_fwd_outputs)
    partitioner, static = _partitioner(), _static_inputs(local_gm, resident)
    rewritten = not inductor

    def whole() -> tuple[fx.GraphModule, fx.GraphModule]:
        nonlocal rewritten
        if not rewritten:  # as torch.compile rewrites a joint graph before partitioning
            compat.joint_graph_passes(local_gm)
            _tag_forward(local_gm, num_fwd_outputs)
            rewritten = True
        return partitioner(local_gm, None, num_fwd_outputs=num_fwd_outputs, static=static)

    def split() -> tuple[fx.GraphModule, fx.GraphModule]:
        # each distinct repeated layer rewritten and partitioned once, its copies given the
        # same split
        by_layer = layer_partition.partition_by_layer(
            local_gm, num_fwd_outputs, static, functools.partial(partitioner, inputs=None),
            None if rewritten else _joint_rewrites) if partitioner is _min_cut else None
        return by_layer or whole()

    fw_gm, bw_gm = split()
    if inductor and outline.enabled() and align_saves(local_gm, fw_gm, num_fwd_outputs):
        # a layer saved other values than its copies: again, with their saves (see align_saves)
        fw_gm, bw_gm = split()
    for gm in (fw_gm, bw_gm):  # the partitioner leaves a dead copy of a forced-save collective's input
        if gm.graph.eliminate_dead_code():  # (the partitioner's code is current otherwise: an
            gm.recompile()                  # 8k-node graph's recompile is 0.15 s)
    # each gradient's reduce_scatter where the gradient is ready, not at the end of the backward
    schedule.land_outputs_early(bw_gm)
    # each layer's parameter gathers issued during the layer before it (FSDP's prefetch)
    prefetched = [prefetch.prefetch_gathers(gm) for gm in (fw_gm, bw_gm)]
    fw_out = next(iter(fw_gm.graph.find_nodes(op="output"))).args[0]
    num_saved = len(fw_out) - num_fwd_outputs
    check([fw_gm, bw_gm])
    counts = _counts([fw_gm, bw_gm])  # before Inductor rewrites the graphs
    # the partitioner returns saved sizes (symbolic shapes) after the saved tensors and the
    # backward takes them first; CompiledJoint's convention is the forward's order
    sizes = sum(isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.SymInt)
                for a in fw_out[num_fwd_outputs:])
    peak = memory.predict_peak(fw_gm, bw_gm, num_fwd_outputs, sizes)  # before Inductor edits
    outlined: list = []
    # the forward's kernels are built while the backward is generated (early_kernels)
    with early_kernels.loads_deferred():
        forward, fw_strides, fw_buckets = _compile(fw_gm, inductor, False, num_fwd_outputs,
                                                   None, outlined)
        saved_strides = fw_strides[num_fwd_outputs:num_fwd_outputs + num_saved - sizes] \
            if fw_strides is not None else None
        bw_inputs = _example_inputs(bw_gm)
        bw_inputs[sizes:] = _restrided(bw_inputs[sizes:], saved_strides)
        backward, _, bw_buckets = _compile(bw_gm, inductor, True, len(bw_gm.graph.find_nodes(
            op="output")[0].args[0]), bw_inputs, outlined)
    buckets = {k: fw_buckets.get(k, []) + bw_buckets.get(k, [])
               for k in {*fw_buckets, *bw_buckets}}
    issued = _issued(counts, buckets)
    return CompiledJoint(forward, _sizes_first(backward, num_saved - sizes, sizes),
                         num_fwd_outputs, num_saved, fw_gm, bw_gm, buckets, issued, sizes,
                         outlined, peak, prefetched)


def sizes_first(args: list, tensors: int, sizes: int) -> list:
    """Backward arguments in the forward's order (saved tensors, saved sizes, tangents) ->
    the order the partitioner gave the backward graph (saved sizes first)."""
    return [*args[tensors:tensors + sizes], *args[:tensors], *args[tensors + sizes:]]


def _sizes_first(backward: Callable, tensors: int, sizes: int) -> Callable:
    if not sizes:
        return backward

    def run(args: list):
        ordered = sizes_first(args, tensors, sizes)
        args.clear()  # the compiled backward holds the only references (see ``_compile``)
        return backward(ordered)
    return run


def _counts(graphs: list[fx.GraphModule]) -> dict[str, int]:
    """Per collective kind, how many the (flat) graphs hold."""
    counts: dict[str, int] = {}
    for gm in graphs:
        for kind in map(collective_kind, gm.graph.nodes):
            if kind:
                counts[kind] = counts.get(kind, 0) + 1
    return counts


def _issued(counts: dict[str, int], buckets: dict[str, list[int]]) -> dict[str, int]:
    """Per kind, the collectives issued per call: a bucket of n issues one instead of n."""
    return {k: n - sum(m - 1 for m in buckets.get(k, [])) for k, n in counts.items()}


def _partitioner() -> Callable:
    """Inductor's min-cut partitioner (AOTAutograd's default with Inductor, so DTensor +
    Inductor's too): it recomputes cheap pointwise ops in the backward instead of saving them
    (llama_tp peak 92 -> 78 MiB per rank, step time unchanged) and never recomputes a
    collective. ``DYNAMO_DIST_PARTITIONER=default`` picks the save-everything partitioner.
    Raises ValueError for another name."""
    name = os.environ.get("DYNAMO_DIST_PARTITIONER", "min_cut")
    if name == "min_cut":
        return _min_cut
    if name == "default":
        return lambda gm, inputs, *, num_fwd_outputs, static: compat.default_partition(
            gm, inputs, num_fwd_outputs=num_fwd_outputs)  # it saves every input anyway
    raise ValueError(f"DYNAMO_DIST_PARTITIONER={name!r}: fix: use 'min_cut' or 'default'")


def _static_inputs(gm: fx.GraphModule, resident: Sequence[int]) -> list[int]:
    """Positions, among ``gm``'s placeholders, of the primals numbered in ``resident``: the
    local program takes the primals first, in order (``lowering.local_joint``)."""
    n = len(gm.graph.find_nodes(op="placeholder"))
    return [k for k in resident if k < n]


def _min_cut(gm: fx.GraphModule, inputs, *, num_fwd_outputs: int, static: list[int]):
    # without its CSE: CSE merges a ZeRO-3 backward re-gather with the forward gather of the same
    # shard, keeping every gathered parameter alive from forward to backward; whether to
    # re-gather is the plan's choice (priced with the parameter's memory), not the partitioner's
    with compat.functorch_config_patch(cse=False):
        return compat.min_cut_rematerialization_partition(
            gm, inputs, num_fwd_outputs=num_fwd_outputs, static_lifetime_input_indices=static)


def _joint_rewrites(gm: fx.GraphModule) -> None:
    """Inductor's joint-graph passes on ``gm`` (a forward-tagged joint graph: a layer's cut
    out by ``layer_partition``, or its outer graph) in place; the nodes they make are tagged as
    ``_tag_forward`` would tag them (forward where a forward node reads them). Among their
    rewrites, a loss's scatter fused: llama_dp_tp peak -2 MiB. (The whole-graph partition runs
    the passes and ``_tag_forward`` over the whole graph instead.)"""
    compat.joint_graph_passes(gm)
    for node in reversed(gm.graph.nodes):
        if node.op in ("placeholder", "output") or "partitioner_tag" in node.meta:
            continue
        forward = any(u.meta.get("partitioner_tag") == "is_forward" for u in node.users)
        node.meta["partitioner_tag"] = "is_forward" if forward else "is_backward"


def _tag_forward(gm: fx.GraphModule, num_fwd_outputs: int) -> None:
    """Tag what the forward outputs need as forward ("is_forward"), the rest as backward, as
    AOTAutograd's joint tracing does, and order the forward first. The default partitioner reads these tags to find the end
    of the forward; without them it took only the inputs as forward and the backward graph
    recomputed the whole forward, collectives included (seen: 1.5x the matmuls per step)."""
    out = next(iter(gm.graph.find_nodes(op="output")))
    forward: set[fx.Node] = set()
    stack = [a for a in out.args[0][:num_fwd_outputs] if isinstance(a, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in forward:
            forward.add(node)
            stack.extend(node.all_input_nodes)
    # every output of a forward multi-output op is forward (SDPA's logsumexp feeds only the
    # backward; tagged backward, the partitioner recomputed the whole attention to get it)
    forward |= {u for n in list(forward) for u in n.users if u.target is operator.getitem}
    # The partitioner takes every node up to the LAST forward-tagged one as forward. Lowering
    # emits the output redistributes (the loss's reduction) at the end, after backward nodes:
    # move forward nodes ahead of the first backward one (their inputs are forward too, so the
    # order stays topological).
    anchor = None
    for node in list(gm.graph.nodes):
        if node.op in ("placeholder", "output"):
            continue
        if node not in forward:
            anchor = anchor or node
        elif anchor is not None:
            anchor.prepend(node)
    for node in gm.graph.nodes:
        if node.op != "output":
            node.meta["partitioner_tag"] = "is_forward" if node in forward else "is_backward"
    # A backward collective whose inputs are all forward values (ZeRO-3's re-gather of a
    # parameter, an all_to_all of a saved activation) would be computed by the min-cut
    # partitioner in the forward and saved, since it must save collectives and never recompute
    # them: memory held from forward to backward (96 tp all_to_alls moved so on the 32-layer
    # Llama-3-8B simulation). Pin them, and their waits, to the backward.
    for node in gm.graph.nodes:
        if node not in forward and collective_kind(node) is not None:
            node.meta["partitioner_tag"] = "must_be_in_backward"
            for user in node.users:
                user.meta["partitioner_tag"] = "must_be_in_backward"
    gm.graph.lint()


def _strip_grads(gm: fx.GraphModule, num_fwd_outputs: int) -> fx.GraphModule:
    """Inference: keep the forward outputs only, drop tangent placeholders."""
    out = next(iter(gm.graph.find_nodes(op="output")))
    out.args = (list(out.args[0][:num_fwd_outputs]),)
    gm.graph.eliminate_dead_code()
    for node in list(gm.graph.find_nodes(op="placeholder")):
        if node.name.startswith("tangents") and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()
    return gm
