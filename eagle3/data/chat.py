"""Render a conversation with the target's chat template into token ids and a loss mask.

The mask is 1 exactly on the tokens the target generated: every assistant turn's answer, its
reasoning where the template shows it, and the closing end-of-turn token; 0 on system/user turns
and on template glue (role headers, the generation prompt, the newline ChatML puts after
``<|im_end|>``). Nothing here knows a particular template: the spans are found by rendering the
conversation prefix by prefix and comparing.

- The sequence is what the target saw when it wrote the LAST assistant turn, followed by what it
  wrote: ``render(messages[:last], add_generation_prompt=True)`` + the last turn. Earlier
  assistant turns appear in it the way the template renders history (Kimi-K2.5 blanks their
  reasoning to ``<think></think>``; ChatML keeps the answer), which is exactly the context the
  target conditioned on, so what the target wrote of them is masked 1 as it appears there (the
  answer and its end-of-turn token; not the empty ``<think></think>``, the template's).
- Assistant turn ``i`` starts where both ``render(messages[:i], add_generation_prompt=True)``
  and the same history with turn ``i`` blank stop agreeing with the sequence (token ids): after
  the role header and after what the template writes into every turn, such as the empty
  ``<think></think>`` Kimi-K2.5 puts in place of earlier reasoning, which the target never wrote
  there. It ends at the first end-of-turn token after that.
- The last turn is ``render(messages[:last + 1])`` minus the generation prompt, cut after its
  end-of-turn token. A template that drops the final turn's reasoning (Kimi-K2.5 renders every
  assistant turn up to the last one as history) gets it back where the target wrote it: just
  before the think-closing tag, i.e. ``<think>`` (generation prompt) + reasoning + ``</think>``
  + answer + ``<|im_end|>``, the Kimi-K2.5 turn shape.
- A turn cut at max tokens (``close_last_turn=False``) ends at its last generated character:
  the end-of-turn token the template adds was never produced, so it is not trained on.
- Reasoning that the template has no place for at all (no think-closing tag, e.g. ChatML) is
  left out and flagged (``Rendered.reasoning_dropped``): the target never writes it.

A server returns a thinking turn in one of two shapes, and both render alike
(:func:`split_thinking`): the reasoning in its own field, ``reasoning`` (OpenRouter) or
``reasoning_content`` (SGLang/vLLM with a reasoning parser), and the bare answer in ``content``;
or, without a reasoning parser, ``content`` = ``reasoning</think>answer`` (the ``<think>`` came
with the generation prompt). Templates receive the reasoning as ``reasoning_content``. Think tags
out of place (an opener without its closer, two closers, a tag in the reasoning field) are
refused: such a turn has no one right rendering. Problems with one record raise
:class:`RenderError` whose ``reason`` is a short stable key for counters.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

from eagle3.data.prompts import Prompt, open_turns
from eagle3.errors import Eagle3Error

# A reasoning block's (opening, closing) tags: most reasoning templates, Kimi-K2.5's included,
# and Kimi-VL's.
THINK_TAGS = (("<think>", "</think>"), ("◁think▷", "◁/think▷"))
# Tags that close a reasoning block, in the order tried.
THINK_CLOSE = tuple(close for _, close in THINK_TAGS)
# Token strings that end an assistant turn in common templates (looked up in the vocabulary).
END_OF_TURN = (
    "<|im_end|>",  # ChatML (SmolLM2, Qwen), Kimi
    "<|eot_id|>",  # Llama 3
    "<|end|>",  # Phi-3, gpt-oss
    "<|return|>",  # gpt-oss
    "<end_of_turn>",  # Gemma
    "<｜end▁of▁sentence｜>",  # DeepSeek
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
)


class RenderError(Eagle3Error):
    """One record cannot be rendered; ``reason`` is a short key for the summary counters."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class Rendered:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on tokens the target generated
    truncated: bool  # cut to max_length
    reasoning_dropped: bool = False  # the template has no place for the record's reasoning


def next_turns(prompt: Prompt, conversation: list[dict]) -> list[dict] | None:
    """The prompt's messages that come before the next generated answer (up to and including
    the next open user turn: eagle3.data.prompts.open_turns), or None when every open turn has
    its answer. `conversation` is what was asked so far, each ask followed by its one answer
    message: a prompt's own assistant turns (a held-out conversation's earlier answers) are
    asked as context, so asks are counted by length, not by assistant turns. An ask not yet
    answered is returned again."""
    start = used = 0
    for i in open_turns(prompt.messages):
        ask = prompt.messages[start : i + 1]
        if used + len(ask) + 1 > len(conversation):  # this ask has no answer yet
            return [dict(m) for m in ask]
        used += len(ask) + 1
        start = i + 1
    return None


def load_chat_template(value: str | None) -> str | None:
    """A template given as a file path (e.g. ``--chat-template kimi.jinja``) or inline text."""
    if value and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


