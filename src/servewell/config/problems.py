"""Validation problems that name their field: collected by the config models, raised together.

A pydantic model validator has no field of its own, so an error raised there would be reported
at the top level. `Problems` raises one `ValidationError` whose entries carry the field they are
about (nested models prefix their own location), and reports every problem at once, so that
`servewell models` shows all of a model.yaml's mistakes in one run.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

#: Where a problem is: field names and list indices, outermost first.
Location = tuple[str | int, ...]
#: How the location of a problem with the file as a whole reads.
TOP_LEVEL = "(top level)"


def dotted(location: Location) -> str:
    """`('preprocess', 'mean')` as `preprocess.mean`; the empty location as `(top level)`."""
    return ".".join(str(part) for part in location) or TOP_LEVEL


def config_error(reason: str) -> PydanticCustomError:
    """An error whose message is `reason` exactly (a plain ValueError would gain a "Value error, " prefix)."""
    return PydanticCustomError("config", "{reason}", {"reason": reason})


class Problems:
    """Problems found by one validator; `raise_if_any` turns them into one `ValidationError`."""

    def __init__(self, title: str) -> None:
        self._title = title
        self._details: list[InitErrorDetails] = []

    def add(self, location: Location, reason: str, value: object = None) -> None:
        """Record that the field at `location` (relative to the model validated) is wrong for `reason`."""
        self._details.append(InitErrorDetails(type=config_error(reason), loc=location, input=value))

    def extend(self, error: ValidationError, prefix: Location = ()) -> None:
        """Keep the problems of a validation that ran inside this one, under `prefix` (messages kept as they are)."""
        for item in error.errors():
            self.add(prefix + tuple(item["loc"]), item["msg"], item.get("input"))

    def __bool__(self) -> bool:
        return bool(self._details)

    def raise_if_any(self) -> None:
        """Raise every recorded problem as one `ValidationError`; nothing when there is none."""
        if self._details:
            raise ValidationError.from_exception_data(self._title, self._details)


@dataclass(slots=True, frozen=True)
class FieldProblem:
    """One reason a config is invalid, with the field it is about (`(top level)` for the file itself)."""

    field: str
    reason: str

    def __str__(self) -> str:
        return self.reason if self.field == TOP_LEVEL else f"field '{self.field}': {self.reason}"


def field_problems(error: ValidationError) -> list[FieldProblem]:
    """Every entry of a pydantic `ValidationError` as field and reason, in the order pydantic found them."""
    return [FieldProblem(dotted(tuple(item["loc"])), item["msg"]) for item in error.errors()]
