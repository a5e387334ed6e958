"""One fault grammar for `megascope train --inject` and `megascope simulate --inject` (trainer/robust/faults.py):
each side knows its own kinds, both raise the same FaultSpecError, and an unknown kind is refused
with the valid kinds named."""

from __future__ import annotations

import pytest

from megascope.samples import faults_sim
from megascope.trainer.robust import faults

TRAIN_SPECS = ["straggler:rank=1,slowdown=2,from=3,to=5", "late_launch:rank=0,ms=5,every=2",
               "flap:ranks=0-3,down_ms=50,period_steps=4", "hang:rank=2,at=3", "crash:rank=3,at=1",
               "slow_data:rank=1,ms=25,from=4", "gc:rank=2,objects=1000,from=2,to=9"]
SIM_SPECS = ["straggler:ranks=2-5,slowdown=0.2,from=3", "late_launch:rank=0,ms=5,every=2,from=1,to=9",
             "flap:ranks=1-9,down_ms=5,period_steps=6,len=2", "hang:rank=2,at=3", "imbalance:stage=1,slowdown=1.3",
             "slow_link:ranks=4-12,factor=3"]


def test_one_error_class():
    assert faults_sim.FaultSpecError is faults.FaultSpecError


@pytest.mark.parametrize("spec", TRAIN_SPECS)
def test_train_specs_parse(spec):
    parsed = faults.parse_spec(spec, world_size=16)
    assert parsed.kind == spec.split(":")[0] and parsed.ranks


@pytest.mark.parametrize("spec", SIM_SPECS)
def test_simulator_specs_parse(spec):
    fault = faults_sim.parse_fault(spec)
    assert fault.kind == spec.split(":")[0]


def test_each_side_refuses_the_other_sides_kind_and_names_its_own():
    with pytest.raises(faults.FaultSpecError) as exc:
        faults_sim.parse_fault("crash:rank=1,at=2")
    message = str(exc.value)
    assert "'crash' is a fault of megascope train only" in message
    assert "the kinds are straggler, late_launch, flap, hang, imbalance, slow_link" in message
    with pytest.raises(faults.FaultSpecError, match=r"\('imbalance' is a fault of megascope simulate only\); the "
                                                    "kinds are straggler, late_launch, flap, hang, crash"):
        faults.parse_spec("imbalance:stage=1,slowdown=2", world_size=4)
    with pytest.raises(faults.FaultSpecError, match="unknown fault 'meltdown'; the kinds are"):
        faults.parse_spec("meltdown:rank=1", world_size=4)


@pytest.mark.parametrize("spec, side, words", [
    ("straggler:slowdown=2", "sim", "missing rank or ranks; syntax: straggler:rank=R|ranks=A-B"),
    ("straggler:rank=1", "train", "missing slowdown; syntax: straggler:rank=R,slowdown=X"),
    ("flap:ranks=0-1,down_ms=5,period_steps=4,len=2", "train", "bad field 'len=2'"),
    ("hang:rank=1,at", "sim", "bad field 'at'"),
])
def test_field_errors_show_the_kinds_syntax(spec, side, words):
    parse = faults_sim.parse_fault if side == "sim" else (lambda s: faults.parse_spec(s, world_size=4))
    with pytest.raises(faults.FaultSpecError) as exc:
        parse(spec)
    assert words in str(exc.value) and str(exc.value).startswith(f"--inject '{spec}': ")


def test_a_slow_loader_and_gc_pressure_act_on_their_rank_from_their_step():
    import gc
    import time

    specs = faults.parse_specs(["slow_data:rank=1,ms=30,from=2", "gc:rank=1,objects=50000,from=2"], world_size=2)
    collections: list[str] = []
    callback = lambda phase, info: collections.append(phase) if info["generation"] == 2 else None  # noqa: E731
    gc.callbacks.append(callback)
    try:
        for rank in (0, 1):
            f = faults.Faults(specs, rank)
            for step in (1, 2):
                f.at_step_start(step)
                collections.clear()
                t0 = time.perf_counter()
                f.in_data_wait()
                waited = time.perf_counter() - t0
                f.before_step_work()
                hit = rank == 1 and step == 2
                assert (waited >= 0.03) == hit, (rank, step, waited)
                assert ("start" in collections) == hit, (rank, step)  # a full (generation 2) collection
            assert len(f._heap) == (50000 if rank == 1 else 0)
    finally:
        gc.callbacks.remove(callback)


@pytest.mark.parametrize("spec", ["slow_data:rank=0,ms=0", "gc:rank=0,objects=-5"])
def test_a_slow_loader_or_gc_of_nothing_is_refused(spec):
    with pytest.raises(faults.FaultSpecError, match="must be > 0"):
        faults.parse_spec(spec, world_size=2)
