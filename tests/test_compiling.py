"""The moment passes' compile helper: a quiet first call that silences exactly two lines."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from uqbench.methods.moments.compiling import compile_dynamic, quiet_compilation

NO_CUDA = "No CUDA runtime is found, using CUDA_HOME='/usr/local'"
DEPRECATED = ("`torch._prims_common.check` is deprecated and will be removed in the future. "
              "Please use `torch._check*` functions instead.")


def _emit() -> None:
    warnings.warn(DEPRECATED, FutureWarning, stacklevel=1)
    warnings.warn("another FutureWarning", FutureWarning, stacklevel=1)
    logger = logging.getLogger("torch.utils.cpp_extension")
    logger.warning(NO_CUDA)
    logger.warning("a C++ compiler is missing")


def test_compilation_drops_only_its_two_noise_lines(caplog):
    """Inside: inductor's deprecation warning and "No CUDA runtime is found" are dropped, a
    different FutureWarning and a different line of the same logger pass; outside, both
    noise lines pass again."""
    caplog.set_level(logging.WARNING, logger="torch.utils.cpp_extension")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_compilation():
            _emit()
        inside = ([str(w.message) for w in caught], [r.getMessage() for r in caplog.records])
        caught.clear()
        caplog.clear()
        _emit()
        outside = ([str(w.message) for w in caught], [r.getMessage() for r in caplog.records])
    assert inside == (["another FutureWarning"], ["a C++ compiler is missing"])
    assert outside == ([DEPRECATED, "another FutureWarning"],
                       [NO_CUDA, "a C++ compiler is missing"])


def test_a_compiled_function_gives_the_eager_numbers_on_every_call():
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * x + 1
    compiled = compile_dynamic(f, suppress_errors=True)
    for n in (5, 9):  # the first call compiles (quietly), then dynamic sizes reuse the graph
        x = torch.linspace(-2, 2, n, dtype=torch.float64)
        torch.testing.assert_close(compiled(x), f(x), rtol=1e-12, atol=0)
    assert compiled.__name__ == "f"


def test_the_quiet_block_lets_go_of_its_filter_on_an_error():
    logger = logging.getLogger("torch.utils.cpp_extension")
    before = list(logger.filters)
    with pytest.raises(RuntimeError), quiet_compilation():
        raise RuntimeError("compilation failed")
    assert logger.filters == before
