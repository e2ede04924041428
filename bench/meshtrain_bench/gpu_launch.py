"""One bench_gpu configuration trained through ``meshtrain.cluster.launcher.launch`` and measured: a
failure becomes a row with its one-line reason, and the run folder's diagnostics (profile, memory
snapshots) are read back either way."""

from __future__ import annotations

from pathlib import Path

from meshtrain.config.schema import MeshtrainConfig
from meshtrain.observe.run_folder import ProfileRecord, RunPaths, read_records, read_worker_starts
from meshtrain.train.profiling import summary_line
from meshtrain_bench.gpu_configs import BenchConfig, Window, build_config, run_settings
from meshtrain_bench.gpu_measure import Row, measure


def read_diagnostics(row: Row, run_dir: Path) -> None:
    """The run's memory snapshots (a rank that ran out of CUDA memory, and every rank at the end with the
    allocator history on) and rank 0's profiler trace with its summary line, from the run folder."""
    row.memory_snapshots = sorted(str(path.relative_to(run_dir)) for path in (run_dir / "memory").glob("*.pickle"))
    windows = [r for r in read_records(run_dir / "metrics.jsonl", ProfileRecord) if r.rank == 0]
    if not windows:
        return
    window = windows[0]
    trace = Path(window.trace)
    row.profile_trace = str(trace.relative_to(run_dir)) if trace.is_relative_to(run_dir) else str(trace)
    ops = [(str(name), float(ms)) for name, ms in window.top_ms_per_step]
    row.profile_summary = summary_line(0, window.first_step, window.step, window.device == "cuda", ops,
                                       Path(row.profile_trace))


def failure_reason(exc: BaseException) -> str:
    """One line: the launcher's root cause (the rank that failed first, not one that lost its peer), or
    for any other error its own line."""
    from meshtrain.cluster.failures import root_failure
    from meshtrain.cluster.outcome import TrainingFailed

    failure = getattr(exc, "failure", None)
    if failure is None and isinstance(exc, TrainingFailed) and exc.__context__ is not None:
        failure = root_failure(exc.__context__)  # a TrainingFailed raised over Ray's error without its cause
    return (failure or root_failure(exc)).describe()


def wait_for_workers_to_exit(run_dir: Path, timeout_s: float = 60.0) -> None:
    """Let the run's worker processes on this node exit (and free their GPU memory) before the next run."""
    import psutil
    import ray

    here = ray.util.get_node_ip_address() if ray.is_initialized() else None
    starts = read_worker_starts(RunPaths(run_dir.name, run_dir.parent))
    pids = {worker["pid"] for start in starts for worker in start.workers if worker["node_ip"] == here}
    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=timeout_s)


def run_one(
    config: BenchConfig, window: Window, stamp: str, storage: str, local_ray: bool, profile: bool = True
) -> Row:
    """Train one configuration through meshtrain.cluster.launcher.launch and measure it; failures become a row."""
    from meshtrain.cluster.capacity import check_capacity
    from meshtrain.cluster.launcher import launch

    row = Row(config.name, "failed", settings=dict(config.settings))
    run_name = f"{config.name}-{stamp}"
    run_dir = Path(storage).expanduser().resolve() / run_name
    cfg: MeshtrainConfig | None = None
    try:
        cfg = build_config(run_settings(config, window, run_name, storage, profile))
        check_capacity(cfg.scaling, local_ray)  # launch's own check would take this Ray for a cluster that may grow
        summary = launch(cfg)
        row = measure(row, cfg, summary, window)
    except Exception as exc:  # noqa: BLE001 - one configuration's failure must not end the benchmark
        row.reason = failure_reason(exc)
    finally:
        wait_for_workers_to_exit(run_dir)
    if cfg is not None and run_dir.is_dir():
        row.run_dir = str(run_dir)
        read_diagnostics(row, run_dir)
    return row
