"""A Megatron-LM style 1F1B trace generator writing NDTimeline Parquet, independent of the simulator.

It follows Megatron's `forward_backward_pipelining_without_interleaving` op for op: warm-up forwards
with plain recv_forward/send_forward, a steady state of `send_forward_recv_backward` and
`send_backward_recv_forward` (one batched isend/irecv each: the op's span ends when BOTH its
transfers are done, so it holds the wait for the peer's compute), cool-down backwards; then a dp
reduce-scatter (ends at the replica group's last arrival), optimizer and all-gather. A transfer
starts when both of its ends have posted and takes a constant time; compute draws log-normal noise
per op. Unlike megascope's simulator, no span is "the transfer alone": the last pipeline boundary
is crossed only by combined ops, whose durations all include peer waiting.

    python tests/megatron_1f1b_gen.py OUT.parquet --dp 8 --tp 8 --pp 8 --micro-batches 4 --steps 100 \
        --slow RANK:1.1:30
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

T0 = 1_700_000_000.0


@dataclass
class GenConfig:
    dp: int = 8
    tp: int = 8
    pp: int = 8
    cp: int = 1
    micro_batches: int = 4
    steps: int = 100
    forward_s: float = 0.020
    backward_s: float = 0.040
    xfer_s: float = 0.004            # constant p2p transfer time
    noise_sigma: float = 0.02        # log-normal sigma of each compute op
    launch_s: float = 5e-5           # host time between two ops of a rank
    slow: dict[int, tuple[float, int]] = field(default_factory=dict)   # rank -> (factor, from step)
    link_extra: dict[tuple[int, int], tuple[float, set[int]]] = field(default_factory=dict)
    """(rank a, rank b) -> (extra seconds per transfer, steps): a disturbed link, both directions."""
    boundary_wait: tuple[int, float, float] | None = None
    """(lower stage s, probability p, seconds w): on each step, each link between stages s and s+1
    independently with probability p has every transfer end w (+-20%) late on both sides: the pattern
    of a boundary whose p2p spans all hold some peer waiting (issue 13 case 4: every link of one
    boundary +1.2-1.5 ms on random steps). Not a link fault: the links are alike."""
    seed: int = 0


def _stage_ops(s: int, pp: int, m: int) -> list[tuple[str, list[tuple[str, int]], int]]:
    """Megatron's 1F1B op list of stage s: (optype, transfers [(kind, mb)], compute mb). Transfer kinds:
    'fs' send activation to s+1, 'fr' recv activation from s-1, 'bs' send grad to s-1, 'br' recv grad from s+1."""
    first, last = s == 0, s == pp - 1
    warm = min(pp - s - 1, m)
    ops: list[tuple[str, list[tuple[str, int]], int]] = []
    fwd, bwd = 0, 0
    for _ in range(warm):
        if not first:
            ops.append(("forward-recv", [("fr", fwd)], -1))
        ops.append(("forward-compute", [], fwd))
        if not last:
            ops.append(("forward-send", [("fs", fwd)], -1))
        fwd += 1
    remaining = m - warm
    if remaining and not first:
        ops.append(("forward-recv", [("fr", fwd)], -1))
    for i in range(remaining):
        ops.append(("forward-compute", [], fwd))
        if not last:
            ops.append(("forward-send-backward-recv", [("fs", fwd), ("br", bwd)], -1))
        fwd += 1
        ops.append(("backward-compute", [], bwd))
        if i == remaining - 1:
            if not first:
                ops.append(("backward-send", [("bs", bwd)], -1))
        elif not first:
            ops.append(("backward-send-forward-recv", [("bs", bwd), ("fr", fwd)], -1))
        bwd += 1
    for _ in range(warm):
        if not last:
            ops.append(("backward-recv", [("br", bwd)], -1))
        ops.append(("backward-compute", [], bwd))
        if not first:
            ops.append(("backward-send", [("bs", bwd)], -1))
        bwd += 1
    return ops


def _transfer_key(s: int, kind: str, mb: int) -> tuple[str, int, int]:
    """The transfer a side belongs to: ('f', lower stage, mb) or ('b', lower stage, mb)."""
    if kind == "fs":
        return ("f", s, mb)
    if kind == "fr":
        return ("f", s - 1, mb)
    if kind == "bs":
        return ("b", s - 1, mb)
    return ("b", s, mb)  # br


def generate(cfg: GenConfig) -> dict[str, np.ndarray]:
    """NDTimeline columns for every rank of the job (rank = tp + tp*(cp + cp*(dp + dp*pp)))."""
    rng = np.random.default_rng(cfg.seed)
    n = cfg.dp * cfg.cp * cfg.tp                      # ranks per stage; column j = rank % n
    cols = np.arange(n)
    dp_of = cols // (cfg.tp * cfg.cp)
    ops = [_stage_ops(s, cfg.pp, cfg.micro_batches) for s in range(cfg.pp)]
    out: dict[str, list[np.ndarray]] = {k: [] for k in ("rank", "stage", "dp_rank", "step", "optype",
                                                         "start_ts", "duration", "mb_id")}
    t = np.full((cfg.pp, n), T0)

    def emit(s: int, step: int, optype: str, start: np.ndarray, dur: np.ndarray, mb: int) -> None:
        out["rank"].append(s * n + cols)
        out["stage"].append(np.full(n, s))
        out["dp_rank"].append(dp_of)
        out["step"].append(np.full(n, step))
        out["optype"].append(np.full(n, optype, dtype=object))
        out["start_ts"].append(start.copy())
        out["duration"].append(dur.copy())
        out["mb_id"].append(np.full(n, mb))

    for step in range(cfg.steps):
        factor = np.ones((cfg.pp, n))
        for rank, (slow, first) in cfg.slow.items():
            if step >= first:
                factor[rank // n, rank % n] = slow
        extra = {}  # (transfer direction, lower stage) -> per-column extra seconds
        for (a, b), (sec, steps) in cfg.link_extra.items():
            if step in steps:
                lo = min(a, b) // n
                for d in ("f", "b"):
                    extra.setdefault((d, lo), np.zeros(n))[a % n] += sec
        if cfg.boundary_wait:
            lo, prob, sec = cfg.boundary_wait
            late = (rng.random(n) < prob) * sec * rng.uniform(0.8, 1.2, n)
            for d in ("f", "b"):
                extra[(d, lo)] = extra.get((d, lo), np.zeros(n)) + late
        posts: dict[tuple[str, int, int], dict[str, np.ndarray]] = {}
        ptr = [0] * cfg.pp
        while any(ptr[s] < len(ops[s]) for s in range(cfg.pp)):
            progressed = False
            for s in range(cfg.pp):
                while ptr[s] < len(ops[s]):
                    optype, transfers, mb = ops[s][ptr[s]]
                    if not transfers:
                        base = cfg.forward_s if optype == "forward-compute" else cfg.backward_s
                        dur = base * factor[s] * rng.lognormal(0, cfg.noise_sigma, n)
                        emit(s, step, optype, t[s], dur, mb)
                        t[s] = t[s] + dur + cfg.launch_s
                        ptr[s] += 1
                        progressed = True
                        continue
                    keys = [_transfer_key(s, k, b) for k, b in transfers]
                    for (k, _), key in zip(transfers, keys):
                        posts.setdefault(key, {}).setdefault(k[1], t[s].copy())  # 's' or 'r' side
                    if not all(len(posts[key]) == 2 for key in keys):
                        break
                    end = np.max([np.maximum(posts[key]["s"], posts[key]["r"]) + cfg.xfer_s
                                  + extra.get(key[:2], 0.0) for key in keys], axis=0)
                    mb_id = transfers[0][1]
                    emit(s, step, optype, t[s], end - t[s], mb_id)
                    t[s] = end + cfg.launch_s
                    ptr[s] += 1
                    progressed = True
            if not progressed:
                raise RuntimeError(f"schedule deadlock at step {step}: {ptr}")
        for s in range(cfg.pp):  # dp reduce-scatter: ends at the group's last arrival (same cp, tp)
            arrive = t[s].reshape(cfg.dp, cfg.cp * cfg.tp)
            done = np.broadcast_to(arrive.max(axis=0) + 0.002, arrive.shape).reshape(n)
            emit(s, step, "grads-reduce-scatter", t[s], done - t[s], -1)
            opt = 0.005 * rng.lognormal(0, cfg.noise_sigma, n)
            emit(s, step, "optimizer", done + cfg.launch_s, opt, -1)
            ag = done + cfg.launch_s + opt + cfg.launch_s
            emit(s, step, "params-all-gather", ag, np.full(n, 0.002), -1)
            t[s] = ag + 0.002 + cfg.launch_s
        t[:] = t.max()  # the next step's data loader / barrier: every rank starts together
    return {k: np.concatenate(v) for k, v in out.items()}


def write_parquet(cfg: GenConfig, path: Path) -> Path:
    cols = generate(cfg)
    table = pa.table({k: (pa.array(v.astype(str)) if k == "optype" else pa.array(v)) for k, v in cols.items()})
    pq.write_table(table, path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    for name, default in (("dp", 8), ("tp", 8), ("pp", 8), ("cp", 1), ("micro-batches", 4), ("steps", 100),
                          ("seed", 0)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--slow", action="append", default=[], help="RANK:FACTOR:FROM_STEP")
    ap.add_argument("--boundary-wait", default=None, help="STAGE:PROB:SECONDS (GenConfig.boundary_wait)")
    args = ap.parse_args()
    slow = {int(r): (float(f), int(s)) for r, f, s in (x.split(":") for x in args.slow)}
    wait = None
    if args.boundary_wait:
        st, prob, sec = args.boundary_wait.split(":")
        wait = (int(st), float(prob), float(sec))
    cfg = GenConfig(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, micro_batches=args.micro_batches,
                    steps=args.steps, seed=args.seed, slow=slow, boundary_wait=wait)
    write_parquet(cfg, args.out)


if __name__ == "__main__":
    main()
