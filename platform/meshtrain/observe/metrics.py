"""Prometheus metrics of one training worker and of the driver's downstream evaluations, the
endpoints that serve them, and the file_sd targets files through which Prometheus finds them.

Every worker series carries the labels ``run``, ``replica`` (its replica group: the group's index in
fault_tolerance.mode=replica, "0" for restart mode's one group), ``rank`` (world rank within that group)
and ``node`` (the node's IP); the driver's series carry ``run`` and no replica (it serves the whole run).
Names follow Prometheus conventions: base units in the name, ``_total`` on counters.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import socketserver
import threading
import time
from pathlib import Path
from typing import Any, cast
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import psutil
import torch
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    make_wsgi_app,
)

from meshtrain.config import OVERALL_LABEL, PermanentError, replica_group_name
from meshtrain.config.network import Endpoint
from meshtrain.observe.goodput import GoodputReport
from meshtrain.observe.run_folder import (
    CheckpointLoadRecord,
    CheckpointSaveRecord,
    DownstreamEvalRecord,
    EvalRecord,
    MixtureRecord,
    RollbackRecord,
    TrainRecord,
)

# Counters and histograms would otherwise add a *_created series each; nothing here reads them.
disable_created_metrics()

LABELS = ("run", "replica", "rank", "node")
# The subfolder of the targets folder holding the drivers' targets files.
DRIVER_TARGETS_DIR = "driver"

# Step times run from milliseconds (small models) to a minute (70B with deep accumulation).
STEP_DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1, 1.5, 2.5, 4, 6, 10, 15, 25, 40, 60, 120)


class StepClock:
    """Durations of consecutive optimizer steps without a device sync per step.

    On CUDA each step end records an event on the current stream; the events are read when the
    durations are drained, at logging steps that synchronize anyway. On CPU, host time is step time.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list[Any] = []
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def drain(self) -> list[float]:
        """Seconds taken by each step marked since the last drain."""
        marks, self._marks = self._marks, self._marks[-1:]
        if self.cuda:
            marks[-1].synchronize()
            return [start.elapsed_time(end) / 1000 for start, end in zip(marks, marks[1:])]
        return [end - start for start, end in zip(marks, marks[1:])]


