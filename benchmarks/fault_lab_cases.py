"""The fault lab's cases (benchmarks/fault_lab.py runs and scores them): each case's fault, its layout
and job, whether it is tuned or held out (the module docstring of fault_lab.py says when each part was
decided), and its true culprit and cause. A case is never moved between parts after it was first run."""

from __future__ import annotations

from dataclasses import dataclass, field

LINK_FAULTS = ("tbf", "cut")

TRUE_CAUSE = {"none": "none", "stop": "paused", "quota": "cpu_quota", "hog": "cpu_contention",
              "sleep": "paused", "data": "data_loading", "gc": "garbage_collection", "tbf": "network",
              "cut": "network"}
"""Each fault's true cause, by issue 41's contract: `paused` is "neither running nor waiting for a CPU:
stopped, sleeping, blocked", so a sleep before a step's first span is paused. Relabelled 2026-12-08 01:35
UTC after the cause matrix's first run, which scored ddp-sleep-r1 (said: paused) against "host_time", our
own earlier reading (no cause.py change was made for it; docs/fault-lab.md keeps that run's 6/7)."""


@dataclass(frozen=True)
class Case:
    name: str
    held_out: bool
    fault: str
    """none | stop | quota | hog | sleep | data (a slow loader) | gc (a full collection every step) | tbf (a
    rate limit) | cut (`ip link set down`, then up). sleep, data and gc are the job's own, from the onset step."""
    layout: tuple[str, ...]
    """--dp/--pp/--tp flags"""
    rank: int | None = None
    """the rank a rank fault acts on"""
    params: dict = field(default_factory=dict)
    nodes: int = 1
    seed: int = 1234
    job: str = "train"
    """train: `megascope train`; else an attached third-party job, samples/<job>.py under torchrun"""

    @property
    def cause(self) -> str:
        """The true cause: the explained_by a culprit's finding should carry (DESIGN.md section 7), "network"
        for a link fault (its network_flap / slow_link finding), "none" for a clean run."""
        return TRUE_CAUSE[self.fault]

    @property
    def expected(self) -> str:
        if self.fault == "none":
            return "none"
        return "link node0-node1" if self.fault in LINK_FAULTS else f"rank {self.rank}"

    @property
    def twin_key(self) -> tuple:
        """What a clean twin shares with this case: the same job, layout, hosts and seed (issue 31's
        what-if error is against the same job without the fault)."""
        return (self.job, self.layout, self.nodes, self.seed)


