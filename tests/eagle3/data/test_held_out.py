"""Held-out conversations (eagle3.data.held_out): the evaluation's prompts come from exactly
the conversations training validates on, chosen by a rule of ids alone."""

from __future__ import annotations

import random

from eagle3.data.chat import next_turns
from eagle3.data.held_out import conversation_prompt, in_validation, pick_held_out
from eagle3.data.prompts import user_turns
from train.datasets import split_validation


def record(rid: str, dataset: str, turns: int = 1) -> dict:
    messages = [{"role": "system", "content": "be brief"}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"question {t} of {rid}"})
        messages.append({"role": "assistant", "content": f"answer {t}", "reasoning": f"think {t}"})
    return {"id": rid, "dataset": dataset, "messages": messages}


class Part:
    """What split_validation reads of a training dataset: record ids and subset()."""

    def __init__(self, ids: list[str]):
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def subset(self, keep: list[int]) -> Part:
        return Part([self.ids[i] for i in keep])


def test_selection_is_deterministic_nested_and_inside_trainings_validation_split():
    """~0.1 s. The picks depend on ids and seed only (any file order, duplicates counted
    once), a larger N keeps a smaller N's prompts, and every pick is a record training's own
    split_validation holds out: none is a record it trains on."""
    records = [
        record(f"{d}-{i}", d, turns=1 + i % 3) for d in ("alpha", "beta") for i in range(150)
    ]
    records.append(record("alpha-0", "alpha"))  # the same conversation again (another dir)
    picks = pick_held_out(records, 6, fraction=0.2, seed=3)
    shuffled = records[:]
    random.Random(0).shuffle(shuffled)
    again = pick_held_out(shuffled, 6, fraction=0.2, seed=3)
    assert {d: [p.id for p in k.prompts] for d, k in picks.items()} == {
        d: [p.id for p in k.prompts] for d, k in again.items()
    }
    assert sorted(picks) == ["alpha", "beta"] and picks["alpha"].records == 150
    fewer = pick_held_out(records, 3, fraction=0.2, seed=3)
    for d in picks:
        assert len(picks[d].prompts) == 6
        assert [p.id for p in fewer[d].prompts] == [p.id for p in picks[d].prompts][:3]
    train, val = split_validation([Part([str(r["id"]) for r in records])], 0.2, 3)
    trained = {i for p in train for i in p.ids}
    validated = {i for p in val for i in p.ids}
    chosen = {p.id for k in picks.values() for p in k.prompts}
    assert chosen <= validated and not chosen & trained
    assert all(in_validation(i, 0.2, 3) for i in chosen)
    assert picks["alpha"].held_out == sum(in_validation(f"alpha-{i}", 0.2, 3) for i in range(150))
    other_seed = {p.id for k in pick_held_out(records, 6, 0.2, seed=4).values() for p in k.prompts}
    assert other_seed != chosen  # the seed is training's data.val_seed: it moves the split


def test_a_conversation_is_asked_its_last_turn_with_earlier_answers_as_context():
    """~0.01 s. The prompt is every turn before the last answer (reasoning kept for the
    template); the decoder answers only the last user turn; too long or unanswerable records
    are passed over, counted, and the next held-out one taken."""
    rec = record("c1", "alpha", turns=2)
    prompt = conversation_prompt(rec)
    assert [m["role"] for m in prompt.messages] == ["system", "user", "assistant", "user"]
    assert prompt.messages[2] == {
        "role": "assistant",
        "content": "answer 0",
        "reasoning": "think 0",
    }
    assert user_turns(prompt) == 1
    asked = next_turns(prompt, [])
    assert asked == prompt.messages  # all context, ending in the open user turn
    assert next_turns(prompt, [*asked, {"role": "assistant", "content": "new"}]) is None
    assert next_turns(prompt, asked) == asked  # not answered yet: asked again
    assert conversation_prompt({"id": "x", "messages": [{"role": "user", "content": "q"}]}) is None
    assert conversation_prompt({"id": "x", "messages": [{"role": "tool"}, "text"]}) is None

    records = [record(f"r{i}", "alpha", turns=1 + i % 2) for i in range(40)]
    records += [{"id": f"bad{i}", "dataset": "alpha", "messages": []} for i in range(40)]
    picks = pick_held_out(
        records, 3, 0.5, 0, fits=lambda p: user_turns(p) == 1 and len(p.messages) < 4
    )
    pick = picks["alpha"]
    assert len(pick.prompts) == 3 and all(len(p.messages) == 2 for p in pick.prompts)
    assert pick.too_long + pick.unusable > 0  # passed over on the way, and counted


def test_evaluate_defaults_to_trainings_split_settings():
    """~0.5 s (imports). `eagle3.evaluate --val-fraction / --val-seed` default to training's
    data.val_fraction / data.val_seed: a run left at its defaults is measured on its own
    validation conversations."""
    from eagle3.evaluation.run import build_parser
    from train.config import DataConfig

    args = build_parser().parse_args(["--target", "t", "--draft", "none"])
    assert (args.val_fraction, args.val_seed) == (DataConfig().val_fraction, DataConfig().val_seed)
