"""OpenMP teams: a service's model thread keeps the only team of worker threads in its process.

libgomp, PyTorch's OpenMP runtime on Linux, gives every thread that starts a
parallel region a team of worker threads of its own and keeps it for the
thread's lifetime. Once a process holds more of those workers than it has
CPUs, libgomp stops letting an idle worker spin: it sleeps in the kernel
between regions, and every parallel region then pays to wake it. A model
thread runs hundreds of regions a step (each linear, norm and elementwise op
of each layer), so one team left behind by the thread that loaded the model
is enough to slow every step. Measured on the 2-core bench VM: a one-row
decode step of the bench model took 34-36 ms on the engine thread with the
loading thread's team alive and 24 ms without it, an 8-row step 42-43 against
33, a 256k-element ``mul`` 104-133 µs against 31-41.

So a service loads its model on a thread of its own that ends when done
(:func:`on_own_thread`): libgomp ends a thread's team when the thread ends.
Its event loop's thread and the loop's helper threads never start one
(:func:`leave_teams_to_model_threads`): their parallel regions run on
themselves alone (a push's finiteness check on the loop thread, an image's
preprocessing on a helper). Spinning workers cost a process that shares its cores with another one
computing at the same time; :class:`SleepingWorkers` makes them sleep while
that lasts (``services/pd/shared_cores.py``). Under another OpenMP runtime
(Intel's or LLVM's ``libomp``, with other wait policies) both are harmless.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime PyTorch loaded into this process (libgomp, or LLVM's or Intel's libomp)."""
    import torch  # noqa: F401  (loads it before the search)

    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = sorted(
                {line.split()[-1] for line in maps if "/libgomp" in line or "omp5" in line or "/libomp" in line}
            )
    except OSError:
        return None
    for path in paths:
        try:
            library = ctypes.CDLL(path)  # the loaded copy: the same soname is not loaded twice
            library.omp_set_num_threads.argtypes = (ctypes.c_int,)
        except (OSError, AttributeError):
            continue
        return library
    return None


def run_alone() -> bool:
    """The calling thread's parallel regions run on it alone from now on: it starts no OpenMP team.

    For a thread that has not started one yet; False, changing nothing, where
    no OpenMP runtime is found."""
    import torch

    library = _openmp()
    if library is None:
        return False
    # PyTorch sizes a thread's team at the thread's first parallel loop, from its own
    # count; a softmax takes that loop now without starting a team (one row: serial).
    torch.ones(1, 1).softmax(-1)
    library.omp_set_num_threads(1)
    return True


def leave_teams_to_model_threads() -> None:
    """For a service's event loop: its thread, and the helper threads of ``asyncio.to_thread``, run alone."""
    if not run_alone():
        log.debug("no OpenMP runtime found: the event loop's threads keep their teams")
        return
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(thread_name_prefix="loop-helper", initializer=run_alone)
    )


def on_own_thread(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` on a new thread that ends when it returns, its OpenMP team with it.

    Blocks the caller (from the event loop, through ``asyncio.to_thread``);
    returns what ``fn`` returned and raises what it raised."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, fn(*args, **kwargs)))
        except BaseException as error:  # handed to the caller below
            outcome.append((False, error))

    thread = threading.Thread(target=run, name="model-loader")
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


class SleepingWorkers:
    """Switches this process's idle OpenMP workers between spinning and sleeping (``set`` from one thread).

    libgomp lets idle workers spin only while the process holds no more
    OpenMP threads than it has CPUs. To make them sleep, and leave the cores
    to another process computing at the same time (an encoder beside a PD),
    a thread of its own starts a spare team and waits, its workers asleep and
    costing nothing; to let them spin again that thread ends, and its team
    with it. It also ends once ``owner_alive`` turns false (checked every
    ``poll_s``)."""

    def __init__(self, owner_alive: Callable[[], bool], poll_s: float = 1.0) -> None:
        self.owner_alive = owner_alive
        self._poll_s = poll_s
        self._release: threading.Event | None = None

    def set(self, sleep: bool) -> None:
        """Asks for sleeping (True) or spinning (False) workers; takes effect within moments."""
        if sleep and self._release is None:
            self._release = threading.Event()
            threading.Thread(target=self._hold, args=(self._release,), name="openmp-spare-team", daemon=True).start()
        elif not sleep and self._release is not None:
            self._release.set()
            self._release = None

    def _hold(self, release: threading.Event) -> None:
        import torch

        torch.empty(1 << 16).fill_(0.0)  # a parallel region (64k elements: above PyTorch's grain): the team starts
        while not release.wait(self._poll_s) and self.owner_alive():
            pass
