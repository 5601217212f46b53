"""Overrides of a scenario mapping before it is validated: `--set KEY=VALUE` parsing, a section's value merged
into the section, the YAML the files and values are read as, and each validation error named by its source.

Generic over the schema: `root` is the pydantic class of the whole mapping (the scenario), walked by dotted path.
"""

from __future__ import annotations

import difflib
import re
import unicodedata
import warnings
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from simharness.errors import ScenarioError, ScenarioNote


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML whose mappings may not repeat a key (PyYAML would keep the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str | int | float | bool | None):
                raise yaml.constructor.ConstructorError(None, None, "a key must be a plain value", key_node.start_mark)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


# YAML 1.2 floats without a dot (`1e-3`), which YAML 1.1 and so PyYAML would read as strings.
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def load_yaml(text: str) -> Any:
    """YAML text as data: safe, no repeated keys, YAML 1.2 floats; raises yaml.YAMLError."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)


def parse_value(text: str) -> Any:
    """Parse a `--set` value as YAML, so `3`, `true`, `[1, 2]` and `wait` all mean what they say."""
    try:
        return load_yaml(text)
    except yaml.YAMLError as e:
        raise ScenarioError(f"cannot parse value {text!r}: {getattr(e, 'problem', None) or e}") from None


def parse_sets(items: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` items -> {dotted path: parsed value}."""
    overrides = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ScenarioError(f"--set {item!r}: expected KEY=VALUE, e.g. --set scheduler.depth=3")
        try:
            overrides[key.strip()] = parse_value(value)
        except ScenarioError as e:
            raise ScenarioError(f"--set {key.strip()}: {e}") from None
    return overrides


def field_overrides(root: type[BaseModel], overrides: dict[str, Any]) -> list[tuple[str, Any]]:
    """Overrides as one (path, value) per field: a section's value (`workload={num_requests: 8}`) sets the fields
    it names and keeps the others as the file has them, never resetting them to their defaults."""

    def leaves(path: str, value: Any) -> list[tuple[str, Any]]:
        if isinstance(value, dict) and _section_class(root, path) is not None:
            return [leaf for key, v in value.items() for leaf in leaves(f"{path}.{key}", v)]
        return [(path, value)]

    return [leaf for path, value in overrides.items() for leaf in leaves(path, value)]


def merged(data: dict[str, Any], fields: list[tuple[str, Any]]) -> dict[str, Any]:
    """A copy of `data` with each (dotted path, value) set, creating sections as needed; a field set where a sweep
    sweeps it replaces the sweep (a ScenarioNote says so), so that the run records what ran."""
    out = _deep_copy(data)
    for path, value in fields:
        _drop_swept(out, path)
        _set(out, path, value)
    return out


def _section_class(root: type[BaseModel], path: str) -> type[BaseModel] | None:
    """The section a dotted path names (`workload.prompt_len`: LengthDist), or None for a value or no field."""
    node: Any = root
    for part in path.split("."):
        field = node.model_fields.get(part) if isinstance(node, type) and issubclass(node, BaseModel) else None
        if field is None:
            return None
        node = field.annotation
    return node if isinstance(node, type) and issubclass(node, BaseModel) else None


def near_field(section: type[BaseModel], key: object) -> str:
    """A hint for an unknown key: the section's field it most resembles, and the look-alike non-ASCII letter a
    key that reads like a field holds (`schedulеr` with a Cyrillic е)."""
    near = difflib.get_close_matches(str(key), list(section.model_fields), n=1, cutoff=0.6)
    hints = [non_ascii(str(key)), f"did you mean {near[0]!r}?" if near else ""]
    return f" ({'; '.join(h for h in hints if h)})" if any(hints) else ""


def non_ascii(text: str) -> str:
    """Names the first non-ASCII letter of a text that should be ASCII ('' if none): `wаit` with a Cyrillic а
    reads like `wait`."""
    letter = next((c for c in text if not c.isascii()), None)
    if letter is None:
        return ""
    return f"its {letter!r} is the non-ASCII U+{ord(letter):04X} {unicodedata.name(letter, 'character')}"


