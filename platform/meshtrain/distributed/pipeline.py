"""Pipeline parallel on paper: torch's own schedules, their timeline, and how the layers split over stages.

The schedules are torch's (``torch.distributed.pipelining.schedules``). Each schedule class works out
every rank's list of compute actions (``pipeline_order``: forward ``F``, backward ``B``, or backward
split into input ``I`` and weight ``W`` gradients) when it is constructed, reading of its stages only
their indices and counts. Given stand-ins for rank 0's stages it builds the whole order with no process
group, device or model, so the driver plans with the very order the workers will run. (GPipe and 1F1B run a
loop of their own and keep the order for display, where torch 2.13's 1F1B numbers the last rank's forwards
from 1: their orders are renumbered as their loops run, see :func:`schedule_order`.)

The order says what each rank does, not when; :func:`simulate` gives it times. Cost model: a stage's
forward takes ``F`` = its work (1 when every stage is alike), a full backward ``B`` = 2F, and the
zero-bubble split ``I`` = ``W`` = F; each rank runs its actions in torch's order, an action starting when
the rank is free and its inputs are done (the previous stage's forward of that micro-batch, the next
stage's input gradient, its own forward; ``W`` after its ``I``); sends and receives take no time, and
DualPipeV's overlapped forward-backward pairs run one after the other (their overlap hides communication,
which this model does not have). The
bubble is then the share of each rank's time on the step's timeline (from 0 to the last action's end)
spent idle. torch's own ``_simulate_comms_compute`` gives every action one time slot, so it finds
deadlocks but cannot weigh a backward against a forward; this one does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.distributed.pipelining import schedules as torch_schedules

from meshtrain.config import PIPELINE_SCHEDULES

Kind = Literal["F", "B", "I", "W"]
# Time of each action as a multiple of its stage's forward (the cost model above).
COST: dict[str, float] = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True)
class Action:
    """One compute action of a schedule: ``kind`` of ``stage`` on ``microbatch``."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass
class _StageStandIn:
    """What a torch schedule reads of a stage while it builds its order (nothing of a model or a group)."""

    stage_index: int
    num_stages: int
    group_size: int
    group_rank: int
    submod: Any = None  # a schedule checks it for torch.compile'd modules
    stage_index_to_group_rank: dict[int, int] | None = None

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


@dataclass(frozen=True)
class ScheduleOrder:
    """Every rank's compute actions in the order torch's schedule runs them, and the rank of each stage."""

    schedule: str
    pipeline: int
    virtual_stages: int
    microbatches: int
    actions: dict[int, tuple[Action, ...]]
    stage_rank: tuple[int, ...]

    @property
    def stages(self) -> int:
        return self.pipeline * self.virtual_stages

    def stages_of(self, rank: int) -> list[int]:
        """The stages pipeline rank ``rank`` holds, in stage order."""
        return [stage for stage, holder in enumerate(self.stage_rank) if holder == rank]


def local_stage_indices(schedule: str, pipeline: int, virtual_stages: int, rank: int) -> list[int]:
    """The stages rank ``rank`` holds: looped schedules rank, rank + pipeline, ...; V schedules rank and
    2 x pipeline - 1 - rank (torch's ``generate_stage_to_rank_mapping`` styles)."""
    if PIPELINE_SCHEDULES[schedule].v_shape:
        return [rank, 2 * pipeline - 1 - rank]
    return [rank + loop * pipeline for loop in range(virtual_stages)]


