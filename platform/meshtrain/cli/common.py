"""What every meshtrain command line shares: exit codes and argument errors on one line."""

from __future__ import annotations

import argparse
import copy
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import yaml

EXIT_TRAINING_FAILED = 1
EXIT_CONFIG_ERROR = 2  # also bad input of any kind: a missing checkpoint, an existing output
EXIT_INTERRUPTED = 130  # Ctrl-C or `ray job stop` (128 + SIGINT, as a shell reports it)
EXIT_FAILED = 1  # any other failure of a command
CONFIG_ERROR_PREFIX = "meshtrain: config error"
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]+")


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``<error_prefix>: <message>; see --help``, exit 2."""

    def __init__(self, *args: Any, error_prefix: str = CONFIG_ERROR_PREFIX, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.error_prefix = error_prefix

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_CONFIG_ERROR, f"{self.error_prefix}: {message}; see --help\n")

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """Positionals may come on either side of options: ``run.x=1 --config F.yaml optim.y=2`` gives both
        overrides (plain parsing fills a ``nargs="*"`` positional once, then refuses the rest)."""
        return self.parse_intermixed_args(args, namespace)


def generated_page(
    prog: str, page: str, source: str, render: Callable[[], str], default: Path, command: str,
    argv: list[str] | None = None,
) -> int:
    """The command behind a generated documentation page: print ``render()``, ``--write`` it to its file,
    or ``--check`` that the file is current (exit 1 with one line naming ``command`` when it is not)."""
    parser = OneLineParser(prog=prog, description=f"Print {page} generated from {source}, write it to "
                           f"{default.name}, or check that the file is current.")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help=f"write {default.name}")
    action.add_argument("--check", action="store_true", help=f"exit 1 when {default.name} is stale")
    parser.add_argument("--path", type=Path, default=default, help="the page's file (default: %(default)s)")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        args.path.parent.mkdir(parents=True, exist_ok=True)
        args.path.write_text(text, encoding="utf-8")
        print(f"wrote {args.path}")
        return 0
    if args.check:
        current = args.path.read_text(encoding="utf-8") if args.path.is_file() else None
        if current != text:
            state = "is missing" if current is None else f"differs from {source}"
            print(f"{prog.removesuffix('.py')}: {args.path} {state}; run {command}", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0


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
    print(f"{command}: error: {_redacted(message)}", file=sys.stderr)
    return EXIT_CONFIG_ERROR


# Failures of what the user gave: a file missing, refused or of the wrong kind, credentials refused, text that is
# not UTF-8. Fixing the input fixes them (exit 2); any other failure exits 1.
_BAD_INPUT = (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError, PermissionError, UnicodeError)
_HINTS = (
    (PermissionError, "check the path's permissions, or the storage credentials (environment, instance role or "
                      "storage options)"),
    ((ConnectionError, TimeoutError), "the storage did not answer: check its endpoint and the network, then run "
                                      "the command again"),
)


def fail(command: str, error: BaseException) -> int:
    """Any failure a command did not expect, as one line: ``<command>: error: <Type: message>`` on stderr (no
    traceback; URL passwords redacted); the exit code to return: 2 when it is the input's, else 1."""
    import sys

    from meshtrain.config import one_line

    hint = next((text for kinds, text in _HINTS if isinstance(error, kinds)), None)
    if hint is None and "Connect" in type(error).__name__:  # botocore's, aiohttp's: not builtin ConnectionErrors
        hint = _HINTS[1][1]
    print(f"{command}: error: {_redacted(one_line(error))}{f'; {hint}' if hint else ''}", file=sys.stderr)
    return EXIT_CONFIG_ERROR if isinstance(error, _BAD_INPUT) else EXIT_FAILED


def interrupted(command: str) -> int:
    """Ctrl-C: one line, the shell's exit code."""
    import sys

    print(f"{command}: interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED


def _redacted(line: str) -> str:
    """``line`` with the password of every ``scheme://user:password@`` in it redacted (a URL as given)."""
    from meshtrain.config import redact_url

    return _URL.sub(lambda match: redact_url(match[0]), line)


def check_writable_folder(folder: Path, option: str, fix: str = "give a writable folder") -> None:
    """ConfigError (one line naming ``option``, then ``fix``) unless ``folder`` is, or can be made, a folder this
    user can write in: a temporary file is created and removed in it or its nearest existing parent, nothing else."""
    import os
    import tempfile

    from meshtrain.config import ConfigError, one_line

    existing = folder = folder.expanduser().absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{option} {folder}: {existing} is a file, not a folder; {fix}")
    try:
        handle, probe = tempfile.mkstemp(prefix=".meshtrain-probe-", dir=existing)
        os.close(handle)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(
            f"{option} {folder}: cannot write in {existing} ({one_line(exc, limit=160)}); {fix}"
        ) from None
