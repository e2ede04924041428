"""Token stores written directly, of any size (sparse shards cost no disk): what the data benchmarks read."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

EOS = 0
VOCAB = 512


def tokenizer_json() -> str:
    """A word-level tokenizer of VOCAB entries: stores written here need one, nothing decodes them."""
    from tokenizers import Tokenizer, models

    vocab = {"<|endoftext|>": EOS, **{f"t{i}": i for i in range(1, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    tokenizer.add_special_tokens(["<|endoftext|>"])
    return tokenizer.to_str()


def write_store(root: Path, shards: int, tokens_per_shard: int, sparse: bool, seed: int = 0) -> dict[str, Any]:
    """A complete uint16 store of ``shards`` shards written directly, the way a prepare leaves one
    (sparse: every shard a hole of ``tokens_per_shard`` zero tokens, which costs no disk). Returns
    what a data plan needs to name it."""
    from meshtrain.data.remote import block_crcs, crc_name
    from meshtrain.data.location import StoreLocation
    from meshtrain.data.store import write_index
    from meshtrain.data.store_format import (
        FORMAT,
        FORMAT_VERSION,
        MANIFEST,
        TOKENIZER,
        Manifest,
        ShardRecord,
        manifest_text,
        shard_name,
        store_fingerprint,
    )

    done = root / "BENCH_COMPLETE"
    if done.exists():
        return json.loads(done.read_text())
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    tokenizer = tokenizer_json()
    zeros_sha = hashlib.sha256(bytes(2 * tokens_per_shard)).hexdigest() if sparse else ""
    records = []
    for index in range(shards):
        path = root / shard_name(index)
        if sparse:
            with open(path, "wb") as handle:
                os.truncate(handle.fileno(), 2 * tokens_per_shard)
            digest = zeros_sha
        else:
            tokens = rng.integers(1, VOCAB, size=tokens_per_shard, dtype=np.uint16)
            tokens[rng.random(tokens_per_shard) < 1 / 200] = EOS
            tokens[-1] = EOS
            data = tokens.tobytes()
            path.write_bytes(data)
            (root / crc_name(path.name)).write_bytes(block_crcs(data))
            digest = hashlib.sha256(data).hexdigest()
        records.append(ShardRecord(file=shard_name(index), unit=f"bench-{index}", tokens=tokens_per_shard,
                                   documents=1, sha256=digest, source_bytes=2 * tokens_per_shard))
    tokenizer_hash = hashlib.sha256(tokenizer.encode()).hexdigest()
    manifest = Manifest(
        format=FORMAT, version=FORMAT_VERSION, complete=True, dtype="uint16", vocab_size=VOCAB, eos_id=EOS,
        tokenizer_sha256=tokenizer_hash, source={"bench": "synthetic"}, source_fingerprint="synthetic",
        documents=shards, tokens=shards * tokens_per_shard, shards=tuple(records),
        fingerprint=store_fingerprint("uint16", tokenizer_hash, records),
    )
    (root / TOKENIZER).write_text(tokenizer)
    text = manifest_text(manifest)
    write_index(StoreLocation(str(root)), manifest, len(text.encode()))
    (root / MANIFEST).write_text(text)
    summary = {"url": str(root), "shards": shards, "tokens": manifest.tokens, "fingerprint": manifest.fingerprint}
    done.write_text(json.dumps(summary))
    return summary