def format_errors(err: ValidationError, root: type[BaseModel], file: str | None, data: Any,
                  fields: list[tuple[str, Any]]) -> str:
    """The validation errors, each as `path: problem`; with `file`, each says where it comes from as well: the
    `--set` options that set the field, or the file (`fields` are the options, `data` the file's mapping)."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-after"))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            parent = _section_class(root, loc.rpartition(".")[0]) if "." in loc else root
            msg = "unknown field" + (near_field(parent, e["loc"][-1]) if parent is not None else "")
        elif e["type"] == "literal_error" and isinstance(e["input"], str) and non_ascii(e["input"]):
            msg += f" ({non_ascii(e['input'])})"
        line = f"{loc}: {msg}" if loc else msg
        if file:
            source = _source(loc or msg.partition(":")[0], file, data, fields, root)
            line = f"{source}: {line.removeprefix(source.removeprefix('--set ') + ': ')}"
        lines.append(line)
    return "; ".join(lines)


def _source(path: str, file: str, data: Any, fields: list[tuple[str, Any]], root: type[BaseModel]) -> str:
    """Where the value at `path` comes from: the `--set` option that set it (or the section holding it, where
    the file has none), the options that set fields inside it when they alone make it wrong, else the file,
    noting the options that set a field inside it."""
    inside = [(p, v) for p, v in fields if p.startswith(path + ".")]
    names = ", ".join(p for p, _ in inside)
    for p, _ in fields:
        if path == p or path.startswith(p + ".") or (any(p == q for q, _ in inside) and not _has(data, path)):
            return f"--set {p}"
    if inside and _wrong_alone(root, data, path, inside):
        return f"--set {names}"
    return f"{file} (with --set {names})" if inside else file


def _wrong_alone(root: type[BaseModel], data: Any, path: str, inside: list[tuple[str, Any]]) -> bool:
    """Whether the section at `path` is still wrong holding only the options' fields (the file's own cleared)."""
    alone = _deep_copy(data)
    try:
        _set(alone, path, {})
        for p, v in inside:
            _set(alone, p, v)
    except ScenarioError:  # a value where the path needs a section: the file's
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its notes were said with the scenario's
        try:
            root.model_validate(alone)
        except ValidationError as e:
            return any(".".join(str(p) for p in x["loc"] if not str(p).startswith("function-after")) == path
                       for x in e.errors())
    return False


def _parts(path: str) -> list[str]:
    """A dotted path's keys; under `sweep` the rest of the path is one key (`sweep.scheduler.depth`)."""
    head, dot, rest = path.partition(".")
    return [head, rest] if head == "sweep" and dot else path.split(".")


def _has(data: Any, path: str) -> bool:
    """Whether a nested mapping has a value at a dotted path."""
    for part in _parts(path):
        if not isinstance(data, dict) or part not in data:
            return False
        data = data[part]
    return True


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    """Set a dotted path inside a nested dict, creating sections as needed."""
    parts = _parts(path)
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ScenarioError(f"{path}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def _drop_swept(data: dict[str, Any], path: str) -> None:
    """An override of a swept field replaces its sweep (a ScenarioNote says so)."""
    sweep = data.get("sweep")
    if not isinstance(sweep, dict) or path.startswith("sweep."):
        return
    for swept in [p for p in sweep if isinstance(p, str)]:
        if swept == path or swept.startswith(path + ".") or path.startswith(swept + "."):
            warnings.warn(f"--set {path} replaces sweep.{swept} {sweep.pop(swept)!r}; to sweep other values, "
                          f"--set 'sweep.{swept}=[...]'", ScenarioNote, stacklevel=5)


def _deep_copy(data: Any) -> Any:
    """A copy whose every mapping and list is its own (a YAML alias's included: setting one leaves the other)."""
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data
