"""The one exception type for bad user input: the CLI prints it on one line and exits with code 2."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class KvbenchError(Exception):
    """A problem with what the user asked for (a name, a value, a path), not a bug in kvbench."""


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """` (did you mean 'x'?)` for the closest of `known` to a misspelled `name`, or nothing when none is close."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""
