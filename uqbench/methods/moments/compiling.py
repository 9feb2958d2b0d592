"""torch.compile as the moment passes use it: one graph with dynamic sizes (or sizes specialised
until they vary), dynamo's settings patched around each call, and the first call (the
compilation) quiet.

Compiling prints two lines that say nothing about the run: a FutureWarning that inductor
raises against its own deprecated helper (``torch._prims_common.check``), and, on a CUDA build
of torch on a machine without a GPU, "No CUDA runtime is found" from the C++ extension loader.
Both come once per process, from the first compilation; that call runs with exactly those two
silenced (every other warning and log line passes).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

_INDUCTOR_DEPRECATION = r"`torch\._prims_common\.check` is deprecated"
_EXTENSION_LOGGER = "torch.utils.cpp_extension"


class _NoCudaRuntime(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No CUDA runtime is found")


@contextlib.contextmanager
def quiet_compilation() -> Iterator[None]:
    """Inside: inductor's deprecation warning and the extension loader's "No CUDA runtime is
    found" are dropped; nothing else is."""
    logger, only = logging.getLogger(_EXTENSION_LOGGER), _NoCudaRuntime()
    logger.addFilter(only)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_INDUCTOR_DEPRECATION,
                                    category=FutureWarning)
            yield
    finally:
        logger.removeFilter(only)


def compile_dynamic(fn: Callable[..., Any], **config: Any) -> Callable[..., Any]:
    """``fn`` through torch.compile with dynamic sizes, run under dynamo's ``config``
    (torch._dynamo.config keys), its first call inside :func:`quiet_compilation`."""
    return _quiet_first(fn, torch._dynamo.config.patch(**config)(torch.compile(fn, dynamic=True)))


def compile_specialised(fn: Callable[..., Any], options: dict[str, Any],
                        **config: Any) -> Callable[..., Any]:
    """``fn`` through torch.compile with its sizes specialised until they vary (dynamo's
    automatic dynamic: a size that changes between calls is compiled again as a dynamic one,
    once, as is one marked ``torch._dynamo.maybe_mark_dynamic`` from the start), inductor's
    ``options`` and dynamo's ``config``, its first call inside :func:`quiet_compilation`."""
    compiled = torch.compile(fn, dynamic=None, options=options)
    return _quiet_first(fn, torch._dynamo.config.patch(**config)(compiled))


def _quiet_first(fn: Callable[..., Any], compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` (``fn``'s compilation) with ``fn``'s name, its first call inside
    :func:`quiet_compilation`."""
    first = True

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal first
        if not first:
            return compiled(*args, **kwargs)
        first = False
        with quiet_compilation():
            return compiled(*args, **kwargs)
    return call


class Programs:
    """Named tensor programs that run eagerly on small inputs and compiled on large ones: each
    through :func:`compile_dynamic` (dynamo's ``config``), built on its first large call; a
    call from code that is itself being compiled runs the plain function (traced into the
    caller's graph)."""

    def __init__(self, functions: dict[str, Callable[..., Any]], **config: Any) -> None:
        self.functions, self.config = functions, config
        self.built: dict[str, Callable[..., Any]] = {}

    def compiled(self, which: str) -> Callable[..., Any]:
        """The program ``which`` (a key of the functions given) compiled, built on first use."""
        if which not in self.built:
            self.built[which] = compile_dynamic(self.functions[which], **self.config)
        return self.built[which]

    def __call__(self, which: str, large: bool) -> Callable[..., Any]:
        """The program ``which``: compiled where ``large``, else the plain function."""
        if large and not torch.compiler.is_compiling():
            return self.compiled(which)
        return self.functions[which]
