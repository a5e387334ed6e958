"""NDTimeline-style Parquet import: synthetic traces (one worker per (dp, stage), as the public
what-if artifact holds) with an injected slow worker, a stage imbalance and random sequence-length
imbalance, analyzed end to end; bad inputs give a clear message and exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from megascope.analyzer import Run
from megascope.cli import main
from megascope.tracer.importers.cli import import_run
from megascope.tracer.importers.writer import ImportInputError

DP, TP, PP, STEPS, MICRO = 4, 2, 4, 10, 4
T0 = 1_700_000_000.0


def _rank(stage: int, dp: int) -> int:
    return (stage * DP + dp) * TP  # tp coordinate 0: one worker per (dp, stage)


def synth_ndtimeline(path: Path, slow: dict[tuple[int, int], float] | None = None,
                     stage_factor: dict[int, float] | None = None, seq_sigma: float = 0.0,
                     seed: int = 0, all_tp: bool = False) -> Path:
    """A GPipe-ordered timeline per replica: forward chain over stages per micro-batch, backward
    chain back, then a dp reduce-scatter (everyone waits for the slowest replica), optimizer, all-gather.
    `seq_sigma`: each (replica, micro-batch) draws a log-normal work factor per step (sequence lengths).
    `all_tp`: every tensor-parallel rank (a full layout; each with its own 0.5% jitter), not one per (dp, stage)."""
    rng = np.random.default_rng(seed)
    rows = []
    t = T0
    for step in range(STEPS):
        seq = np.exp(rng.normal(0, seq_sigma, size=(DP, MICRO))) if seq_sigma else np.ones((DP, MICRO))
        ends = {}
        for d in range(DP):
            fwd_free = [t] * PP
            fwd_end = {}
            for m in range(MICRO):
                for s in range(PP):
                    factor = (slow or {}).get((d, s), 1.0) * (stage_factor or {}).get(s, 1.0) * seq[d, m]
                    ready = fwd_end.get((m, s - 1), t) if s else t
                    if s:  # waiting for the activation: a forward-recv
                        rows.append((d, s, step, "forward-recv", fwd_free[s], max(0.0, ready - fwd_free[s]) + 1e-4, m))
                    start = max(fwd_free[s], ready) + 1e-4
                    dur = 0.010 * factor * (1 + rng.normal(0, 0.005))
                    rows.append((d, s, step, "forward-compute", start, dur, m))
                    if s < PP - 1:
                        rows.append((d, s, step, "forward-send", start + dur, 1e-4, m))
                    fwd_end[(m, s)] = fwd_free[s] = start + dur + 1e-4
            bwd_free = list(fwd_free)
            bwd_end = {}
            for m in range(MICRO):
                for s in reversed(range(PP)):
                    factor = (slow or {}).get((d, s), 1.0) * (stage_factor or {}).get(s, 1.0) * seq[d, m]
                    ready = bwd_end.get((m, s + 1), bwd_free[s]) if s < PP - 1 else bwd_free[s]
                    if s < PP - 1:
                        rows.append((d, s, step, "backward-recv", bwd_free[s], max(0.0, ready - bwd_free[s]) + 1e-4, m))
                    start = max(bwd_free[s], ready) + 1e-4
                    dur = 0.020 * factor * (1 + rng.normal(0, 0.005))
                    rows.append((d, s, step, "backward-compute", start, dur, m))
                    if s:
                        rows.append((d, s, step, "backward-send", start + dur, 1e-4, m))
                    bwd_end[(m, s)] = bwd_free[s] = start + dur + 1e-4
            ends[d] = bwd_free
        for s in range(PP):
            arrive = {d: ends[d][s] for d in range(DP)}
            done = max(arrive.values()) + 0.002
            for d in range(DP):
                rows.append((d, s, step, "grads-reduce-scatter", arrive[d], done - arrive[d], -1))
                rows.append((d, s, step, "optimizer", done, 0.003, -1))
                rows.append((d, s, step, "params-all-gather", done + 0.003, 0.002, -1))
        t = max(max(e) for e in ends.values()) + 0.01
    df = pd.DataFrame(rows, columns=["dp_rank", "stage", "step", "optype", "start_ts", "duration", "mb_id"])
    df["rank"] = [_rank(s, d) for s, d in zip(df.stage, df.dp_rank)]
    if all_tp:
        copies = []
        for t in range(TP):
            c = df.copy()
            c["rank"] += t
            compute = c.optype.str.endswith("-compute")
            c.loc[compute, "duration"] *= 1 + rng.normal(0, 0.005, size=int(compute.sum()))
            copies.append(c)
        df = pd.concat(copies, ignore_index=True)
    df["seq_id"] = df.groupby(["rank", "step"]).cumcount()
    df["mc"] = 0
    df["gmc"] = df["stage"]
    df.to_parquet(path, index=False)
    return path


def _job_yaml(path: Path) -> Path:
    path.write_text(f"# job sizes\ndp: {DP}\npp: {PP}\ntp: {TP}\nvpp: 1\nworld: {DP * TP * PP}\n")
    return path


def _open(tmp: Path, name: str, **synth) -> Run:
    src = synth_ndtimeline(tmp / f"{name}.parquet", **synth)
    out = tmp / f"run-{name}"
    import_run("ndtimeline", [src, _job_yaml(tmp / "job.yaml")], out)
    return Run.open(out)


def _findings(tmp: Path, name: str, **synth) -> list:
    return _open(tmp, name, **synth).findings()


def test_slow_worker_is_named(tmp_path: Path):
    findings = _findings(tmp_path, "slow", slow={(2, 1): 1.3})
    kinds = [(f.kind, f.ranks) for f in findings]
    assert ("straggler", [_rank(1, 2)]) in kinds, kinds
    assert not any(f.kind in ("stage_imbalance", "workload_imbalance") for f in findings), kinds


def test_clean_timeline_has_no_finding(tmp_path: Path):
    findings = _findings(tmp_path, "clean")
    assert not findings, [(f.kind, f.ranks, f.summary) for f in findings]


def test_stage_imbalance_is_named(tmp_path: Path):
    findings = _findings(tmp_path, "imb", stage_factor={3: 1.25})
    imbalance = [f for f in findings if f.kind == "stage_imbalance"]
    assert len(imbalance) == 1 and imbalance[0].evidence["stage"] == 3
    assert sorted(imbalance[0].ranks) == [_rank(3, d) for d in range(DP)]
    assert not any(f.kind == "straggler" for f in findings)


@pytest.mark.parametrize("all_tp", [False, True], ids=["worker-per-dp-stage", "full-layout"])
def test_random_sequence_imbalance_is_workload_imbalance(tmp_path: Path, all_tp: bool):
    run = _open(tmp_path, "seq", seq_sigma=0.25, seed=3, all_tp=all_tp)
    findings = run.findings()
    kinds = [(f.kind, f.ranks[:4], f.steps) for f in findings]
    assert [f.kind for f in findings] == ["workload_imbalance"], kinds
    f = findings[0]
    assert len(f.ranks) == DP * PP * (TP if all_tp else 1)
    assert f.severity > 1.1 and f.evidence["flagged_steps"] >= STEPS // 2
    assert len(f.evidence["slowest_replica_counts"]) >= 2
    assert "balance sequence lengths" in f.summary
    # balancing the replicas' work (same total) saves time: the slowest replica no longer sets the pace
    wi = run.what_if(f)
    assert wi["applicable"] and 0.02 < wi["throughput_lost"] < 0.5, wi


def test_straggler_with_random_imbalance_gets_both(tmp_path: Path):
    # random imbalance is step-to-step noise to the straggler detector, and a worker slow from the first
    # step must stand 3.5 sigma out: a 2x worker does
    findings = _findings(tmp_path, "both", seq_sigma=0.25, seed=3, slow={(1, 2): 2.0})
    kinds = [(f.kind, f.ranks if f.kind == "straggler" else None) for f in findings]
    assert ("straggler", [_rank(2, 1)]) in kinds and ("workload_imbalance", None) in kinds, kinds


def test_imported_run_looks_like_a_traced_one(tmp_path: Path):
    src = synth_ndtimeline(tmp_path / "t.parquet")
    out = tmp_path / "run"
    assert main(["import", "ndtimeline", str(src), str(_job_yaml(tmp_path / "job.yaml")), "--out", str(out)]) == 0
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["source"] == "import:ndtimeline"
    assert [Path(s["path"]).name for s in manifest["import"]["sources"]] == ["job.yaml", "t.parquet"]
    assert (manifest["topology"]["world"], len(manifest["topology"]["ranks"])) == (DP * TP * PP, DP * PP)
    run = Run.open(out)
    ev = run.events(steps=(3, 3))
    assert set(ev.name) >= {"forward", "backward", "send_forward", "recv_forward", "send_backward",
                            "recv_backward", "reduce_scatter", "all_gather", "optimizer"}
    # p2p: the k-th send A->B matches the k-th recv on B from A (the tracer's numbering)
    sends = ev[ev.name == "send_forward"].set_index(["rank", "peer", "seq"]).index
    recvs = ev[ev.name == "recv_forward"].set_index(["peer", "rank", "seq"]).index
    assert set(sends) == set(recvs) and len(sends) == DP * (PP - 1) * MICRO
    assert len(run.steps()) == DP * PP * STEPS
    assert not run.dependencies(3).empty


def test_missing_and_renamed_columns(tmp_path: Path, capsys):
    src = synth_ndtimeline(tmp_path / "t.parquet")
    df = pd.read_parquet(src).rename(columns={"start_ts": "start_time"}).drop(columns=["duration"])
    bad = tmp_path / "bad.parquet"
    df.to_parquet(bad)
    assert main(["import", "ndtimeline", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "missing column(s) start_ts (found 'start_time': pass --column start_ts=start_time); duration" in err
    assert "Traceback" not in err
    renamed = tmp_path / "renamed.parquet"
    pd.read_parquet(src).rename(columns={"start_ts": "begin"}).to_parquet(renamed)
    assert main(["import", "ndtimeline", str(renamed), "--out", str(tmp_path / "r"), "--column", "start_ts=begin",
                 "--tp", str(TP)]) == 0


def test_missing_worker_and_wrong_format(tmp_path: Path, capsys):
    src = synth_ndtimeline(tmp_path / "t.parquet")
    df = pd.read_parquet(src)
    df[~((df.dp_rank == 1) & (df.stage == 2))].to_parquet(tmp_path / "partial.parquet")
    result = import_run("ndtimeline", [tmp_path / "partial.parquet", _job_yaml(tmp_path / "job.yaml")], tmp_path / "p")
    assert len(result.ranks) == DP * PP - 1
    assert any("dp=1/stage=2" in w for w in result.warnings)
    Run.open(tmp_path / "p").findings()  # analyzable with the hole
    (tmp_path / "x.parquet").write_text('{"traceEvents": []}')
    with pytest.raises(ImportInputError, match="not a readable Parquet file"):
        import_run("ndtimeline", [tmp_path / "x.parquet"], tmp_path / "x")
    assert main(["import", "nope", str(src), "--out", str(tmp_path / "n")]) == 2
    assert "unknown format 'nope'" in capsys.readouterr().err


# ---- context (sequence) parallelism: NDTimeline's dsp_size, Megatron order tp, cp, dp, pp ----------

def _cp_trace(tmp: Path, slow: list | None = None) -> tuple[Path, Path]:
    """A dp=4 x cp=2 x tp=1 x pp=2 job (16 ranks) from the independent generator, and its job file
    written as a real one is: NDTimeline's keys among others, nested blocks, a null."""
    from megascope.samples.independent_gen import GenSpec, write_ndtimeline

    spec = GenSpec(dp=4, tp=1, pp=2, cp=2, steps=12, micro=4, seed=5, faults=slow or [])
    src = write_ndtimeline(spec, tmp / "trace")
    meta = tmp / "trace" / "job.yaml"
    meta.write_text("job_name: llm-128\nparallel:\n  dp_size: 4\n  pp_size: 2\n  tp_size: 1\n  dsp_size: 2\n"
                    "  vpp_size: null\n  world_size: 16\nhosts:\n  - node-a\n  - node-b  # two hosts\n")
    return src, meta


