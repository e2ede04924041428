"""A run that starts from another run's committed checkpoint (``checkpoint.start_from``): an anneal on a
new mix, OLMo 2's "mid-training", a continued pretraining.

The driver resolves the checkpoint once (``cluster.start_point``) into a :class:`StartPoint`: which
step directory, of which run, its fingerprint (the commit marker's digest, which covers every file's
checksum) and the learning rate its schedule gave its next step. Each worker of the new run's first
start loads the model's shards from it (and the optimizer's, when asked) through DCP, resharding to its
own mesh, each read checked against the checkpoint's checksums (:func:`load_start_point`); the new run's
data, schedule and counters start at zero. Later starts resume the run's own checkpoints.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from meshtrain.checkpoint.checksums import MARKER_CHECKSUM, seal_marker
from meshtrain.checkpoint.state import keeps_optimizer_by_name, optimizer_by_name, plain_tensors
from meshtrain.checkpoint.reading import read_committed
from meshtrain.checkpoint.storage import CheckpointError, CheckpointStorage


@dataclass(frozen=True)
class StartPoint:
    path: str  # the committed step directory, as the user would write it
    run: str | None  # the run that saved it
    step: int
    fingerprint: str  # the commit marker's digest: the manifest with every file's size and checksum
    lr: float  # the learning rate the checkpoint's own schedule gave its next step
    optimizer: bool  # the optimizer's state is taken too
    model_args: dict[str, Any]  # the shape it holds (the run's must be the same)

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "step": self.step, "path": self.path, "fingerprint": self.fingerprint,
                "lr": self.lr, "optimizer": self.optimizer}


def fingerprint(manifest: dict[str, Any]) -> str:
    return str(seal_marker(manifest)[MARKER_CHECKSUM])


def load_start_point(model: torch.nn.Module, optimizer: torch.optim.Optimizer, start: StartPoint,
                     storage_options: dict[str, Any] | None) -> float:
    """Fill this rank's shards of ``model`` (and of ``optimizer``'s state with ``start.optimizer``) from the
    start point; the seconds it took. The optimizer keeps this run's hyperparameters (learning rate,
    betas, weight decay): only its moments and step counts come from the checkpoint."""
    started = time.perf_counter()
    storage = CheckpointStorage(start.path, storage_options)
    committed = read_committed(storage, whole_files=False)  # DCP's reads are checked as they go
    if fingerprint(committed.manifest) != start.fingerprint:
        raise CheckpointError(f"checkpoint.start_from: {start.path} changed after the driver read it (its marker's "
                              "digest differs); do not rewrite a checkpoint a run starts from")
    reader = storage.reader(committed.path, storage.sidecars(committed))
    wanted: dict[str, Any] = {"model": plain_tensors(get_model_state_dict(model))}
    options = optimizer_by_name(keeps_optimizer_by_name(reader.read_metadata())) if start.optimizer else None
    if start.optimizer:
        wanted["optimizer"] = plain_tensors(get_optimizer_state_dict(model, optimizer, options=options))
    try:
        dcp.load({"train": wanted}, storage_reader=reader, no_dist=not dist.is_initialized())
    except CheckpointException as exc:  # every rank's failures, gathered
        failure = next(iter(exc.failures.values()))[0]
        first = (str(failure).strip().splitlines() or [type(failure).__name__])[0]
        raise CheckpointError(f"checkpoint.start_from {start.path}: {first}") from None
    set_model_state_dict(model, wanted["model"])
    if start.optimizer:
        settings = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
        set_optimizer_state_dict(model, optimizer, wanted["optimizer"], options=options)
        for group, own in zip(optimizer.param_groups, settings):
            group.update(own)
    return time.perf_counter() - started
