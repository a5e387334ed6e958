"""An independent generator of 3D-parallel training traces, for accuracy tests that do not come from
the project's own timing model (it shares no code with the simulator beside it): a discrete-event
replay of Megatron's 1F1B schedule with blocking, rendezvous p2p transfers, written as NDTimeline-style
Parquet plus a job file, so every case goes through the importer a user runs (`megascope import ndtimeline`).

Model (per step; every step ends with a job-wide sync, so steps are computed for all steps at once):
- ranks in Megatron order tp, cp, dp, pp; the tp x cp ranks of one (dp replica, stage) form a group
  that runs every compute op in `chunks` pieces with a collective after each: the group waits for its
  slowest member, so every member's span ends together (its own start, the group's end);
- 1F1B with `micro` micro-batches (warm-up forwards, one-forward-one-backward, cool-down backwards),
  p2p ops as Megatron posts them (send_forward, send_forward_recv_backward, ...): a transfer starts when
  both sides have posted and both ops end when their transfers are done;
- after the last backward, a dp gradient all-reduce per stage (ends when the last replica posted),
  the optimizer, then the job-wide sync (gradient clipping's norm all-reduce) that ends the step.
Noise (all drawn before any fault is applied, so a spec and its fault-free twin share every draw):
per compute piece log-normal, Student-t (on the log scale) or Pareto (multiplicative, heavy-tailed);
a per (rank, step) factor (host contention); GC pauses on any rank (a `gc` row before a forward, the
group waits); a per (replica, step, micro-batch) workload factor (sequence lengths), shared by every
rank of the replica; p2p jitter. Faults: slow ranks (forward/backward factors over a step range,
from step 0 on if wanted) and host pauses (late launches, recorded as `gc` rows or untraced), several
at once. Partial traces: only tp rank 0 of each tp group, and
whole (dp, stage) workers left out.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd


@dataclass
class Noise:
    kind: str = "lognormal"
    """Per compute piece: lognormal | student_t (exp(sigma * t_dof)) | pareto (1 + sigma * Pareto(alpha))."""
    sigma: float = 0.02
    dof: float = 3.0
    pareto_alpha: float = 2.5
    step_sigma: float = 0.0
    """Log-normal factor per (rank, step) on all the rank's compute: host contention, heavy per-step noise."""
    gc_prob: float = 0.0
    """Probability of a GC pause per rank and step (before a random forward); pause ~ Exponential(gc_s)."""
    gc_s: float = 0.0
    seq_sigma: float = 0.0
    """Log-normal work factor per (replica, step, micro-batch): sequence-length imbalance."""
    seq_kind: str = "lognormal"
    """lognormal | student_t (heavy-tailed on the log scale, `dof`: a few very long documents)."""
    seq_rho: float = 0.0
    """Step-to-step correlation of that factor (AR(1)): a replica draws long sequences for a while
    (length-bucketed loaders), which step-to-step noise estimates underrate."""
    p2p_sigma: float = 0.0
    """Log-normal jitter of each p2p transfer's time."""


@dataclass
class SlowRank:
    """A slow GPU at (dp, stage, tp, cp): its compute pieces take `fwd` / `bwd` times longer."""
    dp: int
    stage: int
    tp: int = 0
    cp: int = 0
    fwd: float = 1.5
    bwd: float = 1.5
    first: int = 0
    last: int | None = None


@dataclass
class HostPause:
    """A rank whose host stalls before a forward (GC storms, CPU contention: a late launch) with
    probability `prob` per step, for `pause_s` x Uniform(0.5, 1.5); `recorded`: as an NDTimeline `gc` row,
    else untraced (a gap between ops)."""
    dp: int
    stage: int
    tp: int = 0
    cp: int = 0
    prob: float = 0.5
    pause_s: float = 0.02
    first: int = 0
    last: int | None = None
    recorded: bool = False


