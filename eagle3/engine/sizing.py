"""How much context a managed engine is told to hold (its --max-model-len).

vLLM's default is the target's whole context (Kimi-K2.5: 262,144 tokens, more KV than a 96 GB
card keeps after its weights), so a server told nothing may not start at all. Every command that
starts one (eagle3.evaluate --engine, datagen.local --engine) asks `engine_context` instead: the
longest prompt with every user turn answered, at most the target's own context
(`target_context`).
"""

from __future__ import annotations

from collections.abc import Iterable

from eagle3.data.chat import prompt_ids
from eagle3.data.prompts import Prompt, user_turns
from eagle3.targets import target_facts

# tokens per turn beyond its answer: the answer's template around it, and an answer decoded to
# text and tokenised again in the next turn's prompt, which can grow a little
ANSWER_SLACK = 32


def target_context(model) -> int | None:
    """The target's context (max_position_embeddings), read from its config; None: unknown.
    `model`: a registry name, HF directory, .gguf or ResolvedTarget (what target_facts takes)."""
    context = getattr(target_facts(model)["hf_config"], "max_position_embeddings", None)
    return int(context) if context else None


def engine_context(
    tokenizer, prompts: Iterable[Prompt], max_new_tokens: int, context: int | None
) -> int:
    """The context an engine needs for `prompts`: the longest prompt with every user turn and
    an answer of max_new_tokens (+ ANSWER_SLACK) after each, at most `context` (the target's;
    None: no cap)."""
    need = 0
    for prompt in prompts:
        rendered = len(prompt_ids(tokenizer, prompt.messages))  # every turn, no answers
        need = max(need, rendered + user_turns(prompt) * (max_new_tokens + ANSWER_SLACK))
    return min(need, context) if context else need
