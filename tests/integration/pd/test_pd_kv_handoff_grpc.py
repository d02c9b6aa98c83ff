"""E+P+D's KV hand-off over gRPC: a prefill PD pushes a request's KV to a decode PD.

A raw client plays the proxy: ReserveKV on D, Generate on P with the hand-off
(P prefills, samples the first token, pushes the blocks D lacks), then
Generate on D with the reservation. Greedy tokens must equal those of a
``--role both`` PD (itself held to transformers ``generate()`` by the e2e
oracle tests): text, an image, and Qwen2.5-VL with an image and a video,
whose M-RoPE positions D derives from the reserved spans (a video's with the
model's time rate). K/V a caller pushed is never served to a later request. Refusals (late, foreign or
malformed pushes, wrong role) leave nothing behind on any of the three.
P sends with ``push_wire``'s pre-encoded chunks and D receives data chunks as
views; a relay on the generated stubs between them (a generated-stub
receiver, then a generated-stub sender) must change nothing.
"""

from __future__ import annotations

import time
import uuid
from concurrent import futures

import grpc
import pytest
import torch
from cluster_support import InProcessCluster, pd_config
from pd_client import greedy, new_request_id, push_chunks, run_generate

from services.common import tensors
from services.common.models import load_adapter
from services.common.pb import epd_pb2, epd_pb2_grpc
from services.pd.server import start_pd

QWEN = "qwen2.5-vl-tiny"


class Trio:
    """Three in-process PDs of one model: ``both``, ``prefill`` and ``decode``, with stubs."""

    def __init__(self, model_dir: str) -> None:
        self.cluster = InProcessCluster(model_dir, num_encoders=0, num_pds=0, with_proxy=False).start()
        for role in ("both", "prefill", "decode"):
            config = pd_config(model_dir, host="127.0.0.1", port=0, role=role, block_size=4)
            self.cluster.pds.append(self.cluster.run(start_pd(config), timeout=300))
        self.channels = [grpc.insecure_channel(address) for address in self.cluster.pd_addresses]
        self.both, self.prefill, self.decode = (epd_pb2_grpc.PrefillDecodeStub(c) for c in self.channels)
        self.decode_address = self.cluster.pd_addresses[2]
        self.adapter = load_adapter(model_dir)

    def stop(self) -> None:
        for channel in self.channels:
            channel.close()
        self.cluster.stop()


@pytest.fixture(scope="module", params=["tiny", QWEN])
def trio(request, build_model):
    trio = Trio(str(build_model(request.param)))
    trio.model = request.param
    yield trio
    trio.stop()


@pytest.fixture(autouse=True)
def no_leaks(trio):
    yield
    assert trio.cluster.leaks() == {}, "a PD left something reserved, held, pending or referenced"


def image_prompt(trio, seed: int):
    """A prompt with one image span and a pushed-embedding stand-in: (prompt, items, embedding)."""
    grid = (1, 2, 4) if trio.model == QWEN else None
    num_tokens = 8
    prompt = [5, 9, 11] + [trio.adapter.image_token_id] * num_tokens + [6, 7, 8, 12, 13]
    item = epd_pb2.MultiModalItem(mm_hash=uuid.uuid4().hex * 2, offset=3, num_tokens=num_tokens)
    if grid is not None:
        item.grid.CopyFrom(epd_pb2.ImageGrid(t=grid[0], h=grid[1], w=grid[2]))
    generator = torch.Generator().manual_seed(seed)
    embedding = torch.randn(num_tokens, trio.adapter.hidden_size, generator=generator)
    return prompt, [item], embedding


def preallocate_and_push(stub, request_id, prompt, items, embedding):
    reply = stub.Preallocate(epd_pb2.PreallocateRequest(request_id=request_id, prompt_token_ids=prompt, items=items))
    for allocation, item in zip(reply.items, items):
        if allocation.state == epd_pb2.ItemAllocation.RESERVED:
            stub.PushEmbedding(push_chunks(request_id, allocation.reservation_id, item.mm_hash, embedding))


def generate_request(request_id, prompt, items, max_tokens, sampling=None, **fields):
    return epd_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        mm_items=items,
        sampling=sampling or greedy(max_tokens),
        **fields,
    )


def handed_off(trio, prompt, items=(), embedding=None, max_tokens=12, sampling=None, address=None):
    """Runs one request through P then D (P pushing to ``address``, default D's); returns
    (P's tokens, D's tokens, D's final message)."""
    request_id = new_request_id()
    grant = trio.decode.ReserveKV(
        epd_pb2.ReserveKVRequest(request_id=request_id, prompt_token_ids=prompt, items=items), timeout=30
    )
    if items:
        preallocate_and_push(trio.prefill, request_id, prompt, items, embedding)
    handoff = epd_pb2.KVHandoff(
        address=address or trio.decode_address,
        reservation_id=grant.reservation_id,
        num_cached_blocks=grant.num_cached_blocks,
    )
    first, _, _ = run_generate(
        trio.prefill, generate_request(request_id, prompt, items, max_tokens, sampling, kv_handoff=handoff)
    )
    tokens, _, final = run_generate(
        trio.decode,
        generate_request(request_id, prompt, items, max_tokens, sampling, kv_reservation_id=grant.reservation_id),
    )
    return first, tokens, final


