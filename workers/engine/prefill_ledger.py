"""What became of a worker's pre-inferences: the counts its stats report, and its backlog.

Primitives:
- ``PrefillLedger``: ``counts`` (``admitted``: leased; ``finished``: computed or extended;
  ``cached``: a tier already held the prefix; ``late``: its ranking went ahead without it;
  ``refused``; ``dropped:<reason>``), ``admit(user_id, predicted_ms)`` / ``end(user_id)`` around
  one pre-inference, ``backlog_ms(eta_ms)``: predicted device time of those not finished.
- ``device_share(scheduler)``: the device seconds each priority got, and pre-inference's recent share.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from relaygr.workers.engine.scheduler import DeviceScheduler, Priority

# Pre-inference outcomes (``PrefillOutcome.status``) that computed something.
COMPUTED = frozenset({"computed", "extended"})


class PrefillLedger:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        # Predicted device ms of each user's pre-inference not finished yet (queued or running).
        self._pending_ms: dict[str, float] = {}

    def admit(self, user_id: str, predicted_ms: float) -> None:
        """A pre-inference of ``user_id`` was leased; it is predicted to take ``predicted_ms``.
        Several of one user's pending at once are one computation (the store's single-flight:
        the later ones join it), so the backlog counts the longest once."""
        self.counts["admitted"] += 1
        self._pending_ms[user_id] = max(self._pending_ms.get(user_id, 0.0), predicted_ms)

    def end(self, user_id: str) -> None:
        """``user_id``'s pre-inference ended, however (its outcome is counted apart)."""
        self._pending_ms.pop(user_id, None)

    def outcome(self, source: str) -> None:
        """A pre-inference got its prefix from ``source`` (a store source)."""
        self.counts["finished" if source in COMPUTED else "cached"] += 1

    def backlog_ms(self, eta_ms: Callable[[str], float | None]) -> float:
        """Predicted device ms of the pre-inferences not finished: what ``eta_ms(user)`` says a
        computing one has left (None: not computing), else the whole of it."""
        total = 0.0
        for user, whole_ms in self._pending_ms.items():
            left = eta_ms(user)
            total += whole_ms if left is None else left
        return total


def device_share(scheduler: DeviceScheduler) -> dict[str, float]:
    """Device seconds each priority got since start (``rank_s``, ``prefill_s``), and
    pre-inference's share of the recent device time (``prefill_recent_share``)."""
    busy = scheduler.busy_s
    return {
        "rank_s": busy[Priority.RANK],
        "prefill_s": busy[Priority.PREFILL],
        "prefill_recent_share": scheduler.recent_share(Priority.PREFILL),
    }
