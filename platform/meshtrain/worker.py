"""What each Ray Train worker runs: read its place in the group, train, write the run outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray
import ray.train
import ray.train.torch

from meshtrain.config import MeshtrainConfig
from meshtrain.outputs import RunPaths, write_summary
from meshtrain.progress import StepRecorder
from meshtrain.training import WorkerLayout, train


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    cfg: MeshtrainConfig = loop_config["config"]
    corpus = ray.get(loop_config["corpus"])
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
    recorder = StepRecorder(paths.metrics, cfg.train.steps) if layout.world_rank == 0 else None
    try:
        result = train(
            cfg, corpus, layout, ray.train.torch.get_device(), recorder.record if recorder else None
        )
    finally:
        if recorder is not None:
            recorder.close()
    if layout.world_rank == 0:
        write_summary(
            paths,
            {
                "run": paths.name,
                "steps": cfg.train.steps,
                "final_loss": result.final_loss,
                "mean_tokens_per_s": result.mean_tokens_per_s,
                "tokens": result.tokens,
                "train_time_s": result.train_time_s,
                "mesh_shape": list(result.mesh_shape),
                "world_size": result.world_size,
                "parameters": result.parameters,
                "run_dir": str(paths.run_dir),
            },
        )
