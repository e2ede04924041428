"""The token store's format: its file names, the manifest and shard records, the fingerprint."""


from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict


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
    # Source bytes its documents took (a JSON Lines range: its lines, the whole of one running past its
    # end); stores prepared before 2026-12 recorded the unit's bytes. Informational: progress lines.
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


def manifest_text(manifest: Manifest) -> str:
    return manifest.model_dump_json(indent=1)
