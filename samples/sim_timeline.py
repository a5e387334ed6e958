"""The simulator's timeline engine: one step of a dp x tp x pp (x vpp) job, vectorized over the
dp x tp ranks of each pipeline stage (arrays of N = dp*tp, index j = d*tp + t).

Semantics it reproduces (what the tracer records on a real job):
- compute spans hold the rank's own work; a tensor-parallel all_reduce after each forward/backward
  makes the tp group wait for its slowest member (the waiting lands in the collective's span);
- p2p: sends are non-blocking; a transfer starts when both sides have posted and both spans end when
  it completes, so a receiver that posted early shows the upstream stage's delay as waiting;
- collectives: each member issues when it gets there; all end at the last arrival + the transfer time;
- a hung rank stops; everyone who then waits on it (transitively) blocks at that op and reports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megascope.samples.faults_sim import Fault
from megascope.samples.sim_model import Costs, Noise
from megascope.samples.sim_schedule import global_order, stage_order, upstream
from megascope.trainer.pipelining.schedule_order import Action


@dataclass(frozen=True)
class EventDesc:
    """The static part of an event slot in a stage's per-step program (same for every step)."""
    name: str
    kind: str
    group: str
    microbatch: int
    chunk: int
    peer_stage: int  # stage of the p2p partner (same dp, tp), -1
    bytes: int


class StageLog:
    """Events of one stage: static slots plus, per step, seq and times arrays (slots x N)."""

    def __init__(self) -> None:
        self.desc: list[EventDesc] = []
        self.step_rows: list[list[tuple]] = []   # cleared by the writer after each segment
        self.frozen = False                        # slots are known once the first step is done

    def begin_step(self) -> None:
        # the slots are known once a step has added them; not `bool(step_rows)`: the writer clears
        # step_rows after each segment, so with one step per segment every step would add its slots again
        self.frozen = self.frozen or bool(self.desc)
        self.step_rows.append([])

    def last_completed(self, j: int) -> dict | None:
        """The latest-ending event element j completed in the steps still held (for in-flight records)."""
        best = None
        for rows in self.step_rows[-2:]:
            for slot, (seq, _, _, end, valid) in enumerate(rows):
                if valid[j] and (best is None or end[j] > best[1]):
                    best = (slot, float(end[j]))
        if best is None:
            return None
        d = self.desc[best[0]]
        return {"name": d.name, "kind": d.kind, "microbatch": d.microbatch, "end_s": best[1]}

    def add(self, desc: EventDesc, seq: int, issue, start, end, valid) -> None:
        if not self.frozen:  # every step has the same program: slots come from the first
            self.desc.append(desc)
        self.step_rows[-1].append((seq, issue, start, end, valid))


