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
