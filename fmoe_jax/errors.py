"""`ArgumentError`: the `ValueError` `generate` raises for one bad argument, naming it.

Callers that expose `generate`'s arguments under other names (fmoe-serve's OpenAI fields) read `argument`
to say which of theirs was wrong; everyone else catches it as a `ValueError`.
"""

from __future__ import annotations


class ArgumentError(ValueError):
    """A bad value for `argument` (one of `generate`'s parameter names); the message says what and why."""

    def __init__(self, argument: str, message: str):
        super().__init__(message)
        self.argument = argument
