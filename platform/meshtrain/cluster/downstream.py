"""Downstream evaluation while training goes on: the driver scores chosen committed checkpoints, each in
a Ray task with resources of its own (``eval.downstream``), and training never waits for one.

A thread of the driver lists the run's committed checkpoints every few seconds. A checkpoint whose
step is a multiple of ``every`` x ``checkpoint.interval``, or the run's last step, gets one task,
which loads it as a ``transformers`` Llama, runs lm-evaluation-harness on it and writes the
harness's results JSON into ``{run}/downstream/step-N/``. The driver appends each task's
``downstream_eval`` records to ``metrics.jsonl`` (one line per task, from which rank 0 passes them to
the trackers while it trains) and prints them in the job log. The driver serves the newest scores to
Prometheus itself (``meshtrain_downstream_*``, on :mod:`meshtrain.cluster.driver_endpoint`), so the
results that land after training, the last checkpoint's always, reach it too. A task that fails is one line in the
job log and a ``downstream_eval_failed`` record; training goes on and the next checkpoint is scored.
Steps whose results JSON exists are not scored again, so a relaunch picks up where the run was.
Each chosen checkpoint is leased until its task has scored it, so ``checkpoint.keep`` does not prune
it while the task waits for resources.

After training the job waits up to ``final_wait_s`` for the evaluations still running (the last
checkpoint's above all): during training they may not find free resources, since the workers hold them.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshtrain.checkpoint.storage import CheckpointStorage, CommittedCheckpoint, run_checkpoints
from meshtrain.config import CheckpointConfig, EvalConfig, RunConfig, one_line
from meshtrain.config.evaluation import DownstreamEvalConfig
from meshtrain.evaluate.checkpoint_eval import (
    DOWNSTREAM_DIR,
    RESULTS_FILE,
    SAMPLES_FILE,
    SampleRun,
    evaluate_checkpoint,
    results_folder,
)
from meshtrain.evaluate.harness import HarnessRun
from meshtrain.observe.metrics import DriverMetrics
from meshtrain.observe.run_folder import (
    DownstreamEvalFailedRecord,
    DownstreamEvalRecord,
    RunPaths,
    TextSamplesRecord,
    append_records,
)

POLL_S = 5.0


def chosen_step(step: int, every: int, last_step: int) -> bool:
    """Whether the committed checkpoint of ``step`` is one to score: every ``every`` steps
    (``eval.downstream.every`` x ``checkpoint.interval``), and the run's ``last_step`` (``train.steps``)."""
    return step == last_step or (step % every == 0)


def task_resources(downstream: DownstreamEvalConfig, use_gpu: bool) -> dict[str, Any]:
    """What Ray reserves for one evaluation task (``use_gpu``: ``scaling.use_gpu``)."""
    gpus = downstream.num_gpus if downstream.num_gpus is not None else (1.0 if use_gpu else 0.0)
    resources: dict[str, Any] = {"num_cpus": downstream.num_cpus, "num_gpus": gpus}
    if downstream.memory_gb is not None:
        resources["memory"] = int(downstream.memory_gb * 2**30)
    return resources


def _score(checkpoint: str, harness: HarnessRun | None, samples: SampleRun | None, run_dir: str,
           storage_options: dict[str, Any], injected_failure: str | None = None,
           ) -> list[DownstreamEvalRecord | TextSamplesRecord]:
    """The Ray task: one checkpoint scored and its prompts continued, the files written, its lease
    released; its ``downstream_eval`` and ``text_samples`` records."""
    import torch

    on_gpu = torch.cuda.is_available()
    storage = CheckpointStorage(checkpoint, storage_options)
    try:
        if injected_failure is not None:
            raise RuntimeError(injected_failure)
        evaluation = evaluate_checkpoint(
            checkpoint, harness, lambda step: results_folder(Path(run_dir), step), storage_options,
            dtype=torch.bfloat16 if on_gpu else torch.float32, device="cuda" if on_gpu else "cpu", samples=samples,
        )
    finally:
        storage.release(storage.root)
    return evaluation.records


