"""Real multi-process runs (gloo, 2 ranks): loss, gradient and parameter parity with one process."""

import re

import pytest

from conftest import torchrun


# the full tier (conftest.FULL) adds the even MLP (the uneven one covers its path), 4 plain
# layers (the nested regions' run has 4 outlined layers too) and dynamic lengths (simulated in
# test_dynamic_shapes; the dp=2 dynamic batch below is a real run)
@pytest.mark.parametrize("model,inductor,extra", [pytest.param("mlp", "1", (),
                                                               marks=pytest.mark.full),
                                                  ("mlp", "1", ("--hidden", "127")),
                                                  # one run checks both: they are independent
                                                  ("llama", "0", ("--local-logits",
                                                                  "--use-cache")),
                                                  ("llama", "1", ("--layers", "4",
                                                                  "--nested-regions")),
                                                  pytest.param("llama", "1",
                                                               ("--dynamic", "--steps", "5"),
                                                               marks=pytest.mark.full),
                                                  pytest.param("llama", "1", ("--layers", "4"),
                                                               marks=pytest.mark.full)])
def test_two_rank_tp_parity(model, inductor, extra):
    """The Llama run also checks output_plan + return_local_tensor: logits come back as this
    rank's vocabulary shard, a plain tensor equal to that slice of one process's logits. Hidden
    size 127 splits the MLP's weights unevenly (64 and 63 rows), compiled with Inductor.
    ``--use-cache``: transformers' default config, grouped-query attention through the fused
    kernel (enable_gqa) and the DynamicCache's key/value states returned as DTensors.
    ``--nested-regions``: the decoder layer class's forward a ``nested_compile_region``:
    parity, Megatron's collectives as without it, and (Inductor) its layers sharing compiled
    bodies as without it. ``--dynamic``: ``dynamic=True`` with
    Inductor, sequence lengths 32, 48, 64, 32 and a last batch of another size: one compile
    serves all five steps, at parity. ``--layers 4`` with Inductor: the repeated decoder
    layers run as calls of shared compiled bodies (``inductor_passes.outline``), at parity."""
    out = torchrun("train_parity.py", 2, "--model", model, "--mesh", "tp=2",
                   "--inductor", inductor, *extra).stdout
    m = re.search(r"max relative loss difference ([0-9.e+-]+)", out)
    assert m and float(m.group(1)) <= 1e-4, out
    if "--nested-regions" in extra or "--dynamic" in extra:  # Megatron: 2 a layer each way
        layers = int(extra[extra.index("--layers") + 1]) if "--layers" in extra else 2
        assert f"LEDGER forward {2 * layers} backward {2 * layers}" in out, out
    if "--dynamic" in extra:
        assert "COMPILES 1" in out, out
    if "--layers" in extra:  # forward and backward: at least 2 layer calls share a body
        calls = [int(c.split("/")[0]) for c in re.search(r"OUTLINED (.*)", out).group(1).split()]
        assert len(calls) == 2 and min(calls) >= 2, out


def test_two_rank_dp_dynamic_batch_is_one_compile():
    """FSDP on dp=2 with Inductor and ``dynamic=True``: the batch is split, a symbolic size;
    sequence lengths 32, 48, 64, 32 at batch 8, then batch 4 at 40, all run on one compiled
    program (each rank's piece of the batch a symbol of its own, the batch guarded even), at
    parity. It compiled per shape before."""
    out = torchrun("train_parity.py", 2, "--model", "llama", "--mesh", "dp=2", "--inductor", "1",
                   "--dynamic", "--steps", "5").stdout
    m = re.search(r"max relative loss difference ([0-9.e+-]+)", out)
    assert m and float(m.group(1)) <= 1e-4, out
    assert "COMPILES 1" in out, out


