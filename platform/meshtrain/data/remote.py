"""Reading a remote (``s3://``) token store: exact byte ranges, checked per 1 KiB, through a cache
that the ranks of a node share and that never grows past its bound.

A window is a few KiB of a 64 MiB shard, drawn at random from the whole corpus, so copying whole
shards would have every node download the corpus. A read instead fetches, in one round trip of two
concurrent ranged GETs, the bytes it needs rounded out to 1 KiB check blocks (``CHECK_BYTES``) and
those blocks' CRC-32s (4 bytes each) from the shard's ``.crc32`` list, written by the prepare. A
window of 32 KiB (8,192 uint32 tokens) thus downloads at most 2 KiB + 136 bytes more than it reads
(1.07x at worst); the lists cost 0.4% of the store. (Checks are per block, so a partial block
cannot be checked: the block size trades the rounding against the lists' size.) CRC-32 catches the
corruption a transfer or a disk can cause, at ~1 GB/s; the shard's sha256 still guards whole-store
checks. Checked ranges go to the node cache:

* one directory per store (by fingerprint) under ``data.local_cache_dir``; every fetched range a
  file (windows sit at fixed offsets, so a window read again finds its own file), written under a
  temporary name and renamed, so a rank never reads a partial range;
* bounded by ``data.cache_max_bytes``: a writer that takes the total past the bound removes the
  least recently used files (by modification time, refreshed on every hit) until it is 10% under;
  a range that another rank removes meanwhile is fetched again. Between two scans a process adds
  at most 1/16 of the bound (plus one range), so the cache passes its bound by at most that much
  per process;
* every request is retried with exponential backoff until ``data.read_timeout_s`` has passed, then
  fails with one line naming the URL (a store that stops answering never hangs a run silently).

Stores prepared by earlier versions are read as they were written: with the 64 KiB ``.crc`` lists
of the first ranged reader, or (no list at all) in whole shards checked against their sha256 and kept
in the same bounded cache (which must then hold one shard). A shard of at most one check block is
always read whole, in one request.
"""

from __future__ import annotations

import hashlib
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
from meshtrain.data.integrity import CorruptTokens

CHECK_BYTES = 1 << 10  # bytes per CRC-32 in a shard's .crc32 list
CRC_SUFFIX = ".crc32"
LEGACY_CHECK_BYTES = 1 << 16  # the .crc lists of stores prepared before the .crc32 lists
LEGACY_CRC_SUFFIX = ".crc"
T = TypeVar("T")


def crc_name(shard_file: str, suffix: str = CRC_SUFFIX) -> str:
    return shard_file.removesuffix(".bin") + suffix


def block_crcs(data: bytes, block_bytes: int | None = None) -> bytes:
    """The CRC-32 of every ``block_bytes`` (default ``CHECK_BYTES``) block of ``data``, as little-endian uint32s."""
    block_bytes = block_bytes or CHECK_BYTES
    view = memoryview(data)
    crcs = [zlib.crc32(view[start : start + block_bytes]) for start in range(0, len(data), block_bytes)]
    return np.asarray(crcs, dtype="<u4").tobytes()


class BlockCrcs:
    """:func:`block_crcs` of bytes given in consecutive parts of any size."""

    def __init__(self, block_bytes: int | None = None) -> None:
        self.block_bytes = block_bytes or CHECK_BYTES
        self._crcs: list[int] = []
        self._partial = b""  # the start of a block the parts so far did not fill

    def update(self, data: bytes | memoryview) -> None:
        view, size = memoryview(data).cast("B"), self.block_bytes
        if self._partial:
            taken = size - len(self._partial)
            self._partial += view[:taken]
            view = view[taken:]
            if len(self._partial) < size:
                return
            self._crcs.append(zlib.crc32(self._partial))
            self._partial = b""
        whole = len(view) - len(view) % size
        self._crcs.extend(zlib.crc32(view[start : start + size]) for start in range(0, whole, size))
        self._partial = bytes(view[whole:])

    def digest(self) -> bytes:
        crcs = self._crcs + ([zlib.crc32(self._partial)] if self._partial else [])
        return np.asarray(crcs, dtype="<u4").tobytes()


def checksum_lists() -> tuple[tuple[str, int], ...]:
    """(suffix, bytes per checksum) of the lists a shard may have, newest first."""
    return ((CRC_SUFFIX, CHECK_BYTES), (LEGACY_CRC_SUFFIX, LEGACY_CHECK_BYTES))


class BlockMismatch(CorruptTokens):
    """A fetched block that does not match its checksum; the store turns it into its one line (shard,
    byte offset, the command that re-prepares the shard)."""

    def __init__(self, shard: int, byte: int, what: str) -> None:
        super().__init__(what)
        self.shard, self.byte, self.what = shard, byte, what


