"""benchmarks/gpu_check.py runs end to end on a CPU in its tiny mode (the GPU run is the user's):
every length of the memory sweep is reported (an out-of-memory at one is recorded there and
the next still runs), the JSON is on disk after every length, and the DeepSpeed-like mode
trains bf16 weights through fp32 master copies."""

from __future__ import annotations

import json

import gpu_check
import gpu_check_memory
import pytest
import torch

CHECKS = "soft_label_grad,flex_vs_chunked,memory,memory_recompute"


def run_tiny(tmp_path, *extra: str) -> dict:
    out = tmp_path / "gpu_check.json"
    argv = ["--device", "cpu", "--tiny", "--json", str(out), "--checks", CHECKS, *extra]
    assert gpu_check.main(argv) == 0
    return json.loads(out.read_text())


def test_gpu_check_tiny_on_cpu_writes_its_json(tmp_path):
    """~5 s: every check but the recompile count (test_flex_fallback covers it, ~20 s) runs
    at tiny shapes on a CPU and lands in the JSON without an error; the memory sweep reports
    every length, in the DeepSpeed-like mode, on the path auto chose (chunked for MLA on a
    CPU), with its plan's parts and its peaks (null on a CPU, and why); --small-smem forces
    sm_120's flex options; the recompute sweep runs the same lengths, planned with fewer
    activations."""
    report = run_tiny(tmp_path, "--small-smem")
    assert not [name for name in CHECKS.split(",") if "error" in report[name]]
    for dtype, tol in (("float32", 1e-5), ("bfloat16", 1e-2)):
        assert report["soft_label_grad"][dtype]["max_abs_grad"] < tol
    assert report["flex_vs_chunked"]["auto_chooses"] == "chunked"  # no flex on a CPU
    assert report["flex_vs_chunked"]["kernel_options"] == gpu_check.SM120_TILES["node"]
    assert report["small_smem_options"] == gpu_check.SM120_TILES["node"] != {}
    memory = report["memory"]
    assert (memory["mode"], memory["attention_path"]) == ("deepspeed", "chunked")
    assert "CUDA's caching allocator" in memory["peaks_note"]
    assert set(memory["lengths"]) == {"64", "128", "192"}
    for entry in memory["lengths"].values():
        assert entry["seconds"] > 0 and not {"skipped", "unfinished"} & set(entry)
        assert entry["planned_gb"] == pytest.approx(sum(entry["plan_gb"].values()))
        assert entry["peak_allocated_gb"] is None and entry["peak_reserved_gb"] is None
    recomputed = report["memory_recompute"]  # each TTT step recomputed: planned smaller
    assert recomputed["recompute_ttt_steps"] and not memory["recompute_ttt_steps"]
    for T, entry in recomputed["lengths"].items():
        assert entry["seconds"] > 0 and not {"skipped", "unfinished"} & set(entry)
        plain = memory["lengths"][T]["plan_gb"]["activations"]
        assert entry["plan_gb"]["activations"] < plain


def test_gpu_check_out_of_memory_at_one_length_and_the_next_still_runs(tmp_path, monkeypatch):
    """~3 s: an out-of-memory in the 128-token step is recorded at that length (with its
    peaks), and 192 is still measured."""
    real = gpu_check_memory.ttt_loss

    def loss(step_logits, *args, **kwargs):
        if step_logits[0].shape[1] == 128:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.35 GiB")
        return real(step_logits, *args, **kwargs)

    monkeypatch.setattr(gpu_check_memory, "ttt_loss", loss)
    lengths = run_tiny(tmp_path, "--checks", "memory")["memory"]["lengths"]
    assert lengths["128"]["out_of_memory"].startswith("CUDA out of memory")
    assert "peak_reserved_gb" in lengths["128"] and "seconds" not in lengths["128"]
    assert lengths["64"]["seconds"] > 0 and lengths["192"]["seconds"] > 0


class Killed(BaseException):
    """What no `except Exception` catches: a crash of the process mid-way."""


def test_gpu_check_results_file_survives_a_crash_mid_way(tmp_path, monkeypatch):
    """~3 s: the process dies in the 192-token step; the JSON on disk holds the checks and
    the lengths measured before it."""
    real = gpu_check_memory.ttt_loss

    def loss(step_logits, *args, **kwargs):
        if step_logits[0].shape[1] == 192:
            raise Killed
        return real(step_logits, *args, **kwargs)

    monkeypatch.setattr(gpu_check_memory, "ttt_loss", loss)
    out = tmp_path / "gpu_check.json"
    with pytest.raises(Killed):
        gpu_check.main(["--device", "cpu", "--tiny", "--json", str(out), "--checks", CHECKS])
    report = json.loads(out.read_text())
    assert report["soft_label_grad"]["float32"]["max_abs_grad"] < 1e-5
    assert set(report["memory"]["lengths"]) == {"64", "128", "192"}
    assert report["memory"]["lengths"]["128"]["seconds"] > 0
    assert "unfinished" in report["memory"]["lengths"]["192"]  # begun, not measured
    assert "unfinished" not in report["memory"]["lengths"]["128"]


def test_gpu_check_deepspeed_like_mode_steps_fp32_masters_into_bf16_weights():
    """<1 s: the DeepSpeed-like mode keeps the module bf16, frees each bf16 gradient into the
    fp32 master's as backward makes it, and one step moves the masters (AdamW) and copies them
    into the module."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    trainer = gpu_check_memory.DeepSpeedLike(model)
    start = [m.clone() for m in trainer.master]
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    model(x).float().sum().backward()
    assert all(p.dtype == torch.bfloat16 and p.grad is None for p in model.parameters())
    assert all(m.dtype == torch.float32 and m.grad.abs().sum() > 0 for m in trainer.master)
    trainer.step()
    assert all(not torch.equal(m, s) for m, s in zip(trainer.master, start))
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(trainer.params, trainer.master))
    assert all(m.grad.abs().sum() == 0 for m in trainer.master)


def test_gpu_check_unknown_check_is_one_line_exit_2(capsys):
    """<1 s: a misspelt --checks name is one error line and exit 2, before any work."""
    assert gpu_check.main(["--device", "cpu", "--checks", "memry"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: unknown check(s) memry")


def test_gpu_check_lengths_flag_sets_both_memory_sweeps(tmp_path):
    """<1 s: results/README.md's reruns (`--checks memory_recompute --lengths ...` and
    `--checks memory --lengths ...`) at tiny lengths: each sweep measures exactly the lengths
    given, recompute planned with fewer activations."""
    report = run_tiny(tmp_path, "--checks", "memory,memory_recompute", "--lengths", "32,96")
    plain, recomputed = report["memory"]["lengths"], report["memory_recompute"]["lengths"]
    assert set(plain) == set(recomputed) == {"32", "96"}
    for T in ("32", "96"):
        assert plain[T]["seconds"] > 0 and recomputed[T]["seconds"] > 0
        assert recomputed[T]["plan_gb"]["activations"] < plain[T]["plan_gb"]["activations"]
