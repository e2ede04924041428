"""What a checkpoint holds: the model, optimizer and scheduler state, how far training got, and
every random generator, as one ``Stateful`` object for ``dcp.save``/``dcp.load``."""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor


# An optimizer state keyed by group index ("optimizer.param_groups.0.lr", with the group's parameter names in
# "optimizer.param_groups.0.params"): how checkpoints before pipeline parallel kept it. Since, every entry is
# keyed by its parameter's name ("optimizer.param_groups.layers.0.attention.wq.weight.lr"), and no key lists
# parameters: with the index, the pipeline stages' groups 0 would be one entry, which only one stage's
# parameters list.
_BY_GROUP_INDEX = re.compile(r"(^|\.)optimizer\.param_groups\.\d+\.params$")


def optimizer_by_name(flat: bool = True) -> StateDictOptions:
    """The optimizer state's layout in a checkpoint: by parameter name (``flat``), or by group index."""
    return StateDictOptions(flatten_optimizer_state_dict=flat)


def keeps_optimizer_by_name(metadata: Metadata) -> bool:
    """Whether a checkpoint keeps its optimizer state by parameter name (every one written since pipeline
    parallel), rather than by group index."""
    return not any(_BY_GROUP_INDEX.search(key) for key in metadata.state_dict_metadata)


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
        self.optimizer_by_name = True  # False to read a checkpoint that keeps it by group index

    def state_dict(self) -> dict[str, Any]:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer,
                                                      options=optimizer_by_name(self.optimizer_by_name))
        state: dict[str, Any] = {
            "model": plain_tensors(model_state),
            "optimizer": plain_tensors(optimizer_state),
            "scheduler": self.scheduler.state_dict(),
            "progress": {key: torch.tensor(value) for key, value in vars(self.progress).items()},
        }
        if self.include_rng:
            state[f"rng_rank{self.rank}"] = _rng_state()
        return state

    def nbytes(self) -> int:
        """About the bytes a checkpoint of this state takes: the weights and the optimizer's tensors,
        at their full (unsharded) size."""
        tensors = [*self.model.parameters()]
        for entry in self.optimizer.state.values():
            tensors += [value for value in entry.values() if isinstance(value, torch.Tensor)]
        return sum(tensor.numel() * tensor.element_size() for tensor in tensors)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
            options=optimizer_by_name(self.optimizer_by_name),
        )
        self.scheduler.load_state_dict(state["scheduler"])
        for key, value in state["progress"].items():
            setattr(self.progress, key, int(value))
        if self.include_rng:
            _set_rng_state(state[f"rng_rank{self.rank}"])


def plain_tensors(value: Any) -> Any:
    """``value`` (a nested state dict) with every tensor subclass that only wraps one tensor of its
    own shape and dtype replaced by that tensor, sharing its storage; DTensors keep their sharding.

    torchao's float8 weights are such wrappers (and optimizer moments created with ``zeros_like``
    from them). Saved as they are, DCP would pickle the subclass: the checkpoint could not be read
    without torchao, nor loaded into a run without float8. Since the inner tensor is the parameter's
    storage, an in-place DCP load into it restores the weight too.
    """
    if isinstance(value, dict):
        return {key: plain_tensors(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_tensors(item) for item in value]
    if isinstance(value, DTensor):
        inner = _wrapped(value._local_tensor)
        if inner is None:
            return value
        return DTensor.from_local(
            inner, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
        )
    if isinstance(value, torch.Tensor):
        inner = _wrapped(value)
        return value if inner is None else inner
    return value


def _wrapped(tensor: torch.Tensor) -> torch.Tensor | None:
    """The one tensor a wrapper subclass holds in place of itself, or None (not such a wrapper)."""
    if type(tensor) in (torch.Tensor, torch.nn.Parameter) or not hasattr(tensor, "__tensor_flatten__"):
        return None
    names, _ = tensor.__tensor_flatten__()
    if len(names) != 1:
        return None
    inner = getattr(tensor, names[0])
    if type(inner) is not torch.Tensor or inner.shape != tensor.shape or inner.dtype != tensor.dtype:
        return None
    return inner


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
