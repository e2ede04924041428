"""Driver side: config → Ray → token stores (prepared or re-used) → TorchTrainer → run outputs."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from meshtrain.checkpoint.storage import checkpoint_root, newest_committed, run_checkpoints
from meshtrain.cluster.capacity import START_TIMEOUT_ENV, check_capacity, worker_resources
from meshtrain.cluster.downstream import DownstreamEvaluations
from meshtrain.cluster.failures import Failure, root_failure
from meshtrain.cluster.interrupts import DriverInterrupts
from meshtrain.cluster.preflight import preflight
from meshtrain.cluster.run_lease import RunLease
from meshtrain.cluster.worker_env import worker_env
from meshtrain.config import ConfigError, MeshtrainConfig, config_error_in, one_line, redact_url
from meshtrain.data import SAMPLING_SCHEME, DataPlan, checkpoint_sampling, prepare_data
from meshtrain.data.local_files import write_atomically
from meshtrain.observe.metrics import targets_path, write_targets
from meshtrain.observe.run_folder import RunPaths, StopRequest, read_summary, read_worker_starts, write_summary
from meshtrain.observe.progress import ProgressMonitor
from meshtrain.train.spec import RunSpec


def resolve_run(cfg: MeshtrainConfig) -> tuple[MeshtrainConfig, RunPaths]:
    """Fix the run name (a timestamped one when unset) and make the storage path absolute."""
    name = cfg.run.name or f"{cfg.model.preset}-{datetime.now():%Y%m%d-%H%M%S}"
    storage = Path(cfg.run.storage_path).expanduser().resolve()
    cfg = cfg.model_copy(deep=True)
    cfg.run.name, cfg.run.storage_path = name, str(storage)
    return cfg, RunPaths(name, storage)


def resolve_schedule_horizon(cfg: MeshtrainConfig, paths: RunPaths) -> MeshtrainConfig:
    """Fix optim.schedule_steps when unset: the horizon in the run's config.yaml on a re-run that
    resumes committed checkpoints (so a new train.steps does not silently change the LR curve),
    train.steps on the first launch and on a re-run that has nothing to resume."""
    if cfg.optim.schedule_steps is not None:
        return cfg
    if paths.config.exists() and run_checkpoints(cfg).committed():
        previous = read_run_config(paths)
        # A config.yaml written before optim.schedule_steps existed spanned its train.steps.
        horizon = previous["optim"].get("schedule_steps") or previous["train"]["steps"]
    else:
        horizon = cfg.train.steps
    cfg.optim.check_horizon(horizon)
    cfg = cfg.model_copy(deep=True)
    cfg.optim.schedule_steps = horizon
    return cfg


def config_yaml(cfg: MeshtrainConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


# Settings a re-run of an existing run name may change: it resumes from the run's checkpoints, so
# the model, data, optimizer, seed and global batch must stay as they were. Where the token stores
# are cached and how storage is reached do not change the tokens (their fingerprint is checked).
RESUMABLE_CHANGES = (
    "train.steps", "train.log_every", "train.micro_batch_size", "parallel", "scaling", "run", "checkpoint",
    "metrics", "fault", "data.cache_dir", "data.storage_options", "data.allow_fingerprint_change",
    "optim.schedule_steps", "eval", "train.max_bad_steps", "train.loss_spike_factor", "train.loss_spike_window",
    "train.gc_every", "memory",
)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "storage_options":
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _unresumable_change(previous_text: str, text: str) -> tuple[str, Any, Any] | None:
    """The first setting outside RESUMABLE_CHANGES that differs between two config.yaml texts, as
    (dotted key, earlier value, new value); None when a run could resume across the change."""
    # A setting added to meshtrain after the run started counts as having had its default.
    defaults = _flatten(MeshtrainConfig().model_dump(mode="json"))
    previous = {**defaults, **_flatten(yaml.safe_load(previous_text))}
    current = _flatten(yaml.safe_load(text))
    for key in sorted(previous.keys() | current.keys()):
        allowed = any(key == p or key.startswith(p + ".") for p in RESUMABLE_CHANGES)
        if previous.get(key) != current.get(key) and not allowed:
            return key, previous.get(key), current.get(key)
    return None


def read_run_config(paths: RunPaths) -> dict[str, Any]:
    """The run's config.yaml as written by an earlier launch; a damaged one is one line naming it."""
    try:
        loaded = yaml.safe_load(paths.config.read_text())
        if not isinstance(loaded, dict) or not {"optim", "train", "model"} <= loaded.keys():
            raise ValueError("it is not a whole meshtrain config (optim, train and model sections expected)")
        return loaded
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as exc:
        raise ConfigError(
            f"run.name={paths.name}: {paths.config} is damaged ({one_line(exc, 160)}); restore it (an earlier copy may "
            "sit beside it as config.<time>.yaml) or delete it to let this launch write it again"
        ) from None


