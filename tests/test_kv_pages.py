"""The device tier's pages (``workers/kv_pages.py``): runs of tokens in fixed-address pages, shared
when a prefix grows, given back when no run refers to them, and what a paged ``PrefixKV`` is."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch

from relaygr.workers.kv_pages import ZERO_PAGE, KVLayout, KVPages, PagedKV, PagesExhausted
from relaygr.workers.prefix_kv import PrefixKV

LAYOUT = KVLayout(layers=2, heads=2, attn_dim=3, linear_dim=5, dtype=torch.float32, page_tokens=4)


def _pages(num_pages: int = 6, **kw) -> KVPages:
    return KVPages(LAYOUT, num_pages, "cpu", **kw)


def _tokens(m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(2, m, 2, 3, generator=gen),
        torch.randn(2, m, 2, 5, generator=gen),
        torch.arange(m, dtype=torch.float64) + 100.0 * seed,
    )


def _filled(pages: KVPages, run: PagedKV, start: int, seed: int) -> None:
    pages.write(run, start, *_tokens(run.length - start, seed))


def test_a_layout_says_what_a_token_and_a_page_take() -> None:
    assert LAYOUT.token_bytes == 2 * 2 * (3 + 5) * 4 + 8  # keys and values of both layers, a timestamp
    assert LAYOUT.page_bytes == 4 * LAYOUT.token_bytes
    assert (LAYOUT.pages_for(0), LAYOUT.pages_for(4), LAYOUT.pages_for(5)) == (0, 1, 2)
    assert LAYOUT.bytes_for(5) == 2 * LAYOUT.page_bytes
    with pytest.raises(ValueError, match="at least one"):
        KVLayout(0, 2, 3, 5, torch.float32)


def test_a_run_takes_fresh_pages_and_the_zero_page_is_never_handed_out() -> None:
    pages = _pages()
    run = pages.allocate(6)
    assert run.length == 6 and len(run.pages) == 2 and ZERO_PAGE not in run.pages
    assert pages.used_pages == 2 and pages.free_pages == 3 and pages.capacity_tokens == 20
    assert run.nbytes() == 2 * LAYOUT.page_bytes
    p0, p1 = run.pages
    assert run.rows().tolist() == [4 * p0, 4 * p0 + 1, 4 * p0 + 2, 4 * p0 + 3, 4 * p1, 4 * p1 + 1]
    assert run.rows(9)[6:].tolist() == [0, 1, 2]  # rows of the zero page after the tokens
    with pytest.raises(ValueError, match="does not fit"):
        run.rows(5)
    assert not pages.keys[0][:4].any() and not pages.timestamps[:4].any()  # the zero page reads zeros


def test_tokens_written_are_read_back_in_token_order() -> None:
    pages = _pages()
    run = pages.allocate(7)
    keys, values, ts = _tokens(7, 1)
    pages.write(run, 0, keys, values, ts)
    got_k, got_v, got_ts = pages.gather(run)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values) and torch.equal(got_ts, ts)
    rows = torch.from_numpy(run.rows())
    assert torch.equal(pages.keys[1][rows], keys[1])  # what a row index reads in place
    with pytest.raises(ValueError, match=r"tokens 5\.\.9"):
        pages.write(run, 5, *_tokens(4, 2))


def test_growing_a_run_shares_its_pages_and_writes_only_the_new_tokens() -> None:
    pages = _pages()
    base = pages.allocate(6)  # a page and a half
    _filled(pages, base, 0, 1)
    grown = pages.extend(base, 5)  # fills the half page, then one more
    assert grown.length == 11 and grown.pages[:2] == base.pages and len(grown.pages) == 3
    written = pages.rows_written
    _filled(pages, grown, 6, 2)
    assert pages.rows_written - written == 5 and pages.rows_copied == 0
    k_base, _, _ = pages.gather(base)
    k_grown, _, ts = pages.gather(grown)
    assert torch.equal(ts[6:], _tokens(5, 2)[2])
    assert torch.equal(k_grown[:, :6], k_base) and torch.equal(k_grown[:, 6:], _tokens(5, 2)[0])
    assert pages.extend(grown, 0).pages == grown.pages  # nothing new: the same pages


def test_a_second_growth_of_one_run_copies_the_shared_half_page_and_leaves_the_first_intact() -> None:
    pages = _pages()
    base = pages.allocate(6)
    _filled(pages, base, 0, 1)
    first = pages.extend(base, 1)
    _filled(pages, first, 6, 2)
    second = pages.extend(base, 1)  # another continuation: base's last page is taken past row 6
    _filled(pages, second, 6, 3)
    assert second.pages[0] == base.pages[0] and second.pages[1] != base.pages[1]
    assert pages.rows_copied == 2  # the half page's two filled rows
    assert torch.equal(pages.gather(first)[0][:, 6], _tokens(1, 2)[0][:, 0])  # untouched
    assert torch.equal(pages.gather(second)[0][:, 6], _tokens(1, 3)[0][:, 0])
    assert torch.equal(pages.gather(second)[0][:, :6], pages.gather(base)[0])


def test_pages_come_back_when_no_run_refers_to_them() -> None:
    pages = _pages()
    base = pages.allocate(6)
    grown = pages.extend(base, 3)
    assert pages.used_pages == 3
    base.release()
    assert pages.used_pages == 3 and base.released  # the grown run still reads them
    del grown
    gc.collect()
    assert pages.used_pages == 0 and pages.free_pages == 5
    again = pages.allocate(2)
    assert again.pages[0] in (1, 2, 3)  # a page given back (the last one first: still in cache)
    assert pages.extend(again, 2).pages == again.pages  # its claims start afresh


def test_too_few_pages_ask_the_reclaim_then_refuse() -> None:
    held: list[PagedKV] = []
    asked: list[int] = []

    def reclaim(n: int) -> None:
        asked.append(n)
        if held:
            held.pop(0).release()

    pages = _pages(num_pages=4, reclaim=reclaim)  # 3 pages
    held.append(pages.allocate(8))
    kept = pages.allocate(4)  # nothing the reclaim can give back
    assert pages.free_pages == 0
    run = pages.allocate(4)  # the reclaim freed the first run's two pages
    assert asked == [1] and run.length == 4 and pages.free_pages == 1
    assert kept.length == 4
    with pytest.raises(PagesExhausted, match="2 free pages wanted"):
        pages.allocate(8)
    assert pages.counters()["exhausted"] == 1


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="zero page"):
        KVPages(LAYOUT, 0, "cpu")
    a, b = _pages(), _pages()
    with pytest.raises(ValueError, match="other pages"):
        b.extend(a.allocate(2), 1)
    with pytest.raises(ValueError, match="-1 tokens"):
        a.allocate(-1)


def test_a_paged_prefix_is_its_pages_and_dense_gathers_them() -> None:
    pages = _pages()
    run = pages.allocate(5)
    keys, values, ts = _tokens(5, 4)
    pages.write(run, 0, keys, values, ts)
    prefix = PrefixKV.paged(run, b"f" * 16, "v1", {"worker_id": "w"})
    assert prefix.is_paged and prefix.length == 5 and prefix.num_layers == 2
    assert prefix.keys == [] and prefix.nbytes() == 2 * LAYOUT.page_bytes
    assert prefix.dtype == torch.float32 and prefix.device.type == "cpu"
    dense = prefix.dense()
    assert not dense.is_paged and dense.meta == {"worker_id": "w"} and dense.fingerprint == b"f" * 16
    assert torch.equal(dense.keys[1], keys[1].transpose(0, 1)) and dense.keys[1].shape == (2, 5, 3)
    assert torch.equal(dense.values[0], values[0].transpose(0, 1))
    assert torch.equal(dense.positions, torch.arange(5)) and torch.equal(dense.timestamps, ts)
    assert dense.nbytes() == 5 * (2 * 2 * 8 * 4 + 16)
    assert dense.dense() is dense and not prefix.to("cpu").is_paged


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc")
def test_cpu_pages_cost_memory_as_they_are_written() -> None:
    """A pool far larger than what is written takes memory only as it fills: its zeros come from
    ``calloc``, whose pages the kernel maps in when first written (a torch fill would touch all)."""
    before = _resident_bytes()
    big = KVPages(KVLayout(4, 4, 64, 64, torch.float32, 32), 4096, "cpu")  # 1 GiB of keys and values
    assert big.nbytes() > 1 << 30
    assert _resident_bytes() - before < big.nbytes() // 8
    run = big.allocate(3)
    big.write(run, 0, torch.ones(4, 3, 4, 64), torch.ones(4, 3, 4, 64), torch.ones(3, dtype=torch.float64))
    assert np.count_nonzero(big.gather(run)[0].numpy()) == 4 * 3 * 4 * 64
