"""How a run survives a lost worker: the whole group restarts from a checkpoint, or only the lost
replica group is replaced while the others keep stepping (``fault_tolerance``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import Field, model_validator

from meshtrain.config.section import MAX_DURATION_S, Section


class FaultToleranceConfig(Section):
    mode: Literal["restart", "replica"] = Field(
        "restart",
        description=(
            "restart: a lost worker ends its whole worker group; Ray Train restarts every rank from the newest "
            "committed checkpoint. replica: each replica group (a pipeline x shard x context x tensor group of workers, one "
            "copy of the model) trains under a per-step quorum (torchft, pip install -e '.[ft]'); a lost replica "
            "stops only its own group, the others keep stepping, and its replacement receives the model and "
            "optimizer state from a live peer's memory."
        ),
    )
    data: Literal["strict", "fast"] = Field(
        "strict",
        description=(
            "fault_tolerance.mode=replica: strict trains every sample of every step (the live replicas take a lost "
            "one's share as extra micro-batches, so each step equals an unbroken run's); fast skips the lost "
            "replica's share and records the skipped sample ranges."
        ),
    )
    min_replicas: int = Field(
        1, ge=1, description="fault_tolerance.mode=replica: the fewest live replica groups a step may commit with."
    )
    heartbeat_timeout_s: float = Field(
        5.0, gt=0, le=MAX_DURATION_S, description="fault_tolerance.mode=replica: a replica silent this long is dropped from the next quorum."
    )
    quorum_timeout_s: float = Field(
        900.0, gt=0, le=MAX_DURATION_S,
        description="fault_tolerance.mode=replica: how long a step waits for a quorum of fault_tolerance.min_replicas. "
        "A hung replica group heartbeats until its hang watchdog ends it, and a quorum of two groups waits for it, "
        "so this must outlast run.hang_timeout_s + 5 s + fault_tolerance.heartbeat_timeout_s.",
    )
    join_timeout_s: float = Field(
        10.0, ge=0, le=MAX_DURATION_S,
        description="fault_tolerance.mode=replica: how long a quorum waits for replica groups that have not joined yet.",
    )
    max_uncommitted_steps: int = Field(
        10, ge=1,
        description="fault_tolerance.mode=replica: a replica group whose step fails to commit this many times in a row "
        "stops (Ray then replaces it).",
    )
    timeout_s: float = Field(
        60.0, gt=0, le=MAX_DURATION_S,
        description="fault_tolerance.mode=replica: the cross-replica collectives' and healing transfer's timeout.",
    )
    hang_factor: float = Field(
        2.5, ge=1.5, le=100,
        description="fault_tolerance.mode=replica: a replica group that has not reached the cross-replica sum of a step "
        "this many times the median of the step's recent durations after the step began (and at least "
        "fault_tolerance.hang_floor_s) is declared hung by its peers: they stop waiting for it, and the lighthouse ends "
        "its workers so Ray replaces the group.",
    )
    hang_floor_s: float = Field(
        8.0, gt=0, le=MAX_DURATION_S,
        description="fault_tolerance.mode=replica: the shortest wait before a peer replica group is declared hung, "
        "whatever the step time (a loaded machine's jitter, a step that compiles).",
    )

    @model_validator(mode="after")
    def _replica_settings_need_replica_mode(self) -> FaultToleranceConfig:
        ignored = self._ignored_in_restart_mode()
        if ignored:
            named = ", ".join(f"fault_tolerance.{name}={getattr(self, name)}" for name in ignored)
            raise ValueError(
                f"{named}: read only in fault_tolerance.mode=replica, and the mode is restart; set "
                f"fault_tolerance.mode=replica, or drop {'them' if len(ignored) > 1 else 'it'}"
            )
        return self

    def _ignored_in_restart_mode(self) -> list[str]:
        """The replica-only settings (all but ``mode``) given away from their defaults while the mode is restart.
        One given at its default passes: a config printed by --dry-run or saved with a run names every setting."""
        if self.mode != "restart":
            return []
        fields = type(self).model_fields
        return [name for name in fields if name != "mode" and name in self.model_fields_set
                and getattr(self, name) != fields[name].default]


# The hang watchdog looks at most this often (train.hangs.watch_period_s), so a hung group stops
# heartbeating within run.hang_timeout_s plus this.
WATCH_PERIOD_MAX_S = 5.0


def check_quorum_outlasts_hangs(ft: FaultToleranceConfig, hang_timeout_s: float | None) -> None:
    """ValueError when a hung replica group could outlast the other groups' quorum: it keeps heartbeating
    until its hang watchdog fires, and torchft's lighthouse forms a quorum only from a majority of the
    groups that heartbeat, so with two groups the healthy one waits for it."""
    if hang_timeout_s is None:
        return
    needed = hang_timeout_s + WATCH_PERIOD_MAX_S + ft.heartbeat_timeout_s
    if ft.quorum_timeout_s <= needed:
        raise ValueError(
            f"fault_tolerance.quorum_timeout_s={ft.quorum_timeout_s:g} does not outlast a hung replica group, which "
            f"heartbeats until its watchdog ends it (run.hang_timeout_s={hang_timeout_s:g} + {WATCH_PERIOD_MAX_S:g} s + "
            f"fault_tolerance.heartbeat_timeout_s={ft.heartbeat_timeout_s:g}): the others' quorum would time out "
            f"first; raise fault_tolerance.quorum_timeout_s above {needed:g}, or lower run.hang_timeout_s"
        )


def check_replica_mode(
    ft: FaultToleranceConfig, num_workers: int, group_workers: int, group_data_ranks: int, elastic: bool,
    batch_layout: Callable[[int], object],
) -> int:
    """The number of replica groups of a replica-mode run, or ValueError naming the setting to change.

    ``group_workers``: the workers of one replica group (pipeline x shard x context x tensor); ``group_data_ranks``:
    its data-parallel ranks; ``batch_layout(data_ranks)`` raises when the global batch does not split.
    """
    if num_workers % group_workers or num_workers // group_workers < 2:
        raise ValueError(
            f"fault_tolerance.mode=replica needs at least 2 replica groups: scaling.num_workers={num_workers} over "
            f"groups of {group_workers} workers (parallel.pipeline x shard x context x tensor) makes "
            f"{num_workers / group_workers:g}; use a multiple of {group_workers} of at least {2 * group_workers} workers, "
            "or a smaller parallel.shard"
        )
    replicas = num_workers // group_workers
    if ft.min_replicas > replicas:
        raise ValueError(
            f"fault_tolerance.min_replicas={ft.min_replicas} exceeds the run's {replicas} replica groups; "
            f"use 1..{replicas}"
        )
    if elastic:
        raise ValueError(
            "scaling.min_workers (elastic worker groups) and fault_tolerance.mode=replica both shrink the run; "
            "replica mode goes on with fewer replica groups down to fault_tolerance.min_replicas: unset scaling.min_workers"
        )
    if ft.data == "strict":
        for live in range(ft.min_replicas, replicas + 1):  # the live replicas split each step's samples
            try:
                batch_layout(live * group_data_ranks)
            except ValueError as exc:
                raise ValueError(
                    f"fault_tolerance.data=strict splits each step over the live replica groups; with {live} of "
                    f"{replicas} live: {exc} (or raise fault_tolerance.min_replicas, or use fault_tolerance.data=fast)"
                ) from None
    return replicas
