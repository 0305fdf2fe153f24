"""The registry of draft methods (eagle3/methods/): every method builds its draft from the
fields it derives, exports it and loads back as itself; no product file outside the registry
compares a method's name; loading a checkpoint imports no decoder. Whole file ~4 s. A method's
own maths and training are its own test file's (test_eagle3_1.py, test_parallel_draft.py,
tests/train/test_parallel_drafting.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle3.checkpoint import load_draft, save_draft
from eagle3.errors import Eagle3Error
from eagle3.methods import (
    EAGLE3,
    OPTION_FIELDS,
    REGISTRY,
    UNSET,
    check_recipe,
    draft_for,
    make_draft_config,
    method_named,
    method_of,
    method_of_published,
)
from eagle3.methods.eagle3 import Eagle3Options
from eagle3.methods.p_eagle import PEagleOptions

EAGLE3_OPTIONS = Eagle3Options()

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("eagle3", "train", "datagen", "benchmarks", "experiments", "scripts")


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_method_builds_exports_and_loads_as_itself(name, tiny_config, tmp_path):
    """~0.3 s each: the fields the method derives from an all-null model.draft make a config
    it accepts; its draft saves with its export fields and loads back as the same class and
    config (the loader tells the method from config.json alone)."""
    method = method_named(name)
    shape = SimpleNamespace(num_layers=None, parallel_depth=None, mask_token_id=None)
    fields = method.draft_fields(shape, 3, SimpleNamespace(vocab_size=50, pad_token_id=0))
    cfg = tiny_config(**fields)
    assert method_of(cfg) is method and cfg.method == name
    draft = draft_for(cfg)
    save_draft(draft, tmp_path, extra_config=method.export_extra(cfg))
    loaded = load_draft(tmp_path)
    assert type(loaded) is type(draft) and loaded.config == cfg


@pytest.mark.parametrize("name", list(REGISTRY))
def test_a_config_keeps_its_methods_fields_in_its_sub_config(name, tiny_config):
    """<0.1 s: the method's own fields live in DraftConfig.options (a dataclass of its module),
    flat outside: to_dict flattens them in place and make_draft_config takes them back."""
    method = method_named(name)
    shape = SimpleNamespace(num_layers=None, parallel_depth=None, mask_token_id=None)
    cfg = tiny_config(
        **method.draft_fields(shape, 3, SimpleNamespace(vocab_size=50, pad_token_id=0))
    )
    assert type(cfg.options) is method.options_type
    assert cfg.options.fc_norm is cfg.options.norm_output is bool(method.switches)
    flat = cfg.to_dict()
    assert "options" not in flat and make_draft_config(**flat) == cfg
    names = list(flat)
    own = [f for f in names if hasattr(cfg.options, f)]
    assert names[names.index("method") + 1 : names.index("method") + 1 + len(own)] == own


def test_a_method_drops_other_methods_unset_fields_and_refuses_set_ones(tiny_config):
    """<0.1 s: a peer's config.json may carry other methods' keys at their unset values (each
    sub-config's default), and a model.draft may leave them null; set ones are refused in one
    line naming the method that reads them, in make_draft_config and in the recipe's check."""
    peagle = {k: v for k, v in vars(PEagleOptions()).items() if k not in vars(EAGLE3_OPTIONS)}
    assert set(peagle) == set(OPTION_FIELDS) - set(vars(EAGLE3_OPTIONS))
    assert {k: UNSET[k] for k in peagle} == peagle
    assert tiny_config(**peagle) == tiny_config()
    with pytest.raises(
        Eagle3Error,
        match="mask_token_id 3: a setting of method p-eagle; method 'eagle3.1' does not read it",
    ):
        tiny_config(method="eagle3.1", mask_token_id=3)
    shape = SimpleNamespace(method="eagle3", num_layers=1, parallel_depth=4, mask_token_id=None)
    problems = []
    model = SimpleNamespace(draft=shape, feature="aux")
    check_recipe(model, SimpleNamespace(), lambda ok, msg: ok or problems.append(msg))
    assert problems == [
        "model.draft.parallel_depth is a setting of method p-eagle; model.draft.method eagle3 "
        "does not read it: leave it null"
    ]


@pytest.mark.parametrize(
    "name, trees, unroll, served",
    [
        ("eagle3", True, True, {}),
        ("eagle3.1", True, True, {}),
        ("p-eagle", False, False, {"parallel_drafting": True}),  # K drafts from one pass
    ],
)
def test_each_method_answers_what_others_ask(name, trees, unroll, served):
    """<0.1 s: the facts the quickstart, the memory plan and the engine ask of a method; a
    method that trains otherwise than by the TTT unroll says what the memory plan leaves out."""
    method = method_named(name)
    assert (method.drafts_trees, method.ttt_unroll, method.served_extra()) == (
        trees,
        unroll,
        served,
    )
    assert (method.unmodelled_memory is None) == method.ttt_unroll


@pytest.mark.parametrize(
    "raw, name",
    [
        ({}, "eagle3"),
        ({"fc_norm": True}, "eagle3"),  # one switch: EAGLE-3 with it, as vLLM serves it
        ({"fc_norm": True, "norm_output": True}, "eagle3.1"),
        (
            {"eagle_config": {"method": "eagle3.1"}, "fc_norm": True, "norm_output": True},
            "eagle3.1",
        ),
        ({"method": "p-eagle", "fc_norm": True}, "p-eagle"),
    ],
)
def test_the_method_of_a_published_config(raw, name):
    """<0.1 s: what a config.json records, or a peer's switches imply."""
    assert method_of_published(raw, "ckpt") is method_named(name)


def test_an_unknown_method_is_one_line_error(tiny_config):
    """<0.1 s: the registry names the methods it knows."""
    with pytest.raises(Eagle3Error, match=r"method 'eagle4' is not one of \('eagle3'"):
        method_named("eagle4")


def test_method_names_appear_only_in_the_registry():
    """~0.2 s: no product module outside eagle3/methods/ compares a method's name as a string
    literal (EAGLE-3's own name is also vLLM's and speculators' algorithm name, so it is not
    checked)."""
    names = [name for name in REGISTRY if name != EAGLE3.name]
    literal = re.compile("|".join(rf"[\"']{re.escape(name)}[\"']" for name in names))
    found = [
        f"{path.relative_to(REPO)}:{n}"
        for top in PRODUCT
        for path in sorted((REPO / top).rglob("*.py"))
        if "methods" not in path.relative_to(REPO).parts
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if literal.search(line)
    ]
    assert not found, found


def test_loading_a_checkpoint_imports_no_decoder():
    """~3 s (a fresh interpreter): eagle3.checkpoint and the registry load no decoding loop."""
    code = (
        "import sys, eagle3.checkpoint, eagle3.methods; "
        "print(sorted(m for m in sys.modules if m.startswith('eagle3.decoding') or "
        "m.endswith('.decoding')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
