"""A small pool of open shard files read with ``os.pread``, so a rank's descriptors do not grow with the
number of shards."""


from __future__ import annotations

import os
import threading
from collections import OrderedDict



# Shard files a rank keeps open at once: its windows are drawn at random from every shard, so without
# a bound a 60,000-shard store would hold 60,000 descriptors per rank.
OPEN_SHARDS = 16


class ShortFile(OSError):
    """A positional read past the end of a file."""


class OpenFiles:
    """At most ``capacity`` files open for positional reads; the least recently used is closed first.
    Safe to share between threads."""

    def __init__(self, capacity: int = OPEN_SHARDS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._open: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, path: str, offset: int, size: int) -> bytes:
        """``size`` bytes of ``path`` from ``offset``; :class:`ShortFile` when the file holds fewer."""
        with self._lock:
            fd = self._open.pop(path, None)
            if fd is None:
                fd = os.open(path, os.O_RDONLY)
                while len(self._open) >= self.capacity:
                    os.close(self._open.popitem(last=False)[1])
            self._open[path] = fd
            pieces, done = [], 0
            while done < size:
                piece = os.pread(fd, size - done, offset + done)
                if not piece:
                    raise ShortFile(f"{path}: {size} bytes wanted at offset {offset}, the file ends after {done}")
                pieces.append(piece)
                done += len(piece)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def close(self) -> None:
        with self._lock:
            while self._open:
                os.close(self._open.popitem()[1])

    def __del__(self) -> None:
        self.close()
