"""Where a hung group is stuck: the collective that never completed and the ranks that never entered it.

torch 2.13's flight recorder keeps, per process, a ring of the last collectives of every process
group (gloo's as well as NCCL's) once ``TORCH_FR_BUFFER_SIZE`` is set before the group is created
(the launcher sets it for Ray's workers, ``run.flight_recorder_entries``): the group's name (the
same on every rank), the collective's sequence number in it, the op, and whether it completed.
That covers FSDP's own collectives, which meshtrain never sees.

When the hang watchdog fires, :class:`HangReport` writes this rank's record and its groups to
``<run dir>/hangs/rank<R>.json`` and waits a bounded time for the other ranks' files. The lowest
rank that wrote one prints one line (:func:`diagnose`) and writes it to ``hangs/diagnosis.txt``;
the others wait for that before their process exits, so Ray does not tear the reporter down first,
and write it themselves when it does not come. A rank that wrote nothing (frozen, dead, or still
making progress) is named as such: the line appears whatever state the other ranks are in. The
files of an earlier hang of the run are told apart by time: they predate this rank's last progress.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.config import one_line
from meshtrain.config.fault_tolerance import WATCH_PERIOD_MAX_S

FLIGHT_RECORDER_ENVS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # torch reads the first set
DIAGNOSIS = "diagnosis.txt"
POLL_S = 0.5


def watch_period_s(hang_timeout_s: float) -> float:
    """How often a rank's watchdog looks: the ranks of one hang fire within about this of each other."""
    return min(WATCH_PERIOD_MAX_S, hang_timeout_s / 4)


def wait_for_peers_s(hang_timeout_s: float) -> float:
    """How long a firing rank waits for the other ranks' dumps: three watchdog periods, or a tenth of
    the timeout (at most a minute) for a network file system slow to show new files."""
    return min(60.0, max(3 * watch_period_s(hang_timeout_s), hang_timeout_s / 10))


def flight_recorder_on(environ: Mapping[str, str] = os.environ) -> bool:
    for name in FLIGHT_RECORDER_ENVS:
        if name in environ:
            return environ[name].strip() not in ("", "0")
    return False


def recorded_collectives() -> list[dict[str, Any]]:
    """This process's flight-recorder entries, oldest first: the CPU recorder's (gloo's collectives)
    and, in a CUDA build of torch, the NCCL recorder's, a separate one."""
    c10d = torch._C._distributed_c10d
    entries: list[dict[str, Any]] = []
    for name in ("_dump_fr_trace_json", "_dump_nccl_trace_json"):
        dump = getattr(c10d, name, None)
        if dump is not None:
            entries += json.loads(dump()).get("entries", [])
    return sorted(entries, key=lambda entry: entry["time_created_ns"])


def process_groups() -> dict[str, dict[str, Any]]:
    """The process groups this rank belongs to, by name (what the flight recorder names them by)."""
    if not dist.is_initialized():
        return {}
    from torch.distributed.distributed_c10d import _world  # every group of this process, with its name

    return {
        name: {"desc": group.group_desc, "ranks": dist.get_process_group_ranks(group)}
        for group, name in list(_world.pg_names.items())
    }


@dataclass(frozen=True)
class Collective:
    group: str
    backend: str  # a group's gloo and NCCL backends number their collectives apart
    seq: int
    op: str
    pending: bool
    created_ns: int

    @property
    def key(self) -> tuple[str, str, int]:
        return self.group, self.backend, self.seq

    def name(self, groups: dict[str, tuple[str, list[int]]]) -> str:
        desc, ranks = groups.get(self.group, ("", []))
        desc = "" if desc == "undefined" else desc  # a group created without a description
        about = ", ".join(part for part in (desc, f"ranks {ranges(ranks)}" if ranks else "") if part)
        return f"{self.op} #{self.seq} on process group {self.group}" + (f" ({about})" if about else "")


