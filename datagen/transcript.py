"""A prompt answered turn by turn over a chat-completion API: the chat types that
``datagen.openrouter`` (OpenRouter) and ``datagen.local`` (own servers, or transformers) share.

:class:`Reply` is one assistant turn as a server returned it, :func:`parse_reply` reads it out of
a response body, and :class:`Transcript` holds a prompt being answered: every user turn is asked
with the conversation so far, the model's own earlier answers included, and the finished
conversation becomes one ``eagle3.data.records`` record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eagle3.data.chat import next_turns, split_thinking
from eagle3.data.prompts import Prompt
from eagle3.data.records import make_record, sum_usage


@dataclass
class Reply:
    """One assistant turn as a chat-completion server returned it."""

    message: dict  # {"role": "assistant", "content", "reasoning"}
    usage: dict  # the request's usage, as the server reported it
    finish_reason: str | None
    provider: str | None = None  # who served it: OpenRouter's provider, or a local server
    model: str | None = None


def parse_reply(body: dict) -> Reply:
    """The reply in a response body that :func:`datagen.retry.check` found OK. Reasoning comes
    as ``reasoning`` (OpenRouter), ``reasoning_content`` (SGLang/vLLM with a reasoning parser) or
    before ``</think>`` in the content (no parser: the opener was the generation prompt's); it
    is kept apart (:func:`eagle3.data.chat.split_thinking`), so the record and the next turn's
    request carry the bare answer, which is all Kimi's template shows of an earlier turn."""
    choice = body["choices"][0]
    reasoning, content = split_thinking(choice.get("message") or {})
    message = {"role": "assistant", "content": content, "reasoning": reasoning}
    usage = body.get("usage") or {}
    return Reply(
        message, usage, choice.get("finish_reason"), body.get("provider"), body.get("model")
    )


@dataclass
class Transcript:
    """A prompt being answered turn by turn: every user turn is asked with the conversation so
    far, the model's own earlier answers included."""

    prompt: Prompt
    messages: list[dict] = field(default_factory=list)
    replies: list[Reply] = field(default_factory=list)

    def advance(self) -> bool:
        """Append the prompt's turns up to the next unanswered user turn; False when all are
        answered."""
        turns = next_turns(self.prompt, self.messages)
        if turns is None:
            return False
        self.messages.extend(turns)
        return True

    def add(self, reply: Reply) -> None:
        self.messages.append(reply.message)
        self.replies.append(reply)

    def complete(self) -> bool:
        return bool(self.replies) and next_turns(self.prompt, self.messages) is None

    def providers(self) -> list[str]:
        """Who served the turns, each once, in order."""
        return list(dict.fromkeys(r.provider for r in self.replies if r.provider))

    def record(self, model: str, provider: str | None) -> dict:
        """The finished prompt's record: "length" when any turn was cut, usage summed."""
        finishes = [r.finish_reason for r in self.replies]
        finish = "length" if "length" in finishes else finishes[-1]
        usage = sum_usage(r.usage for r in self.replies)
        return make_record(self.prompt, self.messages, model, provider, finish, usage)
