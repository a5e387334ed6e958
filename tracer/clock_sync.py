"""Estimate every rank's clock offset to rank 0 by ping-pong over a process group (NTP-style).

One exchange between a leader and a peer: the leader sends its time t0, the peer stamps arrival t1
and departure t2 and replies, the leader stamps the reply's arrival t3. Then

    offset = ((t1 - t0) + (t2 - t3)) / 2      (the peer's clock minus the leader's clock)
    delay  = (t3 - t0) - (t2 - t1)            (network round trip, excluding the peer's turnaround)

and of `rounds` exchanges the one with the least delay wins: its error is at most delay / 2, and
queueing noise only ever adds delay.

Two levels, so the cost does not grow with the world size at rank 0:
  1. within each host, its lowest rank leads exchanges with the host's other ranks (every host at once:
     the pairs are disjoint);
  2. the group's first rank (the reference) leads exchanges with each other host's leader.
A rank's offset to the reference is the sum of its two hops (offsets and delays add), and one
all-reduce gives every rank the whole table. Cost: (ranks per host - 1 + hosts - 1) * rounds round
trips, against (world - 1) * rounds when the reference pinged every rank: 12,288 ranks on 1,536
8-GPU hosts need 1,542 sequential exchanges instead of 12,287. It is a collective: every rank of the
group must call it at the same point.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megascope.tracer.clock import HostClock


@dataclass
class ClockSyncResult:
    offsets_ns: dict[int, int]
    """global rank -> that rank's clock minus rank 0's clock, ns."""
    delays_ns: dict[int, int]
    """global rank -> round-trip delay of the winning round (uncertainty is half of it), ns; for a
    rank synced through its host leader, the sum of both hops' delays."""
    hosts: int = 1
    """Hosts the group spans (each synced through its leader)."""


def _tensor_device(group: ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _wait_arrival(device: torch.device) -> None:
    if device.type == "cuda":
        # note: this is a CPU-GPU sync point: a received CUDA tensor has only arrived once the stream
        # catches up; clock sync runs at a step boundary, where a sync costs nothing extra.
        torch.cuda.synchronize(device)


def _leader_rounds(clock: HostClock, peer: int, rounds: int, group: ProcessGroup | None,
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


def _follower_rounds(clock: HostClock, leader: int, rounds: int, group: ProcessGroup | None,
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


def estimate_offsets(clock: HostClock, group: ProcessGroup | None = None, rounds: int = 8) -> ClockSyncResult:
    """Collective over `group` (default: world). The group's first rank is the reference; hosts are
    told apart by `clock.host` (the hostname by default)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    group = group if group is not None else dist.group.WORLD
    members = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    device = _tensor_device(group)
    hosts = _host_of_each_member(clock.host, len(members), group, device)
    host_leader: dict[int, int] = {}  # host -> its lowest member (members are in rank order)
    for rank, host in zip(members, hosts):
        host_leader.setdefault(host, rank)
    my_host = hosts[members.index(me)]
    # each rank's row receives its host-level hop from its host leader and the host leader's hop to
    # the reference from the reference; the all-reduce adds them up (rows built on the host: no
    # per-element device writes)
    rows = [[0, 0] for _ in members]
    if me == host_leader[my_host]:
        for i, (peer, host) in enumerate(zip(members, hosts)):
            if host == my_host and peer != me:
                rows[i] = list(_leader_rounds(clock, peer, rounds, group, device))
    else:
        _follower_rounds(clock, host_leader[my_host], rounds, group, device)
    reference = members[0]
    if me == reference:
        hop: dict[int, tuple[int, int]] = {my_host: (0, 0)}
        for host, leader in host_leader.items():
            if leader != me:
                hop[host] = _leader_rounds(clock, leader, rounds, group, device)
        rows = [[offset + hop[host][0], delay + hop[host][1]] for (offset, delay), host in zip(rows, hosts)]
    elif me == host_leader[my_host]:
        _follower_rounds(clock, reference, rounds, group, device)
    table = torch.tensor(rows, dtype=torch.int64, device=device)
    dist.all_reduce(table, group=group)
    rows = table.cpu().tolist()
    return ClockSyncResult(offsets_ns={r: int(rows[i][0]) for i, r in enumerate(members)},
                           delays_ns={r: int(rows[i][1]) for i, r in enumerate(members)},
                           hosts=len(host_leader))


def _host_of_each_member(host: str, size: int, group: ProcessGroup | None, device: torch.device) -> list[int]:
    """Every member's host, as a 63-bit hash of its name (one all-gather of an int64)."""
    digest = int.from_bytes(hashlib.blake2b(host.encode(), digest_size=8).digest(), "little") >> 1
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    everyone = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(size)]
    dist.all_gather(everyone, mine, group=group)
    return torch.cat(everyone).cpu().tolist()
