"""What each Ray Train worker runs: read its place in the group, train, write the run outputs."""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
import time
from typing import Any, NamedTuple

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from meshtrain.checkpoint.storage import newest_committed
from meshtrain.config import CheckpointConfig, RunConfig, ScalingConfig
from meshtrain.cluster.eviction import StragglerEviction
from meshtrain.cluster.failures import stamp
from meshtrain.distributed.layout import WorkerLayout
from meshtrain.distributed.replicas import ReplicaPlacement
from meshtrain.distributed.parallelize import param_dtype, set_matmul_precision, use_tf32
from meshtrain.distributed.torch_support import check_torch
from meshtrain.model.flops import device_peak_flops, flops_per_token
from meshtrain.config.network import Endpoint, advertised_host
from meshtrain.observe.metrics import (
    TrainingMetrics,
    targets_name,
    targets_path,
    write_targets,
)
from meshtrain.observe.progress import StepRecorder
from meshtrain.observe.reporting import RayTrainReporter, TensorBoardWriter
from meshtrain.observe.run_folder import (
    GroupStartRecord,
    MetricsRecord,
    Placement,
    RecordFollower,
    Resize,
    ResizeRecord,
    RunPaths,
    RunResult,
    StopRequest,
    TrainRecord,
    WorkerStart,
    append_worker_start,
    read_worker_starts,
    write_result,
)
from meshtrain.observe.trackers import DRIVER_RECORDS
from meshtrain.train.plan import WorkerPlan
from meshtrain.train.replica_steps import EndedByPeers, NoPeerToHeal
from meshtrain.train.trainer import train


def _gather(value: Any) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def resize_record(previous: WorkerStart | None, launch_id: str, world_size: int, scaling: ScalingConfig) -> ResizeRecord | None:
    """The ``resize`` event when this group's size differs from the run's previous start, else None."""
    if previous is None:
        return None
    before = previous.world_size
    if before == world_size:
        return None
    if previous.launch != launch_id:
        reason = "a new launch with another scaling.num_workers or cluster"
    elif world_size < before:
        reason = (
            f"capacity lost: Ray restarted the group on the {world_size} workers the cluster holds "
            f"(scaling.min_workers={scaling.required_workers})"
        )
    else:
        reason = (
            f"capacity returned: Ray's check every scaling.resize_check_interval_s={scaling.resize_check_interval_s:g}s "
            f"found room for {world_size} workers"
        )
    return ResizeRecord(time=time.time(), from_workers=before, to_workers=world_size, reason=reason)


def resizes(paths: RunPaths) -> list[Resize]:
    """Every change of the run's worker-group size so far: when, from, to (from worker_starts.jsonl)."""
    return [
        Resize(time=entry.time, from_workers=entry.resized_from, to_workers=entry.world_size,
               reason=entry.resize_reason or "")
        for entry in read_worker_starts(paths)
        if entry.resized_from is not None
    ]


class UntrainableGroupSize(RuntimeError):
    """Ray started an elastic group of a size the run cannot train on; its next start may fit."""


