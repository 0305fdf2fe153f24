"""train/label_cache.py: soft labels kept across epochs, and a run with them equals one without."""

from __future__ import annotations

import pytest
import torch

from train.config import load_config
from train.label_cache import LabelCache, make_label_cache


def batch(seed: int, B: int = 2, T: int = 6, Vd: int = 5):
    g = torch.Generator().manual_seed(seed)
    rows = torch.rand(B, T, generator=g) > 0.4
    probs = torch.rand(B, T, Vd, generator=g) * rows[..., None]
    return probs, (torch.rand(B, T, generator=g) > 0.5) & rows, rows


def test_records_come_back_in_any_batch_and_padding():
    cache = LabelCache(max_bytes=10**6)
    probs, in_vocab, rows = batch(0)
    assert cache.get(["a", "b"], 6) is None
    cache.put(["a", "b"], probs, in_vocab, rows)
    assert len(cache) == 2
    got_p, got_v = cache.get(["b", "a"], 9)  # another batch: other order, longer padding
    assert got_p.shape == (2, 9, 5)
    assert torch.equal(got_p[0, :6], probs[1]) and torch.equal(got_p[1, :6], probs[0])
    assert torch.equal(got_v[0, :6], in_vocab[1]) and not got_p[:, 6:].any()
    assert cache.get(["a", "c"], 6) is None  # one record missing: the batch is computed


def test_the_budget_is_never_exceeded():
    probs, in_vocab, rows = batch(1)
    one = int(rows[0].sum()) * (5 * 4 + 9)
    cache = LabelCache(max_bytes=one)
    cache.put(["a", "b"], probs, in_vocab, rows)
    assert len(cache) == 1 and cache.full and cache.used <= one


def test_only_offline_runs_past_one_epoch_keep_labels():
    def cfg(*overrides):
        base = ["data.shard_dirs=[shards]", "data.batch_size=4"]
        return load_config(None, [*base, *overrides], check_paths=False)

    lengths = [10] * 16  # 4 steps per epoch on one process, 2 on two
    assert make_label_cache(cfg(), lengths, 1, 4) is None  # one epoch: every record read once
    assert make_label_cache(cfg(), lengths, 1, 5).max_bytes == 2**30  # data.label_cache_gb 1
    assert make_label_cache(cfg(), lengths, 2, 3) is not None
    assert make_label_cache(cfg("data.label_cache_gb=0"), lengths, 1, 8) is None
    online = cfg("data.mode=online", "data.records=[r.jsonl]", "data.shard_dirs=[]")
    assert make_label_cache(online, lengths, 1, 8) is None  # the target runs anyway


def test_a_run_with_cached_labels_equals_one_without(tiny_llama_dir, shard_dir, tmp_path, helpers):
    """Several epochs over the shards: the same losses and validation bit for bit."""
    runs = {}
    for gb in (1, 0):
        out = tmp_path / f"cache-{gb}"
        args = helpers.common_args(tiny_llama_dir, out, **helpers.offline(shard_dir), **{
            "data.label_cache_gb": gb, "train.max_steps": 15, "train.eval_every": 5,
            "data.val_fraction": 0.2, "model.ttt_steps": 3,
        })  # fmt: skip
        runs[gb] = helpers.run_cli(args).stdout
        assert ("soft labels kept for later epochs" in runs[gb]) == bool(gb)
    on, off = tmp_path / "cache-1", tmp_path / "cache-0"
    assert helpers.metric_lines(on)[-1]["epoch"] >= 2  # the cache was read
    for split in (None, "val"):
        want, got = helpers.metric_lines(off, split), helpers.metric_lines(on, split)
        assert len(got) == len(want) > 0
        for a, b in zip(want, got):
            a.pop("tokens_per_s", None), b.pop("tokens_per_s", None)
            a.pop("peak_mem_gb", None), b.pop("peak_mem_gb", None)
            assert a == b


@pytest.mark.parametrize("value", ["-1"])
def test_a_negative_budget_is_one_line(value, tiny_llama_dir, shard_dir, tmp_path, helpers):
    args = helpers.common_args(
        tiny_llama_dir,
        tmp_path / "x",
        **helpers.offline(shard_dir),
        **{"data.label_cache_gb": value},
    )
    out = helpers.run_cli(args, check=False)
    assert out.returncode != 0
    assert "data.label_cache_gb must be >= 0, got -1" in out.stderr
