"""Building one settings dataclass from another object's same-named attributes (parsed flags, a wider
set of settings), so a field's name is written once, in the dataclass, not again at every place that
copies it across. Standard library only: the HTTP-only pieces (the bench client) use it too."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def same_named(cls: type, source: object) -> dict[str, Any]:
    """The init fields of dataclass `cls` that `source` has an attribute of the same name for, with their values."""
    return {f.name: getattr(source, f.name) for f in dataclasses.fields(cls) if f.init and hasattr(source, f.name)}


def from_attributes(cls: type[T], source: object, **values: Any) -> T:
    """A `cls` whose fields are `values`, else `source`'s same-named attributes, else their defaults."""
    return cls(**{**same_named(cls, source), **values})
