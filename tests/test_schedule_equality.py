"""The simulator runs the trainer's pipeline schedules: for every (pp, vpp, m) up to 8 the order in
which a simulated stage computes (read back from the trace it writes) is the order the trainer's
ScheduleExecutor would run (trainer/schedule_order.build_schedule)."""

import pyarrow.parquet as pq
import pytest

from megascope.trainer.pipelining.schedule_order import build_schedule

LAYOUTS = [(pp, vpp, m) for pp in range(1, 9) for vpp in range(1, 9) for m in range(1, 9)
           if vpp == 1 or (pp > 1 and m % pp == 0)]


def traced_order(run_dir, rank: int) -> list[str]:
    ev = pq.read_table(run_dir / "events" / f"rank={rank:05d}").to_pandas()
    comp = ev[ev.name.isin(["forward", "backward"])].sort_values("start_ns")
    # without a pipeline the trace writes chunk -1 (none); the schedule calls it chunk 0
    return [f"{n[0].upper()}{max(c, 0)}.{mb}" for n, c, mb in zip(comp.name, comp.chunk, comp.microbatch)]


def test_every_layout_is_enumerated():
    assert len(LAYOUTS) == 8 + 7 * 8 + 7 * (4 + 2 + 2 + 1 + 1 + 1 + 1)


@pytest.mark.parametrize("pp", range(1, 9))
def test_simulated_order_is_the_trainers(tmp_path, simulated_run, pp):
    for _, vpp, m in [x for x in LAYOUTS if x[0] == pp]:
        run = simulated_run(tmp_path / f"pp{pp}-vpp{vpp}-m{m}", dp=1, tp=1, pp=pp, vpp=vpp, micro_batches=m, steps=1,
                            model={"n_layers": 8 * 8, "hidden": 256, "n_heads": 4, "seq_len": 128,
                                   "vocab_size": 512, "window": 0, "ffn_mult": 4})
        for stage in range(pp):
            expected = [repr(a) for a in build_schedule(pp, vpp, stage, m)]
            assert traced_order(run, stage) == expected, (pp, vpp, m, stage)