def test_two_rank_fsdp_bucketed_collectives(monkeypatch):
    """Parameters sharded over dp (ZeRO-3), compiled with Inductor, bucketing at its default
    (25 MiB per bucket, per layer): the comm pass merges the forward's parameter all_gathers and the
    backward's gradient reduce_scatters into buckets. Values still match one process, and the
    collectives counted at run time are exactly the ledger's issued count (fewer than its
    entries)."""
    monkeypatch.setenv("DYNAMO_DIST_BUCKET_MB", "25")
    out = torchrun("train_parity.py", 2, "--model", "mlp", "--mesh", "dp=2", "--inductor", "1",
                   "--check-issued").stdout
    m = re.search(r"ISSUED (\d+) collectives for (\d+) ledger entries", out)
    assert m and int(m.group(1)) < int(m.group(2)), out
    m = re.search(r"max relative loss difference ([0-9.e+-]+)", out)
    assert m and float(m.group(1)) <= 1e-4, out


def test_four_rank_llama_with_prefetched_gathers(monkeypatch):
    """The Llama, 3 layers, Megatron on tp=2 and FSDP on dp=2 (the backward gathers again)
    under Inductor, bucketing and outlining at their defaults: each layer's parameter bucket
    is gathered while the layer before it runs (``inductor_passes.prefetch``: 2 layers a pass,
    forward and backward), its wait where the layer starts. Losses, gradients and parameters
    match one process, and the collectives counted at run time are exactly the ledger's issued
    count. (Prefetch is on by default for GPU graphs only: forced on here.)"""
    monkeypatch.setenv("DYNAMO_DIST_PREFETCH", "1")
    out = torchrun("train_parity.py", 4, "--model", "llama", "--mesh", "dp=2,tp=2",
                   "--inductor", "1", "--layers", "3", "--steps", "2", "--check-issued").stdout
    m = re.search(r"max relative loss difference ([0-9.e+-]+)", out)
    assert m and float(m.group(1)) <= 1e-4, out
    assert "PREFETCHED 2 2" in out, out
    calls = [int(c.split("/")[0]) for c in re.search(r"OUTLINED (.*)", out).group(1).split()]
    assert min(calls) >= 2, out


def test_two_rank_convnet_parity_under_inductor():
    """Conv + BatchNorm + MaxPool + Linear, FSDP on dp=2 with Inductor and AdamW: losses within
    1e-5 of one process's, first-step gradients and running statistics equal (BatchNorm
    statistics over the global batch), no activation gathered on dp. (DDP: ``--ddp``.)"""
    out = torchrun("train_parity.py", 2, "--model", "cnn", "--mesh", "dp=2", "--inductor", "1"
                   ).stdout
    m = re.search(r"max relative loss difference ([0-9.e+-]+)", out)
    assert m and float(m.group(1)) <= 1e-5, out


def test_two_rank_bucketed_syncbn_gradients(monkeypatch, tmp_path):
    """The zoo's ConvNet (two Conv + BatchNorm blocks) on dp=2 under Inductor with bucketing
    on: a BatchNorm's sum of output gradients is all-reduced (SyncBN backward) and also
    reduce-scattered as its bias gradient. Inductor computed it into the all_reduce bucket, which
    the in-place all_reduce_ then overwrote, so the bias gradient came out 2x (AdamW hides it in
    the loss). First-step gradients must match one process."""
    monkeypatch.setenv("DYNAMO_DIST_BUCKET_MB", "25")
    _first_step_at_parity(tmp_path, 2, "convnet", "dp=2")


def _first_step_at_parity(tmp_path, nproc: int, model: str, mesh: str) -> None:
    """One zoo cell on ``nproc`` gloo ranks under Inductor, one step: its first-step
    gradients must match one process's."""
    import json

    out = tmp_path / "cell.json"
    torchrun("zoo_cell.py", nproc, model, mesh, str(out), "--steps", "1")
    row = json.loads(out.read_text())
    assert row["status"] == "parity", (row.get("grad_worst"), row.get("grad_rel"), row.get("error"))
    assert row["grad_rel"] <= 1e-4


def test_four_rank_mixtral_with_outlined_layers_under_inductor(monkeypatch, tmp_path):
    """The zoo's Mixtral, 4 layers, dp=2 x tp=2 under Inductor: two of its forward layers
    matched, and their shared body returned a batch slice of its input (an activation saved
    for the backward). Inductor reused the input's buffer after the call, so first-step
    gradients came out 82x off with the loss right. Such a layer now stays inline
    (``outline._outputs_own_storage``); first-step gradients must match one process."""
    monkeypatch.setenv("DYNAMO_DIST_ZOO_LAYERS", "4")
    _first_step_at_parity(tmp_path, 4, "mixtral", "dp=2,tp=2")


