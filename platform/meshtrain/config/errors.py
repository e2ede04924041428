"""meshtrain's one-line errors: the configuration error, the permanent failure, the one-line form of any
exception, and the walk through the exceptions wrapped around one (Ray's, DCP's, Python's chains)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

_ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)): ?(.*)$")


class ConfigError(ValueError):
    """A user-facing configuration problem; the message is one line naming the field and the fix."""


class PermanentError(RuntimeError):
    """A failure that restarting the worker group cannot fix (corrupt input, no loadable checkpoint,
    no space or no permission on storage): the run stops at its first occurrence, and the message
    (one line naming the path and the fix) becomes the driver's final line."""


def require_extra(setting: str, module: str, extra: str) -> None:
    """ConfigError when ``setting`` (e.g. ``parallel.float8``) is on but ``module`` of the optional
    extra ``extra`` is not installed."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{setting}=true needs {module}: pip install -e '.[{extra}]', or set {setting}=false")


def one_line(exc: BaseException, limit: int = 240) -> str:
    """``Type: message`` on one line; for an error carrying a remote traceback, its last error line; for an
    OSError, its reason and path."""
    text = str(exc)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [m for m in map(_ERROR_LINE.match, lines) if m] if "Traceback (most recent call last)" in text else []
    if errors:
        line = f"{errors[-1][1].rsplit('.', 1)[-1]}: {errors[-1][3]}"
    elif isinstance(exc, OSError) and exc.strerror:
        line = f"{type(exc).__name__}: {exc.strerror}" + (f": {exc.filename}" if exc.filename else "")
    else:
        line = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def wrapped_errors(
    exc: BaseException, inner: Callable[[BaseException], Iterable[BaseException]] | None = None
) -> Iterator[BaseException]:
    """``exc`` and every error wrapped in it, each once: the exception chains, Ray Train's
    ``worker_failures`` and what ``inner`` names (DCP's per-rank failures, say).

    Ray re-raises a task's error as a subclass of both ``RayTaskError`` and the original type, with the
    remote traceback in its message and the original as its own ``cause`` attribute: such a wrapper is
    not yielded, its original is (whose message is the one line). All is followed by attribute, so this
    module needs no Ray.
    """
    seen: set[int] = set()
    stack = [exc]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        cause = vars(current).get("cause")  # own attribute only: a Ray wrapper delegates the rest
        if isinstance(cause, BaseException):
            stack.append(cause)
            continue
        yield current
        stack.extend(e for e in (current.__cause__, current.__context__) if isinstance(e, BaseException))
        failures = getattr(current, "worker_failures", None)
        if isinstance(failures, dict):
            stack.extend(v for v in failures.values() if isinstance(v, BaseException))
        if inner is not None:
            stack.extend(inner(current))


def config_error_in(exc: BaseException) -> ConfigError | None:
    """A ConfigError raised on a worker or task, found among the errors wrapped around it."""
    return next((e for e in wrapped_errors(exc) if isinstance(e, ConfigError)), None)
