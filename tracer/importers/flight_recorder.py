"""Import PyTorch flight-recorder dumps (one per rank), for hang analysis.

A dump is what `torch._C._distributed_c10d._dump_fr_trace()` returns (written on a collective timeout
with TORCH_NCCL_DUMP_ON_TIMEOUT=1, or by hand; TORCH_FR_BUFFER_SIZE / TORCH_NCCL_TRACE_BUFFER_SIZE
must be > 0 for anything to be recorded): a pickled dict with `version`, `pg_config` {pg name: {name,
desc, ranks}}, `pg_status` {pg name: {last_enqueued_collective, last_started_collective,
last_completed_collective}} and `entries` (one per collective/p2p op: pg_id, process_group (name,
desc), collective_seq_id, p2p_seq_id, profiling_name such as 'nccl:all_reduce' or 'gloo:all_reduce',
time_created_ns, time_discovered_started/completed_ns, input/output sizes and dtypes, state, retired,
is_p2p). The JSON variant (`_dump_fr_trace_json`) is read too. The rank comes from a `rank` key or
the file name (fr_files.py: `rank3`, else the digits ending it, as torch's `fr_trace` reads it); file
names carrying a host give the run its hosts; dumps of several jobs in one folder are grouped by the
job id their names carry and one job is imported (`job`). A partially written pickle is used as far
as it was written (fr_partial.py), with a warning; an op it lost while in flight is restored from
its `pg_status` (enqueued but not completed), named from the other ranks' dumps.

Process groups are each rank's own: a pg name means the members that rank's `pg_config` lists (two
sub-groups of one name on different ranks stay apart: no false mismatch between them), else the
default pg's world, else the ranks whose dumps know the name (gloo leaves pg_config nearly empty).

Completed ops become events; each rank's ops still in flight become an in-flight record
(RUN/inflight/rank=NNNNN.json, the tracer watchdog's format), so the analyzer's hang analysis names
the rank(s) everyone waits on: a rank that never joined has no op in flight, hence no record. Dumps
carry no training step: events and records are put at step -1 (NO_STEP, the step of events before the
first training step), so they never mix into a training step's accounting.
"""

from __future__ import annotations

import ast
import io
import json
import math
import pickle
from pathlib import Path
from typing import Any

from megascope.tracer.importers.fr_files import Job, group_jobs, parse_name
from megascope.tracer.importers.fr_partial import salvage
from megascope.tracer.importers.layout import layout_from_sizes
from megascope.tracer.importers.writer import ImportInputError, RunWriter
from megascope.tracer.layout import Layout

