"""Run the OpInfo conformance sweep and write its report.

    python -m dynamo_dist.testing.conformance                  # full sweep -> docs/op_coverage.md + JSON
    python -m dynamo_dist.testing.conformance --fast           # the CI subset (a few minutes)
    python -m dynamo_dist.testing.conformance --ops add mm     # chosen ops

Simulated ranks: a ``fake`` process group for compiling, lock-step execution for values (see
simulate.py); meshes: 1-D of 4 and 2 x 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from .harness import Case, cases_for, inplace_cases_for, run_case
from .report import write_report

FAST_OPS = ("add", "mul", "div", "sum", "mean", "amax", "mm", "matmul", "nn.functional.linear",
            "softmax", "log_softmax", "nn.functional.gelu", "nn.functional.layer_norm",
            "transpose", "reshape", "view", "permute", "cat", "where", "exp", "nn.functional.embedding",
            "index_select", "cumsum", "var", "t", "unsqueeze", "expand", "sigmoid", "tanh")


def make_mesh(shape, names):
    import math

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(shape))
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--fast", action="store_true", help="the CI subset of ops")
    ap.add_argument("--ops", nargs="*", help="OpInfo names to run (default: all)")
    ap.add_argument("--samples", type=int, default=2, help="samples per op (default 2)")
    ap.add_argument("--cases", type=int, default=8, help="placement sets per sample (default 8)")
    ap.add_argument("--inplace-cases", type=int, default=4,
                    help="placement sets of the in-place variant (1 sample; 0: none; default 4)")
    ap.add_argument("--meshes", default="4,2x2", help="comma-separated mesh shapes")
    ap.add_argument("--no-dtensor", action="store_true", help="skip the DTensor eager peer")
    ap.add_argument("--jobs", type=int, default=2, help="meshes run in parallel processes")
    ap.add_argument("--out", default="docs/op_coverage.md")
    ap.add_argument("--json", default="docs/op_coverage.json")
    args = ap.parse_args(argv)

    import torch
    from torch.testing._internal.common_methods_invocations import op_db


    logging.getLogger("dynamo_dist").setLevel(logging.ERROR)
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    torch._dynamo.config.cache_size_limit = 1024
    wanted = set(FAST_OPS) if args.fast else set(args.ops or ())
    ops = [o for o in op_db if torch.float32 in o.supported_dtypes("cpu")
           and (not wanted or o.name in wanted)]
    if args.jobs > 1 and "," in args.meshes:
        results = _run_meshes_in_parallel(args, argv)
    else:
        results = _run(args, ops)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump([r.to_json() for r in results], f, indent=0)
    summary = write_report(results, args.out, " ".join(sys.argv[1:]) or "(full sweep)")
    print(summary)
    return 0


def _run_meshes_in_parallel(args, argv):
    """One process per mesh (each its own fake process group), results merged."""
    import subprocess
    import tempfile


    argv = list(argv if argv is not None else sys.argv[1:])
    procs, paths = [], []
    tmp = tempfile.mkdtemp(prefix="op_coverage_")
    for mesh_text in args.meshes.split(","):
        path = os.path.join(tmp, f"{mesh_text}.json")
        cmd = [sys.executable, "-m", "dynamo_dist.testing.conformance", *argv, "--jobs", "1",
               "--meshes", mesh_text, "--json", path, "--out", path + ".md"]
        procs.append(subprocess.Popen(cmd))
        paths.append(path)
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("a mesh's sweep failed (see its output above)")
    results = []
    for path in paths:
        with open(path) as f:
            results += [Case.from_json(d) for d in json.load(f)]
    return results


def _run(args, ops):
    results = []
    t0 = time.time()
    for mesh_text in args.meshes.split(","):
        shape = tuple(int(x) for x in mesh_text.split("x"))
        names = ("x",) if len(shape) == 1 else ("x", "y")
        mesh = make_mesh(shape, names)
        for k, opinfo in enumerate(ops):
            try:
                cases = list(cases_for(opinfo, mesh, args.samples, args.cases))
                if args.inplace_cases:
                    cases += list(inplace_cases_for(opinfo, mesh, 1, args.inplace_cases))
            except Exception as exc:  # noqa: BLE001  (sample generation failed: reported)
                print(f"[{mesh_text}] {opinfo.name}: no samples ({type(exc).__name__})",
                      file=sys.stderr)
                continue
            for case, op_fn, tensors in cases:
                results.append(run_case(case, op_fn, tensors, mesh, not args.no_dtensor))
            done = [r for r in results[-len(cases):]] if cases else []
            print(f"[{mesh_text} {k + 1}/{len(ops)} {time.time() - t0:6.0f}s] {opinfo.name}: "
                  + " ".join(sorted({r.ours for r in done})), file=sys.stderr, flush=True)
    return results


if __name__ == "__main__":
    sys.exit(main())
