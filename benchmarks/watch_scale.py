"""Can `megascope watch` follow a big job live? A writer process appends a 12,288-rank run (dp768 x tp8 x
pp2) beside the real `megascope watch` command; this prints the watcher's CPU seconds per step of the job
and how far behind the newest complete step it is, then the 16-rank detection latency (watch_latency.py's
straggler cases) in the same run.

The writer lays segments down as a tracer does, through the tracer's own sink (tracer/sink.py
ParquetSegmentSink: its encodings, zstd, a temporary name renamed into place): every --flush-steps steps
one events and one steps segment per rank (default: the steps a tracer's flush interval holds at that
world size, tracer.config.flush_interval), at --step-s seconds a step, or as fast as it
can when that is faster than this machine writes 24,576 files (it prints the rate it held). Its steps
are a simulated 6-step template (samples/simulator.py, built once into --work): steps 0-2 clean, 3-5
with rank 5 computing 50% slower, replayed with shifted times in random order (the straggler from
--onset on). Edge
summaries: a tracer writes them every 1,000 steps or at close (tracer/edge_summary.py SEGMENT_STEPS),
so none land during this run; the watcher summarizes the events itself (analyzer/watch/live_rows.py).
The watcher's CPU is read from /proc (user + system) once it has taken in its first step, its progress
from its /status endpoint every 0.5 s.

    python benchmarks/watch_scale.py [--ranks 12288] [--steps 40] [--step-s 1] [--flush-steps N] [--work DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megascope.tracer.config import TraceConfig, flush_interval  # noqa: E402
from megascope.tracer.sink import ParquetSegmentSink  # noqa: E402
from tests.watch_feed import simulate_steps  # noqa: E402

CULPRIT = 5
CLEAN = 3
TEMPLATE_STEPS = 2 * CLEAN
"""Steps 0-2 clean, 3-5 with the straggler; each job step replays one of its kind drawn at random (a
cycle would repeat any step-to-step difference at its period, which the late-launch detector flags)."""


def load(ranks: int) -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def build_template(work: Path, ranks: int) -> Path:
    out = work / f"template-{ranks}"
    if (out / "run.json").is_file():
        return out
    t0 = time.perf_counter()
    simulate_steps(out, dp=ranks // 16, tp=8, pp=2, steps=TEMPLATE_STEPS, micro_batches=4,
                   inject=[f"straggler:rank={CULPRIT},slowdown=0.5,from={CLEAN}"])
    print(f"template: {ranks} ranks x {TEMPLATE_STEPS} steps simulated in {time.perf_counter() - t0:.0f} s",
          flush=True)
    return out


# ---- the writer (a process of its own) ------------------------------------------------------------

def read_table(template: Path, table: str) -> pa.Table:
    files = sorted((template / table).glob("rank=*/*.parquet"))
    return pa.concat_tables([pq.read_table(f, partitioning=None) for f in files])


def write(template: Path, live: Path, steps: int, onset: int, step_s: float, flush_steps: int, log: Path) -> None:
    """Append the run to `live`: every flush_steps steps one segment per rank and table."""
    manifest = json.loads((template / "run.json").read_text())
    # no step count: the watcher never takes the run for finished, so its final verdict (a full
    # `analyze`) stays out of the measurement; the benchmark stops it
    manifest.setdefault("config", {}).setdefault("train", {}).pop("steps", None)
    tables = {t: read_table(template, t) for t in ("events", "steps")}
    period = max(int(pc.max(pc.subtract(tables["steps"]["end_ns"], tables["steps"]["start_ns"])).as_py()), 1)
    t_start = {t: int(pc.min(tables["steps"].filter(pc.equal(tables["steps"]["step"], t))["start_ns"]).as_py())
               for t in range(TEMPLATE_STEPS)}
    by_step = {t: {name: tab.filter(pc.equal(tab["step"], t)) for name, tab in tables.items()}
               for t in range(TEMPLATE_STEPS)}
    live.mkdir(parents=True)
    (live / "run.json").write_text(json.dumps(manifest))
    base = time.time_ns()
    rng = np.random.default_rng(0)
    sinks: dict[int, ParquetSegmentSink] = {}
    began = time.monotonic()
    with log.open("w") as out:
        for first in range(0, steps, flush_steps):
            last = min(steps, first + flush_steps) - 1
            due = began + (last + 1) * step_s
            if time.monotonic() < due:
                time.sleep(due - time.monotonic())
            batch = {name: [] for name in tables}
            for s in range(first, last + 1):
                t = int(rng.integers(CLEAN)) + (CLEAN if s >= onset else 0)
                shift = base + s * period - t_start[t]
                for name, tab in by_step[t].items():
                    cols = {c: tab[c] for c in tab.column_names}
                    cols["step"] = pa.array(np.full(tab.num_rows, s, dtype=np.int64))
                    for c in ("start_ns", "end_ns"):
                        cols[c] = pc.add(tab[c], shift)
                    batch[name].append(pa.table(cols, schema=tab.schema))
            for name, parts in batch.items():
                whole = pa.concat_tables(parts)
                whole = whole.take(pc.sort_indices(whole["rank"]))
                ranks = whole["rank"].to_numpy()
                cuts = np.flatnonzero(np.diff(ranks)) + 1
                for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(ranks)]):
                    # the tracer's files, not pyarrow's defaults (snappy, every column dictionary-encoded):
                    # DuckDB read those ~20% slower (0.23 vs 0.19 ms an events segment, 0.20 vs 0.15 a steps one)
                    rank = int(ranks[lo])
                    sink = sinks.get(rank) or sinks.setdefault(rank, ParquetSegmentSink(live, rank))
                    sink.write(name, whole.slice(lo, hi - lo))
            out.write(json.dumps({"step": last, "at": time.time()}) + "\n")
            out.flush()


# ---- the watcher beside it -----------------------------------------------------------------------

def cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def status(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def follow(template: Path, work: Path, args: argparse.Namespace) -> dict:
    live = work / "live"
    shutil.rmtree(live, ignore_errors=True)
    log = work / "writer.jsonl"
    writer = subprocess.Popen([sys.executable, __file__, "--writer", str(template), str(live), str(args.steps),
                               str(args.onset), str(args.step_s), str(args.flush_steps), str(log)])
    while not (live / "run.json").is_file() and writer.poll() is None:
        time.sleep(0.2)
    port = free_port()
    watcher = subprocess.Popen([sys.executable, "-m", "megascope", "watch", str(live), "--poll", "1",
                                "--metrics-port", str(port), *args.watch_args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples: list[tuple[float, dict]] = []
    cpu0 = cpu1 = None
    try:
        while True:
            now = time.time()
            st = status(port)
            if st is not None:
                samples.append((now, st))
                if cpu0 is None and st["progress"].get("summarized_step") is not None:
                    cpu0 = (cpu_s(watcher.pid), st["progress"]["summarized_step"], now, st)
            done = writer.poll() is not None
            last = st["progress"].get("summarized_step") if st else None
            judged = st["progress"].get("analyzed_step") if st else None
            if last == args.steps - 1 and cpu1 is None:
                cpu1 = (cpu_s(watcher.pid), now)  # every step read and summarized
            # the last judgement may wait for more steps (--judge-cpu): 60 s for it, then stop
            if cpu1 is not None and (judged == args.steps - 1 or now - cpu1[1] > 60):
                break
            if watcher.poll() is not None or (done and cpu1 is None and samples and now - samples[-1][0] > 600):
                break
            time.sleep(0.5)
        if cpu1 is not None and watcher.poll() is None:
            cpu1 = (cpu_s(watcher.pid), cpu1[1], status(port))  # the last judgement included
    finally:
        watcher.send_signal(signal.SIGINT)
        try:
            out, err = watcher.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            watcher.kill()
            out, err = watcher.communicate()
        writer.wait()
    flushed = [json.loads(line) for line in log.read_text().splitlines()]
    return {"samples": samples, "cpu0": cpu0, "cpu1": cpu1, "flushed": flushed, "stdout": out, "stderr": err}


def lag(flushed: list[dict], samples: list[tuple[float, dict]], key: str) -> list[float]:
    """Per flush: seconds from the writer renaming its last segment to the first /status whose `key`
    step reached that flush's last step."""
    out = []
    for f in flushed:
        seen = next((t for t, st in samples if (st["progress"].get(key) or -1) >= f["step"]), None)
        if seen is not None:
            out.append(max(0.0, seen - f["at"]))
    return out


