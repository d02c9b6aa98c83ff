"""Receiving one PushEmbedding stream: header first, then raw chunks, refused as early as possible.

What is refused before any payload buffer exists: a stream that does not
start with a well-formed header, and a second push to a reservation that
already has one in flight (each would otherwise hold a buffer of the full
size). While bytes arrive: chunks over 1 MiB, more bytes than declared, and a
stream that sends no bytes for ``idle_timeout_s`` (empty chunks are no
progress: a stream that trickles them is ended too). Buffers are bounded: the
bytes of every push in flight together, and the pushes in flight per caller
address, so that many streams each holding a full-size buffer cannot exhaust
memory (a refusal is RESOURCE_EXHAUSTED with a retry hint; the reservation
stays open). Afterwards: a short payload and non-finite values (NaN or
infinity must never reach the KV cache). Runs on the event loop; nothing here
touches the engine's state.

Whether the reservation is live and wants these bytes (a repeat of a push
that landed, from a retried Encode, is acknowledged and dropped) is the
engine core's answer to the one call that stores the embedding, after the
bytes are in. The core answers only between steps: asking it before the
bytes as well made every push wait for two step ends, up to seconds under an
image burst, where one is enough.

``PushSlots`` (one reservation's stream at a time, pushes per caller, buffer
bytes) and ``read_payload`` (the idle timeout that only bytes move) are
shared with the KV push (``kv_transfer.py``), which has its own slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import torch

from services.common import tensors
from services.common.models.vision_io import embedding_shape
from services.common.pb import epd_pb2
from services.common.push_wire import data_of
from services.pd import convert
from services.pd.config import DEFAULT_MAX_BUFFER_BYTES, DEFAULT_MAX_PUSHES_PER_PEER
from services.pd.engine.errors import EngineError, ErrorKind

PUSH_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BUSY_RETRY_S = 0.2  # a push in flight ends within its idle timeout or completes
_STALLED = "push stalled: no data within the idle timeout"


def _invalid(message: str) -> EngineError:
    return EngineError(ErrorKind.INVALID_ARGUMENT, message)


class PushSlot:
    """One push stream admitted by ``PushSlots.hold``: ``take_buffer`` counts its payload buffer."""

    def __init__(self, slots: PushSlots) -> None:
        self._slots = slots
        self.buffered = 0

    def take_buffer(self, num_bytes: int) -> None:
        """Counts a ``num_bytes`` buffer; RESOURCE_EXHAUSTED (a retry hint) when the buffers are full.

        With ``oversize_alone``, a push larger than the bound is let in when no other holds a buffer."""
        slots = self._slots
        total = slots.buffered_bytes + num_bytes
        if total > slots.max_buffer_bytes and not (slots.oversize_alone and slots.buffered_bytes == 0):
            raise EngineError(ErrorKind.RESOURCE_EXHAUSTED, "push buffers are full", _BUSY_RETRY_S)
        slots.buffered_bytes = total
        self.buffered += num_bytes


class PushSlots:
    """The pushes being received: one stream per reservation at a time, at most ``max_per_peer`` per
    caller address, and their payload buffers within ``max_buffer_bytes`` together. Event loop only."""

    def __init__(self, max_buffer_bytes: int, max_per_peer: int, *, oversize_alone: bool = False) -> None:
        self.max_buffer_bytes = max_buffer_bytes
        self.max_per_peer = max_per_peer
        self.oversize_alone = oversize_alone
        self.buffered_bytes = 0
        self._in_flight: set[str] = set()  # reservation ids with a push being received
        self._per_peer: dict[str, int] = {}

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @contextlib.contextmanager
    def hold(self, reservation_id: str, peer: str, in_progress: str) -> Iterator[PushSlot]:
        """Admits one stream for the block; FAILED_PRECONDITION (``in_progress``) while another pushes to
        ``reservation_id``, RESOURCE_EXHAUSTED when ``peer`` has its pushes in flight. Gives all back on exit."""
        if reservation_id in self._in_flight:
            raise EngineError(ErrorKind.FAILED_PRECONDITION, in_progress)
        if self._per_peer.get(peer, 0) >= self.max_per_peer:
            raise EngineError(ErrorKind.RESOURCE_EXHAUSTED, "too many pushes in flight from this caller", _BUSY_RETRY_S)
        self._in_flight.add(reservation_id)
        self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
        slot = PushSlot(self)
        try:
            yield slot
        finally:
            self.buffered_bytes -= slot.buffered
            self._in_flight.discard(reservation_id)
            left = self._per_peer[peer] - 1
            if left:
                self._per_peer[peer] = left
            else:
                del self._per_peer[peer]


async def next_chunk(stream: AsyncIterator[Any], deadline: float, stalled: str) -> Any | None:
    """The stream's next message (None at its end); DEADLINE_EXCEEDED (``stalled``) past ``deadline``."""
    try:
        return await asyncio.wait_for(anext(stream, None), max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        raise EngineError(ErrorKind.DEADLINE_EXCEEDED, stalled) from None


async def read_payload(
    stream: AsyncIterator[Any],
    num_bytes: int,
    payload: bytearray | None,
    idle_timeout_s: float,
    stalled: str,
    too_many: ErrorKind = ErrorKind.FAILED_PRECONDITION,
) -> None:
    """Reads the data chunks after a header into ``payload`` (each chunk's bytes copied once), or counts
    them off (None). Only bytes move the idle deadline: a stream trickling empty chunks is ended too.
    ``too_many``: the refusal of more bytes than declared."""
    view = memoryview(payload) if payload is not None else None
    received = 0
    deadline = time.monotonic() + idle_timeout_s
    try:
        while (chunk := await next_chunk(stream, deadline, stalled)) is not None:
            data = data_of(chunk)
            if data is None:
                raise _invalid("only the first message of a push may be a header")
            if len(data) > tensors.CHUNK_BYTES:
                raise _invalid("push chunk larger than 1 MiB")
            if received + len(data) > num_bytes:
                raise EngineError(too_many, "push carries more bytes than its header declared")
            if view is not None:
                view[received : received + len(data)] = data
            if len(data):
                received += len(data)
                deadline = time.monotonic() + idle_timeout_s
    finally:
        if view is not None:
            view.release()
    if received != num_bytes:
        raise _invalid("push ended before all declared bytes arrived")


class PushIntake:
    """Reads pushes for one PD; the caller hands each embedding to the engine core."""

    def __init__(
        self,
        hidden_size: int,
        idle_timeout_s: float,
        *,
        max_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES,
        max_pushes_per_peer: int = DEFAULT_MAX_PUSHES_PER_PEER,
        num_deepstack_levels: int = 0,
    ) -> None:
        self._hidden_size = hidden_size
        self._num_deepstack_levels = num_deepstack_levels
        self._idle_timeout_s = idle_timeout_s
        self._slots = PushSlots(max_buffer_bytes, max_pushes_per_peer)

    @property
    def buffered_bytes(self) -> int:
        return self._slots.buffered_bytes

    async def receive(
        self, request_iterator: AsyncIterator[Any], peer: str = ""
    ) -> tuple[epd_pb2.EmbeddingHeader, torch.Tensor]:
        """The header and the embedding tensor."""
        stream = aiter(request_iterator)
        first = await next_chunk(stream, time.monotonic() + self._idle_timeout_s, _STALLED)
        if first is None or data_of(first) is not None or first.WhichOneof("kind") != "header":
            raise _invalid("a push must start with a header")
        header = first.header
        self.check_header(header)
        with self._slots.hold(header.reservation_id, peer, "a push to this reservation is already in progress") as slot:
            slot.take_buffer(header.num_bytes)
            payload = bytearray(header.num_bytes)
            await read_payload(stream, header.num_bytes, payload, self._idle_timeout_s, _STALLED)
        embedding = tensors.tensor_from_bytes(payload, tensors.dtype_from_pb(header.dtype), list(header.shape))
        if not tensors.all_finite(embedding):
            raise _invalid("embedding has non-finite values")
        return header, embedding

    def check_header(self, header: epd_pb2.EmbeddingHeader) -> None:
        convert.check_request_id(header.request_id)
        try:
            dtype = tensors.dtype_from_pb(header.dtype)
        except ValueError:
            raise _invalid("unsupported embedding dtype") from None
        if dtype not in PUSH_DTYPES:
            raise _invalid("embedding dtype must be float32, float16 or bfloat16")
        levels = self._num_deepstack_levels
        want = list(embedding_shape(int(header.shape[0]) if header.shape else 0, self._hidden_size, levels))
        if header.num_deepstack_levels != levels:
            raise _invalid(f"this model's embeddings carry {levels} DeepStack levels")
        if list(header.shape) != want or not want[0]:
            shown = (
                f"[num_tokens, {1 + levels}, {self._hidden_size}]" if levels else f"[num_tokens, {self._hidden_size}]"
            )
            raise _invalid(f"embedding shape must be {shown}")
        if header.num_bytes != tensors.expected_num_bytes(dtype, list(header.shape)):
            raise _invalid("num_bytes does not match dtype and shape")
