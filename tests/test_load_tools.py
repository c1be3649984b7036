"""The load every experiment, scenario and benchmark shares: the paced sender's schedules and the
long-user builder (``tools.sender``, ``tools.long_users``). The sending itself runs against the
real broker in the scenarios' broker tests (``test_steady_load.py``, ``test_rolling_restart.py``)."""

from __future__ import annotations

import itertools
import random

import pytest

from relaygr.infra.settings import Settings
from relaygr.schemas import RecommendationRequest
from relaygr.tools.long_users import long_users
from relaygr.tools.sender import BackgroundLoad, cycled, jittered_offsets, rate_offsets
from relaygr.workers.training.movielens import load_movielens


@pytest.fixture(scope="module")
def ml():
    return load_movielens("ml-100k")


def test_a_rate_sends_on_a_fixed_beat_and_none_sends_everything_at_once() -> None:
    assert list(itertools.islice(rate_offsets(4.0), 4)) == [0.0, 0.25, 0.5, 0.75]
    assert list(itertools.islice(rate_offsets(None), 3)) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="positive"):
        rate_offsets(0.0)


def test_jittered_offsets_fall_once_in_each_period() -> None:
    offsets = list(itertools.islice(jittered_offsets(2.0, random.Random(0)), 50))
    assert [int(o // 2.0) for o in offsets] == list(range(50))
    assert len({round(o % 2.0, 6) for o in offsets}) == 50  # not in step with a fixed beat


def test_cycled_requests_go_round_robin_each_with_an_id_of_its_own() -> None:
    base = [RecommendationRequest(request_id=f"r{i}", user_id=f"u{i}", ts=0.0) for i in range(3)]
    got = list(itertools.islice(cycled(base), 7))
    assert [r.user_id for r in got] == ["u0", "u1", "u2", "u0", "u1", "u2", "u0"]
    assert len({r.request_id for r in got}) == 7
    assert all(r.request_id.startswith(f"r{i % 3}-") for i, r in enumerate(got))


def test_a_background_load_takes_a_rate_or_offsets_not_both() -> None:
    with pytest.raises(ValueError, match="not both"):
        BackgroundLoad(Settings(), "t", [], 5.0, offsets=[0.0])


def test_long_users_have_exactly_the_length_asked_and_names_of_their_own(ml) -> None:
    behaviours, requests = long_users(ml, 3, 500, tag="t")
    assert [r.user_id for r in requests] == ["t-1", "t-2", "t-3"]  # in id order
    assert all(r.request_id == r.user_id for r in requests)
    for r in requests:
        mine = [b for b in behaviours if b.user_id == r.user_id]
        assert len(mine) == 500 and all(b.ts > 0 for b in mine)
        assert [b.ts for b in mine] == sorted(b.ts for b in mine)
    _, later = long_users(ml, 2, 500, tag="t", skip=3)
    assert [r.user_id for r in later] == ["t-4", "t-5"]


def test_the_longest_histories_come_first_when_asked(ml) -> None:
    behaviours, (request,) = long_users(ml, 1, 3_000, tag="heavy", longest_first=True)
    longest = max(ml.histories, key=lambda u: len(ml.histories[u]))
    assert request.user_id == f"heavy-{longest}" and len(behaviours) == 3_000
    real = ml.histories[longest]
    assert [b.item_id for b in behaviours[-len(real) :]] == real.item_ids.tolist()  # the real history last


def test_too_few_users_is_an_error_not_a_shorter_list(ml) -> None:
    with pytest.raises(ValueError, match="users with 10000"):
        long_users(ml, 1, 100, tag="t", min_events=10_000)
