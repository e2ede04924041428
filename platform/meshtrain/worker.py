"""What each Ray Train worker runs: read its place in the group, train, write the run outputs."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from meshtrain.config import MeshtrainConfig
from meshtrain.flops import device_peak_flops, flops_per_token
from meshtrain.metrics import Endpoint, TrainingMetrics, advertised_host, targets_path, write_targets
from meshtrain.outputs import RunPaths, write_summary
from meshtrain.parallel import param_dtype
from meshtrain.progress import StepRecorder
from meshtrain.reporting import RayTrainReporter, TensorBoardWriter
from meshtrain.training import WorkerLayout, train


def _gather(value: Any) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def record_worker_start(paths: RunPaths, launch_id: str, layout: WorkerLayout) -> tuple[int, list[dict[str, Any]]]:
    """Log this worker group's start, with where every rank runs, in the run directory.

    Returns the restarts of this launch (earlier starts with the same launch id) and the placements.
    """
    placement = {
        "rank": layout.world_rank,
        "node_rank": layout.node_rank,
        "local_rank": layout.local_rank,
        "node_ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
    }
    workers = _gather(placement)
    starts = paths.run_dir / "worker_starts.jsonl"
    restarts = 0
    if layout.world_rank == 0:
        with starts.open("a", encoding="utf-8") as file:
            file.write(json.dumps({"launch": launch_id, "time": time.time(), "workers": workers}) + "\n")
        launches = [json.loads(line)["launch"] for line in starts.read_text().splitlines() if line.strip()]
        restarts = launches.count(launch_id) - 1
    return _gather(restarts)[0], workers


def start_metrics(
    cfg: MeshtrainConfig, layout: WorkerLayout, device: torch.device, vocab_size: int, restarts: int
) -> TrainingMetrics:
    """Serve this worker's /metrics and (rank 0) publish every worker's endpoint for Prometheus."""
    assert cfg.run.name is not None
    node_ip = ray.util.get_node_ip_address()
    peak = device_peak_flops(
        device,
        param_dtype(cfg.parallel.mixed_precision, device.type),
        cfg.metrics.peak_flops_per_s,
        cfg.metrics.cpu_peak_flops_per_s,
    )
    if peak is None and layout.world_rank == 0:
        print(
            f"[meshtrain] no peak FLOP/s known for {torch.cuda.get_device_name(device)}; "
            "set metrics.peak_flops_per_s to get meshtrain_mfu_ratio"
        )
    metrics = TrainingMetrics(
        run=cfg.run.name,
        rank=layout.world_rank,
        node=node_ip,
        device=device,
        flops_per_token=flops_per_token(cfg.model_args(vocab_size), cfg.data.seq_len),
        peak_flops_per_s=peak,
    )
    metrics.restarts.set(restarts)
    port = metrics.serve(cfg.metrics.bind_address, cfg.metrics.port + layout.local_rank)
    endpoints = _gather(Endpoint(advertised_host(cfg.metrics.bind_address, node_ip), port))
    if layout.world_rank == 0:
        write_targets(targets_path(cfg.metrics.targets_dir, cfg.run.storage_path, cfg.run.name), endpoints)
    return metrics


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    cfg: MeshtrainConfig = loop_config["config"]
    data = loop_config["data"]
    context = ray.train.get_context()
    layout = WorkerLayout(
        world_rank=context.get_world_rank(),
        world_size=context.get_world_size(),
        local_rank=context.get_local_rank(),
        local_world_size=context.get_local_world_size(),
        node_rank=context.get_node_rank(),
    )
    assert cfg.run.name is not None, "the launcher resolves run.name before starting workers"
    paths = RunPaths(cfg.run.name, Path(cfg.run.storage_path))
    device = ray.train.torch.get_device()
    restarts, workers = record_worker_start(paths, loop_config["launch_id"], layout)
    metrics = start_metrics(cfg, layout, device, data.vocab_size, restarts) if cfg.metrics.port else None
    sinks: list[Any] = []
    if layout.world_rank == 0:
        sinks.append(StepRecorder(paths.metrics))
        if cfg.metrics.tensorboard:
            sinks.append(TensorBoardWriter(paths.run_dir / "tensorboard"))

    def on_record(record: dict[str, Any]) -> None:
        for sink in sinks:
            sink.record(record)

    reporter = RayTrainReporter(cfg.metrics.ray_report_interval_s, layout.world_rank, device)
    try:
        result = train(cfg, data, layout, device, on_record if sinks else None, metrics, reporter)
        if metrics is not None:
            metrics.await_final_scrape(cfg.metrics.final_scrape_timeout_s)
    finally:
        for sink in sinks:
            sink.close()
        if metrics is not None:
            metrics.close()
    if layout.world_rank == 0:
        write_summary(
            paths,
            {
                "run": paths.name,
                "steps": cfg.train.steps,
                "final_loss": result.final_loss,
                "eval_loss": result.eval_loss,
                "skipped_steps": result.skipped_steps,
                "stopped": result.stopped,
                "mean_tokens_per_s": result.mean_tokens_per_s,
                "tokens": result.tokens,
                "train_time_s": result.train_time_s,
                "mesh_shape": list(result.mesh_shape),
                "world_size": result.world_size,
                "parameters": result.parameters,
                "run_dir": str(paths.run_dir),
                "workers": workers,
            },
        )
