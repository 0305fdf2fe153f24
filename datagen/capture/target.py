"""The capture's target: in-process (HF), or served by vLLM (``--engine``, ``--engine-url``), and
``--serve``: one capture server for ``--target``, for captures on other nodes (``--engine-url``)."""

from __future__ import annotations

import time

from datagen.capture.settings import CaptureSettings
from eagle3.data.chat import check_renderable
from eagle3.engine.served_target import ServedTarget, describe_served_target
from eagle3.errors import RemoteError
from eagle3.targets import ResolvedTarget, TargetModel, load_target, resolve


def load_capture_target(s: CaptureSettings, state, model: ResolvedTarget) -> TargetModel:
    """The target (`model`: --target resolved once) with a tokenizer and a chat template to
    render with: in-process on this process's device, or (--engine) as vLLM will serve it, not
    started yet."""
    if s.engine.kind or s.engine_urls:
        target = describe_served_target(
            model, s.aux_layers, "--aux-layers", concurrency=s.engine_concurrency
        )
        target.check_length(s.rendering.max_length, "--max-length")
    else:
        target = load_target(
            model,
            dtype=s.model_dtype,
            device=s.device or (None if s.device_map else str(state.device)),
            device_map=s.device_map,
            aux_layer_ids=s.aux_layers,
        )
    check_renderable(target.tokenizer, s.rendering.chat_template, s.target)
    return target


def start_capture_engine(s: CaptureSettings, target: ServedTarget) -> ServedTarget:
    """Attach to the running servers of --engine-url, or start the managed vLLM server the
    engine flags ask for, with the capture connector."""
    if s.engine_urls:
        return target.attach(*s.engine_urls)
    return target.start(
        s.rendering.max_length,
        tensor_parallel_size=s.engine.tensor_parallel_size,
        extra_args=list(s.engine.extra_args),
        log_path=s.engine.log_path,
        host=s.host,
        port=s.port,
        startup_timeout=s.engine.startup_timeout_s,
    )


def run_serve(s: CaptureSettings) -> int:
    """--serve: one capture server for --target, up until Ctrl-C or SIGTERM (then stopped with
    its engine and temp dir); RemoteError (exit 69) if its engine dies."""
    import signal
    import socket

    def interrupt(signum, frame):
        raise KeyboardInterrupt  # SIGTERM stops it as Ctrl-C does: the engine goes with it

    signal.signal(signal.SIGTERM, interrupt)
    target = load_capture_target(s, None, resolve(s.target))
    start_capture_engine(s, target)
    server = target.server
    host = socket.getfqdn() if s.host in ("0.0.0.0", "::") else s.host
    print(f"capture server for {target.name}: http://{host}:{server.port} (Ctrl-C stops it); "
          f"capture through it with --engine-url http://{host}:{server.port}", flush=True)  # fmt: skip
    try:
        while server.running():
            time.sleep(1)
        raise RemoteError(f"the capture server's engine exited (log {server.log_path})")
    except KeyboardInterrupt:
        return 0
    finally:
        target.stop()