def whole(trio, prompt, items=(), embedding=None, max_tokens=12, sampling=None):
    request_id = new_request_id()
    if items:
        preallocate_and_push(trio.both, request_id, prompt, items, embedding)
    tokens, _, _ = run_generate(trio.both, generate_request(request_id, prompt, items, max_tokens, sampling))
    return tokens


def test_text_is_token_exact_through_prefill_then_decode(trio):
    prompt = list(range(3, 40))
    expected = whole(trio, prompt)
    first, tokens, final = handed_off(trio, prompt)
    assert first == expected[:1]
    assert tokens == expected
    assert final.usage.completion_tokens == len(expected)


def test_seeded_sampling_goes_on_where_the_prefill_stopped(trio):
    prompt = list(range(7, 31))
    sampling = epd_pb2.SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=12, min_tokens=3)
    expected = whole(trio, prompt, sampling=sampling)
    assert handed_off(trio, prompt, sampling=sampling)[1] == expected


def logprobs_of(stub, request) -> list[tuple[int, float, tuple[int, ...]]]:
    return [
        (lp.token_id, round(lp.logprob, 4), tuple(lp.top_token_ids))
        for message in stub.Generate(request, timeout=60)
        for lp in message.logprobs
    ]


def test_the_first_tokens_logprobs_come_over_with_it(trio):
    prompt = list(range(11, 33))
    sampling = epd_pb2.SamplingParams(temperature=0.0, max_tokens=5, logprobs=3)
    expected = logprobs_of(trio.both, generate_request(new_request_id(), prompt, [], 5, sampling))
    request_id = new_request_id()
    grant = trio.decode.ReserveKV(epd_pb2.ReserveKVRequest(request_id=request_id, prompt_token_ids=prompt))
    handoff = epd_pb2.KVHandoff(
        address=trio.decode_address, reservation_id=grant.reservation_id, num_cached_blocks=grant.num_cached_blocks
    )
    run_generate(trio.prefill, generate_request(request_id, prompt, [], 5, sampling, kv_handoff=handoff))
    decoded = logprobs_of(
        trio.decode, generate_request(request_id, prompt, [], 5, sampling, kv_reservation_id=grant.reservation_id)
    )
    assert len(expected) == 5 and decoded == expected


def test_a_constrained_output_goes_on_under_the_same_grammar(trio):
    if trio.model != "tiny":
        pytest.skip("one model is enough: the grammar is the servicer's, not the model's")
    prompt = list(range(9, 25))
    constraint = epd_pb2.StructuredOutput(regex="[ab]{3}-[0-9]{2}")
    sampling = epd_pb2.SamplingParams(temperature=0.0, max_tokens=16, structured_output=constraint)
    expected = whole(trio, prompt, sampling=sampling)
    assert handed_off(trio, prompt, sampling=sampling)[1] == expected


def test_an_image_is_token_exact_through_prefill_then_decode(trio):
    prompt, items, embedding = image_prompt(trio, seed=1)
    expected = whole(trio, prompt, items, embedding)
    _, tokens, _ = handed_off(trio, prompt, items, embedding)
    assert tokens == expected


def test_a_video_is_token_exact_through_prefill_then_decode(trio):
    """Qwen2.5-VL spaces a video's temporal positions by ``tokens_per_second * second_per_grid_t``: the
    reservation's spans must be the Generate's, or D refuses the Generate after P pushed."""
    if trio.model != QWEN:
        pytest.skip("videos are Qwen2-VL-family inputs")
    assert trio.adapter.tokens_per_second not in (None, 1)  # a step other than 1 is what is checked
    num_tokens = 16  # t=2 temporal patches of 2x4 merged ones
    prompt = [5, 9, 11] + [trio.adapter.video_token_id] * num_tokens + [6, 7, 8, 12, 13]
    item = epd_pb2.MultiModalItem(
        mm_hash=uuid.uuid4().hex * 2, offset=3, num_tokens=num_tokens, grid=epd_pb2.ImageGrid(t=2, h=2, w=4)
    )
    item.second_per_grid_t = 1.5
    embedding = torch.randn(num_tokens, trio.adapter.hidden_size, generator=torch.Generator().manual_seed(5))
    expected = whole(trio, [*prompt], [item], embedding)
    first, tokens, final = handed_off(trio, prompt, [item], embedding)
    assert first == expected[:1] and tokens == expected
    assert final.usage.completion_tokens == len(expected)


