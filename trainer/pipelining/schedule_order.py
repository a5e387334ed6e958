"""Pipeline schedules as pure action lists (no torch: the trainer, the simulator and tests share them).

A schedule is the ordered list of (forward | backward, chunk, micro-batch) a stage computes in one
step; communication follows from it (a chunk's forward needs the previous virtual stage's activation,
its backward the next virtual stage's gradient), so the list alone fixes the pipeline's behaviour and
its bubble, and can be checked without any process group.

- pp = 1: forward then backward per micro-batch, gradients accumulating (the degenerate schedule).
- 1F1B (PipeDream-Flush): stage p runs pp-p-1 warm-up forwards, then alternates one forward and one
  backward, then drains the remaining backwards. Bubble (p-1)/m of the ideal time.
- Interleaved 1F1B (Megatron-LM SC21): each stage holds vpp chunks and cycles through them in groups
  of pp micro-batches; bubble (p-1)/(v*m). Needs m divisible by pp.
"""

from __future__ import annotations

from dataclasses import dataclass

FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True)
class Action:
    kind: str
    """F (forward) or B (backward)."""
    chunk: int
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.microbatch}"


def schedule_name(pp: int, vpp: int) -> str:
    return "none" if pp == 1 else ("interleaved" if vpp > 1 else "1f1b")


def analytical_bubble(pp: int, vpp: int, n_micro: int) -> float:
    """Bubble time as a fraction of the ideal (bubble-free) time: (p-1)/(v*m)."""
    return (pp - 1) / (vpp * n_micro)


def one_f_one_b(pp: int, stage: int, n_micro: int) -> list[Action]:
    """PipeDream-Flush for one stage (also pp = 1: F, B per micro-batch)."""
    warmup = min(pp - stage - 1, n_micro)
    actions = [Action(FORWARD, 0, mb) for mb in range(warmup)]
    for i in range(n_micro - warmup):
        actions.append(Action(FORWARD, 0, warmup + i))
        actions.append(Action(BACKWARD, 0, i))
    actions += [Action(BACKWARD, 0, mb) for mb in range(n_micro - warmup, n_micro)]
    return actions


def interleaved_one_f_one_b(pp: int, vpp: int, stage: int, n_micro: int) -> list[Action]:
    """Megatron-LM's interleaved schedule for one stage. The k-th forward of a stage runs chunk
    (k mod pp*vpp) // pp on micro-batch (k // (pp*vpp))*pp + k mod pp; backwards visit chunks in
    reverse. Warm-up: (pp - stage - 1)*2 + (vpp - 1)*pp forwards (all of them when m == pp)."""
    if n_micro % pp:
        raise ValueError(f"the interleaved schedule needs micro-batches ({n_micro}) divisible by pp={pp}; "
                         "change --global-batch or --micro-batch")
    total = n_micro * vpp
    group = pp * vpp

    def at(k: int, kind: str) -> Action:
        chunk = (k % group) // pp
        if kind == BACKWARD:
            chunk = vpp - 1 - chunk
        return Action(kind, chunk, (k // group) * pp + k % pp)

    warmup = total if n_micro == pp else min((pp - stage - 1) * 2 + (vpp - 1) * pp, total)
    actions = [at(k, FORWARD) for k in range(warmup)]
    for k in range(total - warmup):
        actions.append(at(warmup + k, FORWARD))
        actions.append(at(k, BACKWARD))
    actions += [at(k, BACKWARD) for k in range(total - warmup, total)]
    return actions


def build_schedule(pp: int, vpp: int, stage: int, n_micro: int) -> list[Action]:
    """The schedule `ParallelConfig` selects: interleaved when vpp > 1, else 1F1B (pp = 1 included)."""
    if vpp > 1:
        return interleaved_one_f_one_b(pp, vpp, stage, n_micro)
    return one_f_one_b(pp, stage, n_micro)


def simulate(pp: int, vpp: int, n_micro: int, forward_time: float = 1.0,
             backward_time: float = 2.0) -> float:
    """Makespan of the whole pipeline when every chunk's forward/backward takes the given times and
    transfers are free: a dependency-driven replay of build_schedule on every stage. Checks that the
    schedules are deadlock-free and gives the bubble a schedule really has (tests, benchmark)."""
    n_virtual = pp * vpp
    queues = [build_schedule(pp, vpp, s, n_micro) for s in range(pp)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, mb) -> finish time
    clock = [0.0] * pp
    pos = [0] * pp
    scale = 1.0 / vpp  # a chunk holds 1/vpp of a stage's layers
    while any(pos[s] < len(queues[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            if pos[s] == len(queues[s]):
                continue
            a = queues[s][pos[s]]
            vs = a.chunk * pp + s
            if a.kind == FORWARD:
                dep = ("F", vs - 1, a.microbatch) if vs > 0 else None
            else:
                dep = ("B", vs + 1, a.microbatch) if vs < n_virtual - 1 else ("F", vs, a.microbatch)
            if dep is not None and dep not in done:
                continue
            start = max(clock[s], done[dep] if dep else 0.0)
            cost = (forward_time if a.kind == FORWARD else backward_time) * scale
            clock[s] = start + cost
            done[(a.kind, vs, a.microbatch)] = clock[s]
            pos[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"schedule deadlocks for pp={pp}, vpp={vpp}, m={n_micro}")
    return max(clock)