@dataclass
class GenSpec:
    dp: int = 2
    tp: int = 1
    pp: int = 2
    cp: int = 1
    steps: int = 20
    micro: int = 4
    fwd_s: float = 0.010
    """Forward time of one micro-batch on one stage (backward: `bwd_ratio` times that)."""
    bwd_ratio: float = 2.0
    chunks: int = 2
    """Compute pieces per op, each followed by a tp/cp collective that syncs the group."""
    stage_work: tuple[float, ...] | None = None
    """Relative work per stage (a partition imbalance); None: equal."""
    p2p_s: float = 2e-4
    allreduce_s: float = 2e-3
    optimizer_s: float = 1e-3
    step_gap_s: float = 1e-3
    noise: Noise = field(default_factory=Noise)
    faults: list[SlowRank | HostPause] = field(default_factory=list)
    seed: int = 0
    traced: str = "all"
    """all | tp0 (one worker per tensor-parallel group: tp rank 0)."""
    missing: list[tuple[int, int]] = field(default_factory=list)
    """(dp, stage) workers with no rows in the trace."""
    t0: float = 1_700_000_000.0

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def rank(self, dp: int, stage: int, tp: int = 0, cp: int = 0) -> int:
        """Megatron order: tp fastest, then cp, dp, pp."""
        return ((stage * self.dp + dp) * self.cp + cp) * self.tp + tp

    def fault_free(self) -> GenSpec:
        return replace(self, faults=[])


# ---- random draws (all of them, before faults) ----------------------------------------------------

@dataclass
class _Draws:
    fwd: np.ndarray   # (S, D, P, G, M, K) compute piece factors
    bwd: np.ndarray
    step: np.ndarray  # (S, D, P, G)
    seq: np.ndarray   # (S, D, M)
    gc: np.ndarray    # (S, D, P, G) pause seconds (0: none)
    gc_mb: np.ndarray  # (S, D, P, G) the forward it precedes
    p2p: np.ndarray   # (S, D, P, M, 2) transfer factors (boundary below stage p, F/B)
    opt: np.ndarray   # (S, D, P, G)
    # (S, D, P, G) host pauses of HostPause faults (drawn from their own streams; set with the others)
    pause: np.ndarray = field(default_factory=lambda: np.empty(0))
    pause_mb: np.ndarray = field(default_factory=lambda: np.empty(0, int))
    pause_recorded: np.ndarray = field(default_factory=lambda: np.empty(0, bool))


def _piece_noise(rng: np.random.Generator, n: Noise, shape: tuple[int, ...]) -> np.ndarray:
    if n.sigma <= 0:
        return np.ones(shape)
    if n.kind == "lognormal":
        return np.exp(rng.normal(0.0, n.sigma, shape))
    if n.kind == "student_t":
        return np.exp(np.clip(n.sigma * rng.standard_t(n.dof, shape), -3.0, 3.0))
    if n.kind == "pareto":
        return 1.0 + n.sigma * rng.pareto(n.pareto_alpha, shape)
    raise ValueError(f"unknown noise kind {n.kind!r}; use lognormal, student_t or pareto")


def _draw(spec: GenSpec) -> _Draws:
    rng = np.random.default_rng(spec.seed)
    n = spec.noise
    S, D, P, G, M, K = spec.steps, spec.dp, spec.pp, spec.tp * spec.cp, spec.micro, spec.chunks
    fwd = _piece_noise(rng, n, (S, D, P, G, M, K))
    bwd = _piece_noise(rng, n, (S, D, P, G, M, K))
    step = np.exp(rng.normal(0.0, n.step_sigma, (S, D, P, G)))
    if n.seq_kind == "student_t":
        seq_log = n.seq_sigma * np.clip(rng.standard_t(n.dof, (S, D, M)), -10.0, 10.0)
    elif n.seq_kind == "lognormal":
        seq_log = rng.normal(0.0, n.seq_sigma, (S, D, M))
    else:
        raise ValueError(f"unknown seq_kind {n.seq_kind!r}; use lognormal or student_t")
    for k in range(1, S if n.seq_rho else 0):  # AR(1) over steps, same stationary sigma
        seq_log[k] = n.seq_rho * seq_log[k - 1] + math.sqrt(1 - n.seq_rho ** 2) * seq_log[k]
    seq = np.exp(seq_log)
    gc_hit = rng.random((S, D, P, G)) < n.gc_prob
    gc = np.where(gc_hit, rng.exponential(max(n.gc_s, 1e-12), (S, D, P, G)), 0.0)
    gc_mb = rng.integers(0, M, (S, D, P, G))
    p2p = np.exp(rng.normal(0.0, n.p2p_sigma, (S, D, P, M, 2)))
    opt = np.exp(rng.normal(0.0, 0.01, (S, D, P, G)))
    draws = _Draws(fwd, bwd, step, seq, gc, gc_mb, p2p, opt)
    _host_pauses(spec, draws)
    return draws


