"""Pipeline schedules for the trace simulator: the trainer's per-stage op order (1F1B, interleaved
1F1B; trainer/pipelining/schedule_order.py) and a global order in which every op's cross-stage dependency is
already resolved.
"""

from __future__ import annotations

from megascope.trainer.pipelining.schedule_order import Action, build_schedule


def stage_order(stage: int, pp: int, micro_batches: int, vpp: int = 1) -> list[Action]:
    """The program order of compute ops on one pipeline stage for one step: the trainer's own
    schedule (trainer/pipelining/schedule_order.py), so simulated and real runs share one rule."""
    return build_schedule(pp, vpp, stage, micro_batches)


def upstream(op: Action, stage: int, pp: int, vpp: int) -> tuple[int, int] | None:
    """(stage, chunk) whose op of the same kind and micro-batch this op waits for, or None.

    Forward on virtual stage v = chunk*pp + stage needs forward on v-1; backward needs backward on v+1."""
    v = op.chunk * pp + stage
    src = v - 1 if op.kind == "F" else v + 1
    if src < 0 or src >= pp * vpp:
        return None
    return src % pp, src // pp


def global_order(pp: int, micro_batches: int, vpp: int = 1) -> list[tuple[int, int]]:
    """(stage, index into stage_order) for every op, each after the op it depends on."""
    orders = [stage_order(s, pp, micro_batches, vpp) for s in range(pp)]
    position = [0] * pp
    done: set[tuple[str, int, int, int]] = set()  # (kind, microbatch, chunk, stage)
    result: list[tuple[int, int]] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(pp):
            while position[s] < len(orders[s]):
                op = orders[s][position[s]]
                dep = upstream(op, s, pp, vpp)
                if dep is not None and (op.kind, op.microbatch, dep[1], dep[0]) not in done:
                    break
                done.add((op.kind, op.microbatch, op.chunk, s))
                result.append((s, position[s]))
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocks; this is a bug in the simulator")
    return result
