"""A Hugging Face transformers.Trainer job (samples/hf_trainer.py, 2 gloo ranks under torchrun, DDP made
by the Trainer) traced through megascope.tracer.hf_callback and judged by `megascope analyze --json`:
clean, and with a rank sleeping 100 ms per forward from step 8. Skipped without the optional extra
`megascope[attach]` (transformers, accelerate). Pinned to one CPU and judged as the DDP and FSDP2
samples are (tests/test_attach_samples.py says why and what was measured)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.test_attach_samples import LATE_NOISE, SLOW, _analyze, _torchrun  # noqa: E402

pytestmark = pytest.mark.slow


def test_hf_trainer_clean_run_has_no_findings(tmp_path):
    _torchrun("hf_trainer.py", tmp_path / "run")
    found = _analyze(tmp_path / "run")
    real = [f for f in found if not (f["kind"] == "late_launch" and f["severity"] < LATE_NOISE)]
    assert real == [], [(f["kind"], f["ranks"], f["steps"], f["severity"], f["summary"]) for f in found]


def test_hf_trainer_slow_rank_is_named_the_straggler(tmp_path):
    _torchrun("hf_trainer.py", tmp_path / "run", *SLOW)
    found = _analyze(tmp_path / "run")
    stragglers = [f for f in found if f["kind"] == "straggler"]
    assert [f["ranks"] for f in stragglers] == [[1]], \
        [(f["kind"], f["ranks"], f["steps"], f["severity"]) for f in found]
    assert 6 <= stragglers[0]["steps"][0] <= 9
