"""Where ours' cold compile time goes: cProfile of one compile of a benchmark workload's model.

    python -m benchmarks.compile_profile [--workload llama_dp_tp] [--top 40]

One process on torch's ``fake`` process group (the workload's mesh; collectives are compiled, not
run), the model sharded as the ``ours`` contestant shards it, one forward + backward compiled with
``backend="dist"`` and Inductor, in a fresh Inductor cache directory (cold; the plan cache is
off; the process's one-time costs paid first, as ``benchmarks.run`` does). Writes
``results/profiles/<workload>-ours-compile.txt``: the backend's stage seconds, then
the top functions of dynamo_dist, inductor_passes and Inductor by cumulative time (profiled, so
about 1.5x slower than unprofiled).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import os
import pstats
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="llama_dp_tp")
    ap.add_argument("--top", type=int, default=70)
    args = ap.parse_args(argv)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="compile-profile-")
    os.environ["DYNAMO_DIST_PLAN_CACHE"] = "0"
    sys.path.insert(0, ROOT)

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import dynamo_dist
    from benchmarks.bench.contestants import _shard_ours
    from benchmarks.run import load_workload

    w = load_workload(args.workload)
    dist.init_process_group("fake", store=FakeStore(), rank=0,
                            world_size=math.prod(w.mesh.values()))
    mesh = init_device_mesh("cpu", tuple(w.mesh.values()), mesh_dim_names=tuple(w.mesh))
    torch.manual_seed(0)
    model = w.build_model()
    _shard_ours(model, w, mesh)
    # the process's one-time costs first, as the benchmark runner pays them (Inductor's
    # vector-ISA checks compile test programs: 7.7 of 53 s of a profile without this)
    from benchmarks.bench.runner import warm_process

    warm_process(torch.device("cpu"), os.environ["TORCHINDUCTOR_CACHE_DIR"])
    fn = torch.compile(model, backend="dist")
    batch = w.batch(0)
    prof = cProfile.Profile()
    prof.enable()
    w.loss(fn(*batch.args, **batch.kwargs)).backward()
    prof.disable()
    stages = dynamo_dist.compile_records()[-1].seconds
    text = io.StringIO()
    # our packages and Inductor's: Dynamo's and torch.compile's wrapper frames say nothing
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(
        r"_inductor|inductor_passes|dynamo_dist", args.top)
    out = os.path.join(ROOT, "benchmarks", "results", "profiles",
                       f"{args.workload}-ours-compile.txt")
    with open(out, "w") as f:
        f.write(f"# {args.workload} / ours: one cold compile, one process, fake process group, "
                f"under cProfile\n# backend stages (s, profiled): "
                + ", ".join(f"{k} {v:.1f}" for k, v in stages.items()) + "\n\n")
        f.write(text.getvalue())
    print(f"wrote {out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
