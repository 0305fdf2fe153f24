"""experiments/bench_fp8_labels.py's measurement on tiny random states (no target): the modes go
through the real shard writer and reader, and the numbers it reports are the ones it claims."""

from __future__ import annotations

import re

import pytest
import torch
from bench_fp8_labels import MODES, compare, stored_states

H, V = 32, 64


def test_fp8_aux_keeps_every_label_and_shares_fp8s_aux_error(tmp_path):
    """~0.1 s. States with outlier channels in the last hidden state (what squeezes fp8's other
    values): fp8-aux's labels equal bf16's (top-1 1.0, KL 0), its aux error and fc(aux) error
    are fp8's, and fp8's labels are the ones that move."""
    g = torch.Generator().manual_seed(0)
    lengths = (12, 20, 9)
    scale = torch.tensor([0.05] * H + [1.0] * H + [40.0] * H)  # aux layers differ by orders
    aux = [torch.randn(t, 3 * H, generator=g) * scale for t in lengths]
    last = [torch.randn(t, H, generator=g) for t in lengths]
    for h in last:
        h[:, :2] *= 200.0  # two outlier channels set fp8's per-token scale
    masks = [[0] * 3 + [1] * (t - 3) for t in lengths]
    meta = {"target": "tiny", "vocab_size": V, "target_hidden_size": H,
            "aux_layer_ids": [1, 3, 4], "num_layers": 8, "max_length": 64}  # fmt: skip
    stored = stored_states(aux, last, masks, meta, tmp_path)
    assert set(stored) == set(MODES)
    lm_head = torch.randn(V, H, generator=g) * 0.3
    torch.manual_seed(0)
    fc = torch.nn.Linear(3 * H, H, bias=False)
    r = compare(aux, last, masks, stored, lm_head, fc)
    assert r["fp8-aux"]["top1_vs_bf16"] == 1.0 and r["fp8-aux"]["kl_max"] == 0.0
    assert r["fp8-aux"]["rel_err_last"] == r["bf16"]["rel_err_last"] < 0.01
    assert r["fp8-aux"]["rel_err_aux"] == r["fp8"]["rel_err_aux"] > r["bf16"]["rel_err_aux"]
    assert r["fp8-aux"]["fc_rel_err"] == r["fp8"]["fc_rel_err"] > 0
    assert 0.99 < r["fp8-aux"]["fc_cos_min"] <= r["fp8-aux"]["fc_cos_mean"] < 1.0
    assert r["fp8"]["kl_max"] > 0 and r["fp8"]["rel_err_last"] > 5 * r["bf16"]["rel_err_last"]


@pytest.mark.slow
def test_the_documented_command_measures_every_mode_on_the_embedded_target(capsys, one_thread):
    """~7 s (mostly the embedded target's load): `bench_fp8_labels.py --target smollm2-135m-q4` at 2
    MT-bench prompts of 4 new tokens: its own answers captured through every mode's shard
    writer and read back, one line per fp8 mode. The docstring's other target (MINI_DIR, the
    Kimi miniature) takes the same path (tests/conftest.py's kimi_miniature costs ~30 s)."""
    from bench_fp8_labels import main

    main(["--target", "smollm2-135m-q4", "--prompts", "2", "--max-new-tokens", "4"])
    out = capsys.readouterr().out
    assert out.startswith("smollm2-135m-q4: ") and "bf16 vs fp32: top-1" in out
    for mode in MODES[1:]:
        assert re.search(rf"^  {mode}\s+top-1 vs bf16 [\d.]+%", out, re.M), (mode, out)
