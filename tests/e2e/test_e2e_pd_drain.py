"""Must-show: SIGTERM to a PD under load drains it; plus the drain's two branches driven in-process.

The main test runs the PD that gets the SIGTERM as a real process (``epd pd
--grace 30 --log-json``) so its exit code and its JSON log are real; the
encoder, the other PD and the proxy run in this process (``InProcessCluster``
and uvicorn on a background loop), which halves the start-up cost and lets
the test read their leak counters and the proxy's access lines. The encoder
delays every push by ``PUSH_LATE_MS``, so the victim can be caught holding a
reservation whose embedding has not arrived yet: the SIGTERM is sent then.

Streaming requests run ``CONCURRENCY`` at a time until the SIGTERM, then
``NUM_AFTER`` more. Every one must answer 200 with all ``MAX_TOKENS`` tokens
(the tiny model never stops early); the victim must finish work after the
SIGTERM, including an image request whose push reached it during the drain;
every request sent after the SIGTERM must be served by the other PD; the
victim must exit 0 within its grace (plus a margin) having drained, not been
cut off; and nothing may be left reserved or outstanding anywhere.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import openai
import pytest
from cluster_support import InProcessCluster, ProxyThread, free_ports, pd_config
from oracle_support import make_image, user_message

from services.common import grpc_utils
from services.common.models import load_adapter
from services.common.pb import epd_pb2, epd_pb2_grpc
from services.common.tensors import dtype_to_pb, iter_chunks, tensor_bytes
from services.encoder.faults import Faults
from services.pd.server import SERVICE_NAME as PD_SERVICE
from services.proxy.config import ProxyConfig

pytestmark = pytest.mark.e2e

GRACE_S = 30  # the victim's --grace
EXIT_MARGIN_S = 15  # how much longer than its grace the victim may take to exit
MAX_TOKENS = 160  # per request: well under a second of decode on the tiny model
PUSH_LATE_MS = 1500  # the encoder's delay before each push
CONCURRENCY = 4
WARM_REQUESTS = 2  # completed before the SIGTERM may be sent
MAX_BEFORE = 40  # requests sent while waiting for the moment to send it
NUM_AFTER = 8  # requests sent after it
SECRET = "quokka-7391"  # in every prompt; never in a log line


class VictimPd:
    """The PD that gets the SIGTERM: a real process writing JSON logs to a file."""

    def __init__(self, model_dir: str, port: int, tmp_path) -> None:
        self.address = f"127.0.0.1:{port}"
        self.stderr_path = tmp_path / "pd.stderr.jsonl"
        self._stdout = open(tmp_path / "pd.stdout", "wb")  # noqa: SIM115 - closed in stop()
        self._stderr = open(self.stderr_path, "wb")  # noqa: SIM115 - closed in stop()
        command = [
            sys.executable,
            "-m",
            "services.cli",
            "pd",
            "--model",
            model_dir,
            "--port",
            str(port),
            "--metrics-port",
            "-1",
            "--threads",
            "1",
            "--grace",
            str(GRACE_S),
            "--log-json",
        ]
        self.process = subprocess.Popen(command, stdout=self._stdout, stderr=self._stderr, start_new_session=True)

    def log_entries(self) -> list[dict]:
        """Every stderr line, parsed as JSON (fails on a line that is not)."""
        return [json.loads(line) for line in self.stderr_path.read_text().splitlines() if line.strip()]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._stdout.close()
        self._stderr.close()


@dataclass
class Outcome:
    index: int
    sent: float
    done: float = 0.0
    response_id: str = ""
    num_tokens: int = 0
    error: object = None


def run_one(client: openai.OpenAI, index: int) -> Outcome:
    """One streaming request; odd ones carry a distinct image (a push each)."""
    outcome = Outcome(index, sent=time.monotonic())
    images = [make_image(1000 + index, (32, 32))] if index % 2 else []
    try:
        stream = client.chat.completions.create(
            model="tiny",
            messages=[user_message(f"Describe {SECRET} number {index}.", images)],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True},
            extra_headers={"X-Request-Timeout": "60"},
        )
        for chunk in stream:
            outcome.response_id = chunk.id
            for choice in chunk.choices:
                outcome.num_tokens += len((choice.model_extra or {}).get("token_ids") or [])
    except openai.APIError as error:
        outcome.error = error
    outcome.done = time.monotonic()
    return outcome


def sigterm_when_a_push_is_pending(victim: VictimPd, num_completed, killed: dict, give_up: threading.Event) -> None:
    """Polls the victim's load; SIGTERM as soon as it holds a reservation still waiting for its push."""
    with grpc.insecure_channel(victim.address) as channel:
        stub = epd_pb2_grpc.PrefillDecodeStub(channel)
        deadline = time.monotonic() + 180
        while not give_up.is_set() and time.monotonic() < deadline:
            load = stub.GetLoad(epd_pb2.GetLoadRequest(), timeout=5)
            if num_completed() >= WARM_REQUESTS and load.embedding_tokens_reserved > 0:
                # The request's Generate follows its Preallocate at once; the push is PUSH_LATE_MS away.
                time.sleep(0.05)
                killed["monotonic"], killed["wall"] = time.monotonic(), time.time()
                victim.process.send_signal(signal.SIGTERM)
                return
            time.sleep(0.02)


