"""Checks on the tokens a worker reads: each block against its recorded CRC-32, each token against
the tokenizer's vocabulary, and the one-line error that names the shard, the byte and the fix.

A flipped bit in a shard either changes a token silently (caught by the shard's checksum list) or,
in a high bit, makes an id past the vocabulary, which the embedding turns into an index error on
every rank; either way a restart reads the same bytes again, so the error is permanent.
"""

from __future__ import annotations

import shlex
import struct
import zlib
from typing import Any

import numpy as np

from meshtrain.config import PermanentError


class CorruptTokens(PermanentError):
    """A token shard whose bytes are not the ones its prepare wrote; re-preparing it is the fix."""


def reprepare_hint(store: str, shard_file: str, source: dict[str, Any] | None) -> str:
    """How to encode one shard of ``store`` again: remove its record and the manifest, then re-run the
    prepare, which re-uses every other shard (see ``prepare._finished_records``).

    ``source`` is the manifest's description of what was prepared; with the store's own tokenizer
    the prepare finds the same store folder. A store that names no source gets the general advice."""
    origin = (source or {}).get("source")
    if not isinstance(origin, str):
        return f"prepare the store again (remove {store} and run jobs/prepare_data.py)"
    record = shard_file.removesuffix(".bin") + ".json"
    command = ["python", "jobs/prepare_data.py", "--output", store.rsplit("/", 1)[0], f"data.source={origin}",
               f"data.tokenizer={store}/tokenizer.json"]
    field = (source or {}).get("field", "text")
    if field != "text":
        command.append(f"data.text_field={field}")
    return (f"re-prepare it: remove {store}/manifest.json and {store}/{record}, then run {shlex.join(command)} "
            "with the other data settings it was prepared with (only that shard is encoded again)")


def bad_block(crcs: bytes, data: memoryview, block_bytes: int) -> int | None:
    """Index of the first ``block_bytes`` block of ``data`` whose CRC-32 is not the one in ``crcs``
    (little-endian uint32s, one per block), or None when all match."""
    found = tuple(zlib.crc32(data[lo : lo + block_bytes]) for lo in range(0, len(data), block_bytes))
    expected = struct.unpack(f"<{len(crcs) // 4}I", crcs[: len(crcs) // 4 * 4])
    if found == expected:
        return None
    return next((k for k, (a, b) in enumerate(zip(found, expected)) if a != b), min(len(found), len(expected)))


def first_out_of_range(tokens: np.ndarray, vocab_size: int) -> int | None:
    """Position of the first token id >= ``vocab_size``, or None (one max over the array)."""
    if not len(tokens) or int(tokens.max()) < vocab_size:
        return None
    return int(np.argmax(tokens >= vocab_size))
