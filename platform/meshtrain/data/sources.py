"""Where documents come from: the standard library's sources, local files, or a Hub dataset.

A source is cut into *units* (groups of whole files, or shards of a streamed Hub dataset) that are
tokenized independently, one prepare task each. Documents are read through Hugging Face
``datasets`` in streaming mode, so no Arrow copy of the corpus is written and memory stays bounded.
The order of documents (units in listing order, documents in file order) is fixed by the source
alone, never by how many CPUs read it.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import json
import os
import socket
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict

from meshtrain.config import ConfigError, SourceConfig, redact_url

LOADERS_BY_SUFFIX = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# Files with one document each (read whole); the others hold one document per row.
_DOCUMENT_PER_FILE = {"text"}


def stdlib_source_files() -> list[Path]:
    """The top-level ``*.py`` files of this interpreter's standard library (present on every machine)."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def expand_local_source(source: str) -> list[Path]:
    """Data files named by a file, a directory (searched recursively) or a glob: each file once, sorted.

    Symlinks never make a file count twice. A directory is searched without entering the symlinked
    folders inside it (as before). A glob follows symlinks like ``glob`` does, so a link to a folder on
    another disk still adds that folder's files, but ``**`` enters each real folder once: a link to a
    folder it has entered already (``ver/latest -> v2`` beside ``ver/v2``) adds nothing, and a loop
    (``up -> ..``) can neither multiply the listing nor keep it walking. A file reached under several
    names (a folder link, a file link) is listed once, under the first of them in path order.
    """
    path = Path(source).expanduser()
    if path.is_file():
        candidates = [path]
    elif path.is_dir():
        candidates = sorted(p for p in path.rglob("*") if p.is_file())
    elif "**" in path.parts:
        candidates = sorted(p for p in _recursive_glob(path) if p.is_file())
    else:  # no **: every match is at a fixed depth, so links cannot loop
        candidates = sorted(Path(p) for p in glob.glob(str(path)) if Path(p).is_file())
    return _each_file_once([p for p in candidates if p.suffix.lower() in LOADERS_BY_SUFFIX])


def _recursive_glob(pattern: Path) -> list[Path]:
    """What ``glob.glob(pattern, recursive=True)`` matches (hidden names only by a pattern that starts
    with a dot, ``**`` any depth of non-hidden folders), with each ``**`` entering a real folder once."""
    parts = pattern.parts
    fixed = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    entered: set[tuple[str, int]] = set()
    found: list[Path] = []

    def walk(directory: Path, position: int) -> None:
        if position == len(parts):
            found.append(directory)
            return
        part, last = parts[position], position + 1 == len(parts)
        if part == "**":
            key = (os.path.realpath(directory), position)
            if key in entered:  # this folder, under another name or through a loop: its matches are in
                return
            entered.add(key)
            walk(directory, position + 1)  # ** as no folder at all
            for child, is_dir in _children(directory):
                if not child.name.startswith("."):
                    if is_dir:
                        walk(child, position)
                    elif last:
                        found.append(child)
        elif glob.has_magic(part):
            for child, _ in _children(directory):
                if (part.startswith(".") or not child.name.startswith(".")) and fnmatch.fnmatchcase(child.name, part):
                    walk(child, position + 1)
        elif os.path.lexists(directory / part) if last else (directory / part).is_dir():
            walk(directory / part, position + 1)

    walk(Path(*parts[:fixed]) if fixed else Path(), fixed)
    return found


def _children(directory: Path) -> list[tuple[Path, bool]]:
    """(path, is a folder or a link to one) of every entry, by name."""
    try:
        with os.scandir(directory) as entries:
            found = [(entry.name, entry) for entry in entries]
    except OSError:  # not a folder, or one this user cannot list: nothing matches below it (as in glob)
        return []
    return [(directory / name, _is_dir(entry)) for name, entry in sorted(found, key=lambda item: item[0])]


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # follows a link; no system call for a plain entry
    except OSError:
        return False


