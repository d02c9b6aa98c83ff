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

So a service ends the team of each thread that is not its model thread:
after loading (:func:`then_end_team`), on the event loop's thread, and in the
loop's helper threads (:func:`leave_teams_to_model_threads`); those threads'
later parallel regions run on themselves alone. Spinning workers cost a
process that shares its cores with another one computing at the same time;
:class:`SleepingWorkers` switches them to sleeping while that lasts
(``services/pd/shared_cores.py``). Under another OpenMP runtime (Intel's or
LLVM's ``libomp``, with other wait policies) this does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

OMP_PAUSE_SOFT = 1
"""``omp_pause_soft`` (OpenMP 5.0): the runtime frees its threads and may start them again when needed."""

_team_threads: int | None = None


def team_threads() -> int:
    """The process's team size: PyTorch's thread count as read before any team here ended.

    ``torch.get_num_threads()`` answers for the calling thread, which is 1 on
    a thread whose team ended; this is the count to give a thread a team."""
    global _team_threads
    if _team_threads is None:
        import torch

        _team_threads = torch.get_num_threads()
    return _team_threads


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (PyTorch's), if it has one with ``omp_pause_resource_all``."""
    import torch  # noqa: F401  (loads PyTorch's OpenMP runtime before the search)

    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libgomp" in line})
    except OSError:
        return None
    for path in paths:
        try:
            library = ctypes.CDLL(path)  # the loaded copy: the same soname is not loaded twice
            library.omp_pause_resource_all.argtypes = (ctypes.c_int,)
        except (OSError, AttributeError):
            continue
        library.omp_set_num_threads.argtypes = (ctypes.c_int,)
        return library
    return None


def end_team() -> bool:
    """Ends the calling thread's team of OpenMP workers; its later parallel regions run on it alone.

    False, changing nothing, without libgomp; also when called inside a
    parallel region, where the runtime refuses."""
    import torch

    library = _libgomp()
    if library is None:
        return False
    team_threads()  # read before the first team ends
    # PyTorch sets a thread's team size at the thread's first parallel loop; a loop
    # now (64k elements: above its grain) keeps that from undoing the size set below.
    torch.empty(1 << 16).fill_(0.0)
    library.omp_set_num_threads(1)
    return library.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


def then_end_team(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` with a whole team on the calling thread (loading a model, say), then :func:`end_team`."""
    import torch

    torch.set_num_threads(team_threads())
    try:
        return fn(*args, **kwargs)
    finally:
        end_team()


def leave_teams_to_model_threads() -> None:
    """For a service's event loop: ends the loop thread's team and gives the loop helper threads without one.

    Sets PyTorch's thread count for new threads first (its default is read
    per thread), so that the model thread, started later, gets a whole team."""
    import torch

    torch.set_num_threads(team_threads())
    if not end_team():
        log.debug("no libgomp with omp_pause_resource_all: OpenMP teams left as they are")
        return
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="loop-helper", initializer=end_team))


class SleepingWorkers:
    """Switches this process's idle OpenMP workers between spinning and sleeping (``set`` from one thread).

    libgomp lets idle workers spin only while the process holds no more
    OpenMP threads than it has CPUs. To make them sleep, and leave the cores
    to another process computing at the same time (an encoder beside a PD),
    a thread of this object's own holds a spare team, whose workers sleep and
    cost nothing; to let them spin again it ends that team. That thread starts
    at the first request for sleep and ends, team and all, once ``owner_alive``
    turns false (checked every ``poll_s``)."""

    def __init__(self, owner_alive: Callable[[], bool], poll_s: float = 1.0) -> None:
        self._owner_alive = owner_alive
        self._poll_s = poll_s
        self._wanted = False
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def set(self, sleep: bool) -> None:
        """Asks for sleeping (True) or spinning (False) workers; takes effect within moments."""
        if sleep == self._wanted:
            return
        with self._changed:
            self._wanted = sleep
            self._changed.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="openmp-spare-team", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        import torch

        library = _libgomp()
        if library is None:
            return
        holding = False
        while True:
            with self._changed:
                while self._wanted == holding and self._owner_alive():
                    self._changed.wait(self._poll_s)
                holding = self._wanted and self._owner_alive()
            if not self._owner_alive():
                end_team()
                return
            if holding:
                library.omp_set_num_threads(team_threads())
                torch.empty(1 << 16).fill_(0.0)  # a parallel region: the spare team starts and stays
            else:
                end_team()
