"""The record reference, ``docs/records.md``, generated from the record types of ``metrics.jsonl``.

    python jobs/record_reference.py            # print the reference
    python jobs/record_reference.py --write    # write docs/records.md
    python jobs/record_reference.py --check    # exit 1 when docs/records.md differs from the record types

One table of every kind (who writes it, what it says), then each kind's keys with their types, read
from the record classes of :data:`meshtrain.observe.run_folder.RECORD_KINDS`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

from meshtrain.cli.common import generated_page
from meshtrain.observe.run_folder import RECORD_KINDS

REPO = Path(__file__).resolve().parents[3]
REFERENCE = REPO / "docs" / "records.md"
COMMAND = "python jobs/record_reference.py --write"

INTRO = f"""\
# Record reference

Every kind of record in a run's `metrics.jsonl`, who writes it, what it says and its keys. Generated
from the record classes (`platform/meshtrain/observe/run_folder.py`, `RECORD_KINDS`) by `{COMMAND}`;
edit the classes there, not this page. [observability](observability.md) says how the records are
followed, relayed and shown.

Each line is one JSON object whose `event` names its kind. Writers build the kind's class and readers
get it back from `parse_record`, which skips a torn last line (a writer killed mid-line) and a record
that lacks a key of its kind, and keeps kinds it does not know (a newer writer) as `UnknownRecord`;
`check_record` says where a JSON object departs from its kind's keys. A key marked *optional* appears
only when it applies.
"""

def type_name(annotation: Any) -> str:
    """A record key's type as the page shows it: ``float | None``, ``list[int]``, a named object."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " or ".join(f'`"{value}"`' if isinstance(value, str) else f"`{value}`"
                           for value in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(arg) for arg in typing.get_args(annotation))
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(a) for a in typing.get_args(annotation))}]"
    if annotation is type(None):
        return "null"
    if typing.is_typeddict(annotation):
        return f"object ({', '.join(typing.get_type_hints(annotation))})"
    return getattr(annotation, "__name__", str(annotation))


def render() -> str:
    """The whole reference page, as markdown."""
    lines = [INTRO, "| kind | written by | what it says |", "|---|---|---|"]
    lines += [f"| [`{event}`](#{event}) | {kind.writer} | {kind.description} |" for event, kind in RECORD_KINDS.items()]
    lines.append("")
    for event, kind in RECORD_KINDS.items():
        hints = typing.get_type_hints(kind.record)
        lines += [f"## {event}", "", f"Written by {kind.writer}: {kind.description}.", "", "| key | type |",
                  "|---|---|", f"| `event` | {type_name(typing.Literal[event])} |"]
        fields = dataclasses.fields(kind.record)
        flat = [field for field in fields if field.metadata.get("flat")]
        required = [field for field in fields if field not in flat and field.default is not None]
        for field in required:
            lines.append(f"| `{field.name}` | {type_name(hints[field.name])} |")
        for field in fields:  # a field that defaults to None: a key written only when it applies
            if field.default is None:
                lines.append(f"| `{field.name}` | {type_name(_without_none(hints[field.name]))} (*optional*) |")
        for field in flat:  # a dict whose items are keys of the record's own
            lines.append(f"| any other key | {type_name(typing.get_args(hints[field.name])[1])} |")
        lines.append("")
    return "\n".join(lines)


def _without_none(annotation: Any) -> Any:
    """``float | None`` as ``float``: an optional key is absent rather than null."""
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    return args[0] if len(args) == 1 else annotation


def main(argv: list[str] | None = None) -> int:
    return generated_page("record_reference.py", "the record reference", "the record types", render, REFERENCE,
                          COMMAND, argv)
