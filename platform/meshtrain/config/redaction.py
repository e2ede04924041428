"""Settings that may carry credentials: shown redacted, kept live.

``storage_options`` (fsspec/S3 keys, secrets, tokens) and locations that may hold a
``user:password@`` part are typed here so that every JSON-mode dump of a config (``config.yaml``,
checkpoint markers, ``--dry-run``, trackers) and its repr show them redacted, by construction; the
Python object keeps the live values that fsspec needs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Annotated, Any

from pydantic import PlainSerializer
from pydantic.fields import FieldInfo

REDACTED = "<redacted>"

# scheme://userinfo@host...: the authority ends at the first '/', '?' or '#' (RFC 3986), and its
# userinfo at its last '@'.
_USERINFO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#]*)@(?P<rest>.*)$")


def redact_url(url: str) -> str:
    """``url`` with the password of a ``scheme://user:password@host`` part (or a bare ``token@``)
    replaced by ``<redacted>``; anything else unchanged."""
    match = _USERINFO.match(url)
    if match is None:
        return url
    user, has_password, _ = match["userinfo"].partition(":")
    shown = f"{user}:{REDACTED}" if has_password else REDACTED
    return f"{match['scheme']}{shown}@{match['rest']}"


def redact_options(options: Any) -> Any:
    """Storage options with their keys kept and every value that could be a credential (anything
    but true/false/null) replaced by ``<redacted>``, through nested mappings and lists."""
    if isinstance(options, dict):
        return {key: redact_options(value) for key, value in options.items()}
    if isinstance(options, (list, tuple)):
        return [redact_options(value) for value in options]
    if options is None or isinstance(options, bool):
        return options
    return REDACTED


# A location (a path or URL) whose user:password@ part is redacted when dumped to JSON.
Location = Annotated[str, PlainSerializer(redact_url, when_used="json")]
OptionalLocation = Annotated[str | None, PlainSerializer(redact_url, when_used="json-unless-none")]
# fsspec options: keys visible, values redacted when dumped to JSON.
StorageOptions = Annotated[dict[str, Any], PlainSerializer(redact_options, when_used="json")]

_REDACTORS: tuple[Callable[[Any], Any], ...] = (redact_url, redact_options)


def redactor(field: FieldInfo) -> Callable[[Any], Any] | None:
    """The function that redacts ``field``'s value for display, or None for an ordinary setting."""
    for item in field.metadata:
        if isinstance(item, PlainSerializer) and item.func in _REDACTORS:
            return item.func
    return None


def redacted_repr_args(fields: dict[str, FieldInfo], args: Iterator[tuple[str | None, Any]]) -> Iterator[tuple[str | None, Any]]:
    """A model's repr arguments with the values of credential-carrying fields redacted."""
    for name, value in args:
        field = fields.get(name) if name is not None else None
        redact = redactor(field) if field is not None else None
        yield name, value if redact is None or value is None else redact(value)
