"""Driver side: config → Ray → token stores (prepared or re-used) → TorchTrainer → run outputs."""

from __future__ import annotations

import contextlib
import os
import time
from datetime import datetime
from pathlib import Path


from meshtrain.cluster.capacity import START_TIMEOUT_ENV, check_capacity
from meshtrain.cluster.driver_endpoint import DriverEndpoint
from meshtrain.cluster.downstream import DownstreamEvaluations
from meshtrain.cluster.failures import root_failure
from meshtrain.cluster.interrupts import DriverInterrupts
from meshtrain.cluster.outcome import (
    Interrupted,
    TrainingFailed,
    failure_message,
    interrupted_message,
    restarts_used,
    stopped_message,
)
from meshtrain.cluster.preflight import preflight
from meshtrain.cluster.ray_trainer import build_trainer
from meshtrain.cluster.replica_groups import fit_replica_groups
from meshtrain.cluster.resume import (
    check_fresh_start,
    data_for_resume,
    read_run_tokenizer,
    resolve_schedule_horizon,
    write_run_config,
)
from meshtrain.cluster.worker_plan import worker_plan
from meshtrain.cluster.run_lease import RunLease
from meshtrain.config import config_error_in, one_line, redact_url
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.data import prepare_data
from meshtrain.cluster.start_point import check_start_model, resolve_start
from meshtrain.data.skips import skips_of
from meshtrain.model.args import model_args
from meshtrain.data.stages import data_stages
from meshtrain.data.local_files import write_atomically
from meshtrain.observe.goodput import GoodputLedger
from meshtrain.observe.metrics import targets_name, targets_path, write_targets
from meshtrain.observe.run_folder import (
    ReadRecord,
    RunPaths,
    StopRequest,
    Summary,
    TrainRecord,
    read_left_out,
    read_result,
    write_summary,
)
from meshtrain.observe.progress import ProgressMonitor
from meshtrain.observe.tracker_relay import TrackerRelay


def resolve_run(cfg: MeshtrainConfig) -> tuple[MeshtrainConfig, RunPaths]:
    """Fix the run name (a timestamped one when unset) and make the storage path absolute."""
    name = cfg.run.name or f"{cfg.model.preset}-{datetime.now():%Y%m%d-%H%M%S}"
    storage = Path(cfg.run.storage_path).expanduser().resolve()
    cfg = cfg.model_copy(deep=True)
    cfg.run.name, cfg.run.storage_path = name, str(storage)
    return cfg, RunPaths.of(cfg.run)


def init_ray() -> bool:
    """Join the cluster in RAY_ADDRESS when set (``auto``: the one started on this machine),
    otherwise start a local Ray sized to this machine. True when it started one (it has no
    autoscaler)."""
    import ray

    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    try:
        if address:
            ray.init(address=address)
            return False
        # "local", not None: None would follow /tmp/ray/ray_current_cluster, which still names a
        # cluster whose processes were killed rather than stopped with `ray stop`.
        ray.init(address="local", num_cpus=os.cpu_count())
    except Exception as exc:  # noqa: BLE001 - Ray raises bare Exception, ConnectionError, RuntimeError... here
        raise RayUnavailable(
            f"could not join the Ray cluster at RAY_ADDRESS={redact_url(address)} ({one_line(exc)}); check it runs "
            "(ray status) or unset RAY_ADDRESS to start a local one" if address else
            f"could not start a local Ray ({one_line(exc)}); the machine may be overloaded or its /tmp full: "
            "retry, or start one with `ray start --head` and set RAY_ADDRESS=auto"
        ) from None
    return True


class RayUnavailable(RuntimeError):
    """Ray did not start or could not be joined: nothing was started or written by the run."""


# Ray sizes an elastic group from the resources its autoscaling coordinator last saw (refreshed every
# 20 s), so just after a node is lost it may still count that node and ask for too many workers.
# Their placement group then never fills; giving up on it after this long (Ray's default: 60 s)
# lets Ray size the group again from a fresh view sooner. A group sized right is placed at once.
ELASTIC_START_TIMEOUT_S = 25


def launch(cfg: MeshtrainConfig) -> Summary:
    """Run the whole job; returns the summary also written to ``summary.json``."""

    started = time.perf_counter()
    started_at = time.time()  # goodput's wall time runs from here
    cfg, paths = resolve_run(cfg)
    cfg = preflight(cfg)  # the config against the world, before anything is written or started
    launch_id = f"{datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}"
    with RunLease.take(paths.run_dir, paths.name, launch_id):  # before any file of the run is read or written
        return _launch(cfg, paths, launch_id, started, started_at)