def check_renderable(tokenizer: Any, chat_template: str | None, target: str) -> None:
    """One line when target `target` leaves nothing to render records with: no tokenizer, or
    neither a --chat-template nor one of the tokenizer's own."""
    if tokenizer is None:
        raise Eagle3Error(f"target {target} has no tokenizer; pass a model directory with one")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise Eagle3Error(
            f"target {target}'s tokenizer has no chat template; pass --chat-template FILE"
        )


def end_of_turn_ids(tokenizer: Any) -> set[int]:
    """Ids that close an assistant turn: the tokenizer's EOS plus known end-of-turn tokens."""
    ids = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    vocab = tokenizer.get_vocab()
    for token in END_OF_TURN:
        if token in vocab:
            ids.add(vocab[token])
    return ids


def _unbalanced(what: str) -> RenderError:
    return RenderError(
        "unbalanced think tags",
        f"{what}; give the reasoning in its own field or as content 'reasoning</think>answer'",
    )


def split_thinking(message: dict) -> tuple[str, str]:
    """An assistant message -> (reasoning, answer), from either shape a server returns a thinking
    turn in: the reasoning in ``reasoning`` or ``reasoning_content`` and the answer in
    ``content``, or ``content`` = ``reasoning</think>answer`` (the opener came with the
    generation prompt; one written at the very start of ``content`` is taken as well). Both
    verbatim: the tokens are the target's. Raises :class:`RenderError` ("unbalanced think tags")
    for tags out of place."""
    content, reasoning = message.get("content") or "", _reasoning(message)
    if not isinstance(content, str) or not isinstance(reasoning, str):
        raise RenderError("bad record", "an assistant turn's content or reasoning is not text")
    for opener, closer in THINK_TAGS:
        if opener in reasoning or closer in reasoning:
            raise _unbalanced(
                f"a {opener if opener in reasoning else closer} in the reasoning field"
            )
        body = content[len(opener) :] if content.startswith(opener) else content
        if opener in body:
            raise _unbalanced(f"an {opener} inside the answer")
        closers = body.count(closer)
        if closers > 1:
            raise _unbalanced(f"{closers} {closer} in one answer")
        if closers and reasoning:
            raise _unbalanced(f"a {closer} in the answer beside a reasoning field")
        if body is not content and not closers:
            raise _unbalanced(f"an {opener} without its {closer}")
        if closers:
            reasoning, content = body.split(closer)
    return reasoning, content


def _split_turn(message: dict) -> dict:
    """An assistant message with its reasoning in ``reasoning`` and the answer in ``content``."""
    if message.get("role") != "assistant":
        return message
    reasoning, content = split_thinking(message)
    kept = {k: v for k, v in message.items() if k not in ("reasoning", "reasoning_content")}
    return {**kept, "content": content, "reasoning": reasoning}


def _template_messages(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        if m["role"] == "assistant":
            reasoning, content = split_thinking(m)
            turn = {"role": "assistant", "content": content}
            if reasoning:
                turn["reasoning_content"] = reasoning
            out.append(turn)
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


def _reasoning(message: dict) -> str:
    return message.get("reasoning") or message.get("reasoning_content") or ""


def render_text(
    tokenizer: Any,
    messages: list[dict],
    *,
    add_generation_prompt: bool,
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
) -> str:
    """The template's text for ``messages`` (no tokenization)."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise RenderError("unknown template", "the tokenizer has no chat template; pass one")
    try:
        return tokenizer.apply_chat_template(
            _template_messages(messages),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            **(template_kwargs or {}),
        )
    except Exception as err:  # jinja raise_exception(...) and friends: one bad record
        raise RenderError("template error", str(err).splitlines()[0][:200]) from err


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of rendered text; special-token strings in it become their ids."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def prompt_ids(
    tokenizer: Any,
    messages: list[dict],
    *,
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """Token ids of ``messages`` rendered with ``add_generation_prompt=True``."""
    text = render_text(
        tokenizer,
        messages,
        add_generation_prompt=True,
        chat_template=chat_template,
        template_kwargs=template_kwargs,
    )
    return encode(tokenizer, text)


def _check_roles(messages: list[dict]) -> int:
    """Validate roles; return the index of the last assistant turn (its reasoning apart)."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and "role" in m for m in messages
    ):
        raise RenderError("bad record", "messages is not a list of {role, content}")
    if not any(m["role"] == "user" for m in messages):
        raise RenderError("no user turn")
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    if last < 0:
        raise RenderError("empty response", "no assistant turn")
    answer = _split_turn(messages[last])
    if not (answer.get("content") or "").strip() and not _reasoning(answer).strip():
        raise RenderError("empty response")
    return last


def _cut_after_generated(gen_text: str, message: dict) -> str:
    """The last turn's text up to its final generated character (no end-of-turn token)."""
    content, reasoning = message.get("content") or "", _reasoning(message)
    for anchor in (content, content.strip(), reasoning, reasoning.strip()):
        if anchor:
            j = gen_text.rfind(anchor)
            if j >= 0:
                return gen_text[: j + len(anchor)]
    return gen_text


