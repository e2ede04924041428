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
import io
import json
import os
import re
import secrets
import socket
import sysconfig
from collections.abc import Generator, Iterator
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
    """The documents of one unit, in order, each whole."""
    for document in unit_documents(plan, unit):
        yield "".join(document)


class ReadProgress:
    """How many source bytes of a unit's documents its reader has read so far (prepare's progress line):
    of a range of a JSON Lines file, the bytes of the lines that start in it (the whole of a line that
    runs past its end, none of the one that runs into its start), so a file's ranges add up to the file."""

    def __init__(self) -> None:
        self.bytes = 0


def unit_documents(
    plan: SourcePlan, unit: Unit, progress: ReadProgress | None = None,
) -> Generator[Iterator[str], None, None]:
    """The documents of one unit, in order, each as the consecutive parts of its text.

    A text file, and a JSON Lines record longer than ``LONG_LINE_BYTES``, come in parts of about
    ``READ_BYTES`` (see :func:`_long_record`), so a document's length never decides what a reader
    holds; every other document is one part (Arrow hands rows over whole). Take a document's parts
    before asking for the next document (one left unfinished is skipped). ``progress`` follows the
    bytes read (files read by Arrow count whole once read).
    """
    progress = progress or ReadProgress()
    if plan.loader == "json" and all(name.lower().endswith(".jsonl") for name in unit.files):
        base = 0
        for name in unit.files:
            yield from _jsonl_documents(name, unit.start or 0, unit.end, plan.field, progress, base)
            base += _file_bytes(name)
        return
    if plan.loader == "text":
        yield from _text_documents(unit, progress)
        return
    try:
        import datasets

        datasets.disable_progress_bars()
        if plan.loader == "hub":
            stream = _hub_stream(plan.source).shard(num_shards=plan.hub_shards, index=unit.hub_shard)
        else:
            stream = datasets.load_dataset(plan.loader, data_files=list(unit.files), split="train", streaming=True)
        for number, row in enumerate(stream):
            text = row.get(plan.field)
            if not isinstance(text, str):
                raise _not_text(plan, unit, row, number)
            yield iter((text,))
        progress.bytes = unit.bytes  # Arrow reads whole files: no position to follow
    except ConfigError:
        raise
    except Exception as exc:  # pyarrow/json/datasets errors: name the files and the problem
        raise ConfigError(f"data.source: cannot read {_where(unit)} ({first_line(exc)}); check the files") from None


# A JSON Lines record longer than this is read in parts (see _long_record), and text files always are:
# READ_BYTES at a time, instead of one line, one str and one parsed value of the document's whole length.
LONG_LINE_BYTES = 1 << 22
READ_BYTES = 1 << 20


def _text_documents(unit: Unit, progress: ReadProgress) -> Iterator[Iterator[str]]:
    """Each file whole, as one document: what ``datasets``' text loader gives with ``sample_by="document"``
    (UTF-8, universal newlines), read without it, so a run on plain-text files needs no ``datasets``."""
    base = 0
    for name in unit.files:
        yield _text_parts(name, unit, progress, base)
        base += _file_bytes(name)


def _file_bytes(name: str) -> int:
    try:
        return os.path.getsize(name)
    except OSError:  # gone: reading it says so
        return 0


def _text_parts(name: str, unit: Unit, progress: ReadProgress, base: int) -> Iterator[str]:
    """One text file in parts of ``READ_BYTES`` characters (newlines translated across parts as a whole
    read translates them)."""
    try:
        with open(name, "rb") as raw, io.TextIOWrapper(raw, encoding="utf-8") as file:  # what open(name) gives
            while part := file.read(READ_BYTES):
                progress.bytes = base + raw.tell()
                yield part
    except Exception as exc:  # undecodable bytes, a file gone: name it
        raise ConfigError(f"data.source: cannot read {_where(unit)} ({first_line(exc)}); check the files") from None


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


def _jsonl_documents(
    path: str, start: int, end: int | None, field: str, progress: ReadProgress | None = None, base: int = 0,
) -> Iterator[Iterator[str]]:
    """The ``field`` of every JSON Lines record that *starts* in bytes ``[start, end)`` of ``path``.

    Ranges cut anywhere: the line that straddles ``start`` belongs to the range before it, so
    consecutive ranges read every line exactly once. Read directly (one ``json.loads`` per line)
    rather than through ``datasets``, which cannot read a byte range. A line longer than
    ``LONG_LINE_BYTES`` is read in parts (:func:`_long_record`).
    """
    progress = progress or ReadProgress()
    try:
        with open(path, "rb") as file:
            if start > 0:
                file.seek(start - 1)
                if file.read(1) != b"\n":
                    _skip_line(file, end)
            first = file.tell()  # where the range's first line starts
            while end is None or file.tell() < end:
                offset = file.tell()
                line = file.readline(LONG_LINE_BYTES)
                if not line:
                    break
                if len(line) == LONG_LINE_BYTES and not line.endswith(b"\n"):
                    del line
                    file.seek(offset)
                    text = _long_record(path, file, offset, field, progress, base - first)
                    if text is not None:
                        yield text
                    progress.bytes = base + file.tell() - first
                    continue
                progress.bytes = base + file.tell() - first
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    raise _not_json(path, offset, exc) from None
                yield iter((_checked_text(_record_text(row, path, offset, field), path, offset, field),))
    except OSError as exc:
        raise ConfigError(f"data.source: cannot read {path} ({exc.strerror or exc}); check the file") from None


