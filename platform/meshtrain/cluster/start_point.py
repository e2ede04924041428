"""The driver's side of ``checkpoint.start_from``: which checkpoint a new run starts from, what learning
rate it takes from it, and that the run's model and tokenizer are the checkpoint's, all before any worker
starts (the workers' side: ``checkpoint.start_point``)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from meshtrain.checkpoint.reading import checkpoint_in, read_committed, run_tokenizer
from meshtrain.checkpoint.start_point import StartPoint, fingerprint
from meshtrain.checkpoint.storage import CheckpointError, CheckpointStorage
from meshtrain.config import ConfigError, ModelArgs, one_line
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.data.tokenizer import tokenizer_sha256
from meshtrain.train.optim import lr_multiplier


def schedule_lr(settings: dict[str, Any], step: int, shown: str) -> float:
    """The learning rate a run's schedule (its resolved config, as a checkpoint's manifest keeps it) gave the
    update after ``step``."""
    try:
        source = MeshtrainConfig.model_validate(settings)
        horizon = source.optim.schedule_steps or source.train.steps
        return source.optim.lr * lr_multiplier(step, source.optim, horizon, source.lr_decay_start(),
                                                 source.lr_stages())
    except (ValidationError, ValueError, TypeError) as exc:
        raise ConfigError(
            f"checkpoint.start_from: the schedule of {shown} cannot be read ({one_line(exc, 160)}); set "
            "checkpoint.start_from_lr=false and give optim.lr"
        ) from None


def resolve_start(cfg: MeshtrainConfig) -> tuple[MeshtrainConfig, StartPoint | None, str | None]:
    """``cfg`` with optim.lr taken from the start point (checkpoint.start_from_lr), the start point, and the
    tokenizer the checkpoint's run trained with (None when the run folder has none: data.tokenizer must
    then be given). No start point without checkpoint.start_from."""
    checkpoint = cfg.checkpoint
    if checkpoint.start_from is None:
        return cfg, None, None
    options = checkpoint.storage_options
    try:
        path = checkpoint_in(checkpoint.start_from, options)
        storage = CheckpointStorage(path, options)
        committed = read_committed(storage, whole_files=False)  # each worker checks what it reads
    except (CheckpointError, OSError) as exc:
        raise ConfigError(f"checkpoint.start_from: {one_line(exc, 300)}") from None
    manifest, shown = committed.manifest, storage.display(committed.path)
    found = manifest.get("config")
    settings: dict[str, Any] = found if isinstance(found, dict) else {}
    run_section = settings.get("run")
    run = run_section.get("name") if isinstance(run_section, dict) else None
    lr = schedule_lr(settings, committed.step, shown) if checkpoint.start_from_lr else cfg.optim.lr
    start = StartPoint(shown, run, committed.step, fingerprint(manifest), lr, checkpoint.start_from_optimizer,
                       dict(manifest["model_args"]))
    if checkpoint.start_from_lr and lr != cfg.optim.lr:
        cfg = cfg.model_copy(deep=True)
        cfg.optim.lr = lr
    tokenizer = run_tokenizer(committed.path, manifest, options)
    if tokenizer is None and cfg.data.tokenizer == "train":
        raise ConfigError(
            f"data.tokenizer: checkpoint.start_from {shown} has no tokenizer.json beside its run; set data.tokenizer "
            "to the tokenizer its run trained with"
        )
    if tokenizer is not None and cfg.data.tokenizer != "train":
        from meshtrain.data.tokenizer import load_tokenizer_file

        if tokenizer_sha256(load_tokenizer_file(cfg.data.tokenizer).to_str()) != tokenizer_sha256(tokenizer):
            raise ConfigError(
                f"data.tokenizer: {cfg.data.tokenizer!r} is not the tokenizer checkpoint.start_from {shown} was "
                "trained with; leave data.tokenizer=train to use that run's"
            )
    return cfg, start, tokenizer


def check_start_model(model: ModelArgs, start: StartPoint) -> None:
    """ConfigError unless the run's model has the checkpoint's shape."""
    theirs = ModelArgs(**start.model_args)
    differs = [name for name in ModelArgs.model_fields if getattr(model, name) != getattr(theirs, name)]
    if differs:
        shown = ", ".join(f"{name}={getattr(model, name)!r} (checkpoint: {getattr(theirs, name)!r})" for name in differs[:4])
        raise ConfigError(
            f"model: checkpoint.start_from {start.path} holds another model shape: {shown}; give the model settings "
            "its run trained with"
        )
