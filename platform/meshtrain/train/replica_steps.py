"""The replica-mode part of the training loop (``fault_tolerance.mode=replica``): each step's quorum,
this group's share of the step's samples, and which group writes the run's records and checkpoints."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshtrain.checkpoint.state import Progress
from meshtrain.config import PermanentError
from meshtrain.data import DataParallelBatches
from meshtrain.distributed.layout import RankLayout
from meshtrain.distributed.replicas import Ended, ReplicaPeers
from meshtrain.observe.run_folder import ReplicaJoinedRecord, ReplicaLostRecord
from meshtrain.train.checkpointing import Checkpointing
from meshtrain.train.loop import LoopPart, StepDone, StepStart
from meshtrain.train.replica_pace import StepPace
from meshtrain.train.records import LoopOutputs
from meshtrain.train.step_log import StepLog
from meshtrain.train.watchdog import Heartbeat


class NoPeerToHeal(PermanentError):
    """A replacement replica group found no live peer to receive the run's state from."""


class EndedByPeers(RuntimeError):
    """This replica group's peers ended it while it could not take the order (frozen): it leaves as the
    order would have made it, and Ray replaces it with a group that heals from a live peer."""


@dataclass(frozen=True)
class LiveReplicas:
    """The replica groups that train this step: the step's sum over them, and its commit vote."""

    peers: ReplicaPeers
    groups: int
    deadline: float | None = None  # time.monotonic(): the peers not in the sum by then are declared hung

    def reduce(self, parameters: list[torch.nn.Parameter], loss_sum: torch.Tensor) -> bool:
        self.peers.sum_gradients(parameters, self.deadline)
        self.peers.sum(loss_sum, self.deadline)
        return self.peers.commit()


