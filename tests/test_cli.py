"""The command line rejects bad numbers with a usage error that names the flag and the rule, and a
command stopped from outside unwinds."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

import pytest

from relaygr.cli import main
from relaygr.tools.args import int_at_least


def test_int_at_least() -> None:
    parse = int_at_least(1)
    assert parse("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="must be at least 1, got 0"):
        parse("0")
    with pytest.raises(argparse.ArgumentTypeError, match="'x' is not an integer"):
        parse("x")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--max-history", "0"], "--max-history: must be at least 1, got 0"),
        (["demo", "--theta", "0"], "--theta: must be greater than 0, got 0"),
        (["demo", "--theta", "11"], "--theta: must be at most 10, got 11"),
        (["calibrate", "--threads", "-2"], "--threads: must be at least 0, got -2"),
        (["bench", "pipeline", "--users", "0"], "--users: must be at least 1, got 0"),
        (["bench", "pipeline", "--warmup-requests", "many"], "--warmup-requests: 'many' is not an integer"),
        (["experiment", "throughput", "--repeat", "0"], "--repeat: must be at least 1, got 0"),
        (["experiment", "seq-len", "--max-requests", "-5"], "--max-requests: must be at least 1, got -5"),
        (["experiment", "throughput", "--confidence", "1.5"], "--confidence: must be between 0 and 1"),
        (["experiment", "throughput", "--miss-rate", "nan"], "--miss-rate: must be a finite number"),
        (["up", "--max-restarts", "-1"], "--max-restarts: must be at least 0, got -1"),
        (["up", "--restart-window", "0"], "--restart-window: must be greater than 0, got 0"),
        (["bench", "noisy-neighbour", "--block-s", "0"], "--block-s: must be greater than 0, got 0"),
        (
            ["bench", "model", "--lengths", "64,-3"],
            "--lengths: positive event counts, comma separated, got '64,-3'",
        ),
        (["bench", "model", "--users-lengths", "x"], "--users-lengths: positive event counts"),
        (["bench", "model", "--lengths", ""], "--lengths: positive event counts"),
    ],
)
def test_bad_numbers_are_usage_errors(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_runs_one_ranking_worker_per_two_cores_at_most_two() -> None:
    from relaygr.demo import default_ranking_workers

    assert [default_ranking_workers(c) for c in (1, 2, 3, 4, 16)] == [1, 1, 1, 2, 2]


def test_an_unwritable_results_file_is_refused_before_the_benchmark_starts(tmp_path, capsys) -> None:
    # A folder where the file should be: refused at once, not after minutes of benchmark.
    assert main(["bench", "noisy-neighbour", "--results", str(tmp_path)]) == 2
    assert "cannot write --results" in capsys.readouterr().err


def test_a_command_stopped_with_sigterm_unwinds_and_stops_what_it_started(tmp_path) -> None:
    # A timeout or a service manager stops a benchmark with SIGTERM: its `finally` (which stops
    # the pipeline it started) must run, as on Ctrl-C.
    (tmp_path / "sleepy_command.py").write_text(
        "import time\n"
        "def add_arguments(parser):\n    pass\n"
        "def run(args):\n"
        "    try:\n        print('started', flush=True)\n        time.sleep(60)\n"
        "    finally:\n        print('stopped what it started', flush=True)\n"
    )
    script = (
        "import sys\nfrom relaygr import cli\n"
        "cli.COMMANDS['sleepy'] = ('sleepy_command', 'sleeps')\nsys.exit(cli.main(['sleepy']))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "started"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "stopped what it started" in out
