"""eagle3.engine.choice: the dtype and attention backend a managed engine serves with (no server)."""

from __future__ import annotations

import json

import pytest

from eagle3.engine.choice import choose_serving, flag_value, uses_mla
from eagle3.errors import Eagle3Error

# (cpu_build, amx, mla, dtype asked, backend asked) -> (dtype, backend served): both kinds of
# CPU this project runs on (AMD EPYC: no AMX; Intel Xeon: AMX), whichever this one is.
SERVING = [
    ((False, False, True, None, None), (None, None)),  # GPU engine: vLLM's defaults
    ((False, False, True, "bfloat16", "TRITON_MLA"), ("bfloat16", "TRITON_MLA")),
    ((True, False, False, None, None), ("float32", None)),  # GQA target: CPU_ATTN takes fp32
    ((True, True, False, None, None), ("float32", None)),
    ((True, True, False, "half", None), ("float16", None)),
    ((True, False, True, None, None), ("float32", "CPU_MLA")),  # MLA, no AMX: CPU_MLA anyway
    ((True, True, True, None, None), ("float32", "CPU_MLA")),  # AMX_MLA refuses fp32 weights
    ((True, True, True, "float16", None), ("float16", "CPU_MLA")),
    ((True, True, True, "bfloat16", None), ("bfloat16", "AMX_MLA")),  # the fast one, bf16
    ((True, False, True, "bfloat16", None), ("bfloat16", "CPU_MLA")),
    ((True, True, True, "bfloat16", "cpu_mla"), ("bfloat16", "CPU_MLA")),  # asked: kept
    ((True, True, True, "bfloat16", "AMX_MLA"), ("bfloat16", "AMX_MLA")),
]
REFUSED = [  # (cpu_build, amx, mla, dtype, backend) -> the fix the one line names
    ((True, True, True, None, "AMX_MLA"), "pass --dtype bfloat16"),
    ((True, True, True, "float32", "AMX_MLA"), "pass --dtype bfloat16"),
    ((True, False, True, "bfloat16", "AMX_MLA"), "this one has none: drop the flag"),
    ((True, False, True, None, "CPU_ATTN"), "served by CPU_MLA or AMX_MLA"),
    ((True, True, False, "int8", None), "serves bfloat16, float16, float32"),
]


@pytest.mark.parametrize(("asked", "served"), SERVING)
def test_serving_choice_takes_what_the_engine_accepts_on_each_kind_of_cpu(asked, served):
    cpu_build, amx, mla, dtype, backend = asked
    choice = choose_serving(
        cpu_build=cpu_build, amx=amx, mla=mla, dtype=dtype, attention_backend=backend
    )
    assert (choice.dtype, choice.attention_backend) == served
    assert choice.reason and "\n" not in choice.describe()


@pytest.mark.parametrize(("asked", "fix"), REFUSED)
def test_serving_choice_refuses_what_the_engine_would_refuse_in_one_line(asked, fix):
    cpu_build, amx, mla, dtype, backend = asked
    with pytest.raises(Eagle3Error) as excinfo:
        choose_serving(
            cpu_build=cpu_build, amx=amx, mla=mla, dtype=dtype, attention_backend=backend
        )
    assert "\n" not in str(excinfo.value) and fix in str(excinfo.value), str(excinfo.value)


def test_flag_values_and_mla_configs(tmp_path):
    assert flag_value(["--dtype", "half", "--x"], "--dtype") == "half"
    assert flag_value(["--dtype=half", "--dtype=bfloat16"], "--dtype") == "bfloat16"
    assert flag_value(["--dtypes=x"], "--dtype") is None
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"kv_lora_rank": 512}}))
    assert uses_mla(tmp_path)  # the Kimi wrapper's text model
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 9}))
    assert not uses_mla(tmp_path)
