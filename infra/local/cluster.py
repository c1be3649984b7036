"""The Kafka cluster a command talks to: the configured one, or the local broker, started if need be.

Primitives:
- ``ensure_broker(settings) -> (settings, started)``: settings whose ``bootstrap`` names a running
  cluster: ``RELAYGR_BOOTSTRAP`` when set, else the local broker of ``RELAYGR_HOME`` (started
  here when it is down; ``started`` says so, so that the caller may stop it at the end). Each
  step is printed as a ``== ...`` line.
"""

from __future__ import annotations

import time

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
