"""The import direction between the packages (issue 16), read from the sources' ASTs: the bottom
layer (``inductor_passes/core``) imports only the standard library and torch; the graph passes
import the front end (``dynamo_dist``) only where they still did when this test was written --
a new such import fails here, and each one moved to the bottom comes off the list."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# (module under inductor_passes, dynamo_dist module it imports): to be emptied (issue 16)
STILL_IMPORTED = {
    ("comm.py", "dynamo_dist._compat"),
    ("compile.py", "dynamo_dist._compat"),
    ("lowering.py", "dynamo_dist._compat"),
    ("lowering.py", "dynamo_dist.annotations"),
    ("sharding/placements.py", "dynamo_dist._compat"),
    ("sharding/solver.py", "dynamo_dist.annotations"),
    ("sharding/rules/__init__.py", "dynamo_dist._compat"),
    ("sharding/rules/dtensor.py", "dynamo_dist._compat"),
    ("sharding/rules/manual.py", "dynamo_dist.annotations"),
    ("sharding/rules/manual.py", "dynamo_dist.manual"),
}


def _imports(path: pathlib.Path) -> set[str]:
    """Absolute names of the project modules ``path`` imports (relative imports resolved)."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else ()
            module = ".".join([*base, *(node.module or "").split(".")]).strip(".")
            out.add(module)
            out.update(f"{module}.{a.name}" for a in node.names)
    return out


def _ours(names: set[str], top: str) -> set[str]:
    return {n for n in names if n == top or n.startswith(top + ".")}


def test_the_bottom_layer_imports_only_torch():
    core = ROOT / "inductor_passes" / "core"
    files = sorted(core.glob("*.py"))
    assert {f.name for f in files} >= {"errors.py", "ledger.py", "ops.py"}
    for f in files:
        names = _imports(f)
        assert not _ours(names, "dynamo_dist"), f
        assert not {n for n in _ours(names, "inductor_passes")
                    if not n.startswith("inductor_passes.core")}, f


def test_graph_passes_import_the_front_end_only_where_they_still_did():
    found = set()
    for f in sorted((ROOT / "inductor_passes").rglob("*.py")):
        rel = f.relative_to(ROOT / "inductor_passes").as_posix()
        for name in _ours(_imports(f), "dynamo_dist"):
            module = name if name.count(".") == 1 or name == "dynamo_dist" else \
                ".".join(name.split(".")[:2])
            found.add((rel, module))
    # "from dynamo_dist import _compat" reads as the package and the module: keep the module
    found = {(r, m) for r, m in found if m != "dynamo_dist"}
    assert found <= STILL_IMPORTED, sorted(found - STILL_IMPORTED)
    assert STILL_IMPORTED <= found, f"moved, take off the list: {sorted(STILL_IMPORTED - found)}"
