"""What every meshtrain command line shares: exit codes and argument errors on one line."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

EXIT_TRAINING_FAILED = 1
EXIT_CONFIG_ERROR = 2  # also bad input of any kind: a missing checkpoint, an existing output
EXIT_INTERRUPTED = 130  # Ctrl-C or `ray job stop` (128 + SIGINT, as a shell reports it)
CONFIG_ERROR_PREFIX = "meshtrain: config error"


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``<error_prefix>: <message>; see --help``, exit 2."""

    def __init__(self, *args: Any, error_prefix: str = CONFIG_ERROR_PREFIX, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.error_prefix = error_prefix

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_CONFIG_ERROR, f"{self.error_prefix}: {message}; see --help\n")


def refuse(command: str, error: BaseException) -> int:
    """Bad input: ``<command>: error: <the error's first line>`` on stderr; the exit code to return."""
    import sys

    message = (str(error).strip().splitlines() or [type(error).__name__])[0]
    print(f"{command}: error: {message}", file=sys.stderr)
    return EXIT_CONFIG_ERROR


def run_checkpoint_root(path: str) -> str:
    """A local run folder's checkpoint root (``{run}/checkpoints``); any other path as it is."""
    from pathlib import Path

    if "://" not in path and (Path(path) / "checkpoints").is_dir():
        return str(Path(path) / "checkpoints")
    return path
