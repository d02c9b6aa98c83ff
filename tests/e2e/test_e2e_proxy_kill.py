"""Must-show 2: SIGKILL one encoder, then one PD, in the middle of a 200-request run.

The encoder and the PD that get killed are real processes (``python -m
services.cli encoder|pd``) so they die the hard way; the survivors and the
proxy run in this process (``InProcessCluster`` and uvicorn on background
loops), which halves the start-up cost and lets the test read the
survivors' leak counters. The proxy is never restarted. Every request must end in bounded
time with either the exact greedy tokens of ``transformers`` ``generate()``
or a clean OpenAI error; at least 95% must succeed; and the only failures
allowed are requests that were in flight at a kill.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
from cluster_support import InProcessCluster, ProxyThread, free_ports
from oracle_support import Oracle, make_image, user_message

from services.common import grpc_utils
from services.proxy.config import ProxyConfig

pytestmark = pytest.mark.e2e

NUM_REQUESTS = 200
CONCURRENCY = 8
MAX_TOKENS = 8
KILL_ENCODER_AFTER = 50  # completed requests
KILL_PD_AFTER = 110
REQUEST_TIMEOUT_S = 15  # X-Request-Timeout of every request
CLIENT_TIMEOUT_S = 30  # a request still open after this has hung


class Service:
    """One encoder or PD process."""

    def __init__(self, kind: str, model_dir: str, port: int, log_path) -> None:
        self.kind = kind
        self.address = f"127.0.0.1:{port}"
        self.log = open(log_path, "wb")  # noqa: SIM115 - the child writes it until killed
        command = [
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
            "--no-warmup",
        ]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def health_name(self) -> str:
        return "epd.v1.Encoder" if self.kind == "encoder" else "epd.v1.PrefillDecode"

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        """Teardown: graceful shutdown is tested elsewhere, so kill (in parallel, no waiting on drains)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.log.close()


@dataclass
class Outcome:
    index: int
    sent: float
    done: float = 0.0
    token_ids: list[int] | None = None
    error: object = None


async def wait_all_ready(services: list[Service], timeout: float) -> None:
    end = time.monotonic() + timeout
    for service in services:
        while not await grpc_utils.check_health(service.address, service.health_name):
            assert service.process.poll() is None, f"{service.kind} exited during start-up"
            assert time.monotonic() < end, f"{service.kind} {service.address} not ready"
            await asyncio.sleep(0.2)


def wait_proxy_sees_all(url: str, count: int, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while True:
        health = httpx.get(url + "/health").json()
        if sum(health["pd"].values()) + sum(health["encoder"].values()) == count:
            return
        assert time.monotonic() < end, health
        time.sleep(0.1)


REQUESTS = [
    (f"Question {i % 40}: what is shown?", [(i % 20) + 1, ((i * 7) % 20) + 1][: i % 3]) for i in range(NUM_REQUESTS)
]


def messages_of(index: int) -> tuple[list[dict], list]:
    text, seeds = REQUESTS[index]
    images = [make_image(seed, (32, 24 + 8 * (seed % 3))) for seed in seeds]
    return [user_message(text, images)], images


def run_one(client: openai.OpenAI, model: str, index: int) -> Outcome:
    outcome = Outcome(index, sent=time.monotonic())
    messages, _ = messages_of(index)
    kwargs = dict(
        model=model,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True},
        extra_headers={"X-Request-Timeout": str(REQUEST_TIMEOUT_S)},
    )
    try:
        if index % 2:
            token_ids = []
            for chunk in client.chat.completions.create(**kwargs, stream=True):
                for choice in chunk.choices:
                    token_ids += (choice.model_extra or {}).get("token_ids") or []
            outcome.token_ids = token_ids
        else:
            reply = client.chat.completions.create(**kwargs)
            outcome.token_ids = reply.choices[0].model_extra["token_ids"]
    except openai.APIError as error:  # status errors and in-stream error events
        outcome.error = error
    outcome.done = time.monotonic()
    return outcome


def is_clean_openai_error(error: object) -> bool:
    if isinstance(error, (openai.APITimeoutError, openai.APIConnectionError)):
        return False  # a hang or a broken connection, not an answer
    body = getattr(error, "body", None)
    if isinstance(body, dict) and "error" in body:
        body = body["error"]
    return isinstance(body, dict) and {"message", "type", "code"} <= set(body) and len(str(body)) < 1024


