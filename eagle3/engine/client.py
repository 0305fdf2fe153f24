"""An OpenAI-compatible vLLM server over HTTP: the same interface for one this process started
(eagle3.engine.server.VLLMServer subclasses it) and one someone else runs.

    with EngineClient("http://127.0.0.1:8000") as server:   # start(): GET /health once
        server.chat([{"role": "user", "content": "Hi"}], max_tokens=64)

Every failure of the server (HTTP error, connection refused, no answer in time) is a
RemoteError: the input was fine, the other side was not.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from eagle3.engine.metrics import (
    SpecDecodeMetrics,
    parse_requests_served,
    parse_spec_decode_metrics,
)
from eagle3.errors import RemoteError


class EngineClient:
    """An OpenAI-compatible vLLM server at base_url (e.g. http://127.0.0.1:8000)."""

    def __init__(self, base_url: str, model: str | None = None, *, timeout: float = 600.0):
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self._model = model
        self.timeout = timeout

    # plumbing
    def _request(self, method: str, path: str, body: Any = None, timeout: float | None = None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.base_url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json"} if data is not None else {},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            detail = " ".join(err.read().decode(errors="replace").split())[:500]
            raise RemoteError(
                f"{method} {self.base_url}{path}: HTTP {err.code}: {detail} "
                "(the vLLM server refused it: see its log)"
            ) from err
        except (urllib.error.URLError, OSError) as err:
            raise RemoteError(
                f"{method} {self.base_url}{path} failed: {err} (is the vLLM server still up? "
                "see its log)"
            ) from err

    def get(self, path: str, timeout: float | None = None) -> str:
        return self._request("GET", path, timeout=timeout)[1].decode()

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return json.loads(self._request("POST", path, body)[1])

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            return self._request("GET", "/health", timeout=timeout)[0] == 200
        except RemoteError:
            return False

    def wait_healthy(self, deadline: float, *, alive: Callable[[], None] | None = None) -> bool:
        """Poll GET /health once a second until it answers (True) or time.monotonic() passes
        `deadline` (False). `alive()`, called before each poll, raises when the server's
        process is known to be gone (VLLMServer's own process, say)."""
        while True:
            if alive is not None:
                alive()
            if self.healthy(timeout=2.0):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(1.0)

    @property
    def model(self) -> str:
        """The served model name (asked from /v1/models once if not given)."""
        if self._model is None:
            models = json.loads(self.get("/v1/models")).get("data") or []
            if not models:
                raise RemoteError(
                    f"{self.base_url}/v1/models lists no model: is it a vLLM server? "
                    "pass the served model name"
                )
            self._model = models[0]["id"]
        return self._model

    # API
    def chat(
        self, messages: list[dict[str, Any]], *, max_tokens: int = 128, **extra: Any
    ) -> dict[str, Any]:
        """POST /v1/chat/completions (greedy unless `temperature` is given) -> the response."""
        return self._sample(
            "/v1/chat/completions", messages=messages, max_tokens=max_tokens, **extra
        )

    def complete(
        self, prompt: str | list[int], *, max_tokens: int = 1, **extra: Any
    ) -> dict[str, Any]:
        """POST /v1/completions; `prompt` may be token ids -> the response JSON."""
        return self._sample("/v1/completions", prompt=prompt, max_tokens=max_tokens, **extra)

    def _sample(self, path: str, **body: Any) -> dict[str, Any]:
        return self.post(path, {"model": self.model, "temperature": 0.0, **body})

    def metrics_text(self) -> str:
        return self.get("/metrics")

    def spec_decode_metrics(self) -> SpecDecodeMetrics:
        return parse_spec_decode_metrics(self.metrics_text())

    def requests_served(self) -> int:
        """The requests this server finished since it started (its own count, from /metrics)."""
        return parse_requests_served(self.metrics_text())

    # a remote server needs no lifecycle; these make both kinds usable the same way
    def start(self) -> EngineClient:
        if not self.healthy(timeout=10):
            raise RemoteError(
                f"no healthy vLLM server at {self.base_url} (GET /health failed): start it, "
                "or check the address"
            )
        return self

    def stop(self) -> None:
        pass

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
