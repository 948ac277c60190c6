"""YAML → typed dataclasses, with dotted `--set key=value` overrides and `base:` inheritance.

One mechanism for every config in the repository: a section is a dataclass; `from_dict` walks the
YAML mapping against the dataclass fields, converts scalars, rejects unknown keys and wrong types,
then runs each dataclass's `validate()` (cross-field checks). Every error names the dotted key.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal

import yaml


class ConfigError(ValueError):
    """A config value is invalid; `key` is its dotted path (e.g. `model.hidden_size`)."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config error at '{key}': {message}")


BASE_KEY = "base"
# libyaml's parser where PyYAML was built with it: the same safe subset, several times faster, and
# a sweep parses every override of every run.
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_SAFE_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def parse_yaml(text: Any) -> Any:
    """One YAML document (a string or an open file), with the safe loader: tags that build Python
    objects are refused."""
    return yaml.load(text, Loader=_SAFE_LOADER)


def flow_yaml(value: Any) -> str:
    """`value` as one line of flow-style YAML that `parse_yaml` reads back to it."""
    text = yaml.dump(value, Dumper=_SAFE_DUMPER, default_flow_style=True, width=2**30)
    return text.strip().removesuffix("...").strip()


def load_yaml(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict:
    """Read a YAML mapping. A top-level `base: other.yaml` (relative to this file) is read first,
    recursively, and this file's values are deep-merged over it."""
    path = Path(path)
    data = _read_mapping(path)
    if BASE_KEY not in data:
        return data
    chain = (*_chain, path.resolve())
    base = data.pop(BASE_KEY)
    if not isinstance(base, str):
        raise ConfigError(BASE_KEY, f"{path}: expected a YAML file name, got {base!r}")
    base_path = path.parent / base
    if not base_path.is_file():
        raise ConfigError(BASE_KEY, f"{path}: base file {base_path} not found")
    if base_path.resolve() in chain:
        cycle = " -> ".join(str(p) for p in (*chain, base_path.resolve()))
        raise ConfigError(BASE_KEY, f"{path}: base files form a cycle: {cycle}")
    return deep_merge(load_yaml(base_path, chain), data)


def _read_mapping(path: Path) -> dict:
    with open(path) as f:
        data = parse_yaml(f) or {}
    if not isinstance(data, dict):
        raise ConfigError("<root>", f"{path} must hold a mapping, got {type(data).__name__}")
    return data


def deep_merge(base: dict, child: dict) -> dict:
    """`child` over `base`: mappings merge key by key, any other value (lists too) replaces."""
    merged = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            value = deep_merge(merged[key], value)
        merged[key] = value
    return merged


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` strings (value parsed as YAML) to a nested dict, in place."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(item, "override must look like key.path=value")
        node = data
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(".".join(parts[: i + 1]), "is not a section, cannot set a sub-key")
            node = child
        node[parts[-1]] = parse_yaml(raw) if raw != "" else ""
    return data


def _convert(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(value, arg, key)
            except ConfigError as e:
                errors.append(e)
        # The only alternative's error, or one below this key (a list item, a section's field:
        # the value has that alternative's shape), is the precise one.
        nested = [e for e in errors if e.key != key]
        if len(errors) == 1 or nested:
            raise (nested or errors)[0]
        raise ConfigError(key, f"{value!r} is not {describe_type(hint)}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(key, f"{value!r} is not one of {list(args)}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"expected a list, got {value!r}")
        item_hint = args[0] if args else Any
        items = [_convert(v, item_hint, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping, got {value!r}")
        return {k: _convert(v, args[1] if args else Any, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, key)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true/false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(key, f"expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # PyYAML (YAML 1.1) reads `3e-4` as a string
            try:
                return float(value)
            except ValueError:
                raise ConfigError(key, f"expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {hint} at {key}")


def _fields_text(cls: type) -> str:
    return f"mapping ({', '.join(f.name for f in dataclasses.fields(cls))})"


def describe_type(hint: Any, dataclass_text: Callable[[type], str] = _fields_text) -> str:
    """A config type in a YAML user's words: `int`, `one of: a, b`, `list of int`, `optional int`,
    `X; or Y`; a section (dataclass) as `dataclass_text(cls)`, by default its keys."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return dataclass_text(hint)
    if origin is Literal:
        return "one of: " + ", ".join(map(str, args))
    if origin in (list, tuple):
        return "list of " + describe_type(args[0], dataclass_text)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        text = "; or ".join(describe_type(a, dataclass_text) for a in options)
        return f"optional {text}" if len(options) < len(args) else text
    return hint.__name__


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    # Resolving string annotations compiles each one; a sweep builds thousands of configs.
    return typing.get_type_hints(cls)


def from_dict(cls: type, data: Any, key: str = "") -> Any:
    """Build dataclass `cls` from a mapping, recursively; unknown keys and bad types raise."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(key or "<root>", f"expected a mapping, got {data!r}")
    hints = _type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{key}.{unknown[0]}" if key else unknown[0]
        raise ConfigError(where, f"unknown key (allowed here: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _convert(value, hints[name], f"{key}.{name}" if key else name)
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate(key)
    return obj


def to_dict(obj: Any) -> Any:
    """Dataclass tree → plain dict (for writing the resolved config)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def check(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(key, message)
