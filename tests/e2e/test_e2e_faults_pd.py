"""PD fault switches (``epd pd --fault ...``) through real servers and the proxy.

- ``forward-raises-after=N``: the model forward of one step raises. The request
  in that batch ends with a clean 500 (INTERNAL), its KV blocks and embedding
  references are freed, and the same PD then serves token-exact answers.
- ``freeze-step-ms=M``: one step stalls. PD's readiness watchdog reports
  NOT_SERVING, the proxy sends new requests to the other PD, and once the step
  completes the frozen PD is ready again and gets traffic again.
- a hung PD (its whole event loop blocked, as SIGSTOP does to a process): the
  proxy answers 504 at the request's deadline, not after its cleanup Abort
  gives up (issue 27, item 9: 2 s deadline -> 7.0 s before), and once PD
  wakes up nothing is left on it.

Faults count steps from the end of warm-up, so each PD here serves nothing
before the test that owns it.
"""

from __future__ import annotations

import argparse
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
from cluster_support import InProcessCluster, pd_config
from grpc_health.v1 import health_pb2, health_pb2_grpc
from oracle_support import make_image, user_message
from test_e2e_handoff_support import MAX_TOKENS, ProxyOnly, chat, client_for

from services.common.pb import epd_pb2, epd_pb2_grpc
from services.pd.faults import PdFaults
from services.pd.main import add_arguments, config_from_args
from services.pd.server import start_pd

RAISE_AT_STEP = 3  # a lone request of MAX_TOKENS tokens runs >= MAX_TOKENS steps
FREEZE_MS = 60_000  # ended early by thaw(); a failing test still ends
STALL_TIMEOUT_S = 0.3
HUNG_S = 8.0  # how long the hung PD's event loop is blocked: longer than deadline + the Abort's 5 s
DEADLINE_S = 2.0
WAIT_S = 30.0  # bound of every wait loop


def _wait_for(predicate, what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="epd.v1.PrefillDecode"), timeout=5
        )
    return reply.status


def _num_steps(cluster: InProcessCluster, pd) -> int:
    return cluster.run(pd.stats()).num_steps


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    """A healthy PD and encoder (the cluster), plus one PD per fault, each behind its own proxy."""
    model_dir = str(tiny_model_dir)
    cluster = InProcessCluster(model_dir, with_proxy=False).start()
    proxies = {}
    try:
        raising, frozen = (
            cluster.run(start_pd(pd_config(model_dir, port=0, metrics_port=-1, grace_s=0, **overrides)))
            for overrides in (
                {"faults": PdFaults(forward_raises_after=RAISE_AT_STEP)},
                {"faults": PdFaults(freeze_step_ms=FREEZE_MS), "stall_timeout_s": STALL_TIMEOUT_S},
            )
        )
        cluster.pds += [raising, frozen]  # leak checks and stop() cover them
        proxies["raise"] = ProxyOnly(model_dir, [raising.address], cluster.encoder_addresses).start()
        # Load polling off: the proxy must not touch the frozen engine, so only the
        # watchdog can notice the stall.
        proxies["freeze"] = ProxyOnly(model_dir, [frozen.address, cluster.pd_addresses[0]], [], load_poll_s=0).start()
        proxies["hung"] = ProxyOnly(model_dir, [cluster.pd_addresses[0]], [], load_poll_s=0).start()
        yield cluster, raising, frozen, proxies
    finally:
        for pd in cluster.pds[1:]:
            pd.engine.core.runner.thaw()
        for proxy in proxies.values():
            proxy.stop()
        cluster.stop()


def test_the_switches_are_off_by_default_and_parsed_from_the_flag() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args([])).faults == PdFaults() and not PdFaults().enabled
    faults = config_from_args(parser.parse_args(["--fault", "forward-raises-after=0,freeze-step-ms=5"])).faults
    assert faults == PdFaults(forward_raises_after=0, freeze_step_ms=5)
    assert PdFaults.parse(faults.describe()) == faults
    for bad in ("forward-raises-after", "freeze-step-ms=x", "freeze-after=2", "forward-raises-after=-1", "hang"):
        with pytest.raises(ValueError):
            PdFaults.parse(bad)


