"""Finding meshtrain's own one-line errors inside the exceptions Ray wraps around them."""

from __future__ import annotations

from meshtrain.config import ConfigError


def config_error_in(exc: BaseException) -> ConfigError | None:
    """A ConfigError raised on a worker or task, found in the chain Ray wraps around it."""
    from ray.exceptions import RayTaskError

    seen: set[int] = set()
    stack = [exc]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, RayTaskError):
            # Ray re-raises a task's error as a subclass of both RayTaskError and the original type,
            # with the remote traceback in its message; the original is its ``cause``.
            stack.append(current.cause)
            continue
        if isinstance(current, ConfigError):
            return current
        stack.extend(e for e in (current.__cause__, current.__context__) if e)
        failures = getattr(current, "worker_failures", None)
        if isinstance(failures, dict):
            stack.extend(v for v in failures.values() if isinstance(v, BaseException))
    return None
