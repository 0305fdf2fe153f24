"""In-process batched generation with ``transformers`` (``datagen.local --target``).

Prompts are rendered with the target's chat template (:func:`datagen.chat.prompt_ids`), sorted
by length so a batch pads little, left-padded, and decoded with the KV cache under
``torch.inference_mode`` until every row has produced an end-of-turn token or
``max_new_tokens``. A reasoning target (Kimi-K2.5: the generation prompt opens ``<think>``)
writes ``reasoning</think>answer``; the text before the think-closing tag becomes the turn's
``reasoning``, the rest its ``content``, as OpenRouter and SGLang return them.

Default temperature: 0.7 (top-p 1, no top-k). The drafter is scored at T=0 and at T=1. Its loss
uses the target's full next-token distribution at every position (soft labels computed from the
captured hidden states), so the sampled token itself never becomes a label: the temperature only
decides which prefixes the drafter is trained on. T=0 gives exactly the prefixes of greedy
decoding, but small targets fall into repetition loops at T=0 and every prompt yields a single
answer; T=1 matches T=1 decoding but spends tokens on low-probability detours. 0.7 stays close
to the high-probability paths that both evaluations mostly follow while keeping the data varied,
and is in line with what peer frameworks regenerate at. Pass ``--temperature 0`` (greedy) or
``1`` to match one evaluation exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from datagen.chat import THINK_CLOSE, end_of_turn_ids, prompt_ids

log = logging.getLogger(__name__)

DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_P = 1.0
DEFAULT_MAX_NEW_TOKENS = 1024
DEFAULT_BATCH_SIZE = 16


@dataclass
class Turn:
    content: str
    reasoning: str
    finish_reason: str  # "stop" (end-of-turn token) or "length" (max_new_tokens)
    prompt_tokens: int
    completion_tokens: int


def split_reasoning(tokenizer: Any, ids: list[int]) -> tuple[str, str]:
    """Generated ids -> (reasoning, content), split at the think-closing tag if there is one."""
    vocab = tokenizer.get_vocab()
    for tag in THINK_CLOSE:
        tag_id = vocab.get(tag)
        if tag_id is not None and tag_id in ids:  # a special token: split on the id
            c = ids.index(tag_id)
            reasoning = tokenizer.decode(ids[:c], skip_special_tokens=True)
            content = tokenizer.decode(ids[c + 1 :], skip_special_tokens=True)
            return reasoning.strip(), content
    text = tokenizer.decode(ids, skip_special_tokens=True)
    for tag in THINK_CLOSE:
        if tag in text:  # a plain-text tag (tokenizers without a special token for it)
            reasoning, content = text.split(tag, 1)
            return reasoning.replace("<think>", "", 1).strip(), content
    return "", text


class Generator:
    """Batched generation of one assistant turn for many conversations at once."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        temperature: float = DEFAULT_TEMPERATURE,
        top_p: float = DEFAULT_TOP_P,
        batch_size: int = DEFAULT_BATCH_SIZE,
        chat_template: str | None = None,
        template_kwargs: dict | None = None,
    ):
        from transformers import GenerationConfig

        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.chat_template = chat_template
        self.template_kwargs = template_kwargs
        self.eot = sorted(end_of_turn_ids(tokenizer))
        if not self.eot:
            raise ValueError("the tokenizer has no EOS or end-of-turn token to stop on")
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = pad if pad is not None else self.eot[0]
        sampling = temperature > 0
        self.config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=sampling,
            temperature=temperature if sampling else None,
            top_p=top_p if sampling else None,
            top_k=0 if sampling else None,  # no top-k (None would become transformers' 50)
            eos_token_id=self.eot,
            pad_token_id=self.pad_id,
            use_cache=True,
        )

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def prompt(self, conversation: list[dict]) -> list[int]:
        return prompt_ids(
            self.tokenizer,
            conversation,
            chat_template=self.chat_template,
            template_kwargs=self.template_kwargs,
        )

    def generate(self, conversations: list[list[dict]]) -> list[Turn]:
        """The next assistant turn of each conversation (each ends with a user turn)."""
        return self.generate_ids([self.prompt(c) for c in conversations])

    def generate_ids(self, prompts: list[list[int]]) -> list[Turn]:
        """The same for rendered prompts: batched by length, results in input order."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: list[Turn | None] = [None] * len(prompts)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            for i, turn in zip(chunk, self._batch([prompts[i] for i in chunk])):
                results[i] = turn
        return results  # type: ignore[return-value]

    @torch.inference_mode()
    def _batch(self, prompts: list[list[int]]) -> list[Turn]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for b, p in enumerate(prompts):  # left padding: every row ends at the same column
            ids[b, width - len(p) :] = torch.tensor(p)
            attn[b, width - len(p) :] = 1
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=attn.to(self.device),
            generation_config=self.config,
        )
        turns = []
        eot = set(self.eot)
        for b, p in enumerate(prompts):
            gen = out[b, width:].tolist()
            stop = next((j for j, t in enumerate(gen) if t in eot), None)
            if stop is None:
                body, finish, used = gen, "length", len(gen)
            else:
                body, finish, used = gen[:stop], "stop", stop + 1
            reasoning, content = split_reasoning(self.tokenizer, body)
            turns.append(Turn(content, reasoning, finish, len(p), used))
        return turns


__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_TEMPERATURE",
    "DEFAULT_TOP_P",
    "Generator",
    "Turn",
    "split_reasoning",
]
