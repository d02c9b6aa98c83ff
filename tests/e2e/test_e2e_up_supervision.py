"""``epd up`` keeps serving through a crash (issue 16's must-show), and through one service's crash loop.

One ``epd up --encoders 2 --pds 2`` on the tiny model serves a bounded mixed
load (text and image requests, some of them streamed) while one encoder and
then one PD are SIGKILLed. Without a restart of ``epd up``: at least 95% of
the requests succeed, every other one ends cleanly (an OpenAI error, or a
stream's error event followed by ``[DONE]``; none is cut off silently), and
both killed services are restarted on their ports and ready again within
60 s. A SIGSTOPped PD is found by its unanswered health RPCs, killed and
restarted. Then one encoder is killed and its port held, so that every restart
fails: ``epd up`` must leave that encoder down, name it with its exit and
its last lines, and keep serving with the others.

Before issue 16, ``epd up`` tore the whole cluster down at the first exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from oracle_support import data_url, make_image

pytestmark = pytest.mark.e2e

NUM_REQUESTS = 48
CONCURRENCY = 4
MAX_TOKENS = 6
KILL_ENCODER_AFTER = 12  # completed requests
KILL_PD_AFTER = 24
BACK_WITHIN_S = 60.0  # must-show bound for a killed service to be ready again
REQUEST_TIMEOUT_S = 20


def free_port_range(count: int) -> int:
    """The first of ``count`` consecutive ports that were all free just now."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - count)
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no free port range")


def disjoint_port_ranges(*counts: int) -> list[int]:
    """The first port of a free range per count, no two ranges overlapping (drawn apart, two could)."""
    taken: set[int] = set()
    bases = []
    for count in counts:
        while True:
            base = free_port_range(count)
            ports = set(range(base, base + count))
            if not ports & taken:
                break
        taken |= ports
        bases.append(base)
    return bases


class Launcher:
    """A running ``epd up`` and everything it has printed (read on a thread so the pipe never fills)."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self.lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with self._lock:
                self.lines.append((time.monotonic(), line.rstrip("\n")))

    def output(self) -> str:
        with self._lock:
            return "\n".join(line for _, line in self.lines)

    def wait_for(self, pattern: str, timeout_s: float, after: float = 0.0) -> tuple[float, re.Match]:
        """The first line printed after ``after`` that matches ``pattern``: (when, match)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with self._lock:
                for when, line in self.lines:
                    match = re.search(pattern, line)
                    if when >= after and match:
                        return when, match
            if self.process.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"{pattern!r} not printed within {timeout_s:.0f}s; output:\n{self.output()[-6000:]}")

    def pid_of(self, name: str, after: float = 0.0) -> int:
        return int(self.wait_for(rf"{name}\s+ready.*\bpid (\d+)\)", 5, after)[1].group(1))

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)


@dataclass
class Cluster:
    launcher: Launcher
    base_url: str
    encoder_base: int
    launcher_metrics: int


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    proxy_port, launcher_metrics, proxy_metrics, encoder_base, pd_base, encoder_metrics, pd_metrics = (
        disjoint_port_ranges(1, 1, 1, 2, 2, 2, 2)
    )
    command = [
        sys.executable,
        "-m",
        "services.cli",
        "up",
        "--model",
        str(tiny_model_dir),
        "--encoders",
        "2",
        "--pds",
        "2",
        "--port",
        str(proxy_port),
        "--encoder-base-port",
        str(encoder_base),
        "--pd-base-port",
        str(pd_base),
        "--encoder-metrics-base-port",
        str(encoder_metrics),
        "--pd-metrics-base-port",
        str(pd_metrics),
        "--launcher-metrics-port",
        str(launcher_metrics),
        "--proxy-metrics-port",
        str(proxy_metrics),
        "--threads",
        "1",
        "--log-level",
        "warning",
        "--max-restarts",
        "2",
        "--restart-backoff-s",
        "0.2",
    ]
    env = {**os.environ, "EPD_CACHE_DIR": str(tmp_path_factory.mktemp("cache")), "PYTHONUNBUFFERED": "1"}
    env.pop("EPD_INTERNAL_TOKEN", None)
    launcher = Launcher(command, env)
    try:
        launcher.wait_for("cluster ready", 300)
        yield Cluster(launcher, f"http://127.0.0.1:{proxy_port}", encoder_base, launcher_metrics)
    finally:
        launcher.stop()


