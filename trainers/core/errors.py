"""Errors that blame the user's data or job spec, as opposed to the system.

Anything a trainer raises that is not a ``DataError`` is a system fault (a bug, a lost device, a full
disk); the worker reports a ``DataError`` to the user with ``param`` naming the offending input.
"""

from __future__ import annotations


class DataError(ValueError):
    """The user's training data or hyperparameters make the job impossible.

    ``param`` names the input at fault in the API's terms, e.g. ``"training_file"``,
    ``"validation_file"`` or ``"hyperparameters.max_length"``.
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
