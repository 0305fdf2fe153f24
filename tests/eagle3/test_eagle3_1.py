"""EAGLE-3.1 (DraftConfig.method "eagle3.1": fc_norm + norm_output) for both draft kinds: the
unroll and the incremental decoder compute what vLLM 0.32's llama_eagle3 / deepseek_eagle3
compute (written here from their code over a plain EAGLE-3 layer with the same weights), the
checkpoint carries the switches vLLM reads, and a checkpoint whose switches, recorded method
or fc_norm tensors disagree is refused in one line. Whole file ~3 s."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.checkpoint import load_config, load_draft, save_draft
from eagle3.errors import Eagle3Error
from eagle3.methods import make_draft_config
from eagle3.model import Eagle3Draft
from tests.eagle3.test_mla_draft import MLA, check_round_trip
from tests.eagle3.test_model import check_ttt_equals_decoding

KINDS = {"gqa": {}, "mla": MLA}


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def vllm_chain(m31: Eagle3Draft, input_ids, aux, t: int, steps: int) -> list[torch.Tensor]:
    """Draft logits at position t for steps 0..steps-1, as vLLM's proposer computes them for an
    EAGLE-3.1 draft: combine_hidden_states = fc(cat(fc_norm_i(aux_i))), the layer, then
    `hidden_states, hidden_prenorm = norm(h, residual)` with the next step fed hidden_states
    (post-norm) under norm_output. The layer itself is a plain EAGLE-3 draft's (its own tests
    check it against naive and transformers' maths), loaded with m31's weights."""
    cfg = m31.config
    off = {"method": "eagle3", "fc_norm": False, "norm_output": False}
    plain = Eagle3Draft(make_draft_config(**{**cfg.to_dict(), **off})).eval()
    state = {k: v for k, v in m31.state_dict().items() if not k.startswith("fc_norm.")}
    plain.load_state_dict(state)
    chunks = aux[:, : t + 1].chunk(3, dim=-1)
    normed = [rms(c, n.weight, cfg.rms_norm_eps) for c, n in zip(chunks, m31.fc_norm)]
    h = plain.fc(torch.cat(normed, dim=-1))
    out, logits, cache = plain.forward(input_ids[:, 1 : t + 2], h, torch.arange(t + 1)[None])
    got = [logits[:, t]]
    hidden = rms(out[:, t : t + 1], plain.norm.weight, cfg.rms_norm_eps)  # norm_output
    for k in range(1, steps):
        out, logits, cache = plain.forward(
            input_ids[:, t + k + 1 : t + k + 2], hidden, torch.tensor([[t + k]]), cache
        )
        got.append(logits[:, 0])
        hidden = rms(out, plain.norm.weight, cfg.rms_norm_eps)
    return got


def eagle3_1(tiny_config, kind: str) -> Eagle3Draft:
    torch.manual_seed(0)
    model = Eagle3Draft(tiny_config(method="eagle3.1", **KINDS[kind])).eval()
    with torch.no_grad():  # non-trivial norm weights, so a skipped norm would show
        for norm in model.fc_norm:
            norm.weight.uniform_(0.5, 2.0)
        model.norm.weight.uniform_(0.5, 2.0)
    return model


@pytest.mark.parametrize("kind", KINDS)
def test_eagle3_1_unroll_and_decoder_compute_what_vllm_computes(kind, tiny_config):
    model = eagle3_1(tiny_config, kind)
    assert (model.config.options.fc_norm, model.config.options.norm_output) == (True, True)
    input_ids, aux = torch.randint(0, 50, (1, 9)), torch.randn(1, 9, 96) * 3
    with torch.no_grad():
        ttt = model.ttt_forward(input_ids, aux, 3)
        want = vllm_chain(model, input_ids, aux, t=4, steps=3)
        for k in range(3):
            assert torch.allclose(ttt[k][:, 4], want[k], atol=1e-5)
    check_ttt_equals_decoding(model)  # the in-house decoder's chain equals the unroll


def test_eagle3_1_differs_from_eagle3_with_the_same_weights(tiny_config):
    """Each switch changes the function (else the test above could not fail)."""
    model = eagle3_1(tiny_config, "gqa")
    ids, aux = torch.randint(0, 50, (1, 8)), torch.randn(1, 8, 96) * 3
    with torch.no_grad():
        want = model.ttt_forward(ids, aux, 2)
        for switch in ("fc_norm", "norm_output"):
            other = Eagle3Draft(make_draft_config(**{**model.config.to_dict(), switch: False}))
            other.load_state_dict(model.state_dict(), strict=False)
            got = other.eval().ttt_forward(ids, aux, 2)
            assert not torch.allclose(got[-1], want[-1], atol=1e-3), switch


def test_eagle3_1_fc_norm_makes_each_aux_state_scale_free(tiny_config):
    """Why fc_norm exists: the aux states' scales differ by layer; normalised, fc sees each at
    unit RMS, so scaling one aux state leaves h_0 unchanged."""
    model = eagle3_1(tiny_config, "gqa")
    aux = torch.randn(1, 5, 96)
    scaled = aux.clone()
    scaled[..., 32:64] *= 40
    with torch.no_grad():
        assert torch.allclose(model.project(aux), model.project(scaled), atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_eagle3_1_checkpoint_carries_the_switches_vllm_reads(kind, tiny_config, tmp_path):
    model = eagle3_1(tiny_config, kind)
    save_draft(model, tmp_path, dtype=None)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert (raw["fc_norm"], raw["norm_output"], raw["norm_before_residual"] if kind == "mla"
            else False) == (True, True, False)  # fmt: skip
    assert raw["eagle_config"]["method"] == "eagle3.1" and "method" not in raw
    names = set(load_file(tmp_path / "model.safetensors"))
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= names
    check_round_trip(model, tmp_path)


def test_eagle3_checkpoint_keeps_the_switches_off(tiny_config, tmp_path):
    save_draft(Eagle3Draft(tiny_config()), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert (raw["fc_norm"], raw["norm_output"], raw["eagle_config"]["method"]) == (
        False,
        False,
        "eagle3",
    )
    assert not any(n.startswith("fc_norm") for n in load_file(tmp_path / "model.safetensors"))


def test_eagle3_1_peer_checkpoint_without_our_method_key_loads_by_its_switches(
    tiny_config, tmp_path
):
    save_draft(eagle3_1(tiny_config, "gqa"), tmp_path)
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    del raw["eagle_config"]["method"]
    path.write_text(json.dumps(raw))
    assert load_config(tmp_path)[0].method == "eagle3.1"


def _edit(path, **changes) -> None:
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if key == "method":
            raw["eagle_config"]["method"] = value
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize(
    "method, edit, expected",
    [
        ("eagle3.1", {"norm_output": False}, "records method eagle3.1 but has norm_output: false"),
        (
            "eagle3.1",
            {"fc_norm": False, "norm_output": False, "method": "eagle3"},
            "fc_norm.* weights but config",
        ),
        ("eagle3", {"fc_norm": True, "norm_output": True}, "records method eagle3 but has"),
        ("eagle3", {"method": "eagle4"}, "is not one of"),
        ("eagle3", {"norm_before_residual": True}, "norm_before_residual is on"),
    ],
    ids=["flag-dropped", "weights-without-flag", "flags-without-method", "unknown", "nbr"],
)
def test_eagle3_1_checkpoint_whose_flags_disagree_is_one_line_error(
    method, edit, expected, tiny_config, tmp_path
):
    save_draft(Eagle3Draft(tiny_config(method=method)), tmp_path)
    _edit(tmp_path / "config.json", **edit)
    with pytest.raises(Eagle3Error) as err:
        load_draft(tmp_path)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_eagle3_1_flag_without_fc_norm_weights_is_one_line_error(tiny_config, tmp_path):
    save_draft(eagle3_1(tiny_config, "gqa"), tmp_path)
    weights = tmp_path / "model.safetensors"
    state = {k: v for k, v in load_file(weights).items() if not k.startswith("fc_norm.")}
    save_file(state, str(weights), metadata={"format": "pt"})
    with pytest.raises(Eagle3Error, match="no fc_norm.* weights but config.json says fc_norm"):
        load_draft(tmp_path)


def test_eagle3_1_config_errors_are_one_line(tiny_config):
    with pytest.raises(Eagle3Error, match="method 'eagle4' is not one of"):
        tiny_config(method="eagle4")
    with pytest.raises(Eagle3Error, match="feature 'last' has one state"):
        tiny_config(method="eagle3.1", feature="last", target_hidden_size=32)
