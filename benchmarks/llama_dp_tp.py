"""Workload ``llama_dp_tp``: the ``llama_tp`` Llama on a dp=2 x tp=2 mesh (4 ranks).

DTensor contestants: torch's tp plan on the ``tp`` axis, then FSDP2 (``fully_shard``: each decoder
layer, then the root) on the ``dp`` axis; each dp rank feeds its half of the global batch. Ours:
TensorParallelPlanner + DataParallelPlanner (parameters sharded over dp, ZeRO-3 style), fed the
global batch.

    python -m benchmarks.llama_dp_tp [options of benchmarks.run]
"""

from __future__ import annotations

import dataclasses
import sys

from benchmarks.llama_tp import SIZE, WORKLOAD as TP

WORKLOAD = dataclasses.replace(
    TP, name="llama_dp_tp", mesh={"dp": 2, "tp": 2},
    description=f"Llama {SIZE} (sdpa), causal-LM loss, AdamW; dp=2 x tp=2 (FSDP2 on dp)")

if __name__ == "__main__":
    from benchmarks import run

    sys.exit(run.main(["--workloads", WORKLOAD.name, *sys.argv[1:]]))
