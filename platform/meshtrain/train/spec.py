"""What a launch resolves once, on the driver after preflight, and ships to every worker."""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.config import MeshtrainConfig, ModelArgs
from meshtrain.data import DataPlan
from meshtrain.model.args import model_args
from meshtrain.observe.run_folder import RunPaths


@dataclass(frozen=True)
class RunSpec:
    """The resolved run: the checked config (run name, storage path and LR horizon fixed), the model's
    shape (read once: ``model.init_from``'s config.json is not read again on every worker), the data
    plan (token stores and tokenizer; resumed runs keep their checkpoints' sampling scheme), the run
    folder and this launch's id. The mesh is not in it: each worker group resolves its mesh from where
    Ray placed its workers and how many it started (an elastic group may be smaller)."""

    config: MeshtrainConfig
    model: ModelArgs
    data: DataPlan
    paths: RunPaths
    launch_id: str

    @classmethod
    def resolve(cls, config: MeshtrainConfig, data: DataPlan, paths: RunPaths, launch_id: str) -> RunSpec:
        return cls(config, model_args(config.model, data.vocab_size), data, paths, launch_id)