def test_context_parallel_import_with_meta_and_with_cp(tmp_path: Path, capsys):
    src, meta = _cp_trace(tmp_path)
    assert main(["import", "ndtimeline", str(src), "--meta", str(meta), "--out", str(tmp_path / "a")]) == 0
    assert main(["import", "ndtimeline", str(src), "--dp", "4", "--pp", "2", "--tp", "1", "--cp", "2",
                 "--out", str(tmp_path / "b")]) == 0
    topo = json.loads((tmp_path / "a" / "run.json").read_text())["topology"]
    assert topo == json.loads((tmp_path / "b" / "run.json").read_text())["topology"]
    assert (topo["world"], topo["dp"], topo["cp"], topo["tp"], topo["pp"]) == (16, 4, 2, 1, 2)
    rows = {r["rank"]: (r["pp"], r["dp"], r["cp"], r["tp"]) for r in topo["ranks"]}
    assert rows[5] == (0, 2, 1, 0) and rows[14] == (1, 3, 0, 0) and len(rows) == 16
    assert list(Run.open(tmp_path / "a").topology.cp[:4]) == [0, 1, 0, 1]
    assert main(["analyze", str(tmp_path / "a"), "--no-what-if"]) == 0
    assert "16 ranks: dp=4 cp=2 tp=1 pp=2" in capsys.readouterr().out