DTYPE_BYTES = {"float": 4, "float32": 4, "half": 2, "float16": 2, "bfloat16": 2, "double": 8, "float64": 8,
               "long": 8, "int64": 8, "int": 4, "int32": 4, "short": 2, "int16": 2, "byte": 1, "char": 1,
               "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
NO_STEP = -1


class _PrimitivesOnly(pickle.Unpickler):
    """Flight-recorder dumps hold only dicts, lists, tuples, strings and numbers: refuse anything else,
    so importing a pickle from elsewhere cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def read_dump(path: Path) -> tuple[dict[str, Any], bool]:
    """The dump and whether it was only partially written (its readable part)."""
    data = path.read_bytes()
    partial = False
    try:
        if data[:1] in (b"{", b"["):
            dump = json.loads(data)
        else:
            dump = _PrimitivesOnly(io.BytesIO(data)).load()
    except Exception as exc:  # any unpickling/JSON failure means: not a dump we can read
        rescued = _salvage(data, exc)
        if rescued is None:
            raise ImportInputError(f"{path} is not a flight-recorder dump ({type(exc).__name__}: {str(exc)[:100]}); "
                                   "expected the pickle written by torch's flight recorder "
                                   "(_dump_fr_trace / TORCH_NCCL_DUMP_ON_TIMEOUT)") from None
        dump, partial = rescued, True
    if not isinstance(dump, dict) or "entries" not in dump:
        keys = ", ".join(map(str, list(dump)[:6])) if isinstance(dump, dict) else type(dump).__name__
        raise ImportInputError(f"{path} is not a flight-recorder dump: expected a dict with 'entries', "
                               f"'pg_config' and 'pg_status', found {keys}")
    return dump, partial


def _salvage(data: bytes, exc: Exception) -> dict[str, Any] | None:
    """A truncated pickle's readable part (None: not a truncated dump)."""
    if data[:1] in (b"{", b"[") or "refusing" in str(exc):
        return None
    try:
        dump = salvage(data)
    except pickle.UnpicklingError as refused:
        raise ImportInputError(str(refused)) from None
    return dump if dump is not None and ("pg_status" in dump or "entries" in dump) else None


def rank_of(path: Path, dump: dict[str, Any]) -> int:
    if isinstance(dump.get("rank"), int):
        return dump["rank"]
    rank = parse_name(path).rank
    if rank is None:
        raise ImportInputError(f"{path}: cannot tell the rank (no 'rank' key and no rank in the file name, "
                               "as in nccl_trace_rank_3); rename the file so it ends with its rank")
    return rank


def _ranks_of(value: Any) -> list[int]:
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return []
    return sorted(int(r) for r in value) if isinstance(value, (list, tuple)) else []


def _group_members(dumps: dict[int, dict], world: int) -> dict[int, dict[str, list[int]]]:
    """rank -> {pg name: member ranks} as that rank knows its groups: its own pg_config where it lists
    them (NCCL), else the default pg is the world, else the ranks whose dumps know the pg name (gloo)."""
    known: dict[str, set[int]] = {}
    for rank, dump in dumps.items():
        for name in (dump.get("pg_status") or {}):
            known.setdefault(str(name), set()).add(rank)
        for e in dump.get("entries", []):
            known.setdefault(_pg(e)[0], set()).add(rank)
    out: dict[int, dict[str, list[int]]] = {}
    for rank, dump in dumps.items():
        own = {name: sorted(ranks) for name, ranks in known.items() if rank in ranks}
        for e in dump.get("entries", []):
            name, desc = _pg(e)
            if desc == "default_pg" or name == "0":
                own[name] = list(range(world))
        for name, cfg in (dump.get("pg_config") or {}).items():
            listed = _ranks_of((cfg or {}).get("ranks"))
            if name and listed and (rank in listed or len(listed) == world):
                own[str(name)] = listed
        out[rank] = own
    return out


def _pg(entry: dict) -> tuple[str, str]:
    pg = entry.get("process_group") or (str(entry.get("pg_id", "")), "")
    return str(pg[0]), str(pg[1]) if len(pg) > 1 else ""


def _world(dumps: dict[int, dict], dp: int | None, tp: int | None, pp: int | None) -> int:
    if dp and tp and pp:
        return dp * tp * pp
    world = max(max(dumps) + 1, (dp or 1) * (tp or 1) * (pp or 1))  # given sizes: a lower bound
    for dump in dumps.values():
        for cfg in (dump.get("pg_config") or {}).values():
            listed = _ranks_of((cfg or {}).get("ranks"))
            if listed:
                world = max(world, max(listed) + 1)
    return world


def _op(entry: dict) -> tuple[str, str]:
    """(name, kind) from profiling_name, e.g. 'nccl:all_reduce' -> ('all_reduce', 'collective')."""
    name = str(entry.get("profiling_name") or "unknown").split(":", 1)[-1]
    return name, "p2p" if entry.get("is_p2p") else "collective"


def _nbytes(entry: dict) -> int:
    total = 0
    for sizes, dtype in zip(entry.get("input_sizes") or [], entry.get("input_dtypes") or []):
        total += math.prod(int(s) for s in sizes) * DTYPE_BYTES.get(str(dtype).lower(), 4)
    return total


def _in_flight(entry: dict, status: dict) -> bool:
    if entry.get("state") == "completed" or entry.get("time_discovered_completed_ns"):
        return False
    name, _ = _pg(entry)
    done = (status.get(name) or {}).get("last_completed_collective")
    if done is not None and not entry.get("is_p2p") and int(entry.get("collective_seq_id", 0)) <= int(done):
        return False
    return not entry.get("retired", False)


def import_flight_recorder(sources: list[Path], writer: RunWriter, dp: int | None, tp: int | None,
                           pp: int | None, vpp: int | None, job: str | None = None
                           ) -> tuple[Layout, list[int], list[str], dict, dict[int, str]]:
    """Returns the layout, the ranks, the unreadable inputs, run.json's extra and rank -> host."""
    chosen = _choose_job(sources, job)
    dumps: dict[int, dict] = {}
    failed: list[str] = []
    for named in chosen.files:
        path = named.path
        try:
            dump, partial = read_dump(path)
            rank = rank_of(path, dump)
        except ImportInputError as exc:
            writer.warn(str(exc))
            failed.append(str(path))
            continue
        if rank in dumps:
            raise ImportInputError(f"two dumps for rank {rank} ({path}); pass one dump per rank")
        if partial:
            writer.warn(f"{path} is partially written (cut off at byte {path.stat().st_size}): its first "
                        f"{len(dump.get('entries') or [])} entries and its pg_status were used")
            dump["_partial"] = True
        dumps[rank] = dump
        writer.add_source(path, kind="flight recorder", rank=rank, version=str(dump.get("version")), partial=partial)
    if not dumps:
        return Layout(1, 1, 1), [], failed, {}, {}
    world = _world(dumps, dp, tp, pp)
    try:
        layout = layout_from_sizes(world, dp, tp, pp, vpp)
    except ValueError as exc:
        raise ImportInputError(str(exc)) from None
    groups = _group_members(dumps, world)
    missing = sorted(set(range(world)) - set(dumps))
    if missing:
        writer.warn(f"no dump for rank(s) {', '.join(map(str, missing[:16]))}: a rank that never wrote one is a "
                    "hang suspect when others wait on it")
    ops = _ops_by_seq(dumps, groups)
    for rank, dump in sorted(dumps.items()):
        _convert_rank(rank, dump, layout, groups[rank], writer, ops)
    ranks = sorted(set(range(world)))  # the topology lists every rank: suspects may have no dump
    pg_members = {name: members for own in groups.values() for name, members in own.items()}
    extra = {"flight_recorder": {"pg_members": pg_members, "ranks_with_dump": sorted(dumps), "job": chosen.id}}
    return layout, ranks, failed, extra, dict(chosen.hosts)


def _choose_job(sources: list[Path], job: str | None) -> Job:
    """The one job among the inputs (or the one `job` names); several without a choice: refused."""
    jobs = group_jobs([parse_name(p) for p in sources])
    if job is not None:
        picked = [j for j in jobs if job in j.id or any(job in f.path.name for f in j.files)]
        if len(picked) != 1:
            raise ImportInputError(f"--job {job} matches {len(picked)} of the jobs here ({_list(jobs)}); "
                                   "pass text that names exactly one")
        return picked[0]
    if len(jobs) > 1:
        raise ImportInputError(f"the dumps are from {len(jobs)} jobs ({_list(jobs)}); import one at a time with "
                               "--job TEXT (part of its file names)")
    return jobs[0]


def _list(jobs: list[Job]) -> str:
    def ranks(j: Job) -> str:
        r = sorted(j.ranks)
        return f"ranks {r[0]}-{r[-1]}" if r else "no rank in the names"
    return "; ".join(f"{j.id}: {len(j.files)} dump(s), {ranks(j)}" for j in jobs[:8])


def _ops_by_seq(dumps: dict[int, dict], groups: dict[int, dict[str, list[int]]]) -> dict[tuple, str]:
    """(members, pg name, collective seq) -> profiling_name, from every readable entry: names an op a
    partially written dump lost."""
    out: dict[tuple, str] = {}
    for rank, dump in dumps.items():
        for e in dump.get("entries", []):
            name, _ = _pg(e)
            if not e.get("is_p2p"):
                key = (tuple(groups[rank].get(name, [])), name, int(e.get("collective_seq_id", 0)))
                out[key] = str(e.get("profiling_name") or "unknown")
    return out


def _describe(entry: dict, label: str, peers: list[int]) -> dict[str, Any]:
    name, kind = _op(entry)
    seq_key = "p2p_seq_id" if entry.get("is_p2p") else "collective_seq_id"
    return {"op": name, "kind": kind, "group": label, "seq": int(entry.get(seq_key, 0)) - 1, "peer": -1,
            "peers": peers, "bytes": _nbytes(entry), "since_ns": int(entry.get("time_created_ns") or 0),
            "step": NO_STEP, "microbatch": -1, "chunk": -1, "state": entry.get("state"),
            "frames": [f"{f.get('filename')}:{f.get('line')} {f.get('name')}" for f in (entry.get("frames") or [])[:8]]}


def _convert_rank(rank: int, dump: dict, layout: Layout, groups: dict[str, list[int]], writer: RunWriter,
                  ops: dict[tuple, str]) -> None:
    status = dump.get("pg_status") or {}
    descs = {str(n): str((cfg or {}).get("desc") or "") for n, cfg in (dump.get("pg_config") or {}).items()}
    inflight: list[dict] = []
    last: dict | None = None
    for entry in sorted(dump.get("entries", []), key=lambda e: e.get("time_created_ns") or 0):
        name, desc = _pg(entry)
        descs.setdefault(name, desc)
        label = _label(name, desc, groups.get(name, []), layout)
        rec = _describe(entry, label, groups.get(name, []))
        if _in_flight(entry, status):
            inflight.append(rec)
            continue
        created = rec["since_ns"]
        started = int(entry.get("time_discovered_started_ns") or created)
        ended = int(entry.get("time_discovered_completed_ns") or started)
        writer.event(rank, NO_STEP, rec["op"], rec["kind"], started, ended, issue_ns=created, group=label,
                     seq=rec["seq"], nbytes=rec["bytes"])
        last = rec
    if dump.get("_partial"):
        inflight += _lost_in_flight(dump, status, descs, groups, layout, ops, inflight)
    if inflight:
        waiting = inflight[0]
        entries = dump.get("entries") or []
        timeout_s = (entries[0].get("timeout_ms") or 0) / 1e3 if entries else None
        writer.inflight(rank, {"state": "waiting", "written_ns": max(r["since_ns"] for r in inflight),
                               "timeout_s": timeout_s,
                               "waiting_on": waiting, "inflight": inflight, "last_completed": last,
                               # flat copy of the waited-on op: the analyzer's hang graph reads these
                               **{k: waiting[k] for k in ("op", "group", "seq", "peers", "bytes", "since_ns",
                                                          "step", "microbatch", "chunk")}})


def _label(name: str, desc: str, peers: list[int], layout: Layout) -> str:
    if desc in ("dp", "tp", "pp"):
        return desc
    return layout.group_name(peers) or ("world" if desc == "default_pg" else f"pg{name}")


def _lost_in_flight(dump: dict, status: dict, descs: dict[str, str], groups: dict[str, list[int]],
                    layout: Layout, ops: dict[tuple, str], seen: list[dict]) -> list[dict]:
    """Collectives a partially written dump enqueued but did not complete, whose entries were cut off:
    from its pg_status, named from the other ranks' entries of the same group and sequence number."""
    entries = dump.get("entries") or []
    since = max((int(e.get("time_created_ns") or 0) for e in entries), default=0) + 1
    out = []
    for name, st in status.items():
        name = str(name)
        enqueued, completed = (st or {}).get("last_enqueued_collective"), (st or {}).get("last_completed_collective")
        if not isinstance(enqueued, int) or not isinstance(completed, int) or enqueued <= completed:
            continue
        peers = groups.get(name, [])
        label = _label(name, descs.get(name, ""), peers, layout)
        if any(r["group"] == label and r["seq"] == enqueued - 1 and r["kind"] == "collective" for r in seen):
            continue
        profiling = ops.get((tuple(peers), name, enqueued), "unknown")
        out.append(_describe({"profiling_name": profiling, "collective_seq_id": enqueued, "time_created_ns": since,
                              "state": "unknown (the dump was cut off before this entry)"}, label, peers))
    return out