class DownstreamEvaluations:
    """The driver's evaluations of a run's checkpoints (see the module's docstring)."""

    def __init__(self, evaluation: EvalConfig, checkpoint: CheckpointConfig, run: RunConfig, paths: RunPaths, *,
                 use_gpu: bool, last_step: int, fail_step: int | None = None,
                 print_line: Callable[[str], None] = print, poll_s: float = POLL_S,
                 exporter: DriverMetrics | None = None) -> None:
        """``use_gpu``: ``scaling.use_gpu``; ``last_step``: ``train.steps``; ``fail_step``:
        ``fault.downstream_fail_step``; ``exporter``: the driver's Prometheus endpoint, which serves the
        newest scores."""
        import ray

        self.paths, self.print_line, self.poll_s = paths, print_line, poll_s
        self.every, self.last_step = checkpoint.interval * evaluation.downstream.every, last_step
        self.fail_step, self.storage_options = fail_step, checkpoint.storage_options
        self.harness = HarnessRun.of(evaluation.downstream) if evaluation.downstream.enabled else None
        self.samples = SampleRun.of(evaluation.samples)
        self.storage = run_checkpoints(checkpoint, run)
        self.task = ray.remote(max_retries=0, **task_resources(evaluation.downstream, use_gpu))(_score)
        self.pending: dict[Any, CommittedCheckpoint] = {}  # task -> the checkpoint it scores
        self.latest: dict[str, DownstreamEvalRecord] = {}  # task -> its newest downstream_eval record
        self.started: set[int] = {step for step in self._scored_steps()}
        self.exporter = exporter if self.harness is not None else None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="meshtrain-downstream", daemon=True)

    def _scored_steps(self) -> set[int]:
        """Steps an earlier launch of the run evaluated already (their files are there)."""
        wanted = [name for name, on in ((RESULTS_FILE, self.harness), (SAMPLES_FILE, self.samples)) if on is not None]
        steps = set()
        for folder in (self.paths.run_dir / DOWNSTREAM_DIR).glob("step-*"):
            if all((folder / name).is_file() for name in wanted):
                try:
                    steps.add(int(folder.name.removeprefix("step-")))
                except ValueError:
                    continue
        return steps

    def __enter__(self) -> DownstreamEvaluations:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.poll_s + 5)

    def _follow(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def poll(self) -> None:
        """Start tasks for newly committed chosen checkpoints, and record those that finished."""
        with self._lock:
            try:
                self._submit_new()
            except Exception as exc:  # storage unreachable for a moment: the next poll lists again
                self.print_line(f"[meshtrain] downstream evaluation: could not list checkpoints ({one_line(exc)}); "
                                "trying again")
            self._collect(timeout_s=0)

    def _submit_new(self) -> None:
        for checkpoint in sorted(self.storage.committed(), key=lambda c: c.step):
            if checkpoint.step in self.started or not chosen_step(checkpoint.step, self.every, self.last_step):
                continue
            self.started.add(checkpoint.step)
            # Evaluations may queue behind training for resources: pruning must leave this one alone.
            self.storage.lease(checkpoint.path, holder=f"downstream evaluation of run {self.paths.name}")
            url = self.storage.display(checkpoint.path)
            fault = (f"fault.downstream_fail_step={checkpoint.step}: injected evaluation failure"
                     if self.fail_step == checkpoint.step else None)
            ref = self.task.remote(url, self.harness, self.samples, str(self.paths.run_dir),
                                   self.storage_options, fault)
            self.pending[ref] = checkpoint

    def _collect(self, timeout_s: float) -> None:
        import ray

        if not self.pending:
            return
        done, _ = ray.wait(list(self.pending), num_returns=len(self.pending), timeout=timeout_s)
        for ref in done:
            checkpoint = self.pending.pop(ref)
            try:
                records: list[DownstreamEvalRecord | TextSamplesRecord] = ray.get(ref)
            except Exception as exc:
                self.storage.release(checkpoint.path)  # the task may have died before it could
                self._failed(checkpoint.step, exc)
                continue
            landed = [dataclasses.replace(record, time=time.time()) for record in records]  # when it landed
            append_records(self.paths.metrics, landed)
            for record in landed:
                if isinstance(record, DownstreamEvalRecord) and record.step >= self._latest_step(record.task):
                    self.latest[record.task] = record
                    if self.exporter is not None:
                        self.exporter.scored(record)

    def _latest_step(self, task: str) -> int:
        latest = self.latest.get(task)
        return latest.step if latest is not None else -1

    def _failed(self, step: int, exc: BaseException) -> None:
        cause = getattr(exc, "cause", None) or exc
        message = (str(cause).strip().splitlines() or [type(cause).__name__])[-1]
        line = f"{type(cause).__name__}: {message}"
        append_records(self.paths.metrics, [DownstreamEvalFailedRecord(step=step, error=line, time=time.time())])

    def finish(self, timeout_s: float) -> None:
        """After training: score the checkpoints committed since the last poll, and wait up to
        ``timeout_s`` for every evaluation still running."""
        self._stop.set()
        self._thread.join(timeout=self.poll_s + 5)
        with self._lock:
            self._submit_new()
            if self.pending:
                steps = ", ".join(str(c.step) for c in sorted(self.pending.values(), key=lambda c: c.step))
                self.print_line(f"[meshtrain] waiting up to {timeout_s:g}s for the downstream evaluation of step(s) {steps}")
            deadline = time.monotonic() + timeout_s
            while self.pending and time.monotonic() < deadline:
                self._collect(timeout_s=min(self.poll_s, max(0.0, deadline - time.monotonic())))
            if self.pending:
                self._cancel_pending(timeout_s)

    def _cancel_pending(self, timeout_s: float) -> None:
        """The driver will not wait for these: their tasks would die with the job's Ray anyway. Cancel
        them, release their checkpoints' leases (or pruning would keep them for LEASE_TTL_S), record each,
        and say which steps were not scored and how to score them later."""
        import ray

        cancelled = sorted(self.pending.values(), key=lambda c: c.step)
        for ref, checkpoint in list(self.pending.items()):
            try:
                ray.cancel(ref, force=True)
            except Exception:  # noqa: BLE001 - finished or gone meanwhile: its lease is released below all the same
                pass
            self.storage.release(checkpoint.path)
        self.pending.clear()
        reason = f"cancelled: the driver waited eval.downstream.final_wait_s={timeout_s:g}s after training"
        append_records(self.paths.metrics, [DownstreamEvalFailedRecord(step=c.step, error=reason, time=time.time())
                                            for c in cancelled])
        steps = ", ".join(str(c.step) for c in cancelled)
        self.print_line(f"[meshtrain] downstream evaluation of step(s) {steps} not scored ({reason}); score them "
                        f"with python jobs/evaluate.py {self.paths.run_dir}, or raise eval.downstream.final_wait_s")
