"""Every CLI's --help shows each option's default once (eagle3.cli.HelpFormatter)."""

from __future__ import annotations

import argparse
import importlib
import re

import pytest

from eagle3.cli import shows_default

CLIS = [
    "datagen.openrouter.cli",
    "datagen.local",
    "datagen.offpolicy",
    "datagen.capture",
    "datagen.audit",
    "eagle3.evaluate",
    "eagle3.compare",
    "scripts.quickstart",  # scripts/quickstart.py (what scripts/quickstart.sh runs)
    "train.train_drafter",
]


def run_help(module: str, monkeypatch, capsys) -> tuple[argparse.ArgumentParser, str]:
    """`python -m MODULE --help`, in-process: (the parser that printed it, the text)."""
    printed = []
    real = argparse.ArgumentParser.print_help

    def keep(self, file=None):
        printed.append(self)
        real(self, file)

    monkeypatch.setattr(argparse.ArgumentParser, "print_help", keep)
    # no wrapping: argparse breaks long words at hyphens, so a default path inside a checkout
    # named like ci-run would print as "ci- run" and match nothing
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit) as exit:
        importlib.import_module(module).main(["--help"])
    assert exit.value.code == 0 and len(printed) == 1
    return printed[0], capsys.readouterr().out


def entries(text: str) -> dict[str, str]:
    """First option string -> that option's help entry, whitespace collapsed."""
    out: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if re.match(r"^  \S", line):  # an entry starts two spaces in; its help wraps deeper
            key = re.split(r"[ ,]", line.strip())[0]
            out[key] = ""
        elif not line.startswith(" "):  # usage, a group title
            key = None
        if key is not None:
            out[key] = " ".join(f"{out[key]} {line}".split())
    return out


@pytest.mark.parametrize("module", CLIS)
def test_help_shows_every_default_once(module, monkeypatch, capsys):
    parser, text = run_help(module, monkeypatch, capsys)
    found = entries(text)
    for action in parser._actions:
        if not action.option_strings or not shows_default(action):
            continue
        entry = found[action.option_strings[0]]
        value = re.escape(str(action.default))
        assert re.search(rf"\bdefault:? {value}(?=[ ,;)]|$)", entry), entry
        assert len(re.findall(r"\bdefault[: ]", entry)) == 1, entry  # said once


def test_evaluate_help_names_the_decoding_defaults(monkeypatch, capsys):
    _, text = run_help("eagle3.evaluate", monkeypatch, capsys)
    found = entries(text)
    assert found["--steps"] == "--steps STEPS chain: draft tokens per step (default: 7)"
    assert found["--topk"] == "--topk TOPK tree: branching (default: 10)"
    assert found["--max-new-tokens"] == "--max-new-tokens MAX_NEW_TOKENS (default: 256)"
    assert found["--threads"] == "--threads THREADS torch CPU threads (default: torch's)"
    assert "None" not in text  # an option without a default says nothing about it


# every CLI that starts a managed engine, with the least argv it parses
ENGINE_CLIS = {
    "datagen.capture": ["--target", "t", "--data", "d", "--out", "o", "--engine", "vllm"],
    "datagen.local": ["--prompts", "mt_bench", "--out", "o", "--target", "t", "--engine", "vllm"],
    "eagle3.evaluate": ["--target", "t", "--draft", "none", "--engine", "vllm"],
}


def engine_settings(module: str, argv: list[str]):
    """The EngineSettings a CLI reads from argv."""
    from eagle3.engine.server import EngineSettings

    cli = importlib.import_module(module)
    if module == "datagen.capture":
        return cli.parse_args(argv).engine
    args = (
        cli.parse_args(argv) if module == "datagen.local" else cli.build_parser().parse_args(argv)
    )
    return EngineSettings.from_args(args)


@pytest.mark.parametrize("module", sorted(ENGINE_CLIS))
def test_every_managed_engine_takes_a_startup_timeout(module, monkeypatch, capsys):
    """~0.2 s each. --engine-startup-timeout SECONDS is in each engine CLI's help (saying
    where its default comes from) and reaches the engine settings; unset, the target's
    registry decides (None); 0 is refused by argparse (exit 2)."""
    _, text = run_help(module, monkeypatch, capsys)
    entry = entries(text)["--engine-startup-timeout"]
    assert entry.startswith("--engine-startup-timeout SECONDS") and "kimi-k2.5" in entry
    argv = ENGINE_CLIS[module]
    assert engine_settings(module, argv).startup_timeout_s is None
    assert (
        engine_settings(module, [*argv, "--engine-startup-timeout", "7200"]).startup_timeout_s
        == 7200
    )
    with pytest.raises(SystemExit) as exit:
        engine_settings(module, [*argv, "--engine-startup-timeout", "0"])
    assert exit.value.code == 2 and "seconds > 0" in capsys.readouterr().err
