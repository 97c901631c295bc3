"""dynamo_dist.explain and `python -m dynamo_dist explain`: graphs (ops, input placements, ledger),
graph breaks at the user's file:line with distributed hints, recompilations with the failed
guard. Single process on a `fake` process group (plans and ledgers right, values not)."""

import importlib.util
import json
import os
import subprocess
import sys

import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import dynamo_dist
from dynamo_dist.diagnose import ExplainReport, recording
from dynamo_dist.plans import ShardingPlan, shard_module
from test_errors import Tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "data", "explain_breaks.py")
FX = {"inductor": False}


def _marker_lines(path: str) -> dict[str, int]:
    """'# BREAK: print' -> its line number (1-based), for every marker comment in ``path``."""
    found = {}
    with open(path) as f:
        for no, text in enumerate(f, 1):
            if "# BREAK: " in text:
                found[text.split("# BREAK: ")[1].strip()] = no
            elif "# RANK-BRANCH" in text:
                found["rank"] = no
    return found


def _load_script():
    spec = importlib.util.spec_from_file_location("explain_breaks", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


HINTS = {"print": "reorderable_logging_functions", "item": "capture_scalar_outputs",
         "distribute": "shard_module"}


def test_explain_names_planted_breaks(fake_mesh):
    mesh = fake_mesh((2,), ("tp",))
    model, inputs = _load_script().build(mesh)
    report = dynamo_dist.explain(model, *inputs, backend_options=FX)  # the module is callable
    assert isinstance(report, ExplainReport) and report.error is None, report.to_text()
    lines = _marker_lines(SCRIPT)
    assert report.break_count == 3, report.to_text()
    for kind, hint in HINTS.items():
        hits = [b for b in report.breaks if b.line == lines[kind]]
        assert len(hits) == 1, (kind, report.to_text())
        assert os.path.samefile(hits[0].file, SCRIPT) and hint in hits[0].hint, hits[0]
        assert f"explain_breaks.py:{lines[kind]}" in report.to_text()
    assert [s.line for s in report.specializations] == [lines["rank"]]
    assert "get_rank" in report.specializations[0].code
    dist_graphs = [g for g in report.graphs if g.compiled_as.startswith("dist")]
    assert len(dist_graphs) >= 2 and report.graph_count >= 3
    assert tuple(report.output.shape) == (4, 8)
    json.dumps(report.to_dict(), default=str)  # JSON-able


def test_cli_on_planted_script(tmp_path):
    out = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "dynamo_dist", "explain", "--json", str(out),
                           SCRIPT], capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = _marker_lines(SCRIPT)
    for kind in HINTS:
        assert f"explain_breaks.py:{lines[kind]}" in proc.stdout, proc.stdout
    assert "output DTensor (4, 8)" in proc.stdout  # the script itself ran to the end
    data = json.loads(out.read_text())
    assert sorted(b["line"] for b in data["breaks"]) == sorted(lines[k] for k in HINTS)


def test_recompile_on_changed_placements(fake_mesh):
    mesh = fake_mesh((2,), ("tp",))

    def f(a):
        return (a * 2).relu()

    with recording(FX) as rec:  # torch.compile(backend="dist") inside is recorded
        cf = torch.compile(f, backend="dist")
        cf(distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]))
        cf(distribute_tensor(torch.randn(4, 4), mesh, [Replicate()]))
    report = rec.report()
    assert len(report.recompiles) == 1, report.to_text()
    r = report.recompiles[0]
    assert r.function == "f" and "dtensor_spec" in r.reason and "placements" in r.hint
    assert [g.inputs[0].placements for g in report.graphs] == ["[S(0)]", "[R]"]
    assert "Recompilations" in report.to_text()


def test_recompile_hints_name_the_fix_for_a_layer_cache_and_a_local_tensor():
    """Guard failures seen when blocks are compiled one by one (Dynamo's own texts): a
    transformers cache passed to every layer, and a DTensor input made two ways."""
    from dynamo_dist.diagnose import recompile_hint

    cache = ("args[1].layers[0].is_initialized == False  # if not self.is_initialized:  "
             "# transformers/cache_utils.py:133 in update")
    assert "use_cache=False" in recompile_hint(cache)
    local = "tensor 'args[0]._local_tensor' requires_grad mismatch. expected requires_grad=0"
    assert "from_local" in recompile_hint(local)
    assert recompile_hint("___check_type_id(L['x'], 94)") is None


