"""The Kafka cluster a command talks to: the configured one, or the local broker, started if need be.

Primitives:
- ``ensure_broker(settings) -> (settings, started)``: settings whose ``bootstrap`` names a running
  cluster: ``RELAYGR_BOOTSTRAP`` when set, else the local broker of ``RELAYGR_HOME`` (started
  here when it is down; ``started`` says so, so that the caller may stop it at the end). Each
  step is printed as a ``== ...`` line.
- ``broker_for_run(settings, keep=False)``: ``ensure_broker`` for a command that runs and ends (a
  benchmark): a local broker it started is stopped when the run ends, however it ends, so that
  no idle broker is left taking CPU from the next measurement; ``keep`` leaves it up (and says
  so) for the next run to reuse. A broker that was already up, or a configured cluster, is never
  stopped.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TextIO

from relaygr.infra.local import broker
from relaygr.infra.settings import Settings


def _step(msg: str) -> None:
    print(f"== {msg}", flush=True)


def ensure_broker(settings: Settings) -> tuple[Settings, bool]:
    if settings.bootstrap:
        _step(f"using the Kafka cluster at {settings.bootstrap}")
        return settings, False
    up, state = broker.status(settings)
    if up and state is not None:
        _step(f"local Kafka broker already up at {state.bootstrap}")
        return settings.model_copy(update={"bootstrap": state.bootstrap}), False
    _step("starting the local Kafka broker (KRaft, 127.0.0.1)")
    t0 = time.monotonic()
    state = broker.start(settings)
    print(f"   up in {time.monotonic() - t0:.1f} s at {state.bootstrap}; log {state.log_file}")
    return settings.model_copy(update={"bootstrap": state.bootstrap}), True


@contextlib.contextmanager
def broker_for_run(
    settings: Settings, *, keep: bool = False, progress: TextIO | None = None
) -> Iterator[Settings]:
    """The settings of a running cluster for the body; a local broker started for it is stopped
    after it unless ``keep`` (see the module docstring). Its lines go to ``progress`` (None: standard
    output), so that a command's standard output may carry JSON alone."""
    lines = contextlib.redirect_stdout(progress) if progress is not None else contextlib.nullcontext()
    with lines:
        up, started = ensure_broker(settings)
    try:
        yield up
    finally:
        with lines:
            if started and keep:
                _step(f"the local Kafka broker stays up at {up.bootstrap} (`relaygr broker stop` stops it)")
            elif started:
                _step("stopping the local Kafka broker this run started")
                broker.stop(settings)
