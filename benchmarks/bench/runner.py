"""One benchmark run of one workload, on every rank of a torchrun job.

Phases, each visiting every contestant (so all contestants take the same steps on the same
batches, and their weights stay comparable with eager_1p's):

  1. first calls   per contestant, alone: step 0 ("cold": fresh Dynamo state, in-memory Inductor
                   caches cleared, a new empty TORCHINDUCTOR_CACHE_DIR) and step 1 ("warm":
                   Dynamo reset again, in-memory caches cleared, the same cache dir, so the FX
                   graph / AOTAutograd caches on disk can hit). Wall time of each first call.
  2. warm-up       ``warmup`` interleaved steps (compiled contestants whose Dynamo state a later
                   contestant's reset dropped recompile here, from their own warm cache dir).
  3. timed         ``steps`` interleaved steps: step k of every contestant before step k+1 of any,
                   the order rotated by one each step; a barrier before every step; wall time per
                   rank (seconds, ``time.perf_counter``).
  4. collectives   one step per contestant under CollectiveRecorder (see comm).
  5. memory        ``MEMORY_REPEATS`` steps per contestant under the memory probe (see memory),
                   interleaved; the median step's peak is reported, with every step's. On gloo the
                   peak moves by up to ~3 MiB between steps of the same program: gloo frees its
                   all_gather staging buffer on its own thread, sometimes only after a later
                   collective.
  6. numerics      a forward on a fixed evaluation batch (the global loss) and the full
                   parameters, compared on rank 0 with eager_1p's.
  7. profile       optional: torch.profiler over a few steps of the named contestants.

``run`` returns the results dict on rank 0 (None elsewhere); it does not write files.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
import traceback
from typing import Callable

import torch
import torch.distributed as dist

from . import contestants as C
from .comm import CollectiveRecorder, ledger_summary
from .machine import load_average, machine_info
from .memory import step_peak

MEMORY_REPEATS = 5  # probe steps per contestant: the median is reported (see phase 5)
from .stats import summarize
from .workload import Workload

EVAL_STEP = 10**6   # batch index of the numerics check (never a training batch)


@dataclasses.dataclass(frozen=True)
class Options:
    steps: int = 30
    warmup: int = 3
    contestants: tuple[str, ...] = C.NAMES
    profile: tuple[str, ...] = ()
    profile_steps: int = 3
    profile_dir: str = "benchmarks/results/profiles"
    device: str = "cpu"
    skip_schedule_check: bool = False
    ours_compile: str = "model"   # or "blocks": each FSDP unit compiled on its own


def configure_dynamo() -> None:
    """Static shapes (otherwise a contestant's recompile of the same code object with another
    batch size, e.g. a dp rank's half batch, turns on dynamic shapes) and room for the several
    compiled contestants that share the model's code objects."""
    import torch._dynamo.config as cfg

    cfg.automatic_dynamic_shapes = False
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 64))


def fresh_compile_state() -> None:
    """Forget every compiled frame and Inductor's in-memory caches, and zero the counters."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import clear_caches

    torch._dynamo.reset()
    clear_caches()
    counters.clear()


def cache_counters() -> dict:
    """Inductor FX graph cache and AOTAutograd cache hits / misses / bypasses since the last
    fresh_compile_state (counts of graphs)."""
    from torch._dynamo.utils import counters

    out = {}
    for group, prefix in (("inductor", "fxgraph_cache_"), ("aot_autograd", "autograd_cache_")):
        for k, v in counters[group].items():
            if k.startswith(prefix):
                out[k] = v
    out["unique_graphs"] = counters["stats"].get("unique_graphs", 0)
    return out


def warm_process(device: torch.device, tmp: str) -> None:
    """Pay one-time process costs (Inductor imports, C++ toolchain checks, compile workers, the
    dist backend's imports) before anything is measured, in a throwaway cache dir."""
    import dynamo_dist.backend  # noqa: F401  (imports inductor_passes; sets DTensor flags)

    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "process-warmup")
    try:
        x = torch.randn(64, 64, device=device, requires_grad=True)
        f = torch.compile(lambda t: (t.sin() @ t).relu().sum())
        f(x).backward()
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old
    fresh_compile_state()


