"""Sequence packing (train/packing.py): records laid end to end in one row train exactly as
the same records padded one per row. `pytest -k packing` selects these (~30 s: two trainer
runs of 3 steps on the tiny target's shards; the rest is in-process and fast)."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3.loss import step_labels, ttt_loss, valid_counts
from eagle3.model import Eagle3Draft
from train.batching import collate
from train.packing import PackedDataset, pack_records


class Records(torch.utils.data.Dataset):
    """Random records with aux/last hidden states, the first third of each "prompt"."""

    def __init__(self, lengths: list[int], hidden: int, vocab: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for n in lengths:
            mask = torch.ones(n, dtype=torch.long)
            mask[: n // 3] = 0
            self.items.append(
                {
                    "input_ids": torch.randint(1, vocab, (n,), generator=g),
                    "loss_mask": mask,
                    "aux_hidden": torch.randn(n, 3 * hidden, generator=g),
                    "last_hidden": torch.randn(n, hidden, generator=g),
                }
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def test_packing_bins_hold_every_record_once_within_capacity():
    lengths = [50, 7, 33, 20, 64, 1, 12, 40, 9, 30]
    bins = pack_records(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert bins == pack_records(lengths, 64)  # deterministic: every rank packs alike
    assert len(bins) == -(-sum(lengths) // 64)  # first-fit decreasing is tight here
    assert pack_records([100, 3], 64) == [[0], [1]]  # too long for a bin: a row of its own


def test_packing_rows_carry_segments_and_restarting_positions():
    data = Records([5, 3, 4], hidden=4, vocab=50)
    packed = PackedDataset(data, [5, 3, 4], capacity=12)
    assert len(packed) == 1 and packed.lengths == [12]
    row = packed[0]
    assert row["segment_ids"].tolist() == [0] * 5 + [1] * 4 + [2] * 3  # longest first
    assert row["position_ids"].tolist() == [*range(5), *range(4), *range(3)]
    assert torch.equal(row["input_ids"][5:9], data[2]["input_ids"])
    batch = collate([row, PackedDataset(data, [5, 3, 4], capacity=5)[2]])
    assert batch["segment_ids"][1].tolist() == [0] * 3 + [-1] * 9  # padding is no record's
    assert batch["attention_mask"][1].sum() == 3


@pytest.mark.parametrize("impl", ["chunked", "flash", "split", "sdpa"])
def test_packing_gives_the_padded_per_token_losses_and_gradients(impl, tiny_config):
    """One packed row vs its records padded one per row: every step's valid positions, their
    soft-label cross-entropies (matched token for token) and the parameter gradients agree."""
    torch.manual_seed(0)
    cfg = tiny_config()
    lengths = [17, 9, 23, 5]
    data = Records(lengths, hidden=cfg.target_hidden_size, vocab=cfg.vocab_size)
    model = Eagle3Draft(cfg)
    model.midlayer.self_attn.ttt_impl = impl
    K = 4
    probs = [torch.randn(n, cfg.draft_vocab_size).softmax(-1) for n in lengths]
    in_vocab = [torch.rand(n) > 0.2 for n in lengths]

    def run(batch: dict, p: torch.Tensor, v: torch.Tensor, packed: bool):
        model.zero_grad()
        seg = batch["segment_ids"] if packed else None
        pos = batch["position_ids"] if packed else None
        logits = model.ttt_forward(batch["input_ids"], batch["aux_hidden"], K, seg, pos)
        loss, metrics = ttt_loss(logits, p, v, batch["loss_mask"], 0.8, None, seg)
        counts = valid_counts(v, batch["loss_mask"], K, seg)
        # per-token CE of every valid position, keyed by (record, position in record, step)
        per_token = {}
        for k, lg in enumerate(logits):
            rows, valid = step_labels(v, batch["loss_mask"], k, seg)
            ce = -(p[:, rows] * lg[:, : valid.shape[1]].detach().log_softmax(-1)).sum(-1)
            for b, t in valid.nonzero().tolist():
                rec = int(seg[b, t]) if packed else b
                at = int(pos[b, t]) if packed else t
                per_token[rec, at, k] = float(ce[b, t])
        (loss * counts.sum()).backward()  # a sum over tokens, not a mean: comparable
        grads = {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
        return per_token, counts, metrics, grads

    padded = collate([data[i] for i in range(len(lengths))])
    T = padded["input_ids"].shape[1]
    p_pad = torch.stack([torch.cat([p, p.new_zeros(T - len(p), p.shape[1])]) for p in probs])
    v_pad = torch.stack([torch.cat([v, v.new_zeros(T - len(v))]) for v in in_vocab])
    want, want_counts, want_m, want_g = run(padded, p_pad, v_pad, packed=False)

    rows = PackedDataset(data, lengths, capacity=sum(lengths))
    (bin_,) = rows.bins
    row = collate([rows[0]])
    got, got_counts, got_m, got_g = run(
        row, torch.cat([probs[i] for i in bin_])[None], torch.cat([in_vocab[i] for i in bin_])[None],
        packed=True,
    )  # fmt: skip
    got = {(bin_[rec], t, k): ce for (rec, t, k), ce in got.items()}  # segment -> record index
    assert torch.equal(got_counts, want_counts) and set(got) == set(want)
    assert len(want) > 20
    for key, ce in want.items():
        assert got[key] == pytest.approx(ce, rel=1e-5, abs=1e-6), key
    for k in range(K):
        assert got_m[f"masked_{k}"] == want_m[f"masked_{k}"]
        assert got_m[f"correct_{k}"] == want_m[f"correct_{k}"]
    for name, g in want_g.items():
        assert torch.allclose(got_g[name], g, rtol=1e-4, atol=1e-6), name


def test_packing_without_the_segment_gate_would_train_across_records(tiny_config):
    """The gate is needed: without segment_ids a packed row counts predictions of the next
    record's tokens (and its attention would see the previous record)."""
    cfg = tiny_config()
    data = Records([9, 9], hidden=cfg.target_hidden_size, vocab=cfg.vocab_size)
    row = collate([PackedDataset(data, [9, 9], capacity=18)[0]])
    v = torch.ones(1, 18, dtype=torch.bool)
    gated = valid_counts(v, row["loss_mask"], 4, row["segment_ids"])
    ungated = valid_counts(v, row["loss_mask"], 4)
    assert (ungated > gated).any()


