"""The element-wise mean of the model weights of a run's newest committed checkpoints.

Averaging the last few checkpoints of an annealed run (Llama 3's recipe, OLMo's "soups") smooths the
noise of the final steps. :class:`AveragedModel` reads like one committed checkpoint (the exporters take
either): each tensor is read from every checkpoint in turn and summed in fp32, so the hf format, which
asks for one tensor at a time, holds one tensor and its sum at once whatever the model's size. Every
checkpoint is verified against its checksums as an export of it alone would be, and all must hold the
same model shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from meshtrain.checkpoint.reading import CommittedModel, newest_loadable
from meshtrain.checkpoint.storage import CheckpointError, CheckpointStorage
from meshtrain.config import ModelArgs
from meshtrain.model.llama import build_model, materialize


@dataclass(frozen=True)
class AveragedModel:
    """The mean of ``sources`` (newest first), read like a :class:`CommittedModel`."""

    sources: tuple[CommittedModel, ...]

    @classmethod
    def open(cls, root: str, count: int, storage_options: dict[str, Any] | None) -> "AveragedModel":
        """The newest ``count`` loadable committed checkpoints under a run's checkpoint ``root``."""
        storage = CheckpointStorage(root, storage_options)
        shown = storage.display(storage.root)
        if count < 2:
            raise CheckpointError(f"--average {count}: average at least 2 checkpoints")
        loadable = newest_loadable(storage, count)
        if len(loadable) < count:
            steps = ", ".join(str(checkpoint.step) for checkpoint in loadable) or "none"
            raise CheckpointError(
                f"--average {count}: {shown} holds {len(loadable)} loadable committed checkpoints (steps {steps}); "
                "average fewer, or give the run's checkpoint root"
            )
        sources = tuple(CommittedModel.open(storage.display(checkpoint.path), storage_options)
                        for checkpoint in loadable)
        other = next((source for source in sources if source.args != sources[0].args), None)
        if other is not None:
            raise CheckpointError(
                f"--average {count}: step {other.committed.step} has another model shape than step "
                f"{sources[0].committed.step}; average checkpoints of one model"
            )
        return cls(sources)

    @property
    def args(self) -> ModelArgs:
        return self.sources[0].args

    @property
    def newest(self) -> str:
        """The newest averaged checkpoint's path (where the run's tokenizer is found from)."""
        return self.sources[0].storage.display(self.sources[0].committed.path)

    @property
    def steps(self) -> list[int]:
        """The averaged steps, oldest first."""
        return sorted(source.committed.step for source in self.sources)

    @property
    def manifest(self) -> dict[str, Any]:
        """The newest checkpoint's manifest, with the steps it is the mean of."""
        return {**self.sources[0].manifest, "averaged_steps": self.steps}

    def to_load(self, model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        wanted = self.sources[0].to_load(model_state)
        for source in self.sources[1:]:
            source.to_load(model_state)  # each checkpoint's metadata against the shape
        return wanted

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Fill ``state``'s tensors with the mean over the checkpoints, one tensor at a time."""
        for name, tensor in state.items():
            total = torch.zeros(tensor.shape, dtype=torch.float32)
            read = torch.empty(tensor.shape, dtype=tensor.dtype)
            for source in self.sources:
                source.load({name: read})
                total += read.float()
            tensor.copy_(total / len(self.sources))

    def full_state(self) -> dict[str, torch.Tensor]:
        """The averaged model as fp32 CPU tensors (a tied embedding is one tensor under both names)."""
        model = materialize(build_model(self.args, "meta"), "cpu")
        self.load(self.to_load(model.state_dict()))
        return model.state_dict()
