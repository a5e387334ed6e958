"""Estimate every rank's clock offset to rank 0 by ping-pong over a process group (NTP-style).

For each rank r, rank 0 runs `rounds` exchanges: it sends its time t0, r stamps arrival t1 and
departure t2 and replies, rank 0 stamps the reply's arrival t3. Then

    offset = ((t1 - t0) + (t2 - t3)) / 2      (r's clock minus rank 0's clock)
    delay  = (t3 - t0) - (t2 - t1)            (network round trip, excluding r's turnaround)

and the round with the least delay wins: its error is at most delay / 2, and queueing noise only ever
adds delay. Rank 0 then broadcasts every rank's (offset, delay) so each rank can align its own
timestamps. It is a collective: every rank of the group must call it at the same point.

Cost is world * rounds sequential round trips at rank 0 (milliseconds for tens of ranks on gloo);
for thousands of ranks a tree of per-host syncs would be needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megascope.tracer.clock import HostClock


@dataclass
class ClockSyncResult:
    offsets_ns: dict[int, int]
    """global rank -> that rank's clock minus rank 0's clock, ns."""
    delays_ns: dict[int, int]
    """global rank -> round-trip delay of the winning round (uncertainty is half of it), ns."""


def _tensor_device(group: object) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _wait_arrival(device: torch.device) -> None:
    if device.type == "cuda":
        # note: this is a CPU-GPU sync point: a received CUDA tensor has only arrived once the stream
        # catches up; clock sync runs at a step boundary, where a sync costs nothing extra.
        torch.cuda.synchronize(device)


def _leader_rounds(clock: HostClock, peer: int, rounds: int, group: object,
                   device: torch.device) -> tuple[int, int]:
    """Rank 0's side with one peer; returns (offset, delay) of the least-delay round."""
    ping = torch.zeros(1, dtype=torch.int64, device=device)
    pong = torch.zeros(2, dtype=torch.int64, device=device)
    best: tuple[int, int] | None = None
    for _ in range(rounds):
        t0 = clock.local_ns()
        ping.fill_(t0)
        dist.send(ping, dst=peer, group=group)
        dist.recv(pong, src=peer, group=group)
        _wait_arrival(device)
        t3 = clock.local_ns()
        t1, t2 = (int(v) for v in pong.tolist())
        delay = (t3 - t0) - (t2 - t1)
        offset = ((t1 - t0) + (t2 - t3)) // 2
        if best is None or delay < best[1]:
            best = (offset, delay)
    assert best is not None
    return best


def _follower_rounds(clock: HostClock, leader: int, rounds: int, group: object,
                     device: torch.device) -> None:
    ping = torch.zeros(1, dtype=torch.int64, device=device)
    pong = torch.zeros(2, dtype=torch.int64, device=device)
    for _ in range(rounds):
        dist.recv(ping, src=leader, group=group)
        _wait_arrival(device)
        t1 = clock.local_ns()
        pong[0] = t1
        pong[1] = clock.local_ns()
        dist.send(pong, dst=leader, group=group)


def estimate_offsets(clock: HostClock, group: object | None = None, rounds: int = 8) -> ClockSyncResult:
    """Collective over `group` (default: world). Rank 0 of the group is the reference."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    group = group if group is not None else dist.group.WORLD
    members = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    leader = members[0]
    device = _tensor_device(group)
    table = torch.zeros(len(members), 2, dtype=torch.int64, device=device)
    if me == leader:
        for i, peer in enumerate(members[1:], start=1):
            table[i, 0], table[i, 1] = _leader_rounds(clock, peer, rounds, group, device)
    else:
        _follower_rounds(clock, leader, rounds, group, device)
    dist.broadcast(table, src=leader, group=group)
    rows = table.cpu().tolist()
    return ClockSyncResult(offsets_ns={r: int(rows[i][0]) for i, r in enumerate(members)},
                           delays_ns={r: int(rows[i][1]) for i, r in enumerate(members)})
