"""The data's errors, in a module without heavy imports so that every reader can raise them."""

from __future__ import annotations

from leantune.errors import UserError


class DataError(ValueError, UserError):
    """The data cannot be trained on; the message says which file and lines and why."""