def _launch(cfg: MeshtrainConfig, paths: RunPaths, launch_id: str, started: float, started_at: float) -> Summary:
    check_fresh_start(cfg.checkpoint, cfg.run, paths)
    cached_tokenizer = read_run_tokenizer(paths)  # a damaged one stops the launch before anything is written
    cfg, start, start_tokenizer = resolve_start(cfg)  # checkpoint.start_from: before the config is written
    cfg = resolve_schedule_horizon(cfg, paths)  # after preflight: it lists the (reachable) checkpoints
    write_run_config(cfg, paths)
    if not paths.tokenizer.exists():  # a fresh start with another config set the earlier one aside
        cached_tokenizer = None
    local_ray = init_ray()
    check_capacity(cfg.scaling, local_ray)  # before data preparation, which may take long
    if cfg.scaling.elastic:
        os.environ.setdefault(START_TIMEOUT_ENV, str(ELASTIC_START_TIMEOUT_S))
    data = prepare_data(
        cfg.data,
        cfg.data_cache_url(),
        cfg.data.seq_len,
        run_tokenizer=cached_tokenizer or start_tokenizer,
        log=lambda line: print(line, flush=True),
        progress_interval_s=cfg.metrics.progress_interval_s,
    )
    data = data_for_resume(cfg.checkpoint, cfg.run, data, allow_fingerprint_change=cfg.data.allow_fingerprint_change,
                           stages=data_stages(cfg.data, cfg.train.global_batch_size),
                           left_out=skips_of(cfg.data.skip_samples, read_left_out(paths.left_out)))
    if cached_tokenizer is None:
        write_atomically(paths.tokenizer, data.tokenizer_json)
    stores = ", ".join(redact_url(ref.url) for ref in data.stores)
    print(
        f"[meshtrain] run {paths.name}: {data.documents:,} documents, {data.tokens:,} tokens, "
        f"vocab {data.vocab_size} from {stores}; outputs in {paths.run_dir}",
        flush=True,
    )
    if start is not None:
        check_start_model(model_args(cfg.model, data.vocab_size), start)
        print(f"[meshtrain] run {paths.name} starts from {start.path} (run {start.run}, step {start.step}"
              f"{', with its optimizer' if start.optimizer else ''}); optim.lr={cfg.optim.lr:.6g}", flush=True)
    plan = worker_plan(cfg, data, launch_id, start_from=start)
    endpoint = DriverEndpoint.open(cfg.metrics, cfg.run.storage_path, paths.name)
    exporter = endpoint.metrics if endpoint is not None else None
    downstream = (DownstreamEvaluations(cfg.eval, cfg.checkpoint, cfg.run, paths, use_gpu=cfg.scaling.use_gpu,
                                        last_step=cfg.train.steps, fail_step=cfg.fault.downstream_fail_step,
                                        exporter=exporter)
                  if cfg.eval.downstream.enabled or cfg.eval.samples.prompts else None)
    trackers = TrackerRelay.open(cfg.metrics, paths, plan.settings)
    goodput = GoodputLedger(started_at)
    trained_at = None

    def follow_goodput(record: ReadRecord) -> None:
        goodput.add(record)
        if exporter is not None and isinstance(record, TrainRecord):
            exporter.goodput(goodput.report(time.time()))

    with endpoint if endpoint is not None else contextlib.nullcontext():
        try:
            with DriverInterrupts(StopRequest(str(paths.stop_request), launch_id), cfg.run.preemption_save_s), \
                    trackers if trackers is not None else contextlib.nullcontext(), \
                    ProgressMonitor(paths.metrics, cfg.train.steps, cfg.metrics.progress_interval_s,
                                    listeners=[follow_goodput]), \
                    downstream if downstream is not None else contextlib.nullcontext():
                if cfg.fault_tolerance.mode == "replica":
                    fit_replica_groups(plan, build_trainer)
                else:
                    build_trainer(plan).fit()
                trained_at = time.time()
                if downstream is not None:  # the job log shows the results as they land
                    downstream.finish(cfg.eval.downstream.final_wait_s)
        except KeyboardInterrupt:
            raise Interrupted(interrupted_message(cfg.checkpoint, cfg.run, None)) from None
        except Exception as exc:
            config_error = config_error_in(exc)
            if config_error is not None:
                raise config_error from None
            failure = root_failure(exc)
            raise TrainingFailed(failure_message(cfg.checkpoint, cfg.run, failure, restarts_used(paths, launch_id),
                                                 cfg.fault_tolerance.mode == "replica"), failure) from None
        finally:
            groups = range(cfg.replica_groups()) if cfg.fault_tolerance.mode == "replica" else [None]
            for group in groups:
                targets = targets_path(cfg.metrics.targets_dir, cfg.run.storage_path, targets_name(paths.name, group))
                if targets.exists():
                    write_targets(targets, [])  # the workers are gone: Prometheus stops scraping them
        report = goodput.report(trained_at if trained_at is not None else time.time())
        if endpoint is not None:
            endpoint.finish(report)
    # Rank 0 wrote its result; the summary is it and the job's wall time, goodput and downstream scores.
    result = read_result(paths)
    summary = write_summary(
        paths, result, wall_time_s=time.perf_counter() - started, goodput=report,
        # replica mode: world_size and mesh_shape are one group's
        replica_groups=cfg.replica_groups() if cfg.fault_tolerance.mode == "replica" else None,
        downstream=downstream.latest if downstream is not None else None,
        started_from=start.to_json() if start is not None else None,
        left_out=[*({"by_hand": True, **skip.model_dump()} for skip in cfg.data.skip_samples),
                  *(entry.to_json() for entry in read_left_out(paths.left_out))],
    )
    stopped, interrupted = result.stopped, result.interrupted
    if stopped:
        raise TrainingFailed(stopped_message(cfg.checkpoint, cfg.run, stopped))
    if interrupted:
        raise Interrupted(interrupted_message(cfg.checkpoint, cfg.run, interrupted))
    return summary
