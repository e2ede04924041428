"""meshtrain's one-line configuration error, and finding it inside the exceptions wrapped around it."""

from __future__ import annotations


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


def config_error_in(exc: BaseException) -> ConfigError | None:
    """A ConfigError raised on a worker or task, found in the chain of exceptions wrapped around it.

    Ray re-raises a task's error as a subclass of both ``RayTaskError`` and the original type, with the
    remote traceback in its message and the original as its ``cause``; Ray Train gathers the workers'
    errors in ``worker_failures``. Both are followed by attribute, so this module needs no Ray.
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
            stack.append(cause)  # the original, whose message is the one line (not the wrapper's)
            continue
        if isinstance(current, ConfigError):
            return current
        stack.extend(e for e in (current.__cause__, current.__context__) if e)
        failures = getattr(current, "worker_failures", None)
        if isinstance(failures, dict):
            stack.extend(v for v in failures.values() if isinstance(v, BaseException))
    return None
