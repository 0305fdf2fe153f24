"""``--serve``: one capture server for ``--target``, for captures on other nodes (``--engine-url``)."""

from __future__ import annotations

import time

from datagen.capture.settings import CaptureSettings
from datagen.capture.target import load_capture_target, start_capture_engine
from eagle3.errors import RemoteError
from eagle3.target import resolve


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