def schedule_order(schedule: str, pipeline: int, virtual_stages: int, microbatches: int) -> ScheduleOrder:
    """torch's order for ``schedule`` with ``pipeline`` ranks of ``virtual_stages`` stages each and
    ``microbatches`` micro-batches. ValueError (torch's reason) when torch refuses the layout."""
    num_stages = pipeline * virtual_stages
    stages = [_StageStandIn(index, num_stages, pipeline, 0)
              for index in local_stage_indices(schedule, pipeline, virtual_stages, 0)]
    cls = torch_schedules.get_schedule_class(schedule)
    try:
        if issubclass(cls, torch_schedules.PipelineScheduleSingle):
            if virtual_stages != 1:
                raise ValueError(f"{schedule} runs one stage per rank")
            built = cls(stages[0], n_microbatches=microbatches)
        else:
            built = cls(stages, n_microbatches=microbatches)
    except (ValueError, RuntimeError, AssertionError) as exc:  # torch's own checks of the layout
        raise ValueError(" ".join(str(exc).split())) from None
    except (AttributeError, TypeError) as exc:  # a torch whose schedule reads more of a stage than its indices
        raise ValueError(f"torch {torch.__version__} builds {schedule} from more than stage indices, so it cannot be "
                         f"planned here ({type(exc).__name__}: {exc})") from None
    order = built.pipeline_order
    assert order is not None
    mapping = getattr(built, "stage_index_to_group_rank", None) or {stage: stage for stage in range(num_stages)}
    actions = {rank: _compute_actions(order[rank]) for rank in range(pipeline)}
    if isinstance(built, torch_schedules.PipelineScheduleSingle):
        # GPipe and 1F1B run a loop of their own and keep pipeline_order for display, where torch 2.13's 1F1B
        # numbers the last rank's forwards from 1. Both loops take a stage's micro-batches in turn, so the
        # k-th forward (and backward) of a stage is its micro-batch k.
        actions = {rank: _in_turn(row) for rank, row in actions.items()}
    _check_complete(actions, num_stages, microbatches, schedule)
    return ScheduleOrder(schedule, pipeline, virtual_stages, microbatches,
                         {rank: tuple(row) for rank, row in actions.items()},
                         tuple(mapping[stage] for stage in range(num_stages)))


def _in_turn(row: list[Action]) -> list[Action]:
    seen: dict[tuple[int, str], int] = {}
    renumbered = []
    for action in row:
        turn = seen.get((action.stage, action.kind), 0)
        seen[(action.stage, action.kind)] = turn + 1
        renumbered.append(Action(action.stage, action.kind, turn))
    return renumbered


def _check_complete(actions: dict[int, list[Action]], stages: int, microbatches: int, schedule: str) -> None:
    """ValueError unless every stage runs each micro-batch's forward once and its backward once (whole, or
    as input and weight gradients)."""
    done: dict[tuple[int, str], list[int]] = {}
    for row in actions.values():
        for action in row:
            done.setdefault((action.stage, action.kind), []).append(action.microbatch)
    every = list(range(microbatches))
    for stage in range(stages):
        backward = sorted(done.get((stage, "B"), []) + done.get((stage, "I"), []))
        if sorted(done.get((stage, "F"), [])) != every or backward != every or \
                sorted(done.get((stage, "W"), [])) != sorted(done.get((stage, "I"), [])):
            raise ValueError(f"{schedule}: torch's order does not run every micro-batch of stage {stage} once")


def _compute_actions(row: Sequence[Any]) -> list[Action]:
    """A rank's compute actions from torch's row: gaps and communication left out; an overlapped
    forward-backward pair (DualPipeV) as its two actions, forward first."""
    kinds = {"F", "B", "I", "W"}
    found: list[Action] = []
    for action in row:
        if action is None:
            continue
        for part in action.sub_actions or (action,):
            kind = part.computation_type.value
            if kind in kinds:
                found.append(Action(part.stage_index, kind, part.microbatch_index))
    return found


@dataclass(frozen=True)
class Timeline:
    """The simulated step: when each rank is busy, and the step's length."""

    makespan: float
    busy: tuple[float, ...]  # per rank
    finish: dict[Action, float]

    @property
    def idle(self) -> tuple[float, ...]:
        return tuple(self.makespan - busy for busy in self.busy)

    @property
    def bubble(self) -> float:
        """Idle share of all ranks' time on the step's timeline."""
        return sum(self.idle) / (self.makespan * len(self.busy))

    def rank_bubble(self, rank: int) -> float:
        return self.idle[rank] / self.makespan


def _inputs(action: Action, stages: int, backward_of: dict[tuple[int, int], Action]) -> list[Action]:
    """The actions whose results ``action`` needs."""
    stage, kind, microbatch = action.stage, action.kind, action.microbatch
    if kind == "F":
        return [Action(stage - 1, "F", microbatch)] if stage > 0 else []
    if kind == "W":
        return [Action(stage, "I", microbatch)]
    needed = [Action(stage, "F", microbatch)]
    if stage < stages - 1:
        needed.append(backward_of[(stage + 1, microbatch)])  # the next stage's input gradient: its B or its I
    return needed