def read_run_tokenizer(paths: RunPaths) -> str | None:
    """The tokenizer an earlier launch of the run kept (None on the first launch); a damaged one is one line."""
    if not paths.tokenizer.exists():
        return None
    from tokenizers import Tokenizer

    try:
        text = paths.tokenizer.read_text()
        Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises a bare Exception for malformed JSON
        raise ConfigError(
            f"run.name={paths.name}: {paths.tokenizer} is damaged ({one_line(exc, 160)}); delete it: the launch "
            "takes the tokenizer again from the run's token stores (or trains the same one from data.source)"
        ) from None
    return text


def check_fresh_start(cfg: MeshtrainConfig, paths: RunPaths) -> None:
    """``checkpoint.resume=false`` on a run with committed checkpoints would overwrite them with another
    training that a later plain relaunch could mix up with them: refused."""
    if not cfg.checkpoint.enabled or cfg.checkpoint.resume:
        return
    storage = run_checkpoints(cfg)
    committed = storage.committed()
    if committed:
        steps = ", ".join(str(c.step) for c in sorted(committed, key=lambda c: c.step))
        raise ConfigError(
            f"checkpoint.resume=false: run {paths.name} holds committed checkpoints (steps {steps}) that this launch "
            f"would replace; choose another run.name, or delete {storage.display(storage.root)} to start the run over"
        )


def write_run_config(cfg: MeshtrainConfig, paths: RunPaths) -> None:
    """Write config.yaml (credentials redacted). A re-run of a run name that has committed checkpoints
    resumes them, so it may change only RESUMABLE_CHANGES; one without (an earlier launch failed
    before its first checkpoint) starts afresh with any config, and the run's tokenizer is trained
    again. The earlier config (and a set-aside tokenizer) is kept beside it as config.<time>.yaml."""
    text = config_yaml(cfg)
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    stamp = f"{datetime.now():%Y%m%d-%H%M%S}"
    if paths.metrics.exists() and not run_checkpoints(cfg).committed():
        # An earlier launch's steps that no checkpoint kept: this launch trains them again from step 0,
        # and its records (and the trackers fed from them) start a fresh history.
        paths.metrics.rename(paths.run_dir / f"metrics.{stamp}.jsonl")
    if paths.config.exists():
        read_run_config(paths)  # a damaged one is one line naming it
        previous_text = paths.config.read_text()
        if previous_text == text:
            return
        change = _unresumable_change(previous_text, text)
        if change is not None:
            key, before, after = change
            if run_checkpoints(cfg).committed():
                raise ConfigError(
                    f"{key}: run {paths.name} was started with {before!r}, not {after!r}, and has committed "
                    "checkpoints; a re-run resumes the same training, so keep it or choose another run.name"
                )
            if paths.tokenizer.exists():
                paths.tokenizer.rename(paths.run_dir / f"tokenizer.{stamp}.json")
            print(
                f"[meshtrain] run {paths.name} has no committed checkpoint: it starts afresh with {key}={after!r} "
                f"(was {before!r}); the earlier config is kept as config.{stamp}.yaml",
                flush=True,
            )
        paths.config.rename(paths.run_dir / f"config.{stamp}.yaml")
    write_atomically(paths.config, text)


