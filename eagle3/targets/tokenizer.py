"""The target's tokenizer: loaded one way, checked to be the registry's class, fingerprinted.

Kimi-K2.5's tokenizer is remote code (tokenization_kimi.py's TikTokenTokenizer over
tiktoken.model). transformers 5 also loads that directory WITHOUT remote code: it converts
tiktoken.model into a tokenizer of its own, which splits whitespace runs differently
("def f(x):\\n    return x*2": 16 ids against the remote code's 14). Token ids that do not
match what vLLM serves (it runs the remote code: --trust-remote-code) train a drafter on the
wrong sequences, silently. So:

- `load_tokenizer(target)` is every load of a target's tokenizer: remote code exactly where
  the registry says, then `check_tokenizer_class` against the registry's `tokenizer_class`
  (one line, exit 2, when it is another class: a path, a plugin or a script that loaded it
  without the registry's flag).
- `tokenizer_fingerprint(tok)`: a hash of the ids of PROBE_TEXT (code, whitespace runs, tabs,
  non-ASCII). A capture writes it into the shards' meta.json, training into the drafter's
  config.json (extra_config); training compares the shards' with the tokenizer it loads and
  evaluation the drafter's (`check_fingerprint`: one line, exit 2, on a mismatch; data written
  before the field: one warning line).
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

from eagle3.errors import Eagle3Error
from eagle3.targets.registry import ResolvedTarget, resolve

log = logging.getLogger(__name__)

# what tokenizers disagree on: indentation and blank-line runs, tabs, mixed runs, non-ASCII
PROBE_TEXT = "def f(x):\n    return x*2\n\n\t  end  caf\u00e9 \u6771\u4eac  \U0001f642\n"


def load_tokenizer(target: str | os.PathLike | ResolvedTarget):
    """The target's tokenizer, with remote code exactly where its registry entry says
    (Kimi-K2.5's tokenization_kimi.py over tiktoken), checked to be the registry's class
    (`check_tokenizer_class`). Errors of the load itself are the caller's to word."""
    from transformers import AutoTokenizer

    t = resolve(target)
    tokenizer = AutoTokenizer.from_pretrained(t.hf_dir, trust_remote_code=t.tokenizer_remote_code)
    check_tokenizer_class(tokenizer, t)
    return tokenizer


def find_tokenizer(target: str | os.PathLike | ResolvedTarget):
    """load_tokenizer, or None (one warning) for a target whose directory holds no tokenizer
    (a bare model, trained on token ids alone); a tokenizer of another class than the
    registry's is still refused."""
    t = resolve(target)
    try:
        return load_tokenizer(t)
    except (OSError, ValueError, TypeError, ImportError):
        log.warning("no tokenizer found with target %s", t.name)
        return None


def is_tokenizer_class(tokenizer: Any, name: str) -> bool:
    """Whether `tokenizer` is a `name`: its class or a base class of that name (remote code is
    known by name only), or an instance of transformers' class of that name (transformers 5
    calls its fast tokenizer TokenizersBackend, PreTrainedTokenizerFast an alias of it)."""
    if name in {cls.__name__ for cls in type(tokenizer).__mro__}:
        return True
    import transformers

    cls = getattr(transformers, name, None)
    return isinstance(cls, type) and isinstance(tokenizer, cls)


def check_tokenizer_class(tokenizer: Any, target: str | os.PathLike | ResolvedTarget) -> None:
    """One line (exit 2) when `tokenizer` is not the class the target's registry entry names
    (`tokenizer_class`); nothing to check for a target the registry does not know."""
    t = resolve(target)
    want = (t.spec or {}).get("tokenizer_class")
    if want is None or is_tokenizer_class(tokenizer, want):
        return
    flag = "trust_remote_code=True" if t.tokenizer_remote_code else "no remote code"
    raise Eagle3Error(
        f"the tokenizer loaded for {t.name} from {t.hf_dir} is a {type(tokenizer).__name__}, "
        f"not the registry's {want} (what vLLM serves): its token ids would not match the "
        f"target's; load it with eagle3.targets.load_tokenizer or AutoTokenizer with {flag}"
    )


def tokenizer_fingerprint(tokenizer: Any) -> str | None:
    """16 hex digits of sha256 over the ids `tokenizer` gives PROBE_TEXT (no special tokens):
    equal for tokenizers that split it alike, whatever their class or version. None for no
    tokenizer."""
    if tokenizer is None:
        return None
    ids = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


def check_fingerprint(recorded: str | None, tokenizer: Any, what: str, redo: str) -> None:
    """Compare the fingerprint `what` (e.g. "shards DIR") recorded with `tokenizer`'s: one line
    (exit 2) naming both and `redo` (what to do instead) when they differ; a one-line warning
    when `what` has none (written before fingerprints were recorded), or when there is no
    tokenizer here to compare with (a target without one)."""
    here = tokenizer_fingerprint(tokenizer)
    if recorded is not None and here is None:
        log.warning("%s record tokenizer fingerprint %s; the target here has no tokenizer to "
                    "compare it with", what, recorded)  # fmt: skip
        return
    if recorded is None:
        log.warning("%s record no tokenizer fingerprint (written before it was recorded): "
                    "their token ids are assumed to be this %s's", what,
                    type(tokenizer).__name__)  # fmt: skip
        return
    if recorded != here:
        raise Eagle3Error(
            f"{what} were tokenized by another tokenizer (fingerprint {recorded}) than the "
            f"{type(tokenizer).__name__} loaded here ({here}): the token ids would not match; "
            f"{redo}"
        )