def _skip_line(file: Any, end: int | None) -> None:
    """Move past the rest of the line, or at least to ``end`` (no line of the range starts before the
    line's end then), holding at most ``READ_BYTES`` of it."""
    while (part := file.readline(READ_BYTES)) and not part.endswith(b"\n"):
        if end is not None and file.tell() >= end:
            return


def _not_json(path: str, offset: int, exc: BaseException) -> ConfigError:
    return ConfigError(f"data.source: {path} is not JSON Lines at byte {offset} ({first_line(exc)}); fix or remove that line")


def _record_text(row: Any, path: str, offset: int, field: str) -> Any:
    """``row[field]``, or the one line saying why a record has no text there."""
    if not isinstance(row, dict) or field not in row:
        columns = ", ".join(row) if isinstance(row, dict) else f"a {type(row).__name__}, not an object"
        raise ConfigError(
            f"data.text_field: column {field!r} not in {path} at byte {offset} (columns: {columns}); "
            "set data.text_field to the column holding the text"
        )
    return row[field]


def _checked_text(value: Any, path: str, offset: int, field: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(
            f"data.text_field: column {field!r} of {path} at byte {offset} holds "
            f"{type(value).__name__}, not text; set data.text_field to the column holding the text"
        )
    return value


# --- long JSON Lines records, read in parts -----------------------------------------------------------
#
# A record of hundreds of MB read as one line is held several times over (the line, its decoded text,
# the parsed value), so a record longer than LONG_LINE_BYTES is read twice, READ_BYTES at a time. The
# first pass checks it is JSON and notes where its long strings lie: the record less the content of its
# strings longer than LONG_STRING_BYTES (each left as a placeholder) is parsed by ``json.loads``, and each
# long string's content is decoded part by part as ``json.loads`` would decode it whole. The second pass
# decodes the text field's content again, part by part, for the tokenizer. Each part is cut where no
# escape, UTF-8 character or surrogate pair (\\ud83d\\ude00) spans the cut, so the parts join to exactly
# the value ``json.loads`` gives the whole line.
LONG_STRING_BYTES = 1 << 16
_BACKSLASH, _QUOTE = 0x5C, 0x22
_HIGH_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}")


def _long_record(
    path: str, file: Any, offset: int, field: str, progress: ReadProgress, shift: int,
) -> Iterator[str] | None:
    """The text of the record at ``offset`` (the file is there), as parts; the file is left after its line.
    None for a line of whitespace only. While the parts are read, ``progress.bytes`` is ``shift`` plus
    the file position."""
    scan = _RecordScan()
    try:
        while not scan.ended and (block := file.read(READ_BYTES)):
            scan.feed(block)
        if not scan.ended:  # the file ends without a newline: the line ends there
            scan.end()
        if scan.blank:
            return None
        row = json.loads(bytes(scan.skeleton))
    except ValueError as exc:
        raise _not_json(path, offset, exc) from None
    file.seek(offset + scan.length)
    value = _record_text(row, path, offset, field)
    span = scan.spans.get(value) if isinstance(value, str) else None
    if span is None:
        return iter((_checked_text(value, path, offset, field),))
    start, end = span
    return _string_parts(path, offset, offset + start, offset + end, progress, shift)


def _string_parts(path: str, offset: int, start: int, end: int, progress: ReadProgress, shift: int) -> Iterator[str]:
    """The decoded content of the JSON string whose raw bytes are ``[start, end)`` of ``path`` (in the
    record at ``offset``)."""
    decoder = _StringDecoder()
    try:
        with open(path, "rb") as file:
            file.seek(start)
            while start < end:
                block = file.read(min(READ_BYTES, end - start))
                if not block:
                    raise ValueError("the file ended before the record did (was it changed while read?)")
                start += len(block)
                progress.bytes = shift + start
                if text := decoder.feed(block):
                    yield text
            if text := decoder.finish():
                yield text
    except ValueError as exc:
        raise _not_json(path, offset, exc) from None
    except OSError as exc:
        raise ConfigError(f"data.source: cannot read {path} ({exc.strerror or exc}); check the file") from None


