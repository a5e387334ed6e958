"""Two-stage checkpoints: exact resume, one reader per dp group, atomicity under a kill, keep-last,
and a clear refusal of a layout change."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from megascope.samples.distributed import run_distributed
from megascope.trainer.config import JobConfig
from megascope.trainer.robust import checkpoint as ck

STEPS, SAVE_AT = 4, 2


def make_cfg(run_dir: str, dp: int, pp: int, zero: bool = True) -> JobConfig:
    cfg = JobConfig()
    cfg.run_dir = run_dir
    cfg.model.n_layers, cfg.model.hidden, cfg.model.n_heads, cfg.model.seq_len = 2, 32, 2, 16
    cfg.train.global_batch, cfg.train.micro_batch, cfg.train.warmup_steps = 8, 2, 2
    cfg.parallel.dp, cfg.parallel.pp, cfg.parallel.zero = dp, pp, zero
    cfg.trace.enabled = False
    cfg.robust.keep_last = 2
    return cfg


def _build(cfg: JobConfig, rank: int):
    from megascope.trainer.parallel.parallel_dims import ParallelDims
    from megascope.trainer.parallel.parallelize import parallelize
    from megascope.trainer.robust.faults import Faults

    p = cfg.parallel
    dims = ParallelDims(p.dp, p.tp, p.pp, p.vpp)
    dims.build_groups()
    return dims, parallelize(cfg, dims, torch.device("cpu"), Faults([], rank))


def _train(state, cfg, dims, rank, start: int, stop: int, manager=None) -> list[float]:
    from megascope.trainer.data import build_loader
    from megascope.trainer.lr_schedule import learning_rate
    from megascope.trainer.step import train_step

    loader = build_loader(cfg, dims, rank, torch.device("cpu"), start_step=start)
    losses = []
    try:
        for step in range(start, stop):
            batch, _ = loader.next()
            losses.append(train_step(state, batch, learning_rate(cfg.train, step)).loss)
            if manager is not None and (step + 1) == SAVE_AT:
                manager.save(step + 1, state)
    finally:
        loader.close()
    return losses


def resume_worker(rank: int, world: int, run_dir: str, dp: int, pp: int, zero: bool) -> dict:
    cfg = make_cfg(run_dir, dp, pp, zero)
    dims, state = _build(cfg, rank)
    manager = ck.CheckpointManager(cfg, dims, rank, torch.device("cpu"))
    straight = _train(state, cfg, dims, rank, 0, STEPS, manager)
    manager.close()
    torch.distributed.barrier()  # rank 0 publishes the manifest inside close()
    # a fresh model (the same seed) must reach the same losses once it loads the checkpoint
    dims2, state2 = _build(cfg, rank)
    reads = []
    real_load = torch.load
    ck.torch.load = lambda path, **kw: (reads.append(Path(path).name), real_load(path, **kw))[1]
    try:
        manager2 = ck.CheckpointManager(cfg, dims2, rank, torch.device("cpu"))
        start = manager2.resume(state2)
    finally:
        ck.torch.load = real_load
    resumed = _train(state2, cfg, dims2, rank, start, STEPS)
    return {"straight": straight[start:], "resumed": resumed, "start": start, "reads": reads,
            "coords": vars(dims.coords(rank))}


@pytest.mark.parametrize("dp,pp,zero", [(2, 2, True), (2, 1, False)])
def test_resume_matches_uninterrupted_and_reads_once_per_dp_group(tmp_path, dp, pp, zero):
    results = run_distributed(resume_worker, dp * pp, str(tmp_path), dp, pp, zero)
    for r in results:
        assert r["start"] == SAVE_AT
        # bit-identical; NaN (on ranks that hold no loss) equals NaN here
        assert len(r["resumed"]) == STEPS - SAVE_AT
        assert all(a == b or (a != a and b != b) for a, b in zip(r["resumed"], r["straight"]))
    assert any(x == x for x in results[0]["resumed"])  # rank 0 holds the loss
    writers = dp if zero else 1
    for r in results:
        c = r["coords"]
        expected = [ck.shard_name(c["pp"], c["tp"], d) for d in range(writers)] if c["dp"] == 0 else []
        assert r["reads"] == expected  # dp rank 0 reads its group's shards; its peers read nothing
    info = ck.latest_complete(tmp_path)
    assert info is not None and info.step == SAVE_AT
    assert sorted(info.manifest["files"]) == sorted(p.name for p in info.path.glob("shard-*.pt"))


def test_layout_change_is_refused_with_what_to_do(tmp_path):
    saved = make_cfg(str(tmp_path), dp=2, pp=1)
    directory = ck.step_dir(tmp_path, 4)
    directory.mkdir(parents=True)
    (directory / ck.MANIFEST).write_text(json.dumps({"step": 4, "layout": ck.layout_of(saved), "files": []}))
    info = ck.latest_complete(tmp_path)
    ck.check_resumable(info, saved)  # same layout: fine
    with pytest.raises(ck.CheckpointLayoutError, match=r"dp: saved 2, now 4.*new --run-dir"):
        ck.check_resumable(info, make_cfg(str(tmp_path), dp=4, pp=1))
    from megascope.trainer.launch import check_resume

    assert "dp: saved 2, now 4" in check_resume(make_cfg(str(tmp_path), dp=4, pp=1), resume=True)


def _fake_checkpoint(run_dir: Path, step: int, complete: bool) -> None:
    d = ck.step_dir(run_dir, step)
    d.mkdir(parents=True)
    (d / "shard-pp000-tp000-dp000.pt").write_bytes(b"x")
    if complete:
        (d / ck.MANIFEST).write_text(json.dumps({"step": step, "files": ["shard-pp000-tp000-dp000.pt"]}))


def test_prune_keeps_last_k_complete_and_drops_abandoned(tmp_path):
    for step, complete in [(2, True), (4, False), (6, True), (8, True), (10, False)]:
        _fake_checkpoint(tmp_path, step, complete)
    cfg = make_cfg(str(tmp_path), dp=1, pp=1)
    manager = ck.CheckpointManager.__new__(ck.CheckpointManager)
    manager.cfg, manager.run_dir = cfg, tmp_path
    manager.prune()
    left = sorted(p.name for p in ck.checkpoint_root(tmp_path).iterdir())
    # 6 and 8 kept (keep_last=2); 2 and the abandoned 4 dropped; 10 may still be in progress
    assert left == ["step-000006", "step-000008", "step-000010"]
    assert [c.step for c in ck.list_complete(tmp_path)] == [6, 8]


CHILD = textwrap.dedent("""
    import sys, time, torch
    from megascope.trainer.robust import checkpoint as ck
    from megascope.trainer.config import JobConfig
    from megascope.trainer.parallel.parallel_dims import ParallelDims

    class Opt:  # the optimizer interface the manager uses
        def __init__(self): self.master = torch.randn(1 << 18)
        def wait_param_sync(self): pass
        def state_dict(self): return {"master": self.master}

    class State: optimizer = Opt()

    cfg = JobConfig(); cfg.run_dir = sys.argv[1]
    manager = ck.CheckpointManager(cfg, ParallelDims(1, 1, 1), 0, torch.device("cpu"))
    manager.save(2, State()); manager.close()
    def stuck_write(tree, path):  # the disk stalls half-way through the next shard
        tmp = path.with_name("." + path.name + ".tmp-child")
        tmp.write_bytes(b"half a shard")
        time.sleep(600)
    ck.save_file = stuck_write
    manager = ck.CheckpointManager(cfg, ParallelDims(1, 1, 1), 0, torch.device("cpu"))
    State.optimizer.master.add_(1)
    manager.save(4, State())
    print("saving", flush=True)
    time.sleep(600)
