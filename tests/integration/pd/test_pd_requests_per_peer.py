"""Bounded by count per peer: Generate calls in progress from one caller address (``--max-requests-per-peer``).

With several proxies, one (or a token holder) could otherwise fill PD's whole
waiting queue. One in-process PD on the tiny model; a raw gRPC client plays
the proxy. After every test nothing is left reserved, pending or referenced.
"""

from __future__ import annotations

import grpc
import pytest
from pd_client import greedy, new_request_id, run_generate, single_pd

from services.common.grpc_utils import RETRY_AFTER_KEY
from services.common.pb import epd_pb2


@pytest.fixture(scope="module")
def pd_cluster(tiny_model_dir):
    yield from single_pd(tiny_model_dir, max_requests_per_peer=2)


def _generate(stub, max_tokens: int):
    request = epd_pb2.GenerateRequest(
        request_id=new_request_id(), prompt_token_ids=[5, 6, 7], sampling=greedy(max_tokens, ignore_eos=True)
    )
    return stub.Generate(request, timeout=60)


def test_a_callers_generates_beyond_its_bound_are_refused_with_a_retry_hint(stub):
    streams = [_generate(stub, 1000) for _ in range(2)]
    for stream in streams:
        next(stream)  # both are in progress
    with pytest.raises(grpc.RpcError) as info:
        run_generate(
            stub, epd_pb2.GenerateRequest(request_id=new_request_id(), prompt_token_ids=[5], sampling=greedy(2))
        )
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "caller" in info.value.details() and int(dict(info.value.trailing_metadata())[RETRY_AFTER_KEY]) > 0
    streams[0].cancel()  # a call that ends, however it ends, gives its slot back
    token_ids, _, final = run_generate(
        stub,
        epd_pb2.GenerateRequest(request_id=new_request_id(), prompt_token_ids=[5], sampling=greedy(2, ignore_eos=True)),
    )
    assert len(token_ids) == 2 and final.finish_reason == epd_pb2.FINISH_REASON_LENGTH
    streams[1].cancel()
