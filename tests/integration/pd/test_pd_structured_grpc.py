"""Structured outputs on a real PD over gRPC (tiny model): a constrained stream matches its regex and stops,
a constraint that does not compile is INVALID_ARGUMENT, and a constrained stream the client drops mid-way
leaves nothing behind.

Compiles are bounded: long ``maxLength`` strings compile, a constraint that overruns the time bound is
INVALID_ARGUMENT within it and the next one is served as usual, compiles waiting beyond the bound are
RESOURCE_EXHAUSTED (a cached constraint never waits), a request that goes away drops its queued compile,
and the grammars kept stay within their bytes."""

from __future__ import annotations

import json
import re
import time

import grpc
import pytest
from pd_client import greedy, new_request_id, run_generate, single_pd

from services.common.grpc_utils import RETRY_AFTER_KEY
from services.common.pb import epd_pb2

SECRET = "zebra-secret-42"
TIMEOUT_S = 2.0
CACHE_MB = 1


@pytest.fixture(scope="module")
def pd_cluster(tiny_model_dir):
    yield from single_pd(
        tiny_model_dir,
        grammar_compile_timeout_s=TIMEOUT_S,
        max_pending_grammar_compiles=2,
        grammar_cache_mb=CACHE_MB,
    )


@pytest.fixture
def grammars(pd_cluster):
    return pd_cluster.pds[0].servicer.grammars


def _slow(n: int) -> epd_pb2.StructuredOutput:
    """A schema xgrammar compiles super-linearly (tens of seconds here), each ``n`` a new one."""
    return epd_pb2.StructuredOutput(json_schema=json.dumps({"type": "string", "pattern": f'^[^"]{{0,{n}}}$'}))


def _bounded(max_length: int) -> epd_pb2.StructuredOutput:
    schema = {"type": "object", "properties": {"text": {"type": "string", "maxLength": max_length}}}
    return epd_pb2.StructuredOutput(json_schema=json.dumps(schema))


def _wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _generate(constraint: epd_pb2.StructuredOutput, max_tokens: int = 64) -> epd_pb2.GenerateRequest:
    sampling = greedy(max_tokens)
    sampling.structured_output.CopyFrom(constraint)
    return epd_pb2.GenerateRequest(request_id=new_request_id(), prompt_token_ids=[5, 6, 7, 8], sampling=sampling)


def test_a_constrained_stream_matches_and_stops(stub):
    _, text, final = run_generate(stub, _generate(epd_pb2.StructuredOutput(regex="[ab]{3}-[0-9]{2}")))
    assert re.fullmatch("[ab]{3}-[0-9]{2}", text)
    assert final.finish_reason == epd_pb2.FINISH_REASON_STOP


def test_a_constraint_that_does_not_compile_is_invalid_argument(stub):
    with pytest.raises(grpc.RpcError) as refused:
        run_generate(stub, _generate(epd_pb2.StructuredOutput(regex=f"({SECRET}")))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert SECRET not in refused.value.details()


def test_a_dropped_constrained_stream_leaves_nothing(stub):
    # Any object never closes within the budget on random weights: the client hangs up mid-stream.
    call = stub.Generate(_generate(epd_pb2.StructuredOutput(json_object=True), max_tokens=256), timeout=60)
    assert next(call).token_ids
    call.cancel()


@pytest.mark.timeout(240)
def test_long_bounded_strings_compile_and_an_overrun_is_refused_within_the_bound(stub, grammars):
    for max_length in (4000, 9000):  # as patterns: 24-47 s and over 200 s each
        token_ids, _, _ = run_generate(stub, _generate(_bounded(max_length), max_tokens=8), timeout=120)
        assert token_ids
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as refused:
        run_generate(stub, _generate(_slow(8000)), timeout=120)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"longer than {TIMEOUT_S:g}s" in refused.value.details() and "8000" not in refused.value.details()
    assert time.monotonic() - started < 30 * TIMEOUT_S  # the bound, not the compile's tens of seconds
    _, text, _ = run_generate(stub, _generate(epd_pb2.StructuredOutput(regex="[cd]{3}-[0-9]{2}")), timeout=60)
    assert re.fullmatch("[cd]{3}-[0-9]{2}", text)  # the next constraint is served as usual
    assert 0 < grammars.cache_bytes <= CACHE_MB << 20


@pytest.mark.timeout(240)
def test_compiles_beyond_the_pending_bound_are_resource_exhausted(stub, grammars):
    cached = epd_pb2.StructuredOutput(regex="[ab]{3}-[0-9]{2}")
    run_generate(stub, _generate(cached), timeout=60)
    slow = [stub.Generate(_generate(_slow(8200 + i)), timeout=120) for i in range(2)]  # calls under way
    _wait_for(lambda: grammars.num_pending == 2)
    with pytest.raises(grpc.RpcError) as refused:
        run_generate(stub, _generate(epd_pb2.StructuredOutput(regex="[ef]+")), timeout=60)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(dict(refused.value.trailing_metadata())[RETRY_AFTER_KEY]) > 0
    assert run_generate(stub, _generate(cached), timeout=60)[0]  # cached: served while the compiles wait
    for call in slow:
        with pytest.raises(grpc.RpcError) as overran:
            list(call)
        assert overran.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    _wait_for(lambda: grammars.num_pending == 0)


@pytest.mark.timeout(240)
def test_a_request_that_goes_away_drops_its_queued_compile(stub, grammars):
    running = stub.Generate(_generate(_slow(8100)), timeout=120)
    _wait_for(lambda: grammars.num_pending == 1)
    queued_spec = epd_pb2.StructuredOutput(regex="[gh]{4}")
    queued = stub.Generate(_generate(queued_spec), timeout=120)
    _wait_for(lambda: grammars.num_pending == 2)
    queued.cancel()  # the client hangs up while its constraint waits for the compile thread
    _wait_for(lambda: grammars.num_pending == 1)
    with pytest.raises(grpc.RpcError):
        list(running)
    _wait_for(lambda: grammars.num_pending == 0)
    cached_before = grammars.num_cached
    run_generate(stub, _generate(epd_pb2.StructuredOutput(regex="[ij]{4}")), timeout=60)
    assert grammars.num_cached == cached_before + 1  # only the new one: the dropped one was never compiled
