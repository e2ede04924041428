"""A save that failed because the checkpoint storage is full or not writable, told in one line.

DCP gathers every rank's failure into a ``CheckpointException`` (a BaseException) whose message is
one traceback per rank; the ``OSError`` that matters is inside it. Neither failure goes away with a
restart, so both become PermanentErrors.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator

from torch.distributed.checkpoint.api import CheckpointException

from meshtrain.checkpoint.errors import CheckpointNotWritable, CheckpointStorageFull
from meshtrain.config import wrapped_errors as config_wrapped_errors

_FULL = (errno.ENOSPC, errno.EDQUOT)
_REFUSED = (errno.EACCES, errno.EPERM, errno.EROFS)


def _rank_failures(exc: BaseException) -> list[BaseException]:
    if not isinstance(exc, CheckpointException):
        return []
    return [failure[0] if isinstance(failure, tuple) else failure for failure in exc.failures.values()]


def wrapped_errors(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every error it wraps: DCP's per-rank failures and the exception chains, each once."""
    return config_wrapped_errors(exc, _rank_failures)


def storage_os_error(exc: BaseException) -> OSError | None:
    """The OSError saying the storage is full or refuses writes, found in ``exc`` or what it wraps."""
    return next(
        (e for e in wrapped_errors(exc) if isinstance(e, OSError) and e.errno in _FULL + _REFUSED), None
    )


def is_full(error: OSError) -> bool:
    return error.errno in _FULL


def storage_full(error: OSError, directory: str, needed: int, basis: str, free: int | None) -> CheckpointStorageFull:
    where = error.filename or directory
    room = f"{free:,} bytes free there" if free is not None else "the store reported no space left"
    return CheckpointStorageFull(
        f"checkpoint storage full: writing {where} failed ({error.strerror}); a checkpoint needs about {needed:,} "
        f"bytes ({basis}), {room}; the partial save was removed: free space or set checkpoint.path to a larger volume"
    )


def not_writable(error: OSError, directory: str) -> CheckpointNotWritable:
    where = error.filename or directory
    return CheckpointNotWritable(
        f"checkpoint directory {directory} is not writable ({error.strerror}: {where}); fix its permissions "
        "or set checkpoint.path to a writable location"
    )
