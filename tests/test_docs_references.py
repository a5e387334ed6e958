"""README.md and docs/*.md name only files that exist: every repository path they mention (a top-level
folder of the checkout, then a file with a source or doc extension) is there, so a rename that forgets
the docs fails here instead of misleading the next reader."""

from __future__ import annotations

import importlib
import importlib.util
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


COMMAND = re.compile(r"(?:^\s*(?:\$\s+)?|[;&|(]\s*|\.venv/bin/|-m\s+)megascope ([a-z][a-z-]+)\b(?! of )")
"""A command line's `megascope COMMAND` (at the start of a code line or span, after a shell operator, a
venv path or `python -m`), not the program's name in its own output ("megascope analysis of ...")."""
DOTTED = re.compile(r"(?<![\w.])(megascope(?:\.[A-Za-z_]\w*)+)")


def code_of(doc: Path) -> list[tuple[int, str]]:
    """The doc's code, by line: fenced and indented blocks whole, elsewhere its `inline` spans."""
    out, fenced = [], False
    for lineno, line in enumerate(doc.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith("    "):
            out.append((lineno, line))
        else:
            out += [(lineno, span) for span in re.findall(r"`([^`]+)`", line)]
    return out


def mentioned(pattern: re.Pattern) -> list[tuple[str, int, str]]:
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        found += [(doc.name, lineno, m.group(1)) for lineno, code in code_of(doc) for m in pattern.finditer(code)]
    return found


def resolves(dotted: str) -> bool:
    """A module, or an attribute of one (a class, a function, a class's attribute), by that name."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            if importlib.util.find_spec(name) is None:
                continue
        except ModuleNotFoundError:
            continue
        obj = importlib.import_module(name)
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_commands_in_the_docs_exist():
    """Every `megascope COMMAND` a doc shows in code is a subcommand (a documented `megascope attach`
    that never existed misled readers for a round)."""
    from megascope.cli import SUBCOMMANDS
    commands = mentioned(COMMAND)
    assert len(commands) > 50
    assert [f"{doc}:{line}: megascope {cmd}" for doc, line, cmd in commands if cmd not in SUBCOMMANDS] == []


def test_modules_in_the_docs_exist():
    """Every dotted `megascope.x.y` name a doc gives is a module or an attribute of one."""
    names = mentioned(DOTTED)
    assert len(names) > 20
    assert [f"{doc}:{line}: {name}" for doc, line, name in names if not resolves(name)] == []
