"""The benchmarks' host CPU figures: busy and steal shares read from /proc/stat."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from relaygr.tools.experiment.scenarios.host_cpu import HostCpuSampler, read_cpu_times, summarise


def test_cpu_times_split_busy_steal_and_idle(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 5 20 800 30 1 4 40 7 0\ncpu0 50 2 10 400 15 0 2 20 3 0\n")
    busy, steal, total = read_cpu_times(stat)
    assert (busy, steal, total) == (130, 40, 1000)  # guest time is inside user already
    stat.write_text("cpu  100 5 20 800\n")  # an old kernel: no iowait.. steal columns
    assert read_cpu_times(stat) == (125, 0, 925)
    assert read_cpu_times(tmp_path / "absent") is None
    (tmp_path / "odd").write_text("intr 1 2 3\n")
    assert read_cpu_times(tmp_path / "odd") is None


def test_a_spell_of_steal_shows_in_its_one_second_window() -> None:
    # 0.5 s samples, 100 ticks each; 10 steal ticks each, except 60 in one interval.
    samples, busy, steal = [], 0, 0
    for i in range(11):
        samples.append((busy, steal, 100 * i))
        busy, steal = busy + 50, steal + (60 if i == 5 else 10)
    got = summarise([samples], window=2)
    assert got["busy_pct"] == 50.0
    assert got["steal_pct"] == 15.0  # (9 × 10 + 60) / 1000
    assert got["steal_pct_max_1s"] == 35.0  # (60 + 10) / 200
    assert summarise([samples[:1]]) == {"busy_pct": None, "steal_pct": None, "steal_pct_max_1s": None}


def test_blocks_of_one_condition_are_summed_and_windows_stay_inside_a_block() -> None:
    # Two blocks of one condition: 100 ticks a sample, 20 % steal in the first, 0 % in the second.
    first = [(50 * i, 20 * i, 100 * i) for i in range(5)]
    second = [(50 * i, 80, 100 * i) for i in range(10, 15)]
    got = summarise([first, second], window=2)
    assert got["busy_pct"] == 50.0 and got["steal_pct"] == 10.0  # 80 of 800, the gap between not counted
    assert got["steal_pct_max_1s"] == 20.0
    assert summarise([first[:1], []]) == summarise([])


async def test_the_sampler_reads_until_stopped() -> None:
    ticks = iter(range(0, 10_000, 100))

    def read() -> tuple[int, int, int]:
        t = next(ticks)
        return t // 2, t // 10, t

    sampler = HostCpuSampler(every_s=0.001, read=read).start()
    await asyncio.sleep(0.02)
    got = (await sampler.stop())["all"]
    assert got["busy_pct"] == pytest.approx(50.0) and got["steal_pct"] == pytest.approx(10.0)
    off_linux = await HostCpuSampler(read=lambda: None).start().stop()
    assert off_linux["all"]["steal_pct"] is None


async def test_switching_blocks_keeps_each_condition_apart() -> None:
    # Steal only while "heavy" runs: each tick of the clock is one sample read.
    state = {"busy": 0, "steal": 0, "total": 0, "label": "quiet"}

    def read() -> tuple[int, int, int]:
        state["total"] += 100
        state["busy"] += 50
        state["steal"] += 40 if state["label"] == "heavy" else 0
        return state["busy"], state["steal"], state["total"]

    sampler = HostCpuSampler(every_s=3600, read=read, label="quiet").start()
    for label in ("heavy", "quiet", "heavy", "quiet"):
        read()
        sampler.switch(label)
        state["label"] = label
        read()
    got = await sampler.stop()
    assert set(got) == {"quiet", "heavy"}
    assert got["quiet"]["steal_pct"] == 0.0
    assert got["heavy"]["steal_pct"] > 0.0
