"""A target served by a vLLM engine: its hidden states come back through the capture connector.

    served = describe_served_target("smollm2-135m-q4")
    served.start(max_length=2048)             # a managed vLLM server with the connector
    aux, last = served.capture(input_ids, attention_mask)   # as eagle3.targets.Target.capture
    served.stop()

The process that uses it never builds the model: it reads the target's identity, tokenizer and
final norm from the checkpoint's files, and the engine (its own process, its own GPUs, its own
kernels, INT4 where the engine has them) runs every forward. Each request asks for one token of
a prompt of exact token ids; the engine's capture connector writes that prompt's hidden
states of the requested layers to a file, named in the response, which is read and deleted
(the protocol: eagle3.engine.capture).

It implements eagle3.targets.TargetModel, as Target does (`served` is True here). What
comes back is `capture`'s contract of eagle3.targets.Target: aux [B, T, 3H] = the outputs of
the project's aux layer ids in that order (vLLM's ids are ours + 1), last [B, T, H] = the final
hidden state after the target's final norm (lm_head's input: vLLM returns it pre-norm),
padded positions zero. datagen.capture --engine and online training with `target.engine` both
go through here.

Several servers (`attach(url, url, ...)`: replicas of the same target, each started with the
capture connector, e.g. by `python -m datagen.capture --serve` on every node) share the
requests: each one goes to the server with the fewest in flight (then the fewest answered), so a
faster server takes more.
A server that stops answering (connection refused or reset, no answer in time) is dropped with
a warning and its requests go to the others; with none left the RemoteError ends the run.
`sent` counts the requests each server answered.
"""

from __future__ import annotations

import logging
import shutil
import sys
import threading
import urllib.error
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from eagle3.checkpoint import check_aux_ids, vllm_aux_layer_ids
from eagle3.engine.capture import capture_engine_args, make_hidden_dir, read_hidden_states
from eagle3.engine.client import EngineClient
from eagle3.engine.server import DEFAULT_STARTUP_TIMEOUT_S, startup_timeout_for, vllm_server
from eagle3.errors import Eagle3Error, RemoteError
from eagle3.targets import (
    ResolvedTarget,
    check_context,
    default_aux_layers,
    load_final_norm,
    load_tokenizer,
    resolve,
    rms_norm,
    target_facts,
)

log = logging.getLogger(__name__)