def init_ray() -> bool:
    """Join the cluster in RAY_ADDRESS when set (``auto``: the one started on this machine),
    otherwise start a local Ray sized to this machine. True when it started one (it has no
    autoscaler)."""
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
        return False
    # "local", not None: None would follow /tmp/ray/ray_current_cluster, which still names a
    # cluster whose processes were killed rather than stopped with `ray stop`.
    ray.init(address="local", num_cpus=os.cpu_count())
    return True


def data_cache_url(cfg: MeshtrainConfig) -> str:
    return cfg.data.cache_dir or str(Path(cfg.run.storage_path) / "token_stores")


def data_for_resume(cfg: MeshtrainConfig, plan: DataPlan) -> DataPlan:
    """The data plan a resumed run continues with: checkpoints trained on other token data are
    refused (unless the user says so), and the sampling scheme they were trained with is kept, so
    the data order never changes mid-run. A run without checkpoints gets the plan as it is."""
    if not (cfg.checkpoint.enabled and cfg.checkpoint.resume):
        return plan
    committed = run_checkpoints(cfg).committed()
    if not committed:
        return plan
    manifest = committed[0].manifest
    scheme = checkpoint_sampling(manifest, f"the checkpoints of run {cfg.run.name}")
    resumed = dataclasses.replace(plan, sampling=scheme)
    trained_on = manifest.get("data_fingerprint")
    if not cfg.data.allow_fingerprint_change and trained_on is not None and trained_on != resumed.fingerprint:
        raise ConfigError(
            f"data.source: the checkpoints of run {cfg.run.name} were trained on data {trained_on[:16]}, this launch "
            f"reads {resumed.fingerprint[:16]}; use the same data, another run.name, or set "
            "data.allow_fingerprint_change=true to continue on the new data deliberately"
        )
    if scheme != plan.sampling:
        print(
            f"[meshtrain] run {cfg.run.name} keeps the data order its checkpoints were trained with ({scheme}); "
            f"a new run.name uses {SAMPLING_SCHEME}",
            flush=True,
        )
    return resumed


class TrainingFailed(RuntimeError):
    """The worker group failed for good (a permanent failure, or restarts exhausted) or the step guard
    stopped the run; the message names the cause and where the run can resume from."""

    def __init__(self, message: str, failure: Failure | None = None) -> None:
        super().__init__(message)
        self.failure = failure


class Interrupted(RuntimeError):
    """The driver was interrupted (Ctrl-C, ``ray job stop``); the message says where the run stopped,
    what was saved and how to resume."""


def _last_committed(cfg: MeshtrainConfig) -> str:
    storage, newest = newest_committed(cfg)
    if newest is not None:
        return f"last committed checkpoint: {storage.display(newest.path)} (step {newest.step})"
    bad = len(storage.all_committed()) if cfg.checkpoint.enabled else 0
    return f"no loadable checkpoint ({bad} committed, marked bad)" if bad else "no checkpoint was committed"


def restarts_used(paths: RunPaths, launch_id: str) -> int:
    """How many times Ray restarted this launch's worker group (from worker_starts.jsonl)."""
    return max(0, sum(entry.get("launch") == launch_id for entry in read_worker_starts(paths)) - 1)


def _failure_message(cfg: MeshtrainConfig, failure: Failure, restarts: int) -> str:
    if failure.permanent:
        how = f"not restarted, a restart cannot fix this{f' (after {restarts} restart(s))' if restarts else ''}"
        resume = f"fix the cause, then run the same command again (run.name={cfg.run.name}) to resume"
    else:
        how = f"after {restarts} restart(s) (run.max_failures={cfg.run.max_failures})"
        resume = f"run the same command again (run.name={cfg.run.name}) to resume"
    return f"training failed: {failure.describe()}; {how}; {_last_committed(cfg)}; {resume}"


