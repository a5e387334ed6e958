"""Huge traces in bounded memory: a generated multi-rank Kineto trace set (one JSON and one .json.gz per
rank, the CPU training loop of import_throughput.py) imported by `megascope import kineto` in a fresh
process, peak RSS (the whole process tree, sampled every 50 ms) and MB/s printed per size, so memory
can be read against trace size side by side; then Holistic Trace Analysis's own loader
(`TraceAnalysis(trace_dir=...)`, which parses every rank into pandas) and ours on a subset HTA can hold.

    python benchmarks/import_memory.py [--gb 10] [--ranks 8] [--jobs 2] [--sizes 0.25,1]
                                       [--hta-python /tmp/hta-venv/bin/python] [--hta-mb 40]

`--gb` is the total uncompressed size of the largest set (the issue's goal is >= 10 GB); `--sizes`
adds smaller sets (fractions of --gb) to show that memory does not grow with size. HTA is run with
the interpreter given by --hta-python (a venv with `pip install holistictraceanalysis`; it pins its
own pandas), skipped when none is given.
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from import_throughput import generate  # noqa: E402  (a sibling script, not a package)

HTA = r"""
import sys
from hta.trace_analysis import TraceAnalysis
TraceAnalysis(trace_dir=sys.argv[1])
"""


def write_set(folder: Path, total_mb: float, ranks: int) -> tuple[int, float]:
    """One trace per rank, total_mb MB of JSON in all, plus a .json.gz copy of each in folder/gz.
    Returns (events, MB of JSON)."""
    (folder / "json").mkdir(parents=True, exist_ok=True)
    (folder / "gz").mkdir(exist_ok=True)
    events = 0
    for rank in range(ranks):
        src = folder / "json" / f"trace_rank{rank}.json"
        events += generate(src, total_mb / ranks, rank=rank, world=ranks)
        with open(src, "rb") as f_in, gzip.open(folder / "gz" / f"{src.name}.gz", "wb", compresslevel=3) as f_out:
            shutil.copyfileobj(f_in, f_out)
    mb = sum(p.stat().st_size for p in (folder / "json").iterdir()) / 1e6
    return events, mb


def measure(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS in MB of the process and all its children together)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    root = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}): {proc.stderr.read()[-2000:]}")
    return wall, peak / 2**20


def ours(src: Path, out: Path, jobs: int) -> tuple[float, float]:
    shutil.rmtree(out, ignore_errors=True)
    return measure([sys.executable, "-m", "megascope.cli", "import", "kineto", str(src), "--out", str(out),
                    "--jobs", str(jobs)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--gb", type=float, default=10.0, help="total uncompressed JSON of the largest set (GB)")
    p.add_argument("--sizes", default="0.25,1", help="fractions of --gb to import, comma-separated")
    p.add_argument("--ranks", type=int, default=8, help="ranks (one trace file each)")
    p.add_argument("--jobs", type=int, default=2, help="megascope import --jobs (files parsed in parallel)")
    p.add_argument("--hta-python", default=None, help="python with holistictraceanalysis installed (none: skip)")
    p.add_argument("--hta-mb", type=float, default=40.0, help="total JSON of the subset HTA loads (MB)")
    p.add_argument("--out", default="/tmp/megascope-import-memory", help="scratch folder (removed at the end)")
    args = p.parse_args()
    root = Path(args.out)
    shutil.rmtree(root, ignore_errors=True)
    print(f"{args.ranks} ranks, megascope import --jobs {args.jobs}\n")
    print("| set | input | wall (s) | MB/s (uncompressed) | events/s | peak RSS, all processes (MB) |")
    print("|---|---|---|---|---|---|")
    try:
        for frac in sorted(float(f) for f in args.sizes.split(",")):
            folder = root / f"set-{frac:g}"
            t0 = time.perf_counter()
            events, mb = write_set(folder, args.gb * 1000 * frac, args.ranks)
            print(f"<!-- generated {events:,} events, {mb:,.0f} MB in {time.perf_counter() - t0:.0f} s -->",
                  file=sys.stderr)
            for label in ("json", "gz"):
                wall, rss = ours(folder / label, root / "run", args.jobs)
                print(f"| {mb / 1000:.2f} GB | {'JSON' if label == 'json' else 'JSON.gz'} | {wall:.0f} | "
                      f"{mb / wall:.1f} | {events / wall:,.0f} | {rss:,.0f} |", flush=True)
            shutil.rmtree(folder)
        if args.hta_python:
            folder = root / "hta-subset"
            events, mb = write_set(folder, args.hta_mb, min(args.ranks, 2))
            print(f"\nSubset for HTA: {min(args.ranks, 2)} ranks, {mb:.0f} MB JSON, {events:,} events\n")
            print("| loader | input | wall (s) | MB/s | peak RSS, all processes (MB) |")
            print("|---|---|---|---|---|")
            for label in ("json", "gz"):
                name = "JSON" if label == "json" else "JSON.gz"
                wall, rss = ours(folder / label, root / "run", args.jobs)
                print(f"| megascope import kineto | {name} | {wall:.1f} | {mb / wall:.1f} | {rss:,.0f} |", flush=True)
                wall, rss = measure([args.hta_python, "-c", HTA, str(folder / label)])
                print(f"| HTA TraceAnalysis | {name} | {wall:.1f} | {mb / wall:.1f} | {rss:,.0f} |", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
