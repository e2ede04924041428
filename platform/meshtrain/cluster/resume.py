"""What a relaunch of a run name keeps and may change: the config it was started with (the settings a
re-run may change), the run's tokenizer, the LR horizon, the checkpoints' data and sampling scheme, and
the refusal to overwrite committed work with a fresh start."""


from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

import yaml

from meshtrain.checkpoint.storage import run_checkpoints
from meshtrain.config import CheckpointConfig, ConfigError, RunConfig, one_line
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.data import SAMPLING_SCHEME, DataPlan, checkpoint_sampling
from meshtrain.data.local_files import write_atomically
from meshtrain.data.sampling import MIXTURE_BLOCK, apportion
from meshtrain.data.skips import SkipRange, check_left_out
from meshtrain.data.stages import DataStage
from meshtrain.observe.run_folder import RunPaths



def resolve_schedule_horizon(cfg: MeshtrainConfig, paths: RunPaths) -> MeshtrainConfig:
    """Fix optim.schedule_steps when unset: the horizon in the run's config.yaml on a re-run that
    resumes committed checkpoints (so a new train.steps does not silently change the LR curve),
    train.steps on the first launch and on a re-run that has nothing to resume."""
    if cfg.optim.schedule_steps is not None:
        return cfg
    if paths.config.exists() and run_checkpoints(cfg.checkpoint, cfg.run).committed():
        previous = read_run_config(paths)
        # A config.yaml written before optim.schedule_steps existed spanned its train.steps.
        horizon = previous["optim"].get("schedule_steps") or previous["train"]["steps"]
    else:
        horizon = cfg.train.steps
    cfg.optim.check_horizon(horizon, cfg.lr_decay_start(), cfg.lr_stages())
    cfg = cfg.model_copy(deep=True)
    cfg.optim.schedule_steps = horizon
    return cfg


def config_yaml(cfg: MeshtrainConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


# Settings a re-run of an existing run name may change: it resumes from the run's checkpoints, so
# the model, data, optimizer, seed and global batch must stay as they were. Where the token stores
# are cached and how storage is reached do not change the tokens (their fingerprint is checked).
RESUMABLE_CHANGES = (
    "train.steps", "train.log_every", "train.micro_batch_size", "parallel", "scaling", "run", "checkpoint", "fault_tolerance",
    "metrics", "fault", "data.cache_dir", "data.storage_options", "data.allow_fingerprint_change",
    "optim.schedule_steps", "eval", "train.max_bad_steps", "train.loss_spike_factor", "train.loss_spike_window",
    "train.grad_norm_spike_factor", "train.rollback_after_spikes", "train.rollback_window", "train.rollback_skip_before",
    "train.max_rollbacks", "data.skip_samples", "train.gc_every", "memory",
    # The stages not begun by the newest checkpoint may change; data_for_resume refuses a change to one that has.
    "data.stages",
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


def check_fresh_start(checkpoint: CheckpointConfig, run: RunConfig, paths: RunPaths) -> None:
    """``checkpoint.resume=false`` on a run with committed checkpoints would overwrite them with another
    training that a later plain relaunch could mix up with them: refused."""
    if not checkpoint.enabled or checkpoint.resume:
        return
    storage = run_checkpoints(checkpoint, run)
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
    if paths.metrics.exists() and not run_checkpoints(cfg.checkpoint, cfg.run).committed():
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
            if run_checkpoints(cfg.checkpoint, cfg.run).committed():
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


def data_for_resume(checkpoint: CheckpointConfig, run: RunConfig, plan: DataPlan, *,
                    allow_fingerprint_change: bool, stages: tuple[DataStage, ...] = (),
                    left_out: tuple[SkipRange, ...] = ()) -> DataPlan:
    """The data plan a resumed run continues with: checkpoints trained on other token data are
    refused (unless the user says so: ``data.allow_fingerprint_change``), the sampling scheme they
    were trained with is kept, so the data order never changes mid-run, and so are the data stages
    that have begun (``check_begun_stages``) and the samples left out among those read
    (``check_left_out``; ``left_out``: data.skip_samples and the run's rollbacks'). A run without
    checkpoints gets the plan as it is."""
    if not (checkpoint.enabled and checkpoint.resume):
        return plan
    committed = run_checkpoints(checkpoint, run).committed()
    if not committed:
        return plan
    manifest = committed[0].manifest
    check_begun_stages(manifest, committed[0].step, run.name, stages)
    check_left_out(manifest, left_out, [(stage.name, stage.first_sample) for stage in stages] or [(None, 0)],
                   committed[0].step)
    scheme = checkpoint_sampling(manifest, f"the checkpoints of run {run.name}")
    resumed = dataclasses.replace(plan, sampling=scheme)
    trained_on = manifest.get("data_fingerprint")
    if not allow_fingerprint_change and trained_on is not None and trained_on != resumed.fingerprint:
        raise ConfigError(
            f"data.source: the checkpoints of run {run.name} were trained on data {trained_on[:16]}, this launch "
            f"reads {resumed.fingerprint[:16]}; use the same data, another run.name, or set "
            "data.allow_fingerprint_change=true to continue on the new data deliberately"
        )
    if scheme != plan.sampling:
        print(
            f"[meshtrain] run {run.name} keeps the data order its checkpoints were trained with ({scheme}); "
            f"a new run.name uses {SAMPLING_SCHEME}",
            flush=True,
        )
    return resumed


def check_begun_stages(manifest: dict[str, Any], step: int, run_name: str | None,
                       stages: tuple[DataStage, ...]) -> None:
    """ConfigError unless a checkpoint's samples were drawn in the stages the config gives up to its data
    position: a stage that has begun keeps its name, start, weights (as the mixture apportions them),
    sequence length and, once over, its end; the stages after it may change freely."""
    trained = manifest.get("data_stages")
    if trained is None and not stages:
        return
    if trained is None or not stages:
        have, want = ("without data.stages", "adds them") if trained is None else ("in data.stages", "drops them")
        raise ConfigError(
            f"data.stages: the checkpoints of run {run_name} were trained {have} and this config {want}; the samples "
            "already trained would be drawn again differently: keep the data settings, or use another run.name"
        )
    position = int(manifest.get("data_position", 0))
    given = [stage.to_json() for stage in stages]

    def drawn(plan: list[dict[str, Any]], k: int) -> tuple[Any, ...] | None:
        """What stage ``k`` of ``plan`` drew up to the position: its name, start, apportioned weights, reach."""
        if k >= len(plan):
            return None
        end = plan[k + 1]["first_sample"] if k + 1 < len(plan) else position
        return (plan[k]["name"], plan[k]["first_sample"], apportion(MIXTURE_BLOCK, plan[k]["weights"]),
                plan[k].get("seq_len"), min(end, position))

    for k, stage in enumerate(trained):
        if stage["first_sample"] >= position:
            break
        if drawn(given, k) != drawn(trained, k):
            raise ConfigError(
                f"data.stages: stage {stage['name']!r} had begun by the checkpoint of step {step} (run {run_name}), "
                "and this config changes it (its name, start, weights, seq_len or, where it is over, its end); a stage that "
                f"has begun cannot change: change only the stages after step {step}, or use another run.name"
            )
