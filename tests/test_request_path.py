"""tools/request_path.py counts the files one rank request runs through (no broker): the files of
the handler, the engine, the model's forward and the attention kernel are among them, and the
hook it installs is gone afterwards."""

from __future__ import annotations

import argparse
import sys

from relaygr.tools import request_path


def _args(path: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    request_path.add_arguments(parser)
    return parser.parse_args(["--path", path, "--history", "64", "--candidates", "8", "--short-term", "8"])


def test_one_relay_request_runs_through_the_handler_the_engine_and_the_kernel() -> None:
    record = request_path.trace_request(_args("relay"))
    assert record["path"] == "relay" and record["prefix_len"] == 56 and record["history_len"] == 64
    files = record["by_file"]
    for name in (
        "streams/ranking/rank_handler.py",
        "streams/history.py",
        "workers/engine/ranker.py",
        "workers/model/inference.py",
        "workers/kernels/cpu.py",
    ):
        assert f"relaygr/{name}" in files, sorted(files)
    assert "relaygr/tools/request_path.py" not in files  # the harness is not the path
    assert record["files"] == len(files)
    assert record["file_lines"] == sum(f["lines"] for f in files.values())
    assert 0 < record["function_lines"] <= record["file_lines"]
    assert sys.getprofile() is None  # the hook is gone


def test_a_full_ranking_takes_the_full_path_without_a_prefix() -> None:
    record = request_path.trace_request(_args("full"))
    assert record["path"] == "full" and record["prefix_len"] == 0
    assert "relaygr/workers/kernels/cpu.py" in record["by_file"]
