"""The import graph keeps DESIGN.md's direction: no import from a lower layer to a higher one,
no import cycle between modules.

Every module under ``staronnx/`` is parsed with ``ast`` (no import runs), and every import
counts: module level, inside functions, under ``if TYPE_CHECKING:``. A lazy import inside a
function hides a dependency from the reader; it does not remove it.

Layers, lowest first (a module may import its own layer and those below):

0. leaf utilities that know nothing of plans: errors, fsutil, modelio, ortutil, feeds, zoo,
   signals, durations, process_settings
1. plan and what reads or builds one: plan, inputs, verify
2. workers, perfmodels, and partition (``staronnx.partition()`` cuts for this host: its CPU
   groups as the runtime lays them out, its calibrated bus)
3. runtime, engines
4. bench, serving, and compat (ONNX Runtime's InferenceSession over the runtime)
5. serve, ray, infer (batch inference: a job over a runtime; Ray Data's predictor runs it)
6. the doors: cli, __main__, demo, and the package's ``__init__`` (the public API)

A new top-level module must be given a layer here (the test fails until it is). Some pairs
are kept apart though the layers would allow them (:data:`APART`): the network front end never
imports the benchmarks (the in-flight window it sizes lives in ``serving``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "staronnx"

LAYERS: dict[str, int] = {
    "errors": 0, "contract": 0, "fsutil": 0, "modelio": 0, "ortutil": 0, "feeds": 0, "zoo": 0, "signals": 0, "durations": 0,
    "process_settings": 0,
    "plan": 1, "inputs": 1, "verify": 1,
    "workers": 2, "perfmodels": 2, "partition": 2,
    "runtime": 3, "engines": 3,
    "bench": 4, "serving": 4, "calibrate": 4, "compat": 4,
    "serve": 5, "ray": 5, "infer": 5,
    "cli": 6, "__main__": 6, "demo": 6, "": 6,
}

#: top-level packages that never import each other's modules, whatever their layers
APART: dict[str, frozenset[str]] = {"serve": frozenset({"bench"})}


@dataclass(frozen=True)
class Import:
    """One import statement's edge: ``importer`` imports ``imported`` at ``path:line``."""

    importer: str
    imported: str
    path: str
    line: int

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def module_name(path: Path, root: Path) -> str:
    """``staronnx/bench/sweep.py`` -> ``staronnx.bench.sweep``; a package's ``__init__`` is the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(name: str, modules: set[str]) -> str | None:
    """The longest prefix of ``name`` that is one of our modules (``staronnx.x.Class`` ->
    ``staronnx.x``), or None for a third-party name."""
    bits = name.split(".")
    for n in range(len(bits), 0, -1):
        candidate = ".".join(bits[:n])
        if candidate in modules:
            return candidate
    return None


def imports_of(path: Path, root: Path, modules: set[str]) -> list[Import]:
    """Every edge from the module at ``path`` to another of ``modules``, wherever the import sits."""
    me = module_name(path, root)
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = str(path.relative_to(root))
    edges: list[Import] = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = me.split(".") if is_package else me.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            # ``from a import b``: b is a module of a, or a name defined in a
            targets = [f"{source}.{alias.name}" for alias in node.names]
        for target in targets:
            found = resolve(target, modules)
            if found is not None and found != me:
                edges.append(Import(me, found, rel, node.lineno))
    return edges


def package_graph(root: Path = ROOT, package: str = PACKAGE) -> list[Import]:
    """Every import edge between the modules of ``package``."""
    paths = sorted((root / package).rglob("*.py"))
    modules = {module_name(p, root) for p in paths}
    return [edge for p in paths for edge in imports_of(p, root, modules)]


def top_of(module: str) -> str:
    """``staronnx.serve.models`` -> ``serve``; the package itself -> ``""``."""
    return module.split(".")[1] if "." in module else ""


def layer_of(module: str, layers: Mapping[str, int]) -> int:
    """The layer of ``staronnx.<top>...``: that of its first component under the package."""
    top = top_of(module)
    if top not in layers:
        raise AssertionError(f"{module} has no layer: add {top!r} to LAYERS in {Path(__file__).name}")
    return layers[top]


def upward(edges: Iterable[Import], layers: Mapping[str, int]) -> list[Import]:
    """The imports from a lower layer to a higher one."""
    return [e for e in edges if layer_of(e.importer, layers) < layer_of(e.imported, layers)]


def cycles(edges: Iterable[Import]) -> list[list[Import]]:
    """One import cycle per strongly connected component of more than one module (Tarjan),
    as the chain of imports that closes it."""
    graph: dict[str, dict[str, Import]] = {}
    for e in edges:
        graph.setdefault(e.importer, {}).setdefault(e.imported, e)
        graph.setdefault(e.imported, {})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the module count (a few hundred)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, set(comp)) for comp in components]


def _cycle_in(graph: Mapping[str, Mapping[str, Import]], comp: set[str]) -> list[Import]:
    """A shortest cycle through the component's first module (breadth-first back to it)."""
    start = min(comp)
    came: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w, edge in sorted(graph[v].items()):
                if w not in comp:
                    continue
                if w == start:
                    chain = [edge]
                    while chain[0].importer != start:
                        chain.insert(0, came[chain[0].importer])
                    return chain
                if w not in came:
                    came[w] = edge
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # pragma: no cover - a component has one


