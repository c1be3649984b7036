"""The part of a long history that is served: a model-level cap on sequence length.

Real logs have users with tens of thousands of events (bots, shared accounts, years of history).
A ranker serves at most the ``max_len`` most recent of them. The window's start moves in whole
``step``s, not one event at a time: a prefix cached for a window stays valid while the user's
new events arrive, until the start moves on by a step (then it is computed once more). So the
served length is between ``max_len - step`` and ``max_len`` events for a capped user.

Primitives:
- ``window_step(max_len)``: the default step, an eighth of the cap.
- ``window_start(total, max_len, step)``: absolute index of the first served event of a history
  of ``total`` events.
- ``served(history, first, max_len, step)``: the served tail of ``history`` (whose first event
  has absolute index ``first``), and whether it was capped.
"""

from __future__ import annotations

from relaygr.workers.prefix_kv import Events


def window_step(max_len: int) -> int:
    return max(1, max_len // 8)


def window_start(total: int, max_len: int, step: int) -> int:
    if total <= max_len:
        return 0
    return -(-(total - max_len) // step) * step  # rounded up to a whole step: never over the cap


def served(history: Events, first: int, max_len: int, step: int) -> tuple[Events, bool]:
    start = max(first, window_start(first + len(history), max_len, step))
    return (history.slice(start - first) if start > first else history), start > 0
