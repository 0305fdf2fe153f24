import json
from pathlib import Path

import pytest

from eagle3.data.decontaminate import NGRAM, BenchmarkIndex
from eagle3.data.prompts import Prompt, load_prompts

SHARED = Path(__file__).resolve().parents[4] / "shared" / "data"
GSM8K_TEST = SHARED / "gsm8k" / "test.jsonl"


def _prompt(*turns: str) -> Prompt:
    return Prompt(id="x", dataset="d", messages=[{"role": "user", "content": t} for t in turns])


@pytest.fixture
def bench_file(tmp_path):
    path = tmp_path / "bench.jsonl"
    rows = [
        {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half "
         "as many clips in May. How many clips did Natalia sell altogether?",
         "answer": "Natalia sold 48/2 = 24 clips in May and 48+24 = 72 clips in April and May "
         "together, which is the answer to the question"},
        {"prompt": "Name three primary colors please"},  # shorter than NGRAM words
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_copied_question_is_found_even_re_punctuated(bench_file):
    index = BenchmarkIndex.from_sources([f"mine={bench_file}"])
    copied = (
        "Hi! natalia SOLD clips to 48 of her friends in april -- and then she sold half as many"
    )
    assert len(copied.split()) > NGRAM
    assert index.hit(_prompt("unrelated first turn", copied).messages)
    assert not index.hit(_prompt("Natalia sold clips to her friends in April.").messages)


def test_a_reference_answer_counts_too(bench_file):
    index = BenchmarkIndex.from_sources([str(bench_file)])
    answer = "so 48+24 = 72 clips in April and May together, which is the answer to the question"
    kept, dropped = index.split([_prompt(answer), _prompt("write a poem about the sea")])
    assert [p.messages[0]["content"] for p in dropped] == [answer]
    assert len(kept) == 1


def test_short_benchmark_texts_match_whole_words_only(bench_file):
    index = BenchmarkIndex.from_sources([str(bench_file)])
    assert index.hit(_prompt("Quick: name three primary colors please!").messages)
    assert not index.hit(_prompt("rename three primary colors pleased").messages)


@pytest.mark.slow
def test_embedded_training_prompts_hold_no_benchmark_prompt():
    """The quickstart trains on ShareGPT and measures on MT-bench, HumanEval and GSM8K: every
    benchmark question must be found when planted, and the training prompts must be clean. Costs
    ~0.6 s (its call: indexing three benchmarks and scanning 2,000 ShareGPT prompts; measured on 2
    xdist workers)."""
    if not GSM8K_TEST.is_file():
        pytest.skip(f"{GSM8K_TEST} is not here")
    sources = ["mt_bench", "humaneval", f"gsm8k={GSM8K_TEST}"]
    index = BenchmarkIndex.from_sources(sources)
    for source in sources:
        for bench in load_prompts(source.split("=")[-1], limit=20):
            assert index.hit(bench.messages), bench.id
    train = load_prompts("sharegpt", limit=2000)
    kept, dropped = index.split(train)
    assert dropped == [], [p.id for p in dropped]


def test_exclude_contaminated_drops_and_says_why(bench_file, capsys):
    import argparse

    from eagle3.data.decontaminate import add_exclude_args, exclude_contaminated

    args = add_exclude_args(argparse.ArgumentParser()).parse_args(
        ["--exclude-benchmarks", f"mt_bench,mine={bench_file}"]
    )
    mt = load_prompts("mt_bench", limit=1)[0]
    prompts = [
        _prompt("write a poem about the sea"),
        Prompt(id="copy", dataset="d", messages=mt.messages[:1]),
        _prompt("Quick: name three primary colors please!"),
    ]
    kept = exclude_contaminated(prompts, args.exclude_benchmarks)
    assert kept == prompts[:1]
    assert capsys.readouterr().out == (
        "--exclude-benchmarks: dropped 2 of 3 prompts sharing a 13-word run with a benchmark "
        "question or answer (mt_bench 1, mine 1)\n"
    )
    assert exclude_contaminated(prompts, None) is prompts  # no flag: nothing read, nothing said
    assert capsys.readouterr().out == ""


def test_exclude_spec_errors_name_the_flag():
    from eagle3.data.decontaminate import exclude_contaminated
    from eagle3.errors import Eagle3Error

    with pytest.raises(Eagle3Error, match="--exclude-benchmarks gsm8k=PATH/gsm8k/test.jsonl"):
        exclude_contaminated([], "mt_bench,gsm8k")
    with pytest.raises(Eagle3Error, match="unknown benchmark 'nope' in --exclude-benchmarks"):
        exclude_contaminated([], "nope")
