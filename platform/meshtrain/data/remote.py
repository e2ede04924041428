"""Reading a remote (``s3://``) token store: ranged block reads, checked per block, through a cache
that the ranks of a node share and that never grows past its bound.

A window is a few KiB of a 64 MiB shard, drawn at random from the whole corpus, so copying whole
shards would have every node download the corpus. Instead a read fetches the 64 KiB blocks
(``BLOCK_BYTES``) that hold its bytes with one ranged GET, and their CRC-32s (4 bytes each) from
the shard's ``.crc`` list, written by the prepare, with another. CRC-32 catches the corruption a
transfer or a disk can cause, at ~1 GB/s; the shard's sha256 still guards whole-store checks. A
window of 16 KiB (8,192 tokens) thus downloads at most ~5x its bytes, never a shard. Checked
blocks go to the node cache:

* one directory per store (by fingerprint) under ``data.local_cache_dir``; every block a file
  written under a temporary name and renamed, so a rank never reads a partial block;
* bounded by ``data.cache_max_bytes``: a writer that takes the total past the bound removes the
  least recently used blocks (by modification time, refreshed on every hit) until it is 10% under;
  a block that another rank removes meanwhile is fetched again. Between two scans a process adds
  at most 1/16 of the bound, so the cache can pass its bound by that much per process;
* every request is retried with exponential backoff until ``data.read_timeout_s`` has passed, then
  fails with one line naming the URL (a store that stops answering never hangs a run silently).

A shard of at most one block, and every shard of a store prepared before the sidecars existed, is
read whole, checked against its sha256 and kept in the same bounded cache (which must then hold one
shard).
"""

from __future__ import annotations

import os
import random
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from meshtrain.config import ConfigError

BLOCK_BYTES = 1 << 16
CRC_SUFFIX = ".crc"
T = TypeVar("T")


def crc_name(shard_file: str) -> str:
    return shard_file.removesuffix(".bin") + CRC_SUFFIX


def block_crcs(data: bytes, block_bytes: int | None = None) -> bytes:
    """The CRC-32 of every ``block_bytes`` (default ``BLOCK_BYTES``) block of ``data``, as little-endian uint32s."""
    block_bytes = block_bytes or BLOCK_BYTES
    view = memoryview(data)
    crcs = [zlib.crc32(view[start : start + block_bytes]) for start in range(0, len(data), block_bytes)]
    return np.asarray(crcs, dtype="<u4").tobytes()


class StorageUnavailable(ConfigError):
    """Remote storage did not answer within ``data.read_timeout_s``."""


def with_retries(action: Callable[[], T], what: str, timeout_s: float) -> T:
    """``action()``, retried with exponential backoff (and jitter) until ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    delay = 0.1
    while True:
        try:
            return action()
        except (FileNotFoundError, PermissionError, ConfigError):
            raise
        except Exception as exc:  # transient network and service errors: botocore, aiohttp, OSError
            if time.monotonic() + delay > deadline:
                reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
                raise StorageUnavailable(
                    f"data.source: {what} did not answer for {timeout_s:.0f}s ({reason}); check the endpoint and "
                    "credentials in data.storage_options, or raise data.read_timeout_s"
                ) from None
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 10.0)


class BlockCache:
    """Files of at most ``max_bytes`` in all under ``root``, shared by processes, least recently used first out."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root, self.max_bytes = root, max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self._added = 0
        self._lock = threading.Lock()

    def get(self, name: str) -> bytes | None:
        path = self.root / name
        try:
            data = path.read_bytes()
            os.utime(path)
        except FileNotFoundError:  # never cached, or evicted by another rank
            return None
        return data

    def put(self, name: str, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=self.root)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, self.root / name)
        with self._lock:
            self._added += len(data)
            due = self._added >= self.max_bytes // 16
            if due:
                self._added = 0
        if due:
            self.evict()

    def size(self) -> int:
        return sum(entry.stat().st_size for entry in os.scandir(self.root) if entry.is_file())

    def evict(self) -> None:
        """Remove the least recently used files until the total is 10% under the bound."""
        entries = []
        for entry in os.scandir(self.root):
            try:
                stat = entry.stat()
            except FileNotFoundError:
                continue
            if entry.is_file() and not entry.name.startswith("."):
                entries.append((stat.st_mtime, stat.st_size, entry.path))
        total = sum(size for _, size, _ in entries)
        if total <= self.max_bytes:
            return
        target = int(self.max_bytes * 0.9)
        for _, size, path in sorted(entries):
            if total <= target:
                break
            try:
                os.unlink(path)
            except FileNotFoundError:  # another rank evicted it first
                pass
            total -= size


