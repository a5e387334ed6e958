"""megascope.tracer.attach on jobs megascope did not write: the layout and group naming, the run.json
it writes, spans from module/optimizer/data-loader hooks, a clean close on exceptions and refusals.
(Interception of torch.distributed and the DDP hook on real gloo groups: test_attach_distributed.py.)"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from megascope import tracer
from megascope.tracer import api
from megascope.tracer.attach_topology import from_mesh, from_sizes, resolve
from megascope.tracer.config import TraceConfig


def _events(run_dir) -> list[dict]:
    return pq.read_table(run_dir / "events", partitioning=None).sort_by("start_ns").to_pylist()


def _steps(run_dir) -> list[dict]:
    return pq.read_table(run_dir / "steps", partitioning=None).sort_by("step").to_pylist()


# -- layout ------------------------------------------------------------------------------------

def test_sizes_follow_megatron_order_and_name_groups():
    lay = from_sizes(8, tp=2, pp=2)  # dp = 8 / (2 x 2)
    assert lay.sizes == {"dp": 2, "tp": 2, "pp": 2, "cp": 1}
    assert lay.coords[5] == (1, 0, 0, 1)  # (pp, dp, cp, tp): rank = tp + 2 * (dp + 2 * pp)
    assert lay.group_of("tp", 5) == [4, 5] and lay.group_of("dp", 5) == [5, 7] and lay.group_of("pp", 5) == [1, 5]
    assert [lay.group_name(g) for g in ([4, 5], [7, 5], [1, 5], list(range(8)), [0, 3], [2])] == \
        ["tp", "dp", "pp", "world", "", ""]
    assert lay.p2p_group(0, 4) == "pp" and lay.p2p_group(0, 2) == "dp" and lay.p2p_group(0, 7) == ""
    topo = lay.topology(["h0"] * 4 + ["h1"] * 4, [0, 1, 2, 3] * 2)
    assert topo["world"] == 8 and (topo["dp"], topo["tp"], topo["pp"]) == (2, 2, 2) and "cp" not in topo
    assert topo["ranks"][5] == {"rank": 5, "pp": 1, "dp": 0, "tp": 1, "host": "h1", "local_rank": 1}


def test_context_parallel_dp_group_spans_dp_and_cp():
    lay = from_sizes(8, dp=2, cp=2, tp=2)
    assert lay.group_of("cp", 0) == [0, 2] and lay.group_of("dp", 0) == [0, 2, 4, 6]
    assert lay.group_name([0, 2]) == "cp"  # a group that is cp (dp x cp is the bigger one)
    assert lay.topology(["h"] * 8, list(range(8)))["ranks"][2]["cp"] == 1


def test_plain_data_parallel_world_is_named_dp():
    assert from_sizes(2).group_name([0, 1]) == "dp"  # as the trainer names it when dp = world


@pytest.mark.parametrize("kwargs, words", [
    ({"world": 6, "tp": 4}, "not divisible"),
    ({"world": 4, "dp": 3}, "product is the world size"),
    ({"world": 4, "tp": 0}, "not a positive integer"),
])
def test_bad_sizes_say_what_is_wrong(kwargs, words):
    with pytest.raises(ValueError, match=words):
        from_sizes(**kwargs)


def _mesh(shape, names):
    return SimpleNamespace(mesh=torch.arange(int(torch.tensor(shape).prod())).reshape(shape), mesh_dim_names=names)


def test_device_mesh_in_megatron_order_equals_sizes():
    assert from_mesh(_mesh((2, 2, 2), ("pp", "dp", "tp")), 8).coords == from_sizes(8, dp=2, tp=2, pp=2).coords


def test_device_mesh_in_another_order_is_read_as_it_is():
    lay = from_mesh(_mesh((2, 2), ("tp", "dp")), 4)  # rank = 2 * tp + dp: tp outermost
    assert lay.group_name([0, 1]) == "dp" and lay.group_name([0, 2]) == "tp"
    assert [r["tp"] for r in lay.topology(["h"] * 4, [0] * 4)["ranks"]] == [0, 0, 1, 1]


def test_hsdp_mesh_dimensions_make_one_dp():
    lay = from_mesh(_mesh((2, 2), ("dp_replicate", "dp_shard")), 4)
    assert lay.sizes["dp"] == 4 and [c[1] for c in lay.coords] == [0, 1, 2, 3]


@pytest.mark.parametrize("layout, error, words", [
    (_mesh((2, 2), ("dp", "expert")), ValueError, "expert"),
    (_mesh((2,), ("dp",)), ValueError, "root mesh"),
    ({"dp": 2, "ep": 2}, ValueError, "ep"),
    ("dp=4", TypeError, "DeviceMesh"),
])
def test_bad_layouts_say_what_is_wrong(layout, error, words):
    with pytest.raises(error, match=words):
        resolve(4, layout)


# -- a single-process job ------------------------------------------------------------------------

class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> dict:  # outputs in a container, as HF models return them
        return {"out": checkpoint(self.inner, x, use_reentrant=False)}


def test_spans_per_micro_batch_from_hooks(tmp_path):
    model = _Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = [torch.randn(4, 8) for _ in range(3)]
    run = tmp_path / "run"
    # hook the checkpointed submodule: its forward runs again inside backward (recompute), which
    # must not count as a forward or a micro-batch
    with tracer.attach(run, model=model.inner, optimizer=opt, config=TraceConfig(nvml=False)) as t:
        for x in t.data(loader):
            for half in x.split(2):  # two micro-batches (gradient accumulation)
                model(half)["out"].pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            t.step(tokens=4, loss=torch.tensor(0.5))
    events, steps = _events(run), _steps(run)
    by_name: dict[str, list[tuple[int, int]]] = {}
    for e in events:
        by_name.setdefault(e["name"], []).append((e["step"], e["microbatch"]))
    pairs = [(s, mb) for s in range(3) for mb in range(2)]
    assert by_name["forward"] == pairs and by_name["backward"] == pairs
    assert [s for s, _ in by_name["optimizer"]] == [0, 1, 2] and [s for s, _ in by_name["data_wait"]] == [0, 1, 2]
    for fwd, bwd in zip([e for e in events if e["name"] == "forward"], [e for e in events if e["name"] == "backward"]):
        assert fwd["end_ns"] <= bwd["start_ns"] and bwd["kind"] == "compute"
    assert [(s["step"], s["tokens"], s["loss"]) for s in steps] == [(0, 4, 0.5), (1, 4, 0.5), (2, 4, 0.5)]
    manifest = json.loads((run / "run.json").read_text())
    assert manifest["source"] == "megascope-attach" and manifest["topology"]["world"] == 1
    assert manifest["attach"]["status"] == "completed" and manifest["attach"]["steps"] == 3
    # nothing left behind: hooks removed, no active tracer
    assert not model.inner._forward_pre_hooks and not model.inner._forward_hooks
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert api.active() is None


def test_an_exception_closes_the_run_and_says_so(tmp_path):
    model = torch.nn.Linear(4, 4)
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="boom"):
        with tracer.attach(run, model=model, config=TraceConfig(nvml=False)) as t:
            model(torch.randn(2, 4)).sum().backward()
            t.step()
            raise RuntimeError("boom")
    assert api.active() is None and not model._forward_pre_hooks
    note = json.loads((run / "run.json").read_text())["attach"]
    assert note["status"] == "failed" and "boom" in note["error"] and note["steps"] == 1
    assert [e["name"] for e in _events(run)] == ["forward", "backward"]  # step 0, written whole


def test_a_directory_holding_a_run_is_refused_untouched(tmp_path):
    run = tmp_path / "run"
    with tracer.attach(run, config=TraceConfig(nvml=False)) as t:
        t.step()
    before = (run / "run.json").read_text()
    with pytest.raises(ValueError, match="already holds a run"):
        tracer.attach(run, config=TraceConfig(nvml=False)).start()
    assert (run / "run.json").read_text() == before and api.active() is None
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        tracer.attach(file).start()