def phases(first: dict, last: dict | None, steps: int, step_s: float) -> None:
    """The watcher's own account of its CPU (/status cpu_s) over the same steps, per phase and job step.
    Listing is paid per poll (--poll 1: one a second), the rest per step: at the job's --step-s a step
    costs the other phases plus step-s polls, whatever rate this writer held."""
    if last is None or "cpu_s" not in first or "cpu_s" not in (last or {}):
        return
    spent = {k: last["cpu_s"][k] - first["cpu_s"].get(k, 0.0) for k in last["cpu_s"]}
    polls = max(1, last["polls"] - first["polls"])
    per_poll = spent["listing"] / polls
    rest = sum(v for k, v in spent.items() if k != "listing") / max(1, steps)
    print("\nper phase (the watcher's /status cpu_s, same span), CPU s per job step; listing also per poll")
    print("\n| listing | reading | summarizing | judging | polls / job step | listing / poll | "
          f"at {1 / step_s:g} step/s: phases + {step_s:g} poll(s) a step |")
    print("|---|---|---|---|---|---|---|")
    print("| " + " | ".join(f"{spent[k] / max(1, steps):.2f}" for k in ("listing", "reading", "summarizing", "judging"))
          + f" | {polls / max(1, steps):.1f} | {per_poll:.3f} | {rest + per_poll * step_s:.2f} |")


