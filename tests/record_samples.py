"""Records for tests: one of any kind with the values a test names, every other key it requires a zero of
its type (``make``), or every key an example value (``example``), built from the record classes' fields."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

R = TypeVar("R")


def make(kind: type[R], **values: Any) -> R:
    """A ``kind`` record with ``values``; each other key it requires is a zero (0, 0.0, "", False, [],
    {}, None where the key may be null, a literal's first value)."""
    hints = typing.get_type_hints(kind)
    for field in dataclasses.fields(kind):
        required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        if required and field.name not in values:
            values[field.name] = _zero(hints[field.name])
    return kind(**values)


def example(kind: type[R]) -> R:
    """A ``kind`` record with every field set, optional ones too, to a value other than a zero."""
    hints = typing.get_type_hints(kind)
    return kind(**{field.name: _example(hints[field.name]) for field in dataclasses.fields(kind)})


def _options(annotation: Any) -> tuple[Any, ...]:
    return typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()


def _zero(annotation: Any) -> Any:
    origin, options = typing.get_origin(annotation), _options(annotation)
    if options:
        return None if type(None) in options else _zero(options[0])
    if origin is typing.Literal:
        return typing.get_args(annotation)[0]
    if origin in (list, dict):
        return origin()
    return annotation()


def _example(annotation: Any) -> Any:
    origin, options = typing.get_origin(annotation), _options(annotation)
    if options:
        return _example(next(option for option in options if option is not type(None)))
    if origin is typing.Literal:
        return typing.get_args(annotation)[-1]
    if origin is list:
        return [_example(typing.get_args(annotation)[0])]
    if origin is dict:
        return {"web": _example(typing.get_args(annotation)[1])}
    if typing.is_typeddict(annotation):
        return {key: _example(value) for key, value in typing.get_type_hints(annotation).items()}
    return {int: 7, float: 0.5, str: "x", bool: True}[annotation]
