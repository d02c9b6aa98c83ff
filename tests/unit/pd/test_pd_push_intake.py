"""Finding 6: a push that trickles empty chunks never timed out, and every live push held a full-size buffer.

``PushIntake`` is driven with hand-made streams (async generators standing in
for gRPC request iterators).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.common import tensors
from services.common.pb import epd_pb2
from services.pd.engine.errors import EngineError, ErrorKind
from services.pd.push_intake import PushIntake, PushSlots

HIDDEN = 8
ROWS = 4
NUM_BYTES = ROWS * HIDDEN * 4
IDLE_S = 0.2


def header(reservation_id: str = "res-1") -> epd_pb2.PushEmbeddingChunk:
    return epd_pb2.PushEmbeddingChunk(
        header=epd_pb2.EmbeddingHeader(
            request_id="req-1",
            reservation_id=reservation_id,
            mm_hash="a" * 64,
            dtype=tensors.dtype_to_pb(torch.float32),
            shape=[ROWS, HIDDEN],
            num_bytes=NUM_BYTES,
        )
    )


def data(payload: bytes) -> epd_pb2.PushEmbeddingChunk:
    return epd_pb2.PushEmbeddingChunk(data=payload)


def intake(**limits) -> PushIntake:
    return PushIntake(HIDDEN, IDLE_S, **limits)


async def stream(*chunks, pause_s: float = 0.0, then_wait: asyncio.Event | None = None):
    for chunk in chunks:
        if pause_s:
            await asyncio.sleep(pause_s)
        yield chunk
    if then_wait is not None:
        await then_wait.wait()


async def test_a_whole_push_is_received():
    payload = torch.arange(ROWS * HIDDEN, dtype=torch.float32).numpy().tobytes()
    got, embedding = await intake().receive(stream(header(), data(payload[:64]), data(payload[64:])))
    assert got.reservation_id == "res-1" and embedding.shape == (ROWS, HIDDEN)


async def test_a_push_that_trickles_empty_chunks_is_ended():
    async def trickle():
        yield header()
        yield data(b"\0" * 16)
        for _ in range(100):  # 100 empty chunks, one every 0.05 s: 5 s of "activity" carrying no bytes
            await asyncio.sleep(0.05)
            yield data(b"")

    started = asyncio.get_running_loop().time()
    with pytest.raises(EngineError) as raised:
        await intake().receive(trickle())
    assert raised.value.kind is ErrorKind.DEADLINE_EXCEEDED
    assert asyncio.get_running_loop().time() - started < 10 * IDLE_S


async def test_push_buffers_in_flight_are_bounded_in_bytes():
    pushes = intake(max_buffer_bytes=NUM_BYTES)  # room for one buffer
    hold = asyncio.Event()
    first = asyncio.create_task(pushes.receive(stream(header("res-1"), data(b"\0" * 16), then_wait=hold)))
    await asyncio.sleep(0.05)
    assert pushes.buffered_bytes == NUM_BYTES
    with pytest.raises(EngineError) as raised:
        await pushes.receive(stream(header("res-2")))
    assert raised.value.kind is ErrorKind.RESOURCE_EXHAUSTED and raised.value.retry_after_s
    hold.set()
    with pytest.raises(EngineError):  # the first ends short of its bytes: its buffer is given back
        await first
    assert pushes.buffered_bytes == 0


async def test_pushes_in_flight_are_bounded_per_caller():
    pushes = intake(max_pushes_per_peer=1)
    hold = asyncio.Event()
    first = asyncio.create_task(pushes.receive(stream(header("res-1"), then_wait=hold), peer="ipv4:10.0.0.1"))
    await asyncio.sleep(0.05)
    with pytest.raises(EngineError) as raised:
        await pushes.receive(stream(header("res-2")), peer="ipv4:10.0.0.1")
    assert raised.value.kind is ErrorKind.RESOURCE_EXHAUSTED
    other = asyncio.create_task(pushes.receive(stream(header("res-3"), then_wait=hold), peer="ipv4:10.0.0.2"))
    await asyncio.sleep(0.05)
    assert not other.done()  # another caller's push is taken
    hold.set()
    for task in (first, other):
        with pytest.raises(EngineError):
            await task
    await pushes.receive(stream(header("res-4"), data(b"\0" * NUM_BYTES)), peer="ipv4:10.0.0.1")  # room again


def test_slots_let_one_push_over_the_byte_bound_in_alone():
    slots = PushSlots(100, 8, oversize_alone=True)
    with slots.hold("res-1", "peer", "busy") as slot:
        slot.take_buffer(150)  # larger than the bound, and no other buffer: let in
        with slots.hold("res-2", "peer", "busy") as other, pytest.raises(EngineError) as refused:
            other.take_buffer(1)
        assert refused.value.kind is ErrorKind.RESOURCE_EXHAUSTED
        with pytest.raises(EngineError) as busy, slots.hold("res-1", "peer", "busy"):
            pass
        assert busy.value.kind is ErrorKind.FAILED_PRECONDITION and busy.value.message == "busy"
    assert slots.buffered_bytes == 0 and slots.num_in_flight == 0
    strict = PushSlots(100, 8)  # without oversize_alone, such a push is refused even alone
    with strict.hold("res-3", "peer", "busy") as alone, pytest.raises(EngineError):
        alone.take_buffer(150)
    assert strict.buffered_bytes == 0 and strict.num_in_flight == 0


def deepstack_header(shape: list[int], levels: int) -> epd_pb2.PushEmbeddingChunk:
    chunk = header()
    chunk.header.shape[:] = shape
    chunk.header.num_deepstack_levels = levels
    chunk.header.num_bytes = 4 * shape[0] * (shape[1] if len(shape) == 2 else shape[1] * shape[2])
    return chunk


async def test_an_embedding_with_deepstack_levels_is_received_whole():
    levels = 3
    payload = torch.arange(ROWS * (1 + levels) * HIDDEN, dtype=torch.float32).numpy().tobytes()
    pushed = deepstack_header([ROWS, 1 + levels, HIDDEN], levels)
    got, embedding = await intake(num_deepstack_levels=levels).receive(stream(pushed, data(payload)))
    assert got.num_deepstack_levels == levels and embedding.shape == (ROWS, 1 + levels, HIDDEN)


@pytest.mark.parametrize(
    ("shape", "levels", "message"),
    [
        ([ROWS, HIDDEN], 0, "DeepStack levels"),  # an older sender: no features for a model that needs them
        ([ROWS, 3, HIDDEN], 2, "DeepStack levels"),  # levels that are not the model's
        ([ROWS, 2, HIDDEN], 3, r"\[num_tokens, 4, 8\]"),  # a shape that disagrees with its levels
        ([0, 4, HIDDEN], 3, "shape"),
    ],
)
async def test_a_push_without_the_models_deepstack_levels_is_refused(shape, levels, message):
    with pytest.raises(EngineError, match=message) as raised:
        await intake(num_deepstack_levels=3).receive(stream(deepstack_header(shape, levels)))
    assert raised.value.kind is ErrorKind.INVALID_ARGUMENT


async def test_a_model_without_deepstack_refuses_pushes_that_carry_levels():
    with pytest.raises(EngineError, match="0 DeepStack levels") as raised:
        await intake().receive(stream(deepstack_header([ROWS, 4, HIDDEN], 3)))
    assert raised.value.kind is ErrorKind.INVALID_ARGUMENT
