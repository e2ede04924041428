"""The token store: a folder (local, NFS or ``s3://``) of binary token shards and a manifest.

Layout::

    tokenizer.json          the tokenizer every shard was encoded with
    plan.json               what is being prepared (source, units, tokenizer hash); written first
    shard-000000.bin        little-endian uint16 (vocabulary <= 65,536) or uint32 token ids; every
                            document is followed by the end-of-document token
    shard-000000.json       that shard's record (tokens, documents, sha256), written after its .bin:
                            a prepare that is re-run skips units whose record and bytes agree
    manifest.json           written last, only when every shard is present: format version, dtype,
                            tokenizer hash, source fingerprint, per-shard counts and checksums

A store is read only when its manifest says it is complete. Workers map the shards with
``numpy.memmap`` (remote stores: each shard is copied once into a local cache first) and read only
the windows they train on; the stream is the shards concatenated in order.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from meshtrain.config import ConfigError

FORMAT = "meshtrain-token-store"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PLAN = "plan.json"
TOKENIZER = "tokenizer.json"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.bin"


class ShardRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    file: str
    unit: str  # hash of the unit's description: a record from another plan is not reused
    tokens: int
    documents: int
    sha256: str
    source_bytes: int


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    format: str
    version: int
    complete: bool
    dtype: str
    vocab_size: int
    eos_id: int
    tokenizer_sha256: str
    source: dict[str, Any]
    source_fingerprint: str
    documents: int
    tokens: int
    shards: tuple[ShardRecord, ...]
    fingerprint: str


def store_fingerprint(dtype: str, tokenizer_hash: str, shards: Iterable[ShardRecord]) -> str:
    """Content id of a store: the tokens it holds and how they decode (not where or when written)."""
    digest = hashlib.sha256(f"{FORMAT}/{FORMAT_VERSION}/{dtype}/{tokenizer_hash}".encode())
    for shard in shards:
        digest.update(f"\n{shard.tokens}:{shard.sha256}".encode())
    return digest.hexdigest()


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

    def write_text(self, name: str, text: str) -> None:
        self.write_bytes(name, text.encode())

    def write_bytes(self, name: str, data: bytes) -> None:
        """Whole-file write: a temporary name renamed into place locally; remote object stores
        publish an object only when its upload completes."""
        target = self.path(name)
        parent, base = target.rsplit("/", 1)
        self.fs.makedirs(parent, exist_ok=True)
        if self.is_local:
            fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=parent)
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        else:
            with self.fs.open(target, "wb") as handle:
                handle.write(data)

    def sha256(self, name: str) -> str:
        digest = hashlib.sha256()
        with self.fs.open(self.path(name), "rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
        return digest.hexdigest()


def is_token_store(url: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``url`` is a (possibly unfinished) token store rather than a folder of documents."""
    if "://" not in url and not Path(url).expanduser().is_dir():
        return False
    try:
        location = StoreLocation(url, storage_options)
        return location.exists(MANIFEST) or location.exists(PLAN)
    except Exception:  # an unreachable remote: reported where the store is opened
        return False


def read_manifest(location: StoreLocation) -> Manifest:
    """The manifest of a complete store of this format version, or a one-line ConfigError."""
    if not location.exists(MANIFEST):
        hint = "its prepare was interrupted; run jobs/prepare_data.py again to finish it" if location.exists(PLAN) else (
            "it is not a token store; prepare one with jobs/prepare_data.py"
        )
        raise ConfigError(f"data.source: {location.display(MANIFEST)} is missing: {hint}")
    try:
        raw = json.loads(location.read_text(MANIFEST))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"data.source: {location.display(MANIFEST)} is not valid JSON ({exc}); prepare the store again") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ConfigError(f"data.source: {location.display(MANIFEST)} is not a meshtrain token store manifest")
    if raw.get("version") != FORMAT_VERSION:
        raise ConfigError(
            f"data.source: {location.url} was written in token store format {raw.get('version')}, this meshtrain "
            f"reads format {FORMAT_VERSION}; prepare it again with this version (jobs/prepare_data.py)"
        )
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"data.source: {location.display(MANIFEST)} is malformed ({exc.errors()[0]['msg']}); prepare the store again") from None
    if not manifest.complete:
        raise ConfigError(f"data.source: {location.url} is not complete; run jobs/prepare_data.py again to finish it")
    return manifest


