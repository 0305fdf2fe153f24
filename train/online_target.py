"""Online training's served target: the first rank of each node starts the node's vLLM server,
every rank of the node sends its sequences to it, and the next step is captured while the ranks
train on this one (target.engine.kind: vllm).

With target.engine.url, no server is started: every rank of every node sends to that running
capture server (python -m datagen.capture --serve on the node that serves, the same client and
hidden-state files by path as a capture's --engine-url), and rank 0 prints its count once.

A node's ranks find their server at 127.0.0.1 on the node's port: target.engine.port, which
each node's command line may set on its own (nodes that share a host need different ones; a
port already taken is refused in one line), else MASTER_PORT + 1, the same on every node.
When training ends, rank 0 prints each node's server's own count of the requests it served
next to what that node's ranks sent: they are equal when every rank used its own node's server."""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import gather_object

from eagle3.engine.client import EngineClient
from eagle3.engine.served_target import ServedTarget, describe_served_target
from eagle3.engine.server import free_port
from eagle3.engine.venv import INSTALL_HINT, engine_available
from eagle3.errors import ConfigError, Eagle3Error, RemoteError
from eagle3.targets import ResolvedTarget
from train.config import Config
from train.distributed import node_rank, num_nodes


def engine_port(cfg: Config, accelerator: Accelerator) -> int:
    """The port of this node's engine: configured, MASTER_PORT + 1 when several processes
    (every rank of a node derives the same one without talking), else any free port."""
    if cfg.target.engine.port:
        return cfg.target.engine.port
    if accelerator.num_processes == 1:
        return free_port()
    if "MASTER_PORT" not in os.environ:
        raise ConfigError("several processes without MASTER_PORT: set target.engine.port")
    return int(os.environ["MASTER_PORT"]) + 1


def describe_target(cfg: Config, model: ResolvedTarget, aux_ids: list[int]) -> ServedTarget:
    """The served target as its files describe it (tokenizer, shapes, final norm), not started:
    every cheap check of the run happens before an engine spends minutes loading it."""
    if cfg.target.engine.url is None and not engine_available():  # a remote one needs none here
        raise Eagle3Error(f"target.engine.kind=vllm needs the vLLM engine venv: {INSTALL_HINT}")
    served = describe_served_target(
        model,
        aux_ids,
        "target.aux_layer_ids",
        concurrency=cfg.target.engine.concurrency,
    )
    served.check_length(cfg.data.max_length, "data.max_length")
    return served


def start_served(cfg: Config, accelerator: Accelerator, served: ServedTarget) -> None:
    """The first rank of each node starts the node's vLLM server; the node's other ranks wait
    until it answers and then send it their sequences too. With target.engine.url every rank
    uses that running server, which must answer now and serve this target (one line if not)."""
    e = cfg.target.engine
    if e.url:
        if accelerator.is_main_process:
            print(f"using the vLLM capture server at {e.url} (target.engine.url) for "
                  f"{served.name}", flush=True)  # fmt: skip
        served.attach(e.url)
        return
    port = engine_port(cfg, accelerator)
    startup_timeout = e.startup_timeout_s or served.startup_timeout  # null: the target's
    if accelerator.is_local_main_process:
        if not port_free(port):  # else this node's ranks could train on another node's server
            raise ConfigError(
                f"port {port} for this node's engine is already in use on {socket.gethostname()} "
                "(another node's engine on the same host?): give each node that shares a host "
                "its own target.engine.port=PORT on its command line"
            )
        # nodes sharing a host and an out_dir (a one-machine rehearsal) each keep their own log
        node = f"-node{node_rank()}" if num_nodes(accelerator) > 1 else ""
        log_path = e.log or Path(cfg.train.out_dir) / f"engine-{socket.gethostname()}{node}.log"
        served.start(
            cfg.data.max_length,
            tensor_parallel_size=e.tensor_parallel_size,
            extra_args=e.args,
            log_path=log_path,
            port=port,
            startup_timeout=startup_timeout,
            startup_timeout_knob="target.engine.startup_timeout_s",
            dtype=None if cfg.target.dtype == "auto" else cfg.target.dtype,
            say=lambda line: print(line, flush=True),
        )
        return
    client = EngineClient(f"http://127.0.0.1:{port}", served.name)
    # the local main process is starting it (and raises, ending the run, if it fails)
    if not client.wait_healthy(time.monotonic() + startup_timeout + 60):
        raise RemoteError(
            f"no engine answered on port {port} within the startup timeout: see the local main "
            "process's error and the engine's log"
        )
    served.attach(client.base_url)


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether nothing listens on host:port. SO_REUSEADDR as the engine's own server binds: the
    connections a killed run's engine left in TIME_WAIT do not make the port taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def report_engines(accelerator: Accelerator, target: ServedTarget, remote: bool = False) -> None:
    """Every rank, once none needs its engine any more: the requests in flight finish, then each
    node's first rank asks its server how many it served; rank 0 prints one line per node with
    that count beside the requests the node's ranks sent (the client's count). A server at
    target.engine.url (`remote`) is shared by every node: rank 0 alone asks it, and its count
    is since it started, not only this run's."""
    target.stop_requests(wait=True)  # a prefetched step's requests: counted on both sides
    accelerator.wait_for_everyone()
    served = None
    if accelerator.is_main_process if remote else accelerator.is_local_main_process:
        try:
            served = target.server.requests_served()
        except RemoteError:  # the drafter is exported already: a report is no reason to fail
            served = "an unknown number of"
    mine = (node_rank(), accelerator.process_index, sum(target.sent.values()), served)
    rows = gather_object([mine]) if accelerator.num_processes > 1 else [mine]
    if not accelerator.is_main_process:
        return
    if remote:
        sent = " + ".join(f"rank {r[1]}: {r[2]}" for r in rows)
        print(f"engine at {target.server.base_url}: served {served} requests since it started; "
              f"the ranks sent {sent}", flush=True)  # fmt: skip
        return
    for node in sorted({r[0] for r in rows}):
        ranks = [r for r in rows if r[0] == node]
        count = next(r[3] for r in ranks if r[3] is not None)
        sent = " + ".join(f"rank {r[1]}: {r[2]}" for r in ranks)
        print(f"engine of node {node}: served {count} requests; its ranks sent {sent}", flush=True)


def captured_ahead(
    stream: Iterator[tuple[int, list[dict]]], target: ServedTarget
) -> Iterator[tuple[int, list[dict]]]:
    """The step stream with each micro-batch's hidden states attached, the next step's already
    requested: the engine forwards step n+1 while the ranks train on step n."""
    pending: deque = deque()

    def request() -> None:
        epoch, micro = next(stream)  # endless
        futures = [target.capture_async(b["input_ids"], b["attention_mask"]) for b in micro]
        pending.append((epoch, micro, futures))

    request()
    while True:
        request()
        epoch, micro, futures = pending.popleft()
        for batch, future in zip(micro, futures):
            batch["aux_hidden"], batch["last_hidden"] = future.result()
        yield epoch, micro
