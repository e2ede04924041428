"""Why a worker group failed, and whether a restart can help: the classification every failure gets,
the line the driver prints, and the decision Ray's controller takes with meshtrain's failure policy.

The errors travel as Ray sends them (pickled), with the stamps the workers put on them. Through Ray:
test_end_to_end.py (a config error on the workers: one start although run.max_failures=3) and
test_recovery.py (a killed worker with no restarts left: the line names rank 0)."""

from __future__ import annotations

import errno
import pickle

import pytest
import torch
from ray.train import FailureConfig, WorkerGroupError
from ray.train.v2._internal.execution.failure_handling import FailureDecision
from safetensors import SafetensorError

from meshtrain.checkpoint.errors import CheckpointStorageFull, CheckpointUnreachable, NoLoadableCheckpoint
from meshtrain.cluster.failures import Failure, is_permanent, root_failure, stamp
from meshtrain.cluster.outcome import failure_message, restarts_used
from meshtrain.observe.run_folder import RunPaths, WorkerStart, append_worker_start
from meshtrain.cluster.ray_trainer import StopOnPermanentFailure
from meshtrain.cluster.worker import UntrainableGroupSize
from meshtrain.config import ConfigError
from meshtrain.config.loading import load_config
from meshtrain.data.integrity import CorruptTokens
from meshtrain.data.remote import StorageUnavailable
from meshtrain.train.preemption import Preempted

PEER_LOST = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.8]:4242")


def as_sent_by_ray(error: BaseException, rank: int, node: str, at: float) -> BaseException:
    stamp(error, rank, node)
    error.meshtrain_time = at  # type: ignore[attr-defined]
    return pickle.loads(pickle.dumps(error))


@pytest.mark.parametrize("error, permanent", [
    (ConfigError("scaling.workers_per_node=1, but Ray placed 2 workers per node"), True),
    (CorruptTokens("token shard shard-000003.bin: block at byte offset 4096 does not match its CRC-32"), True),
    (NoLoadableCheckpoint("no loadable checkpoint"), True),
    (CheckpointStorageFull("no space left"), True),
    (OSError(errno.ENOSPC, "No space left on device", "/ckpt/step-00000200/__0_0.distcp"), True),
    (PermissionError(errno.EACCES, "Permission denied", "/ckpt"), True),
    (OSError(errno.EROFS, "Read-only file system", "/ckpt"), True),
    (NotADirectoryError(errno.ENOTDIR, "Not a directory", "/runs/file/run"), True),
    (OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address"), True),
    (MemoryError(), True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: not enough memory: you tried to "
                  "allocate 70368744177664 bytes."), True),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 GiB"), True),
    (SafetensorError("Error while deserializing header: incomplete metadata, file not fully covered"), True),
    (OverflowError("int too big to convert"), True),
    (PEER_LOST, False),
    (TimeoutError("collective timed out"), False),
    (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), False),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/nfs/flaky"), False),
    (Preempted("rank 0: stopped at step 6 on a preemption notice (SIGTERM)"), False),
    (UntrainableGroupSize("Ray started 6 workers, but ... trains only on 2, 4, 8"), False),
    (StorageUnavailable("data.source: s3://data/store did not answer for 120s"), False),
    (CheckpointUnreachable("checkpoint s3://c/r/step-00000200: the checkpoint storage did not answer"), False),
])
def test_only_what_a_restart_cannot_fix_is_permanent(error: BaseException, permanent: bool) -> None:
    assert is_permanent(pickle.loads(pickle.dumps(error))) is permanent


def test_the_root_cause_is_the_permanent_error_not_the_peer_that_lost_it() -> None:
    corrupt = CorruptTokens("token shard /stores/a/shard-000003.bin: byte offset 4096 does not match its CRC-32; re-prepare it")
    group = WorkerGroupError("snippets", {
        0: as_sent_by_ray(PEER_LOST, 0, "10.0.0.7", at=5.0),  # failed first, but only lost its peer
        1: as_sent_by_ray(corrupt, 1, "10.0.0.8", at=6.0),
    })
    failure = root_failure(pickle.loads(pickle.dumps(group)))
    assert failure == Failure(1, "10.0.0.8", f"CorruptTokens: {corrupt}", permanent=True, other_ranks=1)
    assert failure.describe() == f"rank 1 on 10.0.0.8: CorruptTokens: {corrupt} (+1 other rank(s) failed)"