class ReplicaSteps(LoopPart):
    """Before each step: join the quorum (a group behind its peers receives a live peer's state then),
    take this group's share of the step's samples, hand the step the sum over the live groups, and let
    only the first live group write. The step log counts the time spent in quorums and in attempts a
    failed peer left uncommitted.

    ``strict``: the live groups split every sample of the step between them; otherwise each trains the
    share it has when all groups live, and the shares of the missing ones are skipped.
    ``joining``: this group replaces a lost one, so it must receive a live peer's state at its first
    quorum; it never reads a checkpoint (when every group was lost, the relaunched run does).
    ``pace``: the deadline of each step's sum; the peers that miss it are ended, and the record of the
    quorum that goes on without them names why (``hung``, ``frozen``; ``lost`` for a group that failed
    or stopped heartbeating on its own).
    """

    def __init__(
        self,
        peers: ReplicaPeers,
        strict: bool,
        layout: RankLayout,
        batches: DataParallelBatches,
        progress: Progress,
        outputs: LoopOutputs,
        checkpointing: Checkpointing,
        joining: bool,
        heartbeat: Heartbeat,
        log: StepLog,
        pace: StepPace,
    ) -> None:
        self.peers, self.strict, self.layout, self.batches = peers, strict, layout, batches
        self.progress, self.outputs, self.checkpointing, self.joining = progress, outputs, checkpointing, joining
        self.heartbeat, self.log, self.pace = heartbeat, log, pace
        self._ended: dict[int, Ended] = {}  # peer groups this group ended (hung, frozen, slow), and why
        self._carried: set[int] = set()  # of those, the ones still in the last quorum once already
        self.participants: int | None = None
        self._attempting: tuple[int, float] | None = None  # (step, when its first attempt asked for a quorum)
        self._attempt_started = 0.0

    def before_step(self, start: StepStart) -> None:
        asked = time.perf_counter()
        with self.heartbeat.excused("waiting for the replica quorum"):
            start.reduction = self.begin()
        self._attempt_started = time.perf_counter()
        self.log.waited_for_replicas(self._attempt_started - asked)
        start.step = self.progress.step + 1  # a group that joined has its peer's progress
        self.heartbeat.beat(f"training step {start.step}")

    def step_abandoned(self, start: StepStart) -> None:
        if self.peers.late:
            self._ended.update(self.peers.end_late_peers(start.step))
        self.log.waited_for_replicas(time.perf_counter() - self._attempt_started)

    def after_step(self, done: StepDone) -> bool:
        self.pace.committed(time.perf_counter() - self._attempt_started)
        return True

    def close(self) -> None:
        self.peers.close()

    def begin(self) -> LiveReplicas:
        asked = time.perf_counter()
        step = self.progress.step + 1
        if self._attempting is None or self._attempting[0] != step:
            self._attempting = (step, asked)
        before = self.peers.groups
        quorum = self.peers.quorum()
        placement = self.peers.placement
        ended_at = self.peers.was_ended(healed=quorum.healed, alone=quorum.participants == 1)
        if ended_at is not None and quorum.participants == 1:  # alone, it would train again what its peers trained
            raise EndedByPeers(f"replica group {placement.index} was ended by its peers at step {ended_at} (it missed "
                               "that step's deadline) and finds none of them live; it leaves so that Ray replaces it")
        if self.joining and not quorum.healed:
            raise NoPeerToHeal(
                f"replica group {placement.index} replaces a lost one but no live replica group is ahead of it "
                f"(step {quorum.step}): every group was lost, or the run has ended; run the same command again "
                "to resume from the newest checkpoint"
            )
        self.joining = False
        writer = quorum.rank == 0
        self.outputs.writes = writer
        self.checkpointing.writer = writer
        heal_s = time.perf_counter() - asked if quorum.healed else None
        self.outputs.replicas(quorum.participants, heal_s, quorum.received_bytes if quorum.healed else None)
        if heal_s is not None:
            assert quorum.source is not None, "a quorum that healed this group names the group it healed from"
            self.outputs.emit(ReplicaJoinedRecord(
                step=self.progress.step, replica=placement.index,
                participants=quorum.participants, seconds=heal_s, source=quorum.source,
                bytes=self._group_bytes(quorum.received_bytes), time=time.time(),
            ), any_replica=True)
        elif self.participants is not None and quorum.participants < self.participants:
            now = time.perf_counter()
            gone = before - self.peers.groups
            ended = {group: cause for group, cause in self._ended.items() if group in gone}
            self.outputs.emit(ReplicaLostRecord(
                step=self.progress.step + 1, participants=quorum.participants,
                replicas=placement.replicas, stall_s=now - self._attempting[1], quorum_s=now - asked, time=time.time(),
                cause=next(iter(ended.values()), "lost"), groups=sorted(ended) or None,
            ))
        self._forget_ended()
        self.participants = quorum.participants
        group_ranks = self.layout.data_ranks
        sharing = quorum.participants if self.strict else placement.replicas
        self.batches.resplit(quorum.rank * group_ranks + self.layout.data_rank, sharing * group_ranks,
                             self.progress.data_position)
        bound = self.pace.bound_s()
        return LiveReplicas(self.peers, quorum.participants,
                            time.monotonic() + bound if bound is not None and quorum.participants > 1 else None)

    def end_slow(self, group: int, step: int) -> bool:
        """End peer group ``group``, slower than the others, after step ``step`` (``scaling.evict_stragglers``;
        see ``ReplicaPeers.end_slow_peer``); the quorum that goes on without it names the cause."""
        if not self.peers.end_slow_peer(group, step):
            return False
        self._ended[group] = "slow"
        return True

    def _forget_ended(self) -> None:
        """After a quorum: an ended group still in it stays noted for one quorum more (a slow group ended
        after its step's commit may have asked for the next quorum before the order reached it, and is
        left out only from the one after); the others are accounted for, or never left."""
        groups = self.peers.groups
        kept = {group: cause for group, cause in self._ended.items() if group in groups and group not in self._carried}
        self._carried = set(kept)
        self._ended = kept

    def hand_over(self) -> int:
        """This group is leaving (a preemption notice): the live replica groups besides it in the last
        quorum; when there are any, leave the quorum now (no more heartbeats), so they go on without it."""
        peers = (self.participants or 1) - 1
        if peers:
            self.peers.close()
        return peers

    def _group_bytes(self, mine: int) -> int:
        """What every worker of this group received while healing (they heal together, rank to same rank)."""
        group = self.layout.control_group
        if group is None:
            return mine
        total = torch.tensor([mine], dtype=torch.int64)
        dist.all_reduce(total, group=group)
        return int(total.item())