class _RecordScan:
    """One pass over a long record, fed in blocks: its ``skeleton`` (the line with the content of each
    long string replaced by a placeholder), the raw byte range of each long string by placeholder
    (``spans``), and every long string's content checked by decoding it."""

    def __init__(self) -> None:
        self.skeleton = bytearray()
        self.spans: dict[str, tuple[int, int]] = {}
        self.length = 0  # bytes of the line scanned, its newline included
        self.ended = False
        self.blank = True  # nothing but whitespace so far
        self._nonce = secrets.token_hex(8)
        self._in_string = False
        self._content = bytearray()  # the current string's content while it is short
        self._decoder: _StringDecoder | None = None  # the current string's, once it is long
        self._start = 0  # the current string's first content byte, in the line
        self._run = 0  # backslashes at the end of the current string's content so far

    def feed(self, block: bytes) -> None:
        newline = block.find(b"\n")
        if newline >= 0:
            block = block[:newline]
        base = self.length
        self.length += len(block) + (newline >= 0)
        if self.blank and block.strip():
            self.blank = False
        pos = 0
        while pos < len(block):
            if not self._in_string:
                quote = block.find(b'"', pos)
                if quote < 0:
                    self.skeleton += block[pos:]
                    break
                self.skeleton += block[pos : quote + 1]
                self._in_string, self._start, self._run = True, base + quote + 1, 0
                pos = quote + 1
                continue
            quote = self._closing_quote(block, pos)
            if quote < 0:
                self._add(block[pos:])
                self._run = _trailing_backslashes(block, pos, len(block), self._run)
                break
            self._add(block[pos:quote])
            self._close(base + quote)
            pos = quote + 1
        if newline >= 0:
            self.end()

    def _closing_quote(self, block: bytes, pos: int) -> int:
        """The first quote at or after ``pos`` that ends the string (an even run of backslashes before it), or -1."""
        search = pos
        while (quote := block.find(b'"', search)) >= 0:
            if _trailing_backslashes(block, pos, quote, self._run) % 2 == 0:
                return quote
            search = quote + 1
        return -1

    def end(self) -> None:
        self.ended = True
        if self._in_string:
            raise ValueError(f"Unterminated string starting at: char {self._start - 1}")

    def _add(self, content: bytes) -> None:
        self._content += content
        if self._decoder is None and len(self._content) > LONG_STRING_BYTES:
            self._decoder = _StringDecoder()
        if self._decoder is not None and len(self._content) >= READ_BYTES:
            self._decoder.feed(bytes(self._content))  # checked READ_BYTES at a time
            self._content.clear()

    def _close(self, end: int) -> None:
        self._in_string = False
        if self._decoder is None:
            self.skeleton += self._content + b'"'
            self._content.clear()
            return
        self._decoder.feed(bytes(self._content))
        self._content.clear()
        self._decoder.finish()
        self._decoder = None
        placeholder = f"meshtrain-long-string-{self._nonce}-{len(self.spans)}"
        self.spans[placeholder] = (self._start, end)
        self.skeleton += placeholder.encode() + b'"'


def _trailing_backslashes(block: bytes, start: int, end: int, before: int) -> int:
    """Backslashes just before ``end`` in ``block[start:end]``, plus ``before`` where they reach ``start``."""
    index = end
    while index > start and block[index - 1] == _BACKSLASH:
        index -= 1
    return end - index + (before if index == start else 0)


class _StringDecoder:
    """The content of a JSON string decoded as it is fed in raw parts, each part's complete prefix at once."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, raw: bytes) -> str:
        data = self._pending + raw if self._pending else raw
        cut = _whole_prefix(data)
        self._pending = data[cut:]
        return _decode(data[:cut]) if cut else ""

    def finish(self) -> str:
        data, self._pending = self._pending, b""
        return _decode(data) if data else ""


def _decode(raw: bytes) -> str:
    """String content as ``json.loads`` decodes a line (UTF-8, surrogates passed, strict)."""
    return json.loads('"' + raw.decode("utf-8", "surrogatepass") + '"')


def _whole_prefix(data: bytes) -> int:
    """Where ``data``, the start of a JSON string's content, may be cut: not inside an escape, a UTF-8
    character, or between a high-surrogate escape and the escape after it (json pairs the two)."""
    cut = len(data)
    for i in range(max(0, cut - 3), cut):  # before the last lead byte in the last 3: never inside a character
        if data[i] >= 0xC0:
            cut = i
    if _escaping(data, cut - 1):  # a backslash whose escaped character is not here yet
        cut -= 1
    for start in range(cut - 2, max(cut - 6, -1), -1):  # inside a \uXXXX
        if data[start] == _BACKSLASH and data[start + 1] == ord("u") and _escaping(data, start):
            cut = start
            break
    if cut >= 6 and _HIGH_SURROGATE.fullmatch(data, cut - 6, cut) and _escaping(data, cut - 6):
        cut -= 6
    return cut


def _escaping(data: bytes, index: int) -> bool:
    """Whether ``data[index]`` is a backslash that begins an escape (an odd run of backslashes ends there)."""
    if index < 0 or data[index] != _BACKSLASH:
        return False
    start = index
    while start > 0 and data[start - 1] == _BACKSLASH:
        start -= 1
    return (index - start) % 2 == 0
