"""Markdown report of one run: tables per metric, the ratio of ours to every contestant, and the
spec's targets with PASS / MISS. Input: the results dict of ``runner.run``."""

from __future__ import annotations

# (label, metric, contestant, allowed ratio ours / contestant)
TARGETS = [
    ("step time <= 0.5x DTensor eager", "step", "dtensor_eager", 0.5),
    ("step time <= 1.0x DTensor + Inductor", "step", "dtensor_inductor", 1.0),
    ("collective bytes <= DTensor eager's", "bytes", "dtensor_eager", 1.0),
    ("collective bytes <= DTensor + Inductor's", "bytes", "dtensor_inductor", 1.0),
    ("compile time (cold) <= 1.5x DTensor + Inductor", "compile", "dtensor_inductor", 1.5),
]
MIB = 1024 * 1024


def write_json_and_markdown(out: str, result: dict, markdown: str) -> None:
    """A one-process benchmark's outputs: ``result`` as JSON at ``out``, ``markdown`` beside it
    (same name, ``.md``) and on stdout."""
    import json
    import os

    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(markdown)
    print(markdown)


def _ok(entry: dict | None) -> bool:
    return bool(entry) and entry.get("status") == "ok"


def metric(entry: dict | None, which: str) -> float | None:
    """step: median step time (s, rank 0); compile: cold compile time (s); bytes: collective
    bytes per step per rank (run time); None where it does not apply or did not run."""
    if not _ok(entry):
        return None
    if which == "step":
        return entry["step_time_s"].get("median")
    if which == "compile":
        return (entry.get("compile_s") or {}).get("cold")
    if which == "warm_compile":
        return (entry.get("compile_s") or {}).get("warm")
    if which == "bytes":
        return entry.get("collectives", {}).get("runtime", {}).get("bytes")
    raise ValueError(which)


def ratio(results: dict, which: str, other: str) -> float | None:
    cs = results["contestants"]
    a, b = metric(cs.get("ours"), which), metric(cs.get(other), which)
    if a is None or b is None or b == 0:
        return None
    return a / b


def _f(x, fmt="{:.1f}", none="n/a") -> str:
    return none if x is None else fmt.format(x)


def _ms(x) -> str:
    return _f(None if x is None else x * 1e3)


def _x(r) -> str:
    return _f(r, "{:.2f}x")


def targets(results: dict) -> list[dict]:
    out = []
    for label, which, other, limit in TARGETS:
        r = ratio(results, which, other)
        if r is None and which == "bytes" and metric(results["contestants"].get("ours"), "bytes") == 0:
            r = 0.0
        out.append({"target": label, "ratio": r, "limit": limit,
                    "result": "n/a" if r is None else ("PASS" if r <= limit else "MISS")})
    return out


def _status(entry: dict) -> str:
    return "ok" if _ok(entry) else entry.get("status", "not run")


