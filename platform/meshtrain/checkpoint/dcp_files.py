"""DCP's file writer and reader (local paths and fsspec URLs) with checksums, and without unpickling
anything from storage beyond DCP's own metadata classes.

Writing: every stream DCP's writer opens is hashed per item (see ``checksums``). After its
``write_data`` each rank writes a sidecar per file and returns its write results carrying the
sidecar's checksum, so rank 0's ``finish`` learns every rank's checksums from the results DCP
already gathers (no extra collective, nothing to read back) and hands them to the commit marker.

Reading: ``.metadata`` is read whole, checked and unpickled by the restricted unpickler, once per
reader; each item a rank reads is checked against its file's sidecar before DCP reads it (so a
rank reads only its own items, never whole files); non-tensor entries are unpickled weights-only.
"""

from __future__ import annotations

import dataclasses
import io
import mmap
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from io import UnsupportedOperation
from typing import IO, Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from meshtrain.checkpoint.checksums import (
    SIDECAR_SUFFIX,
    HashedStream,
    Index,
    check_item,
    digest,
    encode_sidecar,
    read_sidecar,
)
from meshtrain.checkpoint.errors import CheckpointError
from meshtrain.checkpoint.safe_unpickling import WeightsOnlyEntries, load_metadata

METADATA_FILE = ".metadata"


@dataclasses.dataclass(frozen=True)
class _Checked:
    """A write result's storage info, with its file's size and the checksum of the file's sidecar
    (travels to rank 0 inside the results DCP gathers; unwrapped before ``.metadata`` is written)."""

    info: _StorageInfo
    file_bytes: int
    sidecar: str


class ChecksummedWriting:
    """Mixed into a DCP file writer: hashes what it writes and records the checksums.

    ``written`` (filled on the rank that writes ``.metadata``, rank 0) maps every file of the
    checkpoint, all ranks' included, to its size and the checksum of its sidecar.
    """

    fs: Any
    path: Any
    sync_files: bool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.written: dict[str, tuple[int, str]] = {}
        self._segments: dict[str, list[tuple[int, int, str]]] = {}
        self._lock = threading.Lock()  # DCP may write files from several threads
        self._plain_stream = self.fs.create_stream
        self.fs.create_stream = self._hashed_stream

    @contextmanager
    def _hashed_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        name = os.path.basename(os.fspath(path))
        with self._plain_stream(path, mode) as stream:
            if "w" not in mode or name.endswith(SIDECAR_SUFFIX):
                yield stream
                return
            hashed = HashedStream(stream, name)
            yield hashed
            hashed.finish()
            with self._lock:
                self._segments[name] = hashed.segments

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results: list[WriteResult] = super().write_data(plan, planner).wait()  # type: ignore[misc]
        # A file without items (a rank with nothing to save) is never read: it needs no sidecar.
        sidecars = {name: self._write_sidecar(name, name) for name in {r.storage_data.relative_path for r in results}}
        checked = []
        for result in results:
            info: _StorageInfo = result.storage_data
            size, sidecar, items = sidecars[info.relative_path]
            if (info.offset, info.length) not in items:  # DCP no longer writes an item between two tell()s
                raise CheckpointError(f"{info.relative_path}: item at {info.offset} was not hashed on its own")
            checked.append(dataclasses.replace(result, storage_data=_Checked(info, size, sidecar)))
        done: Future[list[WriteResult]] = Future()
        done.set_result(checked)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        plain = []
        for rank_results in results:
            for result in rank_results:
                checked: _Checked = result.storage_data
                self.written[checked.info.relative_path] = (checked.file_bytes, checked.sidecar)
            plain.append([dataclasses.replace(r, storage_data=r.storage_data.info) for r in rank_results])
        super().finish(metadata, plain)  # type: ignore[misc]
        size, sidecar, _ = self._write_sidecar(f"{METADATA_FILE}.tmp", METADATA_FILE)  # written, then renamed
        self.written[METADATA_FILE] = (size, sidecar)

    def _write_sidecar(self, written_as: str, name: str) -> tuple[int, str, set[tuple[int, int]]]:
        """Write ``name``'s sidecar; its size, the sidecar's checksum and the (offset, length) items."""
        with self._lock:
            segments = self._segments.pop(written_as)
        payload = encode_sidecar(name, segments)
        with self.fs.create_stream(self.fs.concat_path(self.path, name + SIDECAR_SUFFIX), "wb") as stream:
            stream.write(payload)
            if self.sync_files:
                stream.flush()
                try:
                    os.fsync(stream.fileno())
                except (AttributeError, UnsupportedOperation):  # object storage: durable once closed
                    pass
        size = sum(length for _, length, _ in segments)
        return size, digest(payload), {(offset, length) for offset, length, _ in segments}


