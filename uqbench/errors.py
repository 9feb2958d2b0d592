"""How every uqbench command reports a user's mistake: one line on stderr, exit status 1.

``USER_ERRORS`` are the exceptions that mean "the input is wrong" (a bad value, a missing file,
a folder holding another run); :func:`user_errors` turns them into that one line for every
console script (``uqbench``, ``uqbench-tables``, ``uqbench-combine``, …), so they all speak
the same way. ``UQBENCH_TRACEBACK=1`` lets the exception through with its traceback.
Imports nothing of uqbench.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

USER_ERRORS: tuple[type[Exception], ...] = (
    ValueError, KeyError, FileNotFoundError, FileExistsError, PermissionError, RuntimeError)
HINT = "(set UQBENCH_TRACEBACK=1 for the full traceback)"

log = logging.getLogger("uqbench")


def message(err: BaseException) -> str:
    """The error's text, or its type's name where it has none."""
    return str(err).strip() or type(err).__name__


def report(err: BaseException, logged: bool = True) -> None:
    """Log ``err`` and print it as uqbench's one error line (with the traceback hint).
    ``logged=False`` where the log itself goes to stderr: the line would show twice."""
    if logged:
        log.error("%s: %s", type(err).__name__, message(err))
    print(f"error: {message(err)}\n{HINT}", file=sys.stderr)


def traceback_wanted() -> bool:
    return bool(os.environ.get("UQBENCH_TRACEBACK"))


@contextmanager
def user_errors(catch: tuple[type[BaseException], ...] = USER_ERRORS,
                on_error: Callable[[], None] | None = None, logged: bool = True
                ) -> Iterator[None]:
    """``with user_errors(): …`` — an exception of ``catch`` raised inside prints as one line
    and exits with status 1 (``on_error`` runs first: tidy up what the command left;
    ``logged``: as :func:`report`)."""
    try:
        yield
    except catch as err:
        if traceback_wanted():
            raise
        report(err, logged)
        if on_error is not None:
            on_error()
        sys.exit(1)