def test_context_parallel_analysis_uses_cp_groups(tmp_path: Path):
    from megascope.analyzer.detect.flaps import instance_members

    src, meta = _cp_trace(tmp_path)
    import_run("ndtimeline", [src], tmp_path / "run", meta=meta)
    run = Run.open(tmp_path / "run")
    findings = run.findings()
    assert not [f.summary for f in findings if f.kind in ("network_flap", "slow_link")]
    # the gradient all-reduce spans dp x cp = 8 ranks per stage (one instance per stage: tp = 1)
    inst = run.store.query("""SELECT "group", instance, min(members) AS lo, max(members) AS hi
                              FROM collective_instances GROUP BY ALL""")
    dp_inst = inst[inst.group == "dp"]
    assert sorted(dp_inst.instance) == [0, 1] and (dp_inst.lo == 8).all() and (dp_inst.hi == 8).all()
    assert instance_members(run.store, "dp", 1) == list(range(8, 16))
    # a pipeline is one (dp, cp, tp) column: rank 3 (dp 1, cp 1) pairs with rank 11
    assert instance_members(run.store, "pp", 3) == [3, 11] and instance_members(run.store, "cp", 2) == [4, 5]
    p2p = run.events(steps=(3, 3)).query("kind == 'p2p'")
    assert len(p2p) and ((p2p.peer - p2p["rank"]).abs() == 8).all()