def test_of_transient_errors_the_earliest_that_is_not_a_lost_peer_is_the_cause() -> None:
    oom = RuntimeError("CUDA out of memory. Tried to allocate 3.91 GiB")
    group = WorkerGroupError("snippets", {
        0: as_sent_by_ray(PEER_LOST, 0, "10.0.0.7", at=1.0),
        2: as_sent_by_ray(RuntimeError("second"), 2, "10.0.0.9", at=9.0),
        3: as_sent_by_ray(oom, 3, "10.0.0.9", at=4.0),
    })
    failure = root_failure(group)
    assert (failure.rank, failure.error, failure.permanent) == (3, f"RuntimeError: {oom}", False)


def test_an_os_error_names_its_path_and_a_long_message_stays_one_line() -> None:
    full = OSError(errno.ENOSPC, "No space left on device", "/ckpt/r/step-00000200/__1_0.distcp")
    assert root_failure(full).error == "OSError: No space left on device: /ckpt/r/step-00000200/__1_0.distcp"
    long = root_failure(RuntimeError("x" * 1000 + "\nsecond line")).error
    assert "\n" not in long and len(long) <= 240


def test_rays_controller_stops_at_once_on_a_permanent_failure_and_retries_the_rest() -> None:
    policy = StopOnPermanentFailure(FailureConfig(max_failures=3))
    transient = WorkerGroupError("lost", {1: as_sent_by_ray(PEER_LOST, 1, "n", at=1.0)})
    assert [policy.make_decision(transient) for _ in range(4)] == [FailureDecision.RETRY] * 3 + [FailureDecision.RAISE]

    policy = StopOnPermanentFailure(FailureConfig(max_failures=3))
    for permanent in (CorruptTokens("shard"), NoLoadableCheckpoint("none"), ConfigError("x"),
                      OSError(errno.ENOSPC, "No space left on device", "/ckpt")):
        group = WorkerGroupError("bad", {0: as_sent_by_ray(PEER_LOST, 0, "n", at=1.0),
                                         1: as_sent_by_ray(permanent, 1, "n", at=2.0)})
        assert policy.make_decision(group) == FailureDecision.RAISE


def test_the_drivers_final_line(tmp_path) -> None:
    cfg = load_config(None, [f"run.storage_path={tmp_path}", "run.name=r", "run.max_failures=3"])
    permanent = Failure(1, "10.0.0.8", "CorruptTokens: token shard a.bin: byte offset 4096 ...", permanent=True)
    assert failure_message(cfg.checkpoint, cfg.run, permanent, restarts=0) == (
        "training failed: rank 1 on 10.0.0.8: CorruptTokens: token shard a.bin: byte offset 4096 ...; not restarted, "
        "a restart cannot fix this; no checkpoint was committed; fix the cause, then run the same command again "
        "(run.name=r) to resume"
    )
    transient = Failure(0, "10.0.0.7", "RuntimeError: boom", permanent=False)
    assert failure_message(cfg.checkpoint, cfg.run, transient, restarts=3).startswith(
        "training failed: rank 0 on 10.0.0.7: RuntimeError: boom; after 3 restart(s) (run.max_failures=3); "
    )
    # Replica mode: run.max_failures bounds each group's restarts, so the line counts one group's (two
    # groups restarted 3 times each are 8 starts: "after 7 restart(s) (run.max_failures=3)" read as a contradiction).
    paths = RunPaths("r", tmp_path)
    for replica in (0, 1):
        for _ in range(4):
            append_worker_start(paths, WorkerStart(launch="L", time=0.0, world_size=1, workers=[], replica=replica))
    append_worker_start(paths, WorkerStart(launch="earlier", time=0.0, world_size=1, workers=[], replica=0))
    assert restarts_used(paths, "L") == 3
    assert failure_message(cfg.checkpoint, cfg.run, transient, restarts_used(paths, "L"), replica_groups=True).startswith(
        "training failed: rank 0 on 10.0.0.7: RuntimeError: boom; after 3 restart(s) of a replica group "
        "(run.max_failures=3 per group); "
    )


def test_meshtrains_own_permanent_errors_are_kept_whole() -> None:
    tried = "; ".join(f"checkpoint /c/r/step-000000{n}0: __0_0.distcp at offset 1024 does not match its checksum"
                      for n in (3, 2, 1))
    failure = root_failure(NoLoadableCheckpoint(f"no loadable checkpoint in /c/r: {tried}; repair them"))
    assert failure.error == f"NoLoadableCheckpoint: no loadable checkpoint in /c/r: {tried}; repair them"
