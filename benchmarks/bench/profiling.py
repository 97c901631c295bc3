"""``--profile CONTESTANT``: torch.profiler over a few training steps of one contestant.

Every rank runs the steps (SPMD contestants need all ranks for their collectives); rank 0 alone
records. Written under ``out_dir``:
  <workload>-<contestant>.txt          top ops by self CPU time (``key_averages``; times in ms)
  <workload>-<contestant>.trace.json.gz  the chrome trace (open in Perfetto / chrome://tracing)
"""

from __future__ import annotations

import gzip
import os
import shutil
import tempfile



def profile_steps(contestant, batches: list, record: bool, out_dir: str, rows: int = 40) -> dict | None:
    """Run ``contestant.step`` on each batch; on the recording rank return the written paths."""
    if not record:
        for b in batches:
            contestant.step(b)
        return None
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if contestant.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, record_shapes=False) as prof:
        for b in batches:
            contestant.step(b)
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"{contestant.workload.name}-{contestant.name}")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows,
                                      max_name_column_width=70)
    with open(base + ".txt", "w") as f:
        f.write(f"# {contestant.workload.name} / {contestant.name}: {len(batches)} training "
                f"steps on rank 0, top {rows} ops by self CPU time\n\n{table}\n")
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(base + ".trace.json.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    top = [{"op": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3 / len(batches),
            "calls_per_step": e.count / len(batches)}
           for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]]
    return {"table": base + ".txt", "trace": base + ".trace.json.gz", "steps": len(batches),
            "top_ops_per_step": top}
