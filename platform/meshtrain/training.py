"""The per-rank training loop, independent of Ray (the Ray worker and the tests both call it)."""

from __future__ import annotations

import time
from pathlib import Path
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.checkpoint import CheckpointManager, CheckpointStorage, Progress, TrainState
from meshtrain.config import ConfigError, MeshtrainConfig
from meshtrain.data import DataParallelBatches, DataPlan, TrainingData, open_data
from meshtrain.faults import maybe_kill_self
from meshtrain.init import init_weights
from meshtrain.metrics import TrainingMetrics
from meshtrain.mesh import MeshPlan, resolve_mesh_shape
from meshtrain.model import Transformer, build_model, count_parameters, materialize, token_cross_entropy_sum
from meshtrain.optim import build_lr_scheduler, build_optimizer
from meshtrain.parallel import build_mesh, clip_grad_norm_, parallelize


@dataclass(frozen=True)
class WorkerLayout:
    """Where this process sits in the worker group (from Ray's train context or from a test)."""

    world_rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0


@dataclass
class TrainResult:
    records: list[dict[str, Any]] = field(default_factory=list)
    mesh_shape: tuple[int, int] = (1, 1)
    world_size: int = 1
    parameters: int = 0
    train_time_s: float = 0.0
    tokens: int = 0

    @property
    def final_loss(self) -> float | None:
        return self.records[-1]["loss"] if self.records else None

    @property
    def mean_tokens_per_s(self) -> float | None:
        """Throughput after the first logged interval (which pays for warm-up and compilation)."""
        if not self.records:
            return None
        first, last = self.records[0], self.records[-1]
        if len(self.records) == 1:
            return last["tokens"] / last["elapsed_s"]
        return (last["tokens"] - first["tokens"]) / (last["elapsed_s"] - first["elapsed_s"])


def workers_per_node(layout: WorkerLayout, expected: int | None) -> int:
    """Workers per node, checked to be the same on every node (HSDP shard groups need that)."""
    counts = [layout.local_world_size]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, layout.local_world_size)
        counts = gathered
    if len(set(counts)) != 1:
        raise ConfigError(
            f"parallel.shard=auto: nodes hold different numbers of workers ({sorted(set(counts))}); "
            "set parallel.shard explicitly or size scaling.num_workers to fill whole nodes"
        )
    if expected is not None and expected != counts[0]:
        raise ConfigError(
            f"scaling.workers_per_node={expected}, but Ray placed {counts[0]} workers per node; "
            "fix scaling.workers_per_node or leave it unset"
        )
    return counts[0]


def build_sharded_model(
    cfg: MeshtrainConfig, vocab_size: int, layout: WorkerLayout, device: torch.device
) -> tuple[Transformer, MeshPlan]:
    """Model built on meta, sharded (when distributed), materialized on ``device`` and initialized."""
    model = build_model(cfg.model_args(vocab_size), "meta")
    plan = MeshPlan(1, 1, True)
    if dist.is_initialized():
        plan = resolve_mesh_shape(
            layout.world_size,
            workers_per_node(layout, cfg.scaling.workers_per_node),
            cfg.parallel.strategy,
            cfg.parallel.shard,
        )
        parallelize(model, build_mesh(plan, device.type), plan, cfg.parallel)
    materialize(model, "cpu" if cfg.parallel.cpu_offload else device)
    init_weights(model, cfg.train.seed)
    return model, plan


