"""Whole-file writes on a local file system: the one way meshtrain writes a file that must survive a crash
(token store files, checkpoint markers, the run folder's files)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path


def write_atomically(path: str | os.PathLike[str], data: bytes | str | Iterable[bytes | memoryview]) -> None:
    """``path`` holds all of ``data`` (bytes, text, or consecutive byte buffers) or what it held before,
    never a part, and keeps it through a crash once this returns: a temporary file in the same folder,
    fsynced, renamed over ``path``, then the folder fsynced so the rename itself is durable."""
    target = Path(path)
    parts: Iterable[bytes | memoryview]
    if isinstance(data, str):
        parts = [data.encode()]
    elif isinstance(data, (bytes, bytearray, memoryview)):
        parts = [data]
    else:
        parts = data
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            for part in parts:
                handle.write(part)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
