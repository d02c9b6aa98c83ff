"""Structured outputs on a real PD over gRPC (tiny model): a constrained stream matches its regex and stops,
a constraint that does not compile is INVALID_ARGUMENT, and a constrained stream the client drops mid-way
leaves nothing behind."""

from __future__ import annotations

import re

import grpc
import pytest
from pd_client import greedy, new_request_id, run_generate, single_pd

from services.common.pb import epd_pb2

SECRET = "zebra-secret-42"


@pytest.fixture(scope="module")
def pd_cluster(tiny_model_dir):
    yield from single_pd(tiny_model_dir)


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
