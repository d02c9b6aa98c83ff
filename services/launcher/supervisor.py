"""Supervision of ``epd up``'s children: restart with backoff, crash-loop detection, a status endpoint.

A child that exits while ``epd up`` is not stopping is restarted with the
same command on the same port after a backoff delay; the others keep
serving, and the proxy's health watch takes the instance out of rotation
and back in once it reports ready again. A running child is also checked by
RPC (``HealthPolicy``): one that stops answering, as a SIGSTOPped or wedged
process does, is killed and restarted like one that exited. A restarted
child that does not report ready within ``ready_timeout_s`` is killed and
counts as one more exit, so a service wedged in start-up ends in a crash
loop instead of leaving a hole nobody reports. When one service has been
restarted ``max_restarts`` times within ``window_s`` and exits again, it
is crash-looping: it is left down (``epd_launcher_crash_looping``), one log
line names it with how it exited and its last output lines, and the others
keep serving. Supervision ends, and the caller stops the cluster, only when
the proxy or every PD is crash-looping.

Policy (``CrashHistory``, in ``policy.py``) is pure
and clock-driven; processes, readiness checks and output forwarding are
injected so the loop is testable with tiny processes. Every child's output is drained continuously by the
launcher (``child_output.py``): forwarded line by line, unchanged,
so JSON log lines stay JSON, dropped rather than waited for when nobody
reads ``epd up``'s own output, and its last lines kept for the crash report.
``epd up``'s own metrics are in ``metrics.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from services.common import launch_proof
from services.launcher.child_output import OutputForwarder, OutputTail
from services.launcher.metrics import LauncherMetrics
from services.launcher.policy import CrashHistory, CrashLoop, HealthPolicy, RestartPolicy, describe_exit
from services.launcher.spawner import ProcessSpawner
from services.launcher.specs import ServiceSpec

POLL_S = 0.2
"""How often exits are noticed and restarts are due-checked."""


class ChildState(enum.IntEnum):
    STARTING = 0  # spawned, not ready yet
    RUNNING = 1  # reported ready; checked for liveness every ``HealthPolicy.interval_s``
    WAITING = 2  # exited; restart due at ``restart_at``
    FAILED = 3  # crash-looping: left down until ``epd up`` is restarted, the others keep serving


@dataclass
class Child:
    """One supervised service and its current process."""

    spec: ServiceSpec
    history: CrashHistory
    process: subprocess.Popen | None = None
    output: OutputTail | None = None
    state: ChildState = ChildState.STARTING
    restart_at: float = 0.0
    num_restarts: int = 0
    started_at: float = 0.0
    not_ready_in_s: float | None = None  # set when supervision killed it for not becoming ready
    num_failed_checks: int = 0  # consecutive liveness checks not answered in time
    killed_as_hung: bool = False  # set when supervision killed it for failing its liveness checks
    launch_key: str = field(default_factory=launch_proof.new_launch_key, repr=False)  # its secret for this run
    check: asyncio.Task[bool] | None = None  # the liveness check in flight
    next_check_at: float = 0.0

    @property
    def popen(self) -> subprocess.Popen:
        """The current process; only for a child that was started."""
        assert self.process is not None, f"{self.spec.name} was never started"
        return self.process

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def tail(self) -> list[str]:
        return [] if self.output is None else self.output.lines()


class StartupFailed(Exception):
    """A child exited or did not become ready before the cluster was up."""


Say = Callable[[str], None]
ReadyCheck = Callable[[ServiceSpec, str], Awaitable[bool]]
"""``(spec, launch_key) -> ready/alive``: must hold only when the listener proves it holds ``launch_key``."""
Spawn = Callable[[ServiceSpec], tuple[subprocess.Popen, OutputTail]]


def _say(text: str) -> None:
    print(text, flush=True)


class Supervisor:
    """Starts the children, waits until all are ready, then keeps them running (see the module docstring)."""

    def __init__(
        self,
        specs: list[ServiceSpec],
        policy: RestartPolicy,
        *,
        is_ready: ReadyCheck,
        spawn: Spawn | None = None,
        metrics: LauncherMetrics | None = None,
        say: Say = _say,
        clock: Callable[[], float] = time.monotonic,
        ready_timeout_s: float | None = None,
        is_alive: ReadyCheck | None = None,
        health: HealthPolicy | None = None,
    ) -> None:
        self.policy = policy
        self.ready_timeout_s = ready_timeout_s  # for restarted children; None = wait forever
        self.children = [Child(spec, CrashHistory(policy)) for spec in specs]
        self._is_ready = is_ready
        self._is_alive = is_alive  # None = liveness by process only
        self.health = health or HealthPolicy()
        self._spawn = spawn or ProcessSpawner(OutputForwarder(sys.stderr.buffer))
        self.metrics = metrics or LauncherMetrics()
        self._say = say
        self._clock = clock
        for spec in specs:  # every series exists from the start, at 0
            self.metrics.restarts.labels(spec.name)
            self.metrics.health_kills.labels(spec.name)
            self.metrics.up.labels(spec.name).set(0)
            self.metrics.crash_looping.labels(spec.name).set(0)

    def _start(self, child: Child) -> None:
        # Only this child can prove its key, so a listener that took the port while it was down
        # is never taken for it (see ``services/common/launch_proof.py``).
        env = {**child.spec.env, launch_proof.LAUNCH_KEY_ENV: child.launch_key}
        if child.spec.kind == "proxy":  # the one that sends encoders and PDs the token verifies them too
            peers = {c.spec.address: c.launch_key for c in self.children if c.spec.health_service is not None}
            env[launch_proof.PEER_KEYS_ENV] = launch_proof.format_peer_keys(peers)
        child.process, child.output = self._spawn(dataclasses.replace(child.spec, env=env))
        child.state, child.started_at, child.not_ready_in_s = ChildState.STARTING, self._clock(), None
        child.num_failed_checks, child.killed_as_hung = 0, False
        if child.check is not None:  # a check of the previous process says nothing about this one
            child.check.cancel()
            child.check = None
        self.metrics.up.labels(child.spec.name).set(0)

    def start_all(self) -> None:
        for child in self.children:
            self._start(child)

    async def wait_ready(self, timeout_s: float, stop: asyncio.Event) -> None:
        """Until every child reports ready; ``StartupFailed`` when one exits or the time runs out."""
        deadline = self._clock() + timeout_s
        while not stop.is_set():
            for child in self.children:
                if child.popen.poll() is not None:
                    lines = "".join(f"\n  | {line}" for line in child.tail())
                    raise StartupFailed(
                        f"{child.spec.name} {describe_exit(child.popen.returncode)} during start-up{lines}"
                    )
            if await self._check_starting():
                return
            if self._clock() > deadline:
                pending = [c.spec.name for c in self.children if c.state is not ChildState.RUNNING]
                raise StartupFailed(f"not ready after {timeout_s:.0f}s: {', '.join(pending)}")
            await _wait(stop, POLL_S)

    async def _check_starting(self) -> bool:
        """Asks every starting child whether it is ready now; True when all children run."""
        starting = [c for c in self.children if c.state is ChildState.STARTING and c.popen.poll() is None]
        answers = await asyncio.gather(*(self._is_ready(c.spec, c.launch_key) for c in starting))
        for child, ready in zip(starting, answers):
            if ready and child.popen.poll() is None:
                child.state, child.next_check_at = ChildState.RUNNING, self._clock() + self.health.interval_s
                self.metrics.up.labels(child.spec.name).set(1)
                again = " again" if child.num_restarts else ""
                took = self._clock() - child.started_at
                self._say(
                    f"epd: {child.spec.name} ready{again} on {child.spec.address} ({took:.1f} s, pid {child.pid})"
                )
        return all(c.state is ChildState.RUNNING for c in self.children)

    async def supervise(self, stop: asyncio.Event) -> CrashLoop | None:
        """Restarts children that exit or hang until ``stop`` is set (None) or the cluster cannot serve.

        A crash-looping service is left down while the others keep serving;
        supervision ends (returning it) only when the proxy, or every PD,
        crash-looped: nothing could answer a request any more.
        """
        try:
            while not stop.is_set():
                now = self._clock()
                for child in self.children:
                    if child.state is ChildState.FAILED:
                        continue
                    if child.state is ChildState.WAITING:
                        if now >= child.restart_at:
                            self._start(child)
                            self._say(
                                f"epd: {child.spec.name} restarted (pid {child.pid}, restart {child.num_restarts})"
                            )
                        continue
                    if child.popen.poll() is None:
                        self._kill_if_not_ready(child, now)
                        self._check_alive(child, now)
                        continue
                    crash = self._on_exit(child, now)
                    if crash is not None and self._cannot_serve(crash):
                        return crash
                await self._check_starting()
                await _wait(stop, POLL_S)
            return None
        finally:
            for child in self.children:
                if child.check is not None:
                    child.check.cancel()

    def _cannot_serve(self, crash: CrashLoop) -> bool:
        """Whether the cluster is useless after ``crash``: the proxy or every PD is down for good."""
        if crash.name == "proxy":
            return True
        pds = [c for c in self.children if c.spec.kind == "pd"]
        return bool(pds) and all(c.state is ChildState.FAILED for c in pds)

    def _check_alive(self, child: Child, now: float) -> None:
        """Starts a due liveness check of a running child, or acts on the one that finished."""
        if self._is_alive is None or self.health.max_failures == 0 or child.state is not ChildState.RUNNING:
            return
        if child.check is None:
            if now >= child.next_check_at:
                child.check = asyncio.ensure_future(self._alive_within_timeout(child.spec, child.launch_key))
            return
        if not child.check.done():
            return
        alive, child.check = child.check.result(), None
        child.next_check_at = now + self.health.interval_s
        child.num_failed_checks = 0 if alive else child.num_failed_checks + 1
        if child.num_failed_checks >= self.health.max_failures and not child.killed_as_hung:
            child.killed_as_hung = True
            self.metrics.health_kills.labels(child.spec.name).inc()
            self._say(
                f"epd: {child.spec.name} (pid {child.pid}) did not answer {child.num_failed_checks} health checks "
                f"in a row ({self.health.timeout_s:g}s each); killing it as hung"
            )
            child.popen.kill()

    async def _alive_within_timeout(self, spec: ServiceSpec, launch_key: str) -> bool:
        assert self._is_alive is not None
        try:
            return await asyncio.wait_for(self._is_alive(spec, launch_key), self.health.timeout_s)
        except Exception:  # unanswered, refused or broken: a failed check either way, never a crash of supervision
            return False

    def _kill_if_not_ready(self, child: Child, now: float) -> None:
        """Kills a child still starting after ``ready_timeout_s``; its exit is then handled like any other."""
        timeout_s = self.ready_timeout_s
        if child.state is not ChildState.STARTING or timeout_s is None or now - child.started_at <= timeout_s:
            return
        if child.not_ready_in_s is None:
            child.not_ready_in_s = timeout_s
            self._say(f"epd: {child.spec.name} did not become ready within {timeout_s:g}s; killing it")
            child.popen.kill()

    def _on_exit(self, child: Child, now: float) -> CrashLoop | None:
        how = describe_exit(child.popen.returncode)
        if child.not_ready_in_s is not None:
            how = f"did not become ready within {child.not_ready_in_s:g}s"
        if child.killed_as_hung:
            how = f"stopped answering health checks ({child.num_failed_checks} in a row)"
        self.metrics.up.labels(child.spec.name).set(0)
        delay = child.history.on_exit(now)
        if delay is None:
            crash = CrashLoop(child.spec.name, how, child.history.num_recent, self.policy.window_s, child.tail())
            child.state = ChildState.FAILED
            self.metrics.crash_looping.labels(child.spec.name).set(1)
            self._say(f"epd: {crash.message(stopping=self._cannot_serve(crash))}")
            return crash
        child.num_restarts += 1
        child.state, child.restart_at = ChildState.WAITING, now + delay
        self.metrics.restarts.labels(child.spec.name).inc()
        self._say(
            f"epd: {child.spec.name} {how}; restarting it on {child.spec.address} in {delay:.1f}s "
            f"({child.history.num_recent} of {self.policy.max_restarts} restarts within "
            f"{self.policy.window_s:.0f}s); the others keep serving"
        )
        return None

    def stop_all(self, grace_s: float = 30.0) -> None:
        """Stops every child, tier by tier: the proxy, then the encoders, then the PDs (``STOP_ORDER``).

        The children of one tier are SIGTERMed together and waited for together, so that stopping
        takes as long as the slowest of each tier: an idle server exits at once, one with requests in
        flight drains them first (its own ``--grace``). Whatever outlives ``grace_s`` in its tier is
        SIGKILLed.
        """
        for tier in STOP_ORDER:
            running = [
                c.process
                for c in self.children
                if _tier(c.spec.kind) == tier and c.process is not None and c.process.poll() is None
            ]
            for process in running:
                process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for process in running:
                try:
                    process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        for child in self.children:
            if child.output is not None:
                child.output.lines(wait_s=2.0)  # let the last lines reach the terminal


STOP_ORDER = ("proxy", "encoder", "pd")
"""Tiers in the order they stop: no new work arrives once the proxy is gone, and encoders finish
their pushes to PDs that are still up."""


def _tier(kind: str) -> str:
    return kind if kind in STOP_ORDER else STOP_ORDER[-1]


async def _wait(event: asyncio.Event, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except TimeoutError:
        pass
