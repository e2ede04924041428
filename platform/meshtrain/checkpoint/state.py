"""What a checkpoint holds: the model, optimizer and scheduler state, how far training got, and
every random generator, as one ``Stateful`` object for ``dcp.save``/``dcp.load``."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful


@dataclass
class Progress:
    """How far training got: restored with the weights so the run continues where it stopped."""

    step: int = 0
    tokens: int = 0
    data_position: int = 0
    skipped_steps: int = 0  # steps the guard skipped (non-finite or spiking loss)


class TrainState(Stateful):
    """Everything a checkpoint holds, handed to ``dcp.save``/``dcp.load`` as one object.

    Model and optimizer state stay sharded (DTensors), so each rank reads and writes only its own
    shards and DCP reshards them when the mesh changes. RNG state is kept per rank; it is restored
    only when the world size is unchanged (with another layout, ranks keep the seeded state).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        progress: Progress,
        rank: int,
    ) -> None:
        self.model, self.optimizer, self.scheduler, self.progress, self.rank = model, optimizer, scheduler, progress, rank
        self.include_rng = True

    def state_dict(self) -> dict[str, Any]:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state: dict[str, Any] = {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict(),
            "progress": {key: torch.tensor(value) for key, value in vars(self.progress).items()},
        }
        if self.include_rng:
            state[f"rng_rank{self.rank}"] = _rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        self.scheduler.load_state_dict(state["scheduler"])
        for key, value in state["progress"].items():
            setattr(self.progress, key, int(value))
        if self.include_rng:
            _set_rng_state(state[f"rng_rank{self.rank}"])


def _rng_state() -> dict[str, torch.Tensor]:
    """Every generator's state as tensors (DCP stores tensors as data; nothing is unpickled on load)."""
    python_version, python_mt, python_gauss = random.getstate()
    _, numpy_keys, numpy_pos, numpy_has_gauss, numpy_gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python_version": torch.tensor(python_version),
        "python_mt": torch.tensor(python_mt, dtype=torch.int64),
        "python_gauss": torch.tensor(math.nan if python_gauss is None else python_gauss, dtype=torch.float64),
        "numpy_keys": torch.from_numpy(numpy_keys.astype(np.int64)),
        "numpy_pos": torch.tensor(numpy_pos),
        "numpy_has_gauss": torch.tensor(numpy_has_gauss),
        "numpy_gauss": torch.tensor(numpy_gauss, dtype=torch.float64),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    gauss = float(state["python_gauss"])
    python_gauss = None if math.isnan(gauss) else gauss
    random.setstate((int(state["python_version"]), tuple(state["python_mt"].tolist()), python_gauss))
    np.random.set_state((
        "MT19937", state["numpy_keys"].numpy().astype(np.uint32), int(state["numpy_pos"]),
        int(state["numpy_has_gauss"]), float(state["numpy_gauss"]),
    ))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
