"""Activation checkpointing under ``backend="dist"``: bytes saved for backward per rank.

transformers' Llama (random weights), tp=2 on 2 gloo ranks under the stock Megatron plan,
trained without and with checkpointing on every decoder layer (HF's
``gradient_checkpointing_enable()``: ``torch.utils.checkpoint(layer, use_reentrant=False)``).
Contestants: eager on one process, eager DTensor on the same tp=2 model and plan (the same
parallelism: each rank holds its half of what the plan splits and all of what it replicates),
and ``backend="dist"`` (Inductor). Saved bytes are what autograd
holds between forward and backward per rank, parameters excluded: eager's read with
``torch.autograd.graph.saved_tensors_hooks`` (each storage counted once), the compiled step's
from the partitioned forward's saved outputs (``CompileRecord.saved_for_backward_bytes``,
summed over its graphs).
Also per run: the median step time of ``--steps`` steps and the loss's relative difference
from one process. Writes ``benchmarks/results/activation_checkpointing-<time>.json`` and
``activation_checkpointing.md``.

    PYTHONPATH=$PWD python -m benchmarks.activation_checkpointing [--steps 5 --layers 4]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("none", "hf")


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward while active (parameters
    left out: they are held anyway). A DTensor counts its local tensor (per-rank bytes)."""

    def __init__(self, params) -> None:
        self.params = {self._key(p) for p in params}
        self.seen: dict = {}

    @staticmethod
    def _local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    def _key(self, t: torch.Tensor):
        t = self._local(t)
        return t.untyped_storage().data_ptr(), t.device

    def pack(self, t: torch.Tensor):
        local = self._local(t)
        key = self._key(t)
        if key not in self.params and local.device.type != "meta":
            self.seen[key] = max(self.seen.get(key, 0), local.untyped_storage().nbytes())
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def _wrap_layers(model, mode: str) -> None:
    if mode == "hf":  # torch.utils.checkpoint(layer, use_reentrant=False) on every layer
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})


