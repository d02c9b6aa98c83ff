"""``epd up --prefills 2 --decodes 2`` keeps serving while a prefill PD and a decode PD are SIGKILLed together.

48 mixed requests (text and image, some streamed), 4 at a time, through
encoder -> prefill -> decode, with each PD policy. A prefill instance is
killed after 12 requests completed and a decode instance right after, so
both are down at once: a request caught before its first token fails over to
another pair; at least 95% succeed and every other one ends with a clean error
(none is cut off silently). The decode instance's failures are its own: held
against the prefill instance that tried it, three of them would open its
breaker and, with the other prefill instance down, leave nothing to route to.
"""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_e2e_up_supervision import (
    REQUEST_TIMEOUT_S,
    Launcher,
    Outcome,
    _kill,
    free_port_range,
    send,
)

pytestmark = pytest.mark.e2e

NUM_REQUESTS = 48
CONCURRENCY = 4
KILLS = {12: "pd-0", 13: "pd-2"}  # completed requests -> service: pd-0, pd-1 prefill; pd-2, pd-3 decode


@pytest.fixture(scope="module", params=["least-loaded", "cache-aware"])
def launcher(request, tiny_model_dir, tmp_path_factory):
    proxy_port = free_port_range(1)
    encoder_base, pd_base = free_port_range(1), free_port_range(4)
    command = [sys.executable, "-m", "services.cli", "up", "--model", str(tiny_model_dir)]
    command += ["--encoders", "1", "--prefills", "2", "--decodes", "2", "--port", str(proxy_port)]
    command += ["--encoder-base-port", str(encoder_base), "--pd-base-port", str(pd_base)]
    command += ["--encoder-metrics-base-port", "-1", "--pd-metrics-base-port", "-1", "--launcher-metrics-port", "-1"]
    command += ["--proxy-metrics-port", "-1", "--threads", "1", "--log-level", "warning", "--restart-backoff-s", "0.2"]
    command += ["--pd-policy", request.param]
    env = {**os.environ, "EPD_CACHE_DIR": str(tmp_path_factory.mktemp("cache")), "PYTHONUNBUFFERED": "1"}
    env.pop("EPD_INTERNAL_TOKEN", None)
    launcher = Launcher(command, env)
    try:
        launcher.wait_for("cluster ready", 300)
        launcher.base_url = f"http://127.0.0.1:{proxy_port}"
        yield launcher
    finally:
        launcher.stop()


def test_a_killed_prefill_and_decode_instance_cost_under_five_percent(launcher):
    completed: list[Outcome] = []
    killed: list[str] = []
    lock = threading.Lock()

    def one(client: httpx.Client, index: int) -> None:
        outcome = send(client, index)
        with lock:
            completed.append(outcome)
            name = KILLS.get(len(completed))
            if name is None or name in killed:
                return
            killed.append(name)
        _kill(launcher.pid_of(name))

    with (
        httpx.Client(base_url=launcher.base_url, timeout=REQUEST_TIMEOUT_S + 10) as client,
        ThreadPoolExecutor(CONCURRENCY) as pool,
    ):
        list(pool.map(lambda i: one(client, i), range(NUM_REQUESTS)))
    ok = [o for o in completed if o.ok]
    failed = [o for o in completed if not o.ok]
    print(f"{len(ok)}/{len(completed)} succeeded; failed: {[(o.index, o.status, o.error_code) for o in failed]}")
    assert killed == ["pd-0", "pd-2"]
    assert [o for o in failed if not o.clean_failure] == []
    assert len(ok) >= 0.95 * NUM_REQUESTS
