"""Huge traces in bounded memory: a generated multi-rank Kineto trace set (one trace per rank, even ranks
plain JSON and odd ranks .json.gz, the CPU training loop of import_throughput.py) imported by `megascope
import kineto` in a fresh process; peak RSS (the whole process tree, sampled every 50 ms) and MB/s of
uncompressed JSON printed per set size, so memory can be read against trace size side by side; then
Holistic Trace Analysis's own loader (`TraceAnalysis(trace_dir=...)`, which parses every rank into
pandas) and ours on a subset HTA can hold; and one file grown (`--single-gb`): a single-rank trace of
each size imported alone (--jobs 1), so what one file's conversion holds can be read against its size.

    python benchmarks/import_memory.py [--gb 10] [--ranks 8] [--jobs 2] [--sizes 0.1,1]
                                       [--single-gb 0.5,1,2]
                                       [--hta-python /tmp/hta-venv/bin/python] [--hta-mb 200]

`--gb` is the total uncompressed size of the largest set (the issue's goal is >= 10 GB); `--sizes`
are the fractions of --gb imported (a smaller set shows that memory does not grow with size; '' for
none). `--single-gb` are the sizes of the single-rank files (plain JSON; none by default). The
sets are generated streaming, two ranks at a time, and removed after use. HTA runs with the
interpreter given by --hta-python (a venv with `pip install HolisticTraceAnalysis`: it pins its own
pandas), skipped when none is given.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
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


def _one(job: tuple[Path, float, int, int]) -> int:
    path, mb, rank, world = job
    return generate(path, mb, rank=rank, world=world)


def write_set(folder: Path, total_mb: float, ranks: int) -> tuple[int, float, float]:
    """One trace per rank, total_mb MB of JSON in all (odd ranks gzip-compressed as they are written).
    Returns (events, MB of JSON, seconds)."""
    folder.mkdir(parents=True, exist_ok=True)
    jobs = [(folder / f"trace_rank{r}.json{'.gz' if r % 2 else ''}", total_mb / ranks, r, ranks) for r in range(ranks)]
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(2) as pool:
        events = sum(pool.map(_one, jobs))
    return events, total_mb, time.perf_counter() - t0


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
    try:
        return measure([sys.executable, "-m", "megascope.cli", "import", "kineto", str(src), "--out", str(out),
                        "--jobs", str(jobs)])
    finally:
        shutil.rmtree(out, ignore_errors=True)


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--gb", type=float, default=10.0, help="total uncompressed JSON of the largest set (GB)")
    p.add_argument("--sizes", default="0.1,1", help="fractions of --gb to import, comma-separated")
    p.add_argument("--single-gb", default="", help="sizes (GB of JSON) of single-rank files imported one by one, "
                   "comma-separated (none: skipped)")
    p.add_argument("--ranks", type=int, default=8, help="ranks (one trace file each)")
    p.add_argument("--jobs", type=int, default=2, help="megascope import --jobs (files parsed in parallel)")
    p.add_argument("--hta-python", default=None, help="python with HolisticTraceAnalysis installed (none: skip)")
    p.add_argument("--hta-mb", type=float, default=200.0, help="total JSON of the 2-rank subset HTA loads (MB)")
    p.add_argument("--out", default="/tmp/megascope-import-memory", help="scratch folder (removed at the end)")
    args = p.parse_args()
    root = Path(args.out)
    shutil.rmtree(root, ignore_errors=True)
    try:
        if args.sizes:
            sets(root, args)
        if args.single_gb:
            single_files(root, [float(g) for g in args.single_gb.split(",")])
        if args.hta_python:
            hta_subset(root / "hta-subset", args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def sets(root: Path, args: argparse.Namespace) -> None:
    print(f"{args.ranks} ranks (even: JSON, odd: JSON.gz), megascope import --jobs {args.jobs}, {os.cpu_count()} "
          f"cores\n")
    print("| set (uncompressed) | on disk | generated in (s) | import wall (s) | MB/s | events/s "
          "| peak RSS, all processes (MB) | load |")
    print("|---|---|---|---|---|---|---|---|")
    for frac in sorted(float(f) for f in args.sizes.split(",")):
        folder = root / f"set-{frac:g}"
        events, mb, gen_s = write_set(folder, args.gb * 1000 * frac, args.ranks)
        disk = sum(f.stat().st_size for f in folder.iterdir()) / 1e9
        wall, rss = ours(folder, root / "run", args.jobs)
        print(f"| {mb / 1000:.2f} GB | {disk:.2f} GB | {gen_s:.0f} | {wall:.0f} | {mb / wall:.1f} | "
              f"{events / wall:,.0f} | {rss:,.0f} | {load()} |", flush=True)
        shutil.rmtree(folder)


def single_files(root: Path, sizes: list[float]) -> None:
    """One rank's file of each size, generated and imported alone (--jobs 1: one process)."""
    print("\nOne file grown: a single-rank trace (plain JSON) imported by itself, --jobs 1\n")
    print("| file (1 rank) | events | generated in (s) | import wall (s) | MB/s | peak RSS (MB) | load |")
    print("|---|---|---|---|---|---|---|")
    peaks = []
    for gb in sorted(sizes):
        root.mkdir(parents=True, exist_ok=True)
        path = root / f"rank0-{gb:g}gb.json"
        t0 = time.perf_counter()
        events = generate(path, gb * 1000)
        gen_s = time.perf_counter() - t0
        mb = path.stat().st_size / 1e6
        wall, rss = ours(path, root / "run", 1)
        path.unlink()
        peaks.append(rss)
        print(f"| {mb / 1000:.2f} GB | {events:,} | {gen_s:.0f} | {wall:.0f} | {mb / wall:.1f} | {rss:,.0f} | "
              f"{load()} |", flush=True)
    print(f"\npeak RSS from the smallest to the largest file: {peaks[0]:,.0f} -> {peaks[-1]:,.0f} MB "
          f"({peaks[-1] - peaks[0]:+,.0f} MB)")


def hta_subset(folder: Path, args: argparse.Namespace) -> None:
    events, mb, _ = write_set(folder, args.hta_mb, 2)
    print(f"\nSubset both load: 2 ranks (rank 0 JSON, rank 1 JSON.gz), {mb:.0f} MB JSON, {events:,} events\n")
    print("| loader | wall (s) | MB/s | peak RSS, all processes (MB) | load |")
    print("|---|---|---|---|---|")
    wall, rss = ours(folder, folder.parent / "run", args.jobs)
    print(f"| megascope import kineto --jobs {args.jobs} | {wall:.1f} | {mb / wall:.1f} | {rss:,.0f} | {load()} |",
          flush=True)
    wall, rss = measure([args.hta_python, "-c", HTA, str(folder)])
    print(f"| HTA TraceAnalysis(trace_dir) | {wall:.1f} | {mb / wall:.1f} | {rss:,.0f} | {load()} |", flush=True)


if __name__ == "__main__":
    main()