def check_group_size(plan: WorkerPlan, world_size: int, replica: ReplicaPlacement | None = None) -> None:
    """An elastic group of a size the run cannot train on (a partial shard group, or a global batch
    it does not divide) fails its start with one line; Ray then retries (not a permanent failure:
    the cluster's capacity changes). A replica group has the one size of a replica."""
    scaling = plan.scaling
    sizes = [scaling.num_workers // replica.replicas] if replica is not None else list(plan.group_sizes)
    if world_size not in sizes:
        raise UntrainableGroupSize(
            f"Ray started {world_size} workers, but scaling.min_workers={scaling.required_workers} to "
            f"scaling.num_workers={scaling.num_workers} trains only on {', '.join(map(str, sizes))} (whole shard "
            "groups that divide train.global_batch_size); give nodes whole multiples of the shard group"
        )


def record_worker_start(
    paths: RunPaths, launch_id: str, layout: WorkerLayout, scaling: ScalingConfig, replica: int | None = None
) -> tuple[int, list[Placement], ResizeRecord | None]:
    """Log this worker group's start, with where every rank runs, in the run directory.

    Returns the restarts of this launch (earlier starts with the same launch id, of the same replica
    group in replica mode), the placements, and the resize from the run's previous start (rank 0; None
    elsewhere, in replica mode, or when the size is the same).
    """
    placement = Placement(rank=layout.world_rank, node_rank=layout.node_rank, local_rank=layout.local_rank,
                          node_ip=ray.util.get_node_ip_address(), pid=os.getpid())
    workers: list[Placement] = _gather(placement)
    restarts, resize = 0, None
    if layout.world_rank == 0:
        earlier = read_worker_starts(paths)
        if replica is None:
            resize = resize_record(earlier[-1] if earlier else None, launch_id, layout.world_size, scaling)
        append_worker_start(paths, WorkerStart(
            launch=launch_id, time=time.time(), world_size=layout.world_size, workers=workers, replica=replica,
            resized_from=resize.from_workers if resize is not None else None,
            resize_reason=resize.reason if resize is not None else None,
        ))
        restarts = sum(entry.launch == launch_id and entry.replica == replica for entry in earlier)
    return _gather(restarts)[0], workers, resize


def start_metrics(
    plan: WorkerPlan, layout: WorkerLayout, device: torch.device, restarts: int, replica: int | None = None,
) -> TrainingMetrics:
    """Serve this worker's /metrics and (rank 0) publish every worker's endpoint for Prometheus.

    Replica groups may share a node: each serves on ports of its own, and publishes its own targets file."""
    settings, run = plan.metrics, plan.run
    assert run.name is not None
    offset = layout.local_rank if replica is None else replica * layout.world_size + layout.local_rank
    node_ip = ray.util.get_node_ip_address()
    peak = device_peak_flops(
        device,
        param_dtype(plan.parallel.mixed_precision, device.type),
        settings.peak_flops_per_s,
        settings.cpu_peak_flops_per_s,
        tf32=use_tf32(plan.train.tf32, plan.parallel.mixed_precision, device.type),
    )
    if peak is None and layout.world_rank == 0:
        print(
            f"[meshtrain] no peak FLOP/s known for {torch.cuda.get_device_name(device)}; "
            "set metrics.peak_flops_per_s to get meshtrain_mfu_ratio"
        )
    metrics = TrainingMetrics(
        run=run.name,
        replica=replica,
        rank=layout.world_rank,
        node=node_ip,
        device=device,
        flops_per_token=flops_per_token(plan.model, plan.data_config.seq_len),
        peak_flops_per_s=peak,
    )
    metrics.restarts.set(restarts)
    metrics.set_plan(plan.scaling.num_workers, plan.checkpoint.interval if plan.checkpoint.enabled else None)
    port = metrics.serve(settings.bind_address, settings.port + offset)
    endpoints = _gather(Endpoint(advertised_host(settings.bind_address, node_ip), port))
    if layout.world_rank == 0:
        write_targets(targets_path(settings.targets_dir, run.storage_path, targets_name(run.name, replica)), endpoints)
    return metrics


class PeakMemory(NamedTuple):
    device: str
    peak_device_memory_bytes: int | None = None
    num_alloc_retries: int | None = None
    peak_host_rss_bytes: int | None = None


def peak_memory(device: torch.device) -> PeakMemory:
    """The device and the largest peak over the ranks, read once after training (a collective): PyTorch's
    peak CUDA allocation on GPU workers (and the most times a rank's caching allocator freed its cache
    to retry an allocation), the process's peak resident set (all host memory) on CPU workers."""
    if device.type == "cuda":
        retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
        peaks = _gather((torch.cuda.max_memory_allocated(device), retries))
        return PeakMemory(device=torch.cuda.get_device_name(device), peak_device_memory_bytes=max(peak for peak, _ in peaks),
                          num_alloc_retries=max(count for _, count in peaks))
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return PeakMemory(device="cpu", peak_host_rss_bytes=max(_gather(peak_rss)))


def result_pointer(checkpoint: CheckpointConfig, run: RunConfig, paths: RunPaths) -> dict[str, Any]:
    """What the run's last Ray report points at: the run directory and the newest committed checkpoint."""
    storage, newest = newest_committed(checkpoint, run)
    return {
        "run_dir": str(paths.run_dir),
        "checkpoint": storage.display(newest.path) if newest is not None else None,
        "checkpoint_step": newest.step if newest is not None else None,
    }


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """The worker's run; whatever it raises is stamped with this rank and node, so the driver can
    name the rank that failed first and the failure policy can tell a permanent failure."""
    context = ray.train.get_context()
    try:
        _train_worker(loop_config)
    except BaseException as exc:
        plan: WorkerPlan = loop_config["plan"]
        if isinstance(exc, (NoPeerToHeal, EndedByPeers)) and training_ended(plan.checkpoint, plan.run, plan.train.steps):
            if context.get_world_rank() == 0:
                late = "this replacement started" if isinstance(exc, NoPeerToHeal) else "this group, ended by its peers, resumed"
                print(f"[meshtrain] replica group {loop_config['replica'].index}: training ended at step "
                      f"{plan.train.steps} before {late}; it has nothing to replace", flush=True)
            return
        stamp(exc, context.get_world_rank(), ray.util.get_node_ip_address())
        raise


def training_ended(checkpoint: CheckpointConfig, run: RunConfig, steps: int) -> bool:
    """Whether the run's last step is committed (a checkpoint is always saved after it): a replacement
    replica group that then finds no live peer came too late, not after every group was lost."""
    _, newest = newest_committed(checkpoint, run)
    return newest is not None and newest.step >= steps


def _train_worker(loop_config: dict[str, Any]) -> None:
    plan: WorkerPlan = loop_config["plan"]
    paths = plan.paths
    context = ray.train.get_context()
    layout = WorkerLayout(
        world_rank=context.get_world_rank(),
        world_size=context.get_world_size(),
        local_rank=context.get_local_rank(),
        local_world_size=context.get_local_world_size(),
        node_rank=context.get_node_rank(),
        node=ray.util.get_node_ip_address(),
    )
    device = ray.train.torch.get_device()
    check_torch()  # this node's torch: the driver checked only its own
    check_group_size(plan, layout.world_size, loop_config.get("replica"))
    if device.type == "cuda":
        set_matmul_precision(use_tf32(plan.train.tf32, plan.parallel.mixed_precision, device.type))
    replica: ReplicaPlacement | None = loop_config.get("replica")
    index = replica.index if replica is not None else None
    restarts, workers, resize = record_worker_start(paths, plan.launch_id, layout, plan.scaling, index)
    if replica is not None:
        replica = dataclasses.replace(replica, joining=restarts > 0)  # Ray restarted this group: it replaces one
    metrics = start_metrics(plan, layout, device, restarts, index) if plan.metrics.port else None
    sinks: list[Any] = []
    board = None
    if layout.world_rank == 0:
        recorder = StepRecorder(paths.metrics)
        # The driver relays metrics.jsonl to the trackers; this tells them which start of the group it is.
        recorder.record(GroupStartRecord(restarts=restarts, workers=layout.world_size, time=time.time()))
        sinks.append(recorder)
        if plan.metrics.tensorboard:
            board = TensorBoardWriter(paths.run_dir / "tensorboard")
            sinks.append(board)

    # The driver appends its downstream evaluations to metrics.jsonl; at each logged step rank 0 hands
    # those it has not seen to TensorBoard (the driver serves them to Prometheus and the trackers).
    downstream = (RecordFollower(paths.metrics, DRIVER_RECORDS)
                  if board is not None and (plan.eval.downstream.enabled or plan.eval.samples.prompts) else None)

    def on_record(record: MetricsRecord) -> None:
        for sink in sinks:
            sink.record(record)
        if downstream is not None and board is not None and isinstance(record, TrainRecord):
            for scored in downstream.new_records():
                board.record(scored)

    if resize is not None:
        on_record(resize)

    reporter = RayTrainReporter(plan.metrics.ray_report_interval_s, layout.world_rank, device)
    eviction = None
    if plan.scaling.evict_stragglers and replica is None and layout.world_rank == 0:  # replica mode ends slow groups
        eviction = StragglerEviction(workers, plan.scaling.required_workers, on_record)
    try:
        stop_request = StopRequest(str(paths.stop_request), plan.launch_id)
        result = train(plan, layout, device, on_record if sinks else None, metrics, reporter, eviction,
                       stop_request, replica=replica)
        if metrics is not None:
            metrics.await_final_scrape(plan.metrics.final_scrape_timeout_s)
    finally:
        for sink in sinks:
            sink.close()
        if metrics is not None:
            metrics.close()
    memory = peak_memory(device)
    if layout.world_rank == 0:
        write_result(paths, RunResult(
            run=paths.name,
            steps=plan.train.steps,
            final_loss=result.final_loss,
            eval_loss=result.eval_loss,
            eval_loss_by_source=result.eval_loss_by_source,
            skipped_steps=result.skipped_steps,
            stopped=result.stopped,
            interrupted=result.interrupted,
            mean_tokens_per_s=result.mean_tokens_per_s,
            tokens=result.tokens,
            train_time_s=result.train_time_s,
            mesh_shape=list(result.mesh_shape),
            world_size=result.world_size,
            parameters=result.parameters,
            run_dir=str(paths.run_dir),
            workers=workers,
            resizes=resizes(paths),
            device=memory.device,
            peak_device_memory_bytes=memory.peak_device_memory_bytes,
            num_alloc_retries=memory.num_alloc_retries,
            peak_host_rss_bytes=memory.peak_host_rss_bytes,
        ))
    reporter.final(
        {"step": result.records[-1].step if result.records else 0, "loss": result.final_loss,
         "eval_loss": result.eval_loss, "tokens": result.tokens, "mean_tokens_per_s": result.mean_tokens_per_s,
         "skipped_steps": result.skipped_steps, "stopped": result.stopped},
        result_pointer(plan.checkpoint, plan.run, paths) if layout.world_rank == 0 else {},
    )
