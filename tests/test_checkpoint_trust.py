"""Checkpoints that can be trusted: checksums end to end, nothing on storage runs code, a checkpoint
that will not load is marked bad and the next older one is used, a full or read-only disk stops
the run in one line. In-process (no process group) except one two-rank test."""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from meshtrain.checkpoint.checksums import (
    MARKER_CHECKSUM,
    SIDECAR_SUFFIX,
    HashedStream,
    digest,
    encode_sidecar,
    seal_marker,
)
from meshtrain.checkpoint.errors import CheckpointNotWritable, CheckpointStorageFull, NoLoadableCheckpoint
from meshtrain.checkpoint.manager import CheckpointManager
from meshtrain.checkpoint.state import Progress, TrainState
from meshtrain.checkpoint.storage import BAD_MARKER, COMMIT_MARKER, CheckpointStorage, newest_committed
from meshtrain.config import PermanentError
from meshtrain.config.loading import load_config
from ranks import run_on_ranks


WEIGHT = "train.model.0.weight"


def make_state(seed: int, step: int, dim: int = 8, bias: bool = True, rank: int = 0) -> TrainState:
    """A small model after one optimizer step (so AdamW has its moments), at ``step``."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(dim, dim, bias=bias), torch.nn.LayerNorm(dim))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, dim)).square().sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 ** s)
    scheduler.step()
    return TrainState(model, optimizer, scheduler, Progress(step=step, tokens=step * 64, data_position=step * 2), rank)


class Run:
    """A checkpoint root and the lines its managers log."""

    def __init__(self, root: Path) -> None:
        self.root, self.storage, self.lines = root, CheckpointStorage(str(root)), []

    def manager(self, keep: int = 5, asynchronous: bool = False, rank: int = 0, world_size: int = 1) -> CheckpointManager:
        return CheckpointManager(
            self.storage, rank=rank, world_size=world_size, interval=1, keep=keep, asynchronous=asynchronous,
            log=self.lines.append,
        )

    def save(self, *states: TrainState, keep: int = 5, asynchronous: bool = False) -> None:
        manager = self.manager(keep, asynchronous)
        for state in states:
            manager.save(state, {"world_size": 1})
        manager.close()

    def restore(self, state: TrainState, at_most: int | None = None) -> int | None:
        manager = self.manager()
        try:
            restored = manager.restore(state, at_most)
        finally:
            manager.close()
        return None if restored is None else restored.step

    def step(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def bad(self, step: int) -> dict[str, Any]:
        return json.loads((self.step(step) / BAD_MARKER).read_text())


@pytest.fixture
def run(tmp_path: Path) -> Run:
    return Run(tmp_path / "checkpoints")


def snapshot(state: TrainState) -> dict[str, Any]:
    def copy(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: copy(item) for key, item in value.items()}
        if isinstance(value, list):
            return [copy(item) for item in value]
        return value.clone() if isinstance(value, torch.Tensor) else value

    return copy({
        "model": state.model.state_dict(), "optimizer": state.optimizer.state_dict(),
        "scheduler": state.scheduler.state_dict(), "progress": vars(state.progress),
    })


def assert_bitwise_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


def dcp_metadata(directory: Path) -> Metadata:
    """A checkpoint's metadata read by DCP's own reader (these tests wrote it: it is trusted here)."""
    return dcp.FileSystemReader(str(directory)).read_metadata()


def item_span(directory: Path, fqn: str) -> _StorageInfo:
    return next(info for index, info in dcp_metadata(directory).storage_data.items() if index.fqn == fqn)


def reseal(directory: Path, changed: dict[str, list[tuple[int, int]]]) -> None:
    """What an attacker who knows the scheme would do after editing files: rewrite the sidecars of
    the ``changed`` files (their item spans), the checksums and sizes in the commit marker, and the
    marker's checksum of itself."""
    marker = json.loads((directory / COMMIT_MARKER).read_text())
    del marker[MARKER_CHECKSUM]
    for name, spans in changed.items():
        data = (directory / name).read_bytes()
        sidecar = encode_sidecar(name, [(o, n, digest(data[o : o + n])) for o, n in spans])
        (directory / f"{name}{SIDECAR_SUFFIX}").write_bytes(sidecar)
        marker["checksums"]["sidecars"][name] = digest(sidecar)
    marker["files"] = {p.name: p.stat().st_size for p in directory.iterdir() if p.name not in (COMMIT_MARKER, BAD_MARKER)}
    (directory / COMMIT_MARKER).write_text(json.dumps(seal_marker(marker)))


