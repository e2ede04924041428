"""The per-rank training loop, independent of Ray (the Ray worker and the tests both call it)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from meshtrain.checkpoint import CheckpointManager, CheckpointStorage, CommittedCheckpoint, Progress, TrainState
from meshtrain.config import ConfigError, MeshtrainConfig
from meshtrain.data import DataParallelBatches, DataPlan, TrainingData, open_data
from meshtrain.evaluation import evaluate, validation_samples
from meshtrain.faults import maybe_kill_self, maybe_poison_outputs
from meshtrain.gc_schedule import ScheduledCollection
from meshtrain.guard import StepGuard
from meshtrain.init import init_weights
from meshtrain.metrics import TrainingMetrics
from meshtrain.mesh import MeshPlan, check_shard_placement, resolve_mesh_shape
from meshtrain.model import Transformer, build_model, count_parameters, materialize, token_cross_entropy_sum
from meshtrain.optim import build_lr_scheduler, build_optimizer
from meshtrain.parallel import build_mesh, clip_grad_norm_, parallelize
from meshtrain.reporting import RayTrainReporter
from meshtrain.watchdog import HangWatchdog


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
    eval_loss: float | None = None  # the last evaluation's
    skipped_steps: int = 0
    stopped: str | None = None  # why the run stopped before train.steps (the step guard)

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


def workers_per_node(layout: WorkerLayout, expected: int | None) -> tuple[int, list[int]]:
    """Workers per node, checked to be the same on every node (HSDP shard groups need that), and
    the node of every rank, in rank order (to check where the shard groups landed)."""
    placements = [(layout.local_world_size, layout.node_rank)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, placements[0])
        placements = gathered
    counts = [count for count, _ in placements]
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
    return counts[0], [node for _, node in placements]


def build_sharded_model(
    cfg: MeshtrainConfig,
    vocab_size: int,
    layout: WorkerLayout,
    device: torch.device,
    read_init_from: bool = True,
) -> tuple[Transformer, MeshPlan]:
    """Model built on meta, sharded (when distributed), materialized on ``device`` and initialized,
    or filled from ``model.init_from`` (each rank reading only its own shards). A run that resumes
    passes ``read_init_from=False``: its checkpoint replaces every weight, so reading them is waste."""
    model = build_model(cfg.model_args(vocab_size), "meta")
    plan = MeshPlan(1, 1, True)
    if dist.is_initialized():
        per_node, node_of_rank = workers_per_node(layout, cfg.scaling.workers_per_node)
        plan = resolve_mesh_shape(layout.world_size, per_node, cfg.parallel.strategy, cfg.parallel.shard)
        placement = check_shard_placement(plan, node_of_rank, cfg.parallel.shard)
        if placement is not None and layout.world_rank == 0:
            print(placement, flush=True)
        parallelize(model, build_mesh(plan, device.type), plan, cfg.parallel)
    # Offloaded shards live on the host (FSDP copies them over per unit); the RoPE buffers are read
    # inside the blocks, which FSDP does not move, so they stay on the compute device.
    offload = cfg.parallel.cpu_offload and dist.is_initialized()
    materialize(model, "cpu" if offload else device, buffer_device=device)
    if cfg.model.init_from is None or not read_init_from:
        init_weights(model, cfg.train.seed)
    else:
        from meshtrain.hf_weights import load_hf_weights

        load_hf_weights(model, cfg.model.init_from)
    return model, plan


def _sum_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


@dataclass
class StepOutput:
    """One optimizer step, still on the device: read only at logged steps."""

    loss_sum: torch.Tensor  # summed over every target token of the global batch (all ranks)
    grad_norm: torch.Tensor  # global, before clipping
    tokens: int  # target tokens of the global batch


def _deferrable_hsdp(model: Transformer, micro_batches: int, device: torch.device) -> FSDPModule | None:
    """The model when its replicate-dim gradient all-reduce can wait for the last micro-batch: an
    FSDP2 root on a 2D mesh (FSDP2 takes dim 0 as the replicate dim) with more than one replica.

    ``set_requires_all_reduce(False)`` keeps each micro-batch's reduce-scatter and sums its fp32
    output in one buffer per FSDP unit, the size of the sharded gradient that exists anyway, so
    memory stays as it was. (``set_requires_gradient_sync(False)`` would skip the reduce-scatter too,
    but keep every unit's unsharded gradient, shard-size times larger, for the whole step.)
    Not under CPU offload: the buffer stays on ``device``, where offload keeps no gradients.
    """
    if micro_batches < 2 or not isinstance(model, FSDPModule):
        return None
    param = next(model.parameters(), None)
    if not isinstance(param, DTensor) or param.device != device:
        return None
    mesh = param.device_mesh
    return model if mesh.ndim == 2 and mesh.size(0) > 1 else None


def _abandon_deferred_reduction(model: FSDPModule) -> None:
    """After a micro-batch raised: all-reduce again, and drop the partially accumulated gradient,
    which ``zero_grad`` cannot reach and the next step's all-reduce would otherwise include."""
    model.set_requires_all_reduce(True)
    model.reset_iter_state()


def train_step(
    model: Transformer,
    guard: StepGuard,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    dp_size: int,
    grad_clip: float,
    defer_all_reduce: bool = True,
) -> StepOutput:
    """One optimizer step over this rank's micro-batches, skipped by ``guard`` when it goes bad.

    The loss is the mean over every target token of the global batch. Each micro-batch contributes
    its token-summed loss scaled by ``dp_size / global_tokens``: FSDP averages gradients over the
    ``dp_size`` ranks, so the result is the gradient of the global mean. Packed windows have no
    ignored targets and every rank holds the same shapes, so the global token count follows from the
    shapes, with no collective or device sync. The loss sum is reduced over the ranks every step
    (one scalar all-reduce, no host sync), so every rank's guard sees the same global loss.

    With HSDP and ``defer_all_reduce``, gradients are all-reduced over the replicate dim once, in the
    last micro-batch's backward, instead of after every micro-batch (see ``_deferrable_hsdp``).
    """
    device = micro_batches[0][1].device
    global_tokens = sum(targets.numel() for _, targets in micro_batches) * dp_size
    scale = dp_size / global_tokens
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    hsdp = _deferrable_hsdp(model, len(micro_batches), device) if defer_all_reduce else None
    last = len(micro_batches) - 1
    try:
        for index, (inputs, targets) in enumerate(micro_batches):
            if hsdp is not None:
                hsdp.set_requires_all_reduce(index == last)
            summed = token_cross_entropy_sum(model(inputs), targets)
            (summed * scale).backward()
            loss_sum += summed.detach()
    except BaseException:
        if hsdp is not None:
            _abandon_deferred_reduction(hsdp)
        raise
    loss_sum = _sum_over_ranks(loss_sum)
    grad_norm = clip_grad_norm_(list(model.parameters()), grad_clip)
    guard.step(guard.check(loss_sum / global_tokens, grad_norm))
    guard.optimizer.zero_grad(set_to_none=True)
    return StepOutput(loss_sum, grad_norm, global_tokens)


def checkpoint_root(cfg: MeshtrainConfig) -> str:
    """Where this run's checkpoints live (``checkpoint.path/<run.name>`` or ``<run dir>/checkpoints``)."""
    if cfg.run.name is None:
        raise ValueError("run.name must be resolved before training (the launcher does this)")
    if cfg.checkpoint.path:
        return f"{cfg.checkpoint.path.rstrip('/')}/{cfg.run.name}"
    return str(Path(cfg.run.storage_path) / cfg.run.name / "checkpoints")


def newest_committed(cfg: MeshtrainConfig) -> tuple[CheckpointStorage, CommittedCheckpoint | None]:
    """This run's checkpoint storage and its newest committed checkpoint (None: none, or disabled)."""
    storage = CheckpointStorage(checkpoint_root(cfg), cfg.checkpoint.storage_options)
    committed = storage.committed() if cfg.checkpoint.enabled else []
    return storage, committed[0] if committed else None


def train(
    cfg: MeshtrainConfig,
    data: DataPlan | TrainingData,
    layout: WorkerLayout,
    device: torch.device,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    metrics: TrainingMetrics | None = None,
    reporter: RayTrainReporter | None = None,
) -> TrainResult:
    """Train until ``cfg.train.steps``, resuming from the newest committed checkpoint if any.

    ``on_record`` receives every logged step, evaluation and checkpoint event (rank 0 emits the save
    events); ``metrics`` (when given) is updated every step; ``reporter`` (every rank, or none) hands
    logged steps to Ray Train.
    """
    if isinstance(data, DataPlan):
        data = open_data(data, cfg.data.seq_len, cfg.train.seed)
    trainer = Trainer(cfg, data, layout, device, on_record, metrics, reporter)
    try:
        return trainer.run()
    finally:
        trainer.close()


class Trainer:
    """One rank's run: setup, then per step the named parts of the loop (see ``run``)."""

    def __init__(
        self,
        cfg: MeshtrainConfig,
        data: TrainingData,
        layout: WorkerLayout,
        device: torch.device,
        on_record: Callable[[dict[str, Any]], None] | None,
        metrics: TrainingMetrics | None,
        reporter: RayTrainReporter | None = None,
    ) -> None:
        self.cfg, self.data, self.layout, self.device = cfg, data, layout, device
        self.on_record, self.metrics, self.reporter = on_record, metrics, reporter
        torch.manual_seed(cfg.train.seed)
        self.checkpoints = self._checkpoint_manager()
        resuming = self.checkpoints is not None and cfg.checkpoint.resume and self.checkpoints.any_committed()
        self.model, plan = build_sharded_model(cfg, data.vocab_size, layout, device, read_init_from=not resuming)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        horizon = cfg.optim.schedule_steps or cfg.train.steps
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.optim, horizon)
        self.guard = StepGuard(self.optimizer, device, cfg.train.loss_spike_factor, cfg.train.loss_spike_window)
        self.progress = Progress()
        self.state = TrainState(self.model, self.optimizer, self.scheduler, self.progress, layout.world_rank)
        if resuming:
            assert self.checkpoints is not None
            self.checkpoints.restore(self.state)
        self.guard.skipped_before = self.progress.skipped_steps
        self.micro_batch, _ = cfg.batch_layout(layout.world_size)
        self.batches = DataParallelBatches(
            data.train,
            cfg.train.global_batch_size,
            self.micro_batch,
            dp_rank=layout.world_rank,
            dp_size=layout.world_size,
            device=device,
            position=self.progress.data_position,
        )
        self.validation_samples = 0
        if cfg.eval.interval is not None and data.validation is not None:
            self.validation_samples = validation_samples(
                len(data.validation), cfg.eval.batches, cfg.train.global_batch_size
            )
        self.result = TrainResult(
            mesh_shape=plan.shape, world_size=layout.world_size, parameters=count_parameters(self.model)
        )
        self.manifest = {
            "world_size": layout.world_size,
            "mesh_shape": list(plan.shape),
            "model_args": cfg.model_args(data.vocab_size).model_dump(),
            "data_fingerprint": data.fingerprint,
            "config": cfg.model_dump(mode="json"),
        }
        self.run_dir = Path(cfg.run.storage_path) / (cfg.run.name or "")
        # Last, so a setup that fails leaves neither a thread nor the collector switched off.
        self.watchdog = HangWatchdog(cfg.run.hang_timeout_s, layout.world_rank) if cfg.run.hang_timeout_s else None
        self.collection = ScheduledCollection(cfg.train.gc_every)

    def _checkpoint_manager(self) -> CheckpointManager | None:
        if not self.cfg.checkpoint.enabled:
            return None
        return CheckpointManager(
            CheckpointStorage(checkpoint_root(self.cfg), self.cfg.checkpoint.storage_options),
            rank=self.layout.world_rank,
            world_size=self.layout.world_size,
            interval=self.cfg.checkpoint.interval,
            keep=self.cfg.checkpoint.keep,
            asynchronous=self.cfg.checkpoint.mode == "async",
            on_event=self._checkpoint_event,
        )

    def run(self) -> TrainResult:
        cfg, layout, progress = self.cfg, self.layout, self.progress
        if self.metrics is not None:
            self.metrics.set_mesh(layout.world_size, self.result.mesh_shape)
            self.metrics.start_steps(progress.step, progress.tokens, progress.skipped_steps)
        self.model.train()
        self.started = interval_start = time.perf_counter()
        interval_steps, interval_wait = 0, 0.0
        first_step = progress.step + 1
        for step in range(first_step, cfg.train.steps + 1):
            self._beat(f"training step {step}", arm=step > first_step)
            maybe_kill_self(cfg.fault, layout.world_rank, step, False, self.run_dir / "faults")
            maybe_poison_outputs(cfg.fault, layout.world_rank, step, self.model)
            self.collection.step(step)
            lr = self.scheduler.get_last_lr()[0]
            waiting_since = time.perf_counter()
            micro_batches = list(self.batches.next_step())
            data_wait = time.perf_counter() - waiting_since
            interval_wait += data_wait
            output = train_step(self.model, self.guard, micro_batches, layout.world_size, cfg.optim.grad_clip)
            self.scheduler.step()
            progress.step, progress.tokens = step, progress.tokens + output.tokens
            progress.data_position = self.batches.position
            last = step == cfg.train.steps
            if self.checkpoints is not None:
                self.checkpoints.poll()
                if self.checkpoints.due(step, cfg.train.steps) and not self._maybe_checkpoint(step, last):
                    break
            if self.metrics is not None:
                self.metrics.step_done(step, output.tokens // layout.world_size, data_wait)
            if self.validation_samples and cfg.eval.interval and (step % cfg.eval.interval == 0 or last):
                self._evaluate(step)
            interval_steps += 1
            if step % cfg.train.log_every and not last:
                continue
            now = time.perf_counter()
            step_time, wait = (now - interval_start) / interval_steps, interval_wait / interval_steps
            if not self._log(step, lr, output, step_time, now, last, wait):
                break
            interval_start, interval_steps, interval_wait = now, 0, 0.0
        if self.checkpoints is not None:
            self.checkpoints.close()
        self.result.tokens = progress.tokens
        self.result.skipped_steps = self.guard.read().skipped_total
        self.result.train_time_s = time.perf_counter() - self.started
        return self.result

    def _read_guard(self, step: int) -> int | None:
        """Reads the guard (a device sync) and records it: the skipped steps in a row up to now, or
        None when there are ``train.max_bad_steps`` of them and the run must stop."""
        reading = self.guard.read()
        self.progress.skipped_steps = reading.skipped_total
        if self.metrics is not None:
            self.metrics.skipped(reading.skipped_total)
        if reading.bad_in_a_row < self.cfg.train.max_bad_steps:
            return reading.bad_in_a_row
        self.result.stopped = (
            f"train.max_bad_steps={self.cfg.train.max_bad_steps}: {reading.bad_in_a_row} steps in a row up to step "
            f"{step} were skipped (non-finite or spiking loss or gradient norm)"
        )
        self._emit({"event": "stopped", "step": step, "reason": self.result.stopped})
        return None

    def _maybe_checkpoint(self, step: int, last: bool) -> bool:
        """Save, unless the newest step was skipped: then the last good checkpoint stays the newest.
        False when the run must stop."""
        assert self.checkpoints is not None
        bad_in_a_row = self._read_guard(step)
        if bad_in_a_row is None:
            return False
        if bad_in_a_row:
            self._emit({"event": "checkpoint_skipped", "step": step, "reason": "the step was skipped by the guard"})
            return True
        saving_since = time.perf_counter()
        self._beat(f"saving the checkpoint of step {step}")
        self.checkpoints.save(self.state, {**self.manifest, **vars(self.progress)}, wait=last)
        self._beat(f"training after the checkpoint of step {step}")
        if self.metrics is not None:
            self.metrics.checkpoint_blocked(time.perf_counter() - saving_since)
        maybe_kill_self(self.cfg.fault, self.layout.world_rank, step, True, self.run_dir / "faults")
        return True

    def _evaluate(self, step: int) -> None:
        assert self.data.validation is not None
        self._beat(f"evaluating at step {step}")
        started = time.perf_counter()
        self.model.eval()
        loss = evaluate(
            self.model, self.data.validation, self.validation_samples, self.micro_batch,
            self.layout.world_rank, self.layout.world_size, self.device,
        )
        self.model.train()
        self.result.eval_loss = loss
        record = {
            "event": "eval", "step": step, "loss": loss, "perplexity": math.exp(min(loss, 700.0)),
            "samples": self.validation_samples, "seconds": time.perf_counter() - started,
        }
        if self.metrics is not None:
            self.metrics.evaluated(record)
        if self.reporter is not None:
            self.reporter.evaluated(record)
        self._emit(record)
        self._beat(f"training after the evaluation at step {step}")

    def _log(
        self, step: int, lr: float, output: StepOutput, step_time: float, now: float, last: bool, data_wait: float
    ) -> bool:
        """Record a logged step; False when the guard says the run must stop."""
        allowed = self._read_guard(step) is not None
        record = {
            "event": "train",
            "step": step,
            "loss": output.loss_sum.item() / output.tokens,
            "lr": lr,
            "grad_norm": output.grad_norm.item(),
            "tokens": self.progress.tokens,
            "tokens_per_s": output.tokens / step_time,
            "step_time_s": step_time,
            "data_wait_s": data_wait,  # mean per step of the interval, this rank waiting for its batch
            "elapsed_s": now - self.started,
            "skipped_steps": self.progress.skipped_steps,
            "world_size": self.layout.world_size,
            "time": time.time(),
            # The global samples the step read: the same on any number of ranks.
            "samples": [self.progress.data_position - self.cfg.train.global_batch_size, self.progress.data_position],
        }
        self.result.records.append(record)
        if self.metrics is not None:
            self.metrics.logged(record, self.layout.world_size)
        if self.reporter is not None:
            self.reporter.logged(record, last or not allowed)
        self._emit(record)
        return allowed

    def _checkpoint_event(self, event: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.checkpoint_event(event)
        self._emit(event)

    def _emit(self, record: dict[str, Any]) -> None:
        if self.on_record is not None:
            self.on_record(record)

    def _beat(self, doing: str, arm: bool = False) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(doing, arm)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        self.collection.close()