def _host_pauses(spec: GenSpec, d: _Draws) -> None:
    """HostPause faults draw from their own random streams: the base draws stay those of the fault-free twin."""
    shape = d.gc.shape
    d.pause, d.pause_mb, d.pause_recorded = np.zeros(shape), np.zeros(shape, int), np.zeros(shape, bool)
    for i, f in enumerate(spec.faults):
        if not isinstance(f, HostPause):
            continue
        rng = np.random.default_rng([spec.seed, i + 1])
        g, steps = f.cp * spec.tp + f.tp, slice(f.first, None if f.last is None else f.last + 1)
        n = len(range(spec.steps)[steps])
        hit = rng.random(n) < f.prob
        d.pause[steps, f.dp, f.stage, g] += np.where(hit, f.pause_s * rng.uniform(0.5, 1.5, n), 0.0)
        d.pause_mb[steps, f.dp, f.stage, g] = rng.integers(0, spec.micro, n)
        d.pause_recorded[steps, f.dp, f.stage, g] = f.recorded


def _compute_times(spec: GenSpec, d: _Draws) -> tuple[np.ndarray, np.ndarray]:
    """Per-piece seconds (S, D, P, G, M, K) for forward and backward, faults applied last."""
    work = np.asarray(spec.stage_work or [1.0] * spec.pp, dtype=float)[None, None, :, None, None, None]
    base = d.step[..., None, None] * d.seq[:, :, None, None, :, None] * work / spec.chunks
    fwd = spec.fwd_s * base * d.fwd
    bwd = spec.fwd_s * spec.bwd_ratio * base * d.bwd
    for f in spec.faults:
        if not isinstance(f, SlowRank):
            continue
        g = f.cp * spec.tp + f.tp
        steps = slice(f.first, None if f.last is None else f.last + 1)
        fwd[steps, f.dp, f.stage, g] *= f.fwd
        bwd[steps, f.dp, f.stage, g] *= f.bwd
    return fwd, bwd


# ---- the 1F1B program of one stage -----------------------------------------------------------------

def _program(s: int, P: int, M: int) -> list[tuple]:
    """Megatron's 1F1B for stage s: ("F"|"B", mb) compute, ("comm", [(role, dir, mb, boundary)])."""
    def send_f(i): return [("send", "F", i, s)] if s < P - 1 else []
    def recv_f(i): return [("recv", "F", i, s - 1)] if s > 0 else []
    def send_b(i): return [("send", "B", i, s - 1)] if s > 0 else []
    def recv_b(i): return [("recv", "B", i, s)] if s < P - 1 else []

    warm = min(P - s - 1, M)
    rem = M - warm
    prog: list[tuple] = []
    for i in range(warm):
        prog += [("comm", recv_f(i)), ("F", i), ("comm", send_f(i))]
    if rem:
        prog.append(("comm", recv_f(warm)))
    for i in range(rem):
        prog += [("F", warm + i), ("comm", send_f(warm + i) + recv_b(i)), ("B", i)]
        prog.append(("comm", send_b(i) + ([] if i == rem - 1 else recv_f(warm + i + 1))))
    for i in range(warm):
        prog += [("comm", recv_b(rem + i)), ("B", rem + i), ("comm", send_b(rem + i))]
    return [op for op in prog if op[0] != "comm" or op[1]]


def _optype(comm: list[tuple]) -> str:
    parts = {(role, direction) for role, direction, _, _ in comm}
    names = {("send", "F"): "forward-send", ("recv", "F"): "forward-recv",
             ("send", "B"): "backward-send", ("recv", "B"): "backward-recv"}
    if parts == {("send", "F"), ("recv", "B")}:
        return "forward-send-backward-recv"
    if parts == {("send", "B"), ("recv", "F")}:
        return "backward-send-forward-recv"
    (only,) = parts
    return names[only]


# ---- simulation ---------------------------------------------------------------------------------

