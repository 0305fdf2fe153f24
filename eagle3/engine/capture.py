"""The hidden-state capture protocol between this process and a vLLM engine, in one place.

Configured: `capture_engine_args(layer_ids, out_dir)` gives the `--speculative-config`
(vLLM's `extract_hidden_states` method) and `--kv-transfer-config` (the connector in
plugin/eagle3_vllm_capture.py, imported by the engine from PLUGIN_DIR, the one directory of
this project on its PYTHONPATH). Written: the connector writes each finished request's hidden
states to `out_dir/<request id>.safetensors`, holding `.lock` beside it until the file is
complete; the completion's `kv_transfer_params.hidden_states_path` names it. Read:
`read_hidden_states(path)` waits for the lock and loads {"hidden_states": [T, n_ids, H],
"token_ids": [T]}. The out dirs are per process (`make_hidden_dir`), and those of processes
that are gone are swept (`remove_orphaned_hidden_dirs`).

vLLM layer ids: id k = HF `hidden_states[k]` (after k decoder layers, id L = before the final
norm); the project's aux id k is vLLM id k + 1 (`eagle3.checkpoint.vllm_aux_layer_ids`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from eagle3.errors import RemoteError

log = logging.getLogger(__name__)

CAPTURE_CONNECTOR = "HiddenStatesConnector"
CAPTURE_MODULE = "eagle3_vllm_capture"  # plugin/eagle3_vllm_capture.py, top-level in the engine
PLUGIN_DIR = Path(__file__).resolve().parent / "plugin"


# -- configured ---------------------------------------------------------------------------------
def capture_engine_args(layer_ids: Sequence[int], out_dir: str | os.PathLike) -> list[str]:
    """Engine args for hidden-state extraction of vLLM layer ids `layer_ids` into out_dir.

    Use `eagle3.checkpoint.vllm_aux_layer_ids(aux_ids)` for the project's aux ids, and `num_hidden_layers` for the
    pre-final-norm last hidden state (apply the target's final norm for lm_head's input)."""
    ids = [int(i) for i in layer_ids]
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}},
    }
    kv = {
        "kv_connector": CAPTURE_CONNECTOR,
        "kv_connector_module_path": CAPTURE_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(Path(out_dir).resolve())},
    }
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)]


# -- read ---------------------------------------------------------------------------------------
def read_hidden_states(path: str | os.PathLike, *, cleanup: bool = False, timeout: float = 60):
    """-> {"hidden_states": [T, n_ids, H], "token_ids": [T]} from a capture file, waiting for
    the writer's lock (and for the file, up to `timeout` s). cleanup=True deletes both files."""
    from safetensors.torch import load_file

    path = Path(path)
    lock = Path(str(path) + ".lock")
    deadline = time.monotonic() + timeout
    never = (
        f"hidden states {path} never appeared (waited {timeout:.0f} s): the engine's connector "
        "failed to write them (see the engine's log), or wrote them where this process cannot "
        "see: a server on another node needs TMPDIR on a filesystem both see, at the same path"
    )
    while not (path.exists() or lock.exists()):
        if time.monotonic() > deadline:
            raise RemoteError(never)
        time.sleep(0.05)
    if lock.exists():
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)  # the engine holds LOCK_EX until the file is written
    while not path.exists():
        if time.monotonic() > deadline:
            raise RemoteError(never)
        time.sleep(0.05)
    data = load_file(str(path), device="cpu")
    if cleanup:
        for p in (path, lock):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
    return data


# -- the per-process out dirs -------------------------------------------------------------------
def make_hidden_dir() -> Path:
    """A fresh out dir for this process's captures in TMPDIR (on a GPU node a tmpfs such as
    /dev/shm is the fast choice), after sweeping the dirs of this host's dead processes."""
    remove_orphaned_hidden_dirs(Path(tempfile.gettempdir()))
    return Path(tempfile.mkdtemp(prefix=hidden_dir_prefix(os.getpid())))


def hidden_dir_prefix(pid: int | None = None) -> str:
    """The hidden-state temp dir name of process `pid` on this host, or this host's prefix."""
    host = f"eagle3-engine-hidden-{socket.gethostname()}-"
    return host if pid is None else f"{host}{pid}-"


def remove_orphaned_hidden_dirs(tmp: Path) -> list[Path]:
    """Remove this host's hidden-state temp dirs whose process is gone (a SIGKILLed trainer or
    capture cannot clean up; its dir may hold in-flight hidden states) -> the removed dirs.
    Other hosts' dirs (a shared TMPDIR) and live processes' dirs are left alone."""
    host = hidden_dir_prefix()
    removed = []
    for path in sorted(tmp.glob(f"{host}*")):
        pid = path.name[len(host) :].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("removed %d hidden-state dir(s) of processes that are gone", len(removed))
    return removed


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
