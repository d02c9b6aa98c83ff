"""Client side of ``PrefillDecode.PushEmbedding``: stream one embedding to the PD that reserved it.

A push is a client stream: an ``EmbeddingHeader`` naming the reservation,
then raw little-endian chunks of at most ``chunk_bytes``. Bytes in flight
across all pushes are bounded by a byte budget. A push is retried only
while PD has not received its header and the channel reported UNAVAILABLE
(nothing was accepted, so the same reservation id is still fresh); every
other PD status goes straight back to the caller with the same code.

Pushes are idempotent per (PD, request, reservation, mm_hash): a push PD
already acknowledged is remembered (bounded), so a repeated Encode for the
same reservation succeeds without sending the bytes again. Test-only faults
(``faults.py``) are applied here and nowhere else.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable

import grpc
import torch

from services.common import grpc_utils, push_wire
from services.common.pb import epd_pb2
from services.common.tensors import dtype_to_pb, tensor_bytes
from services.encoder.errors import DeadlineExceeded, PushFailed
from services.encoder.faults import NO_FAULTS, Faults

log = logging.getLogger(__name__)

MAX_CHANNELS = 64
"""Most PD channels kept open; PD addresses come from the proxy's PD list, so this is a safety cap."""

MAX_DELIVERED = 4096
"""Acknowledged pushes remembered for idempotent retries (oldest forgotten first)."""

# PD statuses the caller sees unchanged; anything else becomes INTERNAL.
_PASS_THROUGH = frozenset(
    {
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNAVAILABLE,
    }
)


_CODES_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def _record_first_status(call: grpc.aio.Call) -> list[grpc.StatusCode]:
    """Remembers the first status the call ends with (filled in when it ends).

    Works around grpc/grpc#36066: when PD ends a client stream early (a
    rejection after the header) while one of our writes is in flight, the
    failed write can overwrite PD's status with a local "INTERNAL: Internal
    error from Core". The first status set is PD's real one in that case.
    Reads a private attribute; when it is missing the list stays empty and
    the call's final status is used.
    """
    first: list[grpc.StatusCode] = []

    def record(done_call: grpc.aio.Call) -> None:
        status = getattr(getattr(done_call, "_cython_call", None), "_status", None)
        code = _CODES_BY_VALUE.get(status.code()) if status is not None else None
        if code is not None:
            first.append(code)

    call.add_done_callback(record)
    return first