class StorageUnavailable(ConfigError):
    """Remote storage did not answer within ``data.read_timeout_s``. Before training it is a config
    error (exit 2); on a worker a restart may find the store answering again, so it is retried."""

    restart_may_help = True


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
        if cache_max_bytes < CHECK_BYTES:
            raise ConfigError(
                f"data.cache_max_bytes={cache_max_bytes} is smaller than one checked block ({CHECK_BYTES} bytes); "
                "set it to at least a few reads (a few GiB is typical)"
            )
        self.location, self.timeout_s = location, timeout_s
        self.cache = BlockCache(cache_root / fingerprint[:16], cache_max_bytes)
        self._bytes, self._sha256, self._file = shard_bytes, shard_sha256, shard_file
        self._lock = threading.Lock()
        # Which kind of checksum list the store has, learnt from the first read (a store is written
        # by one prepare); len(checksum_lists()) = none, read whole shards.
        self._list_kind = 0
        self.stats = {"requests": 0, "bytes_downloaded": 0, "cache_hits": 0}

    def _count(self, requests: int, downloaded: int, hits: int = 0) -> None:
        with self._lock:
            self.stats["requests"] += requests
            self.stats["bytes_downloaded"] += downloaded
            self.stats["cache_hits"] += hits

    def read(self, shard: int, offset: int, size: int) -> bytes:
        """``size`` bytes of shard ``shard`` from ``offset``."""
        if self._bytes(shard) <= CHECK_BYTES:  # a shard of one block: one request, checked by its sha256
            return self._whole_shard(shard)[offset : offset + size]
        lists = checksum_lists()
        for kind in range(self._list_kind, len(lists)):
            suffix, block = lists[kind]
            first, last = offset // block, (offset + size - 1) // block
            name = f"{shard:06d}.{block}.{first:07d}-{last:07d}"
            data = self.cache.get(name)
            if data is not None:
                self._count(0, 0, hits=1)
            else:
                data = self._fetch_checked(shard, suffix, block, first, last)
                if data is None:  # the shard has no list of this kind
                    self._list_kind = kind + 1
                    continue
                self.cache.put(name, data)
            lo = offset - first * block
            return data[lo : lo + size]
        return self._whole_shard(shard)[offset : offset + size]

    def _fetch_checked(self, shard: int, suffix: str, block: int, first: int, last: int) -> bytes | None:
        """Blocks ``first..last`` of the shard and their checksums, fetched concurrently and checked;
        None when the shard has no ``suffix`` list."""
        shard_file, size = self._file(shard), self._bytes(shard)
        start, end = first * block, min((last + 1) * block, size)
        if end - start > self.cache.max_bytes:
            raise ConfigError(
                f"data.cache_max_bytes={self.cache.max_bytes} is smaller than one read ({end - start} bytes of "
                f"{self.location.display(shard_file)}); raise it to at least a few reads (a few GiB is typical)"
            )
        paths = [self.location.path(crc_name(shard_file, suffix)), self.location.path(shard_file)]

        def fetch() -> list[Any]:
            results = self.location.fs.cat_ranges(paths, [4 * first, start], [4 * (last + 1), end], on_error="return")
            for result in results:
                if isinstance(result, BaseException) and not isinstance(result, FileNotFoundError):
                    raise result  # transient: the whole round trip is retried
            return results

        crcs, data = with_retries(fetch, f"{self.location.display(shard_file)} (or its {suffix} list)", self.timeout_s)
        if isinstance(data, FileNotFoundError):
            raise ConfigError(f"data.source: shard {self.location.display(shard_file)} is missing; prepare the store again")
        if isinstance(crcs, FileNotFoundError):
            self._count(2, len(data))
            return None
        self._count(2, len(crcs) + len(data))
        crcs = np.frombuffer(crcs, dtype="<u4")
        view = memoryview(data)
        for k in range(last - first + 1):
            lo, hi = k * block, min((k + 1) * block, end - start)
            if hi > len(view) or k >= len(crcs) or zlib.crc32(view[lo:hi]) != int(crcs[k]):
                raise BlockMismatch(
                    shard, start + lo, f"its {block}-byte block {first + k} (bytes {start + lo}-{start + hi}) does not "
                    f"match the checksum in {crc_name(shard_file, suffix)}"
                )
        return bytes(data)

    def _whole_shard(self, shard: int) -> bytes:
        name = self._file(shard)
        if self._bytes(shard) > self.cache.max_bytes:
            raise ConfigError(
                f"data.cache_max_bytes={self.cache.max_bytes} cannot hold shard {self.location.display(name)} "
                f"({self._bytes(shard)} bytes), which this store (prepared without block checksums) is read in; "
                "raise data.cache_max_bytes or prepare the store again"
            )
        data = self.cache.get(name)
        if data is not None:
            self._count(0, 0, hits=1)
            return data
        path = self.location.path(name)
        data = bytes(with_retries(lambda: self.location.fs.cat_file(path), self.location.display(name), self.timeout_s))
        self._count(1, len(data))
        if hashlib.sha256(data).hexdigest() != self._sha256(shard):
            raise ConfigError(f"data.source: shard {self.location.display(name)} does not match its manifest checksum; "
                              "prepare the store again")
        self.cache.put(name, data)
        return data
