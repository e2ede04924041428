"""The base of every config section, and validators that several sections share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fsspec.core import split_protocol
from pydantic import BaseModel, ConfigDict

from meshtrain.config.redaction import redacted_repr_args

# The longest duration a setting may name: a year. What consumes them converts to milliseconds in int64
# (torch's collectives, torchft's lighthouse and manager), to timedelta (at most 1e9 days) or waits on a
# lock (threading.TIMEOUT_MAX, about 292 years on Linux); a year keeps every conversion in range, and
# no run needs a longer timeout or interval.
MAX_DURATION_S = 365 * 24 * 3600


class Section(BaseModel):
    # No float setting may be inf or nan: pydantic rejects them on the field's own path ("finite_number").
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        # An exception or log line that prints a config must not carry its credentials.
        return redacted_repr_args(type(self).model_fields, super().__repr_args__())


def check_tested_scheme(url: str, where: str, opt_in: str | None = None) -> None:
    """Refuse a URL whose scheme meshtrain is not tested with (local paths, file:// and s3:// are)."""
    scheme = split_protocol(url)[0]
    if scheme not in (None, "file", "s3"):
        fix = "use one of those" + (f" or set {opt_in}=true" if opt_in else "")
        raise ValueError(
            f"{where}: scheme {scheme!r} is not tested with meshtrain (local paths and s3:// are); {fix}"
        )


