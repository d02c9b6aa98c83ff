"""Finding 3 over gRPC: a caller's Preallocates are bounded; the refusal says when to retry.

One in-process PD on the tiny model with small bounds; a raw gRPC client
plays the proxy. After every test nothing is left reserved, pending or referenced.
"""

from __future__ import annotations

import hashlib

import grpc
import pytest
from pd_client import new_request_id, single_pd

from services.common.grpc_utils import RETRY_AFTER_KEY
from services.common.pb import epd_pb2

NUM_TOKENS = 16


@pytest.fixture(scope="module")
def pd_cluster(tiny_model_dir):
    yield from single_pd(tiny_model_dir, max_preallocations=3, max_preallocations_per_peer=2)


def _preallocate(stub, adapter, request_id: str):
    prompt = [5, 5, 5] + [adapter.image_token_id] * NUM_TOKENS + [6, 6, 6]
    mm_hash = hashlib.sha256(request_id.encode()).hexdigest()
    items = [epd_pb2.MultiModalItem(mm_hash=mm_hash, offset=3, num_tokens=NUM_TOKENS)]
    return stub.Preallocate(epd_pb2.PreallocateRequest(request_id=request_id, prompt_token_ids=prompt, items=items))


def test_a_flood_of_preallocates_from_one_caller_is_refused_with_a_retry_hint(stub, adapter):
    held = [new_request_id() for _ in range(2)]
    for request_id in held:
        _preallocate(stub, adapter, request_id)
    with pytest.raises(grpc.RpcError) as info:
        _preallocate(stub, adapter, new_request_id())
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(dict(info.value.trailing_metadata())[RETRY_AFTER_KEY]) > 0
    stub.Abort(epd_pb2.AbortRequest(request_id=held[0]))  # an abort gives the room back
    again = new_request_id()
    _preallocate(stub, adapter, again)
    for request_id in (held[1], again):
        stub.Abort(epd_pb2.AbortRequest(request_id=request_id))