def _each_file_once(files: list[Path]) -> list[Path]:
    """``files`` without those whose real path an earlier one has (each folder resolved once)."""
    folders: dict[Path, str] = {}
    seen: set[str] = set()
    kept = []
    for file in files:
        if file.parent not in folders:
            folders[file.parent] = os.path.realpath(file.parent)
        real = os.path.realpath(file) if file.is_symlink() else os.path.join(folders[file.parent], file.name)
        if real not in seen:
            seen.add(real)
            kept.append(file)
    return kept


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


class Unit(BaseModel):
    """One prepare task's input: whole files, a byte range of one JSON Lines file, or one Hub shard."""

    model_config = ConfigDict(frozen=True)

    index: int
    files: tuple[str, ...] = ()
    # A byte range of the one file in ``files`` (JSON Lines only); None = whole files.
    start: int | None = None
    end: int | None = None
    hub_shard: int | None = None
    bytes: int = 0


class SourcePlan(BaseModel):
    """A source resolved against the world: its loader, units and content fingerprint."""

    model_config = ConfigDict(frozen=True)

    source: SourceConfig
    loader: str
    field: str
    units: tuple[Unit, ...]
    fingerprint: str
    hub_shards: int = 0

    @property
    def bytes(self) -> int:
        return sum(unit.bytes for unit in self.units)

    def describe(self) -> dict[str, Any]:
        return {"source": redact_url(self.source.source), "loader": self.loader, "field": self.field,
                "units": len(self.units), "bytes": self.bytes, "fingerprint": self.fingerprint}


# A corpus is cut into at least this many units where it can be (files are split at JSON Lines
# boundaries), so a cluster has work for all its CPUs and the last tasks finish close together.
# Units are not made smaller than MIN_UNIT_BYTES for that (a task's start-up would dominate), and
# no file is split into ranges smaller than MIN_UNIT_BYTES.
UNITS_WANTED = 64
MIN_UNIT_BYTES = 1 << 20