def test_a_raising_forward_fails_its_batch_cleanly_and_pd_keeps_serving(setup, oracle) -> None:
    cluster, raising, _, proxies = setup
    client = client_for(proxies["raise"], timeout=60)
    image = make_image(500)
    messages = [user_message("Describe the picture.", [image])]
    with pytest.raises(openai.InternalServerError) as failure:
        chat(client, messages)  # the only request: it is in the batch whose forward raises
    assert failure.value.status_code == 500
    assert failure.value.body["code"] == "internal_error"
    assert raising.engine.core.runner.num_injected == 1
    assert cluster.leaks() == {}  # its KV blocks, embedding reference and reservation are gone

    # The same image again (its embedding or KV prefix may be reused) and others, concurrently.
    cases = [messages, [user_message("Just text.", [])], [user_message("Another.", [make_image(501)])]]
    images = [[image], [], [make_image(501)]]
    expected = [oracle.generate(m, i, MAX_TOKENS) for m, i in zip(cases, images)]
    with ThreadPoolExecutor(len(cases)) as pool:
        outputs = [tokens for tokens, _ in pool.map(lambda m: chat(client, m), cases)]
    assert outputs == expected
    assert cluster.leaks() == {}


def test_a_frozen_step_loop_turns_pd_not_ready_and_traffic_moves_to_the_other_pd(setup, oracle) -> None:
    cluster, _, frozen, proxies = setup
    healthy = cluster.pds[0]
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    # One request straight to the PD: nothing else reaches its engine, which was idle.
    with grpc.insecure_channel(frozen.address) as channel:
        stub = epd_pb2_grpc.PrefillDecodeStub(channel)
        request = epd_pb2.GenerateRequest(
            request_id="frozen-0",
            prompt_token_ids=[1, 2, 3, 4],
            sampling=epd_pb2.SamplingParams(temperature=0.0, max_tokens=4),
        )
        stuck: list[epd_pb2.GenerateResponse] = []
        reader = threading.Thread(target=lambda: stuck.extend(stub.Generate(request, timeout=WAIT_S)))
        reader.start()
        try:
            _wait_for(lambda: _health(frozen.address) == not_serving, "the watchdog to report NOT_SERVING")
            proxy_health = f"http://127.0.0.1:{proxies['freeze'].port}/health"
            _wait_for(
                lambda: not httpx.get(proxy_health).json()["pd"][frozen.address],
                "the proxy to see the frozen PD as not ready",
            )
            client = client_for(proxies["freeze"], timeout=WAIT_S)
            cases = [[user_message(f"While frozen {i}.", [])] for i in range(4)]
            expected = [oracle.generate(m, [], MAX_TOKENS) for m in cases]
            steps_before = _num_steps(cluster, healthy)
            with ThreadPoolExecutor(len(cases)) as pool:
                outputs = [tokens for tokens, _ in pool.map(lambda m: chat(client, m), cases)]
            assert outputs == expected
            assert _num_steps(cluster, healthy) > steps_before
            # Still frozen, still holding only its first request: nothing was routed to it.
            assert frozen.engine.core.runner.num_steps == 1 and reader.is_alive()
            assert frozen.engine.core.scheduler.num_running + frozen.engine.core.scheduler.num_waiting == 1
        finally:
            frozen.engine.core.runner.thaw()
            reader.join(WAIT_S)
    assert len([t for m in stuck for t in m.token_ids]) == 4 and stuck[-1].finish_reason  # it completed
    _wait_for(lambda: _health(frozen.address) == serving, "SERVING after the stall")

    # Traffic comes back to it (bounded: the proxy may pick the other PD for a while).
    client = client_for(proxies["freeze"], timeout=WAIT_S)
    for attempt in range(40):
        steps_before = frozen.engine.core.runner.num_steps
        chat(client, [user_message(f"After the stall {attempt}.", [])], max_tokens=2)
        if frozen.engine.core.runner.num_steps > steps_before:
            break
    else:
        pytest.fail("the proxy never routed to the recovered PD")
    assert cluster.leaks() == {}


def test_late_504s_a_hung_pd_answers_at_the_deadline_and_is_cleaned_up_after(setup) -> None:
    cluster, _, _, proxies = setup
    hanging = threading.Event()

    def hang() -> None:  # blocks the loop that serves the cluster's PDs: nothing there answers, not even Abort
        hanging.set()
        time.sleep(HUNG_S)

    cluster.loop.call_soon_threadsafe(hang)
    assert hanging.wait(WAIT_S)
    started = time.monotonic()
    reply = httpx.post(
        f"http://127.0.0.1:{proxies['hung'].port}/v1/chat/completions",
        json={"messages": [user_message("Anyone there?", [])], "max_tokens": MAX_TOKENS},
        headers={"X-Request-Timeout": str(DEADLINE_S)},
        timeout=WAIT_S,
    )
    elapsed = time.monotonic() - started
    assert reply.status_code == 504 and reply.json()["error"]["code"] == "timeout"
    assert DEADLINE_S <= elapsed < DEADLINE_S + 0.5, elapsed
    print(f"hung PD: 504 after {elapsed:.2f} s on a {DEADLINE_S} s deadline")  # reported, not asserted
    assert cluster.leaks(settle_s=HUNG_S + 10) == {}  # PD woke up, saw the cancel and the Abort
