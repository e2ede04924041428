"""Checksums of checkpoint files, taken as the bytes are written and checked as they are read back.

Every file DCP writes is a run of items (one tensor shard or one pickled value each), and a rank
loading a checkpoint reads whole items, never whole files. So a file's checksums are per segment:
``(offset, length, xxh3_64)`` for each item, recorded in a sidecar ``<file>.xxh3`` (JSON) that the
writing rank writes next to it. The ``COMMITTED`` marker holds the checksum of every sidecar, so a
rank verifies exactly the bytes it reads (plus the small sidecars of the files it reads), and the
export verifies whole files (their segments tile them). xxh3_64 hashes at memory speed; it guards
against damage (a bit flip, a torn or swapped file), and with the marker as the root, a change to
any file or sidecar shows unless the marker is rewritten too.
"""

from __future__ import annotations

import hashlib
import json
from typing import IO, Any

import xxhash

from meshtrain.checkpoint.errors import CheckpointError

ALGORITHM = "xxh3_64"
SIDECAR_SUFFIX = ".xxh3"
_CHUNK_BYTES = 8 * 2**20

Segment = tuple[int, int, str]  # offset, length, hex digest


def digest(data: Any) -> str:
    return xxhash.xxh3_64_hexdigest(data)


class HashedStream:
    """A binary stream being written that hashes the bytes between consecutive ``tell()`` calls.

    DCP's writer asks ``tell()`` right before and right after each item it writes (for the item's
    offset and length), so every item becomes one segment; bytes after the last ``tell()`` (the
    whole of a ``.metadata`` file) form the last segment when ``finish`` is called.
    """

    def __init__(self, stream: Any, name: str) -> None:
        self._stream, self.name = stream, name
        self._hasher = xxhash.xxh3_64()
        self._start = self._position = 0
        self.segments: list[Segment] = []

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._stream.write(view)
        self._hasher.update(view)
        self._position += len(view)
        return len(view)

    def tell(self) -> int:
        position = self._stream.tell()
        if position != self._position:  # something moved the stream: the segments would be wrong
            raise CheckpointError(f"{self.name}: stream at byte {position}, but {self._position} were written")
        self._cut()
        return position

    def finish(self) -> None:
        self._cut()

    def _cut(self) -> None:
        if self._position > self._start:
            self.segments.append((self._start, self._position - self._start, self._hasher.hexdigest()))
            self._hasher.reset()
            self._start = self._position

    def __getattr__(self, name: str) -> Any:  # flush, fileno, close, ...
        return getattr(self._stream, name)


def encode_sidecar(name: str, segments: list[Segment]) -> bytes:
    size = sum(length for _, length, _ in segments)
    document = {"algorithm": ALGORITHM, "file": name, "bytes": size, "segments": [list(s) for s in segments]}
    return json.dumps(document, separators=(",", ":")).encode()


Index = dict[int, tuple[int, str]]  # offset → (length, digest) of every segment of one file

# The commit marker's checksum of itself: the sha256 of the canonical JSON (sorted keys, no spaces, ASCII) of
# every other field, stored in the marker as this field. Like the checksums above it guards against damage (a
# torn write, a flipped bit, an edit by hand), not against a writer who recomputes it.
MARKER_CHECKSUM = "marker_sha256"


def _marker_digest(fields: dict[str, Any]) -> str:
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def seal_marker(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` as JSON reads it back (tuples as lists, keys as strings), with its ``MARKER_CHECKSUM``
    first (a marker cut short keeps it, and shows as damaged rather than as one from before the checksum)."""
    fields = json.loads(json.dumps(manifest))
    return {MARKER_CHECKSUM: _marker_digest(fields), **fields}


def unseal_marker(document: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """A read marker's fields without its checksum, and what is wrong (None: it matches). A marker without
    the field was written before meshtrain recorded it and is taken as it is (its files' checksums and
    sizes are still checked)."""
    fields = {key: value for key, value in document.items() if key != MARKER_CHECKSUM}
    if MARKER_CHECKSUM not in document:
        return fields, None
    recorded, actual = document[MARKER_CHECKSUM], _marker_digest(fields)
    if recorded != actual:
        shown = str(recorded)[:16]
        return fields, f"does not match its {MARKER_CHECKSUM} (sha256 {actual[:16]}..., recorded {shown}...)"
    return fields, None


def read_sidecar(data: bytes, name: str, expected: str, where: str) -> Index:
    """The segments of ``name``, from its sidecar's bytes ``data`` once they match the checksum
    ``expected`` (from the commit marker); they must tile the file from byte 0."""
    actual = digest(data)
    if actual != expected:
        raise _mismatch(where, name + SIDECAR_SUFFIX, 0, len(data), actual, expected)
    try:
        document = json.loads(data)
        segments = [(int(offset), int(length), str(hexdigest)) for offset, length, hexdigest in document["segments"]]
        recorded_name, size = document["file"], int(document["bytes"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{where}: {name}{SIDECAR_SUFFIX} is not a checksum list ({exc})") from None
    end = 0
    for offset, length, _ in segments:
        if offset != end:
            break
        end += length
    if recorded_name != name or end != size:
        raise CheckpointError(f"{where}: {name}{SIDECAR_SUFFIX} does not describe {name} byte for byte")
    return {offset: (length, hexdigest) for offset, length, hexdigest in segments}


def check_item(data: bytes | memoryview, name: str, offset: int, index: Index, where: str) -> None:
    """One-line CheckpointError unless ``data``, read from ``name`` at ``offset``, is a segment the
    save wrote there, unchanged."""
    if offset not in index:
        raise CheckpointError(
            f"{where}: {name} has no item at offset {offset} in its checksums (its metadata was changed)"
        )
    length, expected = index[offset]
    if len(data) != length:
        raise CheckpointError(
            f"{where}: {name} at offset {offset}: {len(data):,} bytes to check, the save wrote {length:,} there "
            "(the file or its metadata changed)"
        )
    actual = digest(data)
    if actual != expected:
        raise _mismatch(where, name, offset, length, actual, expected)


def _mismatch(where: str, name: str, offset: int, length: int, actual: str, expected: str) -> CheckpointError:
    return CheckpointError(
        f"{where}: {name} at offset {offset} ({length:,} bytes) does not match its checksum "
        f"({ALGORITHM} {actual}, recorded {expected}); it changed after the save"
    )


def verify_whole(handle: IO[bytes], name: str, index: Index, where: str) -> None:
    """Read ``name`` (open as ``handle``) once from start to end, checking every segment of its ``index``."""
    for offset, (length, expected) in sorted(index.items()):
        hasher = xxhash.xxh3_64()
        left = length
        while left:
            chunk = handle.read(min(left, _CHUNK_BYTES))
            if not chunk:
                short = offset + length - left
                raise CheckpointError(f"{where}: {name} ends at byte {short}, expected {offset + length}")
            hasher.update(chunk)
            left -= len(chunk)
        if hasher.hexdigest() != expected:
            raise _mismatch(where, name, offset, length, hasher.hexdigest(), expected)
    if handle.read(1):
        raise CheckpointError(f"{where}: {name} is longer than its checksums record")