class Timeline:
    """Holds the job state across steps; `run_step` appends one step to every stage's log."""

    def __init__(self, dp: int, tp: int, pp: int, vpp: int, micro_batches: int, costs: Costs,
                 noise: Noise, faults: list[Fault], rank_table: np.ndarray, seed: int) -> None:
        self.dp, self.tp, self.pp, self.vpp, self.m = dp, tp, pp, vpp, micro_batches
        self.n = dp * tp
        self.costs, self.noise, self.faults = costs, noise, faults
        self.rank_table = rank_table                     # (pp, N) global ranks
        self.rng = np.random.default_rng(seed)
        self.chip = self.rng.lognormal(0.0, noise.chip_sigma, size=(pp, self.n))
        self.orders = [stage_order(s, pp, micro_batches, vpp) for s in range(pp)]
        self.global_order = global_order(pp, micro_batches, vpp)
        self.cur = [np.zeros(self.n) for _ in range(pp)]
        self.alive = [np.ones(self.n, dtype=bool) for _ in range(pp)]
        self.logs = [StageLog() for _ in range(pp)]
        self.seq: dict[tuple, int] = {}
        self.inflight: list[dict] = []
        self.step_bounds: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # per step: start, end (pp,N), done
        self._masks = self._fault_masks()

    # ---- fault masks -------------------------------------------------------------------------
    def _fault_masks(self) -> list[tuple[Fault, np.ndarray]]:
        """Per fault, a (pp, N) bool mask of the ranks it names."""
        out = []
        for f in self.faults:
            mask = np.isin(self.rank_table, f.ranks)
            if f.kind == "imbalance":
                mask = np.zeros_like(mask)
                mask[f.stage] = True
            out.append((f, mask))
        return out

    def _compute_factor(self, s: int, step: int) -> np.ndarray:
        factor = np.ones(self.n)
        for f, mask in self._masks:
            if f.kind in ("straggler", "imbalance") and f.active(step):
                factor = np.where(mask[s], factor * f.factor, factor)
        return factor

    def _link_penalty(self, step: int, stage_a: int, stage_b: int | None, axis: str) -> tuple[np.ndarray, np.ndarray]:
        """(factor, extra seconds) per element for transfers on links/groups named by flap/slow_link."""
        factor, extra = np.ones(self.n), np.zeros(self.n)
        for f, _ in self._masks:
            if f.kind not in ("flap", "slow_link") or not f.active(step):
                continue
            a, b = f.ranks
            if axis == "p2p":
                ra, rb = self.rank_table[stage_a], self.rank_table[stage_b]
                hit = ((ra == a) & (rb == b)) | ((ra == b) & (rb == a))
            else:  # a collective group holding both ranks: every member's transfer is slow
                ranks = self.rank_table[stage_a].reshape(self.dp, self.tp)
                def has(r: int) -> np.ndarray:
                    return (ranks == r).any(axis=0 if axis == "dp" else 1, keepdims=True)
                hit = np.broadcast_to(has(a) & has(b), ranks.shape).reshape(-1)
            if f.kind == "flap":
                extra = np.where(hit, extra + f.ms / 1e3, extra)
            else:
                factor = np.where(hit, factor * f.factor, factor)
        return factor, extra

    def _late_launch(self, s: int, step: int) -> np.ndarray:
        pause = np.zeros(self.n)
        for f, mask in self._masks:
            if f.kind == "late_launch" and f.active(step):
                pause = np.where(mask[s], pause + f.ms / 1e3, pause)
        hiccup = self.rng.random(self.n) < self.noise.hiccup_prob
        lo, hi = self.noise.hiccup_s
        return pause + np.where(hiccup, self.rng.uniform(lo, hi, size=self.n), 0.0)

    def _hang_now(self, s: int, step: int) -> np.ndarray:
        hang = np.zeros(self.n, dtype=bool)
        for f, mask in self._masks:
            if f.kind == "hang" and f.first == step:
                hang |= mask[s]
        return hang

    # ---- primitives ---------------------------------------------------------------------------
    def _gap(self) -> np.ndarray:
        return self.rng.exponential(self.noise.gap_mean_s, size=self.n)

    def _next_seq(self, key: tuple) -> int:
        value = self.seq.get(key, 0)
        self.seq[key] = value + 1
        return value

    def _block(self, s: int, newly: np.ndarray, step: int, op: str, group: str, seq: int,
               peers: list[np.ndarray], nbytes: int, since: np.ndarray, microbatch: int) -> None:
        """Ranks of stage s that start waiting forever at this op: record what the watchdog writes."""
        for j in np.flatnonzero(newly):
            self.inflight.append({
                "rank": int(self.rank_table[s, j]), "step": step, "microbatch": microbatch, "op": op,
                "group": group, "seq": seq, "peers": sorted(int(p[j]) if np.ndim(p) else int(p) for p in peers),
                "bytes": nbytes, "since_s": float(since[j]),
                "last_completed": self.logs[s].last_completed(int(j))})
        self.alive[s] = self.alive[s] & ~newly

    def _collective(self, s: int, step: int, name: str, group: str, nbytes: int, base_s: float,
                    issue: np.ndarray, microbatch: int = -1, chunk: int = -1) -> np.ndarray:
        """All members issue at `issue`; all end at the last arrival + transfer time. Returns end."""
        axis = 1 if group == "tp" else 0
        shape = (self.dp, self.tp)
        seq = self._next_seq((group, s))
        arrived = self.alive[s].reshape(shape)
        complete = np.broadcast_to(arrived.all(axis=axis, keepdims=True), shape).reshape(-1)
        if not complete.all():
            members = self.rank_table[s].reshape(shape)
            group_members = [np.broadcast_to(members.take([i], axis=axis), shape).reshape(-1)
                             for i in range(shape[axis])]
            self._block(s, self.alive[s] & ~complete, step, name, group, seq, group_members, nbytes,
                        issue, microbatch)
        factor, extra = self._link_penalty(step, s, None, group)
        xfer = base_s * factor * self.rng.lognormal(0, self.noise.xfer_sigma, self.n) + extra
        last = np.broadcast_to(np.where(arrived, issue.reshape(shape), -np.inf).max(axis=axis, keepdims=True),
                               shape).reshape(-1)
        end = last + xfer.reshape(shape).max(axis=axis, keepdims=True).repeat(shape[axis], axis=axis).reshape(-1)
        desc = EventDesc(name, "collective", group, microbatch, chunk, -1, nbytes)
        self.logs[s].add(desc, seq, issue, issue, end, self.alive[s].copy())
        return np.where(self.alive[s], end, issue)

    # ---- one step ----------------------------------------------------------------------------
    def run_step(self, step: int) -> None:
        pp = self.pp
        for log in self.logs:
            log.begin_step()
        step_factor = self.rng.lognormal(0, self.noise.step_sigma)
        start = [self.cur[s].copy() for s in range(pp)]
        for s in range(pp):
            wait = self.rng.exponential(self.noise.data_wait_mean_s, self.n)
            self.logs[s].add(EventDesc("data_wait", "host", "", -1, -1, -1, 0), -1,
                             self.cur[s], self.cur[s], self.cur[s] + wait, self.alive[s].copy())
            self.cur[s] = np.where(self.alive[s], self.cur[s] + wait, self.cur[s])
            self.alive[s] &= ~self._hang_now(s, step)   # hung: stops before its first compute
        factors = [self._compute_factor(s, step) * self.chip[s] * step_factor for s in range(pp)]
        done: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        for s, i in self.global_order:
            self._pipe_op(step, s, self.orders[s][i], factors[s], done)
        for s in range(pp):
            self._step_tail(step, s)
        self.step_bounds.append((np.stack(start), np.stack(self.cur), np.stack(self.alive)))

    def _pipe_op(self, step: int, s: int, op: Action, factor: np.ndarray, done: dict) -> None:
        c = self.costs
        fwd = op.kind == "F"
        dep = upstream(op, s, self.pp, self.vpp)
        if dep is not None:
            self._transfer(step, s, op, dep, done)
        begin = self.cur[s] + self._gap()
        dur = (c.forward_s if fwd else c.backward_s) * factor * self.rng.lognormal(0, self.noise.op_sigma, self.n)
        end = begin + dur
        self.logs[s].add(EventDesc("forward" if fwd else "backward", "compute", "", op.microbatch,
                                   op.chunk if self.vpp > 1 else -1, -1, 0), -1, begin, begin, end,
                         self.alive[s].copy())
        self.cur[s] = np.where(self.alive[s], end, self.cur[s])
        if self.tp > 1:
            self.cur[s] = self._collective(s, step, "all_reduce", "tp", c.tp_bytes, c.tp_s,
                                           self.cur[s] + self._gap(), op.microbatch,
                                           op.chunk if self.vpp > 1 else -1)
        done[(op.kind, op.microbatch, op.chunk, s)] = (self.cur[s].copy(), self.alive[s].copy())

    def _transfer(self, step: int, s: int, op: Action, dep: tuple[int, int], done: dict) -> None:
        """The p2p transfer feeding `op` from stage dep[0]: a send there, a recv here."""
        src, src_chunk = dep
        send_issue, send_alive = done[(op.kind, op.microbatch, src_chunk, src)]
        recv_issue = self.cur[s] + self._gap()
        direction = "forward" if op.kind == "F" else "backward"
        seq = self._next_seq(("p2p", src, s))
        newly = self.alive[s] & ~send_alive
        if newly.any():
            self._block(s, newly, step, f"recv_{direction}", "pp", seq, [self.rank_table[src]],
                        self.costs.p2p_bytes, recv_issue, op.microbatch)
        factor, extra = self._link_penalty(step, src, s, "p2p")
        xfer = self.costs.p2p_s * factor * self.rng.lognormal(0, self.noise.xfer_sigma, self.n) + extra
        end = np.maximum(send_issue, recv_issue) + xfer
        both = send_alive & self.alive[s]
        chunk = op.chunk if self.vpp > 1 else -1
        nbytes = self.costs.p2p_bytes
        self.logs[src].add(EventDesc(f"send_{direction}", "p2p", "pp", op.microbatch, src_chunk if self.vpp > 1 else -1,
                                     s, nbytes), seq, send_issue, send_issue, end, both)
        self.logs[s].add(EventDesc(f"recv_{direction}", "p2p", "pp", op.microbatch, chunk, src, nbytes),
                         seq, recv_issue, recv_issue, end, both)
        self.cur[s] = np.where(self.alive[s], end, self.cur[s])

    def _step_tail(self, step: int, s: int) -> None:
        """Gradient reduce-scatter, optimizer, parameter all-gather (ZeRO-2, not overlapped here)."""
        c = self.costs
        issue = self.cur[s] + self._gap() + self._late_launch(s, step)
        if self.dp > 1:
            self.cur[s] = self._collective(s, step, "reduce_scatter", "dp", c.dp_bytes, c.dp_s, issue)
        else:
            self.cur[s] = np.where(self.alive[s], issue, self.cur[s])
        begin = self.cur[s] + self._gap()
        end = begin + c.optimizer_s * self.rng.lognormal(0, self.noise.op_sigma, self.n)
        self.logs[s].add(EventDesc("optimizer", "compute", "", -1, -1, -1, 0), -1, begin, begin, end,
                         self.alive[s].copy())
        self.cur[s] = np.where(self.alive[s], end, self.cur[s])
        if self.dp > 1:
            self.cur[s] = self._collective(s, step, "all_gather", "dp", c.dp_bytes, c.dp_s,
                                           self.cur[s] + self._gap())
