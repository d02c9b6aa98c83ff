"""Starting, checking and stopping one configuration's processes for ``epd bench serve``.

Each process is ``python -m services.cli pd|encoder|proxy ...`` with every
setting given as a flag (``EPD_*`` variables of the caller are not passed
on, so a stray variable cannot change one configuration and not another),
pinned to its cores with ``sched_setaffinity`` before exec, with its torch
threads set by ``--threads`` and ``OMP_NUM_THREADS``. Ports are picked by
binding port 0 and releasing it. Output goes to one log file per process.
Allow-lists are explicit where a topology names the peers a process pushes
to (encoders: ``--pd-allow``; E+P+D prefill PDs: ``--decode-allow``), as
``epd up`` sets them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from services.bench.serve.layout import ProcessSpec, Topology

PD_HEALTH = "epd.v1.PrefillDecode"
ENCODER_HEALTH = "epd.v1.Encoder"
CHILD_GRACE_S = 5.0
"""Drain time each child is given on SIGTERM (nothing is in flight when the benchmark stops them)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bound to 0, then released for the child to bind)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _repo_root() -> str:
    import services

    return str(Path(services.__file__).resolve().parent.parent)


def child_env(threads: int) -> dict[str, str]:
    """The caller's environment without ``EPD_*`` settings, with thread counts fixed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_") or k == "EPD_CACHE_DIR"}
    root = _repo_root()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.update(
        OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1"
    )
    return env


def _pin_and_tie(cores: tuple[int, ...]):
    """preexec_fn: pin to ``cores``; ask Linux to SIGTERM the child if the benchmark dies.

    libc is loaded here, in the parent: between fork and exec the child only
    makes two system calls (no imports, no dlopen, no locks to inherit).
    """
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):  # not glibc Linux: pinning still works
        prctl = None

    def preexec() -> None:
        os.sched_setaffinity(0, cores)
        if prctl is not None:
            prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    return preexec


@dataclass
class Child:
    """One started process."""

    spec: ProcessSpec
    argv: list[str]
    address: str
    log_path: Path
    process: subprocess.Popen | None = None
    measured_cores: tuple[int, ...] = ()

    @property
    def pid(self) -> int | None:
        """The process id; None before it is started."""
        return None if self.process is None else self.process.pid

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.spec.name,
            "role": self.spec.role,
            "cores": list(self.spec.cores),
            "measured_affinity": list(self.measured_cores),
            "threads": self.spec.threads,
            "encoder_local": self.spec.encoder_local,
            "pd_role": self.spec.pd_role if self.spec.role == "pd" else None,
            "address": self.address,
            "argv": self.argv,
        }


@dataclass
class ServiceArgs:
    """Everything that goes on the children's command lines besides placement."""

    model_dir: str
    host: str = "127.0.0.1"
    log_level: str = "warning"
    pd_args: tuple[str, ...] = ()
    encoder_args: tuple[str, ...] = ()
    proxy_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)