def describe_cycle(chain: list[Import]) -> str:
    names = " -> ".join([chain[0].importer, *(e.imported for e in chain)])
    lines = "; ".join(f"{e.where()} imports {e.imported}" for e in chain)
    return f"import cycle {names} ({lines})"


def kept_apart(edges: Iterable[Import], apart: Mapping[str, frozenset[str]]) -> list[Import]:
    """The imports between packages that :data:`APART` keeps apart."""
    return [e for e in edges if top_of(e.imported) in apart.get(top_of(e.importer), frozenset())]


def problems(edges: list[Import], layers: Mapping[str, int],
             apart: Mapping[str, frozenset[str]] = APART) -> list[str]:
    """What the test reports: every upward import, every import between packages kept apart,
    and every cycle."""
    found = [f"{e.where()}: {e.importer} (layer {layer_of(e.importer, layers)}) imports "
             f"{e.imported} (layer {layer_of(e.imported, layers)}), a higher layer" for e in upward(edges, layers)]
    found += [f"{e.where()}: {e.importer} imports {e.imported}: {top_of(e.importer)} never imports "
              f"{top_of(e.imported)}" for e in kept_apart(edges, apart)]
    return found + [describe_cycle(chain) for chain in cycles(edges)]


# ---------------------------------------------------------------------------------------------
def test_no_upward_import_and_no_cycle():
    edges = package_graph()
    assert len({e.importer for e in edges}) > 50  # the walk saw the package
    found = problems(edges, LAYERS)
    assert not found, "\n" + "\n".join(found)


def test_every_top_level_module_has_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in (ROOT / PACKAGE).iterdir()
            if (p.suffix == ".py" or (p / "__init__.py").is_file())}
    tops = {"" if t == "__init__" else t for t in tops}
    assert not tops - set(LAYERS), f"give these a layer in LAYERS: {sorted(tops - set(LAYERS))}"


def _write(root: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_check_catches_upward_imports_and_cycles(tmp_path):
    # a synthetic package: low imports high inside a function (still an upward import), high
    # imports low at module level (fine), and a <-> b import each other through a relative import
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low.py": "def f():\n    from pkg.high import thing\n    return thing\n",
        "pkg/high/__init__.py": "import pkg.low\nthing = 1\n",
        "pkg/high/a.py": "from . import b\n",
        "pkg/high/b.py": "from pkg.high.a import x\n",
    })
    layers = {"low": 0, "high": 1, "": 2}
    edges = package_graph(tmp_path, "pkg")
    assert {(e.importer, e.imported) for e in edges} == {
        ("pkg.low", "pkg.high"), ("pkg.high", "pkg.low"), ("pkg.high.a", "pkg.high.b"), ("pkg.high.b", "pkg.high.a")}
    found = problems(edges, layers, {})
    assert len(found) == 3, found
    # a downward import between packages kept apart is named too
    (apart,) = set(problems(edges, layers, {"high": frozenset({"low"})})) - set(found)
    assert apart == "pkg/high/__init__.py:1: pkg.high imports pkg.low: high never imports low", apart
    assert any("pkg/low.py:2: pkg.low (layer 0) imports pkg.high (layer 1)" in f for f in found)
    assert any(f.startswith("import cycle pkg.high -> pkg.low -> pkg.high") for f in found)
    assert any("import cycle pkg.high.a -> pkg.high.b -> pkg.high.a" in f and "pkg/high/b.py:1" in f for f in found)
    with pytest.raises(AssertionError, match="no layer"):
        problems(edges, {"low": 0})


def test_every_name_a_module_exports_exists():
    """``from staronnx.x import *`` works: each name of a module's ``__all__`` is defined there
    (workers/cudart listed a ``Runtime`` it does not have, so the star import raised)."""
    import importlib

    broken = []
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        if "proto" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        exported = [node for node in tree.body if isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)]
        if not exported:
            continue
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        try:
            module = importlib.import_module(name)
        except ImportError:  # an optional extra absent here (ray, grpc): not this test's business
            continue
        broken += [f"{name}.{n}" for n in module.__all__ if not hasattr(module, n)]
    assert broken == []
