"""The capture's target: in-process (HF), or served by vLLM (``--engine``, ``--engine-url``)."""

from __future__ import annotations

from datagen.capture.settings import CaptureSettings
from eagle3.data.chat import check_renderable
from eagle3.engine.served_target import ServedTarget, describe_served_target
from eagle3.target import ResolvedTarget, TargetModel, load_target


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