# -- load ---------------------------------------------------------------------------
@dataclass
class Outcome:
    index: int
    streamed: bool
    status: int | None = None  # HTTP status; None = no answer at all
    finished: bool = False  # a finish_reason arrived
    error_event: bool = False  # a stream ended with an OpenAI error event
    done: bool = False  # a stream's data: [DONE]
    error_code: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.finished and not self.error_event and (self.done or not self.streamed)

    @property
    def clean_failure(self) -> bool:
        """Failed, but the client was told: an error status with a body, or an error event then [DONE]."""
        if self.status is not None and self.status != 200:
            return self.error_code is not None
        return self.streamed and self.error_event and self.done


def body_of(index: int) -> dict:
    images = [make_image(index % 7 + 1)] if index % 3 else []  # two thirds carry an image, some repeated
    content = [{"type": "text", "text": f"Request {index}: what is shown?"}]
    content += [{"type": "image_url", "image_url": {"url": data_url(image)}} for image in images]
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": index % 2 == 1,
    }


def send(client: httpx.Client, index: int) -> Outcome:
    body = body_of(index)
    outcome = Outcome(index, streamed=body["stream"])
    headers = {"X-Request-Timeout": str(REQUEST_TIMEOUT_S)}
    try:
        if not body["stream"]:
            reply = client.post("/v1/chat/completions", json=body, headers=headers)
            outcome.status = reply.status_code
            payload = reply.json()
            outcome.finished = reply.status_code == 200 and payload["choices"][0]["finish_reason"] is not None
            outcome.error_code = (payload.get("error") or {}).get("code")
            return outcome
        with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as reply:
            outcome.status = reply.status_code
            if reply.status_code != 200:
                outcome.error_code = (json.loads(reply.read()).get("error") or {}).get("code")
                return outcome
            for line in reply.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    outcome.done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    outcome.error_event, outcome.error_code = True, event["error"].get("code")
                elif any(choice.get("finish_reason") for choice in event.get("choices", [])):
                    outcome.finished = True
    except (httpx.HTTPError, ValueError):
        pass  # no (complete) answer: counted as lost below
    return outcome


def _kill(pid: int) -> float:
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


def _restarts(cluster: Cluster) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{cluster.launcher_metrics}/metrics", timeout=5).text
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'epd_launcher_restarts_total\{service="([^"]+)"\} (\S+)', text)
    }


def _launcher_metric(cluster: Cluster, name: str, service: str) -> float | None:
    text = httpx.get(f"http://127.0.0.1:{cluster.launcher_metrics}/metrics", timeout=5).text
    match = re.search(rf'{name}\{{service="{service}"\}} (\S+)', text)
    return None if match is None else float(match.group(1))


