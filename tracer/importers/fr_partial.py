"""What a partially written flight-recorder pickle still holds.

A dump cut off (the process killed while writing it on a timeout, a full disk, a copy that stopped)
ends inside `entries`, its last key: `version`, `pg_config` and `pg_status` come first. Python's pure
unpickler keeps the objects it is building on a stack of stacks, one level per open container
(`MARK`): after the cut, each level holds the finished items of a container whose last one may be half
built. Folding the levels back into their containers gives the dump as far as it was written; entries
cut in the middle are dropped (they lack the keys every entry has).
"""

from __future__ import annotations

import io
import pickle
import struct
from typing import Any

_ENTRY_KEYS = {"profiling_name", "time_created_ns", "state"}
"""Keys every entry has that the importer reads (an entry cut before them is dropped)."""


class _PartialPrimitives(pickle._Unpickler):  # type: ignore[name-defined]  # the pure one exposes its stacks
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def salvage(data: bytes) -> dict[str, Any] | None:
    """The readable part of a truncated pickled dict; None when not even its first keys are there.
    Raises pickle.UnpicklingError for a pickle that asks to load a class (never runs it)."""
    u = _PartialPrimitives(io.BytesIO(data))
    try:
        u.load()
        return None  # it is complete: the caller's error was something else
    except pickle.UnpicklingError as exc:
        if "refusing" in str(exc):
            raise
    except (EOFError, ValueError, IndexError, KeyError, struct.error):
        pass
    levels = [list(level) for level in getattr(u, "metastack", [])] + [list(getattr(u, "stack", []))]
    for depth in range(len(levels) - 1, 0, -1):
        items, parent = levels[depth], levels[depth - 1]
        container = parent[-1] if parent else None
        if isinstance(container, list):
            container.extend(items)
        elif isinstance(container, dict):
            container.update(zip(items[0::2], items[1::2]))
    top = levels[0][-1] if levels[0] else None
    if not isinstance(top, dict) or not top:
        return None
    entries = top.get("entries")
    if isinstance(entries, list) and entries and isinstance(entries[0], dict):  # drop the half-built last entry
        whole = max((set(e) for e in entries if isinstance(e, dict)), key=len) | _ENTRY_KEYS
        top["entries"] = [e for e in entries if isinstance(e, dict) and whole <= set(e)]
    return top

