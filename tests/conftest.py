"""Fixtures shared by the test files.

`simulated_run` is the one way a test builds a simulated run directory (megascope.samples.simulator):
a module fixture calls it once for the module's tests, a test calls it for a run of its own. Each call
writes a fresh directory: the analyzer persists its summary inside a run (RUN/analysis/), and several
tests change their run's files, so runs are never shared between calls.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest

from megascope.samples.simulator import SimConfig, simulate


class SimulatedRun(Protocol):
    def __call__(self, out: Path | None = None, /, **config: Any) -> Path:
        """Simulate `SimConfig(**config)` into `out` (default: a new temporary folder); returns the run dir."""
        ...


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` need a CUDA device: skipped, with one reason, where there is none."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in gpu:
        item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def processes_temp_dir() -> Iterator[Path]:
    """The temporary directory of the processes the tests start: one folder of this session's, removed
    at its end, so what they cannot remove themselves does not pile up in /tmp (torchrun's
    /tmp/torchelastic_* folders, which torch never removes; the agent folder of a driver a test
    SIGKILLs). This process keeps its own (pinned before TMPDIR changes: pytest's tmp_path and the
    tests' own folders stay where they were, and short enough for Unix socket paths)."""
    tempfile.tempdir = tempfile.gettempdir()
    folder = Path(tempfile.mkdtemp(prefix="mst"))  # short: a socket path under it must stay < 108 bytes
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(folder)
    try:
        yield folder
    finally:
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def simulated_run(tmp_path_factory: pytest.TempPathFactory) -> SimulatedRun:
    """Factory of simulated runs; session-scoped so that module-scoped fixtures can call it too."""

    def make(out: Path | None = None, /, **config: Any) -> Path:
        if out is None:
            out = tmp_path_factory.mktemp("sim") / "run"
        return simulate(out, SimConfig(**config))

    return make