def test_sigkill_an_encoder_then_a_pd_mid_run(tiny_model_dir, tmp_path):
    model_dir = str(tiny_model_dir)
    encoder_port, pd_port = free_ports(2)
    victims = {
        "encoder": Service("encoder", model_dir, encoder_port, tmp_path / "encoder.log"),
        "pd": Service("pd", model_dir, pd_port, tmp_path / "pd.log"),
    }
    survivors = proxy = None
    try:
        # While the victims start: the survivors, the expected tokens, and the
        # proxy (it starts with the victims not ready and picks them up when they are).
        survivors = InProcessCluster(model_dir, num_encoders=1, num_pds=1, with_proxy=False).start()
        oracle = Oracle(model_dir)
        expected = {}
        for index in range(NUM_REQUESTS):
            key = REQUESTS[index][0], tuple(REQUESTS[index][1])
            if key not in expected:
                messages, images = messages_of(index)
                expected[key] = oracle.generate(messages, images, MAX_TOKENS)
        encoder_addresses = (victims["encoder"].address, *survivors.encoder_addresses)
        pd_addresses = (victims["pd"].address, *survivors.pd_addresses)
        proxy = ProxyThread(
            ProxyConfig(
                model=model_dir,
                port=0,
                pd_addresses=pd_addresses,
                encoder_addresses=encoder_addresses,
                request_timeout_s=REQUEST_TIMEOUT_S,
                breaker_open_s=1.0,
                load_poll_s=0.2,
            )
        )
        asyncio.run(wait_all_ready(list(victims.values()), timeout=120))
        wait_proxy_sees_all(proxy.url, 4)

        kills: dict[str, float] = {}
        completed = 0
        lock = threading.Lock()

        def run_and_count(client, model, index) -> Outcome:
            nonlocal completed
            outcome = run_one(client, model, index)
            with lock:
                completed += 1
                victim = {KILL_ENCODER_AFTER: "encoder", KILL_PD_AFTER: "pd"}.get(completed)
                if victim is not None:
                    kills[victim] = time.monotonic()
                    victims[victim].kill()
            return outcome

        started = time.monotonic()
        with openai.OpenAI(
            base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S
        ) as client:
            model = client.models.list().data[0].id
            with ThreadPoolExecutor(CONCURRENCY) as pool:
                outcomes = list(pool.map(lambda i: run_and_count(client, model, i), range(NUM_REQUESTS)))
        elapsed = time.monotonic() - started

        assert set(kills) == {"encoder", "pd"}
        successes = [o for o in outcomes if o.error is None]
        failures = [o for o in outcomes if o.error is not None]
        for outcome in successes:  # correct completions, token for token
            key = REQUESTS[outcome.index][0], tuple(REQUESTS[outcome.index][1])
            assert outcome.token_ids == expected[key], outcome.index
        for outcome in failures:  # clean errors, only for requests caught by a kill
            assert is_clean_openai_error(outcome.error), repr(outcome.error)
            assert any(outcome.sent <= at <= outcome.done for at in kills.values()), outcome.index
        assert all(o.done - o.sent < CLIENT_TIMEOUT_S for o in outcomes)  # nothing hung
        assert len(successes) >= 0.95 * NUM_REQUESTS
        after_both = [o for o in outcomes if o.sent > kills["pd"]]
        assert after_both and all(o.error is None for o in after_both)  # survivors carry on

        health = httpx.get(proxy.url + "/health").json()
        assert health["pd"] == {victims["pd"].address: False, survivors.pd_addresses[0]: True}
        assert health["encoder"] == {victims["encoder"].address: False, survivors.encoder_addresses[0]: True}
        assert survivors.leaks() == {}  # nothing left running, reserved or referenced
        print(
            f"\nmust-show 2: {len(successes)}/{NUM_REQUESTS} succeeded ({len(successes) / NUM_REQUESTS:.1%}) "
            f"in {elapsed:.1f}s; {len(failures)} clean errors "
            f"{sorted({getattr(o.error, 'status_code', None) or type(o.error).__name__ for o in failures}, key=str)}; "
            f"{len(after_both)} requests sent after both kills all succeeded"
        )
    finally:
        if proxy is not None:
            proxy.stop()
        for service in victims.values():
            service.stop()
        if survivors is not None:
            survivors.stop()