def test_every_redistribute_on_a_2x2_mesh():
    """858 pairs of Shard / Replicate / Partial (even and uneven), 262 with a _StridedShard, and
    318 more where one side splits a dim over both mesh axes (nested: [S(0), S(0)])."""
    out = torchrun("redistribute_all.py", 4).stdout
    m = re.search(r"REDISTRIBUTE OK (\d+) pairs", out)
    assert m and int(m.group(1)) == 858 + 262 + 318, out


@pytest.mark.full  # the prefetched-gathers run trains the same mesh, under Inductor
def test_four_rank_dp_tp_parity():
    out = torchrun("train_parity.py", 4, "--model", "llama", "--mesh", "dp=2,tp=2",
                   "--inductor", "0").stdout
    m = re.search(r"max relative loss difference ([0-9.e+-]+)", out)
    assert m and float(m.group(1)) <= 1e-4, out


@pytest.mark.full  # tests/test_per_block.py checks the same on simulated ranks in CI
def test_four_rank_dp_tp_blocks_compiled_one_by_one():
    """Each decoder layer compiled on its own under Inductor, the embedding (its eager pending
    sum settled by shard_module's hook), norm and head eager: 3 steps of SGD at parity on
    dp=2 x tp=2 gloo ranks, and one compiled block serves every layer."""
    out = torchrun("train_parity.py", 4, "--model", "llama", "--mesh", "dp=2,tp=2",
                   "--inductor", "1", "--layers", "3", "--per-block").stdout
    m = re.search(r"max relative loss difference ([0-9.e+-]+)", out)
    assert m and float(m.group(1)) <= 1e-4, out
    assert "COMPILES 1" in out, out


def test_spmd_api_and_dtensor_calls_match_one_process():
    """mark_sharding, manual regions (with a collective in local code), local_map, DTensor
    to_local/from_local and an eagerly annotated input, on 2 gloo ranks: values and gradients
    equal one process's."""
    out = torchrun("spmd_api.py", 2).stdout
    m = re.search(r"SPMD API OK (\d+) checks", out)
    assert m and int(m.group(1)) >= 17, out


def test_rank_divergent_collectives_fail_fast_on_every_rank():
    """A collective on rank 0 only: compilation fails on both ranks with the first difference
    named (the launcher's timeout would catch a hang)."""
    out = torchrun("rank_divergence.py", 2, timeout=240).stdout
    assert out.count("DIVERGENCE CAUGHT rank") == 2 and "MISSING RANK CAUGHT" in out, out
    assert out.count("OTHER PROGRAM CAUGHT rank") == 2, out


@pytest.mark.parametrize("nproc", [2, 4])
def test_a_rank_failing_at_any_compile_stage_stops_every_rank(nproc):
    """One rank raises in capture, in planning (on the planning rank) or in lowering while its
    process lives on: every other rank raises within seconds naming it and its error (before,
    the others blocked in the plan broadcast for as long as it lived)."""
    out = torchrun("rank_faults.py", nproc, timeout=240).stdout
    faults = re.findall(r"FAULT (\w+) rank (\d+) ([0-9.]+)", out)
    assert sorted((stage, int(r)) for stage, r, _ in faults) == sorted(
        (stage, r) for stage in ("capture", "planning", "lowering") for r in range(nproc)), out
    assert max(float(s) for _, _, s in faults) <= 10, out


@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.full)])
def test_meshes_in_any_device_order_train_like_one_process(nproc):
    """DeviceMesh over [1, 0] (and Mesh([1, 0])) on 2 ranks; [[3, 2], [1, 0]], [[2, 3], [0, 1]]
    and [[0, 2], [1, 3]] on 4: loss and gradients equal one process's (a gather on a permuted
    axis came back in the wrong order, with no error)."""
    out = torchrun("permuted_mesh.py", nproc, timeout=300).stdout
    layouts = 2 if nproc == 2 else 3
    assert out.count("PERMUTED OK") == layouts * nproc, out


