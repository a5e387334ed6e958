"""`megascope import FORMAT SRC... --out RUN`: a dump from another tool -> a megascope run directory.

    megascope import kineto traces/rank*.json.gz --out runs/prof [--dp 4 --tp 2 --pp 2] [--jobs 2]
    megascope import ndtimeline dump/*.parquet --meta job.yaml --out runs/ndt [--cp 2] [--column start_ts=begin]
    megascope import flight-recorder dumps/nccl_trace_rank_* --out runs/hang [--dp ...] [--job TEXT]

Exit codes: 0 imported; 2 bad input (one line per problem on stderr, no traceback). When some inputs
are unreadable the readable ranks are still imported (the run is usable) and the exit code is 2.
A failed import leaves nothing behind (writer.py: the run is renamed into --out when complete).
A progress bar is drawn on stderr when it is a terminal.
"""

from __future__ import annotations

import argparse
import glob
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megascope.tracer.importers.writer import ImportInputError, RunWriter

FORMATS = {"kineto": "kineto", "torch-profiler": "kineto", "ndtimeline": "ndtimeline",
           "flight-recorder": "flight_recorder", "fr": "flight_recorder"}


@dataclass
class ImportResult:
    out: Path
    ranks: list[int]
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What was assumed for inputs that lacked something (a rank, steps): worth saying, not a problem."""
    failed_sources: list[str] = field(default_factory=list)
    """Inputs that could not be read at all (their ranks are missing from the run)."""


def import_run(fmt: str, sources: list[str | Path], out: str | Path, dp: int | None = None,
               tp: int | None = None, pp: int | None = None, vpp: int | None = None,
               columns: dict[str, str] | None = None, jobs: int = 1,
               progress: Callable[[str, int, int], None] | None = None, cp: int | None = None,
               meta: str | Path | None = None, job: str | None = None) -> ImportResult:
    """Import `sources` of format `fmt` into the new run directory `out` (nothing is left there when it
    fails). Raises ImportInputError. `cp` (context parallel size) and `meta` (an NDTimeline job file)
    are read by the ndtimeline importer; `job` (text of one job's file names) by the flight-recorder one."""
    module = FORMATS.get(fmt)
    if module is None:
        raise ImportInputError(f"unknown format '{fmt}'; use one of: kineto, ndtimeline, flight-recorder")
    if module != "ndtimeline" and ((cp or 1) > 1 or meta):
        raise ImportInputError(f"--cp and --meta are read by the ndtimeline importer only, not by {fmt}")
    if job is not None and module != "flight_recorder":
        raise ImportInputError(f"--job is read by the flight-recorder importer only, not by {fmt}")
    if meta and not Path(meta).is_file():
        raise ImportInputError(f"--meta {meta}: no such file; pass the job's NDTimeline job file (YAML)")
    paths = _expand(sources)
    writer = RunWriter(out, "flight-recorder" if module == "flight_recorder" else module, inputs=len(paths),
                       progress=progress)
    try:
        ranks, failed = _convert(module, paths, writer, dp, tp, pp, vpp, columns or {}, jobs, cp,
                                 Path(meta) if meta else None, job)
    except BaseException:  # any failure, Ctrl-C included: no half-written run
        writer.abort()
        raise
    return ImportResult(Path(out), ranks, list(writer.warnings), list(writer.notes), failed)


def _convert(module: str, paths: list[Path], writer: RunWriter, dp: int | None, tp: int | None, pp: int | None,
             vpp: int | None, columns: dict[str, str], jobs: int, cp: int | None = None,
             meta: Path | None = None, job: str | None = None) -> tuple[list[int], list[str]]:
    """Run the format's importer into `writer` and finish the run; returns the ranks imported and the
    unreadable inputs."""
    failed: list[str] = []
    extra: dict = {}
    hosts: dict[int, str] = {}
    if module == "kineto":
        from megascope.tracer.importers.kineto import import_kineto

        layout, ranks, hosts, failed = import_kineto(paths, writer, dp, tp, pp, vpp, jobs=jobs)
    elif module == "ndtimeline":
        from megascope.tracer.importers.ndtimeline import import_ndtimeline

        layout, ranks = import_ndtimeline(paths, writer, dp, tp, pp, vpp, columns, cp=cp, meta=meta)
    else:
        from megascope.tracer.importers.flight_recorder import import_flight_recorder

        layout, ranks, failed, extra, hosts = import_flight_recorder(paths, writer, dp, tp, pp, vpp, job=job)
    if not ranks:
        raise ImportInputError("nothing could be imported: " + "; ".join(writer.warnings or ["no ranks found"]))
    writer.finish(layout, ranks, {"dp": dp, "tp": tp, "pp": pp, "vpp": vpp, "cp": cp, "columns": columns},
                  hosts=hosts, extra=extra)
    return ranks, failed


def _expand(sources: list[str | Path]) -> list[Path]:
    """Paths as given; globs the shell did not expand; directories -> their files (sorted)."""
    out: list[Path] = []
    for src in sources:
        text = str(src)
        matches = sorted(glob.glob(text)) if any(c in text for c in "*?[") else [text]
        if not matches:
            raise ImportInputError(f"{text}: no file matches")
        for m in matches:
            p = Path(m)
            if p.is_dir():
                out.extend(sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith(".")))
            elif p.is_file():
                out.append(p)
            else:
                raise ImportInputError(f"{p} does not exist; pass the dump files (one per rank) or their folder")
    if not out:
        raise ImportInputError("no input files; pass the dump files (one per rank) or their folder")
    return out


