"""The token store: a folder (local, NFS or ``s3://``) of binary token shards and a manifest.

Layout::

    tokenizer.json          the tokenizer every shard was encoded with
    plan.json               what is being prepared (source, units, tokenizer hash); written first
    shard-000000.bin        little-endian uint16 (vocabulary <= 65,536) or uint32 token ids; every
                            document is followed by the end-of-document token
    shard-000000.crc32      the CRC-32 of every 1 KiB block of the shard (stores prepared before
                            these lists have 64 KiB ``.crc`` lists, or none)
    shard-000000.json       that shard's record (tokens, documents, sha256), written after its .bin:
                            a prepare that is re-run skips units whose record and bytes agree
    manifest.json           written last, only when every shard is present: format version, dtype,
                            tokenizer hash, source fingerprint, per-shard counts and checksums

A store is read only when its manifest says it is complete. Workers read only the windows they
train on, with positional reads (``os.pread``) through a small pool of open shard files, so a
rank's descriptors and memory maps do not grow with the number of shards (remote stores: byte
ranges through a node cache, see :mod:`meshtrain.data.remote`); the stream is the shards
concatenated in order. Every read is checked where it is read (:mod:`meshtrain.data.integrity`):
the blocks it touches against the shard's checksum list, its tokens against the vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from meshtrain.config import REDACTED, ConfigError, one_line, redact_url
from meshtrain.data.integrity import CorruptTokens, bad_block, first_out_of_range, reprepare_hint
from meshtrain.data.remote import BlockMismatch, RemoteShards, checksum_lists, crc_name, with_retries
from meshtrain.data.location import ReadSettings, StoreLocation, with_timeouts
from meshtrain.data.open_files import OPEN_SHARDS, OpenFiles, ShortFile
from meshtrain.data.shard_index import INDEX_JSON, INDEX_NPY, ShardIndex, index_arrays, parse_header
from meshtrain.data.store_format import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    PLAN,
    TOKENIZER,
    Manifest,
    shard_name,
)

def is_token_store(
    url: str, storage_options: dict[str, Any] | None = None, *, setting: str = "data.source",
    timeout_s: float | None = None,
) -> bool:
    """Whether ``url`` is a (possibly unfinished) token store rather than a folder of documents.

    A remote ``url`` that cannot be asked is a one-line ConfigError naming ``setting``, the endpoint and
    bucket and the error's class, never False (which would read as "no documents there"): a refused or
    unknown endpoint, wrong credentials (403), or an endpoint that never answers. S3 is asked with
    :func:`with_timeouts` of ``timeout_s`` (default ``data.read_timeout_s``'s), so a black hole fails
    after about that long; s3fs retries each request itself. Credentials are never shown.
    """
    if "://" not in url:
        if not Path(url).expanduser().is_dir():
            return False
        try:
            location = StoreLocation(url, storage_options)
            return location.exists(MANIFEST) or location.exists(PLAN)
        except OSError:  # an unreadable folder is no store; its files are reported where they are listed
            return False
    options = dict(storage_options or {})
    budget = ReadSettings().read_timeout_s if timeout_s is None else timeout_s
    try:
        location = StoreLocation(url, with_timeouts(options, budget) if url.startswith("s3://") else options)
        return location.exists(MANIFEST) or location.exists(PLAN)
    except Exception as exc:  # botocore, aiohttp and fsspec errors alike: the store cannot be asked
        raise _unreachable(url, options, setting, exc, budget) from None


def _unreachable(url: str, options: dict[str, Any], setting: str, exc: BaseException, budget: float) -> ConfigError:
    """The one line for a remote store that could not be asked whether it holds a manifest."""
    shown = redact_url(url)
    reason = _without_secrets(one_line(exc, limit=200), options)
    if url.startswith("s3://"):
        bucket = url.removeprefix("s3://").split("/", 1)[0].rsplit("@", 1)[-1]
        client = options.get("client_kwargs") if isinstance(options.get("client_kwargs"), dict) else {}
        endpoint = (client.get("endpoint_url") or options.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL_S3")
                    or os.environ.get("AWS_ENDPOINT_URL"))
        shown_endpoint = redact_url(str(endpoint)) if endpoint else "the default AWS endpoint"
        reason = f"bucket {bucket!r} at {shown_endpoint}: {reason}"
    if isinstance(exc, PermissionError) or "Credentials" in type(exc).__name__:  # 403, or none/partial given
        return ConfigError(
            f"{setting}: {shown} cannot be read with these credentials ({reason}); give credentials that may read "
            "it (environment, instance role, or data.storage_options)"
        )
    if isinstance(exc, TimeoutError) or "timeout" in type(exc).__name__.lower():
        return ConfigError(
            f"{setting}: {shown} did not answer ({reason}); check the endpoint in data.storage_options and that it "
            f"is up, or raise data.read_timeout_s (now {budget:g})"
        )
    return ConfigError(
        f"{setting}: cannot reach {shown} ({reason}); check the endpoint and bucket in data.storage_options and "
        "that the endpoint is up"
    )


def _without_secrets(text: str, options: Any) -> str:
    """``text`` with every string value of the storage options (keys, secrets, tokens, a password in an
    endpoint URL) replaced by ``<redacted>``."""
    if isinstance(options, dict):
        for value in options.values():
            text = _without_secrets(text, value)
    elif isinstance(options, (list, tuple)):
        for value in options:
            text = _without_secrets(text, value)
    elif isinstance(options, str) and len(options) >= 4:  # shorter ones would mangle the text, and are no secret
        text = text.replace(options, redact_url(options) if "://" in options else REDACTED)
    return text


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


def check_shard_sizes(location: StoreLocation, index: ShardIndex, itemsize: int, sizes: dict[str, int] | None = None) -> None:
    """Every shard present with exactly the bytes its manifest says (catches truncation), from one
    listing of the store."""
    sizes = location.sizes() if sizes is None else sizes
    tokens = np.diff(index.ends, prepend=0)
    for shard in range(index.shards):
        name = shard_name(shard)
        size, expected = sizes.get(name), int(tokens[shard]) * itemsize
        if size is None:
            raise ConfigError(f"data.source: shard {location.display(name)} is missing; prepare the store again")
        if size != expected:
            raise ConfigError(
                f"data.source: shard {location.display(name)} holds {size} bytes, its manifest says {expected} "
                f"({int(tokens[shard])} tokens); the file is truncated or replaced: prepare the store again"
            )


def write_index(location: StoreLocation, manifest: Manifest, manifest_bytes: int | None = None) -> bool:
    """Write the store's compact shard index beside its manifest, unless it is there already; False
    when the store cannot hold one (shards not named by position, or storage that refuses the write:
    readers then parse the manifest)."""
    if location.exists(INDEX_JSON):
        return True
    if manifest_bytes is None:
        manifest_bytes = location.size(MANIFEST)
    made = index_arrays(manifest, shard_name, manifest_bytes or 0)
    if made is None:
        return False
    header, table = made
    try:
        location.write_bytes(INDEX_NPY, table)
        location.write_text(INDEX_JSON, json.dumps(header, indent=1))
    except (PermissionError, OSError):
        return False
    return True


class TokenStore:
    """A complete store's token stream, read shard by shard with positional reads.

    ``read(start, stop)`` returns tokens ``[start, stop)`` of the shards concatenated in order,
    reading only that range (across a shard boundary it joins two reads). The shards' offsets come
    from the memory-mapped shard index (:mod:`meshtrain.data.shard_index`), or from the manifest
    for a store without one.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        open_shards: int = OPEN_SHARDS,
        reading: ReadSettings | None = None,
    ) -> None:
        reading = reading or ReadSettings()
        options = storage_options or {}
        self.location = StoreLocation(url, with_timeouts(options, reading.read_timeout_s) if url.startswith("s3://") else options)
        self._cache_root = reading.cache_root()
        # The one listing of a start: index, manifest and shard sizes.
        sizes = with_retries(self.location.sizes, self.location.url, reading.read_timeout_s)
        self.index = self._open_index(sizes)
        self.dtype = np.dtype(self.index.header["dtype"])
        check_shard_sizes(self.location, self.index, self.dtype.itemsize, sizes)
        self._files = OpenFiles(open_shards)
        # The shards' checksum lists get descriptors of their own: in one cache they would halve the
        # shards kept open, and every checked read would cost two opens where an unchecked one costs one.
        self._lists = OpenFiles(open_shards)
        self._manifest: Manifest | None = None
        self.vocab_size = int(self.index.header["vocab_size"])
        # Which checksum list a local store has, learnt from the first read as remote reads learn it
        # (a store is written by one prepare); len(checksum_lists()) = none.
        self._list_kind = 0
        self._opening_requests = 0 if self.location.is_local else 2 + int(INDEX_JSON in sizes)  # listing, index
        self._remote = None if self.location.is_local else RemoteShards(
            self.location, self.fingerprint, reading.cache_root(), reading.cache_max_bytes, reading.read_timeout_s,
            shard_bytes=lambda k: self.index.tokens(k) * self.dtype.itemsize, shard_sha256=self.index.sha256,
            shard_file=shard_name,
        )

    def stats(self) -> dict[str, int]:
        """Remote requests this process made for the store, bytes it downloaded and cache hits."""
        if self._remote is None:
            return {"requests": 0, "bytes_downloaded": 0, "cache_hits": 0}
        stats = dict(self._remote.stats)
        stats["requests"] += self._opening_requests
        return stats

    def _open_index(self, sizes: dict[str, int]) -> ShardIndex:
        display = self.location.display(INDEX_JSON)
        header = parse_header(self.location.read_text(INDEX_JSON), display) if INDEX_JSON in sizes else None
        if header is None or sizes.get(MANIFEST) != header.get("manifest_bytes") or (
            header.get("store_format"), header.get("store_version")) != (FORMAT, FORMAT_VERSION):
            # No index, or one that does not describe this manifest: the manifest says what is what.
            return _index_from_manifest(read_manifest(self.location), self.location.display(MANIFEST))
        if self.location.is_local:
            table = Path(self.location.path(INDEX_NPY))
        else:  # fetched once per node, verified, then memory-mapped like a local one
            table = self._cache_root / header["fingerprint"][:16] / INDEX_NPY
            if not table.exists():
                table.parent.mkdir(parents=True, exist_ok=True)
                data = with_retries(lambda: self.location.fs.cat_file(self.location.path(INDEX_NPY)),
                                    self.location.display(INDEX_NPY), 120.0)
                if hashlib.sha256(data).hexdigest() != header["index_sha256"]:
                    raise ConfigError(f"data.source: {self.location.display(INDEX_NPY)} does not match index.json; "
                                      "delete both index files (the driver writes them again)")
                fd, tmp = tempfile.mkstemp(prefix=f".{INDEX_NPY}.", dir=table.parent)
                with os.fdopen(fd, "wb") as handle:
                    handle.write(data)
                os.replace(tmp, table)
        try:
            return ShardIndex(header, table, self.location.display(INDEX_NPY))
        except (FileNotFoundError, ValueError):
            raise ConfigError(f"data.source: {self.location.display(INDEX_NPY)} is missing or unreadable; delete "
                              f"{display} (the driver writes both again)") from None

    @property
    def manifest(self) -> Manifest:
        """The store's full manifest (parsed on first use: training never needs it)."""
        if self._manifest is None:
            self._manifest = read_manifest(self.location)
        return self._manifest

    @property
    def fingerprint(self) -> str:
        return str(self.index.header["fingerprint"])

    @property
    def url(self) -> str:
        return self.location.url

    def __len__(self) -> int:
        return int(self.index.header["tokens"])

    def tokenizer_json(self) -> str:
        return self.location.read_text(TOKENIZER)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)``; :class:`CorruptTokens` when a block they lie in does not match its
        checksum or a token is outside the vocabulary."""
        index = self.index
        shard = index.shard_of(start)
        pieces = []
        position = start
        itemsize = self.dtype.itemsize
        while position < stop:
            shard_start, shard_end = index.start(shard), index.end(shard)
            end = min(stop, shard_end)
            if end > position:  # an empty shard (a byte range that held no line) is never opened
                offset, size = (position - shard_start) * itemsize, (end - position) * itemsize
                if self._remote is None:
                    data = self._read_local(shard, offset, size, (shard_end - shard_start) * itemsize)
                else:
                    try:
                        data = self._remote.read(shard, offset, size)
                    except BlockMismatch as mismatch:
                        raise self._corrupt(mismatch.shard, mismatch.byte, mismatch.what) from None
                piece = np.frombuffer(data, dtype=self.dtype)
                bad = first_out_of_range(piece, self.vocab_size)
                if bad is not None:
                    raise self._corrupt(shard, offset + bad * itemsize, f"token id {int(piece[bad])} is outside the "
                                        f"tokenizer's vocabulary of {self.vocab_size}")
                pieces.append(piece)
            position, shard = end, shard + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _read_local(self, shard: int, offset: int, size: int, shard_bytes: int) -> bytes:
        """``size`` bytes of a local shard (of ``shard_bytes``) from ``offset``, read with the whole
        checksum blocks they lie in (at most two blocks more) and checked against the shard's list;
        unchecked (but for the vocabulary) in a store prepared without lists: a whole-shard sha256
        here would read whole shards, so those are checked by ``verify_store`` only."""
        name = shard_name(shard)
        lists = checksum_lists()
        while (kind := self._list_kind) < len(lists):
            suffix, block = lists[kind]
            first, last = offset // block, (offset + size - 1) // block
            try:
                crcs = self._lists.read(self.location.path(crc_name(name, suffix)), 4 * first, 4 * (last + 1 - first))
            except FileNotFoundError:
                self._list_kind = max(self._list_kind, kind + 1)  # other reader threads may learn it too
                continue
            except ShortFile:
                raise self._corrupt(shard, offset, f"its {crc_name(name, suffix)} list ends before the checksum of "
                                    f"block {last}") from None
            start, end = first * block, min((last + 1) * block, shard_bytes)
            read = self._files.read(self.location.path(name), start, end - start)
            data = memoryview(read)
            bad = bad_block(crcs, data, block)
            if bad is not None:
                at = start + bad * block
                raise self._corrupt(shard, at, f"its {block}-byte block {first + bad} (bytes {at}-{min(at + block, end)}) "
                                    f"does not match the checksum in {crc_name(name, suffix)}")
            # A copy of just the bytes asked for: the batch then holds what it reads, and the rounded-out
            # buffer is freed here, in the reader thread, not by the training step that frees the batch.
            if (start, end) == (offset, offset + size):
                return read
            return bytes(data[offset - start : offset - start + size])
        return self._files.read(self.location.path(name), offset, size)

    def _corrupt(self, shard: int, byte: int, what: str) -> CorruptTokens:
        name = shard_name(shard)
        try:
            source = self.manifest.source
        except ConfigError:  # a manifest that no longer reads: the hint falls back to a whole prepare
            source = None
        return CorruptTokens(f"data.source: shard {self.location.display(name)} is corrupt at byte offset {byte}: "
                             f"{what}; {reprepare_hint(self.location.url, name, source)}")

    def close(self) -> None:
        self._files.close()
        self._lists.close()


def _index_from_manifest(manifest: Manifest, display: str) -> ShardIndex:
    """The same index, built in memory from a parsed manifest (a store without index files)."""
    made = index_arrays(manifest, shard_name, 0)
    if made is None:
        raise ConfigError(f"data.source: {display} names its shards otherwise than shard-NNNNNN.bin by position; "
                          "prepare the store again")
    header, table = made
    with tempfile.NamedTemporaryFile(suffix=".npy") as handle:
        handle.write(table)
        handle.flush()
        index = ShardIndex(header, Path(handle.name), display)
        index.table = np.array(index.table)  # off the temporary file, into memory
    return index


def verify_store(url: str, storage_options: dict[str, Any] | None = None) -> Manifest:
    """Full check of a store: manifest, sizes and every shard's checksum (reads every byte)."""
    location = StoreLocation(url, storage_options)
    manifest = read_manifest(location)
    check_shard_sizes(location, _index_from_manifest(manifest, location.display(MANIFEST)), np.dtype(manifest.dtype).itemsize)
    for shard in manifest.shards:
        if location.sha256(shard.file) != shard.sha256:
            raise ConfigError(
                f"data.source: shard {location.display(shard.file)} does not match its manifest checksum; "
                "prepare the store again"
            )
    return manifest