class _Exporter:
    """A registry served on /metrics, which can wait for one more scrape before it closes."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._scrapes = _ScrapeCounter()
        self._server: _MetricsServer | None = None

    def serve(self, address: str, port: int) -> int:
        """Serve /metrics on ``address:port`` (an ephemeral port if that one is taken); returns the port."""
        app = make_wsgi_app(self.registry)
        try:
            if port > MAX_PORT:
                raise OSError(errno.EINVAL, f"port {port} is beyond {MAX_PORT}")
            self._server = _MetricsServer.start(address, port, app, self._scrapes)
        except OSError as exc:
            if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) or isinstance(exc, socket.gaierror):
                raise PermanentError(
                    f"metrics.bind_address={address} is not an address of node {socket.gethostname()} ({exc.strerror}); "
                    "use 0.0.0.0 (every interface) or an address every node has (127.0.0.1)"
                ) from None
            if port == 0:
                raise
            print(f"[meshtrain] metrics port {port} on {address} is unavailable ({exc.strerror}); using a free port")
            self._server = _MetricsServer.start(address, 0, app, self._scrapes)
        return self._server.server_port

    def await_final_scrape(self, timeout_s: float) -> bool:
        """Wait until a scrape that began after now has been answered, so Prometheus holds the final
        values; only when something scraped this endpoint lately (nobody waits for no Prometheus)."""
        recently = time.monotonic() - self._scrapes.last_served_at < 2 * timeout_s
        if self._server is None or not recently or timeout_s <= 0:
            return False
        return self._scrapes.wait_beyond(self._scrapes.started, timeout_s)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class DriverMetrics(_Exporter):
    """What the job's driver knows and no worker does: the run's goodput, from every worker group's
    records since the launch, and the downstream evaluation results (those that land after the workers
    have stopped too: the last checkpoint's, always)."""

    def __init__(self, run: str) -> None:
        super().__init__()
        self._run = run
        self.goodput_ratio = Gauge(
            "meshtrain_goodput_ratio",
            "Productive step time over wall time since the job's launch (restarts, redone steps, replica waits, "
            "checkpoint stalls, evaluation and data waits are not productive), exported by the job's driver.",
            ("run",), registry=self.registry,
        ).labels(run=run)
        self.lost_seconds = Gauge(
            "meshtrain_lost_seconds",
            "Wall time since the job's launch not spent on productive steps, by cause (start_up, restarts, "
            "redone, rollbacks, data_wait, replica_waits, replica_hung, replica_frozen, replica_lost, replica_slow, "
            "evaluation, checkpoints, finishing, other).",
            ("run", "cause"), registry=self.registry,
        )
        self.score = Gauge(
            "meshtrain_downstream_score",
            "The newest downstream evaluation's result per lm-evaluation-harness task and metric (acc, acc_norm, "
            "bits_per_byte, ...), exported by the job's driver.",
            ("run", "task", "metric"),
            registry=self.registry,
        )
        self.step = Gauge(
            "meshtrain_downstream_step", "Checkpoint step of the newest downstream evaluation per task.", ("run", "task"),
            registry=self.registry,
        )

    def goodput(self, report: GoodputReport) -> None:
        self.goodput_ratio.set(report["goodput"])
        for cause, seconds in report["lost_s"].items():
            self.lost_seconds.labels(run=self._run, cause=cause).set(seconds)

    def scored(self, record: DownstreamEvalRecord) -> None:
        """A ``downstream_eval`` record, the newest of its task."""
        task = record.task
        for metric, value in record.scores.items():
            self.score.labels(run=self._run, task=task, metric=metric).set(value)
        self.step.labels(run=self._run, task=task).set(record.step)


class TrainingMetrics(_Exporter):
    """The metrics one worker exposes; the training loop updates them, a scrape reads them."""

    def __init__(
        self,
        *,
        run: str,
        rank: int,
        node: str,
        device: torch.device,
        flops_per_token: float,
        peak_flops_per_s: float | None,
        replica: int | None = None,
    ) -> None:
        """``rank``: the world rank in the worker's group; ``replica``: the group's index in replica mode,
        None in restart mode (its one group, labelled "0")."""
        super().__init__()
        self.device, self.peak_flops_per_s = device, peak_flops_per_s
        self.flops_per_token = flops_per_token
        values = {"run": run, "replica": str(replica or 0), "rank": str(rank), "node": node}
        self._label_values = values

        def gauge(name: str, documentation: str) -> Any:
            return _LazyGauge(Gauge(name, documentation, LABELS, registry=self.registry), values)

        def counter(name: str, documentation: str) -> Any:
            return Counter(name, documentation, LABELS, registry=self.registry).labels(**values)

        self.step = gauge("meshtrain_step", "Last completed optimizer step.")
        self.loss = gauge("meshtrain_loss", "Mean next-token cross entropy (nats) over the global batch, last logged step.")
        self.learning_rate = gauge("meshtrain_learning_rate", "Learning rate of the last logged step.")
        self.grad_norm = gauge("meshtrain_grad_norm", "Global gradient L2 norm before clipping, last logged step.")
        self.tokens = counter("meshtrain_tokens", "Tokens this worker has trained on since it started.")
        self.run_tokens = gauge("meshtrain_run_tokens", "Tokens the whole run has trained on (all workers, kept across restarts).")
        self.tokens_per_second = gauge("meshtrain_tokens_per_second", "This worker's tokens per second over the last logging interval.")
        self.mfu = gauge(
            "meshtrain_mfu_ratio",
            "Model FLOPs utilization of this worker's device over the last logging interval (0-1), from the FLOPs "
            "actually computed: attention over the (query, key) pairs its mask allows, counted exactly (causal, and "
            "within each document under model.document_mask).",
        )
        self.mfu_full_attention = gauge(
            "meshtrain_mfu_full_attention_ratio",
            "Model FLOPs utilization over the last logging interval (0-1) with attention counted over the whole window "
            "(every query against every key: the PaLM / torchtitan convention, meshtrain_model_flops_per_token).",
        )
        gauge(
            "meshtrain_model_flops_per_token",
            "Training FLOPs per token (forward and backward) with attention counted over the whole window, as "
            "meshtrain_mfu_full_attention_ratio counts them.",
        ).set(flops_per_token)
        if peak_flops_per_s is not None:
            gauge("meshtrain_device_peak_flops_per_second", "Peak FLOP/s of one device that MFU divides by.").set(peak_flops_per_s)
        self.step_duration = Histogram(
            "meshtrain_step_duration_seconds",
            "Wall time of each optimizer step (forward, backward, optimizer, checkpoint staging).",
            LABELS,
            registry=self.registry,
            buckets=STEP_DURATION_BUCKETS,
        ).labels(**values)
        self.data_wait = counter("meshtrain_data_wait_seconds", "Time spent waiting for input batches.")
        rss = gauge("meshtrain_process_resident_memory_bytes", "Resident memory of the worker process.")
        process = psutil.Process()
        rss.set_function(lambda: process.memory_info().rss)
        if device.type == "cuda":
            for name, read in (
                ("allocated", torch.cuda.memory_allocated),
                ("reserved", torch.cuda.memory_reserved),
                ("peak_allocated", torch.cuda.max_memory_allocated),
            ):
                # The server thread reads these: pass the device, its current device is not ours.
                gauge(f"meshtrain_cuda_memory_{name}_bytes", f"CUDA memory {name.replace('_', ' ')} by PyTorch.").set_function(
                    lambda read=read: read(device)
                )
            gauge(
                "meshtrain_cuda_alloc_retries",
                "Times the CUDA caching allocator freed its cached blocks and retried an allocation "
                "(torch.cuda.memory_stats num_alloc_retries); a rising count means fragmentation near the memory limit.",
            ).set_function(lambda: torch.cuda.memory_stats(device).get("num_alloc_retries", 0))
        self.checkpoint_blocking = gauge(
            "meshtrain_checkpoint_save_blocking_seconds", "Time the last checkpoint save held up training on this worker."
        )
        self.checkpoint_duration = gauge(
            "meshtrain_checkpoint_save_duration_seconds", "Time from the start of the last committed checkpoint save to its commit."
        )
        self.checkpoint_size = gauge("meshtrain_checkpoint_size_bytes", "Size of the last committed checkpoint.")
        self.checkpoint_step = gauge("meshtrain_checkpoint_step", "Step of the last committed checkpoint.")
        self.checkpoint_saves = counter("meshtrain_checkpoint_saves", "Checkpoints committed by this worker process.")
        self.checkpoint_load = gauge("meshtrain_checkpoint_load_duration_seconds", "Time the last checkpoint load took on this worker.")
        self.eval_loss = Gauge(
            "meshtrain_eval_loss",
            f"Mean next-token cross entropy (nats) on the validation set at the last evaluation: per source, and over "
            f"every source (source=\"{OVERALL_LABEL}\").",
            (*LABELS, "source"),
            registry=self.registry,
        )
        self.eval_step = gauge("meshtrain_eval_step", "Step of the last evaluation.")
        self.source_share = Gauge(
            "meshtrain_data_source_share",
            "Each source's share of the samples trained since the previous logged step (a data mixture; "
            "data.sources' weights, or the stage's, are what it aims at).",
            (*LABELS, "source"),
            registry=self.registry,
        )
        self.stage = Gauge(
            "meshtrain_data_stage", "1 for the data.stages stage being trained, 0 for the stages trained before it.",
            (*LABELS, "stage"), registry=self.registry,
        )
        self._stages_seen: list[str] = []
        self.skipped_steps = counter(
            "meshtrain_skipped_steps", "Optimizer steps the guard skipped (non-finite or spiking loss or gradient norm)."
        )
        self._skipped_seen = 0
        self.rollbacks = counter(
            "meshtrain_rollbacks", "Rollbacks after repeated spikes: back to a checkpoint, leaving out the samples behind them."
        )
        self.left_out_samples = counter(
            "meshtrain_left_out_samples", "Samples rollbacks left out of training (their steps read the samples after them)."
        )
        self.restarts = gauge(
            "meshtrain_run_restarts",
            "Times Ray restarted this worker's group in the current job (in replica mode, this replica group).",
        )
        self.replicas_live = gauge(
            "meshtrain_replicas_live",
            "fault_tolerance.mode=replica: replica groups in this worker's last step's quorum (0 in restart mode).",
        )
        self.replica_heal = gauge(
            "meshtrain_replica_heal_seconds",
            "fault_tolerance.mode=replica: seconds this worker's group took to join by receiving a live peer's state.",
        )
        self.replica_heal_bytes = gauge(
            "meshtrain_replica_heal_bytes",
            "fault_tolerance.mode=replica: tensor bytes this worker received from its peer when its group joined.",
        )
        self.workers = gauge("meshtrain_workers", "Workers (world size) in this worker's group (in replica mode, one replica group).")
        self.rank_compute = gauge(
            "meshtrain_rank_step_compute_seconds",
            "This rank's transformer-block forward compute per step (collective waits excluded), last logging interval.",
        )
        self.rank_slowdown = gauge(
            "meshtrain_rank_slowdown_ratio", "This rank's compute per step over the median of the other ranks'."
        )
        self.straggler = gauge("meshtrain_straggler", "1 while the run reports this rank as a straggler, else 0.")
        self.workers_requested = gauge(
            "meshtrain_workers_requested",
            "Workers the run asks for (scaling.num_workers, every replica group's together); an elastic group may have fewer.",
        )
        self.checkpoint_interval = gauge("meshtrain_checkpoint_interval_steps", "Steps between scheduled checkpoints.")
        self.checkpoint_commit_time = gauge(
            "meshtrain_checkpoint_last_commit_timestamp_seconds", "Unix time the last checkpoint was committed."
        )
        self.replicate = gauge("meshtrain_mesh_replicate_degree", "Size of the mesh's replicate dimension (HSDP replicas).")
        self.shard = gauge("meshtrain_mesh_shard_degree", "Size of the mesh's shard dimension (FSDP shard group).")
        self.context = gauge("meshtrain_mesh_context_degree", "Context-parallel degree (ranks sharing each window).")
        self.tensor = gauge("meshtrain_mesh_tensor_degree", "Tensor-parallel degree (ranks sharing each layer).")
        self._clock = StepClock(device)

    # --- updates from the training loop -------------------------------------------------------

    def set_plan(self, workers_requested: int, checkpoint_interval: int | None) -> None:
        """What the run asks for: its workers, and its checkpoint cadence (None: checkpoints off)."""
        self.workers_requested.set(workers_requested)
        if checkpoint_interval is not None:
            self.checkpoint_interval.set(checkpoint_interval)

    def set_rank_speed(self, compute_s: float, slowdown: float, straggler: bool) -> None:
        self.rank_compute.set(compute_s)
        self.rank_slowdown.set(slowdown)
        self.straggler.set(1 if straggler else 0)

    def set_mesh(self, world_size: int, sizes: tuple[int, ...]) -> None:
        """``sizes``: (replicate, shard[, context, tensor]) degrees."""
        replicate, shard, context, tensor = (*sizes, 1, 1)[:4]
        self.workers.set(world_size)
        for gauge_, degree in ((self.replicate, replicate), (self.shard, shard), (self.context, context),
                               (self.tensor, tensor)):
            gauge_.set(degree)

    def start_steps(self, step: int, run_tokens: int, skipped_steps: int = 0) -> None:
        """Called once before the first step (after any resume)."""
        self.step.set(step)
        self.run_tokens.set(run_tokens)
        self._skipped_seen = skipped_steps
        self._clock = StepClock(self.device)

    def step_done(self, step: int, worker_tokens: int, data_wait_s: float) -> None:
        """Every step: cheap host-side updates only (no device sync)."""
        self._clock.mark()
        self.step.set(step)
        self.tokens.inc(worker_tokens)
        self.data_wait.inc(data_wait_s)

    def logged(self, record: TrainRecord, world_size: int) -> None:
        """At logging steps, from the record rank 0 also writes to metrics.jsonl (``world_size``: this
        worker's group's)."""
        for seconds in self._clock.drain():
            self.step_duration.observe(seconds)
        self.loss.set(record.loss)
        self.learning_rate.set(record.lr)
        self.grad_norm.set(record.grad_norm)
        self.run_tokens.set(record.tokens)
        # This worker's share of the step's tokens: in replica mode the replica groups that trained the step
        # (record.replicas) split its samples, each over the world_size workers of its group.
        worker_tokens_per_s = record.tokens_per_s / (world_size * (record.replicas or 1))
        self.tokens_per_second.set(worker_tokens_per_s)
        if self.peak_flops_per_s:
            # A record without the interval's own counts (no model counted them) falls back to the whole window.
            computed = record.flops_per_token if record.flops_per_token is not None else self.flops_per_token
            full = (record.flops_per_token_full_attention if record.flops_per_token_full_attention is not None
                    else self.flops_per_token)
            self.mfu.set(worker_tokens_per_s * computed / self.peak_flops_per_s)
            self.mfu_full_attention.set(worker_tokens_per_s * full / self.peak_flops_per_s)

    def evaluated(self, record: EvalRecord) -> None:
        self.eval_loss.labels(**self._label_values, source=OVERALL_LABEL).set(record.loss)
        for name, scores in record.sources.items():
            if scores["loss"] is not None:
                self.eval_loss.labels(**self._label_values, source=name).set(scores["loss"])
        self.eval_step.set(record.step)

    def mixture(self, record: MixtureRecord) -> None:
        for source, share in record.sources.items():
            self.source_share.labels(**self._label_values, source=source).set(share)
        if record.stage is not None:
            if record.stage not in self._stages_seen:
                self._stages_seen.append(record.stage)
            for stage in self._stages_seen:
                self.stage.labels(**self._label_values, stage=stage).set(1 if stage == record.stage else 0)

    def rollback(self, record: RollbackRecord) -> None:
        self.rollbacks.inc()
        self.left_out_samples.inc(sum(entry["stop"] - entry["start"] for entry in record.left_out))

    def replicas(self, live: int, heal_s: float | None, heal_bytes: int | None) -> None:
        self.replicas_live.set(live)
        if heal_s is not None:
            self.replica_heal.set(heal_s)
        if heal_bytes is not None:
            self.replica_heal_bytes.set(heal_bytes)

    def skipped(self, skipped_total: int) -> None:
        """The run's skipped steps so far (counted in this process from what it started with)."""
        self.skipped_steps.inc(max(0, skipped_total - self._skipped_seen))
        self._skipped_seen = max(self._skipped_seen, skipped_total)

    def checkpoint_event(self, event: CheckpointSaveRecord | CheckpointLoadRecord) -> None:
        if isinstance(event, CheckpointSaveRecord):
            self.checkpoint_duration.set(event.total_s)
            self.checkpoint_size.set(event.bytes)
            self.checkpoint_step.set(event.step)
            self.checkpoint_commit_time.set(time.time())
            self.checkpoint_saves.inc()
        else:
            self.checkpoint_load.set(event.load_s)
            self.checkpoint_step.set(event.step)  # what a resumed group starts from is the newest committed

    def checkpoint_blocked(self, seconds: float) -> None:
        self.checkpoint_blocking.set(seconds)

class _LazyGauge:
    """A gauge child that appears in the exposition only once it has a value (a loss or a
    checkpoint time of 0 before the first one would be wrong)."""

    def __init__(self, gauge: Gauge, labels: dict[str, str]) -> None:
        self._gauge, self._labels = gauge, labels

    def set(self, value: float) -> None:
        self._gauge.labels(**self._labels).set(value)

    def set_function(self, read: Any) -> None:
        self._gauge.labels(**self._labels).set_function(read)


class _ScrapeCounter:
    """Counts requests started and answered, so a worker can wait for one more scrape."""

    def __init__(self) -> None:
        self.started = self.served = 0
        self.last_served_at = float("-inf")
        self._changed = threading.Condition()

    def begin(self) -> None:
        with self._changed:
            self.started += 1

    def end(self) -> None:
        with self._changed:
            self.served += 1
            self.last_served_at = time.monotonic()
            self._changed.notify_all()

    def wait_beyond(self, started_before: int, timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self.served > started_before, timeout=timeout_s)


MAX_PORT = 65535


class _MetricsServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True

    @classmethod
    def start(cls, address: str, port: int, app: Any, scrapes: _ScrapeCounter) -> _MetricsServer:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        server_class = type("MetricsServer", (cls,), {"address_family": family})
        server = cast(_MetricsServer, make_server(address, port, app, server_class, _handler_class(scrapes)))
        threading.Thread(target=server.serve_forever, name="meshtrain-metrics", daemon=True).start()
        return server


def _handler_class(scrapes: _ScrapeCounter) -> type[WSGIRequestHandler]:
    class Handler(WSGIRequestHandler):
        def handle(self) -> None:
            scrapes.begin()
            try:
                super().handle()  # returns once the response is written out
            finally:
                scrapes.end()

        def log_message(self, format: str, *args: Any) -> None:  # no access log in the job output
            pass

    return Handler


# --- service discovery ------------------------------------------------------------------------


def targets_path(targets_dir: str | None, storage_path: str, run: str) -> Path:
    """The targets file of a run's workers."""
    return Path(targets_dir or Path(storage_path) / "prometheus") / f"{run}.json"


def targets_name(run: str, replica: int | None = None) -> str:
    """A targets file's name: the run's, or (replica mode) one per replica group."""
    return run if replica is None else replica_group_name(run, replica)


def driver_targets_path(targets_dir: str | None, storage_path: str, run: str) -> Path:
    """The targets file of a run's driver (goodput, downstream scores): a subfolder, named after the run too."""
    return targets_path(targets_dir, storage_path, run).parent / DRIVER_TARGETS_DIR / f"{run}.json"


def write_targets(path: Path, endpoints: list[Endpoint]) -> None:
    """Replace the file_sd targets file atomically (Prometheus may read it at any moment)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    groups = [{"targets": [e.target for e in endpoints], "labels": {}}] if endpoints else []
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(groups, indent=2) + "\n")
    tmp.replace(path)
