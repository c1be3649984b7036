"""Ranks kept per run (``test_ranks.npz``) and several runs pooled user by user (``relaygr quality``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from relaygr.quality_cli import compare
from relaygr.quality_cli import run as quality_run
from relaygr.workers.training.quality import (
    RANKS_FILE,
    load_ranks,
    paired_differences,
    pooled,
    save_ranks,
    summarise,
)

USERS = [f"u{i:03d}" for i in range(40)]


def _ranks(seed: int, lengths=("16", "64", "all"), targets: int = 1) -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {k: [rng.integers(1, 30, size=targets).astype(float) for _ in USERS] for k in lengths}


def _run_folder(root: Path, name: str, ranks: dict, users=USERS, **train) -> Path:
    folder = root / name
    folder.mkdir()
    save_ranks(folder / RANKS_FILE, users, ranks)
    rows = [{"history": k, **v} for k, v in summarise(ranks).items()]
    metrics = {
        "dataset": "ml-100k",
        "protocol": "leave-last-out",
        "test_events": 1,
        "by_history_length": rows,
        "train": {"seed": 0, "far_keys": 128, "best_epoch": 3, **train},
    }
    (folder / "metrics.json").write_text(json.dumps(metrics))
    return folder


def test_ranks_round_trip_with_any_number_of_targets_a_user(tmp_path: Path) -> None:
    ranks = {"64": [np.array([1.0, 5.0]), np.array([3.0]), np.array([2.0, 9.0, 4.0])]}
    ranks["all"] = [r + 1 for r in ranks["64"]]
    save_ranks(tmp_path / RANKS_FILE, ["b", "a", "c"], ranks)
    users, back = load_ranks(tmp_path / RANKS_FILE)
    assert users == ["b", "a", "c"] and list(back) == ["64", "all"]
    for k in ranks:
        assert [r.tolist() for r in back[k]] == [r.tolist() for r in ranks[k]]
    with pytest.raises(ValueError, match="ranks of"):
        save_ranks(tmp_path / "x.npz", ["a"], ranks)


def test_one_run_pooled_is_that_runs_table_and_paired_differences() -> None:
    ranks = _ranks(0, targets=2)
    got = pooled([ranks])
    table = summarise(ranks)
    for k, row in got["by_history_length"].items():
        assert row["HR@10"] == pytest.approx(table[k]["HR@10"])
        assert row["MRR_ci95"] == pytest.approx(table[k]["MRR_ci95"])
    for k, row in paired_differences(ranks).items():
        assert got["all_minus_truncation"][k]["NDCG@10"] == pytest.approx(row["NDCG@10"])
        assert got["all_minus_truncation"][k]["HR@10_ci95"] == pytest.approx(row["HR@10_ci95"])


def test_runs_are_averaged_per_user_before_the_users_are_resampled() -> None:
    # Run a: the whole history hits for users 0..9 and the last 64 for users 0..11; run b: the reverse.
    hit, miss = np.array([1.0]), np.array([50.0])
    a = {
        "64": [hit if i < 12 else miss for i in range(40)],
        "all": [hit if i < 10 else miss for i in range(40)],
    }
    b = {"64": a["all"], "all": a["64"]}
    got = pooled([a, b])
    assert got["by_history_length"]["all"]["HR@10"] == pytest.approx(11 / 40)
    assert got["all_minus_truncation"]["64"]["HR@10"] == pytest.approx(0.0)
    lo, hi = got["all_minus_truncation"]["64"]["HR@10_ci95"]
    assert lo == hi == 0.0  # every user's mean difference is 0: nothing left to resample
    one = pooled([a])["all_minus_truncation"]["64"]
    assert one["HR@10"] == pytest.approx(-2 / 40) and one["HR@10_ci95"][0] < 0.0
    with pytest.raises(ValueError, match="different numbers of users"):
        pooled([a, {k: v[:-1] for k, v in b.items()}])


def test_compare_names_the_best_truncation_and_the_settings_the_runs_differ_in(
    tmp_path: Path, capsys
) -> None:
    a = _run_folder(tmp_path, "a", _ranks(1))
    b = _run_folder(tmp_path, "b", _ranks(2), seed=1)
    c = _run_folder(tmp_path, "c", _ranks(3), seed=2, far_keys=32)
    report = compare([a, b])
    assert report["settings_that_differ"] == [] and [r["seed"] for r in report["runs"]] == [0, 1]
    means = {k: v["HR@10"] for k, v in report["by_history_length"].items()}
    assert report["best_truncation"] == max(("16", "64"), key=means.get)
    assert report["all_minus_best"]["HR@10"] == pytest.approx(means["all"] - means[report["best_truncation"]])
    assert compare([a, b, c])["settings_that_differ"] == ["far_keys"]
    assert quality_run(_args([a, c])) == 0
    out = capsys.readouterr().out
    assert "a pool of configurations, not of seeds" in out and "far_keys=32" in out
    assert "the whole history is" in out and "best truncation" in out


def test_runs_that_did_not_rank_the_same_users_are_refused(tmp_path: Path) -> None:
    a = _run_folder(tmp_path, "a", _ranks(1))
    other = [*USERS[:-1], "u999"]
    b = _run_folder(tmp_path, "b", _ranks(2), users=other)
    with pytest.raises(SystemExit, match="differ in the users ranked"):
        compare([a, b])
    old = tmp_path / "old"
    old.mkdir()
    (old / "metrics.json").write_text("{}")
    with pytest.raises(SystemExit, match=re.escape(f"no {RANKS_FILE}")):
        compare([a, old])
    with pytest.raises(SystemExit, match=r"no metrics\.json"):
        compare([a, tmp_path / "missing"])
    broken = _run_folder(tmp_path, "broken", _ranks(5))
    (broken / "metrics.json").write_text('{"dataset": "ml-100k", ')
    with pytest.raises(SystemExit, match=r"metrics\.json: unreadable"):
        compare([a, broken])
    (broken / "metrics.json").write_text("[1, 2]")
    with pytest.raises(SystemExit, match="not a JSON object"):
        compare([a, broken])
    torn = _run_folder(tmp_path, "torn", _ranks(6))
    (torn / RANKS_FILE).write_bytes((torn / RANKS_FILE).read_bytes()[:100])
    with pytest.raises(SystemExit, match=re.escape(f"{RANKS_FILE}: unreadable")):
        compare([a, torn])
    whole_only = _run_folder(tmp_path, "whole", {"all": _ranks(4)["all"]})
    with pytest.raises(SystemExit, match="no truncated history length"):
        compare([a, whole_only])


def test_the_json_line_and_the_plot(tmp_path: Path, capsys) -> None:
    runs = [_run_folder(tmp_path, "a", _ranks(1)), _run_folder(tmp_path, "b", _ranks(2), seed=1)]
    png = tmp_path / "pool.png"
    assert quality_run(_args(runs, as_json=True, plot=png)) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["users"] == len(USERS) and len(report["runs"]) == 2
    assert set(report["all_minus_truncation"]) == {"16", "64"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _args(runs: list[Path], as_json: bool = False, plot: Path | None = None):
    import argparse

    return argparse.Namespace(runs=runs, json=as_json, plot=plot)
