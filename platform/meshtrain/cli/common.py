"""What every meshtrain command line shares: exit codes and argument errors on one line."""

from __future__ import annotations

import argparse
import copy
from collections.abc import Sequence
from typing import Any, NoReturn

import yaml

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


def add_storage_option(options: dict[str, Any], item: str) -> None:
    """One ``key=value`` (a dotted key nests, the value is parsed as YAML) into fsspec storage options."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        # Not echoed: a malformed option may be a credential.
        raise ValueError("--storage-option: expected KEY=VALUE, e.g. anon=true (the option given is not shown "
                         "in case it holds a credential)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        value = raw
    node = options
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"--storage-option {key}=...: {part!r} is already a value, not a section")
    node[leaf] = value


class _StorageOptions(argparse.Action):
    """Collects every ``--storage-option`` into one nested dict; a malformed one is the parser's error."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        options = copy.deepcopy(getattr(namespace, self.dest) or {})
        try:
            add_storage_option(options, str(values))
        except ValueError as exc:
            parser.error(str(exc))
        setattr(namespace, self.dest, options)


def add_storage_options_argument(parser: argparse.ArgumentParser, example: str = "") -> None:
    """``--storage-option KEY=VALUE`` (repeatable): ``args.storage_option`` is the fsspec options dict."""
    parser.add_argument(
        "--storage-option", action=_StorageOptions, default={}, metavar="KEY=VALUE",
        help=f"fsspec option for a remote checkpoint (repeatable; dotted keys nest){example}",
    )


def refuse(command: str, error: BaseException) -> int:
    """Bad input: ``<command>: error: <the error's first line>`` on stderr; the exit code to return."""
    import sys

    message = (str(error).strip().splitlines() or [type(error).__name__])[0]
    print(f"{command}: error: {message}", file=sys.stderr)
    return EXIT_CONFIG_ERROR


def run_checkpoint_root(path: str, storage_options: dict[str, Any] | None = None) -> str:
    """A run folder's checkpoint root (``{run}/checkpoints``), local or remote; any other path as it is."""
    from pathlib import Path

    if "://" not in path:
        return str(Path(path) / "checkpoints") if (Path(path) / "checkpoints").is_dir() else path
    import fsspec

    root = f"{path.rstrip('/')}/checkpoints"
    try:
        fs, fs_root = fsspec.core.url_to_fs(root, **(storage_options or {}))
        return root if fs.isdir(fs_root) else path
    except Exception:  # unreachable or refused: reading the checkpoint says why, in its own words
        return path