def _interrupted_message(cfg: MeshtrainConfig, interrupted: dict[str, Any] | None) -> str:
    storage, newest = newest_committed(cfg)
    if interrupted is None:
        at = "stopped at once without saving"
    else:
        at = f"interrupted at step {interrupted['step']}"
    saved = f"checkpoint step {newest.step} committed" if newest is not None else "no checkpoint committed"
    return f"{at}; {saved}; run the same command (run.name={cfg.run.name}) to resume"


def _stopped_message(cfg: MeshtrainConfig, reason: str) -> str:
    return (
        f"training stopped: {reason}; {_last_committed(cfg)}; fix the cause (e.g. lower optim.lr or raise "
        f"train.max_bad_steps) and run the same command again (run.name={cfg.run.name}) to resume from it"
    )


def load_ray_callbacks(specs: list[str]) -> list[Any]:
    """Instances of the ``module:Class`` Ray Train callbacks named in metrics.ray_callbacks."""
    import importlib

    from ray.train import UserCallback

    callbacks = []
    for spec in specs:
        module_name, class_name = spec.split(":")
        try:
            callback_class = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(
                f"metrics.ray_callbacks: cannot import {spec!r} ({one_line(exc)}); install its package "
                "on every node or fix the name"
            ) from None
        if not (isinstance(callback_class, type) and issubclass(callback_class, UserCallback)):
            raise ConfigError(f"metrics.ray_callbacks: {spec!r} is not a ray.train.UserCallback subclass")
        callbacks.append(callback_class())
    return callbacks


def build_trainer(spec: RunSpec) -> Any:
    import ray.train
    from ray.train.torch import TorchConfig

    from meshtrain.cluster.elastic_policy import NewestCommittedStep, TrainableSizesPolicy
    from meshtrain.cluster.ray_trainer import trainer_class
    from meshtrain.cluster.worker import train_loop_per_worker

    cfg, paths = spec.config, spec.paths
    scaling = cfg.scaling
    if not scaling.use_gpu:
        backend = "gloo"
    elif cfg.parallel.cpu_offload:
        backend = "cpu:gloo,cuda:nccl"  # offloaded gradients are clipped with collectives on host memory
    else:
        backend = "nccl"
    elastic_policy = None
    if scaling.elastic:
        # Only trainable sizes; a grow first saves where the group is (none to wait for without checkpoints).
        elastic_policy = functools.partial(
            TrainableSizesPolicy,
            sizes=cfg.elastic_sizes(),
            newest_checkpoint_step=NewestCommittedStep(checkpoint_root(cfg), cfg.checkpoint.storage_options),
            grow_save_timeout_s=scaling.grow_save_timeout_s if cfg.checkpoint.enabled else 0.0,
        )
    return trainer_class()(
        train_loop_per_worker,
        elastic_policy=elastic_policy,
        # The resolved objects themselves: re-validating on workers would re-check data paths that exist
        # only where the driver runs; the data plan holds store locations, workers map the shards themselves.
        train_loop_config={"spec": spec},
        torch_config=TorchConfig(backend=backend, timeout_s=scaling.timeout_s),
        scaling_config=ray.train.ScalingConfig(
            # Elastic: Ray starts the group on as many workers as the cluster holds in this range,
            # and restarts it larger when a check every resize_check_interval_s finds more.
            num_workers=(scaling.min_workers, scaling.num_workers) if scaling.elastic else scaling.num_workers,
            elastic_resize_monitor_interval_s=scaling.resize_check_interval_s,
            use_gpu=scaling.use_gpu,
            resources_per_worker=worker_resources(scaling),
            placement_strategy=scaling.placement_strategy,
            accelerator_type=scaling.accelerator_type,
        ),
        run_config=ray.train.RunConfig(
            name=paths.name,
            storage_path=str(paths.storage_path),
            failure_config=ray.train.FailureConfig(max_failures=cfg.run.max_failures),
            callbacks=load_ray_callbacks(cfg.metrics.ray_callbacks),
            # Read by torch when the worker starts its process group and CUDA, before our code runs.
            worker_runtime_env={"env_vars": worker_env(cfg, os.environ)},
        ),
    )