@dataclass(frozen=True)
class RankDump:
    """What one rank wrote when its watchdog fired (read back from untrusted storage: checked)."""

    rank: int
    doing: str
    groups: dict[str, tuple[str, list[int]]]
    collectives: list[Collective]

    @classmethod
    def parse(cls, data: Any) -> RankDump:
        """ValueError unless ``data`` is a dump as :class:`HangReport` writes it."""
        try:
            groups = {str(name): (str(group["desc"]), [int(rank) for rank in group["ranks"]])
                      for name, group in data["groups"].items()}
            collectives = [
                Collective(
                    group=str(entry["process_group"][0]),
                    backend=str(entry["profiling_name"]).split(":")[0],
                    seq=int(entry["collective_seq_id"]),
                    op=str(entry["profiling_name"]),
                    pending=not entry["retired"] and entry.get("state") != "completed",
                    created_ns=int(entry["time_created_ns"]),
                )
                for entry in data["entries"]
                if not entry["is_p2p"]  # meshtrain issues no point-to-point ops
            ]
            return cls(int(data["rank"]), str(data["doing"]), groups, collectives)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise ValueError(f"not a hang dump ({one_line(exc)})") from None

    def last_seq(self, group: str, backend: str) -> int:
        """The newest collective of that group this rank entered (0: none recorded)."""
        return max((c.seq for c in self.collectives if (c.group, c.backend) == (group, backend)), default=0)

    def pending(self) -> list[Collective]:
        return [c for c in self.collectives if c.pending]


def ranges(ranks: Iterable[int]) -> str:
    """0, 1, 2, 5 -> '0-2, 5'."""
    spans: list[list[int]] = []
    for rank in sorted(set(ranks)):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def _ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {ranges(ranks)}"


def diagnose(dumps: dict[int, RankDump], world_size: int, folder: Path) -> str:
    """One line: the collective the group is stuck in and the ranks that never entered it."""
    groups: dict[str, tuple[str, list[int]]] = {}
    for dump in dumps.values():
        groups.update(dump.groups)
    silent = sorted(set(range(world_size)) - set(dumps))
    no_dump = f"; no dump from {_ranks(silent)} (frozen, gone, or still making progress)" if silent else ""
    waiting: dict[tuple[str, str, int], list[tuple[int, Collective]]] = {}
    for rank, dump in dumps.items():
        for collective in dump.pending():
            waiting.setdefault(collective.key, []).append((rank, collective))
    if not waiting:
        doing = "; ".join(f"rank {rank} while {dumps[rank].doing}" for rank in sorted(dumps))
        return (f"[meshtrain] hang: no collective was in flight on the ranks that wrote a dump ({doing}): stuck "
                f"outside collectives{no_dump}; dumps in {folder}")
    busy = {rank for entries in waiting.values() for rank, _ in entries}

    def members(key: tuple[str, str, int]) -> list[int]:
        return groups.get(key[0], ("", []))[1] or sorted(rank for rank, _ in waiting[key])

    def missing(key: tuple[str, str, int]) -> list[int]:
        group, backend, seq = key
        return [rank for rank in members(key)
                if rank not in dumps or dumps[rank].last_seq(group, backend) < seq]

    def blame(key: tuple[str, str, int]) -> tuple[bool, int, int]:
        # The root of a chain of waits: a collective that a rank waiting in nothing never entered.
        return (any(rank not in busy for rank in missing(key)), len(waiting[key]),
                -min(c.created_ns for _, c in waiting[key]))

    stuck = max(waiting, key=blame)
    collective = waiting[stuck][0][1]
    line = (f"[meshtrain] hang: {collective.name(groups)} never completed: "
            f"{_ranks(rank for rank, _ in waiting[stuck])} wait{'s' if len(waiting[stuck]) == 1 else ''} in it")
    absent = missing(stuck)
    if not absent:
        line += "; every member entered it (a transport fault, or members that called it differently)"
    # Ranks in the same state share one clause, so a line about a large group stays short.
    states: dict[str, list[int]] = {}
    for rank in absent:
        if rank in dumps:
            dump = dumps[rank]
            elsewhere = [c for c in dump.pending() if c.key != stuck]
            last = dump.last_seq(stuck[0], stuck[1])
            where = (f"waits in {elsewhere[0].name(groups)}" if elsewhere else
                     f"last there: #{last}" if last else "none recorded there")
            states.setdefault(f"{where}, while {dump.doing}", []).append(rank)
    for state, ranks in states.items():
        line += f"; {_ranks(ranks)} never entered it ({state})"
    return line + no_dump + f"; dumps in {folder}"