@dataclass
class _Op:
    stage: int
    optype: str
    mb: int
    start: np.ndarray  # (S, D, G) seconds from the step's start
    end: np.ndarray


def _simulate(spec: GenSpec) -> tuple[list[_Op], np.ndarray]:
    """Every op of every group (times relative to the step's start) and the step lengths (S,)."""
    d = _draw(spec)
    fwd, bwd = _compute_times(spec, d)
    S, D, P, M = spec.steps, spec.dp, spec.pp, spec.micro
    progs = [_program(s, P, M) for s in range(P)]
    pos = [0] * P
    free = [np.zeros((S, D)) for _ in range(P)]
    posts: dict[tuple, dict[str, np.ndarray]] = {}
    ops: list[_Op] = []
    while any(pos[s] < len(progs[s]) for s in range(P)):
        progressed = False
        for s in range(P):
            while pos[s] < len(progs[s]):
                op = progs[s][pos[s]]
                if op[0] in ("F", "B"):
                    ops += _compute(spec, s, op[0], op[1], free, fwd if op[0] == "F" else bwd, d)
                elif not _comm(spec, s, op[1], free, posts, d, ops):
                    break
                pos[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"1F1B program deadlocked at {pos} (a generator bug)")
    step_len = _step_end(spec, free, d, ops)
    return ops, step_len


def _compute(spec: GenSpec, s: int, kind: str, mb: int, free: list[np.ndarray], pieces: np.ndarray,
             d: _Draws) -> list[_Op]:
    """A group's compute op: members start when free (after their GC pause, before forwards), the
    group syncs after each piece (tp/cp collectives), so all members end with the slowest."""
    c = pieces[:, :, s, :, mb, :]                               # (S, D, G, K)
    out = []
    start = np.repeat(free[s][:, :, None], c.shape[2], axis=2)  # (S, D, G)
    if kind == "F":
        pause = np.where(d.gc_mb[:, :, s, :] == mb, d.gc[:, :, s, :], 0.0)
        host = np.where(d.pause_mb[:, :, s, :] == mb, d.pause[:, :, s, :], 0.0)
        pause = pause + np.where(d.pause_recorded[:, :, s, :], host, 0.0)
        if pause.any():
            out.append(_Op(s, "gc", -1, start.copy(), start + pause))
        start = start + pause + np.where(d.pause_recorded[:, :, s, :], 0.0, host)  # untraced: a gap
    end = (start + c[..., 0]).max(axis=2)
    end = end + c[..., 1:].max(axis=2).sum(axis=-1)
    free[s] = end
    out.append(_Op(s, "forward-compute" if kind == "F" else "backward-compute", mb, start,
                   np.repeat(end[:, :, None], c.shape[2], axis=2)))
    return out


def _comm(spec: GenSpec, s: int, comm: list[tuple], free: list[np.ndarray], posts: dict, d: _Draws,
          ops: list[_Op]) -> bool:
    """Post the op's transfers; when every peer has posted too, the op ends with its last transfer."""
    for role, direction, mb, boundary in comm:
        posts.setdefault((direction, mb, boundary), {}).setdefault(role, free[s])
    ends = []
    for _, direction, mb, boundary in comm:
        p = posts[(direction, mb, boundary)]
        if len(p) < 2:
            return False
        jitter = d.p2p[:, :, boundary, mb, 0 if direction == "F" else 1]
        ends.append(np.maximum(p["send"], p["recv"]) + spec.p2p_s * jitter)
    end = np.maximum.reduce(ends)
    G = spec.tp * spec.cp
    ops.append(_Op(s, _optype(comm), comm[0][2], np.repeat(free[s][:, :, None], G, axis=2),
                   np.repeat(end[:, :, None], G, axis=2)))
    free[s] = end
    return True


def _step_end(spec: GenSpec, free: list[np.ndarray], d: _Draws, ops: list[_Op]) -> np.ndarray:
    """dp all-reduce per stage (ends when the last replica posted), optimizer, job-wide sync."""
    G = spec.tp * spec.cp
    last = np.zeros(spec.steps)
    for s in range(spec.pp):
        post = free[s]                                          # (S, D)
        done = post.max(axis=1) + spec.allreduce_s              # (S,)
        start = np.repeat(post[:, :, None], G, axis=2)
        ar_end = np.broadcast_to(done[:, None, None], start.shape).copy()
        ops.append(_Op(s, "separate-grads-all-reduce", -1, start, ar_end))
        opt_end = ar_end + spec.optimizer_s * d.opt[:, :, s, :]
        ops.append(_Op(s, "optimizer", -1, ar_end, opt_end))
        last = np.maximum(last, opt_end.max(axis=(1, 2)))
    return last + spec.step_gap_s


