"""Training on any interaction log, without a broker: a small generated log with string item ids,
in CSV and in Parquet, trains, evaluates and round-trips its vocabulary through the checkpoint;
unknown ids fall on the out-of-vocabulary token and are counted; a malformed file is refused with
its row named; retrieval answers with catalogue ids only; old checkpoints keep the identity."""

from __future__ import annotations

import argparse
import json
import random

import numpy as np
import pytest
import torch
from synthetic import write_csv, write_parquet

from relaygr.streams.retrieval import CandidateGenerator
from relaygr.workers.model.model import HSTUConfig, HSTURanker
from relaygr.workers.model.vocab import OOV, VOCAB_FILE, ItemVocab, item_key, item_keys
from relaygr.workers.training import train
from relaygr.workers.training.interactions import Columns, MalformedLog, build_log, read_interactions
from relaygr.workers.training.quality import RANKS_FILE, load_ranks, summarise

TINY = ["--layers", "1", "--heads", "1", "--dim", "16", "--epochs", "1", "--max-steps", "2", "--threads", "1"]


def tiny_log_rows(users: int = 12, events: int = 10, seed: int = 3) -> list[dict]:
    """A catalogue of 25 string ids, each user walking through a stretch of it."""
    rng = random.Random(seed)
    rows = []
    for u in range(users):
        for j in range(events):
            rows.append(
                {
                    "uid": f"user-{u}",
                    "sku": f"sku-{(3 * u + j) % 25:03d}",
                    "when": 1_600_000_000 + 1000 * u + 10 * j,
                    "kind": rng.randint(1, 3),
                }
            )
    return rows


