"""The layers of `chunkwise/` point one way: the ```layers block of docs/ARCHITECTURE.md (bottom to top) against
the import graph built from the source with `ast`.

Every `import` and `from ... import` counts, at module level or inside a function (a lazy import still runs
one layer's code from another), relative ones too. A package's `__init__.py` counts only when a name is taken
from the package itself; running it on the way to a submodule is Python's, not the importer's, doing.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"


def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `package_dir` (a package's own name for its __init__.py)."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that `name` (at `path`) imports anywhere in its source."""
    def known(dotted: str) -> str | None:   # the module itself, or the package it names an attribute of
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(known(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in modules else known(source))
    found.discard(None)
    found.discard(name)
    return found


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    modules = module_files(package_dir)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def read_layers(text: str) -> list[tuple[str, list[str]]]:
    """The ```layers block: (layer name, its entries), bottom layer first."""
    blocks = re.findall(r"^```layers\n(.*?)^```", text, re.S | re.M)
    assert len(blocks) == 1, f"docs/ARCHITECTURE.md must hold exactly one ```layers block, found {len(blocks)}"
    layers: list[tuple[str, list[str]]] = []
    for line in blocks[0].splitlines():
        if not line.strip():
            continue
        if line[0].isspace():
            assert layers, f"a continuation line before any layer: {line!r}"
            layers[-1][1].extend(line.split())
        else:
            layer, sep, entries = line.partition(":")
            assert sep and layer.strip(), f"a layer line is 'name: entries', got {line!r}"
            layers.append((layer.strip(), entries.split()))
    return layers


def place(modules, layers: list[tuple[str, list[str]]]) -> tuple[dict[str, int], list[str]]:
    """Each module's layer index, and the problems: modules placed twice or nowhere, entries naming nothing."""
    where: dict[str, int] = {}
    problems = []
    for index, (layer, entries) in enumerate(layers):
        for entry in entries:
            dotted = entry.removesuffix("/").removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            if entry.endswith("/"):
                matched = [m for m in modules if m == dotted or m.startswith(dotted + ".")]
            else:
                matched = [m for m in modules if m == dotted]
            if not matched:
                problems.append(f"layer {layer!r}: {entry} names no module")
            for module in matched:
                if module in where:
                    problems.append(f"{module} is placed in layer {layers[where[module]][0]!r} and {layer!r}")
                where[module] = index
    problems += [f"{module} is in no layer" for module in sorted(set(modules) - set(where))]
    return where, problems


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (a -> ... -> a) of `graph`, or None."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (circle := visit(nxt)):
                return circle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (circle := visit(node)):
            return circle
    return None


def upward_imports(graph: dict[str, set[str]], where: dict[str, int], layers) -> list[str]:
    return [f"{a} (layer {layers[where[a]][0]!r}) imports {b} (layer {layers[where[b]][0]!r}, above it)"
            for a in sorted(graph) for b in sorted(graph[a])
            if a in where and b in where and where[b] > where[a]]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(ROOT / "chunkwise")


@pytest.fixture(scope="module")
def layers() -> list[tuple[str, list[str]]]:
    return read_layers(ARCHITECTURE.read_text())


def test_every_module_of_chunkwise_is_in_exactly_one_layer_and_every_entry_names_one(graph, layers):
    _, problems = place(graph, layers)
    assert not problems, "\n".join(problems)


def test_no_import_runs_from_a_lower_layer_up_to_a_higher_one(graph, layers):
    where, _ = place(graph, layers)
    upward = upward_imports(graph, where, layers)
    assert not upward, "\n".join(upward)


def test_the_import_graph_of_chunkwise_has_no_circle(graph):
    circle = find_circle(graph)
    assert circle is None, " -> ".join(circle)


# ---- the checker itself, on a made-up package ------------------------------------------------------------------

def write_package(root: Path, files: dict[str, str]) -> Path:
    for relative, source in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root / "pkg"


def test_the_graph_sees_lazy_relative_and_package_imports(tmp_path):
    package = write_package(tmp_path, {
        "pkg/__init__.py": "from pkg.top import run\n",
        "pkg/low.py": "def f():\n    from .top import run\n    return run\n",
        "pkg/top.py": "import pkg.sub.mid as mid\nfrom pkg.sub import deep\n",
        "pkg/sub/__init__.py": "VALUE = 1\n",
        "pkg/sub/mid.py": "from .. import low\nfrom . import VALUE\n",
        "pkg/sub/deep.py": "import os\n",
    })
    assert import_graph(package) == {
        "pkg": {"pkg.top"}, "pkg.low": {"pkg.top"}, "pkg.top": {"pkg.sub.mid", "pkg.sub.deep"},
        "pkg.sub": set(), "pkg.sub.mid": {"pkg.low", "pkg.sub"}, "pkg.sub.deep": set()}


def test_the_checker_reports_a_circle_an_upward_import_and_an_unplaced_module(tmp_path):
    package = write_package(tmp_path, {
        "pkg/__init__.py": "", "pkg/a.py": "from pkg import b\n", "pkg/b.py": "def f():\n    import pkg.a\n",
        "pkg/c.py": "", "pkg/d.py": "",
    })
    graph = import_graph(package)
    assert find_circle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
    layers = read_layers("```layers\nlow: pkg/a.py\n  pkg/__init__.py\nhigh: pkg/b.py pkg/e.py\n  pkg/c.py\n```\n")
    where, problems = place(graph, layers)
    assert problems == ["layer 'high': pkg/e.py names no module", "pkg.d is in no layer"]
    assert upward_imports(graph, where, layers) == ["pkg.a (layer 'low') imports pkg.b (layer 'high', above it)"]
