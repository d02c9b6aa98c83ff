"""E+P+D: a decode instance that fails a job is blamed for it; the prefill instance that tried it is not.

With a decode instance dead, every job routed to it fails once before it moves on. Held against the
prefill instance, those failures (3 in a row) opened its breaker, and with a second prefill instance
restarting at the time, no prefill instance was routable: every request in that window got 503
``backend_unavailable``. Here the decode instance is a real client of an address nothing listens on.
"""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import grpc
import pytest

from services.common.pb import epd_pb2
from services.proxy.backends.instances import BreakerState, PdClient
from services.proxy.dispatch.handoff import HandoffAttempt
from services.proxy.dispatch.jobs import Job
from services.proxy.metrics import ProxyMetrics
from services.proxy.prompt.preprocess import Prompt


def _dead_address() -> str:
    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _client(address: str) -> PdClient:
    return PdClient(address, grpc.aio.insecure_channel(address))


async def test_a_dead_decode_instance_opens_its_own_breaker_not_the_prefill_instances():
    prefill, decode = _client(_dead_address()), _client(_dead_address())
    calls = SimpleNamespace(lease_ms=lambda job: 1000, remaining=lambda job: 5.0, metrics=ProxyMetrics())
    for number in range(prefill.breaker.threshold + 1):
        job = Job(f"job-{number}", Prompt([1, 2, 3]), epd_pb2.SamplingParams(), time.monotonic() + 5)
        attempt = HandoffAttempt(calls, job, prefill, f"job-{number}-0", decode)
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await attempt.start()
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
        attempt.fail(failure.value)  # what the pipeline does with every error of an attempt
        attempt.stop()
        assert attempt.pd_is_innocent and job.decodes_tried == {decode.address}
    assert decode.breaker.state is BreakerState.OPEN
    assert prefill.breaker.state is BreakerState.CLOSED and prefill.routable()
    assert prefill.num_outstanding == decode.num_outstanding == 0


async def test_a_decode_stream_that_breaks_after_the_prefill_is_the_decode_instances_failure():
    prefill, decode = _client(_dead_address()), _client(_dead_address())
    calls = SimpleNamespace(lease_ms=lambda job: 1000, remaining=lambda job: 5.0, metrics=ProxyMetrics())
    job = Job("job", Prompt([1, 2, 3]), epd_pb2.SamplingParams(), time.monotonic() + 5)
    attempt = HandoffAttempt(calls, job, prefill, "job-0", decode)
    attempt.prefill_status = "OK"  # P's stream ended well; D was streaming the answer when it broke
    attempt.fail(grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata()))
    assert attempt.pd_is_innocent and job.decodes_tried == {decode.address}
    attempt.stop()
    assert prefill.breaker._num_failures == 0 and decode.breaker._num_failures == 1