class RemoteShards:
    """Byte ranges of a remote store's shards, through a :class:`BlockCache`."""

    def __init__(self, location: Any, fingerprint: str, cache_root: Path, cache_max_bytes: int, timeout_s: float,
                 shard_bytes: Callable[[int], int], shard_sha256: Callable[[int], str], shard_file: Callable[[int], str]) -> None:
        if cache_max_bytes < BLOCK_BYTES:
            raise ConfigError(
                f"data.cache_max_bytes={cache_max_bytes} is smaller than one read block ({BLOCK_BYTES} bytes); "
                f"set it to at least {BLOCK_BYTES} (a few GiB is typical)"
            )
        self.location, self.timeout_s = location, timeout_s
        self.cache = BlockCache(cache_root / fingerprint[:16], cache_max_bytes)
        self._bytes, self._sha256, self._file = shard_bytes, shard_sha256, shard_file
        self._lock = threading.Lock()
        self.stats = {"requests": 0, "bytes_downloaded": 0, "cache_hits": 0}

    def _count(self, requests: int, downloaded: int) -> None:
        with self._lock:
            self.stats["requests"] += requests
            self.stats["bytes_downloaded"] += downloaded

    def _fetch(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        path = self.location.path(name)
        data = with_retries(lambda: self.location.fs.cat_file(path, start=start, end=end),
                            self.location.display(name), self.timeout_s)
        self._count(1, len(data))
        return bytes(data)

    def _block_crcs(self, shard: int, first: int, last: int) -> np.ndarray | None:
        """The checksums of blocks ``first..last`` of the shard, or None for a store prepared before
        they were recorded."""
        try:
            data = self._fetch(crc_name(self._file(shard)), 4 * first, 4 * (last + 1))
        except FileNotFoundError:
            return None
        return np.frombuffer(data, dtype="<u4")

    def read(self, shard: int, offset: int, size: int) -> bytes:
        """``size`` bytes of shard ``shard`` from ``offset``."""
        if self._bytes(shard) <= BLOCK_BYTES:  # a shard of one block: one request, checked by its sha256
            return self._whole_shard(shard)[offset : offset + size]
        first, last = offset // BLOCK_BYTES, (offset + size - 1) // BLOCK_BYTES
        blocks = {block: self.cache.get(f"{shard:06d}.{block:06d}") for block in range(first, last + 1)}
        missing = [block for block, data in blocks.items() if data is None]
        with self._lock:
            self.stats["cache_hits"] += len(blocks) - len(missing)
        if missing:
            fetched = self._fetch_blocks(shard, missing[0], missing[-1])
            if fetched is None:  # no checksum list: the store is read in whole shards
                return self._whole_shard(shard)[offset : offset + size]
            blocks.update(fetched)
        data = b"".join(blocks[block] or b"" for block in range(first, last + 1))
        lo = offset - first * BLOCK_BYTES
        return data[lo : lo + size]

    def _fetch_blocks(self, shard: int, first: int, last: int) -> dict[int, bytes] | None:
        """Blocks ``first..last`` of the shard in one ranged GET, each checked and cached; None when
        the store has no checksum list."""
        crcs = self._block_crcs(shard, first, last)
        if crcs is None:
            return None
        size = self._bytes(shard)
        data = self._fetch(self._file(shard), first * BLOCK_BYTES, min((last + 1) * BLOCK_BYTES, size))
        blocks = {}
        for k, block in enumerate(range(first, last + 1)):
            start = block * BLOCK_BYTES
            expected = min(BLOCK_BYTES, size - start)
            piece = data[k * BLOCK_BYTES : k * BLOCK_BYTES + expected]
            if len(piece) != expected or len(crcs) <= k or zlib.crc32(piece) != int(crcs[k]):
                raise ConfigError(
                    f"data.source: block {block} (bytes {start}-{start + expected}) of shard "
                    f"{self.location.display(self._file(shard))} does not match its recorded checksum; prepare the store again"
                )
            self.cache.put(f"{shard:06d}.{block:06d}", piece)
            blocks[block] = piece
        return blocks

    def _whole_shard(self, shard: int) -> bytes:
        import hashlib

        name = self._file(shard)
        if self._bytes(shard) > self.cache.max_bytes:
            raise ConfigError(
                f"data.cache_max_bytes={self.cache.max_bytes} cannot hold shard {self.location.display(name)} "
                f"({self._bytes(shard)} bytes), which this store (prepared without block checksums) is read in; "
                "raise data.cache_max_bytes or prepare the store again"
            )
        data = self.cache.get(name)
        if data is not None:
            return data
        data = self._fetch(name)
        if hashlib.sha256(data).hexdigest() != self._sha256(shard):
            raise ConfigError(f"data.source: shard {self.location.display(name)} does not match its manifest checksum; "
                              "prepare the store again")
        self.cache.put(name, data)
        return data
