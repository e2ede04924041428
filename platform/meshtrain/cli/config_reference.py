"""The configuration reference, ``docs/configuration.md``, generated from the schema.

    python jobs/config_reference.py            # print the reference
    python jobs/config_reference.py --write    # write docs/configuration.md
    python jobs/config_reference.py --check    # exit 1 when docs/configuration.md differs from the schema

One section per config section, each a table of dotted key, type, default and description (the
fields' own descriptions, as ``python jobs/pretrain.py --help`` prints them), then the model presets.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from meshtrain.cli.common import generated_page
from meshtrain.config import MODEL_PRESETS
from meshtrain.config.schema import MeshtrainConfig

REPO = Path(__file__).resolve().parents[3]
REFERENCE = REPO / "docs" / "configuration.md"
COMMAND = "python jobs/config_reference.py --write"

INTRO = f"""\
# Configuration reference

Every setting of a meshtrain run, with its type, default and meaning. Generated from the schema
(`platform/meshtrain/config/`) by `{COMMAND}`; edit the schema's descriptions, not this page.
[README](../README.md) · [documentation index](../README.md#documentation)

Settings come from the defaults, then `--config FILE` (YAML, sections as below), then `key=value`
overrides on the command line (dotted keys, YAML values: `train.steps=500`, `'profile.ranks=[0,8]'`).
Any bad input (an unknown key, a wrong type, `inf` or `nan` in any number, a shard size that does not
divide the workers, an unknown preset, a missing data path, ...) exits with code 2 and one line naming
the field and the fix. How sections work together (the mesh, the batch, the
data order, checkpoints and resuming) is explained on the topic pages linked from the index.
`python jobs/pretrain.py --help` prints the same settings; `--dry-run` prints a resolved config.
"""


def _type_name(annotation: Any) -> str:
    """A field's type in words: ``int``, ``float or null``, `` `cosine`, `linear` ``, ``list of str``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return ", ".join(f"`{value}`" for value in args)
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(arg) for arg in args if arg is not type(None)]
        if type(None) in args:
            names.append("null")
        return " or ".join(names)
    if origin is list:
        item = _type_name(args[0]) if args else "any"
        return "list of sections" if item == "section" else f"list of {item}"
    if origin is dict:
        return "mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def _sections_of(annotation: Any) -> list[type[BaseModel]]:
    """The config sections an annotation holds: itself, an optional one, or a list of them."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _sections_of(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType, list):
        return [section for arg in typing.get_args(annotation) for section in _sections_of(arg)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return []


def _size_note(value: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if value >= size and value % size == 0:
            return f" ({value // size} {unit})"
    return ""


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    text = text.removesuffix("...").strip()
    note = _size_note(value) if isinstance(value, int) and not isinstance(value, bool) else ""
    return f"`{text}`{note}"


def _cell(text: str) -> str:
    """Table-cell markdown: pipes escaped, angle brackets and asterisks escaped outside code spans, one line."""
    parts = " ".join(text.split()).split("`")
    for index in range(0, len(parts), 2):  # even parts lie outside code spans
        parts[index] = parts[index].replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")
    return "`".join(parts).replace("|", "\\|")


def _rows(model: type[BaseModel], prefix: str) -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, description) of every setting under ``model``; a subsection's
    settings follow it, a list of sections shows its entries' fields as ``key[].field``."""
    rows: list[tuple[str, str, str, str]] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        sections = _sections_of(annotation)
        nested = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        if not nested:
            rows.append((f"`{key}`", _type_name(annotation), _default(field), _cell(field.description or "")))
        for section in sections:
            is_list = typing.get_origin(annotation) is list or any(
                typing.get_origin(arg) is list for arg in typing.get_args(annotation)
            )
            rows.extend(_rows(section, f"{key}[]." if is_list else f"{key}."))
    return rows


def setting_keys() -> set[str]:
    """Every section and dotted setting of the schema (entries of a list as ``data.sources.weight``)."""
    keys = set()
    for name, field in MeshtrainConfig.model_fields.items():
        keys.add(name)
        for key, *_ in _rows(field.annotation, f"{name}."):
            dotted = key.strip("`").replace("[]", "")
            keys |= {".".join(dotted.split(".")[:end]) for end in range(2, dotted.count(".") + 2)}
    return keys


def _table(rows: list[tuple[str, str, str, str]]) -> list[str]:
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    lines += [f"| {key} | {kind} | {default} | {description} |" for key, kind, default, description in rows]
    return lines


def _parameters(shape: dict[str, Any], vocab: int) -> int:
    """Parameters of a Llama of this shape (no biases): embeddings, blocks, final norm, head."""
    dim, heads, kv_heads = shape["dim"], shape["n_heads"], shape["n_kv_heads"]
    head_dim = dim // heads
    attention = dim * heads * head_dim + 2 * dim * kv_heads * head_dim + heads * head_dim * dim
    block = attention + 3 * dim * shape["ffn_dim"] + 2 * dim
    head = 0 if shape["tie_embeddings"] else vocab * dim
    return vocab * dim + shape["n_layers"] * block + dim + head


def _count(value: int) -> str:
    return f"{value / 1e9:.2f}B" if value >= 1e9 else f"{value / 1e6:.1f}M"


def _presets() -> list[str]:
    default_vocab = MeshtrainConfig().data.vocab_size
    lines = [
        "## Model presets",
        "",
        "`model.preset` picks a shape; any shape field set beside it overrides the preset's value "
        "(`model.n_layers=8`, `model.rope_scaling.factor=8`). A preset without a vocabulary takes the "
        f"tokenizer's, rounded up to a multiple of 64 (the parameters below count the default "
        f"`data.vocab_size={default_vocab}`).",
        "",
        "| preset | parameters | dim | layers | heads | KV heads | FFN | vocabulary | positions | RoPE base "
        "| tied | RoPE scaling |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, shape in MODEL_PRESETS.items():
        vocab = shape["vocab_size"]
        scaling = shape.get("rope_scaling")
        scaling_text = (
            f"llama3, factor {scaling['factor']:g}, from {scaling['original_max_position_embeddings']:,}"
            if scaling else "none"
        )
        lines.append(
            f"| `{name}` | {_count(_parameters(shape, vocab or default_vocab))} | {shape['dim']} | "
            f"{shape['n_layers']} | {shape['n_heads']} | {shape['n_kv_heads']} | {shape['ffn_dim']} | "
            f"{f'{vocab:,}' if vocab else 'the tokenizer'} | {shape['max_seq_len']:,} | {shape['rope_theta']:g} | "
            f"{'yes' if shape['tie_embeddings'] else 'no'} | {scaling_text} |"
        )
    return lines


def render() -> str:
    """The whole reference page, as markdown."""
    sections = MeshtrainConfig.model_fields
    lines = [INTRO, "Sections: " + ", ".join(f"[`{name}`](#{name})" for name in sections)
             + ", and the [model presets](#model-presets).", ""]
    for name, field in sections.items():
        section = field.annotation
        assert isinstance(section, type) and issubclass(section, BaseModel), name
        lines += [f"## {name}", "", _cell(field.description or ""), ""]
        lines += _table(_rows(section, f"{name}."))
        lines.append("")
    lines += _presets()
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return generated_page("config_reference.py", "the configuration reference", "the schema", render, REFERENCE,
                          COMMAND, argv)
