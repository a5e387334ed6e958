"""The streaming trace-JSON reader: same values as json.load at any chunk size, gzip, bare arrays,
and a clear error (never a hang or a whole-file read) on truncated or malformed input."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from megascope.tracer.importers.json_stream import EVENTS_KEY, TraceJsonError, TraceJsonReader

DOC = {"schemaVersion": 1, "distributedInfo": {"rank": 3, "world_size": 8, "pg_config": [{"ranks": [0, 1]}]},
       "baseTimeNanoseconds": 1790857026000000000,
       "traceEvents": [{"ph": "X", "name": f"aten::mm \"{i}\" \u00e9", "ts": 4801136944682.413 + i, "dur": 12.5,
                        "args": {"Input Dims": [[128, 64]], "neg": -1e-3}} for i in range(50)],
       "traceName": "t.json"}


def _read(path: Path, chunk: int) -> tuple[dict, list]:
    meta, events = {}, []
    for key, value in TraceJsonReader(path, chunk_chars=chunk):
        (events.append(value) if key == EVENTS_KEY else meta.__setitem__(key, value))
    return meta, events


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_same_values_as_json_load_at_any_chunk_size(tmp_path: Path, chunk: int):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(DOC, indent=1))
    meta, events = _read(path, chunk)
    assert events == DOC["traceEvents"]
    assert meta == {k: v for k, v in DOC.items() if k != "traceEvents"}


def test_gzip_and_bare_array(tmp_path: Path):
    gz = tmp_path / "t.json.gz"
    gz.write_bytes(gzip.compress(json.dumps(DOC).encode()))
    assert _read(gz, 100)[1] == DOC["traceEvents"]
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(DOC["traceEvents"]))
    assert _read(bare, 33) == ({}, DOC["traceEvents"])


@pytest.mark.parametrize("cut", [10, 200, -40, -2])
def test_truncated_file_is_an_error_with_its_offset(tmp_path: Path, cut: int):
    text = json.dumps(DOC)
    path = tmp_path / "t.json"
    path.write_text(text[:cut])
    with pytest.raises(TraceJsonError, match=r"(truncated|ends inside|end of the file)"):
        _read(path, 16)


def test_malformed_value_stops_without_reading_everything(tmp_path: Path):
    path = tmp_path / "t.json"
    path.write_text('{"traceEvents": [{"ph": "X"}, {"ph": nope}, ' + '{"ph": "X"}, ' * 1000 + "]}")
    reader = TraceJsonReader(path, chunk_chars=64, max_value_bytes=4096)
    with pytest.raises(TraceJsonError, match="malformed JSON value at character 30"):
        list(reader)
    path.write_text("PAR1 not json")
    with pytest.raises(TraceJsonError, match="expected a JSON object"):
        list(TraceJsonReader(path))
