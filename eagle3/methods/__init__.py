"""The draft methods, one module (or package) each, behind one registry.

    eagle3.py     EAGLE-3: one draft layer, the TTT unroll, sum_k w^k CE_k; chain or tree (its
                  draft is eagle3/model.py, its drafter eagle3/decoding/eagle.py: the others
                  build on both)
    eagle3_1.py   EAGLE-3.1: EAGLE-3 with fc_norm and norm_output on
    p_eagle/      P-EAGLE: more layers, every depth from one forward (vLLM parallel drafting),
                  with its own draft (draft.py) and drafter (decoding.py)

A method is an object of its module (EAGLE3, EAGLE3_1, P_EAGLE) answering for what differs:
the draft it builds and the config it accepts (`options_type`, `options`, `check`, `build`),
the training unroll and its loss (`draft_fields`, `check_recipe`, `unroll`), the export
(`writes_method_key`, `export_extra`, `own_tensors`), how vLLM serves it (`served_extra`) and
the in-house drafter that decodes it (`drafter`), plus the facts others ask (`switches`,
`ttt_unroll`, `unmodelled_memory`, `drafts_trees`, `decoder_layers`). The method is named
once, at the config boundary (DraftConfig.method, model.draft.method in a training recipe,
eagle_config.method in a checkpoint: `method_of_published`); everything downstream asks
`method_of(draft_config)` and never compares names or tests which method it has. Adding a
method is adding a module or package here and a line to REGISTRY (docs/adding-a-method.md).

A method's own fields are its sub-config, DraftConfig.options, a frozen dataclass of its module
(`options_type`: eagle3.Eagle3Options, EAGLE-3.1's switches; p_eagle.PEagleOptions, those and
P-EAGLE's layers, depth and mask id). Outside, in config.json and model.draft, they are flat
keys beside DraftConfig's own: `make_draft_config(**flat)` routes them to the method's
sub-config, fills its defaults and checks the config (every DraftConfig made from outside data
is made there: `from_target_config`, the training recipe's train/draft.py, the checkpoint and
published-config loader eagle3.checkpoint.load_config), and DraftConfig.to_dict() flattens them
back, in config.json's order. Another method's fields are dropped at their unset values (a
peer's config.json may carry them) and refused when set, here and in a training recipe
(`check_recipe`), by asking the sub-configs, so no method names another's fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any, Protocol

import torch
from torch import nn

from eagle3.errors import Eagle3Error
from eagle3.methods.eagle3 import EAGLE3, SWITCHES, Eagle3Method
from eagle3.methods.eagle3_1 import EAGLE3_1
from eagle3.methods.p_eagle import P_EAGLE
from eagle3.model import DraftConfig, Eagle3Draft, target_fields

REGISTRY: dict[str, Eagle3Method] = {m.name: m for m in (EAGLE3, EAGLE3_1, P_EAGLE)}
METHODS = tuple(REGISTRY)  # the names, in the order help texts list them
DEFAULT_METHOD = EAGLE3.name  # what a config that names no method trains
# the flat fields some method's sub-config holds (config.json's keys beside DraftConfig's own)
OPTION_FIELDS = tuple(
    dict.fromkeys(f.name for m in REGISTRY.values() for f in dataclasses.fields(m.options_type))
)
# each such field's unset value: its default in the first sub-config that holds it
UNSET = {
    f.name: f.default
    for m in reversed(REGISTRY.values())
    for f in dataclasses.fields(m.options_type)
}
# each such field's methods: those whose sub-config holds it
OWNERS = {
    name: tuple(
        m.name
        for m in REGISTRY.values()
        if name in {f.name for f in dataclasses.fields(m.options_type)}
    )
    for name in OPTION_FIELDS
}


def method_named(name: str) -> Eagle3Method:
    """The method called `name`, or one line naming the known ones."""
    if name not in REGISTRY:
        raise Eagle3Error(f"method {name!r} is not one of {METHODS}")
    return REGISTRY[name]


def method_of(cfg: DraftConfig) -> Eagle3Method:
    """The method of a draft config."""
    return method_named(cfg.method)


def make_draft_config(**fields: Any) -> DraftConfig:
    """A DraftConfig from flat fields: DraftConfig's own, `method` (absent or None: the
    default) and its sub-config's (config.json's and model.draft's keys, DraftConfig.to_dict()'s
    output). The method takes its own into DraftConfig.options, its defaults filled, and checks
    the config; anything wrong is one line (Eagle3Error)."""
    method = method_named(fields.pop("method", None) or DEFAULT_METHOD)
    options = method.options(fields)  # takes its fields out of `fields`
    foreign = foreign_settings(method, fields)
    if foreign:  # a peer's config.json may carry other methods' keys at their unset values
        said = ", ".join(f"{name} {value}" for name, value in foreign.items())
        raise Eagle3Error(
            f"{said}: {_settings_of(foreign)}; method {method.name!r} does not read "
            f"{'it' if len(foreign) == 1 else 'them'}: use that method or drop "
            f"{'it' if len(foreign) == 1 else 'them'}"
        )
    fields = {name: value for name, value in fields.items() if name not in OPTION_FIELDS}
    cfg = DraftConfig(**fields, method=method.name, options=options)
    method.check(cfg)
    return cfg


def foreign_settings(method: Eagle3Method, values: dict[str, Any]) -> dict[str, Any]:
    """The fields of other methods' sub-configs in `values` that `method`'s lacks, set away
    from their unset values (None or UNSET's): name -> value."""
    own = {f.name for f in dataclasses.fields(method.options_type)}
    return {
        name: values[name]
        for name in OPTION_FIELDS
        if name not in own and name in values and values[name] not in (None, UNSET[name])
    }


def _settings_of(names: Collection[str]) -> str:
    """'a setting of method p-eagle' / 'settings of method p-eagle' for the option fields named."""
    owners = dict.fromkeys(owner for name in names for owner in OWNERS[name])
    noun = "a setting" if len(names) == 1 else "settings"
    return f"{noun} of method {' or '.join(owners)}"


def check_recipe(model: Any, train: Any, need: Callable[[bool, str], None]) -> None:
    """A training config's problems with its draft method (train/config.py's collector `need`):
    other methods' model.draft keys set (null or their unset value is fine), then what the
    method itself refuses (its check_recipe)."""
    method = method_named(model.draft.method)
    values = {name: getattr(model.draft, name, None) for name in OPTION_FIELDS}
    for name in foreign_settings(method, values):
        need(
            False,
            f"model.draft.{name} is {_settings_of([name])}; model.draft.method "
            f"{method.name} does not read it: leave it null",
        )
    method.check_recipe(model, train, need)


def from_target_config(
    hf_config: Any, draft_vocab_size: int, aux_layer_ids: list[int], **overrides: Any
) -> DraftConfig:
    """The draft sized like one decoder layer of the target, with its RoPE
    (eagle3.model.target_fields); `overrides` replace any flat field (None: derive), the
    method's among them."""
    return make_draft_config(
        **target_fields(hf_config, draft_vocab_size, aux_layer_ids, **overrides)
    )


def method_of_published(raw: dict[str, Any], where: Any) -> Eagle3Method:
    """The method a drafter's config.json records (eagle_config.method, ours), checked against
    the switches vLLM reads; a peer's config without it is the method whose switches are all
    on when it sets every one (EAGLE-3.1), else the default with whatever switch it sets.
    `where` (the checkpoint) starts each one-line error."""
    switches = {switch: bool(raw.get(switch, False)) for switch in SWITCHES}
    method = (raw.get("eagle_config") or {}).get("method")
    # a method whose switches are its own (P-EAGLE: fc_norm applies to mask_hidden too) also
    # writes its name top-level (vLLM's)
    own = [m for m in (method, raw.get("method")) if m in REGISTRY and REGISTRY[m].switches is None]
    if own:
        if method not in (None, raw.get("method")):
            raise Eagle3Error(
                f"{where}: method {raw.get('method')!r} but eagle_config.method {method!r}: the "
                "config is of two drafters; re-export the checkpoint"
            )
        return REGISTRY[own[0]]
    if method is None:
        on = all(switches.values())
        return next((m for m in REGISTRY.values() if on and m.switches), REGISTRY[DEFAULT_METHOD])
    if method not in METHODS:
        raise Eagle3Error(f"{where}: eagle_config.method {method!r} is not one of {METHODS}")
    want = REGISTRY[method].switches
    wrong = [f"{s}: {str(on).lower()}" for s, on in switches.items() if on != want]
    if wrong:
        raise Eagle3Error(
            f"{where} records method {method} but has {', '.join(wrong)}: vLLM reads only the "
            f"switches and would serve another method than was trained; set "
            f"{' and '.join(s for s in switches)} to {str(want).lower()} or re-export"
        )
    return REGISTRY[method]


def draft_for(cfg: DraftConfig) -> Eagle3Draft:
    """A fresh draft of cfg's method (Eagle3Draft, PEagleDraft, ...)."""
    return method_of(cfg).build(cfg)


class Unroll(Protocol):
    """What the training recipe (train/train_drafter.py) asks of a method's unroll:
    eagle3.methods.eagle3.TTTUnroll, eagle3.methods.p_eagle.ParallelUnroll."""

    depth: int  # the acc_k / loss_k columns: TTT steps, or P-EAGLE's parallel depth

    def module(self, draft: Eagle3Draft) -> nn.Module:
        """The module the recipe prepares and trains (its forward is the unroll)."""

    def prepare(self, mb: dict, step: int | None = None, micro: int = 0, rank: int = 0) -> None:
        """Add what the unroll draws per micro-batch (step None: validation)."""

    def counts(self, mb: dict) -> torch.Tensor:
        """Valid label positions per depth, as the loss counts them -> (depth,)."""

    def summary(self, total: Any, step_weight: float) -> dict[str, float]:
        """The logged metrics of summed micro-batches (train.metrics.MetricSums)."""

    def loss(
        self, model: nn.Module, mb: dict, step_weight: float, denominators: list[float] | None
    ) -> tuple[torch.Tensor, dict]:
        """Forward and loss of a labelled micro-batch -> (loss, metrics)."""

    @staticmethod
    def of(cfg: Any, draft_cfg: DraftConfig) -> Unroll:
        """The unroll of draft_cfg's method for a training config (train.config.Config: its
        model and train sections)."""
        return method_of(draft_cfg).unroll(draft_cfg, cfg.model, cfg.train)
