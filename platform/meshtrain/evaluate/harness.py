"""lm-evaluation-harness tasks on a checkpoint's model: which tasks, the run, and what is kept.

The harness scores the model through its own ``HFLM`` wrapper of a ``transformers`` model, so its
task registry, prompts, metrics and results JSON are exactly what ``lm_eval --model hf`` gives for
the same checkpoint exported with ``jobs/export.py --format hf``. Tasks are harness task names, or
the names of task YAMLs in a folder (``include_path``) for local data. The harness runs from that
folder, so relative ``data_files`` in its YAMLs resolve there (``lm_eval`` itself resolves them
against its working directory). Nothing is downloaded: the Hub is switched off for the harness.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshtrain.config import ConfigError
from meshtrain.config.evaluation import DownstreamEvalConfig
from meshtrain.evaluate.hf_model import CheckpointModel
from meshtrain.observe.run_folder import DownstreamEvalRecord

RESULTS_FILE = "results.json"


@dataclass(frozen=True)
class HarnessRun:
    """What the harness runs: task names, the folder of local task YAMLs, few-shot count, examples per task."""

    tasks: tuple[str, ...]
    include_path: str | None = None
    num_fewshot: int | None = None
    limit: int | None = None
    batch_size: int = 8
    # What errors call the task list and the folder: the config's settings, or a command line's flags.
    settings: tuple[str, str] = ("eval.downstream.tasks", "eval.downstream.include_path")

    @classmethod
    def of(cls, config: DownstreamEvalConfig) -> HarnessRun:
        """The run ``eval.downstream`` asks for; a relative task folder taken from here (a Ray task's
        working directory may be another)."""
        folder = None if config.include_path is None else str(Path(config.include_path).resolve())
        return cls(tuple(config.tasks), folder, config.num_fewshot, config.limit, config.batch_size)


def _quiet_hub() -> None:
    # Task data comes from local files (or the datasets cache); a Hub lookup would wait on the network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def task_manager(run: HarnessRun) -> Any:
    """The harness's task index: only ``run.include_path`` when it holds every task (indexing the
    harness's own thousands of task YAMLs takes seconds), else that folder and the harness's tasks.
    ConfigError (one line) for a folder without task YAMLs or a task name found nowhere."""
    from lm_eval.tasks import TaskManager

    tasks_setting, folder_setting = run.settings
    if not run.tasks:
        raise ConfigError(f"{tasks_setting} is empty; name at least one harness task (e.g. hellaswag) or a task "
                          f"YAML's name in {folder_setting}")
    if run.include_path is not None:
        folder = Path(run.include_path)
        if not folder.is_dir() or not any(folder.rglob("*.yaml")):
            raise ConfigError(f"{folder_setting}={run.include_path!r} is not a folder of task YAMLs; give "
                              "a folder holding lm-eval task .yaml files")
        local = TaskManager(include_path=str(folder.resolve()), include_defaults=False)
        if not _unknown(local, run.tasks):
            return local
    manager = TaskManager(include_path=None if run.include_path is None else str(Path(run.include_path).resolve()))
    unknown = _unknown(manager, run.tasks)
    if unknown:
        where = "the harness's tasks" + ("" if run.include_path is None else f" or {run.include_path}")
        raise ConfigError(f"{tasks_setting}: {', '.join(unknown)} not found among {where}; check the names "
                          f"(`lm_eval ls tasks`) or add a task YAML to {folder_setting}")
    return manager


def _unknown(manager: Any, tasks: Sequence[str]) -> list[str]:
    known = set(manager.all_tasks)
    return [task for task in tasks if task not in known]


@contextmanager
def _working_directory(folder: str | None) -> Iterator[None]:
    """Inside ``folder`` (relative ``data_files`` of its task YAMLs resolve there), then back."""
    if folder is None:
        yield
        return
    previous = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


def run_harness(loaded: CheckpointModel, run: HarnessRun, manager: Any | None = None) -> dict[str, Any]:
    """lm-eval's results for ``loaded`` on ``run``'s tasks (its ``simple_evaluate`` dict). The global
    random generators are left as they were (the harness seeds its few-shot sampling itself)."""
    _quiet_hub()
    import lm_eval
    import lm_eval.evaluator
    from lm_eval.models.huggingface import HFLM

    # The harness records the git commit of the working directory by running git there, which prints
    # "fatal: not a git repository" into the job log from a Ray task's folder; the result files record
    # the checkpoint's step instead.
    lm_eval.evaluator.get_git_commit_hash = lambda: None

    manager = manager if manager is not None else task_manager(run)
    state = random.getstate()
    try:
        with _working_directory(run.include_path):
            results = lm_eval.simple_evaluate(
                model=HFLM(pretrained=loaded.model, tokenizer=loaded.tokenizer, batch_size=run.batch_size,
                           max_length=loaded.args.max_seq_len),
                tasks=list(run.tasks), task_manager=manager, num_fewshot=run.num_fewshot, limit=run.limit,
                random_seed=None, numpy_random_seed=None, torch_random_seed=None,
            )
    finally:
        random.setstate(state)
    assert results is not None  # None only on ranks > 0 of the harness's own multi-process runs
    return results


def metrics_of(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per task, its metrics as numbers (``acc``, ``acc_norm``, ``word_perplexity``, …; a filter
    other than the default one is kept in the name: ``exact_match,strict-match`` → ``exact_match_strict-match``)."""
    metrics: dict[str, dict[str, float]] = {}
    for task, values in results["results"].items():
        kept = {}
        for key, value in values.items():
            name, _, filtered = key.partition(",")
            if not filtered or "_stderr" in name or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            kept[name if filtered == "none" else f"{name}_{filtered}"] = float(value)
        metrics[task] = kept
    return metrics


def downstream_records(results: dict[str, Any], step: int, seconds: float) -> list[DownstreamEvalRecord]:
    """One ``downstream_eval`` record per task, as metrics.jsonl holds them (the driver sets ``time`` to when
    it appends them)."""
    samples = results.get("n-samples", {})
    return [
        DownstreamEvalRecord(step=step, task=task, scores=values, samples=samples.get(task, {}).get("effective"),
                             seconds=seconds, time=time.time())
        for task, values in metrics_of(results).items()
    ]


def save_results(results: dict[str, Any], folder: Path) -> Path:
    """The harness's results JSON (and its per-example samples, one JSONL per task) in ``folder``."""
    from lm_eval.utils import handle_non_serializable

    folder.mkdir(parents=True, exist_ok=True)
    samples = results.get("samples") or {}
    for task, rows in samples.items():
        lines = "".join(json.dumps(row, default=handle_non_serializable) + "\n" for row in rows)
        _write(folder / f"samples_{task}.jsonl", lines)
    summary = {key: value for key, value in results.items() if key != "samples"}
    target = folder / RESULTS_FILE
    _write(target, json.dumps(summary, indent=2, default=handle_non_serializable) + "\n")
    return target


def _write(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(path)


__all__ = ["HarnessRun", "RESULTS_FILE", "downstream_records", "metrics_of", "run_harness",
           "save_results", "task_manager"]
