"""An encoder SIGKILLed while it holds a reserved image: failover or a clean error, and nothing leaks.

Two encoders run as real processes, both with a slow push (``--fault
push-late-ms``) so that a request is still in flight on one of them after
PD reserved room for its image. The test kills whichever encoder holds it.
PD and the proxy run in-process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from cluster_support import InProcessCluster, free_ports
from oracle_support import Oracle, make_image, user_message
from test_e2e_handoff_support import MAX_TOKENS, ProxyOnly, chat, client_for

from services.common import grpc_utils
from services.common.pb import epd_pb2, epd_pb2_grpc

PUSH_LATE_MS = 1500


def _start_encoder(model_dir: str, port: int) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "services.cli",
        "encoder",
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
        "--fault",
        f"push-late-ms={PUSH_LATE_MS}",
    ]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    model_dir = str(tiny_model_dir)
    ports = free_ports(2)
    processes = {f"127.0.0.1:{port}": _start_encoder(model_dir, port) for port in ports}
    cluster = proxy = None
    try:
        cluster = InProcessCluster(model_dir, num_encoders=0, with_proxy=False).start()
        for address in processes:
            cluster.run(grpc_utils.wait_healthy(address, "epd.v1.Encoder", timeout=120), timeout=130)
        proxy = ProxyOnly(model_dir, cluster.pd_addresses, list(processes), request_timeout_s=30).start()
        yield cluster, proxy, processes
    finally:
        if proxy is not None:
            proxy.stop()
        for process in processes.values():
            if process.poll() is None:
                process.kill()
            process.wait(10)
        if cluster is not None:
            cluster.stop()


async def _outbound_bytes(address: str) -> int:
    async with grpc_utils.aio_channel(address) as channel:
        try:
            load = await epd_pb2_grpc.EncoderStub(channel).GetLoad(epd_pb2.GetLoadRequest(), timeout=1)
        except Exception:
            return 0
    return load.outbound_bytes


def _kill_the_holder(cluster: InProcessCluster, processes: dict[str, subprocess.Popen]) -> str:
    """Waits until PD reserved the image and a live encoder holds its push, then SIGKILLs that encoder."""
    end = time.monotonic() + 20
    while time.monotonic() < end:
        reserved = cluster.run(cluster.pds[0].stats()).num_reservations
        for address, process in processes.items():
            if reserved and process.poll() is None and cluster.run(_outbound_bytes(address)):
                os.kill(process.pid, signal.SIGKILL)
                process.wait(10)
                return address
        time.sleep(0.02)
    raise AssertionError("no encoder ever held the reserved image")


def _pd_reservations_drain(cluster: InProcessCluster) -> None:
    """Waits (at most one lease) until PD holds no reservation."""
    end = time.monotonic() + cluster.pds[0].config.default_lease_ms / 1000
    while cluster.run(cluster.pds[0].stats()).num_reservations:
        assert time.monotonic() < end, "PD still holds a reservation"
        time.sleep(0.02)


def test_killed_encoder_fails_over_to_the_other_one(setup, tiny_model_dir) -> None:
    cluster, proxy, processes = setup
    image = make_image(700)
    messages = [user_message("Survive this.", [image])]
    expected = Oracle(str(tiny_model_dir)).generate(messages, [image], MAX_TOKENS)
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(chat, client_for(proxy, timeout=30), messages)  # 30 s = the request deadline
        killed = _kill_the_holder(cluster, processes)
        token_ids, _ = reply.result(timeout=30)
    assert token_ids == expected
    _pd_reservations_drain(cluster)
    assert cluster.leaks() == {}
    assert processes[killed].returncode == -signal.SIGKILL


def test_last_encoder_killed_gives_a_clean_error(setup) -> None:
    cluster, proxy, processes = setup
    if all(process.poll() is not None for process in processes.values()):
        pytest.skip("needs the surviving encoder of the previous test")
    messages = [user_message("Nobody left.", [make_image(701)])]

    def request() -> int:
        try:
            chat(client_for(proxy, timeout=30), messages)
        except openai.APIStatusError as error:
            assert error.body and "message" in error.body
            return error.status_code
        return 200

    with ThreadPoolExecutor(1) as pool:
        status = pool.submit(request)
        _kill_the_holder(cluster, processes)
        assert status.result(timeout=30) == 503  # UNAVAILABLE everywhere: retry later
    _pd_reservations_drain(cluster)
    assert cluster.leaks() == {}