def test_sigterm_to_a_pd_under_load_drains_it(tiny_model_dir, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="services.proxy.web.middleware")
    model_dir = str(tiny_model_dir)
    victim = VictimPd(model_dir, free_ports(1)[0], tmp_path)
    survivors = proxy = None
    try:
        survivors = InProcessCluster(
            model_dir,
            num_encoders=1,
            num_pds=1,
            with_proxy=False,
            encoder={"faults": Faults.parse(f"push-late-ms={PUSH_LATE_MS}")},
        ).start()
        (survivor_address,) = survivors.pd_addresses
        proxy = ProxyThread(
            ProxyConfig(
                model=model_dir,
                port=0,
                pd_addresses=(victim.address, survivor_address),
                encoder_addresses=tuple(survivors.encoder_addresses),
                request_timeout_s=60,
                load_poll_s=0.2,
            )
        )
        asyncio.run(grpc_utils.wait_healthy(victim.address, PD_SERVICE, timeout=120))

        outcomes: list[Outcome] = []
        lock, slots = threading.Lock(), threading.Semaphore(CONCURRENCY)
        killed: dict[str, float] = {}
        give_up = threading.Event()

        def run_in_slot(client, index):
            try:
                outcome = run_one(client, index)
                with lock:
                    outcomes.append(outcome)
                return outcome
            finally:
                slots.release()

        watcher = threading.Thread(
            target=sigterm_when_a_push_is_pending, args=(victim, lambda: len(outcomes), killed, give_up)
        )
        watcher.start()
        with (
            openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=90) as client,
            ThreadPoolExecutor(CONCURRENCY) as pool,
        ):
            index = 0
            while not killed and index < MAX_BEFORE:
                slots.acquire()
                pool.submit(run_in_slot, client, index)
                index += 1
            give_up.set()
            watcher.join()
            assert killed, "the victim never held a pending push"
            exited: dict[str, float] = {}
            waiter = threading.Thread(
                target=lambda: exited.update(
                    code=victim.process.wait(timeout=GRACE_S + EXIT_MARGIN_S), at=time.monotonic()
                )
            )
            waiter.start()
            for _ in range(NUM_AFTER):
                slots.acquire()
                pool.submit(run_in_slot, client, index)
                index += 1
        waiter.join()
        exit_code, exit_s = exited["code"], exited["at"] - killed["monotonic"]

        # Every request answered 200 with every token, before, during and after the drain.
        assert len(outcomes) == index
        assert [o.index for o in outcomes if o.error is not None] == []
        assert all(o.num_tokens == MAX_TOKENS for o in outcomes)
        # The victim exited cleanly, and because its work was done, not because the grace ran out.
        assert exit_code == 0
        entries = victim.log_entries()  # --log-json: every line is a JSON object
        assert any(e["msg"].startswith("drained in") for e in entries)
        assert not any("grace period over" in e["msg"] for e in entries)
        assert not any(SECRET in json.dumps(e) for e in entries)

        def pd_of_each_request() -> dict[str, str]:  # request id -> PD address, from the proxy's access lines
            return {r.request_id: r.pd for r in caplog.records if getattr(r, "event", None) == "http"}

        # A line is written just after its response ended, so the last ones may trail the client.
        _wait_until(lambda: {o.response_id for o in outcomes} <= set(pd_of_each_request()), "proxy lines missing")
        served_by = pd_of_each_request()
        in_flight = [o for o in outcomes if o.sent < killed["monotonic"] < o.done]
        after = [o for o in outcomes if o.sent > killed["monotonic"]]
        assert len(after) >= NUM_AFTER  # (one more when a send raced the SIGTERM)
        assert all(served_by[o.response_id] == survivor_address for o in after)  # new work went elsewhere
        assert any(served_by[o.response_id] == victim.address for o in in_flight)
        victim_ok = [e for e in entries if e.get("event") == "generate" and e["status"] == "OK"]
        finished_in_drain = [e for e in victim_ok if e["ts"] > killed["wall"]]
        assert any(e["image_tokens"] for e in finished_in_drain)  # its push arrived after the SIGTERM
        assert all(e["completion_tokens"] == MAX_TOKENS for e in victim_ok)
        after_ids = {o.response_id for o in after}
        assert not any(e["request_id"].split("-r")[0] in after_ids for e in victim_ok)

        # Nothing left reserved, running or outstanding, and the proxy sees the victim gone.
        assert survivors.leaks() == {}
        assert proxy.num_outstanding() == 0
        health = proxy.app.state.proxy.backends.health_report()["pd"]
        assert health == {victim.address: False, survivor_address: True}
        print(
            f"\nmust-show (drain): {len(outcomes)} requests, all complete; {len(in_flight)} in flight at the "
            f"SIGTERM, {len(finished_in_drain)} finished by the draining PD, {len(after)} sent after it all "
            f"served by the other PD; the PD exited {exit_code} {exit_s:.1f}s after the SIGTERM "
            f"(grace {GRACE_S}s)"
        )
    finally:
        if proxy is not None:
            proxy.stop()
        victim.close()
        if survivors is not None:
            survivors.stop()