def _column_map(items: list[str]) -> dict[str, str]:
    mapping = {}
    for item in items:
        ours, sep, theirs = item.partition("=")
        if not sep or not ours or not theirs:
            raise ImportInputError(f"--column {item!r}: expected OURS=THEIRS, e.g. --column start_ts=begin_s")
        mapping[ours.strip()] = theirs.strip()
    return mapping


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "import", help="turn a trace dump from another tool into a run directory",
        description="Import PyTorch profiler (Kineto) JSON[.gz], NDTimeline-style Parquet or torch "
                    "flight-recorder dumps into a megascope run directory; then analyze/export/dashboard it.")
    p.add_argument("format", metavar="FORMAT", help="kineto | ndtimeline | flight-recorder")
    p.add_argument("sources", metavar="SRC", nargs="+", help="dump files (one per rank), folders or globs")
    p.add_argument("--out", required=True, metavar="RUN",
                   help="new run directory to write, or an object-store URL (s3://bucket/prefix: written locally, "
                        "then uploaded with run.json last)")
    for name in ("dp", "tp", "pp", "vpp"):
        p.add_argument(f"--{name}", type=int, default=None,
                       help=f"{name} size (default: from the dump's process groups / job file)")
    p.add_argument("--cp", type=int, default=None,
                   help="ndtimeline: context (sequence) parallel size, NDTimeline's dsp_size (default 1); "
                        "Megatron rank order tp, cp, dp, pp")
    p.add_argument("--meta", default=None, metavar="JOB.yaml",
                   help="ndtimeline: the job file (dp_size, pp_size, tp_size, dsp_size, vpp_size, world_size); "
                        "flags that contradict it are refused")
    p.add_argument("--column", action="append", default=[], metavar="OURS=THEIRS",
                   help="ndtimeline: read our column OURS from the file's column THEIRS (renamed columns)")
    p.add_argument("--jobs", type=int, default=1, help="kineto: files parsed in parallel (processes)")
    p.add_argument("--job", default=None, metavar="TEXT",
                   help="flight-recorder: when the dumps come from several jobs (told apart by their file names), "
                        "import the one whose file names contain TEXT (default: refuse and list the jobs)")


def run(args: argparse.Namespace) -> int:
    for name in ("dp", "tp", "pp", "vpp", "cp", "jobs"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            print(f"megascope import: --{name} must be >= 1, got {value}", file=sys.stderr)
            return 2
    from megascope.progress import ProgressBar
    from megascope.tracer.storage import is_url, publish, stage_for

    bar = ProgressBar()
    url = args.out if is_url(args.out) else None
    try:  # a URL: imported into a local staging folder, uploaded whole when complete
        out = stage_for(url, hint="pass a new --out prefix") if url else args.out
        result = import_run(args.format, args.sources, out, args.dp, args.tp, args.pp, args.vpp,
                            _column_map(args.column), jobs=args.jobs, progress=bar, cp=args.cp, meta=args.meta,
                            job=args.job)
        if url:
            publish(result.out, url)
    except (ImportInputError, ValueError, OSError) as exc:
        bar.close()
        print(f"megascope import: {exc}", file=sys.stderr)
        return 2
    bar.close()
    for n in result.notes:
        print(f"megascope import: note: {n}", file=sys.stderr)
    for w in result.warnings:
        print(f"megascope import: warning: {w}", file=sys.stderr)
    where = url or result.out  # the URL it was uploaded to, else the local folder
    print(f"imported {len(result.ranks)} rank(s) into {where}; next: megascope analyze {where}")
    if result.failed_sources:
        print(f"megascope import: {len(result.failed_sources)} input(s) could not be read: "
              f"{', '.join(result.failed_sources)}; the other ranks were imported", file=sys.stderr)
        return 2
    return 0