class Cluster:
    """The processes of one topology: ``start()``, ``await wait_ready()``, ``stop()``."""

    def __init__(self, topology: Topology, service: ServiceArgs, log_dir: Path) -> None:
        self.topology = topology
        self.service = service
        self.command = [sys.executable, "-m", "services.cli"]  # what each child's argv follows
        log_dir.mkdir(parents=True, exist_ok=True)
        addresses = {s.name: f"{service.host}:{free_port(service.host)}" for s in topology.processes}
        self.children = [
            Child(spec, self._argv(spec, addresses), addresses[spec.name], log_dir / f"{topology.name}-{spec.name}.log")
            for spec in topology.processes
        ]

    @property
    def proxy_urls(self) -> list[str]:
        return [f"http://{c.address}" for c in self.children if c.spec.role == "proxy"]

    def _argv(self, spec: ProcessSpec, addresses: dict[str, str]) -> list[str]:
        s = self.service
        port = addresses[spec.name].rsplit(":", 1)[1]
        common = ["--model", s.model_dir, "--host", s.host, "--port", port, "--log-level", s.log_level]
        push_to = ",".join(addresses[n] for n in spec.push_to)
        if spec.role == "proxy":
            decode = ["--decode", ",".join(addresses[n] for n in spec.decode_names)] if spec.decode_names else []
            return [
                "proxy",
                *common,
                "--pd",
                ",".join(addresses[n] for n in spec.pd_names),
                "--encoder",
                ",".join(addresses[n] for n in spec.encoder_names),
                *decode,
                "--preprocess-threads",
                str(spec.threads),
                "--grace",
                str(CHILD_GRACE_S),
                *s.proxy_args,
            ]
        served = [*common, "--metrics-port", "-1", "--threads", str(spec.threads)]
        if spec.role == "encoder":
            allow = ["--pd-allow", push_to] if push_to else []
            return ["encoder", *served, *allow, "--grace", str(CHILD_GRACE_S), *s.encoder_args]
        local = ["--encoder", "local" if spec.encoder_local else "remote"]
        role = ["--role", spec.pd_role] if spec.pd_role != "both" else []
        if spec.pd_role == "prefill" and push_to:
            role += ["--decode-allow", push_to]
        return ["pd", *served, *local, *role, "--grace", str(CHILD_GRACE_S), *s.pd_args]

    def start(self) -> None:
        """Starts every process (servers first); they load and warm up in parallel."""
        for child in sorted(self.children, key=lambda c: c.spec.role == "proxy"):
            self.start_child(child)

    def start_child(self, child: Child) -> None:
        """Starts (or restarts, on the same address) one process; its log is appended to."""
        env = {**child_env(child.spec.threads), **self.service.extra_env}
        with open(child.log_path, "ab") as log:
            child.process = subprocess.Popen(
                [*self.command, *child.argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=_pin_and_tie(child.spec.cores),
            )
        try:
            child.measured_cores = tuple(sorted(os.sched_getaffinity(child.process.pid)))
        except OSError:  # already gone; wait_ready reports it
            child.measured_cores = ()

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.spec.name == name)

    async def wait_ready(self, timeout_s: float, children: list[Child] | None = None) -> None:
        """Until every server's gRPC health and every proxy's /health say ready; raises on exit or timeout."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.children if children is None else children)
        while pending:
            for child in list(pending):
                assert child.process is not None
                if child.process.poll() is not None:
                    raise RuntimeError(
                        f"{self.topology.name}/{child.spec.name} exited with code "
                        f"{child.process.returncode} during start-up (log: {child.log_path})"
                    )
                if await self._ready(child):
                    pending.remove(child)
            if pending and time.monotonic() > deadline:
                names = ", ".join(c.spec.name for c in pending)
                raise TimeoutError(f"{self.topology.name}: not ready after {timeout_s:.0f}s: {names}")
            if pending:
                await asyncio.sleep(0.25)

    async def _ready(self, child: Child) -> bool:
        from services.common.grpc_utils import check_health

        if child.spec.role == "encoder":
            return await check_health(child.address, ENCODER_HEALTH)
        if child.spec.role == "pd":
            services = [PD_HEALTH, ENCODER_HEALTH] if child.spec.encoder_local else [PD_HEALTH]
            return all([await check_health(child.address, name) for name in services])
        return await asyncio.to_thread(proxy_ready, f"http://{child.address}")

    def exited(self) -> list[str]:
        """Names of processes that have died (checked between runs)."""
        return [c.spec.name for c in self.children if c.process is not None and c.process.poll() is not None]

    def stop(self, grace_s: float = 15.0) -> dict[str, int | None]:
        """SIGTERM every process at once; SIGKILL what outlives ``grace_s``. Returns exit codes.

        The benchmark stops a cluster only when nothing is in flight, so the
        usual order (proxy first, so that no new work arrives) buys nothing
        here, while stopping one by one would add up every shutdown's time.
        """
        running = [c.process for c in self.children if c.process is not None]
        for process in running:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in running:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return {c.spec.name: (c.process.returncode if c.process else None) for c in self.children}

    def describe(self) -> list[dict[str, Any]]:
        return [c.describe() for c in self.children]


def proxy_ready(base_url: str, timeout_s: float = 2.0) -> bool:
    """The proxy answers /health with 200 and reports every backend it knows as ready (E+P+D: decode PDs too)."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout_s) as reply:
            if reply.status != 200:
                return False
            report = json.loads(reply.read())
    except (OSError, ValueError, urllib.error.HTTPError):
        return False
    backends = [*report.get("pd", {}).values(), *report.get("encoder", {}).values(), *report.get("decode", {}).values()]
    return all(bool(ok) for ok in backends)


READY_TIMEOUT_S = 300.0
START_TRIES = 3
"""``epd up`` exits 2, before any child starts, when a port it is given is taken. Ports picked by binding
port 0 are ephemeral ports, which another process's outgoing connection can take before the child binds
them, so a start refused that way is tried again on fresh ports."""


def _up_argv(model_dir: str, up_args: Sequence[str]) -> tuple[list[str], str]:
    """``epd up``'s command line on free loopback ports, metrics off, and the proxy's base URL."""
    port = free_port()
    argv = [sys.executable, "-m", "services.cli", "up", "--model", model_dir, "--port", str(port)]
    argv += ["--encoder-base-port", str(free_port()), "--pd-base-port", str(free_port())]
    argv += ["--encoder-metrics-base-port", "-1", "--pd-metrics-base-port", "-1", "--launcher-metrics-port", "-1"]
    argv += ["--proxy-metrics-port", "-1", *up_args]
    return argv, f"http://127.0.0.1:{port}"


def _last_line(log: IO[bytes]) -> str:
    log.seek(0)
    lines = log.read().decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else "(nothing on stderr)"


def _stop_up(child: subprocess.Popen) -> None:
    child.send_signal(signal.SIGINT)
    try:
        child.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()


@contextlib.contextmanager
def epd_up(model_dir: str, up_args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> Iterator[str]:
    """``epd up`` on free loopback ports as a child process; yields the proxy's base URL once every
    backend is ready, and stops it with SIGINT (Ctrl-C) on exit. A start refused for its ports is tried
    again on others (``START_TRIES``); a child that exits before it is ready raises with its last stderr line."""
    with tempfile.TemporaryFile() as log:
        for _ in range(START_TRIES):
            argv, base_url = _up_argv(model_dir, up_args)
            log.seek(0)
            log.truncate()
            child = subprocess.Popen(
                argv, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True
            )
            try:
                deadline = time.monotonic() + READY_TIMEOUT_S
                while not proxy_ready(base_url) and child.poll() is None:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"epd up was not ready within {READY_TIMEOUT_S:.0f} s")
                    time.sleep(0.5)
            except BaseException:
                _stop_up(child)
                raise
            if child.returncode is None:
                break
            if child.returncode != 2:
                raise RuntimeError(f"epd up exited with code {child.returncode} before it was ready: {_last_line(log)}")
        else:
            raise RuntimeError(f"epd up refused to start {START_TRIES} times: {_last_line(log)}")
        try:
            yield base_url
        finally:
            _stop_up(child)
