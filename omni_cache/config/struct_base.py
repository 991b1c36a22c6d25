"""What every config struct shares: unknown keys are errors, fields are keyword-only, and the
constrained number types the keys use."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

PositiveInt = Annotated[int, Meta(gt=0)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
PositiveFloat = Annotated[float, Meta(gt=0)]


class ConfigStruct(Struct, forbid_unknown_fields=True, kw_only=True):
    """Common options: unknown keys are errors, fields are keyword-only."""
