"""The prepared device check: its dry run on this machine (`relaygr bench device --device cpu
--quick`, every step at tiny sizes, the real broker), and how a step is cut or skipped."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relaygr.device import check as device
from relaygr.device.report import parse_json_lines, summarise

STEPS = ["environment", "kernels", "exactness", "model", "store", "profile", "pipeline"]


@pytest.mark.broker
@pytest.mark.slow(seconds=300)
def test_the_dry_run_runs_every_step_and_reports_each(kafka_settings, tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {
        **os.environ,
        "RELAYGR_BOOTSTRAP": kafka_settings.bootstrap or "",
        "RELAYGR_HOME": str(tmp_path / "home"),
    }
    cmd = [
        sys.executable,
        "-m",
        "relaygr.cli",
        "bench",
        "device",
        "--device",
        "cpu",
        "--quick",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    doc = json.loads((out / "report.json").read_text())
    steps = {s["name"]: s for s in doc["steps"]}
    assert list(steps) == STEPS
    for name, step in steps.items():
        log = (out / step["log"]).read_text()
        assert step["status"] == "ok", f"{name}: {step['reason']}\n{log[-3000:]}"
        assert 0 < step["seconds"] <= step["budget_s"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert doc["seconds"] <= doc["total_budget_s"] == device.TOTAL_BUDGET_S * device.QUICK_BUDGET_SCALE
    assert doc["quick"] and doc["device"] == "cpu"

    probe = steps["environment"]["summary"]
    assert probe["ok"] and probe["torch"] and probe["modules"]["rocksdict"] and probe["cpu_cores"] >= 1
    exact = steps["exactness"]["summary"]
    assert {(r["dtype"], r["history"]) for r in exact["rows"]} == {
        (d, n) for d in ("float32", "bfloat16") for n in (56, 104)
    }
    assert exact["meets_fp32_target"] and all(
        r["top10_agreement"] == 1.0 for r in exact["rows"] if r["dtype"] == "float32"
    )
    model = steps["model"]["summary"]
    assert len(model["rows"]) == 6 and all(
        r["relay_ms_p50"] > 0 and r["kv_bytes_per_layer"] > 0 for r in model["rows"]
    )
    # The bucketed relay ranking, eagerly on a CPU (no capture, so no capture error).
    assert all(r["relay_graphed_ms_p50"] > 0 and r["graph_captured"] is False for r in model["rows"])
    assert model["graph_errors"] == []
    # A ranking worker's batch at one length: 4 users in one forward, eager and bucketed.
    assert [(u["dtype"], u["prefix_len"], u["users"]) for u in model["users"]] == [
        ("bfloat16", 64, 4),
        ("float32", 64, 4),
    ]
    assert all(u["device_rankings_per_s"] > 0 for u in model["users"])
    (fp32,) = [u for u in model["users"] if u["dtype"] == "float32"]
    assert fp32["batched_graphed_max_abs_diff"] <= 1e-4  # each user scores as it does alone
    assert {b["dtype"] for b in model["budget"]} == {"float32", "bfloat16"}
    store = steps["store"]["summary"]["rows"]
    assert [r["length"] for r in store] == [64] and store[0]["recompute_ms"] > 0
    prof = steps["profile"]["summary"]
    assert [(r["length"], r["path"]) for r in prof["rows"]] == [
        (n, p) for n in (64, 128) for p in ("relay", "full", "relay_graphed")
    ]
    assert all(r["kernels"] > 0 and r["ranking_ms_p50"] > 0 for r in prof["rows"])
    assert all(
        r["floor_eager_ms"] > 0 and r["floor_kernels"] > 0
        for r in prof["rows"]
        if r["path"] != "relay_graphed"
    )
    assert not prof["errors"]
    pipe = steps["pipeline"]["summary"]
    assert [e["experiment"] for e in pipe["experiments"]] == ["seq-len", "throughput"]
    # Reported, held or not: whether a side holds the budget is a timing of this machine's load.
    assert all("relay_max" in e and "baseline_max" in e for e in pipe["experiments"])
    assert pipe["model"]["model_version"]

    md = (out / "report.md").read_text()
    for name in STEPS:
        assert f"| {name} | ok |" in md and f"## {name}" in md
    # What comes back from an accelerator machine (./dev device-run packs the step logs into one
    # file): the two reports and one log per step, none deeper than the folder.
    files = [p for p in out.rglob("*") if p.is_file()]
    assert all(p.parent == out for p in files)
    assert {p.name for p in files} == {"report.json", "report.md", *(f"{s}.log" for s in STEPS)}


def _args(tmp_path: Path, **kw) -> argparse.Namespace:
    base = dict(device="cpu", quick=True, preset="large", budget_ms=50, model=None, work=tmp_path)
    return argparse.Namespace(**(base | kw))


def test_a_step_past_its_budget_is_cut_and_stops_within_the_grace(tmp_path: Path) -> None:
    sleeper = [sys.executable, "-c", "import time; print('{\"a\": 1}', flush=True); time.sleep(60)"]
    step = device.Step("model", 1.0, [sleeper, [sys.executable, "-c", "print('never')"]])
    t0 = time.monotonic()
    res = device.run_step(step, 1.0, tmp_path / "model.log", dict(os.environ))
    assert res.status == "cut" and "budget of 1 s" in res.reason
    assert time.monotonic() - t0 < 1.0 + device.STOP_GRACE_S
    log = (tmp_path / "model.log").read_text()
    assert "never" not in log and parse_json_lines(log) == [{"a": 1}]


def test_a_failing_step_says_which_command_failed(tmp_path: Path) -> None:
    step = device.Step("store", 30.0, [[sys.executable, "-c", "import sys; sys.exit(3)"]])
    res = device.run_step(step, 30.0, tmp_path / "store.log", dict(os.environ))
    assert res.status == "failed" and "exit status 3" in res.reason


def test_steps_are_skipped_with_their_reason(tmp_path: Path) -> None:
    step = device.Step("store", 30.0, [[sys.executable, "-c", "pass"]], modules=("no_such_module_here",))
    res = device.run_step(step, 30.0, tmp_path / "store.log", dict(os.environ))
    assert res.status == "skipped" and "no_such_module_here" in res.reason
    ok = device.Step("model", 30.0, [[sys.executable, "-c", "pass"]])
    res = device.run_step(ok, 30.0, tmp_path / "model.log", dict(os.environ), env_ok=False)
    assert res.status == "skipped" and "environment step failed" in res.reason


def test_the_full_check_fits_its_budget_and_measures_the_issues_lengths(tmp_path: Path) -> None:
    # Every budget, with the grace a cut step gets and what comes before the first, within 9 minutes.
    assert sum(device.BUDGETS_S.values()) <= device.TOTAL_BUDGET_S
    assert device.TOTAL_BUDGET_S + device.STOP_GRACE_S + device.RUN_MARGIN_S <= device.RUN_LIMIT_S <= 9 * 60
    steps = {s.name: s for s in device.plan_steps(_args(tmp_path, quick=False, device="cuda"), tmp_path)}
    assert list(steps) == STEPS
    exact = " ".join(steps["exactness"].commands[0])
    assert (
        "--lengths 4096,16384" in exact and "--dtype float32,bfloat16" in exact and "--preset large" in exact
    )
    anchor = " ".join(steps["model"].commands[1])  # NVIDIA's cached HSTU block shape, batch 1 and 8
    assert "bench model --anchor" in anchor and "--dtype bfloat16" in anchor and "--device cuda" in anchor
    model = " ".join(steps["model"].commands[2])
    assert (
        "--lengths 4096,8192,16384,32768" in model and "--budget-ms 50" in model and "--device cuda" in model
    )
    assert "--users 16 --users-lengths 8192" in model  # the 16-user bucket at 8k: the rate target's
    xl_model = " ".join(steps["model"].commands[0])
    assert "--preset xl" in xl_model and "--lengths 2048,8192" in xl_model and steps["model"].independent
    store, xl_store = (" ".join(c) for c in steps["store"].commands)
    assert "--preset large" in store and "--preset xl" in xl_store and "--lengths 4096" in xl_store
    profile = " ".join(steps["profile"].commands[0])
    assert (
        "relaygr.device.profiling" in profile
        and "--lengths 2048,8192" in profile
        and "--preset large" in profile
    )
    train, experiment = (" ".join(c) for c in steps["pipeline"].commands)
    assert "train --preset large" in train and "--device cuda" in train
    # The points come from the device's calibration (device.points), not from a fixed grid.
    assert "relaygr.device.points" in experiment and "--lengths" not in experiment
    assert "--core-per-stage" in experiment and "--patience 1" in experiment
    assert steps["pipeline"].needs_broker


def test_a_failing_command_of_an_independent_step_does_not_stop_the_next(tmp_path: Path) -> None:
    fail = [sys.executable, "-c", "import sys; sys.exit(2)"]
    ok = [sys.executable, "-c", "print('{\"xl\": 1}')"]
    step = device.Step("model", 30.0, [fail, ok], independent=True)
    res = device.run_step(step, 30.0, tmp_path / "model.log", dict(os.environ))
    assert res.status == "failed" and "exit status 2" in res.reason
    assert parse_json_lines((tmp_path / "model.log").read_text()) == [{"xl": 1}]


def test_summaries_of_empty_logs_are_empty_not_errors(tmp_path: Path) -> None:
    args = _args(tmp_path)
    for name in STEPS:
        summarise(name, [], args)
    assert summarise("exactness", [], args)["meets_fp32_target"] is None


def test_bench_model_takes_a_preset_and_reports_the_checks_figures(capsys) -> None:
    from relaygr.bench import model as bench_model
    from relaygr.cli import build_parser

    argv = ["bench", "model", "--json", "--preset", "large", "--lengths", "16,24", "--suffix", "4",
            "--candidates", "12", "--repeats", "1", "--block", "8", "--roofline-n", "32", "--threads", "1",
            "--budget-ms", "100000"]  # fmt: skip
    assert bench_model.run(build_parser(argv).parse_args(argv)) == 0
    rows = parse_json_lines(capsys.readouterr().out)
    ranks = [r for r in rows if r["kind"] == "rank"]
    assert [(r["layers"], r["dim"], r["heads"], r["preset"]) for r in ranks] == [(8, 256, 4, "large")] * 2
    for r in ranks:
        assert r["top10_agreement"] == 1.0 and r["max_abs_diff"] <= 1e-4
        assert r["kv_bytes_per_layer"] == 2 * r["prefix_len"] * 256 * 4  # keys and values, fp32
        assert r["flop_bound"] > 1 and r["relay_tokens_per_s"] > 0
    (budget,) = [r for r in rows if r["kind"] == "budget"]
    assert budget["relay_max_history"] == budget["full_max_history"] == 28 and budget["ratio"] == 1.0


def test_train_takes_a_preset_and_explicit_shape_flags_win() -> None:
    from relaygr.cli import build_parser
    from relaygr.tools.train_source import apply_preset

    def shape(*flags: str) -> tuple:
        argv = ["train", "--out", "x", *flags]
        args = apply_preset(build_parser(argv).parse_args(argv))
        return args.layers, args.heads, args.dim, args.max_seq_len

    assert shape() == (2, None, None, 8192)  # small's depth and cap; width and heads sized from the log
    assert shape("--preset", "small") == (2, 2, 64, 8192)
    assert shape("--preset", "large") == (8, 4, 256, 32768)
    assert shape("--preset", "large", "--dim", "128", "--max-seq-len", "4096") == (8, 4, 128, 4096)
    assert shape("--preset", "xl") == (24, 8, 1024, 8192)  # HSTU's largest published shape
