"""Fault specs for the simulator, read by the trainer's parser (trainer/faults.parse_fields: one grammar,
one FaultSpecError) with the simulator's kinds (faults.SIMULATE_KINDS), and turned into `Fault`s.

    straggler:rank=R,slowdown=X[,from=S][,to=S]     compute of rank R (or ranks=A-B) slower
    late_launch:rank=R,ms=M[,every=K][,from=S]      rank R pauses M ms before issuing its collectives
    flap:ranks=A-B,down_ms=D,period_steps=P[,len=L][,from=S]   link A-B down for L steps every P
    hang:rank=R,at=S                                rank R stops inside step S
    imbalance:stage=P,slowdown=X                    every rank of pipeline stage P slower
    slow_link:ranks=A-B,factor=X                    link A-B X times slower, all steps

slowdown: a value above 1 is a factor (1.2 = 20% slower); 1 or below is a fraction (0.2 = 20% slower).
A link is the p2p pair when A and B are pipeline neighbours, else the collective group holding both.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from megascope.trainer.robust.faults import SIMULATE_KINDS, FaultSpecError, parse_fields

__all__ = ["Fault", "FaultSpecError", "check_ranks", "parse_fault"]


@dataclass
class Fault:
    kind: str
    ranks: list[int] = field(default_factory=list)
    stage: int = -1
    factor: float = 1.0          # multiplicative slowdown (compute or transfer)
    ms: float = 0.0              # late-launch pause or flap extra time per transfer
    every: int = 1
    period: int = 0
    length: int = 0
    first: int = 0               # first affected step
    last: int = 1 << 40          # last affected step (inclusive)

    def active(self, step: int) -> bool:
        if not self.first <= step <= self.last:
            return False
        if self.kind == "late_launch":
            return (step - self.first) % self.every == 0
        if self.kind == "flap":
            return (step - self.first) % self.period < self.length
        return True

    def to_dict(self) -> dict:
        out = asdict(self)
        out["last"] = None if self.last >= 1 << 40 else self.last
        return out


def _range(text: str, spec: str) -> list[int]:
    try:
        if "-" in text:
            a, b = (int(x) for x in text.split("-", 1))
            return list(range(a, b + 1)) if a <= b else list(range(b, a + 1))
        return [int(text)]
    except ValueError:
        raise FaultSpecError(f"{spec}: '{text}' is not a rank or a range A-B") from None


def _slowdown(text: str, spec: str) -> float:
    value = float(text)
    if value <= 0:
        raise FaultSpecError(f"{spec}: slowdown must be > 0 (0.2 or 1.2 both mean 20% slower)")
    return value if value > 1 else 1.0 + value


def parse_fault(spec: str) -> Fault:
    kind, fields = parse_fields(spec, SIMULATE_KINDS)
    try:
        return _build(kind, fields, spec)
    except ValueError as exc:
        if isinstance(exc, FaultSpecError):
            raise
        raise FaultSpecError(f"{spec}: {exc}") from None


def _build(kind: str, f: dict[str, str], spec: str) -> Fault:
    fault = Fault(kind=kind, first=int(f.get("from", 0)))
    if "to" in f:
        fault.last = int(f["to"])
    if "rank" in f:
        fault.ranks = _range(f["rank"], spec)
    if "ranks" in f:
        fault.ranks = _range(f["ranks"], spec)
    if kind in ("straggler", "imbalance"):
        fault.factor = _slowdown(f["slowdown"], spec)
    if kind == "imbalance":
        fault.stage = int(f["stage"])
    if kind == "late_launch":
        fault.ms, fault.every = float(f["ms"]), int(f.get("every", 1))
    if kind == "flap":
        fault.ms, fault.period = float(f["down_ms"]), int(f["period_steps"])
        fault.length = int(f.get("len", max(1, fault.period // 3)))
        fault.first = int(f.get("from", fault.period))
        if fault.period < 2 or not 0 < fault.length < fault.period:
            raise FaultSpecError(f"{spec}: need period_steps >= 2 and 0 < len < period_steps")
    if kind == "slow_link":
        fault.factor = float(f["factor"])
    if kind == "hang":
        fault.first = fault.last = int(f["at"])
    if kind in ("flap", "slow_link") and len(fault.ranks) != 2:
        fault.ranks = [fault.ranks[0], fault.ranks[-1]]
        if fault.ranks[0] == fault.ranks[1]:
            raise FaultSpecError(f"{spec}: a link needs two different ranks, e.g. ranks=4-12")
    if fault.every < 1:
        raise FaultSpecError(f"{spec}: every must be >= 1")
    return fault


def check_ranks(faults: list[Fault], world: int, pp: int) -> None:
    for fault in faults:
        bad = [r for r in fault.ranks if not 0 <= r < world]
        if bad:
            raise FaultSpecError(f"{fault.kind}: rank(s) {bad} outside the job's {world} ranks")
        if fault.kind == "imbalance" and not 0 <= fault.stage < pp:
            raise FaultSpecError(f"imbalance: stage {fault.stage} outside 0..{pp - 1}")
