"""What a setting's type annotation says about reading it from text (environment variables, CLI flags).

List-valued settings are written as comma-separated items (`0.1,0.5,1`); the annotation, not the
field's name, decides which settings are lists, so any list setting added later works from the
environment and the command line without a special case.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

_SEQUENCES = (list, tuple, set, frozenset)


def strip_optional(annotation: object) -> object:
    """`X | None` -> X; anything else unchanged."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kept = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(kept) == 1:
            return kept[0]
    return annotation


def list_item_type(annotation: object) -> object | None:
    """The item type of a list-like setting (`list[float]`, `list[int] | None`, ...), or None
    when the setting is not a list. A list of unknown items gives `str`."""
    inner = strip_optional(annotation)
    if typing.get_origin(inner) in _SEQUENCES:
        args = typing.get_args(inner)
        return args[0] if args else str
    if inner in _SEQUENCES:
        return str
    return None


def split_items(text: str) -> list[str]:
    """`"0.1, 0.5,,1"` -> `["0.1", "0.5", "1"]`: comma-separated items, blanks dropped."""
    return [part.strip() for part in text.split(",") if part.strip()]


def values_from_env(model: type[BaseModel], environ: Mapping[str, str], prefix: str) -> dict[str, Any]:
    """The fields of `model` set in `environ` as `<prefix><FIELD>`, as text (list fields split into
    items); pydantic converts and checks them."""
    values: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        raw = environ.get(prefix + name.upper())
        if raw is not None:
            values[name] = split_items(raw) if list_item_type(field.annotation) is not None else raw
    return values
