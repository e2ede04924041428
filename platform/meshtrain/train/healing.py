"""What a replica group that joins a running replica-mode run receives from a live peer: the same
state a checkpoint holds (model and optimizer shards, schedule, counters, RNG), the step guard's
loss history and the replica step pace (so the joining group gives its peers the same deadline from its
first step), rank to same rank, as plain tensors.

Sharded tensors travel as this rank's local shard; the receiver puts each back into the DTensor of
its own state, whose mesh and placements are the sender's (the same rank of an identical group).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from meshtrain.checkpoint.state import TrainState
from meshtrain.train.guard import StepGuard
from meshtrain.train.replica_pace import StepPace

_GUARD_TENSORS = ("bad_in_a_row", "longest_streak", "skipped", "history", "norms", "last_step", "recent")


class HealingState:
    def __init__(self, state: TrainState, guard: StepGuard, pace: StepPace) -> None:
        self.state, self.guard, self.pace = state, guard, pace

    def state_dict(self) -> dict[str, Any]:
        """The sender's side: every tensor this rank holds, local shards for DTensors."""
        return {
            "train": _local_tensors(self.state.state_dict()),
            "guard": {name: getattr(self.guard, name) for name in _GUARD_TENSORS},
            "guard_skipped_before": self.guard.skipped_before,
            "pace": torch.tensor(self.pace.recent(), dtype=torch.float64),
        }

    def load_state_dict(self, received: dict[str, Any]) -> None:
        """The joining side: ``received`` put into this rank's state, shard by shard."""
        template = self.state.state_dict()
        self.state.load_state_dict(_into(template, received["train"], "train"))
        for name in _GUARD_TENSORS:
            current = getattr(self.guard, name)
            setattr(self.guard, name, received["guard"][name].to(current.device, current.dtype))
        self.guard.skipped_before = int(received["guard_skipped_before"])
        self.pace.take_over(received["pace"].tolist())


def _local_tensors(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _local_tensors(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_local_tensors(item) for item in value]
    if isinstance(value, DTensor):
        return value.to_local()
    return value


def _into(template: Any, received: Any, where: str) -> Any:
    """``received`` in ``template``'s shape: a local shard becomes a DTensor like the template's."""
    if isinstance(template, dict):
        if not isinstance(received, dict) or template.keys() != received.keys():
            missing = sorted(map(str, template.keys() - (received.keys() if isinstance(received, dict) else set())))
            raise ValueError(f"healing state at {where}: the peer's keys differ (missing {missing[:5]})")
        return {key: _into(template[key], received[key], f"{where}.{key}") for key in template}
    if isinstance(template, list):
        return [_into(item, other, f"{where}[{index}]") for index, (item, other) in enumerate(zip(template, received))]
    if isinstance(template, DTensor):
        local = template.to_local()
        if not isinstance(received, torch.Tensor) or received.shape != local.shape:
            raise ValueError(f"healing state at {where}: the peer's shard has shape "
                             f"{getattr(received, 'shape', None)}, this rank's {tuple(local.shape)}")
        return DTensor.from_local(received.to(local.device, local.dtype), template.device_mesh, template.placements,
                                  shape=template.shape, stride=template.stride())
    return received
