"""Timing and memory measurement for `make bench`: side by side, in one process.

Ratios are what the benchmark reports, so the things compared are timed together: every repeat
runs each callable once, in alternating order (so neither always runs on a warm cache), after
warm-up calls that are not timed; the figure is the median per callable. Where a callable is
meant to be timed as a loop over batches runs it, each timed call can follow untimed calls of
itself (``warm``), so that it finds its own working set in the caches. On CPU, glibc's
allocator makes small-op timings swing several-fold between runs unless its trim and mmap
thresholds are raised (:data:`ALLOCATOR`); :func:`ensure_allocator` restarts the process with
them set, for the benchmark process only.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# glibc reads these once, at process start: keep freed memory instead of returning it to the
# system after every large tensor, so a timed loop does not pay for page faults each time
ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "1000000000000", "MALLOC_TRIM_THRESHOLD_": "1000000000000",
             "MALLOC_TOP_PAD_": "1000000000"}


def ensure_allocator(argv: list[str], module: str = "uqbench.bench") -> None:
    """Re-run ``python -m module argv`` with :data:`ALLOCATOR` in the environment unless it is
    already there (a no-op when it is)."""
    if all(os.environ.get(k) == v for k, v in ALLOCATOR.items()):
        return
    env = {**os.environ, **ALLOCATOR}
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CONFIDENCE = 0.90  # the least coverage of a figure's interval for the median over rounds


def median_interval(values: Iterable[float], confidence: float = CONFIDENCE
                    ) -> tuple[float, float]:
    """A distribution-free confidence interval for the median of ``values``: the k-th smallest
    to the k-th largest, with the largest k whose coverage 1 − 2·P(Binomial(n, ½) < k) is at
    least ``confidence``. With 5 rounds that is the range (coverage 94 %); with 10 rounds the
    second smallest to the second largest (98 %; the range's 99.8 % would let one stray round
    decide a verdict). Under ``confidence`` even for the range (n < 5): the range."""
    xs = sorted(values)
    n, k = len(xs), 1
    while 2 * (k + 1) <= n and 1 - 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n \
            >= confidence:
        k += 1
    return xs[k - 1], xs[n - k]


class Measured(float):
    """A figure measured in rounds: its value is the median of the per-round values, which it
    keeps (``rounds``). Arithmetic with another Measured pairs the rounds (round k with round
    k: both were timed interleaved in it), with a number it applies to each round, so a ratio
    of two timings carries the per-round ratios and ``interval`` is computed from them."""

    rounds: tuple[float, ...]

    def __new__(cls, rounds: Iterable[float]) -> Measured:
        values = tuple(float(v) for v in rounds)
        if not values:
            raise ValueError("a measured figure needs at least one round")
        obj = super().__new__(cls, statistics.median(values))
        obj.rounds = values
        return obj

    @property
    def interval(self) -> tuple[float, float]:
        """The figure's run-to-run interval: :func:`median_interval` of its rounds."""
        return median_interval(self.rounds)

    def _apply(self, other: object, op: Callable[[float, float], float]) -> Measured:
        if isinstance(other, Measured):
            if len(other.rounds) != len(self.rounds):
                raise ValueError(f"figures of {len(self.rounds)} and {len(other.rounds)} rounds "
                                 f"cannot be paired")
            return Measured(op(a, b) for a, b in zip(self.rounds, other.rounds, strict=True))
        if isinstance(other, int | float):
            return Measured(op(a, float(other)) for a in self.rounds)
        return NotImplemented

    def __truediv__(self, other: object) -> Measured:  # type: ignore[override]
        return self._apply(other, lambda a, b: a / b)

    def __rtruediv__(self, other: object) -> Measured:  # type: ignore[override]
        return self._apply(other, lambda a, b: b / a)

    def __mul__(self, other: object) -> Measured:  # type: ignore[override]
        return self._apply(other, lambda a, b: a * b)

    __rmul__ = __mul__  # type: ignore[assignment]

    def __reduce__(self) -> tuple[type, tuple[tuple[float, ...]]]:
        return Measured, (self.rounds,)


@contextlib.contextmanager
def one_thread(device: torch.device) -> Iterator[None]:
    """Run the block on one CPU thread (on a CPU device; a no-op on others), then restore
    torch's thread count: small ops time steadily on one thread, and ours and the anchor are
    pinned alike."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


ROUNDS = 5  # rounds per figure: each one median of its share of the interleaved repeats


def side_by_side(fns: Mapping[str, Callable[[], object]], device: torch.device, repeats: int = 10,
                 warmup: int = 2, rounds: int = ROUNDS, warm: int = 0) -> dict[str, Measured]:
    """Seconds per call of each callable, timed interleaved (order reversed every other
    repeat) after ``warmup`` untimed calls of each: a :class:`Measured` whose rounds are the
    medians of ``rounds`` consecutive groups of the repeats (fewer when there are fewer
    repeats), so that ratios pair what was timed together. ``warm``: untimed calls of the same
    callable right before each timed one, so that the timed call finds its own weights and
    temporaries in the caches, as the next batch of a loop over batches does, instead of what
    the callable timed before it left there (a call of a millisecond or less loses up to a
    quarter of its speed to that)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            for _ in range(warm):
                fns[name]()
            synchronize(device)
            start = time.perf_counter()
            fns[name]()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    groups = max(1, min(rounds, repeats))
    bounds = [round(i * repeats / groups) for i in range(groups + 1)]
    return {name: Measured(statistics.median(t[a:b])
                           for a, b in zip(bounds[:-1], bounds[1:], strict=True))
            for name, t in times.items()}


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages: every storage an op returns is added once and
    subtracted when it is freed (a finalizer on the storage), and the peak is kept."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def add(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        st = t.untyped_storage()
        key = id(st)
        if key in self._seen or st.nbytes() == 0:
            return
        self._seen.add(key)
        self.live += st.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(st, self._freed, key, st.nbytes())

    def _freed(self, key: int, n: int) -> None:
        self._seen.discard(key)
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self.add(t)
        return out


def peak_bytes(fn: Callable[[], object], device: torch.device,
               track: Iterable[torch.nn.Module | torch.optim.Optimizer] = ()) -> int | None:
    """Peak bytes of the tensors alive while ``fn`` runs: those it creates (activations,
    gradients, temporaries) plus the parameters, buffers, gradients and optimiser state of
    ``track`` that exist when it starts. CUDA: the allocator's peak. CPU: a count of live
    tensor storages (what the CPU allocator does not report). None if ``fn`` cannot be
    followed (the table then says "not measured")."""
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        synchronize(device)
        return max(torch.cuda.max_memory_allocated(device), base)
    counter = _LiveBytes()
    for obj in track:
        if isinstance(obj, torch.optim.Optimizer):
            tensors = [v for st in obj.state.values() for v in st.values()]
        else:
            tensors = [*obj.parameters(), *obj.buffers(), *(p.grad for p in obj.parameters())]
        for t in tensors:
            if isinstance(t, torch.Tensor):
                counter.add(t)
    try:
        with counter:
            fn()
    except Exception:  # noqa: BLE001 - an op the counter cannot follow: report it unmeasured
        return None
    return counter.peak


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes held by distinct tensors (shared storage counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += key[1]
    return total


def trainable_state_bytes(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer
                          ) -> int:
    """Parameters + gradients + optimiser state of the trained parameters, in bytes (after at
    least one step, so the optimiser state exists)."""
    state = [v for p in params for v in optimizer.state.get(p, {}).values()
             if isinstance(v, torch.Tensor)]
    return tensor_bytes(params) + tensor_bytes(p.grad for p in params) + tensor_bytes(state)
