"""A streaming generator of summaries at the edge: a dp x tp x pp Megatron-style job of any length written
straight as the tables each rank's tracer summarizes its step into (edge_rank_step, edge_peer_step,
edge_collectives, tracer/edge_summary.py) plus its steps rows, a few hundred ranks at a time, never
holding the job in memory. For scale tests of the analyzer (benchmarks/analyzer_scale.py --edge): the
12,288-rank x 1,000-step case has 786 M raw events, more than this machine can simulate, and 12.3 M
rank-steps of summaries, which it can write.

The model (per step; not the simulator's event-level timeline, a closed form of the same schedule):
- each rank computes its m micro-batches forward, waits for its pipeline neighbours (the 1F1B bubble,
  ~(pp-1)/m of the compute), computes them backward, then reduce-scatters and all-gathers its gradients
  in its data-parallel group and steps its optimizer. Compute has a per-rank level (sigma 0.5%), a
  job-wide per-step factor (0.5%) and per-rank-step noise (1%); host time outside spans, data waits and
  p2p stalls are exponential around their levels; every rank starts its step up to 0.3 ms apart.
- a tensor-parallel all-reduce after each micro-batch's forward and backward: its group's members wait
  for the slowest member's compute (so a slow GPU holds its 8 tp peers at every op);
- the data-parallel reduce-scatter completes when the job's last rank has arrived (the step is
  synchronous), plus its transfer; the all-gather and the optimizer follow; the next step starts then.
- faults, with their true onset (recorded in run.json "injected"): `straggler` (a rank's compute x
  factor from a step), `late_launch` (a rank's host time before the data-parallel collective + ms on
  every nth step), `flap` (every transfer over one pipeline link + down_ms on `length` steps of every
  `period` steps: the link's fastest transfer, both ends' waits and so the job's step grow).

Each rank's rows are written with the tracer's own segment writer (tracer/sink.py), one segment per
table, all rows `final` (as a tracer that summarized its whole run by close).

    python -m megascope.samples.edge_gen OUT [--dp 192 --tp 8 --pp 8 --steps 1000] [--batch-ranks 256]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from megascope.tracer import run_dir as rd
from megascope.tracer.layout import Layout
from megascope.tracer.schema import TABLES
from megascope.tracer.sink import ParquetSegmentSink

START_NS = 1_700_000_000_000_000_000
SEQ_LEN, MICRO_BATCH = 4096, 1
MODEL = {"n_layers": 64, "hidden": 8192, "n_heads": 64, "seq_len": SEQ_LEN, "vocab_size": 50304, "window": 0,
         "ffn_mult": 4}
PEAK_FLOPS = 989e12  # H100 SXM dense bf16


@dataclass
class Fault:
    kind: str            # straggler | late_launch | flap
    ranks: list[int]     # the rank, or the link's two ends (stage p, stage p + 1)
    first: int           # first step it acts on
    factor: float = 1.0  # straggler: compute x factor
    ms: float = 0.0      # late_launch: ms late; flap: ms added to every transfer over the link
    every: int = 1       # late_launch: every nth step from `first`
    period: int = 0      # flap: down on `length` steps of every `period`
    length: int = 0

    def active(self, steps: np.ndarray) -> np.ndarray:
        on = steps >= self.first
        if self.kind == "late_launch":
            on &= (steps - self.first) % self.every == 0
        if self.kind == "flap":
            on &= (steps - self.first) % self.period < self.length
        return on


@dataclass
class EdgeGenConfig:
    dp: int = 192
    tp: int = 8
    pp: int = 8
    steps: int = 1000
    micro_batches: int = 8
    seed: int = 0
    ranks_per_host: int = 8
    fwd_mb_s: float = 0.0145    # one micro-batch's forward on one GPU
    bwd_mb_s: float = 0.029
    optimizer_s: float = 0.002
    allreduce_s: float = 0.0009  # a tp all-reduce's transfer
    reduce_scatter_s: float = 0.085
    all_gather_s: float = 0.07
    p2p_s: float = 0.0003        # one activation / gradient transfer
    faults: list[Fault] = field(default_factory=lambda: [
        Fault("straggler", [1000], 400, factor=1.3),
        Fault("late_launch", [5000], 300, ms=60.0, every=2),
        Fault("flap", [777, 2313], 100, ms=10.0, period=10, length=3),
    ])

    @property
    def layout(self) -> Layout:
        return Layout(dp=self.dp, tp=self.tp, pp=self.pp)


class _Job:
    """The job's draws, the same whichever batch asks: per-rank-step draws come from a generator
    seeded by (seed, rank) so a rank's numbers do not depend on the batch it falls in."""

    def __init__(self, cfg: EdgeGenConfig) -> None:
        self.cfg = cfg
        self.steps = np.arange(cfg.steps)
        g = np.random.default_rng([cfg.seed, 1 << 30])
        self.step_factor = np.exp(g.normal(0, 0.005, cfg.steps))
        self.rs_transfer = cfg.reduce_scatter_s * np.exp(g.normal(0, 0.01, cfg.steps))
        self.ag_transfer = cfg.all_gather_s * np.exp(g.normal(0, 0.01, cfg.steps))
        self.last_arrival: np.ndarray | None = None  # per step, s after the step's start (pass 1)

    def draws(self, ranks: np.ndarray) -> dict[str, np.ndarray]:
        """(ranks x steps) arrays of one batch: every duration of the ranks' steps before the
        data-parallel collective, and when each rank arrives at it."""
        cfg, S = self.cfg, self.cfg.steps
        n = len(ranks)
        shape = (n, S)
        level, fwd_n, bwd_n, opt_n, host, data, coll_gap, p2p_gap, bubble_n, skew = (np.empty(shape) for _ in range(10))
        for i, r in enumerate(ranks):
            g = np.random.default_rng([cfg.seed, int(r)])
            level[i] = np.exp(g.normal(0, 0.005))
            fwd_n[i], bwd_n[i], opt_n[i], bubble_n[i] = np.exp(g.normal(0, [[0.01], [0.01], [0.01], [0.02]], (4, S)))
            host[i], data[i], coll_gap[i], p2p_gap[i] = g.exponential([[3e-4], [4e-4], [3e-4], [1e-4]], (4, S))
            skew[i] = g.uniform(0, 3e-4, S)
        m = cfg.micro_batches
        fwd = m * cfg.fwd_mb_s * level * self.step_factor * fwd_n
        bwd = m * cfg.bwd_mb_s * level * self.step_factor * bwd_n
        late = np.zeros((n, S))
        flap_wait = np.zeros((n, S))
        for f in cfg.faults:
            on = f.active(self.steps)
            for i, r in enumerate(ranks):
                if r not in f.ranks:
                    continue
                if f.kind == "straggler":
                    fwd[i, on] *= f.factor
                    bwd[i, on] *= f.factor
                elif f.kind == "late_launch":
                    late[i, on] += f.ms / 1e3
        per_stage = cfg.dp * cfg.tp
        for off in (-per_stage, per_stage):  # both ends wait for the m slower transfers toward them
            flap_wait += m * link_extra(cfg, ranks, ranks + off, self.steps)
        stage = ranks // (cfg.dp * cfg.tp)
        bubble = (cfg.pp - 1) * (cfg.fwd_mb_s + cfg.bwd_mb_s) * bubble_n * (cfg.pp > 1)
        recv = bubble + flap_wait
        gap_coll = 6e-4 + coll_gap + late
        gap_p2p = (1e-4 + p2p_gap) * (cfg.pp > 1)
        data_wait = 2e-4 + data
        gap_other = 5e-4 + host
        # the tp all-reduces, times in s after the step's start: each member arrives after its own
        # micro-batch, the op ends when the group's last member arrived plus the transfer, and the
        # group starts the next micro-batch together (tp groups lie whole in a batch)
        t, ar = cfg.tp, cfg.allreduce_s

        def last(x: np.ndarray) -> np.ndarray:  # the tp group's max, per member
            return x.reshape(n // t, t, *x.shape[1:]).max(axis=1).repeat(t, axis=0)

        k = np.arange(m)[None, None, :]
        fwd_mb, bwd_mb = fwd / m, bwd / m
        ready = skew + data_wait + gap_other
        f_end0 = last(ready + fwd_mb) + ar
        f_end = f_end0[..., None] + k * (last(fwd_mb) + ar)[..., None]
        f_arr = np.concatenate([(ready + fwd_mb)[..., None], f_end[..., :-1] + fwd_mb[..., None]], axis=2)
        back = f_end[..., -1] + recv + gap_p2p
        b_end0 = last(back + bwd_mb) + ar
        b_end = b_end0[..., None] + k * (last(bwd_mb) + ar)[..., None]
        b_arr = np.concatenate([(back + bwd_mb)[..., None], b_end[..., :-1] + bwd_mb[..., None]], axis=2)
        arrive = b_end[..., -1] + gap_coll
        tp_s = (f_end - f_arr).sum(axis=2) + (b_end - b_arr).sum(axis=2)
        return {"fwd": fwd, "bwd": bwd, "opt": cfg.optimizer_s * opt_n, "tp_s": tp_s, "recv": recv,
                "gap_coll": gap_coll, "gap_p2p": gap_p2p, "data_wait": data_wait, "gap_other": gap_other,
                "skew": skew, "arrive": arrive, "stage": stage, "f_arr": f_arr, "f_end": f_end, "b_arr": b_arr,
                "b_end": b_end}


def link_extra(cfg: EdgeGenConfig, ranks: np.ndarray, peers: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """(ranks x steps) seconds a flap adds to each transfer between ranks[i] and peers[i]."""
    out = np.zeros((len(ranks), len(steps)))
    for f in cfg.faults:
        if f.kind == "flap":
            on = f.active(steps)
            for i in np.flatnonzero(np.isin(ranks, f.ranks) & np.isin(peers, f.ranks) & (ranks != peers)):
                out[i, on] += f.ms / 1e3
    return out


def _batches(cfg: EdgeGenConfig, batch_ranks: int) -> list[np.ndarray]:
    size = max(cfg.tp, batch_ranks // cfg.tp * cfg.tp)  # whole tp groups
    world = cfg.layout.world
    return [np.arange(lo, min(lo + size, world)) for lo in range(0, world, size)]


def generate(out: str | Path, cfg: EdgeGenConfig, batch_ranks: int = 256,
             progress: Callable[[str, int, int], None] | None = None) -> Path:
    """Write the run directory `out` (created; must not hold a run): run.json, then per batch of ranks
    their steps and edge tables. Two passes over the batches: the first finds each step's last arrival
    at the data-parallel collective (the step is synchronous), the second writes."""
    out = Path(out)
    if (out / "run.json").exists():
        raise FileExistsError(f"{out} already holds a run; pick an empty folder")
    if cfg.layout.world % cfg.tp or any(r >= cfg.layout.world for f in cfg.faults for r in f.ranks):
        raise ValueError("a fault names a rank outside the job")
    out.mkdir(parents=True, exist_ok=True)
    job = _Job(cfg)
    batches = _batches(cfg, batch_ranks)
    last = np.zeros(cfg.steps)
    for i, ranks in enumerate(batches):
        last = np.maximum(last, job.draws(ranks)["arrive"].max(axis=0))
        if progress:
            progress("pass 1 (arrivals)", i + 1, len(batches))
    # step s starts at T[s] (+ each rank's skew); the reduce-scatter ends at T + last + transfer,
    # the all-gather after it, the optimizer after that; the next step starts 1 ms after the slowest
    length = last + job.rs_transfer + job.ag_transfer + 1.5 * cfg.optimizer_s + 1e-3
    starts = np.concatenate([[0.0], np.cumsum(length)])
    _write_manifest(out, cfg)
    for i, ranks in enumerate(batches):
        tables = _tables(job, ranks, last, starts)
        for j, rank in enumerate(ranks):
            sink = ParquetSegmentSink(out, int(rank))
            for name in ("steps", "edge_peer_step", "edge_collectives", "edge_rank_step"):  # rank_step last
                t = tables[name]
                sink.write(name, t.slice(int(t.offsets[j]), int(t.offsets[j + 1] - t.offsets[j])).table)
        if progress:
            progress("pass 2 (writing)", i + 1, len(batches))
    return out


@dataclass
class _Rows:
    """One table's rows of a batch, grouped by rank (offsets[j]:offsets[j+1] are ranks[j]'s)."""
    table: pa.Table
    offsets: np.ndarray

    def slice(self, a: int, n: int) -> _Rows:
        return _Rows(self.table.slice(a, n), self.offsets)


def _ns(x: np.ndarray) -> np.ndarray:
    return np.round(x * 1e9).astype(np.int64)


def _tables(job: _Job, ranks: np.ndarray, last: np.ndarray, starts: np.ndarray) -> dict[str, _Rows]:
    cfg, S, m = job.cfg, job.cfg.steps, job.cfg.micro_batches
    d = job.draws(ranks)
    n = len(ranks)
    steps = np.broadcast_to(job.steps, (n, S))
    t0 = starts[:-1] + d["skew"]                     # each rank's step start, s after the job's start
    t0_next = np.concatenate([starts[1:-1] + d["skew"][:, 1:], starts[-1:] + d["skew"][:, -1:]], axis=1)
    rs_end = starts[:-1] + last + job.rs_transfer
    rs = rs_end - (starts[:-1] + d["arrive"])         # wait for the job's last arrival + transfer
    ag_end = rs_end + job.ag_transfer
    opt = d["opt"]
    tail = t0_next - (ag_end + opt)                  # host time after the optimizer until the next step
    gap = d["gap_other"] + tail + d["gap_coll"] + d["gap_p2p"]
    compute = d["fwd"] + d["bwd"] + opt
    collective = d["tp_s"] + rs + job.ag_transfer
    own = compute + d["data_wait"] + gap
    step_time = t0_next - t0
    rank_col = np.repeat(ranks.astype(np.int32), S)
    flat = {k: v.reshape(-1) for k, v in d.items() if isinstance(v, np.ndarray) and v.ndim == 2}
    tokens = np.full(n * S, SEQ_LEN * MICRO_BATCH * m, np.int64)
    p = 12 * MODEL["n_layers"] * MODEL["hidden"] ** 2 + MODEL["vocab_size"] * MODEL["hidden"]
    flops = np.full(n * S, 6.0 * p * SEQ_LEN * MICRO_BATCH * m * cfg.dp)
    stage = np.repeat(d["stage"], S)
    has_prev, has_next = stage > 0, stage < cfg.pp - 1
    n_p2p = 2 * m * (has_prev.astype(int) + has_next.astype(int))
    per = np.arange(n + 1) * S
    start_ns = START_NS + _ns(t0.reshape(-1))
    end_ns = START_NS + _ns(t0_next.reshape(-1))
    steps_flat = steps.reshape(-1).astype(np.int64)
    out: dict[str, _Rows] = {}
    loss = np.where(stage == cfg.pp - 1, 2.0 + 8.0 * np.exp(-steps_flat / 300.0), np.nan)
    out["steps"] = _Rows(pa.table({
        "rank": rank_col, "step": steps_flat, "start_ns": start_ns, "end_ns": end_ns, "tokens": tokens,
        "loss": loss, "lr": np.full(n * S, 2e-4), "grad_norm": np.full(n * S, 1.0), "model_flops": flops,
        "dropped_events": np.zeros(n * S, np.int64)}, schema=TABLES["steps"]), per)
    recv = flat["recv"]
    # a middle stage's wait splits between its two neighbours (activations from the previous stage
    # first; most of the 1F1B bubble waits on the next stage's gradients); the ends have one neighbour
    per_stage = cfg.dp * cfg.tp
    flap_prev = cfg.micro_batches * link_extra(cfg, ranks, ranks - per_stage, job.steps).reshape(-1)
    bubble = recv - flap_prev - cfg.micro_batches * link_extra(cfg, ranks, ranks + per_stage, job.steps).reshape(-1)
    from_prev = np.where(has_next, 0.16, 1.0) * bubble * has_prev + flap_prev
    from_next = recv - from_prev
    out["edge_rank_step"] = _Rows(pa.table({
        "rank": rank_col, "step": steps_flat, "start_ns": start_ns, "end_ns": end_ns,
        "step_time_s": step_time.reshape(-1), "tokens": tokens, "model_flops": flops,
        "compute_s": compute.reshape(-1), "forward_s": flat["fwd"], "backward_s": flat["bwd"],
        "optimizer_s": opt.reshape(-1), "recv_s": recv, "collective_s": collective.reshape(-1),
        "nested_wait_s": np.zeros(n * S), "data_wait_s": flat["data_wait"], "gap_s": gap.reshape(-1),
        "gap_p2p_s": flat["gap_p2p"], "gap_coll_s": flat["gap_coll"], "own_s": own.reshape(-1),
        "other_s": gap.reshape(-1), "n_events": 4 + 2 * m + 2 * m + n_p2p + 2 * m,
        "final": np.ones(n * S, bool)}, schema=TABLES["edge_rank_step"]), per)
    out["edge_peer_step"] = _peer_rows(cfg, ranks, steps_flat, rank_col, stage, flat, gap, opt, collective,
                                       from_prev, from_next, n_p2p, job)
    out["edge_collectives"] = _collective_rows(cfg, ranks, d, starts[:-1], rs_end, ag_end)
    return out


def _peer_rows(cfg: EdgeGenConfig, ranks, steps_flat, rank_col, stage, flat, gap, opt, collective,
               from_prev, from_next, n_p2p, job: _Job) -> _Rows:
    n, S, m = len(ranks), cfg.steps, cfg.micro_batches
    per_stage = cfg.dp * cfg.tp
    ns = _ns
    g = np.random.default_rng([cfg.seed, 2 << 30, int(ranks[0])])
    own_row = {"compute_ns": ns(flat["fwd"] + flat["bwd"] + opt.reshape(-1)), "forward_ns": ns(flat["fwd"]),
               "backward_ns": ns(flat["bwd"]), "optimizer_ns": ns(opt.reshape(-1)),
               "nested_ns": np.zeros(n * S, np.int64), "recv_ns": np.zeros(n * S, np.int64),
               "collective_ns": ns(collective.reshape(-1)), "data_wait_ns": ns(flat["data_wait"]),
               "gap_ns": ns(gap.reshape(-1) - flat["gap_p2p"]), "gap_p2p_ns": np.zeros(n * S, np.int64),
               "gap_coll_ns": ns(flat["gap_coll"]), "send_min_ns": np.full(n * S, -1, np.int64),
               "sends": np.zeros(n * S, np.int64), "recv_min_ns": np.full(n * S, -1, np.int64),
               "n_events": np.full(n * S, 4 + 4 * m, np.int64)}
    zero = np.zeros(n * S, np.int64)
    parts = [(np.full(n * S, -1, np.int32), own_row, np.ones(n * S, bool))]
    for peer_off, share, has in ((-per_stage, from_prev, stage > 0), (per_stage, from_next, stage < cfg.pp - 1)):
        extra = link_extra(cfg, ranks, ranks + peer_off, job.steps).reshape(-1)
        send_min = cfg.p2p_s * np.exp(g.normal(0, 0.05, n * S)) + extra
        half = 0.5 if cfg.pp > 2 else 1.0
        gp = flat["gap_p2p"] * np.where((stage > 0) & (stage < cfg.pp - 1), half, 1.0)
        row = {"compute_ns": zero, "forward_ns": zero, "backward_ns": zero, "optimizer_ns": zero, "nested_ns": zero,
               "recv_ns": ns(share), "collective_ns": zero, "data_wait_ns": zero, "gap_ns": ns(gp),
               "gap_p2p_ns": ns(gp), "gap_coll_ns": zero, "send_min_ns": ns(send_min),
               "sends": np.full(n * S, m, np.int64),
               "recv_min_ns": ns(send_min + 1e-5 + np.minimum(share / m, 0.02) * 0.05),
               "n_events": np.full(n * S, 2 * m, np.int64)}
        parts.append((rank_col + peer_off, row, has))
    cols: dict[str, list] = {k: [] for k in ("rank", "step", "peer", *own_row)}
    order = []
    for k, (peer, row, has) in enumerate(parts):
        idx = np.flatnonzero(has)
        order.append(np.stack([rank_col[idx], steps_flat[idx], np.full(len(idx), k)], axis=1))
        cols["rank"].append(rank_col[idx])
        cols["step"].append(steps_flat[idx])
        cols["peer"].append(peer[idx].astype(np.int32))
        for c, v in row.items():
            cols[c].append(np.asarray(v)[idx] if np.ndim(v) else np.full(len(idx), v))
    keys = np.concatenate(order)
    perm = np.lexsort((keys[:, 2], keys[:, 1], keys[:, 0]))
    arrays = {c: np.concatenate(v)[perm] for c, v in cols.items()}
    masks = {c: arrays[c] < 0 for c in ("send_min_ns", "recv_min_ns")}
    table = pa.table({c: pa.array(v, mask=masks.get(c)) for c, v in arrays.items()}, schema=TABLES["edge_peer_step"])
    offsets = np.searchsorted(arrays["rank"], np.append(ranks, ranks[-1] + 1))
    return _Rows(table, offsets)


def _collective_rows(cfg: EdgeGenConfig, ranks: np.ndarray, d: dict, T: np.ndarray, rs_end: np.ndarray,
                     ag_end: np.ndarray) -> _Rows:
    """2m tp all-reduces (each micro-batch's forward then backward; arrival after the rank's own
    compute, end when the group's slowest arrived plus the transfer) and the dp reduce-scatter and
    all-gather, per rank-step."""
    n, S, m = len(ranks), cfg.steps, cfg.micro_batches
    at = T[None, :, None]
    starts = np.concatenate([at + d["f_arr"], at + d["b_arr"], (T + d["arrive"])[..., None],
                             np.broadcast_to(rs_end[None, :, None], (n, S, 1))], axis=2)
    ends = np.concatenate([at + d["f_end"], at + d["b_end"], np.broadcast_to(rs_end[None, :, None], (n, S, 1)),
                           np.broadcast_to(ag_end[None, :, None], (n, S, 1))], axis=2)
    per = 2 * m + 2
    steps = np.broadcast_to(np.arange(S)[None, :, None], (n, S, per))
    op = np.broadcast_to(np.arange(per)[None, None, :], (n, S, per))
    seq = np.where(op < 2 * m, steps * 2 * m + op, steps * 2 + (op - 2 * m))
    code = np.minimum(op, 2 * m + 1) - np.minimum(op, 2 * m - 1)  # 0: all_reduce, 1: reduce_scatter, 2: all_gather
    code = code.reshape(-1).astype(np.int8)

    def strings(idx: np.ndarray, values: list[str]) -> pa.Array:
        return pa.DictionaryArray.from_arrays(idx, values).cast(pa.string())
    table = pa.table({
        "rank": np.repeat(ranks.astype(np.int32), S * per), "step": steps.reshape(-1).astype(np.int64),
        "group": strings(np.minimum(code, 1), ["tp", "dp"]),
        "seq": seq.reshape(-1).astype(np.int64),
        "op_name": strings(code, ["all_reduce", "reduce_scatter", "all_gather"]),
        "start_ns": START_NS + _ns(starts.reshape(-1)), "end_ns": START_NS + _ns(ends.reshape(-1))},
        schema=TABLES["edge_collectives"])
    return _Rows(table, np.arange(n + 1) * S * per)


def _write_manifest(out: Path, cfg: EdgeGenConfig) -> None:
    lay = cfg.layout
    world = lay.world
    rph = cfg.ranks_per_host
    topology = lay.topology(range(world), hosts={r: f"node{r // rph:04d}" for r in range(world)},
                            local_ranks={r: r % rph for r in range(world)})
    rd.write_manifest(out, {
        "run_id": f"edge-gen-{cfg.dp}x{cfg.tp}x{cfg.pp}-{cfg.steps}-s{cfg.seed}",
        "start_time": np.datetime_as_string(np.datetime64(START_NS, "ns"), unit="s") + "Z",
        "source": "edge_gen",
        "topology": topology,
        "model": MODEL,
        "micro_batches": cfg.micro_batches,
        "schedule": "1f1b" if cfg.pp > 1 else "none",
        "peak_flops": {"per_device": PEAK_FLOPS, "source": "edge_gen", "device": "NVIDIA H100 80GB HBM3 (generated)"},
        "clock_offsets_ns": {str(r): 0 for r in range(world)},
        "versions": {"megascope": "0.1.0", "edge_gen": 1},
        "injected": [asdict(f) for f in cfg.faults],
    })


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the run directory to write (must not hold a run)")
    for k, v in (("dp", 192), ("tp", 8), ("pp", 8), ("steps", 1000), ("seed", 0)):
        ap.add_argument(f"--{k}", type=int, default=v, help=f"(default {v})")
    ap.add_argument("--batch-ranks", type=int, default=256, help="ranks generated at once (default 256)")
    ap.add_argument("--no-faults", action="store_true", help="a clean run (default: the three faults above)")
    a = ap.parse_args()
    cfg = EdgeGenConfig(dp=a.dp, tp=a.tp, pp=a.pp, steps=a.steps, seed=a.seed)
    if a.no_faults:
        cfg.faults = []
    t = time.perf_counter()
    try:
        generate(a.out, cfg, a.batch_ranks, lambda what, i, n: print(
            f"\r{what}: {i}/{n} batches, {time.perf_counter() - t:.0f} s", end="", file=sys.stderr, flush=True))
    except (FileExistsError, ValueError) as exc:
        print(f"\nedge_gen: {exc}", file=sys.stderr)
        return 2
    print(f"\nwrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