def test_graph_input_placements_and_ledger(fake_mesh):
    mesh = fake_mesh((2,), ("tp",))
    m = shard_module(Tiny(), mesh, ShardingPlan(plan={"fc.weight": {"tp": Shard(0)},
                                                      "fc.bias": {"tp": Shard(0)}}))
    report = dynamo_dist.explain(m, torch.randn(2, 4), backend_options=FX)
    assert report.graph_count == 1 and report.break_count == 0 and not report.recompiles
    g = report.graphs[0]
    assert g.compiled_as == "dist, mesh tp=2" and g.ops >= 2
    by_name = {i.name: i for i in g.inputs}
    assert by_name["self.fc.weight"].placements == "[S(0)]"
    assert by_name["self.fc.weight"].shape == (8, 4) and by_name["x"].placements == "-"
    assert g.ledger and all(e["mesh_axis"] == "tp" and e["bytes"] > 0 for e in g.ledger)
    assert sum(n for n, _ in g.collectives.values()) == len(g.ledger)
    text = report.to_text()
    assert "Graph 1: collective ledger" in text and "self.fc.weight" in text


def test_plain_tensors_hook_and_data_dependent_hints():
    """No DTensor anywhere: the dist backend compiles as one device; hints still apply."""
    lin = torch.nn.Linear(4, 4)
    lin.register_full_backward_hook(lambda mod, gin, gout: None)

    def f(x):
        y = lin(x)  # HOOK
        if y.sum() > 0:  # DATA
            y = y * 2
        return y.relu()

    here = f.__code__.co_firstlineno
    report = dynamo_dist.explain(f, torch.randn(2, 4), backend_options=FX)
    assert report.error is None and report.graph_count >= 1, report.to_text()
    assert all(g.compiled_as.startswith("one device") for g in report.graphs)
    hints = {b.line - here: b.hint for b in report.breaks}
    assert "compiled_autograd" in hints[1], report.to_text()
    assert "torch.where" in hints[2], report.to_text()


def test_a_break_inside_a_checkpointed_call_says_the_call_runs_outside_the_graph():
    """A break in code under ``torch.utils.checkpoint`` runs the whole checkpointed call
    outside the graph (for ``dist``: eager DTensor code); the hint says so before the break's
    own fix, and a break outside any checkpoint does not get it."""
    lin = torch.nn.Linear(4, 4)

    def layer(x):
        y = lin(x)
        print("in the layer")  # BREAK
        return y.relu()

    def f(x):
        y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        print("outside")  # OUTSIDE
        return y.sum()

    report = dynamo_dist.explain(f, torch.randn(2, 4), backend_options=FX)
    assert report.error is None, report.to_text()
    hints = {(b.line, b.code): b.hint for b in report.breaks}
    inside = hints[(layer.__code__.co_firstlineno + 2, 'print("in the layer")  # BREAK')]
    assert "activation-checkpointed call" in inside and "log outside" in inside, inside
    outside = hints[(f.__code__.co_firstlineno + 2, 'print("outside")  # OUTSIDE')]
    assert "checkpoint" not in outside and "log outside" in outside, outside


def test_error_is_reported_at_the_user_line():
    def f(x):
        return x @ torch.ones(3, 3)  # shapes do not match

    report = dynamo_dist.explain(f, torch.randn(2, 4), backend_options=FX)
    assert report.error is not None and report.output is None
    assert report.error.line == f.__code__.co_firstlineno + 1
    assert os.path.samefile(report.error.file, __file__)
    assert "error" in report.to_text()


def test_explain_traces_as_the_dist_backend_does(fake_mesh, monkeypatch):
    """Under explain, Dynamo traces for the recording backend exactly as for ``dist``: DTensor's
    tracing fallback is on (SDPA on heads-split DTensors never enters DTensor's search through
    the op's decomposition, which took ~50 s per SDPA and made explain on an HF Llama print
    nothing for 900 s) and sizes are specialised (a second shape compiles statically)."""
    from torch.distributed.tensor._decompositions import DecompShardingStrategy

    def refuse(*args, **kwargs):
        raise AssertionError("DTensor's decomposition search ran while tracing for dist")

    monkeypatch.setattr(DecompShardingStrategy, "propagate_strategy", refuse)
    mesh = fake_mesh((2,), ("tp",))

    def attend(q):
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum()

    for seq in (8, 12):
        q = distribute_tensor(torch.randn(2, 4, seq, 16), mesh, [Shard(1)])
        report = dynamo_dist.explain(attend, q, backend_options=FX)
        assert report.error is None and len(report.graphs) == 1, report
        assert not report.recompiles, report.recompiles