def strip_checksums(directory: Path) -> None:
    """Make ``directory`` look like a checkpoint written before meshtrain recorded checksums (of its files
    and of its marker)."""
    marker = json.loads((directory / COMMIT_MARKER).read_text())
    del marker["checksums"], marker[MARKER_CHECKSUM]
    for sidecar in directory.glob(f"*{SIDECAR_SUFFIX}"):
        del marker["files"][sidecar.name]
        sidecar.unlink()
    (directory / COMMIT_MARKER).write_text(json.dumps(marker))


class Payload:
    """Unpickling this runs ``touch <path>``: the file shows whether storage ran code."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str]]:
        return os.system, (f"touch {self.path}",)


def plant_metadata_payload(directory: Path, proof: Path, *, reseal_it: bool) -> None:
    """A ``.metadata`` that would run ``touch proof``; its new size goes into the marker, and with
    ``reseal_it`` its checksums too (else they no longer match)."""
    (directory / ".metadata").write_bytes(pickle.dumps(Payload(proof)))
    reseal(directory, {".metadata": [(0, (directory / ".metadata").stat().st_size)]} if reseal_it else {})


def flip_exponent_bit(directory: Path, fqn: str, weight: torch.Tensor) -> tuple[str, int]:
    """Flip the top exponent bit of ``weight``'s first element where the checkpoint stores it; the
    file and the offset of the item holding it."""
    info = item_span(directory, fqn)
    shard = directory / info.relative_path
    data = bytearray(shard.read_bytes())
    at = data.find(weight.detach().numpy().tobytes(), info.offset, info.offset + info.length)
    assert at >= 0
    data[at + 3] ^= 0x40  # little-endian float32: byte 3 holds the sign and the top exponent bits
    shard.write_bytes(bytes(data))
    return info.relative_path, info.offset


# --- checksums, and a restore that is exact -------------------------------------------------------


@pytest.mark.parametrize("asynchronous", [False, True])
def test_restore_is_bitwise_equal_and_every_file_has_checksums(run: Run, asynchronous: bool) -> None:
    saved = make_state(seed=1, step=4)
    expected = snapshot(saved)
    run.save(saved, asynchronous=asynchronous)

    marker = json.loads((run.step(4) / COMMIT_MARKER).read_text())
    sidecars = marker["checksums"]["sidecars"]
    assert marker["checksums"]["algorithm"] == "xxh3_64"
    data_files = {name for name in marker["files"] if not name.endswith(SIDECAR_SUFFIX)}
    assert data_files == set(sidecars) and ".metadata" in data_files
    for name, recorded in sidecars.items():
        sidecar = (run.step(4) / f"{name}{SIDECAR_SUFFIX}").read_bytes()
        assert digest(sidecar) == recorded
        segments = json.loads(sidecar)["segments"]
        content = (run.step(4) / name).read_bytes()
        assert sum(length for _, length, _ in segments) == len(content)
        assert all(digest(content[o : o + n]) == d for o, n, d in segments)
    spans = {(info.relative_path, info.offset, info.length) for info in dcp_metadata(run.step(4)).storage_data.values()}
    recorded_spans = {
        (name, o, n) for name in sidecars if name != ".metadata"
        for o, n, _ in json.loads((run.step(4) / f"{name}{SIDECAR_SUFFIX}").read_bytes())["segments"]
    }
    assert spans == recorded_spans  # one checksum per item DCP reads

    target = make_state(seed=2, step=0)
    assert run.restore(target) == 4
    assert_bitwise_equal(snapshot(target), expected)
    assert run.lines == []


def test_a_checkpoint_from_before_checksums_still_loads_with_one_line(run: Run) -> None:
    saved = make_state(seed=1, step=4)
    expected = snapshot(saved)
    run.save(saved)
    directory = run.step(4)
    strip_checksums(directory)

    target = make_state(seed=2, step=0)
    assert run.restore(target) == 4
    assert_bitwise_equal(snapshot(target), expected)
    assert run.lines == [f"[meshtrain] checkpoint {directory} has no checksums (written before meshtrain recorded them): checked its file sizes only"]


def test_a_checkpoint_that_keeps_its_optimizer_by_group_index_still_loads(run: Run) -> None:
    """Checkpoints written before pipeline parallel keep the optimizer state by group index; every one since,
    by parameter name. Both restore the same state, and the next save writes by name."""
    saved = make_state(seed=1, step=4)
    expected = snapshot(saved)
    saved.optimizer_by_name = False
    run.save(saved)
    keys = run.storage.reader(run.step(4)).read_metadata().state_dict_metadata
    assert "train.optimizer.param_groups.0.params" in keys
    target = make_state(seed=2, step=0)
    assert run.restore(target) == 4 and target.optimizer_by_name
    assert_bitwise_equal(snapshot(target), expected)
    target.progress.step = 8
    run.save(target)
    keys = run.storage.reader(run.step(8)).read_metadata().state_dict_metadata
    assert "train.optimizer.param_groups.0.weight.lr" in keys and "train.optimizer.param_groups.0.params" not in keys


# --- falling back ---------------------------------------------------------------------------------


def _other_shape(run: Run, newer: TrainState) -> str:
    run.save(make_state(seed=3, step=8, dim=16))
    return "Size mismatch between saved torch.Size([16, 16]) and current: torch.Size([8, 8]) for train.model.0.weight"


def _other_keys(run: Run, newer: TrainState) -> str:
    run.save(make_state(seed=3, step=8, bias=False))
    return "Missing key in checkpoint state_dict: train.model.0.bias"


def _truncated_shard(run: Run, newer: TrainState) -> str:
    run.save(newer)
    shard = run.step(8) / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    return f"__0_0.distcp has {shard.stat().st_size} bytes, expected {shard.stat().st_size + 10}"


def _flipped_weight(run: Run, newer: TrainState) -> str:
    run.save(newer)
    name, offset = flip_exponent_bit(run.step(8), WEIGHT, newer.model[0].weight)
    # What DCP alone would load: the weight, 2^128 times larger, silently.
    plain = {"train": {"model": {"0.weight": torch.zeros(8, 8)}}}
    dcp.load(plain, storage_reader=dcp.FileSystemReader(str(run.step(8))), no_dist=True)
    assert plain["train"]["model"]["0.weight"].abs().max() > 1e30
    return f"{name} at offset {offset} ("


def _flipped_metadata(run: Run, newer: TrainState) -> str:
    run.save(newer)
    metadata = run.step(8) / ".metadata"
    data = bytearray(metadata.read_bytes())
    data[len(data) // 2] ^= 0x10
    metadata.write_bytes(bytes(data))
    return ".metadata at offset 0 ("


@pytest.mark.parametrize(
    "damage", [_other_shape, _other_keys, _truncated_shard, _flipped_weight, _flipped_metadata],
    ids=["other shape", "other keys", "truncated shard", "flipped weight bit", "flipped metadata bit"],
)
def test_a_newest_checkpoint_that_will_not_load_is_marked_bad_and_the_previous_one_used(
    run: Run, damage: Callable[[Run, TrainState], str]
) -> None:
    older = make_state(seed=1, step=4)
    expected = snapshot(older)
    run.save(older)
    detail = damage(run, make_state(seed=5, step=8))

    target = make_state(seed=2, step=0)
    assert run.restore(target) == 4
    assert_bitwise_equal(snapshot(target), expected)
    assert len(run.lines) == 1
    assert run.lines[0].startswith(f"[meshtrain] checkpoint {run.step(8)}: ") and detail in run.lines[0]
    assert run.lines[0].endswith(f"marked it bad ({run.step(8) / BAD_MARKER}), falling back to the previous committed checkpoint")
    bad = run.bad(8)
    assert bad["step"] == 8 and detail in bad["reason"] and bad["marked_at"].endswith("Z")
    assert (run.step(8) / COMMIT_MARKER).is_file()  # kept for inspection

    # A later start skips it without trying it again; so does everything asking for the newest one.
    run.lines.clear()
    assert run.restore(make_state(seed=2, step=0)) == 4
    assert run.lines == [f"[meshtrain] checkpoint {run.step(8)} skipped: it is bad ({bad['reason']})"]
    assert [c.step for c in run.storage.committed()] == [4]
    cfg = load_config(None, [f"checkpoint.path={run.root.parent}", f"run.name={run.root.name}"])
    assert newest_committed(cfg.checkpoint, cfg.run)[1].step == 4
    # A replacement replica group that finds no peer has nothing to replace only once the last step is
    # committed in a checkpoint that is not bad.
    from meshtrain.cluster.worker import training_ended

    assert [training_ended(cfg.checkpoint, cfg.run, steps) for steps in (4, 8)] == [True, False]


def test_a_commit_marker_that_is_not_json_is_skipped_and_kept(run: Run) -> None:
    run.save(make_state(seed=1, step=4), make_state(seed=1, step=8))
    (run.step(8) / COMMIT_MARKER).write_text('{"step": 8, "files": {')
    assert [(c.step, c.bad) for c in run.storage.all_committed()] == [(8, f"its {COMMIT_MARKER} is not valid JSON"), (4, None)]
    assert run.restore(make_state(seed=2, step=0)) == 4
    assert run.lines == [f"[meshtrain] checkpoint {run.step(8)} skipped: it is bad (its {COMMIT_MARKER} is not valid JSON)"]
    run.save(make_state(seed=1, step=12), keep=1)
    assert sorted(p.name for p in run.root.iterdir()) == ["step-00000008", "step-00000012"]


def test_a_launch_resume_point_loads_that_step_not_a_newer_one(run: Run) -> None:
    """Replica mode: a group starting late in a launch loads the checkpoint the launch resumed from
    (or none), not one a peer saved since; it heals from that peer anyway."""
    run.save(make_state(seed=1, step=4), make_state(seed=1, step=8))
    assert run.restore(make_state(seed=2, step=0), at_most=4) == 4
    assert run.restore(make_state(seed=2, step=0), at_most=7) == 4
    assert run.restore(make_state(seed=2, step=0), at_most=0) is None
    assert run.restore(make_state(seed=2, step=0)) == 8


def test_pruning_keeps_the_loadable_checkpoint_and_never_counts_or_deletes_bad_ones(run: Run) -> None:
    run.save(make_state(seed=1, step=4), make_state(seed=1, step=8))
    run.save(make_state(seed=3, step=16, dim=16))  # another model's checkpoint, newer
    assert run.restore(make_state(seed=2, step=0)) == 8
    assert run.bad(16)

    # keep=1: the checkpoint just saved stays, the bad newer one stays (not counted), older ones go.
    run.save(make_state(seed=1, step=12), keep=1)
    assert sorted(p.name for p in run.root.iterdir()) == ["step-00000012", "step-00000016"]
    assert [c.step for c in run.storage.committed()] == [12]
    assert run.restore(make_state(seed=2, step=0)) == 12

    # Saving a step again whose checkpoint is marked bad moves that one aside, never deletes it.
    run.lines.clear()
    run.save(make_state(seed=1, step=16), keep=1)
    aside = [p for p in run.root.iterdir() if p.name.startswith("step-00000016.bad-")]
    assert len(aside) == 1 and (aside[0] / BAD_MARKER).is_file()
    reason = json.loads((aside[0] / BAD_MARKER).read_text())["reason"]
    assert run.lines == [
        f"[meshtrain] checkpoint {run.step(16)} is bad ({reason}); moved it to {aside[0]} to save step 16 again"
    ]
    assert [c.step for c in run.storage.committed()] == [16]


def test_with_no_loadable_checkpoint_the_run_stops_listing_each_one(run: Run) -> None:
    run.save(make_state(seed=1, step=4), make_state(seed=1, step=8))
    (run.step(8) / ".metadata").unlink()
    flip_exponent_bit(run.step(4), WEIGHT, make_state(seed=1, step=4).model[0].weight)

    with pytest.raises(NoLoadableCheckpoint) as caught:
        run.restore(make_state(seed=2, step=0))
    assert isinstance(caught.value, PermanentError)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"no loadable checkpoint in {run.root}: ")
    assert f"checkpoint {run.step(8)}: .metadata is missing" in message
    assert f"checkpoint {run.step(4)}: __0_0.distcp at offset" in message
    assert run.lines[-1].endswith("no older checkpoint to fall back to")
    assert run.bad(8) and run.bad(4)

    with pytest.raises(NoLoadableCheckpoint, match=f"checkpoint {run.step(8)}: skipped \\(.metadata is missing\\)"):
        run.restore(make_state(seed=2, step=0))
    assert run.manager().any_committed()  # the trainer restores (and stops) rather than starting over


# --- nothing on storage runs code ------------------------------------------------------------------


@pytest.mark.parametrize("reseal_it", [False, True], ids=["checksum stale", "checksum edited to match"])
def test_a_crafted_metadata_never_runs(run: Run, tmp_path: Path, reseal_it: bool) -> None:
    run.save(make_state(seed=1, step=4), make_state(seed=1, step=8))
    proof = tmp_path / "payload-ran"
    plant_metadata_payload(run.step(8), proof, reseal_it=reseal_it)

    assert run.restore(make_state(seed=2, step=0)) == 4
    assert not proof.exists()
    detail = "refers to posix.system, which DCP metadata never holds" if reseal_it else ".metadata at offset 0: "
    assert len(run.lines) == 1 and f"checkpoint {run.step(8)}: " in run.lines[0] and detail in run.lines[0]


@pytest.mark.parametrize("where", ["metadata", "data"])
def test_storage_that_does_not_answer_marks_nothing_bad_and_is_left_to_a_restart(
    run: Run, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A network or S3 outage while loading says nothing about the checkpoint: no BAD marker (else
    every checkpoint would be condemned by one outage), and a retryable error, not NoLoadableCheckpoint."""
    from meshtrain.checkpoint import dcp_files
    from meshtrain.checkpoint.errors import CheckpointUnreachable

    run.save(make_state(seed=1, step=4), make_state(seed=1, step=8))

    def no_answer(*_args: Any, **_kwargs: Any) -> Any:
        raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")

    method = "read_metadata" if where == "metadata" else "read_data"
    monkeypatch.setattr(dcp_files.VerifiedFileSystemReader, method, no_answer)
    with pytest.raises(CheckpointUnreachable, match="did not answer .*nothing was marked bad"):
        run.restore(make_state(seed=2, step=0))
    assert not (run.step(8) / BAD_MARKER).exists() and not (run.step(4) / BAD_MARKER).exists()
    monkeypatch.undo()
    assert run.restore(make_state(seed=2, step=0)) == 8


