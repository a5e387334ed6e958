"""README.md and docs/*.md name only files that exist: every repository path they mention (a top-level
folder of the checkout, then a file with a source or doc extension) is there, so a rename that forgets
the docs fails here instead of misleading the next reader."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("tracer", "analyzer", "dashboard", "trainer", "kernels", "samples", "megascope", "tests", "benchmarks",
       "scripts", "docs", ".ci")
PATH = re.compile(r"(?<![\w./$-])((?:%s)/[\w./-]*\.(?:py|md|sql|toml|json|sh|css))\b" % "|".join(map(re.escape, TOP)))


def mentioned_paths() -> list[tuple[str, int, str]]:
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for lineno, line in enumerate(doc.read_text().splitlines(), 1):
            found += [(doc.name, lineno, m.group(1)) for m in PATH.finditer(line)]
    return found


def test_paths_in_the_docs_exist():
    paths = mentioned_paths()
    assert len(paths) > 50  # the pattern finds the docs' references
    assert [f"{doc}:{line}: {path}" for doc, line, path in paths if not (ROOT / path).exists()] == []