# Ray sizes an elastic group from the resources its autoscaling coordinator last saw (refreshed every
# 20 s), so just after a node is lost it may still count that node and ask for too many workers.
# Their placement group then never fills; giving up on it after this long (Ray's default: 60 s)
# lets Ray size the group again from a fresh view sooner. A group sized right is placed at once.
ELASTIC_START_TIMEOUT_S = 25


def launch(cfg: MeshtrainConfig) -> dict[str, Any]:
    """Run the whole job; returns the summary also written to ``summary.json``."""

    started = time.perf_counter()
    cfg, paths = resolve_run(cfg)
    cfg = preflight(cfg)  # the config against the world, before anything is written or started
    launch_id = f"{datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}"
    with RunLease.take(paths.run_dir, paths.name, launch_id):  # before any file of the run is read or written
        return _launch(cfg, paths, launch_id, started)


def _launch(cfg: MeshtrainConfig, paths: RunPaths, launch_id: str, started: float) -> dict[str, Any]:
    check_fresh_start(cfg, paths)
    cfg = resolve_schedule_horizon(cfg, paths)  # after preflight: it lists the (reachable) checkpoints
    write_run_config(cfg, paths)
    cached_tokenizer = read_run_tokenizer(paths)
    local_ray = init_ray()
    check_capacity(cfg.scaling, local_ray)  # before data preparation, which may take long
    if cfg.scaling.elastic:
        os.environ.setdefault(START_TIMEOUT_ENV, str(ELASTIC_START_TIMEOUT_S))
    data = prepare_data(
        cfg.data,
        data_cache_url(cfg),
        cfg.data.seq_len,
        run_tokenizer=cached_tokenizer,
        log=lambda line: print(line, flush=True),
        progress_interval_s=cfg.metrics.progress_interval_s,
    )
    data = data_for_resume(cfg, data)
    if cached_tokenizer is None:
        write_atomically(paths.tokenizer, data.tokenizer_json)
    stores = ", ".join(redact_url(ref.url) for ref in data.stores)
    print(
        f"[meshtrain] run {paths.name}: {data.documents:,} documents, {data.tokens:,} tokens, "
        f"vocab {data.vocab_size} from {stores}; outputs in {paths.run_dir}",
        flush=True,
    )
    trainer = build_trainer(RunSpec.resolve(cfg, data, paths, launch_id))
    downstream = DownstreamEvaluations(cfg, paths) if cfg.eval.downstream.enabled or cfg.eval.samples.prompts else None
    try:
        with DriverInterrupts(StopRequest(str(paths.stop_request), launch_id), cfg.run.preemption_save_s), \
                ProgressMonitor(paths.metrics, cfg.train.steps, cfg.metrics.progress_interval_s), \
                downstream if downstream is not None else contextlib.nullcontext():
            trainer.fit()
            if downstream is not None:  # the job log shows the results as they land
                downstream.finish(cfg.eval.downstream.final_wait_s)
                downstream.log_to_trackers()
    except KeyboardInterrupt:
        raise Interrupted(_interrupted_message(cfg, None)) from None
    except Exception as exc:
        config_error = config_error_in(exc)
        if config_error is not None:
            raise config_error from None
        failure = root_failure(exc)
        raise TrainingFailed(_failure_message(cfg, failure, restarts_used(paths, launch_id)), failure) from None
    finally:
        targets = targets_path(cfg.metrics.targets_dir, cfg.run.storage_path, paths.name)
        if targets.exists():
            write_targets(targets, [])  # the workers are gone: Prometheus stops scraping them
    # The workers wrote the run outputs; the driver adds the job's wall time.
    summary = read_summary(paths)
    summary["wall_time_s"] = time.perf_counter() - started
    if downstream is not None:
        summary["downstream"] = downstream.latest
    write_summary(paths, summary)
    if summary.get("stopped"):
        raise TrainingFailed(_stopped_message(cfg, summary["stopped"]))
    if summary.get("interrupted"):
        raise Interrupted(_interrupted_message(cfg, summary["interrupted"]))
    return summary
