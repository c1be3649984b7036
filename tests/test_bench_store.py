"""``bench store``'s honesty checks: a figure faster than its link is an error, the expander's choice
is compared with the faster path, and a run verifies which tier served each timed promotion."""

from __future__ import annotations

import argparse
import json

import pytest

from relaygr.bench import store as bench_store
from relaygr.workers.store.tier_costs import TierCosts

GB = 1e9


def test_a_figure_faster_than_its_link_is_refused_with_an_error() -> None:
    links = {"host_to_device": (50 * GB, 52 * GB), "disk": (1 * GB, 1.2 * GB)}
    figures = {
        "host_to_device": (67_000_000, 0.26e-3),  # 258 GB/s over a 52 GB/s link: the figure
        "disk": (67_000_000, 0.060),  # 1.1 GB/s: within the best read seen
    }
    checks, errors = bench_store.check_links(figures, links, tolerance=0.10)
    assert not checks["host_to_device"]["accepted"] and checks["disk"]["accepted"]
    assert checks["disk"]["fraction_of_link"] == pytest.approx(67 / 60, rel=1e-3)
    assert (
        len(errors) == 1 and errors[0].startswith("host_to_device:") and "faster than its link" in errors[0]
    )
    # Within the tolerance above the best: accepted; beyond it: refused.
    assert bench_store.check_links({"disk": (1_250_000, 1e-3)}, links, 0.10)[0]["disk"]["accepted"]
    assert not bench_store.check_links({"disk": (1_400_000, 1e-3)}, links, 0.10)[0]["disk"]["accepted"]


def _row(recompute_ms: float, disk_ms: float) -> dict:
    return {
        "recompute": {"median_ms": recompute_ms},
        "host_to_device": {"median_ms": 1.0, "n": 5},
        "disk": {"median_ms": disk_ms, "n": 5},
        "host_bytes": 50_000_000,
        "disk_blob_bytes": 100_000_000,
        "host_to_device_moves_bytes": True,
    }


def test_the_expander_choice_is_checked_against_the_faster_path() -> None:
    costs = TierCosts(host_bytes_per_s=50 * GB, disk_bytes_per_s=1 * GB, disk_fixed_ms=0.0)  # disk: 100 ms
    agrees = bench_store.expander_choice(_row(recompute_ms=300.0, disk_ms=90.0), costs)
    assert agrees["disk"] == {"predicted_ms": 100.0, "serves": True, "faster": True, "matches": True}
    recomputes = bench_store.expander_choice(_row(recompute_ms=50.0, disk_ms=90.0), costs)
    assert recomputes["disk"]["matches"] and not recomputes["disk"]["serves"]
    wrong = bench_store.expander_choice(_row(recompute_ms=95.0, disk_ms=90.0), costs)  # predicted 100
    assert not wrong["disk"]["matches"] and wrong["disk"]["faster"]


def test_a_small_run_times_only_promotions_from_the_tier_it_names(tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser()
    bench_store.add_arguments(parser)
    flags = "--lengths 64 --layers 1 --dim 16 --heads 2 --repeats 4 --hit-repeats 3 --recompute-repeats 1"
    flags += " --link-mb 8 --json --cold-format bf16"
    args = parser.parse_args([*flags.split(), "--disk-path", str(tmp_path)])
    bench_store.run(args)  # its exit status depends on the timings; the row is what is checked
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["unexpected_tiers"] == {"host_to_device": {}, "disk": {}}
    assert row["disk"]["n"] == 4 and row["host_to_device"]["n"] == 4
    assert row["disk_write_drops"] == 0 and row["cold_format"] == "bf16"
    # One copy of the prefix on the device, and its extensions copy none of its tokens (the
    # pre-inference's and the bucketed ranking's: 64 new tokens each, written where they stay).
    token = row["device_bytes_per_user"] // 64
    assert row["prefix_device_copies"] == 1 and row["graphed_rankings"] == 2
    assert row["grow_copied_bytes"] == 0 and row["grow_written_bytes"] == 2 * 64 * token
    assert row["device_bytes_per_user_before"] > 2 * row["device_bytes_per_user"]
    assert row["users_per_gb_x"] >= 1.9 and row["meets"]["one_device_copy"]
    assert row["links"]["disk"]["best_bytes_per_s"] >= row["links"]["disk"]["bytes_per_s"] > 0
    assert "disk" in row["link_check"] and set(row["expander_choice"]) <= {"host_to_device", "disk"}
    assert list(tmp_path.iterdir()) == []  # its files are gone
    with pytest.raises(SystemExit, match="lengths"):
        bench_store.run(parser.parse_args(["--lengths", "0"]))
