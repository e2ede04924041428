"""Building a config: defaults, then a YAML file, then dotted ``key=value`` overrides; one-line errors.

Also the field table that ``--help`` prints.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from meshtrain.config.errors import ConfigError, one_line
from meshtrain.config.redaction import redact_url
from meshtrain.config.schema import MeshtrainConfig

# A message that already starts with a dotted field name ("train.steps=..." / "data.source: ...").
_NAMES_ITS_FIELD = re.compile(r"^[a-z_]+\.[a-z_0-9.]+[=:]")
# The most values a config may hold once YAML aliases are expanded: far above any real config, far below
# what a crafted file of nested aliases (a "billion laughs") would make validation and messages walk.
MAX_VALUES = 100_000
_SHOWN_CHARS = 200  # of a rejected value in an error line


class _ConfigLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that sets one key twice (YAML would keep the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise _DuplicateKey(key, seen[key] + 1, key_node.start_mark.line + 1)
            if isinstance(key, (str, int, float, bool)):
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, first: int, again: int) -> None:
        super().__init__(f"{key!r} set twice")
        self.key, self.first, self.again = key, first, again


def safe_yaml(text: str, where: str) -> Any:
    """``text`` parsed as YAML with the safe loader: one line (naming ``where``) for a syntax error, a key
    set twice in one mapping, or a document whose aliases expand beyond ``MAX_VALUES`` values."""
    try:
        loaded = yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as exc:
        raise ConfigError(f"{where} sets {exc.key!r} twice in one mapping (lines {exc.first} and {exc.again}); "
                          "keep one") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{where} is not valid YAML{at}; fix the syntax") from None
    if _count_values(loaded, MAX_VALUES) > MAX_VALUES:
        raise ConfigError(f"{where} expands to more than {MAX_VALUES:,} values (YAML aliases repeating one another); "
                          "write the settings out")
    return loaded


def _count_values(value: Any, limit: int) -> int:
    """Values in ``value`` counted as a tree (an alias counts each time it is used), stopping past ``limit``."""
    count, stack = 0, [value]
    while stack and count <= limit:
        current = stack.pop()
        count += 1
        if isinstance(current, dict):
            stack.extend(current.keys())
            stack.extend(current.values())
        elif isinstance(current, list):
            stack.extend(current)
    return count


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected dotted.key=value, e.g. train.steps=100")
    key, raw = item.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"override {item!r}: empty key segment; expected dotted.key=value")
    try:
        value = safe_yaml(raw, f"override {key.strip()}") if raw.strip() else None
    except ConfigError as exc:
        if "not valid YAML" not in str(exc):
            raise
        value = raw
    if isinstance(value, (bool, int, float)) and _is_text_setting(path):
        value = raw.strip()  # run.name=2024 or data.hf_config=20220301 stay the text typed
    return path, value


def _is_text_setting(path: list[str]) -> bool:
    """Whether ``path`` names a free-text (``str`` or ``str | None``) setting."""
    model: type[BaseModel] = MeshtrainConfig
    for part in path[:-1]:
        annotation = model.model_fields[part].annotation if part in model.model_fields else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return False
        model = annotation
    field = model.model_fields.get(path[-1])
    if field is None:
        return False
    annotation = field.annotation
    return annotation is str or (
        get_origin(annotation) in (Union, UnionType) and set(get_args(annotation)) == {str, type(None)}
    )


def _set_dotted(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path)}: {part!r} is a value, not a section")
        node = child
    node[path[-1]] = value


def _format_validation_error(error: ValidationError) -> str:
    first = error.errors()[0]
    location = ".".join(str(part) for part in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        section = ".".join(str(part) for part in first["loc"][:-1])
        known = _field_names(section)
        return f"{location}: unknown setting; {section or 'top level'} accepts {', '.join(known)}"
    if _NAMES_ITS_FIELD.match(message):
        return message
    value = first.get("input")
    # Our own validators (value_error) already quote the value they reject.
    quoted = first["type"] == "value_error"
    if quoted:
        shown = ""
    elif isinstance(value, dict):
        shown = " (got a mapping of sub-keys, not a single value)"
    elif value is None:
        shown = " (got an empty value)"
    elif "storage_options" in first["loc"]:
        shown = ""  # may be a credential
    else:
        text = repr(redact_url(value) if isinstance(value, str) else value)
        shown = f" (got {text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + '...'})"
    return f"{location}: {message}{shown}" if location else message


def _field_names(section: str) -> list[str]:
    model: type[BaseModel] = MeshtrainConfig
    for part in filter(None, section.split(".")):
        annotation = model.model_fields[part].annotation
        if get_origin(annotation) in (Union, UnionType):  # an optional section (model.rope_scaling)
            annotation = next(member for member in get_args(annotation) if member is not type(None))
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def load_config(path: str | os.PathLike[str] | None = None, overrides: list[str] | None = None) -> MeshtrainConfig:
    """Defaults, then the YAML file, then ``dotted.key=value`` overrides; one-line errors."""
    tree: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"--config: {str(path)!r} is not a file; give a YAML config path")
        try:
            text = file.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--config: cannot read {path} ({one_line(exc)}); give a readable UTF-8 YAML file") from None
        loaded = safe_yaml(text, f"--config: {path}")
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"--config: {path} must hold a mapping of sections (model:, train:, ...)")
        tree = loaded or {}
    for item in overrides or []:
        key_path, value = _parse_override(item)
        _set_dotted(tree, key_path, value)
    try:
        return MeshtrainConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc)) from None


def describe_fields(model: type[BaseModel] = MeshtrainConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, description) for every setting, for --help output."""
    rows: list[tuple[str, str, str]] = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.extend(describe_fields(annotation, f"{prefix}{name}."))
        else:
            rows.append((f"{prefix}{name}", repr(field.default), field.description or ""))
    return rows
