"""Running a scenario kind: its set-up, its pipelines one after the other, and its JSON lines.

Every scenario runs the same way: its flags checked before minutes of set-up (a usage error exits
2); the broker (``ensure_broker``, or one the scenario starts for itself), the trained model and
its latency calibration on this machine made ready; then each of its pipelines (``Setup``) on
topics and a home of its own (``harness.fresh_deployment``), one after the other, removed after.
Progress goes to standard error (not at all with ``--json``); standard output carries only the
JSON lines: each pipeline's lines as soon as it is measured (with its ``cores``), then the
scenario's side-by-side lines.

Primitives:
- ``Setup``: one pipeline of a scenario: a label, its mode, ranking workers and extra settings.
- ``ScenarioRun``: what a scenario measures with: its arguments, the clients' settings, MovieLens,
  the model and its settings, ``say``, and what it keeps across its pipelines for its summary.
- ``Scenario``: a kind: ``arguments`` (``--json`` and its ``add_arguments``), ``check``,
  ``setups``, ``env``, ``cores``, ``broker``, ``measure``, ``summary``.
- ``run_scenario(kind, args) -> int``: the command.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relaygr.infra.settings import Settings
from relaygr.tools.experiment.harness import Deployment, fresh_deployment, move_back, move_off_device
from relaygr.workers.engine.cores import CoreLayout


@dataclass(frozen=True)
class Setup:
    """One pipeline a scenario runs on: ``label`` (its runs' tag), mode, ranking workers, and
    ``RELAYGR_*`` settings for its stages besides the model and calibration."""

    label: str
    mode: str = "relay"
    workers: int = 1
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class ScenarioRun:
    args: argparse.Namespace
    settings: Settings  # the clients' (the broker's bootstrap, the deployment's prefix and home)
    ml: Any  # MovieLens-100K (``workers.training.movielens``)
    model_dir: Path
    env: dict[str, str]  # the model and its calibration, for every pipeline's stages
    say: Callable[[str], None]
    t0: float = field(default_factory=time.monotonic)
    kept: dict[str, Any] = field(default_factory=dict)  # what a summary needs from the pipelines


def progress(quiet: bool) -> Callable[[str], None]:
    """``== msg`` lines on standard error, or nothing when ``quiet``."""

    def say(msg: str) -> None:
        if not quiet:
            print(f"== {msg}", file=sys.stderr, flush=True)

    return say


class Scenario:
    """A scenario kind. ``name``: its command (``relaygr bench <name>``); ``tag``: the start of
    its runs' topic and folder names."""

    name: str
    tag: str

    def arguments(self, parser: argparse.ArgumentParser) -> None:
        """The command's flags: ``--json``, then the kind's own."""
        parser.add_argument("--json", action="store_true", help="print only the JSON lines")
        self.add_arguments(parser)

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        raise NotImplementedError

    def check(self, args: argparse.Namespace) -> None:
        """Usage errors (``ValueError``, ``ImportError``, ``OSError``), before any set-up."""

    def setups(self, args: argparse.Namespace) -> list[Setup]:
        return [Setup(self.tag, workers=getattr(args, "ranking_workers", 1))]

    def env(self, args: argparse.Namespace) -> dict[str, str]:
        """Settings every pipeline of the run gets (besides the model and its calibration)."""
        return {}

    def cores(self, args: argparse.Namespace, setup: Setup) -> CoreLayout:
        from relaygr.workers.engine.cores import plan_cores

        return plan_cores(setup.workers, pin=False)

    @contextlib.contextmanager
    def broker(
        self, args: argparse.Namespace, say: Callable[[str], None]
    ) -> Iterator[tuple[Settings, Settings]]:
        """The clients' settings, and those the broker's nodes are recorded under (for pinning). A
        local broker started for the run is stopped at its end."""
        from relaygr.infra.local.cluster import broker_for_run
        from relaygr.infra.settings import get_settings

        with broker_for_run(get_settings(), progress=sys.stderr) as settings:
            yield settings, settings

    async def measure(self, run: ScenarioRun, dep: Deployment, setup: Setup) -> list[dict]:
        raise NotImplementedError

    def summary(self, run: ScenarioRun, lines: list[dict]) -> list[dict]:
        """Lines after every pipeline's (relay and baseline side by side, ...)."""
        return []


def run_scenario(kind: Scenario, args: argparse.Namespace) -> int:
    try:
        kind.check(args)
    except (ImportError, ValueError, OSError) as e:
        print(f"relaygr bench {kind.name}: {e}", file=sys.stderr)
        return 2
    say = progress(getattr(args, "json", False))
    with contextlib.ExitStack() as stack:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON lines
            settings, nodes = stack.enter_context(kind.broker(args, say))
            run = _prepare(args, settings, say)
        lines = []
        for setup in kind.setups(args):
            cores = kind.cores(args, setup)
            say(f"{setup.label}: cores {cores.describe()}")
            env = {**run.env, **kind.env(args), **setup.env}
            move_off_device(cores, nodes)
            try:
                with fresh_deployment(
                    settings, setup.label, setup.mode, env, workers=setup.workers, cores=cores, say=say
                ) as dep:
                    got = asyncio.run(kind.measure(run, dep, setup))
            finally:
                move_back(cores, nodes)
            for line in got:
                line.setdefault("cores", cores.describe())
                print(json.dumps(line), flush=True)
            lines += got
        for line in kind.summary(run, lines):
            print(json.dumps(line), flush=True)
    return 0


def _prepare(args: argparse.Namespace, settings: Settings, say: Callable[[str], None]) -> ScenarioRun:
    """The trained model (trained if missing), its calibration on this machine, MovieLens."""
    from relaygr.streams.config import PipelineSettings
    from relaygr.tools.prepare import ensure_calibration, ensure_model
    from relaygr.workers.training.movielens import load_movielens

    model_dir = PipelineSettings().model_dir
    ensure_model(model_dir)
    calib = ensure_calibration(model_dir)
    env = PipelineSettings.to_env(model_dir=model_dir, calibration_file=calib)
    return ScenarioRun(args, settings, load_movielens("ml-100k"), model_dir, env, say)
