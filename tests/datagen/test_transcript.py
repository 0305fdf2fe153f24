"""The chat types OpenRouter and local generation share (datagen.transcript): a reply read out
of a response body, and a prompt answered turn by turn with the model's own answers."""

from __future__ import annotations

from datagen.transcript import Reply, Transcript, parse_reply
from eagle3.data.prompts import Prompt


def body(content: str, finish: str = "stop", **message) -> dict:
    return {
        "choices": [{"message": {"content": content, **message}, "finish_reason": finish}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 7, "cost": 0.5},
        "provider": "Chutes",
        "model": "moonshotai/kimi-k2.5",
    }


def test_parse_reply_keeps_reasoning_apart_under_either_name():
    openrouter = parse_reply(body("4", reasoning="2+2"))
    vllm = parse_reply(body("4", reasoning_content="2+2"))
    for reply in (openrouter, vllm):
        assert reply.message == {"role": "assistant", "content": "4", "reasoning": "2+2"}
    assert (openrouter.provider, openrouter.model) == ("Chutes", "moonshotai/kimi-k2.5")
    assert openrouter.usage["completion_tokens"] == 7 and openrouter.finish_reason == "stop"


def test_parse_reply_splits_reasoning_written_before_the_closing_tag():
    """A server without a reasoning parser returns Kimi's turn as `reasoning</think>answer`:
    the record and the next request get the same message as with a parser. Cheap (~1 ms)."""
    raw = parse_reply(body("Add.</think>It is 4."))
    parsed = parse_reply(body("It is 4.", reasoning_content="Add."))
    assert (
        raw.message
        == parsed.message
        == {
            "role": "assistant",
            "content": "It is 4.",
            "reasoning": "Add.",
        }
    )


def test_transcript_asks_each_user_turn_with_its_own_earlier_answers():
    turns = [{"role": "user", "content": "one?"}, {"role": "user", "content": "two?"}]
    prompt = Prompt("p0", "chat", turns)  # the user turns (load_prompts drops source answers)
    t = Transcript(prompt)
    assert t.advance() and [m["content"] for m in t.messages] == ["one?"]
    t.add(parse_reply(body("first")))
    assert not t.complete() and t.advance()
    assert [m["content"] for m in t.messages] == ["one?", "first", "two?"]
    t.add(Reply({"role": "assistant", "content": "second", "reasoning": ""}, {}, "length", "B"))
    assert t.complete() and not t.advance()
    assert t.providers() == ["Chutes", "B"]
    record = t.record("moonshotai/kimi-k2.5", "Chutes, B")
    assert record["finish_reason"] == "length"  # one turn was cut: the record says so
    assert [m["content"] for m in record["messages"]] == ["one?", "first", "two?", "second"]
    assert record["usage"]["completion_tokens"] == 7 and record["usage"]["cost"] == 0.5