def test_input_contract_check_names_the_input_that_differs():
    """DYNAMO_DIST_CHECK_INPUTS=1: a plain tensor input (or a replicated DTensor's local) that
    differs on one rank is an error on every rank naming the input and the ranks; off by default
    (the mismatch then runs, each rank on its own value)."""
    out = torchrun("input_contract.py", 2, timeout=240).stdout
    assert out.count("CONTRACT OK rank") == 2, out


@pytest.mark.full  # Mixtral trains on 4 ranks under Inductor in the default tier (zoo cell)
def test_two_rank_mixtral_moe_parity():
    """Mixtral-like MoE (transformers' default grouped_mm experts path: sort, index, histc,
    cumsum, its grouped GEMM op), tp=2 with a hand plan, Inductor, 3 AdamW steps: loss,
    first-step gradients and parameters equal one process's, nothing replicated by fallback."""
    out = torchrun("moe_parity.py", 2, "--inductor", "1").stdout
    m = re.search(r"MOE PARITY loss ([0-9.e+-]+) grad ([0-9.e+-]+) param ([0-9.e+-]+) "
                  r"fallbacks (\d+)", out)
    assert m and float(m.group(1)) <= 1e-5 and float(m.group(2)) <= 1e-4, out
    assert float(m.group(3)) <= 1e-3 and m.group(4) == "0", out


@pytest.mark.full  # torchtitan's model and TP plan run in the default tier under its FSDP2
def test_torchtitan_llama3_with_its_own_tp_plan():
    """torchtitan's Llama 3 debug model (from its wheel), parallelized by torchtitan's own plan
    (``Module.parallelize``, sequence parallel off and on), compiled whole with
    ``backend="dist"`` on 2 gloo ranks: 5 AdamW steps at parity with one process, one graph,
    no break, and fewer collectives per step than eager DTensor issues on the same model, with
    the logits gathered for the loss and with torchtitan's own vocabulary-parallel loss
    (compiled in the model's graph: local code and all_reduces in a manual region). It
    failed as shipped: tracing read every ``.placements`` as Replicate, torchtitan's
    placement asserts broke the graph 12-13 times, then Dynamo's "Guard failed on the same
    frame it was created"."""
    import json

    out = torchrun("torchtitan_tp.py", 2, timeout=600).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(r["loss"], r["sp"]) for r in rows] == [("gather", False), ("gather", True),
                                                    ("parallel", False), ("parallel", True)], out
    for r in rows:
        assert r["loss_rel"] <= 1e-5 and r["grad_rel"] <= 1e-4, r
        assert r["graphs"] == 1 and r["breaks"] == 0, r
        assert r["collectives"] < r["eager_dtensor_collectives"], r


def test_torchtitan_fsdp2_over_its_tp_plan_on_four_ranks():
    """torchtitan's FSDP2 (``apply_fsdp_to_decoder``) over its own TP plan, dp=2 x tp=2 on 4
    gloo ranks, the step with torchtitan's vocabulary-parallel loss compiled: ``dist`` gives
    one process's first-step gradients (every parameter) and losses over 3 AdamW steps, as
    ``backend="inductor"`` does, with no more collectives per step. (Reported in issue 15:
    it failed on non-contiguous local inputs.)"""
    import json

    out = torchrun("torchtitan_fsdp_tp.py", 4, "dist,inductor", timeout=600).stdout
    rows = {r["backend"]: r for r in
            (json.loads(ln) for ln in out.splitlines() if ln.startswith("{"))}
    assert set(rows) == {"dist", "inductor"}, out
    for r in rows.values():
        assert r["loss_rel"] <= 1e-5 and r["grad_rel"] <= 1e-4, r
    assert rows["dist"]["collectives"] <= rows["inductor"]["collectives"], rows


