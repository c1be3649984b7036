"""The main job: its comparison table on recorded results (a snapshot), and a tiny side-by-side
demo end to end against the real broker."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from relaygr.tools.report.compare import comparison_markdown, verdict
from relaygr.tools.report.summary import RunSummary

SNAPSHOT = Path(__file__).parent / "demo_snapshot"


def _recorded() -> dict[str, RunSummary]:
    doc = json.loads((SNAPSHOT / "summaries.json").read_text())
    return {mode: RunSummary.model_validate(doc[mode]) for mode in ("relay", "baseline")}


def test_comparison_table_of_recorded_results_matches_its_snapshot() -> None:
    """``summaries.json``: both modes of one recorded demo run (704-event histories at 16.3/s);
    ``table.md``: what the demo printed for them. Regenerate both together when the table changes."""
    summaries = _recorded()
    text = comparison_markdown(summaries) + "\n\n" + verdict(summaries) + "\n"
    assert text == (SNAPSHOT / "table.md").read_text()


def test_verdict_says_when_full_ranking_fits_the_machine() -> None:
    summaries = _recorded()
    assert "baseline held 0 %" in verdict(summaries) and "relay held 58 %" in verdict(summaries)
    assert "device time, not the SLO" in verdict(summaries, full_fits=True)
    assert verdict({"relay": summaries["relay"]}).startswith("relay held 58 %")


@pytest.mark.slow(seconds=240)
def test_tiny_demo_runs_both_modes_on_one_trace(kafka_settings, model_dir, tmp_path) -> None:
    # The demo calibrates into its model's folder: a copy, so that the session's model keeps its
    # fixed latency model for the tests after this one.
    model = shutil.copytree(model_dir, tmp_path / "model")
    env = {
        **os.environ,
        "RELAYGR_BOOTSTRAP": kafka_settings.bootstrap or "",
        "RELAYGR_HOME": str(tmp_path / "home"),
        "RELAYGR_MODEL_DIR": str(model),
    }
    cmd = [sys.executable, "-m", "relaygr.cli", "demo", "--requests", "8", "--warmup", "2"]
    cmd += ["--max-history", "128", "--qps", "5", "--theta", "0.001", "--ranking-workers", "1", "--json"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(proc.stdout)  # standard output is the JSON line alone
    assert proc.stdout.count("\n") == 1
    assert doc["workload"]["history"] == 128 and doc["workload"]["overridden"] == ["history", "qps"]
    for mode in ("relay", "baseline"):
        assert doc[mode]["results"] == doc[mode]["requests"] == 8, doc[mode]
    # Same trace, different modes: the baseline never pre-infers, the relay's trigger admits all.
    assert doc["baseline"]["admitted"] == 0 and doc["baseline"]["path_reasons"] == {"baseline": 8}
    assert doc["relay"]["admitted"] == 8
    assert doc["verdict"].startswith("baseline held")
    report = Path(proc.stderr.split("== report in ", 1)[1].split(" (")[0])
    for name in ("compare.md", "compare.json", "ranking_cdf.png", "relay/report.md", "baseline/report.md"):
        assert (report / name).is_file(), name
    assert "| ranking P99 (ms), budget 50 |" in (report / "compare.md").read_text()
