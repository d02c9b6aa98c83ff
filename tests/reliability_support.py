"""Kill, restart and rejoin, measured: shared by the process-fault tests and soak scripts.

- ``ServiceProcess``: one ``epd encoder|pd`` process on a fixed port that can be
  killed (any signal) and started again on the same port.
- ``ProxyView``: what a running proxy says about an instance, over HTTP only
  (``/health`` readiness and the ``epd_proxy_backend_requests_total`` counter).
- ``Traffic``: client threads sending chat requests through the proxy until
  stopped (bounded by count and time), recording every outcome.
- ``kill_and_rejoin``: kills services under traffic, restarts them on their
  ports and returns one ``Recovery`` each; it raises if an instance does not
  rejoin within its bound.

Times are ``time.monotonic()`` seconds. Nothing here asserts on a duration.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

HEALTH_NAMES = {"encoder": "epd.v1.Encoder", "pd": "epd.v1.PrefillDecode"}
POLL_S = 0.02


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Polls ``predicate`` until true; returns the time it became true. Raises TimeoutError after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(POLL_S)
    return time.monotonic()


def wait_until_each(predicates: Sequence[Callable[[], bool]], timeout_s: float, what: str) -> list[float]:
    """Polls all ``predicates`` together; returns the time each first became true (then it is not asked again)."""
    end = time.monotonic() + timeout_s
    times: list[float | None] = [None] * len(predicates)
    while None in times:
        for i, predicate in enumerate(predicates):
            if times[i] is None and predicate():
                times[i] = time.monotonic()
        if None in times:
            if time.monotonic() > end:
                raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
            time.sleep(POLL_S)
    return times


def is_ready(address: str, kind: str, timeout_s: float = 2.0) -> bool:
    """True when the instance's ``grpc.health.v1`` says its service is SERVING."""
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=HEALTH_NAMES[kind]), timeout=timeout_s
            )
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


class ServiceProcess:
    """One ``python -m services.cli <kind>`` process bound to ``port``, restartable on it."""

    def __init__(self, kind: str, model_dir: str, port: int, log_path: Path, extra_args: Sequence[str] = ()) -> None:
        if kind not in HEALTH_NAMES:
            raise ValueError(f"kind must be one of {sorted(HEALTH_NAMES)}")
        self.kind = kind
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.command = [
            sys.executable,
            "-m",
            "services.cli",
            kind,
            "--model",
            model_dir,
            "--port",
            str(port),
            "--metrics-port",
            "-1",
            "--threads",
            "1",
            "--log-level",
            "warning",
            *extra_args,
        ]
        self.log_path = Path(log_path)
        self.process: subprocess.Popen | None = None
        self.num_starts = 0

    def start(self) -> None:
        if self.running:
            raise RuntimeError(f"{self.kind} {self.address} is already running")
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.num_starts += 1

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def ready(self) -> bool:
        """True once the service reports ready; raises if the process has exited."""
        if not self.running:
            raise RuntimeError(f"{self.kind} {self.address} is not running; see {self.log_path}")
        return is_ready(self.address, self.kind)

    def wait_ready(self, timeout_s: float = 120.0) -> float:
        """Blocks until the service reports ready; returns that time. Raises if it exits or times out."""
        return wait_until(self.ready, timeout_s, f"{self.kind} {self.address} to be ready")

    def kill(self, sig: int = signal.SIGKILL, wait_s: float = 60.0) -> float:
        """Sends ``sig`` and waits for the process to exit; returns the time the signal was sent."""
        assert self.process is not None
        sent = time.monotonic()
        os.kill(self.process.pid, sig)
        self.process.wait(wait_s)
        return sent

    def stop(self) -> None:
        """Teardown: kill if still running (graceful stops are what the tests check, not teardown)."""
        if self.running:
            self.process.kill()
        if self.process is not None:
            self.process.wait(30)