@pytest.mark.slow
def test_packing_trainer_steps_equal_padded_steps(helpers, tiny_llama_dir, shard_dir, tmp_path):
    """The recipe with data.packing on the tiny target's 24 captured records: each optimizer
    step holds every record (padded: 24 per micro-batch; packed: every row), so each step's
    loss, accuracies and grad norm equal the padded run's (3 steps: the updates agree too). The only
    test of packing through the trainer CLI (the rest of the file checks losses and rows
    in-process). Costs ~9 s (its call: two 3-step trainer runs; measured on 2 xdist workers)."""
    lengths = [json.loads(line)["length"] for line in (shard_dir / "index.jsonl").open()]
    rows = len(pack_records(lengths, 128))
    common = dict(**helpers.offline(shard_dir), **{"data.val_fraction": 0, "train.max_steps": 3})
    padded = helpers.common_args(
        tiny_llama_dir, tmp_path / "padded", **common, **{"data.batch_size": len(lengths)}
    )
    packed = helpers.common_args(
        tiny_llama_dir, tmp_path / "packed", **common,
        **{"data.batch_size": rows, "data.packing": "true", "data.pack_length": 128},
    )  # fmt: skip
    helpers.run_cli(padded)
    log = helpers.run_cli(packed).stdout
    assert f"packing: {len(lengths)} records into {rows} rows of <= 128 tokens, filled to" in log
    a, b = helpers.metric_lines(tmp_path / "padded"), helpers.metric_lines(tmp_path / "packed")
    assert [r["step"] for r in b] == [1, 2, 3]
    for x, y in zip(a, b):
        for key in ("loss", "acc_0", "acc_3", "grad_norm"):
            assert y[key] == pytest.approx(x[key], rel=1e-4), (x["step"], key)
        assert y["padding_frac"] < x["padding_frac"]


def test_packing_online_is_refused_in_one_line(tmp_path):
    from eagle3.errors import ConfigError
    from train.config import load_config

    path = tmp_path / "r.yaml"
    path.write_text("target: {name: x}\ndata: {mode: online, records: [a], packing: true}\n")
    with pytest.raises(ConfigError, match="data.packing packs captured shards"):
        load_config(str(path), [], check_paths=False)
