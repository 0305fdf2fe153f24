"""The target in this process: Target (a HF causal LM, its aux hidden-state capture), the
TargetModel interface it shares with a served target, and the hooks and checks they use."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from eagle3.errors import Eagle3Error
from eagle3.targets.registry import default_aux_layers


def _check_aux_ids(aux_layer_ids: list[int], num_layers: int) -> list[int]:
    ids = [int(i) for i in aux_layer_ids]
    if len(ids) != 3:
        raise Eagle3Error(f"EAGLE-3 needs exactly 3 aux layer ids, got {ids}")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise Eagle3Error(
            f"aux layer id(s) {bad} out of range: this target has {num_layers} decoder layers, "
            f"valid ids are [0, {num_layers - 1}]"
        )
    return ids


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The base transformer (embed_tokens, layers, norm) inside a CausalLM."""
    candidates = []
    if hasattr(model, "get_decoder"):
        candidates.append(model.get_decoder())
    candidates += [m for _, m in model.named_modules()]
    for m in candidates:
        if isinstance(getattr(m, "layers", None), torch.nn.ModuleList) and hasattr(m, "norm"):
            return m
    raise Eagle3Error(
        f"cannot find the decoder layers of {type(model).__name__}; "
        "targets must be HF CausalLMs with a `.layers` ModuleList and a final `.norm`"
    )


@contextlib.contextmanager
def capture_outputs(modules: dict[Any, torch.nn.Module]) -> Iterator[dict[Any, torch.Tensor]]:
    """Forward hooks that keep each module's output (its hidden state) under its key while the
    block runs: ``with capture_outputs({i: layers[i]}) as out: model(...)``, then ``out[i]``."""
    captured: dict[Any, torch.Tensor] = {}

    def hook_for(key: Any):
        def hook(module, args, output):
            captured[key] = output[0] if isinstance(output, tuple) else output

        return hook

    handles = [m.register_forward_hook(hook_for(k)) for k, m in modules.items()]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


class TargetModel(Protocol):
    """What datagen and training use of a target, in-process (Target) or served by an engine
    (ServedTarget): the same capture contract, the same length check, the same end."""

    served: bool  # True: the forwards run in an engine's process, not this one
    name: str
    tokenizer: Any
    vocab_size: int
    hidden_size: int
    num_layers: int
    aux_layer_ids: list[int]

    def check_length(self, max_length: int, what: str) -> None:
        """Eagle3Error (one line naming `what`) when max_length does not fit the context."""

    def capture(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, attention_mask [B, T] -> (aux [B, T, 3H], last [B, T, H]): the outputs
        of the aux layers in order, and the last hidden state after the final norm; padded
        positions zero."""

    def stop(self) -> None:
        """Release what the target holds outside this process (a no-op for Target)."""


def check_context(
    name: str, context: int | None, max_length: int, what: str, spare: int = 0
) -> None:
    """One-line Eagle3Error when max_length (+ `spare` tokens the engine generates) exceeds
    target `name`'s context (max_position_embeddings; None: unknown, nothing to check)."""
    if context and max_length + spare > context:
        raise Eagle3Error(
            f"{what} {max_length} does not fit target {name}'s context of {context} tokens "
            f"(max_position_embeddings): use {what} {context - spare} or less"
        )


class Target:
    """A HF causal LM plus what EAGLE-3 needs from it: aux capture and the lm_head/embeddings."""

    served = False  # the forwards run here

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any = None,
        name: str = "target",
        aux_layer_ids: list[int] | None = None,
        spec: dict[str, Any] | None = None,
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.spec = spec  # registry entry (eagle3/targets/registry_entries/<name>.yaml) or None
        self._decoder = decoder_of(model)
        text_config = getattr(model.config, "text_config", None) or model.config
        self.num_layers = int(
            getattr(text_config, "num_hidden_layers", None) or len(self._decoder.layers)
        )
        self.hidden_size = int(self.embed_weight.shape[1])
        self.vocab_size = int(self.lm_head_weight.shape[0])
        if aux_layer_ids is None:
            aux_layer_ids = default_aux_layers(self.num_layers)
        self.aux_layer_ids = _check_aux_ids(aux_layer_ids, self.num_layers)
        context = getattr(text_config, "max_position_embeddings", None)
        self.context = int(context) if context else None

    def check_length(self, max_length: int, what: str) -> None:
        """One line when max_length does not fit the model's context (max_position_embeddings)."""
        check_context(self.name, self.context, max_length, what)

    def stop(self) -> None:
        """Nothing to release: the model lives in this process (the interface of ServedTarget)."""

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight  # [V, H]; tied -> embed_tokens

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight  # [V, H]

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device  # where input ids go (first shard under device_map)

    @torch.no_grad()  # not inference_mode: the outputs feed drafter training (autograd inputs)
    def capture(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, attention_mask [B, T] -> (aux [B, T, 3H], last_hidden [B, T, H]).

        aux concatenates the outputs of decoder layers `aux_layer_ids` in that order;
        last_hidden is after the final norm (lm_head input). Left or right padding works:
        positions come from the attention mask, and padded positions are returned as zeros.
        """
        input_ids = input_ids.to(self.device)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        attention_mask = attention_mask.to(self.device).long()
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding -> 0,0,0,1,2..

        layers = self._decoder.layers
        with capture_outputs({i: layers[i] for i in self.aux_layer_ids}) as captured:
            out = self._decoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
            )
        last = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        aux = torch.cat([captured[i].to(last.device) for i in self.aux_layer_ids], dim=-1)
        keep = attention_mask.to(last.device).bool()[..., None]  # padded rows may hold garbage
        return aux.masked_fill(~keep, 0.0), last.masked_fill(~keep, 0.0)