# -- the drain's branches, on in-process PDs driven over raw gRPC -------------------------------


@pytest.fixture(scope="module")
def two_pds(tiny_model_dir):
    """Two PDs, one for each test below (each test stops its own)."""
    cluster = InProcessCluster(str(tiny_model_dir), num_encoders=0, num_pds=2, with_proxy=False).start()
    yield cluster, load_adapter(str(tiny_model_dir))
    cluster.stop()


def _image_request(adapter, request_id: str, mm_hash: str, max_tokens: int):
    prompt = [5, 5, 5] + [adapter.image_token_id] * 16 + [6, 6, 6]
    items = [epd_pb2.MultiModalItem(mm_hash=mm_hash, offset=3, num_tokens=16)]
    preallocate = epd_pb2.PreallocateRequest(request_id=request_id, prompt_token_ids=prompt, items=items)
    generate = epd_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        mm_items=items,
        sampling=epd_pb2.SamplingParams(temperature=0, max_tokens=max_tokens),
    )
    return preallocate, generate


def _push(request_id: str, reservation_id: str, mm_hash: str, hidden_size: int):
    import torch

    embedding = torch.randn(16, hidden_size)
    data = tensor_bytes(embedding)
    yield epd_pb2.PushEmbeddingChunk(
        header=epd_pb2.EmbeddingHeader(
            request_id=request_id,
            reservation_id=reservation_id,
            mm_hash=mm_hash,
            dtype=dtype_to_pb(embedding.dtype),
            shape=list(embedding.shape),
            num_bytes=len(data),
        )
    )
    for chunk in iter_chunks(data, 1 << 20):
        yield epd_pb2.PushEmbeddingChunk(data=chunk)