DP2PP2 = ("--dp", "2", "--pp", "2")
CASES = [
    Case("clean-a", False, "none", DP2PP2),
    Case("stop-r1", False, "stop", DP2PP2, 1, {"stop_ms": 30, "period_ms": 100}),
    Case("tbf-pp", False, "tbf", DP2PP2, None, {"rate": "8mbit", "on_s": 2.0, "off_s": 6.0}, nodes=2),
    Case("clean-b", True, "none", DP2PP2, seed=77),
    Case("stop-r2", True, "stop", DP2PP2, 2, {"stop_ms": 20, "period_ms": 70}),
    Case("quota-r3", True, "quota", DP2PP2, 3, {"share": 0.3}),
    # hog-r0 (DP2PP2, a hog pinned beside rank 0, the other three ranks free) was retired 2026-11-29 02:50
    # UTC: its expectation is false in its own data. In the three kept runs of 2026-11-28/29, during the
    # hog rank 0's compute grew 1.26-1.52x and stage 1's two ranks' 1.57-2.01x (they share the other CPU
    # with rank 1 and the trainer's threads): the hog slowed the box, not rank 0 above the rest, and no pinning
    # of four ranks on two CPUs makes the hog's rank the slowest (alone with it on one CPU it gets half of
    # it, the other three a third of the other). Its runs stay in docs/fault-lab.md. In its place, the
    # same fault where its label is true: the 2-rank job, the hog's rank and the other each on a CPU.
    # tbf-dp and cut-pp were held out until 87c855b: their one-step episodes made the network rule's
    # net_spike_share, so they are tuned from then on (their first scores are in docs/fault-lab.md)
    Case("tbf-dp", False, "tbf", ("--dp", "2", "--tp", "2"), None,
         {"rate": "8mbit", "on_s": 2.0, "off_s": 6.0}, nodes=2),
    # added 2026-11-27 23:20 UTC, held out, decided before either was first run: short cuts of node1's link
    # (down at the switch, then up: 300, 500, 800 ms in turn, one every 4 s) in tbf-pp's job, and the
    # clean twins the two-host cases' what-if is measured against (same layout and seed, no fault)
    Case("cut-pp", False, "cut", DP2PP2, None, {"cuts_ms": (300, 500, 800), "every_s": 4.0}, nodes=2),
    Case("clean-2h-pp", True, "none", DP2PP2, nodes=2),
    Case("clean-2h-dp", True, "none", ("--dp", "2", "--tp", "2"), nodes=2),
    # added 2026-11-27 23:50 UTC with 87c855b, held out, decided before either was first run: the network
    # rule's fresh test (other layout, rate, lengths and timing than the cases it was made from): cuts of
    # node1's link under the dp-crossing job (400 and 700 ms in turn, one every 5 s), and a harsher,
    # shorter throttle of the pp-crossing job (4 mbit, 1 s on in every 6 s)
    Case("cut-dp", True, "cut", ("--dp", "2", "--tp", "2"), None, {"cuts_ms": (400, 700), "every_s": 5.0}, nodes=2),
    Case("tbf-pp-4m", True, "tbf", DP2PP2, None, {"rate": "4mbit", "on_s": 1.0, "off_s": 5.0}, nodes=2),
    # attached third-party jobs (2 gloo ranks under torchrun, traced by attach or its callbacks); the part
    # was decided before any of them was run: the two ddp cases are what issue 31 item 4's change (host
    # time at a step's edges, d15bbe1) was looked at against; the rest are held out
    Case("ddp-clean", False, "none", (), job="ddp_loop"),
    Case("ddp-sleep-r1", False, "sleep", (), 1, {"sleep_ms": 30}, job="ddp_loop"),
    Case("hf-clean", True, "none", (), job="hf_trainer"),
    Case("ddp-stop-r0", True, "stop", (), 0, {"stop_ms": 20, "period_ms": 40}, job="ddp_loop"),
    Case("ddp-quota-r1", True, "quota", (), 1, {"share": 0.25}, job="ddp_loop"),
    Case("hf-stop-r1", True, "stop", (), 1, {"stop_ms": 15, "period_ms": 20}, job="hf_trainer"),
    Case("lightning-hog-r0", True, "hog", (), 0, {"cpu": 1}, job="lightning_loop"),
    # added after the seven above were scored, before it was first run: held out
    Case("fsdp2-stop-r1", True, "stop", (), 1, {"stop_ms": 20, "period_ms": 50}, job="fsdp2_loop"),
    # added 2026-11-28 02:10 UTC, held out, decided before any was first run and before settle drops a
    # lost-time finding charged a trifle of the run (ddp-stop-r0's extra "cost 0.0 s" finding): the mirror
    # of that miss, a quota on an FSDP2 job's rank 0, a clean Lightning job, a stop on the last stage
    Case("ddp-stop-r1", True, "stop", (), 1, {"stop_ms": 20, "period_ms": 40}, job="ddp_loop"),
    Case("fsdp2-quota-r0", True, "quota", (), 0, {"share": 0.3}, job="fsdp2_loop"),
    Case("lightning-clean", True, "none", (), job="lightning_loop"),
    Case("stop-r3", True, "stop", DP2PP2, 3, {"stop_ms": 25, "period_ms": 80}, seed=99),
    # added 2026-11-29 02:50 UTC, held out, decided before it was first run (hog-r0's replacement, above)
    Case("hog-dp2-r0", True, "hog", ("--dp", "2"), 0, {"cpu": 1}),
    # the cause cases (issue 41.4), added 2026-12-08 01:05 UTC by the split decided 2026-12-07 20:52 UTC
    # (module docstring), before any was first run: the job's own slow loader (`--inject slow_data`, a
    # sleep inside data_wait) and GC pressure (`--inject gc`: a live heap collected every step) on the
    # trainer, tuned; the same on another rank of another layout and on the attached DDP loop, held out
    Case("data-r1", False, "data", DP2PP2, 1, {"ms": 25}),
    Case("gc-r1", False, "gc", DP2PP2, 1, {"objects": 400_000}),
    Case("data-dp4-r2", True, "data", ("--dp", "4"), 2, {"ms": 40}, seed=55),
    Case("gc-dp4-r3", True, "gc", ("--dp", "4"), 3, {"objects": 1_000_000}, seed=55),
    Case("ddp-data-r1", True, "data", (), 1, {"ms": 25}, job="ddp_loop"),
    Case("ddp-gc-r0", True, "gc", (), 0, {"objects": 400_000}, job="ddp_loop"),
]