def unit_target(total_bytes: int, unit_bytes: int) -> int:
    """Source bytes per unit: at most ``unit_bytes``, less for a small corpus (see UNITS_WANTED)."""
    return max(min(unit_bytes, MIN_UNIT_BYTES), min(unit_bytes, -(-total_bytes // UNITS_WANTED)))


def _cut_units(files: list[Path], unit_bytes: int) -> tuple[Unit, ...]:
    """Cut the listing into units of about ``unit_target`` bytes.

    Small files are grouped in order; a ``.jsonl`` file larger than the target is split into equal
    byte ranges of at least MIN_UNIT_BYTES (each owns the lines that start inside it, see
    ``_jsonl_documents``). Other formats are never split: a text file is one document, and a parquet
    file is read whole by Arrow.
    """
    sizes = [path.stat().st_size for path in files]
    target = unit_target(sum(sizes), unit_bytes)
    units: list[Unit] = []
    group: list[str] = []
    grouped = 0

    def close_group() -> None:
        nonlocal group, grouped
        if group:
            units.append(Unit(index=len(units), files=tuple(group), bytes=grouped))
        group, grouped = [], 0

    for path, size in zip(files, sizes):
        pieces = min(-(-size // target), size // MIN_UNIT_BYTES) if path.suffix.lower() == ".jsonl" else 1
        if pieces > 1:
            close_group()
            step = -(-size // pieces)
            for start in range(0, size, step):
                end = min(start + step, size)
                units.append(Unit(index=len(units), files=(str(path),), start=start, end=end, bytes=end - start))
            continue
        group.append(str(path))
        grouped += size
        if grouped >= target:
            close_group()
    close_group()
    return tuple(units)


def _files_fingerprint(files: list[Path], root: Path | None) -> str:
    """Names, sizes and modification times of the files: cheap to compute on a 10 TB corpus, and it
    changes whenever a file is rewritten. (The store's own fingerprint hashes the tokens.)"""
    digest = hashlib.sha256()
    for path in files:
        stat = path.stat()
        name = str(path.relative_to(root)) if root is not None else str(path)
        digest.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def plan_source(source: SourceConfig, unit_bytes: int) -> SourcePlan:
    """List a source's files (or Hub shards) and cut them into prepare units."""
    if source.source == "stdlib":
        files = stdlib_source_files()
        if source.max_documents is not None:
            files = files[: source.max_documents]
        return SourcePlan(
            source=source, loader="text", field="text", units=_cut_units(files, unit_bytes),
            fingerprint=_files_fingerprint(files, files[0].parent),
        )
    if source.source.startswith("hf:"):
        return _plan_hub_source(source)
    files = expand_local_source(source.source)
    if not files:
        raise ConfigError(
            f"data.source: no .txt/.jsonl/.json/.parquet files at {redact_url(source.source)!r}; give an existing file, "
            "directory or glob, 'stdlib', or 'hf:<dataset>'"
        )
    loaders = {LOADERS_BY_SUFFIX[p.suffix.lower()] for p in files}
    if len(loaders) != 1:
        raise ConfigError(
            f"data.source: {redact_url(source.source)!r} mixes formats ({', '.join(sorted(loaders))}); point it at one kind of file"
        )
    empty = next((p for p in files if p.stat().st_size == 0), None)
    if empty is not None:
        raise ConfigError(f"data.source: {empty} is empty; remove it or point data.source at the other files")
    loader = loaders.pop()
    if loader in _DOCUMENT_PER_FILE and source.max_documents is not None:
        files = files[: source.max_documents]
    field = "text" if loader in _DOCUMENT_PER_FILE else source.text_field
    root = Path(source.source).expanduser()
    return SourcePlan(
        source=source, loader=loader, field=field, units=_cut_units(files, unit_bytes),
        fingerprint=_files_fingerprint(files, root if root.is_dir() else None),
    )


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def check_hub_reachable(source: str, timeout_s: float = 3.0) -> None:
    """Fail in seconds, with one line, where the Hub cannot be reached (instead of retrying for long)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes"}:
        raise ConfigError(
            f"data.source: {redact_url(source)!r} needs the Hugging Face Hub but HF_HUB_OFFLINE is set; "
            "prepare it on a connected machine (jobs/prepare_data.py) and point data.source at the token store"
        )
    url = urlparse(hub_endpoint())
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "", port), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(
            f"data.source: cannot reach {url.scheme}://{url.hostname} to stream {redact_url(source)!r} ({exc}); "
            "prepare it on a connected machine (jobs/prepare_data.py) and point data.source at the token store"
        ) from None


def _hub_stream(source: SourceConfig) -> Any:
    import datasets

    datasets.disable_progress_bars()
    return datasets.load_dataset(source.source[3:], source.hf_config, split=source.split, streaming=True)


def _plan_hub_source(source: SourceConfig) -> SourcePlan:
    check_hub_reachable(source.source)
    try:
        stream = _hub_stream(source)
        revision = _hub_revision(source.source[3:])
    except Exception as exc:  # datasets/hub raise many types; the user needs the source named
        raise ConfigError(
            f"data.source: cannot open {redact_url(source.source)!r} ({first_line(exc)}); check the dataset name, "
            "data.hf_config and data.split"
        ) from None
    if source.text_field not in (stream.column_names or [source.text_field]):
        raise ConfigError(
            f"data.text_field: column {source.text_field!r} not in {redact_url(source.source)!r} "
            f"(columns: {', '.join(stream.column_names)})"
        )
    shards = stream.num_shards
    key = json.dumps([source.source, source.hf_config, source.split, revision, source.max_documents])
    return SourcePlan(
        source=source, loader="hub", field=source.text_field,
        units=tuple(Unit(index=i, hub_shard=i) for i in range(shards)),
        fingerprint=hashlib.sha256(key.encode()).hexdigest(), hub_shards=shards,
    )


def _hub_revision(name: str) -> str:
    from huggingface_hub import HfApi

    return HfApi().dataset_info(name).sha or "unknown"


def read_unit(plan: SourcePlan, unit: Unit) -> Iterator[str]:
    """The documents of one unit, in order."""
    if plan.loader == "json" and all(name.lower().endswith(".jsonl") for name in unit.files):
        for name in unit.files:
            yield from _jsonl_documents(name, unit.start or 0, unit.end, plan.field)
        return
    try:
        if plan.loader == "text":
            yield from _text_documents(unit.files)
            return
        import datasets

        datasets.disable_progress_bars()
        if plan.loader == "hub":
            stream = _hub_stream(plan.source).shard(num_shards=plan.hub_shards, index=unit.hub_shard)
        else:
            kwargs = {"sample_by": "document"} if plan.loader == "text" else {}
            stream = datasets.load_dataset(
                plan.loader, data_files=list(unit.files), split="train", streaming=True, **kwargs
            )
        for number, row in enumerate(stream):
            text = row.get(plan.field)
            if not isinstance(text, str):
                raise _not_text(plan, unit, row, number)
            yield text
    except ConfigError:
        raise
    except Exception as exc:  # pyarrow/json/datasets errors: name the files and the problem
        raise ConfigError(f"data.source: cannot read {_where(unit)} ({first_line(exc)}); check the files") from None


def _text_documents(files: tuple[str, ...]) -> Iterator[str]:
    """Each file whole, as one document: what ``datasets``' text loader gives with ``sample_by="document"``
    (UTF-8, universal newlines), read without it, so a run on plain-text files needs no ``datasets``."""
    for name in files:
        with open(name, encoding="utf-8") as file:
            yield file.read()


def _not_text(plan: SourcePlan, unit: Unit, row: dict[str, Any], number: int) -> ConfigError:
    """The one line for row ``number`` of ``unit`` whose ``plan.field`` is missing, null or not a string."""
    field = plan.field
    if field not in row:
        return ConfigError(
            f"data.text_field: column {field!r} not in {_where(unit)} (columns: {', '.join(row)}); "
            "set data.text_field to the column holding the text"
        )
    where, number = _row_in_files(plan, unit, number)
    if row[field] is None:
        return ConfigError(
            f"data.text_field: row {number} of {where} has no text (column {field!r} is null); "
            "drop or fill that row, or set data.text_field to a column with text in every row"
        )
    return ConfigError(
        f"data.text_field: column {field!r} of {where} holds {type(row[field]).__name__} values (row {number}), "
        "not text; set data.text_field to the column holding the text"
    )


def _row_in_files(plan: SourcePlan, unit: Unit, number: int) -> tuple[str, int]:
    """(file, row within it) of the unit's row ``number``, counting each file's rows on its own
    (only on the way to an error: a unit of several files is read as one stream)."""
    if unit.hub_shard is not None or len(unit.files) == 1:
        return _where(unit), number
    import datasets

    for name in unit.files:
        rows = sum(1 for _ in datasets.load_dataset(plan.loader, data_files=[name], split="train", streaming=True))
        if number < rows:
            return name, number
        number -= rows
    return _where(unit), number


def _where(unit: Unit) -> str:
    if unit.hub_shard is not None:
        return f"hub shard {unit.hub_shard}"
    return unit.files[0] if len(unit.files) == 1 else f"{unit.files[0]} (and {len(unit.files) - 1} more files)"


def _jsonl_documents(path: str, start: int, end: int | None, field: str) -> Iterator[str]:
    """The ``field`` of every JSON Lines record that *starts* in bytes ``[start, end)`` of ``path``.

    Ranges cut anywhere: the line that straddles ``start`` belongs to the range before it, so
    consecutive ranges read every line exactly once. Read directly (one ``json.loads`` per line)
    rather than through ``datasets``, which cannot read a byte range.
    """
    try:
        with open(path, "rb") as file:
            if start > 0:
                file.seek(start - 1)
                if file.read(1) != b"\n":
                    file.readline()
            while end is None or file.tell() < end:
                offset = file.tell()
                line = file.readline()
                if not line:
                    break
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    raise ConfigError(
                        f"data.source: {path} is not JSON Lines at byte {offset} ({first_line(exc)}); "
                        "fix or remove that line"
                    ) from None
                if not isinstance(row, dict) or field not in row:
                    columns = ", ".join(row) if isinstance(row, dict) else f"a {type(row).__name__}, not an object"
                    raise ConfigError(
                        f"data.text_field: column {field!r} not in {path} at byte {offset} (columns: {columns}); "
                        "set data.text_field to the column holding the text"
                    )
                if not isinstance(row[field], str):
                    raise ConfigError(
                        f"data.text_field: column {field!r} of {path} at byte {offset} holds "
                        f"{type(row[field]).__name__}, not text; set data.text_field to the column holding the text"
                    )
                yield row[field]
    except OSError as exc:
        raise ConfigError(f"data.source: cannot read {path} ({exc.strerror or exc}); check the file") from None