def test_a_crafted_non_tensor_entry_never_runs(run: Run, tmp_path: Path) -> None:
    run.save(make_state(seed=1, step=4), make_state(seed=1, step=8))
    directory, proof = run.step(8), tmp_path / "payload-ran"
    metadata = dcp_metadata(directory)
    index = next(i for i, m in metadata.state_dict_metadata.items() if isinstance(m, BytesStorageMetadata))
    key = next(k for k in metadata.storage_data if k.fqn == index)
    shard = directory / metadata.storage_data[key].relative_path
    crafted = io.BytesIO()
    torch.save(Payload(proof), crafted)
    end = shard.stat().st_size
    with shard.open("ab") as handle:
        handle.write(crafted.getvalue())
    metadata.storage_data[key] = _StorageInfo(shard.name, end, len(crafted.getvalue()))
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    sidecar = json.loads((directory / f"{shard.name}{SIDECAR_SUFFIX}").read_bytes())
    spans = [(offset, length) for offset, length, _ in sidecar["segments"]] + [(end, len(crafted.getvalue()))]
    reseal(directory, {shard.name: spans, ".metadata": [(0, (directory / ".metadata").stat().st_size)]})

    assert run.restore(make_state(seed=2, step=0)) == 4
    assert not proof.exists()
    assert len(run.lines) == 1 and f"entry {index} is not plain data, refused to unpickle it" in run.lines[0]


