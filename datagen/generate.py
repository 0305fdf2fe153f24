"""In-process batched generation with ``transformers`` (``datagen.local --target``).

Prompts are rendered with the target's chat template (:func:`eagle3.data.chat.prompt_ids`) and
decoded with continuous batching (:meth:`Generator._continuous`): up to ``batch_size`` rows
decode together, a row leaves at its end-of-turn token or ``max_new_tokens`` and waiting
prompts take the free slots, prefilled in buckets of similar length so little is padding. On
a CPU this and oneDNN-packed linear weights (:class:`PackedLinear`) make it about 2x
transformers' ``generate`` over length-sorted batches (the fallback for sliding-window or
hybrid caches; ``benchmarks/bench_generate.py`` measures both in one run). A reasoning target (Kimi-K2.5: the generation prompt opens ``<think>``)
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
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from eagle3.data.chat import THINK_CLOSE, end_of_turn_ids, prompt_ids
from eagle3.targets import cache_kwarg, output_cache

log = logging.getLogger(__name__)

DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_P = 1.0
DEFAULT_MAX_NEW_TOKENS = 1024
DEFAULT_BATCH_SIZE = 32


@dataclass
class Turn:
    """One assistant turn decoded in-process, with its token counts."""

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
        pack_weights: bool = True,
    ):
        from transformers import GenerationConfig

        self.model = model.eval()
        if pack_weights:
            pack_linear_weights(self.model, batch_size)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.chat_template = chat_template
        self.template_kwargs = template_kwargs
        self.eot = sorted(end_of_turn_ids(tokenizer))
        if not self.eot:
            raise ValueError("the tokenizer has no EOS or end-of-turn token to stop on")
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = pad if pad is not None else self.eot[0]
        # Whether the KV cache is the plain per-layer kind continuous batching needs: decided on
        # first use (_probe_cache). Public: False forces transformers' generate, the reference
        # a benchmark or test compares against.
        self.plain_cache: bool | None = None
        self._cache_kw = cache_kwarg(self.model)  # "cache" (transformers 5) or "past_key_values"
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

    def generate_ids(
        self, prompts: list[list[int]], on_done: Callable[[int, Turn], None] | None = None
    ) -> list[Turn]:
        """The same for rendered prompts, results in input order; `on_done(i, turn)` hears of
        each prompt's turn as soon as it is decoded (progress while a long call runs).

        Continuous batching (:meth:`_continuous`) when the model's KV cache is the plain
        per-layer kind; otherwise (sliding-window, hybrid or custom caches) length-sorted
        batches through ``model.generate``.
        """
        if self.plain_cache is None:
            self.plain_cache = self._probe_cache()
        if self.plain_cache:
            return self._continuous(prompts, on_done)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: list[Turn | None] = [None] * len(prompts)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            for i, turn in zip(chunk, self._batch([prompts[i] for i in chunk])):
                results[i] = turn
                if on_done is not None:
                    on_done(i, turn)
        return results  # type: ignore[return-value]

    # -- continuous batching ---------------------------------------------------------------
    @torch.inference_mode()
    def _probe_cache(self) -> bool:
        """True when a forward returns a DynamicCache of plain full-attention layers."""
        from transformers.cache_utils import DynamicCache, DynamicLayer

        out = self.model(
            input_ids=torch.tensor([[self.pad_id]], device=self.device), use_cache=True
        )
        cache = output_cache(out)
        plain = isinstance(cache, DynamicCache) and all(
            type(layer) is DynamicLayer for layer in cache.layers
        )
        if not plain:
            log.info("%s has a %s: batched model.generate", type(self.model).__name__, type(cache))
        return plain

    def _prefill(self, prompts: list[list[int]]) -> tuple[list[tuple], torch.Tensor, torch.Tensor]:
        """Left-padded prompts -> (per-layer (keys, values), attention mask, last logits)."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, width - len(p) :] = torch.tensor(p)
            attn[b, width - len(p) :] = 1
        pos = (attn.cumsum(-1) - 1).clamp_(min=0)
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=attn.to(self.device),
            position_ids=pos.to(self.device),
            use_cache=True,
            logits_to_keep=1,
        )
        return _layers(output_cache(out)), attn.to(self.device), out.logits[:, -1].float()

    def _next_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) logits -> (B,) next ids: greedy, or temperature + exact top-p sampling."""
        if not self.config.do_sample:
            return logits.argmax(-1)
        probs = torch.softmax(logits / self.config.temperature, dim=-1)
        top_p = self.config.top_p
        if top_p is None or top_p >= 1.0:
            return _sample(probs)
        # The nucleus is almost always inside the top 256: sort those, not the whole vocab;
        # rows whose top 256 hold less than top_p of the mass take the full sort (exact).
        k = min(256, probs.shape[-1])
        vals, idx = probs.topk(k, dim=-1)
        if bool((vals.sum(-1) < top_p).any()):
            vals, idx = probs.sort(dim=-1, descending=True)
        before = vals.cumsum(-1) - vals  # mass strictly before each token
        vals = vals.masked_fill(before >= top_p, 0.0)
        return idx.gather(-1, _sample(vals)[:, None])[:, 0]

    @torch.inference_mode()
    def _continuous(
        self, prompts: list[list[int]], on_done: Callable[[int, Turn], None] | None = None
    ) -> list[Turn]:
        """Decode with up to batch_size rows in flight; a row that finishes frees its slot and
        waiting prompts (longest first, prefilled together) join the running batch. Keys are
        cached after RoPE, so rows of different lengths share one left-padded cache: each row
        has its own position ids and attention mask, and leading columns that are padding in
        every row are trimmed. Same tokens as one-prompt-at-a-time decoding (greedy: tested).
        """
        from transformers.cache_utils import DynamicCache

        waiting = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # pop() = longest
        results: list[Turn | None] = [None] * len(prompts)
        rows: list[int] = []  # prompt index of each batch row
        out_ids: list[list[int]] = []
        cache = DynamicCache()
        attn = torch.zeros((0, 0), dtype=torch.long, device=self.device)
        logits = torch.zeros((0, 1), device=self.device)  # next-token logits of each row
        eot = torch.tensor(self.eot, device=self.device)
        limit = self.config.max_new_tokens
        refill_at = max(1, self.batch_size // 4)  # merging copies the cache: do it in groups

        while rows or waiting:
            if waiting and self.batch_size - len(rows) >= min(refill_at, len(waiting)):
                group = [
                    waiting.pop() for _ in range(min(self.batch_size - len(rows), len(waiting)))
                ]
                kv = _layers(cache) if rows else []
                parts = [logits] if rows else []
                for bucket in _buckets([len(prompts[i]) for i in group]):
                    new_kv, new_attn, new_logits = self._prefill(
                        [prompts[group[j]] for j in bucket]
                    )
                    kv, attn = _merge(kv, attn, new_kv, new_attn)
                    parts.append(new_logits)
                logits = torch.cat(parts)
                cache = _growing_cache(kv, room=limit)
                rows += group
                out_ids += [[] for _ in group]
            nxt = self._next_tokens(logits)
            done = torch.isin(nxt, eot).tolist()
            for b, token in enumerate(nxt.tolist()):
                out_ids[b].append(token)
            keep = []
            for b, i in enumerate(rows):
                if done[b] or len(out_ids[b]) >= limit:
                    gen = out_ids[b]
                    body = gen[:-1] if done[b] else gen
                    reasoning, content = split_reasoning(self.tokenizer, body)
                    finish = "stop" if done[b] else "length"
                    results[i] = Turn(content, reasoning, finish, len(prompts[i]), len(gen))
                    if on_done is not None:
                        on_done(i, results[i])
                else:
                    keep.append(b)
            if len(keep) < len(rows):
                index = torch.tensor(keep, dtype=torch.long, device=self.device)
                kv = [(k[index], v[index]) for k, v in _layers(cache)]
                attn, nxt = attn[index], nxt[index]
                rows = [rows[b] for b in keep]
                out_ids = [out_ids[b] for b in keep]
                kv, attn = _trim(kv, attn)
                cache = _growing_cache(kv, room=limit) if rows else DynamicCache()
            if not rows:
                continue
            attn = torch.cat([attn, attn.new_ones((len(rows), 1))], dim=1)
            pos = attn.sum(-1, keepdim=True) - 1
            out = self.model(
                input_ids=nxt[:, None],
                attention_mask=attn,
                position_ids=pos,
                use_cache=True,
                **{self._cache_kw: cache},
            )
            logits = out.logits[:, -1].float()
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


class PackedLinear(torch.nn.Module):
    """nn.Linear with its weight pre-packed for oneDNN (CPU, fp32) for `rows_hint` rows: the
    same product (to float32 rounding), without re-packing the weight on every call. Whether
    that wins depends on the CPU, the shape and the rows, so pack_linear_weights measures it.
    """

    def __init__(self, linear: torch.nn.Linear, rows_hint: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # kept for code that reads it (embeddings tied to lm_head)
        self.bias = linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


# Calls per side when timing one shape (after a warm-up call): the median of 5 is steady to a
# few percent here; SmolLM2-135M has 5 shapes, timed at 32 rows in about 0.3 s.
PACKING_REPS = 5


def _median_seconds(layer: torch.nn.Module, x: torch.Tensor) -> float:
    layer(x)  # warm-up: first-call allocations and oneDNN's primitive cache
    times = []
    for _ in range(PACKING_REPS):
        start = time.perf_counter()
        layer(x)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def packing_wins(linear: torch.nn.Linear, rows: int) -> bool:
    """True when the oneDNN-packed product of `linear` is faster than nn.Linear's at `rows`
    rows on this CPU, timed here (median of PACKING_REPS calls each, random inputs).

    Measured rather than decided by capability, because the answer turns on shape and rows as
    much as on the ISA. Packed / nn.Linear time per call, 2 threads (SmolLM2: 576 -> 1,536,
    1,536 -> 576, the 576 -> 49,152 lm_head; packed for 32 rows):
      Xeon with AMX (this project's): 1 row 1.60 / 1.67 / 0.92; 32 rows 0.80 / 0.64 / 0.78;
        300 rows 0.96 / 0.93 / 0.40
      the same Xeon as AVX2 (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
        MKL_ENABLE_INSTRUCTIONS=AVX2): 1 row 1.96 / 2.27 / 1.24; 32 rows 1.06 / 1.06 / 0.72;
        300 rows 0.92 / 0.97 / 0.57
      a real AVX2 EPYC (issue 35, 576 -> 1,536): 1 row 6.8 (3,761 against 553 us);
        32 rows 0.77; 300 rows 0.61
      Zen 4 (earlier docstring): 1.4x faster on the decoder's matmuls, 2.8x on the lm_head at
        32 rows
    So packing loses at one row everywhere and wins on the lm_head at decode widths; the small
    decoder matmuls go either way.
    """
    with torch.no_grad():
        x = torch.randn(rows, linear.in_features)
        packed = _median_seconds(PackedLinear(linear, rows), x)
        return packed < _median_seconds(linear, x)


def pack_linear_weights(model: torch.nn.Module, rows_hint: int) -> int:
    """Swap the fp32 CPU nn.Linear layers of `model` for PackedLinear where packing wins at
    `rows_hint` rows (packing_wins, timed once per distinct shape) -> how many were packed.

    A no-op on GPUs, for other dtypes, and where this torch build has no oneDNN linear.
    """
    ops = getattr(torch.ops, "mkldnn", None)
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")):
        return 0
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear
        and child.weight.device.type == "cpu"
        and child.weight.dtype == torch.float32
    ]
    wins: dict[tuple, bool] = {}
    packed = 0
    with torch.no_grad():
        for parent, name, child in swaps:
            shape = (child.in_features, child.out_features, child.bias is not None)
            if shape not in wins:
                wins[shape] = packing_wins(child, rows_hint)
                log.debug("oneDNN packing %s at %d rows: %s", shape, rows_hint, wins[shape])
            if wins[shape]:
                setattr(parent, name, PackedLinear(child, rows_hint))
                packed += 1
    return packed


def _sample(weights: torch.Tensor) -> torch.Tensor:
    """One index per row with probability proportional to `weights` (B, V), by inverting the
    fp64 CDF: torch.multinomial draws an exponential per vocab entry (~30 ms per step here)."""
    cdf = weights.double().cumsum(-1)
    u = torch.rand((weights.shape[0], 1), dtype=torch.float64, device=weights.device)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return idx[:, 0].clamp_(max=weights.shape[-1] - 1)


def _layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _growing_cache(kv: list[tuple[torch.Tensor, torch.Tensor]], room: int):
    """A DynamicCache holding `kv` whose layers write new entries in place.

    transformers' DynamicLayer concatenates on every step, copying the whole cache per token:
    at batch 64 that memory traffic costs about as much as the matmuls on a CPU. Here each
    layer keeps a buffer with `room` free columns and returns views of the filled part.
    """
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class GrowingLayer(DynamicLayer):
        def __init__(self, keys: torch.Tensor, values: torch.Tensor):
            super().__init__()
            self.device, self.is_initialized = keys.device, True
            B, H, n, D = keys.shape
            self._k = keys.new_empty((B, H, n + room, D))
            self._v = values.new_empty((B, values.shape[1], n + room, values.shape[-1]))
            self._k[:, :, :n], self._v[:, :, :n] = keys, values
            self.keys, self.values, self._n = self._k[:, :, :n], self._v[:, :, :n], n

        def update(self, key_states, value_states, *args, **kwargs):
            s = key_states.shape[-2]
            if self._n + s > self._k.shape[2]:  # out of room: grow (rare; sized up front)
                return super().update(key_states, value_states)
            self._k[:, :, self._n : self._n + s] = key_states
            self._v[:, :, self._n : self._n + s] = value_states
            self._n += s
            self.keys, self.values = self._k[:, :, : self._n], self._v[:, :, : self._n]
            return self.keys, self.values

    cache = DynamicCache()
    cache.layers = [GrowingLayer(k, v) for k, v in kv]
    return cache


def _buckets(lengths: list[int], waste: float = 0.1, max_tokens: int = 8192) -> list[list[int]]:
    """Split prompts sorted longest first into prefill batches padded by at most `waste`."""
    parts: list[list[int]] = []
    total = 0
    for j, n in enumerate(lengths):
        if parts:
            width = lengths[parts[-1][0]]
            area = width * (len(parts[-1]) + 1)
            if area <= (1 + waste) * (total + n) and area <= max_tokens:
                parts[-1].append(j)
                total += n
                continue
        parts.append([j])
        total = n
    return parts


def _merge(kv: list, attn: torch.Tensor, new_kv: list, new_attn: torch.Tensor):
    """Stack two left-padded caches along the batch (the shorter one padded on the left)."""
    if not kv:
        return new_kv, new_attn
    width = max(attn.shape[1], new_attn.shape[1])

    def left_pad(x: torch.Tensor, dim: int) -> torch.Tensor:
        missing = width - x.shape[dim]
        if missing == 0:
            return x
        shape = list(x.shape)
        shape[dim] = missing
        return torch.cat([x.new_zeros(shape), x], dim=dim)

    merged = [
        (torch.cat([left_pad(k, 2), left_pad(nk, 2)]), torch.cat([left_pad(v, 2), left_pad(nv, 2)]))
        for (k, v), (nk, nv) in zip(kv, new_kv)
    ]
    return merged, torch.cat([left_pad(attn, 1), left_pad(new_attn, 1)])


def _trim(kv: list, attn: torch.Tensor):
    """Drop leading cache columns that are padding in every row."""
    if attn.shape[0] == 0:
        return kv, attn
    lead = int((attn.cumsum(-1) == 0).sum(-1).min())
    if lead == 0:
        return kv, attn
    return [(k[:, :, lead:], v[:, :, lead:]) for k, v in kv], attn[:, lead:]


__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_TEMPERATURE",
    "DEFAULT_TOP_P",
    "Generator",
    "Turn",
    "split_reasoning",
]
