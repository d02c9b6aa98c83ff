"""A push lands at the first step end after its bytes are in, not the second.

The engine thread answers the asyncio side only between steps. A push that
asked the core whether it was wanted before reading its bytes, then stored
them with a second call, waited for two step ends: under an image burst,
where a step with prompts in it takes seconds, the image reached its prompt
seconds late. Here the engine thread runs the real ``EngineBridge`` loop with
every step held for a while, as a busy PD's are, and the push goes through the
real ``PushEmbedding`` servicer.
"""

from __future__ import annotations

import asyncio
import time

import torch
from core_support import FakeClock, make_core
from reservation_push_support import ContextDouble

from services.common import tensors
from services.common.pb import epd_pb2
from services.pd.bridge import EngineBridge
from services.pd.config import PdConfig
from services.pd.engine.errors import ErrorKind
from services.pd.engine.outputs import StepResult
from services.pd.engine.request import MultiModalSpan
from services.pd.servicer import PrefillDecodeServicer

ROWS = 4
MM_HASH = "c" * 64
STEP_S = 0.2  # long beside reading a push of a few hundred bytes, even on a loaded machine


def _busy_bridge() -> tuple[EngineBridge, list[float]]:
    """A bridge whose engine thread steps without pause, each step taking ``STEP_S``; returns the step ends."""
    bridge = EngineBridge(make_core(clock=FakeClock(), num_blocks=64, block_size=4))
    ends: list[float] = []

    def busy_step() -> StepResult:
        time.sleep(STEP_S)
        ends.append(time.monotonic())
        return StepResult(events=[], executed=True)

    bridge.core.step = busy_step  # type: ignore[method-assign]
    return bridge, ends


def _chunks(request_id: str, reservation_id: str, hidden_size: int) -> list[epd_pb2.PushEmbeddingChunk]:
    data = bytes(tensors.tensor_bytes(torch.ones(ROWS, hidden_size)))
    header = epd_pb2.EmbeddingHeader(
        request_id=request_id,
        reservation_id=reservation_id,
        mm_hash=MM_HASH,
        dtype=tensors.dtype_to_pb(torch.float32),
        shape=[ROWS, hidden_size],
        num_bytes=len(data),
    )
    return [epd_pb2.PushEmbeddingChunk(header=header), epd_pb2.PushEmbeddingChunk(data=data)]


async def _push(servicer: PrefillDecodeServicer, chunks: list[epd_pb2.PushEmbeddingChunk]) -> None:
    async def stream():
        for chunk in chunks:
            yield chunk

    await servicer.PushEmbedding(stream(), ContextDouble())


async def test_a_push_waits_for_one_step_end_while_the_engine_is_busy():
    bridge, ends = _busy_bridge()
    servicer = PrefillDecodeServicer(
        bridge, PdConfig(model="unused"), eos_token_ids=(), vocab_size=16, max_model_len=64
    )
    bridge.start()
    try:
        prompt = [1, 2] + [9] * ROWS + [3]
        (allocation,) = await bridge.preallocate("r1", [MultiModalSpan(MM_HASH, 2, ROWS)], 30.0, prompt)
        chunks = _chunks("r1", allocation.reservation_id, bridge.hidden_size)
        started = time.monotonic()
        await _push(servicer, chunks)
        done = time.monotonic()
        assert sum(started < end < done for end in ends) <= 1
        assert await bridge.call(bridge.core.embedding_cache.is_ready, MM_HASH)

        # A repeat (a retried Encode) is acknowledged and changes nothing; a push to a reservation that is not
        # live is refused with the core's own status, after its bytes.
        await _push(servicer, chunks)
        refused = _chunks("r1", "never-issued", bridge.hidden_size)
        try:
            await _push(servicer, refused)
        except ContextDouble.Aborted as aborted:
            assert aborted.code.name == ErrorKind.NOT_FOUND.name
        else:
            raise AssertionError("a push to an unknown reservation was accepted")
        assert servicer.pushes.buffered_bytes == 0
    finally:
        await asyncio.get_running_loop().run_in_executor(None, bridge.shutdown)
    assert not bridge.is_alive
