"""One capture run's flags, parsed and checked once (:func:`datagen.capture.cli.parse_args`)."""

from __future__ import annotations

from dataclasses import dataclass

from datagen.render import Rendering
from eagle3.engine.server import EngineSettings

DEFAULT_MAX_LENGTH = 4096
DEFAULT_BATCH_TOKENS = 16384  # padded tokens per forward; lower it if the target runs out of memory


@dataclass(frozen=True)
class CaptureSettings:
    """One run's flags, parsed and checked once (parse_args); the helpers below read these."""

    target: str | None  # registry name, HF model directory or .gguf; None only with --verify
    data: list[str]  # result files or directories (datagen output)
    out: str | None  # the shard directory
    dtype: str  # storage dtype (eagle3.data.shards.DTYPES)
    rendering: Rendering  # --max-length, --long-records, --window-context, the chat template
    batch_tokens: int  # padded tokens per forward
    shard_mb: float
    limit: int | None  # capture at most this many records
    aux_layers: list[int] | None  # None: the target's
    device: str | None
    device_map: str | None
    model_dtype: str | None
    no_disk_check: bool
    verify: bool  # only check the shards of --out
    estimate: bool  # only print what the capture would cost (datagen.estimate)
    tokens: int | None  # --estimate's token count
    tokens_per_s: float | None  # --estimate's capture speed
    engine: EngineSettings  # kind "vllm": a managed server runs the forwards (eagle3.engine)
    engine_concurrency: int  # engine requests in flight
    engine_urls: list[str]  # --engine-url: running capture servers to share the requests
    serve: bool  # only start a capture server and keep it up (--host, --port)
    host: str
    port: int | None
    flags: list[str]  # the flags that shape the data (meta.json's command: command_flags)
