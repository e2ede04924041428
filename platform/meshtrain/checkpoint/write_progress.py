"""Bytes this process has written into checkpoints: the sign that a long save is making progress.

An 850 GB checkpoint at 1 GB/s takes 14 minutes, longer than a hang timeout sized for a training
step. The hang watchdog therefore counts bytes reaching checkpoint storage as progress: a save that
keeps writing is never killed, and one whose writes stop is caught like any other hang.

:func:`counting_writes` wraps a DCP storage writer's ``create_stream`` (local files and fsspec
stores alike) so that every stream it opens counts what is written through it, in pieces of at
most ``PIECE_BYTES`` so that one huge tensor shows progress while it is being written.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

PIECE_BYTES = 8 * 2**20

_lock = threading.Lock()
_total = [0]  # DCP writes from several threads


def bytes_written() -> int:
    """Bytes written into checkpoint streams by this process so far."""
    with _lock:
        return _total[0]


def _add(count: int) -> None:
    with _lock:
        _total[0] += count


class _CountingStream:
    """A binary stream that counts what passes through ``write`` and forwards everything else."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), PIECE_BYTES):
            piece = view[start : start + PIECE_BYTES]
            self._stream.write(piece)
            _add(len(piece))
        return len(view)

    def __getattr__(self, name: str) -> Any:  # tell, seek, fileno, flush, close, ...
        return getattr(self._stream, name)


def counting_writes(writer: Any) -> Any:
    """``writer`` (a DCP FileSystemWriter or FsspecWriter) with its streams counted; returned as is
    when it has no ``fs.create_stream`` to wrap."""
    fs = getattr(writer, "fs", None)
    create: Callable[..., Any] | None = getattr(fs, "create_stream", None)
    if create is None:
        return writer

    @contextmanager
    def counted(path: Any, mode: str) -> Iterator[Any]:
        with create(path, mode) as stream:
            yield _CountingStream(stream) if "w" in mode else stream

    fs.create_stream = counted
    return writer