def simulate(order: ScheduleOrder, work: Callable[[int], float] = lambda stage: 1.0) -> Timeline:
    """Times for ``order`` under the module's cost model; ``work(stage)`` is a stage's forward time.
    ValueError when the order cannot finish (an action waits on one that never comes)."""
    backward_of = {(a.stage, a.microbatch): a for actions in order.actions.values() for a in actions
                   if a.kind in ("B", "I")}
    finish: dict[Action, float] = {}
    free = [0.0] * order.pipeline
    busy = [0.0] * order.pipeline
    position = [0] * order.pipeline
    remaining = sum(len(actions) for actions in order.actions.values())
    while remaining:
        progressed = False
        for rank in range(order.pipeline):
            actions = order.actions[rank]
            while position[rank] < len(actions):
                action = actions[position[rank]]
                inputs = _inputs(action, order.stages, backward_of)
                if any(needed not in finish for needed in inputs):
                    break
                start = max([free[rank], *(finish[needed] for needed in inputs)])
                took = COST[action.kind] * work(action.stage)
                finish[action] = free[rank] = start + took
                busy[rank] += took
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {rank: str(order.actions[rank][position[rank]]) for rank in range(order.pipeline)
                     if position[rank] < len(order.actions[rank])}
            raise ValueError(f"{order.schedule}: the order cannot finish; ranks wait at {stuck}")
    return Timeline(max(free), tuple(busy), finish)


def bubble_fraction(schedule: str, pipeline: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The bubble of ``schedule`` with every stage alike (the cost model of the module docstring)."""
    return simulate(schedule_order(schedule, pipeline, virtual_stages, microbatches)).bubble


def peak_in_flight(order: ScheduleOrder, rank: int, weight: Callable[[int], float]) -> float:
    """The most that rank ``rank`` keeps for backward at once, walking its actions in order: a forward
    adds ``weight(stage)`` (a micro-batch's activations of that stage), a full backward frees it, and a
    split backward frees it at ``W`` (the weight gradient still reads the layers' inputs after ``I``:
    an upper bound)."""
    live = peak = 0.0
    for action in order.actions[rank]:
        if action.kind == "F":
            live += weight(action.stage)
            peak = max(peak, live)
        elif action.kind in ("B", "W"):
            live -= weight(action.stage)
    return peak


def balanced_split(layers: int, least: Sequence[int], cost: Callable[[int, int], int]) -> list[int]:
    """Layers per pipeline rank (rank ``r`` at least ``least[r]``, one per stage it holds; all summing to
    ``layers``) that make the costliest rank as cheap as it can be, ``cost(r, k)`` being what rank ``r``
    costs with ``k`` layers (not decreasing in ``k``). Of the splits that reach it, layers leave the costliest
    ranks first, the earlier giving way on a tie (under 1F1B it keeps more micro-batches in flight)."""
    ranks = len(least)
    if ranks < 1 or min(least) < 1 or layers < sum(least):
        raise ValueError(f"{layers} layers cannot fill {sum(least)} stages")
    spare = layers - sum(least)  # the most one rank can take beyond its least

    def room(bound: int) -> list[int]:
        """Per rank, the most layers it can take within ``bound`` (0 when not even its least fits)."""
        found = []
        for rank in range(ranks):
            low, high = least[rank] - 1, least[rank] + spare
            while low < high:
                middle = (low + high + 1) // 2
                low, high = (middle, high) if cost(rank, middle) <= bound else (low, middle - 1)
            found.append(low if low >= least[rank] else 0)
        return found

    bounds = sorted({cost(rank, k) for rank in range(ranks) for k in range(least[rank], least[rank] + spare + 1)})
    low, high = 0, len(bounds) - 1
    while low < high:  # the smallest bound under which the ranks can take every layer
        middle = (low + high) // 2
        fits = room(bounds[middle])
        if all(fits) and sum(fits) >= layers:
            high = middle
        else:
            low = middle + 1
    split = room(bounds[low])
    for _ in range(sum(split) - layers):  # take the surplus from the costliest ranks
        costliest = max((rank for rank in range(ranks) if split[rank] > least[rank]),
                        key=lambda rank: (cost(rank, split[rank]), -rank))
        split[costliest] -= 1
    return split


def stage_split(order: ScheduleOrder, rank_layers: Sequence[int]) -> list[int]:
    """Each stage's layers from its rank's: a rank's layers shared evenly over its stages, the ones left over
    going to its earliest stages, the output head's stage last (the head is work of its own)."""
    last = order.stages - 1
    split = [0] * order.stages
    for rank, total in enumerate(rank_layers):
        held = order.stages_of(rank)
        each, left = divmod(total, len(held))
        takers = sorted(held, key=lambda stage: (stage == last, stage))[:left]
        for stage in held:
            split[stage] = each + (stage in takers)
    return split