class ChecksummedFileSystemWriter(ChecksummedWriting, FileSystemWriter):
    """DCP's local/NFS writer, hashing what it writes."""


class ChecksummedFsspecWriter(ChecksummedWriting, FsspecWriter):
    """DCP's fsspec (s3://...) writer, hashing what it writes."""


class _VerifiedReading:
    """Mixed into a DCP file reader: checks what it reads against the checkpoint's checksums, and
    unpickles nothing but DCP metadata and plain data.

    ``sidecars`` is the marker's file → sidecar checksum map; None for a checkpoint written before
    meshtrain recorded checksums (then nothing is checked, but nothing unsafe is unpickled either).
    """

    fs: Any
    path: Any
    load_id: str

    def __init__(self, path: str, *, where: str, sidecars: dict[str, str] | None, **options: Any) -> None:
        super().__init__(path, **options)
        self._where, self._sidecars = where, sidecars
        self._indexes: dict[str, Index] = {}
        self._metadata: Metadata | None = None
        self._mapped: tuple[IO[bytes], mmap.mmap] | None = None  # the local file DCP reads now, mapped once

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, read, verified and unpickled once (``dcp.load`` asks at every call)."""
        if kwargs.get("rank") is not None:  # DCP's fallback after a failed read; we write no per-rank metadata
            raise CheckpointError(f"{self._where}: {METADATA_FILE} is missing or unreadable")
        if self._metadata is None:
            data = self._read_whole(METADATA_FILE)
            self._verify(METADATA_FILE, 0, data)
            metadata = load_metadata(data, self._where)
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            self._metadata = metadata
        assert self._metadata.storage_meta is not None
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            return super().read_data(plan, WeightsOnlyEntries(planner, self._where))  # type: ignore[misc,arg-type]
        finally:
            self._unmap()

    def _slice_file(self, file: IO[bytes], sinfo: _StorageInfo) -> IO[bytes]:
        """The item's bytes for DCP to read, checked first: a local or NFS file is hashed through a
        memory map, then read by DCP as usual; an object store's item is read once, whole, and checked
        in memory (reading it twice would fetch it twice)."""
        if self._sidecars is None:
            return super()._slice_file(file, sinfo)  # type: ignore[misc]
        try:
            fileno = file.fileno()
        except (AttributeError, OSError):  # fsspec's remote files have no descriptor
            file.seek(sinfo.offset)
            data = file.read(sinfo.length)
            self._verify(sinfo.relative_path, sinfo.offset, data)
            return io.BytesIO(data)
        if self._mapped is None or self._mapped[0] is not file:  # DCP reads one file's items in a row
            self._unmap()
            self._mapped = (file, mmap.mmap(fileno, 0, access=mmap.ACCESS_READ))
        with memoryview(self._mapped[1]) as whole, whole[sinfo.offset : sinfo.offset + sinfo.length] as span:
            self._verify(sinfo.relative_path, sinfo.offset, span)
        return super()._slice_file(file, sinfo)  # type: ignore[misc]

    def _unmap(self) -> None:
        if self._mapped is not None:
            self._mapped[1].close()
            self._mapped = None

    def _verify(self, name: str, offset: int, data: bytes | memoryview) -> None:
        if self._sidecars is not None:
            check_item(data, name, offset, self._index(name), self._where)

    def _index(self, name: str) -> Index:
        if name not in self._indexes:
            assert self._sidecars is not None
            if name not in self._sidecars:
                raise CheckpointError(f"{self._where}: {name} has no checksum in its commit marker")
            raw = self._read_whole(name + SIDECAR_SUFFIX)
            self._indexes[name] = read_sidecar(raw, name, self._sidecars[name], self._where)
        return self._indexes[name]

    def _read_whole(self, name: str) -> bytes:
        try:
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                return stream.read()
        except FileNotFoundError:
            raise CheckpointError(f"{self._where}: {name} is missing") from None


class VerifiedFileSystemReader(_VerifiedReading, FileSystemReader):
    """DCP's local/NFS reader, verifying and unpickling safely."""


class VerifiedFsspecReader(_VerifiedReading, FsspecReader):
    """DCP's fsspec (s3://...) reader, verifying and unpickling safely."""
