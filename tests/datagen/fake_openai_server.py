"""A fake OpenAI-compatible chat server (SGLang/vLLM shape) on 127.0.0.1, for tests.

``/v1/chat/completions`` answers deterministically from the last user message: content
``"answer to <text>"`` and ``reasoning_content`` ``"thinking about <text>"`` (like SGLang with a
reasoning parser). Failures are scripted by the user text: ``fail-once`` gets one 503 first,
``bad-request`` always gets 400, ``long`` comes back with ``finish_reason: "length"``.
``/v1/models`` lists one model. Every request body is kept in ``server.requests``.

    with FakeOpenAIServer() as server:   # server.url == "http://127.0.0.1:PORT"
        ...
    python tests/datagen/fake_openai_server.py --port 30000   # standalone
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "fake/target"


class FakeOpenAIServer:
    def __init__(self, port: int = 0, name: str = "fake"):
        self.name = name
        self.requests: list[dict] = []
        self._failed_once: set[str] = set()
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread: threading.Thread | None = None

    def _answer(self, body: dict) -> tuple[int, dict]:
        messages = body.get("messages") or []
        user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        with self._lock:
            self.requests.append(body)
            if "fail-once" in user and user not in self._failed_once:
                self._failed_once.add(user)
                return 503, {"error": {"message": "overloaded", "code": 503}}
        if "bad-request" in user:
            return 400, {"error": {"message": "bad request", "code": 400}}
        finish = "length" if "long" in user else "stop"
        content = f"answer to {user}"
        return 200, {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": body.get("model", MODEL),
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": content,
                        "reasoning_content": f"thinking about {user}",
                    },
                    "finish_reason": finish,
                }
            ],
            "usage": {
                "prompt_tokens": sum(len(m["content"].split()) for m in messages),
                "completion_tokens": len(content.split()),
                "total_tokens": 0,
            },
        }

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, status: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status == 503:
                    self.send_header("Retry-After", "0")
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path.rstrip("/") == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
                else:
                    self._send(404, {"error": {"message": "not found", "code": 404}})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.path.rstrip("/") != "/v1/chat/completions":
                    self._send(404, {"error": {"message": "not found", "code": 404}})
                    return
                self._send(*server._answer(body))

        return Handler

    def start(self) -> FakeOpenAIServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=30000)
    server = FakeOpenAIServer(parser.parse_args().port)
    print(f"serving on {server.url}", flush=True)
    server.httpd.serve_forever()
