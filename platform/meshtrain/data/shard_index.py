"""A compact, memory-mapped index of a token store's shards, so a rank never parses the manifest.

A 60,000-shard manifest is ~14 MB of JSON; parsing it costs each rank ~100 MiB of peak memory and
a third of a second, and the parsed records stay alive as Python objects. Beside ``manifest.json``
a store therefore holds (written by the prepare, or by the driver for a store prepared before):

    index.json   the few manifest fields a reader needs, the shard count and the manifest's sha256
    index.npy    int64, 5 rows x shards: the token offset where each shard ends, then its sha256
                 as four words (rows, so the offsets are one contiguous array)

``index.npy`` is read through a memory map: a rank touches only the pages of the shards it reads
(a binary search touches ~log2(shards) of them), so its memory does not grow with the shard count.
Shards are named ``shard-NNNNNN.bin`` by their position. Both files are derived from the manifest
and add nothing to it: a store without them (read-only storage, or written by an older meshtrain)
is read through its manifest as before, and its fingerprint never changes.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from meshtrain.config import ConfigError

INDEX_JSON = "index.json"
INDEX_NPY = "index.npy"
INDEX_FORMAT = "meshtrain-shard-index/1"
INDEX_DTYPE = np.dtype("<i8")


def index_arrays(manifest: Any, shard_name: Any, manifest_bytes: int = 0) -> tuple[dict[str, Any], bytes] | None:
    """(index.json's content, index.npy's bytes) for a manifest whose file holds ``manifest_bytes``,
    or None when its shards are not named by position (then readers keep using the manifest)."""
    shards = manifest.shards
    if any(record.file != shard_name(k) for k, record in enumerate(shards)):
        return None
    table = np.empty((5, len(shards)), dtype=INDEX_DTYPE)
    table[0] = np.cumsum([record.tokens for record in shards], dtype=np.int64)
    digests = np.frombuffer(b"".join(bytes.fromhex(record.sha256) for record in shards), dtype=INDEX_DTYPE)
    table[1:] = digests.reshape(len(shards), 4).T
    buffer = io.BytesIO()
    np.save(buffer, table, allow_pickle=False)
    header = {
        "format": INDEX_FORMAT,
        "store_format": manifest.format,
        "store_version": manifest.version,
        "dtype": manifest.dtype,
        "vocab_size": manifest.vocab_size,
        "eos_id": manifest.eos_id,
        "tokens": manifest.tokens,
        "documents": manifest.documents,
        "shards": len(shards),
        "fingerprint": manifest.fingerprint,
        "manifest_bytes": manifest_bytes,  # a manifest of another size means the index is stale
        "index_sha256": hashlib.sha256(buffer.getvalue()).hexdigest(),
    }
    return header, buffer.getvalue()


class ShardIndex:
    """Shard offsets and checksums of a store, read from its memory-mapped index."""

    def __init__(self, header: dict[str, Any], table_path: Path, display: str) -> None:
        self.header = header
        self.table = np.load(table_path, mmap_mode="r", allow_pickle=False)
        if self.table.dtype != INDEX_DTYPE or self.table.shape != (5, header["shards"]) or (
            header["shards"] and int(self.table[0, -1]) != header["tokens"]
        ):
            raise ConfigError(f"data.source: {display} does not agree with its index.json; delete both index files "
                              "(the driver writes them again from manifest.json)")

    @property
    def shards(self) -> int:
        return self.table.shape[1]

    @property
    def ends(self) -> np.ndarray:
        """Where each shard ends in the stream (a view of the map; contiguous)."""
        return self.table[0]

    def start(self, shard: int) -> int:
        return int(self.table[0, shard - 1]) if shard else 0

    def end(self, shard: int) -> int:
        return int(self.table[0, shard])

    def tokens(self, shard: int) -> int:
        return self.end(shard) - self.start(shard)

    def shard_of(self, position: int) -> int:
        """The shard holding token ``position`` (the first non-empty one when shards are empty)."""
        return int(np.searchsorted(self.ends, position, side="right"))

    def sha256(self, shard: int) -> str:
        return np.ascontiguousarray(self.table[1:, shard]).tobytes().hex()


def parse_header(text: str, display: str) -> dict[str, Any]:
    try:
        header = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"data.source: {display} is not valid JSON ({exc}); delete it (the driver writes it again)") from None
    if not isinstance(header, dict) or header.get("format") != INDEX_FORMAT:
        raise ConfigError(f"data.source: {display} is not a meshtrain shard index; delete it (the driver writes it again)")
    return header