def test_transformers_own_tp_plan_compiles_at_parity():
    """transformers' built-in tensor-parallel plan (``model.tp_plan``: its forward hooks move
    activations between DTensors and local tensors at every planned module) on a Llama, tp=2:
    ``backend="dist"`` compiles it in one graph with no break, loss and every gradient as one
    process, as eager DTensor does, with no more collectives. (It issued one more, an all_to_all
    of the vocabulary-split embedding table and an all_gather of its rows instead of one
    all_reduce, before the vocabulary-parallel embedding rule.)"""
    import json

    out = torchrun("hf_tp_plan.py", 2, timeout=600).stdout
    rows = {r["contestant"]: r for r in
            (json.loads(ln) for ln in out.splitlines() if ln.startswith("{"))}
    assert set(rows) == {"eager_dtensor", "dist"}, out
    for r in rows.values():
        assert r["loss_rel"] <= 1e-5 and r["grad_rel"] <= 1e-4, r
    assert rows["dist"]["graphs"] == 1 and rows["dist"]["breaks"] == 0, rows
    assert rows["dist"]["collectives"] <= rows["eager_dtensor"]["collectives"], rows


def test_serving_eval_and_generate_match_one_process():
    """transformers' Llama on 2 gloo ranks (tp): no_grad and inference_mode forwards compile
    forward-only programs at parity, and ``generate`` (greedy, 8 new tokens, DynamicCache)
    through the compiled forward gives one process's tokens, the KV cache split over its
    key/value heads, in at most 3 compiles (the decode steps share a program with a symbolic
    cache length). Before: the no_grad forward crashed (it expected tangents); then generate
    failed after the graph (decode-step logits left split over the vocabulary hit DTensor's
    argmax(-1) bug), and the cache's first update read the whole cache as replicated."""
    import json

    out = torchrun("serve_tp.py", 2, timeout=600).stdout
    row = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert row["no_grad_logits_err"] <= 1e-4 and row["inference_mode_logits_err"] <= 1e-4, row
    assert row["cache_placements"] == ["S(1)"] and row["cache_local_heads"] * 2 == \
        row["cache_global_heads"], row
    assert row["tokens"] == row["ref_tokens"] and len(row["tokens"][0]) == 8 + 8, row
    # prefill, the first decode step, then one program with a symbolic cache length (it was a
    # static compile per step: 8)
    assert row["generate_compiles"] <= 3, row


def _whole_steps(*variants: str) -> dict:
    """Run tests/mp/whole_step.py's ``variants`` on 2 ranks; each one's row, after the checks
    every variant passes: parity with one process (losses and parameters), exactly the
    collectives of the forward and backward compiled alone, no fallback."""
    import json

    out = torchrun("whole_step.py", 2, "--variant", ",".join(variants), timeout=600).stdout
    rows = {r["variant"]: r for r in (json.loads(line) for line in out.splitlines()
                                      if line.startswith("{"))}
    assert set(rows) == set(variants), out[-2000:]
    for row in rows.values():
        assert row["loss_rel"] <= 1e-5 and row["param_rel"] <= 1e-4, row
        assert row["collectives"] == row["alone"] and row["collectives"], row
        assert row["fallbacks"] == 0, row
    return rows


def test_whole_training_step_is_one_program_at_parity():
    """transformers' Llama on tp=2 (Megatron planner), a step function doing forward,
    ``loss.backward()``, AdamW ``opt.step()`` and ``opt.zero_grad()`` compiled with
    ``backend="dist"`` and Inductor: one program, no graph break, 5 steps at parity with one
    process (losses and parameters), and exactly the collectives of the forward and backward
    compiled alone (Megatron's all_reduces: the update communicates nothing). It was 8 graphs
    and 24 breaks."""
    one = _whole_steps("one_program")["one_program"]
    assert one["graphs"] == 1 and one["breaks"] == [], one


@pytest.mark.full  # the split steps' backward is eager DTensor, which other tests run
def test_training_steps_split_at_backward_train_at_parity():
    """The steps Dynamo splits at ``loss.backward()`` (returning ``loss`` itself; reading
    ``opt.param_groups`` before the forward) run the backward eagerly under Dynamo's frame hook:
    at parity too, with the same collectives. They crashed real ranks in about 3 runs of 4
    (SIGSEGV inside DTensor's C++ dispatch) and failed under Inductor."""
    rows = _whole_steps("returns_loss", "lr_first")
    assert rows["returns_loss"]["graphs"] == 2, rows["returns_loss"]
    assert "dist: backward() would miss a parameter" in rows["lr_first"]["breaks"], rows
