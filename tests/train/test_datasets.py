"""Training datasets: shards checked against the run's target, streamed vocab counts, long
records fit alike offline and online, the validation split and nested subsets."""

from __future__ import annotations

import pytest
import torch

from train.datasets import check_shard_meta, token_counts, whole_row_length


def test_shards_of_another_capture_are_one_problem_per_dir_and_key():
    meta = {"target": "t", "vocab_size": 10, "target_hidden_size": 4, "aux_layer_ids": [1, 2, 3]}
    other = {**meta, "vocab_size": 11, "aux_layer_ids": [0, 2, 3]}
    run = {"target": "t", "vocab_size": 10, "hidden_size": 4, "aux_layer_ids": None}
    assert check_shard_meta([meta, meta], ["a", "b"], **run) == []  # aux: the first dir's
    assert check_shard_meta([meta, other], ["a", "b"], **run) == [
        "shards b were captured with vocab_size=11 but this run needs 10 (target t); "
        "re-capture them or fix the config",
        "shards b were captured with aux_layer_ids=[0, 2, 3] but this run needs [1, 2, 3] "
        "(target t); re-capture them or fix the config",
    ]
    assert len(check_shard_meta([meta], ["a"], **{**run, "aux_layer_ids": [0, 2, 3]})) == 1


def test_shards_captured_shorter_than_the_run_trains_are_refused():
    """<1 s: shards whose meta max_length (capture's --max-length) is under data.max_length are
    one problem naming both lengths and the recapture; as long or longer, or unknown: none."""
    meta = {"target": "t", "vocab_size": 10, "target_hidden_size": 4, "aux_layer_ids": [1, 2, 3]}
    run = {"target": "t", "vocab_size": 10, "hidden_size": 4, "aux_layer_ids": None}
    short = {**meta, "max_length": 16384}
    (line,) = check_shard_meta([short], ["/s/kimi"], **run, max_length=65536)
    assert "--max-length 16384, shorter than data.max_length 65536" in line
    assert "--max-length 65536" in line and "data.max_length=16384" in line
    assert check_shard_meta([short], ["a"], **run, max_length=16384) == []
    assert check_shard_meta([short], ["a"], **run, max_length=8192) == []
    assert check_shard_meta([meta], ["a"], **run, max_length=65536) == []  # not recorded


def test_only_packed_or_sequence_parallel_rows_need_shards_as_long():
    """<0.01 s: the length the shards must have been captured at: the pack length (or
    max_length) when packing, max_length under sequence parallelism, none when each record
    trains alone (an off-policy capture cut at 512 beside on-policy shards at 1,024 trains)."""
    assert whole_row_length(65536, None, True, 2) == 65536
    assert whole_row_length(65536, 32768, True, 1) == 32768
    assert whole_row_length(65536, None, False, 2) == 65536
    assert whole_row_length(1024, None, False, 1) is None


def test_shard_token_counts_read_only_ids(shard_dir, records_file):
    """Streaming counts from the shards equal counts over the records themselves."""
    import json

    from eagle3.data.shards import ShardDataset

    records = [json.loads(x) for x in records_file.read_text().splitlines()]
    expected = torch.zeros(256, dtype=torch.long)
    for r in records:
        ids = torch.tensor(r["input_ids"])[torch.tensor(r["loss_mask"]).bool()]
        expected += torch.bincount(ids, minlength=256)
    assert token_counts(ShardDataset(shard_dir), 256).equal(expected)


@pytest.mark.parametrize("mode", ["window", "cut"])
def test_long_records_offline_and_online_alike(shard_dir, records_file, mode):
    """Records longer than data.max_length: windows (every loss token trained once, ids
    <id>#w<i>) or a cut to the first max_length tokens; shard windows are slices of the stored
    record (its hidden states over the whole conversation) with the tokens and loss masks
    TokenRecords' windows have online."""
    from train.datasets import TokenRecords, Windows, concat, load_shards, loss_tokens

    max_length = 30
    full, full_lengths = concat(load_shards([str(shard_dir)])[0])
    offline = Windows(full, full_lengths, max_length, mode, context=12)
    records = TokenRecords([str(records_file)])
    online = Windows(records, records.lengths, max_length, mode, context=12)
    assert max(full_lengths) > max_length and max(offline.lengths) == max_length
    by_id = {r["id"]: r for r in (offline[i] for i in range(len(offline)))}
    assert len(by_id) == len(offline) == len(online)
    whole = {full[i]["id"]: full[i] for i in range(len(full))}
    trained = dict.fromkeys(whole, 0)
    for j, (i, w, n) in enumerate(online.windows):
        item, rid = online[j], records.ids[i]
        got = by_id[rid if n == 0 else f"{rid}#w{n}"]
        assert torch.equal(got["input_ids"], item["input_ids"])
        assert torch.equal(got["loss_mask"], item["loss_mask"])
        for key in ("aux_hidden", "last_hidden"):  # the stored states, sliced
            assert torch.equal(got[key], whole[rid][key][w.start : w.end]), key
        trained[rid] += int(got["loss_mask"].sum())
    total = dict(zip(whole, loss_tokens(full)))
    if mode == "window":
        assert trained == total  # every loss token of every record, once
        assert sum(online.dropped_if_cut) > 0 and len(online) > len(records)
    else:
        assert len(online) == len(records) and all(v <= total[k] for k, v in trained.items())
        assert sum(total.values()) - sum(trained.values()) == sum(online.dropped_if_cut)


def test_validation_split_by_conversation_is_stable_and_shared_across_dirs(shard_dir):
    """Held-out records are chosen by id alone: two dirs holding the same conversations split
    them identically, adding records never moves one, and train + val is every record once."""
    from train.datasets import load_shards, split_validation

    parts, _ = load_shards([str(shard_dir), str(shard_dir)])
    ids = parts[0].ids
    train, val = split_validation(parts, 0.3, seed=1)
    held = [set(p.ids) for p in val]
    assert len(held) == 2 and held[0] == held[1] and 0 < len(held[0]) < len(ids)
    assert sorted(train[0].ids + val[0].ids) == sorted(ids)
    assert not set(train[0].ids) & held[0]
    one = parts[0].subset(list(range(len(ids) // 2)))  # fewer records: the same ones held out
    _, val_small = split_validation([one], 0.3, seed=1)
    assert set(val_small[0].ids if val_small else []) == held[0] & set(one.ids)
    _, other = split_validation(parts[:1], 0.3, seed=2)
    assert set(other[0].ids) != held[0]  # the seed matters (7+ records: a clash is unlikely)
    item = val[0][0]  # a subset reads the same tensors as the whole capture
    whole = parts[0][ids.index(item["id"])]
    assert torch.equal(item["aux_hidden"], whole["aux_hidden"])


def test_take_sequences_is_nested_and_spans_dirs(shard_dir):
    """data.max_sequences: n sequences over all dirs, and a larger n keeps the smaller set."""
    from train.datasets import load_shards, take_sequences

    parts, _ = load_shards([str(shard_dir), str(shard_dir)])
    small = take_sequences(parts, 5, seed=0)
    large = take_sequences(parts, 20, seed=0)
    assert sum(len(p) for p in small) == 5 and sum(len(p) for p in large) == 20
    pairs = lambda ps: {(str(p.dir), rid) for p in ps for rid in p.ids}  # noqa: E731
    assert pairs(small) <= pairs(large)
    assert sum(len(p) for p in take_sequences(parts, 10_000, seed=0)) == 2 * len(parts[0])
