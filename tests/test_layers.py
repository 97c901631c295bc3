"""The import structure (issue 16), read from the sources' ASTs, function-local imports included:
the bottom layer (``inductor_passes/core``) imports only the standard library, torch and itself;
the graph passes never import the front end (``dynamo_dist``); no two project modules import
each other, directly or around a circle."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("dynamo_dist", "inductor_passes")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(f): f for top in PACKAGES for f in (ROOT / top).rglob("*.py")}


def _imports(path: pathlib.Path) -> set[str]:
    """Absolute names ``path`` imports anywhere in it (relative imports resolved), each also
    with the imported attribute appended (``from a import b`` gives ``a`` and ``a.b``)."""
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


def _project_modules(names: set[str], me: str) -> set[str]:
    """The project modules among ``names`` (an attribute import maps to its module), with the
    packages each one's import runs first (``a.b.c`` runs ``a/b/__init__``), except those that
    contain ``me`` (already being imported when ``me`` runs)."""
    found = set()
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        while name:
            if name != me and not me.startswith(name + "."):
                found.add(name)
            name = name.rpartition(".")[0]
    return found


GRAPH = {m: _project_modules(_imports(f), m) for m, f in MODULES.items()}


def test_the_bottom_layer_imports_only_torch_and_itself():
    core = {m for m in MODULES if m.startswith("inductor_passes.core")}
    assert {"inductor_passes.core.compat", "inductor_passes.core.placements",
            "inductor_passes.core.annotation_ops", "inductor_passes.core.roles"} <= core
    for m in sorted(core):
        assert GRAPH[m] <= core | {"inductor_passes"}, (m, sorted(GRAPH[m] - core))


def test_graph_passes_never_import_the_front_end():
    found = sorted((m, d) for m, deps in GRAPH.items() if m.startswith("inductor_passes")
                   for d in deps if d.split(".")[0] == "dynamo_dist")
    assert not found, found


def test_the_product_never_imports_its_testing_tools():
    """The zoo, the conformance sweep and the demo (``dynamo_dist/testing``) sit on the product."""
    found = sorted((m, d) for m, deps in GRAPH.items() if not m.startswith("dynamo_dist.testing")
                   for d in deps if d.startswith("dynamo_dist.testing"))
    assert not found, found


def test_no_import_circle():
    """Tarjan's strongly connected components over every project import: each must be one
    module (a package's ``__init__`` importing its own submodules is not a circle)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not circles, circles


def test_the_layering_test_sees_an_import():
    """The reader itself: a known import is found (a broken parser would pass everything)."""
    assert "inductor_passes.core.compat" in GRAPH["inductor_passes.core.placements"]
    assert "inductor_passes.core.annotation_ops" in GRAPH["dynamo_dist.annotations"]
    # importing a module of a package runs the package's __init__ first
    assert "dynamo_dist.plans" in GRAPH["dynamo_dist.spmd"]
    assert "dynamo_dist.plans" not in GRAPH["dynamo_dist.plans.apply"]
