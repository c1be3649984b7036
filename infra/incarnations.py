"""Committed offsets that name the incarnation of the topic they were read from.

A topic deleted and created again keeps its name and partitions; only its topic id changes. A
commit in flight across that (aiokafka retries a commit to an unknown topic until a topic of that
name exists again) lands on the new topic with an offset read from the old one, and the group
would resume there: the new topic's first records would be skipped, or dropped by faust, whose
consumer ignores records below the offset it resumed at. So each commit carries the topic id of
what was read in its offset metadata, and on assignment a committed offset that names another
topic id than the topic's current one is not used: the partition is read from its start.

Primitives:
- ``Incarnations(settings)``: ``await learn(topics)`` reads the topics' current ids (kept for
  stamping); ``stamp(offsets)`` -> ``{tp: OffsetAndMetadata(offset, topic id)}``;
  ``await stale(group, tps)`` -> the partitions whose committed offset names another topic id than
  the current one (ids read now); ``await close()``.
A commit without a stamp (an older release, another client) is trusted: there is no way to tell.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping

from aiokafka import TopicPartition
from aiokafka.structs import OffsetAndMetadata

from relaygr.infra.cluster_identity import ClusterProbe
from relaygr.infra.kafka import admin
from relaygr.infra.settings import Settings

log = logging.getLogger(__name__)

_STAMP = "topic-id:"
# A check that cannot be answered in this time (a broker just starting, a coordinator moving)
# finds nothing stale: the committed offsets are used, as without the check.
CHECK_TIMEOUT_S = 10.0


class Incarnations:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.ids: dict[str, str] = {}  # topic -> id of the incarnation being read
        self._probe = ClusterProbe(settings)

    async def learn(self, topics: Iterable[str]) -> dict[str, str]:
        """The current id of each of ``topics`` (kept for ``stamp``); a topic the broker does
        not describe (deleted, or ids unknown) is left out."""
        facts = await self._probe.facts(topics)
        now = {name: t.topic_id for name, t in facts.topics.items() if t.topic_id}
        self.ids.update(now)
        return now

    def stamp(self, offsets: Mapping[TopicPartition, int]) -> dict[TopicPartition, OffsetAndMetadata]:
        return {
            tp: OffsetAndMetadata(offset, _STAMP + self.ids[tp.topic] if tp.topic in self.ids else "")
            for tp, offset in offsets.items()
        }

    async def stale(self, group: str, tps: Iterable[TopicPartition]) -> set[TopicPartition]:
        """Of ``tps``, those whose offset committed by ``group`` was read from another incarnation
        of the topic than the current one (learnt now). Unreadable answers count as none stale."""
        tps = list(tps)
        if not tps:
            return set()
        try:
            now, committed = await asyncio.wait_for(self._read(group, tps), CHECK_TIMEOUT_S)
        except Exception as e:  # a check only: never hold up an assignment on it
            log.warning("could not check the committed offsets of %s against the topic ids: %s", group, e)
            return set()
        out = set()
        for tp, om in committed.items():
            meta = om.metadata or ""
            read_from = meta[len(_STAMP) :] if meta.startswith(_STAMP) else None
            if om.offset >= 0 and read_from and tp.topic in now and read_from != now[tp.topic]:
                out.add(tp)
        return out

    async def _read(self, group: str, tps: list[TopicPartition]) -> tuple[dict[str, str], dict]:
        now = await self.learn({tp.topic for tp in tps})
        client = admin(self.settings)
        await client.start()
        try:
            return now, await client.list_consumer_group_offsets(group, partitions=tps)
        finally:
            await client.close()

    async def close(self) -> None:
        await self._probe.close()