class ServedTarget:
    """What a client needs of a target served by vLLM (see the module docstring): its identity
    (from describe_served_target), then start() or attach() for the engine, stop() to end."""

    served = True  # the forwards run in the engine's process

    def __init__(
        self,
        *,
        name: str,
        hf_dir: str,
        tokenizer: Any,
        vocab_size: int,
        hidden_size: int,
        num_layers: int,
        aux_layer_ids: list[int],
        norm_weight: torch.Tensor,
        norm_eps: float,
        context: int | None = None,
        concurrency: int = 16,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S,
    ):
        self.name = name
        self.hf_dir = hf_dir
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.aux_layer_ids = aux_layer_ids
        self.norm_weight = norm_weight
        self.norm_eps = norm_eps
        self.context = context  # max_position_embeddings: the engine's longest max_model_len
        self.concurrency = concurrency  # requests in flight (the engine batches them)
        self.startup_timeout = startup_timeout  # start()'s default: seconds to healthy
        self.servers: list[EngineClient] = []  # once started or attached: the live ones
        self.sent: Counter[str] = Counter()  # requests answered, by server base_url
        self._in_flight: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.owned = False  # start() made the server, so stop() stops it (attach() does not)
        self.hidden_dir: Path | None = None  # where the connector writes (our temp dir)
        self.serving: dict[str, Any] | None = None  # start(): dtype and attention backend, why
        self._pool: ThreadPoolExecutor | None = None
        self._assembly: ThreadPoolExecutor | None = None

    def __repr__(self) -> str:
        state = ", ".join(s.base_url for s in self.servers) or "stopped"
        return f"ServedTarget({self.name!r}, {self.hf_dir!r}, {state})"

    @property
    def server(self) -> EngineClient | None:
        """The (first) server, None before start() or attach()."""
        return self.servers[0] if self.servers else None

    # -- the engine --------------------------------------------------------------------------
    def engine_layer_ids(self) -> list[int]:
        """vLLM's layer ids to extract: our aux ids + 1, then the last layer (pre-norm)."""
        return vllm_aux_layer_ids(self.aux_layer_ids) + [self.num_layers]

    def check_length(self, max_length: int, what: str) -> None:
        """One line when max_length and the one token generated do not fit the target's
        context (vLLM refuses them)."""
        check_context(self.name, self.context, max_length, what, spare=1)

    def start(
        self,
        max_length: int,
        *,
        tensor_parallel_size: int | None = None,
        extra_args: list[str] = (),
        log_path: str | Path | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
        startup_timeout: float | None = None,
        startup_timeout_knob: str | None = None,
        dtype: str | None = None,
        say=log.info,
    ) -> ServedTarget:
        """Start a managed vLLM server for this target with the capture connector; its hidden
        states go to a fresh temp dir (eagle3.engine.capture.make_hidden_dir), removed by
        stop(). `say` gets the one "starting vLLM" line (dtype and attention backend served,
        and why: eagle3.engine.choice.choose_serving). startup_timeout: seconds to healthy
        (None: self.startup_timeout, the target's); startup_timeout_knob:
        the flag or config key a timeout's error tells the user to raise (None: the CLIs')."""
        self.hidden_dir = make_hidden_dir()
        try:
            server = vllm_server(
                self.hf_dir,
                **({"dtype": dtype} if dtype else {}),  # else: choose_serving's default
                served_model_name=self.name,
                max_model_len=min(max_length + 8, self.context or sys.maxsize),
                tensor_parallel_size=tensor_parallel_size,
                log_path=log_path,
                port=port,
                host=host,
                startup_timeout=startup_timeout or self.startup_timeout,
                **({"startup_timeout_knob": startup_timeout_knob} if startup_timeout_knob else {}),
                extra_args=[
                    *capture_engine_args(self.engine_layer_ids(), self.hidden_dir),
                    *extra_args,
                ],
            )
            self.serving = server.serving.as_dict()
            say(f"starting vLLM for {self.name} on port {server.port}: "
                f"{server.serving.describe()}; capturing vLLM layer ids "
                f"{self.engine_layer_ids()}; log {server.log_path or 'a temp file'}")  # fmt: skip
            self.servers = [server.start()]
        except BaseException:  # a refused dtype, a dead engine, Ctrl-C: no temp dir left
            shutil.rmtree(self.hidden_dir, ignore_errors=True)
            self.hidden_dir = None
            raise
        self.owned = True
        log.info("vLLM up at %s after %.0f s", server.base_url, server.startup_seconds)
        return self

    def attach(self, *base_urls: str) -> ServedTarget:
        """Use servers someone else started with this target's capture connector (one, or
        several replicas sharing the requests). Each must answer GET /health and serve this
        target's name, else one line says which does not."""
        clients = []
        for url in base_urls:
            client = EngineClient(url).start()  # RemoteError: not up at that address
            if client.model != self.name:
                raise Eagle3Error(
                    f"the engine at {client.base_url} serves {client.model!r}, not {self.name!r}: "
                    "give the URLs of servers started for this target (python -m datagen.capture "
                    "--serve --target ...)"
                )
            clients.append(client)
        self.servers, self.owned = clients, False
        return self

    def stop_requests(self, wait: bool = False) -> None:
        """Drop the request threads (queued requests are cancelled; wait=True lets those in
        flight finish first, so `sent` and the servers' counts agree); new ones start on use."""
        for pool in (self._pool, self._assembly):
            if pool is not None:
                pool.shutdown(wait=wait, cancel_futures=True)
        self._pool = self._assembly = None

    def stop(self) -> None:
        """Stop the server if we started it, drop the request threads and the temp dir."""
        self.stop_requests()
        if self.owned:
            for server in self.servers:
                server.stop()
        self.servers, self.owned = [], False
        if self.hidden_dir is not None:
            shutil.rmtree(self.hidden_dir, ignore_errors=True)
            self.hidden_dir = None

    # -- hidden states ---------------------------------------------------------------------------
    def hidden_states(self, token_ids: list[int], label: str = "a prompt") -> torch.Tensor:
        """One prompt of token ids -> the engine's [T, 4, H] (aux layers, then pre-norm last)."""
        server, reply = self._ask(token_ids)
        path = (reply.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise RemoteError(
                f"the engine at {server.base_url} returned no "
                "kv_transfer_params.hidden_states_path: start it with the capture connector "
                "(eagle3.engine.capture.capture_engine_args)"
            )
        data = read_hidden_states(path, cleanup=True)
        got = data["token_ids"].tolist()
        if got != list(token_ids):
            raise RemoteError(
                f"{label}: the engine saw {len(got)} tokens that differ from the "
                f"{len(token_ids)} sent; it must be sent token ids, not text"
            )
        hidden = data["hidden_states"]
        want = (len(self.engine_layer_ids()), self.hidden_size)
        if tuple(hidden.shape[1:]) != want:
            raise RemoteError(
                f"the engine at {server.base_url} captured {tuple(hidden.shape[1:])} (layers, "
                f"hidden) per token, not {want}: it was started for other aux layers or another "
                "model; start it with this --target and --aux-layers"
            )
        return hidden

    def _ask(self, token_ids: list[int]) -> tuple[EngineClient, dict]:
        """One completion from the live server with the fewest requests in flight; a server
        that stopped answering is dropped and the request goes to another."""
        while True:
            with self._lock:
                if not self.servers:
                    raise Eagle3Error("the served target is not started: call start() or attach()")
                # fewest in flight, then fewest answered: with one request in flight, by turns
                server = min(
                    self.servers, key=lambda c: (self._in_flight[c.base_url], self.sent[c.base_url])
                )
                self._in_flight[server.base_url] += 1
            try:
                reply = server.complete(token_ids, max_tokens=1, temperature=0.0)
            except RemoteError as err:
                if not self._drop(server, err):
                    raise
                continue
            finally:
                with self._lock:
                    self._in_flight[server.base_url] -= 1
            with self._lock:
                self.sent[server.base_url] += 1
            return server, reply

    def _drop(self, server: EngineClient, err: RemoteError) -> bool:
        """Drop a server that stopped answering when others are left -> whether it was."""
        cause = err.__cause__
        gone = isinstance(cause, OSError) and not isinstance(cause, urllib.error.HTTPError)
        with self._lock:
            if not gone:  # the server answered with an error: the request itself is at fault
                return False
            if server not in self.servers:  # another request thread dropped it already
                return True
            if len(self.servers) == 1:  # the last one: the run ends with its error
                return False
            self.servers.remove(server)
            left = len(self.servers)
        log.warning("the engine at %s stopped answering (%s): dropped, its requests go to the "
                    "%d other server(s)", server.base_url, cause, left)  # fmt: skip
        return True

    def features(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's [T, 4, H] -> (aux [T, 3H], last [T, H] after the final norm), fp32."""
        t = hidden.shape[0]
        aux = hidden[:, :3].float().reshape(t, -1)
        last = rms_norm(hidden[:, 3].float(), self.norm_weight, self.norm_eps)
        return aux, last

    def pool(self) -> ThreadPoolExecutor:
        """The request threads (one request each: the engine batches what is in flight)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max(1, self.concurrency), "served-target")
        return self._pool

    def assembler(self) -> ThreadPoolExecutor:
        """One thread that waits for a batch's rows and pads them (never a request thread,
        so a batch wider than `concurrency` cannot wait on itself)."""
        if self._assembly is None:
            self._assembly = ThreadPoolExecutor(1, "served-target-batch")
        return self._assembly

    def capture_async(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> Future:
        """Start `capture` in the background: every row is its own request, all in flight."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        ids, keep = input_ids.cpu(), attention_mask.cpu().bool()
        rows = [self.pool().submit(self.hidden_states, ids[b][keep[b]].tolist())
                for b in range(ids.shape[0])]  # fmt: skip

        def assemble() -> tuple[torch.Tensor, torch.Tensor]:
            B, T = ids.shape
            aux = torch.zeros(B, T, 3 * self.hidden_size)
            last = torch.zeros(B, T, self.hidden_size)
            for b, row in enumerate(rows):
                aux[b, keep[b]], last[b, keep[b]] = self.features(row.result())
            return aux, last

        return self.assembler().submit(assemble)

    def capture(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, attention_mask [B, T] -> (aux [B, T, 3H], last [B, T, H]) on the CPU, as
        eagle3.targets.Target.capture (left or right padding; padded positions are zeros)."""
        return self.capture_async(input_ids, attention_mask).result()


def describe_served_target(
    name: str | ResolvedTarget,
    aux_layer_ids: list[int] | None = None,
    what: str = "aux layer ids",
    *,
    concurrency: int = 16,
) -> ServedTarget:
    """A ServedTarget for registry name / HF dir `name`, read from its files (no weights but
    the final norm); aux ids default to the registry's, else [1, L//2 - 1, L - 4].
    `concurrency`: requests in flight (the engine batches them)."""
    target = resolve(name)
    facts = target_facts(target)
    layers = int(facts["num_layers"])
    aux = list(aux_layer_ids or facts["aux_layer_ids"] or default_aux_layers(layers))
    aux = check_aux_ids(aux, what)  # vLLM returns them in layer order
    if aux[-1] >= layers:
        raise Eagle3Error(f"{what} {aux}: the target has {layers} layers (ids 0..{layers - 1})")
    context = getattr(facts["hf_config"], "max_position_embeddings", None)
    weight, eps = load_final_norm(target)
    return ServedTarget(
        name=target.name,
        hf_dir=target.hf_dir,
        tokenizer=load_tokenizer(target),
        vocab_size=int(facts["vocab_size"]),
        hidden_size=int(facts["hidden_size"]),
        num_layers=layers,
        aux_layer_ids=aux,
        norm_weight=weight.float(),
        norm_eps=eps,
        context=int(context) if context else None,
        concurrency=concurrency,
        startup_timeout=startup_timeout_for(target),
    )
