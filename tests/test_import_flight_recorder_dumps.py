"""Flight-recorder dumps as people have them (issue 30): sub-groups smaller than the world whose pg names
collide across ranks, file names carrying host and rank, several jobs' dumps in one folder, a dump cut
off while being written. Each still names the hang's culprit. The real dumps come from this torch
build's gloo flight recorder (a world of 3 where rank 2 joins the fourth all-reduce only after the
others dumped), written once per module and renamed / copied / cut per test."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from megascope.analyzer import Run
from megascope.cli import main
from megascope.samples.distributed import run_distributed
from megascope.tracer.importers.cli import import_run
from megascope.tracer.importers.fr_files import group_jobs, parse_name
from megascope.tracer.importers.writer import ImportInputError
from tests.test_import_flight_recorder import _entry, _hang_and_dump

HAS_FR = hasattr(torch._C._distributed_c10d, "_dump_fr_trace")
real = pytest.mark.skipif(not HAS_FR, reason="this torch build has no flight recorder (_dump_fr_trace)")


@pytest.fixture(scope="module")
def gloo_dumps(tmp_path_factory) -> Path:
    """fr_trace_rank_{0,1,2}: ranks 0 and 1 wait in the fourth world all-reduce, rank 2 never joined it."""
    import os

    folder = tmp_path_factory.mktemp("dumps")
    old = os.environ.get("TORCH_FR_BUFFER_SIZE")
    os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"  # spawned ranks inherit it: the recorder is on
    try:
        run_distributed(_hang_and_dump, 3, str(folder), True)
    finally:
        if old is None:
            os.environ.pop("TORCH_FR_BUFFER_SIZE")
        else:
            os.environ["TORCH_FR_BUFFER_SIZE"] = old
    return folder


def _assert_rank_2_named(out: Path) -> None:
    hang = Run.open(out).hang()
    assert hang is not None and hang.suspects == [2], hang
    assert hang.waiting == [0, 1] and hang.op.startswith("all_reduce"), hang


@real
@pytest.mark.slow
def test_host_and_rank_in_file_names(gloo_dumps: Path, tmp_path: Path):
    """Names like the ones fr_trace could not read (pytorch#140879): host between the prefix and the rank."""
    folder = tmp_path / "dumps"
    folder.mkdir()
    hosts = {0: "container-node02", 1: "container-node02", 2: "container-node07"}
    for r in range(3):
        shutil.copy(gloo_dumps / f"fr_trace_rank_{r}", folder / f"nccl_trace_rank_{hosts[r]}_{r}")
    assert main(["import", "flight-recorder", str(folder), "--out", str(tmp_path / "run")]) == 0
    _assert_rank_2_named(tmp_path / "run")
    topology = json.loads((tmp_path / "run" / "run.json").read_text())["topology"]
    assert {row["rank"]: row["host"] for row in topology["ranks"]} == hosts


@real
@pytest.mark.slow
def test_several_jobs_in_one_folder(gloo_dumps: Path, tmp_path: Path, capsys):
    """Two jobs' dumps side by side (job ids in the names, both with ranks 0-2): refused with a list of the
    jobs, then each imported on its own with --job."""
    folder = tmp_path / "dumps"
    folder.mkdir()
    for job in ("slurm-81723", "slurm-81990"):
        for r in range(3):
            shutil.copy(gloo_dumps / f"fr_trace_rank_{r}", folder / f"{job}_nccl_trace_rank_{r}")
    assert main(["import", "flight-recorder", str(folder), "--out", str(tmp_path / "both")]) == 2
    err = capsys.readouterr().err
    assert "from 2 jobs" in err and "slurm-81723_nccl_trace_rank_<rank>: 3 dump(s), ranks 0-2" in err
    assert "--job" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "both").exists()
    for job in ("slurm-81723", "slurm-81990"):
        out = tmp_path / job
        assert main(["import", "flight-recorder", str(folder), "--job", job, "--out", str(out)]) == 0
        _assert_rank_2_named(out)
        manifest = json.loads((out / "run.json").read_text())
        assert manifest["flight_recorder"]["job"] == f"{job}_nccl_trace_rank_<rank>"
        assert all(Path(s["path"]).name.startswith(job) for s in manifest["import"]["sources"])
    with pytest.raises(ImportInputError, match="matches 2 of the jobs"):
        import_run("flight-recorder", [folder], tmp_path / "none", job="slurm-81")