def check_shard_sizes(location: StoreLocation, manifest: Manifest) -> None:
    """Every shard present with exactly the bytes its manifest entry says (catches truncation)."""
    itemsize = np.dtype(manifest.dtype).itemsize
    for shard in manifest.shards:
        size = location.size(shard.file)
        expected = shard.tokens * itemsize
        if size is None:
            raise ConfigError(f"data.source: shard {location.display(shard.file)} is missing; prepare the store again")
        if size != expected:
            raise ConfigError(
                f"data.source: shard {location.display(shard.file)} holds {size} bytes, its manifest says {expected} "
                f"({shard.tokens} tokens); the file is truncated or replaced: prepare the store again"
            )


def _local_cache_dir() -> Path:
    return Path(os.environ.get("MESHTRAIN_TOKEN_CACHE", Path(tempfile.gettempdir()) / "meshtrain-token-cache"))


class TokenStore:
    """A complete store's token stream, memory-mapped shard by shard.

    ``read(start, stop)`` returns tokens ``[start, stop)`` of the shards concatenated in order,
    copying only that range (across a shard boundary it joins two slices).
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.location = StoreLocation(url, storage_options)
        self.manifest = read_manifest(self.location)
        check_shard_sizes(self.location, self.manifest)
        self.dtype = np.dtype(self.manifest.dtype)
        self.offsets = np.cumsum([0] + [s.tokens for s in self.manifest.shards], dtype=np.int64)
        self._maps: dict[int, np.ndarray] = {}

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    @property
    def url(self) -> str:
        return self.location.url

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def tokenizer_json(self) -> str:
        return self.location.read_text(TOKENIZER)

    def _shard(self, index: int) -> np.ndarray:
        mapped = self._maps.get(index)
        if mapped is None:
            shard = self.manifest.shards[index]
            path = self.location.path(shard.file) if self.location.is_local else self._cached(shard)
            mapped = np.memmap(path, dtype=self.dtype, mode="r", shape=(shard.tokens,))
            self._maps[index] = mapped
        return mapped

    def _cached(self, shard: ShardRecord) -> str:
        """A local copy of a remote shard, verified by its checksum, shared by the ranks of a node."""
        local = _local_cache_dir() / self.manifest.fingerprint[:16] / shard.file
        if local.exists() and local.stat().st_size == shard.tokens * self.dtype.itemsize:
            return str(local)
        local.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{shard.file}.", dir=local.parent)
        os.close(fd)
        self.location.fs.get(self.location.path(shard.file), tmp)
        digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
        if digest != shard.sha256:
            os.unlink(tmp)
            raise ConfigError(
                f"data.source: shard {self.location.display(shard.file)} does not match its manifest checksum; "
                "prepare the store again"
            )
        os.replace(tmp, local)
        return str(local)

    def read(self, start: int, stop: int) -> np.ndarray:
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        pieces = []
        index, position = first, start
        while position < stop:
            shard_start = int(self.offsets[index])
            end = min(stop, int(self.offsets[index + 1]))
            if end > position:  # an empty shard (a byte range that held no line) is never mapped
                pieces.append(self._shard(index)[position - shard_start : end - shard_start])
            position, index = end, index + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def verify_store(url: str, storage_options: dict[str, Any] | None = None) -> Manifest:
    """Full check of a store: manifest, sizes and every shard's checksum (reads every byte)."""
    location = StoreLocation(url, storage_options)
    manifest = read_manifest(location)
    check_shard_sizes(location, manifest)
    for shard in manifest.shards:
        if location.sha256(shard.file) != shard.sha256:
            raise ConfigError(
                f"data.source: shard {location.display(shard.file)} does not match its manifest checksum; "
                "prepare the store again"
            )
    return manifest
