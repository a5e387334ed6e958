"""The analyzer's settings tree (analyzer/settings.py): every threshold documented, reachable by
`--set`, and the one the default detectors and the watcher actually use."""

from __future__ import annotations

import dataclasses

import pytest

from megascope.analyzer.run import Run, default_detectors
from megascope.analyzer.settings import AnalyzerSettings, SettingsError, apply_set, settings_dict
from megascope.trainer.config_docs import analyzer_markdown


def leaves(obj, prefix=""):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from leaves(value, key + ".")
        else:
            yield key, value


def test_every_setting_is_documented_and_settable():
    settings = AnalyzerSettings()
    keys = dict(leaves(settings))
    assert len(keys) > 40 and "detect.straggler.min_ratio" in keys
    table = "\n".join(analyzer_markdown())
    for key, default in keys.items():
        row = next(line for line in table.splitlines() if line.startswith(f"| `{key}` |"))
        assert row.split(" | ")[2].strip(" |"), f"{key} has no documentation"
        apply_set(settings, f"{key}={default * 2}")  # each one reachable, its type kept
        assert type(dict(leaves(settings))[key]) is type(default)
    assert settings_dict(settings)["detect"]["straggler"]["min_ratio"] == 2.06


def test_default_detectors_use_the_settings(simulated_run):
    settings = AnalyzerSettings()
    apply_set(settings, "detect.warmup_factor=3")
    apply_set(settings, "detect.flap.flag_ratio=1.5")
    straggler, flap, workload = default_detectors(settings.detect)
    assert straggler.cfg is settings.detect.straggler and flap.cfg.flag_ratio == 1.5
    assert workload.cfg is settings.detect.workload_imbalance
    run = Run.open(simulated_run(steps=4), settings=settings)  # the warm-up factor: one, in their context
    assert run.context.warmup_factor == 3.0
    assert type(run.detectors[0]).__name__ == "HangDetector"
    assert run.detectors[-1].cfg is settings.detect.lost_time  # type: ignore[union-attr]


@pytest.mark.parametrize("item, needle", [
    ("detect.straggler.min_ratio", "expected KEY=VALUE"),
    ("detect.straggler.min_ratio=fast", "expected a number"),
    ("detect.straggler.min_ratio=inf", "finite number >= 0"),
    ("report.max_what_if=2.0", "expected an integer"),
    ("detect.hangs.x=1", "no setting detect.hangs; known here: warmup_factor, straggler"),
])
def test_bad_items_say_what_is_wrong(item, needle):
    with pytest.raises(SettingsError, match=needle.replace(".", r"\.")):
        apply_set(AnalyzerSettings(), item)
