"""The host-path benchmark's figures: a process's CPU read from ``/proc``, the ladder sized from a
measured cost, one rate's figures and whether it was held, and bad arguments refused before any
set-up. (The benchmark itself runs the whole pipeline: ``relaygr bench host-path``.)"""

from __future__ import annotations

import os
import sys
import time

import pytest

from relaygr.bench.host_path import (
    Window,
    cpu_seconds_of_stat,
    held,
    ladder,
    parse_fractions,
    point_figures,
    process_cpu_s,
    stage_pids,
    stages_cpu_s,
)
from relaygr.cli import main
from relaygr.schemas import RankedResult


def test_the_cpu_of_a_stat_line_is_utime_plus_stime_whatever_the_process_name() -> None:
    # The name may hold spaces and parentheses; utime and stime are fields 14 and 15 of the line.
    line = "4242 (a (b) c) S 1 2 3 4 5 6 7 8 9 10 300 200 11 12 20 0 1 0 100 0 0\n"
    assert cpu_seconds_of_stat(line, 100) == pytest.approx(5.0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_the_cpu_of_this_process_grows_with_work_it_does() -> None:
    before = process_cpu_s(os.getpid())
    t0 = time.thread_time()
    while time.thread_time() - t0 < 0.3:  # a third of a second of this thread's own CPU
        sum(range(1000))
    assert process_cpu_s(os.getpid()) - before >= 0.2  # clock ticks: 10 ms each at most


def test_the_ladder_is_fractions_of_one_cores_worth_of_rankings() -> None:
    assert ladder(4.0, [0.5, 1.0, 2.0]) == [125.0, 250.0, 500.0]
    assert ladder(3.0, [1.0]) == [333.0]
    with pytest.raises(ValueError, match="sizes no ladder"):
        ladder(0.0, [1.0])


@pytest.mark.parametrize("text", ["", "a,b", "1,0.5", "0,1", "1,nan"])
def test_bad_fractions_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="--fractions"):
        parse_fractions(text)


def _result(i: int, ranking: float) -> RankedResult:
    return RankedResult(
        request_id=f"r{i}", user_id="u", ts=1.0, items=[], path="relay", latency_ms=ranking,
        breakdown_ms={"ranking": ranking},
    )  # fmt: skip


def test_a_rate_s_figures_split_the_worker_s_cpu_into_device_thread_and_host() -> None:
    results = [_result(i, 10.0 + i) for i in range(10)]
    window = Window(cpu_s=0.05, device_rank_s=0.01, device_prefill_s=0.0, wall_s=1.0, idle_cpu_s_per_s=0.01)
    fig = point_figures(10.0, 8192, 10, results, window, late_s=0.0)
    assert fig["cpu_ms_per_ranking"] == 5.0
    assert fig["cpu_ms_per_ranking_over_idle"] == 4.0
    assert fig["device_thread_ms_per_ranking"] == 1.0
    assert fig["host_ms_per_ranking"] == 4.0
    assert fig["device_share"] == 0.2
    assert (fig["ranking_ms_p50"], fig["ranking_ms_p99"]) == (14.0, 19.0)
    assert fig["paths"] == {"relay": 10}
    assert held(fig, budget_ms=50.0)
    assert not held(fig, budget_ms=15.0)  # its P99 is over that budget
    assert not held({**fig, "results": 9}, budget_ms=50.0)  # a result missing
    assert not held({**fig, "late_s": 5.0}, budget_ms=50.0)  # results came long after they were due


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--fractions", "1,x"], "--fractions"),
        (["--modes", "relay,fast"], "--modes"),
        (["--rates", "20,10"], "--rates"),
    ],
)
def test_bad_arguments_are_refused_before_any_set_up(argv: list[str], message: str, capsys) -> None:
    assert main(["bench", "host-path", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_bad_number_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "host-path", "--seconds", "0"])
    assert exit_.value.code == 2
    assert "--seconds: must be greater than 0, got 0" in capsys.readouterr().err


def test_every_stage_s_cpu_is_per_request_sent_and_sums_to_the_cascade_s() -> None:
    window = Window(
        cpu_s=0.05, device_rank_s=0.01, device_prefill_s=0.0, wall_s=1.0,
        stages_cpu_s={"retrieval": 0.02, "preprocess": 0.01, "ranker": 0.05, "broker": 0.04},
    )  # fmt: skip
    fig = point_figures(10.0, 512, 20, [_result(i, 10.0) for i in range(10)], window, late_s=0.0)
    assert fig["stages_cpu_ms_per_request"] == {
        "retrieval": 1.0,
        "preprocess": 0.5,
        "ranker": 2.5,
        "broker": 2.0,
    }
    assert fig["cascade_cpu_ms_per_request"] == 6.0


def test_the_stages_processes_are_named_by_stage_and_a_gone_one_counts_as_none() -> None:
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    me = type("Proc", (), {"pid": os.getpid()})()
    pipe = type("Pipe", (), {"procs": {"ranker-0": gone, "ranker-1": me, "ingress-requests": me}})()
    from relaygr.infra.settings import Settings

    pids = stage_pids(pipe, Settings(bootstrap="127.0.0.1:1"))
    assert set(pids) == {"ranker", "ingress_requests", "load_generator"}  # no local broker at that address
    assert len(pids["ranker"]) == 2
    cpu = stages_cpu_s(pids)
    assert cpu["ingress_requests"] == cpu["load_generator"] > 0
    assert cpu["ranker"] == cpu["load_generator"]  # the exited process adds nothing
