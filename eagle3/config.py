"""Typed YAML configs: dataclasses hold every default, YAML and dotted ``key=value`` overrides
fill them, and every problem (unknown key, wrong type, bad value) is collected into one
:class:`~eagle3.errors.ConfigError` before any model or data is touched.

    cfg = load_typed(Config, "recipe.yaml", ["optim.lr=5e-5"], check=check_values)

A field typed as a dataclass is a nested section; ``list[SomeDataclass]`` is a list of
mappings, each checked the same way.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from eagle3.errors import ConfigError

T = TypeVar("T")


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return "null" if tp is type(None) else tp.__name__


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """(ok, value) for `value` against a field annotation; ints are accepted as floats."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, out = _coerce(value, arg)
            if ok:
                return True, out
        return False, None
    if origin is list:
        if not isinstance(value, list):
            return False, None
        items = [_coerce(v, typing.get_args(tp)[0]) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if tp is type(None):
        return value is None, None
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 5e-5 (no dot) as a string
            try:
                return True, float(value)
            except ValueError:
                return False, None
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else None
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    return isinstance(value, tp), value


def _dataclass_item(tp: Any) -> type | None:
    """The item type of a ``list[SomeDataclass]`` annotation, else None."""
    if typing.get_origin(tp) is list:
        (arg,) = typing.get_args(tp)
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _fill(obj: Any, raw: Any, prefix: str, problems: list[str]) -> None:
    """Set fields of dataclass `obj` from the mapping `raw`, appending problems."""
    if not isinstance(raw, dict):
        problems.append(f"{prefix or 'config'}: expected a mapping, got {raw!r}")
        return
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            problems.append(f"unknown key {dotted} (known: {', '.join(sorted(names))})")
            continue
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _fill(current, value, f"{dotted}.", problems)
            continue
        item = _dataclass_item(hints[key])
        if item is not None:  # a list of sections, e.g. datasets: [{name, source}, ...]
            if not isinstance(value, list):
                problems.append(f"{dotted}: expected a list of mappings, got {value!r}")
                continue
            sections = []
            for i, entry in enumerate(value):
                section = item()
                _fill(section, entry, f"{dotted}[{i}].", problems)
                sections.append(section)
            setattr(obj, key, sections)
            continue
        ok, coerced = _coerce(value, hints[key])
        if not ok:
            problems.append(f"{dotted}: expected {_type_name(hints[key])}, got {value!r}")
            continue
        setattr(obj, key, coerced)


def environment_words(name: str, what: str) -> list[str]:
    """The words of environment variable `name`, split as a shell would (none when unset), or
    one ConfigError naming it when its quoting does not parse; `what` says what the words are."""
    text = os.environ.get(name, "")
    try:
        return shlex.split(text)
    except ValueError as err:
        raise ConfigError(f"{name}={text!r}: {err} ({what}, quoted as in a shell)") from err


def parse_overrides(overrides: list[str], problems: list[str]) -> dict[str, Any]:
    """["optim.lr=5e-5", "data.shard_dirs=[a,b]"] -> nested dict; values parsed as YAML."""
    nested: dict[str, Any] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            problems.append(f"override {item!r} is not key=value (e.g. optim.lr=5e-5)")
            continue
        try:
            value = yaml.safe_load(text) if text else None
        except yaml.YAMLError:
            value = text
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                problems.append(f"override {item!r} conflicts with another override")
                break
        else:
            node[leaf] = value
    return nested


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML file ({} when empty), or one ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror}") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {str(err).splitlines()[0]}") from err
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return raw


def load_typed(
    cls: type[T],
    path: str | Path | None = None,
    overrides: list[str] = (),
    check: Callable[[T, list[str]], None] | None = None,
) -> T:
    """YAML file (optional) + dotted overrides -> a validated ``cls()``, or one ConfigError.

    ``check(cfg, problems)`` appends value problems (ranges, enums, paths); it runs on a config
    whose fields all have the right types (a field with a type problem keeps its default)."""
    problems: list[str] = []
    raw = read_yaml(path) if path is not None else {}
    raw = merge(raw, parse_overrides(list(overrides), problems))
    cfg = cls()
    _fill(cfg, raw, "", problems)
    if check is not None:
        check(cfg, problems)
    if problems:
        where = f"{path}: " if path is not None else ""
        raise ConfigError(where + "; ".join(problems))
    return cfg