def _last_turn_text(
    prefix_text: str, full_text: str, message: dict, close: bool
) -> tuple[str, bool]:
    """-> (the last turn's text after the generation prompt, reasoning dropped)."""
    if not full_text.startswith(prefix_text):
        raise RenderError(
            "unknown template",
            "the rendered answer does not extend the generation prompt; pass a chat template",
        )
    gen_text = full_text[len(prefix_text) :]
    reasoning = _reasoning(message).strip()
    dropped = False
    if reasoning and reasoning not in gen_text:  # the template dropped it
        tag = next((t for t in THINK_CLOSE if t in gen_text), None)
        if tag is None:  # no reasoning block at all (e.g. ChatML): train on the answer
            if not (message.get("content") or "").strip():
                raise RenderError("empty response", "reasoning only, and the template drops it")
            dropped = True
        else:  # Kimi-K2.5: `<think></think>` for the last turn; put it back where it was
            i = gen_text.index(tag)
            gen_text = gen_text[:i] + _reasoning(message) + gen_text[i:]
    if not close:
        gen_text = _cut_after_generated(gen_text, message)
    return gen_text, dropped


def render_conversation(
    tokenizer: Any,
    messages: list[dict],
    *,
    max_length: int | None = None,
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
    close_last_turn: bool = True,
) -> Rendered:
    """Token ids and loss mask of a conversation (see the module docstring).

    Messages after the last assistant turn are dropped. ``close_last_turn=False`` for a last
    turn cut at max tokens (finish_reason "length"). Raises :class:`RenderError`.
    """
    last = _check_roles(messages)
    msgs = [_split_turn(m) for m in messages[: last + 1]]
    kw = {"chat_template": chat_template, "template_kwargs": template_kwargs}
    prefix_text = render_text(tokenizer, msgs[:last], add_generation_prompt=True, **kw)
    full_text = render_text(tokenizer, msgs, add_generation_prompt=False, **kw)
    gen_text, dropped = _last_turn_text(prefix_text, full_text, msgs[last], close_last_turn)

    eot = end_of_turn_ids(tokenizer)
    prefix = encode(tokenizer, prefix_text)
    gen = encode(tokenizer, gen_text)
    if close_last_turn:
        ends = [j for j, t in enumerate(gen) if t in eot]
        if ends:
            gen = gen[: ends[-1] + 1]  # drop glue after the end-of-turn token
    mask = [0] * len(prefix) + [1] * len(gen)

    # Earlier assistant turns, as they appear in the history of the last one.
    for i, m in enumerate(msgs[:last]):
        if m["role"] != "assistant":
            continue
        before = encode(
            tokenizer, render_text(tokenizer, msgs[:i], add_generation_prompt=False, **kw)
        )
        header = encode(
            tokenizer, render_text(tokenizer, msgs[:i], add_generation_prompt=True, **kw)
        )
        start = _agreement(header, prefix)
        if start < len(before) or before != prefix[: len(before)]:
            raise RenderError(
                "unknown template",
                f"assistant turn {i} is not where the template's history puts it; "
                "pass a chat template",
            )
        end = next((j for j in range(start, len(prefix)) if prefix[j] in eot), None)
        if end is None:
            raise RenderError("unknown template", f"no end-of-turn token after assistant turn {i}")
        # what the template writes into any turn (Kimi's `<think></think>`) is not the target's
        blank = [*msgs[:i], {"role": "assistant", "content": ""}, *msgs[i + 1 : last]]
        with contextlib.suppress(RenderError):  # a template may refuse an empty turn
            blank_text = render_text(tokenizer, blank, add_generation_prompt=True, **kw)
            start = min(max(start, _agreement(encode(tokenizer, blank_text), prefix)), end)
        mask[start : end + 1] = [1] * (end + 1 - start)

    ids = prefix + gen
    truncated = max_length is not None and len(ids) > max_length
    if truncated:
        ids, mask = ids[:max_length], mask[:max_length]
    return Rendered(ids, mask, truncated, reasoning_dropped=dropped)


def _agreement(a: list[int], b: list[int]) -> int:
    """How many leading ids `a` and `b` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def render_record(
    tokenizer: Any,
    record: dict,
    *,
    max_length: int | None = None,
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
) -> Rendered:
    """A datagen record (eagle3.data.records format): its last turn is left open when it was cut at
    max tokens (``finish_reason == "length"``). Raises :class:`RenderError`."""
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list):
        raise RenderError("bad record", "no messages list")
    return render_conversation(
        tokenizer,
        messages,
        max_length=max_length,
        chat_template=chat_template,
        template_kwargs=template_kwargs,
        close_last_turn=record.get("finish_reason") != "length",
    )


__all__ = [
    "END_OF_TURN",
    "THINK_CLOSE",
    "RenderError",
    "Rendered",
    "encode",
    "end_of_turn_ids",
    "load_chat_template",
    "prompt_ids",
    "render_conversation",
    "render_record",
    "render_text",
    "split_thinking",
]