# --- full or read-only storage ----------------------------------------------------------------------


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("previous", [True, False], ids=["after a checkpoint", "first save"])
def test_a_full_disk_stops_the_save_in_one_line_and_removes_the_partial_save(
    run: Run, monkeypatch: pytest.MonkeyPatch, asynchronous: bool, previous: bool
) -> None:
    state = make_state(seed=1, step=8)
    if previous:
        run.save(make_state(seed=1, step=4))
        needed = json.loads((run.step(4) / COMMIT_MARKER).read_text())["bytes"]
        basis = "the size of the previous checkpoint"
    else:
        needed, basis = state.nbytes(), "the size of the training state"

    def full(self: HashedStream, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(HashedStream, "write", full)
    manager = run.manager(asynchronous=asynchronous)
    with pytest.raises(CheckpointStorageFull) as caught:
        manager.save(state, {"world_size": 1})
        manager.finish_pending()
    manager.close()
    message = str(caught.value)
    assert isinstance(caught.value, PermanentError) and "\n" not in message
    assert f"writing {run.step(8)} failed (No space left on device)" in message
    assert f"needs about {needed:,} bytes ({basis})" in message and " bytes free there" in message
    assert not run.step(8).exists()
    assert [c.step for c in run.storage.committed()] == ([4] if previous else [])


def test_an_unwritable_checkpoint_directory_stops_the_save_in_one_line(run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: FileSystem, path: Any) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(FileSystem, "mkdir", refuse)
    manager = run.manager()
    with pytest.raises(CheckpointNotWritable, match=f"^checkpoint directory {run.step(4)} is not writable "):
        manager.save(make_state(seed=1, step=4), {"world_size": 1})


# --- ranks agree ----------------------------------------------------------------------------------


def _two_ranks_fall_back(rank: int, world: int, root: str) -> dict[str, Any]:
    run = Run(Path(root))
    manager = run.manager(rank=rank, world_size=world)
    for step in (4, 8):
        manager.save(make_state(seed=1, step=step, rank=rank), {"world_size": world})
    manager.close()
    dist.barrier()
    if rank == 0:  # damage an item only rank 1 reads: its own RNG state
        info = item_span(run.step(8), "train.rng_rank1.torch")
        shard = run.step(8) / info.relative_path
        data = bytearray(shard.read_bytes())
        data[info.offset + info.length // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    dist.barrier()
    manager = run.manager(rank=rank, world_size=world)
    restored = manager.restore(make_state(seed=2, step=0, rank=rank))
    manager.close()
    return {"step": restored.step if restored else None, "lines": run.lines, "info": info.relative_path if rank == 0 else None}


def test_two_ranks_agree_to_fall_back_when_only_one_reads_a_damaged_item(tmp_path: Path) -> None:
    first, second = run_on_ranks(_two_ranks_fall_back, 2, str(tmp_path / "checkpoints"))
    assert first["step"] == second["step"] == 4
    assert second["lines"] == [] and len(first["lines"]) == 1
    assert f"{first['info']} at offset" in first["lines"][0] and "does not match its checksum" in first["lines"][0]
    assert (tmp_path / "checkpoints" / "step-00000008" / BAD_MARKER).is_file()


# --- object storage -------------------------------------------------------------------------------


def test_s3_checkpoints_are_checksummed_restored_exactly_and_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from s3server import moto_s3

    with moto_s3(monkeypatch, "ckpts") as options:
        run = Run(Path("unused"))
        run.storage = CheckpointStorage("s3://ckpts/run", options)
        saved = make_state(seed=1, step=4)
        expected = snapshot(saved)
        run.save(saved)
        run.save(make_state(seed=1, step=8), asynchronous=True)
        fs = run.storage.fs
        marker = json.loads(fs.cat("ckpts/run/step-00000008/COMMITTED"))
        assert set(marker["checksums"]["sidecars"]) == {".metadata", "__0_0.distcp"}

        metadata = bytearray(fs.cat("ckpts/run/step-00000008/.metadata"))
        metadata[len(metadata) // 2] ^= 0x10
        fs.pipe("ckpts/run/step-00000008/.metadata", bytes(metadata))
        fs.invalidate_cache()
        target = make_state(seed=2, step=0)
        assert run.restore(target) == 4
        assert_bitwise_equal(snapshot(target), expected)
        assert len(run.lines) == 1 and "s3://ckpts/run/step-00000008: .metadata at offset 0 (" in run.lines[0]
        assert "does not match its checksum" in json.loads(fs.cat("ckpts/run/step-00000008/BAD"))["reason"]
        assert [c.step for c in run.storage.committed()] == [4]


# --- the commit marker checks itself ---------------------------------------------------------------


def test_the_marker_carries_the_sha256_of_the_rest_of_it(run: Run) -> None:
    import hashlib

    run.save(make_state(seed=1, step=4))
    marker = json.loads((run.step(4) / COMMIT_MARKER).read_text())
    rest = {key: value for key, value in marker.items() if key != MARKER_CHECKSUM}
    canonical = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    assert marker[MARKER_CHECKSUM] == hashlib.sha256(canonical).hexdigest()
    assert run.storage.read_marker(str(run.step(4))) == rest  # read back without it


def _edit_step(marker: dict[str, Any]) -> str:
    marker["world_size"] = 2  # still valid JSON, still plausible: only the checksum tells
    return json.dumps(marker, indent=1)


def _truncate(marker: dict[str, Any]) -> str:
    text = json.dumps(marker, indent=1)
    return text[: text.rindex('"checksums"')].rstrip().rstrip(",") + "\n}"  # a torn write that still parses


@pytest.mark.parametrize("damage", [_edit_step, _truncate], ids=["edited field", "torn write"])
def test_a_marker_that_does_not_match_its_checksum_is_skipped_and_the_previous_one_used(
    run: Run, damage: Callable[[dict[str, Any]], str]
) -> None:
    older = make_state(seed=1, step=4)
    expected = snapshot(older)
    run.save(older, make_state(seed=5, step=8))
    marker = run.step(8) / COMMIT_MARKER
    marker.write_text(damage(json.loads(marker.read_text())))
    assert json.loads(marker.read_text())  # valid JSON either way

    reason = f"its {COMMIT_MARKER} does not match its {MARKER_CHECKSUM} (sha256 "
    assert [(c.step, (c.bad or "")[: len(reason)]) for c in run.storage.all_committed()] == [(8, reason), (4, "")]
    assert [c.step for c in run.storage.committed()] == [4]
    target = make_state(seed=2, step=0)
    assert run.restore(target) == 4
    assert_bitwise_equal(snapshot(target), expected)
    assert len(run.lines) == 1
    assert run.lines[0].startswith(f"[meshtrain] checkpoint {run.step(8)} skipped: it is bad ({reason}")
    run.save(make_state(seed=1, step=12), keep=1)  # never pruned: kept for inspection
    assert sorted(p.name for p in run.root.iterdir()) == ["step-00000008", "step-00000012"]


def test_a_reader_given_the_folder_names_the_newer_checkpoint_it_passes_over(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    """Export, evaluate and generate given a folder read its newest loadable step, saying on stderr (in a
    restore's words) which newer one they passed over; a bad one older than it goes unsaid."""
    from meshtrain.checkpoint.reading import newest_loadable, resolve_checkpoint

    run.save(make_state(seed=1, step=4), make_state(seed=5, step=8), make_state(seed=6, step=12))
    for step in (12, 4):
        marker = run.step(step) / COMMIT_MARKER
        marker.write_text(_edit_step(json.loads(marker.read_text())))
    assert resolve_checkpoint(str(run.root)) == str(run.step(8))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"[meshtrain] checkpoint {run.step(12)} skipped: it is bad (its {COMMIT_MARKER} does not match its "
        f"{MARKER_CHECKSUM} (sha256 ")
    # Too few loadable ones for an average: the caller's refusal is the only line.
    assert [checkpoint.step for checkpoint in newest_loadable(run.storage, 2)] == [8]
    assert capsys.readouterr().err == ""


def test_a_marker_written_before_its_checksum_still_loads(run: Run) -> None:
    """Markers from before meshtrain recorded marker_sha256 have none: they load as before (their files'
    checksums and sizes are still checked)."""
    saved = make_state(seed=1, step=4)
    expected = snapshot(saved)
    run.save(saved)
    marker = json.loads((run.step(4) / COMMIT_MARKER).read_text())
    del marker[MARKER_CHECKSUM]
    (run.step(4) / COMMIT_MARKER).write_text(json.dumps(marker))
    target = make_state(seed=2, step=0)
    assert run.restore(target) == 4
    assert_bitwise_equal(snapshot(target), expected)
    assert run.lines == []


def test_a_marker_that_is_not_an_object_is_skipped(run: Run) -> None:
    run.save(make_state(seed=1, step=4), make_state(seed=1, step=8))
    (run.step(8) / COMMIT_MARKER).write_text("[8]")
    assert [(c.step, c.bad) for c in run.storage.all_committed()] == [
        (8, f"its {COMMIT_MARKER} is not a JSON object"), (4, None)
    ]
    assert run.restore(make_state(seed=2, step=0)) == 4


def test_the_export_refuses_a_marker_that_does_not_match_its_checksum_in_one_line(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshtrain.cli.export import main as export_main

    run.save(make_state(seed=1, step=4))
    marker = run.step(4) / COMMIT_MARKER
    marker.write_text(_edit_step(json.loads(marker.read_text())))
    code = export_main([str(run.step(4)), "--format", "torch", str(tmp_path / "model.pt")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"export: error: checkpoint {run.step(4)}: {COMMIT_MARKER} does not match its "
                               f"{MARKER_CHECKSUM} (sha256 ") and lines[0].endswith("it changed after the commit")
    assert not (tmp_path / "model.pt").exists()
