"""Driver side: config → Ray → corpus task → TorchTrainer → run outputs."""

from __future__ import annotations

import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from meshtrain.config import ConfigError, MeshtrainConfig
from meshtrain.checkpoint import CheckpointStorage
from meshtrain.data import Corpus, prepare_corpus, tokenizer_vocab_size
from meshtrain.metrics import targets_path, write_targets
from meshtrain.progress import ProgressMonitor
from meshtrain.training import checkpoint_root
from meshtrain.outputs import RunPaths, read_summary, write_summary


def resolve_run(cfg: MeshtrainConfig) -> tuple[MeshtrainConfig, RunPaths]:
    """Fix the run name (a timestamped one when unset) and make the storage path absolute."""
    name = cfg.run.name or f"{cfg.model.preset}-{datetime.now():%Y%m%d-%H%M%S}"
    storage = Path(cfg.run.storage_path).expanduser().resolve()
    cfg = cfg.model_copy(deep=True)
    cfg.run.name, cfg.run.storage_path = name, str(storage)
    return cfg, RunPaths(name, storage)


def config_yaml(cfg: MeshtrainConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


# Settings a re-run of an existing run name may change: it resumes from the run's checkpoints, so
# the model, data, optimizer, seed and global batch must stay as they were.
RESUMABLE_CHANGES = ("train.steps", "train.log_every", "train.micro_batch_size", "parallel", "scaling", "run", "checkpoint", "metrics", "fault")


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "storage_options":
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def write_run_config(cfg: MeshtrainConfig, paths: RunPaths) -> None:
    """Write config.yaml. Re-running a run name may change only RESUMABLE_CHANGES; the earlier
    config is then kept beside it as config.<time>.yaml."""
    text = config_yaml(cfg)
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    if paths.config.exists():
        previous_text = paths.config.read_text()
        if previous_text == text:
            return
        previous, current = _flatten(yaml.safe_load(previous_text)), _flatten(yaml.safe_load(text))
        for key in sorted(previous.keys() | current.keys()):
            allowed = any(key == p or key.startswith(p + ".") for p in RESUMABLE_CHANGES)
            if previous.get(key) != current.get(key) and not allowed:
                raise ConfigError(
                    f"{key}: run {paths.name} was started with {previous.get(key)!r}, not {current.get(key)!r}; "
                    "a re-run resumes the same training, so keep it or choose another run.name"
                )
        paths.config.rename(paths.run_dir / f"config.{datetime.now():%Y%m%d-%H%M%S}.yaml")
    paths.config.write_text(text)


def init_ray() -> None:
    """Join the cluster in RAY_ADDRESS when set (``auto``: the one started on this machine),
    otherwise start a local Ray sized to this machine."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
    else:
        # "local", not None: None would follow /tmp/ray/ray_current_cluster, which still names a
        # cluster whose processes were killed rather than stopped with `ray stop`.
        ray.init(address="local", num_cpus=os.cpu_count())


def _prepare_corpus_task(data_cfg: Any, tokenizer_json: str | None) -> tuple[Corpus, dict[str, Any]]:
    corpus = prepare_corpus(data_cfg, tokenizer_json)
    info = {
        "tokenizer_json": corpus.tokenizer_json,
        "vocab_size": corpus.vocab_size,
        "tokens": int(len(corpus.tokens)),
        "documents": corpus.documents,
    }
    return corpus, info


def _config_error_in(exc: BaseException) -> ConfigError | None:
    """A ConfigError raised on a worker or task, found in the chain Ray wraps around it."""
    from ray.exceptions import RayTaskError

    seen: set[int] = set()
    stack = [exc]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, RayTaskError):
            # Ray re-raises a task's error as a subclass of both RayTaskError and the original type,
            # with the remote traceback in its message; the original is its ``cause``.
            stack.append(current.cause)
            continue
        if isinstance(current, ConfigError):
            return current
        stack.extend(e for e in (current.__cause__, current.__context__) if e)
        failures = getattr(current, "worker_failures", None)
        if isinstance(failures, dict):
            stack.extend(v for v in failures.values() if isinstance(v, BaseException))
    return None


class TrainingFailed(RuntimeError):
    """The worker group failed for good (restarts exhausted); the message says how to resume."""


def _failure_message(cfg: MeshtrainConfig, exc: BaseException) -> str:
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    restarts = f"after {cfg.run.max_failures} restart(s)" if cfg.run.max_failures else "(run.max_failures=0)"
    storage = CheckpointStorage(checkpoint_root(cfg), cfg.checkpoint.storage_options)
    committed = storage.committed() if cfg.checkpoint.enabled else []
    if committed:
        where = f"last committed checkpoint: {storage.display(committed[0].path)} (step {committed[0].step})"
    else:
        where = "no checkpoint was committed"
    return (
        f"training failed {restarts}: {reason}; {where}; "
        f"run the same command again (run.name={cfg.run.name}) to resume"
    )


def build_trainer(cfg: MeshtrainConfig, paths: RunPaths, corpus_ref: Any, launch_id: str) -> Any:
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from meshtrain.worker import train_loop_per_worker

    scaling = cfg.scaling
    resources: dict[str, float] = {"CPU": scaling.cpus_per_worker}
    if scaling.use_gpu:
        resources["GPU"] = 1
    if not scaling.use_gpu:
        backend = "gloo"
    elif cfg.parallel.cpu_offload:
        backend = "cpu:gloo,cuda:nccl"  # offloaded gradients are clipped with collectives on host memory
    else:
        backend = "nccl"
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            # The validated object itself: re-validating on workers would re-check data paths that
            # exist only where the driver runs (the corpus reaches workers through Ray).
            "config": cfg,
            "corpus": corpus_ref,
            "launch_id": launch_id,  # tells this job's worker-group restarts from earlier jobs of the run
        },
        torch_config=TorchConfig(backend=backend, timeout_s=scaling.timeout_s),
        scaling_config=ray.train.ScalingConfig(
            num_workers=scaling.num_workers,
            use_gpu=scaling.use_gpu,
            resources_per_worker=resources,
            placement_strategy=scaling.placement_strategy,
            accelerator_type=scaling.accelerator_type,
        ),
        run_config=ray.train.RunConfig(
            name=paths.name,
            storage_path=str(paths.storage_path),
            failure_config=ray.train.FailureConfig(max_failures=cfg.run.max_failures),
        ),
    )


def launch(cfg: MeshtrainConfig) -> dict[str, Any]:
    """Run the whole job; returns the summary also written to ``summary.json``."""
    import ray

    started = time.perf_counter()
    cfg, paths = resolve_run(cfg)
    if cfg.data.tokenizer != "train":
        tokenizer_vocab_size(cfg.data)  # a broken tokenizer file fails here, before Ray starts
    write_run_config(cfg, paths)
    init_ray()
    cached_tokenizer = paths.tokenizer.read_text() if paths.tokenizer.exists() else None
    task = ray.remote(_prepare_corpus_task).options(num_returns=2, num_cpus=1)
    corpus_ref, info_ref = task.remote(cfg.data, cached_tokenizer)
    try:
        info = ray.get(info_ref)
    except ray.exceptions.RayTaskError as exc:
        ray.wait([corpus_ref])  # the sibling result holds the same error; consume it quietly
        del corpus_ref
        raise _config_error_in(exc) or exc from None
    if cached_tokenizer is None:
        paths.tokenizer.write_text(info["tokenizer_json"])
    print(
        f"[meshtrain] run {paths.name}: {info['documents']} documents, {info['tokens']:,} tokens, "
        f"vocab {info['vocab_size']}; outputs in {paths.run_dir}",
        flush=True,
    )
    trainer = build_trainer(cfg, paths, corpus_ref, launch_id=f"{datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}")
    try:
        with ProgressMonitor(paths.metrics, cfg.train.steps, cfg.metrics.progress_interval_s):
            trainer.fit()
    except Exception as exc:
        config_error = _config_error_in(exc)
        if config_error is not None:
            raise config_error from None
        raise TrainingFailed(_failure_message(cfg, exc)) from None
    finally:
        targets = targets_path(cfg.metrics.targets_dir, cfg.run.storage_path, paths.name)
        if targets.exists():
            write_targets(targets, [])  # the workers are gone: Prometheus stops scraping them
    # The workers wrote the run outputs; the driver adds the job's wall time.
    summary = read_summary(paths)
    summary["wall_time_s"] = time.perf_counter() - started
    write_summary(paths, summary)
    return summary
