"""train/online_target.py with target.engine.url: online training through a running capture
server on another node, against a fake one here (no vLLM).

The fake speaks what a `python -m datagen.capture --serve` server speaks to its clients:
GET /health, /v1/models (the served target's name), /metrics (vllm:request_success_total), and
POST /v1/completions of token ids whose reply names a safetensors file of the prompt's hidden
states ([T, layers, H] and its token ids) written into a directory this process reads by path,
as the capture connector does (eagle3.engine.capture). What it cannot show: a real vLLM on
another host writing into a TMPDIR both hosts see (the real server and the same client:
tests/datagen/test_capture_servers.py, tests/train/test_online_engine.py).
"""

from __future__ import annotations

import json
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from eagle3.engine.served_target import ServedTarget
from eagle3.engine.server import free_port
from eagle3.errors import Eagle3Error, RemoteError
from train.config import load_config
from train.online_target import report_engines, start_served

H, LAYERS = 4, 3  # the fake target's hidden size and depth


def hidden_of(ids: list[int]) -> torch.Tensor:
    """The fake engine's [T, 4, H] for a prompt: a function of token, layer and channel."""
    t = torch.tensor(ids, dtype=torch.float32)[:, None, None]
    layer = torch.arange(4, dtype=torch.float32)[None, :, None]
    channel = torch.arange(H, dtype=torch.float32)[None, None, :]
    return t + 0.1 * layer + 0.01 * channel


class FakeCaptureServer:
    """A capture server's HTTP side on 127.0.0.1; hidden states go to `out_dir` by path."""

    def __init__(self, name: str, out_dir: Path):
        self.name, self.out_dir, self.served = name, out_dir, 0
        self.lock = threading.Lock()  # request threads count and name files
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, body: str | dict, kind="application/json") -> None:
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    self.reply("")
                elif self.path == "/v1/models":
                    self.reply({"data": [{"id": fake.name}]})
                elif self.path == "/metrics":
                    line = f'vllm:request_success_total{{finished_reason="length"}} {fake.served}\n'
                    self.reply(line, "text/plain")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                ids = list(body["prompt"])
                with fake.lock:
                    fake.served += 1
                    path = fake.out_dir / f"req-{fake.served}.safetensors"
                save_file(
                    {"hidden_states": hidden_of(ids), "token_ids": torch.tensor(ids)}, str(path)
                )
                self.reply({"choices": [{"text": "x"}],
                            "kv_transfer_params": {"hidden_states_path": str(path)}})  # fmt: skip

        return Handler

    def __enter__(self) -> FakeCaptureServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def served_target() -> ServedTarget:
    return ServedTarget(
        name="fake-target", hf_dir="/nowhere", tokenizer=None, vocab_size=16, hidden_size=H,
        num_layers=LAYERS, aux_layer_ids=[0, 1, 2], norm_weight=torch.ones(H), norm_eps=1e-6,
        concurrency=2,
    )  # fmt: skip


def online_config(url: str):
    return load_config(
        None,
        ["data.mode=online", "data.records=[r]", "target.engine.kind=vllm",
         f"target.engine.url={url}"],
        check_paths=False,
    )  # fmt: skip


ONE_PROCESS = SimpleNamespace(is_main_process=True, is_local_main_process=True, num_processes=1,
                              process_index=0, wait_for_everyone=lambda: None)  # fmt: skip


def test_online_training_uses_the_running_server_at_target_engine_url(capsys):
    """~1 s. With target.engine.url nothing is started here: the served target attaches to the
    server there, a padded batch's rows come back as the hidden states the server wrote (read
    by path, files removed), and the end-of-run report is one line for that shared server."""
    with tempfile.TemporaryDirectory() as shared, FakeCaptureServer("fake-target", Path(shared)) as fake:  # fmt: skip
        served = served_target()
        start_served(online_config(fake.url), ONE_PROCESS, served)
        assert [s.base_url for s in served.servers] == [fake.url] and not served.owned
        assert f"capture server at {fake.url} (target.engine.url)" in capsys.readouterr().out
        ids = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 3]])
        mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])  # left padding
        aux, last = served.capture(ids, mask)
        for b, row in enumerate(([5, 6, 7, 8], [9, 3])):
            want_aux, want_last = served.features(hidden_of(row))
            keep = mask[b].bool()
            assert torch.equal(aux[b, keep], want_aux) and torch.equal(last[b, keep], want_last)
            assert not aux[b, ~keep].any()
        assert not list(Path(shared).iterdir())  # read, then deleted
        report_engines(ONE_PROCESS, served, remote=True)
        line = capsys.readouterr().out.strip()
        assert (
            line
            == f"engine at {fake.url}: served 2 requests since it started; the ranks sent rank 0: 2"
        )
        served.stop()  # not ours: only our threads go


def test_a_url_serving_another_target_or_nothing_is_one_line():
    """~1 s. A server at target.engine.url for another target, or none at that address: one
    line each (exit 2 for the wrong target, 69 for the missing server), before any step."""
    with tempfile.TemporaryDirectory() as shared, FakeCaptureServer("other", Path(shared)) as fake:
        with pytest.raises(Eagle3Error, match="serves 'other', not 'fake-target'") as err:
            start_served(online_config(fake.url), ONE_PROCESS, served_target())
        assert "\n" not in str(err.value) and err.value.exit_code == 2
    nowhere = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RemoteError, match=f"no healthy vLLM server at {nowhere}"):
        start_served(online_config(nowhere), ONE_PROCESS, served_target())
