"""How ``./dev test`` schedules the suite: files handed to its worker processes the longest first
(``conftest.expected_seconds``), in the order the collection hook left them."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import DEFAULT_SLOW_S, expected_seconds

ROOT = Path(__file__).resolve().parent.parent


def test_files_come_in_the_order_of_their_expected_seconds(request: pytest.FixtureRequest) -> None:
    per_file: dict[Path, float] = {}
    order: list[Path] = []
    for item in request.session.items:
        if item.path not in per_file:
            order.append(item.path)
        per_file[item.path] = per_file.get(item.path, 0.0) + expected_seconds(item)
    # Each file's tests together (xdist's loadfile hands out whole files), the longest file first.
    assert len(order) == len(set(order)) == len({item.path for item in request.session.items})
    weights = [per_file[p] for p in order]
    assert weights == sorted(weights, reverse=True), list(zip(order, weights, strict=True))


def test_a_slow_mark_says_how_slow_or_takes_the_default(request: pytest.FixtureRequest) -> None:
    assert expected_seconds(request.node) == 0.0  # not marked slow
    request.node.add_marker(pytest.mark.slow)
    assert expected_seconds(request.node) == DEFAULT_SLOW_S
    request.node.add_marker(pytest.mark.slow(seconds=420), append=False)  # the closest
    assert expected_seconds(request.node) == 420.0


def test_dev_keeps_the_collection_order_across_its_worker_processes() -> None:
    # Without --no-loadscope-reorder, pytest-xdist hands files out by their number of tests: the
    # few-test pipeline files came last and ran side by side at the end of the run.
    dev = (ROOT / "dev").read_text()
    (parallel,) = [line for line in dev.splitlines() if "--dist loadfile" in line]
    assert "--no-loadscope-reorder" in parallel