class GeneratedStubRelay(epd_pb2_grpc.PrefillDecodeServicer):
    """A PushKV receiver on the generated stubs (parsed messages) that forwards each push to D with
    the generated stub's sender, keeping the chunks it saw."""

    def __init__(self, decode: epd_pb2_grpc.PrefillDecodeStub) -> None:
        self.decode = decode
        self.pushes: list[list[epd_pb2.PushKVChunk]] = []

    def PushKV(self, request_iterator, context):
        chunks = list(request_iterator)
        self.pushes.append(chunks)
        return self.decode.PushKV(iter(chunks), timeout=30)


def test_generated_stub_peers_interoperate_with_the_fast_push(trio):
    relay = GeneratedStubRelay(trio.decode)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    epd_pb2_grpc.add_PrefillDecodeServicer_to_server(relay, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        prompt = list(range(300, 345))
        expected = whole(trio, prompt)
        first, tokens, _ = handed_off(trio, prompt, address=f"127.0.0.1:{port}")
    finally:
        server.stop(0)
    assert first == expected[:1] and tokens == expected
    (chunks,) = relay.pushes
    header, data = chunks[0], chunks[1:]
    assert header.WhichOneof("kind") == "header" and header.header.shape[0] == 2
    assert data and all(c.WhichOneof("kind") == "data" and len(c.data) <= tensors.CHUNK_BYTES for c in data)
    assert sum(len(c.data) for c in data) == header.header.num_bytes


def test_pushed_kv_is_never_served_to_a_later_request(trio):
    """A caller with the internal token reserves, pushes made-up (zero) K/V and takes it over on D: a
    later request with that prompt must be served its own prefill's K/V, not the planted one."""
    prompt = list(range(50, 90))
    expected = whole(trio, prompt)
    request_id = new_request_id()
    grant = trio.decode.ReserveKV(epd_pb2.ReserveKVRequest(request_id=request_id, prompt_token_ids=prompt))
    _, layers, heads, _, block_size, head_dim = trio.cluster.pds[2].engine.core.runner.kv_push_shape(1)
    planted = kv_push(
        request_id,
        grant.reservation_id,
        grant.num_blocks - grant.num_cached_blocks,
        (layers, heads, block_size, head_dim),
    )
    trio.decode.PushKV(planted, timeout=30)
    run_generate(trio.decode, generate_request(request_id, prompt, [], 12, kv_reservation_id=grant.reservation_id))
    again = new_request_id()
    grant = trio.decode.ReserveKV(epd_pb2.ReserveKVRequest(request_id=again, prompt_token_ids=prompt))
    assert grant.num_cached_blocks == 0  # the planted blocks are nobody else's prefix
    trio.decode.Abort(epd_pb2.AbortRequest(request_id=again))
    first, tokens, final = handed_off(trio, prompt)
    assert tokens == expected and final.usage.cached_tokens == 0


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def kv_push(request_id, reservation_id, num_blocks, block_shape, dtype=torch.float32, first=1, extra=b""):
    shape = [2, block_shape[0], block_shape[1], num_blocks, block_shape[2], block_shape[3]]
    payload = bytes(tensors.expected_num_bytes(dtype, shape)) + extra
    header = epd_pb2.KVHeader(
        request_id=request_id,
        reservation_id=reservation_id,
        dtype=tensors.dtype_to_pb(dtype),
        shape=shape,
        num_bytes=len(payload) - len(extra),
        first_token_id=first,
    )
    yield epd_pb2.PushKVChunk(header=header)
    for chunk in tensors.iter_chunks(payload):
        yield epd_pb2.PushKVChunk(data=chunk)


def test_pushes_that_are_not_wanted_are_refused(trio):
    prompt = list(range(3, 20))
    request_id = new_request_id()
    grant = trio.decode.ReserveKV(epd_pb2.ReserveKVRequest(request_id=request_id, prompt_token_ids=prompt))
    pd = trio.cluster.pds[2]
    _, layers, heads, _, block_size, head_dim = pd.engine.core.runner.kv_push_shape(1)
    block = (layers, heads, block_size, head_dim)
    n = grant.num_blocks - grant.num_cached_blocks  # the prompt shares a prefix with earlier tests' on D
    cases = [
        (lambda: kv_push("other", grant.reservation_id, n, block), grpc.StatusCode.FAILED_PRECONDITION),
        (lambda: kv_push(request_id, "kvres-none", n, block), grpc.StatusCode.NOT_FOUND),
        (lambda: kv_push(request_id, grant.reservation_id, n - 1, block), grpc.StatusCode.FAILED_PRECONDITION),
        (
            lambda: kv_push(request_id, grant.reservation_id, n, block, torch.float16),
            grpc.StatusCode.FAILED_PRECONDITION,
        ),
        (lambda: kv_push(request_id, grant.reservation_id, n, block, extra=b"x"), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: iter([epd_pb2.PushKVChunk(data=b"x")]), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: kv_push(request_id, grant.reservation_id, n, block, first=10**7), grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for chunks, code in cases:
        assert code_of(lambda chunks=chunks: trio.decode.PushKV(chunks(), timeout=30)) == code
    landed = trio.decode.PushKV(kv_push(request_id, grant.reservation_id, n, block), timeout=30)  # still wanted
    assert landed.num_bytes == tensors.expected_num_bytes(torch.float32, [2, *block[:2], n, *block[2:]])
    again = code_of(lambda: trio.decode.PushKV(kv_push(request_id, grant.reservation_id, n, block), timeout=30))
    assert again == grpc.StatusCode.FAILED_PRECONDITION
    trio.decode.Abort(epd_pb2.AbortRequest(request_id=request_id))
    late = code_of(lambda: trio.decode.PushKV(kv_push(request_id, grant.reservation_id, n, block), timeout=30))
    assert late == grpc.StatusCode.NOT_FOUND


def test_an_expired_reservation_refuses_the_push(trio):
    prompt = list(range(3, 20))
    request_id = new_request_id()
    grant = trio.decode.ReserveKV(epd_pb2.ReserveKVRequest(request_id=request_id, prompt_token_ids=prompt, lease_ms=50))
    time.sleep(0.5)
    handoff = epd_pb2.KVHandoff(address=trio.decode_address, reservation_id=grant.reservation_id)
    code = code_of(lambda: run_generate(trio.prefill, generate_request(request_id, prompt, [], 4, kv_handoff=handoff)))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_roles_refuse_what_they_do_not_serve(trio):
    prompt = list(range(3, 12))
    for stub in (trio.prefill, trio.decode):
        code = code_of(lambda stub=stub: run_generate(stub, generate_request(new_request_id(), prompt, [], 4)))
        assert code == grpc.StatusCode.FAILED_PRECONDITION
    code = code_of(lambda: trio.prefill.ReserveKV(epd_pb2.ReserveKVRequest(request_id="x", prompt_token_ids=prompt)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    handoff = epd_pb2.KVHandoff(address="127.0.0.1:1", reservation_id="r")
    code = code_of(
        lambda: run_generate(trio.decode, generate_request(new_request_id(), prompt, [], 4, kv_handoff=handoff))
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION


def test_an_unreachable_decode_instance_fails_the_prefill(trio):
    handoff = epd_pb2.KVHandoff(address="127.0.0.1:1", reservation_id="kvres-x")
    prompt = list(range(3, 12))
    code = code_of(
        lambda: run_generate(
            trio.prefill, generate_request(new_request_id(), prompt, [], 4, kv_handoff=handoff), timeout=10
        )
    )
    assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def scrape(trio, index: int) -> dict[str, float]:
    from services.pd.metrics import PdMetrics

    pd = trio.cluster.pds[index]
    text = trio.cluster.run(PdMetrics(pd.engine, transfer=pd.servicer.kv.stats).render()).decode()
    return {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line.startswith("epd_pd_kv_") and " " in line
    }


def test_push_metrics_count_both_sides(trio):
    before = scrape(trio, 1), scrape(trio, 2)
    handed_off(trio, list(range(200, 230)))
    prefill, decode = scrape(trio, 1), scrape(trio, 2)
    sent = (
        prefill['epd_pd_kv_push_bytes_total{role="prefill"}'] - before[0]['epd_pd_kv_push_bytes_total{role="prefill"}']
    )
    received = (
        decode['epd_pd_kv_push_bytes_total{role="decode"}'] - before[1]['epd_pd_kv_push_bytes_total{role="decode"}']
    )
    assert sent == received > 0
    assert (
        prefill['epd_pd_kv_pushes_total{role="prefill"}'] >= 1
        and decode['epd_pd_kv_push_seconds_total{role="decode"}'] > 0
    )
    assert decode['epd_pd_kv_reservations{role="decode"}'] == prefill['epd_pd_kv_reservations{role="prefill"}'] == 0
    assert 'epd_pd_kv_reservations_expired_total{role="decode"}' in decode


def test_a_decode_address_outside_decode_allow_is_refused_before_the_prefill(trio):
    handoff = epd_pb2.KVHandoff(address="10.1.2.3:21061", reservation_id="kvres-x")  # not loopback: not allowed
    steps = trio.cluster.run(trio.cluster.pds[1].stats()).num_steps
    code = code_of(
        lambda: run_generate(
            trio.prefill, generate_request(new_request_id(), list(range(3, 12)), [], 4, kv_handoff=handoff)
        )
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert trio.cluster.run(trio.cluster.pds[1].stats()).num_steps == steps  # no prefill was spent on it