class ProxyView:
    """A proxy's opinion of its instances, read from ``/health`` and ``/metrics``."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")

    def health(self) -> dict:
        return httpx.get(self.base_url + "/health", timeout=5).json()

    def routable(self, kind: str, address: str) -> bool:
        """Ready and breaker closed, as ``/health`` reports it."""
        return bool(self.health()[kind].get(address))

    def num_served(self, kind: str, address: str) -> int:
        """Calls to the instance that ended OK (``epd_proxy_backend_requests_total``)."""
        text = httpx.get(self.base_url + "/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            if family.name != "epd_proxy_backend_requests":
                continue
            return int(
                sum(
                    s.value
                    for s in family.samples
                    if s.name.endswith("_total")
                    and s.labels.get("kind") == kind
                    and s.labels.get("address") == address
                    and s.labels.get("status") == "OK"
                )
            )
        return 0


@dataclass
class Outcome:
    """One request of a ``Traffic`` run."""

    index: int
    sent: float
    done: float = 0.0
    status: int | None = None  # HTTP status; None = no answer (connection error or client timeout)
    token_ids: list[int] | None = None
    error: dict | None = None  # the OpenAI error object of a non-200 answer

    @property
    def ok(self) -> bool:
        return self.status == 200


@dataclass
class Traffic:
    """``concurrency`` threads posting ``make_body(index)`` to ``{base_url}/v1/chat/completions`` until stopped.

    Bounded: at most ``max_requests`` requests and ``max_run_s`` seconds.
    Bodies should ask for ``return_token_ids`` so that answers can be checked.
    """

    base_url: str  # the proxy's root, e.g. http://127.0.0.1:8000
    make_body: Callable[[int], dict]
    concurrency: int = 3
    request_timeout_s: float = 15.0  # X-Request-Timeout of each request
    client_timeout_s: float = 30.0  # a request open longer than this has hung
    max_requests: int = 5000
    max_run_s: float = 600.0
    pause_s: float = 0.0  # each thread's think time between requests
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._indices = itertools.count()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> Traffic:
        self._deadline = time.monotonic() + self.max_run_s
        self._threads = [threading.Thread(target=self._worker, daemon=True) for _ in range(self.concurrency)]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.client_timeout_s + 5)
        with self._lock:
            return sorted(self.outcomes, key=lambda o: o.index)

    def num_ok(self) -> int:
        with self._lock:
            return sum(o.ok for o in self.outcomes)

    def first_success_sent_after(self, moment: float) -> Outcome | None:
        with self._lock:
            done = [o for o in self.outcomes if o.ok and o.sent >= moment]
        return min(done, key=lambda o: o.done) if done else None

    def _worker(self) -> None:
        headers = {"X-Request-Timeout": str(self.request_timeout_s)}
        with httpx.Client(base_url=self.base_url.rstrip("/"), timeout=self.client_timeout_s) as client:
            while not self._stop.is_set() and time.monotonic() < self._deadline:
                index = next(self._indices)
                if index >= self.max_requests:
                    return
                outcome = Outcome(index, sent=time.monotonic())
                try:
                    reply = client.post("/v1/chat/completions", json=self.make_body(index), headers=headers)
                    outcome.status = reply.status_code
                    payload = reply.json()
                    if reply.status_code == 200:
                        outcome.token_ids = payload["choices"][0]["token_ids"]
                    else:
                        outcome.error = payload.get("error")
                except (httpx.HTTPError, ValueError):
                    pass  # no (parsable) answer: status stays None
                outcome.done = time.monotonic()
                with self._lock:
                    self.outcomes.append(outcome)
                self._stop.wait(self.pause_s)


@dataclass(frozen=True)
class Recovery:
    """How one kill played out, in seconds."""

    kind: str
    address: str
    signal: str
    killed_at: float  # time.monotonic() of the signal
    marked_down_s: float  # kill -> the proxy's /health shows the instance not routable
    failover_s: float  # kill -> first successful request sent after the kill (served by the others)
    restart_ready_s: float  # restart -> the restarted process reports ready (process start + model load)
    rejoin_s: float  # restart -> first call the proxy completed OK on the restarted instance
    total_s: float  # kill -> back in rotation and serving

    def line(self) -> str:
        return (
            f"{self.kind} {self.address} {self.signal}: marked down {self.marked_down_s:.2f}s, "
            f"failover {self.failover_s:.2f}s, restart->ready {self.restart_ready_s:.2f}s, "
            f"restart->first request served {self.rejoin_s:.2f}s, kill->rejoined {self.total_s:.2f}s"
        )


def kill_and_rejoin(
    services: Sequence[ServiceProcess],
    proxy: ProxyView,
    traffic: Traffic,
    *,
    sig: int = signal.SIGKILL,
    restart_after_s: float = 0.0,
    timeout_s: float = 120.0,
) -> list[Recovery]:
    """Kills ``services`` (together) while ``traffic`` runs, restarts them on their ports, waits until each serves.

    ``restart_after_s``: downtime before the restarts (0 = as soon as the
    failover was observed). Every wait is bounded by ``timeout_s`` and raises
    ``TimeoutError`` when exceeded: an instance that never rejoins fails the
    caller, whatever the timings.
    """
    killed = [service.kill(sig) for service in services]
    marked_down = wait_until_each(
        [lambda s=s: not proxy.routable(s.kind, s.address) for s in services],
        timeout_s,
        "the proxy to take the killed instances out of rotation",
    )
    wait_until(
        lambda: traffic.first_success_sent_after(max(killed)) is not None,
        timeout_s,
        "a successful request after the kill",
    )
    failover = traffic.first_success_sent_after(max(killed)).done
    time.sleep(restart_after_s)
    served_before = [proxy.num_served(s.kind, s.address) for s in services]
    restarted = []
    for service in services:
        restarted.append(time.monotonic())
        service.start()
    ready = wait_until_each([lambda s=s: s.ready() for s in services], timeout_s, "the restarted instances to be ready")
    rejoined = wait_until_each(
        [lambda s=s, n=n: proxy.num_served(s.kind, s.address) > n for s, n in zip(services, served_before)],
        timeout_s,
        "the proxy to complete a call on each restarted instance",
    )
    name = signal.Signals(sig).name
    return [
        Recovery(
            kind=s.kind,
            address=s.address,
            signal=name,
            killed_at=k,
            marked_down_s=d - k,
            failover_s=failover - k,
            restart_ready_s=r - t,
            rejoin_s=j - t,
            total_s=j - k,
        )
        for s, k, d, t, r, j in zip(services, killed, marked_down, restarted, ready, rejoined)
    ]