""")


def test_kill_during_save_leaves_previous_checkpoint_loadable(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "saving"
        deadline = time.monotonic() + 60
        while not list(ck.step_dir(tmp_path, 4).glob(".*.tmp-*")):
            assert time.monotonic() < deadline and child.poll() is None
            time.sleep(0.01)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    info = ck.latest_complete(tmp_path)
    assert info is not None and info.step == 2
    assert not (ck.step_dir(tmp_path, 4) / ck.MANIFEST).exists()
    shard = torch.load(info.path / info.manifest["files"][0], weights_only=True)
    assert shard["step"] == 2 and shard["optimizer"]["master"].numel() == 1 << 18


def broadcast_worker(rank: int, world: int) -> dict:
    from megascope.trainer.robust.checkpoint_io import broadcast_tree

    tree = {"a": torch.arange(5.0), "nested": [torch.ones(2, 3, dtype=torch.int64), 7], "s": "x"} if rank == 1 else None
    out = broadcast_tree(tree, 1, torch.distributed.group.WORLD, torch.device("cpu"))
    return {"a": out["a"].tolist(), "n": out["nested"][0].tolist(), "k": out["nested"][1], "s": out["s"]}


def test_broadcast_tree_rebuilds_structure_on_every_rank():
    for r in run_distributed(broadcast_worker, 3):
        assert r == {"a": [0.0, 1.0, 2.0, 3.0, 4.0], "n": [[1, 1, 1]] * 2, "k": 7, "s": "x"}
