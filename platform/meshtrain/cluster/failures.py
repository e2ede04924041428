"""Why a worker group failed, in one line, and whether restarting it can help.

Ray Train restarts a failed group up to ``run.max_failures`` times whatever the error was. A
restart helps when a worker or node was lost, a collective hung or timed out, or the job was
preempted; it cannot help when the input is wrong: a config error, corrupt data or checkpoints, no
loadable checkpoint, a storage path without space or permission. Those fail the same way every time,
so :class:`meshtrain.cluster.ray_trainer.StopOnPermanentFailure` (Ray's own failure policy, handed
to its controller the way the elastic policy is) stops the run at the first one, and the driver's final line names it.

Every worker stamps what it raises with its rank, node and time (:func:`stamp`); the stamps travel
with the exception (Ray pickles it with its ``__dict__``), so the driver can tell the rank that failed
first from the ranks that only lost a peer.
"""

from __future__ import annotations

import errno
import re
import time
from dataclasses import dataclass

from meshtrain.config import ConfigError, PermanentError, one_line

# Storage errors a restart cannot fix: the same path fails the same way on the next start.
PERMANENT_ERRNOS = frozenset({
    errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG,
    errno.EADDRNOTAVAIL,  # a bind address the node does not have
})
# Errors the same start raises again: memory a tensor of this shape cannot get (host or device, outside
# a step: a step's is DeviceOutOfMemory), a weights file that is not valid safetensors, and a number too
# large for what it is converted to (a setting's seconds in milliseconds, say).
_PERMANENT_TYPES = frozenset({"MemoryError", "OutOfMemoryError", "SafetensorError", "OverflowError"})
_HOST_ALLOCATION = re.compile(r"DefaultCPUAllocator: (can't allocate memory|not enough memory)")
# What the ranks that only lost a peer (one that died, ran out of memory or failed first) report.
_PEER_LOST = re.compile(
    r"gloo|nccl|connection reset|closed by peer|remote worker|ProcessGroup|Connection refused|Broken pipe", re.IGNORECASE
)
# The last "Type: message" line of a traceback printed into an error's message (Ray's wrappers).


def is_permanent(exc: BaseException) -> bool:
    """Whether a restart of the worker group would fail the same way (an error class may say a restart
    can help: a store that did not answer in time)."""
    if getattr(exc, "restart_may_help", False):
        return False
    if isinstance(exc, (ConfigError, PermanentError)):
        return True
    if type(exc).__name__ in _PERMANENT_TYPES or _HOST_ALLOCATION.search(str(exc)):
        return True
    return isinstance(exc, OSError) and exc.errno in PERMANENT_ERRNOS


def stamp(exc: BaseException, rank: int, node: str | None) -> None:
    """Record on ``exc`` where and when it was raised (kept when Ray sends it to the driver)."""
    try:
        exc.meshtrain_rank, exc.meshtrain_node = rank, node  # type: ignore[attr-defined]
        exc.meshtrain_time = time.time()  # type: ignore[attr-defined]
    except AttributeError:  # an exception type without a __dict__: the rank Ray reports still names it
        pass


@dataclass(frozen=True)
class Failure:
    """The error that ended a worker group: where it was raised, and whether a restart can help."""

    rank: int | None
    node: str | None
    error: str  # "Type: message", one line
    permanent: bool
    other_ranks: int = 0  # how many more ranks failed (mostly peers of this one)

    def describe(self) -> str:
        where = "" if self.rank is None else f"rank {self.rank}{f' on {self.node}' if self.node else ''}: "
        others = f" (+{self.other_ranks} other rank(s) failed)" if self.other_ranks else ""
        return f"{where}{self.error}{others}"


def root_failure(exc: BaseException) -> Failure:
    """The failure under Ray's wrappers: of a worker group's errors, a permanent one first, then the
    earliest that is not a rank losing its peer, then the lowest rank."""
    root = _unwrapped(exc)
    failures = getattr(root, "worker_failures", None)
    if not (isinstance(failures, dict) and failures):
        return Failure(None, None, _line(root), is_permanent(root))
    errors = {rank: _unwrapped(error) for rank, error in failures.items() if isinstance(error, BaseException)}
    if not errors:
        return Failure(None, None, one_line(root), False)

    def order(item: tuple[int, BaseException]) -> tuple[bool, bool, float, int]:
        rank, error = item
        stamped = getattr(error, "meshtrain_time", None)
        return (not is_permanent(error), bool(_PEER_LOST.search(str(error))), stamped or float("inf"), rank)

    rank, error = min(errors.items(), key=order)
    return Failure(
        getattr(error, "meshtrain_rank", rank), getattr(error, "meshtrain_node", None), _line(error),
        is_permanent(error), len(errors) - 1,
    )


def _line(exc: BaseException) -> str:
    """meshtrain's own permanent errors are written as one line (naming every path and checkpoint
    involved), so they are kept whole; anything else is cut to one short line."""
    if isinstance(exc, (ConfigError, PermanentError)):
        return one_line(exc, limit=4000)
    return one_line(exc)


def _unwrapped(exc: BaseException) -> BaseException:
    """Follow Ray's task and controller wrappers down to a worker group's error or the innermost one."""
    seen: set[int] = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        if getattr(exc, "worker_failures", None):
            return exc
        inner = vars(exc).get("cause") or getattr(exc, "controller_failure", None) or exc.__cause__
        if not isinstance(inner, BaseException):
            return exc
        exc = inner
    return exc

