"""Committing offsets: a commit refused after a rebalance is dropped, not fatal."""

from __future__ import annotations

import logging

from aiokafka.errors import CommitFailedError

from relaygr.streams.common import commit_existing


class _Consumer:
    """A consumer whose group rebalanced while it was away: every commit is refused."""

    def __init__(self) -> None:
        self.commits = 0

    def partitions_for_topic(self, topic: str) -> set[int]:
        return {0}

    async def commit(self, offsets) -> None:
        self.commits += 1
        raise CommitFailedError("the group has already rebalanced")


class _TP:
    topic = "t"


async def test_a_commit_after_a_rebalance_is_dropped_with_a_warning(caplog) -> None:
    c = _Consumer()
    with caplog.at_level(logging.WARNING):
        await commit_existing(c, {_TP(): 5})
    assert c.commits == 1 and "rebalance" in caplog.text