def latency_16() -> list[str]:
    from benchmarks.watch_latency import CASES, run_case
    rows = []
    for case in CASES:
        if case.name not in ("straggler 20%", "held-out trace: straggler 1.3x"):
            continue
        with tempfile.TemporaryDirectory(prefix="watch-scale-lat-") as tmp:
            with contextlib.redirect_stdout(io.StringIO()):
                latency, false, ticks = run_case(case, 0, Path(tmp))
        rows.append(f"| {case.name} | {latency} | {false} | {statistics.median(ticks):.2f} | {max(ticks):.2f} |")
    return rows


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--writer":
        t, live, steps, onset, step_s, flush, log = sys.argv[2:9]
        write(Path(t), Path(live), int(steps), int(onset), float(step_s), int(flush), Path(log))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=int, default=12288, help="world size (a multiple of 16: tp8 x pp2)")
    p.add_argument("--steps", type=int, default=40, help="steps the writer appends")
    p.add_argument("--onset", type=int, default=20, help="first step of the straggler (rank 5, 1.5x compute)")
    p.add_argument("--step-s", type=float, default=1.0, help="the job's step time the writer aims at")
    p.add_argument("--flush-steps", type=int, default=None,
                   help="steps per segment (default: the tracer's flush interval for --ranks ranks at --step-s, "
                        "tracer.config.flush_interval: 5 s up to 2,000 ranks, 30.7 s at 12,288)")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "megascope-watch-scale",
                   help="where the template (kept for reruns) and the live run go")
    p.add_argument("--watch-args", nargs=argparse.REMAINDER, default=["--no-summary"],
                   help="options for `megascope watch` (last on the line)")
    p.add_argument("--no-latency", action="store_true", help="skip the 16-rank latency cases")
    args = p.parse_args()
    if args.ranks % 16:
        p.error("--ranks must be a multiple of 16 (tp8 x pp2)")
    if args.flush_steps is None:
        args.flush_steps = max(1, round(flush_interval(TraceConfig(), args.ranks) / args.step_s))
    args.work.mkdir(parents=True, exist_ok=True)
    print(f"load average at the start: {load(0)}", flush=True)
    template = build_template(args.work, args.ranks)
    r = follow(template, args.work, args)
    flushed, samples = r["flushed"], r["samples"]
    written_s = flushed[-1]["at"] - flushed[0]["at"] if len(flushed) > 1 else float("nan")
    rate = (flushed[-1]["step"] - flushed[0]["step"]) / written_s if len(flushed) > 1 else float("nan")
    print(f"\nwriter: {args.steps} steps x {args.ranks} ranks, {len(flushed)} flushes of {args.flush_steps} steps; "
          f"held {rate:.2f} steps/s (aimed at {1 / args.step_s:.2f})")
    cpu0, cpu1 = r["cpu0"], r["cpu1"]
    if cpu0 is None or cpu1 is None:
        print("the watcher did not get going:", r["stderr"][-2000:])
        return 1
    steps = args.steps - 1 - cpu0[1]
    per_step = (cpu1[0] - cpu0[0]) / max(1, steps)
    ingest = lag(flushed, samples, "summarized_step")
    judged = lag(flushed, samples, "analyzed_step")
    st = samples[-1][1]
    print("\nwatcher CPU (user + system, /proc) from its first summarized step to its last judgement: "
          "listing, reading, summarizing, judging")
    print("\n| ranks | job steps followed | watcher CPU s / job step | lag to summarized, median / max s | "
          "lag to judged, median / max s | last judgement CPU s | load |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {args.ranks:,} | {steps} | {per_step:.2f} | {statistics.median(ingest):.1f} / {max(ingest):.1f} | "
          f"{statistics.median(judged):.1f} / {max(judged):.1f} | {st.get('judge_cpu_s', 0):.1f} | {load(0)} |"
          if ingest and judged else f"| {args.ranks} | {steps} | {per_step:.2f} | - | - | - | {load(0)} |")
    found = [line for line in r["stdout"].splitlines() if "NEW" in line]
    phases(cpu0[3], cpu1[2] if len(cpu1) > 2 else None, steps, args.step_s)
    print("\nannounced:", *(found or ["nothing"]), sep="\n  ")
    if not args.no_latency:
        print("\n| 16 ranks (watch_latency.py, seed 0) | latency (steps) | false | tick median s | tick max s |")
        print("|---|---|---|---|---|")
        for row in latency_16():
            print(row, flush=True)
    print(f"\nload average at the end: {load(0)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
