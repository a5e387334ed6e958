"""Flight-recorder dump files as people have them: which rank, host and job a file name says.

Torch writes `<TORCH_NCCL_DEBUG_INFO_TEMP_FILE><rank>` (default /tmp/nccl_trace_rank_<rank>); jobs set
the prefix to carry a job id or the host (`nccl_trace_rank_container-node02_5`, `job42_node07_rank3.pkl`),
and several jobs' dumps end up in one folder. torch's fr_trace wants one common prefix and gives up on
both. Our rules:

- rank: the digits after the word `rank` (`rank3`, `rank_3`, `rank-3`), else the digits ending the name
  before its extension (fr_trace's rule), else the dump's own `rank` key;
- the file's *stem* is its name without the rank and extension; files of one job on different hosts
  have stems that differ only where the host is written;
- jobs: stems are joined into one job while their ranks stay disjoint (the ranks of one job are spread
  over its hosts; two jobs both have a rank 0), largest stems first. A job's id is its stems' common
  text; the host of a rank is the part of its stem that differs from the job's other stems. Files
  without a rank in their name (a stray log, a dump with a `rank` key) go with the largest job.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

_EXPLICIT_RANK = re.compile(r"rank[_\-]?(\d+)(?!\d)", re.I)
_TRAILING_RANK = re.compile(r"(\d+)(?:\.[A-Za-z]\w*)?$")
_EXTENSION = re.compile(r"\.(?:pkl|pickle|json|bin|dump|txt)$", re.I)
_EDGE = "_-."


@dataclass
class DumpFile:
    path: Path
    rank: int | None
    """From the name; None when the name has no rank (the dump's `rank` key may still have one)."""
    stem: str


@dataclass
class Job:
    id: str
    files: list[DumpFile] = field(default_factory=list)
    hosts: dict[int, str] = field(default_factory=dict)
    """rank -> host, where the file names carry one."""

    @property
    def ranks(self) -> set[int]:
        return {f.rank for f in self.files if f.rank is not None}


def parse_name(path: Path) -> DumpFile:
    name = path.name
    m = _EXPLICIT_RANK.search(name)
    if m is None:
        m = _TRAILING_RANK.search(name)
    if m is None:
        return DumpFile(path, None, _EXTENSION.sub("", name))
    stem = name[:m.start(1)] + "#" + _EXTENSION.sub("", name[m.end(1):])
    return DumpFile(path, int(m.group(1)), stem)


def group_jobs(files: list[DumpFile]) -> list[Job]:
    """Files -> jobs (see the module doc), the job with the most files first."""
    by_stem: dict[str, list[DumpFile]] = {}
    for f in files:
        if f.rank is not None:
            by_stem.setdefault(f.stem, []).append(f)
    unnamed = [f for f in files if f.rank is None]
    if not by_stem:
        return [Job(unnamed[0].stem if len(unnamed) == 1 else "<no rank in the names>", unnamed)] if unnamed else []
    groups: list[list[str]] = []
    ranks: list[set[int]] = []
    for stem in sorted(by_stem, key=lambda s: (-len(by_stem[s]), s)):
        own = {f.rank for f in by_stem[stem] if f.rank is not None}
        free = [i for i, taken in enumerate(ranks) if not own & taken]
        if free:  # the job whose name is most like this one (n2_jobA joins n1_jobA, not n1_jobB)
            i = max(free, key=lambda i: _likeness(stem, groups[i][0]))
            groups[i].append(stem)
            ranks[i] |= own
        else:
            groups.append([stem])
            ranks.append(set(own))
    jobs = []
    for stems in groups:
        head, tail = _common_edges(stems)
        job = Job(_job_id(stems, head, tail), [f for s in stems for f in by_stem[s]])
        if len(stems) > 1:
            for s in stems:
                host = s[len(head):len(s) - len(tail)].strip(_EDGE)
                for f in by_stem[s]:
                    if f.rank is not None and host:
                        job.hosts[f.rank] = host
        jobs.append(job)
    jobs.sort(key=lambda j: (-len(j.files), j.id))
    jobs[0].files += unnamed  # no rank in the name: read with the largest job (a `rank` key, or a clear error)
    return jobs


def _likeness(a: str, b: str) -> int:
    """Characters two stems share at their beginning and end."""
    return len(os.path.commonprefix([a, b])) + len(os.path.commonprefix([a[::-1], b[::-1]]))


def _common_edges(stems: list[str]) -> tuple[str, str]:
    """The common beginning and end of the stems, cut back to a separator so a host keeps its digits
    (`_` first: host names hold `-` and `.`, as in container-node02 or node07.dc)."""
    if len(stems) == 1:
        return stems[0], ""
    head = os.path.commonprefix(stems)
    tail = os.path.commonprefix([s[::-1] for s in stems])[::-1]
    for seps in ("_", _EDGE):
        cut = max(head.rfind(c) for c in seps)
        if cut >= 0:
            head = head[:cut + 1]
            break
    else:
        head = ""
    for seps in ("_", _EDGE):
        cuts = [i for i, c in enumerate(tail) if c in seps]
        if cuts:
            tail = tail[cuts[0]:]
            break
    else:
        tail = ""
    return head, tail


def _job_id(stems: list[str], head: str, tail: str) -> str:
    text = stems[0] if len(stems) == 1 else f"{head}<host>{tail}"
    return text.replace("#", "<rank>")