def _sum_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def train_step(
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    dp_size: int,
    grad_clip: float,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One optimizer step over this rank's micro-batches.

    The loss is the mean over every target token of the global batch. Each micro-batch contributes
    its token-summed loss scaled by ``dp_size / global_tokens``: FSDP averages gradients over the
    ``dp_size`` ranks, so the result is the gradient of the global mean. Packed windows have no
    ignored targets and every rank holds the same shapes, so the global token count follows from the
    shapes, with no collective or device sync. Returns this rank's summed (unscaled) loss, the
    pre-clip gradient norm and the global number of target tokens.
    """
    device = micro_batches[0][1].device
    global_tokens = sum(targets.numel() for _, targets in micro_batches) * dp_size
    scale = dp_size / global_tokens
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    for inputs, targets in micro_batches:
        summed = token_cross_entropy_sum(model(inputs), targets)
        (summed * scale).backward()
        loss_sum += summed.detach()
    grad_norm = clip_grad_norm_(list(model.parameters()), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm, global_tokens


def checkpoint_root(cfg: MeshtrainConfig) -> str:
    """Where this run's checkpoints live (``checkpoint.path/<run.name>`` or ``<run dir>/checkpoints``)."""
    if cfg.run.name is None:
        raise ValueError("run.name must be resolved before training (the launcher does this)")
    if cfg.checkpoint.path:
        return f"{cfg.checkpoint.path.rstrip('/')}/{cfg.run.name}"
    return str(Path(cfg.run.storage_path) / cfg.run.name / "checkpoints")


def train(
    cfg: MeshtrainConfig,
    data: DataPlan | TrainingData,
    layout: WorkerLayout,
    device: torch.device,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    metrics: TrainingMetrics | None = None,
) -> TrainResult:
    """Train until ``cfg.train.steps``, resuming from the newest committed checkpoint if any.

    ``on_record`` receives every logged step and checkpoint event (rank 0 emits the save events);
    ``metrics`` (when given) is updated every step.
    """

    def on_checkpoint_event(event: dict[str, Any]) -> None:
        if metrics is not None:
            metrics.checkpoint_event(event)
        if on_record is not None:
            on_record(event)

    if isinstance(data, DataPlan):
        data = open_data(data, cfg.data.seq_len, cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    model, plan = build_sharded_model(cfg, data.vocab_size, layout, device)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_lr_scheduler(optimizer, cfg.optim, cfg.train.steps)
    progress = Progress()
    state = TrainState(model, optimizer, scheduler, progress, layout.world_rank)
    checkpoints = None
    if cfg.checkpoint.enabled:
        checkpoints = CheckpointManager(
            CheckpointStorage(checkpoint_root(cfg), cfg.checkpoint.storage_options),
            rank=layout.world_rank,
            world_size=layout.world_size,
            interval=cfg.checkpoint.interval,
            keep=cfg.checkpoint.keep,
            asynchronous=cfg.checkpoint.mode == "async",
            on_event=on_checkpoint_event,
        )
        if cfg.checkpoint.resume:
            checkpoints.restore(state)
    micro_batch, _ = cfg.batch_layout(layout.world_size)
    batches = DataParallelBatches(
        data.train,
        cfg.train.global_batch_size,
        micro_batch,
        dp_rank=layout.world_rank,
        dp_size=layout.world_size,
        device=device,
        position=progress.data_position,
    )
    result = TrainResult(
        mesh_shape=plan.shape, world_size=layout.world_size, parameters=count_parameters(model)
    )
    manifest = {
        "world_size": layout.world_size,
        "mesh_shape": list(plan.shape),
        "model_args": cfg.model_args(data.vocab_size).model_dump(),
        "data_fingerprint": data.fingerprint,
        "config": cfg.model_dump(mode="json"),
    }
    run_dir = Path(cfg.run.storage_path) / (cfg.run.name or "")
    if metrics is not None:
        metrics.set_mesh(layout.world_size, plan.shape)
        metrics.start_steps(progress.step, progress.tokens)
    model.train()
    start = interval_start = time.perf_counter()
    interval_steps = 0
    for step in range(progress.step + 1, cfg.train.steps + 1):
        maybe_kill_self(cfg.fault, layout.world_rank, step, False, run_dir / "faults")
        lr = scheduler.get_last_lr()[0]
        waiting_since = time.perf_counter()
        micro_batches = list(batches.next_step())
        data_wait = time.perf_counter() - waiting_since
        loss_sum, grad_norm, step_tokens = train_step(
            model, optimizer, micro_batches, layout.world_size, cfg.optim.grad_clip
        )
        scheduler.step()
        progress.step, progress.tokens, progress.data_position = step, progress.tokens + step_tokens, batches.position
        if checkpoints is not None:
            checkpoints.poll()
            if checkpoints.due(step, cfg.train.steps):
                saving_since = time.perf_counter()
                checkpoints.save(state, {**manifest, **vars(progress)}, wait=step == cfg.train.steps)
                if metrics is not None:
                    metrics.checkpoint_blocked(time.perf_counter() - saving_since)
                maybe_kill_self(cfg.fault, layout.world_rank, step, True, run_dir / "faults")
        if metrics is not None:
            metrics.step_done(step, step_tokens // layout.world_size, data_wait)
        interval_steps += 1
        if step % cfg.train.log_every and step != cfg.train.steps:
            continue
        loss = _sum_over_ranks(loss_sum).item() / step_tokens
        now = time.perf_counter()
        step_time = (now - interval_start) / interval_steps
        record = {
            "event": "train",
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm.item(),
            "tokens": progress.tokens,
            "tokens_per_s": step_tokens / step_time,
            "step_time_s": step_time,
            "elapsed_s": now - start,
        }
        result.records.append(record)
        if metrics is not None:
            metrics.logged(record, layout.world_size)
        if on_record is not None:
            on_record(record)
        interval_start, interval_steps = now, 0
    if checkpoints is not None:
        checkpoints.close()
    result.tokens = progress.tokens
    result.train_time_s = time.perf_counter() - start
    return result