def test_a_killed_encoder_and_pd_are_restarted_while_the_cluster_keeps_serving(cluster):
    launcher = cluster.launcher
    proxy_pid = launcher.pid_of("proxy")
    completed: list[Outcome] = []
    kills: dict[str, float] = {}
    lock = threading.Lock()

    def one(client: httpx.Client, index: int) -> None:
        outcome = send(client, index)
        with lock:
            completed.append(outcome)
            count = len(completed)
            if count == KILL_ENCODER_AFTER and "encoder-0" not in kills:
                kills["encoder-0"] = _kill(launcher.pid_of("encoder-0"))
            elif count == KILL_PD_AFTER and "pd-0" not in kills:
                kills["pd-0"] = _kill(launcher.pid_of("pd-0"))

    with (
        httpx.Client(base_url=cluster.base_url, timeout=REQUEST_TIMEOUT_S + 10) as client,
        ThreadPoolExecutor(CONCURRENCY) as pool,
    ):
        list(pool.map(lambda i: one(client, i), range(NUM_REQUESTS)))

    assert set(kills) == {"encoder-0", "pd-0"}
    back = {
        name: launcher.wait_for(rf"{name}\s+ready again", BACK_WITHIN_S, after=killed)[0] - killed
        for name, killed in kills.items()
    }
    ok = [o for o in completed if o.ok]
    failed = [o for o in completed if not o.ok]
    lost = [o for o in failed if not o.clean_failure]
    print(
        f"{len(ok)}/{len(completed)} succeeded; failed cleanly: "
        f"{[(o.index, o.status, o.error_code, o.streamed) for o in failed]}; "
        f"back and ready after kill: " + ", ".join(f"{name} {s:.1f}s" for name, s in back.items())
    )
    assert len(completed) == NUM_REQUESTS
    assert lost == [], f"requests that ended without a clean error: {lost}"
    assert len(ok) >= 0.95 * NUM_REQUESTS
    assert all(seconds <= BACK_WITHIN_S for seconds in back.values())
    # epd up itself never restarted, nor its proxy; each kill counted once.
    assert launcher.process.poll() is None
    restarts = _restarts(cluster)
    assert restarts == {"encoder-0": 1, "encoder-1": 0, "pd-0": 1, "pd-1": 0, "proxy": 0}
    os.kill(proxy_pid, 0)  # the proxy that started with the cluster still runs
    # The proxy's health watch re-admits the restarted instances, and they serve again.
    end = time.monotonic() + 30
    while True:
        health = httpx.get(cluster.base_url + "/health", timeout=5).json()
        if all(health["pd"].values()) and all(health["encoder"].values()):
            break
        assert time.monotonic() < end, f"the proxy did not re-admit the restarted instances: {health}"
        time.sleep(0.1)
    with httpx.Client(base_url=cluster.base_url, timeout=30) as client:
        assert all(send(client, index).ok for index in range(100, 104))


def test_a_hung_pd_is_detected_by_rpc_and_restarted(cluster):
    """Second review, 7: a SIGSTOPped PD stayed "up" with 0 restarts; now its health RPCs time out and it is
    killed and restarted (default liveness: every 2 s, 2 s timeout, 3 failures in a row)."""
    launcher = cluster.launcher
    pid = launcher.pid_of("pd-1")
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        killed_at = launcher.wait_for(r"pd-1 \(pid \d+\) did not answer 3 health checks in a row", 60, after=stopped)[0]
        ready_at = launcher.wait_for(r"pd-1\s+ready again", 60, after=killed_at)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    print(f"hung pd-1: killed {killed_at - stopped:.1f}s after SIGSTOP, ready again {ready_at - stopped:.1f}s after")
    assert _launcher_metric(cluster, "epd_launcher_health_kills_total", "pd-1") == 1
    assert launcher.wait_for(r"pd-1 stopped answering health checks \(3 in a row\); restarting it", 5)
    with httpx.Client(base_url=cluster.base_url, timeout=30) as client:
        assert all(send(client, index).ok for index in range(300, 304))


def test_a_crash_loop_takes_out_only_that_service_while_the_others_keep_serving(cluster):
    """Second review, 7: one encoder's crash loop left it down, named; before, it stopped the whole cluster."""
    launcher = cluster.launcher
    port = cluster.encoder_base + 1
    killed = _kill(launcher.pid_of("encoder-1"))
    holder = socket.socket()  # every restart of encoder-1 now fails to bind its port
    try:
        end = time.monotonic() + 10
        while True:
            try:
                holder.bind(("127.0.0.1", port))
                break
            except OSError:  # the killed process's socket is not closed yet
                assert time.monotonic() < end, "the killed encoder's port never freed"
                time.sleep(0.02)
        holder.listen()
        pattern = r"encoder-1 is crash-looping: it exited with code 1 after 2 restarts within 60s; it stays down"
        launcher.wait_for(pattern, 180, after=killed)
        assert launcher.process.poll() is None  # epd up goes on
        assert _launcher_metric(cluster, "epd_launcher_crash_looping", "encoder-1") == 1
        assert _launcher_metric(cluster, "epd_launcher_crash_looping", "encoder-0") == 0
        output = launcher.output()
        tail = output[output.index("encoder-1 is crash-looping") :]
        assert "| " in tail and "bind" in tail  # its last output lines, with the reason
        # The others keep serving: text and images (on encoder-0) alike.
        with httpx.Client(base_url=cluster.base_url, timeout=30) as client:
            outcomes = [send(client, index) for index in range(200, 206)]
        assert all(o.ok for o in outcomes), [(o.index, o.status, o.error_code) for o in outcomes]
    finally:
        holder.close()
