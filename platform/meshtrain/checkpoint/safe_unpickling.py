"""Reading what DCP pickled without running code from storage.

DCP reads ``.metadata`` with ``pickle.load`` and every non-tensor entry with
``torch.load(weights_only=False)``: whoever can write checkpoint storage could run code on every
rank at resume. Here ``.metadata`` goes through an unpickler that knows only DCP's metadata classes
(and the torch values they hold), and non-tensor entries through torch's weights-only unpickler.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import re
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem
from torch.serialization import _get_layout

from meshtrain.checkpoint.errors import CheckpointError
from meshtrain.config import one_line

# Everything a DCP .metadata of ours references (local and s3, float8 runs and optimizer states
# included): DCP's metadata dataclasses, the storage info of its file writer, torch.Size, torch's
# dtypes, layouts (pickled through _get_layout) and the checkpoint's path.
_CLASSES: dict[tuple[str, str], Any] = {
    **{
        (dcp_metadata.__name__, cls.__name__): cls
        for cls in (
            dcp_metadata.Metadata,
            dcp_metadata.MetadataIndex,
            dcp_metadata.StorageMeta,
            dcp_metadata.TensorStorageMetadata,
            dcp_metadata.BytesStorageMetadata,
            dcp_metadata.ChunkStorageMetadata,
            dcp_metadata.TensorProperties,
            dcp_metadata._MEM_FORMAT_ENCODING,
        )
    },
    (_StorageInfo.__module__, _StorageInfo.__name__): _StorageInfo,
    ("torch.serialization", "_get_layout"): _get_layout,
    ("torch", "Size"): torch.Size,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class _Refused(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = _CLASSES.get((module, name))
        if allowed is not None:
            return allowed
        if module == "torch" and isinstance(vars(torch).get(name), _TORCH_VALUES):
            return vars(torch)[name]
        raise _Refused(f"{module}.{name}")


def load_metadata(data: bytes, where: str) -> dcp_metadata.Metadata:
    """The DCP ``Metadata`` pickled in ``data``; a one-line CheckpointError for anything else."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise CheckpointError(
            f"{where}: .metadata refers to {exc}, which DCP metadata never holds; refused to unpickle it "
            "(the file was tampered with or is not a meshtrain checkpoint)"
        ) from None
    except Exception as exc:  # any other malformed pickle: truncated, wrong arguments, ...
        raise CheckpointError(f"{where}: .metadata is not readable DCP metadata ({one_line(exc)})") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{where}: .metadata holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class WeightsOnlyEntries:
    """The LoadPlanner DCP passes to ``read_data``, but whose non-tensor entries are unpickled by
    torch's weights-only unpickler first (DCP's planner would use ``weights_only=False``).

    The planner then gets a pickle of what that produced, so it sets the entry its own way (flattened
    state dicts included) from bytes this process wrote, never from bytes read off storage.
    """

    def __init__(self, planner: LoadPlanner, where: str) -> None:
        self._planner, self._where = planner, where

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as exc:
            detail = re.search(r"WeightsUnpickler error: ([^\n]*)", str(exc))
            reason = detail[1] if detail else one_line(exc)
            raise CheckpointError(
                f"{self._where}: entry {read_item.dest_index.fqn} is not plain data, refused to unpickle it "
                f"({reason[:200]})"
            ) from None
        plain = io.BytesIO()
        torch.save(loaded, plain)
        plain.seek(0)
        self._planner.load_bytes(read_item, plain)

    def __getattr__(self, name: str) -> Any:  # resolve_tensor, commit_tensor, ...
        return getattr(self._planner, name)