def _step(run, ids, meter: SavedBytes | None):
    if meter is None:
        loss = run(input_ids=ids, labels=ids).loss
    else:
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t):
            loss = run(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss


def _measure(model, run, size, steps: int, compiled: bool) -> dict:
    """One step, then ``steps`` timed ones. Saved bytes: eager's through the hooks on the first
    step; the compiled step's from its programs (``saved_for_backward_bytes``: saved tensors
    hooks turn Dynamo off for the call, which then ran as eager DTensor)."""
    from dynamo_dist import compile_records

    ids = torch.randint(3, size["vocab"], (size["batch"], size["seq"]),
                        generator=torch.Generator().manual_seed(0))
    meter = None if compiled else SavedBytes(model.parameters())
    t0 = time.perf_counter()
    loss = _step(run, ids, meter)
    first = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        _step(run, ids, None)
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    records = compile_records()
    saved = sum(r.saved_for_backward_bytes() for r in records) if compiled else meter.total
    return {"saved_bytes": saved, "first_step_s": round(first, 2), "graphs": len(records),
            "step_ms": round(1e3 * statistics.median(times), 2), "loss": value.item()}


def worker(args) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dynamo_dist import clear_compile_records
    from dynamo_dist.plans import shard_module
    import transformers as T

    from dynamo_dist.testing.zoo.cell import _quiet_transformers_warn_once, plan_model

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    size = {"vocab": 256, "batch": args.batch, "seq": args.seq}
    rows = []
    for mode in args.modes.split(","):
        torch._dynamo.reset()
        clear_compile_records()
        torch.manual_seed(0)
        ref = T.LlamaForCausalLM(T.LlamaConfig(
            hidden_size=args.hidden, intermediate_size=4 * args.hidden, vocab_size=256,
            num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
            use_cache=False, attn_implementation=args.attn)).train()  # training: no KV cache
        _wrap_layers(ref, mode)
        eager = _measure(ref, ref, size, args.steps, compiled=False)
        model = copy.deepcopy(ref)
        shard_module(model, mesh, plan_model(model, {"tp": 2}))
        try:  # every rank fails alike, before any collective (a missing DTensor strategy)
            eager_tp = _measure(model, model, size, args.steps, compiled=False)
            eager_tp["loss_rel"] = abs(eager_tp["loss"] - eager["loss"]) / abs(eager["loss"])
        except NotImplementedError as e:  # 2.13: no CPU SDPA strategy
            eager_tp = {"error": str(e).splitlines()[0]}
            model.zero_grad(set_to_none=True)
        with _quiet_transformers_warn_once():
            dist_row = _measure(model, torch.compile(model, backend="dist"), size, args.steps,
                                compiled=True)
        dist_row["loss_rel"] = abs(dist_row["loss"] - eager["loss"]) / abs(eager["loss"])
        rows.append({"mode": mode, "eager": eager, "eager_tp": eager_tp, "dist": dist_row})
    if dist.get_rank() == 0:
        base = rows[0]
        for r in rows:
            for who in ("eager", "eager_tp", "dist"):
                if "error" in r[who] or "error" in base[who]:
                    continue
                r[who]["saved_factor"] = round(base[who]["saved_bytes"] /
                                               max(r[who]["saved_bytes"], 1), 2)
        print(json.dumps({"layers": args.layers, "hidden": args.hidden, "attn": args.attn,
                          **size, "rows": rows}),
              flush=True)
    dist.destroy_process_group()


def _cell(row: dict, key: str) -> str:
    return "n/a" if "error" in row else str(row[key])


def report(results: list[dict]) -> str:
    first = results[0]
    lines = ["# Activation checkpointing: bytes saved for backward per rank\n",
             f"transformers Llama (GQA), {first['layers']} decoder layers, hidden "
             f"{first['hidden']}, batch {first['batch']} x seq {first['seq']}, no KV cache; "
             f"eager on one process, eager DTensor and `backend=\"dist\"` (Inductor) on 2 gloo "
             f"ranks, tp=2 (the same Megatron plan). Factor: saved bytes without "
             f"checkpointing / with, per contestant. Saved bytes are per rank (one process: all "
             f"of them). Step times: medians.\n"]
    for result in results:
        lines += [f"\n## attn_implementation={result['attn']}\n",
                  "| checkpointing | eager 1 process saved (B) | factor | eager DTensor tp=2 "
                  "saved (B) | factor | dist saved (B) | factor | dist loss rel. diff | "
                  "eager 1 process / eager DTensor / dist step (ms) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in result["rows"]:
            e, t, d = r["eager"], r["eager_tp"], r["dist"]
            lines.append(f"| {r['mode']} | {e['saved_bytes']} | {e['saved_factor']} | "
                         f"{_cell(t, 'saved_bytes')} | {_cell(t, 'saved_factor')} | "
                         f"{d['saved_bytes']} | {d['saved_factor']} | {d['loss_rel']:.1e} | "
                         f"{e['step_ms']} / {_cell(t, 'step_ms')} / {d['step_ms']} |")
        errors = {r["eager_tp"]["error"] for r in result["rows"] if "error" in r["eager_tp"]}
        lines += [f"\neager DTensor failed: {e}" for e in sorted(errors)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--modes", default=",".join(MODES),
                        help="which of none, hf (none first: the factor's base)")
    parser.add_argument("--attn", default="sdpa,eager",
                        help="transformers' attn_implementation(s), each its own run (eager "
                             "DTensor has no CPU SDPA strategy in torch 2.13: n/a under sdpa)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    results = []
    for attn in args.attn.split(","):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
               "-m", "benchmarks.activation_checkpointing", "--worker",
               "--steps", str(args.steps), "--layers", str(args.layers),
               "--hidden", str(args.hidden), "--modes", args.modes, "--batch", str(args.batch),
               "--seq", str(args.seq), "--attn", attn]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(HERE))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("{")), None)
        if proc.returncode != 0 or line is None:
            sys.exit(f"benchmark failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
        results.append(json.loads(line))
    out_dir = os.path.join(HERE, "results")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    with open(os.path.join(out_dir, f"activation_checkpointing-{stamp}.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = report(results)
    with open(os.path.join(out_dir, "activation_checkpointing.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