class ByteBudget:
    """FIFO asyncio budget of bytes: ``acquire(n)`` waits until ``n`` more bytes fit.

    A request larger than the whole capacity is admitted when nothing else is
    in flight, so it can never wait forever. ``release`` is synchronous so it
    is safe in ``finally`` blocks of cancelled tasks.
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._in_use = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def in_use(self) -> int:
        return self._in_use

    def _fits(self, num_bytes: int) -> bool:
        return self._in_use == 0 or self._in_use + num_bytes <= self._capacity

    async def acquire(self, num_bytes: int) -> None:
        if not self._waiters and self._fits(num_bytes):
            self._in_use += num_bytes
            return
        grant: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((num_bytes, grant))
        try:
            await grant
        except asyncio.CancelledError:
            if grant.done() and not grant.cancelled():
                self.release(num_bytes)  # granted and cancelled in the same tick
            else:
                self._wake()  # this waiter may have blocked the queue head
            raise

    def release(self, num_bytes: int) -> None:
        self._in_use -= num_bytes
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            num_bytes, grant = self._waiters[0]
            if grant.done():
                self._waiters.popleft()
                continue
            if not self._fits(num_bytes):
                return
            self._waiters.popleft()
            self._in_use += num_bytes
            grant.set_result(None)


class EmbeddingPusher:
    """Pushes embeddings over one long-lived channel per PD address."""

    def __init__(
        self,
        *,
        chunk_bytes: int,
        max_outbound_bytes: int,
        default_timeout_s: float,
        max_attempts: int,
        connect_timeout_s: float,
        channel_factory: Callable[[str], grpc.aio.Channel] = grpc_utils.aio_channel,
        faults: Faults = NO_FAULTS,
    ) -> None:
        self._chunk_bytes = chunk_bytes
        self._budget = ByteBudget(max_outbound_bytes)
        self._default_timeout_s = default_timeout_s
        self._max_attempts = max_attempts
        self._connect_timeout_s = connect_timeout_s
        self._channel_factory = channel_factory
        self._channels: OrderedDict[str, tuple[grpc.aio.Channel, grpc.aio.StreamUnaryMultiCallable]] = OrderedDict()
        self._closing: set[asyncio.Task] = set()
        self._delivered: OrderedDict[tuple[str, str, str, str], None] = OrderedDict()
        self._faults = faults

    @property
    def outbound_bytes(self) -> int:
        """Bytes of pushes admitted and not yet finished."""
        return self._budget.in_use

    async def push(
        self,
        pd_address: str,
        *,
        request_id: str,
        reservation_id: str,
        mm_hash: str,
        embedding: torch.Tensor,
        deadline: float | None,
    ) -> None:
        """Streams ``embedding`` (``[num_tokens, hidden]``, or with DeepStack features ``[num_tokens, 1 +
        levels, hidden]``) into PD's reservation ``reservation_id``.

        ``deadline`` is in ``time.monotonic()`` seconds (None = ``default_timeout_s``
        from now). Raises ``PushFailed`` carrying the status the caller should see,
        or ``DeadlineExceeded``. A push PD already acknowledged returns at once.
        """
        key = (pd_address, request_id, reservation_id, mm_hash)
        if key in self._delivered:
            log.info("request_id=%s push already delivered, not sending it again", request_id)
            return
        if deadline is None:
            deadline = time.monotonic() + self._default_timeout_s
        embedding = self._faults.tamper(embedding)
        data = tensor_bytes(embedding)
        header = epd_pb2.EmbeddingHeader(
            request_id=request_id,
            reservation_id=reservation_id,
            mm_hash=mm_hash,
            dtype=dtype_to_pb(embedding.dtype),
            shape=list(embedding.shape),
            num_bytes=len(data),
            num_deepstack_levels=embedding.shape[1] - 1 if embedding.dim() == 3 else 0,
        )
        try:
            await asyncio.wait_for(self._budget.acquire(len(data)), timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise DeadlineExceeded("deadline exceeded waiting for outbound capacity") from None
        try:
            if self._faults.push_late_ms:  # a slow push: it holds its outbound bytes meanwhile
                await asyncio.sleep(self._faults.push_late_ms / 1000.0)
            if self._faults.never_push:
                return
            connect_by = min(deadline, time.monotonic() + self._connect_timeout_s)
            for attempt in range(1, self._max_attempts + 1):
                try:
                    await self._push_once(pd_address, header, data, deadline, connect_by)
                    self._remember_delivered(key)
                    return
                except PushFailed as err:
                    if err.sent or err.code != grpc.StatusCode.UNAVAILABLE or attempt == self._max_attempts:
                        raise
                    log.info("request_id=%s push not accepted (UNAVAILABLE), retrying", request_id)
                    await asyncio.sleep(min(0.05 * 2**attempt, max(0.0, connect_by - time.monotonic())))
        finally:
            self._budget.release(len(data))

    def _remember_delivered(self, key: tuple[str, str, str, str]) -> None:
        self._delivered[key] = None
        if len(self._delivered) > MAX_DELIVERED:
            self._delivered.popitem(last=False)

    async def _push_once(
        self,
        pd_address: str,
        header: epd_pb2.EmbeddingHeader,
        data: memoryview,
        deadline: float,
        connect_by: float,
    ) -> None:
        channel, push_call = self._channel(pd_address)
        await self._wait_ready(channel, connect_by)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded("deadline exceeded before the push started")
        call = push_call(timeout=remaining, metadata=((grpc_utils.REQUEST_ID_KEY, header.request_id),))
        first_status = _record_first_status(call)
        sent = write_failed = False
        try:
            try:
                await call.write(epd_pb2.PushEmbeddingChunk(header=header))
                sent = True
                for encoded in push_wire.iter_data_chunks(data, self._chunk_bytes):
                    await call.write(encoded)
                for chunk in self._faults.extra_chunks():
                    await call.write(epd_pb2.PushEmbeddingChunk(data=chunk))
                await call.done_writing()
            except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
                # PD ended the call while we were writing; awaiting the call
                # below raises its status.
                write_failed = True
            reply = await call
        except grpc.aio.AioRpcError as err:
            code = err.code()
            if write_failed and code == grpc.StatusCode.INTERNAL and first_status:
                code = first_status[0]
                log.debug("request_id=%s PD status %s recovered after a failed write", header.request_id, code.name)
            log.warning("request_id=%s push to PD failed: %s", header.request_id, code.name)
            mapped = code if code in _PASS_THROUGH else grpc.StatusCode.INTERNAL
            raise PushFailed(f"embedding push to PD failed ({code.name})", mapped, sent=sent) from None
        finally:
            if not call.done():
                call.cancel()  # cancellation or an error on our side: end the stream now
        if reply.num_bytes != len(data):
            raise PushFailed("PD acknowledged a different byte count", grpc.StatusCode.INTERNAL)

    async def _wait_ready(self, channel: grpc.aio.Channel, connect_by: float) -> None:
        if channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
            return
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout=max(0.0, connect_by - time.monotonic()))
        except TimeoutError:
            raise PushFailed("PD is unreachable", grpc.StatusCode.UNAVAILABLE, sent=False) from None

    def _channel(self, address: str) -> tuple[grpc.aio.Channel, grpc.aio.StreamUnaryMultiCallable]:
        entry = self._channels.get(address)
        if entry is not None:
            self._channels.move_to_end(address)
            return entry
        channel = self._channel_factory(address)
        entry = (channel, push_wire.push_call(channel))
        self._channels[address] = entry
        if len(self._channels) > MAX_CHANNELS:
            _, (old, _) = self._channels.popitem(last=False)
            # grace lets pushes still using the evicted channel finish.
            task = asyncio.create_task(old.close(grace=self._default_timeout_s))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return entry

    async def close(self) -> None:
        """Closes every PD channel (call after the server stopped taking Encode calls)."""
        channels = [channel for channel, _ in self._channels.values()]
        self._channels.clear()
        await asyncio.gather(*(channel.close() for channel in channels), *self._closing, return_exceptions=True)