def _stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class HangReport:
    """What a firing watchdog does before its process exits (see the module's docstring)."""

    def __init__(
        self,
        folder: Path,
        rank: int,
        world_size: int,
        wait_s: float,
        log: Callable[[str], None] = _stderr,
        collectives: Callable[[], list[dict[str, Any]]] = recorded_collectives,
        groups: Callable[[], dict[str, dict[str, Any]]] = process_groups,
    ) -> None:
        self.folder, self.rank, self.world_size, self.wait_s = folder, rank, world_size, wait_s
        self.log, self.collectives, self.groups = log, collectives, groups

    @classmethod
    def of(cls, folder: Path, rank: int, world_size: int, hang_timeout_s: float) -> HangReport | None:
        """The report of this rank, or None when the flight recorder is off in this process."""
        return cls(folder, rank, world_size, wait_for_peers_s(hang_timeout_s)) if flight_recorder_on() else None

    def __call__(self, doing: str, silent_s: float) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        dump = {"rank": self.rank, "world_size": self.world_size, "written": time.time(), "doing": doing,
                "groups": self.groups(), "entries": self.collectives()}
        mine = self._write(f"rank{self.rank}.json", json.dumps(dump))
        # This rank's last progress, on the storage's clock (file times; nodes' clocks may differ):
        # files older than it are an earlier hang's.
        since = mine.stat().st_mtime - silent_s
        deadline = time.monotonic() + self.wait_s
        while not self._lower_rank_reports(since) and time.monotonic() < deadline:
            if all(self._fresh(self._dump_path(rank), since) for rank in range(self.world_size)):
                break
            time.sleep(POLL_S)
        if self._lower_rank_reports(since):
            # It may have fired up to a watchdog period later than this rank; should it freeze before
            # writing its diagnosis, this rank writes one.
            deadline = time.monotonic() + self.wait_s
            while time.monotonic() < deadline:
                if self._fresh(self.folder / DIAGNOSIS, since):
                    return
                time.sleep(POLL_S)
        line = diagnose(self._read_dumps(since), self.world_size, self.folder)
        self._write(DIAGNOSIS, line + "\n")
        self.log(line)

    def _dump_path(self, rank: int) -> Path:
        return self.folder / f"rank{rank}.json"

    def _write(self, name: str, text: str) -> Path:
        partial, path = self.folder / f".{name}.{os.getpid()}.partial", self.folder / name
        partial.write_text(text)
        partial.replace(path)
        return path

    @staticmethod
    def _fresh(path: Path, since: float) -> bool:
        try:
            return path.stat().st_mtime >= since
        except FileNotFoundError:
            return False

    def _lower_rank_reports(self, since: float) -> bool:
        """Whether a lower rank wrote its dump for this hang: the lowest one reports."""
        return any(self._fresh(self._dump_path(rank), since) for rank in range(self.rank))

    def _read_dumps(self, since: float) -> dict[int, RankDump]:
        dumps = {}
        for rank in range(self.world_size):
            path = self._dump_path(rank)
            if not self._fresh(path, since):
                continue
            try:
                dump = RankDump.parse(json.loads(path.read_text()))
            except (OSError, ValueError):  # unreadable or not a dump: as if that rank wrote none
                continue
            if dump.rank == rank:
                dumps[rank] = dump
        return dumps
