"""eagle3.engine.client without a vLLM server: an unreachable or dying server is a RemoteError
(exit 69: the other side failed), and the one health wait gives up or stops as told."""

from __future__ import annotations

import time

import pytest

from eagle3.engine.client import EngineClient
from eagle3.engine.server import free_port
from eagle3.errors import EXIT_UNAVAILABLE, RemoteError


def test_unreachable_server_is_a_remote_error_in_one_line():
    client = EngineClient(f"http://127.0.0.1:{free_port()}", "m")
    assert not client.healthy(timeout=0.5)
    with pytest.raises(RemoteError, match="no healthy vLLM server") as err:
        client.start()
    assert err.value.exit_code == EXIT_UNAVAILABLE and "\n" not in str(err.value)
    with pytest.raises(RemoteError, match="failed") as err:
        client.complete([1, 2, 3])
    assert "\n" not in str(err.value)


def test_wait_healthy_gives_up_at_the_deadline_or_when_the_process_is_gone():
    client = EngineClient(f"http://127.0.0.1:{free_port()}", "m")
    t0 = time.monotonic()
    assert client.wait_healthy(t0 + 0.5) is False
    assert time.monotonic() - t0 < 10

    def gone() -> None:
        raise RemoteError("the server's process exited")

    with pytest.raises(RemoteError, match="exited"):
        client.wait_healthy(time.monotonic() + 60, alive=gone)