def true_step_times(spec: GenSpec) -> np.ndarray:
    """The generated job's step times (seconds, one per step)."""
    return _simulate(spec)[1]


# ---- output ---------------------------------------------------------------------------------------

def trace_frame(spec: GenSpec) -> pd.DataFrame:
    """The NDTimeline rows of the traced ranks (one row per op and rank)."""
    ops, step_len = _simulate(spec)
    S, D, G = spec.steps, spec.dp, spec.tp * spec.cp
    offset = spec.t0 + np.concatenate(([0.0], np.cumsum(step_len)[:-1]))   # each step's start
    members = np.arange(G) if spec.traced == "all" else np.arange(0, G, spec.tp)  # tp rank 0 of each group
    if spec.traced not in ("all", "tp0"):
        raise ValueError(f"traced must be 'all' or 'tp0', got {spec.traced!r}")
    ss, dd, gg = np.meshgrid(np.arange(S), np.arange(D), members, indexing="ij")
    frames = []
    for op in ops:
        start, end = op.start[:, :, members], op.end[:, :, members]
        keep = end > start if op.optype == "gc" else np.ones(start.shape, bool)
        ranks = ((op.stage * D + dd[keep]) * spec.cp + gg[keep] // spec.tp) * spec.tp + gg[keep] % spec.tp
        frames.append(pd.DataFrame({
            "dp_rank": dd[keep], "stage": op.stage, "rank": ranks, "step": ss[keep], "optype": op.optype,
            "start_ts": start[keep] + offset[ss[keep]], "duration": (end - start)[keep], "mb_id": op.mb}))
    df = pd.concat(frames, ignore_index=True)
    for dp_rank, stage in spec.missing:
        df = df[~((df.dp_rank == dp_rank) & (df.stage == stage))]
    df = df.sort_values(["rank", "start_ts"], kind="stable").reset_index(drop=True)
    df["seq_id"] = df.groupby(["rank", "step"]).cumcount()
    df["mc"] = 0
    df["gmc"] = df["stage"]
    return df


def job_yaml(spec: GenSpec) -> str:
    """The job file, with NDTimeline's keys (dsp_size: the context-parallel size)."""
    return (f"dp_size: {spec.dp}\npp_size: {spec.pp}\ntp_size: {spec.tp}\ndsp_size: {spec.cp}\n"
            f"vpp_size: 1\nworld_size: {spec.world}\n")


def write_ndtimeline(spec: GenSpec, out_dir: str | Path) -> Path:
    """Write trace.parquet and job.yaml into `out_dir`; returns the Parquet file to import."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    src = out / "trace.parquet"
    trace_frame(spec).to_parquet(src, index=False)
    (out / "job.yaml").write_text(job_yaml(spec))
    return src


def import_run(spec: GenSpec, tmp_dir: str | Path) -> Path:
    """Write the trace and import it with the real `megascope import ndtimeline` (the CLI entry point);
    returns the run directory. Context parallelism is passed as --cp when the importer has it, else
    folded into tp (the same rank order: tp fastest, then cp)."""
    from megascope.cli import main
    from megascope.tracer.importers.cli import import_run as importer

    tmp = Path(tmp_dir)
    src = write_ndtimeline(spec, tmp / "trace")
    out = tmp / "run"
    has_cp = "cp" in inspect.signature(importer).parameters
    tp = spec.tp if has_cp or spec.cp == 1 else spec.tp * spec.cp
    args = ["import", "ndtimeline", str(src), "--out", str(out), "--dp", str(spec.dp), "--tp", str(tp),
            "--pp", str(spec.pp)]
    if has_cp and spec.cp > 1:
        args += ["--cp", str(spec.cp)]
    code = main(args)
    if code != 0:
        raise RuntimeError(f"megascope {' '.join(args)} exited {code}")
    return out
