"""No import circles between modules: every package's imports (module level, function level and
TYPE_CHECKING blocks alike) are parsed with ast and the module graph must have no cycle. And no
source file in the packages past MAX_LINES.

There is no allowance list: any circle fails (issue 36 broke the last ones: FP8 shards itself for
TP through engines.parallel.tp.ShardableLinear; ModelConfig and its HF form live in
engines.model.model_config, under engines.core.config and engines.core.hardware).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engines", "serving", "training", "tuner", "loadtest", "deploy", "shardserve")



def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, name: str, modules: set[str]) -> set[str]:
    """The project modules `path` imports: `from a.b import c` counts a.b.c when that is a module,
    and a.b itself when some name is not a module (a parent package's __init__ that Python runs
    on the way is not counted: it is not what the importer names)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            subs = {f"{base}.{a.name}" for a in node.names} & modules
            found.update(subs if len(subs) == len(node.names) else {base, *subs})
    # a name resolves to the longest project module it names (a package's __init__ counts as itself)
    out = set()
    for f in found:
        while f and f not in modules:
            f = f.rpartition(".")[0]
        if f and f != name:
            out.add(f)
    return out


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    modules = set(files)
    return {m: imports_of(p, m, modules) for m, p in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(frozenset(comp))
    return out


def test_cycle_finder_finds_a_planted_circle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [frozenset({"a", "b", "c"})]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    found = sorted(sorted(c) for c in cycles(import_graph()))
    assert not found, f"import circles: {found}"


MAX_LINES = 500
"""Most lines of a source file in the packages (Python and the C++ kernels): past that, split it by
responsibility (STYLE.md). Data files (a Grafana dashboard, a vendored JSON schema) do not count."""


def test_no_source_file_over_max_lines():
    long = {str(p.relative_to(ROOT)): n for pkg in PACKAGES for pattern in ("*.py", "*.cpp")
            for p in (ROOT / pkg).rglob(pattern) if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"
