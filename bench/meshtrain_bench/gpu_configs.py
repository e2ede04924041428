"""The configurations of jobs/bench_gpu.py: the matrix file's sets, the ones chosen, and the settings
each job runs with (the configuration's own, then what the benchmark owns: run length, logging, outputs,
the profiler's window and the CUDA allocator's history), as a meshtrain config."""

from __future__ import annotations

import fnmatch
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]  # the checkout: benchmarks run its jobs/ and read its configs

from meshtrain.config import ConfigError, ScalingConfig, TrainConfig
from meshtrain.config.loading import load_config
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.config.section import MAX_DURATION_S

DEFAULT_MATRIX = REPO / "jobs" / "bench_gpu.yaml"
PROFILED_STEPS = 1  # traced by rank 0 after the timed steps, the step before them starting the profiler
PROFILE_TOP = 8  # ops in the profile's summary line
HISTORY_ENTRIES = 100_000  # CUDA allocator events kept with their stacks (torchtitan's default)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class BenchConfig:
    """One configuration: its name and its dotted settings (set base, its own, command line)."""

    name: str
    settings: dict[str, Any]


@dataclass(frozen=True)
class Window:
    """The optimizer steps of one job: warm-up then the timed ones, both whole logging intervals."""

    warmup: int
    timed: int
    log_every: int

    @classmethod
    def for_request(cls, warmup: int, timed: int) -> "Window":
        """Logging every ceil(warmup/2) steps puts the first logged step, which makes Ray Train's first
        report, inside the warm-up; whole intervals make both ends of the timed window alike (below)."""
        log_every = math.ceil(warmup / 2)
        return cls(2 * log_every, log_every * math.ceil(timed / log_every), log_every)

    @property
    def total(self) -> int:
        return self.warmup + self.timed


def load_matrix(path: Path) -> dict[str, dict[str, Any]]:
    """The sets of a matrix file: {set: {"description", "base", "configs": {name: settings}}}."""
    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(
            f"--matrix: cannot read {path} ({type(exc).__name__}); give a YAML file like {DEFAULT_MATRIX.name}"
        ) from None
    sets = loaded.get("sets") if isinstance(loaded, dict) else None
    if not isinstance(sets, dict) or not sets:
        raise ConfigError(f"--matrix: {path} has no 'sets:' mapping; see {DEFAULT_MATRIX}")
    for set_name, entry in sets.items():
        configs = entry.get("configs") if isinstance(entry, dict) else None
        if not isinstance(configs, dict) or not configs:
            raise ConfigError(f"--matrix: set {set_name!r} in {path} has no 'configs:' mapping")
        for name, settings in configs.items():
            if not _NAME.fullmatch(str(name)) or not isinstance(settings, dict):
                raise ConfigError(
                    f"--matrix: configuration {name!r} of set {set_name!r} must be a plain name with a mapping"
                )
    return sets


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``key=value`` strings as a dotted mapping (values read as YAML, as jobs/pretrain.py does)."""
    parsed: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected dotted.key=value, e.g. scaling.num_workers=8")
        try:
            parsed[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            parsed[key.strip()] = raw
    return parsed


def select(
    sets: dict[str, dict[str, Any]], set_name: str, patterns: list[str], overrides: dict[str, Any]
) -> list[BenchConfig]:
    """The set's configurations whose names match any of ``patterns`` (shell globs; none = all)."""
    if set_name not in sets:
        raise ConfigError(f"--set: unknown set {set_name!r}; choose one of {', '.join(sets)}")
    entry = sets[set_name]
    names = list(entry["configs"])
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            raise ConfigError(
                f"--only: {pattern!r} matches no configuration of set {set_name!r}; it has {', '.join(names)}"
            )
    chosen = [name for name in names if not patterns or any(fnmatch.fnmatch(name, p) for p in patterns)]
    base = entry.get("base") or {}
    return [BenchConfig(name, {**base, **entry["configs"][name], **overrides}) for name in chosen]


def _field_default(section: type[TrainConfig] | type[ScalingConfig], name: str) -> Any:
    return section.model_fields[name].default


def owned_settings(window: Window, run_name: str, storage: str) -> dict[str, Any]:
    """What the benchmark sets over every configuration: run length and logging, outputs, no checkpoints,
    no evaluation, no restarts, and Ray Train reports only at the first logged step and the last step."""
    return {
        "train.steps": window.total,
        "train.log_every": window.log_every,
        "eval.interval": None,
        "checkpoint.enabled": False,
        "run.name": run_name,
        "run.storage_path": storage,
        "run.max_failures": 0,
        "metrics.ray_report_interval_s": MAX_DURATION_S,  # only the final report
    }


def profile_settings(window: Window, use_gpu: bool) -> dict[str, Any]:
    """Rank 0's profiler window and, on GPU, the CUDA allocator's history.

    The window comes after the timed steps, not inside them: a traced step runs slower (every op
    recorded, the trace and its summary written at its end) and so does the step before it, which
    starts the profiler. The timed window's last figure is read during its last step (window.total),
    before either, so two more steps leave tokens/s as it was. The allocator's history must record
    from the start to say what allocated each block, so it is on for the whole run, timed steps included.
    """
    first = window.total + 2
    settings: dict[str, Any] = {
        "train.steps": first + PROFILED_STEPS - 1,
        "profile.start_step": first,
        "profile.active_steps": PROFILED_STEPS,
        "profile.ranks": [0],
        "profile.top": PROFILE_TOP,
    }
    if use_gpu:  # memory.history_entries is refused on CPU workers
        settings["memory.history_entries"] = HISTORY_ENTRIES
    return settings


def run_settings(
    config: BenchConfig, window: Window, run_name: str, storage: str, profile: bool = True
) -> dict[str, Any]:
    """The configuration's settings, a global batch of one micro-batch per worker unless it sets one, and
    the benchmark's own settings over them (with ``profile``, the profiler's window and allocator history too)."""
    settings = dict(config.settings)
    if "train.global_batch_size" not in settings:
        micro = settings.get("train.micro_batch_size", _field_default(TrainConfig, "micro_batch_size"))
        workers = settings.get("scaling.num_workers", _field_default(ScalingConfig, "num_workers"))
        # Tensor- and context-parallel peers share their samples: one micro-batch per data-parallel rank.
        peers = int(settings.get("parallel.tensor", 1)) * int(settings.get("parallel.context", 1))
        settings["train.global_batch_size"] = int(micro) * (int(workers) // peers)
    owned = owned_settings(window, run_name, storage)
    if profile:
        use_gpu = settings.get("scaling.use_gpu", _field_default(ScalingConfig, "use_gpu"))
        owned.update(profile_settings(window, bool(use_gpu)))
    return {**settings, **owned}


def to_overrides(settings: dict[str, Any]) -> list[str]:
    return [f"{key}={value if isinstance(value, str) else json.dumps(value)}" for key, value in settings.items()]


def build_config(settings: dict[str, Any]) -> MeshtrainConfig:
    return load_config(None, to_overrides(settings))
