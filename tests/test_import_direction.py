"""Layers point one way: trainer -> tracer -> run directory -> analyzer -> dashboard / CLI.

Parses every module's imports (function-level ones included) and fails on an import against the
direction: the tracer imports neither the trainer, the analyzer nor the dashboard; the analyzer
neither the trainer nor the dashboard; the dashboard reads runs through the analyzer's API, never
DuckDB or the tracer itself; the kernels depend on no other part; the plain-loop sample needs no
megascope trainer. Inside the analyzer, its parts point one way too (ANALYZER_FORBIDDEN)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FORBIDDEN = {
    "tracer": ("megascope.trainer", "megascope.analyzer", "megascope.dashboard"),
    "analyzer": ("megascope.trainer", "megascope.dashboard"),
    "dashboard": ("duckdb", "megascope.trainer", "megascope.tracer"),
    "kernels": ("megascope.trainer", "megascope.tracer", "megascope.analyzer", "megascope.dashboard"),
    "samples/plain_loop.py": ("megascope.trainer",),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def violations(layer: str, banned: tuple[str, ...]) -> list[str]:
    base = ROOT / layer
    files = [base] if base.suffix == ".py" else sorted(base.rglob("*.py"))
    found = []
    for f in files:
        for line, module in imported_modules(f):
            if any(module == b or module.startswith(b + ".") for b in banned):
                found.append(f"{f.relative_to(ROOT)}:{line} imports {module}")
    return found


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_point_one_way(layer):
    assert violations(layer, FORBIDDEN[layer]) == []


# Inside the analyzer the analysis runs one way: run directory -> data/ (derived tables) -> detect/,
# graph/, views/ -> run.py (the facade) -> report/ (the report and its writers) -> watch/. Nothing
# calls back up: a detector never reaches into Run, Run never into the report it is turned into.
A = "megascope.analyzer."
ANALYZER_FORBIDDEN = {
    "analyzer/data": (A + "detect", A + "graph", A + "views", A + "run", A + "report", A + "watch"),
    "analyzer/detect": (A + "graph", A + "views", A + "run", A + "report", A + "watch"),
    "analyzer/graph": (A + "detect", A + "views", A + "run", A + "report", A + "watch"),
    "analyzer/views": (A + "detect", A + "graph", A + "run", A + "report", A + "watch"),
    "analyzer/findings.py": (A + "data", A + "detect", A + "graph", A + "views", A + "run", A + "report", A + "watch"),
    "analyzer/settings.py": (A + "data", A + "detect", A + "graph", A + "views", A + "run", A + "report", A + "watch"),
    "analyzer/run.py": (A + "report", A + "watch"),
    "analyzer/report": (A + "watch",),
    "analyzer/report/html.py": (A + "run",),  # the writers take what was built from the Run, not the Run
    "analyzer/report/perfetto.py": (A + "run",),
}


@pytest.mark.parametrize("part", sorted(ANALYZER_FORBIDDEN))
def test_the_analysis_runs_one_way(part):
    assert violations(part, ANALYZER_FORBIDDEN[part]) == []


def test_the_check_sees_function_level_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\n\ndef late():\n    from megascope.trainer.config import JobConfig\n    return JobConfig\n")
    assert imported_modules(f) == [(1, "os"), (4, "megascope.trainer.config")]


# No circles between megascope's own modules, function-level imports included (a late import inside a
# function hides a circle rather than breaking it: checkpoint <-> checkpoint_dcp was one); imports under
# `if TYPE_CHECKING:` are for annotations only and do not count. A module importing its own package
# (`megascope.analyzer.run` -> `megascope.analyzer`) is Python's package rule, not a circle.
PARTS = ("tracer", "analyzer", "dashboard", "trainer", "kernels", "samples")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(["megascope", *(parts[:-1] if parts[-1] == "__init__" else parts)])


def _runtime_imports(path: Path) -> set[str]:
    """Every module imported at run time (TYPE_CHECKING blocks skipped), `from a import b` as a.b
    where a.b is a module."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                out.add(child.module)
                out.update(f"{child.module}.{a.name}" for a in child.names)
            elif isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return out


def import_circles() -> list[list[str]]:
    files = {_module_name(f): f for part in PARTS for f in sorted((ROOT / part).rglob("*.py"))}
    graph = {m: {d for d in _runtime_imports(f) if d in files and d != m and not m.startswith(d + ".")}
             for m, f in files.items()}
    circles, done = [], set()
    for start in graph:  # a depth-first walk from each module; a back edge closes a circle
        path, on_path = [start], {start}
        stack = [iter(sorted(graph[start]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                finished = path.pop()
                on_path.discard(finished)
                done.add(finished)
            elif nxt in on_path:
                circle = path[path.index(nxt):]
                if sorted(circle) not in [sorted(c) for c in circles]:
                    circles.append(circle)
            elif nxt not in done:
                path.append(nxt)
                on_path.add(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return circles


def test_no_module_imports_itself_round_a_circle():
    assert import_circles() == []


def test_the_circle_check_sees_a_late_import(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import megascope.x\n"
                 "def late():\n    from megascope.trainer.robust import checkpoint\n")
    assert _runtime_imports(f) == {"typing", "typing.TYPE_CHECKING", "megascope.trainer.robust",
                                   "megascope.trainer.robust.checkpoint"}
