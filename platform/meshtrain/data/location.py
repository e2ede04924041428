"""Where a token store lives: a folder on a local or shared file system or an object store, reached
through fsspec with whole-file writes; and how workers read remote stores (timeouts, the node cache)."""


from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import fsspec
from pydantic import BaseModel, ConfigDict

from meshtrain.data.local_files import write_atomically

class StoreLocation:
    """A store folder on any fsspec filesystem, with the writes meshtrain needs (atomic, no overwrite)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self.is_local = isinstance(self.fs, fsspec.implementations.local.LocalFileSystem)

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def display(self, name: str) -> str:
        return f"{self.url}/{name}"

    def exists(self, name: str) -> bool:
        return self.fs.exists(self.path(name))

    def read_text(self, name: str) -> str:
        with self.fs.open(self.path(name), "r", encoding="utf-8") as handle:
            return handle.read()

    def size(self, name: str) -> int | None:
        try:
            return int(self.fs.size(self.path(name)))
        except FileNotFoundError:
            return None

    def sizes(self) -> dict[str, int]:
        """Name -> bytes of every file in the folder, from one listing (not one request per file)."""
        if self.is_local:
            with os.scandir(self.root) as entries:
                return {entry.name: entry.stat().st_size for entry in entries if entry.is_file()}
        listing = self.fs.ls(self.root, detail=True, refresh=True)
        return {entry["name"].rstrip("/").rsplit("/", 1)[-1]: int(entry["size"]) for entry in listing
                if entry.get("type") == "file"}

    def write_text(self, name: str, text: str) -> None:
        self.write_bytes(name, text.encode())

    def write_bytes(self, name: str, data: bytes) -> None:
        """Whole-file write: locally ``write_atomically``; remote object stores publish an object only
        when its upload completes."""
        target = self.path(name)
        parent = target.rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)
        if self.is_local:
            write_atomically(target, data)
        else:
            with self.fs.open(target, "wb") as handle:
                handle.write(data)

    def write_parts(self, name: str, parts: Iterable[bytes | memoryview]) -> None:
        """``write_bytes`` of the bytes of ``parts`` joined, without joining them: locally one atomic
        write; remotely one upload, abandoned (never published) if a part fails."""
        target = self.path(name)
        self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        if self.is_local:
            write_atomically(target, parts)
            return
        handle = self.fs.open(target, "wb")
        try:
            for part in parts:
                handle.write(part)
        except BaseException:
            handle.discard()
            raise
        handle.close()

    def sha256(self, name: str) -> str:
        digest = hashlib.sha256()
        with self.fs.open(self.path(name), "rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
        return digest.hexdigest()


def _local_cache_dir() -> Path:
    return Path(os.environ.get("MESHTRAIN_TOKEN_CACHE", Path(tempfile.gettempdir()) / "meshtrain-token-cache"))


class ReadSettings(BaseModel):
    """How a worker reads remote stores (from the data section of the config)."""

    model_config = ConfigDict(frozen=True)

    cache_max_bytes: int = 32 * 2**30
    local_cache_dir: str | None = None
    read_timeout_s: float = 120.0

    def cache_root(self) -> Path:
        return Path(self.local_cache_dir) if self.local_cache_dir else _local_cache_dir()


def with_timeouts(storage_options: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """S3 options with connect and read timeouts unless the user set their own: a request to an
    endpoint that stops answering fails (and is retried) instead of waiting forever."""
    if "config_kwargs" in storage_options:
        return dict(storage_options)
    # s3fs tries each call 5 times itself: a tenth of the budget per request keeps the whole close to it.
    per_request = max(0.2, min(timeout_s / 10, 30.0))
    return {**storage_options, "config_kwargs": {"connect_timeout": per_request, "read_timeout": per_request,
                                                  "retries": {"total_max_attempts": 1}}}