def test_context_parallel_layout_mistakes_are_one_line(tmp_path: Path, capsys):
    src, meta = _cp_trace(tmp_path)
    cases = [
        (["--dp", "4", "--pp", "2", "--tp", "1"],
         "rank 15 is outside the world of 8 ranks (dp=4 x tp=1 x pp=2) (context/sequence parallelism? pass --cp"),
        (["--cp", "1", "--meta", str(meta)], "--cp 1 contradicts cp=2 in job.yaml"),
        (["--tp", "2", "--meta", str(meta)], "--tp 2 contradicts tp=1 in job.yaml"),
    ]
    no_dsp = tmp_path / "nodsp.yaml"
    no_dsp.write_text("dp_size: 4\npp_size: 2\ntp_size: 1\nworld_size: 16\n")
    expected = ("dp=4 x tp=1 x pp=2 = 8, world=16 (a job with context/sequence parallelism, dsp_size in "
                "NDTimeline job files? pass --cp 2")
    cases.append((["--meta", str(no_dsp)], expected))
    for i, (flags, message) in enumerate(cases):
        assert main(["import", "ndtimeline", str(src), *flags, "--out", str(tmp_path / f"o{i}")]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert not (tmp_path / f"o{i}").exists()
    assert main(["import", "kineto", str(src), "--cp", "2", "--out", str(tmp_path / "k")]) == 2
    assert "--cp and --meta are read by the ndtimeline importer only" in capsys.readouterr().err


def test_layout_is_the_trainers_rank_order_without_cp():
    from megascope.tracer.layout import Layout
    from megascope.trainer.parallel.parallel_dims import ParallelDims

    for dp, tp, pp in ((2, 2, 2), (4, 1, 2), (3, 2, 4)):
        layout, dims = Layout(dp=dp, tp=tp, pp=pp), ParallelDims(dp=dp, tp=tp, pp=pp)
        for rank in range(layout.world):
            c = dims.coords(rank)
            assert layout.coords(rank) == (c.pp, c.dp, c.tp) and layout.cp_of(rank) == 0
            for name in ("dp", "tp", "pp"):
                assert layout.group_of(name, rank) == sorted(dims.peers(name, rank))
    cp = Layout(dp=32, tp=1, pp=2, cp=2)
    assert cp.world == 128 and cp.rank_of(pp=1, dp=31, tp=0, cp=1) == 127
    assert cp.group_name([4, 5]) == "cp" and cp.group_name(list(range(64))) == "dp"
    assert cp.group_name([0, 2, 4]) == ""


def test_context_parallel_topology_view(tmp_path: Path):
    from megascope.dashboard.rank_groups import rank_label, rank_neighbours
    from megascope.dashboard.topology_figure import clicked_rank, topology_figure

    src, meta = _cp_trace(tmp_path)
    import_run("ndtimeline", [src], tmp_path / "run", meta=meta)
    topo = Run.open(tmp_path / "run").topology
    fig = topology_figure(topo, {5: 1.0}, "severity")
    assert list(fig.data[0].x[:4]) == ["dp0·cp0·tp0", "dp0·cp1·tp0", "dp1·cp0·tp0", "dp1·cp1·tp0"]
    assert fig.data[0].z[0][5] == 1.0   # rank 5 = dp 2, cp 1 on stage 0
    click = {"points": [{"x": "dp2·cp1·tp0", "y": "stage 1"}]}
    assert clicked_rank(click, topo) == 13
    peers = rank_neighbours(topo, 13)
    assert peers["cp group"] == [12, 13] and peers["dp group"] == list(range(8, 16))
    assert peers["activations from (previous stage)"] == [5]
    assert rank_label(topo, 13) == "rank 13 · pp1 dp2 cp1 tp0"
    # a run without cp keeps its labels
    plain = topo[topo.cp == 0].drop(columns="cp")
    assert topology_figure(plain, {}, "x").data[0].x[0] == "dp0·tp0"