class Runner:
    """Holds the contestants of one run on this rank and what each phase measured."""

    def __init__(self, workload: Workload, opts: Options, device: torch.device, mesh, tmp: str):
        self.w, self.opts, self.device, self.mesh, self.tmp = workload, opts, device, mesh, tmp
        self.rank = dist.get_rank()
        self.step_index = 0
        self.cs: list[C.Contestant] = []
        # name -> what this rank measured (gathered to rank 0 at the end)
        self.mine: dict[str, dict] = {n: {"times": [], "losses": [], "first": {}, "cache": {},
                                          "stages": {}} for n in opts.contestants}

    # --- failure handling: a contestant that fails is recorded and skipped from then on ---
    def _agree(self, ok: bool) -> bool:
        t = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def guarded(self, c: C.Contestant, what: str, fn: Callable[[], object]):
        """Run ``fn`` where ``c`` is active and healthy; every rank learns if any rank failed."""
        out, err = None, None
        if c.active and c.status == "ok":
            try:
                out = fn()
            except Exception as exc:  # noqa: BLE001 -- recorded in the results, not hidden
                err = f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
                if self.rank == 0 or not c.spmd:
                    traceback.print_exc()
        ok = self._agree(err is None)
        if not ok and c.status == "ok":
            c.status = f"failed: {what}: {err or 'failed on another rank'}"
        return out if ok else None

    def live(self) -> list[C.Contestant]:
        return [c for c in self.cs if c.status == "ok"]

    def batch(self, index: int):
        return self.w.batch(index)

    # --- phases ---
    def build(self) -> None:
        for name in self.opts.contestants:
            placeholder = C.Contestant(name, self.w, self.device, active=True)
            built = self.guarded(placeholder, "build",
                                 lambda name=name: C.build(name, self.w, self.mesh, self.device,
                                                          self.opts.ours_compile))
            self.cs.append(built if built is not None else placeholder)

    def first_calls(self) -> None:
        for c in self.cs:
            for phase, index in (("cold", 0), ("warm", 1)):
                if c.compiled:
                    if phase == "cold":  # the same fresh directory on every rank
                        c.cache_dir = os.path.join(self.tmp, f"{c.name}-cache")
                        os.makedirs(c.cache_dir, exist_ok=True)
                    fresh_compile_state()
                dist.barrier()

                def call(c=c, index=index):
                    t = time.perf_counter()
                    loss = c.step(self.batch(index))
                    dt = time.perf_counter() - t
                    return dt, c.loss_value(loss)
                res = self.guarded(c, f"{phase} first call", call)
                if res is not None:
                    self.mine[c.name]["first"][phase] = res[0]
                    if c.compiled:
                        self.mine[c.name]["cache"][phase] = cache_counters()
                    if c.name == "ours" and c.records:
                        self.mine[c.name]["stages"][phase] = {
                            k: sum(r.seconds.get(k, 0.0) for r in c.records)
                            for k in c.records[0].seconds}
        self.step_index = 2

    def interleaved(self, n: int, timed: bool) -> None:
        for k in range(n):
            cs = self.cs[k % len(self.cs):] + self.cs[:k % len(self.cs)]
            for c in cs:
                if c.status != "ok":
                    continue
                dist.barrier()

                def call(c=c):
                    t = time.perf_counter()
                    loss = c.step(self.batch(self.step_index))
                    dt = time.perf_counter() - t
                    return dt, c.loss_value(loss)
                res = self.guarded(c, "timed step" if timed else "warm-up step", call)
                if res is not None and timed:
                    self.mine[c.name]["times"].append(res[0])
                    self.mine[c.name]["losses"].append(res[1])
            self.step_index += 1

    def collectives(self) -> None:
        from torch._dynamo.utils import counters

        for c in self.cs:
            dist.barrier()

            def call(c=c):
                graphs = counters["stats"].get("unique_graphs", 0)
                with CollectiveRecorder() as rec:
                    c.step(self.batch(self.step_index))
                out = {"runtime": rec.summary(),
                       "recompiled": counters["stats"].get("unique_graphs", 0) != graphs}
                if c.name == "ours":
                    out["ledger"] = ledger_summary(c.records)
                return out
            res = self.guarded(c, "collective count", call)
            if res is not None:
                self.mine[c.name]["collectives"] = res
        self.step_index += 1

    def memory(self) -> None:
        runs: dict[str, list[dict]] = {c.name: [] for c in self.cs}
        for _ in range(MEMORY_REPEATS):
            for c in self.cs:
                dist.barrier()

                def call(c=c):
                    return step_peak(lambda: c.step(self.batch(self.step_index)), self.device,
                                     c.resident_bytes())
                res = self.guarded(c, "memory step", call)
                if res is not None:
                    runs[c.name].append(res)
            self.step_index += 1
        for name, found in runs.items():
            if found:
                found.sort(key=lambda r: r["peak_bytes"])
                median = dict(found[len(found) // 2])
                median["peak_bytes_per_step"] = [r["peak_bytes"] for r in found]
                self.mine[name]["memory"] = median

    def numerics(self) -> dict:
        """rank 0: name -> eval loss and parameter differences against eager_1p."""
        out: dict[str, dict] = {}
        ref_params = None
        for c in self.cs:
            dist.barrier()
            loss = self.guarded(c, "evaluation forward", lambda c=c: c.eval_loss(self.batch(EVAL_STEP)))
            params = self.guarded(c, "parameter gather", c.full_parameters)
            if self.rank != 0 or c.status != "ok":
                continue
            out[c.name] = {"eval_loss": loss}
            if c.name == "eager_1p":
                ref_params = params
            if ref_params is not None and params is not None:
                rel = absd = 0.0
                worst = None
                for k, q in ref_params.items():
                    p = params[k]
                    r = ((p - q).norm() / q.norm().clamp_min(1e-12)).item()
                    if r >= rel:
                        rel, worst = r, k
                    absd = max(absd, (p - q).abs().max().item())
                out[c.name].update(param_max_rel_diff=rel, param_max_abs_diff=absd,
                                   param_worst=worst)
        return out

    def profile(self) -> dict:
        from .profiling import profile_steps

        written = {}
        for c in self.cs:
            if c.name not in self.opts.profile or c.status != "ok":
                continue
            dist.barrier()
            steps = range(self.step_index, self.step_index + self.opts.profile_steps)
            res = self.guarded(c, "profile", lambda c=c: profile_steps(
                c, [self.batch(i) for i in steps], self.rank == 0, self.opts.profile_dir))
            if res:
                written[c.name] = res
        self.step_index += self.opts.profile_steps
        return written


def run(workload: Workload, opts: Options) -> dict | None:
    """Run every phase on every rank; the results dict on rank 0."""
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device(opts.device if opts.device != "cuda" else f"cuda:{torch.cuda.current_device()}")
    mesh = init_device_mesh(device.type, tuple(workload.mesh.values()),
                            mesh_dim_names=tuple(workload.mesh))
    configure_dynamo()
    load_start = load_average()
    if opts.skip_schedule_check:
        C.disable_schedule_check()
    # one scratch root for all ranks: the ranks of a contestant share its fresh Inductor cache
    # directory, as every process of a user shares /tmp/torchinductor_$USER by default (a kernel
    # one rank compiles, the others load; per-rank directories would compile it once per rank)
    box = [tempfile.mkdtemp(prefix=f"bench-{workload.name}-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    tmp = box[0]
    try:
        warm_process(device, tmp)
        r = Runner(workload, opts, device, mesh, tmp)
        r.build()
        r.first_calls()
        r.interleaved(opts.warmup, timed=False)
        r.interleaved(opts.steps, timed=True)
        r.collectives()
        r.memory()
        numerics = r.numerics()
        profiles = r.profile() if opts.profile else {}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, r.mine)
        if dist.get_rank() != 0:
            return None
        results = assemble(workload, opts, device, r, gathered, numerics, profiles)
        results["machine"]["load_average_start"] = load_start
        return results
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def assemble(workload: Workload, opts: Options, device, r: Runner, per_rank: list[dict],
             numerics: dict, profiles: dict) -> dict:
    """The results dict (see benchmarks/README.md for every field; times in seconds, bytes)."""
    ranks = list(range(len(per_rank)))
    out = {"workload": workload.name, "description": workload.description, "mesh": workload.mesh,
           "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "machine": machine_info(device, len(per_rank)),
           "config": {"steps": opts.steps, "warmup": opts.warmup,
                      "order": "interleaved, rotated by one contestant per step; barrier before "
                               "every step",
                      "dynamo": "automatic_dynamic_shapes=False",
                      "skip_schedule_check": opts.skip_schedule_check,
                      "ours_compile": opts.ours_compile,
                      "contestants": list(opts.contestants)},
           "contestants": {}, "profiles": profiles}
    ref_loss = numerics.get("eager_1p", {}).get("eval_loss")
    ref_losses = per_rank[0].get("eager_1p", {}).get("losses", [])
    for c in r.cs:
        me = per_rank[0][c.name]
        spmd_ranks = ranks if c.spmd else [0]
        entry: dict = {"status": c.status, "spmd": c.spmd, "compiled": c.compiled,
                       "ranks": len(spmd_ranks)}
        times = me["times"]
        entry["step_time_s"] = summarize(times)
        per = [per_rank[i][c.name]["times"] for i in spmd_ranks]
        maxed = [max(col) for col in zip(*per)] if per and all(per) else []
        entry["step_time_max_over_ranks_s"] = summarize(maxed)
        entry["raw_step_times_s"] = {f"rank{i}": per_rank[i][c.name]["times"] for i in spmd_ranks}
        first = dict(me["first"])
        entry["first_call_s"] = dict(first, **{
            f"{ph}_max_over_ranks": max(per_rank[i][c.name]["first"].get(ph, 0.0)
                                        for i in spmd_ranks) for ph in me["first"]})
        median = entry["step_time_s"].get("median")
        entry["compile_s"] = ({ph: v - median for ph, v in first.items()}
                              if c.compiled and median is not None else None)
        entry["cache"] = me["cache"] or None
        if me["stages"]:
            entry["ours_compile_stages_s"] = me["stages"]
        if "collectives" in me:
            coll = dict(me["collectives"])
            coll["runtime_totals_per_rank"] = [
                {"count": per_rank[i][c.name]["collectives"]["runtime"]["count"],
                 "bytes": per_rank[i][c.name]["collectives"]["runtime"]["bytes"]}
                for i in spmd_ranks if "collectives" in per_rank[i][c.name]]
            entry["collectives"] = coll
        if "memory" in me:
            mem = [per_rank[i][c.name].get("memory") for i in spmd_ranks]
            entry["memory"] = {"per_rank": mem,
                               "peak_bytes_max": max(m["peak_bytes"] for m in mem if m)}
        entry["losses"] = me["losses"]
        num = dict(numerics.get(c.name, {}))
        if ref_loss is not None and num.get("eval_loss") is not None:
            num["eval_loss_rel_diff"] = abs(num["eval_loss"] - ref_loss) / abs(ref_loss)
        if ref_losses and me["losses"]:
            num["step_loss_max_rel_diff"] = max(abs(a - b) / abs(b)
                                                for a, b in zip(me["losses"], ref_losses))
        entry["numerics"] = num
        out["contestants"][c.name] = entry
    return out
