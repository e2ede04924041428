"""Read an offline W&B run file (``offline-run-*/run-<id>.wandb``) back, for tests.

wandb 0.31 writes runs from its Go core and no longer ships a Python reader of these files. The
format: a 7-byte header (``:W&B``, 0xBEE1, version 0), then LevelDB-log framing, 32 KiB blocks of
chunks each with a 7-byte header (crc32 of type+payload, length, type: 1 full, 2 first, 3 middle,
4 last). Each assembled payload is a ``wandb_internal_pb2.Record``, decoded with W&B's own protobuf
classes.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_BLOCK = 32 * 1024
_CHUNK = struct.Struct("<IHB")
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:7] == struct.pack("<4sHB", b":W&B", 0xBEE1, 0), f"{path} is not a W&B run file"
    position, pending = 7, b""
    while position + _CHUNK.size <= len(data):
        if _BLOCK - position % _BLOCK < _CHUNK.size:  # a block's tail too short for a header is padding
            position += _BLOCK - position % _BLOCK
            continue
        crc, length, kind = _CHUNK.unpack_from(data, position)
        if kind == 0 and length == 0:
            break
        payload = data[position + _CHUNK.size : position + _CHUNK.size + length]
        assert len(payload) == length and zlib.crc32(bytes([kind]) + payload) == crc, f"{path}: bad chunk at {position}"
        position += _CHUNK.size + length
        pending = payload if kind in (_FULL, _FIRST) else pending + payload
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _items(items: Any) -> dict[str, Any]:
    return {(item.key or ".".join(item.nested_key)): json.loads(item.value_json) for item in items}


def read_run(path: Path) -> dict[str, Any]:
    """The run id, config and history rows (without W&B's own ``_`` keys) of one run file."""
    run: dict[str, Any] = {"id": None, "config": {}, "history": []}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["id"] = record.run.run_id
            run["config"].update(_items(record.run.config.update))
        elif kind == "config":
            run["config"].update(_items(record.config.update))
        elif kind == "history":
            row = {key: value for key, value in _items(record.history.item).items() if not key.startswith("_")}
            run["history"].append(row)
    return run
