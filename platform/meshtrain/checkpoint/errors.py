"""Checkpoint failures: one checkpoint that cannot be used (the run falls back to an older one), and
the failures a restart cannot fix (no checkpoint loads, storage full or not writable)."""

from __future__ import annotations

from meshtrain.config import PermanentError


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names it."""


class NoLoadableCheckpoint(PermanentError):
    """Committed checkpoints exist but none loads; starting over would later overwrite them."""


class CheckpointStorageFull(PermanentError):
    """A save ran out of space; the message gives the path, the bytes needed and the bytes free."""


class CheckpointNotWritable(PermanentError):
    """The checkpoint directory refuses writes; the message names it."""


class CheckpointUnreachable(RuntimeError):
    """The checkpoint storage did not answer while a checkpoint was loaded (a network or S3 outage):
    nothing is marked bad, and a restart of the worker group tries again."""
