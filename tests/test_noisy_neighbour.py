"""The noisy-neighbour scenario's alternating blocks: each request counts in the block it was sent in."""

from __future__ import annotations

from types import SimpleNamespace

from relaygr.tools.experiment.scenarios.noisy_neighbour import Blocks


def test_a_request_counts_in_the_block_it_was_sent_in() -> None:
    blocks = Blocks()
    blocks.starts, blocks.labels = [100.0, 105.0, 112.0, 117.0], ["quiet", "heavy", "quiet", "heavy"]
    assert [blocks.of(t) for t in (99.0, 100.0, 104.9, 105.0, 116.9, 117.0, 500.0)] == [0, 0, 0, 1, 2, 3, 3]
    sent = [SimpleNamespace(ts=t) for t in (100.5, 106.0, 111.9, 113.0, 118.0)]
    by = blocks.split(sent)
    assert [r.ts for r in by["quiet"]] == [100.5, 113.0]
    assert [r.ts for r in by["heavy"]] == [106.0, 111.9, 118.0]
