"""SIGKILL an encoder, then a PD, under traffic; restart each on its port; each must rejoin.

The victims are real processes (``python -m services.cli encoder|pd``); a
surviving encoder and PD and the proxy run in this process. Traffic keeps
flowing through the proxy the whole time (text and image requests, every
image new, so encoders and PDs both see work). For each kill the test
measures (``tests/reliability_support.py``): how fast the proxy took the
instance out of rotation, how fast requests succeeded again, how long the
restarted process took to be ready, and how long until the proxy completed a
call on it. Run with ``-s`` to see the numbers.

Checks: each restarted instance serves requests again (bounded waits, no
timed asserts); every answer is token-exact against ``transformers``
``generate()``; the only failures are clean OpenAI errors of requests in
flight at a kill; nothing is left reserved or pending anywhere.
"""

from __future__ import annotations

import grpc
import pytest
from cluster_support import InProcessCluster, free_ports
from oracle_support import make_image, user_message
from reliability_support import (
    ProxyView,
    ServiceProcess,
    Traffic,
    kill_and_rejoin,
    wait_until,
)
from test_e2e_handoff_support import ProxyOnly

from services.common.pb import epd_pb2, epd_pb2_grpc

pytestmark = pytest.mark.e2e

MAX_TOKENS = 6


def _case(index: int) -> tuple[list[dict], list]:
    """Request ``index`` (messages, images): every third is text-only, the others carry a new image
    (so that no cache spares the encoders work)."""
    if index % 3 == 0:
        return [user_message(f"Question {index % 7}: tell me more.", [])], []
    image = make_image(10_000 + index, (32, 32))
    return [user_message("What do you see?", [image])], [image]


def _body(index: int) -> dict:
    return {"messages": _case(index)[0], "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}


def _idle(service: ServiceProcess) -> dict[str, int]:
    """Non-zero in-flight counters of a (restarted) process, read over GetLoad."""
    with grpc.insecure_channel(service.address) as channel:
        if service.kind == "pd":
            load = epd_pb2_grpc.PrefillDecodeStub(channel).GetLoad(epd_pb2.GetLoadRequest(), timeout=5)
            fields = ("num_running", "num_waiting", "num_reservations", "embedding_tokens_reserved")
        else:
            load = epd_pb2_grpc.EncoderStub(channel).GetLoad(epd_pb2.GetLoadRequest(), timeout=5)
            fields = ("num_pending", "outbound_bytes")
    return {name: getattr(load, name) for name in fields if getattr(load, name)}


def test_killed_instances_restart_on_their_port_and_rejoin(tiny_model_dir, tmp_path, oracle) -> None:
    model_dir = str(tiny_model_dir)
    encoder_port, pd_port = free_ports(2)
    victims = [
        ServiceProcess("encoder", model_dir, encoder_port, tmp_path / "encoder.log"),
        ServiceProcess("pd", model_dir, pd_port, tmp_path / "pd.log"),
    ]
    for victim in victims:
        victim.start()
    survivors = proxy = traffic = None
    try:
        survivors = InProcessCluster(model_dir, with_proxy=False).start()
        proxy = ProxyOnly(
            model_dir,
            [victims[1].address, *survivors.pd_addresses],
            [victims[0].address, *survivors.encoder_addresses],
            request_timeout_s=15,
            breaker_open_s=1.0,
            load_poll_s=0.2,
        ).start()
        view = ProxyView(f"http://127.0.0.1:{proxy.port}")
        for victim in victims:
            victim.wait_ready()
        wait_until(
            lambda: all(all(group.values()) for group in (view.health()["pd"], view.health()["encoder"])),
            60,
            "the proxy to see all four instances ready",
        )

        traffic = Traffic(view.base_url, _body, concurrency=2, pause_s=0.2, max_requests=2000, max_run_s=300).start()
        wait_until(lambda: traffic.num_ok() >= 5, 60, "traffic to flow")
        recoveries = kill_and_rejoin(victims, view, traffic, timeout_s=120)  # both at once
        outcomes = traffic.stop()
        traffic = None

        failed = [o for o in outcomes if not o.ok]
        print(
            "\nrestart and rejoin:\n  "
            + "\n  ".join(r.line() for r in recoveries)
            + f"\n  {len(outcomes)} requests, {len(outcomes) - len(failed)} succeeded, "
            f"failed: {sorted((o.status, (o.error or {}).get('code')) for o in failed)}"
        )
        assert all(o.status is not None for o in outcomes), "a request got no answer (hung or connection lost)"
        for outcome in failed:  # clean errors, and only for requests in flight at a kill
            assert outcome.status >= 500 and outcome.error and {"message", "type", "code"} <= set(outcome.error)
            assert any(outcome.sent <= r.killed_at <= outcome.done for r in recoveries), outcome.index
        expected: dict[str, list[int]] = {}  # text-only prompts repeat
        for outcome in (o for o in outcomes if o.ok):
            messages, images = _case(outcome.index)
            key = str(messages) if not images else str(outcome.index)
            if key not in expected:
                expected[key] = oracle.generate(messages, images, MAX_TOKENS)
            assert outcome.token_ids == expected[key], outcome.index
        assert survivors.leaks() == {}
        for victim in victims:
            wait_until(lambda victim=victim: not _idle(victim), 10, f"the restarted {victim.kind} to be idle")
    finally:
        if traffic is not None:
            traffic.stop()
        if proxy is not None:
            proxy.stop()
        for victim in victims:
            victim.stop()
        if survivors is not None:
            survivors.stop()
