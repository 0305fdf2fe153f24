"""OpenRouter's API besides chat (datagen.openrouter.client), against the fake on a real socket:
the key on every call, and a listing OpenRouter cannot give is one line and exit 69."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from datagen.openrouter.client import OpenRouter
from datagen.openrouter.ledger import Ledger
from eagle3.errors import EXIT_UNAVAILABLE, RemoteError

ROUTES = {
    "/api/v1/models/{author}/{slug}/endpoints",
    "/api/v1/key",
    "/api/v1/credits",
    "/api/v1/chat/completions",
    "/api/v1/generation",
}


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def test_every_request_carries_the_key(tmp_path, fake, cli, h, monkeypatch):
    # no_cost: a 200 without usage.cost, counted at worst case, settled by GET /generation
    server = fake(api_key="sk-or-test", faults={"no_cost": 0.5}, seed=3)
    cfg = h.write_config(tmp_path / "c.yaml")
    h.write_prompts(tmp_path / "p.jsonl", 12, multi_every=3)
    args = h.argv(1, cfg, tmp_path / "p.jsonl", tmp_path / "out", server)
    code, _, stderr = cli(*args)
    assert code == 0, stderr
    worst = Ledger(tmp_path / "out" / "ledger.jsonl")
    unknown = [u for u in worst.unknown.values() if u.generation_id]
    assert unknown and worst.spent_usd > server.stats.charged_usd + 1e-6
    worst.close()

    code, stdout, stderr = cli(*args)  # resume: nothing left to generate, the costs settle
    assert code == 0, stderr
    assert f"ledger: settled {len(unknown)} request(s) of unknown cost at $" in stderr
    assert "from GET /generation" in stderr
    led = Ledger(tmp_path / "out" / "ledger.jsonl")
    assert led.spent_usd == pytest.approx(server.stats.charged_usd, abs=1e-9)
    assert f"${server.stats.charged_usd:.2f} spent" in last_line(stdout)
    led.close()
    assert server.stats.unauthorised == 0 and set(server.stats.paths) == ROUTES

    monkeypatch.delenv("OPENROUTER_API_KEY")  # --plan without a key: one line, exit 2
    code, stdout, stderr = cli(*args, "--plan")
    assert code == 2 and server.stats.unauthorised == 1
    assert last_line(stderr) == (
        f"error: {server.server.url} wants an API key for the endpoint listing (401): "
        "export OPENROUTER_API_KEY"
    )


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound once, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_openrouter_is_one_line_and_exit_69(tmp_path, h):
    url = f"http://127.0.0.1:{closed_port()}/api/v1"
    cfg = h.write_config(tmp_path / "c.yaml")
    h.write_prompts(tmp_path / "p.jsonl", 2)
    out = tmp_path / "out"
    unreachable = SimpleNamespace(server=SimpleNamespace(url=url))
    proc = h.spawn_cli(*h.argv(1, cfg, tmp_path / "p.jsonl", out, unreachable))
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_UNAVAILABLE == 69, stderr
    assert "Traceback" not in stderr and stdout == ""
    (line,) = stderr.strip().splitlines()  # one line, nothing else
    assert line.startswith(f"error: cannot reach OpenRouter at {url} (")
    assert line.endswith("check the network and --base-url, then re-run the same command")
    assert not out.exists()  # nothing was started, nothing to lose


async def list_endpoints(status: int, body: str) -> None:
    """``OpenRouter.endpoints`` against a server whose listing answers ``status`` and ``body``."""

    async def listing(request: web.Request) -> web.Response:
        return web.Response(status=status, text=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/api/v1/models/{author}/{slug}/endpoints", listing)
    async with TestServer(app, host="127.0.0.1") as server:
        async with OpenRouter(str(server.make_url("/api/v1"))) as api:
            await api.endpoints("moonshotai/kimi-k2.5")


@pytest.mark.parametrize(
    "status, body, message",
    [
        (503, '{"error": {"message": "down"}}', r"answered HTTP 503: OpenRouter failed; re-run"),
        (200, "<html>a login page</html>", r"gave no endpoint listing \(the endpoints response"),
        (200, '{"data": {"endpoints": null}}', r"gave no endpoint listing"),
    ],
    ids=["http 503", "not json", "no endpoints"],
)
def test_a_listing_openrouter_cannot_give_is_a_remote_error(status, body, message):
    with pytest.raises(RemoteError, match=message) as err:
        asyncio.run(list_endpoints(status, body))
    assert err.value.exit_code == EXIT_UNAVAILABLE and "\n" not in str(err.value)
