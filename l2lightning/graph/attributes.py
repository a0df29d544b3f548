"""Attributes set on the user's objects for a fit, and putting back what they held before."""

from __future__ import annotations

from typing import Any

# What an instance held under a name the callback replaces for the fit, when it held nothing in its own
# __dict__ (None may be a value it held): the class's attribute is then what comes back.
ABSENT = object()


def put_back(obj: Any, name: str, before: Any) -> None:
    """Remove what the callback set on `obj`'s instance under `name` for the fit, and give back what the
    instance held there before (`before`; ABSENT: nothing, the class's attribute shows again)."""
    if name in vars(obj):
        delattr(obj, name)
    if before is not ABSENT:
        setattr(obj, name, before)