def _wait_until(predicate, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def test_a_draining_pd_refuses_new_work_and_still_takes_pushes_for_admitted_work(two_pds, caplog):
    caplog.set_level(logging.INFO, logger="services.pd.server")
    cluster, adapter = two_pds
    pd, address = cluster.pds[0], cluster.pd_addresses[0]
    with grpc.insecure_channel(address) as channel:
        stub = epd_pb2_grpc.PrefillDecodeStub(channel)
        preallocate, generate = _image_request(adapter, "admitted", "a" * 64, max_tokens=24)
        reservation = stub.Preallocate(preallocate, timeout=30).items[0].reservation_id
        call = stub.Generate(generate, timeout=60)
        _wait_until(lambda: cluster.run(pd.stats()).num_live_requests == 1, "Generate not admitted")

        stopping = asyncio.run_coroutine_threadsafe(pd.stop(grace=60), cluster.loop)
        _wait_until(lambda: not cluster.run(grpc_utils.check_health(address, PD_SERVICE)), "still SERVING")
        new_preallocate, new_generate = _image_request(adapter, "late", "b" * 64, max_tokens=4)
        assert _code(lambda: stub.Preallocate(new_preallocate, timeout=30)) == grpc.StatusCode.UNAVAILABLE
        assert _code(lambda: list(stub.Generate(new_generate, timeout=30))) == grpc.StatusCode.UNAVAILABLE

        reply = stub.PushEmbedding(_push("admitted", reservation, "a" * 64, adapter.hidden_size), timeout=30)
        assert reply.num_bytes > 0
        messages = list(call)
    assert sum(len(m.token_ids) for m in messages) == 24
    assert messages[-1].finish_reason == epd_pb2.FINISH_REASON_LENGTH
    stopping.result(timeout=60)
    assert any(r.getMessage().startswith("drained in") for r in caplog.records)  # not cut off by the grace


def test_a_drain_that_outlasts_its_grace_stops_the_pd_anyway(two_pds, caplog):
    caplog.set_level(logging.INFO, logger="services.pd.server")
    cluster, adapter = two_pds
    pd, address = cluster.pds[1], cluster.pd_addresses[1]
    with grpc.insecure_channel(address) as channel:
        stub = epd_pb2_grpc.PrefillDecodeStub(channel)
        preallocate, generate = _image_request(adapter, "stuck", "c" * 64, max_tokens=4)
        stub.Preallocate(preallocate, timeout=30)
        call = stub.Generate(generate, timeout=60)  # waits for a push that never comes
        _wait_until(lambda: cluster.run(pd.stats()).num_live_requests == 1, "Generate not admitted")
        cluster.run(pd.stop(grace=0.5))
        assert _code(lambda: list(call)) in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    assert any("grace period over" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert not cluster.run(grpc_utils.check_health(address, "", timeout=0.5))  # the server is gone


async def test_a_starting_pd_is_not_serving_until_warmed_up(tiny_model_dir, monkeypatch):
    from services.pd import server as pd_server

    warmed, release = asyncio.Event(), asyncio.Event()
    real_warm_up = pd_server.warm_up

    async def held_warm_up(engine, **options):
        await real_warm_up(engine, **options)
        warmed.set()
        await release.wait()  # start-up stays here until the test has looked

    monkeypatch.setattr(pd_server, "warm_up", held_warm_up)
    port = free_ports(1)[0]
    address = f"127.0.0.1:{port}"
    starting = asyncio.create_task(
        pd_server.start_pd(pd_config(str(tiny_model_dir), host="127.0.0.1", port=port, metrics_port=-1))
    )
    try:
        await asyncio.wait_for(warmed.wait(), 120)
        assert await grpc_utils.check_health(address, "")  # alive: the port answers
        assert not await grpc_utils.check_health(address, PD_SERVICE)  # but not ready
    finally:
        release.set()
        pd = await asyncio.wait_for(starting, 60)
    try:
        assert await grpc_utils.check_health(address, PD_SERVICE)
    finally:
        await pd.stop(0)