@real
@pytest.mark.slow
def test_partially_written_dump(gloo_dumps: Path, tmp_path: Path):
    """Rank 0's dump cut inside its last entry (the all-reduce it waits in): its earlier entries are used,
    the lost in-flight op comes back from its pg_status, named from rank 1's entry; the culprit is still
    rank 2, and the cut is warned about."""
    folder = tmp_path / "dumps"
    folder.mkdir()
    for r in (1, 2):
        shutil.copy(gloo_dumps / f"fr_trace_rank_{r}", folder / f"fr_trace_rank_{r}")
    data = (gloo_dumps / "fr_trace_rank_0").read_bytes()
    whole = pickle.loads(data)
    (folder / "fr_trace_rank_0").write_bytes(data[:len(data) - 40])
    result = import_run("flight-recorder", [folder], tmp_path / "run")
    assert any("fr_trace_rank_0 is partially written" in w and f"first {len(whole['entries']) - 1} entries" in w
               for w in result.warnings), result.warnings
    _assert_rank_2_named(tmp_path / "run")
    record = json.loads((tmp_path / "run" / "inflight" / "rank=00000.json").read_text())
    assert record["op"] == "all_reduce" and record["seq"] == 3 and record["group"] == "dp"
    assert record["waiting_on"]["state"].startswith("unknown (the dump was cut off")
    ev = Run.open(tmp_path / "run").events(steps=(-1, -1), ranks=[0])
    assert list(ev[ev.group == "dp"].seq) == [0, 1, 2]  # its completed world all-reduces are all there
    # a dump cut before its first keys is not a dump
    (folder / "fr_trace_rank_0").write_bytes(data[:6])
    result = import_run("flight-recorder", [folder], tmp_path / "run2", dp=3)
    assert result.failed_sources == [str(folder / "fr_trace_rank_0")]


def _subgroup_dumps(folder: Path) -> None:
    """World 4 in the documented NCCL dump format. Each pair made its sub-group on its own (pg name '1' on
    both pairs: [0, 1] on ranks 0 and 1, [2, 3] on ranks 2 and 3, as each rank's pg_config says). Pair
    (2, 3) finished its three sub-group all-reduces and waits in the world all-reduce; in pair (0, 1)
    rank 0 waits in the third sub-group all-reduce, which rank 1 never started."""
    for rank in range(4):
        pair = [0, 1] if rank < 2 else [2, 3]
        config = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
                  "1": {"name": "1", "desc": "undefined", "ranks": str(pair)}}
        entries = [_entry(("0", "default_pg"), 1, 1000, True)]
        done = 3 if rank >= 2 else 2
        entries += [_entry(("1", "undefined"), s, 2000 + 100 * s, True) for s in range(1, done + 1)]
        if rank == 0:
            entries.append(_entry(("1", "undefined"), 3, 2300, False))
        if rank >= 2:
            entries.append(_entry(("0", "default_pg"), 2, 3000, False))
        status = {"0": {"last_enqueued_collective": 2 if rank >= 2 else 1, "last_completed_collective": 1},
                  "1": {"last_enqueued_collective": 3 if rank != 1 else 2, "last_completed_collective": done}}
        dump = {"version": "2.4", "pg_config": config, "pg_status": status, "entries": entries}
        (folder / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(dump))


def test_subgroups_smaller_than_the_world_keep_their_own_members(tmp_path: Path):
    _subgroup_dumps(tmp_path)
    result = import_run("flight-recorder", [tmp_path], tmp_path.parent / f"{tmp_path.name}-run")
    out = result.out
    hang = Run.open(out).hang()
    assert hang is not None and hang.suspects == [1], hang
    inflight = {r: json.loads((out / "inflight" / f"rank={r:05d}.json").read_text()) for r in (0, 2, 3)}
    assert inflight[0]["peers"] == [0, 1] and inflight[0]["seq"] == 2  # its own pair, not ranks 2 and 3
    assert inflight[2]["peers"] == inflight[3]["peers"] == [0, 1, 2, 3]
    ev = Run.open(out).events(steps=(-1, -1))
    pairs = ev[ev.group == "pg1"]  # every completed sub-group op on its own rank, none taken for another
    assert pairs.groupby("rank").size().to_dict() == {0: 2, 1: 2, 2: 3, 3: 3}
    assert set(ev.group) == {"pg1", "dp"}  # the default pg is the world: dp of this layout


@pytest.mark.parametrize("names, jobs, hosts", [
    (["nccl_trace_rank_0", "nccl_trace_rank_1"], ["nccl_trace_rank_<rank>"], {}),
    (["nccl_trace_rank_container-node02_5", "nccl_trace_rank_container-node07_40"],
     ["nccl_trace_rank_<host>_<rank>"], {5: "container-node02", 40: "container-node07"}),
    (["node07.dc_rank3.pkl", "node08.dc_rank4.pkl"], ["<host>_rank<rank>"], {3: "node07.dc", 4: "node08.dc"}),
    (["job7_rank0", "job7_rank1", "job9_rank0", "job9_rank1"], ["job7_rank<rank>", "job9_rank<rank>"], {}),
    (["a_n1_rank0", "a_n2_rank1", "b_n1_rank0", "b_n2_rank1"], ["a_<host>_rank<rank>", "b_<host>_rank<rank>"],
     {0: "n1", 1: "n2"}),
])
def test_file_name_rules(names: list[str], jobs: list[str], hosts: dict[int, str]):
    found = group_jobs([parse_name(Path(n)) for n in names])
    assert sorted(j.id for j in found) == jobs
    assert all(j.hosts == hosts for j in found)
    stray = group_jobs([parse_name(Path(n)) for n in [*names, "fr_trace.log"]])
    assert len(stray) == len(found) and "fr_trace.log" in [f.path.name for f in stray[0].files]
    assert parse_name(Path("rank3_node07")).rank == 3 and parse_name(Path("trace_rank_12.json")).rank == 12
