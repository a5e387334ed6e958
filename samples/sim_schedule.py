"""Pipeline schedules for the trace simulator: per-stage op order (1F1B, interleaved 1F1B) and a
global order in which every op's cross-stage dependency is already resolved.

Follows Megatron-LM's schedules: stage s runs `warmup` forwards, then alternates one forward and
one backward, then drains the remaining backwards. Interleaved: forward k of a stage runs chunk
(k mod pp*vpp) // pp on micro-batch (k // (pp*vpp))*pp + k mod pp; backwards visit chunks in reverse.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipeOp:
    """One compute op of a stage: forward ("F") or backward ("B") of a micro-batch on a chunk."""
    kind: str
    microbatch: int
    chunk: int


def _forward_op(k: int, pp: int, vpp: int, backward: bool) -> PipeOp:
    in_group = k % (pp * vpp)
    chunk = in_group // pp
    if backward:
        chunk = vpp - 1 - chunk
    microbatch = (k // (pp * vpp)) * pp + in_group % pp
    return PipeOp("B" if backward else "F", microbatch, chunk)


def stage_order(stage: int, pp: int, micro_batches: int, vpp: int = 1) -> list[PipeOp]:
    """The program order of compute ops on one pipeline stage for one step."""
    if vpp > 1 and micro_batches % pp:
        raise ValueError(f"the interleaved schedule needs micro-batches ({micro_batches}) divisible by pp={pp}")
    total = micro_batches * vpp
    if vpp == 1:
        warmup = min(pp - stage - 1, total)
    else:
        warmup = min((pp - stage - 1) * 2 + (vpp - 1) * pp, total)
    forwards = [_forward_op(k, pp, vpp, backward=False) for k in range(total)]
    backwards = [_forward_op(k, pp, vpp, backward=True) for k in range(total)]
    order = forwards[:warmup]
    for i in range(total - warmup):
        order += [forwards[warmup + i], backwards[i]]
    order += backwards[total - warmup:]
    return order


def upstream(op: PipeOp, stage: int, pp: int, vpp: int) -> tuple[int, int] | None:
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