def train_args(parser_args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    return parser.parse_args(parser_args)


COLS = ["--user-col", "uid", "--item-col", "sku", "--time-col", "when", "--action-col", "kind"]


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_a_string_id_log_trains_evaluates_and_keeps_its_vocabulary(fmt, tmp_path, one_torch_thread) -> None:
    rows = tiny_log_rows()
    path = (write_csv if fmt == "csv" else write_parquet)(tmp_path / f"log.{fmt}", rows)
    out = tmp_path / "ck"
    assert train.run(train_args(["--interactions", str(path), "--out", str(out), *COLS, *TINY])) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["items"] == 25 and metrics["users"] == 12 and metrics["bad_rows"] == 0
    lengths = [r["history"] for r in metrics["by_history_length"]]
    assert lengths == ["16", "64", "256", "all"]
    for row in [*metrics["by_history_length"], metrics["popularity_baseline"]]:
        lo, hi = row["HR@10_ci95"]
        assert 0.0 <= lo <= row["HR@10"] <= hi <= 1.0
    users, ranks = load_ranks(out / RANKS_FILE)  # kept for `relaygr quality`: the table's own ranks
    assert len(users) == 12 and list(ranks) == lengths
    for row, (k, again) in zip(metrics["by_history_length"], summarise(ranks).items(), strict=True):
        assert row["history"] == k and row["HR@10"] == again["HR@10"] and row["MRR"] == again["MRR"]
    model = HSTURanker.load(out)
    assert model.config.num_items == 25
    assert model.vocab.raw_ids() == sorted({r["sku"] for r in rows})
    ids, unknown = model.vocab.to_model(["sku-000", "sku-024", "not-a-sku", 7])
    assert ids.tolist() == [1, 25, OOV, OOV] and unknown == 2


def test_file_formats_give_the_same_log(tmp_path) -> None:
    rows = tiny_log_rows()
    cols = Columns(user="uid", item="sku", timestamp="when", action="kind")
    a = read_interactions(write_csv(tmp_path / "a.csv", rows), cols)
    b = read_interactions(write_parquet(tmp_path / "b.parquet", rows), cols)
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = read_interactions(jsonl, cols)
    logs = [build_log(x.rows) for x in (a, b, c)]
    for log in logs[1:]:
        assert log.vocab == logs[0].vocab
        assert log.histories.keys() == logs[0].histories.keys()
        for u, h in log.histories.items():
            assert torch.equal(h.item_ids, logs[0].histories[u].item_ids)
            assert torch.equal(h.timestamps, logs[0].histories[u].timestamps)


def test_bad_rows_are_counted_with_examples_or_refused_by_row(tmp_path) -> None:
    rows = tiny_log_rows(users=3, events=4)
    path = write_csv(tmp_path / "bad.csv", rows)
    with path.open("a") as f:
        f.write("user-1,sku-001,last tuesday,2\n")  # data row 13
        f.write(",sku-002,1600000000,1\n")  # data row 14: no user
        f.write("user-2,,1600000000,1\n")  # data row 15: no item
        f.write("user-2,sku-001,1600000000,1,extra\n")  # data row 16: one field too many
    cols = Columns(user="uid", item="sku", timestamp="when", action="kind")
    read = read_interactions(path, cols)
    assert read.total == 16 and len(read.rows) == 12 and read.bad_count == 4
    assert [b.row for b in read.bad] == [13, 14, 15, 16]
    assert "5 fields" in read.bad[3].reason
    assert "last tuesday" in read.bad[0].reason and "uid" in read.bad[1].reason
    with pytest.raises(MalformedLog, match="row 13: timestamp 'last tuesday'"):
        read_interactions(path, cols, strict=True)
    with pytest.raises(MalformedLog, match="no item column 'item_id'"):
        read_interactions(path, Columns(user="uid", timestamp="when", action=None))


def test_vocabularies_map_both_ways_and_count_the_unknown() -> None:
    ints = ItemVocab.build([905, 17, 3_000_000, 17])
    assert ints.is_int and ints.raw_ids() == [17, 905, 3_000_000]
    ids, unknown = ints.to_model(torch.tensor([3_000_000, 1, 17, 0]))
    assert ids.tolist() == [3, OOV, 1, OOV] and unknown == 2
    assert ints.to_raw([1, 3]) == [17, 3_000_000]
    numeric_strings = ItemVocab.build(["12", "7"])  # ids that all read as integers are integers
    assert numeric_strings.is_int and numeric_strings.to_model([7, "7", "07"])[0].tolist() == [1, 1, OOV]
    padded = ItemVocab.build(["007", "12"])  # "007" is no integer's plain form: kept as written
    assert not padded.is_int and padded.raw_ids() == ["007", "12"]
    assert padded.to_model(["007", 7, 12, "12"])[0].tolist() == [1, OOV, 2, 2]
    ident = ItemVocab.identity_of(10)
    mapped, unknown = ident.to_model_tensor(torch.tensor([1, 10, 11, 0]))
    assert mapped.tolist() == [1, 10, 0, 0] and unknown == 2
    assert mapped.dtype == torch.int64 and unknown == ident.to_model_tensor(torch.tensor([-3, 5]))[1] + 1


def test_item_keys_stand_for_raw_ids_in_integer_columns() -> None:
    keys = item_keys([17, "17", "017", "sku-1", "sku-2", 0])
    assert keys.dtype == np.int64 and keys[0] == keys[1] == 17 and keys[5] == 0
    assert (keys[2:5] < 0).all() and len(set(keys[2:5].tolist())) == 3  # strings: negative, distinct
    assert item_key("sku-1") == keys[3]  # the same hash in every process (no PYTHONHASHSEED)
    vocab = ItemVocab.build(["sku-2", "sku-1", "17"])
    raw = ["sku-1", "nope", 17, "sku-2", "017"]
    by_raw, unknown = vocab.to_model(raw)
    by_key, unknown_keys = vocab.to_model_tensor(torch.from_numpy(item_keys(raw)))
    assert by_key.tolist() == by_raw.tolist() == [2, OOV, 1, 3, OOV] and unknown == unknown_keys == 2
    assert vocab.to_raw([1, 2, 3]) == ["17", "sku-1", "sku-2"]


def test_a_checkpoint_without_vocabulary_loads_as_the_identity(tmp_path) -> None:
    model = HSTURanker(HSTUConfig(num_items=30, layers=1, heads=1, dim=8, attn_dim=8, linear_dim=8))
    model.save(tmp_path)
    assert not (tmp_path / VOCAB_FILE).exists()
    loaded = HSTURanker.load(tmp_path)
    assert loaded.vocab.identity and loaded.model_version == model.model_version
    ids, unknown = loaded.vocab.to_model([1, 30, 31])
    assert ids.tolist() == [1, 30, OOV] and unknown == 1


def test_retrieval_answers_with_catalogue_ids_only() -> None:
    vocab = ItemVocab.build([1000 + 7 * i for i in range(20)])
    emb = np.random.default_rng(0).normal(size=(21, 8)).astype(np.float32)
    gen = CandidateGenerator(emb, vocab)
    catalogue = set(vocab.raw_ids())
    gen.observe_many([1000, 1000, 5, 1007])  # 5 is no catalogue item: not counted as popular
    cold = gen.candidates([], 8)
    assert cold[:2] == [1000, 1007] and set(cold) <= catalogue and len(cold) == 8
    warm = gen.candidates([1014, 999_999], 10)
    assert set(warm) <= catalogue and len(warm) == 10
    assert set(gen.candidates([999_999], 5)) <= catalogue  # only unknown ids: the cold answer


def test_a_log_becomes_a_trace_named_by_its_own_ids_integers_or_strings(tmp_path) -> None:
    from relaygr.tools.trace import build_trace, log_as_dataset

    rows = [{**r, "sku": 70_000 + int(r["sku"][4:])} for r in tiny_log_rows(users=4, events=5)]
    cols = Columns(user="uid", item="sku", timestamp="when", action="kind")
    log = build_log(read_interactions(write_csv(tmp_path / "ints.csv", rows), cols).rows)
    trace = build_trace(log_as_dataset(log, "shop"), min_prior=1)
    assert len(trace.requests) == 4 * 4 and trace.meta["users"] == 4
    catalogue = {r["sku"] for r in rows}
    assert {r.label_item_id for r in trace.requests} <= catalogue
    assert {b.item_id for b in trace.behaviours} <= catalogue
    string_rows = tiny_log_rows(3, 3)
    strings = build_log(read_interactions(write_csv(tmp_path / "s.csv", string_rows), cols).rows)
    trace = build_trace(log_as_dataset(strings, "s"), min_prior=1)
    assert len(trace.requests) == 3 * 2
    skus = {r["sku"] for r in string_rows}
    assert {r.label_item_id for r in trace.requests} <= skus
    assert {b.item_id for b in trace.behaviours} <= skus
    first = min(trace.behaviours, key=lambda b: (b.user_id, b.ts))  # user-0's first interaction
    assert first.user_id == "user-0" and first.item_id == "sku-000"