def to_markdown(results: dict) -> str:
    cs = results["contestants"]
    m = results["machine"]
    n = max((e["step_time_s"].get("n", 0) for e in cs.values()), default=0)
    lines = [f"## {results['workload']}: {results['description']}", "",
             f"{results['timestamp']}; torch {m['torch']}, {m['device']}, {m['cores']} cores "
             f"({m['cpu']}), {m['world_size']} ranks x {m['intra_op_threads_per_rank']} "
             f"intra-op thread(s); {n} timed steps after {results['config']['warmup']} warm-up, "
             f"interleaved. Ratios are ours / contestant (below 1: ours is smaller).", ""]
    loads = [x for x in (m.get("load_average_start"), m.get("load_average_end")) if x]
    if loads:
        lines += [f"1-minute load average {' -> '.join(str(l[0]) for l in loads)} on "
                  f"{m['cores']} cores (this job's own {m['world_size']} ranks count for up to "
                  f"{m['world_size']}; more means other work shared the machine).", ""]
    if results["config"].get("ours_compile", "model") == "blocks":
        lines += ["**ours compiled each decoder layer on its own** (`--ours-compile blocks`: "
                  "`Module.compile(backend=\"dist\")` on every FSDP unit; embedding, final norm, "
                  "head and loss eager on DTensors, torchtitan's way).", ""]
    if results["config"].get("skip_schedule_check"):
        lines += ["**ours ran with dynamo_dist's rank-divergence check turned off** "
                  "(`--skip-schedule-check`; before 94d2e33 the check rejected every dp x tp "
                  "program, see benchmarks/README.md).", ""]

    lines += ["### Step time (ms; forward + backward + optimizer step)", "",
              "| contestant | status | median | IQR (q1-q3) | min | max | median of max over ranks "
              "| ours / it |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, e in cs.items():
        s, mx = e["step_time_s"], e.get("step_time_max_over_ranks_s", {})
        lines.append(f"| {name} | {_status(e)} | {_ms(s.get('median'))} | {_ms(s.get('iqr'))} "
                     f"({_ms(s.get('q1'))}-{_ms(s.get('q3'))}) | {_ms(s.get('min'))} | "
                     f"{_ms(s.get('max'))} | {_ms(mx.get('median'))} | "
                     f"{_x(ratio(results, 'step', name)) if name != 'ours' else '-'} |")

    lines += ["", "### Compile time (s; first call minus the median step; cold: empty caches, "
              "warm: Inductor's on-disk caches)", "",
              "| contestant | first call cold | first call warm | compile cold | compile warm | "
              "FX graph cache cold / warm (hit, miss) | ours / it cold | ours / it warm |",
              "|---|---:|---:|---:|---:|---|---:|---:|"]
    for name, e in cs.items():
        fc, comp, cache = e.get("first_call_s") or {}, e.get("compile_s") or {}, e.get("cache") or {}

        def hm(ph):
            c = cache.get(ph) or {}
            return (f"{c.get('fxgraph_cache_hit', 0)}, {c.get('fxgraph_cache_miss', 0)}"
                    + (f" (+{c['fxgraph_cache_bypass']} bypass)" if c.get("fxgraph_cache_bypass") else ""))
        compiled = e.get("compiled")
        lines.append(
            f"| {name} | {_f(fc.get('cold'), '{:.2f}')} | {_f(fc.get('warm'), '{:.2f}')} | "
            f"{_f(comp.get('cold'), '{:.2f}') if compiled else 'n/a (eager)'} | "
            f"{_f(comp.get('warm'), '{:.2f}') if compiled else 'n/a (eager)'} | "
            f"{(hm('cold') + ' / ' + hm('warm')) if compiled and cache else 'n/a'} | "
            f"{_x(ratio(results, 'compile', name)) if compiled and name != 'ours' else 'n/a'} | "
            f"{_x(ratio(results, 'warm_compile', name)) if compiled and name != 'ours' else 'n/a'} |")
    st = cs.get("ours", {}).get("ours_compile_stages_s")
    if st:
        lines += ["", "ours, backend stages (s): " + "; ".join(
            f"{ph}: " + ", ".join(f"{k} {v:.2f}" for k, v in d.items()) for ph, d in st.items())]

    lines += ["", "### Collectives per step (per rank; counted at run time by a TorchDispatchMode)",
              "", "| contestant | count | bytes | by kind (count / bytes) | ours / it (bytes) |",
              "|---|---:|---:|---|---:|"]
    for name, e in cs.items():
        rt = e.get("collectives", {}).get("runtime")
        if not rt:
            lines.append(f"| {name} | n/a | n/a | n/a | n/a |")
            continue
        kinds = ", ".join(f"{k} {v['count']} / {v['bytes']:,}" for k, v in rt["by_kind"].items()) or "none"
        lines.append(f"| {name} | {rt['count']} | {rt['bytes']:,} | {kinds} | "
                     f"{_x(ratio(results, 'bytes', name)) if rt['bytes'] and name != 'ours' else '-' if name == 'ours' else 'n/a'} |")
    led = cs.get("ours", {}).get("collectives", {}).get("ledger")
    if led:
        kinds = ", ".join(f"{k} {v['count']} / {v['bytes']:,}" for k, v in led["by_kind"].items())
        phases = ", ".join(f"{k} {v['count']} / {v['bytes']:,}" for k, v in led["by_phase"].items())
        lines += ["", f"ours, compile-time ledger ({led['graphs']} graph(s)): {led['count']} "
                      f"collectives, {led['bytes']:,} bytes; {kinds}; by phase: {phases}."]
    recompiled = [n for n, e in cs.items() if e.get("collectives", {}).get("recompiled")]
    if recompiled:
        lines.append(f"\nWARNING: recompiled under the counting mode: {', '.join(recompiled)}")

    lines += ["", "### Memory (MiB per rank; the median of each rank's probe steps) and agreement "
              "with eager_1p", "",
              "| contestant | peak rank 0 | peak max over ranks | resident rank 0 | eval loss "
              "rel. diff | max step-loss rel. diff | max param rel. diff |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for name, e in cs.items():
        mem, num = e.get("memory") or {}, e.get("numerics") or {}
        r0 = (mem.get("per_rank") or [None])[0] or {}
        mib = (lambda b: _f(None if b is None else b / MIB))
        lines.append(f"| {name} | {mib(r0.get('peak_bytes'))} | {mib(mem.get('peak_bytes_max'))} "
                     f"| {mib(r0.get('resident_bytes'))} | "
                     f"{_f(num.get('eval_loss_rel_diff'), '{:.1e}')} | "
                     f"{_f(num.get('step_loss_max_rel_diff'), '{:.1e}')} | "
                     f"{_f(num.get('param_max_rel_diff'), '{:.1e}')} |")

    lines += ["", "### Targets (the spec's, for the small Llama; reported, not enforced)", "",
              "| target | ours / it | result |", "|---|---:|---|"]
    for t in targets(results):
        lines.append(f"| {t['target']} | {_x(t['ratio'])} | {t['result']} |")
    failed = [f"{n}: {e['status']}" for n, e in cs.items() if not _ok(e)]
    if failed:
        lines += ["", "Failed contestants: " + "; ".join(failed)]
    return "\n".join(lines) + "\n"
